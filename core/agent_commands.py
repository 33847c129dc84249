"""The agent's commands and the signals to ranktop itself: how they reach the monitor loop from
other threads and signal handlers, and what the loop does with each. LocalAgent inherits these
(as it does core/agent_rendezvous.py's); `submit` and `handle_signal` run in any thread and only
queue, wake the loop and wait for its Ack; the rest runs in the monitor loop, on the agent's state
(`state`, `events`, `spec`, `attempt`, the stop and restart requests)."""

from __future__ import annotations

import collections
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ranktop.core import commands as cmd
from ranktop.core.context import PContext, Waker
from ranktop.core.signals import NOTICE_SIGNALS, StopAction, StopRule, take_early_stops
from ranktop.core.state import GroupState

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ACK_TIMEOUT = 5.0  # the loop answers within milliseconds; this only bounds a wedged engine
KILL_NOW_REAP_TIMEOUT = 1.0  # after a second Ctrl-C, how long a rank may outlive SIGKILL


# What a command gets when the group has no ranks to act on, by why it has none: (a stop's answer,
# any other command's). A stop's None: it is applied, as it still has something to end (a round
# forming, the next attempt about to start); any other command has nothing to act on.
_NOT_NOW: dict[str, tuple[cmd.Ack | None, cmd.Ack]] = {
    # the run is over (or ending, before the monitor loop took the command): a stop got what it asked for
    "run_ended": (cmd.Ack(True, "the run had ended already"),
                  cmd.Ack(False, "the run has ended: nothing left to act on")),
    "rendezvous": (None, cmd.Ack(False, "waiting for the rendezvous: no ranks to act on yet")),
    "between_attempts": (None, cmd.Ack(False, "between two attempts: try again once the next one started")),
    "group_ended": (cmd.Ack(False, "the group has ended: nothing left to signal or restart"),) * 2,
}


def _refusal(command: cmd.Command, why: str) -> cmd.Ack | None:
    """The answer to `command` while the group has no ranks to act on (`why`: a key of _NOT_NOW),
    or None where it is applied all the same."""
    stop_answer, other_answer = _NOT_NOW[why]
    return stop_answer if isinstance(command, (cmd.Stop, cmd.KillGroup)) else other_answer


def _after_the_end(command: cmd.Command) -> cmd.Ack:
    """The answer to a command that came once the run had ended."""
    return _refusal(command, "run_ended")


class _Reply:
    """Where the monitor loop puts its answer to one command, and the event its caller waits on."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ack: cmd.Ack | None = None

    def answer(self, ack: cmd.Ack) -> None:
        self.ack = ack
        self.done.set()


class AgentCommands:
    """LocalAgent's commands and signal policy (a part of it, not a class of its own to make)."""

    def _set_up_command_queue(self, hangup_stops: bool, signals_to_handle: tuple[int, ...]) -> None:
        """Where signals to ranktop and commands wait for the monitor loop, and what wakes it."""
        # (signal, monotonic arrival time), appended by signal handlers, drained by the loop.
        self._pending_signals: collections.deque[tuple[int, float]] = collections.deque()
        self._stop_rule = StopRule(hangup_stops=hangup_stops, passed_on=NOTICE_SIGNALS & frozenset(signals_to_handle))
        self._killed_now = False  # a kill now was applied: a second Ctrl-C, or a KillGroup after a stop
        # Commands waiting for the monitor loop, each with the slot its Ack goes into.
        self._commands: collections.deque[tuple[cmd.Command, _Reply | None]] = collections.deque()
        self._accepting = True  # False once the run is over: a late command is answered at once
        self._queue_lock = threading.Lock()  # only around the queue: never held while applying
        self._waker = Waker()  # wakes the loop; shared by every attempt's context

    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        # The notices always: unhandled, their default action would end ranktop without a report.
        handled = dict.fromkeys((*_FORWARDED_SIGNALS, *self.signals_to_handle, *NOTICE_SIGNALS))
        if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
            # `nohup ranktop ...`: asked to outlive the terminal. A handler of ours made the
            # hang-up a stop (exit 129), as it is for torchrun; ignored, it reaches no one (the
            # ranks inherit the ignoring, as nohup means), and so no rank outlives ranktop.
            del handled[signal.SIGHUP]
        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        for sig in take_early_stops(handled):  # (as PID 1: they came before we could act on them)
            self.handle_signal(sig)
        return previous

    @staticmethod
    def _restore_signal_handlers(handlers: dict) -> None:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.handle_signal(signum)

    def handle_signal(self, signum: int) -> None:
        """ranktop itself got `signum`: forward it to every rank (grace, then SIGKILL) and end with
        128+N; `StopRule` says what a repeat means. Safe from a signal handler: it only notes the
        signal and when it came, and wakes the loop, which decides and acts outside the
        interrupted code."""
        self._pending_signals.append((signum, time.monotonic()))
        self._waker.wake()

    def _handle_stop_request(self, pc: PContext | None) -> None:
        """Apply the signals ranktop received (monitor thread only; `pc` None: no ranks yet)."""
        while self._pending_signals:
            signum, received_at = self._pending_signals.popleft()
            action = self._stop_rule.decide(signum, received_at)
            ignored = action in (StopAction.DUPLICATE, StopAction.IGNORED)
            self.events.write("signal_received", signal=signal.Signals(signum).name,
                              forwarded=not ignored, action=action.value)
            if ignored:
                continue
            if action == StopAction.PASS_ON:
                if pc is not None:
                    for r in range(self.spec.local_world_size):
                        pc.signal_rank(r, signum)
                continue
            self._stop_signal = self._stop_signal or signum
            self.state = GroupState.STOPPING
            if pc is None:  # waiting on the rendezvous: no ranks to stop
                continue
            self._tell_the_round_of_the_stop(signum)  # before our ranks stop: the others' break once they do
            if action == StopAction.KILL_NOW:  # the user wants out now: do not wait long on the kernel
                self._killed_now = True
                pc.stop(signal.SIGKILL, 0, reap_timeout=KILL_NOW_REAP_TIMEOUT)
            else:
                pc.stop(signum, self.shutdown_timeout)

    def _kill_now_pending(self) -> bool:
        """Whether a signal or command waiting for the monitor loop kills every rank at once (a
        second Ctrl-C; the TUI's second q or Ctrl-C, a KillGroup): the monitor loop, held by a
        stop's word to the other nodes, stops waiting for it. (list(): a signal handler may
        append meanwhile.)"""
        if any(self._stop_rule.kills_now(signum) for signum, _ in list(self._pending_signals)):
            return True
        with self._queue_lock:
            return any(isinstance(command, cmd.KillGroup) for command, _ in self._commands)

    def submit(self, command: cmd.Command, timeout: float = ACK_TIMEOUT) -> cmd.Ack:
        """Queue `command` for the monitor loop and wait (at most `timeout`) for its answer. A bad
        command is refused at once and changes nothing. `Interrupt` is answered without waiting
        (a signal handler submits it)."""
        problem = cmd.problem(command, self.spec.local_world_size)
        if problem is not None:
            return cmd.Ack(False, problem)
        if isinstance(command, cmd.Interrupt):
            self.handle_signal(command.signal)
            return cmd.Ack(True, f"{signal.Signals(command.signal).name} noted")
        reply = _Reply()
        with self._queue_lock:
            if not self._accepting:
                return _after_the_end(command)
            self._commands.append((command, reply))
        self._waker.wake()
        if not reply.done.wait(timeout):
            return cmd.Ack(False, f"no answer from the monitor loop within {timeout:g}s; the command stays queued")
        return reply.ack

    def _apply_commands(self) -> None:
        """Monitor thread only: apply the signals and commands received since the last pass."""
        pc = self.pcontext
        self._handle_stop_request(pc)
        while True:
            with self._queue_lock:
                if not self._commands:
                    return
                command, reply = self._commands.popleft()
            try:
                ack = self._apply(pc, command)
            except Exception as exc:  # a command must never take the loop down
                ack = cmd.Ack(False, f"{type(command).__name__} failed: {exc}")
            if reply is not None:
                reply.answer(ack)

    def _stop_accepting(self) -> None:
        with self._queue_lock:
            self._accepting = False
            left, self._commands = list(self._commands), collections.deque()
        for command, reply in left:
            if reply is not None:
                reply.answer(_after_the_end(command))

    def _apply(self, pc: PContext | None, command: cmd.Command) -> cmd.Ack:
        # Detach whatever the ranks are doing: it is the run that lets go of its terminal.
        if not isinstance(command, cmd.Detach) and (why := self._no_ranks_to_act_on(pc)) is not None:
            refused = _refusal(command, why)
            if refused is not None:
                return refused
        handler = self._COMMAND_HANDLERS.get(type(command))
        if handler is None:
            return cmd.Ack(False, f"{type(command).__name__} is not applied by the monitor loop")
        return handler(self, pc, command)

    def _no_ranks_to_act_on(self, pc: PContext | None) -> str | None:
        """Why the group has no ranks a command could act on now (a key of _NOT_NOW), if it has none."""
        if pc is None or self.state == GroupState.RENDEZVOUS:  # a round forming, or the exit barrier
            return "rendezvous"
        if not pc.ended:
            return None
        return "between_attempts" if self._between_attempts else "group_ended"

    def _on_detach(self, _pc: PContext | None, command: cmd.Detach) -> cmd.Ack:
        """The run let go of its terminal: from now on a SIGHUP is noted, not a stop."""
        self._stop_rule.hangup_stops = False
        self.events.write("detached", reason=command.reason)
        return cmd.Ack(True, "detached: the run goes on without its terminal")

    def _on_signal_rank(self, pc: PContext, command: cmd.SignalRank) -> cmd.Ack:
        return self._signal_ranks(pc, [command.local_rank], command.signal)

    def _on_signal_group(self, pc: PContext, command: cmd.SignalGroup) -> cmd.Ack:
        return self._signal_ranks(pc, range(self.spec.local_world_size), command.signal)

    def _on_kill_rank(self, pc: PContext, command: cmd.KillRank) -> cmd.Ack:
        return self._signal_ranks(pc, [command.local_rank], signal.SIGKILL)

    def _on_restart_rank(self, pc: PContext, command: cmd.RestartRank) -> cmd.Ack:
        if self.rendezvous is not None:  # one new rank cannot rejoin the other nodes' collectives
            return self._on_restart_group(pc, cmd.RestartGroup())
        rank = self.spec.global_rank(command.local_rank)
        if not pc.restart_rank(command.local_rank):
            return cmd.Ack(False, f"the group is stopping or has ended: rank {rank} is not started again")
        self.events.write("user_restart_rank", rank=rank, local_rank=command.local_rank)
        self._user_actions.note(self.attempt, f"restarted rank {rank}")
        return cmd.Ack(True, f"restarting rank {rank}")

    def _on_restart_group(self, pc: PContext, _command: cmd.RestartGroup) -> cmd.Ack:
        # A stop asked for (K, q's y, ranktop stop, a stop signal) wins over any restart: `R` during
        # it was answered `restarting the group`, logged as done, and never done.
        if self._stop_requested:
            return cmd.Ack(False, "the run is stopping (a stop was asked for): the group is not started again")
        self.events.write("user_restart_group", attempt=self.attempt)
        self._restart_requested = True
        overtaken = self._say_restart_group()  # before our ranks stop: the others' may break once they do
        pc.stop()
        if overtaken:
            self._notice(overtaken)
        return cmd.Ack(True, overtaken or "restarting the group (next attempt)")

    def _on_stop(self, pc: PContext | None, command: cmd.Stop | cmd.KillGroup) -> cmd.Ack:
        sig, grace = (signal.SIGKILL, 0.0) if isinstance(command, cmd.KillGroup) else (command.signal, command.grace)
        self._killed_now = self._killed_now or (sig == signal.SIGKILL and self._stop_requested)  # (after a stop)
        self._user_stop = True
        self._restart_requested = False
        self.state = GroupState.STOPPING
        self.events.write("user_stop", signal=signal.Signals(sig).name)
        if pc is not None:
            self._tell_the_round_of_the_stop(None)  # before our ranks stop: the others' break once they do
            pc.stop(sig, grace)
        return cmd.Ack(True, f"{signal.Signals(sig).name} → every rank")

    def _send_input(self, pc: PContext, command: cmd.SendInput) -> cmd.Ack:
        rank = self.spec.global_rank(command.local_rank)
        if self.rank_stdin == "inherit":  # an attached TUI's `i` into a headless run
            return cmd.Ack(False, f"rank {rank} reads the stdin of the headless ranktop that started it, as "
                                  "under torchrun: type into that terminal")
        data = command.text.encode()
        try:
            taken = pc.send_input(command.local_rank, data)
        except OSError as exc:
            return cmd.Ack(False, f"rank {rank}: cannot type into its stdin: {exc.strerror or exc}")
        if taken == 0:
            return cmd.Ack(False, f"rank {rank}'s stdin has no room for the line ({len(data)} bytes): it is not "
                                  "reading, or the line is more than its pipe holds; nothing was typed")
        if taken < len(data):  # (a terminal's: --pty)
            return cmd.Ack(False, f"rank {rank} is not reading its stdin: {taken} of {len(data)} bytes taken")
        self.events.write("user_input", rank=rank, local_rank=command.local_rank, bytes=len(data))
        return cmd.Ack(True, f"typed {len(data)} bytes into rank {rank}")

    def _signal_ranks(self, pc: PContext, local_ranks: Any, sig: int) -> cmd.Ack:
        name = signal.Signals(sig).name
        sent = [r for r in local_ranks if pc.signal_rank(r, sig)]
        if not sent:
            return cmd.Ack(False, f"not running: no {name} sent")
        for r in sent:  # (a refused command did nothing: it is no user action)
            self._user_actions.note_signal(self.attempt, self.spec.global_rank(r), sig)
        who = "every rank" if len(sent) > 1 else f"rank {self.spec.global_rank(sent[0])}"
        return cmd.Ack(True, f"{name} → {who}")

    # The monitor loop's handler of each command it applies (a command's type is its own: none
    # subclasses another).
    _COMMAND_HANDLERS: dict[type, Callable[..., cmd.Ack]] = {
        cmd.Detach: _on_detach,
        cmd.SignalRank: _on_signal_rank,
        cmd.SignalGroup: _on_signal_group,
        cmd.KillRank: _on_kill_rank,
        cmd.SendInput: _send_input,
        cmd.RestartRank: _on_restart_rank,
        cmd.RestartGroup: _on_restart_group,
        cmd.Stop: _on_stop,
        cmd.KillGroup: _on_stop,
    }

    # The calls below are kept for API users and tests; each is one queued command.
    def signal_rank(self, local_rank: int, sig: int) -> bool:
        return self.submit(cmd.SignalRank(local_rank, sig)).ok

    def signal_group(self, sig: int) -> None:
        self.submit(cmd.SignalGroup(sig))

    def kill_rank(self, local_rank: int) -> bool:
        return self.submit(cmd.KillRank(local_rank)).ok

    def restart_rank(self, local_rank: int) -> None:
        self.submit(cmd.RestartRank(local_rank))

    def restart_group(self) -> None:
        """Stop every rank (with the grace) and start the group again as the next attempt."""
        self.submit(cmd.RestartGroup())

    def stop(self, sig: int = signal.SIGTERM, grace: float | None = None) -> None:
        """Stop the run on the user's behalf: `sig` to every rank, SIGKILL after the grace."""
        self.submit(cmd.Stop(sig, grace))

    def kill_group(self) -> None:
        self.submit(cmd.KillGroup())
