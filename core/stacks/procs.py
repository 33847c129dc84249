"""The processes being dumped: whether one still runs, and what its environment says."""

from __future__ import annotations

import psutil


def gone_reason(pid: int) -> str | None:
    """Why `pid` cannot be dumped because it is no longer running, or None while it runs."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "process gone (it exited before or during the dump)"
    except psutil.Error:
        return None
    if status == psutil.STATUS_ZOMBIE:
        return "process exited (not reaped yet)"
    return None


def environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except psutil.Error:
        return {}
