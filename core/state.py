"""The narrow, typed interface between the engine and whatever shows it.

A UI reads immutable snapshots at its own pace and sends commands; it never touches a
process or a pipe itself. Everything here is plain data so that it could later be served
over a local socket for detach/attach.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque
from dataclasses import dataclass


class RankState(str, enum.Enum):
    STARTING = "starting"  # spawned, no output yet
    RUNNING = "running"
    STALLED = "stalled"  # alive, silent for longer than the stall timeout
    STOPPING = "stopping"  # asked to stop, not reaped yet
    SUCCEEDED = "exited"  # exit code 0
    FAILED = "failed"  # non-zero exit code or a signal
    KILLED = "killed"  # stopped by ranktop, the user, or a stop of the whole job from outside
    # SIGKILLed, yet not gone long after: stuck in the kernel (uninterruptible sleep, "D" state,
    # e.g. a hung NCCL or NFS call). ranktop stopped waiting and left it to the orphan guard.
    UNREAPABLE = "unreapable"
    # Alive when a client (ranktop attach, ranktop web) last saw it, then the run's engine was lost
    # before the run's end: whether it still runs, the client cannot tell. Its pid, samples and
    # output are as last seen. No engine says it; only such a client's view of the run.
    UNKNOWN = "unknown"

    @property
    def alive(self) -> bool:
        return self in (RankState.STARTING, RankState.RUNNING, RankState.STALLED, RankState.STOPPING)


class GroupState(str, enum.Enum):
    """A worker group's state: the one enum for the engine, the TUI and torch's API. torch's
    `WorkerState` is this enum under its name, and torch's member names are aliases of ours."""

    INIT = "init"
    RENDEZVOUS = "rendezvous"  # waiting for a rendezvous round (or at the exit barrier)
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # stopped by a signal or the user
    # torch's names for the same states (enum aliases: `GroupState.HEALTHY is GroupState.RUNNING`).
    HEALTHY = "running"
    UNHEALTHY = "restarting"
    UNKNOWN = "init"  # torch: the agent cannot tell; here: nothing to report yet

    @property
    def finished(self) -> bool:
        return self in (GroupState.SUCCEEDED, GroupState.FAILED, GroupState.STOPPED)

    @staticmethod
    def is_running(state: GroupState) -> bool:
        """torch's `WorkerState.is_running`: the ranks are up (healthy or being restarted)."""
        return state in (GroupState.RUNNING, GroupState.RESTARTING)


def world_undecided(state: str | None, round_: int | None, ranks_started: bool = True) -> bool:
    """Whether a group's world size and node are still the command line's guesses: a rendezvous
    run before its first round decides them, or one that ended before any did (its round timed
    out: no rank ever started). `state` as a snapshot's, or its JSON's string."""
    if round_ is not None:
        return False
    ended = state in (GroupState.SUCCEEDED, GroupState.FAILED, GroupState.STOPPED)
    return state == GroupState.RENDEZVOUS or (ended and not ranks_started)


@dataclass(frozen=True)
class GpuSample:
    """One rank's GPU as NVML last saw it. `index` is None when no GPU is known for the rank."""

    index: int | None = None
    util_percent: float | None = None
    mem_used: int | None = None  # bytes, whole device
    mem_total: int | None = None  # bytes
    proc_mem: int | None = None  # bytes used by this rank's process tree on that device


@dataclass(frozen=True)
class RankSnapshot:
    """One rank as the engine sees it at one moment: its state, exit, restarts and samples."""

    rank: int
    local_rank: int
    pid: int | None
    state: RankState
    exitcode: int | None  # Popen convention: -N means killed by signal N
    signal_name: str | None  # "SIGSEGV" when exitcode < 0
    restarts: int  # how often this rank was started again (group or single-rank restarts)
    started_at: float | None  # time.time()
    ended_at: float | None
    last_output_at: float | None
    output_version: int  # grows whenever new output arrived; cheap dirtiness check for UIs
    cpu_percent: float | None = None  # summed over the rank's process tree
    rss: int | None = None  # bytes, summed over the process tree
    gpu: GpuSample | None = None
    stall_seconds: float | None = None  # seconds without output while stalled
    # The input prompt it waits at, e.g. "(Pdb)": its output ends in an unfinished line that is one
    # (core/prompts.py), quiet for PROMPT_QUIET s; None otherwise. Running or stalled ranks only.
    input_prompt: str | None = None
    native: bool = False  # a binary rather than a Python rank (stack dumps need to know)
    log_bytes_lost: int = 0  # output read but not saved: a log file write failed (disk full)
    log_error: str | None = None  # why, e.g. "No space left on device"; None while the logs are whole
    paused: bool = False  # stopped, as the kernel says (/proc/PID/stat): a SIGSTOP from ranktop or from anywhere
    stdout_log: str | None = None  # where its stdout goes (None: not to a file)
    stderr_log: str | None = None  # None also with --pty, where stderr shares stdout's terminal
    # time.time() when ranktop SIGKILLs it if it is still alive then (a stop's grace running out);
    # None while no stop of it is under way. A view's countdown is this less `taken_at`.
    kill_at: float | None = None
    # It died of a stop signal ranktop did not send, maybe the first sign of a stop of the whole
    # job from outside (core/signals.py's OUTSIDE_STOP_WINDOW): its state says `failed` until the
    # window has passed, yet it may still turn out `killed`, part of that stop. A view says so.
    end_held: bool = False


@dataclass(frozen=True)
class GroupSnapshot:
    """The whole group at one moment, the ranks included: what every view draws from."""

    name: str  # the job: script or binary name
    role: str
    run_id: str
    state: GroupState
    world_size: int
    local_world_size: int
    node_rank: int
    nnodes: int
    attempt: int  # 0-based; the UI shows attempt+1 of max_restarts+1+user_restarts
    max_restarts: int
    started_at: float
    ended_at: float | None
    log_dir: str | None  # the run directory (holds events.jsonl and attempt_<k>/)
    ranks: tuple[RankSnapshot, ...]
    gpu_status: str | None = None  # e.g. "no GPU" when NVML is unavailable; None when fine
    root_cause: RootCause | None = None
    incomplete_logs: tuple[LogLoss, ...] = ()  # log files a write failed on, this run so far
    taken_at: float = 0.0  # time.time() when the engine took this picture
    shutdown_timeout: float = 10.0  # the grace a stop gives the ranks before SIGKILL
    output_lines_kept: int = 10_000  # complete lines the engine keeps per rank for output_since
    ended: bool = False  # the run is over and the engine has let go of every rank
    exit_status: int | None = None  # once ended: 0, 1 or 128+N (the CLI's exit status)
    stop_signal: int | None = None  # the signal to ranktop that ended the run, if one did
    error: str | None = None  # the engine itself failed (a bug, a spawn error): what went wrong
    # why this node's run ended with no rank of its own to blame, if it did: the rendezvous (a round
    # that failed, a node that gave up or failed, the store lost) or a rank that could not be
    # started (RunResult's field of that name)
    rendezvous_error: str | None = None
    # Said of an ended run besides its state: how its exit barrier ended without every node (a
    # success all the same; the line headless printed then, a TUI showed only as a toast).
    end_note: str | None = None
    round: int | None = None  # the rendezvous round (node_rank is then this round's group rank)
    waiting: str | None = None  # while a rendezvous round forms or at the exit barrier: what this node waits for, in words
    # Starts of the group so far, from 0: a new one brings new output rings. It differs from
    # `attempt` when nodes joining restart the group without spending a restart.
    generation: int = 0
    # "attempt_<k>: rank 1 failed (exit 1)" for the earlier attempts of this run, oldest first
    # (one that ended in no failure says `restarted...`: see ended_calmly): the first and the last
    # few (EarlierAttempts), with how many came between them and whether each of those ended calmly.
    earlier_attempts: tuple[str, ...] = ()
    earlier_left_out: int = 0
    earlier_left_out_calm: bool = True
    # Attempts the user's group restart started: each advanced `attempt` and spent no restart, so
    # restarts spent are attempt - user_restarts, and the run may have max_restarts + 1 + this.
    user_restarts: int = 0
    # Once ended: the global ranks the user ended (a kill, or the very signal they sent it), which
    # are no failure. With none failed, the run ended as a stop on request.
    user_ended: tuple[int, ...] = ()
    # The Python the ranks run when it is not ranktop's own (PYTHON_EXEC, or the active virtualenv
    # or conda env when ranktop runs from an install of its own): said where it could surprise.
    interpreter: str | None = None
    # While this node's own looks find the rendezvous's store gone (the node serving it ended):
    # "the c10d rendezvous 'job42''s store at HOST:PORT"; None while it answers.
    store_lost: str | None = None
    # With store_lost: it is that a look waits for the store's answer (its node paused or hung: it
    # may answer again), not that its connection broke (its node gone: no new round can form).
    store_silent: bool = False
    # While this node joins a rendezvous round (and, once ended, the round it was joining when the
    # run ended before that round formed): what is known of it. world_size, node_rank, nnodes and
    # round are then the last round's (of none before the first: the command line's guesses).
    forming: RoundForming | None = None
    # sha256 (hex) of the secret the engine writes into its final.json, and only there: a client
    # that saw this takes a final.json as the run's end only if it holds that secret (a rank can
    # plant a final.json where a killed engine left none; it cannot know the secret).
    final_seal: str | None = None

    @property
    def end_unknown(self) -> bool:
        """Ended with no final state: a client lost the run's engine before the run's end."""
        return self.ended and not self.state.finished

    def engine_lost(self, why: str) -> GroupSnapshot:
        """This picture, a client's last of the run, once its engine has gone before the run's end:
        ended, the end unknown, stopped at the time it was taken; the ranks alive in it are of
        unknown state now (pid, samples and output as last seen), and nothing waits on them."""
        ranks = tuple(dataclasses.replace(r, state=RankState.UNKNOWN, paused=False, input_prompt=None,
                                          stall_seconds=None, kill_at=None) if r.state.alive else r
                      for r in self.ranks)
        return dataclasses.replace(self, ended=True, ranks=ranks, waiting=None, ended_at=self.taken_at or time.time(),
                                   error=f"lost the run's engine before its end ({why})")

    @property
    def earlier_count(self) -> int:
        """How many earlier attempts there were, those left out of earlier_attempts included."""
        return len(self.earlier_attempts) + max(0, self.earlier_left_out)

    @property
    def earlier_calm(self) -> bool:
        """Whether every earlier attempt ended in no failure (see ended_calmly)."""
        return self.earlier_left_out_calm and all(ended_calmly(words) for words in self.earlier_attempts)

    @property
    def earlier_words(self) -> str:
        """The earlier attempts on one line, `; ` between them, those left out as one count:
        `attempt_0: ...; ... 290 more (events.jsonl) ...; attempt_291: ...`."""
        return self._earlier_words_of(self.earlier_attempts)

    @property
    def earlier_words_before_cause(self) -> str:
        """earlier_words less the root cause's own attempt, which the end report's headline names:
        a restart spent on its failure whose next round never formed (a node lost) left the run on
        a later attempt, the failure among the earlier ones, and the report said it twice. Starts
        of that attempt that ended calmly (restarted for nodes that joined) came before it and stay."""
        cause = self.root_cause
        if cause is None:
            return self.earlier_words
        failed_in = self.attempt if cause.attempt is None else cause.attempt  # (as the headline names it)
        kept = tuple(words for words in self.earlier_attempts if _came_before(words, failed_in))
        # Where every attempt after the first few was dropped, the cause's attempt may be among
        # those left out, and so may some after it: their count is not the ones before it.
        counted = len(kept) > EARLIER_FIRST or len(self.earlier_attempts) <= EARLIER_FIRST
        return self._earlier_words_of(kept, counted)

    def _earlier_words_of(self, kept: tuple[str, ...], counted: bool = True) -> str:
        if self.earlier_left_out <= 0:
            return "; ".join(kept)
        between = f"... {self.earlier_left_out if counted else 'some'} more (events.jsonl) ..."
        return "; ".join((*kept[:EARLIER_FIRST], between, *kept[EARLIER_FIRST:]))

    @property
    def paused(self) -> tuple[int, ...]:
        """Local ranks stopped (SIGSTOP, from ranktop or from anywhere), as the kernel says."""
        return tuple(r.local_rank for r in self.ranks if r.paused)

    @property
    def unreapable(self) -> tuple[int, ...]:
        """Local ranks that outlived SIGKILL and were left to the orphan guard."""
        return tuple(r.local_rank for r in self.ranks if r.state == RankState.UNREAPABLE)


def ended_calmly(earlier_attempt: str) -> bool:
    """Whether an earlier attempt, as GroupSnapshot.earlier_attempts words it, ended in no failure:
    restarted by the user, by another node's user, or for nodes that joined. Those alone begin
    `restarted` (LocalAgent._attempt_end); a failure, also one the user then restarted, names it."""
    return earlier_attempt.partition(": ")[2].startswith("restarted")


def _came_before(earlier_attempt: str, attempt: int) -> bool:
    """Whether an earlier attempt's words (`attempt_<k>: how it ended`) tell of one before
    `attempt`, or of a start of it that ended calmly; words that name no attempt are kept."""
    number, _, _ = earlier_attempt.partition(": ")
    digits = number.removeprefix("attempt_")
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 9:
        return True
    return int(digits) < attempt or (int(digits) == attempt and ended_calmly(earlier_attempt))


# Of a run's earlier attempts a snapshot carries the first and the last few, and a count of those
# between: it went whole into every snapshot (served to each attach client several times a second)
# and the end report, 27 KB after 300 group restarts. events.jsonl's group_restart events say each.
EARLIER_FIRST = 1
EARLIER_LAST = 3


class EarlierAttempts:
    """How the attempts before the running one ended, as a snapshot carries them: the first, the
    last EARLIER_LAST, how many came between and whether all of those ended in no failure."""

    def __init__(self) -> None:
        self._first: list[str] = []
        self._last: deque[str] = deque()
        self.left_out = 0
        self.left_out_calm = True

    def add(self, words: str) -> None:
        """One more attempt's end, "attempt_<k>: how it ended"."""
        if len(self._first) < EARLIER_FIRST:
            self._first.append(words)
            return
        self._last.append(words)
        if len(self._last) > EARLIER_LAST:
            dropped = self._last.popleft()
            self.left_out += 1
            self.left_out_calm = self.left_out_calm and ended_calmly(dropped)

    def kept(self) -> tuple[str, ...]:
        return (*self._first, *self._last)


@dataclass(frozen=True)
class RoundForming:
    """A rendezvous round this node joins, as far as its handler says (torch's dynamic handlers,
    c10d and etcd-v2, say all of it; others the number this node's rounds give it)."""

    number: int | None = None  # the round's number, the same on every node under c10d and etcd-v2
    joined: int | None = None  # the nodes in it so far
    nodes: str | None = None  # the nodes it needs, as this node's --nnodes says: "2", "2 to 4"


@dataclass(frozen=True)
class LogLoss:
    """A log file that misses output: a write to it failed (disk full), the rest was dropped."""

    rank: int
    path: str
    error: str
    bytes_lost: int


@dataclass(frozen=True)
class RootCause:
    """The earliest failure of the run, ready to show."""

    rank: int
    local_rank: int
    pid: int | None
    exitcode: int
    signal_name: str | None
    message: str
    traceback: str | None
    timestamp: float
    error_file: str | None
    last_lines: tuple[str, ...] = ()  # the root-cause rank's last output lines
    # (rank, its last lines) for every rank that failed on its own, earliest first
    failed_tails: tuple[tuple[int, tuple[str, ...]], ...] = ()
    # a user action on a rank that came before this failure (a restart, a kill), e.g. "you
    # restarted rank 2 at 12:03:04, 1.2 s before this failure"; None when there was none
    user_action: str | None = None
    # The ranks ranktop stopped because of this failure, (global rank, how each ended): effects,
    # named so that nobody blames them.
    stopped: tuple[tuple[int, str], ...] = ()
    # The attempt its rank failed in (0 first): a restart spent on it whose next round never
    # formed (a peer node lost) leaves the run on the next attempt, whose ranks never started.
    attempt: int | None = None
    # The user action above in a few words ("killed rank 2", "restarted rank 1"), which headlines
    # put before the failure, and when it came (epoch seconds); None where there was none.
    user_action_what: str | None = None
    user_action_at: float | None = None
