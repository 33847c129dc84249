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
from ranktop.core.guard import status_fields
from ranktop.core.layout import RunDir, dump_log_path
from ranktop.core.stacks.grouping import build_report
from ranktop.core.stacks.model import Frame, RankStack, StackReport, StackStatus, ThreadStack, snapshot_facts
from ranktop.core.stacks.procs import HeldProcess, children_of, gone_reason, is_paused
from ranktop.core.stacks.saving import save_report


def _signal_bit(sig: int) -> int:
    return 1 << (int(sig) - 1)


def _status_masks(path: str, names: tuple[str, ...]) -> tuple[int, ...] | None:
    """The signal masks `names` (SigCgt, SigBlk...) of a /proc status file, None where it cannot be
    read (the process or thread is gone) or lacks one."""
    try:
        fields = status_fields(path, names)
        return tuple(int(fields[name], 16) for name in names)
    except (OSError, ValueError, KeyError):
        return None


def catches_signal(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (SigCgt in /proc), i.e. it will not die of it."""
    caught = _status_masks(f"/proc/{pid}/status", ("SigCgt",))
    return caught is not None and bool(caught[0] & _signal_bit(sig))


_MASK_FIELDS = ("SigPnd", "ShdPnd", "SigBlk")


def thread_signal_masks(pid: int) -> dict[int, tuple[int, int, int]]:
    """Each thread's (pending to it, pending to the process, blocked) signal masks, as
    /proc/PID/task/TID/status shows them to anyone (no ptrace needed); threads that end while
    read are left out, and a process that is gone has none."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    masks = {int(tid): _status_masks(f"/proc/{pid}/task/{tid}/status", _MASK_FIELDS) for tid in tids}
    return {tid: mask for tid, mask in masks.items() if mask is not None}


def threads_blocking(pid: int, sig: int) -> frozenset[int]:
    """The threads of `pid` that block `sig` now (helper threads that block every signal, as
    some native libraries start theirs): they take no part in its delivery."""
    bit = _signal_bit(sig)
    return frozenset(tid for tid, (_own, _shared, blocked) in thread_signal_masks(pid).items() if blocked & bit)


def handler_returned(pid: int, sig: int, blockers: frozenset[int]) -> bool:
    """Whether no handler of `sig` runs in `pid` and none is due: `sig` pending neither to the
    process nor to a thread, and blocked by no thread but `blockers` (those that blocked it
    before it was sent). The kernel blocks a signal in the thread that runs its handler until
    the handler returns (faulthandler asks for no SA_NODEFER), so a dump seen begun in the log
    and this true after means faulthandler has written all of it."""
    bit = _signal_bit(sig)
    masks = thread_signal_masks(pid)
    return bool(masks) and not any(own & bit or shared & bit or (blocked & bit and tid not in blockers)
                                   for tid, (own, shared, blocked) in masks.items())


PAUSED = "skipped: paused (stopped by a signal): it runs no handler until it is continued"


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
        elif is_paused(pid):  # its handler would run only once it is continued, long after the read
            outcome[rank] = PAUSED
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


def _read_from(path: str, offset: int) -> tuple[str, int]:
    """What the log holds past `offset`, at most MAX_DUMP_BYTES of it (the rank may write without
    end), and its size when opened (all of that text was written by then)."""
    fd = _open_log(path)
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, offset, os.SEEK_SET)
        return read_at_most(fd, MAX_DUMP_BYTES).decode(errors="replace"), size
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

    A rank's dump is taken as complete once the new part of that log holds a stack and either
    has not grown for DUMP_QUIET_SECONDS or, after its handler was seen to have returned, has
    grown twice (see `_DumpReading`): a rank that writes without a pause never goes quiet.
    """
    started, taken_at = time.perf_counter(), time.time()
    offsets, unreadable = _log_ends(pids, dump_logs)  # unreadable: {rank: why its log cannot be read}
    blockers = {r: threads_blocking(pid, signal.SIGUSR1) for r, pid in pids.items()}
    # Signalled all the same: the stacks still reach the rank's stderr, and its pane.
    outcome = signal_pids(pids, held=held)
    pending = {r for r, what in outcome.items() if what == "sent" and r not in unreadable}
    readings = {r: _DumpReading(dump_logs.get(r, ""), offsets[r], pids[r], blockers[r]) for r in pending}
    texts = _read_dumps(readings, unreadable, timeout)
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
_POLL_SECONDS = 0.03
_HEADER_END = "(most recent call first):"


class _DumpReading:
    """One rank's log read back after SIGUSR1, until its dump is complete.

    A rank that writes without a pause (a progress thread, a logging loop while its main thread
    waits in a collective) never goes quiet, and faulthandler's dump has no end to see: the last
    thread's block ends in a frame like any other, and the dump is written from a signal handler,
    nine write(2)s a frame, while the rank's other threads write on, so the line after a block
    may be theirs, written mid-dump. The kernel tells the end: it blocks SIGUSR1 in the thread
    that runs the handler until the handler returns (`handler_returned`). Seen returned after the
    dump began in the log, all of the dump is in the log or in the pipe, ahead of whatever the
    rank writes next. The agent's reader empties a pipe each time it reads it (a pty: reads it
    until it has nothing), and writes what it read to the log before it reads again: once the log
    has grown twice past its size at that moment, a read that came after the handler's end has
    been written. (Not so for a handler in Python, which runs after the kernel's part returned: a
    dump it wrote slowly while other threads write could be taken before its end. faulthandler's
    is in C, and it is the one ranktop registers.)

    `blockers`: the rank's threads that blocked SIGUSR1 when it was sent (native helper threads
    that block every signal); they take no part. The main thread among them (a rank holding the
    signal off a moment) is its likely taker once it lets it in, and its handler would look like
    its own blocking: then no end is told, and the quiet rule alone holds.
    """

    def __init__(self, path: str, offset: int, pid: int, blockers: frozenset[int]) -> None:
        self.path, self.offset, self.pid = path, offset, pid
        self.blockers = None if pid in blockers else blockers
        self.text, self.grew_at = "", time.monotonic()
        self.returned = False  # its handler was seen to have returned (with the dump begun)
        self.size = -1  # the log's size at the last read since then
        self.growths = 0  # reads since then that found it grown

    def poll(self, now: float) -> bool:
        """Read the log once more; whether the dump is complete (UnreadableLog if it cannot be read)."""
        if not self.returned and self.blockers is not None and _HEADER_END in self.text:
            # (the text was read before this: the handler had begun, its mask set, by then)
            self.returned = handler_returned(self.pid, signal.SIGUSR1, self.blockers)
        text, size = _read_from(self.path, self.offset)
        if text != self.text:
            self.text, self.grew_at = text, now
        if self.returned:
            if 0 <= self.size < size:  # (the first size, read just after the check, is where it counts from)
                self.growths += 1
            self.size = size
        if _HEADER_END not in text:
            return False
        return self.growths >= 2 or now - self.grew_at >= DUMP_QUIET_SECONDS


def _read_dumps(readings: Mapping[int, _DumpReading], unreadable: dict[int, str], timeout: float) -> dict[int, str]:
    """What each rank's log gained past its offset, read until its dump is complete or `timeout`
    passes; a log that turns unreadable joins `unreadable`."""
    pending = set(readings)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
        now = time.monotonic()
        for r in sorted(pending):
            try:
                if readings[r].poll(now):
                    pending.discard(r)
            except UnreadableLog as exc:  # replaced since: what was read so far stands
                unreadable[r] = str(exc)
                pending.discard(r)
    return {r: reading.text for r, reading in readings.items()}


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
    if outcome == PAUSED:
        return RankStack(**base, status=StackStatus.FAILED, reason=outcome, paused=True,
                         hint=f"py-spy (without --signal) reads a stopped rank; kill -CONT {pid} lets it run on")
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
