"""ranktop as PID 1 of a PID namespace, as a container's command is (a Kubernetes PyTorchJob runs
its launcher so): the kernel drops a signal to PID 1 that has no handler instead of acting on it,
orphans of the whole namespace are re-parented to it, and when it dies the kernel kills everything
in the namespace. Real namespaces through util-linux's `unshare`; skipped where it cannot make one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
from conftest import ROOT, ranktop_cmd, wait_for
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


def _as_pid1(tmp_path, script: str, *flags: str) -> subprocess.Popen:
    path = tmp_path / "rank.py"
    path.write_text(script)
    # --kill-child: should the test fail, killing unshare kills PID 1, and with it the namespace
    return subprocess.Popen([*UNSHARE, *ranktop_cmd("--headless", "--log-dir", str(tmp_path / "logs"), *flags,
                                                    str(path))],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
