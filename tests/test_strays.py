"""Helpers that escape their rank (no marker variable, a session or process group of their own,
orphaned) are still swept: SIGTERM and the grace at a normal end, and by the guard when ranktop is
SIGKILLed. They clear their environment, so the no_orphans fixture cannot see them: every test
here checks their pids itself and kills whatever is left."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
from conftest import ROOT, ranktop_cmd, read_events, read_line, wait_for
from ranktop.core.guard import (
    MARKER,
    Proc,
    find_strays,
    marked_pids,
    process_table,
    read_orders,
    read_proc,
    younger_than,
)
from ranktop.core.strays import _left_by_which, forget_own_child, note_own_child, orphan_candidates

HELPERS = str(ROOT / "tests" / "ranks" / "helpers.py")
KINDS = ("setsid", "setpgid")


def _running(pid, mark):
    """Is `pid` a live process whose command line holds `mark` (a path unique to the test)? The
    pid alone may name another process by the time we look again."""
    proc = read_proc(pid)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return proc is not None and not proc.zombie and mark.encode() in f.read()
    except OSError:
        return False


def _zombie_of(pid, parent):
    """Is `pid` a child of `parent` that exited and was not reaped (or one still running)?"""
    proc = read_proc(pid)
    return proc is not None and proc.ppid == parent


class Helpers:
    """The helpers' files in one folder: their pids and the SIGTERMs they recorded."""

    def __init__(self, folder, ranks):
        self.folder, self.ranks = folder, ranks

    def path(self, rank, kind, ext):
        return self.folder / f"{rank}-{kind}.{ext}"

    def pids(self):
        return {(r, k): int(self.path(r, k, "pid").read_text()) for r in self.ranks for k in KINDS
                if self.path(r, k, "pid").exists()}

    def running(self, pid):
        return _running(pid, str(self.folder))

    def got_term(self, rank, kind):
        path = self.path(rank, kind, "term")
        return path.exists() and "TERM" in path.read_text()

    def kill_leftovers(self):
        for pid in self.pids().values():
            if self.running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def helpers(tmp_path):
    box = {}

    def make(ranks):
        folder = tmp_path / "helpers"
        folder.mkdir()
        box["h"] = Helpers(folder, ranks)
        return box["h"]

    yield make
    if "h" in box:
        box["h"].kill_leftovers()


def _ranktop(tmp_path, nproc, *script_args, grace="1"):
    return subprocess.Popen(
        ranktop_cmd("--headless", "--nproc-per-node", str(nproc), "--shutdown-timeout", grace, "--log-dir",
                    str(tmp_path / "logs"), "--run-id", "h", HELPERS, str(tmp_path / "helpers"), *script_args),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_normal_end_gives_escaped_helpers_sigterm_then_the_grace(tmp_path, helpers):
    h = helpers([0])
    proc = _ranktop(tmp_path, 1, "0")  # the rank exits 0 at once: its helpers are left behind
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    pids = h.pids()
    assert set(pids) == {(0, "setsid"), (0, "setpgid")}
    for kind in KINDS:
        assert h.got_term(0, kind), kind
    wait_for(lambda: not any(h.running(p) for p in pids.values()), timeout=5, what="helpers gone")
    events = read_events(tmp_path / "logs" / "h", while_written=True)
    stopping = [e for e in events if e["event"] == "strays_stopping"]
    assert len(stopping) == 1 and set(pids.values()) <= set(stopping[0]["pids"]) and stopping[0]["grace"] == 1
    adopted = {e["pid"] for e in events if e["event"] == "stray_adopted"}
    assert set(pids.values()) <= adopted  # both were orphaned to ranktop, their subreaper


def test_a_helper_that_ignores_sigterm_is_killed_after_the_grace(tmp_path, helpers):
    h = helpers([0])
    proc = _ranktop(tmp_path, 1, "0", "stubborn", grace="1.5")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    pids = h.pids()
    assert all(h.got_term(0, kind) for kind in KINDS)  # SIGTERM came first ...
    wait_for(lambda: not any(h.running(p) for p in pids.values()), timeout=5, what="helpers gone")  # ... then SIGKILL
    events = read_events(tmp_path / "logs" / "h", while_written=True)
    stopping = next(e for e in events if e["event"] == "strays_stopping")
    killed = next(e for e in events if e["event"] == "strays_killed")
    assert set(pids.values()) <= set(stopping["pids"]) and set(pids.values()) <= set(killed["pids"])
    assert killed["ts"] - stopping["ts"] > 1.4  # they had their grace (the clock is read just before the event)


def test_a_helper_that_forks_its_successor_and_exits_again_and_again_is_swept(tmp_path):
    # Each generation lives ~1 ms: one look of the end sweep read it alive, the process table read
    # next had it gone, and its successor (ours already) was in neither; the sweep ended with
    # nothing found, and the line ran on after ranktop, re-parented to init.
    sid_file = tmp_path / "runaway.sid"
    done = subprocess.run(
        ranktop_cmd("--headless", "--nproc-per-node", "1", "--shutdown-timeout", "1", "--log-dir",
                    str(tmp_path / "logs"), "--run-id", "r", str(ROOT / "tests" / "ranks" / "runaway.py"),
                    str(sid_file), "0.001"),
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    sid = int(sid_file.read_text())  # every generation's session (and process group)

    def left():
        return [p.pid for p in process_table().values() if p.sid == sid and not p.zombie and _running(p.pid, "runaway.py")]

    try:
        assert done.returncode == 0 and "RUNAWAY STARTED" in done.stdout, done.stderr
        for _ in range(10):  # (a line that escaped has a live member at every moment, but a read of the
            assert left() == []  # table, one entry at a time, may miss the one of that moment)
            time.sleep(0.02)
        events = [e["event"] for e in read_events(tmp_path / "logs" / "r", while_written=True)]
        assert "strays_killed" in events and "strays_left" not in events  # SIGTERM is ignored: SIGKILL ended it
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sid, signal.SIGKILL)


def _guard_of(pid):
    """The pid of the orphan guard ranktop `pid` started."""
    table = process_table()
    for child, entry in table.items():
        with contextlib.suppress(OSError), open(f"/proc/{child}/cmdline", "rb") as f:
            if entry.ppid == pid and b"guard.main()" in f.read():
                return child
    return None


def test_sigkilled_ranktop_leaves_no_escaped_helper(tmp_path, helpers):
    # Rank 0 exits (its helpers are orphaned to ranktop), rank 1 lives on (its setsid helper is
    # still its child; its double-forked one is orphaned to ranktop). The guard is killed first:
    # ranktop went on without one, and its SIGKILL then left every helper and rank 1 running.
    h = helpers([0, 1])
    proc = _ranktop(tmp_path, 2, "0", grace="5")
    try:
        wait_for(lambda: len(h.pids()) == 4, timeout=20, what="four helpers started")
        pids = h.pids()
        orphans = {pids[(0, "setsid")], pids[(0, "setpgid")], pids[(1, "setpgid")]}

        def events():
            return read_events(tmp_path / "logs" / "h", while_written=True)

        wait_for(lambda: orphans <= {e["pid"] for e in events() if e["event"] == "stray_adopted"},
                 timeout=20, what="ranktop adopted the orphans (and told the guard)")
        first = wait_for(lambda: _guard_of(proc.pid), timeout=10, what="the guard")
        os.kill(first, signal.SIGKILL)
        replaced = wait_for(lambda: [e for e in events() if e["event"] == "guard_replaced"], timeout=10,
                            what="a new guard, told what the first knew")
        assert replaced[0]["pid"] == first and replaced[0]["status"] == -signal.SIGKILL
        # (said on stderr just after the event is written: waited for, not taken from a kill's leftovers)
        read_line(proc.stderr, 10, "ranktop's line on the new guard",
                  equal_to=f"ranktop: the orphan guard (pid {first}) ended under the run (killed by SIGKILL); a new one "
                           f"(pid {replaced[0]['new_pid']}) guards the ranks\n")
        proc.kill()
        proc.communicate(timeout=10)
        wait_for(lambda: not any(h.running(p) for p in pids.values()), timeout=15, what="the guard swept every helper")
        for rank, kind in pids:
            assert h.got_term(rank, kind), (rank, kind)  # SIGTERM, with the grace, not SIGKILL at once
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_orphans_that_exit_are_reaped_while_ranktop_runs(tmp_path):
    """Being the subreaper, ranktop must reap the orphans it adopts: no zombies pile up."""
    script = tmp_path / "short_helpers.py"
    script.write_text(textwrap.dedent("""
        import os, time
        for _ in range(3):
            middle = os.fork()
            if middle == 0:
                middle_pid = os.getpid()
                if os.fork() == 0:
                    while os.getppid() == middle_pid:  # until the middle one exited
                        time.sleep(0.01)
                    # one write: the ranks run with -u, where print() writes word by word and the
                    # three orphans' lines could interleave
                    os.write(1, f"ORPHAN {os.getpid()} {os.getppid()}\\n".encode())
                    time.sleep(0.3)
                    os._exit(0)
                os._exit(0)
            os.waitpid(middle, 0)
        while True:
            time.sleep(1)
    """))
    proc = subprocess.Popen(ranktop_cmd("--headless", "--log-dir", str(tmp_path / "logs"), str(script)),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline().split() for _ in range(3)]
        orphans = [int(words[-2]) for words in lines]
        assert [int(words[-1]) for words in lines] == [proc.pid] * 3  # re-parented to ranktop, not init
        wait_for(lambda: not any(_zombie_of(p, proc.pid) for p in orphans), timeout=10,
                 what="the exited orphans reaped (not left as zombies of ranktop)")
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM


def _proc(pid, ppid, pgid, sid, start, zombie=False):
    return Proc(pid, ppid, pgid, sid, start, zombie)


def test_find_strays_never_takes_a_reused_pid():
    table = {p.pid: p for p in [
        _proc(100, 1, 100, 100, 50),  # rank 100
        _proc(101, 100, 100, 100, 60),  # its child, in its group
        _proc(102, 1, 102, 100, 70),  # left the group (setpgid), still in the session
        _proc(103, 100, 103, 103, 80),  # setsid: below the rank in the parent chain
        _proc(104, 103, 103, 103, 90),  # and its child
        _proc(200, 1, 200, 200, 10),  # a stray we were told of, but this pid is someone else now
        _proc(300, 1, 300, 300, 20),  # a stray we were told of, the same process
        _proc(400, 1, 400, 400, 5),  # pid 400 was a rank; now another process leads group 400
        _proc(401, 400, 400, 400, 6),
        _proc(500, 1, 500, 500, 30, zombie=True),  # a dead stray: nothing to do
    ]}
    found = find_strays(table, ranks={100: 50, 400: 1}, strays={200: 11, 300: 20, 500: 30})
    assert found == {100: 50, 101: 60, 102: 70, 103: 80, 104: 90, 300: 20}


def test_only_processes_as_young_as_the_run_are_read_for_the_marker():
    # A process that started before the run's first rank (or its guard) cannot carry its marker:
    # a busy host's other processes are never read.
    table = {p.pid: p for p in [_proc(10, 1, 10, 10, 99), _proc(11, 1, 11, 11, 100), _proc(12, 11, 11, 11, 250),
                                _proc(13, 1, 13, 13, 300, zombie=True)]}
    assert younger_than(table, 100) == [11, 12]  # the same tick counts; a zombie is gone already
    assert sorted(younger_than(table, 0)) == [10, 11, 12]


def test_the_marker_is_found_after_a_long_environment():
    # /proc/PID/environ is read in pieces past its first 64 KiB: a marker 300 KiB in is still found.
    env = {**{f"BIG{i}": "x" * (60 << 10) for i in range(5)}, MARKER: "f00d"}  # (one variable: 128 KiB at most)
    proc = subprocess.Popen(["sleep", "30"], env=env)
    try:
        wait_for(lambda: read_proc(proc.pid) is not None and proc.pid in marked_pids("f00d", [proc.pid]),
                 what="the marker read after the long variable")
        assert marked_pids("beef", [proc.pid]) == set()
    finally:
        proc.kill()
        proc.wait()


def test_a_guard_started_the_old_way_still_sweeps():
    # A ranktop that was running when ranktop was upgraded in place starts its next attempt's
    # guard as `guard.py TOKEN GRACE`: that guard must still sweep what carries the marker.
    guard_py = ROOT / "core" / "guard.py"
    old_way = subprocess.Popen([sys.executable, "-I", "-S", str(guard_py), "c0ffee", "1.0"], stdin=subprocess.PIPE)
    marked = subprocess.Popen(["sleep", "30"], env={"PATH": os.environ["PATH"], MARKER: "c0ffee"})
    try:
        wait_for(lambda: read_proc(marked.pid) is not None, what="the marked process started")
        old_way.stdin.close()  # its ranktop is gone
        assert old_way.wait(15) == 0
        assert marked.wait(5) == -signal.SIGTERM  # swept, with SIGTERM first
    finally:
        for proc in (old_way, marked):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_spare_guard_that_died_is_replaced_when_taken():
    from ranktop.core import guard

    guard.prestart()
    dead = guard.spare_pid()
    os.kill(dead, signal.SIGKILL)
    wait_for(lambda: read_proc(dead).zombie, what="the spare guard dead")
    taken = guard.take("feed", 1.0)  # the dead one is reaped, a live one started in its place
    try:
        assert guard.spare_pid() is None and taken.pid != dead and taken.poll() is None
    finally:
        taken.stdin.close()  # no rank was told of: it exits at once
        assert taken.wait(15) == 0
    with pytest.raises(ChildProcessError):
        os.waitpid(dead, os.WNOHANG)  # reaped, not left a zombie


def test_guard_reads_what_ranktop_told_it():
    lines = [b"run 0a1b 2.5\n", b"rank 10 5\n", b"rank 11 6\n", b"stray 12 7\n", b"gone 10\n", b"garbage\n",
             b"run ffff 9\n", b"tmp " + b"/t/a b".hex().encode() + b"\n", b"tmp zz\n", b"done\n"]
    def told(lines):
        orders = read_orders(lines)
        return orders.token, orders.grace, orders.ranks, orders.strays, orders.tmp_dirs, orders.normal_exit

    assert told(lines) == ("0a1b", 2.5, {11: 6}, {12: 7}, [b"/t/a b"], True)  # the first run line only
    assert told([b"rank 10 5\n"]) == (None, 0.0, {10: 5}, {}, [], False)  # a spare no run took
    assert told([b"run x y\n"])[:2] == (None, 0.0)  # a bad grace: no run
    # A rank being started: until its `rank` line has come
    assert read_orders([b"run 0a1b 2.5\n", b"spawning\n"]).spawning
    assert not read_orders([b"run 0a1b 2.5\n", b"spawning\n", b"rank 10 5\n"]).spawning


def test_a_rank_ranktop_died_starting_is_swept_once_its_exec_gives_it_the_marker(monkeypatch):
    """ranktop SIGKILLed as it started a rank: the rank, in a session of its own already, closed
    its copy of the guard's pipe before its exec, so the guard swept at that end of file and
    found nothing of the run; the exec then gave it the marker, and it ran on, an orphan (2 of 60
    ranktops SIGKILLed as their ranks started). Here the guard (its main, in this process) is
    told of the start and then of nothing more, and the rank's exec is let go once the guard has
    looked for the marker."""
    from ranktop.core import guard

    looked = threading.Event()
    first_look = guard.marked_pids

    def look(*args, **kwargs):
        found = first_look(*args, **kwargs)
        looked.set()
        return found

    monkeypatch.setattr(guard, "marked_pids", look)
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(b"run 5a1e 1.0\nspawning\n")))
    rank = subprocess.Popen(["sh", "-c", f"read go; exec env -i {MARKER}=5a1e sleep 30"], stdin=subprocess.PIPE,
                            start_new_session=True)

    def exec_once_looked_for():
        if looked.wait(10):
            rank.stdin.write(b"go\n")
            rank.stdin.close()

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)}
    releaser = threading.Thread(target=exec_once_looked_for)
    releaser.start()
    try:
        guard.main()  # (it ignores stop signals: only end of file on stdin ends it)
        releaser.join(10)
        assert rank.wait(10) == -signal.SIGTERM
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        looked.set()
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_library_stop_sweeps_a_setsid_helper_found_by_the_parent_chain(tmp_path):
    """Without a subreaper (the Python API in someone else's process), a helper that cleared its
    environment and called setsid is still found below its rank when the group is stopped."""
    from ranktop.core import LocalAgent, WorkerSpec

    term, ready = tmp_path / "helper.term", tmp_path / "helper.ready"
    # (its pid is told once its trap is set: a stop before that killed it with no TERM written, once in a full run)
    code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        helper = subprocess.Popen(["env", "-i", "setsid", "/bin/sh", "-c",
                                   "trap 'echo TERM >> {term}; exit 0' TERM; : > {ready}; while :; do /bin/sleep 0.05; done"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.exists("{ready}"):
            time.sleep(0.01)
        sys.stdout.write(f"HELPER {{helper.pid}}\\n")
        while True:
            time.sleep(1)
    """)
    spec = WorkerSpec(role="default", local_world_size=1, entrypoint=sys.executable, args=("-c", code))
    agent = LocalAgent(spec, log_dir=str(tmp_path / "logs"), console=False, shutdown_timeout=5)
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=agent.run()))
    thread.start()
    helper = None
    try:
        assert agent.wait_started(10)
        line = wait_for(lambda: next((x for x in agent.output(0) if x.startswith(b"HELPER")), None), what="helper")
        helper = int(line.split()[1])
        agent.stop()
        thread.join(30)
        assert not thread.is_alive()
        assert term.read_text() == "TERM\n"
        wait_for(lambda: not _running(helper, str(term)), timeout=5, what="helper gone")
    finally:
        if helper is not None and _running(helper, str(term)):
            os.kill(helper, signal.SIGKILL)
        thread.join(30)


# Each stray says it has left the rank's session before the rank prints them and ends (one still
# in the rank's group when it ended went with the group's stop, and was missing from the sweep's).
_MANY_STUBBORN = """
import os, signal, sys, time
pids = []
ready_r, ready_w = os.pipe()
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(ready_w, b"x")
        time.sleep(60)
        os._exit(0)
    pids.append(pid)
os.close(ready_w)
left = len(pids)
while left:
    left -= len(os.read(ready_r, left))
print(*pids, flush=True)
"""


def test_more_strays_than_descriptors_are_all_killed(tmp_path):
    """The end sweep holds a pidfd per stray: under a low `ulimit -n`, those it could not open
    were never signalled, and were then reported as having outlived SIGKILL. (These strays keep
    the marker: the no_orphans fixture kills and reports any that are left.)"""
    import resource

    script = tmp_path / "many.py"
    script.write_text(_MANY_STUBBORN)

    def few_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))

    done = subprocess.run(ranktop_cmd("--headless", "--shutdown-timeout", "1", "--log-dir", str(tmp_path / "logs"),
                                      "--run-id", "m", str(script), "150"),
                          cwd=ROOT, capture_output=True, text=True, timeout=90, preexec_fn=few_descriptors)
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split(":", 1)[1].split()]
    assert len(pids) == 150
    events = read_events(tmp_path / "logs" / "m")
    assert not [e for e in events if e["event"] == "strays_left"], done.stderr
    (killed,) = [e for e in events if e["event"] == "strays_killed"]
    assert set(pids) <= set(killed["pids"])
    wait_for(lambda: not any(_running(p, str(script)) for p in pids), timeout=10, what="every stray gone")


def test_a_rank_given_up_as_unreapable_is_left_out_of_the_sweep_but_not_what_it_left():
    """A rank stuck in the kernel had its SIGKILL and its wait: the end sweep used to take it for
    a stray and do both again (a run with a D-state rank took three times as long to end)."""
    import psutil
    from ranktop.core.strays import StrayTracker

    rank = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    try:
        wait_for(lambda: psutil.Process(rank.pid).children(), what="the rank's child")
        (child,) = psutil.Process(rank.pid).children()
        tracker = StrayTracker("token", tell=lambda line: None, emit=lambda *a, **k: None)
        tracker.rank_started(rank.pid)
        assert {rank.pid, child.pid} <= set(tracker.find(with_marker=False))
        tracker.rank_given_up(rank.pid)
        found = tracker.find(with_marker=False)
        assert rank.pid not in found and child.pid in found
    finally:
        os.killpg(rank.pid, signal.SIGKILL)
        rank.wait()


# A rank that starts two helpers, each recording a SIGTERM in DIR/<rank>-<kind>.term: `group` stays
# in the rank's process group and ignores SIGTERM (only SIGKILL ends it); `session` is a daemon that
# called setsid (orphaned once its rank exits) and exits on SIGTERM. Ranks listed in EXIT_RANKS then
# exit 0; the others, and every rank started again, run until stopped. The session helper of a rank
# that runs on also clears its environment (no marker: only the parent chain leads to it).
_RANK_LEAVES_HELPERS = """
    import os, subprocess, sys, time
    base = os.path.join(os.environ["RANKTOP_TEST_DIR"], os.environ["LOCAL_RANK"] + "-")
    exits = os.environ["LOCAL_RANK"] in os.environ["EXIT_RANKS"].split(",")
    if os.path.exists(base + "group.pid"):  # started again: no helpers this time
        print("again", flush=True)
        time.sleep(60)
    for kind, own_session, on_term in (("group", False, ""), ("session", True, "; exit 0")):
        script = (f"trap 'echo TERM >> {base}{kind}.term{on_term}' TERM; : > {base}{kind}.ready; "
                  "while :; do /bin/sleep 0.05; done")
        helper = subprocess.Popen(["/bin/sh", "-c", script], start_new_session=own_session,
                                  env={} if own_session and not exits else None,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.exists(base + kind + ".ready"):  # its trap is set
            time.sleep(0.01)
        with open(base + kind + ".pid", "w") as f:
            f.write(str(helper.pid))
    print("helpers up", flush=True)
    if exits:
        sys.exit(0)
    time.sleep(60)
"""


@contextlib.contextmanager
def _killed_at_the_end(folder):
    """Kill every helper whose pid file is in `folder` and that still runs (those without the
    test session's marker escape the no_orphans fixture)."""
    try:
        yield
    finally:
        for path in folder.glob("*.pid"):
            pid = int(path.read_text())
            if _running(pid, str(folder)):
                os.kill(pid, signal.SIGKILL)


def _helper_pids(folder, rank):
    return {kind: int((folder / f"{rank}-{kind}.pid").read_text()) for kind in ("group", "session")}


def _got_term(folder, rank, kind):
    path = folder / f"{rank}-{kind}.term"
    return path.exists() and "TERM" in path.read_text()


@pytest.mark.parametrize("exit_ranks", ["0", ""], ids=["exited_on_its_own", "running"])
def test_a_rank_restart_stops_what_the_old_rank_left_and_nothing_of_the_others(tmp_path, exit_ranks):
    """A restart of a rank that had exited on its own started the new process beside what the old
    one left running (a worker in its process group, a daemon that called setsid); one of a running
    rank left the daemon. Now both get SIGTERM, the grace, then SIGKILL, as a group stop gives them,
    before the new process starts; the other rank's helpers are not touched."""
    from conftest import Running, make_agent
    from ranktop.core import RankState

    agent = make_agent(tmp_path / "logs", code=_RANK_LEAVES_HELPERS, n=2, shutdown_timeout=1.0,
                       env={"RANKTOP_TEST_DIR": str(tmp_path), "EXIT_RANKS": exit_ranks})
    run = Running(agent)
    with _killed_at_the_end(tmp_path), run:
        wait_for(lambda: all(b"helpers up" in agent.output(r) for r in (0, 1)), what="both ranks' helpers up")
        if exit_ranks:
            wait_for(lambda: run.rank(0).state == RankState.SUCCEEDED, what="rank 0 exited on its own")
        old, others = _helper_pids(tmp_path, 0), _helper_pids(tmp_path, 1)
        agent.restart_rank(0)
        wait_for(lambda: b"again" in agent.output(0), what="rank 0 started again")
        for kind, pid in old.items():
            assert _got_term(tmp_path, 0, kind), kind  # SIGTERM first ...
            assert not _running(pid, str(tmp_path)), kind  # ... and gone before the new process started
        assert all(_running(pid, str(tmp_path)) for pid in others.values()), "another rank's helper was stopped"
        assert not any(_got_term(tmp_path, 1, kind) for kind in ("group", "session"))
    events = read_events(agent.run_dir)
    restarted_at = [e["ts"] for e in events if e["event"] == "started" and e["local_rank"] == 0][1]
    stopping = next(e for e in events if e["event"] == "strays_stopping" and e.get("local_rank") == 0)
    assert set(old.values()) <= set(stopping["pids"]) and not set(others.values()) & set(stopping["pids"])
    assert stopping["grace"] == 1.0 and restarted_at - stopping["ts"] > 0.8  # the grace, then SIGKILL
    if exit_ranks:  # (a running rank's worker had its group's SIGTERM and SIGKILL, as a group stop gives it)
        killed = next(e for e in events if e["event"] == "strays_killed" and e.get("local_rank") == 0)
        assert old["group"] in killed["pids"] and stopping["ts"] < killed["ts"] < restarted_at


def test_a_group_stop_during_a_rank_restarts_sweep_takes_it_over(tmp_path):
    """A stop of the group while a restart's sweep waits out its grace: the end sweep goes on from
    there, and a helper that had the restart's SIGTERM gets no second one, only the SIGKILL."""
    from conftest import Running, make_agent
    from ranktop.core import RankState

    agent = make_agent(tmp_path / "logs", code=_RANK_LEAVES_HELPERS, n=2, shutdown_timeout=30.0,
                       env={"RANKTOP_TEST_DIR": str(tmp_path), "EXIT_RANKS": "0"})
    run = Running(agent)
    with _killed_at_the_end(tmp_path), run:
        wait_for(lambda: run.rank(0).state == RankState.SUCCEEDED and b"helpers up" in agent.output(1),
                 what="rank 0 exited on its own, rank 1 up")
        old = _helper_pids(tmp_path, 0)
        agent.restart_rank(0)
        wait_for(lambda: _got_term(tmp_path, 0, "group"), what="the restart's SIGTERM to rank 0's worker")
        agent.stop(grace=0.5)
        run.join(timeout=20)
    assert (tmp_path / "0-group.term").read_text() == "TERM\n"
    assert not any(_running(pid, str(tmp_path)) for pid in old.values())
    starts = [e for e in read_events(agent.run_dir) if e["event"] == "started" and e["local_rank"] == 0]
    assert len(starts) == 1  # the stop came first: rank 0 was not started again


# A rank whose helper (its own session, no environment: only the parent chain leads to it) starts a
# cleanup child on SIGTERM and exits 0.5 s later; the child ignores SIGTERM and records it in
# DIR/child.term. Started again, the rank only says so.
_HELPER_LEAVES_A_CHILD = """
    import os, subprocess, sys, time
    folder = os.environ["RANKTOP_TEST_DIR"]
    if os.path.exists(os.path.join(folder, "helper.pid")):
        print("again", flush=True)
        time.sleep(60)
    helper = subprocess.Popen(["/bin/sh", os.path.join(folder, "helper.sh")], start_new_session=True, env={},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.exists(os.path.join(folder, "helper.ready")):
        time.sleep(0.01)
    with open(os.path.join(folder, "helper.pid"), "w") as f:
        f.write(str(helper.pid))
    print("helper up", flush=True)
    time.sleep(60)
"""


def test_a_rank_restart_stops_what_its_helper_started_as_it_was_swept(tmp_path):
    """What a restart's sweep found below what the old rank left (a helper's cleanup child, started
    on the sweep's SIGTERM) was signalled but not noted: once the helper exited, nothing led to the
    child any more, the sweep took itself for done, and the new process started beside it (no
    SIGKILL ever came). Now it is kept, as the end sweep keeps what it finds below its strays."""
    from conftest import Running, make_agent

    (tmp_path / "child.sh").write_text(f"trap 'echo TERM >> {tmp_path}/child.term' TERM\n"
                                       f"echo $$ > {tmp_path}/child.tmp && mv {tmp_path}/child.tmp {tmp_path}/child.pid\n"
                                       "while :; do /bin/sleep 0.05; done\n")
    (tmp_path / "helper.sh").write_text(f"trap '/bin/sh {tmp_path}/child.sh & /bin/sleep 0.5; exit 0' TERM\n"
                                        f": > {tmp_path}/helper.ready\n"
                                        "while :; do /bin/sleep 0.05; done\n")
    agent = make_agent(tmp_path / "logs", code=_HELPER_LEAVES_A_CHILD, n=1, shutdown_timeout=1.5,
                       env={"RANKTOP_TEST_DIR": str(tmp_path)})
    run = Running(agent)
    with _killed_at_the_end(tmp_path), run:
        wait_for(lambda: b"helper up" in agent.output(0), what="the rank's helper up")
        agent.restart_rank(0)
        wait_for(lambda: b"again" in agent.output(0), what="rank 0 started again")
        child = int((tmp_path / "child.pid").read_text())
        assert (tmp_path / "child.term").read_text() == "TERM\n"  # SIGTERM first ...
        assert not _running(child, str(tmp_path)), "the new process started beside the helper's child"
    killed = [e for e in read_events(agent.run_dir) if e["event"] == "strays_killed"]
    assert any(child in e["pids"] for e in killed)  # ... then SIGKILL after the grace


def test_the_monitor_sleeps_between_the_end_sweeps_looks_once_a_swept_process_exited(tmp_path):
    """A stray's pidfd stays readable from its exit on, and a sweep looks (and closes it) at most
    every 0.1 s: polled meanwhile, it woke the monitor at once, pass after pass, thousands of
    passes until the next look. (The helper keeps the marker: no_orphans sees it.)"""
    from ranktop.core import start_processes

    code = textwrap.dedent(f"""
        import os, subprocess, time
        subprocess.Popen(["/bin/sh", "-c", "trap 'exit 0' TERM; : > {tmp_path}/ready; while :; do /bin/sleep 0.05; done"],
                         start_new_session=True)
        while not os.path.exists("{tmp_path}/ready"):
            time.sleep(0.01)
    """)
    (tmp_path / "logs").mkdir()
    ctx = start_processes("t", sys.executable, {0: ("-c", code)}, {0: {"LOCAL_RANK": "0"}}, str(tmp_path / "logs"))
    passes = 0
    step = ctx.step

    def counted():
        nonlocal passes
        passes += 1
        return step()

    ctx.step = counted
    events = []
    ctx.on_event = events.append
    try:
        result = ctx.wait(timeout=30)
    finally:
        ctx.close()
    assert result is not None and not result.failures
    assert [e for e in events if e["event"] == "strays_stopping"], "the helper was not swept"
    assert passes < 50, f"{passes} monitor passes"


def test_a_rank_restart_during_the_groups_end_sweep_is_refused(tmp_path):
    """Every rank had ended and the end sweep was in its grace (a worker that ignores SIGTERM): a
    restart of a rank was taken, and its own sweep sent that worker a second SIGTERM (its handler
    entered twice); the group has ended, so it is refused as during a stop."""
    from conftest import Running, make_agent
    from ranktop.core import commands as cmd

    agent = make_agent(tmp_path / "logs", code=_RANK_LEAVES_HELPERS, n=1, shutdown_timeout=2.0,
                       env={"RANKTOP_TEST_DIR": str(tmp_path), "EXIT_RANKS": "0"})
    run = Running(agent)
    with _killed_at_the_end(tmp_path), run:
        wait_for(lambda: _got_term(tmp_path, 0, "group"), what="the end sweep's SIGTERM to rank 0's worker")
        ack = agent.submit(cmd.RestartRank(0))
        run.join(timeout=20)
    assert not ack.ok and ack.message == "the group is stopping or has ended: rank 0 is not started again"
    assert (tmp_path / "0-group.term").read_text() == "TERM\n"
    assert b"again" not in agent.output(0)


# A rank that starts a helper in a session of its own (setsid), which starts a `sleep`: the rank's
# leftovers two steps below it, neither in its group or session. It prints their pids.
RANK_WITH_HELPER = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import subprocess, time; print(subprocess.Popen(['sleep', '60']).pid, "
                           "flush=True); time.sleep(60)"], start_new_session=True, stdout=subprocess.PIPE, text=True)
print(helper.pid, helper.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def test_the_walk_to_a_leftovers_rank_ends_on_a_process_table_whose_parents_form_a_cycle():
    """What a reaped rank left is matched to it by walking up the parent chain (_left_by_which),
    bounded against a cycle. A cycle is what a table read one /proc entry at a time can hold: A
    read with parent B, then B exits and its pid goes to a child of A before B's entry is read.
    That needs a pid freed and reused between two reads of one pass: not something real
    processes can be made to do on cue, so the cycle is made in a real snapshot, as such a read
    would leave it. The walk's `found` comes from the same table (find_strays), which never
    reaches a cycle; handed one from another read, the bound still ends the walk."""
    rank = subprocess.Popen([sys.executable, "-c", RANK_WITH_HELPER], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    try:
        helper, sleeper = map(int, rank.stdout.readline().split())
        table = process_table()
        ranks = {rank.pid: table[rank.pid].start}
        found = find_strays(table, ranks, {})
        assert {helper, sleeper} <= set(found)
        assert _left_by_which(sleeper, table, ranks, found) == (rank.pid, ranks[rank.pid])  # two steps up

        torn = dict(table)
        for pid, parent in ((helper, sleeper), (sleeper, helper)):
            p = table[pid]
            torn[pid] = Proc(pid, parent, p.pgid, p.sid, p.start, p.zombie)
        assert find_strays(torn, ranks, {}) == {rank.pid: ranks[rank.pid]}  # nothing below the rank now
        walked = []
        walk = threading.Thread(target=lambda: walked.append(_left_by_which(sleeper, torn, ranks, found)), daemon=True)
        walk.start()
        walk.join(10)
        assert walked == [None], "the walk round the cycle did not end"
    finally:
        for pid in (sleeper, helper) if "sleeper" in locals() else ():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        rank.kill()
        rank.wait()
        rank.stdout.close()


def test_the_children_of_a_thread_that_started_one_are_read_and_still_once_it_ended():
    """A monitor pass reads the children of our first thread and of each thread that started a
    child of ours (older kernels gave it the orphans of that child's tree), not every thread's;
    once such a thread ended, its children (given to another of ours) are still found."""
    started, leave, box = threading.Event(), threading.Event(), {}

    def spawner():
        box["child"] = subprocess.Popen(["sleep", "60"])
        note_own_child(box["child"].pid)
        started.set()
        leave.wait(30)

    thread = threading.Thread(target=spawner)
    thread.start()
    try:
        assert started.wait(30)
        pid = box["child"].pid
        assert pid in orphan_candidates()  # read from the spawning thread's own children file
        leave.set()
        thread.join(30)
        assert pid in orphan_candidates()  # the thread is gone: its child is ours still
    finally:
        leave.set()
        thread.join(30)
        if "child" in box:
            forget_own_child(box["child"].pid)
            box["child"].kill()
            box["child"].wait(10)


def test_a_later_rank_with_a_reused_pid_leaves_the_pid_1_tables_with_its_group():
    """A rank's pid taken again by a later rank of the group while the first rank's leftovers
    were still being swept: forgetting the first rank took the later one's entry out of the
    tracker's own list, so the group's end left the later rank's session in the module's table
    (the one PID 1 reads) for as long as ranktop ran."""
    from ranktop.core import strays

    rank = subprocess.Popen(["sleep", "30"])
    try:
        tracker = strays.StrayTracker("reused", tell=lambda line: None, emit=lambda *a, **k: None)
        pid, start = tracker.rank_started(rank.pid)
        tracker.forget_rank((pid, start - 1))  # the earlier rank of that pid: its sweep ends now
        assert strays._rank_sessions.get(pid) == start  # the later rank's: it runs on
        tracker.close()
        assert pid not in strays._rank_sessions
    finally:
        rank.kill()
        rank.wait()
