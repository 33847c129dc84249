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
from collections.abc import Iterable
from typing import Any, TextIO

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


class _Guarded:
    """sys.stdout or sys.stderr, whose writes never raise: a stream that takes no more (a full disk:
    ENOSPC; a terminal that hung up: EIO; a reader that left: EPIPE) is noted in `_lost` and
    pointed at /dev/null, it and what waited in its buffer, so that nothing later (another line,
    the flush at exit) fails on it again. Everything else is the stream's own."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream, self._name = stream, name

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            lose(self._name, exc)
            return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            lose(self._name, exc)
        except ValueError:  # closed: nothing waits in it
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_streams() -> None:
    """Make every write to sys.stdout and sys.stderr (a print, argparse's --help, a report)
    one that never raises; `report_lost` says at the end what a stream did not take."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Guarded):
            setattr(sys, name, _Guarded(stream, name))


# The streams that took no more: their name, and the system's why; None for a reader that left
# (EPIPE), which is no error for a command whose output it is (`ranktop ls | head`, as coreutils).
_lost: dict[str, str | None] = {}
_told: set[str] = set()  # losses said already, where they happened (a run's console_lost line)


def lose(name: str, exc: OSError) -> None:
    """The stream `name` ("stdout" or "stderr") took no more: note why, and point its descriptor
    at /dev/null, where what is written to it goes from now on (its buffer included)."""
    _lost.setdefault(name, None if exc.errno == errno.EPIPE else exc.strerror or str(exc))
    to_devnull(getattr(sys, name))


def lost_told(name: str) -> None:
    """The loss of `name` was said already (a run's console_lost line): `report_lost` is quiet on it."""
    _told.add(name)


def report_lost(status: int, *, keep_status: bool = False) -> int:
    """At the end of a command: flush stdout and stderr, say in one line on the other stream
    each that took no more (not a reader that left); the exit status: 1 instead of 0 where one
    did, as a command whose output was lost failed, unless `keep_status` (a run ends with its
    own status: its output is in its log files)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError as exc:  # (not guarded: a caller's own stream)
            lose("stdout" if stream is sys.stdout else "stderr", exc)
        except (AttributeError, ValueError):
            pass
    failed = [(name, why) for name, why in _lost.items() if why is not None]
    for name, why in failed:
        if name not in _told:
            _say_on(1 if name == "stderr" else 2, f"ranktop: cannot write to {name} ({why}): what was to be shown "
                                                  "there is lost")
    return status if keep_status or status or not failed else 1


def _say_on(fd: int, line: str) -> None:
    """`line` straight to descriptor `fd`, if it takes it: the stream's buffer is not to be trusted."""
    with contextlib.suppress(OSError):
        os.write(fd, (line + "\n").encode("utf-8", "backslashreplace"))


def print_out(text: str) -> bool:
    """`text` and a newline on stdout, at once, and never an exception (see `_Guarded`): a reader
    that has gone (`ranktop ls | head`) drops the rest. Whether stdout still takes what is written."""
    return _print(text, "stdout")


def print_err(text: str) -> bool:
    """`text` and a newline on stderr, at once, and never an exception (see `_Guarded`); whether
    stderr still takes what is written."""
    return _print(text, "stderr")


def _print(text: str, name: str) -> bool:
    try:
        print(text, file=getattr(sys, name), flush=True)
    except OSError as exc:  # (not guarded: called outside the ranktop command, e.g. by a test)
        lose(name, exc)
    return name not in _lost


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
    except OSError as exc:
        if fd in (1, 2):
            lose("stdout" if fd == 1 else "stderr", exc)
        return False
    return True
