"""Plain-text report of how a run ended, for the terminal (headless) and for logs."""

from __future__ import annotations

import datetime
import os

from core.state import RootCause


def describe_exit(exitcode: int, signal_name: str | None) -> str:
    return f"was killed by {signal_name}" if exitcode < 0 else f"exited with code {exitcode}"


def output_tails(cause: RootCause) -> list[tuple[int, tuple[str, ...]]]:
    """The last lines of every rank that failed on its own. Where the rank's traceback is shown
    already, its lines are left out of that rank's tail: only what is news remains."""
    shown = {line.strip() for line in (cause.traceback or "").splitlines()}
    tails = []
    for rank, tail in cause.failed_tails or ((cause.rank, cause.last_lines),):
        if rank == cause.rank and shown:
            tail = tuple(line for line in tail if line.strip() not in shown)
        if tail:
            tails.append((rank, tail))
    return tails


def format_root_cause(cause: RootCause, *, name: str, attempt: int, max_restarts: int) -> str:
    when = datetime.datetime.fromtimestamp(cause.timestamp).strftime("%H:%M:%S.%f")[:-3]
    lines = [
        f"ranktop: {name} failed (attempt {attempt + 1} of {max_restarts + 1})",
        f"  root cause: rank {cause.rank} (local rank {cause.local_rank}, pid {cause.pid}) "
        f"{describe_exit(cause.exitcode, cause.signal_name)} at {when}",
        f"  {cause.message}",
    ]
    if cause.traceback:
        lines += ["  " + line for line in cause.traceback.rstrip().splitlines()]
    for rank, tail in output_tails(cause):
        lines.append(f"  last output of rank {rank}:")
        lines += ["    " + line for line in tail]
    if cause.error_file:
        lines.append(f"  error file: {cause.error_file}")
        lines.append(f"  logs: {os.path.dirname(cause.error_file)}")
    return "\n".join(lines)
