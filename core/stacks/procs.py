"""The processes being dumped: whether one still runs, and what its environment says."""

from __future__ import annotations

import os
import select
import signal

import psutil
from ranktop.core.guard import status_fields


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


def tracer_of(pid: int) -> tuple[int, str] | None:
    """(pid, name) of the process that ptraces `pid` (a debugger, strace, another py-spy's dump),
    or None when none does (or it cannot be read). py-spy cannot suspend a process another tracer
    holds, and says only EPERM."""
    try:
        tracer = int(status_fields(f"/proc/{pid}/status", ("TracerPid",)).get("TracerPid", "0"))
    except (OSError, ValueError):
        return None
    if tracer <= 0:
        return None
    try:
        name = psutil.Process(tracer).name()
    except psutil.Error:
        name = "?"
    return tracer, name


def is_paused(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (SIGSTOP, the TUI's `x` STOP, SIGTSTP, SIGTTIN at a read
    of its terminal): it runs nothing, a signal handler included, until SIGCONT."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


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


class HeldProcess:
    """A process held by a pidfd: while it lives, its pid names no other process, so what is
    checked of that pid once it is held, and a dump taken while it still lives, are of it (a
    process that exits lets the kernel give its pid to any other, root's included).
    ProcessLookupError if `pid` is gone already."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)

    def alive(self) -> bool:
        """Whether the held process still runs (a pidfd reads as ready once it has exited). Polled:
        select() takes no descriptor past 1023, and thousands of ranks are held at once."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return not poller.poll(0)

    def send(self, sig: int) -> None:
        """`sig` to the held process, never to another that took its pid (ProcessLookupError)."""
        signal.pidfd_send_signal(self._fd, sig)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def close_all(held: dict[int, HeldProcess]) -> None:
    for process in held.values():
        process.close()
