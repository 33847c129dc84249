"""A group of ranks started together: the PContext that the agent, the command line and
`start_processes` (core/processes_api.py, torch's front door) all start and watch.

The context owns the one monitor step (`step`): reap what exited, stop the siblings of a failed
rank with the shutdown grace (a rank that died of a stop signal we did not send counts as failed
only once `outside_stop_window` passed without a stop of the group: a deadline, as the others),
SIGKILL what outlived its grace, give up on what outlived SIGKILL, restart single ranks on request,
and report the result once every rank is accounted for and what the ranks left running (helpers
that left their group, orphans; see core/strays.py) has had SIGTERM, the grace, then SIGKILL.
`wait`, `close` and the agent all go through it. Exits are noticed at once through pidfds rather
than by sleeping.

Every wait has a deadline. A rank in uninterruptible sleep (a hung NCCL or NFS call: "D" state)
does not die of SIGKILL until the kernel lets go of it, which may be never; after `reap_timeout`
seconds the context stops waiting, reports the rank as unreapable and leaves it to the orphan
guard, which still holds its process group.
"""

from __future__ import annotations

import contextlib
import errno
import numbers
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from string import Template
from typing import Any, BinaryIO, TextIO

from ranktop.core import guard
from ranktop.core.caller_signals import restore_signals, signals_held
from ranktop.core.errors import ERROR_FILE_ENV, ProcessFailure, RankStartError, UsageError, killed_by, signal_name
from ranktop.core.guard import MARKER
from ranktop.core.layout import ERROR_FILE, Dir, checked_tempdir, log_name
from ranktop.core.limits import check_timeout
from ranktop.core.output import (
    STDERR,
    STDOUT,
    ConsoleWriter,
    FilteredCopy,
    LineRing,
    OutputPump,
    StreamSink,
    binary_console,
    console_budget,
    console_name,
)
from ranktop.core.process import (
    LEADER_ONLY_SIGNALS,
    STOP_SIGNALS,
    Launch,
    RankProcess,
    kernel_state,
    python_call_argv,
    wait_exit,
)
from ranktop.core.sanitize import clean_console
from ranktop.core.signals import OUTSIDE_STOP_SIGNALS
from ranktop.core.spec import Std, per_rank
from ranktop.core.state import LogLoss
from ranktop.core.strays import (
    RANK_MARKER,
    StrayTracker,
    Sweep,
    forget_own_child,
    note_own_child,
    rank_marker,
    rank_needle,
)
from ranktop.core.value import Value
from ranktop.core.weak import weakly

DEFAULT_PREFIX_TEMPLATE = "[${role_name}${rank}]:"

EventSink = Callable[[dict], None]
# Seconds a SIGKILLed rank may take to be gone before it counts as unreapable. A killed process
# normally vanishes within milliseconds; one that lingers is stuck in the kernel.
REAP_TIMEOUT = 5.0
# Seconds a restarted rank's new process waits at most for the old one's output to be read to its
# end (its pipes' end of file comes within a pump round, unless a grandchild holds them open).
RESPAWN_DRAIN = 0.5
# Seconds wait(period=0) naps between looks (exits wake it sooner).
_SHORTEST_NAP = 0.05


class Waker:
    """A pipe that wakes a loop sleeping in poll(); `wake()` is safe from any thread and from a
    signal handler. Its descriptors are closed only when the object is garbage-collected: whoever
    can still call wake() holds a reference, so a late wake (a signal after the end, a UI command
    after close) can never write into a descriptor number that was closed and then reused."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        weakref.finalize(self, _close_fds, self.fd, self._write_fd)

    def wake(self) -> None:
        try:
            os.write(self._write_fd, b"x")
        except OSError:
            pass  # the pipe is full: the loop has plenty of reasons to wake already

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except OSError:
            pass  # empty (EAGAIN)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


@dataclass
class RunProcsResult:
    """What a finished group left: values returned by callables, failures, log file paths
    (all keyed by local rank; a path is "" where that stream was not written to a file)."""

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    # local rank -> pid of each rank that outlived SIGKILL; left to the orphan guard, not a failure
    # of its own (it only ends that way after a stop), but it may still be running
    unreapable: dict[int, int] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return bool(self.failures)


class StreamPlan(Value):
    """How one rank's output is handled; built once per context by `plan_streams`."""

    __slots__ = ("files", "console", "prefix", "discard", "filtered")

    def __init__(self, files: Std, console: Std, prefix: bytes = b"", discard: Std = Std.NONE,
                 filtered: Std | None = None) -> None:
        self.files = files  # streams written to <log_dir>/<rank>/std{out,err}.log
        self.console = console  # streams shown on our stdout/stderr, prefixed
        self.prefix = prefix
        # Streams shown nowhere (torch's os.devnull: a rank local_ranks_filter leaves out, unredirected).
        self.discard = discard
        # Streams whose lines feed the filtered_std*.log copies; None: every stream with a sink (the
        # agent). start_processes: the teed ones only, as torch tails only those into the copies.
        self.filtered = filtered


class RankSlot:
    """Bookkeeping for one local rank across single-rank restarts within this context."""

    __slots__ = ("local_rank", "ring", "proc", "restarts", "stopped_by_us", "stopped_by_user", "kill_at",
                 "stopping_with", "survived_by", "respawn_by", "user_signals", "restart_pending", "failure",
                 "sinks", "reap_by", "unreapable", "held_until", "stopped_from_outside", "identity", "leftovers")

    def __init__(self, local_rank: int, ring: LineRing) -> None:
        self.local_rank, self.ring = local_rank, ring
        self.proc: RankProcess | None = None
        self.restarts = 0
        self.stopped_by_us = False  # its end was asked for (group stop, user kill): not a failure cause
        self.stopped_by_user = False  # of those, by the user's own signal to it (k, x), not the group's stop
        # Monotonic time after which the group gets SIGKILL; kept after its leader is reaped, for what
        # else is in the group (a worker that ignores the stop signal), until the group is gone.
        self.kill_at: float | None = None
        self.stopping_with: int | None = None  # the stop signal it was sent and is within its grace for
        # A stop signal the user sent it alone (the signal picker): still alive at this monotonic
        # time, it survived the signal (pdb takes SIGINT as a break) and its end is no longer ours.
        self.survived_by: float | None = None
        # A restart waits at most until this monotonic time for the replaced process's output to be
        # read to its end, so that its last lines come before the separator, not after it.
        self.respawn_by: float | None = None
        self.user_signals: set[int] = set()  # signals the user sent its process (of which its death is theirs)
        self.restart_pending = False
        self.failure: ProcessFailure | None = None
        self.sinks: list[StreamSink] = []  # its live ones, and earlier ones that lost output
        self.reap_by: float | None = None  # monotonic time after which a SIGKILLed rank counts as unreapable
        self.unreapable = False  # it outlived SIGKILL by reap_timeout: no longer waited for
        # It died of a stop signal we did not send: not a failure until this monotonic time passes
        # without a stop of the group (see OUTSIDE_STOP_WINDOW in core/signals.py).
        self.held_until: float | None = None
        self.stopped_from_outside = False  # it was: its end is part of the group's stop, not a failure
        self.identity: tuple[int, int] | None = None  # its process's (pid, start time): what it left is found by
        # A restart's sweep of what the replaced process left running (helpers in its group or session,
        # daemons with its marker): the new process starts once it is done.
        self.leftovers: Sweep | None = None

    @property
    def ended_by(self) -> str:
        """Why its process ended, if not with exit 0 (the one reading of the flags above): "user"
        (their kill, or the very signal they sent it), "stop" (the group's stop, or a stop of the
        whole job from outside that reached it first), "itself" (a failure of its own)."""
        if self.stopped_by_user:
            return "user"
        if self.stopped_by_us or self.stopped_from_outside:
            return "stop"
        return "itself"

    @property
    def log_bytes_lost(self) -> int:
        return sum(sink.bytes_lost for sink in self.sinks)

    @property
    def log_error(self) -> str | None:
        return next((sink.log_error for sink in self.sinks if sink.log_error), None)

    @property
    def alive(self) -> bool:
        """Running, or at least not given up on: the context still waits for its exit."""
        return self.proc is not None and self.proc.returncode is None and not self.unreapable

    @property
    def being_stopped(self) -> bool:
        """Its end was asked for (the group's stop, a restart, the user's stop signal within its
        grace): shown `stopping`, and quiet for that reason, not stalled."""
        return self.stopped_by_us or self.restart_pending


def plan_streams(
    nprocs: int,
    redirects: Std | Mapping[int, Std],
    tee: Std | Mapping[int, Std],
    *,
    capture_all: bool = False,
    console_ranks: set[int] | None = None,
    prefixes: Mapping[int, str] | None = None,
) -> dict[int, StreamPlan]:
    """torch's semantics: redirect = file only, tee = file and console (also when the same stream
    is redirected: torch tees by tailing the file a redirect writes), neither = console as is.
    With capture_all (the agent, the CLI) every stream also goes to a file and the ring, and
    what is not redirected is shown prefixed; `console_ranks` limits who reaches the console."""
    redirects, tee = per_rank(redirects, nprocs), per_rank(tee, nprocs)
    plans = {}
    for r in range(nprocs):
        if capture_all:
            files, console = Std.ALL, (Std.ALL & ~redirects[r]) | tee[r]
        else:
            files, console = redirects[r] | tee[r], tee[r]
        hidden = console_ranks is not None and r not in console_ranks
        if hidden:
            console = Std.NONE
        prefix = (prefixes or {}).get(r, "")
        plans[r] = StreamPlan(files=files, console=console, prefix=prefix.encode(),
                              discard=Std.ALL & ~files if hidden else Std.NONE,
                              filtered=None if capture_all else console)
    return plans


def prefix_for(template: str | None, role: str, rank: int, local_rank: int) -> str:
    return Template(template or DEFAULT_PREFIX_TEMPLATE).safe_substitute(
        role_name=role, rank=rank, local_rank=local_rank
    )


class PContext:
    """Ranks started together, watched by one monitor step. An API caller makes one with
    `start_processes` (core/processes_api.py)."""

    # The method a function rank's multiprocessing identity names (core/mp_identity.py); every
    # one starts as spawn does whatever it says.
    start_method = "spawn"

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: Mapping[int, tuple],
        envs: Mapping[int, Mapping[str, str]],
        log_dir: Dir,
        streams: Mapping[int, StreamPlan],
        *,
        global_ranks: Mapping[int, int] | None = None,
        shutdown_timeout: float = 30.0,
        ring_lines: int = 10_000,
        on_event: EventSink | None = None,
        passthrough_console: bool = True,
        sanitize_console: bool = False,
        cwd: str | None = None,
        pty: tuple[int, int] | None = None,
        rank_stdin: str = "null",
        duplicate_filters: dict[int, tuple[bytes, ...]] | None = None,
        waker: Waker | None = None,
        generation: int = 0,
        reap_timeout: float = REAP_TIMEOUT,
        cpu_affinity: Mapping[int, frozenset[int]] | None = None,
        console: ConsoleWriter | None = None,
        outside_stop_window: float = 0.0,
    ):
        if not isinstance(log_dir, Dir):  # torch's constructor: (..., start_method, logs_specs)
            raise TypeError(f"{type(self).__name__} is made by start_processes(), which checks and opens "
                            "its run directory first: call it instead")
        check_timeout("shutdown_timeout", shutdown_timeout)
        self.name = name
        self.entrypoint = entrypoint
        self.args = {r: tuple(args[r]) for r in sorted(args)}
        self.envs = {r: dict(envs[r]) for r in sorted(envs)}
        self.nprocs = len(self.args)
        # Held from here to close(): rank directories are made and files opened relative to it.
        self.dir = log_dir
        self.log_dir = log_dir.path
        self._rank_dirs: dict[int, Dir] = {}
        self.streams = dict(streams)
        self.global_ranks = dict(global_ranks or {r: r for r in range(self.nprocs)})
        self.shutdown_timeout = shutdown_timeout
        self.on_event = on_event
        self.cwd = cwd
        self.pty = pty  # (columns, rows) of the terminal each rank writes to; None: pipes
        self.rank_stdin = rank_stdin  # "null", "inherit" (ours) or "pipe" (send_input): see Launch
        self.cpu_affinity = dict(cpu_affinity or {})  # local rank -> the CPUs it starts on (--numa-binding)
        self._set_up_torch_files(duplicate_filters)
        self.generation = generation  # which attempt of a run this is: new rings, new pids
        self.reap_timeout = reap_timeout
        # How long a rank's end by a stop signal we did not send is held before it counts as a
        # failure (the agent's OUTSIDE_STOP_WINDOW); 0, torch's API: at once.
        self.outside_stop_window = outside_stop_window
        self._passthrough = passthrough_console  # unredirected, unteed streams: inherit our fds
        self._sanitize_console = sanitize_console  # filter what the console shows (files stay raw)
        self.slots = [RankSlot(r, LineRing(ring_lines)) for r in range(self.nprocs)]
        self.token = os.urandom(8).hex()
        # Their callbacks are weak (as are the sinks'): no cycle keeps an attempt past its last holder.
        self._strays = StrayTracker(self.token, weakly(self._tell_guard), weakly(self._emit_group))
        # The end sweep: what the ranks left running gets SIGTERM, then SIGKILL after the grace.
        self._sweep = Sweep(shutdown_timeout, weakly(self._emit_group))
        self._pump: OutputPump | None = None
        # The tee's writer: the caller's (an agent keeps one for all its attempts), else our own.
        self._console: ConsoleWriter | None = console
        self._owns_console = console is None
        self._guard: subprocess.Popen | None = None
        self._environ: dict[str, str] = {}  # ours when the group started: every rank's base
        self._tmp: str | None = None
        self._stopping = False
        self._result: RunProcsResult | None = None
        self._closed = False
        self._holds_signals = False  # start_processes' stop-signal handlers count this context
        # Commands may come from other threads (API users); it is never held across a wait.
        self._lock = threading.RLock()
        # Held while the result is collected, which waits for the last output without `_lock`:
        # one thread collects, and close() lets go of the pump and the pickles only after it.
        self._collecting = threading.RLock()
        self._waker = waker or Waker()  # an agent passes its own, woken by its command queue too

    def _set_up_torch_files(self, duplicate_filters: dict[int, tuple[bytes, ...]] | None) -> None:
        """torch's names: local rank -> where each stream went ("" the console as is, os.devnull
        nowhere), the error file each rank is told of, and the filtered copies as open files."""
        # stream -> the attempt's filtered_<stream>.log (torchrun's --duplicate-*-filters)
        self._filtered: dict[int, FilteredCopy] = {}
        self.stdouts = {r: self._stream_path(r, STDOUT) for r in range(self.nprocs)}
        self.stderrs = {r: self._stream_path(r, STDERR) for r in range(self.nprocs)}
        self.error_files = {r: self.error_file(r) for r in range(self.nprocs)}
        self.filtered_stdout: TextIO | None = None
        self.filtered_stderr: TextIO | None = None
        for stream, needles in (duplicate_filters or {}).items():
            if needles:
                self._open_filtered(stream, needles)

    # ----- paths (to tell people and ranks; ranktop itself goes through the held directories) --
    def rank_dir(self, local_rank: int) -> str:
        return self.dir.path_of(str(local_rank))

    def error_file(self, local_rank: int) -> str:
        return os.path.join(self.rank_dir(local_rank), ERROR_FILE)

    def log_path(self, local_rank: int, stream: int) -> str:
        return os.path.join(self.rank_dir(local_rank), log_name(stream))

    def _held_rank_dir(self, local_rank: int) -> Dir:
        """The rank's directory, made and opened at its first start and held: a restart writes
        into the same directory whatever has been renamed or planted in the tree since."""
        if local_rank not in self._rank_dirs:
            self._rank_dirs[local_rank] = self.dir.sub(str(local_rank))
        return self._rank_dirs[local_rank]

    def log_files(self, local_rank: int) -> tuple[str | None, str | None]:
        """(stdout log, stderr log) of a rank; None for a stream not written to a file. With a
        pty, stderr shares stdout's terminal and lands in stdout.log."""
        plan = self.streams[local_rank]
        out = self.log_path(local_rank, STDOUT) if plan.files & Std.OUT else None
        err = self.log_path(local_rank, STDERR) if plan.files & Std.ERR and self.pty is None else None
        return out, err

    def _stream_path(self, local_rank: int, stream: int) -> str:
        plan, flag = self.streams[local_rank], Std.OUT if stream == STDOUT else Std.ERR
        if plan.files & flag:
            return self.log_path(local_rank, stream)
        return os.devnull if plan.discard & flag else ""

    def _open_filtered(self, stream: int, needles: tuple[bytes, ...]) -> None:
        name = f"filtered_{log_name(stream)}"
        try:
            fd = self.dir.open_append(name)
        except OSError:  # the attempt's directory could not be made: its ranks' log lines say so
            return
        self._filtered[stream] = FilteredCopy(fd, needles)
        # torch hands out the open file; the copy owns the descriptor (it closes it), so this
        # view of it never does, and carries the path as its name, as torch's file does.
        view = open(fd, "w", buffering=1, errors="replace", closefd=False)  # noqa: SIM115
        view.buffer.raw.name = self.dir.path_of(name)
        if stream == STDOUT:
            self.filtered_stdout = view
        else:
            self.filtered_stderr = view

    def _result_path(self, local_rank: int) -> str:
        return os.path.join(self._tmp or "", f"{local_rank}.ret")

    def _payload_path(self, local_rank: int) -> str:
        return os.path.join(self._tmp or "", f"{local_rank}.payload")

    def _exited_path(self, local_rank: int) -> str:
        """Made when a function rank is reaped: its peers waiting to exit stop waiting for it."""
        return os.path.join(self._tmp or "", f"{local_rank}.exited")

    def _peers(self, local_rank: int) -> list[tuple[str, str]]:
        return [(self._result_path(p), self._exited_path(p)) for p in range(self.nprocs) if p != local_rank]

    # ----- starting ----------------------------------------------------------------------------
    def start(self) -> PContext:
        # A process limit met by ranktop's own process or thread for the group is said as a
        # rank's start that met it (a cgroup's pids.max counts threads): it was a traceback.
        try:
            self._start_guard()
        except OSError as exc:
            raise RankStartError.starting("the orphan guard", exc) from None
        try:
            self._pump = OutputPump()
        except (OSError, RuntimeError) as exc:
            self.close(signal.SIGKILL, 0)  # lets the guard go
            raise RankStartError.starting("ranktop's output thread", exc) from None
        if self._owns_console and any(plan.console for plan in self.streams.values()):
            self._console = ConsoleWriter(budget=console_budget(2 * len(self.slots)),  # a budget per stream
                                          clean=clean_console if self._sanitize_console else None,
                                          on_lost=weakly(self._console_lost))
        if callable(self.entrypoint):
            self._tmp = tempfile.mkdtemp(prefix="ranktop-", dir=checked_tempdir())
            # Removed by close(); the guard removes it if we die (or exit) without one.
            self._tell_guard(f"tmp {os.fsencode(self._tmp).hex()}")
        self._environ = dict(os.environ)  # (os.environ decodes every variable on every read)
        try:
            for slot in self.slots:
                self._spawn(slot)
        except BaseException:
            self.close(signal.SIGKILL, 0)  # whatever did start must not outlive the error
            raise
        return self

    def _start_guard(self) -> None:
        self._guard = guard.take(self.token, self.shutdown_timeout)
        note_own_child(self._guard.pid)

    def _keep_guard(self) -> None:
        """A guard killed under the run (a `kill` of the wrong pid, a sweep of python processes)
        left the ranks unguarded, without a word: ranktop SIGKILLed later left them and their
        helpers running. A new one is started and told all the old one knew."""
        dead = self._guard
        if dead is None or dead.poll() is None:
            return
        forget_own_child(dead.pid)
        try:
            self._start_guard()
        except OSError as exc:  # no process or descriptor left for one: said, and not tried again
            self._guard = None
            self._emit_group("guard_replaced", pid=dead.pid, status=dead.returncode, new_pid=None,
                             error=exc.strerror or str(exc))
            return
        if self._tmp:
            self._tell_guard(f"tmp {os.fsencode(self._tmp).hex()}")
        for pid, start in self._strays.ranks.items():
            self._tell_guard(f"rank {pid} {start}")
        for pid, start in self._strays.known.items():
            self._tell_guard(f"stray {pid} {start}")
        self._emit_group("guard_replaced", pid=dead.pid, status=dead.returncode, new_pid=self._guard.pid)

    def _tell_guard(self, line: str) -> None:
        try:
            self._guard.stdin.write(line.encode() + b"\n")
            self._guard.stdin.flush()
        except (OSError, ValueError, AttributeError):
            pass

    def _spawn(self, slot: RankSlot) -> None:
        r = slot.local_rank
        if slot.held_until is not None:  # the user restarted a rank whose end was held
            self._end_hold(slot, "restarted")
        try:
            self._held_rank_dir(r).remove(ERROR_FILE)  # a stale one would be taken for this start's
        except OSError:
            pass  # disk full: the log files cannot be opened either, and their sinks report that
        env = {**self._environ, **self.envs[r], ERROR_FILE_ENV: self.error_file(r), MARKER: self.token,
               RANK_MARKER: rank_marker(self.token, r)}
        if callable(self.entrypoint):
            payload = self._payload_path(r)
            self._remove_stale(self._result_path(r))
            self._remove_stale(self._exited_path(r))
            argv = python_call_argv(self.entrypoint, self.args[r], payload, self._result_path(r), self._peers(r),
                                    self.start_method)
        else:
            argv = [str(self.entrypoint), *map(str, self.args[r])]
        sinks = self._sinks(r, slot.ring)
        pty = self.pty if STDOUT in sinks else None  # no sink: the rank inherits our own stdout
        launch = Launch(r, argv, env, sinks, cwd=self.cwd, pty=pty, stdin=self.rank_stdin,
                        cpus=self.cpu_affinity.get(r))
        self._tell_guard("spawning")  # should we die before its `rank` line, it still finds the rank
        try:
            slot.proc = RankProcess(launch, self._pump)
        except OSError as exc:
            raise RankStartError.of(r, exc) from None
        slot.stopped_by_us = slot.stopped_by_user = slot.stopped_from_outside = False
        slot.kill_at = slot.reap_by = slot.survived_by = slot.stopping_with = None
        slot.user_signals.clear()
        slot.failure = None
        slot.unreapable = False
        slot.identity = self._strays.rank_started(slot.proc.pid)
        self._emit("started", r, pid=slot.proc.pid, restarts=slot.restarts)

    @staticmethod
    def _remove_stale(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _sinks(self, r: int, ring: LineRing) -> dict[int, StreamSink]:
        plan = self.streams[r]
        sinks = {}
        for stream, flag, target in ((STDOUT, Std.OUT, sys.stdout), (STDERR, Std.ERR, sys.stderr)):
            if stream == STDERR and self.pty is not None and STDOUT in sinks:
                break  # stderr shares the terminal with stdout: no stderr.log
            to_file, to_console = bool(plan.files & flag), bool(plan.console & flag)
            if not (to_file or to_console or plan.discard & flag) and self._passthrough:
                continue  # inherit our descriptor: the rank writes straight to our console
            console = (self._console, binary_console(target), plan.prefix) if to_console else None
            sinks[stream] = StreamSink(
                stream, ring, console=console,
                log=(self.log_path(r, stream), weakly(self._open_log, r, stream)) if to_file else None,
                on_log_error=weakly(self._log_write_failed, r),
                on_failure=weakly(self._output_failed, r),
                copy=self._filtered[stream].for_rank(plan.prefix)
                if stream in self._filtered and (plan.filtered is None or plan.filtered & flag) else None)
        slot = self.slots[r]
        # An ended stream that lost nothing has nothing left to report: only live sinks and those
        # with a loss are kept (a rank restarted by hand thousands of times kept every one).
        slot.sinks[:] = [s for s in slot.sinks if not s.done.is_set() or s.log_error]
        slot.sinks.extend(sinks.values())
        return sinks

    def _open_log(self, r: int, stream: int) -> int:
        return self._held_rank_dir(r).open_append(log_name(stream))

    def _log_write_failed(self, r: int, sink: StreamSink) -> None:
        """Called once per log file, from the output thread, when a write to it failed."""
        self._emit("log_write_failed", r, path=sink.log_path, error=sink.log_error, bytes_lost=sink.bytes_lost,
                   shown=sink.console is not None)

    def _console_lost(self, target: BinaryIO, error: str) -> None:
        """Called once per console stream, from a writing thread, when a write to it failed."""
        self._emit_group("console_lost", stream=console_name(target), error=error)

    def _output_failed(self, r: int, sink: StreamSink) -> None:
        """Called once per stream, from the output thread, when handling its output raised."""
        self._emit("output_failed", r, stream=sink.stream, error=sink.failure, path=sink.log_path,
                   saved=sink.saving, traceback=sink.failure_trace)

    def let_go_of_output(self) -> None:
        """Another attempt replaced this one: what its rings hold goes now (its log files keep
        it), whoever still holds the context. The agent lets go of it next, and it is freed then,
        with no garbage collection: nothing in it refers back to it (its callbacks are weak,
        core/weak.py), so neither a cycle nor the TUI's freeze of start-up's objects keeps it."""
        for slot in self.slots:
            slot.ring.clear()

    def incomplete_logs(self) -> list[LogLoss]:
        """The log files of this context that miss output, with the bytes each lost so far."""
        return [LogLoss(self.global_ranks[slot.local_rank], sink.log_path, sink.log_error, sink.bytes_lost)
                for slot in self.slots for sink in slot.sinks if sink.log_error]

    # ----- the monitor step --------------------------------------------------------------------
    def step(self) -> RunProcsResult | None:
        """One pass of the monitor: returns the result once every rank is reaped (or given up
        on). It never waits on a rank; only the final collection waits, briefly and with a
        deadline, for the last output to drain, and it does so without holding the lock."""
        with signals_held():  # a stop signal mid-pass would leave a rank reaped but not recorded
            with self._lock:
                if self._result is not None:
                    return self._result
                now = time.monotonic()
                for slot in self.slots:
                    self._advance(slot, now)
                self._strays.look()
                self._keep_guard()
                if any(s.alive or s.restart_pending or s.held_until is not None for s in self.slots) \
                        or not self._swept(now):
                    return None
            # Once, by one thread: a close() from another thread while wait() collected let go of
            # the pump (OSError EBADF out of wait()) and removed the return values being read.
            with self._collecting:
                with self._lock:
                    if self._result is not None:
                        return self._result
                result = self._collect()
                with self._lock:
                    self._result = result
                    return result

    def _advance(self, slot: RankSlot, now: float) -> None:
        self._reap(slot)
        if slot.kill_at is not None and not slot.alive and not slot.proc.signal_group(0):
            slot.kill_at = None  # nothing left in its group: nothing to kill (and the id may be reused)
        if slot.kill_at is not None and now >= slot.kill_at:
            self._kill(slot, now)
        if slot.alive and slot.reap_by is not None and now >= slot.reap_by:
            self._give_up(slot)
        if slot.alive and slot.survived_by is not None and now >= slot.survived_by:
            self._survived(slot)
        if slot.held_until is not None and now >= slot.held_until:
            self._end_hold(slot, "failure", reason="no stop came within the window")
            self._fail_group("another rank failed")
        # (the old group is gone or killed first, and what the old process left elsewhere swept: a
        # worker of the old process must not run, and print, beside the new one)
        if slot.restart_pending and not slot.alive and self._leftovers_swept(slot, now) and slot.kill_at is None \
                and self._old_output_read(slot, now):
            slot.restart_pending = False
            slot.restarts += 1
            self._mark_restart(slot)
            self._spawn(slot)

    def _leftovers_swept(self, slot: RankSlot, now: float) -> bool:
        """One pass of the sweep of what the replaced process left running, as the group's end
        sweep passes over the whole run's; True once it is done."""
        sweep = slot.leftovers
        if sweep is None or slot.identity is None:
            return True
        if not sweep.due(now):
            return False
        needle = rank_needle(self.token, slot.local_rank)
        found = self._strays.left_by(slot.identity, needle, with_marker=sweep.deadline is None)
        if not sweep.step(found, now, self._groups_stopping()):
            return False
        sweep.close()
        slot.leftovers = None
        self._strays.forget_rank(slot.identity)
        return True

    def _old_output_read(self, slot: RankSlot, now: float) -> bool:
        """The replaced process's pipes read to their end, or RESPAWN_DRAIN passed (a grandchild
        of its may hold them open). Without the wait, its last lines could be read after the
        separator and shown as the new process's."""
        if slot.proc is None:
            return True
        if slot.respawn_by is None:
            slot.respawn_by = now + RESPAWN_DRAIN
            self._pump.wake()  # read them now, not after the round's pause
        if slot.proc.output_done() or now >= slot.respawn_by:
            slot.respawn_by = None
            return True
        return False

    @staticmethod
    def _mark_restart(slot: RankSlot) -> None:
        """A separator in the rank's output ring (not its log files), ranktop's own line and marked
        as such: the pane shows where the old process's output ends and the new one's begins."""
        when = time.strftime("%H:%M:%S")
        slot.ring.add_own_line(f"──── {when} restart {slot.restarts} of this rank (ranktop) ────")

    def _kill(self, slot: RankSlot, now: float, reap_timeout: float | None = None) -> None:
        """SIGKILL the rank's group and, while the rank itself lives, start the clock on its reaping."""
        slot.proc.signal_group(signal.SIGKILL)
        slot.kill_at, slot.stopping_with = None, None
        if not slot.alive:
            return
        deadline = now + (self.reap_timeout if reap_timeout is None else reap_timeout)
        slot.reap_by = deadline if slot.reap_by is None else min(slot.reap_by, deadline)

    def _give_up(self, slot: RankSlot) -> None:
        """The rank outlived SIGKILL: stop waiting. The guard keeps its process group (we never
        told it the rank was gone) and sweeps it when we exit."""
        slot.unreapable = True
        slot.proc.close_pidfd()
        self._strays.rank_given_up(slot.proc.pid)
        self._emit("unreapable", slot.local_rank, pid=slot.proc.pid, kernel_state=kernel_state(slot.proc.pid),
                   waited_s=self.reap_timeout)
        # It got SIGKILL, so that is how it counts: a failure, the group's end unless we stopped it.
        slot.failure = ProcessFailure(
            slot.local_rank, slot.proc.pid, -signal.SIGKILL, self.error_file(slot.local_rank),
            rank=self.global_ranks[slot.local_rank], exited_at=time.time(), raise_bad_file=False,
        )
        if not slot.stopped_by_us and not self._stopping:
            self._fail_group("another rank failed")

    def _swept(self, now: float) -> bool:
        """One pass of the end sweep: True once nothing the ranks left is running (or what is left
        would not die of SIGKILL either: the guard tries again after we exit)."""
        if not self._sweep.due(now):
            return False
        found = self._strays.find(with_marker=self._sweep.deadline is None)
        return self._sweep.step(found, now, self._groups_stopping())

    def _groups_stopping(self) -> set[int]:
        """The process groups of ranks sent a stop signal and within its grace (ranks gone, their
        groups maybe not)."""
        return {slot.proc.pid for slot in self.slots
                if slot.proc is not None and slot.stopping_with is not None and slot.kill_at is not None}

    def _reap(self, slot: RankSlot) -> None:
        proc = slot.proc
        if proc is None or proc.returncode is not None or proc.poll() is None:
            return
        code = proc.returncode
        proc.close_input()
        if callable(self.entrypoint):
            self._mark_exited(slot.local_rank)
        self._strays.rank_reaped(proc.pid)
        if -code in slot.user_signals:  # it died of the user's signal, later than the grace: still theirs
            slot.stopped_by_us = slot.stopped_by_user = True
        if slot.stopped_by_us and slot.kill_at is None:  # what is left in its group has the user's grace
            slot.kill_at = slot.survived_by
        self._emit("exited", slot.local_rank, pid=proc.pid, exitcode=code,
                   signal=killed_by(code), by_us=slot.stopped_by_us)
        if code == 0:
            return
        held = self._rank_dirs.get(slot.local_rank)  # none if the disk was too full to make it
        slot.failure = ProcessFailure(
            slot.local_rank, proc.pid, code, self.error_file(slot.local_rank) if held else None,
            rank=self.global_ranks[slot.local_rank], exited_at=proc.exited_at,
            error_dir_fd=held.fd if held else None, raise_bad_file=False,  # the rank's file: named, not raised
        )
        if slot.stopped_by_us or self._stopping:
            return
        if -code in OUTSIDE_STOP_SIGNALS and self.outside_stop_window > 0:
            self._hold(slot, -code)
        else:
            self._fail_group("another rank failed")

    def _mark_exited(self, local_rank: int) -> None:
        """Tell the rank's peers waiting to exit that it ended. A full disk refuses the marker, a
        new file (a rank that ended without a value left its peers waiting until close()): the
        rank's payload, a file already there that it read as it started, becomes the marker, a
        rename that takes no space."""
        marker = self._exited_path(local_rank)
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o600))
            return
        except OSError as exc:
            error = exc.strerror or str(exc)
        try:
            os.replace(self._payload_path(local_rank), marker)
            told = True
        except OSError:
            told = False
        self._emit("exit_marker_failed", local_rank, path=marker, error=error, peers_told=told)

    def _survived(self, slot: RankSlot) -> None:
        """The rank outlived a stop signal the user sent it alone by the grace: it handled it
        (pdb breaks on SIGINT; a loop may catch KeyboardInterrupt) and runs on. It is no longer
        stopping, and an end of its own from now on is a failure, as any rank's, unless that
        signal is what it dies of (a checkpoint that took longer than the grace)."""
        slot.survived_by = None
        if slot.kill_at is None and not self._stopping and not slot.restart_pending:
            slot.stopped_by_us = slot.stopped_by_user = False
            slot.stopping_with = None
            self._emit("signal_survived", slot.local_rank, pid=slot.proc.pid, grace_s=self.shutdown_timeout)

    def _hold(self, slot: RankSlot, sig: int) -> None:
        """The rank died of a stop signal we did not send: maybe a stop of the whole job from
        outside (a scheduler signals every process at once) that has yet to reach us. Its end
        counts as a failure only once the window passed without a stop of the group."""
        slot.held_until = time.monotonic() + self.outside_stop_window
        self._emit("exit_held", slot.local_rank, pid=slot.proc.pid, signal=signal.Signals(sig).name,
                   window_s=self.outside_stop_window)

    def _end_hold(self, slot: RankSlot, outcome: str, **fields: Any) -> None:
        """outcome: "failure" (counts as one), "stopped" (part of the group's stop), "restarted"."""
        slot.held_until = None
        slot.stopped_from_outside = outcome == "stopped"
        self._emit("exit_held_ended", slot.local_rank, pid=slot.proc.pid, outcome=outcome, **fields)

    def _fail_group(self, why_held_ends: str) -> None:
        """A rank failed on its own: one failure ends the group, and every held end counts as a
        failure too (the first to end is still the root cause)."""
        for slot in self.slots:
            if slot.held_until is not None:
                self._end_hold(slot, "failure", reason=why_held_ends)
        self._stop_all(signal.SIGTERM, self.shutdown_timeout)

    def wait_activity(self, timeout: float) -> None:
        """Sleep until a rank exits, a command arrives, a deadline (grace, reaping) is due, or
        `timeout` passes."""
        with self._lock:
            live = [s for s in self.slots if s.alive]
            fds = [s.proc.pidfd for s in live if s.proc.pidfd is not None]
            now = time.monotonic()
            sweeps = [self._sweep, *(s.leftovers for s in self.slots if s.leftovers is not None)]
            deadlines = [t for s in live for t in (s.kill_at, s.reap_by, s.survived_by) if t is not None]
            # (a reaped rank's group: SIGKILL at the grace's end; a restart waits on it, looked at again soon)
            deadlines += [min(s.kill_at, time.monotonic() + 0.05) if s.restart_pending else s.kill_at
                          for s in self.slots if s.kill_at is not None and not s.alive]
            deadlines += [s.held_until for s in self.slots if s.held_until is not None]
            # (a restart waiting for the old output: looked at again soon, the pump's EOF wakes nothing)
            deadlines += [min(s.respawn_by, time.monotonic() + 0.02) for s in self.slots if s.respawn_by is not None]
            deadlines += [t for sweep in sweeps if (t := sweep.wake_at(now)) is not None]
        if deadlines:
            timeout = min(timeout, max(0.0, min(deadlines) - time.monotonic()))
        poller = select.poll()
        for fd in (*fds, self._waker.fd):
            poller.register(fd, select.POLLIN)
        try:
            if any(fd == self._waker.fd for fd, _ in poller.poll(max(0.0, timeout) * 1000)):
                self._waker.drain()
        except OSError:
            pass  # a pidfd closed under us by a concurrent reap: just run the step again

    def wake(self) -> None:
        """Wake `wait_activity` (safe from any thread, from a signal handler, and after close)."""
        self._waker.wake()

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Block until every rank ended (the result) or `timeout` passed (None); <0 blocks."""
        if timeout != timeout:  # nan: no deadline would ever pass, and none is meant by it either
            raise UsageError("bad timeout nan: expected seconds, or a negative number to wait to the end")
        check_timeout("period", period)
        # Exits wake the wait at once; the period only bounds each nap. torch's 0 polls without
        # one: a short nap here, never a wait that ends before the timeout.
        nap = period or _SHORTEST_NAP
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            result = self.step()
            if result is not None:
                return result
            left = nap if deadline is None else min(nap, deadline - time.monotonic())
            if left <= 0:
                return None
            self.wait_activity(left)

    # ----- commands ----------------------------------------------------------------------------
    def _stop_all(self, sig: int, grace: float) -> None:
        for slot in self.slots:  # (a failure has ended the holds already, as failures)
            if slot.held_until is not None:
                self._end_hold(slot, "stopped", stop_signal=signal_name(-sig))  # SIG40 for a real-time one
        self._stopping = True
        self._strays.note_below_ranks()
        self._sweep.hurry(grace, time.monotonic())
        for slot in self.slots:
            slot.restart_pending = False
            if slot.leftovers is not None:  # the end sweep finds what it swept, and goes on from there
                self._sweep.take_over(slot.leftovers)
                slot.leftovers = None
            if slot.alive:
                self._stop_slot(slot, sig, grace)
            elif slot.kill_at is not None:  # its process is gone, not the rest of its group: a shorter grace holds there too
                slot.kill_at = min(slot.kill_at, time.monotonic() + grace)

    def _stop_slot(self, slot: RankSlot, sig: int, grace: float) -> None:
        slot.stopped_by_us = True
        # A rank already stopping with this signal (the group's failure shutdown, a restart, the
        # user's own) is not sent it again: that would re-enter its checkpoint handler. A shorter
        # grace only brings its SIGKILL forward.
        if slot.stopping_with != sig:
            slot.proc.signal_group(sig)
        if sig != signal.SIGKILL:
            # A stopped process (paused here, or with `kill -STOP` from elsewhere) sees the signal
            # only once resumed: without this it would wait out the grace and get SIGKILL.
            slot.proc.signal_group(signal.SIGCONT)
            slot.stopping_with = sig
        deadline = time.monotonic() + grace
        slot.kill_at = deadline if slot.kill_at is None else min(slot.kill_at, deadline)

    def stop(self, sig: int = signal.SIGTERM, grace: float | None = None, *, reap_timeout: float | None = None) -> None:
        """Ask every rank to stop (`sig` now, SIGKILL after the grace); returns at once. A
        `reap_timeout` shorter than the context's gives up sooner on ranks that outlive SIGKILL
        (a second Ctrl-C: the user wants out now)."""
        if grace is not None:
            check_timeout("grace", grace)
        with self._lock:
            self._stop_all(sig, self.shutdown_timeout if grace is None else grace)
            if reap_timeout is not None:
                now = time.monotonic()
                for slot in self.slots:
                    if slot.alive or slot.kill_at is not None:
                        self._kill(slot, now, reap_timeout)
        self.wake()

    def signal_rank(self, local_rank: int, sig: int) -> bool:
        """Send `sig` to one rank on the user's behalf: its whole process group, except for
        USR1/USR2, which go to the rank process alone."""
        with self._lock:
            slot = self.slots[local_rank]
            if not slot.alive:
                return False
            slot.user_signals.add(sig)  # should it die of it (USR2 unhandled, say), that is the user's doing
            if sig in STOP_SIGNALS:
                slot.stopped_by_us = slot.stopped_by_user = True
                if sig != signal.SIGKILL and slot.kill_at is None:
                    slot.survived_by = time.monotonic() + self.shutdown_timeout
            self._emit("signalled", local_rank, pid=slot.proc.pid, signal=signal.Signals(sig).name)
            if sig == signal.SIGKILL:
                self._kill(slot, time.monotonic())
                return True
            if sig in LEADER_ONLY_SIGNALS:
                return slot.proc.signal_leader(sig)
            sent = slot.proc.signal_group(sig)
            if sent and sig in STOP_SIGNALS:
                slot.stopping_with = sig
                # Paused (here, or `kill -STOP` elsewhere), it would not see the signal until
                # resumed: it would count as having survived it by the grace, and die of it
                # later as a failure of its own. As the group's stop does.
                slot.proc.signal_group(signal.SIGCONT)
            return sent

    def restart_rank(self, local_rank: int, grace: float | None = None) -> bool:
        """Stop one rank (with the grace) and start it again in this context. False once the
        group has ended or is stopping: there is nothing left to restart it into (started during
        the stop, it was nobody's to stop, and the group waited on it to end on its own). Every
        rank gone and what they left being swept is an end too: a rank's own sweep would signal
        again what that one had (a second SIGTERM), and the run go on past its SIGKILL."""
        if grace is not None:
            check_timeout("grace", grace)
        with self._lock:
            if self._result is not None or self._stopping or self._sweep.deadline is not None:
                return False
            slot = self.slots[local_rank]
            grace = self.shutdown_timeout if grace is None else grace
            if not slot.restart_pending:  # (a second restart asked for meanwhile changes nothing)
                slot.leftovers = Sweep(grace, weakly(self._emit_for, local_rank))
            slot.restart_pending = True
            if slot.alive:
                self._strays.note_below_ranks([slot.proc.pid])  # its helpers that left its group
                self._stop_slot(slot, signal.SIGTERM, grace)
            self._emit("restart_requested", local_rank)
        self.wake()
        return True

    def send_input(self, local_rank: int, data: bytes) -> int:
        """Write `data` to a running rank's stdin (rank_stdin="pipe"); the bytes it took now.
        OSError when it is not running or does not read from us."""
        with self._lock:
            slot = self.slots[local_rank]
            if not slot.alive:
                raise OSError(errno.ESRCH, "it is not running")
            taken = slot.proc.write_input(data)
            if self.pty is None:  # a pipe does not echo: show the line in the pane as a terminal would
                slot.ring.feed(STDOUT, data[:taken])
            return taken

    def pids(self) -> dict[int, int]:
        return {s.local_rank: s.proc.pid for s in self.slots if s.proc is not None}

    # ----- results and teardown ----------------------------------------------------------------
    def _collect(self) -> RunProcsResult:
        result = RunProcsResult()
        drain_until = time.monotonic() + 0.5  # a stray grandchild may hold a pipe: do not wait on it
        for slot in self.slots:
            r = slot.local_rank
            if slot.proc is not None:
                slot.proc.output_drained(timeout=max(0.0, drain_until - time.monotonic()))
            result.stdouts[r], result.stderrs[r] = self.stdouts[r], self.stderrs[r]
            if slot.unreapable:
                result.unreapable[r] = slot.proc.pid
            if slot.failure is not None and not self._returned_before_stop(slot):
                result.failures[r] = slot.failure
            else:  # a binary returns nothing: None, as torch reports it
                result.return_values[r] = self._read_return_value(r) if callable(self.entrypoint) else None
        own = {r: f for r, f in result.failures.items() if not self.slots[r].stopped_by_us}
        # As torch: function ranks report the ranks that failed, not the ones stopped because of
        # them; binary ranks report those too (torch keeps their SIGTERM "for bookkeeping").
        if own and callable(self.entrypoint):
            result.failures = own
        if result.failures:
            result.return_values = {}  # as torch: a failed group has no return values
        return result

    def _returned_before_stop(self, slot: RankSlot) -> bool:
        """A function rank that had returned, and was waiting for its peers when it was stopped
        (close(), stop(), a peer's failure): it finished, so its end is no failure."""
        return callable(self.entrypoint) and slot.stopped_by_us and os.path.exists(self._result_path(slot.local_rank))

    def _read_return_value(self, local_rank: int) -> Any:
        import pickle  # function ranks only: a command line's start does not pay for it

        try:
            with open(self._result_path(local_rank), "rb") as f:
                return pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None

    @property
    def ended(self) -> bool:
        """Every rank is accounted for: the result is known."""
        return self._result is not None

    def close(self, death_sig: int | None = None, timeout: float = 30,
              between: Callable[[], None] | None = None) -> None:
        """Stop every rank's whole group (`death_sig`, then SIGKILL after `timeout`) and clean up.
        No `death_sig` (None, or 0 as torch tests it) is SIGTERM, torch's default; a negative
        `timeout` is 0, as torch's (SIGKILL at once). Both are checked before any rank is
        signalled. Bounded: a rank that outlives SIGKILL by `reap_timeout` is left to the guard.
        `between` runs on each pass of the wait (the agent applies its commands there: a second
        Ctrl-C still acts while closing)."""
        death_sig = check_death_sig(death_sig)
        timeout = check_timeout("timeout", 0 if _negative(timeout) else timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:  # the signals sent too: a stop signal that came while they went out left this closed for good
            with self._lock:
                for slot in self.slots:  # a rank that ended on its own before close() failed by itself,
                    self._reap(slot)     # not by this stop: reaped first, it is reported as it ended
                self._stop_all(death_sig, timeout)
            while self.step() is None:
                if between is not None:
                    between()
                self.wait_activity(0.05)
        except BaseException:  # a second stop signal (SignalException) cut the wait short:
            with self._lock:   # a later close() finishes it, as torch's close() can be called again
                self._closed = False
            raise
        with signals_held():  # bounded; a signal meanwhile is raised once all is let go
            self._release()
            self._let_go_of_signals()

    def _let_go_of_signals(self) -> None:
        holds, self._holds_signals = self._holds_signals, False  # (once: a close may be retried)
        restore_signals(holds)

    def _release(self) -> None:
        """Let go of everything once the ranks are accounted for. Every wait here has its own
        deadline, and no lock is held: a UI reading snapshots meanwhile never stalls."""
        for slot in self.slots:  # the ranks are reaped; a grandchild may still hold the group
            if slot.proc is not None:
                slot.proc.signal_group(signal.SIGKILL)
                slot.proc.close_input()
        self._tell_guard("done")  # it sweeps strays that left the group while we drain
        if self._guard is not None:
            with contextlib.suppress(OSError, ValueError):  # a guard killed meanwhile: "done" stays unsent
                self._guard.stdin.close()
        if self._pump is not None:
            self._pump.close(timeout=2.0)
        if self._console is not None and self._owns_console:
            self._console.close()
        self._finish_guard()
        with self._lock:
            self._sweep.close()
            self._strays.close()
            for slot in self.slots:
                if slot.leftovers is not None:
                    slot.leftovers.close()
            for held in (*self._rank_dirs.values(), self.dir):
                held.close()
            for view in (self.filtered_stdout, self.filtered_stderr):
                if view is not None:
                    with contextlib.suppress(OSError):  # what a caller wrote there and could not be flushed
                        view.close()
            for copy in self._filtered.values():
                copy.close()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _finish_guard(self) -> None:
        if self._guard is None:
            return
        # A rank that outlived SIGKILL keeps the guard at it for its own 5 s: no waiting on that.
        if wait_exit(self._guard, timeout=0.5 if any(s.unreapable for s in self.slots) else 5):
            forget_own_child(self._guard.pid)
        # (else it is sweeping strays with their grace; it exits on its own)

    # ----- for UIs -----------------------------------------------------------------------------
    def _emit(self, event: str, local_rank: int, **fields: Any) -> None:
        self._emit_group(event, local_rank=local_rank, rank=self.global_ranks[local_rank], **fields)

    def _emit_for(self, local_rank: int, event: str, **fields: Any) -> None:
        self._emit(event, local_rank, **fields)

    def _emit_group(self, event: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event({"event": event, **fields})


class MultiprocessContext(PContext):
    """Ranks that run a Python callable in a fresh interpreter each; return values come back.
    `start_method` is the one asked for, as torch's keeps it (every rank starts as spawn does)."""


class SubprocessContext(PContext):
    """Ranks that run a binary; arguments are passed as strings."""


def check_death_sig(death_sig: object) -> int:
    """close()'s signal, checked before any rank is signalled: none (None, 0: torch's `not
    death_sig`) is SIGTERM; else a signal this system has. A number it lacks was os.killpg's
    bare `[Errno 22] Invalid argument`, naming neither the argument nor the value (torch's close
    raises AttributeError for any plain number)."""
    if not death_sig:
        return signal.SIGTERM
    if isinstance(death_sig, bool) or not isinstance(death_sig, int):
        raise TypeError(f"death_sig must be a signal (signal.SIGTERM, or its number), "
                        f"not {type(death_sig).__name__} {repr(death_sig)[:80]}")
    if death_sig not in signal.valid_signals():
        shown = int(death_sig) if abs(death_sig) < 1 << 64 else "(a number of 20 digits or more)"  # str() refuses 4300
        raise UsageError(f"bad death_sig {shown}: expected a signal of this system, "
                         f"1 to {max(signal.valid_signals())} (signal.SIGTERM, signal.SIGKILL, ...)")
    return death_sig


def _negative(timeout: object) -> bool:
    return isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and timeout < 0


_START_METHODS = ("spawn", "fork", "forkserver")


def check_start_method(method: str) -> None:
    if method not in _START_METHODS:
        raise ValueError(f"unknown start method {method!r}: expected one of {', '.join(_START_METHODS)}")


def set_start_method(method: str) -> None:
    """Accepted for parity. Every callable rank runs in a fresh interpreter (spawn semantics):
    forking a parent that holds threads and CUDA state is what makes fork unsafe for training,
    so the method is checked and otherwise ignored."""
    check_start_method(method)


def __getattr__(name: str) -> Any:
    """`start_processes` moved to core/processes_api.py; `from ranktop.core.context import
    start_processes` still works (loaded on first use: that module imports this one)."""
    if name in ("start_processes", "RanksMismatch"):
        from ranktop.core import processes_api

        return getattr(processes_api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
