"""Search every rank's output at once: per-rank hit counts for the titles and the rank list, and
the order in which next/previous go from one rank's matches to the next rank's.

The counts are taken once, when the search is run, over the lines the engine still keeps for each
rank (output_since from the start); they are not kept up to date as ranks print more. A `re:`
pattern given up on a line (past its time limit: tui/bounded_regex.py) ends the count there: the
ranks after it are not searched, and `stopped_in` names the rank.
"""

from __future__ import annotations

from ranktop.core.engine import EVERY_KEPT_LINE, Engine
from ranktop.tui.logview import matches, plain_needle, regex_matches, search_pattern


class RankSearch:
    """One search over every rank: the query and how many kept lines of each rank match it."""

    def __init__(self, query: str, counts: dict[int, int], stopped_in: int | None = None) -> None:
        self.query = query
        self.counts = counts  # local rank -> matching lines (only ranks with at least one)
        self.stopped_in = stopped_in  # the local rank where the pattern was given up, if it was

    @classmethod
    def run(cls, engine: Engine, local_ranks: range, query: str) -> RankSearch:
        """Count the matches of `query` (plain text, any case; `re:` then a regular expression)
        in every rank, up to a pattern given up; ValueError for a regular expression that does not
        compile."""
        pattern = search_pattern(query)
        needle = plain_needle(query)
        needle_bytes = needle.encode() if needle.isascii() else None

        def hit(line: bytes) -> bool:
            return regex_matches(line, pattern) if pattern is not None else matches(line, needle, needle_bytes)

        counts = {}
        for r in local_ranks:
            _cursor, lines, open_lines = engine.output_since(r, None, EVERY_KEPT_LINE)  # (made for this count alone)
            hits = sum(1 for line in (*lines, *open_lines) if hit(line))
            if hits:
                counts[r] = hits
            if pattern is not None and pattern.stopped:
                return cls(query, counts, stopped_in=r)
        return cls(query, counts)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def next_rank(self, current: int, direction: int) -> int | None:
        """The next rank with matches after `current` (direction +1) or before it (-1), wrapping
        round; None when no rank matched."""
        ranks = sorted(self.counts)
        if not ranks:
            return None
        if direction > 0:
            return next((r for r in ranks if r > current), ranks[0])
        return next((r for r in reversed(ranks) if r < current), ranks[-1])

    def summary(self, rank_of) -> str:  # noqa: ANN001 (local rank -> global rank)
        """'14 matches for 'loss' in 3 ranks: 0 (12), 5 (1), 7 (1)'"""
        if not self.counts:
            return f"no match for {self.query!r} in any rank"
        shown = ", ".join(f"{rank_of(r)} ({n})" for r, n in sorted(self.counts.items())[:8])
        more = ", …" if len(self.counts) > 8 else ""
        return (f"{self.total} match{'es' if self.total != 1 else ''} for {self.query!r} in {len(self.counts)} "
                f"rank{'s' if len(self.counts) != 1 else ''}: {shown}{more}  (n / N: next / previous, across ranks)")
