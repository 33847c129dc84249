"""What a UI may ask of the engine, and the engine's answer: small frozen values, plain data.

Every action a person can take on a running group is one of these, handed to `Engine.submit`.
They hold only numbers, strings and tuples, so that the same commands can later travel over a
local socket (detach/attach) unchanged. The engine's monitor loop applies them, one at a time,
in the order they came; no other thread changes the engine's state.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from ranktop.core.limits import SECONDS
from ranktop.core.value import Value

if TYPE_CHECKING:  # the stack code loads when a dump is asked for, not at every start
    from ranktop.core.stacks import StackReport


class SignalRank(Value):
    """Send `signal` to one rank: its whole process group (USR1/USR2: the rank process alone)."""

    __slots__ = ("local_rank", "signal")

    def __init__(self, local_rank: int, signal: int) -> None:
        self.local_rank, self.signal = local_rank, signal


class SignalGroup(Value):
    """Send `signal` to every rank, as SignalRank does to one."""

    __slots__ = ("signal",)

    def __init__(self, signal: int) -> None:
        self.signal = signal


class KillRank(Value):
    """SIGKILL to one rank's process group. The others go on: a user kill is not a failure (nor is
    a death by the signal a SignalRank or SignalGroup sent): no restart, never the root cause."""

    __slots__ = ("local_rank",)

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank


class KillGroup(Value):
    """End the run now: SIGKILL to every rank, no grace."""

    __slots__ = ()


class RestartRank(Value):
    """Stop one rank (the shutdown grace, then SIGKILL) and start it again in this attempt."""

    __slots__ = ("local_rank",)

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank


class RestartGroup(Value):
    """Stop every rank (with the grace) and start the group again as the next attempt, spending
    none of --max-restarts."""

    __slots__ = ()


class Stop(Value):
    """End the run on the user's behalf: `signal` to every rank, SIGKILL after `grace` seconds
    (None: the engine's shutdown grace)."""

    __slots__ = ("signal", "grace")

    def __init__(self, signal: int = signal.SIGTERM, grace: float | None = None) -> None:
        self.signal, self.grace = signal, grace


class Interrupt(Value):
    """ranktop itself received `signal` (Ctrl-C, SIGTERM, a hang-up): forward it to every rank
    with the grace and end with 128+N; a repeated one kills at once. Answered without waiting,
    so that a signal handler may submit it."""

    __slots__ = ("signal",)

    def __init__(self, signal: int) -> None:
        self.signal = signal


class DumpStacks(Value):
    """py-spy every live rank (or these local ranks) and group the stacks; the Ack carries the
    report, which is also saved in the run directory and logged, unless not `save`; with
    `native_frames`, the C/C++ frames too (py-spy --native: about a second a rank)."""

    __slots__ = ("local_ranks", "save", "native_frames")

    def __init__(self, local_ranks: tuple[int, ...] | None = None, save: bool = True,
                 native_frames: bool = False) -> None:
        self.local_ranks, self.save, self.native_frames = local_ranks, save, native_frames


class SignalDump(Value):
    """No ptrace needed: SIGUSR1 makes each Python rank print its stacks (faulthandler); the
    engine reads them back from the rank's log and the Ack carries the grouped report (saved
    as DumpStacks saves it)."""

    __slots__ = ("local_ranks", "save")

    def __init__(self, local_ranks: tuple[int, ...] | None = None, save: bool = True) -> None:
        self.local_ranks, self.save = local_ranks, save


class SendInput(Value):
    """Type `text` into one rank's standard input (a pipe, or its terminal with --pty): a
    `breakpoint()` in a rank gets its commands this way."""

    __slots__ = ("local_rank", "text")

    def __init__(self, local_rank: int, text: str) -> None:
        self.local_rank, self.text = local_rank, text


MAX_INPUT = 64 << 10  # characters one SendInput may carry: a typed line, not a file


class Detach(Value):
    """The TUI that started the run lets go of it (`reason`: "key", or its terminal's "SIGHUP"):
    the run goes on without a terminal, and a hang-up from now on is noted, not a stop."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


MAX_DETACH_REASON = 40  # characters: a word for events.jsonl

Command = (SignalRank | SignalGroup | KillRank | KillGroup | RestartRank | RestartGroup | Stop | Interrupt
           | DumpStacks | SignalDump | SendInput | Detach)


class Ack(Value):
    """The engine's answer to one command: whether it was applied, and one line saying what
    happened (or why not). Stack commands also carry their report."""

    __slots__ = ("ok", "message", "report")

    def __init__(self, ok: bool, message: str, report: StackReport | None = None) -> None:
        self.ok, self.message, self.report = ok, message, report


def problem(command: object, local_world_size: int) -> str | None:
    """Why `command` cannot be applied to a group of `local_world_size` ranks (one line), or None.
    Checked before anything happens, so a bad value changes nothing."""
    if not isinstance(command, _COMMAND_TYPES):
        return f"unknown command {type(command).__name__}: expected one of {', '.join(_NAMES)}"
    ranks = [getattr(command, "local_rank", None)] if hasattr(command, "local_rank") else []
    chosen = getattr(command, "local_ranks", None)
    if chosen is not None and not isinstance(chosen, (list, tuple)):
        return f"bad local ranks {chosen!r}: expected a list of local ranks, or none for all"
    ranks += chosen or ()
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < local_world_size:
            return f"bad local rank {rank!r}: local ranks are 0..{local_world_size - 1}"
    sig = getattr(command, "signal", None)
    if hasattr(command, "signal") and _signal_of(sig) is None:
        return f"bad signal {sig!r}: expected a signal number such as {int(signal.SIGTERM)} (SIGTERM)"
    grace = getattr(command, "grace", None)
    if grace is not None and not SECONDS.accepts(grace):  # the bound PContext.stop holds it to
        return f"bad grace {grace!r}: expected {SECONDS.describe()}"
    if hasattr(command, "save") and not isinstance(command.save, bool):
        return f"bad save {command.save!r}: expected true or false"
    if isinstance(command, SendInput) and (not isinstance(command.text, str) or len(command.text) > MAX_INPUT):
        return f"bad input: expected text of at most {MAX_INPUT} characters"
    if isinstance(command, Detach) and (not isinstance(command.reason, str) or len(command.reason) > MAX_DETACH_REASON):
        return f"bad detach reason: expected at most {MAX_DETACH_REASON} characters of text"
    return None


def _signal_of(value: object) -> signal.Signals | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    try:
        return signal.Signals(value)
    except ValueError:
        return None


_COMMAND_TYPES = (SignalRank, SignalGroup, KillRank, KillGroup, RestartRank, RestartGroup, Stop, Interrupt,
                  DumpStacks, SignalDump, SendInput, Detach)
_NAMES = [t.__name__ for t in _COMMAND_TYPES]
