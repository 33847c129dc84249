"""Scrollback that waits packed: a ring's older output is compressed where it waits, by a thread
of its own, and unpacked only when a view asks for its lines.

A rank's scrollback is mostly output nobody looks at again: 64 ranks of 10k training-log lines
are ~48 MB of bytes in the rings, most of a TUI's memory, and zlib's fastest level keeps such
lines in a sixth of that. Only output that stayed a while is packed (it was already there at the
packer's previous look, `PACK_SECONDS` before): a flood leaves the ring before it would be, so
the hot path never pays for it, and what is packed is what stays (a TUI's 8 ranks at 1000 lines/s:
no CPU the packer thread could be seen to use, the panes making those lines first). Lines a ring
made for a look that nothing keeps are packed again the same way (LineRing.pack).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Protocol

from ranktop.core.heap import give_back_free_memory

PACK_SECONDS = 2.0  # how often the packer looks, and so how long output waits before it is packed
_SMALLEST = 1 << 10  # a smaller chunk (stdout and stderr taking turns) is not worth a zlib stream
_WORTH = 0.75  # packed output must fit in this share of its bytes, or it stays as it is
_SAMPLE = 4 << 10  # a larger chunk's head is packed first, to see whether the rest is worth it
_TAIL = 4 << 10  # the text after a packed chunk's last newline is kept beside it up to this many bytes
_TRIM_AFTER = 1 << 20  # bytes a look's packing saved before the heap's free pages are handed back


class PackedChunk:
    """A chunk of one stream compressed, with what the ring asks of a chunk without its lines:
    its length, and the text after its last newline (the open line it leaves)."""

    __slots__ = ("data", "size", "line_end", "_tail")

    def __init__(self, raw: bytes | bytearray, data: bytes, size: int | None = None):
        self.data, self.size = data, len(raw) if size is None else size
        self.line_end = raw.rfind(b"\n") + 1  # 0: it holds no newline
        tail = raw[self.line_end :]
        self._tail = bytes(tail) if len(tail) <= _TAIL else None

    def __len__(self) -> int:
        return self.size

    @property
    def stored(self) -> int:
        """Bytes of memory it takes: its packed data, and the tail kept beside it."""
        return len(self.data) + (len(self._tail) if self._tail is not None else 0)

    def unpacked(self) -> bytes:
        import zlib  # (here, not at start-up: nothing is packed before the packer's second look)

        return zlib.decompress(self.data)

    def tail(self) -> bytes:
        """Its bytes after its last newline (all of them when it holds none)."""
        return self._tail if self._tail is not None else self.unpacked()[self.line_end :]


def pack(raw: bytes | bytearray, size: int | None = None) -> PackedChunk | None:
    """`raw` packed, or None where that would not save enough to be worth unpacking it later.
    `size`: the length it counts as, where not its own (made lines, counted without newlines)."""
    if len(raw) < _SMALLEST:
        return None
    import zlib

    if len(raw) > 4 * _SAMPLE and len(zlib.compress(raw[:_SAMPLE], 1)) > _SAMPLE * _WORTH:
        return None  # (binary output, say: its head tells, and the rest is not tried in vain)
    data = zlib.compress(raw, 1)  # (the GIL is let go while zlib works)
    if len(data) > len(raw) * _WORTH:
        return None
    packed = PackedChunk(raw, data, size)  # its kept tail counts too: a chunk of no newline would be kept twice
    return packed if packed.stored <= len(raw) * _WORTH else None


def unpacked(chunk: bytes | bytearray | PackedChunk) -> bytes | bytearray:
    return chunk.unpacked() if isinstance(chunk, PackedChunk) else chunk


def tail_after_newline(chunk: bytes | bytearray | PackedChunk) -> tuple[bool, bytes | bytearray]:
    """Whether `chunk` holds a newline, and its bytes after the last one (all when it holds none)."""
    if isinstance(chunk, PackedChunk):
        return bool(chunk.line_end), chunk.tail()
    end = chunk.rfind(b"\n") + 1
    return bool(end), chunk[end:]


class Packable(Protocol):
    def pack(self) -> tuple[bool, int]: ...


class RingPacker:
    """The thread that packs the rings of this process. A ring wakes it when output comes after
    it was found with nothing left to pack; then every `PACK_SECONDS` it asks each ring it was
    woken by to pack what was already there at the previous look (`LineRing.pack`), until none
    has more coming. Rings are held weakly: a ring let go of is not kept for packing."""

    def __init__(self, every: float = PACK_SECONDS):
        self.every = every
        self._rings: weakref.WeakSet[Packable] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._due = threading.Event()
        self._thread: threading.Thread | None = None

    def wake(self, ring: Packable) -> None:
        """`ring` has output to pack in a while."""
        with self._lock:
            self._rings.add(ring)
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="ranktop-packer", daemon=True)
                try:
                    thread.start()
                except (RuntimeError, MemoryError):  # (no thread to be had: a pids limit) the reader's feed
                    return  # must not fail; the ring stays listed for the thread a later wake starts
                self._thread = thread
        self._due.set()

    def _run(self) -> None:
        while True:
            self._due.wait()
            time.sleep(self.every)
            self._due.clear()
            with self._lock:
                rings = list(self._rings)
                self._rings.clear()  # each ring that has more coming is back below, or wakes us again
            done = [self._pack(ring) for ring in rings]
            more = [ring for ring, (ring_more, _) in zip(rings, done, strict=True) if ring_more]
            with self._lock:
                self._rings.update(more)
            if more:
                self._due.set()
            if sum(saved for _, saved in done) >= _TRIM_AFTER:
                # The raw chunks freed lie all through the heap: without this a TUI of 64 quiet
                # ranks held 91 MB with its output packed, against 58.
                give_back_free_memory()
            del rings, more

    @staticmethod
    def _pack(ring: Packable) -> tuple[bool, int]:
        try:
            return ring.pack()
        except Exception:  # (no memory for zlib's work, say) what it chose waits as it is; the ring
            return True, 0  # is looked at again: it may have said more was coming, and then never wakes us


_lock = threading.Lock()
_packer: RingPacker | None = None


def packer() -> RingPacker:
    """This process's packer (a forked child makes its own: the parent's thread is not in it)."""
    global _packer
    with _lock:
        if _packer is None:
            _packer = RingPacker()
        return _packer


def _forget_after_fork() -> None:
    global _lock, _packer
    _lock, _packer = threading.Lock(), None


os.register_at_fork(after_in_child=_forget_after_fork)
