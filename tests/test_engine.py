"""The Engine interface and its command queue, on real ranks: every command goes through the
monitor loop; teardown is bounded even for a rank that outlives SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import make_agent, read_events, wait_for
from ranktop.core import commands as cmd
from ranktop.core import start_processes
from ranktop.core.context import PContext, plan_streams
from ranktop.core.engine import LocalEngine, OutputCursor
from ranktop.core.layout import RunDir
from ranktop.core.state import GroupState, RankState

pytestmark = pytest.mark.timeout(60)

PY = sys.executable
TICKER = "import os, time\nprint('hello from', os.environ['RANK'], flush=True)\nwhile True:\n    time.sleep(0.05)\n"
# Ignores SIGTERM: only the SIGKILL after the grace ends it.
STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n"


def make_engine(tmp_path, code: str = TICKER, n: int = 2, **agent_kw) -> LocalEngine:
    return LocalEngine(make_agent(tmp_path, code, n, name="t.py", **agent_kw))


def running(engine: LocalEngine):
    wait_for(lambda: all(r.pid and r.last_output_at for r in engine.snapshot().ranks), what="ranks printing")


def test_snapshot_and_output_since_are_plain_data(tmp_path):
    engine = make_engine(tmp_path).start()
    try:
        running(engine)
        snap = engine.snapshot()
        assert not snap.ended and snap.exit_status is None and snap.shutdown_timeout == 2.0
        assert abs(snap.taken_at - time.time()) < 5 and snap.paused == ()
        assert snap.ranks[1].stdout_log.endswith(os.path.join("attempt_0", "1", "stdout.log"))
        # last_output_at is stamped as bytes arrive, a moment before the ring has split the line
        cursor, lines, open_lines = wait_for(lambda: (got := engine.output_since(1, None))[1] and got,
                                             what="rank 1's line in its ring")
        assert lines == [b"hello from 1"] and open_lines == [] and cursor == OutputCursor(0, 1, cursor.version)
        again = engine.output_since(1, cursor)
        assert again == (cursor, [], [])  # nothing new since the cursor
    finally:
        engine.close()
    snap = engine.snapshot()
    assert snap.ended and snap.state == GroupState.STOPPED and snap.exit_status == 128 + signal.SIGINT  # a user stop


def test_a_search_of_every_rank_leaves_the_rings_output_as_it_waits(tmp_path):
    """ctrl+f counts matches over every rank's kept lines: they are made for the count alone, and
    each ring's output goes on waiting as it came (packed, where it stayed a while). Made in the
    rings, 64 quiet ranks' 640k lines stayed Python objects: a TUI of 59 MB took 129 for the rest
    of the run."""
    from ranktop.tui.search_all import RankSearch

    code = "import sys, time\nfor i in range(3000):\n    print('line', i, flush=i % 500 == 499)\ntime.sleep(60)\n"
    engine = make_engine(tmp_path, code).start()
    try:
        rings = [engine.agent.pcontext.slots[r].ring for r in range(2)]
        wait_for(lambda: all(ring.total_lines == 3000 for ring in rings), what="3000 lines in each ring")
        found = RankSearch.run(engine, range(2), "line 17")
        assert found.counts == {0: 111, 1: 111}  # line 17, 170-179, 1700-1799
        assert [len(ring.lines) for ring in rings] == [0, 0]  # nothing made in the rings
        assert [line for line in engine.output_since(0, None)[1] if b"line 17" in line][:3] == \
            [b"line 17", b"line 170", b"line 171"]
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (cmd.SignalRank(5, signal.SIGTERM), "bad local rank 5: local ranks are 0..1"),
        (cmd.KillRank(-1), "bad local rank -1: local ranks are 0..1"),
        (cmd.SignalGroup(999), "bad signal 999: expected a signal number such as 15 (SIGTERM)"),
        (cmd.Stop(signal.SIGTERM, grace=-1.0), "bad grace -1.0: expected a number of seconds from 0 to 604800"),
        # past the longest wait ranktop takes: refused here, not half-applied (the run marked stopping)
        (cmd.Stop(signal.SIGTERM, grace=1e6), "bad grace 1000000.0: expected a number of seconds from 0 to 604800"),
        (cmd.DumpStacks((0, 7)), "bad local rank 7: local ranks are 0..1"),
        (cmd.SignalDump(5), "bad local ranks 5: expected a list of local ranks, or none for all"),
        ("stop", "unknown command str: expected one of SignalRank, SignalGroup, KillRank, KillGroup, "
                 "RestartRank, RestartGroup, Stop, Interrupt, DumpStacks, SignalDump, SendInput, Detach"),
    ],
)
def test_bad_commands_are_one_line_and_change_nothing(tmp_path, command, message):
    engine = make_engine(tmp_path).start()
    try:
        running(engine)
        before = [(r.pid, r.state) for r in engine.snapshot().ranks]
        ack = engine.submit(command)
        assert not ack.ok and ack.message == message and "\n" not in ack.message
        assert [(r.pid, r.state) for r in engine.snapshot().ranks] == before
        assert engine.snapshot().state == GroupState.RUNNING
        assert not any(e["event"] in ("signalled", "user_stop") for e in read_events(engine.agent.run_dir))
    finally:
        engine.close()


def test_a_detach_is_a_command_after_which_a_hangup_is_noted_not_a_stop(tmp_path):
    """SPEC 6: every action, detach included, goes through Engine.submit. The TUI's launcher reached
    into the agent to write the `detached` event and to stop a hang-up from stopping the run."""
    engine = make_engine(tmp_path).start()
    try:
        running(engine)
        ack = engine.submit(cmd.Detach("key"))
        assert ack.ok and ack.message == "detached: the run goes on without its terminal"
        assert [e["reason"] for e in read_events(engine.agent.run_dir) if e["event"] == "detached"] == ["key"]
        engine.submit(cmd.Interrupt(signal.SIGHUP))
        received = wait_for(lambda: [e for e in read_events(engine.agent.run_dir) if e["event"] == "signal_received"],
                            what="the hang-up noted")
        assert received[0]["forwarded"] is False and received[0]["action"] == "ignored"
        assert engine.snapshot().state == GroupState.RUNNING
        assert all(r.state.alive for r in engine.snapshot().ranks)
        assert engine.submit(cmd.Detach("x" * 41)).message == "bad detach reason: expected at most 40 characters of text"
    finally:
        engine.close()


def _rank_0_paused(tmp_path, go, then: str, holds_out: bool = False) -> LocalEngine:
    """Two ranks that print, wait for the file `go`, then run `then` (`holds_out`: SIGTERM
    ignored); started, with rank 0 paused by the user (SIGSTOP)."""
    code = ("import os, pathlib, signal, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if holds_out else "")
            + "print('up', flush=True)\n"
            f"while not pathlib.Path({str(go)!r}).exists():\n    time.sleep(0.02)\n" + then)
    engine = make_engine(tmp_path, code=code).start()
    try:
        running(engine)
        assert engine.submit(cmd.SignalRank(0, signal.SIGSTOP)).ok
        wait_for(lambda: engine.snapshot().paused == (0,), what="rank 0 paused")
    except BaseException:
        engine.close()
        raise
    return engine


def test_a_pause_the_user_ended_says_so_in_the_root_causes_user_action(tmp_path):
    """A rank paused (SIGSTOP) and resumed (SIGCONT) seconds later, then another's failure a while
    after: the root cause said only `you sent SIGSTOP to rank 0 at ..., N s before this failure`,
    as if the rank were paused still. It says when the pause ended."""
    go = tmp_path / "go"
    engine = _rank_0_paused(tmp_path, go, "raise SystemExit(3 if os.environ['RANK'] == '1' else 0)\n")
    try:
        assert engine.submit(cmd.SignalRank(0, signal.SIGCONT)).ok
        go.touch()
        cause = wait_for(lambda: engine.snapshot().root_cause, what="the root cause")
        assert cause.rank == 1
        assert re.fullmatch(r"you sent SIGSTOP to rank 0 at \d\d:\d\d:\d\d \(SIGCONT \d+\.\d s later\), "
                            r"\d+\.\d s before this failure", cause.user_action), cause.user_action
    finally:
        engine.close()


def test_a_pause_resumed_only_after_the_failure_is_not_said_to_have_ended_before_it(tmp_path):
    """Rank 0 paused, rank 1 fails, and the user's SIGCONT comes while the group stops (rank 0
    holds out against SIGTERM): the note said `(SIGCONT N s later)`, as if the pause had ended
    before the failure, where the rank was paused at the failure."""
    go = tmp_path / "go"
    engine = _rank_0_paused(tmp_path, go, "if os.environ['RANK'] == '1':\n    raise SystemExit(3)\ntime.sleep(60)\n",
                            holds_out=True)
    try:
        go.touch()
        wait_for(lambda: not engine.snapshot().ranks[1].state.alive, what="rank 1 failed")
        assert engine.submit(cmd.SignalRank(0, signal.SIGCONT)).ok
        cause = wait_for(lambda: engine.snapshot().root_cause, what="the root cause")
        assert cause.rank == 1
        assert re.fullmatch(r"you sent SIGSTOP to rank 0 at \d\d:\d\d:\d\d, \d+\.\d s before this failure",
                            cause.user_action), cause.user_action
    finally:
        engine.close()


@pytest.mark.parametrize("resumed", [True, False], ids=["paused-and-resumed", "paused-still"])
def test_a_users_action_long_before_a_failure_leads_its_report_only_if_it_may_have_caused_it(
        tmp_path, monkeypatch, resumed):
    """A rank paused and resumed long before another's failure: `after you sent SIGSTOP to rank 0`
    headed the root cause, the headless lines and the TUI's heading however long before it came
    (hours). Only an action within USER_ACTION_BOUND of the failure counts now (here made 0 s,
    not 900 s: any failure after the action is past it, no sleep), or a pause still in force when
    it came (the peers waited on the paused rank)."""
    from ranktop.core import root_cause
    from ranktop.tui.screens import root_cause_heading

    monkeypatch.setattr(root_cause, "USER_ACTION_BOUND", 0.0)
    go = tmp_path / "go"
    engine = _rank_0_paused(tmp_path, go, "raise SystemExit(3 if os.environ['RANK'] == '1' else 0)\n")
    try:
        if resumed:
            assert engine.submit(cmd.SignalRank(0, signal.SIGCONT)).ok
            wait_for(lambda: engine.snapshot().paused == (), what="rank 0 resumed")
        go.touch()
        cause = wait_for(lambda: engine.snapshot().root_cause, what="the root cause")
        heading = root_cause_heading(engine.snapshot()).plain
    finally:
        engine.close()
    assert cause.rank == 1
    if resumed:
        assert (cause.user_action, cause.user_action_what) == (None, None), cause
        assert "after you" not in heading, heading
    else:
        assert cause.user_action_what == "sent SIGSTOP to rank 0", cause
        assert re.search(r"ROOT CAUSE\s+after you sent SIGSTOP to rank 0:", heading), heading


def test_commands_from_many_threads_are_all_applied_in_the_loop(tmp_path):
    engine = make_engine(tmp_path, n=2).start()
    try:
        running(engine)
        acks: list[cmd.Ack] = []
        threads = [threading.Thread(target=lambda r=r: acks.append(engine.submit(cmd.SignalRank(r % 2, signal.SIGCONT))))
                   for r in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        # None lost, each answered by the loop once it was applied.
        assert len(acks) == 10 and all(a.ok and a.message.startswith("SIGCONT → rank ") for a in acks)
        sent = [e["local_rank"] for e in read_events(engine.agent.run_dir) if e["event"] == "signalled"]
        assert sorted(sent) == [0] * 5 + [1] * 5
    finally:
        engine.close()


def test_only_the_monitor_thread_acts_on_the_ranks(tmp_path):
    engine = make_engine(tmp_path, n=2).start()
    acting: list[tuple[str, str]] = []
    write = engine.agent.events.write

    def noting_thread(event, **fields):  # which thread wrote each record of an action
        acting.append((event, threading.current_thread().name))
        write(event, **fields)

    engine.agent.events.write = noting_thread
    try:
        running(engine)
        engine.submit(cmd.SignalRank(0, signal.SIGCONT))
        engine.submit(cmd.RestartRank(1))
        engine.submit(cmd.Stop())
        wait_for(lambda: engine.snapshot().ended, what="run over")
    finally:
        engine.close()
    acted = {event: name for event, name in acting
             if event in ("signalled", "user_restart_rank", "restart_requested", "user_stop")}
    assert acted == dict.fromkeys(("signalled", "user_restart_rank", "restart_requested", "user_stop"),
                                  "ranktop-engine")


def test_stop_during_a_restart_ends_the_run_and_no_attempt_starts(tmp_path):
    engine = make_engine(tmp_path, STUBBORN, n=2, shutdown_timeout=1.0).start()
    try:
        running(engine)
        assert engine.submit(cmd.RestartGroup()).ok  # the ranks ignore SIGTERM: a second of grace
        assert engine.submit(cmd.Stop()).ok  # lands while the restart is under way
        wait_for(lambda: engine.snapshot().ended, timeout=15, what="run over")
    finally:
        engine.close()
    snap = engine.snapshot()
    assert snap.state == GroupState.STOPPED and snap.attempt == 0
    assert not any(e["event"] == "group_restart" for e in read_events(engine.agent.run_dir))
    # A stop got what it asked for (`ranktop stop` of a run that ended meanwhile exits 0); a restart cannot.
    assert engine.submit(cmd.KillGroup()) == cmd.Ack(True, "the run had ended already")
    assert engine.submit(cmd.RestartGroup()) == cmd.Ack(False, "the run has ended: nothing left to act on")


def test_interrupt_while_closing_kills_at_once(tmp_path):
    engine = make_engine(tmp_path, STUBBORN.replace("SIGTERM", "SIGINT"), n=2, shutdown_timeout=30.0).start()
    try:
        running(engine)
        began = time.monotonic()
        assert engine.submit(cmd.Interrupt(signal.SIGINT)).ok  # forwarded: the ranks ignore it
        wait_for(lambda: engine.snapshot().state == GroupState.STOPPING, what="stopping")
        assert engine.submit(cmd.Interrupt(signal.SIGINT)).ok  # a second Ctrl-C: no more grace
        wait_for(lambda: engine.snapshot().ended, timeout=15, what="run over")
        assert time.monotonic() - began < 15  # far less than the 30 s grace
    finally:
        engine.close()
    snap = engine.snapshot()
    assert snap.exit_status == 128 + signal.SIGINT
    assert all(r.signal_name == "SIGKILL" for r in snap.ranks)


def test_restart_rank_after_the_end_is_refused(tmp_path):
    engine = make_engine(tmp_path, "print('done')", n=1).start()
    wait_for(lambda: engine.snapshot().ended, what="run over")
    ack = engine.submit(cmd.RestartRank(0))
    assert not ack.ok and ack.message == "the run has ended: nothing left to act on"
    assert engine.snapshot().exit_status == 0


def test_wake_after_close_writes_into_no_reused_descriptor(tmp_path):
    ctx = start_processes("t", PY, {0: ("-c", "pass")}, {0: {}}, str(tmp_path))
    assert ctx.wait(timeout=30) is not None
    ctx.close()
    pipes = [os.pipe() for _ in range(16)]  # take the lowest free descriptor numbers
    try:
        ctx.wake()  # a late wake (a signal, a UI command) after the close
        for r, _w in pipes:
            os.set_blocking(r, False)
            with pytest.raises(BlockingIOError):
                os.read(r, 1)
    finally:
        for pair in pipes:
            for fd in pair:
                os.close(fd)


# ----- a rank that outlives SIGKILL ---------------------------------------------------------------
# A rank stuck in the kernel (D state: a hung NFS or NCCL call) cannot be made on demand here, so
# the test makes a rank that really outlives SIGKILL in another way the kernel offers: a ptrace
# tracer that never waits for it. The SIGKILLed rank is then a zombie its parent (us) cannot reap
# until the tracer lets go: from ranktop's side exactly a rank whose pid is not reaped in time.
TRACER = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE = 0x4206
if libc.ptrace(PTRACE_SEIZE, int(sys.argv[1]), None, None) != 0:
    print('error', ctypes.get_errno(), flush=True)
    sys.exit(1)
print('attached', flush=True)
time.sleep(120)  # never waits for the tracee
"""


def test_a_rank_that_outlives_sigkill_is_left_to_the_guard_and_close_is_bounded(tmp_path):
    seen: list[dict] = []
    ctx = PContext("t", PY, {0: ("-c", "import time; print('up', flush=True); time.sleep(60)")}, {0: {}},
                   RunDir.adopt(str(tmp_path)), plan_streams(1, 0, 0, capture_all=True), on_event=seen.append,
                   passthrough_console=False, reap_timeout=1.0).start()
    pid = ctx.pids()[0]
    tracer = subprocess.Popen([PY, "-c", TRACER, str(pid)], stdout=subprocess.PIPE, text=True)
    try:
        line = tracer.stdout.readline().strip()
        if line != "attached":
            pytest.skip(f"cannot ptrace here ({line})")
        began = time.monotonic()
        ctx.close(timeout=0.5)  # SIGTERM, 0.5 s of grace, SIGKILL, then 1 s for the reaping
        took = time.monotonic() - began
        assert took < 8, f"close took {took:.1f}s"
        gone = [e for e in seen if e["event"] == "unreapable"]
        assert len(gone) == 1 and gone[0]["pid"] == pid and gone[0]["kernel_state"] == "Z"
        assert ctx.step().unreapable == {0: pid}
        assert ctx.slots[0].unreapable and not ctx.slots[0].alive
    finally:
        tracer.kill()
        tracer.wait()
        os.waitpid(pid, 0)  # the tracer let go: now the zombie is ours to reap
        ctx.slots[0].proc.popen.returncode = -signal.SIGKILL


def test_agent_reports_an_unreapable_rank_in_snapshot_and_events(tmp_path):
    engine = make_engine(tmp_path, TICKER, n=1, shutdown_timeout=0.5, reap_timeout=1.0).start()
    running(engine)
    pid = engine.snapshot().ranks[0].pid
    tracer = subprocess.Popen([PY, "-c", TRACER, str(pid)], stdout=subprocess.PIPE, text=True)
    try:
        line = tracer.stdout.readline().strip()
        if line != "attached":
            pytest.skip(f"cannot ptrace here ({line})")
        assert engine.submit(cmd.KillRank(0)).ok
        wait_for(lambda: engine.snapshot().ranks[0].state == RankState.UNREAPABLE, timeout=10, what="unreapable")
        assert engine.snapshot().unreapable == (0,)
        engine.close()
        assert engine.snapshot().ended
        assert engine.result.unreapable == {0: pid}
        assert any(e["event"] == "unreapable" and e["pid"] == pid for e in read_events(engine.agent.run_dir))
    finally:
        tracer.kill()
        tracer.wait()
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        engine.close()



# A rank whose executable lost its execute bit: its next start fails at exec, as a start does when
# fork fails (a process limit, no memory), which a test cannot bring about as root.
def test_a_rank_that_cannot_be_restarted_ends_the_run_in_one_line(tmp_path):
    script = tmp_path / "rank.sh"
    script.write_text("#!/bin/sh\necho up\nexec sleep 60\n")
    script.chmod(0o755)
    engine = LocalEngine(make_agent(tmp_path / "logs", entrypoint=str(script), args=(), n=2, name="rank.sh")).start()
    try:
        running(engine)
        script.chmod(0o644)
        assert engine.submit(cmd.RestartRank(0)).ok
        wait_for(lambda: engine.snapshot().ended, timeout=20, what="the run over")
    finally:
        engine.close()
    snap = engine.snapshot()
    assert snap.state == GroupState.FAILED and snap.exit_status == 1 and snap.error is None  # no exception
    assert snap.rendezvous_error == "cannot start local rank 0: Permission denied"
    events = read_events(engine.agent.run_dir)
    assert [e["message"] for e in events if e["event"] == "start_failed"] == [snap.rendezvous_error]
    assert snap.ranks[1].state != RankState.RUNNING  # stopped with the run


def test_a_group_that_cannot_be_restarted_ends_the_run_in_one_line(tmp_path):
    script = tmp_path / "rank.sh"  # rank 0 takes the bit away once rank 1 has started; then both fail
    script.write_text("#!/bin/sh\necho up\nif [ \"$LOCAL_RANK\" = 1 ]; then\n  touch \"$0.started\"\n"
                      "  while [ -x \"$0\" ]; do sleep 0.01; done\n  exit 3\nfi\n"
                      "while [ ! -e \"$0.started\" ]; do sleep 0.01; done\nchmod -x \"$0\"\nexit 3\n")
    script.chmod(0o755)
    done = subprocess.run([sys.executable, "-m", "ranktop", "--headless", "--no-python", "--nproc-per-node", "2",
                           "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), "--run-id", "r", str(script)],
                          capture_output=True, text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "ranktop: error: cannot start local rank 0: Permission denied\n" in done.stderr, done.stderr
    events = read_events(tmp_path / "logs" / "r")
    assert [e["event"] for e in events if e["event"] in ("group_restart", "start_failed", "run_finished")] == [
        "group_restart", "start_failed", "run_finished"]


_LIMIT = "(a process limit: ulimit -u, or the container's pids.max)"


@pytest.mark.parametrize(("limit", "said"), [
    (1, f"ranktop: error: cannot start the orphan guard: Resource temporarily unavailable {_LIMIT}\n"),
    (2, f"ranktop: error: cannot start ranktop's output thread: can't start new thread {_LIMIT}\n"),
    (4, f"ranktop: not serving this run for ranktop ls/stop/logs: can't start new thread {_LIMIT}\n"),
    (5, ""),
])
def test_a_process_limit_met_by_ranktops_own_process_or_thread_is_one_line(tmp_path, limit, said):
    """A cgroup's pids.max counts threads: one rank's headless run is ranktop, its guard, its
    output thread, the rank, the server's thread, then the console's (stdout a pipe). The
    guard's fork and each thread's start ended ranktop in a traceback (the server's after the
    ranks had started: exit 1, no end report, its socket left bound); without the console's,
    the rank's output was lost, said as a console that took nothing for 5s. The first two fail
    the run as a rank's start does; the run goes on unserved with the third; the console is
    written at once without the fourth."""
    from conftest import pids_cgroup, ranktop_cmd

    script = tmp_path / "up.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(0.5)  # holding its pid while its line is shown\n")
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    with pids_cgroup(limit) as group:
        done = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh",
             *ranktop_cmd("--headless", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"), "--run-id", "r",
                          str(script))],
            capture_output=True, text=True, timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
            cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr == said or done.returncode == 1 and said in done.stderr, done.stderr
    events = [e["event"] for e in read_events(tmp_path / "logs" / "r")]
    if limit < 4:
        assert done.returncode == 1 and done.stdout == "" and "start_failed" in events
    else:
        assert done.returncode == 0 and done.stdout == "[default0]:up\n"
        assert os.listdir(runtime / "ranktop") == []  # no socket left behind
    assert events[-1] == "run_finished"
