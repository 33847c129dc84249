"""`launch(func, args, nprocs)`: the small helper for running a function on N local ranks."""

from __future__ import annotations

import collections
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from ranktop.core.context import PContext, RunProcsResult
from ranktop.core.errors import MainProcessError, WorkerError
from ranktop.core.processes_api import start_processes
from ranktop.core.signals import StopAction, StopRule
from ranktop.core.spec import Std, WorkerSpec, free_port, rank_env

_GRACE = 10.0  # seconds a rank has to stop after the caller was signalled, before SIGKILL


def launch(
    func: Callable[..., Any],
    args: Any,
    nprocs: int,
    master_addr: str = "localhost",
    master_port: int | None = None,
) -> dict[int, Any]:
    """Run `func(args)` in `nprocs` fresh processes with the rank environment set.

    Returns the return values by rank. The first failing rank stops the rest and raises
    WorkerError; SIGINT/SIGTERM to the caller stops every rank and raises MainProcessError.
    """
    spec = WorkerSpec(role="default", local_world_size=nprocs, entrypoint=func,
                      master_addr=master_addr, master_port=master_port or free_port())
    envs = {r: rank_env(spec, r, master_port=spec.master_port, restart_count=0, run_id="launch", error_file="")
            for r in range(nprocs)}
    received: collections.deque[tuple[int, float]] = collections.deque()  # (signal, arrival time)
    contexts = []  # the handler goes in before any rank starts, so no signal finds us unprepared
    previous = _catch_signals(received, lambda: [c.wake() for c in contexts])
    with tempfile.TemporaryDirectory(prefix="ranktop-launch-") as log_dir:
        try:
            ctx = start_processes("launch", func, {r: (args,) for r in range(nprocs)}, envs, log_dir,
                                  redirects=Std.NONE, tee=Std.NONE)
        except BaseException:
            _restore(previous)
            raise
        contexts.append(ctx)
        try:
            result, stopped_by = _run_until_end(ctx, received)
        finally:
            try:
                ctx.close()  # our handlers still note signals: a Ctrl-C here cannot cut it short
            finally:
                _restore(previous)
    if stopped_by is not None:
        raise MainProcessError(stopped_by)
    if result.failures:
        first = min(result.failures.values(), key=lambda f: f.exited_at)
        raise WorkerError(first.local_rank, first.exitcode, first)
    return result.return_values


def _run_until_end(ctx: PContext, received: collections.deque[tuple[int, float]]) -> tuple[RunProcsResult, int | None]:
    """Watch the ranks to their end, stopping them as the caller's signals ask (the agent's rule:
    a repeated interrupt kills at once). Returns the result and the signal that stopped the
    ranks, if one did."""
    rule, stopped_by = StopRule(), None
    while True:
        while received:
            signum, received_at = received.popleft()
            action = rule.decide(signum, received_at)
            if action == StopAction.DUPLICATE:
                continue
            stopped_by = stopped_by or signum
            if action == StopAction.KILL_NOW:
                ctx.stop(signal.SIGKILL, 0)
            else:
                ctx.stop(signum, _GRACE)
        result = ctx.step()
        if result is not None and not received:
            return result, stopped_by
        ctx.wait_activity(1.0)


def _catch_signals(received: collections.deque[tuple[int, float]], wake: Callable[[], None]) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def note(signum: int, _frame: Any) -> None:
        received.append((signum, time.monotonic()))
        wake()

    return {sig: signal.signal(sig, note) for sig in LAUNCH_STOP_SIGNALS}


# The signals that stop the ranks and end launch() with MainProcessError: the ones torch's
# start_processes turns into SignalException, so none of them escapes launch() as that.
LAUNCH_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


__all__ = ["launch"]
