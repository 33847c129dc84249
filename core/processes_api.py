"""torch's front door to a group of ranks: `start_processes` (torch.distributed.elastic's API,
both of its forms), its argument checks, and the stop-signal handlers it installs for its caller.

Every argument is checked, with a one-line error, before a directory is made or opened: a refused
call leaves nothing behind. The group itself is a PContext (core/context.py); the agent and the
command line make theirs directly, without this module.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ranktop.core.caller_signals import catch_stop_signals, restore_signals
from ranktop.core.context import (
    MultiprocessContext,
    PContext,
    StreamPlan,
    SubprocessContext,
    check_start_method,
    plan_streams,
)
from ranktop.core.layout import RunDir, checked_tempdir
from ranktop.core.limits import ensure_fds_for
from ranktop.core.output import STDERR, STDOUT
from ranktop.core.process import check_sendable, refuse_while_loading_main
from ranktop.core.spec import Std, checked_entrypoint

if TYPE_CHECKING:
    from ranktop.core.logs_specs import LogsSpecs


class RanksMismatch(RuntimeError, ValueError):
    """args and envs do not name the same local ranks 0..n-1 (torch raises RuntimeError)."""


_UNSET: Any = object()  # "not given": tells a keyword apart from one also given by position
# What follows logs_specs by position in each form: torch 2.13's when the fifth argument is a
# LogsSpecs, the older log_dir form's otherwise.
_LOGS_SPECS_FORM = ("log_line_prefixes", "start_method", "numa_options",
                    "duplicate_stdout_filters", "duplicate_stderr_filters")
_LOG_DIR_FORM = ("start_method", "redirects", "tee", "log_line_prefixes")


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str | bytes | os.PathLike,
    args: Mapping[int, tuple],
    envs: Mapping[int, dict[str, str]],
    logs_specs: LogsSpecs | str | None = None,
    *more: Any,
    log_dir: str | None = _UNSET,
    start_method: str = _UNSET,
    redirects: Std | Mapping[int, Std] = _UNSET,
    tee: Std | Mapping[int, Std] = _UNSET,
    log_line_prefixes: Mapping[int, str] | None = _UNSET,
    numa_options: Any = _UNSET,
    duplicate_stdout_filters: list[str] | None = _UNSET,
    duplicate_stderr_filters: list[str] | None = _UNSET,
) -> PContext:
    """Start one process per local rank (torch.distributed.elastic's API, same semantics).

    torch 2.13's form: (name, entrypoint, args, envs, logs_specs, log_line_prefixes, start_method,
    numa_options, duplicate_stdout_filters, duplicate_stderr_filters), the files where the
    LogsSpecs says. The older form: (name, entrypoint, args, envs, log_dir, start_method,
    redirects, tee, log_line_prefixes), `log_dir` an existing empty directory. Which form the
    positions after the fifth follow is decided by whether it is a LogsSpecs."""
    from ranktop.core.logs_specs import LogsSpecs, adopt_logs_specs

    refuse_while_loading_main("start_processes")
    options = {"log_dir": log_dir, "start_method": start_method, "redirects": redirects, "tee": tee,
               "log_line_prefixes": log_line_prefixes, "numa_options": numa_options,
               "duplicate_stdout_filters": duplicate_stdout_filters,
               "duplicate_stderr_filters": duplicate_stderr_filters}
    logs_specs = adopt_logs_specs(logs_specs)  # torch's own DefaultLogsSpecs, as ours
    new_form = isinstance(logs_specs, LogsSpecs)
    opts = _bind_options(options, more, logs_specs, new_form)

    check_start_method(opts["start_method"])
    nprocs = len(args)
    ensure_fds_for(nprocs)
    _check_ranks(args, envs)
    entrypoint = checked_entrypoint(entrypoint)  # a bytes path too, as Popen takes it
    if not callable(entrypoint):
        _check_command(entrypoint, args)
    from ranktop.core.gpu import numa_options_binding  # NVML only when asked for

    cpu_affinity = numa_options_binding(opts["numa_options"], nprocs)
    specs = logs_specs if new_form else None
    # Every argument is checked before a directory is made or opened: a refused call leaves
    # nothing behind, on disk or among our descriptors.
    streams = _stream_plans(name, nprocs, opts, specs)
    filters = {STDOUT: _filter_needles("duplicate_stdout_filters", opts["duplicate_stdout_filters"]),
               STDERR: _filter_needles("duplicate_stderr_filters", opts["duplicate_stderr_filters"])}
    if callable(entrypoint):
        check_sendable(entrypoint, args)  # as each rank's start would, before anything is made
        checked_tempdir()  # where its pickles go (PContext.start): before the run directory is made
    run_dir = _run_dir(opts["log_dir"], specs, envs)
    cls = MultiprocessContext if callable(entrypoint) else SubprocessContext
    make = functools.partial(cls, name, entrypoint, args, envs, run_dir, streams, duplicate_filters=filters,
                             cpu_affinity=cpu_affinity, rank_stdin="null" if callable(entrypoint) else _callers_stdin())
    return _start_for_caller(make, run_dir, opts["start_method"])


def _bind_options(options: dict[str, Any], more: tuple, logs_specs: Any, new_form: bool) -> dict[str, Any]:
    """The keyword arguments (`options`, _UNSET where not given) with the positions after the
    fifth (`more`) bound to them in the form the fifth decides, then the defaults: TypeError for
    too many positions, a value given twice, or the older form's keywords with a LogsSpecs."""
    form = _LOGS_SPECS_FORM if new_form else _LOG_DIR_FORM
    if len(more) > len(form):
        raise TypeError(f"start_processes() takes at most {5 + len(form)} positional arguments when the fifth "
                        f"is {'a LogsSpecs' if new_form else 'a log_dir'} ({5 + len(more)} given)")
    for key, value in zip(form, more, strict=False):  # more may be shorter: the rest keep their defaults
        if options[key] is not _UNSET:
            raise TypeError(f"start_processes() got multiple values for argument {key!r}")
        options[key] = value
    if new_form:
        given = [key for key in ("log_dir", "redirects", "tee") if options[key] is not _UNSET]
        if given:  # torch has no such parameters; silently preferring the LogsSpecs' would mislead
            raise TypeError(f"start_processes() got {', '.join(given)} with a LogsSpecs: "
                            "they belong in the LogsSpecs (DefaultLogsSpecs(log_dir, redirects, tee))")
    elif logs_specs is not None:
        if options["log_dir"] is not _UNSET:
            raise TypeError("start_processes() got multiple values for argument 'log_dir'")
        options["log_dir"] = logs_specs  # the older positional form: (name, fn, args, envs, log_dir)
    defaults = {"log_dir": None, "start_method": "spawn", "redirects": Std.NONE, "tee": Std.NONE}
    return {key: defaults.get(key) if value is _UNSET else value for key, value in options.items()}


def _stream_plans(name: str, nprocs: int, opts: dict[str, Any], logs_specs: LogsSpecs | None) -> dict[int, StreamPlan]:
    """How each rank's output is handled: redirects and tee from the LogsSpecs where one was
    given (and its local_ranks_filter), else from the older form's arguments."""
    console_ranks, redirects, tee = None, opts["redirects"], opts["tee"]
    if logs_specs is not None:
        redirects, tee = logs_specs.redirects, logs_specs.tee
        console_ranks = logs_specs.local_ranks_filter or None  # torch: an empty filter filters nothing
    prefixes = _line_prefixes(opts["log_line_prefixes"], name, nprocs)
    return plan_streams(nprocs, redirects, tee, prefixes=prefixes, console_ranks=console_ranks)


def _run_dir(log_dir: str | None, logs_specs: LogsSpecs | None, envs: Mapping[int, dict[str, str]]) -> RunDir:
    """The directory the ranks' files go to (the LogsSpecs' attempt directory, where one was
    given: it also sets the ranks' variables), checked empty, then held: see core/layout.py."""
    if logs_specs is not None:
        logs_specs.reify(envs)
        log_dir = logs_specs.attempt_dir
    if log_dir is None:
        raise ValueError("start_processes needs logs_specs (a LogsSpecs) or log_dir")
    return RunDir.adopt(log_dir)


def _start_for_caller(make: Callable[[], PContext], run_dir: RunDir, start_method: str) -> PContext:
    """Make the context and start it, the caller's stop signals caught for it (see
    core/caller_signals.py). On any error nothing is left: the handlers are put back (by the
    last context counting on them) and the directory let go."""
    caught, ctx = catch_stop_signals(), None
    try:
        ctx = make()
        ctx._holds_signals = caught
        if isinstance(ctx, MultiprocessContext):
            ctx.start_method = start_method
        return ctx.start()
    except BaseException:
        if ctx is None:
            restore_signals(caught)
        else:  # (a start that failed has closed it, and let go already)
            ctx._let_go_of_signals()
        run_dir.close()  # a context that failed to start has closed it already: closing twice is a no-op
        raise


def _callers_stdin() -> str:
    """How a binary rank's stdin is given: the caller's, as torch's binary ranks inherit it (a
    `breakpoint()` there reads the caller's terminal), where descriptor 0 is still the stdin
    Python opened; /dev/null where it was closed (0 may be another file of the caller's by now),
    or replaced (pytest's capture). torch's function ranks read /dev/null, as multiprocessing's."""
    try:
        return "inherit" if sys.stdin is not None and not sys.stdin.closed and sys.stdin.fileno() == 0 else "null"
    except (OSError, ValueError, AttributeError):  # a stand-in (io.StringIO, pytest's) has no descriptor
        return "null"


def _check_ranks(args: Mapping[int, Any], envs: Mapping[int, Mapping[Any, Any]]) -> None:
    """args and envs name the same local ranks 0..n-1, each with arguments and variables as
    torch takes them."""
    nprocs = len(args)
    expected = set(range(nprocs))
    if set(args) != expected or set(envs) != expected:
        raise RanksMismatch(
            f"args and envs must both have exactly the local ranks 0..{nprocs - 1}; "
            f"got args for {sorted(args)} and envs for {sorted(envs)}"
        )
    _check_args(args)
    _check_envs(envs)



def _line_prefixes(given: Any, name: str, nprocs: int) -> dict[int, str]:
    """torch's log_line_prefixes (local rank -> the text before each console line), with
    "[<name><rank>]:" for a rank it does not name; TypeError (one line) for anything else."""
    if given is not None and not isinstance(given, Mapping):
        raise TypeError(f"log_line_prefixes must map local ranks to text, not {type(given).__name__}")
    prefixes = {r: (given or {}).get(r, f"[{name}{r}]:") for r in range(nprocs)}
    for r, prefix in prefixes.items():
        if not isinstance(prefix, str):
            raise TypeError(f"log_line_prefixes[{r}] must be text, not {type(prefix).__name__}")
    return prefixes


def _check_args(args: Mapping[int, Any]) -> None:
    """Each rank's arguments, as something to iterate (torch unpacks them): TypeError (one line)
    naming the first rank whose are not, before anything is made."""
    for r in sorted(args):
        try:
            iter(args[r])
        except TypeError:
            raise TypeError(f"args[{r}] must be the rank's arguments (a tuple), "
                            f"not {type(args[r]).__name__}") from None


def _check_envs(envs: Mapping[int, Mapping[Any, Any]]) -> None:
    """Each rank's variables, names and values, as text Popen takes: TypeError (one line) naming
    the first that is not text, ValueError (Popen's) for a NUL byte, or '=' in a name. torch's
    binary ranks raise Popen's errors, which name neither rank nor variable, once directories are
    made; its function ranks fail at their start instead."""
    for r in sorted(envs):
        if not isinstance(envs[r], Mapping):
            raise TypeError(f"envs[{r}] must map variable names to values, not {type(envs[r]).__name__}")
        for key, value in envs[r].items():
            for what, item in (("name", key), ("value", value)):
                if not isinstance(item, (str, bytes, os.PathLike)):
                    raise TypeError(f"envs[{r}][{key!r}]: an environment variable's {what} must be text, "
                                    f"not {type(item).__name__}")
                try:
                    text = os.fsencode(item)
                except UnicodeEncodeError:  # a lone surrogate: no bytes stand for it
                    raise ValueError(f"envs[{r}][{key!r}]: an environment variable's {what} cannot be "
                                     "encoded for the ranks") from None
                if b"\0" in text or (what == "name" and b"=" in text):
                    held = "a NUL byte" if b"\0" in text else "'='"
                    raise ValueError(f"envs[{r}][{key!r}]: an environment variable's {what} cannot hold {held}")


def _check_command(binary: Any, args: Mapping[int, Any]) -> None:
    """A binary rank's command line as the exec takes it: ValueError (one line) for a NUL byte in
    the binary or in an argument (cast to str, as each rank's are), naming which, before anything
    is made (Popen's "embedded null byte" named neither, its directories made)."""
    if "\0" in str(binary):
        raise ValueError(f"entrypoint {str(binary)!r}: a binary's path cannot hold a NUL byte")
    for r in sorted(args):
        for i, arg in enumerate(args[r]):
            if "\0" in str(arg):
                raise ValueError(f"args[{r}][{i}]: an argument cannot hold a NUL byte")


def _filter_needles(what: str, given: Any) -> tuple[bytes, ...]:
    """A duplicate_*_filters list as the bytes looked for; TypeError (one line) for anything else."""
    needles = tuple(given or ())
    for needle in needles:
        if not isinstance(needle, str):
            raise TypeError(f"{what} must be a list of text, not one holding {type(needle).__name__}")
    return tuple(needle.encode() for needle in needles)

