"""events.jsonl: what happened in a run, one JSON object a line. The one writer of that file,
and the reader that the file's readers outside the run share."""

from __future__ import annotations

import collections
import errno
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ranktop.core.layout import EVENTS

MAX_EVENT_LINE = 4 << 20  # longer than any event ranktop writes: a longer "line" is not one of them


class EventLog:
    """Appends events to an events.jsonl opened for appending (see core/layout.py), from any
    thread. Each line is a single write to an O_APPEND descriptor, so lines written at the same
    time by this process and by another one (`ranktop stacks`) never mix.

    A line is written whole or not at all. When the disk is full, lines are held back (up to
    `HELD_LINES`) and written, in order, with the next line that fits."""

    HELD_LINES = 10_000
    RECENT = 256  # the newest events, kept for the served run's subscribers (see since())

    def __init__(self, fd: int):
        self._fd = fd
        self._held: collections.deque[bytes] = collections.deque(maxlen=self.HELD_LINES)
        self._recent: collections.deque[str] = collections.deque(maxlen=self.RECENT)
        self._count = 0  # events written so far
        self._lock = threading.Lock()
        self.echo: Callable[[str], None] | None = None  # also say each line here (torchrun's console handler)

    def write(self, event: str, *, strict: bool = False, **fields: Any) -> None:
        """Append one event; `strict` raises OSError rather than holding the line back."""
        line = json.dumps({"ts": round(time.time(), 6), "event": event, **fields}, default=str) + "\n"
        with self._lock:
            if self._fd < 0:
                return
            self._count += 1
            self._recent.append(line)
            self._held.append(line.encode())
            self._write_held(strict)
        if self.echo is not None:  # outside the lock: saying it may fail, and the failure is an event too
            self.echo(line)

    def since(self, seen: int) -> tuple[int, list[str]]:
        """(events written so far, the lines of those after the first `seen` that are still
        kept): a reader that falls more than RECENT behind skips the oldest."""
        with self._lock:
            new = min(self._count - seen, len(self._recent))
            return self._count, list(self._recent)[len(self._recent) - new:] if new > 0 else []

    def _write_held(self, strict: bool) -> None:
        """The lines held back, then the new one, in order, while they fit. Lock held."""
        while self._held:
            try:
                self._append(self._held[0])
            except OSError:
                if strict:
                    raise
                return
            self._held.popleft()

    def _append(self, data: bytes) -> None:
        start = os.lseek(self._fd, 0, os.SEEK_END)
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError:
            os.ftruncate(self._fd, start)  # no torn line for readers of the file
            raise

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1



def read_events(path: str) -> Iterator[dict]:
    """events.jsonl's events, in order. Whoever could write the run directory could write this
    file, so it is opened as a log is (never through a symlink, never waiting on a FIFO) and a
    line that is not a JSON object (half-written, or planted) is skipped."""
    fd = open_events_file(path)
    if fd is None:
        return
    try:
        yield from events_in(fd)
    finally:
        os.close(fd)


def open_events_file(path: str, dir_fd: int | None = None) -> int | None:
    """A descriptor of the regular file at `path` (in the directory `dir_fd`, if given), opened as
    read_events opens one; None if it is not one (gone, a symlink, a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


def events_in(fd: int) -> Iterator[dict]:
    """The events of the open events.jsonl `fd` (read_events' reading, for a caller that also
    needs the file's fstat)."""
    for line in _lines_of_data(fd, MAX_EVENT_LINE):
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(event, dict):
            yield event


def _lines_of_data(fd: int, longest: int, block: int = 1 << 16) -> Iterator[bytes]:
    """The lines of the regular file `fd`, read block by block. A line longer than `longest` is
    skipped whole (its tail is not taken for a line of its own), and so is a line that meets a
    hole: a sparse file reads as zeros, which no line of ours holds, so its holes are stepped
    over (SEEK_DATA), not read (a terabyte of them took `ranktop stacks DIR` hours)."""
    pos, parts, size, spoiled = 0, [], 0, False
    while True:
        data_at = _next_data(fd, pos)
        if data_at > pos:
            pos, parts, size, spoiled = data_at, [], 0, True
        chunk = os.pread(fd, block, pos)
        if not chunk:
            break
        pos += len(chunk)
        *ends, rest = chunk.split(b"\n")
        for end in ends:
            if not spoiled and size + len(end) <= longest:
                yield b"".join([*parts, end])
            parts, size, spoiled = [], 0, False
        if not spoiled:
            parts.append(rest)
            size += len(rest)
            spoiled = size > longest
            if spoiled:
                parts, size = [], 0
    if parts and not spoiled:
        yield b"".join(parts)  # a last line without its newline (one being written)


def _next_data(fd: int, pos: int) -> int:
    """Where the first byte at or past `pos` that is not in a hole lies (the file's end if none)."""
    try:
        return os.lseek(fd, pos, os.SEEK_DATA)
    except OSError as exc:
        return os.fstat(fd).st_size if exc.errno == errno.ENXIO else pos  # (a file system that cannot say)


def run_started(run_dir: str) -> dict | None:
    """The run_started event that begins `run_dir`'s events.jsonl (it names the run's id and the
    pid of the ranktop that wrote it), None without one."""
    fd = open_events_file(os.path.join(run_dir, EVENTS))
    if fd is None:
        return None
    try:
        return started_event(fd)
    finally:
        os.close(fd)


def recorded_seal(run_fd: int) -> str | None:
    """The final_seal that the run_started event of the run directory `run_fd` recorded (the
    sha256 of the key only the engine's own final.json holds), or None: an older ranktop's run,
    or no run_started there to read. Only that first line is read."""
    fd = open_events_file(EVENTS, dir_fd=run_fd)
    if fd is None:
        return None
    try:
        first = started_event(fd)
    finally:
        os.close(fd)
    seal = first.get("final_seal") if first is not None else None
    return seal if isinstance(seal, str) else None


def started_event(fd: int) -> dict | None:
    """The run_started event on the first line of the open events.jsonl `fd`, None if that line is
    not one (or cannot be read). Only the first line is read: a rank can fill the file with lines
    that are not events, and each look at a run read all of them for the first that parsed."""
    head = bytearray()
    try:
        while b"\n" not in head and len(head) <= MAX_EVENT_LINE:
            chunk = os.pread(fd, 1 << 16, len(head))
            if not chunk:
                break
            head += chunk
    except OSError:
        return None
    line = bytes(head).partition(b"\n")[0]
    try:
        event = json.loads(line) if len(line) <= MAX_EVENT_LINE else None
    except (ValueError, RecursionError):
        return None
    return event if isinstance(event, dict) and event.get("event") == "run_started" else None
