"""ranktop's own standard streams, made usable before anything else runs.

Started with a stream closed (`ranktop ... >&-`, a daemon manager), Python sets sys.stdout (or
stdin, stderr) to None, and the first file ranktop opens takes the free descriptor 0, 1 or 2: rank
output would be teed into a log file, or a print would crash. A closed stream counts as /dev/null.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import sys
import time
from typing import TextIO

_STREAMS = ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w"))


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError as exc:
        if exc.errno == errno.EBADF:
            return False
        raise
    return True


def reopen_closed_streams() -> list[str]:
    """Open /dev/null on each of descriptors 0, 1 and 2 that is closed, and give Python a file
    object for it; returns the names of the streams that were closed. Call it first thing,
    before any file is opened."""
    closed = [(fd, name, mode) for fd, name, mode in _STREAMS if not _is_open(fd)]
    for fd, _name, _mode in closed:
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:  # the lowest free descriptor: it is fd itself unless a lower one is closed too
            os.dup2(null, fd)
            os.close(null)
    for fd, name, mode in closed:
        stream = open(fd, mode, closefd=False, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    return [name for _, name, _ in closed]


def escape_unencodable() -> None:
    """What ranktop prints that its stdout's encoding cannot hold (an é in a path under
    `PYTHONIOENCODING=ascii`, or `LC_ALL=C` with `PYTHONUTF8=0`) is written as `\\xe9`, as
    Python's own stderr does: a strict stdout (surrogateescape, in the C locale, is strict for
    any character but a file name's stand-in bytes) ended `ranktop ls` in a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) in ("strict", "surrogateescape"):
            with contextlib.suppress(AttributeError, ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")


def print_out(text: str) -> None:
    """`text` and a newline on stdout, at once. A reader that has gone (`ranktop ls | head`) is no
    error for a command whose output it is: the rest is dropped, stdout pointed at /dev/null so
    that the flush at exit cannot fail again."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        to_devnull(sys.stdout)


def print_err(text: str) -> None:
    """`text` and a newline on stderr, at once, and never an exception: a stderr that takes no
    more (a terminal hung up: EIO; a closed pipe) is pointed at /dev/null, it and what waited in
    its buffer, so that nothing later (another line, the flush at exit) fails on it again."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        to_devnull(sys.stderr)


def to_devnull(stream: TextIO) -> None:
    """Point `stream`'s descriptor at /dev/null, where what is written to it goes from now on
    (its buffer included), for a stream whose reader has gone."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)


def terminal_problem() -> str | None:
    """Why the TUI cannot run here, or None when it can: Textual reads keys from stdin and draws
    on stderr, and both must be a terminal."""
    for fd, name in ((0, "stdin"), (2, "stderr")):
        if not os.isatty(fd):
            return f"{name} is not a terminal"
    return None


_PIECE = 512  # bytes a write may take once poll said the descriptor has room: it then never blocks


def write_within(stream: TextIO, text: str, seconds: float) -> bool:
    """Write `text` to `stream` unless it takes nothing for `seconds` (a stuck terminal, a pipe
    nobody reads: ranktop must still end); whether all of it went out. Ctrl-C cannot break a
    blocked write once ranktop handles its signals, so this one never blocks for long."""
    try:
        stream.flush()
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's StringIO): it cannot block
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):
            return False
        return True
    # (a character the console's encoding lacks, é under PYTHONIOENCODING=ascii, shows as \\xe9: not ?)
    data = memoryview(text.encode(getattr(stream, "encoding", None) or "utf-8", errors="backslashreplace"))
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    deadline = time.monotonic() + seconds
    try:
        while data:
            if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                return False
            data = data[os.write(fd, data[:_PIECE]):]
            deadline = time.monotonic() + seconds  # it took some: the wait starts again
    except OSError:
        return False
    return True
