"""`launch(func, args, nprocs)`: the small helper for running a function on N local ranks."""

from __future__ import annotations

import signal
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from ranktop.core.context import start_processes
from ranktop.core.errors import MainProcessError, WorkerError
from ranktop.core.spec import Std, WorkerSpec, free_port, rank_env


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
    received: list[int] = []
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
            while (result := ctx.wait(timeout=0.5, period=0.5)) is None:
                if received:
                    ctx.close(death_sig=received[0], timeout=10)
                    raise MainProcessError(received[0])
            if received:
                raise MainProcessError(received[0])
        finally:
            _restore(previous)
            ctx.close()
    if result.failures:
        first = min(result.failures.values(), key=lambda f: f.timestamp)
        raise WorkerError(first.local_rank, first.exitcode, first)
    return result.return_values


def _catch_signals(received: list[int], wake: Callable[[], None]) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def note(signum: int, _frame: Any) -> None:
        received.append(signum)
        wake()

    return {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


__all__ = ["launch"]
