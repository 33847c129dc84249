"""Stack dumps of real ranks: grouping, odd rank out, native and vanishing ranks, the SIGUSR1
fallback, missing ptrace permission, and `ranktop stacks` (core/stacks/, tui/stacks_cli.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import textwrap
from pathlib import Path

import psutil
import pytest
from conftest import PY, ROOT, Running, make_agent, no_ranks_left, ranktop_cmd, read_events, run_ranktop, wait_for
from ranktop.core import spec, stacks
from ranktop.core.agent import LocalAgent
from ranktop.core.client import served_runs
from ranktop.core.layout import MAX_RUNS_OPENED
from ranktop.core.stacks import StackStatus, discovery
from ranktop.core.stats import StatsSampler
from ranktop.tui import stacks_cli

# Rank SPINNER burns CPU in spin(); the others block in wait_for_lock() on a lock that their
# "holder" thread keeps: two different stacks, one of them on CPU.
LOCK_OR_SPIN = """
import os, threading, time
SPINNER = 2
lock = threading.Lock()

def holder():
    with lock:
        time.sleep(3600)

def spin():
    x = 0
    while True:
        x += 1

def wait_for_lock():
    lock.acquire()

if int(os.environ["RANK"]) == SPINNER:
    print("ready", flush=True)
    spin()
threading.Thread(target=holder, name="holder", daemon=True).start()
while not lock.locked():
    time.sleep(0.005)
print("ready", flush=True)
wait_for_lock()
"""

WAIT_HERE = """
import time
def wait_here():
    print("ready", flush=True)  # (from in here: a dump that follows finds the rank in wait_here)
    time.sleep(3600)
wait_here()
"""

# A thread that writes a line to stderr every millisecond, as a progress or logging thread does
# while the main thread waits in a collective: the rank's log never rests. It holds its line
# while the main thread writes a dump (SIGUSR1 blocked in it: faulthandler's handler runs), and
# shares one CPU with it: faulthandler writes a line in nine pieces, and a line of the chatter's
# landing amid them would be read as part of a frame (`step 7<module>`, its rank an odd one out).
# test_a_dump_held_up_halfway_... has lines amid a dump.
CHATTER = """
import os, sys, threading, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
def dumping():
    with open(f"/proc/self/task/{os.getpid()}/status") as f:
        return any(line.startswith("SigBlk:") and int(line[7:], 16) & 1 << 9 for line in f)
def chatter():
    n = 0
    while True:
        n += 1
        if not dumping():
            sys.stderr.write(f"step {n}\\n")
        time.sleep(0.001)
threading.Thread(target=chatter, daemon=True).start()
"""


def wait_ready(agent: LocalAgent, n: int) -> None:
    wait_for(lambda: all(b"ready" in b"".join(agent.output(r)) for r in range(n)), 20, what="ranks ready")


@pytest.fixture(scope="module", autouse=True)
def py_spy_can_attach():
    """Skip (with the reason) where py-spy is missing or may not ptrace, rather than fail."""
    proc = subprocess.Popen([PY, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()
        probe = stacks.dump_pid(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    if probe.status != StackStatus.OK:
        pytest.skip(f"py-spy cannot dump here: {probe.status.value}: {probe.reason} ({probe.hint})")


def test_blocked_ranks_group_and_spinning_rank_is_odd_one_out(tmp_path):
    env = spec.faulthandler_env(True, os.environ)  # (for the SIGUSR1 fallback's dump below)
    with Running(make_agent(tmp_path, LOCK_OR_SPIN, n=3, sampler=StatsSampler(interval=0.1), env=env)) as agent:
        wait_ready(agent, 3)

        def cpu(r: int) -> float:
            return agent.snapshot().ranks[r].cpu_percent or 0.0

        # With a sampler attached, cpu% tells the spinner from the blocked ranks.
        wait_for(lambda: cpu(2) > 20 and cpu(0) < 10 and cpu(1) < 10, 20, what="spinner busy, others idle")
        report = stacks.dump_agent_stacks(agent)
        assert report.ranks[2].cpu_percent > 20 and "cpu " in stacks.rank_facts(report.ranks[2])
        # So does the SIGUSR1 fallback's dump (`u`), which has no py-spy to say `on CPU` or `idle`:
        # its ranks' lines had their pids alone.
        signalled = stacks.signal_agent_report(agent, timeout=20, save=False)
        assert [s.status for s in signalled.ranks] == [StackStatus.OK] * 3, stacks.format_report(signalled)
        assert signalled.ranks[2].cpu_percent > 20 and signalled.ranks[0].cpu_percent < 10
        assert "cpu " in stacks.rank_facts(signalled.ranks[2])

        assert [s.status for s in report.ranks] == [StackStatus.OK] * 3
        blocked, spinning = report.groups
        assert blocked.ranks == (0, 1) and not blocked.odd
        assert blocked.frames[-1].name == "wait_for_lock"
        assert spinning.ranks == (2,) and spinning.odd and report.odd_ranks == [2]
        assert spinning.frames[-1].name == "spin"
        # py-spy tells a thread on CPU from an idle one: spinning and blocked look different.
        by_rank = {s.rank: s for s in report.ranks}
        assert by_rank[2].main.active and not by_rank[0].main.active
        assert spinning.active == (2,) and blocked.active == ()
        # The merged tree forks at the first frame that differs (<module> calls from two lines).
        assert report.tree.ranks == [0, 1, 2]
        assert sorted(tuple(c.ranks) for c in report.tree.children) == [(0, 1), (2,)]
        # Other threads are kept: the lock holder in ranks 0 and 1, which the spinner lacks.
        assert [(g.name, g.ranks, g.odd_words) for g in stacks.other_thread_groups(report)] == [
            ("holder", (0, 1), "not in rank 2")]

        text = stacks.format_report(report, threads=True)
        assert "rank 2 (1)  <-- ODD ONE OUT" in text and "odd one out: rank 2" in text
        assert "thread 'holder' in ranks 0-1  <-- not in rank 2" in text
        # Saved under the run dir, with an event.
        assert report.saved_txt.startswith(os.path.join(agent.run_dir, "stacks"))
        assert os.path.exists(report.saved_txt) and os.path.exists(report.saved_json)
        with open(report.saved_json) as f:
            assert json.load(f)["odd_ranks"] == [2]
        dumped = [e for e in read_events(agent.run_dir) if e["event"] == "stacks_dumped"]
        assert dumped[-1]["odd_ranks"] == [2] and dumped[-1]["file"] == report.saved_txt

        one = stacks.dump_agent_stacks(agent, local_ranks=[1])
        assert [s.rank for s in one.ranks] == [1] and not one.odd_ranks

        # The same from another terminal: by run dir, by log root, by a rank's pid.
        cli = run_ranktop("stacks", agent.run_dir, timeout=30)
        assert cli.returncode == 0, cli.stderr
        assert "odd one out: rank 2" in cli.stdout and "wait_for_lock" in cli.stdout
        root = run_ranktop("stacks", "--threads", str(tmp_path), timeout=30)
        assert root.returncode == 0 and "thread 'holder'" in root.stdout
        pid = agent.snapshot().ranks[2].pid
        single = run_ranktop("stacks", "--json", str(pid), timeout=30)
        data = json.loads(single.stdout)
        assert [r["rank"] for r in data["ranks"]] == [2]
        assert data["groups"][0]["frames"][-1]["name"] == "spin"
        assert sum(e["event"] == "stacks_dumped" for e in read_events(agent.run_dir)) >= 5


def test_native_rank_is_listed_as_native_and_python_under_it_is_found(tmp_path):
    with Running(make_agent(tmp_path, n=2, entrypoint="/bin/sleep", args=("60",))) as agent:
        wait_for(lambda: all(r.pid for r in agent.snapshot().ranks), what="ranks started")
        report = stacks.dump_agent_stacks(agent)
        assert [s.status for s in report.ranks] == [StackStatus.NATIVE] * 2
        assert all(s.threads == () and "native" in s.reason for s in report.ranks)
        assert not report.groups and "native binary rank" in stacks.format_report(report)
        # A bare pid says the same through py-spy's own error.
        bare = stacks.dump_pids({0: agent.snapshot().ranks[0].pid})
        assert bare.ranks[0].status == StackStatus.NOT_PYTHON

    # A shell script rank that runs Python: the Python child is dumped in its place.
    (tmp_path / "wait.py").write_text(WAIT_HERE)
    script = f"{PY} -u {tmp_path / 'wait.py'}; echo done"  # not the last command: sh forks for it
    with Running(make_agent(tmp_path / "sh", n=1, entrypoint="/bin/sh", args=("-c", script))) as agent:
        wait_ready(agent, 1)
        (rank,) = stacks.dump_agent_stacks(agent).ranks
        assert rank.status == StackStatus.OK and rank.dumped_pid not in (None, rank.pid)
        assert rank.main.frames[-1].name == "wait_here"

    # A --no-python rank that is a script with a python shebang is itself the Python process.
    shebang = tmp_path / "shebang.py"
    shebang.write_text(f"#!{PY} -u\n{WAIT_HERE}")
    shebang.chmod(0o755)
    with Running(make_agent(tmp_path / "shebang", n=1, entrypoint=str(shebang), args=())) as agent:
        wait_ready(agent, 1)
        assert agent.snapshot().ranks[0].native
        (rank,) = stacks.dump_agent_stacks(agent).ranks
        assert rank.status == StackStatus.OK and rank.dumped_pid is None


def test_rank_that_exits_during_the_dump_gets_a_clean_status():
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(0.3)"])
    seen = set()
    while proc.poll() is None:  # dump until it is gone: whatever moment we catch, no exception
        (s,) = stacks.dump_pids({0: proc.pid}).ranks
        seen.add(s.status)
        assert s.status == StackStatus.OK or s.reason
    (s,) = stacks.dump_pids({0: proc.pid}).ranks
    assert s.status == StackStatus.GONE and "exited" in s.reason
    assert seen <= {StackStatus.OK, StackStatus.GONE, StackStatus.NOT_PYTHON, StackStatus.FAILED}

    zombie = subprocess.Popen([PY, "-c", "pass"])
    wait_for(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, what="zombie")
    (z,) = stacks.dump_pids({5: zombie.pid}).ranks
    assert (z.rank, z.status, z.reason) == (5, StackStatus.GONE, "process exited (not reaped yet)")
    zombie.wait()
    assert "not dumped:" in stacks.format_report(stacks.dump_pids({5: zombie.pid}))


def test_sigusr1_fallback_writes_the_stack_into_stderr_log(tmp_path):
    env = spec.faulthandler_env(True, os.environ)
    with_child = "import subprocess\nchild = subprocess.Popen(['sleep', '3600'])\n" + CHATTER + WAIT_HERE
    with Running(make_agent(tmp_path, with_child, n=2, env=env)) as agent:
        wait_ready(agent, 2)
        assert stacks.signal_dump(agent) == {0: "sent", 1: "sent"}
        log = os.path.join(agent.attempt_dir(), "1", "stderr.log")

        def dumped() -> bool:
            with open(log) as f:
                text = f.read()
            return "most recent call first" in text and "in wait_here" in text

        wait_for(dumped, 10, what="faulthandler's stack in stderr.log")
        assert all(r.state.alive for r in agent.snapshot().ranks)  # a dump, not a death
        assert any(e["event"] == "stacks_signalled" for e in read_events(agent.run_dir))
        # The same dumps, read back and grouped: the view without ptrace. The ranks never stop
        # writing, so their logs never rest for 0.25 s: each dump was taken when the timeout came
        # (3 s; here 30 s). It is taken once faulthandler's handler has returned and the agent
        # has read past it.
        report = stacks.signal_agent_report(agent, timeout=30)
        assert report.elapsed_s < 10, report.elapsed_s
        assert [s.status for s in report.ranks] == [StackStatus.OK] * 2, stacks.format_report(report)
        (group,) = report.groups
        assert group.ranks == (0, 1) and group.frames[-1].name == "wait_here" and not report.odd_ranks
        assert os.path.exists(report.saved_txt)
        # Each rank's line names its child process, as py-spy's dump does (it named none).
        (child,) = psutil.Process(report.ranks[1].pid).children()
        assert stacks.rank_facts(report.ranks[1]).endswith(f", child {child.pid} sleep")
    # Nothing of the dump came after it was taken: the whole log, read once the agent has read the
    # ranks' pipes to their end, holds the same stacks (a later block of a thread replaces its earlier).
    with open(log) as f:
        assert stacks.parse_faulthandler(f.read()) == report.ranks[1].threads

    # Without faulthandler the signal would kill the process: it is not sent.
    plain = subprocess.Popen([PY, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE)
    try:
        plain.stdout.readline()
        assert stacks.signal_pids({0: plain.pid})[0].startswith("skipped")
        assert plain.poll() is None
    finally:
        plain.kill()
        plain.wait()


# A rank paused mid-dump: its handler writes the inner frames, then, 0.1 s later, the outer ones
# (past the 30 ms the reader used to wait, and short of its 0.25 s with room for a busy box).
PAUSED_DUMP = r"""
import os, signal, time
def dump(signum, frame):
    os.write(2, b'Current thread 0x00007f0000000001 (most recent call first):\n'
                b'  File "/t/x.py", line 3 in inner\n')
    time.sleep(0.1)
    os.write(2, b'  File "/t/x.py", line 9 in <module>\n')
signal.signal(signal.SIGUSR1, dump)
print("ready", flush=True)
time.sleep(60)
"""


def _signal_dump_of(tmp_path, script: str, timeout: float = 20) -> tuple[stacks.StackReport, Path]:
    """The SIGUSR1 dump of one process running `script` (it prints a line once its handler is
    set), read back from its stderr log as a rank's is; and that log."""
    log = tmp_path / "stderr.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, stderr=err)
    try:
        proc.stdout.readline()
        return stacks.signal_report({0: proc.pid}, {0: str(log)}, timeout=timeout), log
    finally:
        proc.kill()
        proc.wait()


def test_a_dump_paused_midway_is_read_whole(tmp_path):
    """faulthandler writes a line at a time, and on a busy box a rank (or the agent that logs its
    stderr) paused mid-dump for longer than the 30 ms the reader waited: the stack came cut, its
    outer frames missing, and a rank stopped where the others were read as the odd one out."""
    report, _ = _signal_dump_of(tmp_path, PAUSED_DUMP)
    assert [f.name for f in report.ranks[0].main.frames] == ["<module>", "inner"], stacks.format_report(report)


# A rank whose log never rests and whose dump is held up halfway: its chatter thread appends a
# line to the log every millisecond, while faulthandler writes into a one-page pipe that the
# rank's relay thread copies into the log a line at a time, holding still for 0.5 s once the dump
# has begun (as a slow reader of the rank's pipe, or a busy box, leaves a dump half-written).
# Eight threads wait 30 calls deep (a dump of ~20 KiB: the handler waits on the pipe), and a
# helper thread blocks every signal, as native libraries start theirs.
HELD_UP_DUMP = r"""
import faulthandler, os, signal, sys, threading, time
log = os.dup(2)
r, w = os.pipe()
os.set_blocking(r, True)
import fcntl; fcntl.fcntl(w, 1031, 4096)  # F_SETPIPE_SZ
os.dup2(w, 2)
faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
up = threading.Semaphore(0)

def relay():
    held, rest = False, b""
    while chunk := os.read(r, 65536):
        lines, _, rest = (rest + chunk).rpartition(b"\n")
        if lines:
            os.write(log, lines + b"\n")
        if not held and b"(most recent call first):" in lines:
            held = True
            time.sleep(0.5)

def chatter():
    for n in range(10**9):
        os.write(log, b"step %d\n" % n)
        time.sleep(0.001)

def helper():
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    up.release()
    time.sleep(3600)

def deep(n):
    if n:
        return deep(n - 1)
    up.release()
    time.sleep(3600)

for target, args in [(relay, ()), (chatter, ()), (helper, ())] + [(deep, (30,))] * 8:
    threading.Thread(target=target, args=args, daemon=True).start()
for _ in range(9):
    up.acquire()

def wait_here():
    print("ready", flush=True)
    time.sleep(3600)
wait_here()
"""


def test_a_dump_held_up_halfway_in_a_log_that_never_rests_is_read_whole_at_its_end(tmp_path):
    """A rank that writes without a pause never left its log unchanged for 0.25 s, so its dump
    was taken when the timeout came (3 s; here 30 s). It is taken once faulthandler's handler has
    returned, and not before: lines that are not the dump's keep coming while the dump is held
    up, and the dump comes out whole (the main thread, written last, included)."""
    report, log = _signal_dump_of(tmp_path, HELD_UP_DUMP, timeout=30)
    (rank,) = report.ranks
    assert rank.status == StackStatus.OK, stacks.format_report(report)
    assert report.elapsed_s < 10, report.elapsed_s  # (the quiet rule alone: 30 s)
    assert [f.name for f in rank.main.frames] == ["<module>", "wait_here"]
    assert len(rank.threads) == 12  # main, relay, chatter, helper and the eight deep ones
    assert sorted(len(t.frames) for t in rank.threads)[-8:] == [34] * 8  # 31 deep(), 3 of threading's
    text = log.read_text()
    dump = text[text.index("Thread 0x"):text.index(" in wait_here\n")]
    assert re.search(r"^step \d+$", dump, re.M)  # the chatter's lines came amid the dump


# A progress bar redrawn with '\r' (tqdm's, examples/demo_train.py's) ends no line, and it is
# redrawn ten times a second: one redraw comes between the reader noting where the log ends and
# the signal. Here always: SIGUSR1 is held back until it is pending, the bar redrawn, then let in.
BAR_THEN_DUMP = r"""
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
def wait_here():
    while signal.SIGUSR1 not in signal.sigpending():
        time.sleep(0.005)
    sys.stderr.write('\repoch 1 |####....| 5/100 [ 9.9 it/s]')
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})  # faulthandler writes now
    time.sleep(60)
print("ready", flush=True)
wait_here()
"""


def test_a_dump_that_lands_on_a_progress_bars_open_line_is_read(tmp_path):
    """The dump's first line came after the bar, `...| 5/100 [ 9.9 it/s]Current thread 0x...
    (most recent call first):`, and only a header at a line's start was read: the SIGUSR1
    fallback of demo_train's 3 ranks said `no stack in its log within 3s` for 1 to 3 of them."""
    report, log = _signal_dump_of(tmp_path, BAR_THEN_DUMP)
    assert "5/100 [ 9.9 it/s]Current thread 0x" in log.read_text()
    assert report.ranks[0].status == StackStatus.OK, stacks.format_report(report)
    assert [f.name for f in report.ranks[0].main.frames][:2] == ["<module>", "wait_here"]  # (then signal.py's wrapper)


def test_sigusr1_fallback_with_pty_reads_the_dump_from_stdout_log(tmp_path):
    # With a pseudo-terminal, stderr shares the terminal with stdout: there is no stderr.log.
    env = spec.faulthandler_env(True, os.environ)
    with Running(make_agent(tmp_path, CHATTER + WAIT_HERE, n=2, env=env, pty=True)) as agent:
        wait_ready(agent, 2)
        report = stacks.signal_agent_report(agent, timeout=30)  # (ranks that never stop writing: ends at the dumps)
        assert report.elapsed_s < 10, report.elapsed_s
        assert [s.status for s in report.ranks] == [StackStatus.OK] * 2, stacks.format_report(report)
        assert report.groups[0].frames[-1].name == "wait_here"
        assert not os.path.exists(os.path.join(agent.attempt_dir(), "0", "stderr.log"))


def test_faulthandler_env_chains_to_the_shadowed_sitecustomize(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.update(spec.faulthandler_env(True, env))
    assert env["PYTHONPATH"] == spec.BOOT_DIR + os.pathsep + str(tmp_path)
    assert spec.faulthandler_env(False, env) == {}
    assert spec.faulthandler_env(True, {})["PYTHONPATH"] == spec.BOOT_DIR  # no empty entry
    probe = textwrap.dedent(f"""
        import json, os, sys, signal
        from ranktop.core.stacks import catches_signal
        print(json.dumps([os.environ.get("CHAINED"), sys.modules["sitecustomize"].__file__,
                          {spec.BOOT_DIR!r} in sys.path, catches_signal(os.getpid(), signal.SIGUSR1)]))
    """)
    out = subprocess.run([PY, "-c", probe], env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    chained, site, boot_on_path, catches = json.loads(out.stdout)
    assert (chained, site, boot_on_path, catches) == ("yes", str(tmp_path / "sitecustomize.py"), False, True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to drop privileges")
def test_no_ptrace_permission_says_how_to_get_it(monkeypatch):
    # py-spy run as `nobody` against our process: the kernel refuses, as without SYS_PTRACE.
    folder = tempfile.mkdtemp(prefix="ranktop-spy-")
    try:
        os.chmod(folder, 0o755)
        spy = os.path.join(folder, "py-spy")
        shutil.copy(stacks.find_py_spy(), os.path.join(folder, "py-spy.bin"))
        with open(spy, "w") as f:
            f.write(f'#!/bin/sh\nexec setpriv --reuid=65534 --regid=65534 --clear-groups {folder}/py-spy.bin "$@"\n')
        os.chmod(spy, 0o755)
        monkeypatch.setenv("RANKTOP_PY_SPY", spy)
        proc = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
        try:
            (s,) = stacks.dump_pids({0: proc.pid}).ranks
        finally:
            proc.kill()
            proc.wait()
    finally:
        shutil.rmtree(folder)
    assert s.status == StackStatus.NO_PERMISSION
    assert "SYS_PTRACE" in s.hint and "ptrace_scope" in s.hint


@pytest.mark.skipif(not shutil.which("strace") or not shutil.which("timeout"), reason="needs strace and timeout")
def test_a_rank_another_tracer_holds_is_said_so_and_another_dumps_hold_is_waited_out(tmp_path):
    """Two dumps of one rank at once (two `ranktop stacks`): py-spy cannot suspend a process that
    another tracer holds and says only EPERM, which read `no-permission` with the ptrace hint. A
    tracer that stays (strace here, a debugger) is named; another py-spy's hold is waited out, within
    the dump's time, and the dump made."""
    from ranktop.core.stacks.procs import tracer_of

    strace = shutil.which("strace")
    fake_spy = tmp_path / "py-spy"  # another dump's py-spy, as its tracer's name says: strace by that name
    fake_spy.symlink_to(strace)
    proc = subprocess.Popen([PY, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE)
    tracers = []
    try:
        proc.stdout.readline()
        tracers.append(subprocess.Popen([strace, "-p", str(proc.pid), "-o", os.devnull], stderr=subprocess.DEVNULL))
        wait_for(lambda: tracer_of(proc.pid) == (tracers[0].pid, "strace"), what="strace attached")
        (traced,) = stacks.dump_pids({0: proc.pid}).ranks
        tracers[0].terminate()  # (strace lets go on SIGTERM)
        tracers[0].wait(10)
        # it lets go of its own 0.7 s after it starts: py-spy's first try meets it
        tracers.append(subprocess.Popen(["timeout", "0.7", str(fake_spy), "-p", str(proc.pid), "-o", os.devnull],
                                        stderr=subprocess.DEVNULL))
        wait_for(lambda: (tracer_of(proc.pid) or (0, ""))[1] == "py-spy" or tracers[1].poll() is not None,
                 what="the other py-spy attached")
        (waited,) = stacks.dump_pids({0: proc.pid}).ranks
    finally:
        for tracer in tracers:
            tracer.terminate()  # (timeout passes it on to its strace)
            tracer.wait(10)
        proc.kill()
        proc.wait()
    assert (traced.status, traced.reason) == (StackStatus.FAILED, f"traced by another process, strace (pid "
                                              f"{tracers[0].pid}): py-spy cannot suspend it while it is"), traced
    assert "strace's Ctrl-C" in traced.hint
    assert waited.status == StackStatus.OK, waited


@pytest.mark.parametrize("args", [
    ("stacks", "/no/such/dir"), ("stacks", "999999999"), ("stacks", "--bogus", "1"),
    ("stacks", "not a pid"), ("stacks", "/"),
    ("stacks", "1" * 30), ("stacks", "9" * 5000), ("stacks", "²"),  # OverflowError, ValueError before
])
def test_stacks_cli_bad_input_is_one_line_and_exit_2(args):
    out = run_ranktop(*args)
    assert out.returncode == 2, out
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("ranktop: error: "), out.stderr


def test_stacks_cli_against_a_ranktop_process_and_the_signal_fallback(tmp_path, capsys):
    script = tmp_path / "wait.py"
    script.write_text(WAIT_HERE)
    cmd = ranktop_cmd("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), "--run-id", "r1",
                      "--env", "RANKTOP_FAULTHANDLER=1", "--env", f"PYTHONPATH={spec.BOOT_DIR}", str(script))
    ranktop = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for _ in range(2):
            assert "ready" in ranktop.stdout.readline()
        served = next(run for run in served_runs() if run.run_id == "r1")
        out = run_ranktop("stacks", str(ranktop.pid), timeout=30)
        assert out.returncode == 0 and "ranks 0-1 (2)" in out.stdout and "wait_here" in out.stdout, out
        # The dump is saved in the run dir found from the ranks' environment.
        assert os.listdir(tmp_path / "logs" / "r1" / "stacks")

        # No ptrace: SIGUSR1, and the grouped view read back from the stderr logs.
        sig = run_ranktop("stacks", "--signal", str(tmp_path / "logs"), timeout=30)
        assert sig.returncode == 0 and "ranks 0-1 (2)" in sig.stdout and "wait_here (wait.py:" in sig.stdout, sig
        log = tmp_path / "logs" / "r1" / "attempt_0" / "0" / "stderr.log"
        wait_for(lambda: "in wait_here" in log.read_text(), 10, what="stack in stderr.log")
    finally:
        ranktop.send_signal(signal.SIGTERM)
        ranktop.communicate(timeout=30)
    ended = run_ranktop("stacks", str(tmp_path / "logs" / "r1"))
    # (its final.json says how it ended: stopped, by the SIGTERM above)
    assert ended.returncode == 1 and ended.stderr == ("ranktop stacks: r1 has ended (stopped); its engine has left: "
                                                      "no ranks to dump\n")
    # A stacks that asked as the run ended (its engine gone before it answered) says the same, from
    # the final.json that engine left: it said "the run's engine went away", as for one killed.
    capsys.readouterr()
    asked = argparse.Namespace(no_save=False, native=False, signal=False, json=False)
    assert stacks_cli._through_engine(served, asked) == 1
    assert capsys.readouterr().err == ended.stderr


@pytest.mark.parametrize("catches,status", [(False, 1), (True, 0)])
def test_stacks_signal_to_a_pid_with_no_run_to_read_back_exits_1_unless_one_was_sent(catches, status):
    # A process that is no rank of a run here: the signal is all there is (its stacks go to its
    # stderr). Skipped, as one that does not catch SIGUSR1 is, nothing was sent: it exited 0.
    setup = "import faulthandler, signal; faulthandler.register(signal.SIGUSR1); " if catches else ""
    proc = subprocess.Popen([PY, "-c", f"{setup}import time; print('ready', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        proc.stdout.readline()
        out = run_ranktop("stacks", "--signal", str(proc.pid))
    finally:
        proc.kill()
        proc.wait()
    what = "sent" if catches else "skipped: it does not handle SIGUSR1"
    assert out.returncode == status and f"rank 0 (pid {proc.pid}): {what}" in out.stdout, out
    # Where the stacks went is said only of a signal sent (it followed a skip too), and a skip
    # names what reads them instead.
    assert ("the stacks go to each rank's stderr" in out.stdout) == catches, out
    assert ("without --signal, py-spy reads" in out.stdout) != catches, out


def test_stacks_cli_without_a_target_uses_the_default_log_directory(tmp_path):
    root = tmp_path / f"ranktop-{os.geteuid()}"
    none_there = (f"ranktop: error: no target given and no runs in {root}: "
                  "give a run directory, a log directory or a pid")
    empty = run_ranktop("stacks", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert empty.returncode == 2 and empty.stdout == ""
    assert empty.stderr.strip() == none_there
    # The root an earlier run made, emptied since: no runs either (it was `bad target 'ROOT'`, a
    # target the user never gave)
    root.mkdir()
    emptied = run_ranktop("stacks", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert emptied.returncode == 2 and emptied.stderr.strip() == none_there, emptied.stderr
    run = root / "r1"
    run.mkdir()
    (run / "events.jsonl").write_text("")
    ended = run_ranktop("stacks", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert ended.returncode == 1 and ended.stderr == no_ranks_left(run), ended.stderr


def test_stacks_cli_does_not_import_textual():
    code = "import sys, ranktop.tui.stacks_cli, ranktop.core.stacks; sys.exit('textual' in sys.modules)"
    assert subprocess.run([PY, "-c", code], cwd=ROOT).returncode == 0


# A C call that keeps the GIL (ctypes.PyDLL does not release it), one that releases it, and a
# rank waiting on the child it started: py-spy shows only `pause` or `Popen._try_wait`.
IN_C = """
import ctypes, subprocess, sys
def hold_gil():
    ctypes.PyDLL(None).pause()
def release_gil():
    ctypes.CDLL(None).pause()
def wait_on_child():
    subprocess.run(["sleep", "3600"])
print("ready", flush=True)
{"hold": hold_gil, "release": release_gil, "child": wait_on_child}[sys.argv[1]]()
"""


def _dumped_in(proc: subprocess.Popen, innermost: str, *, children: bool = False) -> stacks.RankStack:
    """Dump `proc` until its main thread is in `innermost` (and, if asked, its child is up)."""
    found = {}

    def there() -> bool:
        (s,) = stacks.dump_pids({0: proc.pid}).ranks
        found["s"] = s
        names = [f.name for f in s.main.frames] if s.main else []
        return innermost in names and (bool(s.children) or not children)

    wait_for(there, 20, what=f"pid {proc.pid} in {innermost}")
    return found["s"]


def test_a_c_call_holding_the_gil_and_a_wait_on_a_child_process_are_named():
    """The stack alone read the same for a C call that kept the GIL and one that let it go, and
    a rank in `subprocess.run` did not say what it waited on."""
    procs = {mode: subprocess.Popen([PY, "-c", IN_C, mode], stdout=subprocess.PIPE) for mode in ("hold", "release", "child")}
    try:
        for proc in procs.values():
            proc.stdout.readline()
        held = _dumped_in(procs["hold"], "hold_gil")
        released = _dumped_in(procs["release"], "release_gil")
        waiting = _dumped_in(procs["child"], "wait_on_child", children=True)
        (child,) = psutil.Process(procs["child"].pid).children()
    finally:
        for proc in procs.values():
            for kid in psutil.Process(proc.pid).children():
                kid.kill()
            proc.kill()
            proc.wait()
    assert held.main.owns_gil and "idle, holds the GIL" in stacks.rank_facts(held)
    assert "GIL" not in stacks.rank_facts(released)
    assert waiting.children == (f"{child.pid} sleep",)
    assert stacks.rank_facts(waiting).endswith(f", child {child.pid} sleep")
    assert f"child {child.pid} sleep" in stacks.format_report(stacks.build_report([waiting], 0, 0))


def test_a_paused_rank_is_dumped_as_it_stands_and_said_to_be_paused():
    """A rank stopped by a signal (`x` STOP, kill -STOP, SIGTTIN) was `failed: Failed to get stack
    traces` (py-spy cannot suspend a stopped process), and `--signal` waited 3 s for a dump it could
    not write, then blamed a Python handler for SIGUSR1."""
    code = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1)\n" + WAIT_HERE
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()
        _dumped_in(proc, "wait_here")
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, what="stopped")
        (paused,) = stacks.dump_pids({0: proc.pid}).ranks
        (native,) = stacks.dump_pids({0: proc.pid}, native_frames=True).ranks
        signalled = stacks.signal_pids({0: proc.pid})
        pending = int(re.search(r"ShdPnd:\s*(\w+)", Path(f"/proc/{proc.pid}/status").read_text())[1], 16)
    finally:
        proc.kill()
        proc.wait()
    assert paused.status == StackStatus.OK and paused.paused, paused
    assert [f.name for f in paused.main.frames][-1:] == ["wait_here"]
    assert stacks.rank_facts(paused) == f"pid {proc.pid}, paused (stopped by a signal)"
    assert (native.status, native.reason) == (StackStatus.FAILED, "paused (stopped by a signal): py-spy reads "
                                              "no C frames of a stopped process"), native
    # Not signalled: its handler would write the dump once it is continued, long after the read
    assert signalled == {0: "skipped: paused (stopped by a signal): it runs no handler until it is continued"}
    assert not pending & 1 << (signal.SIGUSR1 - 1)


def test_ranks_not_dumped_for_one_reason_share_one_line_and_one_hint(monkeypatch):
    """Eight ranks without py-spy (or ptrace) were eight copies of the same three-line hint."""
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        pids = {r: p.pid for r, p in enumerate(sleepers)}
        native = stacks.dump_pids(pids, native=pids)  # binaries: a gdb hint with each one's pid
        lone = stacks.dump_pids({5: sleepers[0].pid}, native=[5])
        monkeypatch.setenv("RANKTOP_PY_SPY", "/no/such/py-spy")
        missing = stacks.dump_pids(pids)
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
    listed = ", ".join(str(p.pid) for p in sleepers)
    text = stacks.format_report(missing)
    assert f"   ranks 0-2 (pids {listed}): no-py-spy: py-spy not found" in text
    assert text.count("hint: ") == 1 and text.count("py-spy not found") == 1
    (group,) = stacks.problem_groups(native)
    assert [s.rank for s in group.ranks] == [0, 1, 2] and group.hint == "for native frames: gdb -p <pid> -batch " \
                                                                         "-ex 'thread apply all bt'"
    (one,) = stacks.problem_groups(lone)  # a rank alone keeps its own pid in the hint
    assert one.who == f"rank 5 (pid {sleepers[0].pid})" and f"gdb -p {sleepers[0].pid} " in one.hint
    assert stacks.rank_list([]) == "no ranks"  # the tree's title with no rank dumped: it read `ranks `


def test_a_dump_that_cannot_be_saved_says_so(tmp_path):
    """A run directory deleted under a live run (or a full disk) lost the dump's files without a
    word: the view said nothing of a file, the user went looking for one."""
    with Running(make_agent(tmp_path, WAIT_HERE, n=1)) as agent:
        wait_ready(agent, 1)
        shutil.rmtree(agent.run_dir)
        report = stacks.dump_agent_stacks(agent)
        assert report.ranks[0].status == StackStatus.OK and report.saved_txt is None
        assert report.save_error == f"not saved in {agent.run_dir}/stacks: No such file or directory"
        assert stacks.format_report(report).splitlines()[1] == report.save_error
    ended = stacks.dump_agent_stacks(agent)  # the run is over: its directory is let go
    assert ended.save_error == "not saved: the run has ended" and ended.ranks[0].status == StackStatus.GONE


IN_PAUSE = """
import ctypes
def wait_in_c():
    ctypes.CDLL(None).pause()
print("ready", flush=True)
wait_in_c()
"""


def test_native_frames_show_the_c_call_and_ranks_stopped_there_still_group():
    """Only Python frames were shown: a rank waiting in gloo or a C library showed the Python
    call that entered it, never where it waited. With the C frames, a frame py-spy has no symbol
    for is named by its address, which differs per process: it is `??`, so that the ranks group."""
    procs = [subprocess.Popen([PY, "-c", IN_PAUSE], stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for proc in procs:
            proc.stdout.readline()
        pids = {r: p.pid for r, p in enumerate(procs)}
        found = {}

        def in_pause() -> bool:
            found["report"] = report = stacks.dump_pids(pids, native_frames=True)
            return all(s.main and s.main.frames[-1].name.endswith("pause") for s in report.ranks)

        wait_for(in_pause, 30, what="both in pause(), with C frames")
        python_only = stacks.dump_pids(pids)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    report = found["report"]
    (group,) = report.groups
    assert group.ranks == (0, 1) and report.native_frames and not python_only.native_frames
    innermost = group.frames[-1]
    assert innermost.short_filename.startswith("libc") and innermost.label == f"{innermost.name} ({innermost.short_filename})"
    assert "wait_in_c" in [f.name for f in group.frames]
    assert not any(f.name.startswith("0x") for f in group.frames)
    assert python_only.groups[0].frames[-1].name == "wait_in_c"
    assert re.match(r"stacks at \S+ \(\d+\.\d\ds, with C frames\): 2 of 2 ranks", stacks.format_report(report))


def test_stacks_cli_native_is_not_for_the_signal_fallback():
    out = run_ranktop("stacks", "--native", "--signal", "1")
    assert out.returncode == 2 and out.stderr == ("ranktop: error: --native needs py-spy: --signal's faulthandler "
                                                  "prints Python frames only\n"), out


def test_a_rank_waiting_for_input_says_so_among_its_facts(tmp_path):
    """The grid titles a rank at a prompt `input (i)`; its stack view said only `idle`."""
    code = "import sys\nprint('went on', input('Continue? '), flush=True)\n"
    with Running(make_agent(tmp_path, code, n=1)) as agent:
        wait_for(lambda: agent.snapshot().ranks[0].input_prompt, what="the rank at its prompt")
        (rank,) = stacks.dump_agent_stacks(agent, save=False).ranks
        assert rank.status == StackStatus.OK and "waits for input at Continue?" in stacks.rank_facts(rank)


STUCK_PREFETCH = str(ROOT / "tests" / "ranks" / "stuck_prefetch.py")


def stuck_prefetch_agent(tmp_path, **kw) -> LocalAgent:
    """Three ranks of tests/ranks/stuck_prefetch.py: rank 2's prefetch thread is the culprit."""
    return make_agent(tmp_path, n=3, args=("-u", STUCK_PREFETCH), **kw)


def test_other_threads_stopped_elsewhere_or_missing_are_odd_and_listed_first(tmp_path):
    """The other threads were listed by rank, none marked: the prefetch thread stuck in rank 2's
    storage read (the culprit: rank 2's main thread only waits for it) came after the ranks that
    were fine; and `ranktop stacks` listed the odd main-thread group after the majority, where the
    TUI lists it first."""
    with Running(stuck_prefetch_agent(tmp_path)) as agent:
        wait_ready(agent, 3)
        report = stacks.dump_agent_stacks(agent)
        assert report.odd_ranks == [2] and [g.ranks for g in report.groups_odd_first] == [(2,), (0, 1)]
        groups = stacks.other_thread_groups(report)
        assert [(g.name, g.ranks, g.odd_words) for g in groups] == [
            ("prefetch", (2,), "ODD ONE OUT"),  # stopped elsewhere than in the others
            ("writer", (0, 1), "not in rank 2"),  # a thread some ranks lack
            ("prefetch", (0, 1), ""),
        ]
        assert "fetch_from_storage" in [f.name for f in groups[0].frames] and not groups[0].missing
        assert any(f.name.endswith("put") for f in groups[2].frames)  # the others' wait on a full queue
        # The prefetch threads' call tree forks where rank 2's went elsewhere.
        tree = stacks.thread_tree(report, "prefetch")
        assert tree.ranks == [0, 1, 2]
        forks = _fork(tree)
        assert sorted(tuple(c.ranks) for c in forks) == [(0, 1), (2,)]

        cli = run_ranktop("stacks", "--threads", "--no-save", agent.run_dir, timeout=30)
        assert cli.returncode == 0, cli.stderr
        out = cli.stdout
        # The odd one out first, in the main threads' groups and the other threads alike.
        assert out.index("== rank 2 (1)  <-- ODD ONE OUT") < out.index("== ranks 0-1 (2)"), out
        threads = out[out.index("other threads:"):].splitlines()
        assert [line for line in threads if line.startswith("--")] == [
            "-- thread 'prefetch' in rank 2  <-- ODD ONE OUT",
            "-- thread 'writer' in ranks 0-1  <-- not in rank 2",
            "-- thread 'prefetch' in ranks 0-1",
        ]
        with open(report.saved_txt) as f:  # the saved .txt is the same view
            assert "-- thread 'prefetch' in rank 2  <-- ODD ONE OUT" in f.read()


def _fork(node: stacks.TreeNode) -> list[stacks.TreeNode]:
    """The children where the tree first branches."""
    while len(node.children) == 1:
        node = node.children[0]
    return node.children


def _run_with_events(root, name: str, written: float, *events: dict):
    run = root / name
    run.mkdir()
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    os.utime(run / "events.jsonl", (written, written))
    return run


def test_stacks_without_a_target_reads_only_the_runs_written_last(tmp_path, monkeypatch):
    """With no target, the log root's runs were read one by one, each events.jsonl to its end,
    until one had live ranks: with none live, every run there (a log root used for months holds
    thousands). Now only the MAX_RUNS_OPENED written last are read, as the no-run line's ended
    runs are: a live run among them is found, one older than all of them is not."""
    root = tmp_path / f"ranktop-{os.geteuid()}"
    root.mkdir(mode=0o700)
    rank = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], env={**os.environ, "TORCHELASTIC_RUN_ID": "live"})
    try:
        live = _run_with_events(root, "live", 1000.0, {"event": "run_started", "run_id": "live", "pid": os.getpid()},
                                {"event": "started", "rank": 0, "local_rank": 0, "attempt": 0, "pid": rank.pid})
        for i in range(MAX_RUNS_OPENED):  # ended: their rank's pid is this test's, no rank of theirs
            _run_with_events(root, f"ended-{i:02d}", 2000.0 + i, {"event": "run_started", "run_id": f"ended-{i}"})
        newest = root / f"ended-{MAX_RUNS_OPENED - 1:02d}"
        read = []
        real = discovery.live_ranks_in_run_dir
        monkeypatch.setattr(discovery, "live_ranks_in_run_dir", lambda d: read.append(d) or real(d))
        assert stacks.find_run_dir(str(root)) == str(newest) and len(read) == MAX_RUNS_OPENED
        assert str(live) not in read
        out = run_ranktop("stacks", env={**os.environ, "TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "rt")})
        assert out.returncode == 1 and out.stderr == no_ranks_left(newest), out
        os.utime(live / "events.jsonl", (2010.5, 2010.5))  # among the runs written last: found
        assert stacks.find_run_dir(str(root)) == str(live)
    finally:
        rank.kill()
        rank.wait()


NUMBERED_THREADS = """
import os, threading, time
def log_sender():
    time.sleep(3600)
def worker():
    time.sleep(3600)
if os.environ["RANK"] == "0":  # rank 0's own thread, started first: its later threads' numbers shift
    threading.Thread(target=log_sender, daemon=True).start()
threading.Thread(target=worker, daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
"""


def test_threads_python_numbered_group_across_ranks_whatever_their_number(tmp_path):
    """Python names a thread it is given no name for by the order of its start ('Thread-2
    (worker)'): one extra thread of rank 0's, started first, gave the same worker another name
    there, and it was marked `not in ranks 1-2`, the others' `not in rank 0`, all listed first
    as odd. The number is left out of the grouping (`Thread-N (worker)`): only rank 0's own thread
    is odd."""
    with Running(make_agent(tmp_path, NUMBERED_THREADS, n=3)) as agent:
        wait_ready(agent, 3)
        report = stacks.dump_agent_stacks(agent)
        names = {r.rank: sorted(t.name for t in r.others) for r in report.ranks}
        assert names == {0: ["Thread-1 (log_sender)", "Thread-2 (worker)"], 1: ["Thread-1 (worker)"],
                         2: ["Thread-1 (worker)"]}, names
        groups = stacks.other_thread_groups(report)
        assert [(g.name, g.ranks, g.odd_words) for g in groups] == [
            ("Thread-N (log_sender)", (0,), "not in ranks 1-2"), ("Thread-N (worker)", (0, 1, 2), "")]
        assert stacks.thread_tree(report, "Thread-N (worker)").ranks == [0, 1, 2]
