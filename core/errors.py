"""Failures: error files in torch's JSON format, the `record` decorator, and the exceptions
that the API raises.

An error file looks like what torch.distributed.elastic writes, so files from either side can be
read by the other:

    {"message": {"message": "ValueError: bad", "extraInfo": {"py_callstack": "...", "timestamp": "1700000000"}}}
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import signal
import stat
import time
import traceback
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any, TypeVar

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_NO_TRACE_HINT = "To see the traceback, wrap the rank's main function in @ranktop.core.record (or torch's @record)."

F = TypeVar("F", bound=Callable[..., Any])


class UsageError(ValueError):
    """Bad input from the user: shown as one line, exit status 2, nothing started."""


class RankStartError(OSError):
    """A rank's process could not be made (the fork or the exec failed: a process limit, no
    memory). Its message is one line naming the rank and why."""

    @classmethod
    def of(cls, local_rank: int, exc: OSError) -> RankStartError:
        why = exc.strerror or str(exc)
        if exc.errno == errno.EAGAIN:
            why += " (a process limit: ulimit -u, or the container's pids.max)"
        return cls(exc.errno, f"cannot start local rank {local_rank}: {why}")


class SignalException(Exception):
    """torch's: raised in the launcher when it receives a stop signal; `sigval` is the signal."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


class ChildFailedError(Exception):
    """torch's: one or more ranks failed; `failures` maps global rank -> ProcessFailure, and
    the first (earliest) one is the root cause."""

    def __init__(self, name: str, failures: dict[int, ProcessFailure]) -> None:
        self.name = name
        self.failures = failures
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        rank = min(self.failures, key=lambda r: self.failures[r].exited_at)
        return rank, self.failures[rank]

    def format_msg(self) -> str:
        rank, first = self.get_first_failure()
        lines = [f"{self.name} FAILED", f"Root Cause (first observed failure): rank {rank} "
                                        f"(local_rank {first.local_rank}, pid {first.pid}): {first.message}"]
        lines += [f"  rank {r} (local_rank {f.local_rank}, pid {f.pid}): {f.message}"
                  for r, f in sorted(self.failures.items()) if r != rank]
        return "\n".join(lines)


class ErrorHandler:
    """torch's: writes a rank's exception to $TORCHELASTIC_ERROR_FILE (what @record uses)."""

    def initialize(self) -> None:
        try:
            import faulthandler

            faulthandler.enable(all_threads=True)
        except (OSError, ValueError):
            pass  # no usable stderr: the error file still gets the exception

    def _error_file_path(self) -> str | None:
        return os.environ.get("TORCHELASTIC_ERROR_FILE")

    def record_exception(self, e: BaseException) -> None:
        path = self._error_file_path()
        if path:
            write_error_file(path, e)

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a rank's error file to ours ($TORCHELASTIC_ERROR_FILE), as torchrun does for
        the root cause when a scheduler watches the launcher's error file."""
        target = self._error_file_path()
        content = load_error_file(rootcause_error_file)
        if not target or content is None:
            return
        data = {"message": {"message": content.message, "extraInfo": {
            "py_callstack": content.traceback or "", "timestamp": str(content.timestamp or int(time.time())),
            "errorCode": error_code}}}
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)


def get_error_handler() -> ErrorHandler:
    return ErrorHandler()


class WorkerError(RuntimeError):
    """Raised by `launch` when a rank fails."""

    def __init__(self, worker_id: int, exitcode: int, failure: ProcessFailure | None = None):
        self.worker_id = worker_id
        self.exitcode = exitcode
        self.failure = failure
        super().__init__(f"worker[{worker_id}] failed with exitcode={exitcode}")


class MainProcessError(RuntimeError):
    """Raised by `launch` when the caller got SIGINT/SIGTERM and stopped its ranks."""

    def __init__(self, signal_no: int):
        self.signal_no = signal_no
        super().__init__(f"main process received {signal_name(-signal_no)}, stopped all workers")


def signal_name(exitcode: int | None) -> str:
    """'SIGSEGV' for -11 (Popen's convention for death by signal), '<N/A>' for anything else."""
    if exitcode is None or exitcode >= 0:
        return "<N/A>"
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"SIG{-exitcode}"


def killed_by(exitcode: int | None) -> str | None:
    """The signal that ended a process ('SIGSEGV' for -11), or None when it exited by itself."""
    return signal_name(exitcode) if exitcode is not None and exitcode < 0 else None


def describe_exit(exitcode: int, signal: str | None = None, *, sentence: bool = False) -> str:
    """How a process ended, the one wording of it: 'exit code 3' / 'killed by SIGKILL', or as the
    end of a sentence about it ('exited with code 3' / 'was killed by SIGKILL')."""
    if exitcode < 0:
        return f"{'was ' if sentence else ''}killed by {signal or signal_name(exitcode)}"
    return f"exited with code {exitcode}" if sentence else f"exit code {exitcode}"


def write_error_file(path: str | os.PathLike, exc: BaseException) -> None:
    """Write `exc` (with its traceback) in torch's error-file format."""
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


@dataclass(frozen=True)
class ErrorFileContent:
    """An error file as read: the failure's message, the traceback and time when it has them."""

    message: str
    traceback: str | None
    timestamp: int | None
    data: dict = field(default_factory=dict, repr=False)  # the file as loaded (at most 1 MB)


ERROR_FILE_LIMIT = 1 << 20  # bytes; a real error file is a message and a traceback


class BadErrorFile(ValueError):
    """An error file that is there but cannot be trusted; the text says what is wrong with it.
    A ValueError, as json's JSONDecodeError is (what torch's ProcessFailure raises for one)."""


def read_error_file(path: str | os.PathLike) -> ErrorFileContent | None:
    """Read an error file written by us or by torch; None when missing, unreadable or malformed."""
    try:
        return load_error_file(path)
    except BadErrorFile:
        return None


def load_error_file(path: str | os.PathLike, dir_fd: int | None = None) -> ErrorFileContent | None:
    """An error file is input a rank controls, so: None when there is none; BadErrorFile when it
    is a symlink, not a regular file (a FIFO would block a plain open forever), over 1 MB, not
    JSON, or not in torch's shape. With `dir_fd`, the file is opened relative to that directory."""
    name = os.path.basename(path) if dir_fd is not None else path
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadErrorFile("is a symlink" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadErrorFile(f"is not a regular file ({file_kind(info.st_mode)})")
        data = read_at_most(fd, ERROR_FILE_LIMIT + 1)
    finally:
        os.close(fd)
    if len(data) > ERROR_FILE_LIMIT:
        raise BadErrorFile(f"is larger than {ERROR_FILE_LIMIT >> 20} MB")
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        raise BadErrorFile("is not valid JSON") from None
    return _error_content(parsed)


def read_at_most(fd: int, limit: int) -> bytes:
    """At most `limit` bytes from `fd`'s position on: a file a rank controls may grow without end."""
    chunks, size = [], 0
    while size < limit and (chunk := os.read(fd, min(1 << 16, limit - size))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for a one-line reason: 'a FIFO', 'a directory', ..."""
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((kind for test, kind in kinds if test(mode)), "not a file")


def _error_content(data: object) -> ErrorFileContent:
    """torch's {"message": {"message": str, "extraInfo": {"py_callstack": str, "timestamp": str}}}
    or the plain {"message": str, "timestamp": N}; anything else is BadErrorFile."""
    if not isinstance(data, dict) or "message" not in data:
        raise BadErrorFile('has no "message" object at the top')
    msg = data["message"]
    if isinstance(msg, str):
        return ErrorFileContent(msg, None, _timestamp(data.get("timestamp")), data)
    if not isinstance(msg, dict) or not isinstance(msg.get("message", ""), str):
        raise BadErrorFile('has a "message" that is neither text nor torch\'s {"message": text, ...}')
    extra = msg.get("extraInfo") or {}
    if not isinstance(extra, dict):
        raise BadErrorFile('has an "extraInfo" that is not an object')
    trace = extra.get("py_callstack")
    if trace is not None and not isinstance(trace, str):
        raise BadErrorFile('has a "py_callstack" that is not text')
    return ErrorFileContent(msg.get("message", ""), trace, _timestamp(extra.get("timestamp")), data)


def _timestamp(value: object) -> int | None:
    """torch writes seconds as a string of digits; a number is taken too."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return int(value)
    if value is None:
        return None
    raise BadErrorFile('has a "timestamp" that is not a number of seconds')


def record(fn: F, error_file: str | None = None) -> F:
    """Decorator: an exception escaping `fn` is written to $TORCHELASTIC_ERROR_FILE, then re-raised.

    SystemExit is not an error here: `sys.exit(138)` leaves no error file, only its exit code,
    and `sys.exit(0)` returns normally, as torch's does. As torch's, it turns faulthandler on, so
    a crash in native code (a segfault) still shows the Python stack on stderr.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ErrorHandler().initialize()
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code in (0, None):
                return None
            raise
        except BaseException as exc:
            path = error_file or os.environ.get(ERROR_FILE_ENV)
            if path:
                write_error_file(path, exc)
            raise

    return wrapper  # type: ignore[return-value]


NOT_AVAILABLE = "<N/A>"  # torch's error_file when a rank wrote none
NO_ERROR_DATA = {"message": "<NONE>"}  # torch's error_file_data then


@dataclass
class ProcessFailure:
    """One rank that ended badly, in torch's shape. `exitcode` is negative (-N) when signal N
    killed it; `timestamp` is whole seconds (the error file's, else when the exit was seen) and
    `error_file` is "<N/A>" when the rank wrote none. A malformed error file raises BadErrorFile,
    as torch raises; the engine, which reads files its ranks control, passes `raise_bad_file=False`
    and the problem is named in `message` instead."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str | None
    rank: int | None = None
    # When the engine saw the exit (sub-second, so the earliest failure can be told apart).
    # Left at 0 it falls back to the error file's whole-second stamp, then to now.
    exited_at: float = 0.0
    # The held rank directory the error file is in: read relative to it, never by path again.
    error_dir_fd: int | None = field(default=None, repr=False, compare=False)
    message: str = field(init=False)
    timestamp: int = field(init=False)
    error_file_data: dict = field(init=False, repr=False)
    traceback: str | None = field(init=False, default=None)
    error_file_read: bool = field(init=False, default=False)  # a trustworthy error file was there
    raise_bad_file: InitVar[bool] = True

    def __post_init__(self, raise_bad_file: bool) -> None:
        problem = content = None
        try:
            content = load_error_file(self.error_file, self.error_dir_fd) if self.error_file else None
        except BadErrorFile as exc:
            if raise_bad_file:
                raise BadErrorFile(f"error file {self.error_file} {exc}") from None
            problem = f"error file {self.error_file} {exc}; ignored"
        self.error_file_data = dict(NO_ERROR_DATA)
        stamp = None
        if content is not None:
            self.message, self.traceback, stamp = content.message, content.traceback, content.timestamp
            self.error_file_data = content.data
            self.error_file_read = True
        elif self.exitcode < 0:
            self.message = f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
        else:
            self.message = f"exited with code {self.exitcode}. {_NO_TRACE_HINT}"
        if problem:
            self.message = f"{self.message.split('. ')[0]}; {problem}"
        elif content is None:
            self.error_file = NOT_AVAILABLE
        if not self.exited_at:
            self.exited_at = float(stamp) if stamp is not None else time.time()
        self.timestamp = int(stamp) if stamp is not None else int(self.exited_at)
        if self.rank is None:
            self.rank = self.local_rank

    def signal_name(self) -> str:
        return signal_name(self.exitcode)

