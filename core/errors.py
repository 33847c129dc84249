"""Failures: error files in torch's JSON format, the `record` decorator, and the exceptions
that the API raises.

An error file looks like what torch.distributed.elastic writes, so files from either side can be
read by the other:

    {"message": {"message": "ValueError: bad", "extraInfo": {"py_callstack": "...", "timestamp": "1700000000"}}}
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_NO_TRACE_HINT = "To see the traceback, wrap the rank's main function in @ranktop.core.record (or torch's @record)."

F = TypeVar("F", bound=Callable[..., Any])


class UsageError(ValueError):
    """Bad input from the user: shown as one line, exit status 2, nothing started."""


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
    message: str
    traceback: str | None
    timestamp: int | None


def read_error_file(path: str | os.PathLike) -> ErrorFileContent | None:
    """Read an error file written by us or by torch; None when missing or unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    msg = data.get("message", data) if isinstance(data, dict) else data
    if isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        stamp = extra.get("timestamp")
        return ErrorFileContent(
            message=str(msg.get("message", "")),
            traceback=extra.get("py_callstack"),
            timestamp=int(stamp) if str(stamp or "").isdigit() else None,
        )
    return ErrorFileContent(message=str(msg), traceback=None, timestamp=None)


def record(fn: F, error_file: str | None = None) -> F:
    """Decorator: an exception escaping `fn` is written to $TORCHELASTIC_ERROR_FILE, then re-raised.

    SystemExit is not an error here: `sys.exit(138)` leaves no error file, only its exit code.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException as exc:
            path = error_file or os.environ.get(ERROR_FILE_ENV)
            if path:
                write_error_file(path, exc)
            raise

    return wrapper  # type: ignore[return-value]


@dataclass
class ProcessFailure:
    """One rank that ended badly. `exitcode` is negative (-N) when signal N killed it."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    rank: int | None = None
    # When the engine saw the exit (sub-second, so the earliest failure can be told apart).
    # Left at 0 it falls back to the error file's whole-second stamp, then to now.
    timestamp: float = 0.0
    message: str = field(init=False)
    traceback: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        content = read_error_file(self.error_file) if self.error_file else None
        if content is not None:
            self.message = content.message
            self.traceback = content.traceback
            if not self.timestamp and content.timestamp is not None:
                self.timestamp = float(content.timestamp)
        elif self.exitcode < 0:
            self.message = f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
        else:
            self.message = f"exited with code {self.exitcode}. {_NO_TRACE_HINT}"
        if not self.timestamp:
            self.timestamp = time.time()
        if self.rank is None:
            self.rank = self.local_rank

    def signal_name(self) -> str:
        return signal_name(self.exitcode)
