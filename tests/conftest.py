"""Shared test plumbing: no orphans after any test, and waiting on conditions with a deadline.

Every process a test starts inherits RANKTOP_TEST_ID from this session's environment (ranktop
passes the caller's environment on to ranks, and ranks to their children). After each test no
process carrying it may be left, apart from pytest itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_ID = os.environ.setdefault("RANKTOP_TEST_ID", uuid.uuid4().hex)
MARK = f"RANKTOP_TEST_ID={TEST_ID}\0".encode()


def polls(timeout: float, what: str):
    """Yields once per try, and fails the test once `timeout` seconds have gone by: the one
    deadline loop behind wait_for and the async waits of the TUI tests."""
    deadline = time.monotonic() + timeout
    while True:
        yield
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")


def wait_for(condition, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll `condition` until it returns something truthy; fail the test after `timeout`."""
    for _ in polls(timeout, what):
        if value := condition():
            return value
        time.sleep(interval)


def marked_processes() -> dict[int, str]:
    """Live processes started (directly or not) by this test session, except pytest itself."""
    found = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if MARK not in f.read() + b"\0":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
    return found


def _reap_children() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    deadline = time.monotonic() + 8.0
    left = marked_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap_children()
        left = marked_processes()
    if left:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        pytest.fail(f"processes left behind: {left}")


def ranktop_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ranktop", *args]


def run_ranktop(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    """Run the real command line to the end, capturing its output as text."""
    kwargs.setdefault("cwd", ROOT)
    return subprocess.run(ranktop_cmd(*args), capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture
def examples() -> Path:
    return ROOT / "examples"
