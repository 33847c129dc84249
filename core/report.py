"""Plain-text report of how a run ended, for the terminal (headless) and for logs."""

from __future__ import annotations

import datetime
import os

from ranktop.core.state import LogLoss, RootCause


def describe_exit(exitcode: int, signal_name: str | None) -> str:
    return f"was killed by {signal_name}" if exitcode < 0 else f"exited with code {exitcode}"


TAIL_LINES = 10  # lines of a failed rank's output shown under the root cause
_TRACEBACK_HEAD = "Traceback (most recent call last):"
_CHAIN_LINES = ("During handling of the above exception, another exception occurred:",
                "The above exception was the direct cause of the following exception:")


def output_tails(cause: RootCause) -> list[tuple[int, tuple[str, ...]]]:
    """The last lines of every rank that failed on its own. Where the rank's traceback is shown
    already, the traceback it printed is left out of that rank's tail: only what is news remains."""
    shown = {line.strip() for line in (cause.traceback or "").splitlines()}
    tails = []
    for rank, tail in cause.failed_tails or ((cause.rank, cause.last_lines),):
        if rank == cause.rank and shown:
            tail = _before_traceback(tail, shown)
        tail = tail[-TAIL_LINES:]
        if tail:
            tails.append((rank, tail))
    return tails


def _before_traceback(tail: tuple[str, ...], shown: set[str]) -> tuple[str, ...]:
    """The lines before the rank's printed traceback (with any exceptions chained to it). The
    printed one may have frames error.json lacks (the module-level call of a @record main), so
    it is cut where it starts rather than line by line; without a header, drop the known lines."""
    heads = [i for i, line in enumerate(tail) if line.strip() == _TRACEBACK_HEAD]
    if not heads:
        return tuple(line for line in tail if line.strip() not in shown)
    start = heads[-1]
    for earlier in reversed(heads[:-1]):
        between = [line.strip() for line in tail[earlier:start] if line.strip()]
        if not between or between[-1] not in _CHAIN_LINES:
            break
        start = earlier
    return tail[:start]


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


def format_incomplete_logs(losses: tuple[LogLoss, ...] | list[LogLoss]) -> str:
    """Which log files miss output and by how much ("" when every log is whole)."""
    if not losses:
        return ""
    lines = [f"ranktop: {len(losses)} log file{'s' if len(losses) > 1 else ''} incomplete "
             "(exit status 1 for that): a write failed, the rest of that output was not saved"]
    lines += [f"  {loss.path}: {loss.error}, {loss.bytes_lost} bytes lost (rank {loss.rank})" for loss in losses]
    return "\n".join(lines)
