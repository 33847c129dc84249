"""Who a failed group's end is blamed on: the rank that failed first on its own (`find_root_cause`),
and the actions the user took on single ranks before it (`UserActions`), which a root cause that
follows one names: restarting or signalling one rank of a collective job makes its peers fail."""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from ranktop.core.errors import describe_exit, killed_by
from ranktop.core.state import RootCause

# The user's actions kept, the newest: a client of the run's socket may send thousands of signals
# a second, and each was kept for the run's life (24 MB of the engine's after 120k SIGWINCH sent
# through the socket in a minute), every SIGCONT looking through them all (120 answered a second).
MAX_USER_ACTIONS = 1000


class UserActions:
    """Each action the user took on single ranks, as (when, attempt, what, when a SIGCONT resumed
    it), the newest MAX_USER_ACTIONS: noted by the monitor loop as it applies the command, read
    when a root cause is found."""

    def __init__(self) -> None:
        self._actions: list[tuple[float, int, str, float | None]] = []

    def note(self, attempt: int, what: str) -> None:
        self._actions.append((time.time(), attempt, what, None))
        if len(self._actions) > MAX_USER_ACTIONS:
            del self._actions[0]

    def note_signal(self, attempt: int, rank: int, sig: int) -> None:
        """The user's signal reached `rank` (USR1/USR2 are notices, not acts on the rank; SIGCONT
        ends a pause)."""
        if sig == signal.SIGCONT:
            self._note_resumed(attempt, rank)
        elif sig == signal.SIGKILL:
            self.note(attempt, f"killed rank {rank}")
        elif sig not in (signal.SIGUSR1, signal.SIGUSR2):
            self.note(attempt, f"sent {signal.Signals(sig).name} to rank {rank}")

    def _note_resumed(self, attempt: int, rank: int) -> None:
        """A SIGCONT to a rank the user paused in this attempt: the pause's note says when it ended
        (a failure long after a pause of seconds read as if the rank were paused still)."""
        paused = f"sent SIGSTOP to rank {rank}"
        for i in range(len(self._actions) - 1, -1, -1):
            at, at_attempt, what, resumed = self._actions[i]
            if at_attempt == attempt and what == paused and resumed is None:
                self._actions[i] = (at, at_attempt, what, time.time())
                return

    def last_before(self, attempt: int, failed_at: float) -> LastAction | None:
        """The user's last action in `attempt` that a failure at `failed_at` may have followed
        (`_may_follow`); an action long before it, with nothing of it left, is no cause of it."""
        before = [(t, what, resumed) for t, at, what, resumed in self._actions if at == attempt and t <= failed_at]
        for i in range(len(before) - 1, -1, -1):
            at, what, resumed = before[i]
            ended = _pause_ended(what, resumed, before[i + 1:])
            if _may_follow(at, what, ended, failed_at):
                return LastAction(what, at, _user_action_text(at, what, resumed, failed_at))
        return None


# A failure counts as following the user's action only within this many seconds of it (of the
# end of a pause): longer than NCCL's default collective time-out (10 min), after which the peers
# of a rank the user killed or paused fail. A pause still in force when the failure came counts
# however long it lasted: the peers waited on the paused rank.
USER_ACTION_BOUND = 900.0


def _pause_ended(what: str, resumed: float | None, later: list[tuple[float, str, float | None]]) -> float | None:
    """When a pause (SIGSTOP) ended: its SIGCONT, or the next action on that rank (a kill or a
    restart ends it as well); None while it lasts, and for an action that is no pause."""
    if not what.startswith("sent SIGSTOP to "):
        return None
    rank = what.rpartition(" ")[2]
    ends = [t for t, other, _ in later if other.rpartition(" ")[2] == rank]
    return min([resumed, *ends]) if resumed is not None else min(ends, default=None)


def _may_follow(at: float, what: str, pause_ended: float | None, failed_at: float) -> bool:
    """Whether a failure at `failed_at` may be the effect of the action: a pause in force then,
    or an action (or the end of a pause) at most USER_ACTION_BOUND seconds before it."""
    paused = what.startswith("sent SIGSTOP to ")
    if paused and (pause_ended is None or pause_ended > failed_at):
        return True
    return failed_at - (pause_ended if paused else at) <= USER_ACTION_BOUND


class LastAction(NamedTuple):
    """The user's last action before a failure: `what` ("killed rank 3"), when (epoch seconds),
    and the sentence the evidence gives (`_user_action_text`)."""

    what: str
    at: float
    text: str


def find_root_cause(slots: Sequence[Any], attempt: int, user_actions: UserActions) -> RootCause | None:
    """The root cause among an attempt's rank slots (a context's `slots`), None where no rank failed."""
    # Never a rank the user ended: their kill or signal is no failure.
    failed = [s for s in slots if s.failure is not None and s.ended_by != "user"]
    if not failed:
        return None
    # The first rank that failed on its own is the cause; the ranks we stopped are effects.
    own = sorted([s for s in failed if s.ended_by == "itself"] or failed, key=lambda s: s.failure.exited_at)
    slot, f = own[0], own[0].failure
    return RootCause(
        rank=f.rank, local_rank=f.local_rank, pid=f.pid, exitcode=f.exitcode,
        signal_name=killed_by(f.exitcode), message=f.message_text,
        traceback=f.traceback, timestamp=f.exited_at,
        error_file=f.error_file if f.error_file_read else None, last_lines=_decoded(slot.ring.tail(20)),
        # Enough lines to see past the rank's own printed traceback (the report cuts it out).
        failed_tails=tuple((s.failure.rank, _decoded(s.ring.tail(60))) for s in own),
        **_user_action_fields(user_actions.last_before(attempt, f.exited_at)),
        # (a rank the user stopped is the user action above, not ranktop's doing: not in `failed`)
        stopped=tuple((s.failure.rank, describe_exit(s.failure.exitcode)) for s in failed
                      if s.stopped_by_us and s not in own),
        attempt=attempt,
    )


def _user_action_fields(action: LastAction | None) -> dict[str, Any]:
    if action is None:
        return {}
    return {"user_action": action.text, "user_action_what": action.what, "user_action_at": action.at}


def rank_failed(cause: RootCause) -> str:
    """`rank 1 failed (exit 3)` or `(signal SIGKILL)`: the words of the restart line and of the
    reason a node that gives up leaves for the others (which said `exit -9`)."""
    how = f"signal {cause.signal_name}" if cause.exitcode < 0 else f"exit {cause.exitcode}"
    return f"rank {cause.rank} failed ({how})"


def after_user(cause: RootCause) -> str:
    """'after you killed rank 3, ' where a user action came first ('' where none did, or a
    final.json of an older ranktop does not say which): what this node's person reads first."""
    return f"after you {cause.user_action_what}, " if cause.user_action_what else ""


def _user_action_text(at: float, what: str, resumed: float | None, failed_at: float) -> str:
    """'you restarted rank 2 at 12:03:04, 1.2 s before this failure'; a pause `resumed` (SIGCONT)
    before the failure says when (' (SIGCONT 3.0 s later)'), one resumed after it does not: the
    rank was paused when the failure came."""
    when = time.strftime("%H:%M:%S", time.localtime(at))
    then = f" (SIGCONT {resumed - at:.1f} s later)" if resumed is not None and resumed <= failed_at else ""
    return f"you {what} at {when}{then}, {max(0.0, failed_at - at):.1f} s before this failure"


def _decoded(lines: list[bytes]) -> tuple[str, ...]:
    return tuple(line.decode(errors="replace") for line in lines)
