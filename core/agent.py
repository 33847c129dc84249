"""The local agent: runs one role's ranks on this node, restarts the group on failure, keeps the
event log, and is what the CLI and the TUI drive (snapshots out, commands in). Its parts, each in
a module of its own: the command queue and the signal policy (core/agent_commands.py), the
rendezvous hooks (core/agent_rendezvous.py), stall detection (core/stalls.py) and the root cause
of a failure (core/root_cause.py).

There is one monitor loop (`_monitor`), running in whichever thread called `run()`, and it is the
only thread that changes the group's state. Other threads read it (snapshots), and one writes
beside it: `hold_stall_clock`, called by the thread about to have ranks print their stacks, marks
their coming output as the dump, not their speech, which only the stall clock reads
(core/stalls.py says why that is safe). Every command (core/commands.py), from a UI, an API
caller or a signal to ranktop itself, goes into one queue that the loop drains on each pass, and
also while it waits for an attempt to close: a stop that arrives between two attempts is applied,
never recorded and forgotten. Callers wait for the loop's Ack; a signal handler does not.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from ranktop.core.agent_commands import AgentCommands
from ranktop.core.agent_rendezvous import AgentRendezvous, store_call_left_blocked
from ranktop.core.context import (
    REAP_TIMEOUT,
    PContext,
    RunProcsResult,
    plan_streams,
    prefix_for,
    set_start_method,
)
from ranktop.core.errors import (
    ProcessFailure,
    RankStartError,
    SignalException,
    UsageError,
    describe_exit,
    get_error_handler,
    killed_by,
)
from ranktop.core.events import EventLog
from ranktop.core.layout import (
    ERROR_FILE,
    FINAL_FILE,
    FINAL_KEY,
    Dir,
    RunDir,
    UnmadeDir,
    check_run_id,
    final_seal_of,
)
from ranktop.core.limits import LINES, POSITIVE_SECONDS, check_timeout, ensure_fds_for
from ranktop.core.output import ConsoleWriter, binary_console, console_budget, console_name, console_stall
from ranktop.core.process import exit_status_for_signal, refuse_while_loading_main
from ranktop.core.prompts import PROMPT_QUIET, rank_prompt
from ranktop.core.rendezvous import PEER_RESTART_WORDS, USER_RESTART, USER_STOP, Rendezvous
from ranktop.core.root_cause import UserActions, after_user, find_root_cause, rank_failed
from ranktop.core.sanitize import check_console_prefix, clean, clean_console
from ranktop.core.signals import OUTSIDE_STOP_WINDOW, StopAction
from ranktop.core.spec import WorkerSpec, faulthandler_env, free_port, pty_size, rank_args, rank_env
from ranktop.core.stalls import StallWatch
from ranktop.core.state import EarlierAttempts, GroupSnapshot, GroupState, LogLoss, RankSnapshot, RankState, RootCause
from ranktop.core.stdio import lost_told
from ranktop.core.strays import LOOK_SECONDS, adopting
from ranktop.core.weak import weakly

__all__ = ["LocalAgent", "LocalElasticAgent", "RunResult", "Worker", "WorkerGroup", "WorkerState", "new_run_id",
           "other_interpreter", "store_call_left_blocked"]


def _check_arguments(spec: WorkerSpec, start_method: str, prefix_template: str | None, *,
                     shutdown_timeout: float, exit_barrier_timeout: float, stall_timeout: float | None,
                     ring_lines: int) -> None:
    """A UsageError in one line for the first bad argument, before anything of the run exists."""
    set_start_method(start_method)  # checked; every rank starts as a fresh interpreter anyway
    check_timeout("shutdown_timeout", shutdown_timeout)
    check_timeout("exit_barrier_timeout", exit_barrier_timeout)  # torch's logs a traceback at the barrier
    if stall_timeout is not None:
        POSITIVE_SECONDS.check("stall_timeout", stall_timeout)
    LINES.check("ring_lines", ring_lines)
    ensure_fds_for(spec.local_world_size)  # before anything exists: a shortage is one line
    check_console_prefix("role", spec.role)
    check_console_prefix("log line prefix template", prefix_template)


# torch's name for the group state (`RunResult.state`, the `run_finished` event): the same enum.
WorkerState = GroupState


@dataclass
class RunResult:
    """The end of a run; return values and failures are keyed by global rank."""

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    root_cause: RootCause | None = None
    stop_signal: int | None = None  # the signal that stopped us, if one did
    incomplete_logs: tuple[LogLoss, ...] = ()  # log files a write failed on (disk full)
    # global rank -> pid of each rank that outlived SIGKILL (stuck in the kernel), left to the guard
    unreapable: dict[int, int] = field(default_factory=dict)
    # Why this node's run ended with no rank of its own to blame, if it did: a rendezvous round
    # that failed, a node that gave up (the rendezvous closed) or failed while this node had no
    # restarts left, the store lost, or a rank that could not be started. (Its name is older than
    # the last of these: it is API, and the protocol's, so it stays.)
    rendezvous_error: str | None = None
    interpreter: str | None = None  # the ranks' Python, when not ranktop's own (see GroupSnapshot)
    end_note: str | None = None  # how its exit barrier ended without every node (see GroupSnapshot)
    user_ended: tuple[int, ...] = ()  # global ranks the user killed or signalled to their end (see GroupSnapshot)

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED

    @property
    def exit_status(self) -> int:
        """The CLI's exit status: 0 success, 1 a rank failed or output was lost on its way to a
        log file, 128+N stopped by signal N, 130 stopped by the user (a TUI's K or q, `ranktop
        stop`): an interrupt, as Ctrl-C's, whichever way it was asked for, never a rank's failure."""
        if self.stop_signal is not None:
            return exit_status_for_signal(self.stop_signal)
        if self.state == WorkerState.STOPPED:  # no signal stopped it: the user did
            return exit_status_for_signal(signal.SIGINT)
        return 0 if self.state == WorkerState.SUCCEEDED and not self.incomplete_logs else 1


@dataclass
class Worker:
    """torch's Worker: one rank of the group as the agent sees it (`id`: its pid while it runs)."""

    local_rank: int
    global_rank: int
    role_rank: int
    world_size: int
    role_world_size: int
    id: int | None = None


@dataclass
class WorkerGroup:
    """torch's WorkerGroup, as `get_worker_group()` answers it: a picture of the group now."""

    spec: WorkerSpec
    workers: list[Worker]
    store: Any
    group_rank: int
    group_world_size: int
    state: WorkerState
    master_addr: str
    master_port: int


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + os.urandom(2).hex()


class LocalAgent(AgentRendezvous, AgentCommands):
    """Runs `spec` on this node: per-rank environment, restarts, events, snapshots, commands."""

    def __init__(
        self,
        spec: WorkerSpec,
        log_dir: str | None = None,
        start_method: str = "spawn",
        log_line_prefix_template: str | None = None,
        *,
        shutdown_timeout: float = 10.0,
        stall_timeout: float | None = None,
        console: bool = True,
        color: bool = False,
        ring_lines: int = 10_000,
        sampler: Any = None,
        on_stalls: Callable[[list[RankSnapshot]], None] | None = None,
        faulthandler: bool = True,
        sanitize_console: bool = False,
        reap_timeout: float = REAP_TIMEOUT,
        exit_barrier_timeout: float = 300.0,
        signals_to_handle: tuple[int, ...] = (),
        echo_events: bool = False,
        duplicate_filters: dict[int, tuple[str, ...]] | None = None,
        on_notice: Callable[[str], None] | None = None,
        hangup_stops: bool = True,
        on_under_way: Callable[[], None] | None = None,
        numbered_run_dir: bool = False,
        typed_stdin: bool = False,
        log_dir_name: str = "log_dir",
    ):
        refuse_while_loading_main(type(self).__name__)
        self.start_method = start_method
        self.prefix_template = log_line_prefix_template or os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
        _check_arguments(spec, start_method, self.prefix_template, shutdown_timeout=shutdown_timeout,
                         exit_barrier_timeout=exit_barrier_timeout, stall_timeout=stall_timeout, ring_lines=ring_lines)
        spec = _bind_numa(spec)
        self.spec = spec
        self.shutdown_timeout = shutdown_timeout
        self.stall_timeout = stall_timeout
        self.console = console
        self.console_stall = console_stall()  # (checked with the rest: a bad value is one line, nothing started)
        # Ranks read a pipe that SendInput types into (the TUI's `i`, also attached): always
        # without a console, and with one where ours is nobody's keyboard (--detach: /dev/null)
        self.rank_stdin = "pipe" if typed_stdin or not console else "inherit"
        self.sanitize_console = sanitize_console  # the console tee through core.sanitize; files stay raw
        self.color = color
        self.ring_lines = ring_lines
        self.sampler = sampler  # core.stats.StatsSampler or None: cpu/rss/GPU per rank
        self.on_stalls = on_stalls  # each monitor pass's stall and prompt reports, if any
        self.reap_timeout = reap_timeout  # how long a SIGKILLed rank may take to go before it is given up on
        self.faulthandler = faulthandler  # SIGUSR1 dumps a Python rank's stacks (no ptrace needed)
        # Handled besides SIGINT/TERM/HUP (which ranktop always handles: no rank may outlive it):
        # a stop signal like those, or a notice (USR1/USR2) passed on to the ranks.
        self.signals_to_handle = tuple(signals_to_handle)
        self.on_notice = on_notice  # one-line news for the person watching (rendezvous rounds)
        self.exit_barrier_timeout = exit_barrier_timeout
        self._interpreter = other_interpreter(spec)
        self._native_ranks = not callable(spec.entrypoint) and not _is_python(spec)  # py-spy's --native
        # Called once, when the run first has something to watch: its first ranks started, or it
        # waits for a rendezvous round. The command line serves the run then, not before: what
        # only serves observers must not hold up the ranks' start.
        self._on_under_way = on_under_way
        # `log_dir_name`: the command line's is --log-dir; an API caller never used that flag
        self._place_run(spec, log_dir, numbered_run_dir, log_dir_name)
        self._set_up_output(echo_events, duplicate_filters)
        # Only final.json gets the key: a client that saw its seal (the snapshot's, run_started's)
        # knows a final.json the engine wrote from one a rank planted.
        self._final_key = os.urandom(16).hex()
        self.final_seal = final_seal_of(self._final_key)
        self.events = self._open_events()
        self._stalls = StallWatch(stall_timeout, self.events, on_stalls, sampler)
        # the actions the user took on single ranks: a root cause that follows one names it
        self._user_actions = UserActions()
        self._set_up_group_state()
        self._set_up_command_queue(hangup_stops, signals_to_handle)
        self._set_up_rendezvous_state()

    def _place_run(self, spec: WorkerSpec, log_dir: str | None, numbered_run_dir: bool, log_dir_name: str) -> None:
        """The run's rendezvous (if its spec has a handler), its id, its run directory and its master port."""
        self.rendezvous = (Rendezvous(spec.rdzv_handler, spec.role, spec.local_world_size)
                           if spec.rdzv_handler is not None else None)
        if self.rendezvous is not None:
            self.rendezvous.on_store_change = weakly(self._store_changed)
            self.rendezvous.on_every_node_dropped = weakly(self._every_node_dropped)
            self.rendezvous.on_state_refused = weakly(self._state_refused)
            self.rendezvous.on_peers_done = weakly(self._peers_done)
        shared_id = self.rendezvous.run_id if self.rendezvous is not None else "none"
        if spec.run_id is not None:
            self.run_id = check_run_id(spec.run_id)
        else:
            self.run_id = check_run_id(shared_id) if shared_id != "none" else new_run_id()
        # Made fresh and held until the end: every file of the run is opened through it. The
        # rendezvous id is the same on every node: nodes sharing a file system get <id>.1, <id>.2...
        self._shared_id = spec.run_id is None and shared_id != "none"
        # `numbered_run_dir`: elastic_launch's, whose run id may serve several calls, as torch's does
        self.layout = RunDir.create(log_dir, self.run_id, numbered=self._shared_id or numbered_run_dir,
                                    log_dir_name=log_dir_name)
        self.run_dir = self.layout.path
        self.master_port = spec.master_port or free_port()
        self._asked_spec = spec  # its master_addr/port, where set, beat every round's (placed() replaces them)

    def _set_up_output(self, echo_events: bool, duplicate_filters: dict[int, tuple[str, ...]] | None) -> None:
        """The console writer (headless), the echo of events to it, and the duplicate-line filters."""
        spec = self.spec
        # Headless, one console writer serves every attempt: the ranks' tee and our own lines,
        # none of which may wait on a stuck terminal (the monitor loop says things too).
        self._tee = (ConsoleWriter(budget=console_budget(2 * spec.local_world_size),
                                   clean=clean_console if self.sanitize_console else None,
                                   on_lost=weakly(self._console_lost))
                     if self.console else None)
        self.console_unshown = 0  # bytes of output the console had not taken when the run ended
        self.console_cut_by: int | None = None  # the stop signal that cut the wait for it short, if one did
        # torchrun's --event-log-handler console (or torch's WorkerSpec field of that name)
        echo_events = echo_events or spec.event_log_handler == "console"
        self._echo = (lambda line: self.say("ranktop: event " + line)) if echo_events else None
        if duplicate_filters is None:  # the Python API's: torch's WorkerSpec fields
            duplicate_filters = {1: tuple(spec.duplicate_stdout_filters or ()), 2: tuple(spec.duplicate_stderr_filters or ())}
        # (surrogateescape: a filter typed with bytes that are not UTF-8 matches those bytes)
        self.duplicate_filters = {stream: tuple(n.encode(errors="surrogateescape") for n in needles)
                                  for stream, needles in duplicate_filters.items()}

    def _set_up_group_state(self) -> None:
        """The group before its first start: attempts, restarts, the ranks' context, the result."""
        self.attempt = 0
        self.state = GroupState.INIT
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.pcontext: PContext | None = None
        self._pcontext_attempt = 0  # the attempt self.pcontext's ranks belong to
        self._generation = -1  # the group's starts so far, less one: each start's rings are new
        # Starts of the group since the last restart was spent: nodes joining restart the group
        # without spending one, and that start logs to attempt_<k>.<n>.
        self._same_attempt_starts = 0
        # Attempts the user's RestartGroup started: they advance the attempt and spend no restart.
        self.user_restarts = 0
        self._between_attempts = False  # closing one attempt to start the next
        # "attempt_<k>: why it ended" for the attempts before this one (the first, the last few)
        self._earlier_attempts = EarlierAttempts()
        self._earlier_losses: list[LogLoss] = []  # incomplete logs of the attempts before this one
        self._started = threading.Event()
        self.root_cause: RootCause | None = None
        self._stop_signal: int | None = None
        self._user_stop = False
        self._restart_requested = False
        self._user_ended: tuple[int, ...] = ()  # once the run ended: global ranks the user ended
        self.result: RunResult | None = None  # once run() returned
        self._ran = False  # run() was called: its run directory and event log go with that one run
        # Why this node's run ended with no rank of its own to blame (RunResult.rendezvous_error)
        self._node_error: str | None = None
        self._start_error: RankStartError | None = None  # why a rank could not be started, if one could not

    def _open_events(self) -> EventLog:
        """The run directory and its event log, with the first event written: a disk that is full
        (or read-only) from the start is a UsageError, before any rank starts."""
        events = None
        try:
            events = EventLog(self.layout.open_events())
            events.echo = self._echo
            # Under a rendezvous each round decides the world, this node's rank and where the ranks
            # meet (rendezvous_joined says): null here rather than values no round gave.
            by_round = self.rendezvous is not None
            events.write("run_started", strict=True, run_id=self.run_id, name=self.spec.display_name(),
                         world_size=None if by_round else self.spec.world_size,
                         node_rank=None if by_round else self.spec.node_rank,
                         master_port=None if by_round else self.master_port, pid=os.getpid(),
                         final_seal=self.final_seal)
            return events
        except OSError as exc:
            if events is not None:
                events.close()
            self.layout.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)  # ours, made just now: leave no empty run
            raise UsageError(f"cannot start the run in {self.run_dir}: {exc.strerror or exc}") from None

    # ----- the run -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Run to the end (restarting as allowed); the calling thread becomes the monitor loop.
        Once per agent: a second call raises RuntimeError (torch's would run the group again)."""
        if self._ran:  # its run directory, made with the agent, is closed at the end of the first
            raise RuntimeError(f"this agent has run already (its run: {self.run_dir}); "
                               "make a new agent for another run")
        self._ran = True
        handlers = self._install_signal_handlers()
        try:
            with self._quiet_lost_heartbeats():
                self.result = self._finish(self._attempts())
            self._close_attempt()
            self._write_final()
            return self.result
        finally:
            self._end_watch()
            self._close_attempt()  # after an error too: no rank outlives run()
            self._stop_accepting()
            self._close_console()  # with our handlers still there: a stop signal cuts its wait short
            self._restore_signal_handlers(handlers)
            self.events.close()
            self.layout.close()

    def _close_console(self) -> None:
        """Let the console take what waits for it, for as long as it keeps taking it, or until a
        stop signal comes (Ctrl-C at a stuck terminal: the run is over, nothing is left to wait for)."""
        if self._tee is not None:
            self.console_unshown = self._tee.close(self.console_stall, cut_short=self._stopped_at_the_end)
            if self.console_unshown:
                cut_by = None if self.console_cut_by is None else signal.Signals(self.console_cut_by).name
                self.events.write("console_behind", bytes=self.console_unshown, stall_seconds=self.console_stall,
                                  cut_short_by=cut_by)

    def _stopped_at_the_end(self) -> bool:
        """Whether a stop signal came once the ranks were gone (noted, as every signal is); it
        changes no exit status: the run had ended."""
        while self.console_cut_by is None and self._pending_signals:
            signum, received_at = self._pending_signals.popleft()
            action = self._stop_rule.decide(signum, received_at)
            self.events.write("signal_received", signal=signal.Signals(signum).name, forwarded=False,
                              action=action.value)
            if action in (StopAction.FORWARD, StopAction.KILL_NOW):
                self.console_cut_by = signum
        return self.console_cut_by is not None

    def _attempts(self) -> RunProcsResult:
        """Run attempts until one ends for good; returns its result (the ranks may still close)."""
        result = RunProcsResult()
        while True:
            if not self._start_attempt():  # the rendezvous failed, or a stop came first
                return result
            result = self._monitor()
            self._end_watch()
            reason = self._restart_reason(result)
            if reason is None:
                return result
            how_it_ended = self._attempt_end(reason)
            earlier = f"attempt_{self.attempt}: {how_it_ended}"
            self._earlier_attempts.add(earlier)
            self._between_attempts = True
            try:
                self._close_attempt()  # commands are applied meanwhile: a stop here ends the run
            finally:
                self._between_attempts = False
            if self._stop_requested:
                return result
            self._restart_requested = False
            self._earlier_losses += self.pcontext.incomplete_logs()
            self._count_restart(reason)
            self.state = GroupState.RESTARTING
            self.events.write("group_restart", attempt=self.attempt, reason=reason, earlier=earlier)
            if reason == "peer_user":  # (this node's own `R` said so where it was pressed)
                self._notice(f"{PEER_RESTART_WORDS}: restarting the group as attempt_{self.attempt} "
                             "(no restart spent)")
            if reason == "failure":  # one line a restart, as the console contract says
                self._notice(f"{how_it_ended}; restarting the group: attempt_{self.attempt} "
                             f"({self.restarts_spent} of {self.spec.max_restarts} restarts spent)")

    def _count_restart(self, reason: str) -> None:
        """Only a failure spends a restart. Newcomers, or this node dropped from its round, start the
        group again as the same attempt (attempt_<k>.<n>); the user's restart starts the next
        attempt, spending none."""
        if reason in ("nodes_joined", "left_behind"):
            self._same_attempt_starts += 1
            return
        self.attempt += 1
        self._same_attempt_starts = 0
        self.user_restarts += reason in ("user", "peer_user")

    @property
    def restarts_spent(self) -> int:
        """Restarts of --max-restarts spent so far: those that followed a failure."""
        return self.attempt - self.user_restarts

    @property
    def _stop_requested(self) -> bool:
        """A stop was asked for: a signal to ranktop, or the user's Stop or KillGroup."""
        return self._stop_signal is not None or self._user_stop

    def _attempt_end(self, reason: str) -> str:
        """How the attempt that is being restarted ended, in a few words (the header, the console).
        Where nothing failed, the words begin `restarted` (state.ended_calmly reads them so)."""
        if reason == "user":  # (maybe while the group stopped for a failure: both are said)
            cause = self._find_root_cause() if self._own_failure() else None
            return "restarted by the user" if cause is None else f"{rank_failed(cause)}, then restarted by the user"
        if reason == "nodes_joined":
            return "restarted, nodes joined"
        if reason == "left_behind":
            return "restarted, dropped from the round"
        if reason == "peer_user":
            return f"restarted: {PEER_RESTART_WORDS}"
        if self._round_end is not None and self._round_end.kind in ("peer_failed", "peer_stopped"):
            return self._round_end.message  # this node's ranks were stopped for it: none of them is to blame
        cause = self._find_root_cause()
        return "failed" if cause is None else after_user(cause) + rank_failed(cause)

    def _restart_reason(self, result: RunProcsResult) -> str | None:
        if self._stop_requested:
            return None
        if self._restart_requested and not self._restart_overtaken():
            return "user"
        if self._peer_restarted():  # (its ranks may have broken meanwhile: no failure of theirs)
            return "peer_user"
        failed = self._group_failed(result) and self._node_error is None
        if self._left_behind(failed):
            return "left_behind"
        if self._nodes_joined(result):
            return "nodes_joined"
        word = self._peers_word() if failed else None
        if word in ("nodes_joined", USER_RESTART):
            return "nodes_joined" if word == "nodes_joined" else "peer_user"
        if word == USER_STOP:  # (a failure's restart, but the words name the node stopped)
            self._peer_was_stopped()
        if failed and self.restarts_spent < self.spec.max_restarts:
            return None if self._no_round_can_form() else "failure"
        return None

    def _user_ended_ranks(self, result: RunProcsResult) -> list[int]:
        """The local ranks among the group's failures whose end the user caused (a kill, or the
        very signal they sent it): no failure, as the user asked for it."""
        return [r for r in result.failures if self.pcontext.slots[r].ended_by == "user"]

    def _group_failed(self, result: RunProcsResult) -> bool:
        """A rank ended with a failure that was not the user's doing."""
        return len(result.failures) > len(self._user_ended_ranks(result))

    def _own_failure(self) -> bool:
        """A rank of the current group failed on its own (not stopped by us, the user or a stop from outside)."""
        slots = self.pcontext.slots if self.pcontext is not None else ()
        return any(s.ended_by == "itself" for s in slots if s.failure is not None)

    def _close_attempt(self) -> None:
        """Close the current attempt's context, bounded, applying commands while it waits."""
        if self.pcontext is not None:
            self.pcontext.close(timeout=self.shutdown_timeout, between=self._apply_commands)

    def attempt_dir(self, attempt: int | None = None) -> str:
        """attempt_<k>; with `attempt` None, the running group's (attempt_<k>.<n> after nodes joined)."""
        if attempt is None:
            return self.layout.attempt_path(self.attempt, self._same_attempt_starts)
        return self.layout.attempt_path(attempt)

    def _start_attempt(self) -> bool:
        """Start the group; in a rendezvous run, join the next round first (False: the rendezvous
        failed, or a stop came while waiting for it)."""
        if self.rendezvous is not None and not self._join_round():
            return False
        context = self._new_context(self._held_attempt_dir())
        self._stalls.new_group()
        previous = self.pcontext
        try:
            self.pcontext = context.start()  # what did start is stopped if a rank cannot be
        except RankStartError as exc:
            self._start_failed(exc)
            return False
        self._pcontext_attempt = self.attempt
        if previous is not None:
            previous.let_go_of_output()
        self.state = GroupState.RUNNING
        self._start_watch()
        self._started.set()
        self._now_under_way()
        return True

    def _held_attempt_dir(self) -> Dir:
        """This attempt's directory, made and held (the PContext closes it). One that cannot be
        made (out of inodes, the run directory removed under the run) is an UnmadeDir: the
        ranks run, and each log file that cannot be made is reported as a disk full midway."""
        try:
            return self.layout.attempt(self.attempt, self._same_attempt_starts)
        except OSError as exc:
            return UnmadeDir(self.attempt_dir(), exc)

    def _rank_envs(self, log_dir: Dir) -> dict[int, dict[str, str]]:
        """Each rank's variables for this attempt: torchrun's, faulthandler's for a Python rank,
        and a TERM for a rank on a terminal."""
        spec = self.spec
        envs = {
            r: rank_env(spec, r, master_port=self.master_port, restart_count=self.attempt,
                        run_id=self.run_id, error_file=os.path.join(log_dir.path, str(r), ERROR_FILE),
                        color=self.color)
            for r in range(spec.local_world_size)
        }
        if self.faulthandler and (callable(spec.entrypoint) or _is_python(spec)):
            for env in envs.values():  # (a ChainMap: os.environ decodes every variable a copy reads)
                env.update(faulthandler_env(True, collections.ChainMap(env, os.environ)))
        if spec.pty:
            for env in envs.values():
                env.setdefault("TERM", os.environ.get("TERM") or "xterm-256color")
        return envs

    def _new_context(self, log_dir: Dir) -> PContext:
        """This attempt's ranks, not yet started, writing to `log_dir`."""
        spec, n = self.spec, self.spec.local_world_size
        envs = self._rank_envs(log_dir)
        prefixes = {r: prefix_for(self.prefix_template, spec.role, spec.global_rank(r), r) for r in range(n)}
        streams = plan_streams(n, spec.redirects, spec.tee, capture_all=True,
                               console_ranks=spec.local_ranks_filter if self.console else set(),
                               prefixes=prefixes)
        pc = PContext(
            spec.display_name(), spec.entrypoint, {r: rank_args(spec.args, r) for r in range(n)}, envs, log_dir, streams,
            global_ranks={r: spec.global_rank(r) for r in range(n)}, shutdown_timeout=self.shutdown_timeout,
            ring_lines=self.ring_lines, on_event=weakly(self._on_rank_event), passthrough_console=False,
            pty=pty_size(envs[0]) if spec.pty else None, sanitize_console=self.sanitize_console,
            # headless: our stdin, as torchrun gives it (pdb works); a UI types through SendInput
            rank_stdin=self.rank_stdin, duplicate_filters=self.duplicate_filters,
            waker=self._waker, generation=self._next_generation(), reap_timeout=self.reap_timeout,
            cpu_affinity=spec.cpu_affinity, console=self._tee, outside_stop_window=OUTSIDE_STOP_WINDOW,
        )
        pc.start_method = self.start_method  # the multiprocessing child a function rank passes for
        return pc

    def _now_under_way(self) -> None:
        hook, self._on_under_way = self._on_under_way, None
        if hook is not None:
            hook()

    def _start_failed(self, exc: RankStartError) -> None:
        """A rank's process could not be made: the run ends, failed, saying why (no rank to blame)."""
        self._node_error = str(exc.strerror)
        self._start_error = exc
        self.events.write("start_failed", message=self._node_error)

    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def _monitor(self) -> RunProcsResult:
        pc = self.pcontext
        while True:
            self._apply_commands()
            self._check_round_end(pc)
            try:
                result = pc.step()
            except RankStartError as exc:  # a rank restarted on its own could not be
                self._start_failed(exc)
                pc.stop()
                continue
            if result is not None:
                return result
            idle = self.spec.monitor_interval if self.stall_timeout else 1.0
            self._stalls.note_gap(idle)
            self._check_stalls()
            pc.wait_activity(min(idle, LOOK_SECONDS) if adopting() else idle)  # orphans come without a word

    def _finish(self, result: RunProcsResult) -> RunResult:
        self._step_out_ended()  # (still stopping, before the end is final: the others' round forms without this node)
        failed = self._group_failed(result)
        self._user_ended = tuple(sorted(self.spec.global_rank(r) for r in self._user_ended_ranks(result)))
        self.state = self._end_state(failed)
        self.root_cause = self._find_root_cause() if failed and self._a_rank_to_blame() else None
        state = self.state
        if self.rendezvous is not None:
            self._leave_rendezvous(state)
            self._stop_heartbeats()
        self._pass_error_file_up()
        self.ended_at = time.time()
        run = self._run_result(state, result)
        self.events.write("run_finished", state=state.name, exit_status=run.exit_status,
                          root_cause_rank=self.root_cause.rank if self.root_cause else None,
                          # (the user's action the failure followed: "killed rank 3")
                          root_cause_after=self.root_cause.user_action_what if self.root_cause else None,
                          user_ended=list(self._user_ended),
                          incomplete_logs=[dataclasses.asdict(loss) for loss in run.incomplete_logs])
        return run

    def _end_state(self, failed: bool) -> GroupState:
        # Ranks the user ended, and none that failed: the run ends as a Stop of theirs would.
        if self._stop_requested or (self._user_ended and not failed and not self._node_error):
            return GroupState.STOPPED
        if failed or self._node_error:
            return GroupState.FAILED
        return GroupState.SUCCEEDED

    def _a_rank_to_blame(self) -> bool:
        """Whether the group's failure is one of this node's ranks' own."""
        # A stop (a signal, the user's) has no culprit among the ranks unless a rank had failed on its
        # own before it (a rank that a stop sent from outside to the whole job reached first did not).
        own_failure = self._own_failure()
        # A node that gave up, or one that failed while this node has no restarts left: the ranks
        # ranktop stopped for it are not to blame (they ended by its SIGTERM). Nor are ranks whose
        # collective broke as another node's user stopped that node.
        peer_stop = self._round_end is not None and (self._round_end.kind in ("peer_gave_up", "store_lost", "peer_stopped")
                                                     or (self._round_end.kind == "peer_failed" and not own_failure))
        blamed = own_failure or not self._stop_requested
        return blamed and not peer_stop

    def _run_result(self, state: GroupState, result: RunProcsResult) -> RunResult:
        """What run() returns: the ended group's result by global rank, and how the run ended
        (`state`, as decided before the exit barrier)."""
        global_rank = self.spec.global_rank
        failures = {global_rank(r): f for r, f in result.failures.items()}
        values = {global_rank(r): v for r, v in result.return_values.items()}
        unreapable = {global_rank(r): pid for r, pid in result.unreapable.items()}
        return RunResult(state, values, failures, self.root_cause, self._stop_signal,
                         incomplete_logs=self.incomplete_logs(), unreapable=unreapable,
                         rendezvous_error=self._node_error, interpreter=self._interpreter, end_note=self._end_note,
                         user_ended=self._user_ended)

    def _write_final(self) -> None:
        """final.json: the last snapshot, from which `ranktop attach` shows an ended run once its
        engine has gone, with the key to the run's seal. Written through the held run directory,
        like every file of the run, under a name of its own and renamed into place whole: a view
        never reads half of it."""
        from ranktop.core.server import to_json

        final = dataclasses.replace(self.snapshot(), ended=True, exit_status=self.result.exit_status)
        # The key last: `ranktop ls` reads it from the file's tail (layout._final_key_at_end).
        text = json.dumps({**to_json(final), FINAL_KEY: self._final_key})  # (json.dump encodes in Python, dumps in C)
        writing = f"{FINAL_FILE}.writing-{os.urandom(4).hex()}"
        try:
            # A rank may have planted one (it knows the run directory): kept as evidence, not
            # left to speak for the run, as `attach` and `logs` would take it.
            self.layout.set_aside(FINAL_FILE)
            with os.fdopen(self.layout.open_new(writing), "w") as f:
                f.write(text)
            self.layout.rename(writing, FINAL_FILE)
        except OSError as exc:  # a full disk: no half-written file for a view to stumble on
            with contextlib.suppress(OSError):  # (a read-only file system refuses this too)
                self.layout.remove(writing)
            why = exc.strerror or str(exc)
            self.events.write("final_write_failed", error=why)
            if self.console:  # it went without a word, and `logs` later took the run for one whose engine was killed
                self.say(f"ranktop: {self.layout.path_of(FINAL_FILE)} was not written ({why}): once this ranktop "
                         "has exited, attach and logs cannot show how the run ended")

    def _pass_error_file_up(self) -> None:
        """A scheduler that gave ranktop itself a TORCHELASTIC_ERROR_FILE gets the root cause's,
        as torchrun does."""
        cause = self.root_cause
        if cause is None or not cause.error_file or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            return
        try:
            get_error_handler().copy_error_file(cause.error_file, error_code=cause.exitcode)
        except (OSError, ValueError) as exc:  # BadErrorFile (it changed since it was read), UsageError
            why = getattr(exc, "strerror", None) or str(exc)
            self.events.write("error_file_copy_failed", error=why)
            self._notice(f"the root cause's error file was not copied for the scheduler: {why}")

    def _find_root_cause(self) -> RootCause | None:
        return find_root_cause(self.pcontext.slots, self._pcontext_attempt, self._user_actions)

    def _notice(self, text: str) -> None:
        if self.on_notice is not None:
            self.on_notice(text)
        elif self.console:
            self.say(f"ranktop: {text}")

    def say(self, line: str, *, on_stdout: bool = False) -> None:
        """One line of ours to stderr (stdout where stderr is gone), from any thread: headless, in
        order with the ranks' output and never waiting on a stuck console; a closed or broken stream
        loses only the line. It is cleaned as one line: it may quote what a peer node wrote to the
        rendezvous store."""
        line = clean(line.rstrip("\n"))
        console = sys.stdout if on_stdout else sys.stderr
        if self._tee is not None:
            self._tee.say(binary_console(console), line)
        else:
            _say(line, console)

    def _console_lost(self, target, error: str) -> None:
        self._on_rank_event({"event": "console_lost", "stream": console_name(target), "error": error})


    def served_names(self) -> list[str]:
        """The names this run may be served under, for `ranktop ls`/`attach`, in order: its run id.
        A multi-node job's shared rendezvous id may be served by several of its nodes on one
        host (a job tried on loopback): then the run directory's name (`<id>.1` where nodes share
        the log root), then `<id>.1`, `<id>.2`, ... as each is taken."""
        if not self._shared_id:
            return [self.run_id]
        first = os.path.basename(self.run_dir)
        return [first] + [name for name in (f"{self.run_id}.{n}" for n in range(1, 100)) if name != first]

    def get_worker_group(self, role: str = "default") -> WorkerGroup:
        """torch's ElasticAgent call: this node's group (one role per agent, as torch's local
        agent; `role` is taken for its signature) with its state and ranks as they are now."""
        spec, pc = self.spec, self.pcontext
        pids = pc.pids() if pc is not None and self.state == GroupState.RUNNING else {}
        workers = [Worker(r, spec.global_rank(r), spec.role_rank(r), spec.world_size, spec.role_world_size,
                          pids.get(r)) for r in range(spec.local_world_size)]
        store = self.rendezvous.store if self.rendezvous is not None else None
        return WorkerGroup(spec, workers, store, spec.node_rank, spec.nnodes, self.state,
                           spec.master_addr or "127.0.0.1", self.master_port)

    def wait_started(self, timeout: float | None = None) -> bool:
        return self._started.wait(timeout)

    def hold_stall_clock(self, local_ranks: Any, seconds: float) -> None:
        """We are about to make these ranks print their stacks (SIGUSR1): output in the next
        `seconds` is the dump, not the rank speaking, and must not clear a stall. Called from the
        thread that dumps, not the monitor loop (core/stalls.py says why that is safe)."""
        pc = self.pcontext
        if pc is not None:
            self._stalls.hold(pc.slots, local_ranks, seconds)

    # ----- snapshots ---------------------------------------------------------------------------
    def _on_rank_event(self, event: dict) -> None:
        name = event.pop("event")
        if name == "exited":  # (a stall it ended in is answered first: stall_cleared, or `stalled` here)
            event["stalled"] = self._ended_stalled(event["local_rank"], event["rank"])
        self.events.write(name, attempt=self.attempt, **event)
        if name == "console_lost":  # said on the other stream, the one that may still be read
            lost_told(event["stream"])  # (not again at ranktop's end)
            self.say(f"ranktop: the console's {event['stream']} is gone ({event['error']}): rank output is no "
                     "longer shown there; the ranks go on, and their log files keep their output",
                     on_stdout=event["stream"] == "stderr")
        if name == "guard_replaced" and self.console:
            now = (f"a new one (pid {event['new_pid']}) guards the ranks" if event["new_pid"] else
                   f"no new one could be started ({event['error']}): should ranktop be killed, its ranks "
                   "and what they started are left running")
            self.say(f"ranktop: the orphan guard (pid {event['pid']}) ended under the run "
                     f"({describe_exit(event['status'])}); {now}")
        if name == "log_write_failed" and self.console:
            still = "read and shown" if event.get("shown") else "read (so that the rank goes on)"
            self.say(f"ranktop: rank {event['rank']}: cannot write {event['path']}: {event['error']}; "
                     f"its output is still {still}, but no longer saved there")
        if name == "exit_marker_failed" and self.console:
            how = ("its payload file became the marker" if event["peers_told"] else
                   "a rank that returned waits for it until the group is closed")
            self.say(f"ranktop: rank {event['rank']}: cannot write its exit marker {event['path']} "
                     f"({event['error']}); {how}")
        if name == "output_failed" and self.console:
            kept = f"only saved in {event['path']}" if event["saved"] else "only read (to keep the rank going)"
            self.say(f"ranktop: rank {event['rank']}: its {'stdout' if event['stream'] == 1 else 'stderr'} "
                     f"could not be handled ({event['error']}); it is no longer shown, {kept}; "
                     "events.jsonl has the traceback")

    def incomplete_logs(self) -> tuple[LogLoss, ...]:
        """Every log file of the run that misses output, with the bytes each lost so far."""
        now = self.pcontext.incomplete_logs() if self.pcontext is not None else []
        return tuple(self._earlier_losses + now)

    def _check_stalls(self) -> None:
        if self.stall_timeout:
            self._stalls.check(self.pcontext.slots, self._rank_snapshot, self.spec.global_rank)

    def _ended_stalled(self, local_rank: int, rank: int) -> bool:
        """Whether the rank that just ended was stalled still (reported, silent since). Called as
        its process is reaped, by the thread that runs the monitor loop, which owns the StallWatch."""
        pc = self.pcontext
        return pc is not None and self._stalls.rank_ended(pc.slots, local_rank, rank)

    def _rank_state(self, slot: Any, now: float) -> RankState:
        # Stalled is read off the ring each time, not off the monitor's last pass: a rank that
        # printed again is running at once, not up to a monitor interval later.
        proc = slot.proc
        if proc is None:
            return RankState.STARTING
        if slot.unreapable:
            return RankState.UNREAPABLE
        code = proc.returncode
        if code is None:
            if slot.being_stopped:
                return RankState.STOPPING
            if self.stall_timeout and self._stalls.silent_for(slot, now) >= self.stall_timeout:
                return RankState.STALLED
            return RankState.RUNNING if slot.ring.last_output_at else RankState.STARTING
        if code == 0:
            return RankState.SUCCEEDED
        return RankState.FAILED if slot.ended_by == "itself" else RankState.KILLED

    def _rank_snapshot(self, slot: Any, now: float) -> RankSnapshot:
        proc, r = slot.proc, slot.local_rank
        # A rank's last sample outlives it in the sampler (and in final.json): an ended rank has none
        stats = self.sampler.latest(r) if self.sampler is not None and slot.alive else None
        state = self._rank_state(slot, now)
        last = self._stalls.spoke_at(slot)  # (as the stall clock: the stacks we made it print are not it speaking)
        code = proc.returncode if proc else None
        logs = self.pcontext.log_files(r)
        # Told by the kernel, not counted from the signals ranktop sent: a `kill -STOP` from
        # elsewhere showed `running`, and a `kill -CONT` from elsewhere left `paused` shown.
        paused = state.alive and proc is not None and proc.stopped()
        return RankSnapshot(
            rank=self.spec.global_rank(r), local_rank=r, pid=proc.pid if proc else None, state=state,
            exitcode=code, signal_name=killed_by(code),
            restarts=self._pcontext_attempt + slot.restarts, started_at=proc.started_at if proc else None,
            ended_at=proc.exited_at if proc else None, last_output_at=last, output_version=slot.ring.version,
            cpu_percent=stats.cpu_percent if stats else None, rss=stats.rss if stats else None,
            gpu=stats.gpu if stats else None,
            stall_seconds=self._stalls.silent_for(slot, now) if state == RankState.STALLED else None,
            input_prompt=None if paused else self._input_prompt(slot, state, now),
            native=self._native_ranks,
            log_bytes_lost=slot.log_bytes_lost, log_error=slot.log_error,
            paused=paused, stdout_log=logs[0], stderr_log=logs[1],
            kill_at=_wall_clock(slot.kill_at, now) if state.alive else None,
            end_held=slot.held_until is not None and state == RankState.FAILED,
        )

    @staticmethod
    def _input_prompt(slot: Any, state: RankState, now: float) -> str | None:
        """The prompt a live rank waits at ('(Pdb)', or any while it reads its stdin), once it
        has been quiet a moment: when a snapshot is taken, never per chunk of output."""
        proc = slot.proc
        if state not in (RankState.STARTING, RankState.RUNNING, RankState.STALLED) or proc is None:
            return None
        # Quiet since it started where it printed nothing yet: its first act may be to read stdin.
        if now - max(slot.ring.last_output_at or 0.0, proc.started_at) < PROMPT_QUIET:
            return None
        return rank_prompt(slot.ring.open_line(), proc.pid)

    def snapshot(self) -> GroupSnapshot:
        """A consistent picture of the group, cheap enough to take several times a second."""
        now = time.time()
        pc = self.pcontext
        ranks = tuple(self._rank_snapshot(s, now) for s in pc.slots) if pc else ()
        return GroupSnapshot(
            name=self.spec.display_name(), role=self.spec.role, run_id=self.run_id, state=self.state,
            world_size=self.spec.world_size, local_world_size=self.spec.local_world_size,
            node_rank=self.spec.node_rank, nnodes=self.spec.nnodes, attempt=self.attempt,
            max_restarts=self.spec.max_restarts, started_at=self.started_at, ended_at=self.ended_at,
            log_dir=self.run_dir, ranks=ranks,
            gpu_status=self.sampler.gpu_status() if self.sampler is not None else None,
            root_cause=self.root_cause, incomplete_logs=self.incomplete_logs(), taken_at=now,
            shutdown_timeout=self.shutdown_timeout, output_lines_kept=self.ring_lines,
            stop_signal=self._stop_signal, round=self.spec.placement.round if self.spec.placement else None,
            generation=pc.generation if pc else 0, rendezvous_error=self._node_error, waiting=self._waiting,
            earlier_attempts=self._earlier_attempts.kept(), earlier_left_out=self._earlier_attempts.left_out,
            earlier_left_out_calm=self._earlier_attempts.left_out_calm, interpreter=self._interpreter, end_note=self._end_note,
            user_restarts=self.user_restarts, user_ended=self._user_ended,
            store_lost=self.rendezvous.store_lost if self.rendezvous is not None else None,
            store_silent=self.rendezvous is not None and self.rendezvous.store_silent,
            forming=self.round_forming(), final_seal=self.final_seal,
        )

    def rank_processes(self) -> dict[int, tuple[int, dict[str, str]]]:
        """local rank -> (pid, the environment we started it with) of each running rank, for the
        stats sampler; a plain read, safe from any thread while attempts come and go."""
        pc = self.pcontext
        if pc is None:
            return {}
        return {s.local_rank: (s.proc.pid, pc.envs.get(s.local_rank, {})) for s in list(pc.slots) if s.alive}

    def output(self, local_rank: int, n: int | None = None) -> list[bytes]:
        """The rank's recent output lines (raw bytes, '\\r' collapsed), oldest first."""
        return self.pcontext.slots[local_rank].ring.tail(n)

    def ring(self, local_rank: int):
        return self.pcontext.slots[local_rank].ring


def _wall_clock(monotonic: float | None, now: float) -> float | None:
    """A deadline the engine keeps on the monotonic clock, on time.time()'s (`now`): the clock
    snapshots carry, to views in other processes."""
    return None if monotonic is None else now + (monotonic - time.monotonic())


def _say(line: str, console: TextIO) -> None:
    """One line to our stderr (or stdout), from any thread; a closed or broken one loses only the line."""
    try:
        print(line, file=console, flush=True)
    except (OSError, ValueError, AttributeError):
        pass


def other_interpreter(spec: WorkerSpec) -> str | None:
    """The ranks' Python when it is not ranktop's own interpreter (None for that, or a binary)."""
    if callable(spec.entrypoint) or not _is_python(spec) or spec.entrypoint == sys.executable:
        return None
    return str(spec.entrypoint)


def _is_python(spec: WorkerSpec) -> bool:
    path = str(spec.entrypoint)
    if path == sys.executable:
        return True
    # by name, or by what a link named otherwise (PYTHON_EXEC=~/bin/py) points to
    return any(os.path.basename(p).startswith(("python", "pypy")) for p in (path, os.path.realpath(path)))


def _bind_numa(spec: WorkerSpec) -> WorkerSpec:
    """torch's numa_options on a spec from the Python API: the CPUs each rank starts on, as
    --numa-binding gives them; a usage error in one line where they cannot be told."""
    if spec.numa_options is None or spec.cpu_affinity is not None:
        return spec
    from ranktop.core.gpu import numa_options_binding
    from ranktop.core.numa import NumaError

    try:
        return dataclasses.replace(spec, cpu_affinity=numa_options_binding(spec.numa_options, spec.local_world_size))
    except (NumaError, TypeError) as exc:
        raise UsageError(str(exc)) from None


class LocalElasticAgent(LocalAgent):
    """torch's LocalElasticAgent, constructor and all, as a LocalAgent: the run directory goes
    under the LogsSpecs' root log dir, and its redirects, tee and local_ranks_filter say what
    reaches the console (ranktop keeps every stream in its file whatever they say). torch's
    defaults hold here: a 30 s grace. `health_check_server` is kept, not started: torch's own
    starts nothing either; `uninterruptible_state_timeout` is kept for code that reads it."""

    def __init__(self, spec: WorkerSpec, logs_specs: Any = None, start_method: str = "spawn",
                 exit_barrier_timeout: float = 300.0, log_line_prefix_template: str | None = None,
                 shutdown_timeout: float = 30.0, health_check_server: Any = None,
                 uninterruptible_state_timeout: float | None = None, **kwargs: Any) -> None:
        from ranktop.core.logs_specs import adopt_logs_specs

        log_dir = None
        spec = _adopt_worker_spec(spec)  # torch's own WorkerSpec, as ours
        logs_specs = adopt_logs_specs(logs_specs)  # torch's own DefaultLogsSpecs, as ours
        if logs_specs is not None:
            log_dir = getattr(logs_specs, "root_log_dir", None)
            spec = dataclasses.replace(spec, redirects=logs_specs.redirects, tee=logs_specs.tee,
                                       local_ranks_filter=logs_specs.local_ranks_filter)
        self.health_check_server = health_check_server
        self.uninterruptible_state_timeout = uninterruptible_state_timeout
        super().__init__(spec, log_dir=log_dir, start_method=start_method, exit_barrier_timeout=exit_barrier_timeout,
                         log_line_prefix_template=log_line_prefix_template, shutdown_timeout=shutdown_timeout,
                         **kwargs)

    def run(self, role: str = "default") -> RunResult:
        """Run as LocalAgent does, then end as torch's agent does: a stop signal to the caller
        (SIGINT, SIGTERM, SIGHUP) raises SignalException once the ranks are stopped, and a rank
        that could not be started raises its OSError (FileNotFoundError, PermissionError, ...).
        The result is still `self.result`. `role` is torch's parameter (the spec names the role)."""
        result = super().run()
        if self._start_error is not None:
            raise self._start_error
        if result.stop_signal is not None:
            raise SignalException.received(result.stop_signal)
        return result


def _adopt_worker_spec(spec: Any) -> WorkerSpec:
    """torch's own WorkerSpec as ours, every field kept (its fields are a subset of ours), so code
    that still builds torch's can swap only the agent; ours as given."""
    if isinstance(spec, WorkerSpec) or not type(spec).__module__.startswith("torch.distributed.elastic"):
        return spec
    return WorkerSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init})
