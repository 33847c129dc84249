"""Helpers that leave their rank, and how ranktop keeps hold of them.

A rank's helper may clear its environment (no marker variable) and call setsid or setpgid (out of
the rank's process group), or outlive its rank. Such a process is still found:
- while its parent chain reaches a live rank, by that chain;
- once orphaned, by being re-parented to ranktop, which makes itself the subreaper of all it
  starts (`adopt_orphans`, called by the ranktop command); ranktop must then reap it when it exits;
- when its rank ends, by the rank's session and process group, looked at before the rank's ids
  can be reused.
As PID 1 (a container's command) ranktop adopts every orphan of the namespace, also those of
processes a person started with `kubectl exec`: an orphan counts as a rank's only if it is in a
rank's session or carries a group's marker; the rest are only reaped once they exit.
Each such process is told to the guard by pid and start time (so the guard can sweep it should
ranktop itself be SIGKILLed), and swept by ranktop at the end of the group with SIGTERM, the
grace, then SIGKILL, like the ranks (`Sweep`).
A restart of one rank sweeps what that rank left the same way, and only that: what was noted from
it (its group and session as it was reaped, its helpers below it as it was stopped) and what
carries its own marker (RANK_MARKER: the run's marker names the run, not the rank), with all
below these. Its group and session ids are not used once it is reaped: once they are empty the
rank's pid, and with it those ids, may belong to someone else.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from ranktop.core.guard import (
    GIVE_UP_SECONDS,
    Proc,
    carries_marker,
    descendants,
    find_strays,
    marked_pids,
    marker_needle,
    open_pidfd,
    process_table,
    rank_leading,
    read_proc,
    send_signal,
    spare_pid,
    thread_children,
    younger_than,
)

# Each rank's own marker, beside the run's (guard.MARKER): what a restart of that rank sweeps.
RANK_MARKER = "RANKTOP_RANK_TOKEN"

_PR_SET_CHILD_SUBREAPER = 36
# At most this often, a monitor pass looks for newly orphaned helpers, and at least this often
# while we adopt them: until then, a daemon that left its rank's group, session and environment
# is known to nobody, and would outlive a SIGKILLed ranktop.
LOOK_SECONDS = 0.1

# Looks in a row the end sweep takes while they find nothing but an orphan of the ranks is our child
# (StrayTracker.find); past them, that orphan is what it found, and its next pass looks again.
_SETTLE_LOOKS = 20

_adopting = False
_own_children: set[int] = set()  # the session leaders this process started itself: ranks, guards
# Our threads (native ids) that an orphan may be given to, besides the first (see orphan_parents).
_spawners: set[int] = set()
# Every rank this process started (its pid, which is its session's id -> its start time) and every
# group's marker: as PID 1, what an orphan came from.
_rank_sessions: dict[int, int] = {}
_markers: set[bytes] = set()
_tools = 0  # our own tools (py-spy, a pager) running now: each reaps its own child
_tools_lock = threading.Lock()


def adopt_orphans() -> bool:
    """Make this process the subreaper of everything it starts: a helper whose parent exits (a
    double fork, or its rank ended) is re-parented here instead of to init, so it stays in
    sight. For a process that runs one group at a time and starts no other session leaders of
    its own (the ranktop command): every child outside our session that we did not start
    ourselves is then an orphan from the ranks. Returns whether the kernel agreed."""
    global _adopting
    _adopting = prctl(_PR_SET_CHILD_SUBREAPER, 1)
    return _adopting


def prctl(option: int, value: int) -> bool:
    """Linux's prctl(option, value); whether the kernel agreed (False where there is none)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def note_own_child(pid: int) -> None:
    """`pid` is a child this thread started (a rank, a guard): not an orphan, and this thread
    may be given the orphans of its tree (see orphan_parents)."""
    _own_children.add(pid)
    _spawners.add(threading.get_native_id())


def forget_own_child(pid: int) -> None:
    _own_children.discard(pid)


def adopting() -> bool:
    """Whether this process is the subreaper of what its ranks leave behind."""
    return _adopting


@contextmanager
def own_tool() -> Iterator[None]:
    """Around starting and waiting for a tool of ours (py-spy, a pager): as PID 1 no child in our
    session is taken for an orphan meanwhile, so its exit status stays its caller's."""
    global _tools
    with _tools_lock:
        _tools += 1
    try:
        yield
    finally:
        with _tools_lock:
            _tools -= 1


def adopted_children() -> dict[int, Proc]:
    """Our children that we did not start (when adopting): orphans from the ranks' trees and, as
    PID 1, from anywhere in the namespace."""
    if not _adopting:
        return {}
    me, my_session = os.getpid(), os.getsid(0)
    found = {}
    for pid in orphan_candidates() - _own_children - {spare_pid()}:
        proc = read_proc(pid)
        # Our own tools run in our session; nothing from a rank can join it. As PID 1 whatever
        # enters the namespace from outside may share it (its id reads 0 where its leader is
        # outside): such orphans are ours to reap while no tool of ours runs (the count is read
        # after the child: a tool's child is forked after the count goes up, reaped before it drops).
        if proc is not None and proc.ppid == me and (proc.sid != my_session or (me == 1 and _tools == 0)):
            found[pid] = proc
    return found


def from_a_rank(pid: int, proc: Proc) -> bool:
    """Did this orphan come from a rank? Anything we adopt did, except as PID 1: there it must be
    in a rank's session (started after that rank, whose pid was not reused) or carry a marker."""
    if os.getpid() != 1:
        return True
    start = _rank_sessions.get(proc.sid)
    if start is not None and proc.start >= start:
        leader = read_proc(proc.sid)  # while its session has members, its id is not reused
        if leader is None or leader.start == start:
            return True
    return carries_marker(pid, _markers)


def children_of_self(*, note_spawners: bool = False) -> set[int]:
    """Every child of this process, whichever of its threads is the parent (`note_spawners`: each
    of them is looked at by orphan_candidates from now on). Out of descriptors (EMFILE), none: a
    monitor pass must go on, and the next look sees them."""
    try:
        tids = os.listdir("/proc/self/task")
        if note_spawners:
            _spawners.update(int(t) for t in tids)
        return _children_of(tids)
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN: read the whole table
        me = os.getpid()
        return {p.pid for p in process_table().values() if p.ppid == me}
    except OSError:
        return set()


def orphan_candidates() -> set[int]:
    """The children of the threads an orphan can be given to, what a monitor pass reads to adopt
    orphans: our first thread, where Linux gives a subreaper's orphans since 3.19 (and PID 1's,
    always), and each thread that started a child of ours, where older kernels gave the orphans
    of that child's tree. Reading every thread's file cost a listing of our threads and a read
    each, ten times a second. A thread of these that ended gave its children to another of ours:
    then every thread's are read, and every thread is one of these from then on."""
    me = os.getpid()
    spawners = tuple(_spawners)  # (a copy: another thread may start a child meanwhile)
    try:
        pids = _read_children(me)
    except FileNotFoundError:
        return children_of_self()  # no children files: the process table
    except OSError:  # out of descriptors (EMFILE): the next look sees them
        return set()
    for tid in spawners:
        if tid == me:
            continue
        try:
            pids |= _read_children(tid)
        except FileNotFoundError:  # the thread ended, and its children are elsewhere now
            _spawners.discard(tid)
            return pids | children_of_self(note_spawners=True)
        except OSError:
            pass  # (as above)
    return pids


def _children_of(tids: Iterable[str | int]) -> set[int]:
    """The children of these threads of ours (a thread that ended has none)."""
    pids: set[int] = set()
    for tid in tids:
        try:
            pids |= _read_children(int(tid))
        except FileNotFoundError:
            if int(tid) == os.getpid():
                raise  # no children files at all
        except OSError:
            pass  # (the next look sees the rest)
    return pids


def _read_children(tid: int) -> set[int]:
    """The children of our thread `tid`, from its /proc children file (the guard's plain-descriptor
    read: a file object cost twice as much, read ten times a second)."""
    return set(thread_children("self", tid))


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def rank_marker(token: str, local_rank: int) -> str:
    """The value of RANK_MARKER for one rank of the group marked `token`."""
    return f"{token}.{local_rank}"


def rank_needle(token: str, local_rank: int) -> bytes:
    """RANK_MARKER=value as it reads in /proc/PID/environ."""
    return f"{RANK_MARKER}={rank_marker(token, local_rank)}\0".encode()


def command_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return ""


class StrayTracker:
    """One group's ranks and the strays they left, kept by pid and start time, told to the guard
    as they are learnt. Not thread-safe: the context calls it under its lock."""

    def __init__(self, token: str, tell: Callable[[str], None], emit: Callable[..., None]):
        self.token = token
        self._tell = tell  # a line for the guard
        self._emit = emit  # an event for the run's log
        self.ranks: dict[int, int] = {}  # pid -> start time, until what it left was looked at
        self.known: dict[int, int] = {}  # strays: pid -> start time
        self._adopted: dict[int, int] = {}  # the orphans re-parented to us: pid -> start time
        self._not_ours: dict[int, int] = {}  # as PID 1, adopted orphans that came from no rank
        self._reaped: list[int] = []
        self._given_up: set[int] = set()  # ranks that outlived SIGKILL: the guard's, not the sweep's
        # What each rank (pid, start time) left, noted as it was stopped or reaped, until forgotten
        self._left: dict[tuple[int, int], dict[int, int]] = {}
        self.since: int | None = None  # the first rank's start (clock ticks since boot)
        self._looked_at = 0.0
        self._sessions: dict[int, int] = {}  # the ranks' sessions (pid -> start) this put in _rank_sessions
        _markers.add(marker_needle(token))

    def rank_started(self, pid: int) -> tuple[int, int]:
        """Take note of a rank just started; its (pid, start time), what it is known by."""
        if pid in self._reaped:  # the pid of a rank reaped a moment ago, reused: settle that one first
            self.look(force=True)
        proc = read_proc(pid)  # our unreaped child: its entry is there even if it already exited
        start = proc.start if proc is not None else 0
        self.since = start if self.since is None else min(self.since, start)
        self.ranks[pid] = start
        _rank_sessions[pid] = self._sessions[pid] = start
        self._tell(f"rank {pid} {start}")
        return pid, start

    def rank_reaped(self, pid: int) -> None:
        self._reaped.append(pid)

    def rank_given_up(self, pid: int) -> None:
        """The rank outlived SIGKILL (stuck in the kernel): the end sweep would only signal it
        again and wait as long once more; what it left is still swept."""
        self._given_up.add(pid)

    def note_below_ranks(self, pids: Iterable[int] | None = None) -> None:
        """Take note of everything below the live ranks now (or those of `pids`): their helpers
        that left the group with setsid. They are about to be stopped, and once their rank is
        gone nothing else leads to them where no subreaper adopts them."""
        live = [pid for pid in (self.ranks if pids is None else pids) if pid in self.ranks and pid not in self._reaped]
        if not live:
            return
        table = process_table()
        for rank in live:
            for pid in descendants(table, [rank]):
                proc = table[pid]
                if not proc.zombie and proc.pgid not in self.ranks:
                    self._note(pid, proc.start, (rank, self.ranks[rank]))

    def look(self, force: bool = False) -> dict[int, Proc] | None:
        """Cheap enough for every monitor pass: adopt newly orphaned helpers (reaping those that
        exited), and note what reaped ranks left in their group and session. Returns the process
        table when it read one (after the adoptions), for a caller that needs it too."""
        now = time.monotonic()
        if not force and now - self._looked_at < LOOK_SECONDS:
            return None
        self._looked_at = now
        for pid, proc in adopted_children().items():
            if proc.zombie:
                _reap(pid)  # ours to reap: nobody else will
                self._adopted.pop(pid, None)  # gone: a long run with many such orphans keeps no trace
                self._not_ours.pop(pid, None)
                self.known.pop(pid, None)
            elif proc.start not in (self._adopted.get(pid), self._not_ours.get(pid)):  # judged once
                self._adopt(pid, proc)
        if self._reaped:
            reaped = {pid: self.ranks[pid] for pid in self._reaped}
            table = process_table()
            found = find_strays(table, reaped, {}, skip=(os.getpid(),))
            for pid, start in found.items():
                self._note(pid, start, _left_by_which(pid, table, reaped, found))
            for pid in reaped:  # their ids may be reused from now on: the guard forgets them
                del self.ranks[pid]
                self._tell(f"gone {pid}")
            self._reaped.clear()
            return table
        return None

    def _adopt(self, pid: int, proc: Proc) -> None:
        if not from_a_rank(pid, proc):
            self._not_ours[pid] = proc.start  # only reaped: never noted, signalled or swept
            return
        self._adopted[pid] = proc.start
        self._note(pid, proc.start)
        self._emit("stray_adopted", pid=pid, command=command_of(pid))

    def find(self, with_marker: bool) -> dict[int, int]:
        """Every live process of the group (pid -> start time), for the end sweep. The marker
        scan reads the environment of every process as young as the run: the first look of a
        sweep is enough. Nothing found is taken as nothing left only where no orphan from the
        ranks is our child either: a helper that forks its successor and exits, again and again
        (a new pid each time, SIGTERM ignored), was often read alive by one look, gone from the
        table read after it, and its successor, already ours, in neither; the sweep then ended
        and it ran on for good. Every moment such a line has a child of ours, alive or not yet
        reaped, as an orphan's children are given to us before it is a zombie."""
        for _ in range(_SETTLE_LOOKS):
            found = self._find_once(with_marker)
            coming = {pid: proc.start for pid, proc in adopted_children().items() if from_a_rank(pid, proc)}
            if found or not coming:
                return found
        return coming  # not over: the sweep's next pass looks again

    def _find_once(self, with_marker: bool) -> dict[int, int]:
        table = self.look(force=True) or process_table()  # one read for both: on a busy host each is long
        # Only what started with or after the first rank can carry the marker.
        marked = marked_pids(self.token, younger_than(table, self.since or 0)) if with_marker else set()
        found = find_strays(table, self.ranks, self.known, marked, skip=(os.getpid(), *self._given_up))
        for pid, start in found.items():
            self._note(pid, start)
        return found

    def left_by(self, rank: tuple[int, int], needle: bytes, with_marker: bool) -> dict[int, int]:
        """What the rank (pid, start time), reaped or given up on, left running (pid -> start
        time): what was noted from it, what carries its own marker `needle`, and everything below
        these; never another rank. All it finds is noted: a helper's child is still found once the
        helper exits. The marker scan reads the environment of every process as young as the
        rank: the first look of a sweep is enough."""
        table = self.look(force=True) or process_table()  # (notes what its group and session hold, if just reaped)
        if with_marker:
            for pid in younger_than(table, rank[1]):
                if carries_marker(pid, (needle,)):
                    self._note(pid, table[pid].start, rank)
        skip = (os.getpid(), *self.ranks, *self._given_up)
        found = find_strays(table, {}, self._left.get(rank, {}), skip=skip)
        for pid, start in found.items():  # (what is below them too: it outlives them, orphaned)
            self._note(pid, start, rank)
        return found

    def forget_rank(self, rank: tuple[int, int]) -> None:
        """What the rank left has been swept: a rank started again and again keeps no trace."""
        self._left.pop(rank, None)
        self._forget_session(*rank)

    def close(self) -> None:
        """The group is over and swept: its ranks' sessions and its marker no longer tell where an
        orphan came from (as PID 1). A run restarted thousands of times kept every one of them."""
        for pid, start in list(self._sessions.items()):
            self._forget_session(pid, start)
        _markers.discard(marker_needle(self.token))

    def _forget_session(self, pid: int, start: int) -> None:
        if self._sessions.get(pid) != start:
            return  # a later rank of the same pid has the entries now: they go with it
        del self._sessions[pid]
        if _rank_sessions.get(pid) == start:
            del _rank_sessions[pid]

    def _note(self, pid: int, start: int, rank: tuple[int, int] | None = None) -> None:
        if rank is not None:
            self._left.setdefault(rank, {})[pid] = start
        if self.known.get(pid) != start and self.ranks.get(pid) != start:
            self.known[pid] = start
            self._tell(f"stray {pid} {start}")


def _left_by_which(pid: int, table: dict[int, Proc], ranks: dict[int, int],
                   found: dict[int, int]) -> tuple[int, int] | None:
    """Which of `ranks` (pid -> start time) left `pid`, one of `found` (what they left): the rank
    whose group or session it, or the nearest of its ancestors among them, is in. One pass over
    the process table finds what every rank reaped at once left (a group's end reaps them all)."""
    # A table read one entry at a time can hold a cycle of parents (A read with parent B; B exits
    # and its pid goes to a child of A before B is read). A `found` from the same table never
    # leads into one (each of it is a rank's or below one), but the walk is bounded all the same:
    # no walk is longer than what it may pass through.
    for _ in range(len(found)):
        if pid not in found:
            break
        proc = table[pid]
        if (leader := rank_leading(proc, ranks, table)) is not None:
            return leader, ranks[leader]
        pid = proc.ppid
    return None


def group_of(pid: int) -> int | None:
    """The process group of `pid`; None once it is gone."""
    try:
        return os.getpgid(pid)
    except OSError:
        return None


class Sweep:
    """Stopping what ranks left running as the ranks themselves are stopped: SIGTERM to each
    process as it is found, SIGKILL to what is left once the grace is over, and giving up
    GIVE_UP_SECONDS after that (what outlives SIGKILL is stuck in the kernel: the guard tries
    again once ranktop exits). Each process is known by pid and start time and signalled through
    a pidfd opened after checking both, so a reused pid is never signalled. One sweeps the
    group's end; one sweeps each rank a restart replaces. `emit` writes an event (its name, then
    its fields)."""

    def __init__(self, grace: float, emit: Callable[..., None]):
        self.grace = grace
        self.deadline: float | None = None  # set once something is found
        self._emit = emit
        self._sent: dict[tuple[int, int], int] = {}  # (pid, start) -> the last signal sent
        self._fds: dict[tuple[int, int], int] = {}
        self._looked_at: float | None = None  # the last step that found something

    def hurry(self, grace: float, now: float) -> None:
        """A stop with a shorter grace came: it holds here too."""
        self.grace = grace
        if self.deadline is not None:
            self.deadline = min(self.deadline, now + grace)

    def due(self, now: float) -> bool:
        """Whether a step should look now. Each look reads every process's /proc entry, and the
        monitor may pass many times a second while other ranks write: once something is
        found, at most every LOOK_SECONDS, and at the SIGKILL and the giving up."""
        if self._looked_at is None:
            return True
        return now - self._looked_at >= LOOK_SECONDS or self._next_moment(self._looked_at) <= now

    def step(self, found: dict[int, int], now: float, groups_stopping: set[int]) -> bool:
        """One pass over what is `found` now (pid -> start time); True once nothing is left (or
        what is left would not die of SIGKILL either). A process in one of `groups_stopping` (a
        rank's group a stop has just signalled) is within that stop's grace, whose SIGKILL is on
        its way: a second SIGTERM would re-enter its handler."""
        for key in set(self._fds) - set(found.items()):
            os.close(self._fds.pop(key))
        if not found:
            return True
        self._looked_at = now
        if self.deadline is None:
            self.deadline = now + self.grace
            self._emit("strays_stopping", pids=sorted(found), grace=self.grace)
        if now > self.deadline + GIVE_UP_SECONDS:
            self._emit("strays_left", pids=sorted(found))
            return True
        sig = signal.SIGKILL if now >= self.deadline else signal.SIGTERM
        fresh = [key for key in found.items() if self._sent.get(key) != sig]
        if sig == signal.SIGTERM:
            for key in [key for key in fresh if group_of(key[0]) in groups_stopping]:
                self._sent[key] = sig
                fresh.remove(key)
        if sig == signal.SIGKILL and fresh:
            self._emit("strays_killed", pids=sorted(pid for pid, _ in fresh))
        for key in fresh:
            self._sent[key] = sig
            self._signal(key, sig)
        return False

    def _signal(self, key: tuple[int, int], sig: int) -> None:
        if key not in self._fds:
            # None: gone, its pid names another process now, no pidfds, or no descriptor to spare
            # (hundreds of strays under a low `ulimit -n`): send_signal then goes by pid.
            fd = open_pidfd(*key)
            if fd is not None:
                self._fds[key] = fd
        send_signal(*key, sig, self._fds.get(key))

    def take_over(self, other: Sweep) -> None:
        """Go on with what `other` began (a rank's, overtaken by the group's stop): what it sent
        is not sent again, and its descriptors are ours to close."""
        self._sent.update(other._sent)
        for key, fd in other._fds.items():
            if key in self._fds:
                os.close(fd)
            else:
                self._fds[key] = fd
        other._fds = {}

    def wake_at(self, now: float) -> float | None:
        """When the monitor should pass again for this sweep: its next look, or sooner the
        SIGKILL or the giving up. (Its pidfds are not polled: one stays readable from its
        process's exit until a look closes it, and woke the monitor pass after pass until then.)"""
        if self._looked_at is None:
            return None
        return min(self._looked_at + LOOK_SECONDS, self._next_moment(now))

    def _next_moment(self, after: float) -> float:
        """The SIGKILL, or once that is past the giving up (the deadline is set)."""
        return self.deadline if after < self.deadline else self.deadline + GIVE_UP_SECONDS

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
