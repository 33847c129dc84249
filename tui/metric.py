"""A number taken from every rank's output (`--metric 'loss ([0-9.eE+-]+)'`), its output rate, and
a short history of both and of the engine's samples, for the titles, the rank list and sparklines.

With a metric, every rank is read, shown or not, through its own cursor on `engine.output_since`,
once a second: only the lines printed since the last look are copied (which also gives the output
rate), made for the look, the rank's output left in the engine as it waits. Without one no output
is read here: a run nobody asked a metric of pays nothing per line, and the histories are the
engine's samples only (cpu, rss, GPU).
"""

from __future__ import annotations

import collections
import math
import re
import statistics
import time

from ranktop.core.engine import EVERY_KEPT_LINE, Engine, OutputCursor
from ranktop.core.output import RanktopLine
from ranktop.core.sanitize import quoted
from ranktop.core.state import GroupSnapshot
from ranktop.tui.bounded_regex import BoundedPattern
from ranktop.tui.cells import drawable
from rich.cells import cell_len

HISTORY = 60  # samples kept per series (one a second: the last minute)
READ_SECONDS = 1.0  # how often every rank's new output is read
OUTLIER_MADS = 3.0  # a value this many median absolute deviations from the median is marked
_BARS = "▁▂▃▄▅▆▇█"
SPARK_BARS = (12, 8, 5)  # bars a zoomed title's sparkline may have, most first
SPARKS_GIVEN_UP = ("gmem", "rss", "gpu", "cpu", "out")  # the series a narrow zoomed title leaves out, in turn


class BadMetric(ValueError):
    """The --metric expression does not compile; the message is the one line to show."""


def compile_metric(pattern: str) -> BoundedPattern:
    """The --metric regular expression: its first group (or the whole match) is the value. Each
    match of it is bounded in time (see tui/bounded_regex.py)."""
    from ranktop.tui.usage import compiled_regex

    try:
        return compiled_regex(pattern)
    except ValueError as exc:
        raise BadMetric(f"bad --metric {quoted(pattern[:80])}: {exc}") from None


def metric_name(pattern: BoundedPattern | re.Pattern[str]) -> str:
    """A named group's name, else the literal words before the first group ('loss'), else 'metric'."""
    if pattern.groupindex:
        return next(iter(pattern.groupindex))
    head = re.match(r"[A-Za-z_][\w ]*?(?=\s*[:=]?\s*\()", pattern.pattern)
    return head.group(0).strip() if head else "metric"


def sparkline(values: list[float], width: int = 12) -> str:
    """The last `width` values as bar characters, scaled between their own min and max."""
    values = values[-width:]
    if not values:
        return ""
    # Halved: the span of two finite values far apart (`loss 1e308`, then `loss -1e308`) is past
    # the largest float, and infinity over infinity made a NaN bar, a ValueError that ended the TUI.
    low, high = min(values) / 2, max(values) / 2
    span = (high - low) or 1.0
    return "".join(_BARS[min(len(_BARS) - 1, int((v / 2 - low) / span * len(_BARS)))] for v in values)


class RankTrack:
    """One rank: its cursor, its last metric value, its output rate and their histories."""

    def __init__(self) -> None:
        self.cursor: OutputCursor | None = None
        self.value: str | None = None
        self.rate = 0.0  # complete lines a second over the last read
        self.history: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=HISTORY))

    def reading(self) -> float | None:
        """The value as a number, NaN and the infinities included; None where it reads as none."""
        try:
            return float(self.value) if self.value is not None else None
        except ValueError:
            return None

    def number(self) -> float | None:
        """The value as a history holds it: None where it is no finite number. A rank's `loss
        nan` or `loss 1e999` (infinity) went in as read: a sparkline scaled by it drew a NaN bar,
        a ValueError that ended the TUI, and with it the run."""
        number = self.reading()
        return number if number is not None and math.isfinite(number) else None


class Tracker:
    """Metric, output rate and history for every rank of an engine."""

    def __init__(self, engine: Engine, pattern: BoundedPattern | None) -> None:
        self.engine = engine
        self.pattern = pattern
        self.stopped_in: int | None = None  # the local rank whose line took the pattern past its time limit
        self.name = metric_name(pattern) if pattern is not None else None
        self.ranks: dict[int, RankTrack] = {}
        self._last_read = 0.0
        self._generation = -1

    def update(self, snap: GroupSnapshot, now: float | None = None) -> bool:
        """Read the ranks' new output and the snapshot's samples, at most once a READ_SECONDS;
        True when it did."""
        now = time.monotonic() if now is None else now
        if now - self._last_read < READ_SECONDS:
            return False
        elapsed = now - self._last_read if self._last_read else READ_SECONDS
        self._last_read = now
        if snap.generation != self._generation:  # a group restart: new rings, new numbers
            self._generation, self.ranks = snap.generation, {}
        for rank in snap.ranks:
            track = self.ranks.setdefault(rank.local_rank, RankTrack())
            if self.pattern is not None:
                self._read(rank.local_rank, track, elapsed)
            self._sample(track, rank, rate=self.pattern is not None)
        return True

    def _read(self, local_rank: int, track: RankTrack, elapsed: float) -> None:
        before = track.cursor.line if track.cursor is not None else None
        # All it keeps, asked as its newest: the engine makes them aside from the output as it
        # waits, and a quiet rank's next look makes none. Read as all new lines, every rank's
        # whole ring became lines for good, one Python object each (64 quiet ranks of 10k lines:
        # a TUI of 156 MB against 96 with a metric).
        cursor, lines, open_lines = self.engine.output_since(local_rank, track.cursor, tail=EVERY_KEPT_LINE)
        track.cursor = cursor
        track.rate = 0.0 if before is None else max(0, cursor.line - before) / elapsed
        for raw in (*reversed(open_lines), *reversed(lines)):  # the newest match is the one wanted
            if type(raw) is RanktopLine:  # a restart's separator is not the rank's output
                continue
            # As the pane shows the line, as a search reads it: a value in colours (Rich's log
            # handler colours numbers, and the ranks get FORCE_COLOR) gave none, and a value in an
            # escape sequence the pane drops (`ESC ] 0 ; loss 9 BEL`) was read where none shows.
            found = self.pattern.search(drawable(raw.decode("utf-8", "replace")))
            if self.pattern.stopped:  # given up for good: no value from here on, the last one stays
                if self.stopped_in is None:
                    self.stopped_in = local_rank
                break
            value = (found.group(1) if found.groups() else found.group(0)) if found else None
            # (a group that took no part in the match, `loss (\S+)|acc` on `acc`, is no value: it
            # was None, a TypeError at the next read that ended the TUI)
            if value is not None:
                track.value = value[:16]
                break

    @staticmethod
    def _sample(track: RankTrack, rank, *, rate: bool) -> None:  # noqa: ANN001 (a RankSnapshot)
        history = track.history
        if rate:
            history["out"].append(track.rate)
        if rank.cpu_percent is not None:
            history["cpu"].append(rank.cpu_percent)
        if rank.rss is not None:
            history["rss"].append(float(rank.rss))
        if rank.gpu is not None and rank.gpu.util_percent is not None:
            history["gpu"].append(rank.gpu.util_percent)
        if rank.gpu is not None and (rank.gpu.proc_mem or rank.gpu.mem_used) is not None:
            history["gmem"].append(float(rank.gpu.proc_mem or rank.gpu.mem_used))
        number = track.number()
        if number is not None:
            history["metric"].append(number)

    def outliers(self) -> set[int]:
        """Local ranks whose metric is far from the others' (median absolute deviation), and those
        whose value is NaN or infinite (a loss gone wrong) where others' are numbers."""
        readings = {r: t.reading() for r, t in self.ranks.items()}
        diverged = {r for r, v in readings.items() if v is not None and not math.isfinite(v)}
        numbers = {r: v for r, v in readings.items() if v is not None and r not in diverged}
        if len(numbers) + len(diverged) < 3:
            return set()
        marked = diverged if numbers else set()
        if len(numbers) < 3:
            return marked
        median = statistics.median(numbers.values())
        mad = statistics.median(abs(v - median) for v in numbers.values())
        if mad == 0:
            return marked | ({r for r, v in numbers.items() if v != median} if len(set(numbers.values())) > 1 else set())
        return marked | {r for r, v in numbers.items() if abs(v - median) > OUTLIER_MADS * mad}

    def title_part(self, local_rank: int) -> str | None:
        """'loss 0.0123 4.0/s' for a rank's title, or None without a metric."""
        track = self.ranks.get(local_rank)
        if self.pattern is None or track is None:
            return None
        return f"{self.name} {track.value or '-'} {track.rate:.1f}/s"

    def sparks(self, local_rank: int, room: int | None = None) -> str:
        """'cpu ▁▃▅ out ▂▂▇ loss ▇▅▃' for the zoomed title, in at most `room` cells (None: any):
        shorter bars first, then fewer series (the metric's last), else ""."""
        track = self.ranks.get(local_rank)
        if track is None:
            return ""
        names = {"cpu": "cpu", "rss": "rss", "gpu": "gpu", "gmem": "gmem", "out": "out", "metric": self.name}
        series = [key for key in names if len(track.history.get(key, ())) > 1]

        def line(keys: list[str], bars: int) -> str:
            return "  ".join(f"{names[key]} {sparkline(list(track.history[key]), bars)}" for key in keys)

        tries = [(series, bars) for bars in SPARK_BARS]
        kept = list(series)
        for key in SPARKS_GIVEN_UP:  # (the ones least telling of a rank's health go first)
            if key in kept and len(kept) > 1:
                kept.remove(key)
                tries.append((list(kept), SPARK_BARS[-1]))
        for keys, bars in tries:
            text = line(keys, bars)
            if room is None or cell_len(text) <= room:
                return text
        return ""
