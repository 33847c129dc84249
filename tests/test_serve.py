"""A run served on its socket: ranktop ls / logs / stop from another terminal, a TUI that
outlives its terminal's hang-up, and a socket that refuses strangers and garbage."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import resource
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import psutil
import pytest
from conftest import (
    ROOT,
    drive,
    freeze,
    no_ranks_left,
    polls,
    ranktop_cmd,
    read_events,
    read_line,
    run_in_pty,
    run_ranktop,
    stop_process,
    until,
    wait_for,
)
from ranktop.core import protocol
from test_tui_tmux import Terminal

TICKER = "import os, time\nprint('hello from', os.environ['RANK'], flush=True)\nwhile True:\n    time.sleep(0.1)\n"


@pytest.fixture
def runtime():
    """Sockets in a directory of this test's own (what $XDG_RUNTIME_DIR is for), made 0700 with a
    short path: one under tmp_path (pytest-of-root/pytest-451/popen-gw0/<test name>) left a
    chosen run id's socket over the 107 bytes a Unix socket's path may have."""
    path = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    try:
        yield {**os.environ, "XDG_RUNTIME_DIR": path}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def ls(env) -> list[dict]:
    done = run_ranktop("ls", "--json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def gone(pid: int) -> bool:
    """Whether process `pid` has ended. A zombie has: a detached engine or an orphaned rank is
    init's to reap, and a container's init may reap only every 2 s (1-2 s of each wait here)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def start_headless(tmp_path, env, run_id: str, script_text: str = TICKER, nproc: int = 2,
                   name: str = "ticker.py", grace: float = 3, options: tuple[str, ...] = ()) -> subprocess.Popen:
    """A headless run of `script_text` (by default the 2-rank ticker), served for ls/attach/logs."""
    script = tmp_path / name
    script.write_text(script_text)
    return subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", str(nproc), "--shutdown-timeout", f"{grace:g}",
                                        *options,
                                        "--run-id", run_id, "--log-dir", str(tmp_path / "logs"), str(script)),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_each(calls: list[tuple[str, ...]], env: dict) -> list[subprocess.CompletedProcess]:
    """`ranktop ARGS` for each of `calls`, side by side: a silent engine keeps each waiting for its
    connect time-out, not for one another's."""
    return run_each_in([(env, args) for args in calls])


def run_each_in(calls: list[tuple[dict, tuple[str, ...]]]) -> list[subprocess.CompletedProcess]:
    """run_each with an environment of its own for each call: (env, ARGS)."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: run_ranktop(*call[1], env=call[0]), calls))


@pytest.mark.parametrize("encoding", [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "PYTHONUTF8": "0"}],
                         ids=["ascii-io", "C-without-utf8-mode"])
def test_ls_and_stop_show_a_run_named_in_utf8_on_an_ascii_console(tmp_path, runtime, encoding):
    """An é in the run id and its log dir: `ranktop ls` on a console whose encoding lacks it ended
    in a UnicodeEncodeError traceback; now it is written as `\\xe9`, as Python's stderr would."""
    proc = subprocess.Popen(ranktop_cmd("--headless", "--run-id", "café", "--log-dir", str(tmp_path / "lögs"),
                                        str(_ticker(tmp_path))),
                            cwd=ROOT, env=runtime, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: [r for r in ls(runtime) if r["state"] == "running"], what="the run listed")
        env = {**runtime, "LANG": "", **encoding}
        table = run_ranktop("ls", env=env)
        assert table.returncode == 0 and table.stderr == "", table.stderr
        assert "caf\\xe9" in table.stdout and "l\\xf6gs" in table.stdout
        # Each column as wide as it is printed: `caf\xe9` is 7 columns, not café's 4 (the row ran
        # past the header's SCRIPT, STATE ...).
        header, row = table.stdout.splitlines()
        assert [header.index(name) for name in ("SCRIPT", "STATE", "LOGS")] == [
            row.index("ticker.py"), row.index("running"), row.index("/")], table.stdout  # (the log dir: the first /)
        stopped = run_ranktop("stop", env=env)
        # (the name read from its socket's file name, where the file system's encoding is ASCII: its bytes)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.strip() in ("ranktop: stopped caf\\xe9", "ranktop: stopped caf\\xc3\\xa9")
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _ticker(tmp_path) -> Path:
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    return script


def test_ls_logs_and_stop_reach_a_headless_run(tmp_path, runtime):
    proc = start_headless(tmp_path, runtime, "served")
    try:
        (run,) = wait_for(lambda: [r for r in ls(runtime) if r["state"] == "running"], what="the run listed")
        assert run["run_id"] == "served" and run["world"] == 2 and run["script"] == "ticker.py"
        assert run["pid"] == proc.pid and run["log_dir"] == str(tmp_path / "logs" / "served")
        # A client killed with SIGKILL mid-stream: the engine lets it go and serves on.
        follower = subprocess.Popen(ranktop_cmd("logs", "served", "-f"), cwd=ROOT, env=runtime,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert follower.stdout.readline().startswith(b"[")  # subscribed, and streaming
        follower.kill()
        follower.wait()
        follower.stdout.close()
        wait_for(lambda: [(r["state"], r["clients"]) for r in ls(runtime)] == [("running", 0)],
                 what="the killed client let go")
        table = run_ranktop("ls", env=runtime).stdout
        assert table.splitlines()[0].split()[:4] == ["RUN", "SCRIPT", "WORLD", "STATE"] and "served" in table
        for how in ((), ("--json",)):  # into a reader that has gone (`ranktop ls | head`): no traceback
            read_end, write_end = os.pipe()
            os.close(read_end)
            gone = subprocess.run(ranktop_cmd("ls", *how), cwd=ROOT, env=runtime, stdout=write_end,
                                  stderr=subprocess.PIPE, text=True, timeout=30)
            os.close(write_end)
            assert gone.returncode == 0 and gone.stderr == "", (how, gone.stderr)
        logs = wait_for(lambda: "[1]:hello from 1" in (out := run_ranktop("logs", "serv", env=runtime).stdout)
                        and out, what="rank 1's line through the socket")
        assert "[0]:hello from 0" in logs
        one = run_ranktop("logs", "served", "--rank", "0", env=runtime).stdout
        assert one.strip() == "[0]:hello from 0"
        stopped = run_ranktop("stop", env=runtime)  # no RUN: the newest running one
        assert stopped.returncode == 0 and stopped.stdout.strip() == "ranktop: stopped served", stopped.stderr
        assert proc.wait(30) == 130  # stopped on request: a user's stop, as Ctrl-C's, not a rank's failure
        # Its terminal says why the output ended (over SSH nothing else would)
        said = proc.stderr.read()
        assert f"ranktop: ticker.py stopped on request; logs in {tmp_path / 'logs' / 'served'}" in said, said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert ls(runtime) == []
    assert [e["signal"] for e in read_events(tmp_path / "logs" / "served") if e["event"] == "user_stop"] == ["SIGTERM"]


def test_ls_cleans_the_socket_of_an_engine_that_died(tmp_path, runtime):
    """ranktop SIGKILLed: nothing unlinks its socket (the guard ends its ranks); the next ls finds
    nobody answering there, leaves the run out and removes the socket."""
    proc = start_headless(tmp_path, runtime, "doomed")
    try:
        (run,) = wait_for(lambda: [r for r in ls(runtime) if r["state"] == "running"], what="the run listed")
    finally:
        proc.kill()
        proc.wait()
    assert os.path.exists(run["socket"])  # left behind by the dead engine
    assert ls(runtime) == []
    assert not os.path.exists(run["socket"])
    alone = {**runtime, "TMPDIR": str(tmp_path)}  # (no ended runs under its default log root to name)
    assert run_ranktop("ls", env=alone).stdout.strip() == "no runs are served on this host"


def test_a_run_whose_engine_died_is_named_with_its_log_directory(tmp_path, runtime):
    """ranktop SIGKILLed (no final.json): `ranktop logs RUN_DIR` said `'RUN_DIR' names no run ...;
    an ended run is named by its run directory`, which it had been given. Each command now says the
    engine left no final view and where the log files are, exit 1; `stacks` that line, then that it
    has no ranks to dump, whether named by the run's id or its directory (which said `no live ranks
    in DIR (the run has ended)`)."""
    env = {**runtime, "TMPDIR": str(tmp_path)}
    (tmp_path / "ticker.py").write_text(TICKER)
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--run-id", "doomed",
                                        str(tmp_path / "ticker.py")),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (run,) = wait_for(lambda: [r for r in ls(env) if r["state"] == "running"], what="the run listed")
    finally:
        proc.kill()
        proc.wait()
    ranks = [e["pid"] for e in read_events(run["log_dir"]) if e["event"] == "started"]
    wait_for(lambda: all(gone(pid) for pid in ranks), what="the guard ended the ranks")
    said = (f"ranktop: doomed is not served and left no final.json: its engine went away before the run's end "
            f"(killed?), so how the run ended is unknown; its log files are under {run['log_dir']}")
    for args in (("logs", "doomed"), ("logs", run["log_dir"]), ("stop", "doomed"), ("attach", "doomed"),
                 ("web", "doomed")):
        done = run_ranktop(*args, env=env)
        assert (done.returncode, done.stdout, done.stderr) == (1, "", said + "\n"), args
    for target in ("doomed", run["log_dir"]):
        done = run_ranktop("stacks", target, env=env)
        stacks_said = f"ranktop stacks: {said.removeprefix('ranktop: ')}: no ranks to dump\n"
        assert (done.returncode, done.stdout, done.stderr) == (1, "", stacks_said), target
        assert stacks_said == no_ranks_left(run["log_dir"])  # (the line the stacks tests expect)


PLANT_FINAL = """import os, shutil, time
run_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.environ['TORCHELASTIC_ERROR_FILE'])))
if os.environ['RANK'] == '0':
    shutil.copy(os.environ['DONOR_FINAL'], os.path.join(run_dir, 'final.json'))
print('planted', flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_final_json_a_rank_planted_is_not_the_end_of_a_run_whose_engine_was_killed(tmp_path, runtime):
    """A rank copied another run's final.json (a success, well formed) into its run directory and
    the engine was SIGKILLed, so it never set that one aside: `logs -f`, attach's view and `logs`
    afterwards all showed the run as that success. Only a final.json that holds the key to the
    seal the engine served (and recorded in run_started) counts; a planted one is one line,
    ignored, and the run's end is unknown, as for a killed engine that left none."""
    env = {**runtime, "TMPDIR": str(tmp_path)}
    (tmp_path / "ok.py").write_text("print('ok')\n")
    (tmp_path / "plant.py").write_text(PLANT_FINAL)
    assert run_ranktop("--headless", "--nproc-per-node", "2", "--run-id", "donor", str(tmp_path / "ok.py"),
                       env=env).returncode == 0
    root = tmp_path / f"ranktop-{os.geteuid()}"
    env["DONOR_FINAL"] = str(root / "donor" / "final.json")
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--run-id", "doomed",
                                        str(tmp_path / "plant.py")),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    follow = None
    try:
        (run,) = wait_for(lambda: [r for r in ls(env) if r["state"] == "running"], what="the run listed")
        final = Path(run["log_dir"]) / "final.json"
        wait_for(final.exists, what="the planted final.json")
        follow = subprocess.Popen(ranktop_cmd("logs", "-f", "doomed"), cwd=ROOT, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert "planted" in follow.stdout.readline()
        from ranktop.core.client import RemoteEngine
        view = RemoteEngine(run["socket"])
    finally:
        proc.kill()
        proc.wait()
    try:
        said = f"{final} was not written by the run's engine (its key does not match the run's seal): ignored"
        out, err = follow.communicate(timeout=20)
        assert follow.returncode == 1, err
        assert f"ranktop: doomed: {said}\n" in err and "lost the run's engine before its end" in err
        snap = wait_for(lambda: (s := view.snapshot()).ended and s, what="attach's view lost the engine")
        assert snap.state.value == "running" and said in snap.error and snap.exit_status is None
    finally:
        view.close()
        if follow.poll() is None:
            stop_process(follow)
    ranks = [e["pid"] for e in read_events(run["log_dir"]) if e["event"] == "started"]
    wait_for(lambda: all(gone(pid) for pid in ranks), what="the guard ended the ranks")
    done = run_ranktop("logs", "doomed", env=env)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr.startswith(f"ranktop: {said}\nranktop: doomed is not served and left no final.json")
    stacks = run_ranktop("stacks", run["log_dir"], env=env)  # as its id is: it said `no live ranks in DIR`
    assert (stacks.returncode, stacks.stderr) == (1, f"ranktop: {said}\n{no_ranks_left(run['log_dir'])}"), stacks.stderr
    # The engine's own final.json holds the key, and views take it: the donor's, by the seal it recorded.
    assert run_ranktop("logs", "donor", env=env).returncode == 0


@pytest.fixture(scope="module")
def silent(tmp_path_factory) -> dict[str, dict]:
    """The engines the four tests below stop (SIGSTOP) or plant, each served from a runtime
    directory of its own, and what every command of those tests said of them. The commands run in
    one batch, side by side: each waits out its time-out for an answer that never comes (5 s),
    and four tests waited one each. Every process is ended before the first of them ends (the
    no_orphans check); each test asserts on its own part: "frozen", "jammed", "x" and "planted"
    (its `said` by command; its `run` as `ls --json` listed it while it answered)."""
    base = tmp_path_factory.mktemp("silent")
    found: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        for name in ("frozen", "jammed", "x", "planted"):
            runtime = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
            stack.callback(shutil.rmtree, runtime, ignore_errors=True)
            (base / name).mkdir()
            env = {**os.environ, "XDG_RUNTIME_DIR": runtime}
            if name in ("frozen", "x"):  # (a default log root of its own, where an id is looked for)
                env["TMPDIR"] = str(base / name)
            found[name] = {"env": env, "dir": base / name, "calls": []}
        _freeze_a_headless_run(stack, found["frozen"])
        _jam_a_headless_run(stack, found["jammed"])
        _freeze_a_detached_run(stack, found["x"])
        _plant_a_silent_socket(stack, found["planted"])
        batch = [(name, args) for name, part in found.items() for args in part["calls"]]
        said = run_each_in([(found[name]["env"], args) for name, args in batch])
        for (name, args), done in zip(batch, said, strict=True):
            found[name].setdefault("said", {})[args] = done
        for args in (("stacks", "--no-save", "x"), ("stacks", "--no-save")):
            found["x"]["said"][args] = run_ranktop(*args, env=found["x"]["env"])
        proc = found["frozen"]["proc"]
        proc.send_signal(signal.SIGCONT)
        found["frozen"]["stopped"] = run_ranktop("stop", "frozen", env=found["frozen"]["env"])
        found["frozen"]["status"] = proc.wait(30)
    return found


def _freeze_a_headless_run(stack: contextlib.ExitStack, part: dict) -> None:
    proc = part["proc"] = start_headless(part["dir"], part["env"], "frozen")
    stack.callback(proc.stderr.close)
    stack.callback(stop_process, proc)
    stack.callback(proc.send_signal, signal.SIGCONT)
    (part["run"],) = wait_for(lambda: [r for r in ls(part["env"]) if r["state"] == "running"], what="the run listed")
    freeze(proc.pid)
    part["calls"] = [("ls",), ("ls", "--json"), ("logs", "frozen"), ("logs", "-f"), ("stop", "fro")]


def _jam_a_headless_run(stack: contextlib.ExitStack, part: dict) -> None:
    proc = start_headless(part["dir"], part["env"], "jammed")
    stack.callback(proc.stderr.close)
    stack.callback(stop_process, proc)
    stack.callback(proc.send_signal, signal.SIGCONT)
    (part["run"],) = wait_for(lambda: [r for r in ls(part["env"]) if r["state"] == "running"], what="the run listed")
    freeze(proc.pid)
    queued = 0
    while True:  # what a queue of looks fills: connects until the kernel refuses one at once
        sock = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        sock.setblocking(False)
        queued += 1
        try:
            sock.connect(part["run"]["socket"])
        except BlockingIOError:
            break
        assert queued < 1000, "the listen queue never filled"
    part["calls"] = [("ls", "--json"), ("logs", "jammed")]


def _freeze_a_detached_run(stack: contextlib.ExitStack, part: dict) -> None:
    env, at = part["env"], part["dir"]
    (at / "ticker.py").write_text(TICKER)
    # An older run that answers, which `stacks` with no target took: x, started last, is the newest
    from fake_engine import FakeEngine
    from ranktop.core.server import serve

    with mock.patch.dict(os.environ, {"XDG_RUNTIME_DIR": env["XDG_RUNTIME_DIR"]}):
        server, problem = serve(FakeEngine(1), ["older"])
    assert problem is None
    stack.callback(server.close)
    done = run_ranktop("--detach", "--run-id", "x", str(at / "ticker.py"), env=env)
    assert done.returncode == 0, done.stderr
    (run,) = [r for r in ls(env) if r["run_id"] == "x"]
    part["run"] = run
    stack.callback(wait_for, lambda: gone(run["pid"]), what="the engine gone")
    stack.callback(run_ranktop, "stop", "x", env=env)
    stack.callback(os.kill, run["pid"], signal.SIGCONT)
    other = part["other"] = at / "elsewhere" / "x"  # another run of that id: written by a pid that serves nothing
    other.mkdir(parents=True)
    (other / "events.jsonl").write_text(json.dumps({"event": "run_started", "run_id": "x", "pid": 1}) + "\n")
    freeze(run["pid"])
    run_dir = run["log_dir"]
    # (`stacks` by its id runs after the batch: two py-spy at once on one rank, one is refused)
    part["calls"] = [("logs", "x"), ("logs", run_dir), ("logs", run_dir + "/"), ("stop", run_dir), ("logs", str(other)),
                     ("stacks", "--no-save", run_dir)]


def _plant_a_silent_socket(stack: contextlib.ExitStack, part: dict) -> None:
    directory = Path(part["env"]["XDG_RUNTIME_DIR"]) / "ranktop"
    directory.mkdir(mode=0o700)
    planted = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))  # listens, never answers
    planted.bind(str(directory / "\x1b]0;owned\x07\x1b[2Jjob.sock"))
    # Room for every connection: each is taken, then waits for a hello that never comes (with
    # a full queue they were refused at once, and `stacks` waited 60 s whenever one had room)
    planted.listen(16)
    part["calls"] = [("logs", "\x1b"), ("stop", "\x1b"), ("stacks", "\x1b")]


def test_a_served_run_whose_engine_does_not_answer_is_listed_and_said_so(silent):
    """An engine stopped (SIGSTOP) or swamped: ls left its run out, `logs` printed nothing, exit 0,
    and a lingering run's `stop` said it had already ended, its engine gone, exit 0. ls lists it as
    `not answering`, and the commands that reach it say so, exit 1; nothing is removed."""
    part = silent["frozen"]
    run, said = part["run"], part["said"]
    silent_line = f"ranktop: frozen: the engine at {run['socket']} does not answer\n"
    # its pid is the socket's listener, as the kernel names it: the engine, though it cannot say so
    assert [(r["run_id"], r["state"], r["pid"]) for r in json.loads(said["ls", "--json"].stdout)] == [
        ("frozen", "not answering", part["proc"].pid)]
    assert "frozen  ?       ?      not answering" in said["ls",].stdout
    for args in [("logs", "frozen"), ("logs", "-f"), ("stop", "fro")]:
        done = said[args]
        assert (done.returncode, done.stdout, done.stderr) == (1, "", silent_line), args
    assert part["stopped"].returncode == 0  # once it answers again
    assert part["status"] == 130


def test_a_silent_engine_whose_queue_of_connections_filled_is_still_listed(silent):
    """Each look at a stopped engine leaves a connection in its listen queue; once the queue was
    full, a connect failed at once (EAGAIN) and the run was taken for gone: ls left it out and the
    commands said it was not served. It is `not answering` however many looked before."""
    part = silent["jammed"]
    listed, done = part["said"]["ls", "--json"], part["said"]["logs", "jammed"]
    assert listed.returncode == 0, listed.stderr
    assert [(r["run_id"], r["state"]) for r in json.loads(listed.stdout)] == [("jammed", "not answering")]
    assert (done.returncode, done.stderr) == (1, f"ranktop: jammed: the engine at {part['run']['socket']} does not answer\n")


def test_a_silent_engine_named_by_its_run_directory_is_said_not_to_answer(silent):
    """A SIGSTOPped engine's run named by its directory got the dead engine's line (`its engine
    went away before the run's end`), exit 1, though its socket was there. The directory is matched
    to the socket whose listener wrote its run_started event: the line says it does not answer, as
    by id; a directory of the same id that another engine wrote is still said to have no engine."""
    part = silent["x"]
    run, said = part["run"], part["said"]
    run_dir = run["log_dir"]
    assert run_dir == str(part["dir"] / f"ranktop-{os.getuid()}" / "x")
    silent_line = f"ranktop: x: the engine at {run['socket']} does not answer\n"
    for args in [("logs", "x"), ("logs", run_dir), ("logs", run_dir + "/"), ("stop", run_dir)]:
        done = said[args]
        assert (done.returncode, done.stdout, done.stderr) == (1, "", silent_line), args
    elsewhere = said["logs", str(part["other"])]
    assert elsewhere.returncode == 1 and "its engine went away before the run's end" in elsewhere.stderr
    # `stacks` of it dumps its ranks from here, as given a pid: the hang may be the engine's own
    # (it said only that the engine does not answer, exit 1)
    # so is it with no target, the newest run, not an older one that answers (dumped with no word)
    for args in (("stacks", "--no-save", run_dir), ("stacks", "--no-save", "x"), ("stacks", "--no-save")):
        done = said[args]
        assert done.stderr == silent_line.replace("ranktop:", "ranktop stacks:").replace(
            "answer\n", "answer: its ranks are dumped from here\n"), done.stderr
        assert done.returncode == 0 and "1 of 1 ranks dumped" in done.stdout, done.stdout


@pytest.mark.parametrize(("args", "message"), [
    (("stop", "nope"), "ranktop: error: 'nope' names no run: none is served on this host; none has ended under "
                       "{root} either; an ended run elsewhere is named by its run directory"),
    (("logs",), "ranktop: error: no runs are served on this host; none has ended under {root} either; an ended run "
                "elsewhere is named by its run directory"),
    (("logs", "--events"), "ranktop: error: --events needs -f: the events so far are in events.jsonl in the run "
                           "directory"),
])
def test_a_run_that_is_not_there_is_one_line(tmp_path, runtime, args, message):
    done = run_ranktop(*args, env={**runtime, "TMPDIR": str(tmp_path)})  # a default log root with no run in it
    assert done.returncode == 2 and done.stderr.strip() == message.format(root=tmp_path / f"ranktop-{os.getuid()}")


def _ended_copy(root: Path, name: str, final: bytes, when: float) -> Path:
    """A run directory `name` under `root` holding `final` as its final.json, written at `when`."""
    run_dir = root / name
    run_dir.mkdir(mode=0o700)
    (run_dir / "final.json").write_bytes(final)
    os.utime(run_dir / "final.json", (when, when))
    os.utime(run_dir, (when, when))
    return run_dir


def test_a_user_back_after_the_engine_left_is_told_which_runs_ended_and_how_to_reach_them(tmp_path, runtime):
    """Back after the run's engine left (its --linger passed, or its TUI ended): `attach`, `logs`
    and `stop` with no RUN said `no runs are served on this host; an ended run is named by its run
    directory` (`ls`: its first half): no hint which run was theirs, and an id works too. They name the runs that ended
    last under the default log root, newest first, and the command that reaches the newest, by
    its directory and by its id, which both work. The root is read as it may have been tampered
    with: a symlink, another user's directory, a final.json that is a link, a run with none, and
    a name with escapes are never named as they are (and two hundred older runs cost no more)."""
    env = {**runtime, "TMPDIR": str(tmp_path)}
    script = tmp_path / "quick.py"
    script.write_text("print('done', flush=True)\n")
    for run_id in ("older", "newest"):
        done = run_ranktop("--headless", "--run-id", run_id, str(script), env=env)
        assert done.returncode == 0, done.stderr
    root = tmp_path / f"ranktop-{os.getuid()}"
    final, ended_at = (root / "older" / "final.json").read_bytes(), (root / "older" / "final.json").stat().st_mtime
    for i in range(200):
        _ended_copy(root, f"old-{i:03d}", final, ended_at - 3600 - i)
    _ended_copy(root, "\x1b]0;owned\x07third", final, ended_at - 60)
    later = time.time() + 5  # newer than every run: each would be named first
    elsewhere = _ended_copy(tmp_path, "elsewhere", final, later)
    (root / "linked").symlink_to(elsewhere)
    os.utime(root / "linked", (later, later), follow_symlinks=False)
    (root / "final-is-a-link").mkdir()
    (root / "final-is-a-link" / "final.json").symlink_to(root / "newest" / "final.json")
    (root / "killed").mkdir()  # an engine that died before the end: events.jsonl, no final.json
    (root / "killed" / "events.jsonl").write_text("{}\n")
    if os.geteuid() == 0:  # another user's directory, final.json and all
        theirs = _ended_copy(root, "theirs", final, later)
        os.chown(theirs / "final.json", 65534, 65534)
        os.chown(theirs, 65534, 65534)
    for name in ("final-is-a-link", "killed"):
        os.utime(root / name, (later, later))
    named = rf"ended under {re.escape(str(root))}, newest first: newest \(\d+m\d\ds ago\), older \(\d+m\d\ds ago\), third \(\d+m\d\ds ago\); "
    for command, reach in (("attach", "attach"), ("logs", "logs"), ("stop", "attach")):
        done = run_ranktop(command, env=env)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert re.fullmatch(rf"ranktop: error: no runs are served on this host; {named}ranktop {reach} "
                            rf"{re.escape(str(root / 'newest'))} reaches the newest, as does its id: ranktop {reach} newest\n",
                            done.stderr), done.stderr
    listed = run_ranktop("ls", env=env)  # the first command typed on coming back
    assert listed.returncode == 0 and re.fullmatch(
        rf"no runs are served on this host; {named}ranktop attach {re.escape(str(root / 'newest'))} reaches the "
        r"newest, as does its id: ranktop attach newest\n", listed.stdout), listed.stdout
    for command in ("logs", "stacks"):  # a RUN that names nothing gets the same names
        wrong = run_ranktop(command, "nope", env=env)
        assert wrong.returncode == 2 and re.search(
            rf"^ranktop: error: 'nope' names no run: none is served on this host; {named}ranktop {command} ",
            wrong.stderr), wrong.stderr
    for target in (str(root / "newest"), "newest"):  # the two commands it names reach that run
        shown = run_ranktop("logs", target, env=env)
        assert (shown.returncode, shown.stdout) == (0, "[0]:done\n"), shown.stderr
        assert "ranktop: newest has ended (succeeded); its engine has left" in shown.stderr


def test_an_ended_run_still_served_is_named_once_by_the_line_for_an_unknown_run(tmp_path, runtime):
    """A run that has ended whose engine still serves it (its TUI shows the end panel, or it
    lingers after --detach) has its final.json written: the line for an unknown RUN named it twice,
    `runs are shown; ended under ROOT, newest first: shown (0m09s ago), gone ...`, and offered
    `ranktop attach ROOT/shown` as the newest ended. It is named once, as served: it still answers."""
    env = {**runtime, "TMPDIR": str(tmp_path)}
    root = tmp_path / f"ranktop-{os.getuid()}"
    done = run_ranktop("--detach", "--linger", "60", "--run-id", "shown", "--no-python", "true", env=env)
    assert done.returncode == 0, done.stderr
    (run,) = wait_for(lambda: [r for r in ls(env) if r["state"] == "succeeded"], what="the ended run lingering")
    try:
        assert (root / "shown" / "final.json").exists()
        alone = run_ranktop("attach", "nosuch", env=env)
        assert (alone.returncode, alone.stderr) == (2, (
            f"ranktop: error: 'nosuch' names no run served on this host: runs are shown; no other run has ended "
            f"under {root}; an ended run elsewhere is named by its run directory\n")), alone.stderr
        assert run_ranktop("--headless", "--run-id", "gone", "--no-python", "true", env=env).returncode == 0
        both = run_ranktop("attach", "nosuch", env=env)
        assert both.returncode == 2 and re.fullmatch(
            rf"ranktop: error: 'nosuch' names no run served on this host: runs are shown; ended under "
            rf"{re.escape(str(root))}, newest first: gone \(\d+m\d\ds ago\); ranktop attach {re.escape(str(root / 'gone'))} "
            r"reaches the newest, as does its id: ranktop attach gone\n", both.stderr), both.stderr
    finally:
        run_ranktop("stop", "shown", env=env)
        wait_for(lambda: gone(run["pid"]), what="the engine gone")


def test_a_run_is_named_by_its_id_a_unique_prefix_or_its_directory_else_the_candidates_are_listed():
    from ranktop.core.client import ServedRun, find_run

    def run(run_id, **snap):
        return ServedRun(run_id, f"/run/{run_id}.sock", {"log_dir": f"/logs/{run_id}", **snap}, 0, 1)

    runs = [run("job-b", ended=True), run("job-a"), run("other")]  # newest first, as served_runs gives them
    assert find_run("job-a", runs) is runs[1] and find_run("oth", runs) is runs[2]
    assert find_run("/logs/job-b", runs) is runs[0]
    assert find_run(None, runs) is runs[1]  # the newest one still running
    with pytest.raises(ValueError, match=r"^'job-' matches several runs: runs are job-b, job-a$"):
        find_run("job-", runs)
    with pytest.raises(ValueError, match=r"^'nope' names no run served on this host: runs are job-b, job-a, other$"):
        find_run("nope", runs)


def test_a_served_runs_directory_reached_through_a_symlink_names_it(tmp_path):
    from ranktop.core.client import ServedRun, find_run

    (tmp_path / "logs" / "job").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "logs")
    runs = [ServedRun("job", "/run/job.sock", {"log_dir": str(tmp_path / "logs" / "job")}, 0, 1)]
    assert find_run(str(tmp_path / "link" / "job"), runs) is runs[0]


def test_a_socket_name_with_escapes_is_shown_clean_by_every_command(silent):
    """A run id comes from a socket's file name: `ls` cleaned it, but `logs`, `stop` and `stacks`
    of a silent engine printed it (and the socket's path) raw, so an escape sequence in the name
    reached the terminal. Only the user can name those sockets; they are shown safely all the same."""
    said = silent["planted"]["said"]
    for args in [("logs", "\x1b"), ("stop", "\x1b"), ("stacks", "\x1b")]:
        done = said[args]
        assert done.returncode == 1 and done.stdout == "", args
        assert "\x1b" not in done.stderr and "\x07" not in done.stderr, (args, done.stderr)
        assert re.fullmatch(r"ranktop( stacks)?: .*job: the engine at .*job\.sock does not answer\n", done.stderr), args


def test_a_silent_run_of_unknown_pid_is_not_a_directory_whose_events_name_none(tmp_path):
    """A silent engine whose full listen queue hid its pid (None), and a directory whose
    run_started names its id and no pid (anyone who can write the directory can write that): the
    two were matched, None to None, as the very process that wrote it."""
    from ranktop.core.client import ServedRun, find_run

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").write_text('{"event": "run_started", "run_id": "run"}\n')
    runs = [ServedRun("run", "/run/run.sock", {"state": "not answering"}, 0, None)]
    with pytest.raises(ValueError, match=r"names an ended run, not one served on this host$"):
        find_run(str(tmp_path / "run"), runs)


@pytest.mark.parametrize("events", [b"[" * 100_000 + b"\n", b"\xff\n", b'"run_started"\n'])
def test_a_directory_whose_events_file_is_garbage_names_no_silent_run(tmp_path, events):
    """events.jsonl is written by whoever could write the run directory: a nested array too deep
    for the JSON decoder raised RecursionError out of `ranktop logs DIR` while an engine was silent."""
    from ranktop.core.client import ServedRun, find_run

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").write_bytes(events)
    runs = [ServedRun("run", "/run/run.sock", {"state": "not answering"}, 0, os.getpid())]
    with pytest.raises(ValueError, match=r"names an ended run, not one served on this host$"):
        find_run(str(tmp_path / "run"), runs)


def _rank_pids(path: str) -> list[int]:
    from ranktop.core.client import Connection

    with Connection(path) as conn:
        return [r["pid"] for r in conn.snapshot()["ranks"]]


@pytest.fixture
def open_runtime():
    """A runtime directory another uid can traverse (pytest's own tmp dirs are 0700)."""
    path = tempfile.mkdtemp(prefix="ranktop-rt-")
    os.chmod(path, 0o711)
    yield {**os.environ, "XDG_RUNTIME_DIR": path}
    shutil.rmtree(path, ignore_errors=True)


def test_the_socket_refuses_other_users_and_garbage(tmp_path, open_runtime):
    runtime = open_runtime
    proc = start_headless(tmp_path, runtime, "guarded")
    try:
        (run,) = wait_for(lambda: ls(runtime), what="the run listed")
        # Another uid: a child that gives up root before it connects.
        code = ("import os, socket, sys; os.setgid(65534); os.setuid(65534); s = socket.socket(socket.AF_UNIX); "
                "s.connect(sys.argv[1]); print(s.recv(4096)[5:].decode())")
        os.chmod(os.path.dirname(run["socket"]), 0o711)  # let it reach the socket, which must refuse it
        os.chmod(run["socket"], 0o777)
        other = subprocess.run([sys.executable, "-c", code, run["socket"]], capture_output=True, text=True, timeout=30)
        assert "uid 65534 may not reach this run" in other.stdout, other.stderr
        os.chmod(os.path.dirname(run["socket"]), 0o700)  # back to private: ls refuses a directory open to others
        for garbage in (b"GET / HTTP/1.1\r\n\r\n", b"J\xff\xff\xff\xff", protocol.encode_control({"type": "hello",
                                                                                                   "version": 99,
                                                                                                   "role": "client"}),
                        protocol.encode_control(protocol.hello("client"))
                        + protocol.encode_control({"type": "subscribe", "ranks": [7]}),
                        protocol.encode_control(protocol.hello("client"))
                        + protocol.encode_control({"type": "subscribe", "cursors": {"0": "x"}}),
                        *(protocol.encode_control(protocol.hello("client"))
                          + protocol.encode_control({"type": "output", "rank": 0, "generation": 0, "line": 0,
                                                     "tail": tail}) for tail in (-1, "3")),
                        # values the frames cannot carry: these used to take the server thread down
                        *(protocol.encode_control(protocol.hello("client"))
                          + protocol.encode_control({"type": "output", "rank": rank, "line": line})
                          for rank, line in ((-1, 0), (2**40, 0), (2, 0), (0, 2**70), (0, -5))),
                        protocol.encode_control({"type": "snapshot"})):  # no hello first
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(run["socket"])
                s.sendall(garbage)
                reply = b""
                while chunk := s.recv(4096):
                    reply += chunk
                assert b'"type":"error"' in reply  # dropped with a reason
        # Fuzz: seeded random frames, after a hello or without one, each on a connection of its own
        # whose end is closed after them (a frame left unfinished is dropped on end of file).
        pids = _rank_pids(run["socket"])
        rng = random.Random(11)
        hello = protocol.encode_control(protocol.hello("client"))
        for _ in range(60):
            junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
            if rng.random() < 0.5:  # a plausible head: a known frame type and a small length
                junk = rng.choice((b"J", b"O")) + rng.randrange(0, 400).to_bytes(4, "big") + junk
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(run["socket"])
                s.sendall((hello if rng.random() < 0.7 else b"") + junk)
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):  # until the engine lets it go
                    pass
        assert _rank_pids(run["socket"]) == pids  # the engine and the ranks did not notice
        assert [r["state"] for r in ls(runtime)] == ["running"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_subscriber_naming_a_rank_many_times_is_dropped_and_the_others_are_served(tmp_path, runtime):
    """Found by fuzzing the socket: `"ranks": [0] * 150000` was taken, and every push walked it,
    so `ranktop ls` and `logs` found the engine not answering while that client stayed."""
    proc = start_headless(tmp_path, runtime, "crowded")
    try:
        (run,) = wait_for(lambda: ls(runtime), what="the run listed")
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(run["socket"])
            s.sendall(protocol.encode_control(protocol.hello("client"))
                      + protocol.encode_control({"type": "subscribe", "ranks": [0] * 150000}))
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        assert b"subscribe needs distinct local ranks in 0..1 and cursors" in reply
        assert [r["state"] for r in ls(runtime)] == ["running"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@contextlib.contextmanager
def hostile_engine(env, snapshot: object, output: dict | bytes | None = None, clients: object = 1,
                   hellos: tuple[bytes, ...] = (), pushes: bytes = b"") -> Iterator[None]:
    """A socket in the runtime directory that speaks as an engine (any process of the same user
    could serve one) and answers every snapshot request with `snapshot` and `clients`, every
    output request with the head `output` and two empty output frames (or with `output`'s bytes),
    a subscription with `snapshot`, then `pushes`.
    Its k-th connection gets `hellos[k]` as its first bytes where given."""
    connections = iter(hellos)
    directory = Path(env["XDG_RUNTIME_DIR"]) / "ranktop"
    directory.mkdir(mode=0o700, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(directory / "evil.sock"))
    listener.listen(8)

    def answer(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # (a client that leaves)
            conn.sendall(next(connections, None)
                         or protocol.encode_control(protocol.hello("engine", run_id="evil", pid=os.getpid())))
            decoder = protocol.FrameDecoder()
            while data := conn.recv(65536):
                for request in decoder.feed(data):
                    if request["type"] == "snapshot":
                        conn.sendall(protocol.encode_control({"type": "snapshot", "snapshot": snapshot,
                                                                  "clients": clients}))
                    elif request["type"] == "output" and isinstance(output, bytes):
                        conn.sendall(output)
                    elif request["type"] == "output":
                        conn.sendall(protocol.encode_control({"type": "output", **(output or {})})
                                     + protocol.encode_output(0, 0, b"") * 2)
                    elif request["type"] == "subscribe":
                        conn.sendall(protocol.encode_control({"type": "subscribe", "snapshot": snapshot}) + pushes)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        (directory / "evil.sock").unlink()


def _fake_snapshot(**changes: object) -> dict:
    from fake_engine import FakeEngine
    from ranktop.core.server import to_json

    return {**to_json(FakeEngine().group), **changes}


@pytest.mark.parametrize(("snapshot", "clients"), [(_fake_snapshot(), "x"), (_fake_snapshot(ranks="ab"), 1),
                                                   (_fake_snapshot(ranks=[5]), 1), (5, 1)])
def test_an_engine_whose_snapshot_is_no_runs_is_not_listed(runtime, snapshot, clients):
    """Found by fuzzing what an engine answers: `ls`, `logs` and `stacks` read its snapshot
    unchecked, and a `clients` of "x" or ranks that are text ended them in a traceback."""
    with hostile_engine(runtime, snapshot, clients=clients):
        assert ls(runtime) == []
        done = run_ranktop("logs", "evil", "--rank", "0", env=runtime)
        assert (done.returncode, done.stderr.count("\n"), "Traceback" in done.stderr) == (2, 1, False), done.stderr


def test_an_engine_whose_start_is_no_time_is_listed_with_an_unknown_age(runtime):
    """A start time no clock shows is unknown in a checked snapshot: `ls` divided it into
    minutes and stopped with a traceback (cannot convert float NaN to integer)."""
    with hostile_engine(runtime, _fake_snapshot(started_at="yesterday")):
        (run,) = ls(runtime)
        assert (run["run_id"], run["age"], run["state"]) == ("evil", None, "running")
        done = run_ranktop("ls", env=runtime)
        assert done.returncode == 0 and "evil  fake.py  2      running  ?" in done.stdout, done.stderr


def test_logs_stop_asking_an_engine_that_says_more_and_gives_none(runtime):
    """An engine whose answer to an output request says `more` with its cursor where it was
    kept `ranktop logs` asking for good; one whose answer has no line count ended it in a
    traceback."""
    with hostile_engine(runtime, _fake_snapshot(),
                        output={"generation": 0, "line": 0, "version": 1, "lines": 0, "open": 0, "more": True}):
        done = run_ranktop("logs", "evil", env=runtime, timeout=30)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    with hostile_engine(runtime, _fake_snapshot(), output={"generation": "x", "line": 0}):
        done = run_ranktop("logs", "evil", env=runtime, timeout=30)
        # (it exited 0 in silence, as for an engine that went away, which now says how the run ended)
        assert (done.returncode, done.stdout, done.stderr.count("\n")) == (1, "", 1), done.stderr
        assert done.stderr.startswith("ranktop: evil: the run's engine ended this connection"), done.stderr


def test_logs_f_shows_a_push_whose_numbers_are_not_whole_and_counts_no_hole_for_it(runtime):
    """A pushed output head is not checked as an answer is: one whose generation and line are
    no numbers ended `logs -f` in a traceback where it counted the lines not shown. Its lines
    are shown, no hole is said for it, and the run's end is one line."""
    push = (protocol.encode_control({"type": "output", "rank": 0, "generation": "x", "line": None, "lines": 1})
            + protocol.encode_output(0, 0, b"hi") + protocol.encode_output(0, 0, b"")
            + protocol.encode_control({"type": "ended", "state": "succeeded", "exit_status": 0}))
    with hostile_engine(runtime, _fake_snapshot(), pushes=push):
        done = run_ranktop("logs", "evil", "-f", env=runtime, timeout=30)
    assert (done.returncode, done.stdout, done.stderr.count("\n")) == (0, "[0]:hi\n", 1), done.stderr
    assert done.stderr.startswith("ranktop: evil has ended (succeeded, exit status 0)"), done.stderr


@pytest.mark.parametrize(("hellos", "output"), [
    ((), b"X\x00\x00\x00\x00"),  # garbage for an answer
    ((), protocol.encode_output(0, 0, b"x")),  # rank output where the answer's head was due
    # listed by `logs`, then another hello on its next connection: another version, rank output
    ((b"", protocol.encode_control({"type": "hello", "version": 99, "role": "engine"})), None),
    ((b"", protocol.encode_output(0, 0, b"hi")), None),
])
def test_an_engine_that_does_not_speak_the_protocol_is_one_line_for_logs(runtime, hellos, output):
    """Found by fuzzing what an engine answers: a frame of an unknown type, output where a
    message was due, or a hello of another version on `logs`' own connection were tracebacks."""
    with hostile_engine(runtime, _fake_snapshot(), output, hellos=hellos):
        done = run_ranktop("logs", "evil", env=runtime, timeout=30)
    assert "Traceback" not in done.stderr and done.returncode in (0, 1), done.stderr
    assert done.stderr.count("\n") <= 1 and done.stdout == ""


def test_a_run_out_of_descriptors_refuses_newcomers_with_a_reason_and_drops_silent_clients(tmp_path, runtime):
    """Each client holds a descriptor. Out of them, accept() fails while the client still waits,
    so the listener stays readable: the server used to spin on it at a full core and never answer."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "1", "--run-id", "fds", "--log-dir",
                                        str(tmp_path / "logs"), str(script)),
                            cwd=ROOT, env=runtime, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    clients: list[socket.socket] = []
    try:
        (run,) = wait_for(lambda: ls(runtime), what="the run listed")
        # Room for 5 more descriptors from now on (ranktop raises its own limit at start, so set it after).
        limit = len(os.listdir(f"/proc/{proc.pid}/fd")) + 5
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (limit, limit))
        refusal = b""
        for _ in range(20):  # silent clients: connected, no hello
            conn = socket.socket(socket.AF_UNIX)
            conn.settimeout(10)
            conn.connect(run["socket"])
            clients.append(conn)
            first = conn.recv(4096)
            if b'"type":"error"' in first:
                refusal = first
                break
            if len(clients) == 1:  # this one says hello, then starts a frame it never finishes
                conn.sendall(protocol.encode_control(protocol.hello("client")) + protocol.encode_control({"type": "x"})[:7])
        assert b"out of file descriptors" in refusal
        # The silent ones are dropped once their time to say hello (or to end a frame) is over, and
        # the run is served again.
        assert b"a frame left unfinished for 5s" in clients[0].recv(4096) + clients[0].recv(4096)
        assert b"no hello within 5s" in clients[1].recv(4096) + clients[1].recv(4096)
        wait_for(lambda: [r["state"] for r in ls(runtime)] == ["running"], what="the run served again")
    finally:
        for conn in clients:
            conn.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def said_hello(path: str, *requests: dict) -> socket.socket:
    """A raw client that said hello (and sent `requests` after it) and read the engine's hello."""
    conn = socket.socket(socket.AF_UNIX)
    conn.settimeout(10)
    conn.connect(path)
    conn.sendall(b"".join(protocol.encode_control(m) for m in (protocol.hello("client"), *requests)))
    assert b'"type":"hello"' in conn.recv(4096)
    return conn


def test_a_run_whose_clients_fill_every_slot_is_listed_and_can_still_be_stopped(tmp_path, runtime, monkeypatch):
    """64 idle clients: the 65th connection was refused, and ls took the refusal for a dead engine,
    so the run was not listed and `ranktop stop RUN` said it named no run. A few short connections
    past the 64 are served (ls, stop); what needs a long one (logs -f, attach) is refused in one
    line; with the short ones taken too, ls lists the run as `full` and stop says why it cannot."""
    from ranktop.core.client import EngineRefused, RemoteEngine
    from ranktop.core.server import MAX_CLIENTS, SPARE_CLIENTS

    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
    proc = start_headless(tmp_path, runtime, "crowd", nproc=1)
    idle: list[socket.socket] = []
    try:
        (run,) = wait_for(lambda: ls(runtime), what="the run listed")
        idle += [said_hello(run["socket"]) for _ in range(MAX_CLIENTS)]
        (listed,) = ls(runtime)
        assert (listed["run_id"], listed["state"], listed["clients"], listed["full"]) == ("crowd", "running", 64, True)
        row = run_ranktop("ls", env=runtime).stdout.splitlines()[1].split()
        assert row[0] == "crowd" and row[3] == "running" and row[5] == "full"
        follow = run_ranktop("logs", "crowd", "-f", env=runtime)
        assert (follow.returncode, follow.stdout) == (1, "") and follow.stderr.count("\n") == 1, follow.stderr
        assert follow.stderr.startswith("ranktop: crowd: this run has 64 clients"), follow.stderr
        with pytest.raises(EngineRefused, match="this run has 64 clients"):
            RemoteEngine(run["socket"])  # attach's engine: it needs a long connection
        spare = [said_hello(run["socket"]) for _ in range(SPARE_CLIENTS)]  # the short ones taken too
        idle += spare
        listed, stopped = run_each([("ls", "--json"), ("stop", "crowd")], runtime)
        assert [(r["run_id"], r["state"]) for r in json.loads(listed.stdout)] == [("crowd", "full")]
        assert (stopped.returncode, stopped.stdout) == (1, "") and stopped.stderr.count("\n") == 1, stopped.stderr
        assert stopped.stderr.startswith("ranktop: crowd: this run has 64 clients"), stopped.stderr
        for conn in spare:
            conn.close()
        stopped = run_ranktop("stop", "crowd", env=runtime)  # the 64 stay, and a user can still stop the run
        assert (stopped.returncode, stopped.stdout) == (0, "ranktop: stopped crowd\n"), stopped.stderr
        assert proc.wait(30) == 130
    finally:
        for conn in idle:
            conn.close()
        stop_process(proc)
        proc.stderr.close()


def test_a_command_sent_with_the_hello_by_a_client_that_left_at_once_is_applied(tmp_path, runtime):
    """A client that sends its hello and a Stop and closes before the engine takes the connection:
    the engine's hello failed (EPIPE) and it closed the connection unread, so the Stop was lost
    and the run went on. What arrived before the close is read and applied."""
    proc = start_headless(tmp_path, runtime, "hasty", nproc=1)
    try:
        (run,) = wait_for(lambda: ls(runtime), what="the run listed")
        freeze(proc.pid)  # the engine takes the connection only after the client has gone
        with socket.socket(socket.AF_UNIX) as hasty:
            hasty.connect(run["socket"])
            hasty.sendall(protocol.encode_control(protocol.hello("client"))
                          + protocol.encode_control({"type": "command", "id": 1, "command": "Stop", "args": {}}))
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(30) == 130
    finally:
        proc.send_signal(signal.SIGCONT)
        stop_process(proc)
        proc.stderr.close()
    assert [e["signal"] for e in read_events(tmp_path / "logs" / "hasty") if e["event"] == "user_stop"] == ["SIGTERM"]


def _answers(conn: socket.socket, most: int) -> list:
    """The frames the engine sends on `conn` until it closes it (a reset, where it left requests
    unread), or `most` of them, or 10 s of silence."""
    decoder, frames = protocol.FrameDecoder(), []
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while len(frames) < most and (data := conn.recv(1 << 16)):
            frames += decoder.feed(data)
    return frames


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # (dropped while it still sends)
        conn.sendall(data)


def test_a_client_that_asks_and_never_reads_costs_only_its_own_connection(tmp_path, runtime):
    """One client that sent many requests and read none held the single server thread in a
    blocking send for 2 s (ls said `not answering`, attached views got nothing), and was then
    dropped. Its answers wait in its own outbox: the others are served meanwhile, and it gets
    every answer once it reads; only one that owes more than the outbox's bound is dropped."""
    from ranktop.core.client import Connection
    from ranktop.core.server import MAX_PENDING

    proc = start_headless(tmp_path, runtime, "piped")
    lazy = greedy = None
    try:
        (run,) = wait_for(lambda: [r for r in ls(runtime) if r["state"] == "running"], what="the run listed")
        ask = protocol.encode_control({"type": "snapshot"})
        with Connection(run["socket"]) as conn:
            size = len(protocol.encode_control({"type": "snapshot", "snapshot": conn.snapshot()}))
        lazy = said_hello(run["socket"])
        lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        lazy.sendall(ask * 1000)  # answers far past what its socket holds
        follower = subprocess.Popen(ranktop_cmd("logs", "piped", "-f"), cwd=ROOT, env=runtime,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert read_line(follower.stdout, 30, "a line of logs -f").startswith("[")  # pushes go on
        finally:
            follower.kill()
            follower.wait()
            follower.stdout.close()
        assert [r["state"] for r in ls(runtime)] == ["running"]
        assert [f["type"] for f in _answers(lazy, 1000)] == ["snapshot"] * 1000  # every answer, once it reads
        greedy = said_hello(run["socket"])
        asks = MAX_PENDING // size * 2  # answers past the bound: this one is dropped
        threading.Thread(target=_send_quietly, args=(greedy, ask * asks), daemon=True).start()
        wait_for(lambda: ls(runtime)[0]["clients"] == 1, timeout=30, what="the greedy client dropped")
        assert len(_answers(greedy, asks)) < asks  # its connection ended before all its answers
        assert [r["state"] for r in ls(runtime)] == ["running"]
    finally:
        for conn in (lazy, greedy):
            if conn is not None:
                conn.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_name_in_the_socket_directory_that_is_not_a_socket_is_left_alone(runtime):
    directory = os.path.join(runtime["XDG_RUNTIME_DIR"], "ranktop")
    os.mkdir(directory, 0o700)
    with open(os.path.join(directory, "file.sock"), "w") as f:
        f.write("mine")
    os.symlink("/etc/hostname", os.path.join(directory, "link.sock"))
    assert ls(runtime) == []
    assert sorted(os.listdir(directory)) == ["file.sock", "link.sock"]  # not ours to remove


def test_a_detached_run_is_refused_before_it_starts_when_its_socket_would_be_unsafe_or_too_long(tmp_path):
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    root = tmp_path / "tmp" / f"ranktop-{os.geteuid()}"
    root.symlink_to(victim)  # planted by someone who can write to the shared temp directory

    def detach(*args: str) -> subprocess.CompletedProcess:
        return run_ranktop("--detach", *args, "--log-dir", str(tmp_path / "logs"), str(script), env=env)

    done = detach("--run-id", "planted")
    assert done.returncode == 2 and done.stderr.strip() == (
        f"ranktop: error: cannot serve a detached run: {root} is a symlink; ranktop will not make or serve sockets "
        "through it")
    assert list(victim.iterdir()) == [] and not (tmp_path / "logs" / "planted").exists()  # nothing made, nothing run
    # Nor are runs looked for there, and ls says why rather than that none is served.
    unlisted = f"ranktop: error: cannot list the runs served on this host: {root} is a symlink; ranktop will not"
    for args in (["ls"], ["ls", "--json"]):
        done = run_ranktop(*args, env=env)
        assert (done.returncode, done.stdout) == (2, "") and done.stderr.startswith(unlisted), done.stderr
        assert len(done.stderr.splitlines()) == 1
    done = run_ranktop("stop", "planted", env=env)
    assert done.returncode == 2 and f"(ranktop cannot look for them: {root} is a symlink;" in done.stderr
    root.unlink()
    done = detach("--run-id", "x" * 120)
    assert done.returncode == 2 and "a Unix socket allows: use a shorter --run-id" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "logs").exists()
    # A run id that starts with a dash reaches the background run as the same id.
    done = detach("--nproc-per-node", "1", "--run-id=-dash")
    assert done.returncode == 0 and done.stdout.startswith("ranktop: started -dash in the background"), done.stderr
    (run,) = ls(env)
    assert run["run_id"] == "-dash"
    assert run_ranktop("stop", env=env).returncode == 0
    wait_for(lambda: gone(run["pid"]), what="the background ranktop gone")
    (root / "sock").chmod(0o777)
    done = run_ranktop("ls", env=env)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"ranktop: error: cannot list the runs served on this host: {root / 'sock'} is open to others (mode 777)")


def test_a_runtime_directory_that_is_not_ours_is_not_used(tmp_path, monkeypatch):
    from ranktop.core import server

    runtime = tmp_path / "run-user-1000"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, 65534, 65534)  # another user's, as $XDG_RUNTIME_DIR is after sudo
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert server.socket_dir() == str(tmp_path / f"ranktop-{os.geteuid()}" / "sock")
    assert list(runtime.iterdir()) == []


def ranktop_in_tmux(runtime, args: str, after: str = "", **size: int) -> Terminal:
    """`ranktop ARGS` (with this test's socket directory) in a tmux session of its own; `after`
    runs in the shell once ranktop has returned (e.g. `; echo STATUS $?`)."""
    env = f"XDG_RUNTIME_DIR={runtime['XDG_RUNTIME_DIR']}"
    return Terminal(f"cd {ROOT} && {env} {sys.executable} -m ranktop {args}{after}", **size)


def tui_in_tmux(tmp_path, runtime, run_id: str, after: str = "") -> Terminal:
    """A 2-rank ticker run under the TUI."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    return ranktop_in_tmux(runtime, f"--tui --nproc-per-node 2 --shutdown-timeout 3 --run-id {run_id} "
                                    f"--log-dir {tmp_path / 'logs'} {script}", after)


def test_a_hangup_detaches_the_tui_and_the_run_goes_on(tmp_path, runtime):
    term = tui_in_tmux(tmp_path, runtime, "hup")
    try:
        term.wait_screen("hello from 1")
    finally:
        term.close()  # the terminal goes away: SIGHUP
    run_dir = tmp_path / "logs" / "hup"
    wait_for(lambda: any(e["event"] == "detached" for e in read_events(run_dir)), what="detached event")
    (run,) = ls(runtime)
    assert run["state"] == "running"
    # Nothing of the engine's holds the dead terminal, and a later hang-up is noted, not a stop.
    assert [os.readlink(f"/proc/{run['pid']}/fd/{fd}") for fd in (0, 1, 2)] == ["/dev/null"] * 3
    os.kill(run["pid"], signal.SIGHUP)
    wait_for(lambda: [e["action"] for e in read_events(run_dir) if e["event"] == "signal_received"] == ["ignored"],
             what="the hang-up noted")
    assert "[1]:hello from 1" in run_ranktop("logs", "hup", env=runtime).stdout
    client = ranktop_in_tmux(runtime, "attach", "; sleep 30")  # from a new terminal
    try:
        shown = client.wait_screen("hello from 1")
        assert "ticker.py" in shown and "2/2 alive" in shown
        client.press("1", "x")  # the signal picker, through the socket: SIGSTOP to rank 1
        client.wait_screen("SIGSTOP")
        client.press("7")
        client.wait_screen("paused")
    finally:
        client.close()  # the client is killed with its terminal: the run does not notice
    wait_for(lambda: ls(runtime)[0]["clients"] == 0, what="the client gone")
    assert ls(runtime)[0]["state"] == "running"
    assert run_ranktop("stop", "hup", env=runtime).returncode == 0
    wait_for(lambda: gone(run["pid"]), what="ranktop gone after the stop")
    assert [e["event"] for e in read_events(run_dir)][-1] == "run_finished"


def test_a_terminal_that_dies_without_a_hangup_signal_detaches_too(tmp_path, runtime):
    """The shell ignores SIGHUP (`trap '' HUP`), so none reaches ranktop when its terminal goes:
    the dead terminal itself must end the TUI. Textual's writer used to die of the first EIO and
    the app then waited forever on its full queue: the TUI (and an attached client) never left,
    spinning a core, and survived even `ranktop stop`."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    env = f"XDG_RUNTIME_DIR={runtime['XDG_RUNTIME_DIR']}"
    term = Terminal(f"trap '' HUP; cd {ROOT} && {env} {sys.executable} -m ranktop --tui --nproc-per-node 2 "
                    f"--shutdown-timeout 3 --run-id deaf --log-dir {tmp_path / 'logs'} {script}")
    try:
        term.wait_screen("hello from 1")
    finally:
        term.close()
    run_dir = tmp_path / "logs" / "deaf"
    wait_for(lambda: any(e["event"] == "detached" for e in read_events(run_dir)), what="detached event")
    (run,) = ls(runtime)
    assert run["state"] == "running"
    client = Terminal(f"trap '' HUP; cd {ROOT} && {env} {sys.executable} -m ranktop attach deaf", width=80, height=24)
    try:
        client.wait_screen("hello from 1")
        wait_for(lambda: ls(runtime)[0]["clients"] == 1, what="the client counted")
    finally:
        client.close()
    wait_for(lambda: ls(runtime)[0]["clients"] == 0, what="the client gone with its terminal")
    assert ls(runtime)[0]["state"] == "running"
    assert run_ranktop("stop", "deaf", env=runtime).returncode == 0
    wait_for(lambda: gone(run["pid"]), what="ranktop gone after the stop")


def test_a_tui_whose_waiting_parent_is_killed_detaches_and_gives_the_terminal_back(tmp_path, runtime):
    """The pid the shell started is SIGKILLed: its child, the TUI, detaches as on a hang-up, but
    the terminal lives on. It used to be left in the alternate screen with mouse reporting on (the
    TUI's way out went to /dev/null, as if the terminal were gone)."""
    term = tui_in_tmux(tmp_path, runtime, "orphan", "; sleep 30")
    try:
        term.wait_screen("hello from 1")
        (run,) = ls(runtime)
        os.kill(psutil.Process(run["pid"]).ppid(), signal.SIGKILL)
        wait_for(lambda: any(e["event"] == "detached" for e in read_events(tmp_path / "logs" / "orphan")),
                 what="detached event")
        # (the shell's STATUS 137 may land in the alternate screen the TUI is still leaving)
        wait_for(lambda: term._tmux("display", "-p", "-t", "t", "#{alternate_on} #{mouse_any_flag}").split()
                 == ["0", "0"], what="the terminal out of the TUI's modes")
        term.wait_screen("ranktop: run orphan goes on in the background")
        assert [r["state"] for r in ls(runtime)] == ["running"]
    finally:
        term.close()
    assert run_ranktop("stop", "orphan", env=runtime).returncode == 0
    wait_for(lambda: gone(run["pid"]), what="ranktop gone after the stop")


def test_a_tui_whose_engine_is_killed_gives_the_terminal_back(tmp_path, runtime):
    """`kill -9` of the pid `ranktop ls` shows (the TUI and its engine, the child of the pid the
    shell waits on), or the OOM killer's: the waiting parent exited 137 and left the terminal in
    the TUI's alternate screen, mouse reporting on, cursor hidden and keys unechoed. The parent
    now gives the terminal back and says what happened."""
    term = tui_in_tmux(tmp_path, runtime, "killed", "; echo STATUS $?; sleep 30")
    try:
        term.wait_screen("hello from 1")
        (run,) = ls(runtime)
        ranks = [e["pid"] for e in read_events(tmp_path / "logs" / "killed") if e["event"] == "started"]
        os.kill(run["pid"], signal.SIGKILL)
        term.wait_screen("STATUS 137")
        flags = "#{alternate_on} #{mouse_any_flag} #{mouse_sgr_flag} #{cursor_flag} #{wrap_flag}"
        assert term._tmux("display", "-p", "-t", "t", flags).split() == ["0", "0", "0", "1", "1"]
        term.wait_screen(f"ranktop: the TUI and its engine (pid {run['pid']}) were killed by SIGKILL; the orphan "
                         "guard stops the ranks")
        wait_for(lambda: all(gone(pid) for pid in ranks), what="the guard ended the ranks")
    finally:
        term.close()


def test_stop_of_a_run_whose_tui_is_on_screen_returns_once_the_run_has_ended(tmp_path, runtime):
    """The TUI that started a run keeps its engine, showing the end, until its user quits it.
    `ranktop stop` from another terminal used to wait for that engine to go: 18 s, then 'still
    there after the stop', exit 1, although the run had stopped."""
    term = tui_in_tmux(tmp_path, runtime, "onscreen", "; echo STATUS $?; sleep 30")
    try:
        term.wait_screen("hello from 1")
        stopped = run_ranktop("stop", "onscreen", env=runtime)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout == "ranktop: stopped onscreen (the TUI that started it shows the end until it is quit)\n"
        events = read_events(tmp_path / "logs" / "onscreen")
        assert [e["state"] for e in events if e["event"] == "run_finished"] == ["STOPPED"]
        term.wait_screen("STOPPED")
        again = run_ranktop("stop", "onscreen", env=runtime)  # over already, the TUI still up: said at once
        assert (again.returncode, again.stdout) == (0, "ranktop: onscreen had already ended (stopped); the TUI "
                                                       "that started it shows the end until it is quit\n"), again.stderr
        term.press("q")
        term.wait_screen("STATUS 130")
    finally:
        term.close()
    assert ls(runtime) == []


@pytest.mark.parametrize("twice", [False, True])
def test_a_tui_that_fails_leaves_its_run_going_in_the_background(tmp_path, runtime, twice):
    """A bug in the TUI (tests/failing_tui.py: `z` raises) ends the TUI, not the training run it
    showed: it goes on detached, as after q then d, and the shell gets its prompt back with 1
    (it stopped every rank: a crash of the screen ended the run). So does a second error, as
    Textual closes, that comes out of its `App.run()` (`twice`): it was a raw traceback, and the
    run stopped by the exit."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    fail = "RANKTOP_TEST_FAIL_AS_IT_CLOSES=1 " if twice else ""
    term = Terminal(f"cd {ROOT} && XDG_RUNTIME_DIR={runtime['XDG_RUNTIME_DIR']} {fail}{sys.executable} "
                    f"tests/failing_tui.py --tui --nproc-per-node 2 --run-id bug --log-dir {tmp_path / 'logs'} "
                    f"{script}; echo PROMPT BACK $?; sleep 60")
    run_dir = tmp_path / "logs" / "bug"
    try:
        term.wait_screen("hello from 1")
        term.press("z")
        shown = " ".join(term.wait_screen("PROMPT BACK 1").split())
        assert "ranktop: the TUI failed (RuntimeError: a bug at z; its traceback is above): the run goes on" in shown
        assert "run bug goes on in the background" in shown and "ranktop attach bug" in shown
        assert ("RuntimeError: a bug as it closed" in shown) == twice
        assert [e["reason"] for e in read_events(run_dir) if e["event"] == "detached"] == ["failed"]
        (run,) = ls(runtime)
        assert run["state"] == "running"
        ranks = [e["pid"] for e in read_events(run_dir) if e["event"] == "started"]
        assert len(ranks) == 2 and not [e for e in read_events(run_dir) if e["event"] == "exited"]
        for pid in ranks:
            os.kill(pid, 0)
    finally:
        term.close()
    assert run_ranktop("stop", "bug", env=runtime).returncode == 0
    wait_for(lambda: gone(run["pid"]), what="ranktop gone after the stop")
    assert [e["event"] for e in read_events(run_dir)][-1] == "run_finished"


def _status_field(pid: int, name: str) -> str | None:
    with open(f"/proc/{pid}/status") as status:
        return next((line.split()[1] for line in status if line.startswith(f"{name}:")), None)


def test_q_detach_gives_the_prompt_back_and_the_run_goes_on(tmp_path, runtime, monkeypatch):
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs

    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
    term = tui_in_tmux(tmp_path, runtime, "qd", "; echo PROMPT BACK $?; sleep 60")
    try:
        term.wait_screen("hello from 1")
        term.press("q")
        term.wait_screen("Detach (d)")
        term.press("d")
        shown = term.wait_screen("PROMPT BACK 0")
        assert "run qd goes on in the background" in shown and "ranktop attach qd" in shown
        run_dir = tmp_path / "logs" / "qd"
        wait_for(lambda: any(e.get("reason") == "key" for e in read_events(run_dir) if e["event"] == "detached"),
                 what="detached event")
        (run,) = ls(runtime)
        assert run["state"] == "running"
        os.kill(run["pid"], 0)  # the engine lives on, in a session of its own
        assert os.getsid(run["pid"]) == run["pid"]
        # A rank started after the detach hears a hang-up as any process does (none is ignored).
        engine = RemoteEngine(served_runs()[0].path)
        try:
            assert engine.submit(cmd.RestartRank(0)).ok
        finally:
            engine.close()
        (again,) = wait_for(lambda: [e["pid"] for e in read_events(run_dir) if e["event"] == "started"][2:],
                            what="rank 0 started again")
        ignored = wait_for(lambda: _status_field(again, "SigIgn"), what="the new rank's signal mask")
        assert not int(ignored, 16) & (1 << (signal.SIGHUP - 1))
    finally:
        term.close()
    assert run_ranktop("stop", "qd", env=runtime).returncode == 0
    wait_for(lambda: gone(run["pid"]), what="ranktop gone after the stop")
    assert [e["event"] for e in read_events(run_dir)][-1] == "run_finished"


def test_a_signal_to_the_tuis_own_pid_reaches_the_run_and_its_status_comes_back(tmp_path, runtime):
    """The TUI runs in a child of the process the shell started (so that q can detach): a SIGTERM
    to that pid still stops the run with the grace, and $? is the run's."""
    term = tui_in_tmux(tmp_path, runtime, "term", "; echo STATUS $?; sleep 60")
    try:
        term.wait_screen("hello from 1")
        (run,) = ls(runtime)
        shell_started = psutil.Process(run["pid"]).ppid()
        assert "ranktop" in " ".join(psutil.Process(shell_started).cmdline())
        os.kill(shell_started, signal.SIGTERM)
        term.wait_screen("STATUS 143")
        wait_for(lambda: gone(run["pid"]), what="the engine gone")
    finally:
        term.close()
    exits = [e for e in read_events(tmp_path / "logs" / "term") if e["event"] == "exited"]
    assert [e["signal"] for e in exits] == ["SIGTERM", "SIGTERM"]


def test_attach_shows_the_run_acts_on_it_and_leaves_it_running(tmp_path, runtime):
    proc = start_headless(tmp_path, runtime, "att")
    term = None
    try:
        wait_for(lambda: ls(runtime), what="the run listed")
        term = ranktop_in_tmux(runtime, "attach at", "; sleep 30", width=120, height=30)
        term.wait_screen("hello from 1", "ticker.py", "world 2", "hello from 0")
        term.press("1", "k", "k")  # through the socket, confirmed as in the local TUI
        term.wait_screen("killed SIGKILL")
        term.press("q")
        term.wait_screen("Detach (d)")
        term.press("d")
        term.wait_screen("ranktop: left att; it runs on")
        assert [r["state"] for r in ls(runtime)] == ["running"]
        assert any(e["event"] == "exited" and e["local_rank"] == 1 for e in read_events(tmp_path / "logs" / "att"))
    finally:
        if term is not None:
            term.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


IGNORES_TERM = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n"
                "while True:\n    time.sleep(0.1)\n")


def test_an_attached_tui_counts_down_to_the_sigkill_of_a_stop(tmp_path, runtime):
    """The engine's kill deadlines go out with its snapshots: an attached TUI's header counts
    the grace down as the local one does (the ranks ignore SIGTERM: only SIGKILL ends them)."""
    proc = start_headless(tmp_path, runtime, "graced", IGNORES_TERM, grace=30)
    term = None
    try:
        wait_for(lambda: ls(runtime), what="the run listed")
        term = ranktop_in_tmux(runtime, "attach graced", "; sleep 30", width=80, height=24)
        term.wait_screen(" 1/1 ", "up")
        term.press("K")
        term.wait_screen("Press K again")
        term.press("K")

        def countdown() -> int | None:
            found = re.search(r"SIGKILL in (\d+)s", term.screen())
            return None if found is None else int(found[1])

        first = wait_for(countdown, what="the countdown in the attached TUI")
        assert first <= 30
        wait_for(lambda: (left := countdown()) is not None and left < first, what="the countdown going down")
    finally:
        if term is not None:
            term.close()
        proc.send_signal(signal.SIGINT)  # a second SIGINT kills at once: no waiting out the grace
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def test_detach_says_how_to_stop_a_run_that_is_not_served_in_time(tmp_path, monkeypatch, capsys):
    """A background run still starting when --detach stops waiting (its rendezvous store out of
    reach, say) is not listed yet: the line says so and how to stop it (it said `ranktop ls`)."""
    from ranktop.tui import cli

    monkeypatch.setattr(cli, "SERVE_WAIT_SECONDS", 0.5)
    child = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        assert cli._wait_served(child, "slow", str(tmp_path / "slow.sock")) == 1
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    assert capsys.readouterr().err == (
        f"ranktop: slow (pid {child.pid}) is not served after 0.5 s: it is still starting, and ranktop ls lists "
        f"it once it is (a rendezvous store out of reach is waited for until its time-out); kill {child.pid} "
        "stops it\n")


def test_ctrl_c_while_detach_waits_ends_the_wait_with_a_line_and_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C while --detach waits for its background run to be served (a store out of reach,
    say) ends the wait, not the run, which is in a session of its own: the line says so and how
    to stop it. It was a KeyboardInterrupt traceback, and the run went on unnamed."""
    from ranktop.tui import cli

    def ctrl_c(*_args):  # the wait is under way: a real SIGINT lands in it
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(cli, "_served_name", ctrl_c)
    child = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        try:
            status = cli._wait_served(child, "slow", str(tmp_path / "slow.sock"))
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C while --detach waited was a traceback")
        assert child.poll() is None  # the background run goes on
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    assert status == 130
    assert capsys.readouterr().err == (
        f"\nranktop: slow (pid {child.pid}) goes on starting in the background, as Ctrl-C ended only the wait "
        f"for it: ranktop ls lists it once it is served; kill {child.pid} stops it\n")


def test_detach_starts_the_run_in_the_background_and_returns(tmp_path, runtime):
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    done = run_ranktop("--detach", "--nproc-per-node", "2", "--run-id", "bg", "--log-dir", str(tmp_path / "logs"),
                       str(script), env=runtime)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ranktop: started bg in the background (pid ")
    (run,) = ls(runtime)
    try:
        assert run["run_id"] == "bg" and run["state"] == "running"
        wait_for(lambda: "[1]:hello from 1" in run_ranktop("logs", "bg", env=runtime).stdout, what="its output")
        # Started to outlive its terminal: a hang-up is noted, and the run goes on.
        os.kill(run["pid"], signal.SIGHUP)
        run_dir = tmp_path / "logs" / "bg"
        wait_for(lambda: [e["action"] for e in read_events(run_dir) if e["event"] == "signal_received"] == ["ignored"],
                 what="the hang-up noted")
        assert [r["state"] for r in ls(runtime)] == ["running"]
        # The same id again (its run directory elsewhere) is refused, nothing started: this run
        # answered on its socket and was said to be the new one, started (`stop bg` stopped it).
        again = run_ranktop("--detach", "--run-id", "bg", "--log-dir", str(tmp_path / "again"), str(script),
                            env=runtime)
        assert (again.returncode, again.stdout) == (2, "")
        assert again.stderr == (f"ranktop: error: cannot serve a detached run: {run['socket']} is in use: another run "
                                "has this run id; pick another --run-id\n")
        assert not (tmp_path / "again").exists() and [r["pid"] for r in ls(runtime)] == [run["pid"]]
        # What --detach waits for is its own child serving the socket, not any engine there.
        from ranktop.tui import cli
        assert cli._served_now(run["socket"], run["pid"]) and not cli._served_now(run["socket"], run["pid"] + 1)
    finally:
        assert run_ranktop("stop", "bg", env=runtime).returncode == 0
        wait_for(lambda: gone(run["pid"]), what="the background ranktop gone")
    # A run over before it could be reached (no lingering) succeeded: said so, exit 0, not an error.
    # Its ranks get the colour hints, as a TUI run's do: attach shows their output (it came plain).
    plain_env = {k: v for k, v in runtime.items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS")}
    quick = run_ranktop("--detach", "--linger", "0", "--run-id", "quick", "--log-dir", str(tmp_path / "logs"),
                        "--no-python", "env", env={**plain_env, "TERM": "xterm"})
    assert (quick.returncode, quick.stderr) == (0, ""), quick.stderr
    assert quick.stdout.startswith("ranktop: started quick in the background") or quick.stdout == (
        "ranktop: quick ran in the background and has already ended (exit 0)\n")
    wait_for(lambda: ls(runtime) == [], what="the quick run's engine gone")
    rank_env = (tmp_path / "logs" / "quick" / "attempt_0" / "0" / "stdout.log").read_text().splitlines()
    assert "FORCE_COLOR=1" in rank_env and "COLUMNS=120" in rank_env
    bad = run_ranktop("--detach", "--nproc-per-node", "0", "x.py", env=runtime)
    assert bad.returncode == 2 and bad.stderr.startswith("ranktop: error: ") and ls(runtime) == []


def test_the_commands_a_detached_run_prints_reach_a_run_whose_id_starts_with_a_dash(tmp_path, runtime):
    """README: `--run-id=-x` reaches the background run as the same id. The started line then said
    `ranktop attach -x | ranktop logs -x -f | ranktop stop -x`, and each was an unknown option to
    the shell that typed it (exit 2). The id comes after `--`, quoted for the shell (it may hold a
    space), so each command works as printed; so does the one `attach` names without a terminal."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    done = run_ranktop("--detach", "--run-id=-my run", "--log-dir", str(tmp_path / "logs"), str(script), env=runtime)
    assert done.returncode == 0, done.stderr
    (run,) = ls(runtime)
    try:
        attach, logs, stop = [line.split(":", 1)[1].strip() for line in done.stdout.splitlines()[1:]]
        assert (attach, logs, stop) == ("ranktop attach -- '-my run'", "ranktop logs -f -- '-my run'",
                                        "ranktop stop -- '-my run'")
        no_terminal = run_ranktop(*shlex.split(attach)[1:], stdin=subprocess.DEVNULL, env=runtime)
        assert no_terminal.returncode == 2 and no_terminal.stderr.endswith(
            f"(stdin is not a terminal): {logs} prints a run's output instead\n"), no_terminal.stderr
        follow = subprocess.Popen(ranktop_cmd(*shlex.split(logs)[1:]), stdout=subprocess.PIPE, text=True,
                                  cwd=ROOT, env=runtime)
        try:
            assert follow.stdout.readline() == "[0]:hello from 0\n"
            stopped = run_ranktop(*shlex.split(stop)[1:], env=runtime)
            assert (stopped.returncode, stopped.stdout) == (0, "ranktop: stopped -my run\n"), stopped.stderr
            assert follow.wait(timeout=30) == 0
        finally:
            stop_process(follow)
            follow.stdout.close()
    finally:
        run_ranktop("stop", "--", "-my run", env=runtime)
        wait_for(lambda: gone(run["pid"]), what="the background ranktop gone")


@pytest.mark.parametrize("named", [("--run-id", "mine"), ("--run-id=mine",), ()], ids=["two-words", "one-word", "chosen"])
def test_a_detached_runs_command_line_names_its_run_once(tmp_path, runtime, named):
    """`ps` showed `--run-id` twice in a --detach run's command line (the user's, and the one
    ranktop added). It is there once: the user's as typed, else the one chosen."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    done = run_ranktop("--detach", *named, "--log-dir", str(tmp_path / "logs"), str(script), env=runtime)
    assert done.returncode == 0, done.stderr
    (run,) = ls(runtime)
    try:
        assert done.stdout.startswith(f"ranktop: started {run['run_id']} in the background (pid {run['pid']})")
        assert f"ranktop attach {run['run_id']}" in done.stdout
        if named:
            assert run["run_id"] == "mine" and run["log_dir"] == str(tmp_path / "logs" / "mine")
        line = psutil.Process(run["pid"]).cmdline()
        given = [a for a in line if a.startswith("--run-id")]
        assert given == (list(named[:1]) if named else [f"--run-id={run['run_id']}"]), line
    finally:
        assert run_ranktop("stop", run["run_id"], env=runtime).returncode == 0
        wait_for(lambda: gone(run["pid"]), what="the background ranktop gone")


def test_a_detached_run_samples_the_ranks_stats_for_attach(tmp_path, runtime, monkeypatch):
    """A --detach run is watched through `ranktop attach`: it samples cpu, rss and GPUs as the
    TUI's engine does (and has its 60 s stall clock). It used to run with headless's defaults:
    attach showed no cpu, no memory, no GPU line, and a hung rank never showed stalled."""
    from ranktop.core.client import RemoteEngine, served_runs

    script = tmp_path / "quiet.py"
    script.write_text("import time\nprint('once', flush=True)\ntime.sleep(600)\n")
    done = run_ranktop("--detach", "--nproc-per-node", "2", "--run-id", "watched", "--log-dir",
                       str(tmp_path / "logs"), str(script), env={**runtime, "RANKTOP_FAKE_GPUS": "0"})
    assert done.returncode == 0, done.stderr
    (run,) = ls(runtime)
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
    engine = RemoteEngine(served_runs()[0].path)
    try:
        snap = wait_for(lambda: (s := engine.snapshot()).gpu_status
                        and all(r.rss and r.cpu_percent is not None for r in s.ranks) and s,
                        what="the ranks' cpu and memory sampled")
        assert snap.gpu_status == "no GPU"
    finally:
        engine.close()
        assert run_ranktop("stop", "watched", env=runtime).returncode == 0
        wait_for(lambda: gone(run["pid"]), what="the background ranktop gone")


def test_a_detached_run_lingers_after_its_end_and_attach_shows_its_final_view(tmp_path, runtime):
    script = tmp_path / "quick.py"
    script.write_text("import os\nprint('done on', os.environ['RANK'])\n")
    done = run_ranktop("--detach", "--linger", "60", "--nproc-per-node", "2", "--run-id", "end",
                       "--log-dir", str(tmp_path / "logs"), str(script), env=runtime)
    assert done.returncode == 0, done.stderr
    (run,) = wait_for(lambda: [r for r in ls(runtime) if r["state"] == "succeeded"], what="the ended run lingering")
    assert "[1]:done on 1" in run_ranktop("logs", "end", env=runtime).stdout  # still served after the end
    left = run_ranktop("stop", "end", env=runtime)
    # The stop let the lingering engine go, and says the run was over, with how it ended.
    assert left.returncode == 0 and left.stdout.strip() == "ranktop: end had already ended (succeeded); its engine has left"
    assert ls(runtime) == []  # no longer served once stop returned
    wait_for(lambda: gone(run["pid"]), what="the engine gone")
    final = json.loads((tmp_path / "logs" / "end" / "final.json").read_text())
    assert final["ended"] and final["exit_status"] == 0 and final["state"] == "succeeded"
    term = ranktop_in_tmux(runtime, f"attach {tmp_path / 'logs' / 'end'}", "; echo STATUS $?; sleep 30",
                           width=120, height=30)
    try:
        term.wait_screen("done on 1", "DONE: all ranks exited 0", "quick.py")  # the final view, its panel too
        term.press("q")  # leaving the final view leaves the end report in the terminal; the run's status
        screen = term.wait_screen("ranktop: quick.py succeeded: all ranks exited 0; logs in", "STATUS 0")
        assert str(tmp_path / "logs" / "end") in screen.replace("\n", "")
    finally:
        term.close()


def test_ls_says_how_long_ago_a_lingering_run_ended(tmp_path, runtime):
    """AGE was the time since the start, for an ended run too, its engine lingering: someone back
    after it could not tell how long ago it ended (nor so how soon its engine leaves). It says
    `ended 0m03s ago` (`--json`: `ended_ago`, null while the run runs); a running run's AGE is
    still the time since its start."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    for run_id, entry in (("ticking", str(script)), ("ended", "--no-python")):
        args = ("true",) if entry == "--no-python" else ()
        done = run_ranktop("--detach", "--linger", "60", "--run-id", run_id, "--log-dir", str(tmp_path / "logs"),
                           entry, *args, env=runtime)
        assert done.returncode == 0, done.stderr
    runs = wait_for(lambda: {r["run_id"]: r for r in ls(runtime) if r["state"] in ("running", "succeeded")}.keys()
                    == {"ticking", "ended"} and {r["run_id"]: r for r in ls(runtime)}, what="one run running, one ended")
    try:
        assert runs["ended"]["ended_ago"] is not None and re.fullmatch(r"\d+m\d\ds", runs["ended"]["ended_ago"])
        assert runs["ticking"]["ended_ago"] is None and runs["ticking"]["age"] is not None
        table = run_ranktop("ls", env=runtime).stdout
        header, *rows = table.splitlines()
        ages = {row.split()[0]: row[header.index("AGE"):header.index("CLIENTS")].strip() for row in rows}
        assert re.fullmatch(r"ended \d+m\d\ds ago", ages["ended"]) and re.fullmatch(r"\d+m\d\ds", ages["ticking"]), table
    finally:
        for run_id in runs:
            run_ranktop("stop", run_id, env=runtime)
    wait_for(lambda: all(gone(run["pid"]) for run in runs.values()), timeout=15, what="both engines gone")


def test_the_attached_header_drops_whole_parts_at_80_columns_rather_than_cut_one(tmp_path, runtime):
    """At 80 columns the header was cut mid-word (`no` of `no GPU`, `4/4` of `4/4 alive`). Its
    parts that do not fit go whole, least useful first (the node, the world, the log dir, the
    restarts left, which first say `(2 left)`, the GPU status, the attempt, the clock, the alive
    count); at 160 all show, whole."""
    env = {**runtime, "RANKTOP_FAKE_GPUS": "0"}  # NVML with no device: the engine's `no GPU`
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    done = run_ranktop("--detach", "--nproc-per-node", "2", "--max-restarts", "2", "--run-id", "narrow",
                       "--log-dir", str(tmp_path / "logs"), str(script), env=env)
    assert done.returncode == 0, done.stderr
    (run,) = ls(runtime)
    term = ranktop_in_tmux(runtime, "attach narrow", width=80, height=24)
    try:
        header = wait_for(lambda: re.search(r"2/2 alive", line := term.screen().splitlines()[0]) and line,
                          what="the header at 80 columns")
        assert re.fullmatch(r" ranktop  ticker\.py  running   attempt_0 \(2 left\)  \d+:\d\d:\d\d  2/2 alive  no GPU *",
                            header), header
        term.resize(160, 48)
        wide = wait_for(lambda: "logs" in (line := term.screen().splitlines()[0]) and line, what="the header at 160")
        assert re.fullmatch(r" ranktop  ticker\.py  running   attempt_0 \(2 restarts left\)  world 2  node 0/1  "
                            r"\d+:\d\d:\d\d  2/2 alive  no GPU  logs \S*/logs/narrow *", wide), wide
    finally:
        term.close()
        run_ranktop("stop", "narrow", env=runtime)
    wait_for(lambda: gone(run["pid"]), what="the engine gone")


def test_a_detached_engine_stopped_by_a_signal_does_not_linger(tmp_path, runtime):
    """A SIGTERM to a detached engine stops its run, and the engine leaves; one lingering after
    its run's end leaves on SIGTERM too (SIGQUIT here). It used to stay its 10 minutes, as if it
    ignored it. A SIGHUP or SIGUSR1 leaves it lingering, as it left the run going."""
    script = tmp_path / "ticker.py"
    script.write_text("import time\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.2)\n")
    for run_id, entry in (("ticking", str(script)), ("ended", "--no-python")):
        args = ("true",) if entry == "--no-python" else ()
        done = run_ranktop("--detach", "--run-id", run_id, "--log-dir", str(tmp_path / "logs"), entry, *args,
                           env=runtime)
        assert done.returncode == 0, done.stderr
    runs = wait_for(lambda: {r["run_id"]: r for r in ls(runtime)}.keys() == {"ticking", "ended"}
                    and {r["run_id"]: r for r in ls(runtime)}, what="both runs served")
    wait_for(lambda: {r["run_id"]: r["state"] for r in ls(runtime)}["ended"] == "succeeded", what="the end")
    # A hang-up is not a stop, nor is Slurm's SIGUSR1: the lingering engine stays (their default
    # actions killed it, the socket left behind); an ls after each is answered once it has landed.
    for sig in (signal.SIGHUP, signal.SIGUSR1):
        os.kill(runs["ended"]["pid"], sig)
        assert [(r["pid"], r["state"]) for r in ls(runtime) if r["run_id"] == "ended"] == [
            (runs["ended"]["pid"], "succeeded")], sig.name
    for run, sig in ((runs["ticking"], signal.SIGTERM), (runs["ended"], signal.SIGQUIT)):
        os.kill(run["pid"], sig)
    wait_for(lambda: all(gone(run["pid"]) for run in runs.values()), timeout=15, what="both engines gone")
    assert not any(os.path.exists(run["socket"]) for run in runs.values())  # each left, not killed: ls cleared none
    assert ls(runtime) == []
    events = read_events(tmp_path / "logs" / "ticking")
    assert [e["state"] for e in events if e["event"] == "run_finished"] == ["STOPPED"]


@pytest.mark.parametrize(("content", "why"), [
    (b'{"name": "x"', "JSONDecodeError"),  # truncated
    (b'[1, 2]', "the top is [1, 2], expected an object"),  # another shape
    (b'{"name": "x"}', "role is missing"),  # fields missing
    (b'[' * 100_000, "RecursionError"),
])
def test_a_bad_final_view_is_one_line(tmp_path, runtime, content, why):
    run_dir = tmp_path / "ended"
    run_dir.mkdir()
    (run_dir / "final.json").write_bytes(content)
    done = run_ranktop("attach", str(run_dir), env=runtime)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith(f"ranktop: error: bad final view {run_dir / 'final.json'}: {why}")


# Rank 1 fails once rank 0 has said its line (else rank 0 might be stopped before it could).
FAIL_ON_1 = """
import os, sys, time
done = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0-said-it")
print("out of", os.environ["RANK"], flush=True)
if os.environ["RANK"] == "0":
    open(done, "w").close()
    sys.exit(0)
deadline = time.monotonic() + 20
while not os.path.exists(done) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(3)
"""
SECRET = "SECRET-LINE-42"


def ended_run(tmp_path, env) -> Path:
    """A real 2-rank run that has ended (rank 1 exited 3): its directory, with final.json and the logs."""
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_1)
    done = run_ranktop("--headless", "--nproc-per-node", "2", "--run-id", "ended", "--log-dir", str(tmp_path / "logs"),
                       str(script), env=env)
    assert done.returncode == 1, done.stderr
    (tmp_path / "secret.txt").write_text(SECRET + "\n")  # outside the run directory: never shown
    return tmp_path / "logs" / "ended"


def test_attach_to_a_failed_run_lingering_after_its_end_shows_the_root_cause(tmp_path, runtime):
    """Served by its lingering engine (not read from final.json): the states, the ROOT CAUSE
    panel, and on leaving, the end report with the root cause in the terminal. attach exits with
    the run's status, 1, there and in the final view once the engine has left (that was 0)."""
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_1)
    done = run_ranktop("--detach", "--linger", "60", "--nproc-per-node", "2", "--run-id", "broke",
                       "--log-dir", str(tmp_path / "logs"), str(script), env=runtime)
    assert done.returncode == 0, done.stderr
    (run,) = wait_for(lambda: [r for r in ls(runtime) if r["state"] == "failed"], what="the failed run lingering")
    term = ranktop_in_tmux(runtime, "attach broke", "; echo STATUS $?; sleep 30", width=120, height=30)
    try:
        term.wait_screen("ROOT CAUSE", "rank 1 exit code 3", "out of 1", "fail.py")
        term.press("q")
        term.wait_screen("root cause: rank 1 (local rank 1, pid", "STATUS 1")
    finally:
        term.close()
    assert run_ranktop("stop", "broke", env=runtime).returncode == 0
    wait_for(lambda: gone(run["pid"]), what="the lingering engine gone")
    term = ranktop_in_tmux(runtime, f"attach {tmp_path / 'logs' / 'broke'}", "; echo STATUS $?; sleep 30",
                           width=120, height=30)
    try:
        term.wait_screen("ROOT CAUSE", "rank 1 exit code 3", "fail.py")  # the final view, from final.json
        term.press("q")
        term.wait_screen("root cause: rank 1 (local rank 1, pid", "STATUS 1")
    finally:
        term.close()


def edit_final(run_dir: Path, **edits) -> None:
    """Set fields of final.json: `ranks__1__state="zombie"` sets final["ranks"][1]["state"]."""
    final = json.loads((run_dir / "final.json").read_text())
    for name, value in edits.items():
        *path, last = [int(k) if k.isdigit() else k for k in name.split("__")]
        target = final
        for key in path:
            target = target[key]
        target[last] = value
    (run_dir / "final.json").write_text(json.dumps(final))


@pytest.mark.parametrize(("edits", "shown", "report"), [
    # A time no clock shows, a string for a time, a bad pid, a log outside the run directory:
    # the rest is shown, those are unknown.
    ({"root_cause__timestamp": 1e300, "started_at": "yesterday", "ranks__1__pid": "x", "gpu_status": 5,
      "ranks__1__cpu_percent": float("nan"), "ranks__0__stdout_log": "SECRET"},
     "exit code 3 at an unknown time",
     "root cause: rank 1 (local rank 1, pid PID) exited with code 3 at an unknown time"),
    # (a rank had failed on its own before the stop: the report names it under the stop's words)
    ({"stop_signal": 99999}, "exit code 3", "fail.py failed in attempt_0 (1 of 1 attempts), then was stopped by signal 99999"),
])
def test_a_final_view_with_bad_fields_shows_the_rest(tmp_path, runtime, edits, shown, report):
    run_dir = ended_run(tmp_path, runtime)
    pid = json.loads((run_dir / "final.json").read_text())["root_cause"]["pid"]
    if edits.get("ranks__0__stdout_log") == "SECRET":
        edits["ranks__0__stdout_log"] = str(tmp_path / "secret.txt")
    edit_final(run_dir, **edits)
    term = ranktop_in_tmux(runtime, f"attach {run_dir}", "; sleep 30", width=120, height=30)
    try:
        screen = term.wait_screen(shown, "out of 1", "fail.py")
        assert SECRET not in screen and "Traceback" not in screen
        term.press("q")  # the end report after the final view
        assert "Traceback" not in term.wait_screen(report.replace("PID", str(pid)))
    finally:
        term.close()


@pytest.mark.parametrize(("edits", "why"), [
    ({"ranks__1__state": "zombie"},
     'ranks[1].state is "zombie", expected one of starting, running, stalled, stopping, exited, failed, killed, '
     'unreapable'),
    ({"ranks__1__state": "unknown"},  # (what only a client says, of a run whose engine it lost)
     'ranks[1].state is "unknown", expected one of starting, running, stalled, stopping, exited, failed, killed, '
     'unreapable'),
    ({"world_size": "two"}, 'world_size is "two", expected a whole number'),
    ({"root_cause__exitcode": 3.5}, "root_cause.exitcode is 3.5, expected a whole number"),
    ({"ranks__0__local_rank": 1}, "ranks[0].local_rank is 1, expected 0"),
    ({"local_world_size": 10**6}, "local_world_size is 1000000, expected 1 to 4096"),
    ({"ranks": 5}, "ranks is 5, expected a list"),
    ({"root_cause__message": ["x"]}, 'root_cause.message is ["x"], expected text'),
])
def test_a_final_view_no_run_could_have_left_is_one_line(tmp_path, runtime, edits, why):
    run_dir = ended_run(tmp_path, runtime)
    edit_final(run_dir, **edits)
    done = run_ranktop("attach", str(run_dir), env=runtime)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"ranktop: error: bad final view {run_dir / 'final.json'}: {why}\n"


def test_a_whole_number_too_large_for_a_time_in_a_final_view_is_an_unknown_time(tmp_path, runtime):
    """Found by fuzzing final.json: 10**400 where a time goes stopped `ranktop logs DIR` with
    OverflowError (int too large to convert to float); it is a time no clock shows, as 1e300 is."""
    from ranktop.core.client import FinalEngine

    run_dir = ended_run(tmp_path, runtime)
    edit_final(run_dir, started_at=10**400, root_cause__timestamp=-(10**400), ranks__1__ended_at=10**400)
    snap = FinalEngine(str(run_dir / "final.json")).snapshot()
    assert math.isnan(snap.root_cause.timestamp) and snap.started_at != snap.started_at
    done = run_ranktop("logs", str(run_dir), env=runtime)
    assert (done.returncode, done.stdout.count("out of 1")) == (0, 1), done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1


def plant_rank_dir_link(tmp_path, run_dir) -> None:
    """attempt_0/1 becomes a symlink to a directory outside whose stdout.log is the secret."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "stdout.log").write_text(SECRET + "\n")
    (run_dir / "attempt_0" / "1").rename(tmp_path / "moved")
    (run_dir / "attempt_0" / "1").symlink_to(outside)


@pytest.mark.parametrize("lead_out", [
    lambda tmp_path, run_dir: edit_final(run_dir, ranks__1__stdout_log=str(tmp_path / "secret.txt")),
    lambda tmp_path, run_dir: edit_final(run_dir, ranks__1__stdout_log="attempt_0/../../../secret.txt"),
    lambda tmp_path, run_dir: edit_final(run_dir, ranks__1__stdout_log="../secret.txt", log_dir=None,
                                         ranks__0__stdout_log="attempt_0/0/stdout.log"),
    lambda tmp_path, run_dir: edit_final(run_dir, ranks__1__stdout_log=str(tmp_path / "secret.txt"), log_dir="/",
                                         ranks__0__stdout_log="attempt_0/0/stdout.log"),
    lambda tmp_path, run_dir: (run_dir / "attempt_0" / "1" / "stdout.log").unlink()
    or (run_dir / "attempt_0" / "1" / "stdout.log").symlink_to(tmp_path / "secret.txt"),
    plant_rank_dir_link,
], ids=["absolute", "dot-dot", "relative-up", "recorded-root", "symlinked-log", "symlinked-rank-dir"])
def test_the_final_view_reads_no_log_outside_its_run_directory(tmp_path, runtime, lead_out):
    from ranktop.core.client import FinalEngine

    run_dir = ended_run(tmp_path, runtime)
    lead_out(tmp_path, run_dir)
    engine = FinalEngine(str(run_dir / "final.json"))
    try:
        snap = engine.snapshot()
        assert snap.log_dir == str(run_dir)  # where final.json lies, whatever it says
        assert snap.ranks[1].stdout_log is None and engine.output_since(1, None)[1] == []
        # The other rank's log, where final.json says (in the run directory), is read.
        assert snap.ranks[0].stdout_log == str(run_dir / "attempt_0" / "0" / "stdout.log")
        assert engine.output_since(0, None)[1] == [b"out of 0"]
    finally:
        engine.close()


def test_the_final_view_offers_no_key_that_acts_on_ranks(tmp_path, runtime):
    """Nothing is left to act on: its footer lists none of those keys, and k says why at once."""
    from conftest import screen_rows
    from ranktop.core.client import FinalEngine
    from test_tui_app import notes
    from test_tui_fake import drive, shown_footer_keys

    engine = FinalEngine(str(ended_run(tmp_path, runtime) / "final.json"))

    async def body(app, pilot):
        await until(pilot, lambda: shown_footer_keys(app), what="the footer")
        shown = {key.description for key in shown_footer_keys(app)}
        assert "Quit" in shown and not shown & {"Signal…", "Kill rank", "Stop group", "Restart rank"}, shown
        assert "read-only view" in screen_rows(app)[0]
        await pilot.press("k")
        await until(pilot, lambda: "the group has ended" in notes(app), what="k's answer")
        assert "again to confirm" not in notes(app)

    drive(engine, body)


def test_the_final_views_stack_view_shows_the_last_dump_saved_or_says_there_is_none(tmp_path, runtime):
    """`d` in a final view (its engine gone) opened an empty stack view that answered `the run has
    ended: this is its final view, read-only` and offered `g Dump again`, `t` and `n`, which did
    nothing. It shows the last dump saved during the run, without g and n; with none, one line."""
    from ranktop.core.client import FinalEngine
    from ranktop.tui.stacks_view import StacksScreen
    from test_tui_fake import drive, shown_footer_keys

    def stack_view(engine, expect: str) -> tuple[str, set[str], set[str]]:
        seen = {}

        async def body(app, pilot):
            await pilot.press("d")
            await until(pilot, lambda: isinstance(app.screen, StacksScreen)
                        and expect in str(app.screen.query_one("#stacks-summary").render()), what="the stack view")
            await pilot.pause(0.2)  # (the footer settles)
            seen["summary"] = str(app.screen.query_one("#stacks-summary").render())
            seen["footer"] = {key.description for key in shown_footer_keys(app)}
            seen["palette"] = {c.title for c in app.get_system_commands(app.screen)}

        drive(engine, body)
        return seen["summary"], seen["footer"], seen["palette"]

    (tmp_path / "a").mkdir()
    with lingering(tmp_path / "a", runtime, "dumped") as (_run, go):
        assert run_ranktop("stacks", "dumped", env=runtime).returncode == 0  # saved under stacks/
        go.touch()
    summary, footer, palette = stack_view(FinalEngine(str(tmp_path / "a" / "logs" / "dumped" / "final.json")),
                                          "its last dump")
    assert "the run has ended: its last dump, taken at" in summary and "2 of 2 ranks dumped" in summary
    assert "saved: " + str(tmp_path / "a" / "logs" / "dumped" / "stacks") in summary
    assert "Other threads" in footer and not footer & {"Dump again", "SIGUSR1 fallback"}, footer
    assert not palette & {"Dump again", "C frames", "Python frames"}, palette

    summary, footer, palette = stack_view(FinalEngine(str(ended_run(tmp_path, runtime) / "final.json")), "no stacks")
    assert summary == "no stacks: the run has ended, and no stack dump was saved during it"
    assert footer == {"Close", "Help"} and not palette & {"Dump again", "Other threads", "C frames"}, (footer, palette)


def test_a_view_whose_engine_was_lost_shows_the_last_dump_saved_and_offers_no_new_one(tmp_path, runtime, monkeypatch):
    """Once the engine was lost (SIGKILLed, no final.json), `d` still asked it for a dump, which
    failed in a line, and the stack view offered `g` and `n` to try again. As in a final view, the
    last dump saved during the run is shown, and no new one is offered."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs

    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
    proc = start_headless(tmp_path, runtime, "lostdump")
    try:
        wait_for(lambda: ls(runtime), what="the run listed")
        assert run_ranktop("stacks", "lostdump", env=runtime).returncode == 0  # saved under stacks/
        engine = RemoteEngine(served_runs()[0].path)
        try:
            assert engine.redumps
            proc.kill()
            proc.wait(30)
            assert wait_for(lambda: engine.snapshot().end_unknown, what="the engine lost")
            assert not engine.redumps
            ack = engine.submit(cmd.DumpStacks())
            assert ack.ok and ack.report is not None and ack.message == "the last stack dump saved during the run"
            assert ack.report.saved_txt.startswith(str(tmp_path / "logs" / "lostdump" / "stacks"))
        finally:
            engine.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_saved_dumps_a_view_reads_back_are_input_not_trusted(tmp_path):
    """`d` in a view whose engine is gone reads <run dir>/stacks/*.json, which whoever could write
    the run directory wrote: newest first, a symlink (to a file outside), a FIFO (a plain read
    would wait for ever), a file past 16 MiB, JSON that is not a report and bytes that are not JSON
    are each passed over for the dump before them; a `stacks` that is a symlink is no dump at all."""
    from ranktop.core.client import last_saved_dump
    from ranktop.core.server import to_json
    from ranktop.core.stacks.model import StackReport, TreeNode

    run = tmp_path / "run"
    (run / "stacks").mkdir(parents=True)
    good = StackReport(taken_at=1.0, elapsed_s=0.1, ranks=(), groups=(), tree=TreeNode(None))
    (run / "stacks" / "20260101-000000.json").write_text(json.dumps(to_json(good)))
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(to_json(good)))
    (run / "stacks" / "20260101-000006.json").symlink_to(outside)
    os.mkfifo(run / "stacks" / "20260101-000005.json")
    with open(run / "stacks" / "20260101-000004.json", "wb") as f:
        f.truncate(17 << 20)  # (sparse: zeros past the limit)
    (run / "stacks" / "20260101-000003.json").write_text(json.dumps({"taken_at": "\x1b]0;owned\x07"}))
    (run / "stacks" / "20260101-000002.json").write_bytes(b"\xff{not json")
    fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ack = last_saved_dump(fd, str(run))
    finally:
        os.close(fd)
    assert ack.ok and ack.report.taken_at == 1.0
    assert ack.report.saved_txt == str(run / "stacks" / "20260101-000000.txt")
    (run / "stacks").rename(tmp_path / "real-stacks")
    (run / "stacks").symlink_to(tmp_path / "real-stacks")
    fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ack = last_saved_dump(fd, str(run))
    finally:
        os.close(fd)
    assert not ack.ok and ack.message == "no stacks: the run has ended, and no stack dump was saved during it"


UNTIL_GO = ("import os, time, pathlib\nprint('up', os.environ['RANK'], flush=True)\n"
            "while not pathlib.Path(os.environ['GO']).exists():\n    time.sleep(0.05)\n")
ACTING_KEYS = {"Signal…", "Kill rank", "Stop group", "Restart rank", "Restart group"}


@contextlib.contextmanager
def lingering(tmp_path, runtime, run_id: str) -> Iterator[tuple[dict, Path]]:
    """A --detach 2-rank run that lingers after its end, which comes once the yielded file exists:
    its `ls` entry and that file; stopped, its engine gone, on the way out."""
    script = tmp_path / "until_go.py"
    script.write_text(UNTIL_GO)
    go = tmp_path / "go"
    done = run_ranktop("--detach", "--linger", "60", "--nproc-per-node", "2", "--run-id", run_id,
                       "--log-dir", str(tmp_path / "logs"), str(script), env={**runtime, "GO": str(go)})
    assert done.returncode == 0, done.stderr
    (run,) = ls(runtime)
    try:
        yield run, go
    finally:
        go.touch()
        run_ranktop("stop", run_id, env=runtime)
        wait_for(lambda: gone(run["pid"]), what="the engine gone")


def _offered(app) -> tuple[set[str], set[str]]:
    """What the app offers: the footer's keys and the palette's titles."""
    from test_tui_fake import shown_footer_keys

    return {key.description for key in shown_footer_keys(app)}, {c.title for c in app.get_system_commands(app.main)}


@pytest.mark.parametrize("where", ["local", "attached"])
def test_after_the_end_the_tui_offers_only_the_keys_that_still_work(tmp_path, runtime, monkeypatch, where):
    """The TUI, local or attached, went on listing k, K, x (kill, signal) in its footer, ? help and
    palette once the run had ended, where they can do nothing (they only said so)."""
    from ranktop.core.client import RemoteEngine, served_runs
    from ranktop.core.engine import LocalEngine
    from ranktop.tui.app import RanktopApp
    from ranktop.tui.screens import HelpScreen
    from ranktop.tui.stacks_view import StacksScreen
    from test_tui_app import ticker_agent
    from test_tui_fake import shown_footer_keys

    go = tmp_path / "go"
    monkeypatch.setenv("GO", str(go))
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])

    async def body(app, pilot):
        await until(pilot, lambda: ACTING_KEYS & {k.description for k in shown_footer_keys(app)}, what="the footer")
        go.touch()
        await until(pilot, lambda: app.main.ended, what="the run's end", timeout=20)
        await until(pilot, lambda: (shown := {k.description for k in shown_footer_keys(app)}) and not shown & ACTING_KEYS,
                    what="the footer without the keys that act on ranks")
        footer, palette = _offered(app)
        assert "Quit" in footer and not palette & ACTING_KEYS, palette
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        shown = app.export_screenshot()
        assert "Zoom" in shown and not [t for t in ACTING_KEYS if t.replace(" ", "&#160;") in shown or t in shown]
        assert "Signal&#160;picker" not in shown and "Signal picker" not in shown
        await pilot.press("escape", "d")  # the stack view's SIGUSR1 fallback is left out too
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and shown_footer_keys(app), what="stacks")
        assert "SIGUSR1 fallback" not in {k.description for k in shown_footer_keys(app)}

    if where == "local":
        app = RanktopApp(LocalEngine(ticker_agent(tmp_path / "logs", UNTIL_GO)))
        drive(app, body)
        return
    with lingering(tmp_path, runtime, "over"):
        app = RanktopApp(RemoteEngine(served_runs()[0].path))
        app.attached = True
        asyncio.run(_drive_attached(app, body))


async def _drive_attached(app, body) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: app.main is not None and app.main.is_mounted, what="main screen")
        await body(app, pilot)


def test_a_read_only_view_says_so_after_the_runs_end_too(tmp_path, runtime):
    """`ranktop attach --read-only` (what each `ranktop web` tab runs) dropped `read-only view`
    from its header once the run ended; it keeps it."""
    with lingering(tmp_path, runtime, "ro"):
        term = ranktop_in_tmux(runtime, "attach --read-only ro", "; sleep 30", width=140, height=30)
        try:
            assert "read-only view" in term.wait_screen("up 1", "read-only view").splitlines()[0]
            (tmp_path / "go").touch()
            header = term.wait_screen("DONE: all ranks exited 0").splitlines()[0]
            assert "succeeded" in header and "read-only view" in header, header
        finally:
            term.close()


def test_a_moved_final_view_reads_its_logs_below_where_it_lies(tmp_path, runtime):
    from ranktop.core.client import FinalEngine

    run_dir = ended_run(tmp_path, runtime)
    moved = tmp_path / "moved-run"
    run_dir.rename(moved)  # a run directory moved: its recorded paths are taken below it, as relative ones
    edit_final(moved, ranks__1__stdout_log="attempt_0/1/stdout.log")
    engine = FinalEngine(str(moved / "final.json"))
    try:
        assert engine.output_since(1, None)[1] == [b"out of 1"] and engine.output_since(0, None)[1] == [b"out of 0"]
        assert engine.snapshot().ranks[0].stdout_log == str(moved / "attempt_0" / "0" / "stdout.log")
    finally:
        engine.close()


def test_commands_with_bad_arguments_through_the_socket_change_nothing(tmp_path, runtime):
    from ranktop.core.client import Connection

    proc = start_headless(tmp_path, runtime, "args")
    try:
        (run,) = wait_for(lambda: [r for r in ls(runtime) if r["state"] == "running"], what="the run running")
        with Connection(run["socket"]) as conn:
            # (the run is `running` once a rank is: the other may be `starting` a moment longer)
            before = wait_for(lambda: _every_rank_running(conn.snapshot()), what="both ranks running")
            answers = [conn.command("SignalRank", local_rank=9, signal=15),
                       conn.command("SignalRank", local_rank=0, signal="TERM"),
                       conn.command("Stop", nonsense=1),
                       conn.command("RunShell", cmd="rm -rf /"),
                       conn.command("DumpStacks", save="no"),
                       # args that are no object: a known command, not "unknown command 'KillGroup'"
                       conn.request({"type": "command", "id": 2, "command": "KillGroup", "args": [1]})[0]]
            assert [a["ok"] for a in answers] == [False] * 6
            assert answers[5]["message"] == "bad KillGroup: its args must be an object of named values"
            assert answers[4]["message"] == "bad save 'no': expected true or false"
            assert answers[0]["message"] == "bad local rank 9: local ranks are 0..1"
            assert answers[2]["message"].startswith("bad Stop: ")
            assert answers[3]["message"].startswith("unknown command 'RunShell': expected one of ")
            after = conn.snapshot()
            assert after["state"] == "running" and [(r["pid"], r["state"]) for r in after["ranks"]] == before
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _every_rank_running(snapshot: dict) -> list[tuple[int, str]] | None:
    """(pid, state) of each rank once every one is running, else None."""
    ranks = [(r["pid"], r["state"]) for r in snapshot["ranks"]]
    return ranks if all(state == "running" for _, state in ranks) else None


def test_stack_dumps_go_through_the_engine(tmp_path, runtime, monkeypatch):
    """`ranktop stacks RUN` and an attached TUI's stack view ask the run's engine, which dumps
    its own ranks (py-spy, or SIGUSR1) from a thread of its own while other clients go on. So
    does `ranktop stacks` given a rank's pid, the ranktop pid or the log directory of a served
    run: they were dumped from /proc, and each rank's line lacked what only the engine knows,
    its cpu% and how long it has been silent (`rank 1: pid N, idle`)."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs

    proc = start_headless(tmp_path, runtime, "stk", options=("--stall-timeout", "1"))  # (a sampler: cpu%)
    try:
        wait_for(lambda: [r for r in ls(runtime) if r["state"] == "running"], what="the run listed")
        dumped = run_ranktop("stacks", env=runtime)  # no RUN: the newest running one, by its engine
        assert dumped.returncode == 0, dumped.stderr
        assert "2 of 2 ranks dumped" in dumped.stdout and "ticker.py" in dumped.stdout
        as_json = json.loads(run_ranktop("stacks", "stk", "--json", env=runtime).stdout)
        assert sorted(r["rank"] for r in as_json["ranks"]) == [0, 1]
        run_dir = tmp_path / "logs" / "stk"
        saved = sorted(os.listdir(run_dir / "stacks"))
        logged = [e for e in read_events(run_dir) if e["event"] == "stacks_dumped"]
        assert len(saved) == 4 and len(logged) == 2  # a .txt and a .json per dump
        for how in ((), ("--signal",)):  # --no-save: the engine dumps and writes nothing (it saved regardless)
            unsaved = run_ranktop("stacks", "stk", "--no-save", *how, env=runtime)
            assert unsaved.returncode == 0 and "2 of 2 ranks dumped" in unsaved.stdout, unsaved.stderr
            assert "saved:" not in unsaved.stdout
        native = run_ranktop("stacks", "stk", "--no-save", "--native", env=runtime)  # the engine's py-spy --native
        assert native.returncode == 0 and "s, with C frames): 2 of 2 ranks dumped" in native.stdout, native
        assert sorted(os.listdir(run_dir / "stacks")) == saved
        assert [e for e in read_events(run_dir) if e["event"] == "stacks_dumped"] == logged
        for how in ((), ("--json",), ("--signal",)):  # into a reader that has gone (`| head`): no traceback
            read_end, write_end = os.pipe()
            os.close(read_end)
            gone = subprocess.run(ranktop_cmd("stacks", "stk", "--no-save", *how), cwd=ROOT, env=runtime,
                                  stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
            os.close(write_end)
            assert gone.returncode == 0 and gone.stderr == "", (how, gone.stderr)
        # neither a served run nor a path: the runs there are, and the ended ones, as attach and logs say
        unknown = run_ranktop("stacks", "nope", env={**runtime, "TMPDIR": str(tmp_path)})
        assert unknown.returncode == 2 and unknown.stderr.strip() == (
            f"ranktop: error: 'nope' names no run served on this host: runs are stk; none has ended under "
            f"{tmp_path}/ranktop-{os.geteuid()} either; an ended run elsewhere is named by its run directory "
            "(or give a run directory, a log directory or a pid)")
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
        (run,) = served_runs()
        engine = RemoteEngine(run.path)
        try:
            ack = engine.submit(cmd.SignalDump((1,)))
            assert ack.ok and [r.rank for r in ack.report.ranks] == [1], ack.message
            assert ack.report.ranks[0].threads[0].frames  # the faulthandler dump, read back from its log
            assert engine.snapshot().state.value == "running"  # the same client goes on
        finally:
            engine.close()
        while "where each rank is" not in read_line(proc.stderr, 20, "the stall lines"):
            pass  # (both ranks stalled, their cpu% sampled)
        rank_pids = {e["rank"]: e["pid"] for e in read_events(run_dir) if e["event"] == "started"}
        one = run_ranktop("stacks", "--no-save", str(rank_pids[1]), env=runtime)  # that rank alone, as before
        assert one.returncode == 0 and "1 of 1 ranks dumped" in one.stdout, one
        # (py-spy's sample may find the ticker printing: on CPU)
        assert re.search(rf"^   rank 1: pid {rank_pids[1]}, cpu \d+%, silent \d+s, (idle|on CPU)$", one.stdout, re.M), one.stdout
        for how, target in ((("--signal",), str(proc.pid)), ((), str(tmp_path / "logs"))):  # every rank, by the engine
            every = run_ranktop("stacks", "--no-save", *how, target, env=runtime)
            assert every.returncode == 0 and "2 of 2 ranks dumped" in every.stdout, every
            assert re.search(rf"^   rank 0: pid {rank_pids[0]}, cpu \d+%, silent \d+s(, idle|, on CPU)?$", every.stdout, re.M), every.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_stacks_signal_of_ranks_run_without_faulthandler_says_why_and_exits_1(tmp_path, runtime):
    """--no-faulthandler: the ranks do not handle SIGUSR1. `stacks --signal` called them
    `not-python`, told the user to start them with ranktop (it had), and exited 0 with nothing dumped.
    A run id's digits that are no process's pid name the run (`20261127` of a run started that
    day): they were taken for a pid, `no process with that pid`."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--no-faulthandler", "--run-id", "99999999-nofh",
                                        "--log-dir", str(tmp_path / "logs"), str(script)),
                            cwd=ROOT, env=runtime, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: [r for r in ls(runtime) if r["state"] == "running"], what="the run listed")
        signalled = run_ranktop("stacks", "99999999-nofh", "--signal", "--no-save", env=runtime)
        assert signalled.returncode == 1, signalled.stdout
        assert "0 of 2 ranks dumped" in signalled.stdout and "not-python" not in signalled.stdout
        assert "does not handle SIGUSR1" in signalled.stdout and "py-spy reads it" in signalled.stdout
        # py-spy needs no handler; digits above the kernel's pid_max (4194304) are no process's
        dumped = run_ranktop("stacks", "99999999", "--no-save", env=runtime)
        assert dumped.returncode == 0 and "2 of 2 ranks dumped" in dumped.stdout, dumped
        nothing = run_ranktop("stacks", "99999998", env=runtime)  # digits no run has either: a pid still
        assert (nothing.returncode, nothing.stderr) == (2, "ranktop: error: bad target 99999998: no process with that pid\n")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_two_clients_at_once_see_the_same_run(tmp_path, runtime, monkeypatch):
    from ranktop.core.client import RemoteEngine, served_runs

    proc = start_headless(tmp_path, runtime, "two")
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
    try:
        wait_for(lambda: [r for r in ls(runtime) if r["state"] == "running"], what="the run listed")
        (run,) = served_runs()
        first, second = RemoteEngine(run.path), RemoteEngine(run.path)
        try:
            assert wait_for(lambda: ls(runtime)[0]["clients"] == 2, what="two clients counted")
            # running is not yet printed: wait for rank 1's first line, then both clients see it
            wait_for(lambda: first.output_since(1, None)[1], what="rank 1's first line")
            seen = [e.output_since(1, None)[1] for e in (first, second)]
            assert seen[0][:1] == seen[1][:1] == [b"hello from 1"]
            cursor, newest, _ = first.output_since(1, None, tail=1)  # a new pane's first screen: the newest only
            assert newest == [second.output_since(1, None)[1][cursor.line - 1]]
            assert first.snapshot().ranks[1].pid == second.snapshot().ranks[1].pid
        finally:
            first.close()
            second.close()
        wait_for(lambda: ls(runtime)[0]["clients"] == 0, what="both clients gone, the run untouched")
        assert ls(runtime)[0]["state"] == "running"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_attach_look_ahead_answers_the_first_screen_and_goes_on_with_no_gap(tmp_path, runtime, monkeypatch):
    from ranktop.core.client import RemoteEngine, served_runs
    from ranktop.core.engine import FIRST_LOOK_LINES, OutputCursor

    script = tmp_path / "count.py"  # 400 lines at once, then a line every 10 ms until stdin closes
    script.write_text("import sys, time\nfor i in range(400):\n    print(i)\nsys.stdout.flush()\nfor i in range(400, 10**6):\n"
                      "    print(i, flush=True)\n    time.sleep(0.01)\n")
    proc = subprocess.Popen(ranktop_cmd("--headless", "--run-id", "ahead", "--log-dir", str(tmp_path / "logs"),
                                        "--shutdown-timeout", "3", str(script)),
                            cwd=ROOT, env=runtime, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
    try:
        wait_for(lambda: [r for r in ls(runtime) if r["state"] == "running"], what="the run listed")
        logged = lambda: b"".join(p.read_bytes() for p in (tmp_path / "logs").glob("ahead/*/*/stdout.log"))  # noqa: E731
        wait_for(lambda: logged().count(b"\n") > 401, what="the first 400 lines read (and one after them)")
        (run,) = served_runs()
        engine = RemoteEngine(run.path, look_ahead=True)
        try:
            asked = []
            real_output = engine._view.conn.output
            monkeypatch.setattr(engine._view.conn, "output", lambda *a: asked.append(a) or real_output(*a))
            cursor, lines, _ = engine.output_since(0, OutputCursor(engine.last.generation, 0), FIRST_LOOK_LINES)
            assert asked == [] and len(lines) == FIRST_LOOK_LINES  # answered by the look-ahead
            seen = [int(x) for x in lines]

            def more() -> bool:  # later requests go on from its cursor
                nonlocal cursor
                cursor, lines, _ = engine.output_since(0, cursor)
                seen.extend(int(x) for x in lines)
                return seen[-1] >= 450

            wait_for(more, what="lines printed after the look-ahead")
            assert asked and seen == list(range(seen[0], seen[-1] + 1))  # no gap, no overlap
        finally:
            engine.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


HOSTILE = (b"\x1b]52;c;cHduZWQ=\x07\x1b]0;retitled\x07\x1b[2J\x1b[32mgreen\x1b[0m "
           b"\x1b]8;;https://example.org\x1b\\docs\x1b]8;;\x1b\\ end")


def test_logs_to_a_terminal_are_cleaned_and_to_a_pipe_are_raw(tmp_path, runtime, monkeypatch):
    """What a rank prints must not drive the terminal of whoever reads its logs (a clipboard
    write, a new title, a cleared screen): `ranktop logs` to a terminal goes through the panes'
    filter, colours kept. It wrote the rank's bytes as they came. A pipe still gets them raw."""
    proc = start_headless(tmp_path, runtime, "hostile", nproc=1, name="hostile.py", script_text=(
        f"import sys, time\nsys.stdout.buffer.write({HOSTILE!r} + b'\\n')\nsys.stdout.flush()\ntime.sleep(600)\n"))
    try:
        piped = wait_for(lambda: b" end" in (out := subprocess.run(ranktop_cmd("logs", "hostile"), cwd=ROOT, env=runtime,
                                                                   capture_output=True).stdout) and out,
                         what="the rank's line through the socket")
        assert piped == b"[0]:" + HOSTILE + b"\n"  # a pipe or a file: the bytes as the log holds them
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
        shown, status = run_in_pty(ranktop_cmd("logs", "hostile"), ROOT, until=b"\xff")  # (to its end)
        assert status == 0
        assert b"\x1b]" not in shown and b"\x1b[2J" not in shown and b"\x07" not in shown
        assert b"\x1b[32mgreen\x1b[0m" in shown and b"docs <https://example.org> end" in shown
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    # Ended, its engine gone: the logs come from its files, cleaned the same way (stderr.log too,
    # where this writes the same line).
    with open(tmp_path / "logs" / "hostile" / "attempt_0" / "0" / "stderr.log", "ab") as err:
        err.write(b"from stderr " + HOSTILE + b"\n")
    shown, status = run_in_pty(ranktop_cmd("logs", str(tmp_path / "logs" / "hostile")), ROOT, until=b"\xff")
    assert status == 0 and b"[0]:" in shown and b"\x1b]" not in shown and b"\x1b[32mgreen" in shown
    assert b"[0]:from stderr " in shown and b"\x1b[2J" not in shown and b"\x07" not in shown


def test_logs_follow_is_pushed_history_then_live_with_no_gap_or_overlap(tmp_path, runtime):
    script = tmp_path / "count.py"
    script.write_text("import os, sys, time\nfor i in range(40):\n    print(os.environ['RANK'], i, flush=True)\n"
                      "    time.sleep(0.05)\nsys.stdin.close()\n")
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--run-id", "follow", "--log-dir",
                                        str(tmp_path / "logs"), str(script)),
                            cwd=ROOT, env=runtime, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: ls(runtime), what="the run served")
        followed = run_ranktop("logs", "follow", "-f", "--events", env=runtime)  # returns when the run ends
    finally:
        proc.wait(30)
    assert followed.returncode == 0, followed.stderr
    for rank in (0, 1):
        mine = [line for line in followed.stdout.splitlines() if line.startswith(f"[{rank}]:")]
        assert mine == [f"[{rank}]:{rank} {i}" for i in range(40)]  # every line, once, in order
    # The engine pushed each event as it wrote it to events.jsonl: both ranks' exits among them.
    pushed = [json.loads(line[len("[ranktop]:"):]) for line in followed.stdout.splitlines()
              if line.startswith("[ranktop]:")]
    assert sorted(e["local_rank"] for e in pushed if e["event"] == "exited") == [0, 1]
    written = read_events(tmp_path / "logs" / "follow")
    assert pushed == written[written.index(pushed[0]):][:len(pushed)]


def test_a_subscriber_that_never_reads_does_not_slow_the_run(tmp_path, runtime):
    script = tmp_path / "flood.py"  # floods once the test has subscribed (the run must outlast the subscription)
    go = tmp_path / "go"
    script.write_text(f"import os, sys, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\n"
                      "for i in range(400_000):\n    sys.stdout.write(f'line {i} ' + 'x' * 60 + '\\n')\n")
    err = tmp_path / "ranktop.err"  # (kept: a run that is never served says why there)
    with open(err, "w") as err_file:
        proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--run-id", "flood", "--log-dir",
                                            str(tmp_path / "logs"), str(script)),
                                cwd=ROOT, env=runtime, stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        # A generous deadline: once, with the other worker busy, it was not listed within 10 s.
        (run,) = wait_for(lambda: ls(runtime), timeout=30, what=f"the run served (its stderr: {err})")
        with socket.socket(socket.AF_UNIX) as lazy:  # subscribes, then never reads a byte
            lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            lazy.connect(run["socket"])
            lazy.sendall(protocol.encode_control(protocol.hello("client"))
                         + protocol.encode_control({"type": "subscribe"}))
            go.touch()
            assert proc.wait(60) == 0  # the ranks wrote ~50 MB and the run ended as if nobody watched
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for rank in (0, 1):  # and the log files have every line
        log = tmp_path / "logs" / "flood" / "attempt_0" / str(rank) / "stdout.log"
        assert log.read_bytes().count(b"\n") == 400_000


# ----- what an attached view takes from an engine (a fake one, served by the real server) ----------
ESCAPES = "\x1b]52;c;cHduZWQ=\x1b\\\x1b]0;PWNTITLE\x07\x1b[2J\x9d0;c1\x9c"


@pytest.fixture
def served_fake(runtime, monkeypatch):
    """A FakeEngine served on a real socket: (engine, its socket path)."""
    from fake_engine import FakeEngine
    from ranktop.core.server import serve

    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
    engine = FakeEngine(2)
    server, problem = serve(engine, ["fake"])
    assert problem is None
    try:
        yield engine, server.path
    finally:
        server.close()


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if dataclasses.is_dataclass(value):
        return [s for f in dataclasses.fields(value) for s in _strings(getattr(value, f.name))]
    if isinstance(value, (tuple, list)):
        return [s for item in value for s in _strings(item)]
    return []


def test_an_engines_text_reaches_an_attached_view_cleaned(served_fake):
    """A snapshot's text is put on the screen as it is (titles, the end panel): an engine's, or
    a final.json's, is cleaned on the way in. Raw, its escapes wrote the clipboard and the title."""
    from ranktop.core.client import RemoteEngine
    from ranktop.core.state import LogLoss

    fake, path = served_fake
    fake.group = dataclasses.replace(
        fake.group, name="t.py" + ESCAPES, gpu_status="gpu" + ESCAPES, waiting="waiting for nodes" + ESCAPES,
        incomplete_logs=(LogLoss(0, "/p", "err" + ESCAPES, 5),),
        ranks=tuple(dataclasses.replace(r, signal_name="SIGSEGV" + ESCAPES, log_error="disk" + ESCAPES)
                    for r in fake.group.ranks))
    engine = RemoteEngine(path)
    try:
        snap = engine.snapshot()
    finally:
        engine.close()
    assert not [t for t in _strings(snap) if any(c in t for c in "\x1b\x07\x9c\x9d")]
    assert (snap.name, snap.gpu_status, snap.incomplete_logs[0].error) == ("t.py", "gpu", "err")
    assert snap.waiting == "waiting for nodes"
    assert [(r.signal_name, r.log_error) for r in snap.ranks] == [("SIGSEGV", "disk")] * 2


def test_a_bad_snapshot_from_an_engine_is_one_line_not_a_traceback(served_fake):
    from ranktop.core.client import RemoteEngine, RunGone

    fake, path = served_fake
    fake.group = dataclasses.replace(fake.group, local_world_size=10**6)
    with pytest.raises(RunGone, match=r"^the run's engine sent a bad snapshot: local_world_size is 1000000, "):
        RemoteEngine(path)
    fake.group = dataclasses.replace(fake.group, local_world_size=2)
    engine = RemoteEngine(path)
    try:
        fake.group = dataclasses.replace(fake.group, started_at=1e308)  # a time no clock can show: unknown
        assert math.isnan(engine.snapshot().started_at)
        fake.group = dataclasses.replace(fake.group, local_world_size=10**6)  # no view can be made of it
        snap = engine.snapshot()
    finally:
        engine.close()
    assert snap.ended and snap.state.value == "running" and snap.local_world_size == 2  # what it had
    assert snap.error == "lost the run's engine before its end (local_world_size is 1000000, expected 1 to 4096)"


def test_an_engine_that_stops_answering_is_waited_for_not_taken_for_the_runs_end(served_fake, monkeypatch):
    """A stopped (SIGSTOP) or swamped engine: an attached view used to freeze on a trickling
    answer, or take a 3 s silence for the run's end and say it was stopped on request."""
    import threading

    from ranktop.core import client

    monkeypatch.setattr(client, "REQUEST_SECONDS", 0.3)
    fake, path = served_fake
    engine = client.RemoteEngine(path)
    hold = threading.Event()
    answer = fake.snapshot
    fake.snapshot = lambda: (hold.wait(30), answer())[1]  # the engine's loop stuck until `hold`
    try:
        began = time.monotonic()
        snap = engine.snapshot()
        assert time.monotonic() - began < 10 and not snap.ended and not engine.gone  # what it saw last
        assert not engine.submit(client.cmd.KillGroup()).ok  # asked again later, on a new connection
        hold.set()
        fake.group = dataclasses.replace(fake.group, attempt=1)
        wait_for(lambda: engine.snapshot().attempt == 1, timeout=10, what="the engine answering again")
        assert not engine.gone
    finally:
        hold.set()
        engine.close()


def test_an_attached_view_does_not_wait_behind_a_command_the_engine_answers_slowly(served_fake):
    """A stop or an R in a multi-node run is answered once the store took the node's word: up to
    2 s where it hangs. The attached TUI's snapshots and panes waited behind it (one connection,
    one lock, and the engine's one server thread), its view frozen. They are answered meanwhile,
    `ls` too, which counts the view once (its commands have a connection of their own); the
    command's slow answer is its answer, not a silent engine's; and a kill now sent meanwhile
    reaches the engine at once."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs

    fake, path = served_fake
    held, viewed, killed, submit = threading.Event(), threading.Event(), threading.Event(), fake.submit

    def slow_stop(command):
        if isinstance(command, cmd.KillGroup):
            killed.set()
        if isinstance(command, cmd.Stop):
            began = time.monotonic()
            held.set()
            viewed.wait(10)
            killed.wait(10)  # (a kill behind the stop ends its wait for the store)
            # past a second's silence: what a command's connection made again after a drop allowed
            time.sleep(max(0.0, began + 1.5 - time.monotonic()))
        return submit(command)

    fake.submit = slow_stop
    fake.print(0, "before the stop")
    engine = RemoteEngine(path)
    seen = {}

    def view():  # the UI's tick and a pane's worker
        seen["lines"] = engine.output_since(0, None)[1]
        seen["state"] = engine.snapshot().state.value
        seen["clients"] = [(run.snapshot["state"], run.clients) for run in served_runs()]
        viewed.set()

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            stop = pool.submit(engine.submit, cmd.Stop(signal.SIGTERM))  # the TUI's sender
            assert held.wait(10)
            pool.submit(view)
            assert viewed.wait(5), "the view waited behind the stop"
            assert not stop.done()
            assert seen == {"lines": [b"before the stop"], "state": "running", "clients": [("running", 1)]}
            # a second q: the kill goes at once, on a connection of its own (it waited behind the stop)
            kill = pool.submit(engine.submit, cmd.KillGroup())
            assert killed.wait(5) and not stop.done(), "the kill waited behind the stop"
            ack = stop.result(10)
            assert kill.result(10).ok
        assert (ack.ok, ack.message) == (True, "fake: Stop")
        assert engine.snapshot().state.value == "running" and engine.take_dropped() is None and not engine.gone
    finally:
        viewed.set()
        engine.close()


# Rank 0 ignores SIGTERM (a stop waits out the grace); on SIGUSR1 (a --signal stack dump) it
# marks that it was asked and freezes its engine, its parent, so the dump's answer never comes.
FREEZER = """import os, signal, sys, time
def freeze(*_):
    open(sys.argv[1], 'w').close()
    os.kill(os.getppid(), signal.SIGSTOP)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, freeze)
print('up', flush=True)
while True:
    time.sleep(0.1)
"""


def interrupted(proc: subprocess.Popen) -> tuple[int, str]:
    """SIGINT to a subcommand (Ctrl-C): its exit status and what it said on stderr."""
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    return proc.returncode, err


def test_ctrl_c_ends_a_subcommand_with_130_and_no_traceback(tmp_path, runtime):
    script = tmp_path / "freezer.py"
    script.write_text(FREEZER)
    asked = tmp_path / "asked"
    engine = subprocess.Popen(ranktop_cmd("--headless", "--shutdown-timeout", "3", "--run-id", "ctrlc", "--log-dir",
                                          str(tmp_path / "logs"), str(script), str(asked)),
                              cwd=ROOT, env=runtime, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def subcommand(*args: str) -> subprocess.Popen:
        return subprocess.Popen(ranktop_cmd(*args), cwd=ROOT, env=runtime, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    try:
        wait_for(lambda: ls(runtime), what="the run served")
        follower = subcommand("logs", "ctrlc", "-f")
        assert follower.stdout.readline() == "[0]:up\n"  # following, until the run ends
        status, err = interrupted(follower)
        assert status == 130 and "Traceback" not in err, err
        # The engine is frozen mid-dump (by the rank it signalled): stacks waits for its answer.
        dumper = subcommand("stacks", "ctrlc", "--signal")
        wait_for(lambda: asked.exists() and _status_field(engine.pid, "State").startswith("T"),
                 what="the engine frozen while it dumps")
        status, err = interrupted(dumper)
        assert status == 130 and "Traceback" not in err, err
        os.kill(engine.pid, signal.SIGCONT)
        # stop sends the stop, then waits out the grace the rank takes (it ignores SIGTERM).
        stopper = subcommand("stop", "ctrlc")
        wait_for(lambda: any(e["event"] == "user_stop" for e in read_events(tmp_path / "logs" / "ctrlc", while_written=True)),
                 what="the stop sent")
        status, err = interrupted(stopper)
        assert status == 130 and "Traceback" not in err, err
        assert engine.wait(30) == 130  # the stop went on without the command that sent it: SIGKILL after 3 s
    finally:
        if engine.poll() is None:
            os.kill(engine.pid, signal.SIGCONT)
            engine.kill()
            engine.wait()


def test_an_ended_run_whose_engine_has_gone_is_said_so_by_logs_stop_and_stacks(tmp_path, runtime):
    """Its run directory holds final.json: logs shows what attach's final view shows, stop has
    nothing left to do, stacks nothing to dump; each names the run's final state. They used to say
    that RUN 'names no run served on this host'."""
    env = {**runtime, "TMPDIR": str(tmp_path)}  # the default log root, where a run id is looked for
    script = tmp_path / "fail.py"
    # FAIL_ON_1 (rank 1 fails once rank 0 has printed: else rank 0 could be stopped first), with a
    # line on stderr from each rank, where a traceback would be.
    said = 'print("out of", os.environ["RANK"], flush=True)\n'
    assert said in FAIL_ON_1
    script.write_text(FAIL_ON_1.replace(said, said + 'print("err of", os.environ["RANK"], file=sys.stderr, flush=True)\n'))
    done = run_ranktop("--headless", "--nproc-per-node", "2", "--run-id", "over", str(script), env=env)
    assert done.returncode == 1, done.stderr
    run_dir = tmp_path / f"ranktop-{os.geteuid()}" / "over"
    assert (run_dir / "final.json").is_file() and ls(env) == []
    ended = "over has ended (failed); its engine has left"
    for target in ("over", str(run_dir), "ov"):  # its id, its directory, a unique prefix of its id
        stopped = run_ranktop("stop", target, env=env)
        assert stopped.returncode == 0 and stopped.stdout == "ranktop: over had already ended (failed); its engine " \
                                                               "has left\n" and stopped.stderr == "", stopped.stderr
        for follow in ((), ("-f",)):
            logs = run_ranktop("logs", target, *follow, env=env)
            assert logs.returncode == 0 and logs.stdout == "[0]:out of 0\n[1]:out of 1\n", logs.stderr
            assert logs.stderr == ("[0]:err of 0\n[1]:err of 1\n"  # stderr.log, where a traceback is, on stderr
                                   f"ranktop: {ended}: that was the last MiB of each rank's stdout.log and "
                                   f"stderr.log; all its log files are under {run_dir}\n")
        stacks = run_ranktop("stacks", target, env=env)
        assert stacks.returncode == 1 and stacks.stderr == f"ranktop stacks: {ended}: no ranks to dump\n"
    one = run_ranktop("logs", "over", "--rank", "1", env=env)
    assert one.returncode == 0 and one.stdout == "[1]:out of 1\n" and one.stderr.startswith("[1]:err of 1\nranktop: ")
    bad = run_ranktop("logs", "over", "--rank", "2", env=env)
    assert bad.returncode == 2 and bad.stderr == "ranktop: error: bad --rank 2: the ranks of over are 0..1\n"
    # The second node of two (ranktop's own static form): --rank is the rank its lines are
    # prefixed with, 2 or 3 there; it took the local rank (`--rank 1` printed `[3]:`, `--rank 3` was refused).
    says_rank = tmp_path / "says_rank.py"
    says_rank.write_text('import os\nprint("rank", os.environ["RANK"])\n')
    second = run_ranktop("--headless", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr",
                         "10.0.0.5", "--master-port", "29555", "--run-id", "node1", str(says_rank), env=env,
                         without="torch")
    assert second.returncode == 0, second.stderr
    three = run_ranktop("logs", "node1", "--rank", "3", env=env)
    assert (three.returncode, three.stdout) == (0, "[3]:rank 3\n"), three.stderr
    local = run_ranktop("logs", "node1", "--rank", "1", env=env)
    assert (local.returncode, local.stderr) == (2, "ranktop: error: bad --rank 1: the ranks of node1 are 2..3\n")
    again = run_ranktop("--headless", "--run-id", "overt", str(script), env=env)
    assert again.returncode == 0, again.stderr
    for command in ("logs", "stacks"):  # a prefix of two ended runs: both named, nothing shown
        both = run_ranktop(command, "ov", env=env)  # (stacks said 'ov' names no run: none is served)
        assert both.returncode == 2 and both.stdout == ""
        assert both.stderr == "ranktop: error: 'ov' matches several ended runs: over, overt\n", command
    assert run_ranktop("logs", "over", env=env).stdout == "[0]:out of 0\n[1]:out of 1\n"  # the exact id still wins
    # A progress bar redrawn with '\r' prints as its last state, as a served run's logs and the panes
    # show it (the file keeps every redraw): it printed every redraw, and to a terminal as 10%␍50%␍...
    attempt = run_dir / "attempt_0"
    log = attempt / "0" / "stdout.log"
    log.write_bytes(log.read_bytes() + b"10%\r50%\r100%\n")
    assert run_ranktop("logs", "over", env=env).stdout == "[0]:out of 0\n[0]:100%\n[1]:out of 1\n"
    # A log a rank swapped for a FIFO or a link is not read (nothing hangs, nothing is followed),
    # and is said to be left out: it was left out without a word.
    (attempt / "1" / "stdout.log").unlink()
    os.mkfifo(attempt / "1" / "stdout.log")
    (attempt / "0" / "stderr.log").unlink()
    (attempt / "0" / "stderr.log").symlink_to("/etc/passwd")
    swapped = run_ranktop("logs", "over", env=env, timeout=30)
    assert (swapped.returncode, swapped.stdout) == (0, "[0]:out of 0\n[0]:100%\n"), swapped.stderr
    assert swapped.stderr.startswith("[1]:err of 1\nranktop: over: rank 0's stderr.log was left out: it is a symlink, "
                                     "not a plain file\nranktop: over: rank 1's stdout.log was left out: it is a FIFO, "
                                     "not a plain file\nranktop: over has ended"), swapped.stderr


def test_a_run_id_under_a_log_root_that_is_not_ours_alone_names_no_run(tmp_path, runtime):
    """A run id (or a prefix of one) is looked for under the default log root only as ended runs
    are named there (`newest_ended_runs`): the root ours and private, the run's directory ours and
    no symlink, its final.json or events.jsonl a plain file of ours. Another user who made
    /tmp/ranktop-0 first (or a root others may write) had root's `logs ID` show their tree."""
    env = {**runtime, "TMPDIR": str(tmp_path)}
    script = tmp_path / "quick.py"
    script.write_text("print('ours', flush=True)\n")
    done = run_ranktop("--headless", "--run-id", "over", str(script), env=env)
    assert done.returncode == 0, done.stderr
    root = tmp_path / f"ranktop-{os.geteuid()}"
    assert run_ranktop("logs", "over", env=env).stdout == "[0]:ours\n"
    crafted = tmp_path / "crafted"
    shutil.copytree(root / "over", crafted)
    (crafted / "attempt_0" / "0" / "stdout.log").write_text("crafted by them\n")
    (root / "linked").symlink_to(crafted)  # a run directory through a symlink

    def refused(target: str) -> None:
        for command in ("logs", "stop"):
            shown = run_ranktop(command, target, env=env)
            assert shown.returncode == 2 and shown.stdout == "", (command, target, shown.stdout, shown.stderr)
            assert f"{target!r} names no run: none is served on this host" in shown.stderr, shown.stderr

    refused("linked")
    refused("lin")  # a prefix
    shutil.rmtree(root / "over")
    shutil.copytree(crafted, root / "over")
    assert run_ranktop("logs", "over", env=env).stdout == "[0]:crafted by them\n"  # ours: shown
    root.chmod(0o777)  # a root others may write: any of its runs could be theirs
    refused("over")
    refused("ov")
    root.chmod(0o700)
    if os.geteuid() == 0:
        os.chown(root / "over", 65534, 65534)  # a run directory of another user's
        refused("over")
        os.chown(root / "over", 0, 0)
        os.chown(root, 65534, 65534)  # another user made the root first
        refused("over")
        refused("ov")


@pytest.mark.parametrize("root_is, why", [
    ("shared", "is writable by group and others (mode 777)"),
    ("a symlink", "is a symlink"),
    ("theirs", "belongs to uid 65534, not to you (uid 0)"),
])
def test_a_default_log_root_not_ours_alone_is_said_so_not_called_empty(tmp_path, runtime, root_is, why):
    """The no-run line said `none has ended under ROOT either` of a root it refused to read (one
    another user made first, or may write): it says why no run is named from it."""
    if root_is == "theirs" and os.geteuid() != 0:
        pytest.skip("makes another user's directory: needs root")
    root = tmp_path / f"ranktop-{os.geteuid()}"
    if root_is == "a symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
    else:
        root.mkdir(mode=0o700)
        root.chmod(0o777) if root_is == "shared" else os.chown(root, 65534, 65534)
    done = run_ranktop("logs", env={**runtime, "TMPDIR": str(tmp_path)})
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr == (f"ranktop: error: no runs are served on this host; the default log root {root} {why}, "
                           "so no run is named from it; an ended run is named by its run directory\n")


def test_a_bare_name_is_a_run_id_before_a_directory_of_that_name_here(tmp_path, runtime):
    """A bare name named a directory of that name in the current directory first: root's `ranktop
    logs exp` typed in /tmp showed another user's /tmp/exp (its own run `exp` never). It is the id
    first; `./exp` names the directory here."""
    env = {**runtime, "TMPDIR": str(tmp_path)}
    here = tmp_path / "here"
    here.mkdir()
    for where, words in ((None, "the id's"), (here, "the directory's")):
        script = tmp_path / "say.py"
        script.write_text(f"print({words!r}, flush=True)\n")
        log_dir = () if where is None else ("--log-dir", str(where))
        done = run_ranktop("--headless", *log_dir, "--run-id", "exp", str(script), env=env)
        assert done.returncode == 0, done.stderr
    assert run_ranktop("logs", "exp", env=env, cwd=here).stdout == "[0]:the id's\n"
    assert run_ranktop("logs", "./exp", env=env, cwd=here).stdout == "[0]:the directory's\n"
    assert run_ranktop("logs", str(here / "exp"), env=env).stdout == "[0]:the directory's\n"


def test_attach_without_a_terminal_is_one_line(tmp_path, runtime, monkeypatch):
    """Textual drew into the pipe and waited for keys that never came; now one line, exit 2,
    before any connection (the run has no client)."""
    proc = start_headless(tmp_path, runtime, "att")
    try:
        wait_for(lambda: ls(runtime), what="the run served")
        piped = run_ranktop("attach", "att", env=runtime, stdin=subprocess.DEVNULL)
        assert piped.returncode == 2 and piped.stdout == ""
        assert piped.stderr == ("ranktop: error: ranktop attach needs a terminal (stdin is not a terminal): "
                                "ranktop logs att -f prints a run's output instead\n")
        # stdin and stderr a terminal, stdout into a file
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
        out_file = tmp_path / "out"
        screen, status = run_in_pty(["/bin/sh", "-c", f"exec {shlex.quote(sys.executable)} -m ranktop attach "
                                     f"> {shlex.quote(str(out_file))}"], ROOT, until=b"")
        assert status == 2 and out_file.read_text() == ""
        assert screen == (b"ranktop: error: ranktop attach needs a terminal (stdout is not a terminal): "
                          b"ranktop logs -f prints a run's output instead\r\n")
        assert [(r["state"], r["clients"]) for r in ls(runtime)] == [("running", 0)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_detach_with_tui_is_refused_and_starts_nothing(tmp_path, runtime):
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    done = run_ranktop("--detach", "--tui", "--run-id", "both", "--log-dir", str(tmp_path / "logs"), str(script),
                       env=runtime)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("ranktop: error: --detach and --tui exclude each other: a detached run has no TUI; "
                           "start it with --detach, then ranktop attach RUN shows it\n")
    assert ls(runtime) == [] and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("flag,as_attach", [(("--metric", "loss ([0-9.]+)"), "--metric REGEX"),
                                            (("--exit-on-end",), "--exit-on-end")])
def test_a_tuis_flag_with_detach_is_refused_and_named_for_attach(tmp_path, runtime, flag, as_attach):
    """A detached run has no TUI: its flags were dropped without a word; attach takes them."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    done = run_ranktop("--detach", *flag, "--run-id", "tuiflag", "--log-dir", str(tmp_path / "logs"), str(script),
                       env=runtime)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"ranktop: error: {flag[0]} is for a TUI and a detached run has none: give it to the "
                           f"TUI that shows the run (ranktop attach RUN {as_attach})\n")
    assert ls(runtime) == [] and not (tmp_path / "logs").exists()


def test_attach_takes_the_tuis_metric_and_exit_on_end(tmp_path, runtime):
    script = tmp_path / "value.py"
    script.write_text("import os, time, pathlib\nprint('step value=7.25', flush=True)\n"
                      "while not pathlib.Path(os.environ['GO']).exists():\n    time.sleep(0.05)\n")
    go = tmp_path / "go"
    done = run_ranktop("--detach", "--linger", "0", "--nproc-per-node", "2", "--run-id", "met",
                       "--log-dir", str(tmp_path / "logs"), str(script), env={**runtime, "GO": str(go)})
    assert done.returncode == 0, done.stderr
    (run,) = ls(runtime)
    term = ranktop_in_tmux(runtime, "attach met --metric 'value=([0-9.]+)' --exit-on-end", "; echo STATUS $?; sleep 30",
                           width=120, height=30)
    try:
        screen = term.wait_screen("step value=7.25", "value 7.25")  # the metric in the rank titles
        assert screen.count("value 7.25") == 2, screen
        go.touch()  # the run ends: --exit-on-end leaves at once, with the end report
        term.wait_screen("ranktop: value.py succeeded: all ranks exited 0", "STATUS 0")
    finally:
        term.close()
        go.touch()
    wait_for(lambda: gone(run["pid"]), what="the engine gone")


def test_attach_whose_engine_is_killed_under_it_exits_1(tmp_path, runtime):
    """The end is unknown when the engine went away before it (SIGKILLed): attach said so and
    exited 0, as if the person had simply left. Its header and titles went on saying `running`,
    `2/2 alive`, the clock ticking, under the END UNKNOWN panel: they say `unknown` and what was
    last seen."""
    proc = start_headless(tmp_path, runtime, "lost")
    term = None
    try:
        wait_for(lambda: ls(runtime), what="the run listed")
        term = ranktop_in_tmux(runtime, "attach lost", "; echo STATUS $?; sleep 30", width=160, height=30)
        term.wait_screen("hello from 1", "hello from 0", "2/2 alive")
        pids = [r.pid for r in psutil.Process(proc.pid).children() if "ticker.py" in " ".join(r.cmdline())]
        proc.kill()  # the engine; its guard then ends the ranks
        proc.wait(30)
        screen = term.wait_screen("END UNKNOWN", "engine lost: 2/2 alive when last seen")
        assert " running " not in screen and not re.search("alive(?! when last seen)", screen)
        assert "hello from 0" in screen  # (the output as last seen stays)
        titles = re.findall(r" (\w+) +last seen: pid (\d+)", screen)  # (the panes side by side)
        assert sorted(titles) == sorted(("unknown", str(pid)) for pid in pids), screen
        clock = re.search(r"node 0/1  (\d+:\d\d:\d\d)", screen)[1]
        time.sleep(1.5)  # (the clock stopped where the engine was last seen: it does not go on)
        assert re.search(r"node 0/1  (\d+:\d\d:\d\d)", term.screen())[1] == clock
        term.press("q")
        screen = term.wait_screen("STATUS 1")
        assert "lost the run's engine before its end" in screen.replace("\n", "")
    finally:
        if term is not None:
            term.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_prefix_of_several_served_runs_is_not_taken_for_an_ended_run(tmp_path, runtime):
    """`ranktop stop pre` with served runs pre1 and pre2 and an ended pre0 (final.json under the
    default log root) named the ended one: 'pre0 had already ended', exit 0, and neither served
    run was stopped. It is the usage error naming the served runs, as without pre0."""
    env = {**runtime, "TMPDIR": str(tmp_path)}
    script = tmp_path / "ok.py"
    script.write_text("print('done')\n")
    assert run_ranktop("--headless", "--run-id", "pre0", str(script), env=env).returncode == 0
    procs = [start_headless(tmp_path, env, run_id) for run_id in ("pre1", "pre2")]
    try:
        wait_for(lambda: len([r for r in ls(env) if r["state"] == "running"]) == 2, what="both runs listed")
        several = "'pre' matches several runs: runs are "
        for command in ("stop", "logs", "stacks"):
            done = run_ranktop(command, "pre", env=env)
            assert done.returncode == 2 and done.stdout == "", (command, done.stdout)
            assert done.stderr.startswith(f"ranktop: error: {several}"), (command, done.stderr)
        assert sorted(r["run_id"] for r in ls(env)) == ["pre1", "pre2"]  # nothing was stopped
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            assert proc.wait(30) == 143
            proc.stderr.close()


def test_the_exact_id_of_an_ended_run_is_not_taken_for_a_prefix_of_a_served_one(tmp_path, runtime):
    """`ranktop stop job` with job ended (final.json under the default log root) and job2 served
    stopped job2: the id typed in full named the ended run, and a prefix match won over it. An
    exact id (or run directory) names its run, served or ended, before any prefix does."""
    env = {**runtime, "TMPDIR": str(tmp_path)}
    script = tmp_path / "ok.py"
    script.write_text("print('done')\n")
    assert run_ranktop("--headless", "--run-id", "job", str(script), env=env).returncode == 0
    proc = start_headless(tmp_path, env, "job2")
    try:
        wait_for(lambda: [r for r in ls(env) if r["state"] == "running"], what="job2 listed")
        logs = run_ranktop("logs", "job", env=env)
        assert logs.returncode == 0 and logs.stdout == "[0]:done\n", logs.stdout
        stacks = run_ranktop("stacks", "job", env=env)
        assert stacks.returncode == 1 and "job has ended (succeeded)" in stacks.stderr, stacks.stderr
        stop = run_ranktop("stop", "job", env=env)
        assert stop.returncode == 0 and "job had already ended (succeeded)" in stop.stdout, stop.stdout
        assert [r["run_id"] for r in ls(env)] == ["job2"]  # the served run was not stopped
        assert run_ranktop("stop", "job2", env=env).returncode == 0
        assert proc.wait(30) == 130  # stopped on request
    finally:
        stop_process(proc)
        proc.stderr.close()


SECOND_ATTEMPT = """import os, sys, time
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    print("first attempt", flush=True)
    sys.exit(1)
print("second attempt", flush=True)
while True:
    time.sleep(0.1)
"""


def test_logs_after_a_group_restart_say_where_the_earlier_attempts_are(tmp_path, runtime):
    """A run on its second attempt: `logs` printed that attempt's lines alone, the ended run's
    closing line said `the last MiB of each rank's stdout.log`, and nothing told that an earlier
    attempt had printed other lines into other files. Both now name the attempt shown."""
    env = {**runtime, "TMPDIR": str(tmp_path)}
    script = tmp_path / "twice.py"
    script.write_text(SECOND_ATTEMPT)
    proc = subprocess.Popen(ranktop_cmd("--headless", "--max-restarts", "1", "--run-id", "twice", str(script)),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = tmp_path / f"ranktop-{os.geteuid()}" / "twice"
    earlier = f"ranktop: twice is on attempt_1: the output of earlier attempts is in their log files under {run_dir}\n"
    try:
        wait_for(lambda: (run_dir / "attempt_1" / "0" / "stdout.log").is_file()
                 and (run_dir / "attempt_1" / "0" / "stdout.log").read_text(), what="the second attempt's line")
        logs = run_ranktop("logs", "twice", env=env)
        assert (logs.returncode, logs.stdout, logs.stderr) == (0, "[0]:second attempt\n", earlier)
        follow = subprocess.Popen(ranktop_cmd("logs", "twice", "-f"), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            assert follow.stderr.readline() == earlier and follow.stdout.readline() == "[0]:second attempt\n"
            assert run_ranktop("stop", "twice", env=env).returncode == 0
            assert follow.wait(30) == 0 and proc.wait(30) == 130
        finally:
            stop_process(follow)
            follow.stdout.close()
            follow.stderr.close()
    finally:
        stop_process(proc)
    logs = run_ranktop("logs", "twice", env=env)
    assert logs.stdout == "[0]:second attempt\n"
    assert logs.stderr == ("ranktop: twice has ended (stopped); its engine has left: that was the last MiB of each "
                           "rank's stdout.log and stderr.log of attempt_1, the last of 2 attempts; all its log files "
                           f"are under {run_dir}\n")


BURST = """import os, pathlib, sys, time
print('up', flush=True)
while not pathlib.Path(os.environ['GO']).exists():
    time.sleep(0.05)
sys.stdout.write(''.join(f'burst {i}\\n' for i in range(200000)))  # far more than the 10k lines a rank's ring keeps
"""


def _left_out(stderr: str, run_dir: Path) -> int:
    """The lines `logs` said it left out of rank 0, checking each such line names where they all are."""
    said = re.findall(r"ranktop: burst: (\d+) lines of rank 0 (?:in all )?were not shown: .* all of them are in the "
                      r"log files under (\S+)\n", stderr)
    assert all(where == str(run_dir) for _n, where in said), stderr
    return int(said[-1][0]) if said else 0


def test_logs_say_how_many_lines_went_by_unshown_and_where_they_are(tmp_path, runtime):
    """A rank that printed more than its ring keeps: `logs` printed the newest 10k lines and `logs
    -f` skipped the lines that went by between two pushes, and neither said a word (80k lines
    printed, 40k shown, the file taken for the whole log). Both now say how many lines of which
    rank they left out, and where all of them are."""
    script = tmp_path / "burst.py"
    script.write_text(BURST)
    go = tmp_path / "go"
    run_dir = tmp_path / "logs" / "burst"
    done = run_ranktop("--detach", "--linger", "60", "--nproc-per-node", "1", "--run-id", "burst",
                       "--log-dir", str(tmp_path / "logs"), str(script), env={**runtime, "GO": str(go)})
    assert done.returncode == 0, done.stderr
    (run,) = ls(runtime)
    follow = subprocess.Popen(ranktop_cmd("logs", "burst", "-f"), cwd=ROOT, env=runtime, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert follow.stdout.readline() == "[0]:up\n"  # subscribed
        go.touch()
        out, err = follow.communicate(timeout=60)
        assert follow.returncode == 0 and 1 + out.count("[0]:") + _left_out(err, run_dir) == 200001, err  # (up, then the burst)
        wait_for(lambda: ls(runtime)[0]["state"] == "succeeded", what="the run's end")
        logs = run_ranktop("logs", "burst", env=runtime)
        shown = logs.stdout.count("[0]:")
        assert logs.returncode == 0 and shown < 200001 and shown + _left_out(logs.stderr, run_dir) == 200001, logs.stderr
    finally:
        stop_process(follow)
        run_ranktop("stop", "burst", env=runtime)
        wait_for(lambda: gone(run["pid"]), what="the engine gone")


def test_logs_follow_says_how_the_run_ended(tmp_path, runtime):
    """`logs -f` of a run that failed ended as it does for a run that succeeded, exit 0 and not a
    word: whoever followed it over SSH learnt nothing of the end. It now says the run's state and
    exit status on stderr, and where its log files are (its own status stays 0: it printed all)."""
    go = tmp_path / "go"  # the ranks end once `logs -f` follows them (the end is what it must say)
    failing = (f"import os, sys, time\nprint('up', flush=True)\nwhile not os.path.exists({str(go)!r}):\n"
               "    time.sleep(0.05)\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = start_headless(tmp_path, runtime, "fails", failing, name="fail.py")
    try:
        wait_for(lambda: ls(runtime), what="the run listed")
        follow, seen = _following(runtime, "fails", "[1]:up")
        go.touch()
        out, err = follow.communicate(timeout=60)
        assert (follow.returncode, err) == (
            0, f"ranktop: fails has ended (failed, exit status 1); its log files are under {tmp_path / 'logs' / 'fails'}\n")
        assert "[1]:up" in seen + out
        assert proc.wait(30) == 1
    finally:
        go.touch()
        stop_process(proc)


def _following(env: dict, run: str, line: str) -> tuple[subprocess.Popen, str]:
    """`ranktop logs RUN -f`, started, once it has printed `line` (so it follows the run live), and
    what it printed up to there."""
    follow = subprocess.Popen(ranktop_cmd("logs", run, "-f"), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    seen = b""
    try:
        for _ in polls(30, f"`logs -f` printing {line!r}"):
            if select.select([follow.stdout], [], [], 0.1)[0]:
                chunk = os.read(follow.stdout.fileno(), 1 << 16)  # (unbuffered: select sees all that is left)
                assert chunk, follow.stderr.read()
                seen += chunk
                if line in seen.decode(errors="replace").splitlines():
                    return follow, seen.decode(errors="replace")
    except BaseException:
        follow.kill()
        follow.communicate()
        raise


def test_logs_follow_whose_engine_is_killed_says_so_and_exits_1(tmp_path, runtime):
    """`logs -f` of a run whose engine went away before its end (SIGKILLed) exited 0 without a word,
    as if the run had ended: like attach, it now says the end is unknown and exits 1."""
    proc = start_headless(tmp_path, runtime, "lost")
    try:
        wait_for(lambda: ls(runtime), what="the run listed")
        follow = subprocess.Popen(ranktop_cmd("logs", "lost", "-f"), cwd=ROOT, env=runtime, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert follow.stdout.readline().startswith("[")  # subscribed
        proc.kill()  # the engine; its guard then ends the ranks
        proc.wait(30)
        _out, err = follow.communicate(timeout=30)
        assert follow.returncode == 1, err
        assert err.startswith("ranktop: lost: lost the run's engine before its end (") and err.endswith(
            f"; its log files are under {tmp_path / 'logs' / 'lost'}\n"), err
    finally:
        stop_process(proc)


def test_logs_of_an_ended_run_into_a_pipe_closed_early_exits_0(tmp_path, runtime):
    """`ranktop logs RUN | head` of an ended run whose engine has gone: a traceback
    (BrokenPipeError) and exit 1; as for a served run, it stops quietly, exit 0."""
    env = {**runtime, "TMPDIR": str(tmp_path)}
    script = tmp_path / "many.py"
    script.write_text("for i in range(100000):\n    print('line', i)\n")  # more than a pipe holds
    assert run_ranktop("--headless", "--run-id", "many", str(script), env=env).returncode == 0
    reader = subprocess.Popen(ranktop_cmd("logs", "many"), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert reader.stdout.readline().startswith("[0]:line ")
    reader.stdout.close()  # as head does after its lines
    _out, err = reader.communicate(timeout=30)
    assert reader.returncode == 0 and err == "", err


def test_a_detached_runs_ranks_read_what_attach_types(tmp_path, runtime, monkeypatch):
    """A --detach run's stdin is /dev/null: its ranks read it too, so a breakpoint() met end of
    file at once and pdb quit (BdbQuit, a failed run) before anyone could attach. They read a
    pipe that attach's `i` types into, as under the TUI. Attach learns that the rank waits at
    its prompt (`input_prompt`) from the engine's snapshots."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs

    script = tmp_path / "pdb_rank.py"
    script.write_text("x = 41\nprint('before', flush=True)\nbreakpoint()\nprint('after', x, flush=True)\n")
    done = run_ranktop("--detach", "--linger", "60", "--nproc-per-node", "1", "--run-id", "dbg", "--log-dir",
                       str(tmp_path / "logs"), str(script), env=runtime)
    assert done.returncode == 0, done.stderr
    (run,) = ls(runtime)
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
    engine = RemoteEngine(served_runs()[0].path)
    log = tmp_path / "logs" / "dbg" / "attempt_0" / "0" / "stdout.log"
    try:
        wait_for(lambda: log.exists() and "(Pdb) " in log.read_text(), what="the pdb prompt")
        # The snapshot attach draws from says the rank waits at it (its title: `input (i)`).
        wait_for(lambda: engine.snapshot().ranks[0].input_prompt == "(Pdb)", what="the prompt in the snapshot")
        assert engine.submit(cmd.SendInput(0, "p x\n")).ok
        wait_for(lambda: "41" in log.read_text(), what="pdb's answer")
        assert engine.submit(cmd.SendInput(0, "c\n")).ok
        wait_for(lambda: engine.snapshot().ended, what="the run's end")
        assert engine.snapshot().exit_status == 0 and "after 41" in log.read_text()
    finally:
        engine.close()
        assert run_ranktop("stop", "dbg", env=runtime).returncode == 0
        wait_for(lambda: gone(run["pid"]), what="the background ranktop gone")


def test_typing_into_a_headless_runs_rank_says_where_it_reads(tmp_path, runtime, monkeypatch):
    """A headless run's ranks read ranktop's own stdin (torchrun's way): an attached `i` cannot
    reach them, and says where to type (it said `its stdin is not ranktop's to write`)."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs

    proc = start_headless(tmp_path, runtime, "fg")
    try:
        wait_for(lambda: ls(runtime), what="the run listed")
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
        engine = RemoteEngine(served_runs()[0].path)
        try:
            ack = engine.submit(cmd.SendInput(1, "c\n"))
        finally:
            engine.close()
        assert (ack.ok, ack.message) == (False, "rank 1 reads the stdin of the headless ranktop that started it, "
                                                "as under torchrun: type into that terminal")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


# ----- ranktop's own lines (a restart's separator) through the engine, the socket and an attached pane ---
FORGER = """
import os, sys, time
print("up", os.getpid(), flush=True)
forged = False
while True:
    if not forged and os.path.exists(os.environ["FORGE"]):  # the separator as the test saw it, in its colours
        with open(os.environ["FORGE"], "rb") as f:
            sys.stdout.buffer.write(f.read())
        sys.stdout.flush()
        forged = True
    time.sleep(0.05)
"""


def test_a_ranks_copy_of_the_restart_separator_is_told_from_the_real_one_everywhere(tmp_path, runtime, monkeypatch):
    """A restarted rank's separator went into its output as ordinary bytes: a rank printing the same
    text in the same colours made the same line in the engine, in `ranktop attach` (and so `ranktop
    web`) and in the pane. The real one is ranktop's line, marked out of band all the way; the
    rank's copy is output like any other."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import Connection, RemoteEngine
    from ranktop.core.engine import LocalEngine
    from ranktop.core.output import RanktopLine
    from ranktop.core.server import serve
    from ranktop.tui.app import RanktopApp
    from test_logview import cells, sgr
    from test_tui_app import ticker_agent

    forge = tmp_path / "forge"
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
    engine = LocalEngine(ticker_agent(tmp_path / "logs", FORGER, n=1, env={"FORGE": str(forge)})).start()
    server, problem = serve(engine, ["forged"])
    assert problem is None
    seen = {}

    def pane_rows(log) -> list[str]:
        return [log.render_line(y).text.rstrip() for y in range(log.scrollable_content_region.height)]

    async def body(app, pilot):
        await until(pilot, lambda: app.main.pane(0).log.line_count, what="the rank's first line")
        assert engine.submit(cmd.RestartRank(0)).ok
        log = app.main.pane(0).log
        real_text = await until(pilot, lambda: next((r for r in pane_rows(log) if "(ranktop)" in r), None),
                                what="the separator in the attached pane")
        text = real_text.rstrip("─").rstrip()
        band = text + " " + "─" * (log.text_width - len(text) - 1)
        own = log.get_component_rich_style("logview--ranktop")
        forge.write_bytes(f"{sgr(own)}{band}\x1b[0m\n".encode())
        rows = await until(pilot, lambda: (rows := pane_rows(log)).count(band) == 1 and rows, what="the rank's copy")
        forged, real = rows.index(band), rows.index(band + "─")
        assert real < forged
        forged_cells, real_cells = cells(log.render_line(forged)), cells(log.render_line(real))
        width = log.text_width
        assert forged_cells[:width] == real_cells[:width] and forged_cells[width] != real_cells[width]
        assert real_cells[width] == ("─", real_cells[0][1])  # the band runs through the scrollbar's column
        seen["text"], seen["band"] = text, band

    try:
        app = RanktopApp(RemoteEngine(server.path))
        app.attached = True
        asyncio.run(_drive_attached(app, body))
        text, band = seen["text"].encode(), seen["band"].encode()

        def marks(lines: list[bytes]) -> list[tuple[bool, bool]]:
            """(is it ranktop's line, is it the separator's text) of each line that holds the text."""
            return [(type(line) is RanktopLine, line == text) for line in lines if text in line]

        expected = [(True, True), (False, False)]  # the real one, then the rank's copy (its colours around it)
        assert marks(engine.output_since(0, None)[1]) == expected
        remote = RemoteEngine(server.path)
        try:
            assert marks(remote.output_since(0, None)[1]) == expected
        finally:
            remote.close()
        with Connection(server.path) as conn:
            conn.subscribe([0])
            message, lines = next((m, lines) for m, lines in conn.pushed() if m["type"] == "output")
            assert marks(lines) == expected and message["own"] == [lines.index(text)]
        done = run_ranktop("logs", "forged", env=runtime)
        assert done.returncode == 0, done.stderr
        printed = [line for line in done.stdout.splitlines() if seen["text"] in line]
        assert len(printed) == 1 and band.decode() in printed[0]  # the rank's copy; the separator is no output
    finally:
        engine.close()
        server.close()


def test_attachs_exit_status_is_the_local_tuis(tmp_path, runtime, monkeypatch):
    """`q` then `y` in `ranktop attach` stopped the run and exited 0 (the local TUI, and a headless
    stop, give 130): attach now exits as the local TUI does: 130 for a stop asked for, 0 for a
    detach, 1 for a run that failed (with --exit-on-end); a SIGTERM leaves as a detach, 143, also
    while `o`'s pager is open (it is ended: attach waited for it, however long); a SIGINT, 130."""
    started = tmp_path / "pager.pid"
    pager = tmp_path / "pager.sh"  # a pager that waits, as less does
    pager.write_text(f"#!/bin/sh\necho $$ > {started}.new && mv {started}.new {started}\nexec sleep 60\n")
    pager.chmod(0o755)
    monkeypatch.setenv("PAGER", str(pager))  # (the terminal's shell inherits it)
    proc = start_headless(tmp_path, runtime, "qy")
    term = None
    try:
        wait_for(lambda: ls(runtime), what="the run listed")
        term = ranktop_in_tmux(runtime, "attach qy", "; echo STATUS $?; sleep 30", width=120, height=30)
        term.wait_screen("hello from 1", "hello from 0")
        term.press("q")
        term.wait_screen("Detach (d)")
        term.press("d")  # the run goes on: a clean exit
        term.wait_screen("ranktop: left qy; it runs on", "STATUS 0")
        term.close()
        # SIGTERM (`kill`, `timeout`) leaves as `d` does, 143, and gives the terminal back: it died of
        # its default action in the TUI's alternate screen, mouse reporting on and the cursor hidden.
        term = ranktop_in_tmux(runtime, "attach qy", "; echo STATUS $?; sleep 30", width=120, height=30)
        term.wait_screen("hello from 1", "hello from 0")
        (client,) = psutil.Process(int(term.pane_pid())).children(recursive=True)
        for notice in (signal.SIGUSR1, signal.SIGUSR2):  # (Slurm's warnings: their default action killed it)
            client.send_signal(notice)
        term.press("o")
        wait_for(started.exists, what="the pager started")
        client.send_signal(signal.SIGTERM)
        term.wait_screen("ranktop: left qy; it runs on", "STATUS 143")
        assert not psutil.pid_exists(int(started.read_text()))  # ended, and reaped
        flags = "#{alternate_on} #{mouse_any_flag} #{cursor_flag}"
        assert term._tmux("display", "-p", "-t", "t", flags).split() == ["0", "0", "1"]
        term.close()
        # SIGINT (`kill -INT`, `timeout -s INT`, a Ctrl-C before the TUI reads keys) too, 130: it was
        # a KeyboardInterrupt in Textual's loop, which left as `d` does, exit 0
        term = ranktop_in_tmux(runtime, "attach qy", "; echo STATUS $?; sleep 30", width=120, height=30)
        term.wait_screen("hello from 1", "hello from 0")
        (client,) = psutil.Process(int(term.pane_pid())).children(recursive=True)
        client.send_signal(signal.SIGINT)
        term.wait_screen("ranktop: left qy; it runs on", "STATUS 130")
        term.close()
        term = ranktop_in_tmux(runtime, "attach qy", "; echo STATUS $?; sleep 30", width=120, height=30)
        term.wait_screen("hello from 1", "hello from 0")
        term.press("q")
        term.wait_screen("Stop and quit (y)")
        term.press("y")
        term.wait_screen("STATUS 130")
        assert proc.wait(30) == 130  # (the engine's own status agrees)
        term.close()
        go = tmp_path / "go"  # the ranks end once attach shows them (a headless run's engine leaves at its end)
        fail = (f"import os, sys, time\nprint('up until go', flush=True)\nwhile not os.path.exists({str(go)!r}):\n"
                "    time.sleep(0.05)\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
        failing = start_headless(tmp_path, runtime, "fails", fail, name="fail.py")
        wait_for(lambda: ls(runtime), what="the failing run listed")
        term = ranktop_in_tmux(runtime, "attach fails --exit-on-end", "; echo STATUS $?; sleep 30", width=120, height=30)
        term.wait_screen("up until go")
        go.touch()
        term.wait_screen("STATUS 1")
        assert failing.wait(30) == 1
    finally:
        if term is not None:
            term.close()
        for each in (proc, locals().get("failing")):
            if each is not None and each.poll() is None:
                each.kill()
                each.wait(30)


def test_a_run_served_from_the_runtime_directory_logind_makes_is_listed_for_its_user_only(other_user):
    """$XDG_RUNTIME_DIR as logind makes it, /run/user/UID (0700, the user's, under root's /run):
    the user's run is served from it and listed by their `ranktop ls`; root's, also with the
    user's $XDG_RUNTIME_DIR kept (`sudo -E`), neither lists it nor serves from there."""
    runtime = Path(f"/run/user/{other_user.uid}")
    if not runtime.parent.is_dir() or runtime.exists():
        pytest.skip(f"{runtime.parent} missing, or {runtime} there already")
    runtime.mkdir(mode=0o700)
    os.chown(runtime, other_user.uid, other_user.gid)
    home = Path(tempfile.mkdtemp(prefix="h22-", dir="/tmp"))  # the user's own: logs and the rank's script
    os.chown(home, other_user.uid, other_user.gid)
    (home / "ticker.py").write_text(TICKER)
    theirs = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "TMPDIR": str(home)}
    proc = subprocess.Popen(other_user.ranktop("--headless", "--nproc-per-node", "1", "--shutdown-timeout", "3",
                                               "--run-id", "logind", "--log-dir", str(home / "logs"),
                                               str(home / "ticker.py")),
                            cwd=home, env=theirs, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def their_ls() -> list[dict]:
            done = subprocess.run(other_user.ranktop("ls", "--json"), cwd=home, env=theirs, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        (run,) = wait_for(lambda: [r for r in their_ls() if r["state"] == "running"], what="the run listed")
        assert run["run_id"] == "logind" and run["socket"] == str(runtime / "ranktop" / "logind.sock"), run
        assert mode_of_dir(runtime / "ranktop") == (0o700, other_user.uid)
        roots = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
        try:
            for env in ({**os.environ, "XDG_RUNTIME_DIR": str(roots), "TMPDIR": str(roots)},
                        {**theirs, "TMPDIR": str(roots)}):
                done = run_ranktop("ls", env=env)
                assert (done.returncode, done.stdout, done.stderr) == (0, "no runs are served on this host\n", ""), done
        finally:
            shutil.rmtree(roots, ignore_errors=True)
        stopped = subprocess.run(other_user.ranktop("stop", "logind"), cwd=home, env=theirs, capture_output=True, text=True)
        assert stopped.returncode == 0 and stopped.stdout.strip() == "ranktop: stopped logind", stopped
        assert proc.wait(30) == 130  # stopped on request
        assert f"ranktop: ticker.py stopped on request; logs in {home / 'logs' / 'logind'}" in proc.stderr.read()
        assert their_ls() == []
    finally:
        stop_process(proc)
        proc.stderr.close()
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def mode_of_dir(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return info.st_mode & 0o7777, info.st_uid
