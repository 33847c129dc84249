"""How a run ended, told once: the root cause's lines (`root_cause_lines`) for every renderer,
the plain-text report for the terminal (headless) and logs, and incomplete logs."""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Any, NamedTuple

from ranktop.core.errors import NO_TRACE_HINT, describe_exit
from ranktop.core.sanitize import clean
from ranktop.core.state import GroupSnapshot, GroupState, LogLoss, RankState, RootCause

TAIL_LINES = 10  # lines of a failed rank's output shown under the root cause
MESSAGE_LINES = 20  # lines of the failure's message shown (the traceback has its own cap)
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


def _asks_for_a_traceback_already_printed(cause: RootCause) -> bool:
    """A message that only says how to get a traceback is left out where the rank printed one
    (a script's uncaught exception, gloo's error): its tail below shows it, and the headline
    says the exit code the message repeats."""
    if not (cause.message or "").endswith(NO_TRACE_HINT):
        return False
    tail = dict(cause.failed_tails).get(cause.rank, cause.last_lines)
    return any(line.rstrip().endswith(_TRACEBACK_HEAD) for line in tail)


def failed_at(cause: RootCause) -> str:
    """The failure's time of day, to the millisecond: ranks of one group fail within moments.
    'an unknown time' for one no clock shows (NaN, 1e300: an ended run's final.json is read
    back, and anyone who could write its directory could have written that)."""
    if not math.isfinite(cause.timestamp):
        return "an unknown time"
    seconds = int(cause.timestamp)
    micros = round((cause.timestamp - seconds) * 1e6)  # rounded as datetime rounds it
    seconds, micros = seconds + micros // 10**6, micros % 10**6
    try:
        return time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{micros // 1000:03d}"
    except (OverflowError, OSError, ValueError):
        return "an unknown time"


def _signal_label(number: int) -> str:
    """'SIGTERM' for 15; 'signal 99999' for a number that names no signal (a final.json's)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class CauseLine(NamedTuple):
    """One line under a root cause's headline. `kind`: message, traceback (an exception line),
    frame (an indented traceback line), more (traceback lines left out), tail-head, tail (a failed
    rank's last output), file or stopped (the ranks ranktop stopped because of it). `text` is the rank's own, unfiltered: each renderer filters it
    for its terminal."""

    kind: str
    text: str

    @property
    def indent(self) -> str:
        return "    " if self.kind == "tail" else "  "


def root_cause_lines(cause: RootCause, *, max_traceback: int | None = None,
                     max_tail: int = TAIL_LINES) -> list[CauseLine]:
    """The evidence for a root cause, the same for every view: the message, the traceback (its
    last `max_traceback` lines), each failed rank's last output, the error file."""
    # (each line of a message its own: the lines after the first kept the indent of none)
    message = [] if _asks_for_a_traceback_already_printed(cause) else (cause.message or "").rstrip().splitlines()
    lines = [CauseLine("message", line) for line in message[:MESSAGE_LINES]]
    if len(message) > MESSAGE_LINES:  # error.json is the rank's to write: up to 1 MiB of lines
        lines.append(CauseLine("more", f"… {len(message) - MESSAGE_LINES} more message lines in error.json"))
    if cause.traceback:
        trace = cause.traceback.rstrip().splitlines()
        if max_traceback is not None and len(trace) > max_traceback:
            lines.append(CauseLine("more", f"… {len(trace) - max_traceback} more traceback lines in error.json"))
            trace = trace[-max_traceback:]
        lines += [CauseLine("frame" if line.startswith(" ") else "traceback", line) for line in trace]
    for rank, tail in output_tails(cause):
        lines.append(CauseLine("tail-head", f"last output of rank {rank}:"))
        lines += [CauseLine("tail", line) for line in tail[-max_tail:]]
    if cause.error_file:
        lines.append(CauseLine("file", f"error file: {clean(cause.error_file)}"))
    if cause.stopped:
        ranks = ", ".join(f"{rank} ({how})" for rank, how in cause.stopped)
        lines.append(CauseLine("stopped", f"stopped by ranktop after it, not the cause: rank{'s' if len(cause.stopped) > 1 else ''} {ranks}"))
    return lines


def format_root_cause(cause: RootCause, *, name: str, attempt: int, max_restarts: int,
                      run_dir: str | None = None, user_restarts: int = 0, then: str | None = None) -> str:
    """The headline, the evidence and where the logs are: the run directory when known (a rank
    killed by a signal leaves no error file, and its logs are what is left to read). Attempts
    the user's group restarts started spent no restart: they add to the attempts the run may
    have. `then`: how the run was stopped after the failure ("stopped by SIGINT")."""
    if cause.attempt is not None:  # the run may be on a later attempt whose ranks never started
        attempt = cause.attempt
    stopped = f", then was {then}" if then else ""
    # A user action first: the failure may well be its effect (a peer of a killed rank), and the
    # person reading this is the one who acted.
    after = f" after you {clean(cause.user_action_what)}" if cause.user_action_what else ""
    before = f"after {clean(cause.user_action)}: " if cause.user_action else ""
    # The attempt named as its directory is, as every other view names it ("attempt 1 of 1",
    # counted from 1, sent a reader looking for an attempt_1/); the count says how many it had.
    allowed = max_restarts + 1 + user_restarts
    lines = [
        f"ranktop: {name} failed{after} in attempt_{attempt} ({attempt + 1} of {allowed} attempts){stopped}",
        f"  root cause: {before}rank {cause.rank} (local rank {cause.local_rank}, pid {cause.pid}) "
        f"{describe_exit(cause.exitcode, cause.signal_name, sentence=True)} at {failed_at(cause)}",
    ]
    lines += [line.indent + line.text for line in root_cause_lines(cause)]
    logs = run_dir or (os.path.dirname(cause.error_file) if cause.error_file else None)
    if logs:
        lines.append(f"  logs: {clean(logs)}")
    return "\n".join(lines)


def format_incomplete_logs(losses: tuple[LogLoss, ...] | list[LogLoss]) -> str:
    """Which log files miss output and by how much ("" when every log is whole)."""
    if not losses:
        return ""
    lines = [f"ranktop: {len(losses)} log file{'s' if len(losses) > 1 else ''} incomplete "
             "(exit status 1 for that): a write failed, the rest of that output was not saved"]
    lines += [f"  {clean(loss.path)}: {loss.error}, {loss.bytes_lost} bytes lost (rank {loss.rank})" for loss in losses]
    return "\n".join(lines)


def format_end_report(result: Any, *, name: str, attempt: int, max_restarts: int, run_dir: str | None,
                      success_line: bool = False, earlier_attempts: str = "",
                      user_restarts: int = 0) -> str:
    """Everything said on the terminal once a run is over (headless, and after the TUI closed):
    the root cause and how it was stopped, incomplete logs, ranks left to the guard, a rendezvous
    error. `success_line`: also say so when it succeeded (the TUI leaves nothing else behind),
    with `earlier_attempts` (GroupSnapshot.earlier_words_before_cause) where there were any."""
    parts = []
    rendezvous_error = result.rendezvous_error if result.stop_signal is None else None
    if result.root_cause is not None:  # a rank that failed on its own, maybe before a stop
        parts.append(format_root_cause(result.root_cause, name=name, attempt=attempt, max_restarts=max_restarts,
                                       run_dir=run_dir, user_restarts=user_restarts, then=_how_stopped(result)))
    elif result.stop_signal is not None:
        parts.append(f"ranktop: stopped by {_signal_label(result.stop_signal)}; logs in {clean(str(run_dir))}")
    elif result.state == GroupState.STOPPED and not result.rendezvous_error:
        # (headless too: stopped from elsewhere, `ranktop stop`, the output just ended without a word)
        parts.append(f"ranktop: {name} stopped on request{_user_ended(result.user_ended)}; "
                     f"logs in {clean(str(run_dir))}")
    elif success_line and result.state == GroupState.SUCCEEDED:
        parts.append(f"ranktop: {name} succeeded: all ranks exited 0; logs in {clean(str(run_dir))}")
    if rendezvous_error and not parts:
        # Why no rank ran (a peer's stop with no restart left, a round that never formed) heads the
        # report, and the lines under it are its: `  earlier attempts: ...` came first, alone. The
        # run's directory is named under it as under a failed rank's headline (headless named none:
        # its events.jsonl says what the rendezvous did, and any rank that ran left its logs there).
        parts.append(f"ranktop: error: {rendezvous_error}")
        if run_dir:
            parts.append(f"  logs: {clean(str(run_dir))}")
        rendezvous_error = None
    if success_line and earlier_attempts:
        parts.append("  earlier attempts: " + earlier_attempts)
    if success_line and result.end_note:  # (headless said it when it happened)
        parts.append(f"ranktop: note: {clean(result.end_note)}")
    if result.incomplete_logs:
        parts.append(format_incomplete_logs(result.incomplete_logs))
    for rank, pid in sorted(result.unreapable.items()):
        parts.append(f"ranktop: rank {rank} (pid {pid}) outlived SIGKILL (stuck in the kernel); "
                     "left to the orphan guard")
    if rendezvous_error:  # after the root cause: why no later attempt ran
        parts.append(f"ranktop: error: {rendezvous_error}")
    if parts and result.interpreter:  # PYTHON_EXEC or another env's python: which one ran matters
        parts.append(f"  the ranks ran {clean(result.interpreter)}")
    return "\n".join(parts)


def _how_stopped(result: Any) -> str | None:
    """'stopped by SIGINT', 'stopped on request' (the user's Stop), or None: not stopped."""
    if result.stop_signal is not None:
        return f"stopped by {_signal_label(result.stop_signal)}"
    return "stopped on request" if result.state == GroupState.STOPPED else None


def _user_ended(ranks: tuple[int, ...]) -> str:
    """': you ended ranks 0, 1' for the ranks the user killed or signalled to their end ('' for none)."""
    if not ranks:
        return ""
    return f": you ended rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class _SeenEnd(NamedTuple):
    """What format_end_report reads of a RunResult, as a final snapshot tells it."""

    state: GroupState
    root_cause: RootCause | None
    stop_signal: int | None
    incomplete_logs: tuple[LogLoss, ...]
    unreapable: dict[int, int | None]
    rendezvous_error: str | None
    interpreter: str | None
    end_note: str | None
    user_ended: tuple[int, ...]


def report_after_tui(group: GroupSnapshot) -> str:
    """What a TUI leaves in the terminal once it closes on an ended run (in-process or attached):
    the headless end report with its success line, from the run's final snapshot."""
    unreapable = {r.rank: r.pid for r in group.ranks if r.state == RankState.UNREAPABLE}
    seen = _SeenEnd(group.state, group.root_cause, group.stop_signal, group.incomplete_logs, unreapable,
                    group.rendezvous_error, group.interpreter, group.end_note, group.user_ended)
    return format_end_report(seen, name=group.name, attempt=group.attempt, max_restarts=group.max_restarts,
                             run_dir=group.log_dir, success_line=True,
                             earlier_attempts=group.earlier_words_before_cause,
                             user_restarts=group.user_restarts)
