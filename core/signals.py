"""What a stop signal to ranktop means: one rule for the agent, the TUI and `launch()`.

A real SSH hangup often arrives as two SIGHUPs (the terminal's and the login shell's), and a
service manager may send SIGTERM to a whole scope while a wrapper forwards its own: repeats of
SIGHUP/SIGTERM within a second are one event, so the ranks keep their whole grace and a
checkpoint-on-hangup handler gets to run. Only a person's repeated interrupt (a second Ctrl-C)
means "now": SIGKILL without the grace.

The rule is pure (the caller passes the time each signal arrived), so a signal handler only
records (signal, time) and the loop that owns the ranks decides and acts.
"""

from __future__ import annotations

import enum
import os
import signal

from ranktop.core.errors import UsageError
from ranktop.core.sanitize import quoted

# Repeats of SIGHUP/SIGTERM closer than this to the one acted on are the same event.
DUPLICATE_WINDOW = 1.0


class StopAction(str, enum.Enum):
    FORWARD = "forward"  # send the signal to every rank; SIGKILL what is left after the grace
    DUPLICATE = "duplicate"  # a repeat of the hangup/termination just forwarded: nothing more to do
    KILL_NOW = "kill_now"  # a repeated interrupt: SIGKILL every rank at once
    PASS_ON = "pass_on"  # a notice for the ranks (Slurm's SIGUSR1 before a requeue): sent, the run goes on
    # a hang-up to a run that has no terminal to lose (detached), or a notice not listed in
    # --signals-to-handle: noted, the run goes on
    IGNORED = "ignored"


# Never a reason to stop: passed on when listed in --signals-to-handle, else only noted. Slurm's
# --signal=USR1@N (without B:) reaches ranktop and every rank of the step at once; by default
# ranktop must neither die of it (its default action) nor give the ranks a second one.
NOTICE_SIGNALS = frozenset({signal.SIGUSR1, signal.SIGUSR2})

# A rank that dies of one of these, not sent by ranktop, may be the first sign of a stop from
# outside: Slurm (scancel, a time limit) and systemd (KillMode=control-group) signal every process
# of the job at once, and the ranks may get theirs a little before ranktop does. Its end is held
# this long (seconds) before it counts as a failure: a stop signal to ranktop meanwhile makes it
# part of that stop (no root cause, no restart spent); otherwise it is a failure, as any other.
OUTSIDE_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
OUTSIDE_STOP_WINDOW = 1.0


class StopRule:
    """Decides, signal by signal, what ranktop does with the stop signals it receives."""

    __slots__ = ("window", "hangup_stops", "passed_on", "_interrupted", "_forwarded_at")

    def __init__(self, window: float = DUPLICATE_WINDOW, hangup_stops: bool = True,
                 passed_on: frozenset[int] = NOTICE_SIGNALS) -> None:
        self.window = window
        self.hangup_stops = hangup_stops  # False once the run is detached: it was started to outlive a hang-up
        self.passed_on = passed_on  # the notices given to the ranks; the others are only noted
        self._interrupted = False
        self._forwarded_at: float | None = None  # when the last SIGHUP/SIGTERM acted on arrived

    def kills_now(self, signum: int) -> bool:
        """Whether `signum` kills every rank at once (a person's second Ctrl-C), asked without
        deciding it: a wait that the stop makes first must not hold that up."""
        return signum == signal.SIGINT and self._interrupted

    def decide(self, signum: int, received_at: float) -> StopAction:
        """`received_at` is a monotonic time taken when the signal arrived."""
        if signum in NOTICE_SIGNALS:
            return StopAction.PASS_ON if signum in self.passed_on else StopAction.IGNORED
        if signum == signal.SIGHUP and not self.hangup_stops:
            return StopAction.IGNORED
        if self.kills_now(signum):
            return StopAction.KILL_NOW
        if signum == signal.SIGINT:
            self._interrupted = True
            return StopAction.FORWARD
        if self._forwarded_at is not None and received_at - self._forwarded_at < self.window:
            return StopAction.DUPLICATE
        self._forwarded_at = received_at
        return StopAction.FORWARD


class InterruptPairs:
    """A SIGINT sent to every process of a TUI's job at once (`kill -INT %1`, `pkill -INT
    ranktop`, a scheduler's or systemd's signal to each process) reaches the TUI's process twice:
    itself, and through the waiting parent the shell started, which passes its own on. A second
    interrupt means "now" (SIGKILL, no grace), so the parent passes a SIGINT on as a signal of
    its own, and one of each kind within `window` of the other are one interrupt. Two of one
    kind are still two: a SIGINT sent twice to either process, or a second Ctrl-C."""

    __slots__ = ("window", "_unpaired")

    def __init__(self, window: float = DUPLICATE_WINDOW) -> None:
        self.window = window
        self._unpaired: tuple[bool, float] | None = None  # (passed on by the parent, monotonic arrival)

    def is_other_half(self, passed_on: bool, received_at: float) -> bool:
        """Whether this SIGINT (`passed_on` by the parent, or not) is the other half of the last
        one, which was acted on: then it is nothing more."""
        last = self._unpaired
        if last is not None and last[0] != passed_on and received_at - last[1] < self.window:
            self._unpaired = None
            return True
        self._unpaired = (passed_on, received_at)
        return False


# As PID 1 of a PID namespace (a container's command), a signal with no handler is dropped by the
# kernel, not acted on: a SIGTERM from kubelet before the run has its handlers would be lost, and the
# ranks would run until the SIGKILL a grace period later. Until then such a signal is only noted.
_EARLY_STOPS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_early: list[int] = []


def deaf_to(signals: tuple[int, ...] | frozenset[int]) -> dict[int, object]:
    """`signals` change nothing in this process from now on (a hang-up, Slurm's SIGUSR1/2 warnings
    where their default action would kill it); the handlers they had. A handler that does nothing,
    not SIG_IGN, which a rank started later would inherit through exec."""
    return {sig: signal.signal(sig, _unheard) for sig in signals}


def _unheard(_signum: int, _frame: object) -> None:
    pass


def _note_early(signum: int, _frame: object) -> None:
    _early.append(signum)


def hold_early_stops() -> None:
    """As PID 1, note the stop signals that come before the run can act on them (`take_early_stops`).
    Elsewhere their default action ends ranktop before it has started anything: nothing to do."""
    if os.getpid() == 1:
        for sig in _EARLY_STOPS:
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _note_early)


def take_early_stops(handled: object) -> list[int]:
    """The noted signals that are among `handled`, once: the run acts on them now. A signal it
    does not handle (SIGQUIT left out of --signals-to-handle) gets its default back: noted for
    ever, it would end nothing and say nothing."""
    taken = [sig for sig in _early if sig in handled]
    _early.clear()
    for sig in _EARLY_STOPS:
        if sig not in handled and signal.getsignal(sig) is _note_early:
            signal.signal(sig, signal.SIG_DFL)
    return taken


_UNCATCHABLE = ("SIGKILL", "SIGSTOP")
_NOT_STOPS = ("SIGCHLD", "SIGCLD")  # how ranktop learns that a rank ended: it cannot also end the run


def parse_signal_names(text: str, what: str = "--signals-to-handle") -> tuple[int, ...]:
    """torchrun's signals to handle, 'SIGTERM,SIGUSR1', as signal numbers; UsageError (one line,
    naming `what`) for a name that is not a signal ranktop can handle."""
    found = []
    for name in (part.strip() for part in text.split(",") if part.strip()):
        number = getattr(signal, name, None)
        if not name.startswith("SIG") or name.startswith("SIG_") or not isinstance(number, signal.Signals) \
                or name in _UNCATCHABLE:
            raise UsageError(f"bad {what} {quoted(text[:80])}: {quoted(name[:40])} is not a signal ranktop can handle "
                             "(names such as SIGTERM,SIGUSR1; SIGKILL and SIGSTOP cannot be caught)")
        if name in _NOT_STOPS:
            raise UsageError(f"bad {what} {quoted(text[:80])}: {name} comes each time a rank ends; it cannot stop the run")
        found.append(int(number))
    return tuple(found)
