"""Rank output: pipes read in large chunks by one thread, every byte to the log files, a ring of
recent lines for the UI, and an optional prefixed tee to the console.

The hot path works on whole chunks with bytes methods (split/join run in C); nothing here looks
at a line in Python unless the chunk holds a carriage return.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import os
import queue
import selectors
import threading
import time
from typing import BinaryIO

_READ_SIZE = 1 << 20  # one buffer, reused: os.read(fd, 1 MiB) would map and unmap 1 MiB per read
# Under a steady flow, read rounds start at most this often. A rank writing a line at a time would
# otherwise wake the reader for every write; waiting lets a round take many writes from every pipe
# at once (the 1 MiB pipes hold far more than 5 ms of output). After a quiet spell the next round
# starts at once, so occasional output is not delayed at all.
_ROUND_SECONDS = 0.005
_PIPE_SIZE = 1 << 20  # ask the kernel for 1 MiB pipes: fewer wake-ups, ranks block less
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)

STDOUT, STDERR = 1, 2


def widen_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_SIZE)
    except OSError:
        pass  # over /proc/sys/fs/pipe-max-size for unprivileged users: keep the default


def collapse_cr(line: bytes) -> bytes:
    """What a terminal would show for a line redrawn with '\\r': its last non-empty state."""
    parts = [p for p in line.split(b"\r") if p]
    return parts[-1] if parts else b""


class LineRing:
    """The recent complete lines of one rank (both streams, in arrival order) plus the unfinished
    last line of each stream. Written by the reader thread, read by UIs from any thread."""

    def __init__(self, maxlen: int = 10_000):
        self.lines: collections.deque[bytes] = collections.deque(maxlen=maxlen)
        self.partial = {STDOUT: b"", STDERR: b""}
        self.version = 0  # bumped per chunk: UIs repaint only when it moved
        self.total_lines = 0
        self.last_output_at: float | None = None
        self._lock = threading.Lock()

    def feed(self, stream: int, chunk: bytes) -> None:
        pieces = chunk.split(b"\n")
        with self._lock:
            if len(pieces) > 1:
                pieces[0] = self.partial[stream] + pieces[0]
                self.partial[stream] = pieces.pop()
                # The '\r' of a finished line may have come in an earlier chunk (still partial then).
                if b"\r" in chunk or b"\r" in pieces[0]:
                    pieces = [collapse_cr(p) if b"\r" in p else p for p in pieces]
                self.lines.extend(pieces)
                self.total_lines += len(pieces)
            else:
                self.partial[stream] += chunk
            self.version += 1
            self.last_output_at = time.time()

    def tail(self, n: int | None = None) -> list[bytes]:
        """The last n lines (all kept lines when None), unfinished ones last, '\\r' collapsed."""
        with self._lock:
            lines = list(self.lines)
            open_lines = [collapse_cr(p) for p in self.partial.values() if p]
        lines.extend(open_lines)
        return lines if n is None else lines[-n:]

    def since(self, seen: int) -> tuple[int, int, list[bytes], list[bytes]]:
        """For UIs that keep their own copy: (version, total_lines, the complete lines numbered
        `seen` and up that are still kept, the open lines with '\r' collapsed). Line k is the
        k-th complete line ever fed; only the new lines are copied, not the whole ring."""
        with self._lock:
            count = max(0, min(self.total_lines - seen, len(self.lines)))
            new = list(itertools.islice(reversed(self.lines), count))
            open_lines = [p for p in self.partial.values() if p]
            version, total = self.version, self.total_lines
        new.reverse()
        return version, total, new, [collapse_cr(p) for p in open_lines]


class ConsoleWriter:
    """Writes teed output to our own stdout/stderr from a thread of its own, so that a slow
    terminal never stalls the pipe reader and through it the ranks. Past `budget` bytes
    waiting, console output is dropped with a note; the log files still get every byte."""

    def __init__(self, budget: int = 64 << 20):
        self._queue: queue.SimpleQueue[tuple[BinaryIO, bytes] | None] = queue.SimpleQueue()
        self._pending = 0
        self._dropped = 0
        self._budget = budget
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ranktop-console", daemon=True)
        self._thread.start()

    def write(self, target: BinaryIO, data: bytes) -> None:
        with self._lock:
            if self._pending + len(data) > self._budget:
                self._dropped += len(data)
                return
            self._pending += len(data)
        self._queue.put((target, data))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            target, data = item
            try:
                target.write(data)
                if self._queue.empty():
                    target.flush()
            except (OSError, ValueError):
                pass  # console gone (closed pipe, detached terminal): the log files still have it
            with self._lock:
                self._pending -= len(data)
                dropped, self._dropped = self._dropped, 0
            if dropped:
                note = f"[ranktop: console fell behind, {dropped} bytes not shown here; see the log files]\n"
                self._queue.put((target, note.encode()))

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


class StreamSink:
    """Where one stream of one rank goes: a log file, the ring, maybe the console (prefixed).
    `log_fd` is the log file, already open for appending (core/layout.py); the sink closes it."""

    def __init__(
        self,
        stream: int,
        ring: LineRing,
        log_fd: int | None = None,
        console: tuple[ConsoleWriter, BinaryIO, bytes] | None = None,
    ):
        self.stream = stream
        self.ring = ring
        self.log_fd = log_fd
        self.console = console
        self._console_partial = b""
        self.done = threading.Event()

    def feed(self, data: bytes) -> None:
        if self.log_fd is not None:
            _write_all(self.log_fd, data)
        self.ring.feed(self.stream, data)
        if self.console is not None:
            self._tee(data)

    def _tee(self, data: bytes) -> None:
        writer, target, prefix = self.console
        head, sep, rest = data.rpartition(b"\n")
        if not sep:
            self._console_partial += data
            return
        body = self._console_partial + head
        self._console_partial = rest
        if b"\r" in body:  # a redrawn progress bar would overwrite the prefix: show its last state
            body = b"\n".join(collapse_cr(line) for line in body.split(b"\n"))
        if prefix:
            body = prefix + body.replace(b"\n", b"\n" + prefix)
        writer.write(target, body + b"\n")

    def finish(self) -> None:
        if self.console is not None and self._console_partial:
            self._tee(b"\n")
        if self.log_fd is not None:
            os.close(self.log_fd)
            self.log_fd = None
        self.done.set()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class OutputPump:
    """One thread that reads every rank's pipes with epoll and hands chunks to their sinks."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: queue.SimpleQueue[tuple[int, StreamSink]] = queue.SimpleQueue()
        self._buffer = memoryview(bytearray(_READ_SIZE))
        self._open = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="ranktop-output", daemon=True)
        self._thread.start()

    def add(self, fd: int, sink: StreamSink) -> None:
        """Start reading `fd` (ours to close) into `sink`."""
        widen_pipe(fd)
        self._pending.put((fd, sink))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # already awake

    def _run(self) -> None:
        last_round = 0.0
        while True:
            ready = self._selector.select()  # until some pipe has data, or we are woken
            pause = last_round + _ROUND_SECONDS - time.monotonic()
            if pause > 0:
                time.sleep(pause)
                ready = self._selector.select(0)  # everything that came in meanwhile
            last_round = time.monotonic()
            for key, _ in ready:
                if key.data is None:
                    os.read(self._wake_r, 4096)
                    self._register_pending()
                    continue
                try:
                    data = self._buffer[: os.readv(key.fd, [self._buffer])].tobytes()
                except OSError:
                    data = b""
                if data:
                    key.data.feed(data)
                else:
                    self._selector.unregister(key.fd)
                    os.close(key.fd)
                    self._open -= 1
                    key.data.finish()
            if self._closing and self._open == 0 and self._pending.empty():
                return

    def _register_pending(self) -> None:
        while not self._pending.empty():
            fd, sink = self._pending.get()
            self._selector.register(fd, selectors.EVENT_READ, sink)
            self._open += 1

    def close(self, timeout: float = 5.0) -> None:
        """Stop once every pipe reached end of file (or after `timeout`)."""
        self._closing = True
        self._wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
