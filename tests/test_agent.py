"""LocalAgent, launch() and the snapshot/command interface the TUI uses, on real processes."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest
import rank_fns
from conftest import PY, ROOT, Running, make_agent, read_events, tmpfs, wait_for
from ranktop.core import (
    GroupState,
    LocalAgent,
    RankState,
    WorkerError,
    WorkerSpec,
    WorkerState,
    free_port,
    launch,
    strays,
)
from ranktop.core import commands as cmd
from ranktop.core.guard import marker_needle
from ranktop.core.output import OutputPump, StreamSink
from ranktop.core.process import Launch, RankProcess, kernel_state, wait_exit


def test_callable_ranks_return_values_by_global_rank(tmp_path):
    spec = WorkerSpec(role="r", local_world_size=2, entrypoint=rank_fns.echo_env, args=("RANK", "WORLD_SIZE"),
                      nnodes=2, node_rank=1)
    result = LocalAgent(spec, log_dir=str(tmp_path), console=False).run()
    assert result.state == WorkerState.SUCCEEDED and result.exit_status == 0
    assert result.return_values == {2: {"RANK": "2", "WORLD_SIZE": "4"}, 3: {"RANK": "3", "WORLD_SIZE": "4"}}


def test_failure_has_root_cause_with_traceback_and_last_lines(tmp_path):
    spec = WorkerSpec(role="r", local_world_size=3, entrypoint=rank_fns.fail_rank, args=(2, "lost the batch"))
    result = LocalAgent(spec, log_dir=str(tmp_path), console=False, shutdown_timeout=5).run()
    assert result.state == WorkerState.FAILED and result.exit_status == 1
    assert set(result.failures) == {2}  # as torch: the failed rank, not the two stopped for it
    cause = result.root_cause
    assert (cause.rank, cause.exitcode, cause.message) == (2, 1, "RuntimeError: lost the batch")
    assert "fail_rank" in cause.traceback and cause.error_file.endswith("attempt_0/2/error.json")
    assert any("RuntimeError: lost the batch" in line for line in cause.last_lines)


def test_snapshot_states_and_user_commands(tmp_path):
    agent = make_agent(tmp_path, shutdown_timeout=5, code="""
        import time
        print("ready", flush=True)
        while True:
            print("tick", flush=True)
            time.sleep(0.02)
    """, n=3)
    run = Running(agent)
    try:
        wait_for(lambda: all(r.state == RankState.RUNNING for r in agent.snapshot().ranks), what="running ranks")
        snap = agent.snapshot()
        assert snap.state == GroupState.RUNNING and snap.world_size == 3 and snap.log_dir == agent.run_dir
        assert agent.output(0)[0] == b"ready"

        pid = run.rank(0).pid
        agent.signal_rank(0, signal.SIGSTOP)  # not terminating: the rank stays, just stopped
        wait_for(lambda: kernel_state(pid) == "T", what="rank 0 stopped by the kernel")
        frozen = _lines_once_rank_1_printed(agent, 3)  # what rank 0 wrote before it stopped has been read
        _lines_once_rank_1_printed(agent, 10)
        assert len(agent.output(0)) == frozen, "a stopped rank printed"
        assert run.rank(0).state == RankState.RUNNING and run.rank(0).paused
        agent.signal_rank(0, signal.SIGCONT)
        wait_for(lambda: len(agent.output(0)) > frozen + 3, what="rank 0 printing again")
        assert run.rank(0).state == RankState.RUNNING and not run.rank(0).paused

        old_pid = run.rank(1).pid
        agent.restart_rank(1)
        wait_for(lambda: run.rank(1).pid != old_pid and run.rank(1).state == RankState.RUNNING,
                 what="rank 1 restarted")
        assert run.rank(1).restarts == 1 and run.rank(0).restarts == 0

        agent.kill_rank(2)
        wait_for(lambda: run.rank(2).state == RankState.KILLED, what="rank 2 killed")
        assert run.rank(2).signal_name == "SIGKILL"
        assert run.rank(0).state == RankState.RUNNING  # a user kill is not a failure that stops the group
        agent.kill_group()
        result = run.join()
    finally:
        agent.kill_group() if run.thread.is_alive() else None
        run.join()
    assert result.state == WorkerState.STOPPED and agent.snapshot().state == GroupState.STOPPED
    names = [(e["event"], e.get("local_rank"), e.get("signal")) for e in read_events(agent.run_dir)]
    assert ("signalled", 0, "SIGSTOP") in names and ("signalled", 0, "SIGCONT") in names
    assert ("signalled", 2, "SIGKILL") in names and ("user_restart_rank", 1, None) in names
    assert ("user_stop", None, "SIGKILL") in names


def _stream_sinks() -> int:
    """StreamSink objects alive in this process (each holds a rank stream's buffers and log file)."""
    gc.collect()
    return sum(type(o) is StreamSink for o in gc.get_objects())  # (isinstance asks torch's modules: a warning)


def test_a_rank_restarted_many_times_keeps_only_its_live_streams(tmp_path):
    """Each restart of one rank kept the two sinks of the process it replaced for the rest of the
    attempt: ~5 KiB a restart, without end. Only the live process's (and those of the last few,
    while their pipes drain) are kept."""
    agent = make_agent(tmp_path, n=1, code="""
        import time
        print("up", flush=True)
        time.sleep(60)
    """)
    restarts = 20
    with Running(agent) as running:
        wait_for(lambda: running.snapshot().ranks[0].state == RankState.RUNNING, what="rank 0 running")
        before = _stream_sinks()
        for i in range(1, restarts + 1):
            running.restart_rank(0)
            wait_for(lambda i=i: (r := running.snapshot().ranks[0]).restarts == i and r.state == RankState.RUNNING,
                     timeout=20, what=f"restart {i} running")
        extra = _stream_sinks() - before
    assert extra <= 8, f"{extra} more stream sinks after {restarts} restarts of one rank"


def test_restart_group_starts_the_next_attempt(tmp_path):
    agent = make_agent(tmp_path, shutdown_timeout=5, code="""
        import os, time
        print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
        time.sleep(60)
    """)
    run = Running(agent)
    try:
        wait_for(lambda: agent.output(0) == [b"attempt 0"], what="attempt 0 output")
        agent.restart_group()
        wait_for(lambda: agent.snapshot().attempt == 1 and agent.output(0) == [b"attempt 1"], what="attempt 1")
        assert all(r.restarts == 1 for r in agent.snapshot().ranks)
    finally:
        agent.stop()
        run.join()
    assert ("group_restart", "user") in [(e["event"], e.get("reason")) for e in read_events(agent.run_dir)]


def test_a_replaced_attempt_lets_go_of_its_output_and_its_log_files_keep_it(tmp_path):
    """The next attempt's start empties the rings of the one it replaced: an attempt can outlive
    its use in a reference cycle, frozen with start-up's objects in the TUI (gc.freeze), and up
    to 8 MiB a rank of output with it."""
    agent = make_agent(tmp_path, n=1, max_restarts=1, code="""
        import os, sys
        print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], "x" * 5000, flush=True)
        sys.exit(3)
    """)
    first = []
    start = agent._start_attempt

    def start_and_keep() -> bool:  # (the test's own reference to the first attempt's context)
        started = start()
        if not first:
            first.append(agent.pcontext)
        return started

    agent._start_attempt = start_and_keep
    result = agent.run()
    assert result.exit_status == 1 and agent.attempt == 1
    (old,) = first
    assert old is not agent.pcontext and old.slots[0].ring.tail() == [] and old.slots[0].ring.bytes == 0
    assert agent.pcontext.slots[0].ring.tail() == [b"attempt 1 " + b"x" * 5000]  # the last one keeps its own
    log = Path(agent.run_dir) / "attempt_0" / "0" / "stdout.log"
    assert log.read_bytes() == b"attempt 0 " + b"x" * 5000 + b"\n"


def test_the_earlier_attempts_a_snapshot_carries_are_bounded_and_events_say_each(tmp_path):
    """Each earlier attempt's words went into every snapshot (served to each attach client several
    times a second), final.json and the end report: 300 group restarts made a 27 KB line. They
    carry the first, the last three and a count of those between; events.jsonl says each."""
    from ranktop.core.report import report_after_tui

    agent = make_agent(tmp_path, n=1, max_restarts=8, code="import sys; sys.exit(3)")
    result = agent.run()
    assert result.exit_status == 1 and agent.attempt == 8
    words = [f"attempt_{k}: rank 0 failed (exit 3)" for k in range(8)]
    snap = agent.snapshot()
    assert snap.earlier_attempts == (words[0], *words[5:]) and snap.earlier_left_out == 4
    assert snap.earlier_count == 8 and not snap.earlier_calm
    final = json.loads((Path(agent.run_dir) / "final.json").read_text())
    assert (final["earlier_attempts"], final["earlier_left_out"]) == ([words[0], *words[5:]], 4)
    assert [e["earlier"] for e in read_events(agent.run_dir) if e["event"] == "group_restart"] == words
    assert f"  earlier attempts: {words[0]}; ... 4 more (events.jsonl) ...; {'; '.join(words[5:])}\n" in \
        report_after_tui(snap) + "\n"


def test_a_replaced_attempt_is_freed_without_a_garbage_collection_and_leaves_no_trace(tmp_path):
    """Each attempt's context sat in reference cycles (its sinks, sweeps and stray tracker called
    back into it through bound methods): only a full collection freed it, and between two of them
    a run restarting its group fast held ~150 attempts (RSS 20 to 50 MB in 300 restarts). Its
    ranks' sessions and its marker stayed in the module's tables for as long as ranktop ran."""
    agent = make_agent(tmp_path, n=2, max_restarts=3, code="import sys; sys.exit(3)")
    contexts, pids, tokens = [], set(), set()
    start = agent._start_attempt

    def start_and_watch() -> bool:
        started = start()
        # the attempt it replaced is gone already, with no collection (its rings with it)
        assert [ref() is not None for ref in contexts] == [False] * len(contexts)
        contexts.append(weakref.ref(agent.pcontext))
        pids.update(slot.proc.pid for slot in agent.pcontext.slots)
        tokens.add(agent.pcontext.token)
        return started

    agent._start_attempt = start_and_watch
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        result = agent.run()
        alive = [ref() is not None for ref in contexts]
    finally:
        if was_enabled:
            gc.enable()
    assert result.exit_status == 1 and agent.attempt == 3
    assert alive == [False, False, False, True]  # the last one is the agent's to report on
    assert not pids & set(strays._rank_sessions)
    assert not {marker_needle(token) for token in tokens} & strays._markers


def test_a_rank_the_user_killed_is_the_user_action_not_one_ranktop_stopped(tmp_path):
    """The user kills rank 1; rank 0 then fails because of it (as a collective would), and
    ranktop stops rank 2. The root cause named rank 1 among the ranks "stopped by ranktop after
    it", under the note that the user had killed it."""
    gone = tmp_path / "peer-gone"
    agent = make_agent(tmp_path, n=3, shutdown_timeout=5, code=f"""
        import os, sys, time
        print("up", flush=True)
        if os.environ["RANK"] == "0":
            while not os.path.exists({str(gone)!r}):
                time.sleep(0.02)
            sys.exit(1)
        time.sleep(60)
    """)
    run = Running(agent)
    wait_for(lambda: all(agent.output(r) == [b"up"] for r in range(3)), what="three ranks up")
    assert agent.kill_rank(1)
    wait_for(lambda: run.rank(1).state == RankState.KILLED, what="rank 1 killed")
    gone.touch()
    result = run.join()
    cause = agent.snapshot().root_cause
    assert result.exit_status == 1 and cause.rank == 0 and "you killed rank 1" in cause.user_action
    assert cause.stopped == ((2, "killed by SIGTERM"),), cause.stopped


def test_stall_detection_marks_silent_rank_and_clears(tmp_path):
    """Each stall_detected is answered: by stall_cleared once the rank prints again, also when it
    prints and ends within one monitor pass (rank 2: nothing answered it), else by its `exited`
    saying it ended stalled (rank 3)."""
    stalls = []
    agent = make_agent(tmp_path, n=4, shutdown_timeout=5, code=f"""
        import os, time
        rank = os.environ["RANK"]
        if rank == "1":
            print("quiet now", flush=True)
            time.sleep(1.0)
            print("back", flush=True)
            time.sleep(60)
        if rank in ("2", "3"):
            print("quiet now", flush=True)
            while not os.path.exists({str(tmp_path / "go")!r} + rank):  # the test saw its stall
                time.sleep(0.01)
            if rank == "2":
                os.write(1, b"back\\n")  # and at once gone: no monitor pass in between
            os._exit(0)
        while True:
            print("tick", flush=True)
            time.sleep(0.05)
    """, stall_timeout=0.4, monitor_interval=0.05, on_stalls=stalls.extend)
    run = Running(agent)
    try:
        wait_for(lambda: run.rank(1).state == RankState.STALLED, what="rank 1 stalled")
        assert run.rank(0).state == RankState.RUNNING
        assert run.rank(1).stall_seconds >= 0.4
        wait_for(lambda: run.rank(1).state == RankState.RUNNING, what="rank 1 back")
        # The state is read off the output at once; the monitor logs the change on its next pass.
        wait_for(lambda: ("stall_cleared", 1) in _event_kinds(agent), what="the stall_cleared event")
        wait_for(lambda: {("stall_detected", 2), ("stall_detected", 3)} <= set(_event_kinds(agent)),
                 what="ranks 2 and 3 reported stalled")
        for rank in (2, 3):
            (tmp_path / f"go{rank}").touch()
        wait_for(lambda: run.rank(2).state == run.rank(3).state == RankState.SUCCEEDED, what="ranks 2 and 3 ended")
    finally:
        agent.stop()
        run.join()
    assert sorted(s.rank for s in stalls) == [1, 2, 3]  # each once, in whatever order they went quiet
    kinds = _event_kinds(agent)
    assert ("stall_detected", 1) in kinds and ("stall_cleared", 1) in kinds
    ends = [(e["event"], e.get("stalled")) for e in read_events(agent.run_dir)
            if e.get("rank") == 2 and e["event"] in ("stall_detected", "stall_cleared", "exited")]
    assert ends == [("stall_detected", None), ("stall_cleared", None), ("exited", False)], ends
    ends = [(e["event"], e.get("stalled")) for e in read_events(agent.run_dir)
            if e.get("rank") == 3 and e["event"] in ("stall_detected", "stall_cleared", "exited")]
    assert ends == [("stall_detected", None), ("exited", True)], ends


def test_a_rank_is_paused_as_the_kernel_says_whoever_stopped_it():
    """`paused` comes from what the kernel tells the rank's parent (waitid), not from a /proc read
    per snapshot: a SIGSTOP and a SIGCONT from outside ranktop show, and a rank killed while
    stopped is not paused in the moment before it is reaped (it told nothing of that)."""
    pump = OutputPump()
    proc = RankProcess(Launch(0, [PY, "-c", "import time; time.sleep(60)"], dict(os.environ), {}), pump)
    try:
        assert not proc.stopped()
        os.kill(proc.pid, signal.SIGSTOP)  # from elsewhere: ranktop sent nothing
        wait_for(proc.stopped, what="the rank paused")
        assert kernel_state(proc.pid) == "T" and proc.stopped()  # (told once, known after)
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: not proc.stopped(), what="the rank resumed")
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(proc.stopped, what="the rank paused again")
        os.kill(proc.pid, signal.SIGKILL)
        wait_for(lambda: kernel_state(proc.pid) == "Z", what="the rank dead, not yet reaped")
        assert not proc.stopped()
        assert proc.poll() == -signal.SIGKILL and not proc.stopped()
    finally:
        if proc.poll() is None:
            proc.signal_group(signal.SIGKILL)
            wait_exit(proc.popen, 10)
        pump.close()


def _lines_once_rank_1_printed(agent, more: int) -> int:
    """Rank 0's line count, taken once rank 1 printed `more` lines after this call: the output
    thread has then read everything rank 0 wrote before that."""
    start = len(agent.output(1))
    wait_for(lambda: len(agent.output(1)) >= start + more, what=f"rank 1 printed {more} more lines")
    return len(agent.output(0))


def _event_kinds(agent) -> list[tuple[str, int | None]]:
    return [(e["event"], e.get("rank")) for e in read_events(agent.run_dir)]


def test_launch_returns_values_and_raises_worker_error(tmp_path):
    assert launch(rank_fns.echo_env, "RANK", nprocs=2) == {0: {"RANK": "0"}, 1: {"RANK": "1"}}
    with pytest.raises(WorkerError, match=r"worker\[0\] failed with exitcode=3") as info:
        launch(rank_fns.exit_with, 3, nprocs=1)
    assert (info.value.worker_id, info.value.exitcode) == (0, 3)


def test_launch_stops_every_rank_at_the_first_failure():
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"^worker\[1\] failed with exitcode=1$") as info:
        launch(rank_fns.fail_only_rank, 1, nprocs=3)  # ranks 0 and 2 would sleep 60 s
    assert (info.value.worker_id, info.value.exitcode) == (1, 1)
    assert time.monotonic() - started < 30  # they were stopped, not waited for


def test_launch_gives_the_ranks_its_master_addr_and_port_else_localhost_and_a_free_port():
    names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
    port = free_port()
    asked = launch(rank_fns.echo_env_of, names, nprocs=2, master_addr="127.0.0.1", master_port=port)
    assert asked == {r: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"} for r in (0, 1)}
    default = launch(rank_fns.echo_env_of, names, nprocs=2)
    assert default[0] == default[1] and default[0]["MASTER_ADDR"] == "localhost"
    assert 0 < int(default[0]["MASTER_PORT"]) < 65536


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_launch_caller_signalled_stops_ranks_and_raises(tmp_path, sig):
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        import rank_fns
        from ranktop.core import launch, MainProcessError
        try:
            launch(rank_fns.fail_only_rank, 99, 2)  # no rank 99: both ranks sleep until stopped
        except MainProcessError as e:
            print("MainProcessError", e.signal_no, flush=True)
    """)
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    wait_for(lambda: len(_children(proc.pid)) >= 2, what="two ranks started")
    ranks = _children(proc.pid)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == f"MainProcessError {int(sig)}"
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in ranks), what="ranks gone")


def _children(pid):
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children() if "guard.main()" not in " ".join(c.cmdline())]
    except psutil.Error:
        return []


def test_usr1_goes_to_the_rank_alone_and_user_stop_has_no_root_cause(tmp_path):
    agent = make_agent(tmp_path, shutdown_timeout=5, code="""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGUSR1, lambda *a: print("got USR1", flush=True))
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        sys.stdout.write(f"child {child.pid}\\n")  # one write: never seen half-printed
        while True:
            time.sleep(0.05)
    """, n=1)
    run = Running(agent)
    try:
        line = wait_for(lambda: next((x for x in agent.output(0) if x.startswith(b"child")), None), what="child pid")
        child = int(line.split()[1])
        agent.signal_rank(0, signal.SIGUSR1)
        wait_for(lambda: b"got USR1" in agent.output(0), what="the rank's handler ran")
        with open(f"/proc/{child}/stat") as f:
            assert f.read().split(") ")[1][0] != "Z"  # the child, without a handler, was not signalled
        assert run.rank(0).state == RankState.RUNNING
    finally:
        agent.stop()
    result = run.join()
    assert result.state == WorkerState.STOPPED and result.root_cause is None


def test_wait_exit_reaps_at_the_exit_and_leaves_a_running_process_alone():
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    assert wait_exit(quick, timeout=30) and quick.returncode == 0
    assert wait_exit(quick, timeout=30)  # reaped already: nothing to wait for
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not wait_exit(slow, timeout=0.1)
        assert slow.poll() is None  # still running, and still ours to reap
    finally:
        slow.kill()
        assert wait_exit(slow, timeout=30) and slow.returncode == -signal.SIGKILL


def test_a_rank_that_survives_the_users_stop_signal_fails_on_its_own_later(tmp_path):
    """`x` INT breaks a rank into pdb (or a loop that catches KeyboardInterrupt): it runs on. It
    stayed `stopping` for good, and a later exit of its own counted as the user's stop, not a
    failure: its siblings were never stopped and the group hung in its collectives. Quiet through
    its grace, it is not stalled then (it was, `no output for 0s` headless; pdb at its prompt
    again was said to be stalled, not waiting for input): it is being stopped."""
    trigger = tmp_path / "exit now"
    agent = make_agent(tmp_path, shutdown_timeout=1.0, stall_timeout=0.4, code=f"""
        import os, sys, time
        if os.environ["LOCAL_RANK"] == "1":
            time.sleep(60)
        print("ready", flush=True)
        try:
            while True:
                time.sleep(0.02)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        while not os.path.exists({str(trigger)!r}):
            time.sleep(0.02)
        sys.exit(3)
    """)
    run = Running(agent)
    with run:
        wait_for(lambda: agent.output(0)[:1] == [b"ready"], what="rank 0 ready")
        agent.signal_rank(0, signal.SIGINT)
        wait_for(lambda: b"interrupted" in agent.output(0), what="rank 0 interrupted")
        assert run.rank(0).state == RankState.STOPPING
        # (quiet since, it is stalled 0.4 s after the grace)
        wait_for(lambda: run.rank(0).state in (RankState.RUNNING, RankState.STALLED),
                 what="running again once the grace passed")
        trigger.write_text("")
        result = run.join()
    assert result.state == WorkerState.FAILED and result.root_cause.local_rank == 0
    assert result.root_cause.exitcode == 3
    events = [e["event"] for e in read_events(agent.run_dir) if e.get("local_rank", 0) == 0]
    assert "signal_survived" in events
    assert "stall_detected" not in events[:events.index("signal_survived")], events


def test_a_rank_restarted_while_its_group_stops_is_not_started_again(tmp_path):
    """`r` on the failed rank while the group stops for its failure (its siblings have the grace):
    the rank was started again, as nobody's to stop, and the group waited on it to end on its own."""
    first, refused = tmp_path / "started once", tmp_path / "restart refused"
    agent = make_agent(tmp_path, shutdown_timeout=10.0, code=f"""
        import os, signal, sys, time
        if os.environ["LOCAL_RANK"] == "1":
            def stay(*_):  # the group stops until the test has had its answer, then rank 1 ends
                while not os.path.exists({str(refused)!r}):
                    time.sleep(0.02)
                sys.exit(0)
            signal.signal(signal.SIGTERM, stay)
            print("ready", flush=True)
            time.sleep(60)
        if not os.path.exists({str(first)!r}):
            open({str(first)!r}, "w").close()
            while b"ready" not in open(os.path.join(os.environ["RANKTOP_TEST_DIR"], "ready"), "rb").read():
                time.sleep(0.02)
            sys.exit(3)
        print("started again", flush=True)
        time.sleep(60)
    """, env={"RANKTOP_TEST_DIR": str(tmp_path)})
    (tmp_path / "ready").write_bytes(b"")
    run = Running(agent)
    with run:
        wait_for(lambda: agent.output(1)[:1] == [b"ready"], what="rank 1 ready")
        (tmp_path / "ready").write_bytes(b"ready")
        wait_for(lambda: run.rank(0).state == RankState.FAILED and run.rank(1).state == RankState.STOPPING,
                 what="the group stopping for rank 0's failure")
        ack = agent.submit(cmd.RestartRank(0))
        refused.touch()
        assert not ack.ok and "stopping" in ack.message
        result = run.join(timeout=15)
    assert result.state == WorkerState.FAILED and result.root_cause.local_rank == 0
    starts = [e for e in read_events(agent.run_dir) if e["event"] == "started" and e["local_rank"] == 0]
    assert len(starts) == 1


def test_a_stop_signal_to_a_paused_rank_reaches_it_at_once(tmp_path):
    """`x` TERM to a rank paused with `x` STOP: it never saw the signal, so once the grace passed
    it counted as having survived it, and when resumed it died of it as a failure of its own,
    which ended the group. A stop signal to one rank is followed by SIGCONT, as the group's is."""
    agent = make_agent(tmp_path, shutdown_timeout=1.0, code="""
        import time
        print("ready", flush=True)
        time.sleep(60)
    """)
    run = Running(agent)
    with run:
        wait_for(lambda: all(agent.output(r)[:1] == [b"ready"] for r in (0, 1)), what="both ranks ready")
        pid = run.rank(0).pid
        agent.signal_rank(0, signal.SIGSTOP)
        wait_for(lambda: kernel_state(pid) == "T", what="rank 0 stopped by the kernel")
        agent.signal_rank(0, signal.SIGTERM)
        wait_for(lambda: run.rank(0).state == RankState.KILLED, what="rank 0 ended by the user's SIGTERM")
        assert not run.rank(0).paused and run.rank(1).state == RankState.RUNNING
    events = [e["event"] for e in read_events(agent.run_dir)]
    assert "signal_survived" not in events and "exit_held" not in events


def test_a_rank_that_dies_of_the_users_signal_after_the_grace_is_still_the_users_stop(tmp_path):
    """A rank that traps `x` TERM to save a checkpoint for longer than the grace, then dies of the
    signal: its end is the user's stop, not a failure that would stop its siblings."""
    agent = make_agent(tmp_path, shutdown_timeout=0.5, code="""
        import os, signal, time
        if os.environ["LOCAL_RANK"] == "1":
            print("ready", flush=True)
            time.sleep(60)
        asked = []
        signal.signal(signal.SIGTERM, lambda *_: asked.append(1))
        print("ready", flush=True)
        while not asked:
            time.sleep(0.02)
        print("saving a checkpoint", flush=True)
        time.sleep(1.5)  # three graces: the rank counts as having survived the signal meanwhile
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    """)
    run = Running(agent)
    with run:
        wait_for(lambda: all(agent.output(r)[:1] == [b"ready"] for r in (0, 1)), what="both ranks ready")
        agent.signal_rank(0, signal.SIGTERM)
        wait_for(lambda: [e["event"] for e in read_events(agent.run_dir, while_written=True)].count("signal_survived"),
                 what="the grace passed with rank 0 alive")
        wait_for(lambda: run.rank(0).state == RankState.KILLED, what="rank 0 dead of its SIGTERM")
        events = read_events(agent.run_dir, while_written=True)
        assert [e["by_us"] for e in events if e["event"] == "exited"] == [True]
        assert not [e for e in events if e["event"] in ("exit_held", "group_failed")]
        assert run.rank(1).state == RankState.RUNNING and agent.snapshot().state == GroupState.RUNNING


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGALRM])
def test_a_rank_that_dies_of_any_signal_the_user_sent_it_is_no_failure(tmp_path, sig):
    """The picker's USR1/USR2 (to the rank alone) and any other signal a client of the socket sends:
    a rank with no handler for it dies of it, the user's doing, as for TERM. It was a failure, the
    root cause, and its sibling was stopped (found by a protocol audit: SignalRank 12)."""
    agent = make_agent(tmp_path, code="""
        import time
        print("ready", flush=True)
        time.sleep(60)
    """)
    run = Running(agent)
    with run:
        wait_for(lambda: all(agent.output(r)[:1] == [b"ready"] for r in (0, 1)), what="both ranks ready")
        agent.signal_rank(0, sig)
        exited = wait_for(lambda: [(e["signal"], e["by_us"]) for e in read_events(agent.run_dir, while_written=True)
                                   if e["event"] == "exited"], what="rank 0 dead of the user's signal")
        assert exited == [(sig.name, True)] and run.rank(0).state == RankState.KILLED
        events = read_events(agent.run_dir, while_written=True)
        assert not [e for e in events if e["event"] in ("exit_held", "group_failed")]
        assert run.rank(1).state == RankState.RUNNING and agent.snapshot().state == GroupState.RUNNING


def test_a_restarted_ranks_last_lines_come_before_the_separator(tmp_path):
    """The separator went into the ring as soon as the old process was reaped; its last lines,
    still in its pipe for the output thread's next round, were read after it and shown as the
    new process's (seen in the restart-separator screenshot)."""
    agent = make_agent(tmp_path, n=1, code="""
        import os, signal, sys, time
        def last_words(*_):
            sys.stdout.write("".join(f"last words {i}\\n" for i in range(2000)))
            sys.stdout.flush()
            os._exit(0)
        signal.signal(signal.SIGTERM, last_words)
        print("ready", flush=True)
        while True:
            time.sleep(0.3)  # a trickle: the output thread reads it in its slow rounds
    """)
    run = Running(agent)
    with run:
        for restart in (1, 2, 3):
            wait_for(lambda: agent.output(0)[-1:] == [b"ready"], what="the rank ready")
            agent.restart_rank(0)
            wait_for(lambda r=restart: run.rank(0).restarts == r and agent.output(0)[-1:] == [b"ready"],
                     what="restarted")
            lines = agent.output(0)
            separator = max(i for i, line in enumerate(lines) if b"restart" in line and b"(ranktop)" in line)
            assert lines[separator - 1] == b"last words 1999" and lines[separator + 1:] == [b"ready"], lines[-5:]


def _fill_inodes(disk: Path) -> None:
    """Empty files on `disk` until it has no inode left: no new file can be made there (ENOSPC)."""
    for n in range(100_000):
        try:
            os.close(os.open(disk / f"ballast{n}", os.O_WRONLY | os.O_CREAT, 0o600))
        except OSError:
            return
    raise AssertionError(f"{disk} never filled up")


def test_a_rank_ending_without_a_value_on_a_full_disk_still_lets_its_peers_go(tmp_path, monkeypatch, capfd):
    """Function ranks: rank 0 returns and waits for rank 1 to end; rank 1 exits 0 without a value
    once the disk under the context's files has no room for a new file. Its exit marker could not
    be made and rank 0 waited until the group was closed (here: stopped after 60 s). ranktop now
    turns rank 1's payload, a file already there, into the marker, and says the marker failed."""
    import tempfile
    import threading

    with tmpfs(tmp_path / "disk", "size=1m,nr_inodes=64") as disk:
        monkeypatch.setattr(tempfile, "tempdir", str(disk))  # where the context keeps its files
        go = tmp_path / "go"
        spec = WorkerSpec(role="r", local_world_size=2, entrypoint=rank_fns.exit0_once, args=(str(go),))
        agent = LocalAgent(spec, log_dir=str(tmp_path / "logs"), console=True, shutdown_timeout=2)

        def fill_the_disk_once_rank_0_returned() -> None:
            wait_for(lambda: list(disk.glob("ranktop-*/0.ret")), timeout=60, what="rank 0's return value")
            _fill_inodes(disk)
            go.touch()

        filler = threading.Thread(target=fill_the_disk_once_rank_0_returned, daemon=True)
        filler.start()
        watchdog = threading.Timer(60, agent.stop)
        watchdog.start()
        try:
            result = agent.run()
        finally:
            watchdog.cancel()
            filler.join(timeout=60)
    assert result.state == WorkerState.SUCCEEDED and result.return_values == {0: "returned", 1: None}
    # (rank 0's own marker, made as it ends after rank 1, fails the same way)
    (marker_failed,) = [e for e in read_events(next((tmp_path / "logs").iterdir()))
                        if e["event"] == "exit_marker_failed" and e["rank"] == 1]
    assert (marker_failed["rank"], marker_failed["error"], marker_failed["peers_told"]) == (
        1, "No space left on device", True)
    err = capfd.readouterr().err
    assert (f"ranktop: rank 1: cannot write its exit marker {marker_failed['path']} (No space left on device); "
            "its payload file became the marker") in err.splitlines(), err


# A rank whose worker, in the rank's own process group, ignores SIGTERM (a data loader worker, a
# child that checkpoints): the rank itself dies of SIGTERM at once. Every line says who printed it.
_RANK_WITH_A_STUBBORN_WORKER = """
    import os, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-u", "-c",
                               "import os, signal, time\\n"
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                               "while True:\\n"
                               "    print('worker', os.getpid(), flush=True)\\n"
                               "    time.sleep(0.02)\\n"])
    print("rank", os.environ["LOCAL_RANK"], "worker", worker.pid, flush=True)
    time.sleep(60)
"""


def _worker_pid(agent: LocalAgent, local_rank: int) -> int:
    """The pid of the rank's worker, once the worker itself printed (it ignores SIGTERM from then on)."""
    line = wait_for(lambda: next((line for line in agent.output(local_rank) if line.startswith(b"rank ")), None),
                    what=f"rank {local_rank} up with its worker")
    pid = int(line.split()[-1])
    wait_for(lambda: f"worker {pid}".encode() in agent.output(local_rank), what=f"rank {local_rank}'s worker up")
    return pid


def _gone(pid: int) -> bool:
    return kernel_state(pid) in (None, "Z")


def test_a_restart_kills_what_the_old_rank_left_in_its_group_before_the_new_one_starts(tmp_path):
    """The restart's SIGTERM ended the rank at once; its worker ignored it, and the grace's SIGKILL
    only ever went to a group whose leader was alive: the new rank started beside the old worker,
    which ran until the run ended, its lines shown after the separator as the new process's."""
    agent = make_agent(tmp_path, n=1, shutdown_timeout=1.0, code=_RANK_WITH_A_STUBBORN_WORKER)
    run = Running(agent)
    with run:
        old = _worker_pid(agent, 0)
        agent.restart_rank(0)
        wait_for(lambda: run.rank(0).restarts == 1 and run.rank(0).state == RankState.RUNNING, what="restarted")
        assert _gone(old), "the old rank's worker outlived the restart"
        lines = agent.output(0)
        separator = max(i for i, line in enumerate(lines) if b"restart 1 of this rank" in line)
        new = int(wait_for(lambda: [line for line in agent.output(0)[separator:] if line.startswith(b"rank ")],
                           what="the new rank up")[0].split()[-1])
        lines = wait_for(lambda: (seen := agent.output(0)).count(f"worker {new}".encode()) >= 5 and seen,
                         what="the new worker printing")
        assert f"worker {old}".encode() not in lines[separator:], lines[separator:separator + 5]
        assert f"worker {old}".encode() in lines[:separator]
    starts = [e for e in read_events(agent.run_dir) if e["event"] == "started"]
    assert len(starts) == 2


def test_the_users_sigterm_to_a_rank_kills_what_it_left_in_its_group_after_the_grace(tmp_path):
    """`x` TERM to one rank whose worker ignores SIGTERM: the rank died of it, and its worker ran on
    for the rest of the run, nothing left to escalate once the rank's own process was gone."""
    agent = make_agent(tmp_path, n=2, shutdown_timeout=0.5, code=_RANK_WITH_A_STUBBORN_WORKER)
    run = Running(agent)
    with run:
        worker = _worker_pid(agent, 0)
        _worker_pid(agent, 1)
        agent.signal_rank(0, signal.SIGTERM)
        wait_for(lambda: run.rank(0).state == RankState.KILLED, what="rank 0 dead of the user's SIGTERM")
        wait_for(lambda: _gone(worker), what="rank 0's worker killed once the grace passed")
        assert run.rank(1).state == RankState.RUNNING and agent.snapshot().state == GroupState.RUNNING


# Rank 0 checkpoints for `CHECKPOINT_S` seconds in its SIGTERM handler, saying so each time it is
# entered; rank 1 fails once rank 0 is ready.
_CHECKPOINT_THEN_FAIL = """
    import os, signal, sys, time
    ready = os.path.join(os.environ["RANKTOP_TEST_DIR"], "ready")
    if os.environ["LOCAL_RANK"] == "1":
        while not os.path.exists(ready):
            time.sleep(0.02)
        sys.exit(3)
    def checkpoint(*_):
        print("got SIGTERM, checkpointing", flush=True)
        time.sleep(float(os.environ["CHECKPOINT_S"]))
        sys.exit(143)
    signal.signal(signal.SIGTERM, checkpoint)
    open(ready, "w").close()
    time.sleep(60)
"""


@pytest.mark.parametrize("command", [cmd.Stop(signal.SIGTERM), cmd.RestartGroup()], ids=["stop", "restart_group"])
def test_a_stop_while_the_group_stops_does_not_signal_a_stopping_rank_again(tmp_path, command):
    """`ranktop stop` (or `R`) while the group stops for a failure sent SIGTERM again to the rank
    already in its checkpoint handler: the handler was entered a second time, inside the first."""
    agent = make_agent(tmp_path, shutdown_timeout=10.0, code=_CHECKPOINT_THEN_FAIL,
                       env={"RANKTOP_TEST_DIR": str(tmp_path), "CHECKPOINT_S": "1.5"})
    run = Running(agent)
    with run:
        wait_for(lambda: b"got SIGTERM, checkpointing" in agent.output(0), what="rank 0 checkpointing")
        assert agent.submit(command).ok
        run.join(timeout=20)
    log = Path(agent.attempt_dir(0), "0", "stdout.log").read_bytes()
    assert log.count(b"got SIGTERM") == 1, log
    # Its checkpoint ran to its end, not cut short by a SIGKILL. (Attempt 0's: after R the next
    # attempt's rank 1 fails at once, maybe before rank 0 has its handler.)
    first_end = next(e for e in read_events(agent.run_dir) if e["event"] == "exited" and e["local_rank"] == 0)
    assert first_end["attempt"] == 0 and first_end["exitcode"] == 143, first_end


def test_a_shorter_grace_while_the_group_stops_brings_the_sigkill_forward(tmp_path):
    """Also: once a stop was asked for, `R` is refused. It was answered `restarting the group`
    and logged as `user_restart_group`, and the run stopped all the same."""
    agent = make_agent(tmp_path, shutdown_timeout=60.0, code=_CHECKPOINT_THEN_FAIL,
                       env={"RANKTOP_TEST_DIR": str(tmp_path), "CHECKPOINT_S": "60"})
    run = Running(agent)
    with run:
        wait_for(lambda: b"got SIGTERM, checkpointing" in agent.output(0), what="rank 0 checkpointing")
        assert agent.submit(cmd.Stop(signal.SIGTERM)).ok  # the user's stop, its grace no shorter
        restart = agent.submit(cmd.RestartGroup())
        assert not restart.ok and "the group is not started again" in restart.message, restart
        assert agent.submit(cmd.Stop(signal.SIGTERM, grace=0.2)).ok
        result = run.join(timeout=20)
    assert result.failures[0].exitcode == -signal.SIGKILL
    assert not [e for e in read_events(agent.run_dir) if e["event"] == "user_restart_group"]
    log = Path(agent.attempt_dir(0), "0", "stdout.log").read_bytes()
    assert log.count(b"got SIGTERM") == 1, log


# The rank dies of SIGTERM at once; the worker it started (in its process group) checkpoints for
# `CHECKPOINT_S` seconds in its own SIGTERM handler, saying so each time it is entered.
_WORKER_CHECKPOINTS = """
    import os, subprocess, sys, time
    worker = (
        "import signal, sys, time\\n"
        "def checkpoint(*_):\\n"
        "    print('worker got SIGTERM, checkpointing', flush=True)\\n"
        "    time.sleep(float(sys.argv[1]))\\n"
        "    sys.exit(0)\\n"
        "signal.signal(signal.SIGTERM, checkpoint)\\n"
        "print('worker ready', flush=True)\\n"
        "time.sleep(60)\\n"
    )
    subprocess.Popen([sys.executable, "-c", worker, os.environ["CHECKPOINT_S"]])
    time.sleep(60)
"""


def test_the_end_sweep_leaves_a_stopping_groups_worker_to_its_grace(tmp_path):
    """Once the rank itself was gone, the end sweep sent its own SIGTERM to the worker the group's
    stop had just sent one: the worker's checkpoint handler was entered a second time."""
    agent = make_agent(tmp_path, shutdown_timeout=10.0, code=_WORKER_CHECKPOINTS, env={"CHECKPOINT_S": "1.5"})
    run = Running(agent)
    with run:
        wait_for(lambda: b"worker ready" in agent.output(0), what="the rank's worker up")
        agent.stop()
        run.join(timeout=20)
    log = Path(agent.attempt_dir(0), "0", "stdout.log").read_bytes()
    assert log.count(b"worker got SIGTERM") == 1, log


@pytest.mark.parametrize(("max_restarts", "then"), [
    (3, "the group restarts for that, a restart spent, as on every node"),
    (0, "no restarts are left (0 of 0 spent): the run ends for that"),  # (it said the group restarts)
])
def test_an_r_after_the_round_watch_saw_another_nodes_failure_says_the_group_restarts_for_that(tmp_path, max_restarts,
                                                                                               then):
    """The round watch had recorded another node's failure (its heartbeats lapsed) when the
    user's `R` came: `R` was answered `restarting the group (next attempt)`, though the restart
    is that failure's, a restart spent (the user's R decides nothing then). It says so; with no
    restarts left, that the run ends."""
    from ranktop.core.rendezvous import RoundEnd

    class Round:  # the rendezvous' part here: its name (the store decided already: not asked)
        def describe(self) -> str:
            return "c10d rendezvous 'job'"

        def agree_on_end(self, seen: str) -> str:
            raise AssertionError("the store asked again")

    class Group:  # the running group's part here: it is stopped
        stopped = False

        def stop(self) -> None:
            self.stopped = True

    agent = make_agent(tmp_path, "pass", n=1, max_restarts=max_restarts)
    agent.rendezvous, group = Round(), Group()
    gone = "node 127.0.0.2 (group rank 1) of the c10d rendezvous 'job' is gone"
    agent._round_end = RoundEnd("peer_failed", gone)
    ack = agent._on_restart_group(group, cmd.RestartGroup())
    assert (ack.ok, ack.message) == (True, f"{gone} just before your R: {then}")
    assert group.stopped
