"""Who is to blame when the user had a hand in a run's end: a stop after a rank's own failure
names that failure; ranks the user killed or signalled are no failure (no restart spent, no root
cause); the user's group restart spends no restart; a refused command is no user action. Real
ranks, real signals, commands through the Engine interface and the real command line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import tracemalloc

import pytest
from conftest import ROOT, make_agent, ranktop_cmd, read_events, wait_for
from ranktop.core import commands as cmd
from ranktop.core.engine import LocalEngine
from ranktop.core.report import report_after_tui
from ranktop.core.state import GroupState

pytestmark = pytest.mark.timeout(90)


def _engine(tmp_path, code: str, n: int = 2, **kw) -> LocalEngine:
    return LocalEngine(make_agent(tmp_path, code, n, name="t.py", **kw)).start()


def _ended(engine: LocalEngine, timeout: float = 30):
    return wait_for(lambda: (s := engine.snapshot()).ended and s, timeout=timeout, what="the run's end")


def _up(engine: LocalEngine, n: int = 2, line: bytes = b"up") -> None:
    wait_for(lambda: all(line in engine.agent.output(r) for r in range(n)), what="every rank up")


# ----- a stop after a rank's own failure (Ctrl-C, SIGTERM, `ranktop stop`) ---------------------
# Rank 1 fails once rank 0 is up (argv[1] exists); rank 0 saves a checkpoint in its SIGTERM
# handler until told it is saved (argv[2] exists: the test makes it once ranktop has taken the
# user's stop, so the checkpoint's end, not the grace, ends the run), or until killed.
CHECKPOINTS = """
import os, signal, sys, time
def checkpoint(*_):
    print("checkpointing", flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.02)
    sys.exit(0)
signal.signal(signal.SIGTERM, checkpoint)
up = sys.argv[1]
if os.environ["RANK"] == "0":
    open(up, "w").close()
else:
    while not os.path.exists(up):
        time.sleep(0.02)
    sys.exit(3)
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "ranktop stop"])
def test_a_stop_during_a_failures_shutdown_still_names_the_failed_rank(tmp_path, how):
    """The usual "a rank crashed, the rest hang in teardown, I press Ctrl-C": the report said only
    `stopped by SIGINT` (`ranktop stop`: `stopped on request`, and no root cause anywhere)."""
    script = tmp_path / "ckpt.py"
    script.write_text(CHECKPOINTS)
    run_dir = tmp_path / "logs" / "r"
    saved = tmp_path / "checkpoint saved"
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--shutdown-timeout", "4",
                                        "--log-dir", str(tmp_path / "logs"), "--run-id", "r", str(script),
                                        str(tmp_path / "rank 0 up"), str(saved)),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopper = None
    try:
        wait_for(lambda: b"checkpointing" in _log(run_dir, 0), timeout=20, what="rank 0 checkpointing")
        if how == "ranktop stop":  # (in the background: it may wait for the run's end)
            stopper = subprocess.Popen(ranktop_cmd("stop", "r"), cwd=ROOT, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
        else:
            proc.send_signal(getattr(signal, how))
        taken = "user_stop" if how == "ranktop stop" else "signal_received"
        wait_for(lambda: any(e["event"] == taken for e in read_events(run_dir)), timeout=20, what="the stop taken")
        saved.touch()
        _, err = proc.communicate(timeout=30)
        if stopper is not None:
            assert stopper.wait(30) == 0, stopper.communicate()
    finally:
        for started in (proc, stopper):
            if started is not None and started.poll() is None:
                started.kill()
                started.communicate()
    assert proc.returncode == (128 + signal.SIGTERM if how == "SIGTERM" else 130), err
    stop = "stopped on request" if how == "ranktop stop" else f"stopped by {how}"
    assert f"ranktop: ckpt.py failed in attempt_0 (1 of 1 attempts), then was {stop}\n" in err, err
    assert re.search(r"root cause: rank 1 \(local rank 1, pid \d+\) exited with code 3", err), err
    final = json.loads((run_dir / "final.json").read_text())
    assert final["root_cause"]["rank"] == 1 and final["exit_status"] == proc.returncode
    finished = [e for e in read_events(run_dir) if e["event"] == "run_finished"]
    assert [(e["state"], e["root_cause_rank"]) for e in finished] == [("STOPPED", 1)]


def _log(run_dir, rank: int) -> bytes:
    try:
        return (run_dir / "attempt_0" / str(rank) / "stdout.log").read_bytes()
    except FileNotFoundError:
        return b""


# ----- ends the user caused ---------------------------------------------------------------------
# Both ranks print and wait; rank 1 exits 0 once the file `done` exists.
WAITS = """
import os, pathlib, time
print("up", flush=True)
while not (os.environ["RANK"] == "1" and pathlib.Path({done!r}).exists()):
    time.sleep(0.02)
"""


def test_a_rank_the_user_killed_is_no_failure_and_spends_no_restart(tmp_path):
    """exp6: the user kills rank 0 and rank 1 goes on to succeed. The group's end counted the kill
    as a failure: with a restart left it restarted the group (rank 1, done, ran again); without,
    the run failed with the kill as its root cause."""
    done = tmp_path / "done"
    engine = _engine(tmp_path, WAITS.format(done=str(done)), max_restarts=1)
    try:
        _up(engine)
        assert engine.submit(cmd.KillRank(0)).ok
        wait_for(lambda: not engine.snapshot().ranks[0].state.alive, what="rank 0 killed")
        done.touch()
        snap = _ended(engine)
    finally:
        engine.close()
    assert (snap.state, snap.exit_status, snap.root_cause, snap.attempt) == (GroupState.STOPPED, 130, None, 0)
    assert snap.user_ended == (0,) and snap.ranks[1].exitcode == 0
    assert not [e for e in read_events(engine.agent.run_dir) if e["event"] == "group_restart"]
    report = report_after_tui(snap)
    assert report.startswith("ranktop: t.py stopped on request: you ended rank 0; logs in "), report
    assert "root cause" not in report


def test_a_group_signal_the_ranks_die_of_is_the_users_stop_not_a_failure(tmp_path):
    """exp21: SignalGroup(SIGTERM) read as `rank 0 failed (signal SIGTERM); restarting the group`."""
    engine = _engine(tmp_path, WAITS.format(done=str(tmp_path / "never")), max_restarts=1)
    try:
        _up(engine)
        assert engine.submit(cmd.SignalGroup(signal.SIGTERM)).ok
        snap = _ended(engine)
    finally:
        engine.close()
    assert (snap.state, snap.exit_status, snap.root_cause, snap.attempt) == (GroupState.STOPPED, 130, None, 0)
    assert snap.user_ended == (0, 1)
    assert not [e for e in read_events(engine.agent.run_dir) if e["event"] == "group_restart"]
    assert report_after_tui(snap).startswith("ranktop: t.py stopped on request: you ended ranks 0, 1; logs in ")


def test_a_group_signal_is_noted_per_rank_as_a_user_action(tmp_path):
    """SignalGroup noted no user action (SignalRank does): a rank that survives the group's SIGINT
    and fails later was an unexplained failure."""
    failing = tmp_path / "fail"
    engine = _engine(tmp_path, f"""
        import os, pathlib, sys, time
        print("up", flush=True)
        try:
            while True:
                time.sleep(0.02)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        while not pathlib.Path({str(failing)!r}).exists():
            time.sleep(0.02)
        sys.exit(3 if os.environ["RANK"] == "1" else 0)
    """, shutdown_timeout=0.5)
    try:
        _up(engine)
        assert engine.submit(cmd.SignalGroup(signal.SIGINT)).ok
        wait_for(lambda: [e["event"] for e in read_events(engine.agent.run_dir, while_written=True)]
                 .count("signal_survived") == 2, what="both ranks survived the SIGINT")
        failing.touch()
        snap = _ended(engine)
    finally:
        engine.close()
    assert snap.state == GroupState.FAILED and snap.root_cause.rank == 1
    assert re.fullmatch(r"you sent SIGINT to rank 1 at \d\d:\d\d:\d\d, \d+\.\d s before this failure",
                        snap.root_cause.user_action or ""), snap.root_cause.user_action



def test_the_users_actions_kept_are_bounded_and_the_newest_is_named():
    """Every signal the user sent a rank was kept for the run's life: a client of the socket
    sending them without pause grew the engine by 200 bytes each (24 MB after 120k). The newest
    are kept, and the last still leads a root cause."""
    from ranktop.core.root_cause import UserActions

    tracemalloc.start()
    try:
        actions = UserActions()
        for _ in range(50_000):
            actions.note_signal(0, 0, signal.SIGWINCH)
        actions.note_signal(0, 1, signal.SIGTERM)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 1 << 20, held
    assert actions.last_before(0, time.time()).what == "sent SIGTERM to rank 1"

def test_a_refused_command_is_no_user_action(tmp_path):
    """exp9: a KillRank and a SignalRank to a rank that had already exited were refused (nothing
    sent), and the root cause then said `you sent SIGTERM to rank 0 ... before this failure`."""
    failing = tmp_path / "fail"
    engine = _engine(tmp_path, f"""
        import os, pathlib, sys, time
        print("up", flush=True)
        if os.environ["RANK"] == "0":
            sys.exit(0)
        while not pathlib.Path({str(failing)!r}).exists():
            time.sleep(0.02)
        sys.exit(3)
    """)
    try:
        _up(engine)
        wait_for(lambda: engine.snapshot().ranks[0].exitcode == 0, what="rank 0 done")
        assert not engine.submit(cmd.KillRank(0)).ok
        assert not engine.submit(cmd.SignalRank(0, signal.SIGTERM)).ok
        assert engine.submit(cmd.SignalGroup(signal.SIGSTOP)).ok  # sent to rank 1 alone: rank 0 has ended
        assert engine.submit(cmd.SignalGroup(signal.SIGCONT)).ok
        failing.touch()
        snap = _ended(engine)
    finally:
        engine.close()
    assert snap.root_cause.rank == 1
    assert re.fullmatch(r"you sent SIGSTOP to rank 1 at \d\d:\d\d:\d\d \(SIGCONT \d+\.\d s later\), "
                        r"\d+\.\d s before this failure", snap.root_cause.user_action or ""), snap.root_cause.user_action


# ----- the user's group restart ---------------------------------------------------------------
# Rank 1 fails (exit 3) whenever the file `fail` exists, taking it away.
FAILS_ON_FILE = """
import os, pathlib, sys, time
print("up", flush=True)
flag = pathlib.Path({fail!r})
while not (os.environ["RANK"] == "1" and flag.exists()):
    time.sleep(0.02)
flag.unlink()
sys.exit(3)
"""


def test_a_group_restart_the_user_asked_for_spends_no_restart(tmp_path):
    """exp16: after an `R`, the first real failure ended a run with --max-restarts 1."""
    fail = tmp_path / "fail"
    engine = _engine(tmp_path, FAILS_ON_FILE.format(fail=str(fail)), max_restarts=1)
    try:
        _up(engine)
        assert engine.submit(cmd.RestartGroup()).ok
        wait_for(lambda: engine.snapshot().attempt == 1 and all(r.pid for r in engine.snapshot().ranks),
                 what="attempt_1")
        _up(engine)
        fail.touch()  # a failure: the restart left is spent on it
        wait_for(lambda: engine.snapshot().attempt == 2, what="attempt_2")
        _up(engine)
        fail.touch()  # no restarts left now
        snap = _ended(engine)
    finally:
        engine.close()
    assert (snap.state, snap.exit_status, snap.attempt, snap.user_restarts) == (GroupState.FAILED, 1, 2, 1)
    assert snap.earlier_attempts == ("attempt_0: restarted by the user", "attempt_1: rank 1 failed (exit 3)")
    reasons = [e["reason"] for e in read_events(engine.agent.run_dir) if e["event"] == "group_restart"]
    assert reasons == ["user", "failure"]
    assert "ranktop: t.py failed in attempt_2 (3 of 3 attempts)\n" in report_after_tui(snap)


def test_a_group_restart_during_a_failures_shutdown_keeps_the_failure(tmp_path):
    """exp8: `R` while the group stopped for rank 1's exit 3 (no restarts left): the attempt was
    recorded only as `restarted by the user`, and rank 1's failure was gone."""
    up = tmp_path / "rank 0 up"
    engine = _engine(tmp_path, f"""
        import os, pathlib, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: print("checkpointing", flush=True))
        if os.environ["RANK"] == "0":
            pathlib.Path({str(up)!r}).touch()
        elif os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            while not pathlib.Path({str(up)!r}).exists():
                time.sleep(0.02)
            sys.exit(3)
        while True:
            time.sleep(0.02)
    """, shutdown_timeout=2)
    try:
        wait_for(lambda: b"checkpointing" in engine.agent.output(0), what="rank 0 stopping for the failure")
        assert engine.submit(cmd.RestartGroup()).ok
        wait_for(lambda: engine.snapshot().attempt == 1 and all(r.pid for r in engine.snapshot().ranks),
                 what="attempt_1")
        snap = engine.snapshot()
    finally:
        engine.close()
    assert snap.earlier_attempts == ("attempt_0: rank 1 failed (exit 3), then restarted by the user",)
    assert snap.user_restarts == 1


# ----- a failure that follows the user's action is said as following it -------------------------
# tests/ranks/rdzv_rank.py's local-pair: rank 1 holds a connection to rank 0, as a collective's
# peers do; once rank 1 is gone, rank 0 fails with the peer's loss (gloo's "Connection closed by
# peer"), on its own.
PAIR = ROOT / "tests" / "ranks" / "rdzv_rank.py"


def test_a_failure_after_the_users_kill_says_first_that_it_followed_the_kill(tmp_path):
    """The user kills rank 1; rank 0 then fails of it. The report led with rank 0's failure and
    gave the kill as a `note:` above it; the TUI's heading named rank 0 alone. Now the headline,
    the root-cause line and the TUI's heading say first that the failure came after the kill, and
    final.json and run_finished say which action (new fields: the old ones are unchanged)."""
    from ranktop.core.client import FinalEngine
    from ranktop.tui.screens import root_cause_heading

    status, err, run_dir = _kill_rank_1_of_peers(tmp_path)
    assert status == 1, err
    assert "ranktop: rdzv_rank.py failed after you killed rank 1 in attempt_0 (1 of 1 attempts)\n" in err, err
    assert re.search(r"\n  root cause: after you killed rank 1 at \d\d:\d\d:\d\d, \d+\.\d s before this failure: "
                     r"rank 0 \(local rank 0, pid \d+\) exited with code 1 at ", err), err
    assert "note:" not in err
    final = json.loads((run_dir / "final.json").read_text())["root_cause"]
    assert (final["rank"], final["user_action_what"]) == (0, "killed rank 1")
    assert final["user_action_at"] <= final["timestamp"] and final["user_action"].startswith("you killed rank 1 at ")
    (finished,) = [e for e in read_events(run_dir) if e["event"] == "run_finished"]
    assert (finished["root_cause_rank"], finished["root_cause_after"]) == (0, "killed rank 1")
    view = FinalEngine(str(run_dir / "final.json"))
    try:
        heading = root_cause_heading(view.snapshot()).plain
    finally:
        view.close()
    assert re.search(r"ROOT CAUSE\s+after you killed rank 1:\s+rank 0 exit code 1 at ", heading), heading


def test_a_restart_after_the_users_kill_says_it_followed_the_kill(tmp_path):
    """The same with a restart left: the restart's line named rank 0's failure alone."""
    status, err, _ = _kill_rank_1_of_peers(tmp_path, "--max-restarts", "1")
    assert status == 0, err
    assert ("ranktop: after you killed rank 1, rank 0 failed (exit 1); restarting the group: attempt_1 "
            "(1 of 1 restarts spent)\n") in err, err


def _kill_rank_1_of_peers(tmp_path, *flags: str) -> tuple[int, str, object]:
    """PAIR run headless to its end, the user killing rank 1 once both are up (through the served
    engine, as `ranktop attach`'s k): (exit status, stderr, run directory)."""
    from ranktop.core.client import RemoteEngine, served_runs
    from ranktop.core.spec import free_port

    run_dir = tmp_path / "logs" / "kill"
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                                        "--run-id", "kill", *flags, str(PAIR), "local-pair", str(free_port())),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # (the line itself: b"UP" alone is in the PLACED line's GROUP_RANK, and the kill came before
        # rank 1 had connected, leaving rank 0 in accept() for ever)
        wait_for(lambda: all(b"\nUP\n" in _log(run_dir, r) for r in range(2)), timeout=20, what="both ranks up")
        assert RemoteEngine(served_runs()[0].path).submit(cmd.KillRank(1)).ok
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err, run_dir
