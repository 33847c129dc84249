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


def children_of(pid: int, most: int = 64) -> tuple[str, ...]:
    """'PID NAME' of `pid`'s child processes, at most `most`: a rank whose stack waits in
    `subprocess` or `os.wait` is waiting on one of them, and py-spy shows only the rank itself."""
    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return ()
    named = []
    for kid in kids[:most]:
        try:
            named.append(f"{kid.pid} {kid.name()}")
        except psutil.Error:  # gone meanwhile
            continue
    return tuple(named)


def environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except psutil.Error:
        return {}
