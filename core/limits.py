"""Bounds on every number a user gives ranktop, and the file descriptors a run needs.

A number outside its bounds is refused with one line naming it, the value and what is accepted,
before anything starts: `nan` seconds never compare true (a grace that never ends), 0 or a
negative interval makes a loop spin, and an absurd count of ranks would build that many
environments before failing.
"""

from __future__ import annotations

import math
import numbers
import os
import resource

from ranktop.core.errors import UsageError
from ranktop.core.sanitize import quoted
from ranktop.core.value import Value

# The longest time ranktop waits on anything (a grace, an interval, a stall). Beyond a week it is a
# typo; the bound also keeps every wait far under poll()'s limit of 2**31 ms (about 24.8 days).
MAX_SECONDS = 7 * 24 * 3600
# Silence before a rank shows stalled where a person watches: the TUI, and a --detach run (attach)
TUI_STALL_TIMEOUT = 60.0
# Ranks on one node. The largest single machines have about 2,000 logical CPUs; one process per
# CPU is the most that makes sense, and each rank costs ranktop ~5 descriptors and a pane.
MAX_NPROC_PER_NODE = 4096
# Nodes, so that WORLD_SIZE (nodes x ranks per node) fits the 32-bit int collectives use.
MAX_NNODES = 2**31 // MAX_NPROC_PER_NODE - 1


class Bounds(Value):
    """The values a number may take: lo..hi (hi None: no upper bound), whole or any finite."""

    __slots__ = ("lo", "hi", "whole", "above", "unit")

    def __init__(self, lo: float, hi: float | None = None, whole: bool = False, above: bool = False,
                 unit: str = "") -> None:
        self.lo, self.hi, self.whole = lo, hi, whole
        self.above = above  # lo itself is excluded
        self.unit = unit  # "seconds", "ranks"... for the message

    def describe(self) -> str:
        kind = ("a whole number" if self.whole else "a number") + (f" of {self.unit}" if self.unit else "")
        lo = _shown(self.lo)
        if self.hi is None:
            return f"{kind}, more than {lo}" if self.above else f"{kind}, {lo} or more"
        if self.above:
            return f"{kind} above {lo}, at most {_shown(self.hi)}"
        return f"{kind} from {lo} to {_shown(self.hi)}"

    def accepts(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        if self.whole and not isinstance(value, numbers.Integral):
            return False
        if not math.isfinite(value):
            return False
        low_ok = value > self.lo if self.above else value >= self.lo
        return low_ok and (self.hi is None or value <= self.hi)

    def check(self, name: str, value: object, shown: str | None = None) -> object:
        """`value` if accepted, else UsageError 'bad NAME VALUE: expected ...'."""
        if not self.accepts(value):
            if shown is None:  # text or None given where a number belongs shows as such: '1', None
                shown = str(value) if isinstance(value, numbers.Real) else repr(value)
            raise UsageError(f"bad {name} {shown}: expected {self.describe()}")
        return value

    def parse(self, name: str, text: str) -> int | float:
        """The number written in `text` (as a user typed it), checked; UsageError otherwise, the
        text quoted as typed (an empty one, `--linger=`, would vanish from the line unquoted)."""
        try:
            value: int | float = int(text) if self.whole else float(text)
        except ValueError:  # not a number, or more digits than int() reads (4300)
            raise UsageError(f"bad {name} {quoted(text)}: expected {self.describe()}") from None
        self.check(name, value, shown=quoted(text))
        return value


def _shown(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


SECONDS = Bounds(0, MAX_SECONDS, unit="seconds")  # a grace: 0 means SIGKILL at once
POSITIVE_SECONDS = Bounds(0, MAX_SECONDS, above=True, unit="seconds")
# The monitor wakes on every rank exit anyway; under a millisecond it would only spin a core.
MONITOR_SECONDS = Bounds(0.001, MAX_SECONDS, unit="seconds")
NPROC = Bounds(1, MAX_NPROC_PER_NODE, whole=True)
NNODES = Bounds(1, MAX_NNODES, whole=True)
COUNT = Bounds(0, whole=True)  # restarts, a node's rank
PORT = Bounds(1, 65535, whole=True)
PORT_OR_FREE = Bounds(0, 65535, whole=True)  # 0: any free port, as a socket's bind reads it
LINES = Bounds(1, whole=True)


def check_timeout(name: str, value: object) -> float:
    """Seconds to wait for something: finite, 0 to MAX_SECONDS (the Python API's check)."""
    return SECONDS.check(name, value)  # type: ignore[return-value]


# ----- file descriptors ---------------------------------------------------------------------------
# What each rank holds open in ranktop: its stdout and stderr pipes, a pidfd, stdout.log,
# stderr.log and its log directory (measured: 100 ranks take 600 more than one). The spare covers what starting a rank
# holds for a moment (three pipes), the event log, the TUI, the stats sampler and py-spy's pipes.
FDS_PER_RANK = 6
FDS_SPARE = 64


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing the directory
    except OSError:
        return 0


def fds_needed(nranks: int) -> int:
    """About how many descriptors this process needs to run `nranks` more ranks."""
    return open_fds() + FDS_PER_RANK * nranks + FDS_SPARE


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one (ranks inherit it, as they would a
    raised `ulimit -n`); returns (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # keep what we have; the check below says whether it is enough
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def ensure_fds_for(nranks: int) -> None:
    """Make sure `nranks` ranks can be started: raise the soft limit, and if even the hard limit
    is too low, one line (UsageError) saying how many are needed and how to get them."""
    soft, hard = raise_fd_limit()
    need = fds_needed(nranks)
    if soft != resource.RLIM_INFINITY and need > soft:
        raise UsageError(
            f"too few file descriptors for {nranks} rank{'' if nranks == 1 else 's'}: about {need} are needed "
            f"and the limit is {soft} (hard limit {'unlimited' if hard == resource.RLIM_INFINITY else hard}); raise it "
            f"(ulimit -Hn {need}, or LimitNOFILE= for a service) or start fewer ranks per node"
        )


def _nr_open() -> int:
    """The kernel's ceiling for any process's open-files limit."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20
