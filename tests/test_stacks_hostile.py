"""Stack dumps against ranks and files that fight back: a rank that plants a FIFO or a symlink
where its log was, an events.jsonl of the wrong shape, a stack command with arguments of the
wrong shape. Each ends in an answer (a per-rank reason, a one-line error), never a hang or a
traceback. Most need no py-spy (the SIGUSR1 dump and the file readers); the last one dumps with it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import NOBODY, PY, ROOT, no_ranks_left, ranktop_cmd, run_ranktop, run_side_by_side, stop_process

# Ranks 0 and 1 put something hostile where their stderr.log was (the rank directory is the
# error file's): their stderr stays open to the old file, so the dump itself still happens.
# Rank 2 leaves its log alone.
PLANTS = """
import os, time
rank_dir = os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])
planted = os.path.join(rank_dir, "planted")
if os.environ["RANK"] == "0":
    os.mkfifo(planted)  # a plain open() of it waits for a writer forever
    os.replace(planted, os.path.join(rank_dir, "stderr.log"))
elif os.environ["RANK"] == "1":
    os.symlink("/dev/zero", planted)  # a plain read() of it never ends
    os.replace(planted, os.path.join(rank_dir, "stderr.log"))
def wait_here():
    time.sleep(3600)
print("planted", flush=True)
wait_here()
"""


@pytest.fixture
def runtime(tmp_path):
    """Sockets in a directory of this test's own (what $XDG_RUNTIME_DIR is for)."""
    path = tmp_path / "rt"
    path.mkdir(mode=0o700)
    return {**os.environ, "XDG_RUNTIME_DIR": str(path)}


def start(tmp_path, env, run_id: str, code: str, n: int = 2) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(code)
    return subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", str(n), "--shutdown-timeout", "3",
                                        "--run-id", run_id, "--log-dir", str(tmp_path / "logs"), str(script)),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def wait_lines(proc: subprocess.Popen, text: str, n: int) -> None:
    """Until the ranks printed `text` n times (headless: their lines on ranktop's stdout)."""
    for _ in range(n):
        line = proc.stdout.readline()
        assert text in line, line


def test_a_planted_fifo_or_symlink_log_is_a_reason_not_a_hang(tmp_path, runtime):
    proc = start(tmp_path, runtime, "planted", PLANTS, n=3)
    try:
        wait_lines(proc, "planted", 3)
        rank_dir = tmp_path / "logs" / "planted" / "attempt_0"
        assert (rank_dir / "0" / "stderr.log").is_fifo() and (rank_dir / "1" / "stderr.log").is_symlink()
        began = time.monotonic()
        out = run_ranktop("stacks", "--signal", "planted", env=runtime, timeout=30)  # by the run's engine
        assert out.returncode == 0, out.stderr
        assert time.monotonic() - began < 15  # the engine's 3 s wait at most, not the client's 60 s
        lines = out.stdout.splitlines()
        assert "1 of 3 ranks dumped" in lines[0] and "wait_here (rank.py:" in out.stdout, out.stdout
        assert any(line.startswith("   rank 0 (pid ") and "stderr.log cannot be read: not a regular file (a FIFO)"
                   in line for line in lines), out.stdout
        assert any(line.startswith("   rank 1 (pid ") and "stderr.log cannot be read: a symlink, not followed"
                   in line for line in lines), out.stdout
        # The same from the files (no engine): a run directory given as a path.
        local = run_ranktop("stacks", "--signal", str(tmp_path / "logs" / "planted"),
                            env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}, timeout=30)
        assert local.returncode == 0 and "1 of 3 ranks dumped" in local.stdout, local
        assert "not a regular file (a FIFO)" in local.stdout and "a symlink, not followed" in local.stdout
        assert proc.poll() is None  # the run goes on
    finally:
        stop_process(proc)


# Lines a hostile events.jsonl may hold (PID: a live process of this test's).
BAD_EVENTS = [
    '5', '[]', '"started"', 'null', '{', '{"event": "run_started", "run_id": 5}',
    '{"event": "started", "rank": 0, "local_rank": 0}',  # no pid
    '{"event": "started", "rank": 0, "local_rank": 0, "pid": "PID"}',
    '{"event": "started", "rank": true, "local_rank": 0, "pid": PID}',
    '{"event": "started", "attempt": "9", "rank": 0, "local_rank": 0, "pid": PID}',
    '{"event": "started", "rank": 0, "local_rank": 0, "pid": 0}',  # os.kill(0, ...): our own group
    '{"event": "exited", "pid": [PID]}',
]


@pytest.fixture
def bystander():
    """A live process that says it belongs to run `hostile` (and does not handle SIGUSR1)."""
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "TORCHELASTIC_RUN_ID": "hostile"})
    yield proc.pid
    stop_process(proc)


def write_events(run_dir, lines: list[str], pid: int) -> None:
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("".join(line.replace("PID", str(pid)) + "\n" for line in lines))


@pytest.mark.parametrize("bad", BAD_EVENTS)
def test_a_bad_events_line_is_skipped_not_a_traceback(tmp_path, runtime, bystander, bad):
    run_dir = tmp_path / "run"
    write_events(run_dir, ['{"event": "run_started", "run_id": "hostile"}', bad], bystander)
    out = run_ranktop("stacks", "--signal", str(run_dir), env=runtime, timeout=30)
    assert (out.returncode, out.stdout) == (1, ""), out.stderr
    assert out.stderr == no_ranks_left(run_dir)


def test_the_good_events_among_bad_ones_still_find_the_rank(tmp_path, runtime, bystander):
    run_dir = tmp_path / "run"
    good = '{"event": "started", "rank": 3, "local_rank": 1, "pid": PID}'
    write_events(run_dir, ['{"event": "run_started", "run_id": "hostile"}', *BAD_EVENTS, good, *BAD_EVENTS],
                 bystander)
    out = run_ranktop("stacks", "--signal", str(run_dir), env=runtime, timeout=30)
    assert out.returncode == 1, out.stderr  # found, and skipped: no signal was sent
    assert out.stdout.splitlines()[0] == f"rank 3 (pid {bystander}): skipped: it does not handle SIGUSR1 " \
                                         "(faulthandler off, or not Python)"
    # Without its run_started, nothing in the file is taken for a rank of that run.
    write_events(tmp_path / "anonymous", [good], bystander)
    out = run_ranktop("stacks", "--signal", str(tmp_path / "anonymous"), env=runtime, timeout=30)
    assert out.returncode == 1 and out.stderr == no_ranks_left(tmp_path / "anonymous"), out.stderr


def test_a_sparse_events_file_is_not_read_through_and_a_too_long_line_has_no_tail_taken(tmp_path, runtime,
                                                                                         bystander):
    """A terabyte-long hole (`truncate -s 1T`, free to make) is stepped over, not read as zeros
    (20 GB of one took 53 s, a terabyte hours); an over-long line is skipped whole: its last
    4 MiB were read as a line of their own, so a line could end in an event."""
    run_dir = tmp_path / "run"
    good = '{"event": "started", "rank": 3, "local_rank": 1, "pid": PID}'
    write_events(run_dir, ['{"event": "run_started", "run_id": "hostile"}'], bystander)
    with open(run_dir / "events.jsonl", "r+b") as f:
        f.seek(1 << 40)
        f.write(f"\n{good}\n".replace("PID", str(bystander)).encode())
    out = run_ranktop("stacks", "--signal", str(run_dir), env=runtime, timeout=60)
    assert out.returncode == 1, out.stderr  # found, and skipped: no signal was sent
    assert out.stdout.startswith(f"rank 3 (pid {bystander}): skipped"), out.stdout
    write_events(tmp_path / "long", ['{"event": "run_started", "run_id": "hostile"}', "x" * (4 << 20) + good],
                 bystander)
    out = run_ranktop("stacks", "--signal", str(tmp_path / "long"), env=runtime, timeout=60)
    assert (out.returncode, out.stdout) == (1, ""), out.stdout
    assert out.stderr == no_ranks_left(tmp_path / "long"), out.stderr


def test_a_process_whose_rank_variables_are_not_numbers_is_dumped_as_itself(runtime):
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "RANK": "x", "LOCAL_RANK": "1" * 5000})
    try:
        out = run_ranktop("stacks", str(proc.pid), env=runtime, timeout=60)
    finally:
        stop_process(proc)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith("stacks at ") and f"pid {proc.pid}" in out.stdout, out.stdout


def test_a_stack_command_with_ranks_of_the_wrong_shape_is_answered_at_once(tmp_path, runtime):
    from ranktop.core.client import Connection

    proc = start(tmp_path, runtime, "shapes", "import time\nprint('up', flush=True)\ntime.sleep(3600)\n")
    try:
        wait_lines(proc, "up", 2)
        (sock,) = (tmp_path / "rt" / "ranktop").glob("shapes.sock")
        with Connection(str(sock), timeout=20) as conn:  # a dump thread that died would leave it waiting
            for name, ranks in [("SignalDump", 5), ("SignalDump", 0), ("SignalDump", True), ("DumpStacks", 1.5)]:
                answer = conn.command(name, local_ranks=ranks)
                assert not answer["ok"] and answer["report"] is None, answer
                assert answer["message"] == f"bad local ranks {ranks!r}: expected a list of local ranks, or none for all"
            good = conn.command("SignalDump", local_ranks=[1])  # the engine is fine
            assert good["ok"] and [r["rank"] for r in good["report"]["ranks"]] == [1], good
            assert conn.snapshot()["state"] == "running"
    finally:
        stop_process(proc)


def test_a_process_naming_another_runs_directory_gets_no_dump_saved_there(tmp_path, runtime):
    """`ranktop stacks PID` saves a rank's dump in its run directory, which it learns from the
    rank's environment: anyone can start a process that names someone else's run. Only the run
    that the process's parent started (its run_started pid) is written to."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    events = '{"event": "run_started", "run_id": "victim", "pid": 1}\n'
    (victim / "events.jsonl").write_text(events)
    error_file = victim / "attempt_0" / "0" / "error.json"
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_ERROR_FILE": str(error_file)})
    try:
        out = run_ranktop("stacks", str(proc.pid), env=runtime, timeout=60)
    finally:
        stop_process(proc)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "time.sleep" in out.stdout or "<module>" in out.stdout, out.stdout  # dumped all the same
    assert sorted(p.name for p in victim.iterdir()) == ["events.jsonl"]  # no stacks/ made there
    assert (victim / "events.jsonl").read_text() == events




@pytest.mark.skipif(os.geteuid() != 0, reason="makes another user's directory: needs root")
def test_a_run_directory_reached_through_another_users_directory_gets_no_dump_saved(tmp_path, runtime):
    """`ranktop stacks DIR` saves the dump in DIR: a link in a directory someone else owns had it
    write into whichever private directory of ours they pointed it at."""
    proc = start(tmp_path, runtime, "mine", "import time\nprint('up', flush=True)\ntime.sleep(3600)\n", n=1)
    try:
        wait_lines(proc, "up", 1)
        run_dir, theirs = tmp_path / "logs" / "mine", tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, NOBODY, NOBODY)
        (theirs / "run").symlink_to(run_dir)
        os.lchown(theirs / "run", NOBODY, NOBODY)
        files = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}  # not served there: found from the files
        out = run_ranktop("stacks", "--signal", str(theirs / "run"), env=files, timeout=30)
        assert out.returncode == 0 and "1 of 1 ranks dumped" in out.stdout, out
        assert out.stderr == (f"ranktop stacks: bad run directory {theirs / 'run'}: it goes through {theirs}, which "
                              f"belongs to uid {NOBODY}, not to you (uid 0): whoever controls it decides where the "
                              "path leads; the dump is shown, not saved\n")
        assert not (run_dir / "stacks").exists() and "stacks_dumped" not in (run_dir / "events.jsonl").read_text()
        direct = run_ranktop("stacks", "--signal", str(run_dir), env=files, timeout=30)
        assert (direct.returncode, direct.stderr) == (0, ""), direct
        assert os.listdir(run_dir / "stacks") and "stacks_dumped" in (run_dir / "events.jsonl").read_text()
    finally:
        stop_process(proc)


# A rank whose names are its weapons: a function, a file and a thread named with a line break that
# starts a line of ranktop's own, escape sequences and a bidi override; 3000 calls deep.
HOSTILE_NAMES = r"""
import sys, threading, time, types
sys.setrecursionlimit(10000)
NAME = "x\n== rank 9 (1)  <-- ODD ONE OUT\x1b]0;title\x07\x1b[2J\u202e"
def down(n):
    if n == 0:
        print("ready", flush=True)
        time.sleep(3600)
    down(n - 1)
qualname = {"co_qualname": NAME} if sys.version_info >= (3, 11) else {}  # (3.10's code has none)
down = types.FunctionType(down.__code__.replace(co_name=NAME, co_filename="/t/f\x1b[31m\n.py", **qualname),
                          globals())
threading.Thread(target=time.sleep, args=(3600,), name=NAME, daemon=True).start()
down(3000)
"""


def assert_one_line_each(text: str) -> None:
    """Every name on the line it belongs to, nothing a terminal obeys."""
    assert not any(c in text for c in "\x1b\x07\u202e"), text[:2000]
    assert [line for line in text.splitlines() if line.startswith("==")] == ["== ranks 0-1 (2)"], text[:2000]
    assert "x␊== rank 9 (1)  <-- ODD ONE OUT⟨U+202E⟩ (f␊.py:9)" in text and "thread 'x\\n== rank 9" in text


@pytest.mark.skipif(os.environ.get("RANKTOP_PY_SPY") is None and shutil.which("py-spy") is None
                    and not os.access(os.path.join(os.path.dirname(PY), "py-spy"), os.X_OK), reason="no py-spy")
def test_names_with_line_breaks_and_escapes_stay_on_their_line_and_a_deep_stack_shows_its_ends(tmp_path, runtime):
    """A name with a line break started a line of its own in `ranktop stacks` and the saved .txt
    (a fake group, a fake ODD ONE OUT), its escapes reached the saved .txt; 3000 frames ended the
    dump in a RecursionError (`stack dump failed` in the TUI)."""
    proc = start(tmp_path, runtime, "names", HOSTILE_NAMES)
    try:
        wait_lines(proc, "ready", 2)
        out = run_ranktop("stacks", "--threads", "names", env=runtime, timeout=60)
        assert out.returncode == 0 and "2 of 2 ranks dumped, 1 distinct stack(s)" in out.stdout, out
        assert_one_line_each(out.stdout)
        (saved,) = (tmp_path / "logs" / "names" / "stacks").glob("*.txt")
        assert_one_line_each(saved.read_text())
        # The outermost and innermost 50 frames, and between them how many were left out.
        assert "... 2902 frames left out ..." in out.stdout and len(out.stdout.splitlines()) < 300
        report = json.loads(run_ranktop("stacks", "--json", "--no-save", "names", env=runtime, timeout=60).stdout)
        frames = [f["name"] for f in report["ranks"][0]["threads"][0]["frames"]]
        assert len(frames) == 101 and frames[0] == "<module>" and frames[50] == "... 2902 frames left out ..."
        assert frames[-1].startswith("x\n== rank 9") and frames[-2] == frames[-1]  # JSON keeps them as they are
        assert proc.poll() is None
    finally:
        stop_process(proc)


# A rank that answers SIGUSR1 with a dump of its own making in faulthandler's form: 3000 frames.
FAKE_DEEP_DUMP = r"""
import os, signal, sys, time
def dump(signum, frame):
    lines = ["Current thread 0x00007f0000000001 (most recent call first):"]
    lines += [f'  File "/t/deep.py", line {i} in f{i}' for i in range(3000, 0, -1)]
    os.write(2, ("\n".join(lines) + "\n").encode())
signal.signal(signal.SIGUSR1, dump)
print("ready", flush=True)
time.sleep(3600)
"""


def test_a_deep_dump_in_faulthandlers_form_shows_its_ends_by_the_signal_too(tmp_path, runtime):
    """README: a thread deeper than 100 frames shows its outermost and innermost 50. Only py-spy's
    dumps were cut: one read back after SIGUSR1 is the rank's to write, and 3000 frames of it
    ended `ranktop stacks --signal` in a RecursionError."""
    proc = start(tmp_path, runtime, "deep", FAKE_DEEP_DUMP, n=1)
    try:
        wait_lines(proc, "ready", 1)
        out = run_ranktop("stacks", "--signal", "deep", env=runtime, timeout=60)
        assert (out.returncode, out.stderr) == (0, ""), out
        assert "1 of 1 ranks dumped" in out.stdout and "... 2900 frames left out ..." in out.stdout, out.stdout
        lines = out.stdout.splitlines()
        assert len(lines) < 300 and any("f1 (deep.py:1)" in x for x in lines) and any("f3000 " in x for x in lines)
        assert proc.poll() is None
    finally:
        stop_process(proc)


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    stop_process(proc)


# What a py-spy (a fake one on RANKTOP_PY_SPY, a tool boundary) may answer, and the reason shown.
GARBAGE = {
    "not a list": ("echo '{\"a\": 1}'", "the dump is of type dict, not list"),
    "a thread not an object": ("echo '[1]'", "a thread is of type int, not dict"),
    "a name not text": ("echo '[{\"frames\": [{\"name\": 5}]}]'", "name is of type int, not str"),
    "a line too big": ("echo '[{\"frames\": [{\"name\": \"f\", \"line\": 1e400}]}]'",
                       "line is of type float, not a whole number"),
    "a file name a list": ("echo '[{\"frames\": [{\"name\": \"f\", \"filename\": [\"a\"]}]}]'",
                           "filename is of type list, not str"),
    "an error not UTF-8": ("printf '\\377bad\\n' >&2; exit 1", "failed: \ufffdbad"),
    "200 MB": ("head -c 200000000 /dev/zero", "py-spy's answer is over 64 MiB: not read"),
}


def stacks_by(tmp_path, runtime, pid: int, script: str) -> subprocess.CompletedProcess:
    """`ranktop stacks PID` with a py-spy that runs `script`."""
    spy = tmp_path / "py-spy"
    spy.write_text(f"#!/bin/sh\n{script}\n")
    spy.chmod(0o755)
    return run_ranktop("stacks", "--no-save", str(pid), env={**runtime, "RANKTOP_PY_SPY": str(spy)}, timeout=60)


@pytest.mark.parametrize("answer", GARBAGE.values(), ids=GARBAGE.keys())
def test_a_py_spy_that_answers_garbage_is_a_reason_not_a_traceback(tmp_path, runtime, sleeper, answer):
    """Each was a traceback (AttributeError, OverflowError, TypeError, UnicodeDecodeError), or all
    of the answer held in memory, eight ranks' at once."""
    script, reason = answer
    out = stacks_by(tmp_path, runtime, sleeper, script)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out
    (line,) = [line for line in out.stdout.splitlines() if line.startswith(f"   rank 0 (pid {sleeper}): failed: ")]
    assert reason in line, out.stdout


def test_a_name_that_is_not_utf8_is_dumped_with_a_replacement_character(tmp_path, runtime, sleeper):
    """It was a UnicodeDecodeError traceback."""
    out = stacks_by(tmp_path, runtime, sleeper,
                    "printf '[{\"frames\": [{\"name\": \"f\\377\", \"filename\": \"x.py\", \"line\": 1}]}]'")
    assert out.returncode == 0 and "     f\ufffd (x.py:1)" in out.stdout.splitlines(), out


# A py-spy that will not go when told: it ignores SIGTERM and waits on a child of its own, which
# holds its pipes open (or closes them and waits: then its exit is what is waited for).
DEAF_PY_SPY = {
    "holds its pipes": "trap '' TERM\nsleep 600\n",
    "closed its pipes": "trap '' TERM\nexec >/dev/null 2>&1\nsleep 600\n",
}


def deaf_py_spy(tmp_path, script: str) -> str:
    spy = tmp_path / "py-spy"
    spy.write_text(f"#!/bin/sh\n{script}")
    spy.chmod(0o755)
    return str(spy)


def sleeps_left(spy: str) -> list[int]:
    """What is left of the stand-in `spy` and of its `sleep` (the no_orphans check would wait 8 s
    for them, then fail)."""
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] in ([spy], ["sleep", "600"])
            and p.pid != os.getpid()]
    return [pid for pid in left if _carries_test_mark(pid)]


def _carries_test_mark(pid: int) -> bool:
    from conftest import MARK

    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return MARK in f.read() + b"\0"
    except OSError:
        return False


@pytest.fixture(scope="module")
def deaf_dumps(tmp_path_factory) -> dict:
    """The dumps of the two tests below, side by side: each stand-in of DEAF_PY_SPY by a `ranktop
    stacks PID` of its own (of a sleeping process), and an engine's (run "deaf", two ranks, its
    py-spy a stand-in that notes its /proc stat first). Each waits out the 5 s bound, and the two
    tests waited one each. The engine is stopped, and every process ended, before the first of them
    ends (the no_orphans check). Holds each dump's output by kind ("engine" for the engine's), and
    what the second test looks at while the engine runs and once it stopped."""
    base = tmp_path_factory.mktemp("deaf")
    (base / "rt").mkdir(mode=0o700)
    runtime = {**os.environ, "XDG_RUNTIME_DIR": str(base / "rt")}
    spies = {}
    for i, (kind, script) in enumerate(DEAF_PY_SPY.items()):
        (base / f"spy{i}").mkdir()
        spies[kind] = deaf_py_spy(base / f"spy{i}", script)
    (base / "engine").mkdir()
    spies["engine"] = deaf_py_spy(base / "engine", 'cat /proc/$$/stat > "$(dirname "$0")/spy.stat"\n'
                                  + DEAF_PY_SPY["holds its pipes"])
    found: dict = {"spies": spies}
    sleeper = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    proc = start(base / "engine", {**runtime, "RANKTOP_PY_SPY": spies["engine"]}, "deaf",
                 "import time\nprint('up', flush=True)\ntime.sleep(3600)\n")
    try:
        wait_lines(proc, "up", 2)
        runs = {kind: {"args": ranktop_cmd("stacks", "--no-save", str(sleeper.pid)), "cwd": ROOT,
                       "env": {**runtime, "RANKTOP_PY_SPY": spy}} for kind, spy in spies.items() if kind != "engine"}
        runs["engine"] = {"args": ranktop_cmd("stacks", "deaf"), "cwd": ROOT, "env": runtime}
        found["out"] = run_side_by_side(runs, timeout=60)
        found["session"], found["running"] = os.getsid(proc.pid), proc.poll() is None
        found["stopped"] = run_ranktop("stop", "deaf", env=runtime, timeout=30)
        proc.wait(30)
    finally:
        stop_process(proc)
        stop_process(sleeper)
    found["sleeper"], found["stat"] = sleeper.pid, (base / "engine" / "spy.stat").read_text()
    found["left"] = {kind: sleeps_left(spy) for kind, spy in spies.items()}
    return found


def test_a_py_spy_that_will_not_exit_is_ended_with_what_it_started_at_the_bound(deaf_dumps):
    """README: a py-spy that does not answer within 5 s is a reason, not a wait. The wait was
    bounded, but only py-spy itself was killed: a wrapper's child holding its pipes (a script, a
    version manager's shim) was left running after the dump. Each stand-in of DEAF_PY_SPY by a
    `ranktop stacks` of its own, side by side: each waits out the bound."""
    sleeper = deaf_dumps["sleeper"]
    for kind in DEAF_PY_SPY:
        out = deaf_dumps["out"][kind]
        assert out.returncode == 1 and "Traceback" not in out.stderr, (kind, out)
        assert f"   rank 0 (pid {sleeper}): failed: py-spy did not answer within 5s" in out.stdout.splitlines(), (
            kind, out.stdout)
        assert not deaf_dumps["left"][kind], deaf_dumps["left"]


def test_an_engine_whose_py_spy_will_not_exit_answers_at_the_bound_and_still_stops(deaf_dumps):
    """The engine dumps in a thread of its server, never its monitor loop: a dump held by a py-spy
    that ignores SIGTERM answers at the bound with each rank's reason, the run goes on and stops
    as asked, and nothing of py-spy's is left. py-spy runs in a group of its own within the
    engine's session: in a session of its own the engine took it for an orphan and adopted it."""
    out = deaf_dumps["out"]["engine"]
    assert out.returncode == 1 and "0 of 2 ranks dumped" in out.stdout, out
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("   ranks 0-1 (pids ")]
    assert line.endswith("): failed: py-spy did not answer within 5s"), out.stdout
    pid, _, rest = deaf_dumps["stat"].partition(" (")
    pgrp, session = rest.rsplit(") ", 1)[1].split()[2:4]
    assert (int(pgrp), int(session)) == (int(pid), deaf_dumps["session"])
    assert deaf_dumps["running"]  # the run goes on
    assert deaf_dumps["stopped"].returncode == 0, deaf_dumps["stopped"]
    assert not deaf_dumps["left"]["engine"], deaf_dumps["left"]


# A "rank" of root's own run: it notes a SIGUSR1 in a file instead of dumping (so the test sees
# whether one came), and sleeps.
ROOTS_RANK = """
import os, signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: open(sys.argv[1], "w").close())
print("up", flush=True)
time.sleep(60)
"""


def fake_run_dir(user, where: Path, run_id: str, pid: int) -> Path:
    """A run directory `user` made, whose events.jsonl names `pid` as rank 0 of `run_id`."""
    run_dir = where / "run"
    events = [{"event": "run_started", "run_id": run_id, "pid": 1},
              {"event": "started", "rank": 0, "local_rank": 0, "pid": pid, "attempt": 0}]
    text = "".join(json.dumps(e) + "\n" for e in events)
    made = user.run(["sh", "-c", 'mkdir "$1" && cat > "$1/events.jsonl"', "-", str(run_dir)], input=text)
    assert made.returncode == 0, made.stderr
    return run_dir


def user_process(user, code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(["runuser", "-u", user.name, "--", user.python, "-c", code, *args],
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, text=True)


def stop_user_process(runuser: subprocess.Popen, pid: int | None) -> None:
    """Ends `runuser` and the user's process `pid` it started (None: not known). SIGTERM goes to
    that process: runuser, signalled itself, ends its child and then sleeps 2 s before it exits."""
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        try:
            runuser.wait(10)
            return
        except subprocess.TimeoutExpired:
            pass
    stop_process(runuser)


def test_another_users_run_directory_steers_root_to_none_but_their_own_processes(tmp_path, runtime, other_user):
    """Root's `ranktop stacks DIR` of a directory another user made dumped (or with --signal,
    SIGUSR1ed) any process it named, root's own ranks included (the check that a pid is that run's
    rank reads its environment, which the user can name too). Only that user's processes are
    dumped from it now; theirs still are, by root as by themselves."""
    where = Path(tempfile.mkdtemp(prefix="h22-", dir="/tmp"))
    where.chmod(0o755)
    os.chown(where, other_user.uid, other_user.gid)  # their log directory
    noted = where / "sigusr1"
    roots = subprocess.Popen([PY, "-c", ROOTS_RANK, str(noted)], env={**os.environ, "TORCHELASTIC_RUN_ID": "roots"},
                             stdout=subprocess.PIPE, text=True)
    theirs = user_process(other_user, "import os, time; print(os.getpid(), flush=True); time.sleep(60)",
                          env={"TORCHELASTIC_RUN_ID": "theirs"})  # (its pid: runuser, its parent, is root's)
    their_pid = None
    try:
        assert roots.stdout.readline() == "up\n"
        their_pid = int(theirs.stdout.readline())
        steer = fake_run_dir(other_user, where, "roots", roots.pid)
        for how in ([str(steer)], ["--signal", str(steer)], [str(where)]):  # (the log directory: its newest run)
            out = run_ranktop("stacks", "--no-save", *how, env=runtime, timeout=30)
            assert (out.returncode, out.stdout) == (2, ""), out
            assert out.stderr == (f"ranktop: error: bad target '{steer}': its events.jsonl is uid {other_user.uid}'s and "
                                  f"names rank 0, pid {roots.pid}, which runs as uid 0: only uid {other_user.uid}'s "
                                  "processes are dumped from it\n"), out.stderr
        assert not noted.exists()  # no SIGUSR1 came
        shutil.rmtree(steer)
        own = fake_run_dir(other_user, where, "theirs", their_pid)
        out = run_ranktop("stacks", "--no-save", str(own), env=runtime, timeout=30)
        assert (out.returncode, out.stderr) == (0, "") and "1 of 1 ranks dumped" in out.stdout, out
        assert "time.sleep" in out.stdout or "<module>" in out.stdout, out.stdout
    finally:
        stop_process(roots)
        stop_user_process(theirs, their_pid)
        for proc in (roots, theirs):
            proc.stdout.close()
        shutil.rmtree(where, ignore_errors=True)


def test_a_process_that_keeps_roots_saved_uid_is_not_the_users_own(tmp_path, runtime, other_user):
    """A process whose real and effective uid are the user's but whose saved uid is root's (a
    setuid program that set its euid aside for a while) is not theirs to ptrace: the kernel
    refuses them. Root's `ranktop stacks DIR` of their directory dumped it."""
    where = Path(tempfile.mkdtemp(prefix="h22-", dir="/tmp"))
    where.chmod(0o755)
    os.chown(where, other_user.uid, other_user.gid)
    aside = ("import os, sys, time; u = int(sys.argv[1]); os.setresgid(u, u, u); os.setresuid(u, u, 0); "
             "print('up', flush=True); time.sleep(60)")
    held = subprocess.Popen([PY, "-c", aside, str(other_user.uid)], env={**os.environ, "TORCHELASTIC_RUN_ID": "aside"},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline() == "up\n"
        steer = fake_run_dir(other_user, where, "aside", held.pid)
        out = run_ranktop("stacks", "--no-save", str(steer), env=runtime, timeout=30)
        assert (out.returncode, out.stdout) == (2, ""), out
        assert f"names rank 0, pid {held.pid}, which runs as uid 0/{other_user.uid}:" in out.stderr, out.stderr
    finally:
        stop_process(held)
        held.stdout.close()
        shutil.rmtree(where, ignore_errors=True)


# A process of the user's that the kernel would not let them trace, and how it was made so.
UNTRACEABLE = {
    "setgid": "whose real, effective and saved gids differ ({gid}/0/0: a setgid program): it is not dumped",
    "undumpable": "which is not dumpable (prctl PR_SET_DUMPABLE 0, or it changed its ids): it is not dumped",
}
UNDUMPABLE = ("import ctypes, os, time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); "  # PR_SET_DUMPABLE
              "print(os.getpid(), flush=True); time.sleep(60)")


def untraceable(user, how: str, where: Path) -> subprocess.Popen:
    """The user's process, made untraceable by them `how`; its pid is its first line."""
    env = {"TORCHELASTIC_RUN_ID": how}
    if how == "undumpable":
        return user_process(user, UNDUMPABLE, env=env)
    setgid = where / "sleep"  # a setgid-root copy of a program: the user's real gid, root's effective one
    shutil.copy("/bin/sleep", setgid)
    os.chown(setgid, 0, 0)
    setgid.chmod(0o2755)
    return subprocess.Popen(["runuser", "-u", user.name, "--", "sh", "-c", 'echo $$; exec "$0" 60', str(setgid)],
                            env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("how", UNTRACEABLE)
def test_a_process_of_the_users_they_could_not_trace_is_not_dumped_for_them(tmp_path, runtime, other_user, how):
    """Their uids were all that was checked: root's `ranktop stacks DIR` of a directory the user
    made dumped (or SIGUSR1ed) a setgid program of theirs, or one that made itself undumpable,
    which the kernel lets not even them trace."""
    where = Path(tempfile.mkdtemp(prefix="h23-", dir="/tmp"))
    where.chmod(0o755)
    os.chown(where, other_user.uid, other_user.gid)
    proc = untraceable(other_user, how, where)
    pid = None
    try:
        pid = int(proc.stdout.readline())
        steer = fake_run_dir(other_user, where, how, pid)
        for args in ([str(steer)], ["--signal", str(steer)]):
            out = run_ranktop("stacks", "--no-save", *args, env=runtime, timeout=30)
            assert (out.returncode, out.stdout) == (2, ""), out
            assert out.stderr == (f"ranktop: error: bad target '{steer}': its events.jsonl is uid {other_user.uid}'s "
                                  f"and names rank 0, pid {pid}, {UNTRACEABLE[how].format(gid=other_user.gid)}\n")
    finally:
        stop_user_process(proc, pid)
        proc.stdout.close()
        shutil.rmtree(where, ignore_errors=True)


def test_a_rank_whose_process_ended_during_the_dump_is_not_shown_as_dumped(tmp_path, runtime):
    """The pid was checked, then dumped: a process that exited in between left its pid to any
    other (root's), and that one's stacks were shown and saved as the rank's. The process is
    held (a pidfd) from its check to the end of its dump; a py-spy that ends it and answers a
    dump (of whatever took its pid) is not believed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    victim = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], env={**os.environ, "TORCHELASTIC_RUN_ID": "r"})
    events = [{"event": "run_started", "run_id": "r", "pid": 1},
              {"event": "started", "rank": 0, "local_rank": 0, "pid": victim.pid, "attempt": 0}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    spy = tmp_path / "py-spy"  # it ends the rank and answers a dump all the same
    spy.write_text("#!/bin/sh\nkill -9 \"$3\"\nwhile kill -0 \"$3\" 2>/dev/null && "
                   "! grep -q '^State:.*Z' /proc/\"$3\"/status; do :; done\n"
                   "printf '[{\"frames\": [{\"name\": \"someone_elses\", \"filename\": \"x.py\", \"line\": 1}]}]'\n")
    spy.chmod(0o755)
    try:
        out = run_ranktop("stacks", "--no-save", str(run_dir), env={**runtime, "RANKTOP_PY_SPY": str(spy)}, timeout=30)
    finally:
        stop_process(victim)
    assert out.returncode == 1 and "someone_elses" not in out.stdout, out
    assert (f"   rank 0 (pid {victim.pid}): gone: process exited during the dump: its pid may have named another "
            "process by then, so what was dumped is not shown") in out.stdout.splitlines(), out.stdout


def run_dir_naming(run_dir: Path, run_id: str, pid: int, ranks: int) -> Path:
    """`run_dir`, made, whose events.jsonl names `pid` as each of `ranks` live ranks of `run_id`."""
    run_dir.mkdir(parents=True)
    events = [{"event": "run_started", "run_id": run_id, "pid": 1}]
    events += [{"event": "started", "rank": r, "local_rank": r, "pid": pid, "attempt": 0} for r in range(ranks)]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def sleeping_ranks(run_dir: Path, run_id: str, ranks: int) -> subprocess.Popen:
    """A sleeping process of `run_id`, which `run_dir`'s events.jsonl (made here) names as each of
    `ranks` ranks."""
    rank = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], env={**os.environ, "TORCHELASTIC_RUN_ID": run_id})
    run_dir_naming(run_dir, run_id, rank.pid, ranks)
    return rank


def few_files() -> None:
    """(a preexec_fn) 64 open files at most, the hard limit too: 200 ranks cannot all be held."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def test_more_ranks_than_files_it_may_open_is_one_line_and_nothing_dumped(tmp_path, runtime):
    """Each rank is held by a pidfd from its check to its dump: a run directory naming more ranks
    than `stacks` may open files (a run of thousands, or a made-up events.jsonl) was a traceback."""
    run_dir = tmp_path / "run"
    rank = sleeping_ranks(run_dir, "many", 200)
    try:
        out = run_ranktop("stacks", "--no-save", str(run_dir), env=runtime, timeout=30, preexec_fn=few_files)
        assert (out.returncode, out.stdout) == (2, ""), out
        assert out.stderr.startswith(f"ranktop: error: bad target '{run_dir}': rank "), out.stderr
        assert f", pid {rank.pid}, cannot be held from its check to its dump (Too many open files): nothing dumped; " \
               "raise the open-files limit (ulimit -n) or name one rank's pid\n" in out.stderr, out.stderr
        assert out.stderr.count("\n") == 1
        assert rank.poll() is None  # nothing sent to it
    finally:
        stop_process(rank)


THREADED = ("import os, sys, threading, time; t = threading.Thread(target=time.sleep, args=(60,), daemon=True); "
            "t.start(); print(t.native_id, flush=True); sys.stdin.read()")


def test_a_threads_id_named_as_a_ranks_pid_is_one_line_that_says_so(tmp_path, runtime):
    """A pid in events.jsonl that is a thread's id (a made-up events.jsonl) cannot be held by a
    pidfd: the line said to raise the open-files limit, which is not why."""
    proc = subprocess.Popen([PY, "-c", THREADED], env={**os.environ, "TORCHELASTIC_RUN_ID": "threads"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        tid = int(proc.stdout.readline())
        run_dir = run_dir_naming(tmp_path / "run", "threads", tid, 1)
        out = run_ranktop("stacks", "--no-save", str(run_dir), env=runtime, timeout=30)
        assert proc.poll() is None  # nothing sent to it
    finally:
        proc.stdin.close()
        stop_process(proc)
        proc.stdout.close()
    assert (out.returncode, out.stdout) == (2, ""), out
    assert out.stderr == (f"ranktop: error: bad target '{run_dir}': rank 0, pid {tid}, is a thread's id, not a "
                          "process's: nothing dumped\n"), out.stderr


def test_ranks_held_past_descriptor_1024_are_checked_and_signalled(tmp_path, runtime):
    """Thousands of ranks, the open-files limit raised for them: a pidfd numbered past 1023 was
    looked at with select(), whose sets stop there, and `stacks` ended in a ValueError traceback."""
    import resource

    rank = subprocess.Popen(["sleep", "60"], env={**os.environ, "TORCHELASTIC_RUN_ID": "past-1024"})
    try:
        run_dir = run_dir_naming(tmp_path / "run", "past-1024", rank.pid, 1100)
        files = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))  # noqa: E731
        out = run_ranktop("stacks", "--no-save", "--signal", str(run_dir), env=runtime, timeout=60, preexec_fn=files)
        assert rank.poll() is None  # sleep does not catch SIGUSR1: nothing sent to it
    finally:
        stop_process(rank)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "nothing was sent: without --signal, py-spy reads the stacks", out.stdout
    assert lines[1099] == (f"rank 1099 (pid {rank.pid}): skipped: it does not handle SIGUSR1 (faulthandler off, "
                           "or not Python)"), lines[1099]


def test_a_log_roots_newest_live_run_with_more_ranks_than_files_is_named_not_passed_over(tmp_path, runtime):
    """Named by its log root, the newest run with live ranks, whose ranks could not all be held,
    was passed over as if it had none: an older live run was dumped instead, and nothing said
    why the newest was not. It is the run chosen, and the one line says why nothing is dumped."""
    root = tmp_path / "logs"
    small = sleeping_ranks(root / "older", "older", 1)
    try:
        os.utime(root / "older" / "events.jsonl", (1, 1))  # written long before the other
        many = sleeping_ranks(root / "newest", "newest", 200)
        try:
            out = run_ranktop("stacks", "--no-save", str(root), env=runtime, timeout=30, preexec_fn=few_files)
            assert (out.returncode, out.stdout) == (2, ""), out
            assert out.stderr.startswith(f"ranktop: error: bad target '{root / 'newest'}': rank "), out.stderr
            assert "cannot be held from its check to its dump (Too many open files)" in out.stderr, out.stderr
        finally:
            stop_process(many)
    finally:
        stop_process(small)
