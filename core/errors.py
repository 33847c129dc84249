"""Failures: error files in torch's JSON format, the `record` decorator, and the exceptions
that the API raises.

An error file looks like what torch.distributed.elastic writes, so files from either side can be
read by the other:

    {"message": {"message": "ValueError: bad", "extraInfo": {"py_callstack": "...", "timestamp": "1700000000"}}}
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import signal
import stat
import time
import warnings
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any, TypeVar

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
NO_TRACE_HINT = "To see the traceback, wrap the rank's main function in @ranktop.core.record (or torch's @record)."

F = TypeVar("F", bound=Callable[..., Any])


class UsageError(ValueError):
    """Bad input from the user: shown as one line, exit status 2, nothing started."""


class RankStartError(OSError):
    """A rank's process could not be made (the fork or the exec failed: no such binary, not
    executable, a process limit, no memory). Its `strerror` is one line naming the rank and why;
    it is also the OSError subclass of its errno (FileNotFoundError, PermissionError, ...), with
    the binary as `filename`, so `except FileNotFoundError` catches it as it catches torch's."""

    @classmethod
    def of(cls, local_rank: int, exc: OSError) -> RankStartError:
        return cls.starting(f"local rank {local_rank}", exc)

    @classmethod
    def starting(cls, what: str, exc: OSError | RuntimeError) -> RankStartError:
        """`what` (a rank, or ranktop's own process or thread for the group) could not be made.
        A thread that cannot be started is Python's RuntimeError; it meets the same process
        limit a fork does (a cgroup's pids.max counts threads)."""
        code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EAGAIN
        why = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
        if code == errno.EAGAIN:
            why += " (a process limit: ulimit -u, or the container's pids.max)"
        kind = _RANK_START_KINDS.get(type(OSError(code, why)), RankStartError)
        return kind(code, f"cannot start {what}: {why}", getattr(exc, "filename", None))


# RankStartError as the OSError subclass of the errno an exec or fork fails with most
# (named here, not made on the fly, so that they pickle).
class RankStartFileNotFoundError(RankStartError, FileNotFoundError):
    __doc__ = RankStartError.__doc__


class RankStartPermissionError(RankStartError, PermissionError):
    __doc__ = RankStartError.__doc__


class RankStartBlockingIOError(RankStartError, BlockingIOError):
    __doc__ = RankStartError.__doc__


_RANK_START_KINDS: dict[type, type[RankStartError]] = {
    FileNotFoundError: RankStartFileNotFoundError, PermissionError: RankStartPermissionError,
    BlockingIOError: RankStartBlockingIOError}


class SignalException(Exception):
    """torch's: raised in the launcher when it receives a stop signal; `sigval` is the signal."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval

    @classmethod
    def received(cls, signum: int) -> SignalException:
        """torch's, for this process receiving `signum`: 'Process <pid> got signal: <N>'."""
        return cls(f"Process {os.getpid()} got signal: {int(signum)}", sigval=signal.Signals(signum))


class ChildFailedError(Exception):
    """torch's: one or more ranks failed; `failures` maps global rank -> ProcessFailure, and
    the first (earliest) one is the root cause. Its text is torch's table: the other failures,
    then the root cause, each with time, host, rank, exit code, error file and traceback."""

    def __init__(self, name: str, failures: dict[int, ProcessFailure]) -> None:
        self.name = name
        self.failures = failures
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        # exited_at orders failures within one second; a failure made by torch's own
        # ProcessFailure has only the whole-second timestamp, which is torch's order.
        rank = min(self.failures, key=lambda r: getattr(self.failures[r], "exited_at", self.failures[r].timestamp))
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """The table str() shows. The parameter names are torch's, its spelling included, so a
        call by keyword written for torch works here."""
        title = f"{self.name} FAILED"
        root_rank, _ = self.get_first_failure()
        root, others, width = "", [], len(title)
        # idx counts every failure in the dict's order, the root cause's too, as torch numbers them.
        for idx, (rank, failure) in enumerate(self.failures.items()):
            block = _failure_block(idx, rank, failure)
            width = max([width] + [len(line) for line in block.splitlines()])
            if rank == root_rank:
                root = block
            else:
                others.append(block)
        width = min(width, 60)  # a long traceback line must not make a rule as wide as itself
        rule, section = boarder_delim * width, section_delim * width
        return "\n".join(["", rule, title, section, "Failures:", "\n".join(others or ["  <NO_OTHER_FAILURES>"]),
                          section, "Root Cause (first observed failure):", root, rule])


@functools.cache
def _hostname() -> str:
    # getfqdn may wait on DNS; the host does not change while we run, so ask once. Imported
    # here, as datetime below: only a failure's table needs them, and every start pays imports.
    import socket

    return socket.getfqdn()


def _failure_block(idx: int, rank: int, failure: ProcessFailure) -> str:
    """One failure as a block of the table; the traceback's lines are indented under it."""
    shown: object = failure.message
    if isinstance(shown, dict):
        extra = shown.get("extraInfo")
        trace = extra.get("py_callstack") if isinstance(extra, dict) else None
        shown = trace if isinstance(trace, str) else shown.get("message", NOT_AVAILABLE)
        shown = str(shown).replace("\n", "\n  ")
    sig = failure.signal_name()
    return "\n".join([
        f"[{idx}]:",
        f"  time      : {failure.timestamp_isoformat()}",
        f"  host      : {_hostname()}",
        f"  rank      : {rank} (local_rank: {failure.local_rank})",
        # torch's line has a space before the signal part and one inside it; kept, so the
        # text (and the table's width) is the same byte for byte.
        f"  exitcode  : {failure.exitcode} (pid: {failure.pid}) {f' ({sig})' if sig != NOT_AVAILABLE else ''}",
        f"  error_file: {failure.error_file}",
        f"  traceback : {shown}",
    ])


class ErrorHandler:
    """torch's: writes a rank's exception to $TORCHELASTIC_ERROR_FILE (what @record uses), and
    copies a rank's error file to the launcher's own (`dump_error_file`)."""

    def initialize(self) -> None:
        try:
            import faulthandler

            faulthandler.enable(all_threads=True)
        except Exception:
            pass  # no usable stderr (None, or no file descriptor): the error file still gets the exception

    def _get_error_file_path(self) -> str | None:
        return os.environ.get(ERROR_FILE_ENV) or None

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if path:
            write_error_file(path, e)

    def override_error_code_in_rootcause_data(self, rootcause_error_file: str, rootcause_error: dict[str, Any],
                                              error_code: int = 0) -> None:
        """Put the exit code the launcher saw into a loaded error file, as `message.errorCode`:
        a rank killed by a signal could not write it. Only torch's {"message": {...}} shape has a
        place for it; a plain-text message or a file without one is left as it is."""
        message = rootcause_error.get("message") if isinstance(rootcause_error, dict) else None
        if isinstance(message, dict):
            message["errorCode"] = error_code

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy the root cause's error file to ours ($TORCHELASTIC_ERROR_FILE), as torchrun does
        for a scheduler that watches the launcher's error file: every key is kept, and a nonzero
        `error_code` goes into `message.errorCode`. As torch's, a missing or bad rank file raises
        (`copy_error_file`), and a copy that cannot be written is a warning: `record` then raises
        the rank's failure, not the copy's."""
        try:
            self.copy_error_file(rootcause_error_file, error_code)
        except _CopyNotWritten as exc:
            warnings.warn(f"Unable to write error to file. {exc.why}", stacklevel=2)

    def copy_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """dump_error_file, raising on every failure (the agent says it in one line).

        The rank's file is read as input the rank controls (no symlink, a regular file, at most
        1 MB, JSON); a missing one raises FileNotFoundError, a bad one BadErrorFile (also json's
        JSONDecodeError when it is not JSON, as torch raises). Ours is replaced whole, never
        written through a symlink planted at its name, in its directory reached as a --log-dir
        is (UsageError when another user controls the way there: a link they planted in their
        own directory had root write the file wherever it pointed)."""
        data = _read_json(rootcause_error_file)
        if data is _MISSING:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), rootcause_error_file)
        if error_code:  # 0 is torch's "not known": the rank's own errorCode, if any, stays
            self.override_error_code_in_rootcause_data(rootcause_error_file, data, error_code)
        target = self._get_error_file_path()
        if not target:  # no scheduler asked for one: nothing to copy to
            return
        from ranktop.core.layout import open_chosen_dir  # (layout imports this module)

        target = os.path.abspath(target)
        try:
            held = open_chosen_dir(os.path.dirname(target), f"directory of ${ERROR_FILE_ENV}", make=False,
                                   advice="give ranktop one in a directory of your own", room_below=0)
            try:
                _replace_file(target, json.dumps(data), held.fd)
            finally:
                held.close()
        except (OSError, UsageError) as exc:
            raise _CopyNotWritten(exc) from exc


class _CopyNotWritten(UsageError):
    """The launcher's copy of the root cause's error file could not be written (`why` says so)."""

    def __init__(self, cause: OSError | UsageError) -> None:
        self.why = f"{type(cause).__name__}: {cause}"
        self.strerror = getattr(cause, "strerror", None) or str(cause)
        super().__init__(self.strerror)


def _replace_file(path: str | os.PathLike, text: str, dir_fd: int | None = None) -> None:
    """Write `path` whole (in the held directory `dir_fd`, when given): a temporary file with a
    random name next to it (made exclusively, 0600, never through a symlink, so a file planted
    under a guessable name cannot take the write), then a rename, which replaces a symlink at
    `path` rather than writing through it and never truncates a file that another name (a hard
    link) shares. The temporary file is removed on any failure. An OSError names `path`, as
    torch's plain write names it: the temporary name is ours, never seen by the caller."""
    path = os.fspath(path)
    try:
        return _write_then_rename(path, text, dir_fd)
    except OSError as exc:
        if exc.filename is None:  # (a full disk names no file)
            raise
        failed = exc  # named '.error.json.1a2b3c4d.tmp', or that -> 'error.json'
    # Raised out here, not in the handler, so that its context stays the caller's (in `record`,
    # the function's own exception), not the OSError it stands for.
    raise OSError(failed.errno, failed.strerror, path).with_traceback(failed.__traceback__)


def _write_then_rename(path: str, text: str, dir_fd: int | None) -> None:
    name = os.path.basename(path) if dir_fd is not None else path
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = os.path.join(os.path.dirname(name), f".{os.path.basename(name)}.{os.urandom(4).hex()}.tmp")
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name", path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


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
    import traceback  # (only for a failure: not loaded before the first rank starts, nor in every rank)

    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    _replace_file(path, json.dumps(data))


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
    A ValueError; the kinds below are also what torch's ProcessFailure raises for the same file,
    so `except json.JSONDecodeError` or `except KeyError` written for torch catches them too."""

    def __str__(self) -> str:
        # Plain text even where KeyError (which quotes its argument) is a base class.
        return str(self.args[0]) if self.args else ""

    def about(self, path: str | os.PathLike) -> BadErrorFile:
        """The same error, its text naming the file."""
        return type(self)(f"error file {path} {self}")


class ErrorFileNotJSON(BadErrorFile, json.JSONDecodeError):
    """The file is not JSON (or not UTF-8, or nested too deep to parse): torch raises
    json.JSONDecodeError here. `msg`, `pos`, `lineno`, `colno` are json's when json found the
    fault; `doc` is left empty, as the file may be a megabyte."""

    def __init__(self, text: str, msg: str = "", pos: int = 0, lineno: int = 1, colno: int = 1) -> None:
        ValueError.__init__(self, text)  # not JSONDecodeError's: our text, not its "line N column M"
        self.msg, self.doc, self.pos, self.lineno, self.colno = msg, "", pos, lineno, colno

    def about(self, path: str | os.PathLike) -> BadErrorFile:
        return type(self)(f"error file {path} {self}", self.msg, self.pos, self.lineno, self.colno)

    def __reduce__(self) -> tuple:  # JSONDecodeError's own rebuilds with its (msg, doc, pos)
        return type(self), (str(self), self.msg, self.pos, self.lineno, self.colno)


class ErrorFileWithoutMessage(BadErrorFile, KeyError):
    """A JSON object with no "message" key: torch raises KeyError('message') here."""


class ErrorFileNotRegular(BadErrorFile):
    """Something other than a regular file at the error file's path (a directory, a FIFO):
    torch's ProcessFailure takes it for no error file (its test is os.path.isfile)."""


_MISSING = object()  # _read_json's answer for a file that is not there


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
    data = _read_json(path, dir_fd)
    return None if data is _MISSING else _error_content(data)


def _read_json(path: str | os.PathLike, dir_fd: int | None = None) -> Any:
    """The JSON in a file a rank controls, or _MISSING; BadErrorFile (or one of its kinds) when
    it cannot be trusted. Read at most 1 MB, never through a symlink, never from a FIFO."""
    name = os.path.basename(path) if dir_fd is not None else path
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return _MISSING
    except OSError as exc:
        raise BadErrorFile("is a symlink" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ErrorFileNotRegular(f"is not a regular file ({file_kind(info.st_mode)})")
        data = read_at_most(fd, ERROR_FILE_LIMIT + 1)
    finally:
        os.close(fd)
    if len(data) > ERROR_FILE_LIMIT:
        raise BadErrorFile(f"is larger than {ERROR_FILE_LIMIT >> 20} MB")
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise ErrorFileNotJSON("is not valid JSON", exc.msg, exc.pos, exc.lineno, exc.colno) from None
    except (ValueError, RecursionError) as exc:  # bytes that are not UTF-8; nesting past the stack
        raise ErrorFileNotJSON("is not valid JSON", type(exc).__name__) from None


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
    if not isinstance(data, dict):
        raise BadErrorFile('has no "message" object at the top')
    if "message" not in data:
        raise ErrorFileWithoutMessage('has no "message" object at the top')
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


# The latest error-file timestamp taken: 9999-01-01 UTC in seconds. Later is no time a rank
# failed, and the table's local time (datetime) cannot show all of that year in every time zone.
MAX_TIMESTAMP = 253_370_764_800
_TIMESTAMP_DIGITS = 12  # as text: enough for MAX_TIMESTAMP, and int() never sees a huge string


def _timestamp(value: object) -> int | None:
    """torch writes seconds as a string of digits; a number is taken too. Only 0..MAX_TIMESTAMP:
    a huge, negative, infinite or NaN value, or digits that are not ASCII, is BadErrorFile, so
    nothing that later turns it into a time can raise."""
    if value is None:
        return None
    if isinstance(value, str) and len(value) <= _TIMESTAMP_DIGITS and value.isascii() and value.isdigit():
        value = int(value)
    # NaN fails both comparisons; bool is an int but no time
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_TIMESTAMP:
        return int(value)
    raise BadErrorFile('has a "timestamp" that is not a number of seconds up to the year 9999')


class _FileErrorHandler(ErrorHandler):
    """An ErrorHandler for one fixed file: record(fn, error_file=...), ranktop's older form."""

    def __init__(self, path: str) -> None:
        self._path = path

    def _get_error_file_path(self) -> str | None:
        return self._path


def record(fn: F, error_handler: ErrorHandler | None = None, *, error_file: str | None = None) -> F:
    """Decorator: an exception escaping `fn` is written to $TORCHELASTIC_ERROR_FILE (through
    `error_handler`, torch's keyword, or to `error_file`), then re-raised.

    SystemExit is not an error here and leaves no error file: `sys.exit(0)` returns normally
    (None), any other (`sys.exit()`, `sys.exit(138)`, `sys.exit("text")`) is re-raised, as
    torch's does. A ChildFailedError (fn launched ranks and one failed) is not written either:
    the root cause's own error file is copied instead, as torch does, so the file names the
    rank's exception rather than the launcher's. As torch's, it turns faulthandler on, so a
    crash in native code still shows the Python stack on stderr.
    """
    if error_handler is None:
        error_handler = _FileErrorHandler(error_file) if error_file else get_error_handler()
    handler = error_handler

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        handler.initialize()
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            # torch's test, exactly: `code == 0` (0, and False or 0.0 that equal it). A bare
            # sys.exit() (None) goes up as any other SystemExit: the process still exits 0.
            if exc.code == 0:
                return None
            raise
        except ChildFailedError as exc:
            _, failure = exc.get_first_failure()
            # A ranktop failure says whether its file was read and trusted; torch's own
            # ProcessFailure only marks a missing one "<N/A>".
            usable = getattr(failure, "error_file_read", failure.error_file != NOT_AVAILABLE)
            if usable:
                handler.dump_error_file(failure.error_file, failure.exitcode)
            raise
        except BaseException as exc:  # KeyboardInterrupt too: a rank stopped by ^C says so
            handler.record_exception(exc)
            raise

    return wrapper  # type: ignore[return-value]


NOT_AVAILABLE = "<N/A>"  # torch's error_file when a rank wrote none
NO_ERROR_DATA = {"message": "<NONE>"}  # torch's error_file_data then
# torch's error_file_data for a rank that exited by itself with no error file: exit codes are
# the program's, so torch marks the failure as one the system did not cause and not to retry.
NO_ERROR_DATA_EXITED = {"message": "<NONE>",
                        "errorTraits": {"category": "system_terminated_error", "retryability": "False"}}


@dataclass
class ProcessFailure:
    """One rank that ended badly, in torch's shape. `exitcode` is negative (-N) when signal N
    killed it; `timestamp` is whole seconds (the error file's, else when the exit was seen) and
    `error_file` is "<N/A>" when the rank wrote none.

    `message` is torch's: what the error file has under "message", so the whole
    {"message": ..., "extraInfo": {...}} object for a file @record wrote, text for a plain one,
    and ranktop's own sentence when there is no file; `message_text` is always the one line.
    A malformed error file raises BadErrorFile (ErrorFileNotJSON, also json's JSONDecodeError;
    ErrorFileWithoutMessage, also a KeyError), as torch raises; a path that is not a regular file
    (a directory, a FIFO) is no error file, as torch's. The engine, which reads files its ranks
    control, passes `raise_bad_file=False` and the problem is named in `message` instead."""

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
    message: str | dict = field(init=False)
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
            if not raise_bad_file:  # the engine's: a rank controls the file, and the problem is named
                problem = f"error file {self.error_file} {exc}; ignored"
            elif not isinstance(exc, ErrorFileNotRegular):  # that one is none, as torch's isfile test has it
                raise exc.about(self.error_file) from None
        stamp = None
        if content is not None:
            self.message, self.traceback, stamp = content.data["message"], content.traceback, content.timestamp
            self.error_file_data = content.data
            self.error_file_read = True
        elif self.exitcode < 0:
            self.error_file_data = dict(NO_ERROR_DATA)
            self.message = f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
        else:
            # A fresh copy each time: a caller may add to one failure's data.
            self.error_file_data = json.loads(json.dumps(NO_ERROR_DATA_EXITED))
            self.message = f"exited with code {self.exitcode}. {NO_TRACE_HINT}"
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
        """'SIGSEGV' for -11; '<N/A>' for an exit by itself and, as torch, for a signal without a
        name (a real-time one: -40)."""
        name = signal_name(self.exitcode)
        return name if name in signal.Signals.__members__ else NOT_AVAILABLE

    @property
    def message_text(self) -> str:
        """The failure in one line of text whatever `message` holds: the exception line of a
        file @record wrote ("ValueError: boom"), else `message` itself."""
        if isinstance(self.message, dict):
            inner = self.message.get("message", "")
            return inner if isinstance(inner, str) else ""
        return self.message

    def timestamp_isoformat(self) -> str:
        """`timestamp` as local time, 'YYYY-MM-DD_HH:MM:SS' (torch's form, for the table)."""
        from datetime import datetime

        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")
