"""A user's regular expression (a `re:` search, --metric), matched with a time limit on each match.

Python's `re` holds the GIL for as long as a match takes, and a pattern that backtracks without
end (`(a+)+b` on a line of a thousand `a`s) takes minutes or forever: in a TUI run the engine's
output thread, in the same process, stopped reading the ranks' pipes, and the run stalled behind
full pipes. The `regex` package (re's syntax in its default VERSION0) releases the GIL while it
matches (`concurrent=True`) and gives up on a match past a timeout. Past its first timeout a
BoundedPattern matches nothing, at once: a search over 640k lines would take 640k timeouts.

`regex` writes a repeat out as many times as its least count (`a{10000000}` is ten million items:
2.6 GB and 5 s; `a{4294967294}`, which re takes, ran the box out of memory), so a pattern whose
repeats come to more than MAX_ITEMS is refused before regex sees it.

`regex` is imported on the first pattern compiled only: a run without one never loads it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any

# re's own parser (private, but its tree is the pattern regex will compile: re read it already)
try:
    from re import _parser as re_parser  # Python 3.11 on
except ImportError:  # 3.10
    import sre_parse as re_parser

# One match's time limit, wall-clock (regex checks it now and then: it fired 5-80 ms late). Far
# above any match of a pattern that does not backtrack without end (microseconds on a 10,000-
# character line), so that a busy box (8 ranks flooding 2 cores) does not give a good one up;
# a pattern that does is given up once, the GIL released meanwhile (the run goes on).
MATCH_SECONDS = 0.25
# A pattern slow on every line but never past MATCH_SECONDS on one (`(.* ){8}\d{9}`: ~0.1 s a
# line of a training log) froze the TUI for a ring's worth of lines (10,000: minutes). Matches
# slower than SLOW_MATCH count against a budget: SLOW_BUDGET of them within SLOW_WINDOW gives the
# pattern up as a timeout does. A good pattern takes microseconds a line, and reaches SLOW_MATCH
# only where the box kept the thread waiting: a second of that within ten is a frozen screen anyway.
SLOW_MATCH, SLOW_BUDGET, SLOW_WINDOW = 0.01, 1.0, 10.0
MAX_ITEMS = 100_000  # items a pattern's repeats may come to once written out (~40 MB, 0.03 s for regex)
_REPEATS = {getattr(re_parser, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
            if hasattr(re_parser, name)}


class BoundedPattern:
    """A compiled user pattern with the part of re.Pattern's interface the TUI and Rich use:
    `search`, `finditer` (Text.highlight_regex), `pattern`, `groupindex`. Each call matches
    for at most MATCH_SECONDS; the first that would take longer sets `stopped`, and from then on
    every call finds nothing without matching."""

    def __init__(self, compiled: Any, seconds: float = MATCH_SECONDS) -> None:
        self._compiled = compiled  # a regex.Pattern
        self.seconds = seconds
        self.pattern: str = compiled.pattern
        self.groupindex: dict[str, int] = dict(compiled.groupindex)
        self.stopped = False  # given up for good: see `why`
        self.why = ""  # how it was given up: "took over 250 ms on one line"
        self._told = False  # someone has said on screen that it was given up
        self._slow: collections.deque[tuple[float, float]] = collections.deque()  # (when, seconds) of slow matches
        self.slow_match, self.slow_budget = SLOW_MATCH, SLOW_BUDGET

    @classmethod
    def compile(cls, text: str, *, ignore_case: bool = False) -> BoundedPattern:
        """`text` compiled by the regex package; ValueError with its reason where it does not
        compile (re read it already: see usage.compiled_regex)."""
        flags = re_parser.SRE_FLAG_IGNORECASE if ignore_case else 0
        if written_out(re_parser.parse(text, flags)) > MAX_ITEMS:
            raise ValueError(f"too large to compile: over {MAX_ITEMS:,} items with its repeats written out (a{{n}} is n)")
        import regex

        try:
            return cls(regex.compile(text, regex.IGNORECASE if ignore_case else 0))
        except regex.error as exc:
            raise ValueError(str(exc)) from None

    def search(self, text: str) -> Any:  # -> regex.Match | None
        """The first match in `text`, as re.Pattern.search; None once stopped."""
        if self.stopped:
            return None
        started = time.monotonic()
        try:
            return self._compiled.search(text, concurrent=True, timeout=self.seconds)
        except TimeoutError:
            self._give_up(f"took over {round(self.seconds * 1000)} ms on one line")
            return None
        finally:
            self._count(started)

    def finditer(self, text: str) -> Iterator[Any]:
        """Every match in `text`, as re.Pattern.finditer, within one time limit for them all;
        those found before a timeout, and none once stopped."""
        if self.stopped:
            return
        started = time.monotonic()
        try:
            yield from self._compiled.finditer(text, concurrent=True, timeout=self.seconds)
        except TimeoutError:
            self._give_up(f"took over {round(self.seconds * 1000)} ms on one line")
        finally:
            self._count(started)

    def _count(self, started: float) -> None:
        """A match that took over SLOW_MATCH counts against the slow budget."""
        now = time.monotonic()
        if now - started < self.slow_match or self.stopped:
            return
        self._slow.append((now, now - started))
        while self._slow and self._slow[0][0] < now - SLOW_WINDOW:
            self._slow.popleft()
        if sum(seconds for _when, seconds in self._slow) >= self.slow_budget:
            self._give_up(f"took over {self.slow_budget:g} s within {SLOW_WINDOW:g} s on lines")

    def tell_once(self) -> bool:
        """Whether it was given up and no one has said so yet: True once, to whoever says it (a
        search of every rank, a pane, the metric's reader may each meet the line)."""
        if not self.stopped or self._told:
            return False
        self._told = True
        return True

    def _give_up(self, why: str) -> None:
        self.stopped, self.why = True, why

    def __repr__(self) -> str:
        return f"BoundedPattern({self.pattern!r}{', stopped' if self.stopped else ''})"


def written_out(parsed: Any) -> int:
    """How many items a pattern parsed by re comes to with each repeat written out as many times as
    its least count (at least once), as regex compiles it."""
    items = 0
    for op, arg in parsed:
        if op in _REPEATS:
            least, _most, body = arg
            items += max(least, 1) * written_out(body)
        else:
            items += 1 + sum(written_out(part) for part in _parts(arg))
    return items


def _parts(arg: Any) -> Iterator[Any]:
    """The subpatterns in an item's argument (a group's, a branch's, a look-ahead's)."""
    if isinstance(arg, re_parser.SubPattern):
        yield arg
    elif isinstance(arg, (tuple, list)):
        for value in arg:
            yield from _parts(value)


def stopped_line(what: str, pattern: BoundedPattern, rank: int, outcome: str) -> str:
    """The one line that says a pattern was given up: `the pattern 're:(a+)+b' took over 250 ms
    on one line of rank 3: stopped (no more matches counted)`."""
    return f"{what} {pattern.why or 'was given up'} of rank {rank}: stopped ({outcome})"
