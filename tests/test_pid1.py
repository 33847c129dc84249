"""ranktop as PID 1 of a PID namespace, as a container's command is (a Kubernetes PyTorchJob runs
its launcher so): the kernel drops a signal to PID 1 that has no handler instead of acting on it,
orphans of the whole namespace are re-parented to it, and when it dies the kernel kills everything
in the namespace. Real namespaces through util-linux's `unshare`; skipped where it cannot make one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile

import pytest
from conftest import ROOT, ranktop_cmd, read_events, run_ranktop, wait_for
from ranktop.core.guard import read_proc


def _unshare_prefix() -> list[str] | None:
    """The unshare command line that makes a PID namespace here (as root, or in a user namespace
    of our own), or None where neither works (no unshare, a sandbox that forbids namespaces)."""
    if shutil.which("unshare") is None:
        return None
    for extra in ([], ["--user", "--map-root-user"]):
        prefix = ["unshare", *extra, "--pid", "--fork", "--mount-proc", "--kill-child"]
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


UNSHARE = _unshare_prefix()
pytestmark = pytest.mark.skipif(UNSHARE is None, reason="unshare cannot make a PID namespace here")

SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(60)\n"


def _as_pid1(tmp_path, script: str, *flags: str, session: bool = False, args: tuple[str, ...] = ()) -> subprocess.Popen:
    """ranktop as PID 1; `session`: in a session of its own (as a container runtime starts it),
    else in the test's, whose id reads 0 inside the namespace, as does that of whatever enters it."""
    path = tmp_path / "rank.py"
    path.write_text(script)
    # --kill-child: should the test fail, killing unshare kills PID 1, and with it the namespace
    command = ranktop_cmd("--headless", "--log-dir", str(tmp_path / "logs"), *flags, str(path), *args)
    # (unshare's child leads no process group: setsid makes the session without forking, so stays PID 1)
    return subprocess.Popen([*UNSHARE, *(["setsid"] if session else []), *command],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _exec_in(init: int, shell: str) -> None:
    """As `kubectl exec` does: a shell entered into PID 1's namespaces from outside, whose
    background job is re-parented to PID 1 when the shell exits."""
    subprocess.run(["nsenter", "-t", str(init), "-p", "-m", "--", "sh", "-c", shell], check=True, timeout=10)


def _children(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()  # unshare's --kill-child takes PID 1, and the kernel the rest of the namespace
    proc.communicate()


def test_a_sigterm_to_pid1_while_it_starts_is_acted_on_once_it_can(tmp_path):
    """kubelet's SIGTERM as the container starts (a job's pods deleted as they come up): ranktop
    as PID 1 used to have no handler for it until its engine was imported (~0.1 s), so the kernel
    dropped it and the ranks ran on until kubelet's SIGKILL a grace period later."""
    proc = _as_pid1(tmp_path, SLEEPER, "--nproc-per-node", "1", "--shutdown-timeout", "2")
    try:
        init = wait_for(lambda: next(iter(_children(proc.pid)), None), what="ranktop as PID 1")
        # Its guard starts as soon as the command line is read, before the engine is imported.
        wait_for(lambda: _children(init), interval=0.001, what="the guard started ahead of the run")
        os.kill(init, signal.SIGTERM)
        assert proc.wait(20) == 128 + signal.SIGTERM
        assert "stopped by SIGTERM" in proc.communicate()[1]
    finally:
        _end(proc)


DAEMONS = """import os, sys, time
def double_fork(seconds):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(seconds)
            os._exit(0)
        os._exit(0)
    os.wait()
for _ in range(20):
    double_fork(0.05)  # each exits soon after it is re-parented: a zombie for PID 1 to reap
double_fork(60)
print('daemons started', flush=True)
time.sleep(60)
"""


def _zombies(pid: int) -> list[int]:
    return [c for c in _children(pid) if (p := read_proc(c)) is not None and p.zombie]


def test_as_pid1_orphans_are_reaped_and_sigterm_stops_the_ranks_with_143(tmp_path):
    """What ranktop claims as PID 1: the orphans its ranks leave are reaped (no zombies pile up),
    kubelet's SIGTERM stops the ranks and ends with 143, and nothing outlives the namespace."""
    proc = _as_pid1(tmp_path, DAEMONS, "--nproc-per-node", "2", "--shutdown-timeout", "2")
    try:
        init = wait_for(lambda: next(iter(_children(proc.pid)), None), what="ranktop as PID 1")
        # the ranks, the guard and the two long daemons, once the short ones are reaped
        wait_for(lambda: len(_children(init)) == 5 and not _zombies(init), what="the short daemons reaped")
        namespace = os.readlink(f"/proc/{init}/ns/pid")
        os.kill(init, signal.SIGTERM)
        assert proc.wait(20) == 128 + signal.SIGTERM
        assert "stopped by SIGTERM" in proc.communicate()[1]
        wait_for(lambda: not _in_namespace(namespace), what="the namespace emptied")
    finally:
        _end(proc)


def _in_namespace(namespace: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                found.append(int(entry))
        except OSError:
            continue
    return found


RESTARTED = """import os, sys, time
def daemon(new_session, env):
    if os.fork() == 0:
        os.setsid() if new_session else os.setpgid(0, 0)
        if os.fork() == 0:
            os.execve("/bin/sleep", ["sleep", "999"], env)
        os._exit(0)
    os.wait()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    daemon(True, dict(os.environ))  # a session of its own, the run's marker kept
    daemon(False, {})  # environment cleared, still in the rank's session
    print("daemons started", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    sys.exit(1)
time.sleep(60)
"""


def _sleepers(namespace: str, seconds: str) -> list[int]:
    """The `sleep SECONDS` processes of the namespace, by their pids out here."""
    found = []
    for pid in _in_namespace(namespace):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == f"sleep\0{seconds}\0".encode() and not read_proc(pid).zombie:
                    found.append(pid)
        except (OSError, AttributeError):
            continue
    return found


@pytest.mark.parametrize("background", ["sleep 1000 & exit 0", "setsid sleep 1000 & exit 0"])
def test_as_pid1_an_orphan_from_outside_the_ranks_is_left_alone_when_the_group_ends(tmp_path, background):
    """As PID 1, ranktop adopts every orphan of the namespace. Only those from the ranks (in a
    rank's session, or with the run's marker) are strays: a job a person left running from
    `kubectl exec` used to be noted as one and SIGTERMed at the group's end."""
    trigger = tmp_path / "fail now"
    proc = _as_pid1(tmp_path, RESTARTED, "--nproc-per-node", "1", "--max-restarts", "1", "--shutdown-timeout", "1",
                    "--run-id", "p", session=True, args=(str(trigger),))
    run_dir = tmp_path / "logs" / "p"
    try:
        init = wait_for(lambda: next(iter(_children(proc.pid)), None), what="ranktop as PID 1")
        namespace = os.readlink(f"/proc/{init}/ns/pid")
        wait_for(lambda: len(_sleepers(namespace, "999")) == 2, timeout=20, what="the rank's daemons")
        _exec_in(init, background)
        outsider = wait_for(lambda: _sleepers(namespace, "1000"), what="the job left from outside")[0]
        trigger.write_text("")  # the group ends; the run restarts it
        wait_for(lambda: any(e["event"] == "started" and e["attempt"] == 1
                             for e in read_events(run_dir, while_written=True)), timeout=20, what="the second attempt")
        events = read_events(run_dir, while_written=True)
        adopted = [e["command"] for e in events if e["event"] == "stray_adopted"]
        assert sorted(adopted) == ["sleep 999", "sleep 999"]  # the rank's, by marker and by session
        stopping = [e for e in events if e["event"] == "strays_stopping"]
        assert len(stopping) == 1 and len(stopping[0]["pids"]) == 2
        assert not _sleepers(namespace, "999")  # swept with the group
        assert _sleepers(namespace, "1000") == [outsider]  # not signalled
    finally:
        _end(proc)


def test_as_pid1_orphans_in_its_own_session_are_reaped(tmp_path):
    """ranktop as PID 1 in a session whose leader is outside the namespace (its id reads 0 there),
    as is every process entered from outside: their orphans used to be taken for ranktop's own
    tools and never reaped, so each left a zombie."""
    proc = _as_pid1(tmp_path, SLEEPER, "--nproc-per-node", "1", "--run-id", "p")
    try:
        init = wait_for(lambda: next(iter(_children(proc.pid)), None), what="ranktop as PID 1")
        wait_for(lambda: len(_children(init)) == 2, timeout=20, what="the rank and the guard")
        for _ in range(10):
            _exec_in(init, "sleep 0.1 & exit 0")
        wait_for(lambda: len(_children(init)) == 2 and not _zombies(init), what="the orphans reaped")
        assert not [e for e in read_events(tmp_path / "logs" / "p", while_written=True) if "stray" in e["event"]]
    finally:
        _end(proc)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_the_tui_as_pid1_stays_after_a_detach_and_reaps_orphans(tmp_path):
    """`docker run -it IMAGE ranktop ...`: PID 1 is the TUI's waiting parent. It used to exit at
    a detach, as it does to give a shell its prompt back, and the kernel then ended the whole
    namespace: the run the person meant to leave going. It also reaped only its TUI child, so
    the orphans the namespace gave it stayed zombies."""
    from test_serve import ls
    from test_tui_tmux import SCRIPT, Terminal

    runtime = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # (short: a socket's path has 107 bytes)
    env = {**os.environ, "XDG_RUNTIME_DIR": runtime}
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    status = tmp_path / "status"
    command = " ".join([*UNSHARE, *ranktop_cmd("--tui", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                                               str(script))])
    term = Terminal(f"cd {ROOT} && XDG_RUNTIME_DIR={runtime} {command}; echo $? > {status}; sleep 60", 80, 24)
    try:
        term.wait_screen("hello from 0", "hello from 1")
        (run,) = wait_for(lambda: ls(env), what="the run served")
        init = wait_for(lambda: _init_running(str(script)), what="PID 1 (the TUI's waiting parent)")
        engine = next(iter(_children(init)))
        _exec_in(init, "for i in 1 2 3 4 5; do sleep 0.1 & done; exit 0")  # orphans for init
        term.press("q")
        term.wait_screen("Detach")
        term.press("d")
        term.wait_screen("as PID 1 this process stays until the run ends")
        wait_for(lambda: not _zombies(init) and _children(init) == {engine}, what="the orphans reaped")
        assert [r["state"] for r in ls(env)] == ["running"]  # the run goes on, detached
        assert not status.exists()
        assert run_ranktop("stop", run["run_id"], env=env).returncode == 0
        wait_for(status.exists, timeout=20, what="PID 1 gone once the run ended")
        assert not os.path.exists(f"/proc/{init}")
    finally:
        term.close()
        shutil.rmtree(runtime, ignore_errors=True)


def _init_running(script: str) -> int | None:
    """The PID 1 (by its pid out here) of the namespace that unshare made to run `script`."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"unshare") and script.encode() in argv:
            return next(iter(_children(int(entry))), None)
    return None


def test_a_sigterm_to_the_tui_as_pid1_while_it_starts_stops_the_run(tmp_path):
    """`docker run -it IMAGE ranktop --tui ...` deleted as it starts: PID 1 passes the SIGTERM to
    its TUI child, which noted it while it had no handler of its own yet and never acted on it
    (its agent runs in a thread, which takes no early signals): the ranks ran on to the SIGKILL."""
    script = tmp_path / "rank.py"
    script.write_text(SLEEPER)
    status = tmp_path / "status"
    runtime = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    command = " ".join([*UNSHARE, *ranktop_cmd("--tui", "--nproc-per-node", "1", "--shutdown-timeout", "2",
                                               "--log-dir", str(tmp_path / "logs"), str(script))])
    from test_tui_tmux import Terminal

    term = Terminal(f"cd {ROOT} && XDG_RUNTIME_DIR={runtime} {command}; echo $? > {status}; sleep 60", 80, 24)
    try:
        init = wait_for(lambda: _init_running(str(script)), interval=0.001, what="PID 1 (the TUI's waiting parent)")
        wait_for(lambda: _children(init), interval=0.001, what="the TUI's child forked")
        os.kill(init, signal.SIGTERM)
        wait_for(status.exists, timeout=20, what="the run stopped by the SIGTERM")
        assert status.read_text().strip() == str(128 + signal.SIGTERM)
    finally:
        term.close()
        shutil.rmtree(runtime, ignore_errors=True)
