"""ranktop's own stdout or stderr takes nothing: /dev/full (ENOSPC), a pty whose master was closed
(EIO, an SSH link that dropped), a pipe whose reader left (EPIPE, `| head -1`), a closed descriptor
(`>&-`, which counts as /dev/null). Never a traceback: a command says so in one line on the other
stream and exits 1 (quietly, its own status, for a reader that left, as coreutils under SIGPIPE);
a run goes on and ends with its own status, its log files whole."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
from conftest import ROOT, ranktop_cmd, run_ranktop, wait_for
from ranktop.core.spec import free_port

pytestmark = pytest.mark.timeout(120)

WHY = {"full": "No space left on device", "eio": "Input/output error", "epipe": "Broken pipe"}
KINDS = ("full", "eio", "epipe", "closed")


def dead_stream(kind: str) -> int | None:
    """A descriptor that takes nothing, as `kind` says; None for a closed one."""
    if kind == "full":
        return os.open("/dev/full", os.O_WRONLY)
    if kind == "eio":
        master, slave = pty.openpty()
        os.close(master)  # the terminal hung up: every write to it is EIO
        return slave
    if kind == "epipe":
        reader, writer = os.pipe()
        os.close(reader)
        return writer
    return None


def run_dead(args: list[str], stream: str, kind: str, env: dict, timeout: float = 60) -> tuple[int, str]:
    """ranktop `args` with its `stream` ("stdout" or "stderr") dead as `kind` says: its exit
    status and what its other stream got."""
    fd = dead_stream(kind)
    closing = 1 if stream == "stdout" else 2
    with tempfile.TemporaryFile() as other:
        streams = {"stdout": fd, "stderr": other} if stream == "stdout" else {"stdout": other, "stderr": fd}
        try:
            done = subprocess.run(ranktop_cmd(*args), cwd=ROOT, env=env, stdin=subprocess.DEVNULL, timeout=timeout,
                                  preexec_fn=(lambda: os.close(closing)) if fd is None else None, **streams)
        finally:
            if fd is not None:
                os.close(fd)
        other.seek(0)
        return done.returncode, other.read().decode()


def command_end(stream: str, kind: str, status: int = 0) -> tuple[int, str]:
    """What a command whose `stream` was dead as `kind` says ends with: its status and the line
    on its other stream."""
    if kind in ("epipe", "closed"):  # a reader that left, /dev/null: nothing lost that anyone reads
        return status, ""
    return status or 1, f"ranktop: cannot write to {stream} ({WHY[kind]}): what was to be shown there is lost\n"


@pytest.fixture
def env(tmp_path):
    runtime = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # (short: a socket's path is at most 107 bytes)
    try:
        yield {**os.environ, "XDG_RUNTIME_DIR": runtime, "TMPDIR": str(tmp_path)}
    finally:
        subprocess.run(["rm", "-rf", runtime])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("args", [["--version"], ["--help"], ["ls"], ["ls", "--json"], ["stacks", "--help"]],
                         ids=" ".join)
def test_a_commands_stdout_that_takes_nothing_is_one_line_on_stderr(env, args, kind):
    """`ranktop ls` and `--version` into /dev/full or a hung-up terminal were a traceback, exit 1;
    `--help` lost its text and exited 0."""
    assert run_dead(args, "stdout", kind, env) == command_end("stdout", kind)


@pytest.mark.parametrize("kind", KINDS)
def test_a_usage_errors_stderr_that_takes_nothing_is_one_line_on_stdout(env, kind):
    assert run_dead(["ls", "--no-such-flag"], "stderr", kind, env) == command_end("stderr", kind, status=2)


@pytest.mark.parametrize("kind", KINDS)
def test_commands_on_a_served_run_whose_output_takes_nothing(tmp_path, env, kind):
    """A run started with --detach, its started line into a dead stdout; then stacks (grouped,
    --json, --signal), logs and stop into it, and web's address into a dead stderr (it serves
    nothing then: nobody would learn its token). Each is one line, exit 1 (none, exit 0, into a
    reader that left); the run itself was started, and is stopped."""
    script = tmp_path / "sleepy.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    started = run_dead(["--detach", "--run-id", "dead", "--log-dir", str(tmp_path / "logs"), str(script)],
                       "stdout", kind, env)
    assert started == command_end("stdout", kind)
    try:
        wait_for(lambda: "up" in _log(tmp_path / "logs" / "dead"), what="the rank's first line", timeout=30)
        for args in (["stacks", "dead"], ["stacks", "--json", "dead"], ["stacks", "--signal", "dead"]):
            assert run_dead(args, "stdout", kind, env) == command_end("stdout", kind), args
        status, said = run_dead(["logs", "dead"], "stdout", kind, env)
        assert (status, said) == ((0, "") if kind in ("epipe", "closed") else
                                  (1, f"ranktop: dead: logs cannot write its output ({WHY[kind]})\n"))
        if kind != "closed":  # (/dev/null: web would serve, its address said to nobody)
            web = run_dead(["web", "dead", "--port", str(free_port("127.0.0.1"))], "stderr", kind, env)
            assert web == (1, command_end("stderr", kind)[1])
        assert run_dead(["stop", "dead"], "stdout", kind, env) == command_end("stdout", kind)
    finally:
        run_ranktop("stop", "dead", env=env)
    assert json.loads(run_ranktop("ls", "--json", env=env).stdout) == []


def _log(run_dir: Path) -> str:
    path = run_dir / "attempt_0" / "0" / "stdout.log"
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("kind", ["full", "eio", "epipe"])
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_headless_runs_dead_console_is_said_on_the_other_and_the_run_ends_with_its_own_status(
        tmp_path, env, stream, kind):
    """A console stream that takes nothing is said once, on the other stream (stderr's loss went
    unsaid: its line was written to stderr); the run ends as it would (the rank's exit 3: 1), its
    log files whole, and the end report's loss is not said again."""
    script = tmp_path / "both.py"
    script.write_text("import sys\nfor i in range(200):\n    print('out', i)\n    print('err', i, file=sys.stderr)\n"
                      "sys.exit(3)\n")
    status, said = run_dead(["--headless", "--run-id", "r", "--log-dir", str(tmp_path / "logs"), str(script)],
                            stream, kind, env)
    assert status == 1
    assert said.count(f"ranktop: the console's {stream} is gone ({WHY[kind]})") == 1, said
    assert "Traceback" not in said and "cannot write to" not in said, said
    rank = tmp_path / "logs" / "r" / "attempt_0" / "0"
    assert (rank / "stdout.log").read_text() == "".join(f"out {i}\n" for i in range(200))
    assert (rank / "stderr.log").read_text() == "".join(f"err {i}\n" for i in range(200))


@pytest.mark.parametrize("kind", KINDS)
def test_logs_of_an_ended_run_whose_stderr_takes_nothing_is_one_line_on_stdout(tmp_path, env, kind):
    """`ranktop logs` of an ended run writes each rank's stderr.log on stderr: a dead one ended
    it in exit 1 and not a word (its line was said to stdout's /dev/null)."""
    script = tmp_path / "both.py"
    script.write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\n")
    assert run_ranktop("--headless", "--run-id", "e", "--log-dir", str(tmp_path / "logs"), str(script),
                       env=env).returncode == 0
    status, said = run_dead(["logs", str(tmp_path / "logs" / "e")], "stderr", kind, env)
    end_status, line = command_end("stderr", kind)
    assert (status, said) == (end_status, "[0]:out\n" + line)


# A console writer whose telling of a lost console raises `raised`; it writes on to its stdout.
TELLING_RAISES = """
import sys
from ranktop.core.output import ConsoleWriter, binary_console
def told(target, why):
    raise {raised}
writer = ConsoleWriter(on_lost=told)
for _ in range(3):
    writer.write(binary_console(sys.stdout), b"a line\\n", "rank 0")
writer.close()
print("went on", file=sys.stderr)
"""


@pytest.mark.parametrize("raised", ["nope", "OSError(28, 'No space left on device')"])
def test_a_bug_telling_that_the_console_is_gone_is_said_once_and_the_writing_goes_on(raised):
    """Any exception out of the on_lost callback was swallowed as best effort: a NameError there
    hid that no one was ever told the console was gone. A bug is now one line, once, on the other
    stream; an OSError (that stream, or the events' disk, is gone too) stays quiet, and either way
    the writing goes on."""
    dead = dead_stream("epipe")
    try:
        done = subprocess.run(ranktop_cmd()[:1] + ["-c", TELLING_RAISES.format(raised=raised)], cwd=ROOT,
                              stdout=dead, stderr=subprocess.PIPE, text=True, timeout=30)
    finally:
        os.close(dead)
    bug = ("ranktop: a bug while telling that the console's stdout is gone: NameError: name 'nope' is not defined "
           "(at <string>:5); the run goes on, please report it\n")
    assert (done.returncode, done.stderr) == (0, (bug if raised == "nope" else "") + "went on\n")


def test_a_lost_consoles_line_on_a_stream_whose_lane_had_ended_is_written_before_close_returns():
    """close() ends each screen's lane; the last write of one (stdout, its reader gone) says on
    the other stream that it is lost. Where that stream's lane had ended already, the line went
    into a queue no one read any more: left unwritten as the process exited (close() waited again
    only for lanes that were new)."""
    from ranktop.core.output import ConsoleWriter

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    out, err = open(out_w, "wb"), open(err_w, "wb")
    writer = ConsoleWriter(on_lost=lambda target, why: writer.say(err, f"lost: {why}"))
    before = {t for t in threading.enumerate() if t.name == "ranktop-console"}
    lanes = lambda: {t for t in threading.enumerate() if t.name == "ranktop-console"} - before  # noqa: E731
    try:
        writer.write(err, b"rank 1's line\n", "rank 1")  # the stderr lane, started
        assert os.read(err_r, 100) == b"rank 1's line\n"
        writer.write(out, b"x" * (1 << 20), "rank 0")  # more than the pipe holds: its lane waits for a reader
        left = []
        closing = threading.Thread(target=lambda: left.append(writer.close(stall=30)))
        closing.start()
        wait_for(lambda: len(lanes()) == 1, what="the stderr lane ended, the stdout one writing")
        os.close(out_r)  # its reader gone: the write fails, and that is said on stderr
        closing.join(30)
        os.set_blocking(err_r, False)
        assert os.read(err_r, 1000).startswith(b"lost: ")
        assert left == [0]
    finally:
        with contextlib.suppress(OSError):
            out.close()
        err.close()
        os.close(err_r)
