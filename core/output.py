"""Rank output: pipes read in large chunks by one thread, every byte to the log files, a ring of
recent lines for the UI, and an optional prefixed tee to the console.

The hot path works on whole chunks with bytes methods (split/join run in C); nothing here looks
at a line in Python unless the chunk holds a carriage return.
"""

from __future__ import annotations

import collections
import fcntl
import functools
import itertools
import os
import queue
import re
import select
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import BinaryIO

from ranktop.core.errors import UsageError
from ranktop.core.guard import status_fields
from ranktop.core.limits import SECONDS
from ranktop.core.packing import PackedChunk, pack, packer, tail_after_newline, unpacked
from ranktop.core.sanitize import quoted, unfinished_tail

Buffer = bytes | memoryview  # what a console write takes: a memoryview spares a copy

_READ_SIZE = 1 << 20  # one buffer, reused: os.read(fd, 1 MiB) would map and unmap 1 MiB per read
# While a pipe fills fast, read rounds start this often: a round takes many writes from every pipe
# at once (the 1 MiB pipes hold far more than 5 ms of output). While no pipe comes back more than
# _PRESSING full, the pause doubles up to _IDLE_SECONDS, the longest that output waits to be read:
# a trickle (a TUI's 8 ranks x 1000 lines/s) costs a round every 100 ms, not every 5 ms. 100 ms is
# also how often torchrun's tee reads the log files it tails.
_ROUND_SECONDS = 0.005
_IDLE_SECONDS = 0.1
_PRESSING = 0.25  # of a pipe's capacity: doubling the pause keeps such a pipe at most half full
# Quiet this long (no pipe had anything, none was added), the thread polls the pipes instead of
# reading them in rounds. A pipe once polled costs each later write into it ~0.1 us of the
# writer's system time (see OutputPump): a rank that writes without a break never pays it.
_QUIET_SECONDS = 1.0
_TTY_ROOM = 16 << 10  # what a pty holds before its writer waits, roughly (the kernel's buffers)
_TTY_FULL = _TTY_ROOM // 2  # read in one round from a pty: its writer likely waits on us (a raw pty held 11.5 KiB)
_PIPE_SIZE = 1 << 20  # ask the kernel for 1 MiB pipes: fewer wake-ups, ranks block less
_FULL_PIPE = 64 << 10  # what a pipe holds when it could not be widened (over the user's budget)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)

STDOUT, STDERR = 1, 2
MADE = 0  # a ring's entry of lines it had made, packed again: complete lines of either stream


class RanktopLine(bytes):
    """A line ranktop itself adds to a rank's output (a restart's separator), never one the rank
    printed: the type says so, out of band, whatever its bytes. A rank can print the same bytes in
    the same colours; the pane draws these where no rank output reaches (tui/logview.py), search
    and copy leave them out, and the engine's protocol marks them for its clients."""

    __slots__ = ()


_PIPE_BUDGET_SHARE = 2  # we take at most 1/2 of the user's pipe budget: their other pipes need room
_widened_lock = threading.Lock()
_widened: set[int] = set()  # our descriptors of pipes we asked 1 MiB for (each counts _PIPE_SIZE)


# The kernel exempts a process from the per-user pipe limits for CAP_SYS_RESOURCE or CAP_SYS_ADMIN
# (pipe_is_unprivileged_user), not for being root: root in a container (Docker's, a pod's) has
# neither, and its pipes count against a budget every root process on the host shares.
_PIPE_EXEMPTING_CAPS = (1 << 24) | (1 << 21)  # CAP_SYS_RESOURCE, CAP_SYS_ADMIN
# The kernel asks for them in the initial user namespace (capable()), whose /proc/PID/ns/user has
# this inode (PROC_USER_INIT_INO). CapEff says what we hold in our own: root of a user namespace
# (rootless podman, a pod with hostUsers: false, apptainer --fakeroot) holds every capability there.
_INITIAL_USER_NS_INODE = 0xEFFFFFFD


@functools.cache  # (read once: a launch of 128 ranks asks for 256 pipes)
def exempt_from_pipe_limits() -> bool:
    """Whether our effective capabilities free us from the per-user pipe limits."""
    if not _in_initial_user_namespace():  # (whatever CapEff says: the kernel counts none of it)
        return False
    try:
        caps = status_fields("/proc/self/status", ("CapEff",)).get("CapEff")
        if caps is not None:
            return bool(int(caps, 16) & _PIPE_EXEMPTING_CAPS)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0  # nothing says: root usually holds them


def _in_initial_user_namespace() -> bool:
    try:
        return os.stat("/proc/self/ns/user").st_ino == _INITIAL_USER_NS_INODE
    except OSError:  # a kernel without user namespaces (or no /proc): there is only the one
        return True


def pipe_budget() -> int | None:
    """Bytes of pipe buffers this user may hold before the kernel shrinks new pipes to two pages
    (/proc/sys/fs/pipe-user-pages-soft); None when there is no such limit for us (see
    exempt_from_pipe_limits: root without those capabilities has one)."""
    if exempt_from_pipe_limits():
        return None
    try:
        with open("/proc/sys/fs/pipe-user-pages-soft") as f:
            pages = int(f.read())
    except (OSError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") if pages else None


def widen_pipe(fd: int, budget: int | None = None) -> bool:
    """Ask for a 1 MiB buffer on the pipe `fd` if that stays within our share of `budget`
    (the user's pipe budget, `pipe_budget()` when None); True if it was granted. `release_pipe(fd)`
    gives the share back when the pipe is closed."""
    budget = pipe_budget() if budget is None else budget
    with _widened_lock:
        if budget is not None and (len(_widened) + 1) * _PIPE_SIZE > budget // _PIPE_BUDGET_SHARE:
            return False  # the default 64 KiB pipe: slower, but the user's other pipes keep theirs
        try:
            fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_SIZE)
        except OSError:
            return False  # over /proc/sys/fs/pipe-max-size for unprivileged users: keep the default
        _widened.add(fd)
        return True


def _capacity(fd: int) -> int:
    """Bytes the pipe `fd` holds before its writer waits (any other descriptor: a pipe's default)."""
    try:
        return fcntl.fcntl(fd, _F_GETPIPE_SZ)
    except OSError:  # not a pipe (a file a test hands us, say)
        return _FULL_PIPE


def next_pause(pause: float, fill: float, busy: float) -> float:
    """The read thread's sleep before its next round, after a round of `busy` seconds that found
    its fullest pipe `fill` full (a share of its capacity) and followed a sleep of `pause`. While a
    pipe fills fast, rounds start every _ROUND_SECONDS (a round takes what every pipe gathered
    meanwhile); otherwise the pause doubles up to _IDLE_SECONDS, so a trickle or idle ranks cost
    little and a pipe that was under _PRESSING full stays under twice that."""
    if fill >= _PRESSING:
        return max(0.0, _ROUND_SECONDS - busy)
    return min(_IDLE_SECONDS, max(2 * pause, _ROUND_SECONDS))


def release_pipe(fd: int) -> None:
    with _widened_lock:
        _widened.discard(fd)


def collapse_cr(line: bytes) -> bytes:
    """What a terminal would show for a line redrawn with '\\r': its last non-empty state."""
    parts = [p for p in line.split(b"\r") if p]
    return parts[-1] if parts else b""


LINE_CAP = 64 << 10  # bytes of one line the ring keeps (its head); the log files keep it whole
PROMPT_SECONDS = 0.2  # a line begun and left this long is shown as it is: a prompt waits on it
RING_BYTES = 8 << 20  # bytes of output the ring keeps per rank, besides the line count
_FEW_LINES = 16  # a chunk with no more lines than this costs little to make into lines
# Small reads of one stream are gathered into blocks of up to this many bytes: a rank printing a
# line at a time would otherwise leave ~100k chunks in the byte budget, which the first look at
# it (`ranktop attach` of a long run) has to walk.
_BLOCK = 64 << 10
# Chunks the ring keeps before it makes the oldest into lines, whatever their bytes: tiny writes
# that alternate between stdout and stderr cannot be gathered, and each costs ~100 bytes of
# Python objects that the byte budget does not see (1-byte chunks would reach ~1 GB in 8 MiB).
_MAX_CHUNKS = 4096
_TURNOVER = 4  # output packed lives at least about this many of the packer's looks (core/packing.py)
# The packer's looks that lines made again from the packed lines wait, at most, before they are
# packed again: they wait twice as long each time. A client following a rank that prints a line
# every few seconds had them all made again at each line, and packed again before the next; so did
# a ring at its byte budget, whose next chunk made them all to let the oldest go (a rank of 1 KB
# lines, one every 3 s after a look had made them: 8 MB packed and unpacked every 7 s, for good).
_MADE_AGAIN_WAIT = 32


def count_newlines(data: bytes) -> int:
    """How many b"\n" `data` holds. Not `data.count(b"\n")`: CPython counts one byte with a plain
    loop (~2 GB/s here), while `replace` finds it with memchr and copies the rest in runs: twice
    as fast on log lines even with the copy."""
    return len(data) - len(data.replace(b"\n", b""))


def cut_line(line: bytes, length: int | None = None) -> bytes:
    """The head of an over-long line with a note of its full `length`; short lines as they are."""
    length = len(line) if length is None else length
    if length <= LINE_CAP:
        return line
    return line[:LINE_CAP] + f" \u2026 [ranktop: line cut, {length:,} bytes; the log file has it all]".encode()


_CUT_NOTE = re.compile(rb" \xe2\x80\xa6 \[ranktop: line cut, ([0-9,]+) bytes; the log file has it all\]$")


def _fewer_redraws(piece: bytes) -> bytes:
    """`piece` of a line with the redraws between its first '\\r' and its last cut down to the
    last that was not empty: an OpenLine shows the same of it (the text before the first '\\r'
    goes on the line so far, and that last state shows while the text after the last is empty),
    without a step in Python per redraw (a progress bar redrawn for hours with no newline)."""
    head, _, rest = piece.partition(b"\r")
    between, last_cr, last = rest.rpartition(b"\r")
    if not last_cr:  # one '\r' at most: nothing between
        return piece
    between = between.rstrip(b"\r")
    return b"\r".join((head, between[between.rfind(b"\r") + 1 :], last))


def line_length(line: bytes) -> int:
    """How long a ring line was when it was printed, before `cut_line` cut it."""
    if len(line) > LINE_CAP and (note := _CUT_NOTE.search(line, LINE_CAP)):
        return int(note.group(1).replace(b",", b""))
    return len(line)


class OpenLine:
    """The unfinished last line of one stream, in bounded memory and linear time however long it
    grows: what a terminal would show of it (the text after its last '\r', or the last non-empty
    state before that) is kept up to LINE_CAP bytes, with the true lengths."""

    def __init__(self) -> None:
        self.current = bytearray()  # head of the text since the last '\r'
        self.current_len = 0
        self.shown_before = b""  # the last non-empty state before that '\r', already cut
        self.length = 0  # bytes of the whole line, '\r's included

    def copy(self) -> OpenLine:
        """Another OpenLine where this one stands, that adding to changes this one in nothing."""
        other = OpenLine()
        other.current, other.current_len = bytearray(self.current), self.current_len
        other.shown_before, other.length = self.shown_before, self.length
        return other

    def add(self, piece: bytes) -> None:
        self.length += len(piece)
        segments = piece.split(b"\r") if b"\r" in piece else (piece,)
        self._extend(segments[0])
        for segment in segments[1:]:
            if self.current_len:
                self.shown_before = self.state()
            self.current, self.current_len = bytearray(), 0
            self._extend(segment)

    def _extend(self, segment: bytes) -> None:
        room = LINE_CAP - len(self.current)
        if room > 0:
            self.current += segment[:room]
        self.current_len += len(segment)

    def state(self) -> bytes:
        """The line as shown: '\r' collapsed, cut at LINE_CAP with a note."""
        if not self.current_len:
            return self.shown_before
        return cut_line(bytes(self.current), self.current_len)

    def finish(self, last: bytes) -> bytes:
        """The complete line once `last` (its text up to the newline) came; the line starts over."""
        if not self.length and b"\r" not in last:
            return cut_line(last)  # the usual case: the line came whole in one chunk
        self.add(last)
        line = self.state()
        self.__init__()
        return line


def _unheld_after_own(lines: collections.deque[bytes]) -> int:
    """How many of the newest `lines`, those after the last of ranktop's own (a RanktopLine), may
    be packed again: all of them where nothing besides `lines` holds any, else none. A TUI's pane
    keeps every line it is given; a hidden one asks for no more, and holds only the older lines
    where another view's look made newer ones. Walked from the newest: a shown pane holds that one.
    The interpreter shares b"" and one-byte objects: a line longer than that is counted, and
    where there is none, they count as held."""
    once, count, counted = _refs_when_held_once(), 0, False
    for line in reversed(lines):
        if type(line) is RanktopLine:
            break
        if len(line) > 1:
            if sys.getrefcount(line) > once:
                return 0
            counted = True
        count += 1
    return count if counted else 0


@functools.cache
def _refs_when_held_once() -> int:
    """sys.getrefcount of an object held by one deque alone, seen as _unheld_after_own sees it
    (the count differs between Python versions)."""
    held = collections.deque([os.urandom(8) + b"held"])
    for line in held:
        return sys.getrefcount(line)
    return 0


def as_shown(line: bytes) -> bytes:
    """A complete line as the ring keeps it (and a pane shows it): '\r' collapsed, cut at LINE_CAP."""
    return cut_line(collapse_cr(line) if b"\r" in line else line)


class LineRing:
    """The recent output of one rank (both streams, in arrival order) as lines, plus the
    unfinished last line of each stream. Written by the reader thread, read by UIs from any thread.

    The reader only appends the chunk as read (and counts its newlines, in C): lines are made
    only when someone asks (`tail`, `since`), so a run nobody watches pays nothing per line.
    Bounded by `max_bytes` bytes (chunks waiting and lines together) and `maxlen` lines; a line
    is kept up to LINE_CAP bytes."""

    def __init__(self, maxlen: int = 10_000, max_bytes: int = RING_BYTES):
        self.maxlen = maxlen
        self.max_bytes = max_bytes
        self._next_seq = 0  # the number of the next entry of _chunks: each counts once, as it comes
        self._lines_stamp = 0  # bumped whenever self.lines changes, or a look hands them out (its view may keep them)
        self._empty()
        self._block = min(_BLOCK, max_bytes // 8)  # a block is dropped whole: a small part of the budget
        self.version = 0  # bumped per chunk: UIs repaint only when it moved
        self.total_lines = 0  # newlines ever fed: line k is the k-th complete line
        self.last_output_at: float | None = None
        self._open_asked: tuple[int, bytes | None] = (-1, None)  # (version, open_line()'s answer then)
        self._pack_due = False  # the packer will look: output came, or lines were made, since it found nothing to pack
        self._pack_from = 0  # the entries numbered below were packed, or found not worth it
        self._looked = (0, 0)  # (_next_seq, version) at the packer's previous look
        self._fed_since_look = 0  # bytes fed since the packer's previous look
        self._lines_seen = self._lines_done = 0  # its stamp at the packer's previous look / when it last judged them
        self._steady_looks = 0  # the packer's looks in a row that found the stamp as it was
        self._made_wait = 1  # steady looks made lines wait before they are packed again (doubled when made again)
        self._lock = threading.Lock()

    def _empty(self) -> None:
        """Nothing kept: no lines, no chunks, no open lines."""
        self.lines: collections.deque[bytes] = collections.deque()
        self.bytes = 0  # of the complete lines made so far and kept
        self._lines_stamp += 1
        self.partial = {STDOUT: OpenLine(), STDERR: OpenLine()}
        # Not made into lines yet: [stream, chunk or gathered block, its newlines], counted once as it came.
        self._chunks: collections.deque[list] = collections.deque()
        self._chunk_bytes = 0
        self._chunk_newlines = 0
        self._last_stream = STDOUT  # of the chunk last made into lines (the newest waits in _chunks)

    def feed(self, stream: int, chunk: bytes, newlines: int | None = None) -> None:
        """Keep `chunk` of `stream`; `newlines` is how many it holds, when the caller knows."""
        if newlines is None:
            newlines = count_newlines(chunk)
        with self._lock:
            last = self._chunks[-1] if self._chunks else None
            if (last is not None and last[0] == stream and len(last[1]) + len(chunk) <= self._block
                    and not isinstance(last[1], PackedChunk)):
                if not isinstance(last[1], bytearray):
                    last[1] = bytearray(last[1])
                last[1] += chunk
                last[2] += newlines
                self._pack_from = min(self._pack_from, self._next_seq - 1)  # (found not worth packing, it grew)
            else:
                self._chunks.append([stream, chunk, newlines])
                self._next_seq += 1
            self._chunk_bytes += len(chunk)
            self._chunk_newlines += newlines
            self._fed_since_look += len(chunk)
            self.total_lines += newlines
            self._fit()
            self.version += 1
            self.last_output_at = time.time()
            wake, self._pack_due = not self._pack_due, True
        if wake:
            packer().wake(self)

    def _fit(self) -> None:
        """Back within `max_bytes` and `maxlen`. A chunk goes, unsplit, as soon as the newer ones
        hold `maxlen` lines: its lines would leave as soon as made. So a rank of short lines keeps
        about `maxlen` lines' worth of chunks, not the whole byte budget (8 ranks x 8 MiB of fresh
        memory cost the reader ~20k page faults per 170 MB), and a first look at a long run's rank
        (`ranktop attach`) splits only what it shows. Over the byte budget the oldest chunks go
        first (those of a few lines, a long line among them, are made into lines, which are short
        once cut), then the oldest lines; so do the oldest chunks beyond _MAX_CHUNKS."""
        while len(self._chunks) > 1 and self._chunk_newlines - self._chunks[0][2] >= self.maxlen:
            stream, chunk, _ = self._pop_chunk()
            self._skip(stream, chunk)
        while (self._chunk_bytes > self.max_bytes or len(self._chunks) > _MAX_CHUNKS) and len(self._chunks) > 1:
            stream, chunk, newlines = self._pop_chunk()
            if newlines <= _FEW_LINES or stream == MADE:  # (made lines go one by one, as they did made)
                self._make(stream, chunk)
            else:
                self._skip(stream, chunk)
        while self._chunk_bytes + self.bytes > self.max_bytes and self.lines:
            self.bytes -= len(self.lines.popleft())
            self._lines_stamp += 1

    def _pop_chunk(self) -> tuple[int, bytes | bytearray | PackedChunk, int]:
        stream, chunk, newlines = self._chunks.popleft()
        self._chunk_bytes -= len(chunk)
        self._chunk_newlines -= newlines
        return stream, chunk, newlines

    def _skip(self, stream: int, chunk: bytes | bytearray | PackedChunk) -> None:
        """Drop a chunk that waited too long to be made into lines: its lines would have left
        the ring by now, and so did every line before it. Only the open line carries over."""
        self.lines.clear()
        self.bytes = 0
        self._lines_stamp += 1
        if stream == MADE:
            return
        ends_line, tail = tail_after_newline(chunk)
        open_line = self.partial[stream]
        if ends_line:
            open_line.__init__()
        open_line.add(tail)

    def _make_lines(self) -> None:
        if self._chunks and not self._pack_due:  # lines made for a look: the packer sees whether they stay
            self._pack_due = True
            packer().wake(self)  # (the packer never waits on a ring's lock while it holds its own)
        while self._chunks:
            stream, chunk, _ = self._pop_chunk()
            self._make(stream, chunk)
            if stream != MADE:
                self._last_stream = stream

    def _make(self, stream: int, chunk: bytes | bytearray | PackedChunk) -> None:
        chunk = unpacked(chunk)
        if stream == MADE:  # lines as they were made: nothing of an open line in them
            self._keep(chunk.split(b"\n")[:-1])
            # Made again, by a look or by _fit letting the oldest go: they wait longer (_MADE_AGAIN_WAIT).
            self._made_wait = min(2 * self._made_wait, _MADE_AGAIN_WAIT)
            return
        pieces = bytes(chunk).split(b"\n")  # a gathered block is a bytearray: lines are bytes
        open_line = self.partial[stream]
        if len(pieces) == 1:
            open_line.add(chunk)
            return
        first = open_line.finish(pieces[0])
        open_line.add(pieces.pop())
        if b"\r" in chunk or max(map(len, pieces)) > LINE_CAP:
            pieces = [as_shown(p) for p in pieces]
        pieces[0] = first
        self._keep(pieces)

    def _keep(self, lines: list[bytes]) -> None:
        self._lines_stamp += 1
        self.lines.extend(lines)
        self.bytes += sum(map(len, lines))
        while len(self.lines) > self.maxlen or self.bytes > self.max_bytes:
            self.bytes -= len(self.lines.popleft())

    def add_own_line(self, text: str) -> None:
        """A line of ranktop's own (a RanktopLine) after everything fed so far. The open lines
        end before it: their process is gone, and the next one's output starts a line of its own."""
        with self._lock:
            self._make_lines()
            ended = [p.finish(b"") for p in self.partial.values() if p.state()]
            for open_line in self.partial.values():
                open_line.__init__()
            self._keep([*ended, RanktopLine(text.encode())])
            self.total_lines += len(ended) + 1
            self.version += 1

    def touch(self) -> None:
        """The rank wrote, though its output is no longer kept here (its sink failed)."""
        self.last_output_at = time.time()

    def pack(self) -> tuple[bool, int]:
        """Compress the waiting chunks that were here at the previous call and did not change
        since, and the lines made for a look that nothing else keeps (_made_lines_to_pack);
        core/packing.py's thread calls this every PACK_SECONDS while output comes or lines are
        made. Whether any are left for a later call, and the bytes of memory it saved. zlib works
        outside the lock: only a chunk that nothing can add to any more is packed there (the
        newest is copied first), and it replaces the chunk only if that is still where it was."""
        with self._lock:
            chosen = [] if self._turning_over() else self._chunks_to_pack()
            made = self._made_lines_to_pack()
            looked_seq, _ = self._looked = (self._next_seq, self.version)
            self._fed_since_look = 0
            self._pack_due = self._pack_from < looked_seq or (bool(self.lines) and self._lines_done != self._lines_stamp)
            more = self._pack_due
        packed = [(entry, raw, pack(raw)) for entry, raw in chosen]
        saved = 0
        with self._lock:
            for entry, raw, done in packed:
                if done is not None and entry[1] is raw:
                    entry[1] = done
                    saved += len(raw) - done.stored
        if made is not None:
            saved_made = self._pack_made_lines(*made)
            more = more or saved_made is None
            saved += saved_made or 0
        return more, saved

    def _made_lines_to_pack(self) -> tuple[int, list[bytes]] | None:
        """The lines made so far, to pack again (as one MADE entry before the waiting chunks),
        with their stamp: where they stayed as they are for a whole look and no view holds them.
        A client's look at a served run made them, and they stayed as objects after it left
        (walking 64 quiet ranks took their engine from 31 to 99 MB for good); a TUI's pane keeps
        the very objects it was given, and packed they would be kept twice. A line of ranktop's own
        (RanktopLine) would lose its type: only the lines after the last are packed. Lock held."""
        stamp = self._lines_stamp
        self._steady_looks = self._steady_looks + 1 if self._lines_seen == stamp else 0
        self._lines_seen = stamp
        if not self.lines or self._lines_done == stamp or self._steady_looks < self._made_wait:
            return None
        self._lines_done = stamp
        count = _unheld_after_own(self.lines)
        return (stamp, list(itertools.islice(self.lines, len(self.lines) - count, None))) if count else None

    def _pack_made_lines(self, stamp: int, lines: list[bytes]) -> int | None:
        """Pack `lines` (made at `stamp`) outside the lock; in their place if none changed since,
        nor was handed out (None where one was: they are judged again). The bytes of memory it saved."""
        count, size = len(lines), sum(map(len, lines))
        done = pack(b"\n".join(lines) + b"\n", size)  # (sized as the lines were counted, newlines left out)
        del lines
        with self._lock:
            if self._lines_stamp != stamp:
                return None
            if done is None:
                return 0
            self._put_made_first(done, count)
            for _ in range(count):  # (the newest: those before a line of ranktop's own stay)
                self.lines.pop()
            self.bytes -= size
            self._lines_stamp += 1
            self._lines_done = self._lines_stamp
        return size - done.stored

    def _put_made_first(self, made: PackedChunk, count: int) -> None:
        """`made`, `count` lines made and packed again, to wait first, before the chunks. Lock held."""
        self._chunks.appendleft([MADE, made, count])
        self._chunk_bytes += len(made)
        self._chunk_newlines += count

    def _made_newlines(self) -> int:
        """The lines of the made lines packed again that wait (first, where any do). Lock held."""
        return self._chunks[0][2] if self._chunks and self._chunks[0][0] == MADE else 0

    def _make_open_lines(self) -> None:
        """Make the waiting chunks where they hold no newline (they only go on the open lines)
        but for made lines packed again, first: those stay as they wait. Lock held."""
        made = self._pop_chunk() if self._made_newlines() else None
        self._make_lines()
        if made is not None:
            self._put_made_first(made[1], made[2])

    def _turning_over(self) -> bool:
        """Whether more came since the previous look than a quarter of what the ring holds: what
        it holds leaves within a few looks, so packing it would be mostly wasted (a rank writing
        MBs a second of long lines would have every byte packed, then dropped). Lock held."""
        return self._fed_since_look * _TURNOVER > self.held_bytes

    def _chunks_to_pack(self) -> list[tuple[list, bytes | bytearray]]:
        """The entries pack() compresses now, each with its chunk as it is; the rest of them are
        not looked at again. Lock held."""
        looked_seq, looked_version = self._looked
        end = looked_seq if looked_version == self.version else min(looked_seq, self._next_seq - 1)
        first = self._next_seq - len(self._chunks)  # the number of _chunks[0] (made lines packed again take the one before)
        start = self._pack_from = max(self._pack_from, first)  # (those gone count as done)
        if end <= start:
            return []
        self._pack_from = end
        chosen = []
        for seq, entry in enumerate(itertools.islice(self._chunks, start - first, end - first), start):
            if isinstance(entry[1], PackedChunk):
                continue
            if seq == self._next_seq - 1 and isinstance(entry[1], bytearray):
                entry[1] = bytes(entry[1])  # the newest: feed() would add to it while zlib reads it
            chosen.append((entry, entry[1]))
        return chosen

    @property
    def stored_bytes(self) -> int:
        """Bytes of memory the ring's output takes: its lines, its waiting chunks as they are kept."""
        with self._lock:
            return self.bytes + sum(c.stored if isinstance(c, PackedChunk) else len(c) for _, c, _ in self._chunks)

    @property
    def held_bytes(self) -> int:
        """Bytes of output the ring holds: its lines and the chunks not made into lines yet."""
        return self.bytes + self._chunk_bytes

    def _open_lines(self) -> list[bytes]:
        return [line for line in (p.state() for p in self.partial.values()) if line]

    def clear(self) -> None:
        """Let go of everything kept (the attempt is over and replaced; its log files have it)."""
        with self._lock:
            self._empty()
            self.version += 1

    def tail(self, n: int | None = None) -> list[bytes]:
        """The last n lines (all kept lines when None), unfinished ones last, '\\r' collapsed."""
        with self._lock:
            self._make_lines()
            lines = list(self.lines)
            self._lines_stamp += 1  # (handed out: not packed again before the packer sees whether they are kept)
            lines.extend(self._open_lines())
        return lines if n is None else lines[-n:]

    def open_line(self) -> bytes | None:
        """The unfinished line of the stream that wrote last, '\\r' collapsed; None when that
        stream's output ended a line. Asked of every quiet rank at each snapshot (4 a second in
        a TUI, 20 for an attached view, each second of a stall's watch), so nothing is made into
        lines for it, and it is worked out once for each version of the ring's output: making
        the waiting chunks into lines (as `tail` does) turned every line of a quiet rank nobody
        watched into a Python object, 1.6x its bytes (64 quiet ranks of 10k lines: a TUI of 160
        MB against 97), and it did so wherever the newest chunk held no newline: a prompt, a
        progress bar, `print(..., end="")`, on either stream."""
        with self._lock:
            if self._open_asked[0] != self.version:
                self._open_asked = (self.version, self._open_line_now())
            return self._open_asked[1]

    def _open_line_now(self) -> bytes | None:
        """open_line's answer, from the chunks still waiting (none made into lines). Lock held."""
        stream = self._chunks[-1][0] if self._chunks else MADE
        if stream == MADE:  # (made lines packed again come first: then only they wait)
            stream = self._last_stream
        return self._open_before(stream, len(self._chunks)).state() or None

    def _open_before(self, stream: int, end: int) -> OpenLine:
        """The open line of `stream` as making the chunks before the `end`-th that wait would leave
        it, none made: its text since its last newline there, on top of its open line as made so
        far where none of them holds one. Lock held."""
        since_newline, line = [], None
        for chunk_stream, chunk, _ in itertools.islice(reversed(self._chunks), len(self._chunks) - end, None):
            if chunk_stream != stream:
                continue
            ends_line, tail = tail_after_newline(chunk)
            since_newline.append(tail)
            if ends_line:
                line = OpenLine()
                break
        if line is None:
            line = self.partial[stream].copy()
        line.add(_fewer_redraws(b"".join(reversed(since_newline))))
        return line

    def since(self, seen: int, tail: int | None = None) -> tuple[int, int, list[bytes], list[bytes]]:
        """For UIs that keep their own copy: (version, total_lines, the complete lines numbered
        `seen` and up that are still kept, at most the last `tail` of them, the open lines with
        '\r' collapsed). Line k is the k-th complete line ever fed; only the new lines are copied,
        not the whole ring. The newest `tail` (a pane's first look, an attached view's look ahead
        at every rank) are made from the chunks that hold them, the ring's own left as they wait:
        making them all kept every line of a rank looked at once as a Python object, 1.6x its
        bytes (`ranktop attach` to 64 quiet ranks of 10k lines: an engine of 148 MB against 72)."""
        with self._lock:
            if self.total_lines <= seen:  # nothing new (a quiet rank's next look): nothing made for it
                if self._chunk_newlines == self._made_newlines():
                    # What waits only goes on the open lines (a progress bar redrawn without a
                    # newline): made, it makes no line, and the next look does not read it again
                    # from where the line began (up to the byte budget, at every frame of a pane).
                    self._make_open_lines()
                    return self.version, self.total_lines, [], self._open_lines()
                return self.version, self.total_lines, [], self._open_lines_aside()
            if tail is not None and (newest := self._newest_made_aside(seen, tail)) is not None:
                return newest
            self._make_lines()
            kept = len(self.lines) if tail is None else min(tail, len(self.lines))
            count = max(0, min(self.total_lines - seen, kept))
            new = list(itertools.islice(reversed(self.lines), count))
            self._lines_stamp += bool(count)  # (handed out, as in tail())
            open_lines = self._open_lines()
            version, total = self.version, self.total_lines
        new.reverse()
        return version, total, new, open_lines

    def _open_lines_aside(self) -> list[bytes]:
        """The open lines since() gives, made aside (none of the waiting chunks made). Lock held."""
        ends = [self._open_before(stream, len(self._chunks)).state() for stream in self.partial]
        return [line for line in ends if line]

    def _newest_made_aside(self, seen: int, tail: int) -> tuple[int, int, list[bytes], list[bytes]] | None:
        """since(seen, tail)'s answer, made by a ring of its own from the newest chunks that hold
        `tail` lines, each stream's line before them as making the rest would leave it; this
        ring's lines and chunks as they were. None where fewer lines wait (making them costs
        little). Lock held."""
        want = min(tail, self.maxlen, self.total_lines - seen)  # (the newest `want`: all since() returns)
        if not want or self._chunk_newlines < want:
            return None
        first, newlines = len(self._chunks), 0
        while newlines < want:  # (the chunks' newlines were counted as they came)
            first -= 1
            newlines += self._chunks[first][2]
        aside = LineRing(want, self.max_bytes)  # keeps the newest `want` within the byte budget, as this one would
        aside.partial = {stream: self._open_before(stream, first) for stream in self.partial}
        for stream, chunk, _ in itertools.islice(self._chunks, first, None):
            aside._make(stream, chunk)
        count = max(0, min(self.total_lines - seen, len(aside.lines)))
        new = list(itertools.islice(aside.lines, len(aside.lines) - count, None))
        return self.version, self.total_lines, new, aside._open_lines()


class _Gap:
    """Console output of one rank dropped in a row: a note in the queue at the place it went."""

    def __init__(self, prefix: bytes, ends_line: bool) -> None:
        self.dropped = 0
        self.prefix = prefix  # the rank's, so that one can tell whose output went
        self.ends_line = ends_line  # a line was open on the screen: the note starts on a line of its own

    def note(self) -> bytes:
        return (b"\n" if self.ends_line else b"") + self.prefix + (
            f"[ranktop: console fell behind, {self.dropped} bytes of this stream not shown here; "
            "see its log file]\n").encode()


_Queue = queue.SimpleQueue  # of (target, parts or a _Gap, key), or None: the end

CONSOLE_BUDGET = 16 << 20  # bytes one rank's tee may have waiting for a slow console
# What one queued write costs besides its bytes (a tuple, the parts, the queue's slot): counted
# against the budget, so a stream of 1-byte writes cannot queue 16 million of them.
_ITEM_COST = 128
CONSOLE_TOTAL = 128 << 20  # all ranks together: a stuck terminal must not cost gigabytes
CONSOLE_STALL = 5.0  # at the end, seconds a console may take no output at all before what waits is given up
CONSOLE_STALL_ENV = "RANKTOP_CONSOLE_STALL"  # the user's own value for it
_CONSOLE_PIECE = 16 << 10  # bytes per write to a console: ~0.25 s at 64 KB/s, well inside CONSOLE_STALL
_OWN = "ranktop"  # the key of ranktop's own lines (restarts, notices)


def console_stall() -> float:
    """Seconds a console may take nothing at the end before what waits for it is given up:
    $RANKTOP_CONSOLE_STALL where set (a link that lags longer, or 0 for a job that must end at
    once), else CONSOLE_STALL. A value that is no number of seconds is a one-line UsageError."""
    text = os.environ.get(CONSOLE_STALL_ENV)
    if text is None:
        return CONSOLE_STALL
    try:
        return float(SECONDS.parse(CONSOLE_STALL_ENV, text))
    except UsageError:
        raise UsageError(f"bad {CONSOLE_STALL_ENV}={quoted(text)}: expected {SECONDS.describe()}") from None


def console_budget(ranks: int) -> int:
    """Each rank's share of what may wait for the console: CONSOLE_BUDGET, less with more
    ranks than CONSOLE_TOTAL holds at that, but never under 1 MiB."""
    return max(1 << 20, min(CONSOLE_BUDGET, CONSOLE_TOTAL // max(1, ranks)))


class ConsoleWriter:
    """Writes teed output to our own stdout/stderr from a thread of its own, so that a slow
    terminal never stalls the pipe reader and through it the ranks. Each rank's stream (`key`)
    may have `budget` bytes waiting; past that its console output is dropped, and a note saying
    how much takes its place, so a flooding rank cannot crowd out a quiet one. The log files
    still get every byte. One writer serves a whole run, attempt after attempt: what waits for a
    stuck console is bounded once, not once per restart.

    A console that is /dev/null or a file on a local filesystem (a batch job's output file) is
    written at once by the caller, as the log files are: such a write never waits on a reader,
    and handing each chunk to the thread cost the reader a wake-up and a GIL handover per chunk.

    Lines of different ranks never share a line on the screen (stdout and stderr on one terminal
    are one screen). A stream may leave a line open (a prompt waiting for input, a line too long
    to hold): if anything else comes to that screen first, the writer ends the open line, and
    starts the rest of it on a line of its own with its stream's prefix."""

    def __init__(self, budget: int = CONSOLE_BUDGET, clean: Callable[[bytes], bytes] | None = None,
                 on_lost: Callable[[BinaryIO, str], None] | None = None):
        self._clean = clean  # applied to every write of rank output; the log files keep the raw bytes
        self._unfinished: dict[object, bytes] = {}  # key -> the tail its last piece kept back from _clean
        # A console whose write failed (closed pipe, gone terminal, full disk) gets no more
        # writes; on_lost(target, why) is told once, from whichever thread wrote.
        self._on_lost = on_lost
        self._lost: set[BinaryIO] = set()
        self._pending: dict[object, int] = collections.defaultdict(int)  # key -> bytes queued, and _ITEM_COST per write
        self._items = 0  # writes queued
        self._gaps: dict[object, _Gap] = {}  # key -> the gap its drops go to now
        self._budget = budget
        self._lock = threading.Lock()  # also orders the writes to each screen
        self._direct: dict[BinaryIO, bool] = {}  # target -> written by the caller (never blocks)
        self._screens: dict[BinaryIO, object] = {}  # target -> what it shows on (a terminal, a file)
        self._open_line: dict[object, object] = {}  # screen -> the key whose line is open there
        self._cut: set[object] = set()  # keys whose open line something else ended
        # A queue and a thread per screen: a stuck terminal holds up only what goes to it (our
        # stderr lines still reach a log file), and one screen's writes keep their order.
        self._lanes: dict[object, tuple[_Queue, threading.Thread]] = {}
        # Pieces written so far: how close() sees a slow console still taking what waits. Only
        # ever compared with an earlier value, so the lane threads bump it without the lock.
        self._progress = 0

    def write(self, target: BinaryIO, data: Buffer | tuple[Buffer, ...], key: object = None, *,
              prefix: bytes = b"", line_open: bool = False) -> None:
        """Queue `data` (bytes, or parts written one after the other: no copy to join them) for
        `target`, or drop it if `key` has its budget waiting already. `prefix` is the stream's
        (for the drop note, and the rest of a line that was ended under it); `line_open`: `data`
        leaves a line open, which `key`'s next write goes on with."""
        if target in self._lost:
            return  # the log files still get it
        parts = (data,) if not isinstance(data, tuple) else data
        if self._clean is not None and key != _OWN:
            parts = self._cleaned(parts, key, line_open)
        direct, failed = self._writes_at_once(target), None
        with self._lock:
            screen = self._screen(target)
            if not direct and self._pending[key] + sum(map(len, parts)) + _ITEM_COST > self._budget:
                self._drop(target, screen, sum(map(len, parts)), key, prefix, line_open)
                return
            parts = self._place(screen, key, parts, prefix, line_open)
            # (no lane: no thread to be had, a process limit; written at once, as a file console is)
            if direct or (lane := self._lane(screen)) is None:
                # under the lock: another thread's line cannot land between placing and writing
                failed = self._write(target, parts, flush=True)
            else:
                self._pending[key] += sum(map(len, parts)) + _ITEM_COST
                self._items += 1
                self._gaps.pop(key, None)  # what comes next goes after the note
                lane.put((target, parts, key))
        if failed is not None:
            self._lose(target, failed)

    def _cleaned(self, parts: tuple[Buffer, ...], key: object, line_open: bool) -> tuple[bytes]:
        """`parts` through the console filter; a piece of a line still open keeps back an
        unfinished tail (a cut UTF-8 character) for the next, to be cleaned whole."""
        data = self._unfinished.pop(key, b"") + b"".join(parts)
        if line_open and (tail := unfinished_tail(data)):
            data, self._unfinished[key] = data[:-tail], data[-tail:]
        return (self._clean(data),)

    def say(self, target: BinaryIO, line: str) -> None:
        """One line of ranktop's own (a restart, a stall, a notice), in order with the ranks'
        output, and never waiting on the console: a stuck terminal must not stop the monitor."""
        self.write(target, (line.rstrip("\n") + "\n").encode(errors="replace"), _OWN)

    def _place(self, screen: object, key: object, parts: tuple[Buffer, ...], prefix: bytes,
               line_open: bool) -> tuple[Buffer, ...]:
        """`parts` as they must go out on `screen`: after the end of another stream's open line,
        and with `key`'s prefix again when its own open line was ended meanwhile. Lock held."""
        owner = self._open_line.get(screen)
        if key in self._cut:
            self._cut.discard(key)
            parts = _resumed(parts, prefix)
        # The other stream's line ends after `parts` are resumed: _resumed takes a leading newline
        # for the end of `key`'s own line, and dropped this one with the prefix, so that the rest
        # of a line cut twice (two ranks' prompts in turns) went on the other rank's line.
        if owner is not None and owner != key:
            parts = (b"\n", *parts)
            self._cut.add(owner)
        if line_open:
            self._open_line[screen] = key
        else:
            self._open_line.pop(screen, None)
        return parts

    def _drop(self, target: BinaryIO, screen: object, size: int, key: object, prefix: bytes,
              line_open: bool) -> None:
        """`key` is over its budget: `size` bytes go, and a note says so. Lock held."""
        gap = self._gaps.get(key)
        if gap is None:
            owner = self._open_line.pop(screen, None)  # the note ends the line open there
            if owner is not None and owner != key:
                self._cut.add(owner)
            gap = self._gaps[key] = _Gap(prefix, ends_line=owner is not None)
            if (lane := self._lane(screen)) is not None:  # (one there: what is over budget waits in it)
                lane.put((target, gap, key))
        gap.dropped += size
        if line_open:
            self._cut.add(key)  # the stream goes on with a line whose start is not on the screen
        else:
            self._cut.discard(key)
            if self._open_line.get(screen) == key:
                del self._open_line[screen]

    def forget(self, key: object) -> None:
        """`key`'s stream has ended: nothing of it is kept beyond what still waits to be written."""
        with self._lock:
            self._cut.discard(key)
            self._unfinished.pop(key, None)
            for screen in [screen for screen, owner in self._open_line.items() if owner == key]:
                del self._open_line[screen]

    def _lane(self, screen: object) -> _Queue | None:
        """The queue of `screen`, and its thread started on first use; None while no thread can
        be started (a process limit: a cgroup's pids.max counts threads). Lock held. That ended
        the reader's handling of the stream, and what was queued for the thread never came,
        said at the end as a console that took nothing."""
        lane = self._lanes.get(screen)
        if lane is None:
            lanes: _Queue = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(lanes,), name="ranktop-console", daemon=True)
            try:
                thread.start()
            except RuntimeError:
                return None
            lane = self._lanes[screen] = (lanes, thread)
        return lane[0]

    def _run(self, lane: _Queue) -> None:
        unflushed: set[BinaryIO] = set()  # written since their last flush: a write with more behind it is not flushed
        while (item := lane.get()) is not None:
            target, data, key = item
            if isinstance(data, _Gap):
                with self._lock:
                    if self._gaps.get(key) is data:
                        del self._gaps[key]  # later drops make a new note
                data, charged = (data.note(),), 0
            else:
                charged = sum(map(len, data)) + _ITEM_COST
            if target not in self._lost:
                flush = lane.empty()
                (unflushed.discard if flush else unflushed.add)(target)
                if failed := self._write(target, data, flush, _CONSOLE_PIECE):
                    self._lose(target, failed)
            with self._lock:
                self._items -= charged > 0
                if not (left := self._pending[key] - charged):
                    del self._pending[key]  # (a key is a stream: an ended attempt's go with their rings)
                else:
                    self._pending[key] = left
        # Told to end (close) with the last write not flushed: the end was behind it in the queue.
        for target in unflushed - self._lost:
            if failed := self._write(target, (), True):
                self._lose(target, failed)

    def _writes_at_once(self, target: BinaryIO) -> bool:
        direct = self._direct.get(target)
        if direct is None:
            direct = self._direct[target] = _never_blocks(target)
        return direct

    def _screen(self, target: BinaryIO) -> object:
        screen = self._screens.get(target)
        if screen is None:
            screen = self._screens[target] = _screen_of(target)
        return screen

    def waiting(self) -> int:
        """Bytes queued for a slow console and not written yet."""
        with self._lock:
            return sum(self._pending.values()) - self._items * _ITEM_COST

    def close(self, stall: float = CONSOLE_STALL, cut_short: Callable[[], bool] | None = None) -> int:
        """Write what waits, for as long as the console keeps taking it, and stop; the bytes
        given up because it took nothing for `stall` seconds, or because `cut_short()` said so
        (0: everything was written)."""
        # Again while lanes come: one lane's last write may start another's (a lost console's
        # line on the other stream), which was left unwritten as the process exited. A lane is
        # taken out as it is told to end, so a write after that starts a new one, waited for too
        # (one behind the end of a lane that had ended went unread).
        while lanes := self._take_lanes():
            if not self._drained(lanes, stall, cut_short):
                break
        return self.waiting()

    def _take_lanes(self) -> list[tuple[_Queue, threading.Thread]]:
        """The lanes there are, each told to end once it has written what it holds, and forgotten."""
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
            for lane, _thread in lanes:
                lane.put(None)
        return lanes

    def _drained(self, lanes: list[tuple[_Queue, threading.Thread]], stall: float,
                 cut_short: Callable[[], bool] | None) -> bool:
        """Wait for `lanes` to write what they hold and end; False if given up (see close)."""
        seen, since = -1, time.monotonic()
        # One list per look: a lane may end between two tests of is_alive().
        while alive := [thread for _lane, thread in lanes if thread.is_alive()]:
            if cut_short is not None and cut_short():
                return False
            if self._progress != seen:
                seen, since = self._progress, time.monotonic()
            elif time.monotonic() - since > stall:
                return False
            alive[0].join(0.05)
        return True

    def _write(self, target: BinaryIO, parts: tuple[Buffer, ...], flush: bool, piece: int | None = None) -> str | None:
        """Write `parts`; why that failed (a closed pipe, a gone terminal, a full disk), or None.
        A lane writes in pieces of at most `piece` bytes: one part can be a rank's burst of
        megabytes, and a console that takes it slowly but surely must not look stuck to close()
        meanwhile (a console written at once never waits: one write each)."""
        try:
            for part in parts:
                if piece is None or len(part) <= piece:
                    target.write(part)
                else:
                    view = memoryview(part)
                    for at in range(0, len(view), piece):
                        target.write(view[at:at + piece])
                        self._progress += 1
                self._progress += 1
            if flush:
                target.flush()
        except (OSError, ValueError) as exc:
            return getattr(exc, "strerror", None) or str(exc)
        return None

    def _lose(self, target: BinaryIO, why: str) -> None:
        """No more writes to `target`; on_lost is told once. Called without the lock: what it
        does may write (a line saying so, on the other stream)."""
        with self._lock:
            first = target not in self._lost
            self._lost.add(target)
        if first and self._on_lost is not None:
            try:
                self._on_lost(target, why)
            except (OSError, ValueError):
                pass  # the other console (or the events' disk) is gone too: the writing threads go on
            except Exception as exc:  # a bug: seen, once, on the other stream; the writing threads still go on
                self.say(_other_console(target), _bug_line(f"telling that the console's {console_name(target)} "
                                                           "is gone", exc))


def _other_console(target: BinaryIO) -> BinaryIO:
    """Our stdout for a lost stderr, else our stderr."""
    return binary_console(sys.stdout if console_name(target) == "stderr" else sys.stderr)


def _bug_line(doing: str, exc: BaseException) -> str:
    """One line naming a bug of ranktop's met while `doing`, and where it was raised."""
    import traceback  # (only for a bug: not loaded before the first rank starts)

    where = traceback.extract_tb(exc.__traceback__)[-1]
    return (f"ranktop: a bug while {doing}: {type(exc).__name__}: {exc} (at {os.path.basename(where.filename)}:"
            f"{where.lineno}); the run goes on, please report it")


def _resumed(parts: tuple[Buffer, ...], prefix: bytes) -> tuple[Buffer, ...]:
    """The rest of a stream's line that something else ended on the screen: on a line of its own,
    with the stream's prefix (or, when the rest is only the line's end, without that end)."""
    data = b"".join(parts)
    if data.startswith(b"\n"):
        return (data[1:],)
    return (prefix, data)


def _screen_of(target: BinaryIO) -> object:
    """What `target` shows on: one terminal or file for our stdout and stderr alike (`2>&1`)."""
    try:
        info = os.fstat(target.fileno())
    except (OSError, ValueError, AttributeError):
        return target
    return (info.st_dev, info.st_ino)


class TextConsole:
    """A console that takes text only (a test's StringIO, `contextlib.redirect_stdout`): the
    bytes written decoded as UTF-8, as torch writes text there."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, data: Buffer) -> None:
        self._stream.write(bytes(data).decode("utf-8", "replace"))

    def flush(self) -> None:
        self._stream.flush()


def console_name(target: BinaryIO) -> str:
    """"stdout" or "stderr" for ours (their buffers are named after them), else the target's name."""
    name = str(getattr(target, "name", None) or getattr(getattr(target, "_stream", None), "name", target))
    return {"<stdout>": "stdout", "<stderr>": "stderr"}.get(name, name)


def binary_console(stream) -> BinaryIO:
    """The byte stream under `stream` (sys.stdout or sys.stderr as they are now)."""
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else TextConsole(stream)


# Filesystems whose writes return at once (local disks, memory). A console file elsewhere (NFS,
# Lustre, GPFS, FUSE: a Slurm job's output file often is) can stall, so it goes through the
# console thread, where a stall costs dropped console output, not ranks blocked on their pipes.
_LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "f2fs", "jfs",
                                "reiserfs", "zfs", "tmpfs", "ramfs"})


def _never_blocks(target: BinaryIO) -> bool:
    """Whether writes to `target` return at once: /dev/null, or a regular file on a local
    filesystem (not a terminal, pipe or socket, which wait for their reader)."""
    try:
        mode = os.fstat(target.fileno())
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's BytesIO): the thread
        return False
    if stat.S_ISREG(mode.st_mode):
        return filesystem_type(mode.st_dev) in _LOCAL_FILESYSTEMS
    try:
        return stat.S_ISCHR(mode.st_mode) and mode.st_rdev == os.stat("/dev/null").st_rdev
    except OSError:
        return False


def filesystem_type(dev: int) -> str | None:
    """The type ("ext4", "nfs4", ...) of the filesystem mounted from device `dev` (a stat's
    st_dev), from /proc/self/mountinfo; None when it is not listed there."""
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == wanted and "-" in fields:
                    return fields[fields.index("-") + 1]
    except OSError:
        pass
    return None


class FilteredCopy:
    """torchrun's --duplicate-stdout/stderr-filters: every line of every rank that contains one
    of `needles` also goes, prefixed with its rank, into one file of the attempt
    (filtered_stdout.log / filtered_stderr.log). A write that fails loses only the copy."""

    def __init__(self, fd: int, needles: tuple[bytes, ...]):
        self._fd, self._needles = fd, needles
        self._lock = threading.Lock()  # one line at a time from every rank's sink

    def for_rank(self, prefix: bytes) -> Callable[[bytes | None], None]:
        """What one rank's sink calls with each chunk (None at its end): lines are matched whole."""
        pending = bytearray()

        def feed(data: bytes | None) -> None:
            if data is None:
                lines, pending[:] = [bytes(pending)] if pending else [], b""
            else:
                pending.extend(data)
                *lines, rest = bytes(pending).split(b"\n")
                pending[:] = rest[-LINE_CAP:]  # an endless line is matched by its tail
            hits = [prefix + line + b"\n" for line in lines if any(n in line for n in self._needles)]
            if hits:
                self._write(b"".join(hits))

        return feed

    def _write(self, data: bytes) -> None:
        with self._lock:
            try:
                while data:
                    data = data[os.write(self._fd, data):]
            except OSError:
                pass

    def close(self) -> None:
        os.close(self._fd)


class StreamSink:
    """Where one stream of one rank goes: a log file, the ring, maybe the console (prefixed).

    `log` is the log file: its path (for messages) and how to open it for appending (relative
    to the held rank directory, core/layout.py); the sink closes it. A log write that fails
    (disk full) never stops the reading: the rank must not block on its pipe. The file keeps
    what was written, the rest is counted in `bytes_lost`, `log_error` says why, and
    `on_log_error` is told once."""

    def __init__(
        self,
        stream: int,
        ring: LineRing,
        console: tuple[ConsoleWriter, BinaryIO, bytes] | None = None,
        log: tuple[str, Callable[[], int]] | None = None,
        on_log_error: Callable[[StreamSink], None] | None = None,
        copy: Callable[[bytes | None], None] | None = None,
        on_failure: Callable[[StreamSink], None] | None = None,
    ):
        self.stream = stream
        self.ring = ring
        self._copy = copy  # FilteredCopy.for_rank(...): matching lines into the filtered file
        self.log_path = log[0] if log else None
        self.log_error: str | None = None
        self.bytes_lost = 0
        self._on_log_error = on_log_error
        self._on_failure = on_failure
        self.failure: str | None = None  # why this sink went down to its files alone (fail())
        self.failure_trace = ""
        self.log_fd: int | None = None
        self.console = console  # (before the log is opened: a failed open tells on_log_error, which reads it)
        if log:
            try:
                self.log_fd = log[1]()
            except OSError as exc:
                self._log_failed(exc, 0)
        # The unfinished line, held for the console until its newline (to prefix it and collapse
        # its '\r's) as pieces, and only up to LINE_CAP: past that it is shown as it comes.
        self._console_open: list[bytes] = []
        self._console_open_bytes = 0
        self._console_open_cr = False  # a held piece has a '\r': the line must be collapsed
        self._console_streaming = False  # the open line's start (and prefix) is out already
        self.console_held_since = 0.0  # when the held line's first piece came (0: none held)
        self.done = threading.Event()

    def feed(self, data: bytes) -> None:
        """One chunk as read: the file gets it as it is, the ring keeps it, the console gets it
        prefixed (one `replace` over the chunk, which also counts its lines for the ring)."""
        if self.log_path:
            self._log(data)
        if self._copy is not None:
            self._copy(data)
        if self.failure is not None:
            self.ring.touch()  # the rank still writes: not stalled, only no longer shown
            return
        newlines = self._tee(data) if self.console is not None else None
        self.ring.feed(self.stream, data, newlines)

    def fail(self, exc: BaseException) -> None:
        """What the reader calls when handling a chunk raised (a bug, no memory left): from now
        on the sink only writes its files (the log, the filtered copy), so the rank's pipe is
        still emptied (a rank blocked on a full pipe would hang the run) and its bytes still
        saved; the ring and the console get no more. Told once, with the traceback's end."""
        if self.failure is None:
            import traceback  # only ever needed here

            self.failure = f"{type(exc).__name__}: {exc}"
            self.failure_trace = "".join(traceback.format_exception(exc, limit=-5))
            if self._on_failure is not None:
                self._on_failure(self)

    @property
    def saving(self) -> bool:
        """Whether its output still reaches its log file (there is one, and no write failed)."""
        return self.log_fd is not None and self.log_error is None

    def _log(self, data: bytes) -> None:
        if self.log_error is not None:
            self.bytes_lost += len(data)
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.log_fd, view) :]
        except OSError as exc:
            self._log_failed(exc, len(view))

    def _log_failed(self, exc: OSError, unwritten: int) -> None:
        self.log_error = exc.strerror or str(exc)
        self.bytes_lost += unwritten
        if self._on_log_error is not None:
            self._on_log_error(self)

    def _tee(self, data: bytes) -> int | None:
        """Show `data` on the console, every line prefixed; its newlines when that counted them."""
        writer, target, prefix = self.console
        end = data.rfind(b"\n") + 1  # after the last newline; 0: none
        if not end:
            self._hold(data)
            return 0
        newlines = None
        if self._console_open_cr or b"\r" in data:
            self._tee_lines(data[: end - 1])
        else:  # the usual chunk: one replace puts the prefix after every newline
            lead = (prefix,) if prefix and not self._console_streaming else ()
            lead += tuple(self._console_open)  # the start of the first line, held until now
            self._forget_open_line()
            if prefix:
                body = data.replace(b"\n", b"\n" + prefix)
                newlines = (len(body) - len(data)) // len(prefix)
                # body ends with the prefix of the line after the last newline, then its start
                cut = len(body) - len(prefix) - (len(data) - end)
            else:
                body, cut = data, end
            writer.write(target, (*lead, memoryview(body)[:cut]), self, prefix=prefix)
        if end < len(data):
            self._hold(data[end:])
        return newlines

    def _tee_lines(self, head: bytes) -> None:
        """The slow way, for lines with a '\r' (a progress bar redrawn over its prefix shows
        its last state): `head` is the chunk up to its last newline (not included)."""
        writer, target, prefix = self.console
        streamed = self._console_streaming
        body = b"".join(self._console_open) + head
        self._forget_open_line()
        if b"\r" in body:
            body = b"\n".join(collapse_cr(line) for line in body.split(b"\n"))
        if prefix:
            body = (b"" if streamed else prefix) + body.replace(b"\n", b"\n" + prefix)
        writer.write(target, body + b"\n", self, prefix=prefix)

    def _forget_open_line(self, streaming: bool = False) -> None:
        self._console_open, self._console_open_bytes, self._console_open_cr = [], 0, False
        self._console_streaming = streaming
        self.console_held_since = 0.0

    def _hold(self, piece: bytes) -> None:
        writer, target, prefix = self.console
        if self._console_streaming:
            writer.write(target, piece, self, prefix=prefix, line_open=True)
            return
        if not self._console_open:
            self.console_held_since = time.monotonic()
        self._console_open.append(piece)
        self._console_open_bytes += len(piece)
        self._console_open_cr = self._console_open_cr or b"\r" in piece
        if self._console_open_bytes > LINE_CAP:  # too long to hold: show it as it comes
            self._show_held()

    def show_held_if_quiet(self, now: float) -> None:
        """The rank has written nothing since it began a line PROMPT_SECONDS ago: a prompt
        (`input()`, `(Pdb) `) waits for an answer that cannot come before it is seen. Show the
        line so far; the rest follows on it. (Not a line with a '\r': a progress bar shows its
        last state when its line ends, as always.)"""
        due = self.held_line_due()
        if due is not None and now >= due:
            self._show_held()

    def held_line_due(self) -> float | None:
        """When (time.monotonic()) `show_held_if_quiet` shows the line held for the console if
        nothing more comes; None when it never would (none held, a '\r' in it, a failed sink)."""
        if not self.console_held_since or self._console_open_cr or self.failure is not None:
            return None
        return self.console_held_since + PROMPT_SECONDS

    def _show_held(self) -> None:
        writer, target, prefix = self.console
        writer.write(target, (prefix, *self._console_open), self, prefix=prefix, line_open=True)
        self._forget_open_line(streaming=True)

    def finish(self) -> None:
        try:
            if self.console is not None and self.failure is None and (self._console_open or self._console_streaming):
                self._tee_lines(b"")
            elif self.console is not None and self._console_streaming:  # cut short by fail(): end it
                writer, target, prefix = self.console
                writer.write(target, b"\n", self, prefix=prefix)
            if self.console is not None:
                self.console[0].forget(self)
            if self._copy is not None:
                self._copy(None)
        finally:
            if self.log_fd is not None:
                os.close(self.log_fd)
                self.log_fd = None
            self.done.set()


def _fail(sink: StreamSink, exc: Exception) -> None:
    try:
        sink.fail(exc)
    except Exception:
        pass  # (its note could not be made either) the next chunk is read all the same


class OutputPump:
    """One thread that reads every rank's pipes in rounds and hands chunks to their sinks.

    While output flows the pipes are not polled (no epoll, select or poll on them between
    rounds): once a pipe has been polled, Linux wakes its poller on every write into it
    (`pipe->poll_usage`), which made 8 ranks that write a line at a time spend 12x the system
    time of the same ranks writing into `cat`'s pipes (3.5x their wall time on a 16-core host).
    Instead each round reads every pipe without blocking, and the thread sleeps between rounds:
    _ROUND_SECONDS while a pipe fills fast, longer (up to _IDLE_SECONDS) while none does. Adding
    a pipe or closing wakes it at once.

    Once no pipe has had anything for _QUIET_SECONDS (and none was added), the thread polls them
    all until one has something (or ends), or a line held for the console is due to be shown (a
    prompt): idle ranks cost no rounds, and the first output after a quiet spell is read at once.
    That poll returns at the first write, so nobody waits on a rank's pipe while output flows;
    what stays is the `poll_usage` mark on a pipe once polled: each later write into it wakes its
    (empty) list of waiters, ~0.1 us more of the writer's system time per write, +25-30% of the
    system time of a rank that writes one short line per call (docs/performance-log.md). Hence
    the quiet second first: a run that starts writing at once and never pauses is never polled.

    A pty is the exception, while its writer outpaces us: it holds only 12-16 KiB, so a writer
    that filled it would wait out the whole pause. Such a pty is watched between rounds (a tty keeps no
    such wake-on-every-write state once polled), and the next round starts when it has more."""

    def __init__(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._pending: queue.SimpleQueue[tuple[int, StreamSink]] = queue.SimpleQueue()
        self._buffer = memoryview(bytearray(_READ_SIZE))
        self._pipes: dict[int, tuple[StreamSink, bool, int]] = {}  # fd -> (its sink, is it a pty, room)
        self._pressing: list[int] = []  # ptys that were full at the last round: watched until the next
        self._closing = False
        self.rounds = 0  # read rounds so far; tests look at it
        self.polling = False  # asleep until a pipe has something (quiet for _QUIET_SECONDS); tests wait on it
        self._thread = threading.Thread(target=self._run, name="ranktop-output", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:  # a process limit: the caller says so; nothing of ours is left open
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise

    def add(self, fd: int, sink: StreamSink) -> None:
        """Start reading `fd` (ours to close) into `sink`."""
        widen_pipe(fd)
        os.set_blocking(fd, False)  # a round never waits on one descriptor
        self._pending.put((fd, sink))
        self.wake()

    def wake(self) -> None:
        """Start a read round now (a rank ended: its pipes are at their end)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # already awake

    def _run(self) -> None:
        """Rounds until closed and every pipe ended. The thread must never die of an error: every
        rank would then block on its full pipe and the run would hang. A stream whose handling
        raises goes down to its log file alone (`StreamSink.fail`); anything else that raises
        costs one round."""
        pause, idle, last_news = 0.0, False, time.monotonic()
        while True:
            started, ready = time.monotonic(), []
            try:
                ready = self._sleep(pause, idle)
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                    if self._register_pending():
                        last_news = started  # a new rank: its first second is read in rounds
                fill = self._round()
                self.rounds += 1
            except Exception:
                fill = None  # nothing better to do than try again after a pause
            if self._closing and not self._pipes and self._pending.empty():
                return
            if fill != 0.0:
                last_news = time.monotonic()
            # Every pipe empty for a while: sleep until one is not. (Not when a pipe the poll
            # found ready gave nothing: a round that fails on it must not come back at once.)
            idle = time.monotonic() - last_news >= _QUIET_SECONDS and not any(fd != self._wake_r for fd in ready)
            self.polling = idle
            pause = _IDLE_SECONDS if idle else next_pause(pause, fill or 0.0, time.monotonic() - started)

    def _sleep(self, pause: float, idle: bool = False) -> list[int]:
        """Wait up to `pause` seconds for our own pipe or a pressing pty (never a rank's pipe),
        or when `idle` (no pipe had anything for _QUIET_SECONDS) for any of our pipes until a held
        console line is due; the descriptors that are ready. poll, not select: a many-rank run's
        descriptors pass 1023."""
        poller = select.poll()
        watched = (*self._pressing, *self._pipes) if idle else self._pressing
        for fd in (self._wake_r, *watched):
            poller.register(fd, select.POLLIN)
        timeout = self._until_a_held_line_is_due() if idle else pause
        return [fd for fd, _ in poller.poll(None if timeout is None else timeout * 1000)]

    def _until_a_held_line_is_due(self) -> float | None:
        """Seconds until the first line held for the console is shown, at least _ROUND_SECONDS
        (a line due now was shown by the last round); None when no line is held."""
        due = [d for sink, _tty, _room in self._pipes.values() if (d := sink.held_line_due()) is not None]
        return max(_ROUND_SECONDS, min(due) - time.monotonic()) if due else None

    def _round(self) -> float:
        """Read every pipe once; how full the fullest was, as a share of what it holds (1.0 after
        an end of file: the rank's other stream is likely ending too, so look again soon)."""
        fill = 0.0
        self._pressing = []
        for fd, (sink, tty, room) in list(self._pipes.items()):
            try:
                fill = max(fill, self._take(fd, sink, tty, room))
            except Exception as exc:  # a bug, or no memory: this stream goes down to its log alone
                _fail(sink, exc)
        return fill

    def _take(self, fd: int, sink: StreamSink, tty: bool, room: int) -> float:
        """One pipe's part of a round: read it, feed its sink; its fill (see _round)."""
        data = self._read(fd, tty)
        if data is None:  # end of file: every writer is gone
            del self._pipes[fd]
            release_pipe(fd)
            os.close(fd)
            sink.finish()
            return 1.0
        if data:
            sink.feed(data)
            if tty and len(data) >= _TTY_FULL:
                self._pressing.append(fd)
        elif sink.console_held_since:
            sink.show_held_if_quiet(time.monotonic())
        return len(data) / room

    def _read(self, fd: int, tty: bool | None = None) -> bytes | None:
        """What `fd` holds now, up to one buffer (b"" if nothing); None at end of file. One read empties a pipe
        (read again only if it was full: its writer may have been waiting with more), but a pty
        (`tty`; asked of the descriptor when None) hands out at most 4 KiB a read, so one read a
        round would hold a rank to that pace: a pty is read again until it is empty."""
        if tty is None:
            tty = os.isatty(fd)
        filled, size = 0, len(self._buffer)
        while filled < size:
            try:
                count = os.readv(fd, [self._buffer[filled:]])
            except BlockingIOError:
                break
            except OSError:  # EIO: a pty whose last writer is gone, the end as for a pipe
                count = 0
            if not count:
                if not filled:
                    return None
                break  # what came before the end first; the end is seen next round
            filled += count
            if not tty and count < _FULL_PIPE:
                break  # a pipe read short of a full pipe left it empty: no second read to see that
        return self._buffer[:filled].tobytes()

    def _register_pending(self) -> bool:
        """Take the pipes added since the last round; whether there were any."""
        added = not self._pending.empty()
        while not self._pending.empty():
            fd, sink = self._pending.get()
            tty = os.isatty(fd)
            self._pipes[fd] = (sink, tty, _TTY_ROOM if tty else _capacity(fd))
        return added

    def close(self, timeout: float = 5.0) -> None:
        """Stop once every pipe reached end of file (or after `timeout`)."""
        self._closing = True
        self.wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)
