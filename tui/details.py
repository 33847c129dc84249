"""The details view of one rank (`m`): who it is, where its logs are, and the histories the TUI
keeps of it (cpu, memory, GPU, output rate, the --metric value) as labelled sparklines with their
current, lowest and highest values. Redrawn every second from the engine's snapshot."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

from ranktop.core.engine import Engine, OutputCursor
from ranktop.core.state import GroupSnapshot, RankSnapshot
from ranktop.tui.cells import drawable
from ranktop.tui.metric import RankTrack, Tracker, sparkline
from ranktop.tui.panes import gpu_util_text, human_bytes, human_duration, pid_text, state_label
from ranktop.tui.screens import MODAL_HELP, SIDEWAYS, ClosesOnTop
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.dom import DOMNode
from textual.screen import ModalScreen
from textual.widgets import Static

REFRESH_SECONDS = 1.0


def _percent(v: float) -> str:
    return f"{v:.0f}%"


def _bytes(v: float) -> str:
    return human_bytes(int(v))


def _rate(v: float) -> str:
    return f"{v:.1f}/s"


def _number(v: float) -> str:
    return f"{v:.4g}"


# (history key, label, how a value reads)
SERIES: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("cpu", "cpu", _percent), ("rss", "memory", _bytes), ("gpu", "gpu util", _percent),
    ("gmem", "gpu memory", _bytes), ("out", "output", _rate), ("metric", "metric", _number),
)


def details_text(rank: RankSnapshot, group: GroupSnapshot, track: RankTrack | None, now: float, *,
                 width: int = 76, metric_name: str | None = None) -> Text:
    """The view's text for `rank`: identity lines, log paths, then one line per history."""
    text = Text()
    text.append(f"rank {rank.rank}", style="bold")
    text.append(f"  local {rank.local_rank} {pid_text(rank)}  ")
    text.append(state_label(rank), style="bold reverse")
    text.append(f"\nrestarts {rank.restarts}  attempt_{group.attempt} (of {group.max_restarts + 1 + group.user_restarts})")
    if rank.started_at:
        started = datetime.datetime.fromtimestamp(rank.started_at).strftime("%H:%M:%S")
        text.append(f"  started {started}, {human_duration(now - rank.started_at)} ago")
    if rank.last_output_at and rank.state.alive:
        text.append(f"\nlast output {human_duration(now - rank.last_output_at)} ago")
    for stream, path in (("stdout", rank.stdout_log), ("stderr", rank.stderr_log)):
        if path:
            text.append(f"\n{stream}  {drawable(path)}", style="dim")
    gpu = rank.gpu
    if gpu is not None and gpu.index is not None:  # the title has room for the rank's own memory only
        text.append(f"\ngpu{gpu.index}  util {gpu_util_text(gpu)}  this rank {human_bytes(gpu.proc_mem)}  "
                    f"device {human_bytes(gpu.mem_used)} of {human_bytes(gpu.mem_total)} used", style="cyan")
    spark_width = max(8, width - 55)  # label 12, then "  now", "  min", "  max" with 8-column values
    text.append("\n")
    for key, label, fmt in SERIES:
        if key == "metric":
            if metric_name is None:
                continue
            label = drawable(metric_name)[:12]
        values = list(track.history[key]) if track is not None and key in track.history else []
        text.append(f"\n{label:<12}")
        if not values:
            text.append(_why_no_values(key, rank, group, track), style="dim")
            continue
        text.append(sparkline(values, spark_width).ljust(spark_width), style="bold")
        text.append(f"  now {fmt(values[-1]):>8}  min {fmt(min(values)):>8}  max {fmt(max(values)):>8}")
    return text


def _why_no_values(key: str, rank: RankSnapshot, group: GroupSnapshot, track: RankTrack | None) -> str:
    """What an empty history means: not sampled yet, or nothing to sample (no GPU: it never fills)."""
    if key in ("gpu", "gmem"):
        if group.gpu_status:  # "no GPU" (no NVML, no driver, no device), "NVML error: ..."
            return drawable(group.gpu_status)
        if rank.gpu is None and track is not None and track.history.get("cpu"):  # sampled: no device is the rank's
            return "no GPU seen for this rank"
    if key == "out":
        return "no samples yet (read while this view is open)"
    return "no samples yet"


class RankDetails(ClosesOnTop, ModalScreen[None]):
    """One rank's details and histories; Esc (or m) closes it."""

    BINDINGS = [Binding("escape,m", "dismiss", "Close the details"), MODAL_HELP]

    def __init__(self, engine: Engine, tracker: Tracker, local_rank: int) -> None:
        super().__init__()
        self.engine, self.tracker, self.local_rank = engine, tracker, local_rank
        # Without a --metric the tracker reads no output: the rate is measured here, for this rank.
        self._cursor: OutputCursor | None = None
        self._read_at = 0.0

    def compose(self) -> ComposeResult:
        # Scrolls (it has the focus: ↑ ↓ PgUp PgDn Home End) where the terminal is shorter than
        # the view: the histories, its point, were cut off below the log paths.
        with VerticalScroll(id="details-box"):
            yield Static("", id="details-text", markup=False)
            yield Static(Text("esc: close  ?: keys", style="dim"))

    def key_sections(self, hidden: tuple[str, ...] = ()) -> list[tuple[str, DOMNode, tuple[str, ...]]]:
        """Its keys for the help (tab does nothing: the scrolling box is all that takes the focus;
        ctrl+c copies what the mouse selected), then the box's."""
        return [("Rank details (m)", self, (*hidden, "focus_next", "focus_previous")),
                ("Scrolling the details", VerticalScroll(), SIDEWAYS)]

    def on_mount(self) -> None:
        self.redraw(measure=True)
        self.set_interval(REFRESH_SECONDS, lambda: self.redraw(measure=True))

    def on_resize(self) -> None:
        # At once, for the new width (its lines wrapped, or left room, until the next second);
        # after the layout, which gives the box its new size and a scrollbar or none.
        self.call_after_refresh(self.redraw)

    def redraw(self, measure: bool = False) -> None:
        """The view as it stands; `measure`: the once-a-second redraw, which also takes the output
        rate's sample (a resize's redraw took one too, over the few ms since the last: the view's
        own first resize made every history start with 0/s or a spike, 9.0/s for a rank printing
        2 lines a second, and each resize while it was open added another)."""
        group = self.engine.snapshot()
        rank = next((r for r in group.ranks if r.local_rank == self.local_rank), None)
        box = self.query_one("#details-text", Static)
        if rank is None:
            box.update(Text(f"local rank {self.local_rank} has not started (yet)"))
            return
        track = self.tracker.ranks.get(self.local_rank)
        if measure and track is not None and self.tracker.pattern is None:
            self._measure_rate(track)
        # Inside its scrollbar, where a short terminal shows one: the lines wrapped under it.
        width = self.query_one("#details-box").scrollable_content_region.width or 76
        box.update(details_text(rank, group, track, group.taken_at or time.time(), width=width,
                                metric_name=self.tracker.name))

    def _measure_rate(self, track: RankTrack) -> None:
        now = time.monotonic()
        before = self._cursor
        self._cursor, _lines, _open = self.engine.output_since(self.local_rank, self._cursor)
        if before is not None and before.generation == self._cursor.generation and now > self._read_at:
            track.history["out"].append(max(0, self._cursor.line - before.line) / (now - self._read_at))
        self._read_at = now
