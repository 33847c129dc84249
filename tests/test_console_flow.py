"""The headless console when it is slow, stuck or shared: what reaches it, in what order, and
that ranktop still ends. Real runs of ranktop; the console is a pipe or a FIFO that the test
reads slowly, or holds open and never reads."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, Running, make_agent, ranktop_cmd, read_events, run_ranktop, wait_for
from ranktop.core import start_processes
from ranktop.core.errors import UsageError
from ranktop.core.spec import Std

pytestmark = pytest.mark.timeout(120)

# The end's wait for a console that takes nothing (5 s unless RANKTOP_CONSOLE_STALL says): the
# stuck consoles here are given up on after 1 s; what they check is that they are, not when.
STALL = "1"


@contextlib.contextmanager
def stuck_console(tmp_path: Path):
    """A FIFO that this test holds open for reading and never reads: writes to it block once
    its 64 KiB are full, as to a terminal stopped with Ctrl-S or a stalled SSH connection."""
    path = tmp_path / "stuck"
    os.mkfifo(path)
    holder = os.open(path, os.O_RDWR)  # a reader exists, so writers block rather than fail
    try:
        yield path
    finally:
        os.close(holder)


def _drain(fifo: Path) -> None:
    with open(fifo, "rb") as f:
        while f.read(1 << 16):
            pass


# Each rank writes its lines; rank 1 then says so in a file (under $FLOOD_MARKS) and waits to be
# stopped; rank 0 fails once it sees that file, so that no rank is stopped with lines unwritten.
_FLOOD_THEN_FAIL = """\
import os, sys, time
for i in range(4000):
    print('flood', i, 'x' * 200)
sys.stdout.flush()
written = os.path.join(os.environ['FLOOD_MARKS'], 'written-' + os.environ['TORCHELASTIC_RESTART_COUNT'])
if os.environ['LOCAL_RANK'] == '1':
    open(written, 'w').close()
    time.sleep(60)
deadline = time.monotonic() + 60
while not os.path.exists(written) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(3)
"""


def test_a_stuck_console_is_given_up_at_the_end_with_a_word_and_ranktop_ends(tmp_path):
    script = tmp_path / "flood.py"
    script.write_text(_FLOOD_THEN_FAIL)
    with stuck_console(tmp_path) as fifo, open(fifo, "wb") as console:
        done = subprocess.run(ranktop_cmd("--headless", "--nproc-per-node", "2", "--max-restarts", "2",
                                          "--log-dir", str(tmp_path / "logs"), "--run-id", "stuck", str(script)),
                              cwd=ROOT, stdout=console, stderr=subprocess.PIPE, timeout=90,
                              env={**os.environ, "FLOOD_MARKS": str(tmp_path), "RANKTOP_CONSOLE_STALL": STALL})
    stderr = done.stderr.decode()
    assert done.returncode == 1, stderr
    events = read_events(tmp_path / "logs" / "stuck")
    assert [e["attempt"] for e in events if e["event"] == "group_restart"] == [1, 2]
    (behind,) = [e for e in events if e["event"] == "console_behind"]
    assert behind["stall_seconds"] == float(STALL)
    assert 0 < behind["bytes"] <= 16 << 20  # what waited: within the run's one budget (4 streams' shares)
    assert re.search(rf"^ranktop: the console took nothing for {STALL}s after the run ended: the last \d+ bytes of rank "
                     r"output were not shown; the log files have them$", stderr, re.M), stderr
    assert "restarting the group: attempt_1" in stderr  # our own lines still reach a stderr that works
    for rank in (0, 1):  # every byte saved all the same
        log = tmp_path / "logs" / "stuck" / "attempt_2" / str(rank) / "stdout.log"
        assert log.read_bytes().count(b"\n") == 4000


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "1e9", "1\x1b[2J"])
def test_a_bad_console_stall_time_is_one_line_and_nothing_starts(tmp_path, monkeypatch, value):
    """RANKTOP_CONSOLE_STALL, the seconds the end waits for a console that takes nothing: on the
    command line and in the Python API alike, a value that is no number of seconds is refused."""
    message = (f"bad RANKTOP_CONSOLE_STALL='{value.replace(chr(27), chr(0x241B))}': "
               "expected a number of seconds from 0 to 604800")
    done = run_ranktop("--headless", "--log-dir", str(tmp_path / "cli"), "--no-python", "true",
                       env={**os.environ, "RANKTOP_CONSOLE_STALL": value})
    assert (done.returncode, done.stderr) == (2, f"ranktop: error: {message}\n")
    monkeypatch.setenv("RANKTOP_CONSOLE_STALL", value)
    with pytest.raises(UsageError) as refused:
        make_agent(tmp_path / "api", "pass", console=True)
    assert str(refused.value) == message
    assert not (tmp_path / "cli").exists() and not (tmp_path / "api").exists()


def test_every_attempt_tees_through_the_runs_one_console_writer(tmp_path, monkeypatch):
    """Each attempt used to make a console thread of its own, wait 5 s for it at the attempt's
    end and leave it blocked on a stuck console, still holding what it had queued: memory and
    delay grew with every restart."""
    monkeypatch.setenv("RANKTOP_CONSOLE_STALL", STALL)
    with stuck_console(tmp_path) as fifo, open(fifo, "w") as console:
        monkeypatch.setattr(sys, "stdout", console)
        monkeypatch.setattr(sys, "stderr", open(tmp_path / "stderr", "w"))  # noqa: SIM115 (closed below)
        agent = make_agent(tmp_path / "logs", _FLOOD_THEN_FAIL, console=True, max_restarts=2,
                           env={"FLOOD_MARKS": str(tmp_path)})
        writers: set[int] = set()
        running = Running(agent)
        while running.thread.is_alive():
            writers.update(id(t) for t in threading.enumerate() if t.name == "ranktop-console")
            time.sleep(0.01)
        result = running.join()
        sys.stderr.close()
        threading.Thread(target=_drain, args=(fifo,), daemon=True).start()  # so that the given-up write ends
    assert result.exit_status == 1 and agent.attempt == 2
    assert len(writers) == 1
    assert agent.console_unshown > 0
    assert "restarting the group: attempt_2" in (tmp_path / "stderr").read_text()


def test_a_stuck_stderr_does_not_hang_ranktop_at_the_end(tmp_path):
    """The end report used to be printed with no limit: ranktop, having ended its run, waited on
    a stuck stderr for ever, and Ctrl-C could not break the write."""
    script = tmp_path / "fail.py"
    script.write_text("import sys\nfor i in range(3000):\n    print('err', i, 'y' * 100, file=sys.stderr)\n"
                      "raise SystemExit('the end')\n")
    with stuck_console(tmp_path) as fifo, open(fifo, "wb") as stuck:
        proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                                            "--run-id", "err", str(script)),
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stuck,
                                env={**os.environ, "RANKTOP_CONSOLE_STALL": STALL})
        try:
            assert proc.wait(timeout=60) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    events = read_events(tmp_path / "logs" / "err")
    (finished,) = [e for e in events if e["event"] == "run_finished"]
    assert finished["exit_status"] == 1
    assert events[-1]["event"] == "console_behind"  # given up on after the end, as the last thing


def test_ctrl_c_while_ranktop_waits_for_a_stuck_console_ends_it_with_the_runs_status_and_report(tmp_path):
    """The run has ended and ranktop waits up to 5 s for a console that takes nothing: Ctrl-C
    there used to meet Python's own handler (ranktop's were already gone), a KeyboardInterrupt
    traceback, death by SIGINT, no end report and the event log left unclosed."""
    script = tmp_path / "chatty.py"
    script.write_text("import sys\nfor i in range(20000):\n    print('line', i, 'x' * 80)\nsys.exit(3)\n")
    logs = tmp_path / "logs"
    with stuck_console(tmp_path) as fifo, open(fifo, "wb") as stuck:
        proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "1", "--log-dir", str(logs),
                                            "--run-id", "ctrlc", str(script)),
                                cwd=ROOT, stdout=stuck, stderr=subprocess.PIPE)
        try:
            wait_for(lambda: (logs / "ctrlc" / "final.json").exists(), timeout=30, what="the run's end")
            proc.send_signal(signal.SIGINT)  # the drain is on, or about to be
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = stderr.decode()
    assert proc.returncode == 1, stderr  # the run's own status: it had ended when Ctrl-C came
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "root cause: rank 0" in stderr and "exited with code 3" in stderr, stderr  # the end report
    assert re.search(r"^ranktop: SIGINT cut short the wait for the console after the run ended: the last \d+ bytes "
                     r"of rank output were not shown; the log files have them$", stderr, re.M), stderr
    events = read_events(logs / "ctrlc")
    assert events[-1]["event"] == "console_behind" and events[-1]["cut_short_by"] == "SIGINT"
    assert [e["exit_status"] for e in events if e["event"] == "run_finished"] == [1]
    assert json.loads((logs / "ctrlc" / "final.json").read_text())["exit_status"] == 1


def test_a_slow_console_gets_everything_as_long_as_it_keeps_reading(tmp_path):
    """At the end, ranktop waits for a console that still takes output, however slowly; it used
    to give up after 5 s in all, cutting the output mid-line with no word of it. Progress counts
    piece by piece: one queued write can hold a rank's whole burst (hundreds of KB), and at this
    pace it took over a second, so with RANKTOP_CONSOLE_STALL=1 the console was given up while it
    read (669,780 bytes unshown)."""
    script = tmp_path / "burst.py"
    script.write_text("for i in range(3500):\n    print('line', i, 'z' * 90)\n")  # ~350 KB a rank
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                                        str(script)),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "RANKTOP_CONSOLE_STALL": "1"})
    shown = bytearray()
    while piece := proc.stdout.read(4096):  # at most ~200 KB/s: over 3 s for the whole of it
        shown += piece
        time.sleep(0.02)
    assert proc.wait(timeout=60) == 0
    stderr = proc.stderr.read().decode()
    assert "took nothing" not in stderr, stderr
    lines = bytes(shown).splitlines()
    assert len(lines) == 7000 and all(line.startswith((b"[default0]:line ", b"[default1]:line ")) for line in lines)


def test_a_prompt_without_a_newline_is_shown_before_its_answer(tmp_path):
    """`input()`, pdb's `(Pdb) `: the line waits for an answer, so it must be on the console
    before its newline comes (it was held until then, after the answer)."""
    script = tmp_path / "ask.py"
    script.write_text("import sys\nsys.stdout.write('Continue? [y/n] ')\nsys.stdout.flush()\n"
                      "answer = sys.stdin.readline().strip()\nprint('got', answer)\n")
    proc = subprocess.Popen(ranktop_cmd("--headless", "--log-dir", str(tmp_path / "logs"), str(script)), cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    shown = bytearray()

    def read() -> None:
        while piece := os.read(proc.stdout.fileno(), 4096):
            shown.extend(piece)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        wait_for(lambda: bytes(shown) == b"[default0]:Continue? [y/n] ", timeout=20, what="the prompt on the console")
        proc.stdin.write(b"y\n")
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
    assert bytes(shown) == b"[default0]:Continue? [y/n] got y\n"


def test_a_line_longer_than_what_is_held_is_never_spliced_with_another_ranks_lines(tmp_path):
    """Past 64 KiB a line is shown as it comes; another rank's line used to land in its middle,
    and the rest of the long line then came with no prefix."""
    script = tmp_path / "long.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['LOCAL_RANK'] == '0':\n"
        "    for i in range(200):\n"
        "        os.write(1, b'A' * 1000)\n"
        "        time.sleep(0.002)\n"
        "    os.write(1, b'\\n')\n"
        "else:\n"
        "    for i in range(200):\n"
        "        print('rank1 line', i, flush=True)\n"
        "        time.sleep(0.002)\n")
    done = subprocess.run(ranktop_cmd("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                                      str(script)), cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split(b"\n")
    assert lines[-1] == b""
    assert all(line.startswith((b"[default0]:", b"[default1]:")) for line in lines[:-1])
    assert [line for line in lines if line.startswith(b"[default1]:")] == [
        b"[default1]:rank1 line %d" % i for i in range(200)]
    long = b"".join(line.removeprefix(b"[default0]:") for line in lines if line.startswith(b"[default0]:"))
    assert long == b"A" * 200_000  # all of it, in pieces each on a line of its own


def test_the_python_api_tees_to_a_console_that_takes_text_only(tmp_path):
    """torch writes the tee as text, so sys.stdout may be a StringIO (redirect_stdout); ranktop
    asked it for its .buffer and raised."""
    console = io.StringIO()
    (tmp_path / "logs").mkdir()
    with contextlib.redirect_stdout(console):
        ctx = start_processes("echo", sys.executable, {0: ("-c", "print('héllo')")}, {0: {}},
                              str(tmp_path / "logs"), tee=Std.ALL)
        try:
            result = ctx.wait(timeout=30)
        finally:
            ctx.close()
    assert result is not None and not result.is_failed()
    assert console.getvalue() == "[echo0]:héllo\n"
