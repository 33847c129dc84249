"""Stop signals to ranktop: a repeated SIGHUP/SIGTERM is one event (the ranks keep their grace),
only a repeated SIGINT kills at once. Real ranktop, real ranks, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import ROOT, marked_processes, ranktop_cmd, read_events, run_ranktop, wait_for
from ranktop.core import LocalAgent, WorkerSpec
from ranktop.core.signals import OUTSIDE_STOP_WINDOW, InterruptPairs, StopAction, StopRule

RANK = str(ROOT / "tests" / "ranks" / "checkpoint_on_signal.py")
HUP, TERM, INT = signal.SIGHUP, signal.SIGTERM, signal.SIGINT
FWD, DUP, KILL = StopAction.FORWARD, StopAction.DUPLICATE, StopAction.KILL_NOW


@pytest.mark.parametrize("arrivals, actions", [
    ([(HUP, 0.0)], [FWD]),
    ([(HUP, 0.0), (HUP, 0.01)], [FWD, DUP]),  # an SSH hangup's two SIGHUPs
    ([(TERM, 0.0), (TERM, 0.5), (TERM, 0.99)], [FWD, DUP, DUP]),
    ([(HUP, 0.0), (TERM, 0.2)], [FWD, DUP]),  # a hangup and a service manager's TERM: one event
    ([(TERM, 0.0), (TERM, 1.0)], [FWD, FWD]),  # a second later it is new: forwarded again, no kill
    ([(TERM, 0.0), (TERM, 0.6), (TERM, 1.2)], [FWD, DUP, FWD]),  # the window runs from the one acted on
    ([(INT, 0.0), (INT, 0.01)], [FWD, KILL]),  # Ctrl-C twice: now
    ([(INT, 0.0), (INT, 30.0)], [FWD, KILL]),
    ([(TERM, 0.0), (INT, 0.1)], [FWD, FWD]),  # the first interrupt of a person gets the grace
    ([(TERM, 0.0), (INT, 0.1), (INT, 0.2)], [FWD, FWD, KILL]),
    ([(INT, 0.0), (HUP, 0.1), (HUP, 0.2)], [FWD, FWD, DUP]),
])
def test_stop_rule(arrivals, actions):
    rule = StopRule()
    assert [rule.decide(sig, at) for sig, at in arrivals] == actions


def _start(tmp_path, delay):
    proc = subprocess.Popen(
        ranktop_cmd("--headless", "--shutdown-timeout", "60", "--log-dir", str(tmp_path / "logs"),
                    "--run-id", "sig", RANK, str(tmp_path / "checkpoint"), str(delay)),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "READY" in line, line + proc.stderr.read()
    return proc, int(line.split()[-1])


def _signal_twice(proc, sig):
    """The second signal comes once the first was handled (the rank says it got it): two signals
    that close together could merge into one in the kernel and prove nothing."""
    proc.send_signal(sig)
    line = proc.stdout.readline()
    assert f"GOT {int(sig)}" in line, line
    proc.send_signal(sig)
    return proc.communicate(timeout=40)


@pytest.mark.parametrize("arrivals, acted_on", [
    ([(False, 0.0), (True, 0.001)], [True, False]),  # a SIGINT to both processes of the TUI's job: one
    ([(True, 0.0), (False, 0.002)], [True, False]),  # (the parent's may come first)
    ([(False, 0.0), (False, 0.01)], [True, True]),  # two to the TUI's process: two
    ([(True, 0.0), (True, 0.3)], [True, True]),  # two to the pid the shell sees: two
    ([(False, 0.0), (True, 0.001), (False, 0.3)], [True, False, True]),  # a pair, then a second interrupt
    ([(False, 0.0), (True, 1.5)], [True, True]),  # a second apart: not one
])
def test_interrupt_pairs(arrivals, acted_on):
    pairs = InterruptPairs()
    assert [not pairs.is_other_half(passed_on, at) for passed_on, at in arrivals] == acted_on


@pytest.mark.parametrize("sig", [HUP, TERM])
def test_repeated_hangup_or_term_keeps_the_grace(tmp_path, sig):
    proc, rank_pid = _start(tmp_path, delay=1.5)
    _, err = _signal_twice(proc, sig)
    assert proc.returncode == 128 + sig, err
    assert (tmp_path / "checkpoint").read_text() == f"checkpoint after signal {int(sig)}\n"
    exited = [e for e in read_events(tmp_path / "logs" / "sig") if e["event"] == "exited"]
    assert [(e["pid"], e["exitcode"], e["signal"]) for e in exited] == [(rank_pid, 128 + sig, None)]
    received = [e for e in read_events(tmp_path / "logs" / "sig") if e["event"] == "signal_received"]
    assert len(received) == 2 and received[0]["action"] == "forward" and received[1]["action"] != "kill_now"


def test_repeated_interrupt_kills_at_once(tmp_path):
    proc, rank_pid = _start(tmp_path, delay=30)
    _, err = _signal_twice(proc, INT)  # within the 40 s wait only if the 60 s grace was cut short
    assert proc.returncode == 128 + INT, err
    assert not (tmp_path / "checkpoint").exists()
    exited = [e for e in read_events(tmp_path / "logs" / "sig") if e["event"] == "exited"]
    assert [(e["pid"], e["signal"]) for e in exited] == [(rank_pid, "SIGKILL")]
    assert [e["action"] for e in read_events(tmp_path / "logs" / "sig") if e["event"] == "signal_received"] == [
        "forward", "kill_now"]


def test_agent_handle_signal_applies_the_rule(tmp_path):
    """The TUI hands signals to the agent through handle_signal: the same rule holds there."""
    spec = WorkerSpec(role="default", local_world_size=1, entrypoint=sys.executable,
                      args=("-u", RANK, str(tmp_path / "checkpoint"), "1.0"))
    agent = LocalAgent(spec, log_dir=str(tmp_path), console=False, shutdown_timeout=60)
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=agent.run()))
    thread.start()
    try:
        assert agent.wait_started(10)
        wait_for(lambda: any(line.startswith(b"READY") for line in agent.output(0)), what="rank ready")
        agent.handle_signal(HUP)
        wait_for(lambda: any(line.startswith(b"GOT") for line in agent.output(0)), what="rank got SIGHUP")
        agent.handle_signal(HUP)
    finally:
        thread.join(40)
    assert not thread.is_alive()
    assert box["result"].exit_status == 128 + HUP
    assert (tmp_path / "checkpoint").exists()


def test_launch_second_interrupt_kills_at_once(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        import rank_fns
        from ranktop.core import launch, MainProcessError
        try:
            launch(rank_fns.checkpoint_on_signal, {str(tmp_path / 'checkpoint')!r}, 1)
        except MainProcessError as e:
            print("MainProcessError", e.signal_no, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert "READY" in proc.stdout.readline()
    proc.send_signal(INT)
    assert proc.stdout.readline().startswith("GOT")
    proc.send_signal(INT)
    out, _ = proc.communicate(timeout=8)  # launch's grace is 10 s: only SIGKILL ends it this soon
    assert out.strip() == f"MainProcessError {int(INT)}"
    assert not (tmp_path / "checkpoint").exists()


USR1_RANK = ("import os, signal, sys, time\n"
             "signal.signal(signal.SIGUSR1, lambda *_: print('requeue notice', os.environ['RANK'], flush=True))\n"
             "print('up', os.environ['RANK'], flush=True)\n"
             "while True:\n    time.sleep(0.05)\n")


def _usr1_script(tmp_path):
    script = tmp_path / "usr1.py"
    script.write_text(USR1_RANK)
    return script


def _start_usr1(tmp_path, *flags):
    script = _usr1_script(tmp_path)
    return subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--shutdown-timeout", "3",
                                        "--log-dir", str(tmp_path / "logs"), "--run-id", "r", *flags, str(script)),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _logged(tmp_path, rank: int) -> str:
    path = tmp_path / "logs" / "r" / "attempt_0" / str(rank) / "stdout.log"
    return path.read_text() if path.exists() else ""


def _ends_on_sigterm(proc: subprocess.Popen) -> None:
    """A run still going ends on SIGTERM to ranktop, with its status (143)."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM


def _reaped(proc: subprocess.Popen) -> None:
    """Whatever happened, ranktop gone (killed if it still runs) and its pipes read."""
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_signals_to_handle_passes_sigusr1_on_and_the_run_goes_on(tmp_path):
    proc = _start_usr1(tmp_path, "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1")
    try:
        wait_for(lambda: all("up" in _logged(tmp_path, r) for r in range(2)), what="ranks up")
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: all("requeue notice" in _logged(tmp_path, r) for r in range(2)), what="notice passed on")
        assert proc.poll() is None  # still running: a notice is not a stop
        _ends_on_sigterm(proc)
    finally:
        _reaped(proc)


def test_slurms_sigusr1_to_ranktop_and_every_rank_at_once_is_neither_fatal_nor_doubled(tmp_path):
    """--signal=USR1@60 without B: Slurm signals every process of the step itself. Unlisted in
    --signals-to-handle, SIGUSR1's default action used to end ranktop (exit 138, no report) and
    the guard then stopped the ranks that were about to checkpoint."""
    proc = _start_usr1(tmp_path)
    try:
        wait_for(lambda: all("up" in _logged(tmp_path, r) for r in range(2)), what="ranks up")
        events = tmp_path / "logs" / "r" / "events.jsonl"
        ranks = [e["pid"] for e in read_events(tmp_path / "logs" / "r") if e["event"] == "started"]
        for pid in (proc.pid, *ranks):  # as slurmstepd does: each process of the step, one by one
            os.kill(pid, signal.SIGUSR1)
        wait_for(lambda: all("requeue notice" in _logged(tmp_path, r) for r in range(2)), what="the notices")
        wait_for(lambda: '"SIGUSR1"' in events.read_text(), what="ranktop noting its SIGUSR1")
        assert proc.poll() is None  # a notice is not a stop
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        assert [_logged(tmp_path, r).count("requeue notice") for r in range(2)] == [1, 1]  # not passed on again
        noted = [e for e in read_events(tmp_path / "logs" / "r") if e.get("signal") == "SIGUSR1"]
        assert [(e["forwarded"], e["action"]) for e in noted] == [(False, "ignored")]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_sigquit_stops_the_run_like_sigterm_by_default(tmp_path):
    proc = _start_usr1(tmp_path)
    try:
        wait_for(lambda: all("up" in _logged(tmp_path, r) for r in range(2)), what="ranks up")
        proc.send_signal(signal.SIGQUIT)
        assert proc.wait(30) == 128 + signal.SIGQUIT
        assert "stopped by SIGQUIT" in proc.communicate()[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# Ranktop run with a SIGINT that is pending (sent, blocked) from the start and comes when `module`
# is first looked for: a Ctrl-C at that moment of the start, whatever the machine's speed. `how` it
# comes: in plain code; in code made from a string (`exec`), as a dataclass's generated __init__ is
# run while its module is imported; in a class's __set_name__, which Python 3.11 wraps in a
# RuntimeError. Run as `python -m`, as `python -m ranktop` is: only then does Python end by SIGINT
# itself when a KeyboardInterrupt was raised in string code, caught or not.
_INTERRUPTED_AT = """\
import os, signal, sys, runpy
module, how = sys.argv.pop(1), sys.argv.pop(1)
def unblock():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    for _ in range(10 ** 7):  # the KeyboardInterrupt is raised here, at the loop's first check
        pass
class Field:
    def __set_name__(self, owner, name):
        unblock()
class Unblock:
    def find_spec(self, name, path=None, target=None):
        if name == module and how == "plain":
            unblock()
        elif name == module and how == "exec":
            exec("unblock()")
        elif name == module and how == "set_name":
            type("Holder", (), {"field": Field()})
sys.meta_path.insert(0, Unblock())
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
os.kill(os.getpid(), signal.SIGINT)
runpy.run_module("ranktop", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module, how", [
    ("ranktop.tui.cli", "plain"),  # the command line loading
    ("ranktop.core.context", "plain"),  # the run being set up, before it handles signals
    ("ranktop.tui.cli", "exec"),  # it ended by SIGINT (-2), not with 130
    ("ranktop.core.context", "set_name"),  # it was a RuntimeError traceback, exit 1
])
def test_a_ctrl_c_as_ranktop_starts_is_one_line(tmp_path, module, how):
    """A SIGINT while ranktop loads, or before its run handles it, was a KeyboardInterrupt
    traceback (an import's, or the command line's). It is one line now, exit 130, nothing left.
    (Later the run's own handlers take it: `stopped by SIGINT`.)"""
    (tmp_path / "interrupted_at.py").write_text(_INTERRUPTED_AT)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "interrupted_at", module, how, "--headless", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path / "logs"), "--no-python", "sleep", "30"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 130, done
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert "ranktop: interrupted (SIGINT)" in done.stderr, done.stderr
    wait_for(lambda: not marked_processes(), what="nothing left running")


@pytest.mark.parametrize("value", ["SIGKILL", "SIGNOPE", "SIG_IGN", "TERM"])
def test_a_signal_that_cannot_be_handled_is_one_line(tmp_path, value):
    done = run_ranktop("--headless", "--signals-to-handle", value, "--log-dir", str(tmp_path), "x.py")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith(f"ranktop: error: bad --signals-to-handle {value!r}: {value!r} is not a signal")
    assert not list(tmp_path.iterdir())


# ----- a stop sent to the whole job from outside (Slurm's scancel, systemd's control group) -----
def _start_sleepers(tmp_path, *flags):
    """Headless ranktop over 2 ranks that sleep; returns it and the ranks' pids once both started."""
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--shutdown-timeout", "5",
                                        "--log-dir", str(tmp_path / "logs"), "--run-id", "r", *flags,
                                        "--no-python", "sleep", "300"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = wait_for(lambda: _pids_of(tmp_path, "started") if len(_pids_of(tmp_path, "started")) == 2 else None,
                       what="both ranks started")
    return proc, started


def _pids_of(tmp_path, event: str) -> list[int]:
    return [e["pid"] for e in read_events(tmp_path / "logs" / "r", while_written=True) if e["event"] == event]


def _ended(proc) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def _final(tmp_path) -> dict:
    import json

    return json.loads((tmp_path / "logs" / "r" / "final.json").read_text())


@pytest.mark.parametrize("flags", [(), ("--max-restarts", "3")])
def test_a_stop_from_outside_that_reaches_the_ranks_first_is_a_stop_not_a_failure(tmp_path, flags):
    """Slurm and systemd SIGTERM every process of the job at once; the ranks' may come first.
    ranktop used to blame the first rank to die (exit 1), say its sibling was stopped by ranktop,
    and with restarts left start attempt_1, which its own SIGTERM then stopped."""
    proc, ranks = _start_sleepers(tmp_path, *flags)
    for pid in ranks:
        os.kill(pid, TERM)
    wait_for(lambda: len(_pids_of(tmp_path, "exit_held")) == 2, what="both ends held")  # before ours comes
    proc.send_signal(TERM)
    status, err = _ended(proc)
    assert status == 128 + TERM, err
    assert "stopped by SIGTERM" in err and "root cause" not in err and "stopped by ranktop" not in err
    events = read_events(tmp_path / "logs" / "r")
    ended = [(e["pid"], e["outcome"], e["stop_signal"]) for e in events if e["event"] == "exit_held_ended"]
    assert sorted(ended) == sorted((pid, "stopped", "SIGTERM") for pid in ranks)
    assert not [e for e in events if e["event"] == "group_restart"]
    assert not (tmp_path / "logs" / "r" / "attempt_1").exists()
    final = _final(tmp_path)
    assert final["root_cause"] is None
    assert [(r["state"], r["signal_name"]) for r in final["ranks"]] == [("killed", "SIGTERM")] * 2


def test_a_rank_sigtermed_alone_fails_once_the_window_passed_and_is_restarted(tmp_path):
    proc, ranks = _start_sleepers(tmp_path, "--max-restarts", "1")
    try:
        os.kill(ranks[0], TERM)
        wait_for(lambda: len(_pids_of(tmp_path, "started")) == 4, what="attempt_1")
    finally:
        proc.send_signal(TERM)
    status, err = _ended(proc)
    assert status == 128 + TERM, err
    assert "rank 0 failed (signal SIGTERM); restarting the group: attempt_1" in err
    events = read_events(tmp_path / "logs" / "r")
    held = next(e for e in events if e["event"] == "exit_held")
    ended = next(e for e in events if e["event"] == "exit_held_ended")
    assert (held["pid"], ended["pid"], ended["outcome"]) == (ranks[0], ranks[0], "failure")
    assert ended["ts"] - held["ts"] >= OUTSIDE_STOP_WINDOW - 0.05  # (ts is the wall clock; the hold, monotonic)
    restart = next(e for e in events if e["event"] == "group_restart")
    assert restart["reason"] == "failure" and events.index(ended) < events.index(restart)
    sibling = next(e for e in events if e["event"] == "exited" and e["pid"] == ranks[1])
    assert sibling["by_us"] and events.index(ended) < events.index(sibling)  # stopped only after the window


def test_a_rank_sigtermed_alone_with_no_restarts_is_the_root_cause(tmp_path):
    proc, ranks = _start_sleepers(tmp_path)
    os.kill(ranks[1], TERM)
    status, err = _ended(proc)
    assert status == 1, err
    assert f"root cause: rank 1 (local rank 1, pid {ranks[1]}) was killed by SIGTERM" in err
    assert "stopped by ranktop after it, not the cause: rank 0" in err
    assert _final(tmp_path)["root_cause"]["rank"] == 1


def test_a_rank_sigkilled_is_a_failure_at_once(tmp_path):
    proc, ranks = _start_sleepers(tmp_path)
    os.kill(ranks[0], signal.SIGKILL)
    status, err = _ended(proc)
    assert status == 1, err
    assert f"root cause: rank 0 (local rank 0, pid {ranks[0]}) was killed by SIGKILL" in err
    events = read_events(tmp_path / "logs" / "r")
    assert not [e for e in events if e["event"].startswith("exit_held")]  # no window: not a stop signal
    sibling = next(e for e in events if e["event"] == "exited" and e["pid"] == ranks[1])
    assert sibling["by_us"]


def test_under_nohup_a_hangup_stops_nothing(tmp_path):
    """`nohup ranktop ...` (SIGHUP ignored when it starts) is asked to outlive its terminal: its
    own handler made the hang-up a stop (exit 129), as torchrun's does."""
    proc = subprocess.Popen(["nohup", *ranktop_cmd("--headless", "--nproc-per-node", "2", "--shutdown-timeout", "3",
                                                   "--log-dir", str(tmp_path / "logs"), "--run-id", "r",
                                                   str(_usr1_script(tmp_path)))],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: all("up" in _logged(tmp_path, r) for r in range(2)), what="ranks up")
        ranks = [e["pid"] for e in read_events(tmp_path / "logs" / "r") if e["event"] == "started"]
        for pid in (proc.pid, *ranks):  # as a closed terminal does: to everything that was in its session
            os.kill(pid, signal.SIGHUP)
        # A later signal ranktop notes: the hang-up, sent first, would have been acted on by then.
        proc.send_signal(signal.SIGUSR1)
        events = tmp_path / "logs" / "r" / "events.jsonl"
        wait_for(lambda: '"SIGUSR1"' in events.read_text(), what="ranktop noting its SIGUSR1")
        assert proc.poll() is None
        assert "SIGHUP" not in events.read_text()
        assert all(os.path.exists(f"/proc/{pid}") for pid in ranks)  # the ranks ignore it too
        _ends_on_sigterm(proc)
    finally:
        _reaped(proc)


def test_ranktop_stopped_and_continued_blames_no_rank_for_the_silence(tmp_path):
    """Ctrl-Z on a headless run (or SIGSTOP) stops ranktop and not the ranks, as under torchrun.
    Back with `fg`, the ranks had said nothing that ranktop read for as long as it was stopped:
    `rank 1 stalled: no output for 6s` blamed them for ranktop's own pause."""
    script = tmp_path / "steady.py"
    script.write_text("import time\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.5)\n")
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--stall-timeout", "1.5",
                                        "--shutdown-timeout", "3", "--log-dir", str(tmp_path / "logs"),
                                        "--run-id", "r", str(script)),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "r"
    try:
        wait_for(lambda: all("tick" in _logged(tmp_path, r) for r in range(2)), what="ranks up")
        proc.send_signal(signal.SIGSTOP)
        time.sleep(3)  # the pause itself: twice the stall time
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: [e for e in read_events(run_dir, while_written=True) if e["event"] == "ranktop_suspended"],
                 what="the pause noted")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        events = read_events(run_dir)
        assert not [e for e in events if e["event"] == "stall_detected"], events
        (noted,) = [e for e in events if e["event"] == "ranktop_suspended"]
        assert noted["seconds"] >= 2.5
    finally:
        if proc.poll() is None:
            proc.kill()
        said = proc.communicate()[1]
    assert "stalled" not in said, said
