"""The fallback that needs no ptrace: SIGUSR1 makes a rank's faulthandler print its stacks to
its stderr (its log and its pane); read them back from the log and group them like py-spy's."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import signal
import stat
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ranktop.core.errors import file_kind, read_at_most
from ranktop.core.events import EventLog
from ranktop.core.layout import RunDir, dump_log_path
from ranktop.core.stacks.grouping import build_report
from ranktop.core.stacks.model import Frame, RankStack, StackReport, StackStatus, ThreadStack, snapshot_facts
from ranktop.core.stacks.procs import HeldProcess, children_of, gone_reason
from ranktop.core.stacks.saving import save_report


def catches_signal(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (SigCgt in /proc), i.e. it will not die of it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def signal_pids(pids: Mapping[int, int], sig: int = signal.SIGUSR1,
                held: Mapping[int, HeldProcess] | None = None) -> dict[int, str]:
    """Send `sig` to each rank process (not its group) that catches it; {rank: what happened}.

    Only the rank process: its children (data loader workers, compilers) did not necessarily
    register faulthandler, and SIGUSR1's default action would kill them. A rank that does not
    catch the signal is skipped for the same reason. `held`: {rank: its process, held since it
    was checked}, which gets the signal through its pidfd (never a process that took its pid since).
    """
    outcome = {}
    for rank, pid in sorted(pids.items()):
        if gone_reason(pid):
            outcome[rank] = "gone"
        elif not catches_signal(pid, sig):
            outcome[rank] = "skipped: it does not handle SIGUSR1 (faulthandler off, or not Python)"
        else:
            try:
                _send(pid, sig, (held or {}).get(rank))
                outcome[rank] = "sent"
            except ProcessLookupError:
                outcome[rank] = "gone"
            except PermissionError:
                outcome[rank] = "no permission to signal it"
    return outcome


def _send(pid: int, sig: int, process: HeldProcess | None) -> None:
    if process is None:
        os.kill(pid, sig)
    else:
        process.send(sig)


def signal_dump(agent: Any) -> dict[int, str]:
    """SIGUSR1 to every live rank that handles it; each writes its stacks to its stderr (log, pane)."""
    snap = agent.snapshot()
    pids = {r.rank: r.pid for r in snap.ranks if r.pid is not None and r.state.alive}
    outcome = signal_pids(pids)
    agent.events.write("stacks_signalled", signal="SIGUSR1", ranks=outcome)
    return outcome


# Searched, not matched at the line's start: the dump often lands on a line the rank left open (a
# progress bar redrawn with '\r' ends no line), `...| 76/100 [10.0 it/s]Current thread 0x...`.
_FH_HEADER = re.compile(r"(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')


def parse_faulthandler(text: str) -> tuple[ThreadStack, ...]:
    """faulthandler's dump (all threads, most recent call first) -> threads, main first.

    The thread that ran the handler ("Current thread") is the main thread: Linux delivers a
    signal sent to a process to its main thread when that thread does not block it, and Python
    threads do not. faulthandler prints no thread names, so other threads are grouped by stack.
    """
    blocks: dict[int, tuple[bool, list[Frame]]] = {}  # by thread id: a second dump replaces the first
    frames: list[Frame] | None = None
    for line in text.splitlines():
        head = _FH_HEADER.search(line.rstrip())
        if head:
            frames = []
            blocks.pop(int(head.group(2), 16), None)
            blocks[int(head.group(2), 16)] = (head.group(1) == "Current thread", frames)
            continue
        frame = _FH_FRAME.match(line)
        if frame and frames is not None:
            path = frame.group(1)
            frames.append(Frame(frame.group(3), path, os.path.basename(path), int(frame.group(2))))
    threads = [ThreadStack("" if current else "(unnamed)", tid, None, None, False, current, tuple(reversed(fs)))
               for tid, (current, fs) in blocks.items()]
    threads.sort(key=lambda t: not t.is_main)
    return tuple(threads)


MAX_DUMP_BYTES = 4 << 20  # read of a log after the signal: faulthandler's dump of hundreds of threads is far less


class UnreadableLog(Exception):
    """A rank's log cannot be read back (a FIFO or a symlink planted in its place, gone); one line says why."""


def _open_log(path: str) -> int:
    """The log opened as layout.tail_lines opens one: a rank can plant anything in its own
    directory, so never through a symlink, never waiting on a FIFO, and only a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UnreadableLog("a symlink, not followed" if exc.errno == errno.ELOOP else exc.strerror) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnreadableLog(f"not a regular file ({file_kind(mode)})")
    return fd


def _size(path: str) -> int:
    fd = _open_log(path)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _read_from(path: str, offset: int) -> str:
    """What the log holds past `offset`, at most MAX_DUMP_BYTES of it (the rank may write without end)."""
    fd = _open_log(path)
    try:
        os.lseek(fd, offset, os.SEEK_SET)
        return read_at_most(fd, MAX_DUMP_BYTES).decode(errors="replace")
    finally:
        os.close(fd)


def signal_report(pids: Mapping[int, int], dump_logs: Mapping[int, str], *,
                  local_ranks: Mapping[int, int] | None = None, timeout: float = 3.0,
                  run_dir: RunDir | None = None, events: EventLog | None = None,
                  source: str = "signal", held: Mapping[int, HeldProcess] | None = None,
                  extra: Mapping[int, dict] | None = None) -> StackReport:
    """The grouped view without ptrace: SIGUSR1 to each rank, then read its dump from the log its
    stderr goes to (`layout.dump_log_path`). `extra`: {rank: facts the dump cannot tell}, as
    `snapshot_facts` gives them.

    A rank's dump is taken as complete once the new part of that log holds a stack and has not
    grown for DUMP_QUIET_SECONDS.
    """
    started, taken_at = time.perf_counter(), time.time()
    offsets, unreadable = _log_ends(pids, dump_logs)  # unreadable: {rank: why its log cannot be read}
    # Signalled all the same: the stacks still reach the rank's stderr, and its pane.
    outcome = signal_pids(pids, held=held)
    pending = {r for r, what in outcome.items() if what == "sent" and r not in unreadable}
    texts = _read_dumps(pending, dump_logs, offsets, unreadable, timeout)
    found = [dataclasses.replace(_rank_stack(r, pids[r], (local_ranks or {}).get(r), outcome[r], texts.get(r, ""),
                                             dump_logs.get(r, ""), unreadable.get(r), timeout),
                                 **(extra or {}).get(r, {}))
             for r in sorted(pids)]
    report = build_report(found, taken_at, time.perf_counter() - started)
    return save_report(report, run_dir, events, source) if run_dir else report


def _log_ends(pids: Mapping[int, int], dump_logs: Mapping[int, str]) -> tuple[dict[int, int], dict[int, str]]:
    """Where each rank's log ends before the signal (its dump comes after), and why the logs
    that cannot be read cannot."""
    offsets, unreadable = {}, {}
    for r in pids:
        try:
            offsets[r] = _size(dump_logs.get(r, ""))
        except UnreadableLog as exc:
            unreadable[r] = str(exc)
    return offsets, unreadable


# faulthandler writes a dump a line at a time, innermost frame first, and it reaches the log
# through the agent's reader: a rank or an agent paused mid-dump on a busy box (30 ms, the old
# quiet time, was seen) left a stack cut, its outer frames missing, so the rank read as odd.
DUMP_QUIET_SECONDS = 0.25


def _read_dumps(pending: set[int], dump_logs: Mapping[int, str], offsets: Mapping[int, int],
                unreadable: dict[int, str], timeout: float) -> dict[int, str]:
    """What the `pending` ranks' logs gained past their offsets, read until each holds a stack
    that has not grown for DUMP_QUIET_SECONDS or `timeout` passes; a log that turns unreadable
    joins `unreadable`."""
    texts: dict[int, str] = {}
    grew_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        time.sleep(0.03)
        now = time.monotonic()
        for r in list(pending):
            try:
                text = _read_from(dump_logs.get(r, ""), offsets[r])
            except UnreadableLog as exc:  # replaced since: what was read so far stands
                unreadable[r] = str(exc)
                pending.discard(r)
                continue
            if texts.get(r) != text:
                texts[r], grew_at[r] = text, now
            elif "(most recent call first):" in text and now - grew_at[r] >= DUMP_QUIET_SECONDS:
                pending.discard(r)  # quiet for long enough: the handler is done
    return texts


def _rank_stack(rank: int, pid: int, local_rank: int | None, outcome: str, text: str, log: str,
                unreadable: str | None, timeout: float) -> RankStack:
    """One rank's part of the report: its stacks, or why there are none."""
    base = {"rank": rank, "local_rank": local_rank, "pid": pid}
    threads = parse_faulthandler(text) if outcome == "sent" else ()
    if threads:  # (its children, as py-spy's dump names them: what a wait in subprocess waits on)
        return RankStack(**base, status=StackStatus.OK, threads=threads, children=children_of(pid))
    if outcome == "gone":
        return RankStack(**base, status=StackStatus.GONE, reason="process gone")
    if outcome == "sent" and unreadable is not None:
        return RankStack(**base, status=StackStatus.FAILED, reason=f"its log {log} cannot be read: {unreadable}",
                         hint="the stacks still went to its stderr (a TUI's pane shows them)")
    if outcome == "sent":
        return RankStack(**base, status=StackStatus.FAILED, reason=f"no stack in its log within {timeout:g}s",
                         hint="a Python handler for SIGUSR1 in the program replaces faulthandler's")
    # (not known to be no Python: a Python rank run with --no-faulthandler looks the same)
    return RankStack(**base, status=StackStatus.FAILED, reason=outcome,
                     hint="a Python rank: py-spy reads it (without --signal); SIGUSR1 needs faulthandler, "
                          "which ranktop turns on in its Python ranks unless --no-faulthandler")


def signal_agent_report(agent: Any, local_ranks: Iterable[int] | None = None, timeout: float = 3.0, *,
                        save: bool = True) -> StackReport:
    """`signal_report` for the agent's live ranks (the TUI's fallback when py-spy cannot attach),
    saved and logged in its run dir unless not `save`."""
    snap = agent.snapshot()
    wanted = set(local_ranks) if local_ranks is not None else None
    live = [r for r in snap.ranks if r.pid and r.state.alive and (wanted is None or r.local_rank in wanted)]
    logs = {r.rank: dump_log_path(os.path.join(agent.attempt_dir(), str(r.local_rank))) for r in live}
    return signal_report({r.rank: r.pid for r in live}, logs, local_ranks={r.rank: r.local_rank for r in live},
                         timeout=timeout, run_dir=agent.layout if save else None,
                         events=agent.events if save else None, source="signal",
                         extra={r.rank: snapshot_facts(r) for r in live})
