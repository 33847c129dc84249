"""Stop signals for a caller of the Python API: torch's start_processes makes SIGTERM, SIGINT,
SIGHUP and SIGQUIT raise SignalException in the caller's main thread, and so does ours.

Two halves share this module's state. `catch_stop_signals` (start_processes) installs the handler
and `restore_signals` (the context's close) puts back what it replaced once no open context counts
on it. `signals_held` (every monitor pass of a context, its close) keeps the exception out of the
middle of a pass: a signal that comes meanwhile is raised when the pass is over, with every rank's
state recorded. The agent and the command line install handlers of their own (core/signals.py says
what a stop signal means to them).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")

_held = threading.local()  # .depth: inside a monitor pass; .pending: a stop signal that came meanwhile


def _raise_signal_exception(signum: int, _frame: Any) -> None:
    if getattr(_held, "depth", 0):
        _held.pending = signum  # raised when the pass is over, with every rank's state recorded
        return
    _raise_for(signum)


def _raise_for(signum: int) -> None:
    from ranktop.core.errors import SignalException

    raise SignalException.received(signum)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """A stretch (a monitor pass) that a stop signal must not cut short: it is raised at the end."""
    _held.depth = getattr(_held, "depth", 0) + 1
    try:
        yield
    finally:
        _held.depth -= 1
        pending = getattr(_held, "pending", None)
        if pending is not None and not _held.depth:
            _held.pending = None
            # Also when the pass raised: the stop signal is what torch's handler would have raised
            # mid-pass, and the caller's error stays as its __context__. Kept for a later pass, it
            # came out of a wait() or close() long after the signal.
            _raise_for(pending)


# What the handlers replaced, and how many open contexts count on them: they are put back when
# the last of those is closed (closing one of two must not let a SIGTERM kill the other's caller).
_replaced: dict[int, Any] = {}
_holders = [0]


def catch_stop_signals() -> bool:
    """As torch's start_processes: in the main thread, SIGTERM/SIGINT/SIGHUP/SIGQUIT raise
    SignalException in the caller (in its wait()), which can then close(e.sigval). Unlike torch,
    a handler the caller set itself (or SIG_IGN, as under nohup) is left alone. Returns whether
    the new context counts on the handlers (then its close() puts back what they replaced, if it
    is the last such)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for name in _STOP_SIGNALS:
        number = getattr(signal, name)
        current = signal.getsignal(number)
        if current in (signal.SIG_DFL, signal.default_int_handler):
            _replaced[number] = current
            signal.signal(number, _raise_signal_exception)
    _holders[0] += 1
    return True


def restore_signals(holds: bool) -> None:
    """A context that counted on the handlers (`holds`) no longer does: the last such puts back
    what they replaced."""
    if not holds:
        return
    _holders[0] -= 1
    if _holders[0] == 0 and threading.current_thread() is threading.main_thread():
        for number, handler in _replaced.items():
            if signal.getsignal(number) is _raise_signal_exception:  # not changed since by the caller
                signal.signal(number, handler)
        _replaced.clear()

