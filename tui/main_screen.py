"""The main screen: header, the grid of rank panes (or the compact list past what fits), the
search bar, the root-cause panel, and every key that acts on a rank or the group.

The screen knows only the Engine interface (core/engine.py): a timer reads `engine.snapshot()` a
few times a second and repaints what is visible, output comes through `engine.output_since()`,
and every key that acts is one command, sent to the engine without waiting for its answer
(RanktopApp.send), which shows when it comes: the monitor loop answers within milliseconds (it
never waits on a rank), but a stop or a group restart of a multi-node run only once the
rendezvous's store has, and the commands after one wait for it. When the group has ended
the screen posts `GroupEnded`; it calls into the app only to send (the app's sender keeps the
screen's commands in order with the app's own: q's stop).
"""

from __future__ import annotations

import math
import os
import signal
import time
from functools import partial
from typing import Any

from ranktop.core import commands as cmd
from ranktop.core.engine import Engine
from ranktop.core.report import format_root_cause
from ranktop.core.sanitize import clean, quoted
from ranktop.core.state import GroupSnapshot, GroupState, RankSnapshot, RankState
from ranktop.core.strays import own_tool
from ranktop.tui.attempts import FileFeed, attempt_dirs
from ranktop.tui.bounded_regex import BoundedPattern, stopped_line
from ranktop.tui.cells import drawable
from ranktop.tui.logview import LogView, search_pattern
from ranktop.tui.metric import Tracker
from ranktop.tui.pager import pager_argv, run_in_front
from ranktop.tui.panes import (
    ACTS_ON_RANKS,
    FILTERS,
    SORTS,
    CalmFooter,
    GroupHeader,
    LiveText,
    RankFeed,
    RankList,
    RankPane,
    list_head,
    rank_title,
    read_only,
)
from ranktop.tui.screens import RootCausePanel, SignalPicker
from ranktop.tui.search_all import RankSearch
from ranktop.tui.usage import compiled_regex
from textual import on
from textual.app import ComposeResult, SuspendNotSupported
from textual.binding import Binding
from textual.containers import Container, Horizontal, VerticalScroll
from textual.events import DescendantFocus, Paste, Resize
from textual.message import Message
from textual.notifications import Notification, Notify
from textual.reactive import reactive
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Input, Static

TICK_SECONDS = 0.25  # snapshot + repaint rate: 4 Hz is live to the eye and cheap under floods
# A pane without focus takes its new lines every second tick (2 Hz): drawing eight scrolling panes
# is most of the TUI's CPU under a flood, and the pane being read stays at 4 Hz.
UNFOCUSED_EVERY = 2
MIN_PANE_WIDTH = 36
MIN_PANE_HEIGHT = 6  # title + 5 lines of output: less than that is not worth a pane
NARROW_TITLE = 72  # panes narrower than this get the label-free title
CONFIRM_SECONDS = 3.0  # a destructive key acts when pressed again within this long
DIGIT_SECONDS = 1.0  # digits typed within this long of each other make one rank number (1 2 -> 12)
# The keys that act on ranks, but K: a stop always acts (it ends a forming round's wait too).
RANK_KEYS = tuple(action for action in ACTS_ON_RANKS if action != "kill_group")


def plan_grid(n: int, width: int, height: int) -> tuple[int, int] | None:
    """(columns, rows) of the best grid for n panes in width x height cells, or None when even the
    best leaves panes under the minimum size (then the compact list is used)."""
    best, best_score = None, -1.0
    for cols in range(1, n + 1):
        rows = math.ceil(n / cols)
        w, h = (width - (cols - 1)) // cols, height // rows  # one column of gutter between panes
        if w < MIN_PANE_WIDTH or h < MIN_PANE_HEIGHT:
            continue
        # Cells are about twice as tall as wide: balance w/2 against h, then prefer fewer empty cells.
        score = min(w / 2, h) - 0.01 * (cols * rows - n)
        if score > best_score:
            best, best_score = (cols, rows), score
    return best


def keys_not_now(snap: GroupSnapshot, local_rank: int) -> dict[str, str]:
    """The actions of RANK_KEYS that can do nothing now in a live run, each with the line its key
    answers at once; the footer shows them dimmed, as keys that will act again. All of them while
    this node has no running round (none formed yet, a later one forming, the exit barrier: the
    engine refuses them all); with the focused rank not running, k and i (nothing to kill, nothing
    reads its stdin); x once no rank here runs (its picker signals the whole group too). An ended
    run's are another matter: they never act again, and the footer leaves them out."""
    if snap.ended:
        return {}
    if not snap.ranks or snap.state == GroupState.RENDEZVOUS:
        return dict.fromkeys(RANK_KEYS, _rendezvous_refusal(snap))
    not_now: dict[str, str] = {}
    rank = snap.ranks[local_rank] if local_rank < len(snap.ranks) else None
    if rank is not None and not rank.state.alive:
        gone = f"rank {rank.rank} is not running ({rank.state.value})"
        not_now.update(kill_rank=f"{gone}: nothing to kill", type_input=f"{gone}: nothing reads its stdin")
    if not any(r.state.alive for r in snap.ranks):
        not_now["signal"] = "no rank of this node is running: nothing to signal"
    return not_now


def _rendezvous_refusal(snap: GroupSnapshot) -> str:
    """Why no key acts on a rank while the node waits on the rendezvous, in words."""
    if not snap.ranks:
        return "waiting for the rendezvous: no ranks to act on yet (K stops the run)"
    if all(r.state == RankState.SUCCEEDED for r in snap.ranks):
        return "this node's ranks are done, waiting at the exit barrier: no rank to act on (K stops the run)"
    return "waiting for the next rendezvous round: no ranks to act on until it forms (K stops the run)"


class StdinBox(Input):
    """`i`'s box: a line for a rank's stdin, as long as one SendInput may carry with its line
    break (cmd.MAX_INPUT). It had no bound: a longer line was refused only once sent, and each
    key slowed with the line's length (0.1 s at 250,000 characters, in tmux on a 2-core box). A
    key past the bound rings the bell (Textual's way); a paste that would go past it says so."""

    LONGEST = cmd.MAX_INPUT - 1

    def __init__(self) -> None:
        super().__init__(id="stdin", max_length=self.LONGEST)

    def on_paste(self, event: Paste) -> None:
        line = event.text.splitlines()[0] if event.text else ""  # (the part of a paste Input takes)
        start, end = sorted(self.selection)  # the paste replaces what is selected
        length = len(self.value) - (end - start) + len(line)
        if length > self.LONGEST:  # Input's own handler refuses it too, with only the bell
            event.prevent_default()
            event.stop()
            self.app.bell()
            self.notify(f"nothing pasted: the line would be {length:,} characters, and one typed into a rank "
                        f"is at most {self.LONGEST:,}", severity="warning", timeout=5, markup=False)


class MainScreen(Screen):
    AUTO_FOCUS = None  # focus follows the focused rank, set explicitly; never "the first widget"

    BINDINGS = [
        # The app's, repeated here first so that a narrow footer still shows them (it lists the
        # focused widget's keys, then the screen's, then the app's, and cuts what does not fit).
        Binding("q", "app.quit", "Quit"),
        Binding("question_mark", "app.help", "Help"),
        Binding("left", "move(-1, 0)", "Move focus between panes", show=False, priority=True),
        Binding("right", "move(1, 0)", "Move focus between panes", show=False, priority=True),
        Binding("up", "move(0, -1)", "Move focus between panes", show=False, priority=True),
        Binding("down", "move(0, 1)", "Move focus between panes", show=False, priority=True),
        Binding("tab", "cycle(1)", "Focus next rank", show=False),
        Binding("shift+tab", "cycle(-1)", "Focus previous rank", show=False),
        *[Binding(str(i), f"digit({i})", "Focus rank N (type its number: 1 2 is rank 12)", show=False)
          for i in range(10)],
        Binding("g,colon", "go_to", "Go to rank…", show=False),
        Binding("z,enter", "zoom", "Zoom"),
        Binding("escape", "unzoom", "Back to the grid", show=False),
        Binding("slash", "search", "Search"),
        Binding("ctrl+f", "search(True)", "Search every rank", show=False),
        Binding("n", "search_step(1)", "Next match (^f: on across ranks)", show=False, priority=True),
        Binding("N", "search_step(-1)", "Previous match (^f: back across ranks)", show=False, priority=True),
        # Stacks before the keys that act on ranks: the footer shows what fits, and at 80 columns
        # `d`, the way into a hang, was past its end.
        Binding("d", "stacks(False)", "Stacks"),
        Binding("D", "stacks(True)", "Stacks (all ranks)", show=False),
        Binding("x", "signal", "Signal…"),
        Binding("k", "kill_rank", "Kill rank"),
        Binding("K", "kill_group", "Stop group"),
        Binding("r", "restart_rank", "Restart rank"),
        Binding("R", "restart_group", "Restart group"),
        Binding("e", "toggle_end_panel", "Show/hide the end report", show=False),
        Binding("E", "end_report", "Scroll the end report from the keyboard (esc: back)", show=False),
        Binding("s", "cycle_sort", "Sort the rank list (rank, state, cpu, quiet)", show=False),
        Binding("v", "cycle_filter", "Filter the rank list (all, problems, running)", show=False),
        Binding("left_square_bracket", "attempt(-1)", "Earlier attempt's output (log files)", show=False),
        Binding("right_square_bracket", "attempt(1)", "Later attempt's output", show=False),
        Binding("y", "copy_root_cause", "Copy the selection, else the root cause (clipboard, OSC 52)", show=False),
        # Priority, as the arrows that extend it are: a priority key is handled before the keys
        # queued ahead of it, so "V up" typed fast would otherwise arrive as "up V".
        Binding("V", "select_lines", "Select lines in the pane (up/down extend, y or enter copies, esc cancels)",
                show=False, priority=True),
        Binding("o", "open_log", "Open the rank's log in $PAGER", show=False),
        Binding("m", "details", "More about the rank: details and histories", show=False),
        Binding("i", "type_input", "Type into the rank's stdin (pdb, prompts)", show=False),
    ]

    class GroupEnded(Message):
        """The engine's run is over (its snapshot says ended); posted once."""

        def __init__(self, snapshot: GroupSnapshot) -> None:
            super().__init__()
            self.snapshot = snapshot

    # State bound down to the widgets that show it (data_bind in compose).
    note: reactive[str | None] = reactive(None, init=False)  # shown in the header, e.g. "stopping…"
    ended: reactive[bool] = reactive(False, init=False)  # the group is over: the end panel shows
    group_stop_taken = False  # the engine took K's stop (q then asks nothing: see RanktopApp.action_quit)
    end_panel_hidden: reactive[bool] = reactive(False, init=False)  # e hid it

    def __init__(self, engine: Engine, metric: BoundedPattern | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.tracker = Tracker(engine, metric)
        self.last: GroupSnapshot = engine.snapshot()
        self.n = self.last.local_world_size
        # Local rank -> its pane, made the first time it is to be shown (see pane()): a pane is
        # ~190 KB of Textual's per-widget machinery, and the compact view shows one of 64.
        self._panes: dict[int, RankPane] = {}
        self._step_note: Notification | None = None  # n / N's last toast: the next one takes its place
        self.current = 0
        self.zoomed = False
        self.compact = False
        self.cols = 1
        self._feeds: dict[int, RankFeed] = {}  # local rank -> the feed its LogView shows
        self._shown: set[int] = set()  # the panes displayed: set in compose
        # (action, local rank, what it is about, when): awaiting its second press (_confirmed)
        self._armed: tuple[str, int, tuple, float] | None = None
        self._digits = ("", 0.0)  # the rank number being typed, and when its last digit came
        self.sort, self.filter = SORTS[0], FILTERS[0]  # the compact rank list's order and filter
        self.everywhere: RankSearch | None = None  # the last search of every rank, while it stands
        self._viewing: dict[int, FileFeed] = {}  # local rank -> the earlier attempt its pane shows
        self._search_all = False  # the search input is for every rank
        self._typing_to = 0  # the local rank the stdin box types into: the one it names
        self._line_select: tuple[int, int] | None = None  # V: (anchor row, cursor row) in the focused pane
        self._reads = 0  # of the engine, by ticks and by actions
        self._header_state: GroupState | None = None  # the state the header shows
        self._unfilled: set[int] = set()  # panes shown since the last read: filled on the next one, whatever its turn
        self._waiting: str | None = None  # what the #waiting line shows
        self._store_lost: str | None = None  # the rendezvous's store, while the engine finds it lost
        # The rank keys the footer dims (keys_not_now at the last read): dimmed from the first frame
        self._dimmed = frozenset(keys_not_now(self.last, self.current))

    # ----- building ---------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        # The first layout's classes go on before anything mounts: changing a class later restyles
        # every widget below it, which cost the first frame a tenth of a second.
        self._set_layout_classes(self._plan(self.app.size.width, self.app.size.height))
        standing = "read-only view" if read_only(self.app) else None  # (ranktop web without --control)
        yield GroupHeader(id="header", standing=standing).data_bind(MainScreen.note, MainScreen.ended)
        yield Static(id="waiting", markup=False)  # while a rendezvous round forms
        with Horizontal(id="body"):
            with VerticalScroll(id="rank-list-box"):
                yield LiveText(id="rank-list-head")  # docked: it stays on screen as the rows scroll
                yield RankList(id="rank-list")
            with Container(id="grid"):
                self._shown = set(range(self.n)) if not self.compact else {self.current}
                yield from (self._new_pane(r) for r in sorted(self._shown))
        yield RootCausePanel(id="root-cause").data_bind(MainScreen.end_panel_hidden)
        yield Input(placeholder="search this rank's output (enter: find, esc: cancel)", id="search")
        yield Input(placeholder="go to rank: type its number, enter (esc: cancel)", id="goto", type="integer")
        yield StdinBox()
        yield CalmFooter(hidden=ACTS_ON_RANKS if read_only(self.app) else ())

    def on_mount(self) -> None:
        if self.tracker.pattern is not None:  # room for the metric column
            self.query_one("#rank-list-box").styles.width = 47
        self.relayout()
        self.focus_rank(0)
        self._read_engine()  # the first frame already shows the ranks' output (is_mounted is not true yet)
        self.set_interval(TICK_SECONDS, self.tick)

    def pane(self, local_rank: int) -> RankPane:
        """The rank's pane, mounted (hidden unless shown) the first time it is asked for: whatever
        looks a pane up gets one, and a rank never shown costs no widgets."""
        pane = self._panes.get(local_rank)  # (a query by id walked the DOM: several per pane each tick)
        return pane if pane is not None else self._mount_pane(local_rank)

    def _new_pane(self, local_rank: int) -> RankPane:
        pane = RankPane(local_rank, id=f"pane-{local_rank}", focused=local_rank == self.current)
        pane.display = local_rank in self._shown
        self._panes[local_rank] = pane
        return pane

    def _mount_pane(self, local_rank: int) -> RankPane:
        """Make the rank's pane and mount it in rank order: the grid places its cells in the order
        of its children."""
        after = [r for r in self._panes if r > local_rank]
        pane = self._new_pane(local_rank)
        self.query_one("#grid").mount(pane, before=self._panes[min(after)] if after else None)
        pane.mount_parts()
        return pane

    # ----- layout -----------------------------------------------------------------------------
    def on_resize(self, event: Resize) -> None:
        if self.relayout():
            self.tick()  # panes just shown (the first real size): fill them now, not on the next tick

    def relayout(self) -> bool:
        """Grid when every pane fits at a useful size; else the rank list plus the focused pane.
        Returns whether a pane that was hidden is shown now."""
        plan = self._plan(self.size.width, self.size.height)
        single = self.zoomed or self.compact
        cols, rows = (1, 1) if single else plan
        self.cols = 1 if single else cols
        grid = self.query_one("#grid")
        grid.styles.grid_size_columns = cols
        grid.styles.grid_size_rows = rows
        self.query_one("#rank-list-box").display = self.compact and not self.zoomed
        self._set_layout_classes(plan)
        return self._show_panes({self.current} if single else set(range(self.n)))

    def _plan(self, width: int, height: int) -> tuple[int, int] | None:
        """(columns, rows) of the grid at this size, None for the compact view; sets `compact`."""
        plan = plan_grid(self.n, width, max(1, height - 2)) if width else (1, 1)  # header and footer rows
        self.compact = plan is None
        return plan

    def _set_layout_classes(self, plan: tuple[int, int] | None) -> None:
        single = self.zoomed or plan is None
        self.set_class(single, "single")
        self.set_class(not single, "-grid")

    def _show_panes(self, wanted: set[int]) -> bool:
        """Show these panes only (mounting those never shown yet); whether one of them was hidden."""
        # Touch only panes whose visibility changes: with 64 ranks most stay as they were.
        for r in self._shown - wanted:
            self._panes[r].display = False
        newly = wanted - self._shown
        self._shown = set(wanted)
        for r in sorted(newly):
            self.pane(r).display = True
        self._unfilled |= newly
        return bool(newly)

    # ----- focus ------------------------------------------------------------------------------
    def focus_rank(self, local_rank: int) -> None:
        if self._line_select is not None:
            self._end_selection()
        local_rank %= self.n
        previous, self.current = self.current, local_rank
        if previous != local_rank:  # each class change restyles the pane's widgets
            self.pane(previous).remove_class("focused")
            self.pane(local_rank).add_class("focused")
        if self.zoomed or self.compact:
            self._show_panes({local_rank})
        self.pane(local_rank).log.focus()
        self.tick()
        if self.compact:
            self.call_after_refresh(self._list_shows, local_rank)

    def _list_shows(self, local_rank: int) -> None:
        """Scroll the rank list so that the focused rank's row is on screen (below its header)."""
        box, listing = self.query_one("#rank-list-box"), self.query_one(RankList)
        row = listing.row_of(local_rank)
        top, height = round(box.scroll_y), box.scrollable_content_region.height - listing.dock_gutter.height
        if row is not None and not top <= row < top + height:
            box.scroll_to(y=max(0, row - height // 2), animate=False, immediate=True)

    def action_cycle_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        self._list_changed(f"rank list sorted by {self.sort}")

    def action_cycle_filter(self) -> None:
        self.filter = FILTERS[(FILTERS.index(self.filter) + 1) % len(FILTERS)]
        shown = {"all": "every rank", "problems": "ranks with a problem", "running": "running ranks"}[self.filter]
        self._list_changed(f"rank list shows {shown}")

    def _list_changed(self, what: str) -> None:
        self.notify(what + self._where_the_list_shows(), timeout=2)
        self.tick()
        if self.compact:
            self.call_after_refresh(self._list_shows, self.current)

    def _where_the_list_shows(self) -> str:
        """What brings the rank list on screen when it is not ("" when it is): a larger terminal
        fits the panes and so hides it, and a zoom hides it too."""
        if not self.compact:
            return " (the list shows only where the panes do not fit)"
        return " (zoomed: esc shows the list)" if self.zoomed else ""

    def on_descendant_focus(self, event: DescendantFocus) -> None:
        # A click (or Textual's own focus moves) on a log widget makes its rank the focused one.
        if event.widget is not self.focused:  # stale: the focus has moved on since (two moves in a row)
            return
        for node in event.widget.ancestors_with_self:
            if isinstance(node, RankPane) and node.local_rank != self.current:
                self.focus_rank(node.local_rank)
                return

    @on(RankPane.Picked)
    @on(RankList.Picked)
    def picked(self, event: RankPane.Picked | RankList.Picked) -> None:
        self.focus_rank(event.local_rank)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Arrow keys are priority bindings (they beat the log's own scrolling); let the search
        # input keep them while it is being typed into.
        if action in ("move", "focus_rank", "digit", "cycle", "zoom", "search_step", "select_lines") and isinstance(
                self.focused, Input):
            return False
        if action == "search" and not parameters and isinstance(self.focused, Input):
            return False  # `/` types a slash into the box: the footer showed `/ Search` alone there
        if action == "move" and self.zoomed and self._line_select is None:  # zoomed: the arrows scroll the pane
            return False
        if action in ("move", "select_lines") and isinstance(self.focused, RootCausePanel):  # its arrows scroll it
            return False
        if action in self._dimmed:
            return None  # shown, dimmed: the key still answers (answer_dimmed)
        return True

    def answer_dimmed(self, action: str, parameters: tuple[object, ...]) -> bool:
        """A dimmed rank key pressed (or run from the palette): Textual runs no disabled action, and
        the key did nothing at all. Its action runs, and says at once why it does nothing now, or
        acts, where the run moved on since the last read. Whether it was such a key."""
        if action not in RANK_KEYS or self.check_action(action, parameters) is not None:
            return False
        getattr(self, f"action_{action}")(*parameters)
        return True

    def action_move(self, dx: int, dy: int) -> None:
        if self._line_select is not None:  # V: up/down extend the selection
            if dy:
                self._extend_selection(dy)
            return
        order = self.query_one(RankList).order
        if self.compact:  # every arrow walks the list as it is sorted and filtered (one column)
            self._walk_list(order, dy or dx)
            return
        step = dx + dy * self.cols
        target = self.current + step
        if 0 <= target < self.n:
            self.focus_rank(target)

    def _walk_list(self, order: list[int], step: int) -> None:
        """Focus the rank `step` rows away in the compact list; only ranks it shows: a rank the
        filter hides is never focused by an arrow (with none shown, its header says 0/N)."""
        if not order:
            return
        if self.current not in order:  # filtered out: start from the list's end nearest the key
            self.focus_rank(order[0] if step > 0 else order[-1])
            return
        target = order.index(self.current) + step
        if 0 <= target < len(order):
            self.focus_rank(order[target])

    def action_cycle(self, step: int) -> None:
        self.focus_rank(self.current + step)

    def action_focus_rank(self, local_rank: int) -> None:
        if local_rank < self.n:
            self.focus_rank(local_rank)

    def action_digit(self, digit: int) -> None:
        """Digits typed in quick succession make one number: 1 then 2 is rank 12 (when it exists)."""
        if self._goto_pending():
            self.query_one("#goto", Input).insert_text_at_cursor(str(digit))
            return
        typed, at = self._digits
        now = time.monotonic()
        number = typed + str(digit)
        if not typed or now - at > DIGIT_SECONDS or self._local_of(int(number)) is None:
            number = str(digit)
        self._digits = (number, now)
        local = self._local_of(int(number))
        if local is not None:
            self.focus_rank(local)
        elif any(str(rank).startswith(number) for rank in self._ranks_here()):
            # The start of a rank's number (1 of 12 on a node of ranks 8..15): said only if no digit follows
            self.set_timer(DIGIT_SECONDS, lambda: self._say_no_rank_if_last((number, now)))
        else:
            self._say_no_rank(number)

    def _say_no_rank_if_last(self, typed: tuple[str, float]) -> None:
        """No digit came after the number `typed` (what self._digits was then): it names no rank."""
        if self._digits == typed:
            self._say_no_rank(typed[0])

    def _ranks_here(self) -> list[int]:
        """The global ranks this node has panes for, in order."""
        return [snap.rank for snap in self.last.ranks] or list(range(self.n))

    def _say_no_rank(self, text: str) -> None:
        """A rank number typed (a digit key, or `g`'s box) that this node has no pane for."""
        ranks = self._ranks_here()
        self.notify(f"no rank {text} here: ranks are {ranks[0]}..{ranks[-1]}", severity="warning", timeout=3,
                    markup=False)

    def _local_of(self, rank: int) -> int | None:
        """The local rank showing global rank `rank`, or None when this node has no such rank."""
        for snap in self.last.ranks:
            if snap.rank == rank:
                return snap.local_rank
        return rank if not self.last.ranks and 0 <= rank < self.n else None

    def shows_rank(self, rank: int) -> bool:
        """Whether this node has a pane for global rank `rank`."""
        return self._local_of(rank) is not None

    def zoom_to_rank(self, rank: int) -> None:
        """Focus global rank `rank`'s pane and zoom it (esc: back to the grid): the stack view's
        enter on a group of ranks, from the odd one out to its output."""
        local = self._local_of(rank)
        if local is None:
            return
        self.focus_rank(local)
        if not self.zoomed:
            self.zoomed = True
            self.relayout()
            self.pane(local).log.focus()

    def focus_now(self, widget: Widget) -> None:
        """Give `widget` the focus at once, not after the keys already typed (Widget.focus waits
        for them): `/` then `need` typed in one go went n to the grid's next match, e and e to
        the end report and d to a stack dump, and the box got nothing (see RanktopApp._grid_key)."""
        self.set_focus(widget)

    def _goto_pending(self) -> bool:
        """`g` was pressed but its input has no focus yet (focus moves a moment later): keys typed
        fast after it (g 2 3 enter) are meant for it, not for the grid."""
        box = self.query_one("#goto", Input)
        return bool(box.display) and self.focused is not box

    def action_go_to(self) -> None:
        box = self.query_one("#goto", Input)
        box.value = ""
        box.display = True
        self.focus_now(box)

    @on(Input.Submitted, "#goto")
    def go_to(self, event: Input.Submitted) -> None:
        self._go_to(event.value.strip())

    def _go_to(self, text: str) -> None:
        # No rank's number is 20 digits long, and int() refuses 4300 and more: a long paste
        # raised ValueError, which ended the TUI and stopped the run.
        local = self._local_of(int(text)) if text.isdigit() and len(text) < 20 else None
        self._close_input("#goto", local)
        if text and local is None:
            self._say_no_rank(text if len(text) < 20 else text[:19] + "…")

    def action_zoom(self) -> None:
        if self._line_select is not None:  # enter copies what V selected
            self._copy_selection()
            return
        if self._goto_pending():  # enter right after g and a number
            self._go_to(self.query_one("#goto", Input).value.strip())
            return
        self.zoomed = not self.zoomed
        self.relayout()
        self.pane(self.current).log.focus()

    def action_unzoom(self) -> None:
        if self.selections:  # (V's selection is one too)
            self._end_selection()
        elif self.zoomed:
            self.action_zoom()

    def action_details(self) -> None:
        from ranktop.tui.details import RankDetails

        self.app.push_screen(RankDetails(self.engine, self.tracker, self.current))

    # ----- selecting text -----------------------------------------------------------------------
    def action_select_lines(self) -> None:
        """Line selection from the keyboard in the focused pane, from its bottom line."""
        log = self.pane(self.current).log
        if not log.row_count:
            self.notify("nothing to select: this pane is empty", severity="warning", timeout=3)
            return
        row = log.bottom_row
        self._line_select = (row, row)
        log.select_rows(row, row)
        self.notify("selecting lines: up/down extend, y or enter copies, esc cancels", timeout=3)

    def _extend_selection(self, step: int) -> None:
        anchor, cursor = self._line_select
        log = self.pane(self.current).log
        cursor = max(0, min(log.row_count - 1, cursor + step))
        self._line_select = (anchor, cursor)
        log.select_rows(anchor, cursor)

    def _copy_selection(self) -> None:
        """What is selected (V, or the mouse) in a pane, to the terminal's clipboard (OSC 52)."""
        text = self.get_selected_text() or ""  # Textual's: each selected widget's get_selection
        self._end_selection()
        self.app.copy_to_clipboard(text)
        self.notify(f"{text.count(chr(10)) + 1} line(s) copied to the terminal's clipboard (OSC 52)", timeout=3)

    def _end_selection(self) -> None:
        self._line_select = None
        self.clear_selection()

    # ----- typing into a rank --------------------------------------------------------------------
    def action_type_input(self) -> None:
        """A line for the focused rank's stdin (a breakpoint()'s pdb reads it); it stays open
        for the next line until esc."""
        if self._cannot_act("type_input"):
            return
        box = self.query_one("#stdin", Input)
        self._typing_to = self.current
        box.placeholder = (f"stdin of rank {self.rank_of(self.current)}: type a line, enter sends it "
                           "(esc: close)")
        box.border_title = f"rank {self.rank_of(self.current)} stdin"
        box.value = ""
        box.display = True
        self.focus_now(box)

    @on(Input.Submitted, "#stdin")
    def send_input(self, event: Input.Submitted) -> None:
        event.input.value = ""
        # To the rank the box names, which a click on another pane while it is open does not change
        self.app.send(cmd.SendInput(self._typing_to, event.value + "\n"), self._input_refused)

    def _input_refused(self, ack: cmd.Ack) -> None:
        if not ack.ok and self.is_mounted:  # a typed line shows in the pane itself; only a refusal needs words
            self.notify(drawable(ack.message), severity="warning", timeout=4, markup=False)

    # ----- search -----------------------------------------------------------------------------
    def action_search(self, every_rank: bool = False) -> None:
        self._search_all = every_rank
        box = self.query_one("#search", Input)
        box.placeholder = ("search every rank's output (enter: find, esc: cancel)" if every_rank
                           else "search this rank's output (enter: find, esc: cancel)")
        box.display = True
        self.focus_now(box)

    @on(Input.Submitted, "#search")
    def run_search(self, event: Input.Submitted) -> None:
        log = self.pane(self.current).log
        query = event.value.strip()
        self._close_search()
        self.everywhere = None
        compiled_regex.cache_clear()  # a new search tries its pattern afresh; its n / N reuse it
        self.tick()
        if self._search_all:
            self._search_every_rank(query)
            return
        if not query:
            log.clear_search()
            return
        try:
            hits = log.search(query)
        except ValueError as exc:  # a bad regular expression: say why, change nothing
            self.notify(drawable(str(exc)), severity="warning", timeout=5, markup=False)
            return
        # The query is often pasted from rank output: plain, safe text, never markup.
        self.notify(drawable(f"{hits} match{'es' if hits != 1 else ''} for {query!r} in rank {self.rank_of(self.current)}"
                          + ("  (n / N: next / previous)" if hits else "")), timeout=3, markup=False)

    def _search_every_rank(self, query: str) -> None:
        for pane in self._panes.values():  # (a pane not made yet has no search to clear)
            pane.log.clear_search()
        if not query:
            self.tick()
            return
        try:
            found = RankSearch.run(self.engine, range(self.n), query)
        except ValueError as exc:
            self.notify(drawable(str(exc)), severity="warning", timeout=5, markup=False)
            return
        self.notify(drawable(found.summary(self.rank_of)), timeout=5, markup=False)
        if found.stopped_in is not None and search_pattern(query).tell_once():
            self._say_search_stopped(query, found.stopped_in)
        if not found.counts:
            return
        self.everywhere = found
        first = self.current if self.current in found.counts else found.next_rank(self.current, +1)
        self._show_matches_of(first, -1)

    @on(LogView.SearchStopped)
    def search_stopped(self, event: LogView.SearchStopped) -> None:
        local_rank = next((r for r, pane in self._panes.items() if pane.log is event.log), None)
        if local_rank is not None:
            self._say_search_stopped(event.query, local_rank)

    def _say_search_stopped(self, query: str, local_rank: int) -> None:
        """The one line that says the search's pattern was given up in a rank (once a search:
        BoundedPattern.tell_once, as a search of every rank, then its pane's own, meet the line)."""
        line = stopped_line(f"the pattern {quoted(query[:80])}", search_pattern(query), self.rank_of(local_rank),
                            "no more matches counted")
        self.notify(drawable(line), severity="warning", timeout=10, markup=False)

    def _show_matches_of(self, local_rank: int, direction: int) -> None:
        """Focus `local_rank` and highlight the search there, at its first (+1) or last (-1) match."""
        self.focus_rank(local_rank)  # (its pane shown, made now if need be, and filled)
        self._take_scrollback(local_rank)
        log = self.pane(local_rank).log
        log.search(self.everywhere.query)
        log.go_to_edge_match(direction)

    def _take_scrollback(self, local_rank: int) -> None:
        """The rank's whole kept output into its pane now, where its feed's first look brought only
        the newest lines (a pane made just now): the rest came at the next tick, and a match older
        than them was found by the search of every rank but not by the pane's, which followed
        the tail."""
        feed = self._feeds.get(local_rank)
        if feed is not None and feed.scrollback_due and local_rank not in self._viewing:
            self.pane(local_rank).log.poll()

    def action_search_step(self, direction: int) -> None:
        """n / N: through the focused pane's matches; after a search of every rank, on to the
        next (previous) rank's. Each step says where it is: a match on screen moved only its colour."""
        log = self.pane(self.current).log
        if self.everywhere is None and not log.search_query:
            self._step_toast(f"no search in rank {self.rank_of(self.current)}: / searches it, ctrl+f every rank", 3)
            return
        if self.everywhere is None or (log.search_query and not log.at_edge_match(direction)):
            wrapped = log.search_next() if direction > 0 else log.search_prev()
            self._say_match(direction if wrapped else 0)
            return
        target = self.everywhere.next_rank(self.current, direction)
        if target is not None:
            self._show_matches_of(target, direction)
            self._say_match(0)

    def _say_match(self, wrapped: int) -> None:
        """'match 3 of 4 in rank 2', and where it wrapped round (+1: to the oldest, -1: the newest)."""
        position = self.pane(self.current).log.match_position
        if position is None:
            return
        note = {1: "  (wrapped round to the oldest)", -1: "  (wrapped round to the newest)"}.get(wrapped, "")
        self._step_toast(f"match {position[0]} of {position[1]} in rank {self.rank_of(self.current)}{note}", 2)

    def _step_toast(self, text: str, seconds: float) -> None:
        """`text` as a toast in the place of n / N's last one: each step's own piled up, n held
        down, dozens over the pane's lines. (Textual takes a single toast back by a private call
        only; where it has none, the toasts pile up as they did.)"""
        unnotify = getattr(self.app, "_unnotify", None)
        if self._step_note is not None and unnotify is not None:
            unnotify(self._step_note)
        self._step_note = Notification(text, timeout=seconds)
        self.app.post_message(Notify(self._step_note))

    def on_key(self, event: Any) -> None:
        if event.key == "escape" and isinstance(self.focused, Input):
            event.stop()
            self._close_input(f"#{self.focused.id}")

    def _close_search(self) -> None:
        self._close_input("#search")

    def _close_input(self, selector: str, local_rank: int | None = None) -> None:
        """Hide the input and give the focus back to a pane: the current one, or `local_rank`'s
        (focused here, in one go: a focus moved twice would come back to the first pane)."""
        box = self.query_one(selector, Input)
        box.display = False
        if local_rank is None:
            self.pane(self.current).log.focus()
        else:
            self.focus_rank(local_rank)

    # ----- commands to the ranks ----------------------------------------------------------------
    def rank_of(self, local_rank: int) -> int:
        ranks = self.last.ranks
        return ranks[local_rank].rank if local_rank < len(ranks) else local_rank

    def _cannot_act(self, action: str) -> bool:
        """Whether the key of `action` (one of ACTS_ON_RANKS) must do nothing here, said at once
        (before any question, picker or input box that would only end in a refusal): in a
        read-only view, once the group has ended, or where keys_not_now says why not (the first
        round forming: `k` asked to kill a rank 0 not started)."""
        snap = self.engine.snapshot()
        if snap.ended:  # (first: an ended run's final view is read-only too)
            self.notify("the group has ended: no rank left to signal, restart or type into (q quits)", severity="warning")
            return True
        if read_only(self.app):
            from ranktop.core.client import READ_ONLY  # (a read-only engine is a client's)

            self.notify(READ_ONLY, severity="warning", timeout=3, markup=False)
            return True
        why = keys_not_now(snap, self.current).get(action)
        if why is not None:
            self.notify(why, severity="warning", timeout=3, markup=False)
            return True
        return False

    def _send(self, command: cmd.Command) -> None:
        """Hand one command to the engine, and show its answer when it comes: the keys and frames
        go on meanwhile (RanktopApp.send). The monitor loop answers in order, and a stop or a group
        restart of a multi-node run only once the rendezvous's store has: a key that waited for
        its answer here waited behind those too."""
        self.app.send(command, self._show_answer)

    def _show_answer(self, ack: cmd.Ack) -> None:
        if not self.is_mounted:  # (a sent command's answer, come as the app left)
            return
        # An attached engine's words: plain, safe text, never markup.
        self.notify(drawable(ack.message), severity="information" if ack.ok else "warning", timeout=3, markup=False)
        self.tick()

    def send_signal(self, sig: int, whole_group: bool) -> None:
        if not self._cannot_act("signal"):
            self._send(cmd.SignalGroup(sig) if whole_group else cmd.SignalRank(self.current, sig))

    def action_signal(self) -> None:
        if self._cannot_act("signal"):
            return
        picker = SignalPicker(self.rank_of(self.current), self.current, self.n)
        self.app.push_screen(picker, lambda choice: choice and self.send_signal(*choice))

    def _confirmed(self, action: str, key: str, question: str, snap: GroupSnapshot | None = None) -> bool:
        """Destructive keys act on a second press within CONFIRM_SECONDS (of the same key, on
        the same rank, about the same process or attempt); the first one says what the second
        will do. `snap`: the picture `question` was worded from, if it names what it is about."""
        now = time.monotonic()
        armed, about = self._armed, self._asked_about(action, snap)
        if armed is not None and armed[:3] == (action, self.current, about) and now - armed[3] <= CONFIRM_SECONDS:
            self._armed = None
            self.app.clear_notifications()  # the question is answered: the outcome replaces it
            return True
        self._armed = (action, self.current, about, now)
        self.notify(f"{question}  Press {key} again to confirm.", title="Confirm", severity="warning",
                    timeout=CONFIRM_SECONDS, markup=False)
        return False

    def _asked_about(self, action: str, snap: GroupSnapshot | None = None) -> tuple:
        """What a destructive key's question is about, beyond its rank: a second press answers
        it only while that still stands. The group restarted between the two presses (a failure
        with restarts left, another view's R) and the second R, asked about `attempt_1`, made
        attempt_2 of the attempt just begun; a k or an r, asked of a process since replaced,
        ended its new one. K stops whatever runs, and so asks about the run alone."""
        if action == "kill_group":
            return ()
        snap = snap if snap is not None else self.engine.snapshot()
        if action == "restart_group":
            return (snap.generation,)
        rank = snap.ranks[self.current] if self.current < len(snap.ranks) else None
        return (snap.generation, rank.pid if rank is not None else None)

    def action_kill_rank(self) -> None:
        rank = self.rank_of(self.current)
        if not self._cannot_act("kill_rank") and self._confirmed("kill_rank", "k", f"Kill rank {rank} (SIGKILL)?"):
            self._send(cmd.KillRank(self.current))

    def action_kill_group(self) -> None:
        grace = self.last.shutdown_timeout
        if not self._cannot_act("kill_group") and self._confirmed(
                "kill_group", "K", f"Stop every rank (SIGTERM, SIGKILL after {grace:g} s)?"):
            self.note = "stopping…"  # at once: the engine's answer may wait on the rendezvous's store
            self.app.send(cmd.Stop(signal.SIGTERM), self._group_stop_answered)

    def _group_stop_answered(self, ack: cmd.Ack) -> None:
        if not self.stop_answered(ack):
            self.group_stop_taken = self.group_stop_taken or ack.ok
            self._show_answer(ack)

    def stop_answered(self, ack: cmd.Ack) -> bool:
        """The answer to a stop (K's, q's): shown where it was refused, and the header's
        `stopping…` taken back while the run goes on (it stayed, the ranks running). Whether it
        was refused so."""
        if ack.ok or not self.is_mounted or self.ended:
            return False
        self.note = None
        self.notify(drawable(ack.message), severity="error", timeout=8, markup=False)
        return True

    def action_restart_rank(self) -> None:
        if self._cannot_act("restart_rank"):
            return
        rank = self.rank_of(self.current)
        question = f"Restart rank {rank}?"
        if self.last.world_size > 1:
            # Every rank gets MASTER_ADDR/MASTER_PORT: a collective (gloo, NCCL) cannot take back
            # one new process, so its peers fail. ranktop cannot see whether they use one.
            question += (" Its peers share MASTER_ADDR with it: in a collective job (gloo/NCCL) they fail"
                         " when it restarts alone (R restarts the whole group).")
        if self._confirmed("restart_rank", "r", question):
            self._send(cmd.RestartRank(self.current))  # (a group restart, in a multi-node run)

    def action_restart_group(self) -> None:
        if self._cannot_act("restart_group"):
            return
        # One picture for the question's words and what its answer is armed for: a restart that
        # came between two (the engine runs on meanwhile) armed the attempt after the one named.
        snap = self.engine.snapshot()
        if self._confirmed("restart_group", "R", f"Restart every rank as attempt_{snap.attempt + 1}?", snap):
            self._send(cmd.RestartGroup())

    def action_stacks(self, all_ranks: bool) -> None:
        from ranktop.tui.stacks_view import StacksScreen

        self.app.push_screen(StacksScreen(self.engine, None if all_ranks else [self.current]))

    def action_attempt(self, step: int) -> None:
        """Show the focused rank's output of an earlier (step -1) or later (+1) attempt, read from
        its log files; past the newest, the live output again."""
        r = self.current
        dirs = attempt_dirs(self.last.log_dir, self.last.attempt)
        if len(dirs) < 2:
            self.notify("no earlier attempt: this is the first", timeout=2)
            return
        names = [os.path.basename(d) for d in dirs]
        viewing = self._viewing.get(r)
        at = names.index(viewing.name) if viewing is not None and viewing.name in names else len(dirs) - 1
        target = max(0, min(len(dirs) - 1, at + step))
        if target == len(dirs) - 1:  # the newest attempt is the live one
            self._viewing.pop(r, None)
            self._feeds.pop(r, None)  # the next tick brings the live feed back
            self.tick()
            self.notify(f"rank {self.rank_of(r)}: live output ({names[-1]})", timeout=2)
            return
        feed = FileFeed(dirs[target], r, self.last.output_lines_kept)
        self._viewing[r] = feed
        self.pane(r).log.set_ring(feed)
        self.tick()
        self.notify(f"rank {self.rank_of(r)}: {feed.name} from its log files  ([ earlier, ] later)", timeout=3)

    def action_copy_root_cause(self) -> None:
        """The selection, if there is one; else the root cause as the text report has it, to the
        terminal's clipboard (OSC 52: works over SSH, and in tmux with `set-clipboard on`)."""
        if self.selections:  # V's, or the mouse's
            self._copy_selection()
            return
        snap = self.engine.snapshot()
        if snap.root_cause is None:
            self.notify("no root cause to copy: no rank has failed on its own", severity="warning", timeout=3)
            return
        text = clean(format_root_cause(snap.root_cause, name=snap.name, attempt=snap.attempt,
                                       max_restarts=snap.max_restarts, run_dir=snap.log_dir,
                                       user_restarts=snap.user_restarts), newlines=True)
        self.app.copy_to_clipboard(text)
        self.notify(f"root cause copied ({text.count(chr(10)) + 1} lines) to the terminal's clipboard (OSC 52)",
                    timeout=3)

    def action_open_log(self) -> None:
        """The focused rank's log files in $PAGER (less if unset); the TUI steps aside meanwhile."""
        snap = self.last.ranks[self.current] if self.current < len(self.last.ranks) else None
        paths = [p for p in (snap.stdout_log, snap.stderr_log) if p and os.path.exists(p)] if snap else []
        if not paths:
            self.notify("this rank has no log file to open", severity="warning", timeout=3)
            return
        try:
            argv = pager_argv(paths)
        except ValueError as exc:  # (PAGER='"': a traceback that ended the TUI, and the run with it)
            self.notify(drawable(f"bad $PAGER {quoted(os.environ.get('PAGER'))}: {exc}; the log: {paths[0]}"),
                        severity="warning", markup=False)
            return
        try:
            with self.app.suspend(), own_tool():  # its exit is its own, not an orphan's to reap
                # Nothing may leave this block raising: Textual's suspend resumes the TUI only when
                # it ends normally (a $PAGER not on PATH left the screen blank, no key read, for good).
                try:
                    problem = run_in_front(argv)
                except OSError as exc:
                    problem = exc.strerror or str(exc)
        except SuspendNotSupported:
            problem = None
            self.notify(drawable(f"cannot hand the terminal over here; the log: {paths[0]}"), severity="warning",
                        markup=False)
        if problem is not None:
            self.notify(drawable(f"cannot run {quoted(argv[0][:200])}: {problem}; the log: {paths[0]}"),
                        severity="warning", markup=False)
        self.refresh()

    def action_toggle_end_panel(self) -> None:
        if self.ended:
            self.end_panel_hidden = not self.end_panel_hidden
            if self.end_panel_hidden and isinstance(self.focused, RootCausePanel):
                self.action_focus_pane()  # (the focus would be left on nothing)
        else:
            self.notify("the run has not ended: e shows or hides its end report once it has", timeout=3)

    def action_end_report(self) -> None:
        """The end report takes the focus (shown again if e hid it), so that its keys scroll it."""
        if not self.ended:
            self.notify("the run has not ended: E scrolls its end report once it has", timeout=3)
            return
        self.end_panel_hidden = False
        self.focus_now(self.query_one(RootCausePanel))

    def action_focus_pane(self) -> None:
        self.pane(self.current).log.focus()

    # ----- the timer --------------------------------------------------------------------------
    def tick(self) -> None:
        """Read one snapshot and repaint what changed; the only place the engine is read."""
        if self.is_mounted:
            self._read_engine()

    def _read_engine(self) -> None:
        snap = self.engine.snapshot()
        self.last = snap
        self._dim_keys(snap)
        self._say_if_dropped()
        now = snap.taken_at or time.time()
        # Every other tick repaints every pane; a change of the group's state (its end, say)
        # shows everywhere at once, and so does an end with none (the engine lost: "unknown").
        every_pane = (self._reads % UNFOCUSED_EVERY == 0 or snap.state != self._header_state
                      or snap.ended != self.ended)
        if every_pane:
            self.query_one(GroupHeader).show_group(snap, now)
            self._header_state = snap.state
        self._show_waiting(snap)
        self._show_store(snap, now)
        if snap.ranks:  # none started yet (a rendezvous round forming), or none ever will
            self._show_ranks(snap, now, every_pane)
        if snap.ended and not self.ended:
            self._on_end(snap)

    def _dim_keys(self, snap: GroupSnapshot) -> None:
        """The footer dims the rank keys that can do nothing now (keys_not_now), and shows them
        whole again once they can: it asks check_action only when told that the answer changed."""
        dimmed = frozenset(keys_not_now(snap, self.current))
        if dimmed != self._dimmed:
            self._dimmed = dimmed
            self.refresh_bindings()

    def _say_if_dropped(self) -> None:
        """An attached view whose connection the engine ended (it asked nothing while suspended,
        took nothing behind a frozen link) connects again: it says why, and that it goes on."""
        take = getattr(self.engine, "take_dropped", None)  # (a RemoteEngine's: a local run has no connection)
        if take is not None and (why := take()):
            self.notify(drawable(f"the run's engine ended this view's connection ({why}); the view connected again"),
                        severity="warning", timeout=10, markup=False)

    def _show_ranks(self, snap: GroupSnapshot, now: float, every_pane: bool) -> None:
        """The shown panes (all of them, else the current one and those not filled yet), and the
        rank list where it is shown."""
        digits = len(str(snap.world_size - 1))
        self.tracker.update(snap)
        self._say_if_metric_stopped()
        outliers = self.tracker.outliers()
        for rank in snap.ranks:
            r = rank.local_rank
            if r in self._shown and (every_pane or r == self.current or r in self._unfilled):
                self._show_pane(snap, rank, now, digits, outlier=r in outliers)
        self._reads += 1
        if self.compact:
            metrics = None if self.tracker.pattern is None else {
                r: track.value or "-" for r, track in self.tracker.ranks.items()}
            listing = self.query_one(RankList)
            listing.show_ranks(snap.ranks, self.current, now, sort=self.sort, filter_=self.filter,
                               hits=None if self.everywhere is None else self.everywhere.counts,
                               metrics=metrics, outliers=outliers)
            self.query_one("#rank-list-head", LiveText).show(
                list_head(len(listing.order), len(snap.ranks), self.sort, self.filter))

    def _say_if_metric_stopped(self) -> None:
        """Once: the --metric pattern was given up (a line took it past its time limit); the
        values shown are the last ones read, and the output rates go on."""
        stopped_in = self.tracker.stopped_in
        if stopped_in is None or not self.tracker.pattern.tell_once():
            return
        line = stopped_line(f"the --metric pattern {quoted(self.tracker.pattern.pattern[:80])}", self.tracker.pattern,
                            self.rank_of(stopped_in), "no more values read")
        self.notify(drawable(line), severity="warning", timeout=10, markup=False)

    def _show_pane(self, snap: GroupSnapshot, rank: RankSnapshot, now: float, digits: int, *, outlier: bool) -> None:
        """One rank's pane: its title, and its output (unless an earlier attempt's log is viewed)."""
        r = rank.local_rank
        pane = self.pane(r)
        viewing = self._viewing.get(r)
        if viewing is None:
            feed = self._feed(r, snap)
            feed.version = rank.output_version
        position = pane.log.position_text if viewing is None else f"{viewing.name} (log files, ] newer)"
        pane.set_title(rank_title(rank, now, world_digits=digits, narrow=pane.size.width < NARROW_TITLE,
                                  position=position, hits=self._hits_of(r),
                                  metric=self.tracker.title_part(r), outlier=outlier,
                                  sparks=partial(self.tracker.sparks, r) if self.zoomed else None,
                                  log_path=rank.stdout_log if self.zoomed else None,
                                  width=pane.title_width))
        pane.log.poll()
        self._unfilled.discard(r)

    def _show_waiting(self, snap: GroupSnapshot) -> None:
        """What a forming rendezvous round waits for, above the panes (empty until it completes)."""
        waiting = None if snap.ended or not snap.waiting else drawable(snap.waiting)
        if waiting != self._waiting:
            self._waiting = waiting
            box = self.query_one("#waiting", Static)
            if waiting and snap.ranks and all(r.state == RankState.SUCCEEDED for r in snap.ranks):
                box.update(f"{waiting}\nthis node's ranks are done; it ends once every node's are")  # the exit barrier
            elif waiting:
                n = snap.local_world_size
                ranks = f"{n} ranks start" if n != 1 else "1 rank starts"
                box.update(f"{waiting}\nthis node's {ranks} once the round is complete")
            box.display = bool(waiting)

    def _show_store(self, snap: GroupSnapshot, now: float) -> None:
        """The rendezvous's store lost while the ranks run (or answering again): a toast once; the
        header marks it for as long as it lasts."""
        if snap.store_lost == self._store_lost:
            return
        was, self._store_lost = self._store_lost, snap.store_lost
        if snap.store_lost and snap.store_silent:  # (its node paused or hung: it may answer again)
            self.notify(drawable(f"{snap.store_lost} does not answer (the node serving it paused, hung or cut off?): "
                              "this node's ranks run on"), severity="warning", timeout=10, markup=False)
        elif snap.store_lost:
            self.notify(drawable(f"lost {snap.store_lost}: this node's ranks run on, but no new round can form"),
                        severity="warning", timeout=10, markup=False)
        elif was:
            self.notify(drawable(f"{was} answers again"), timeout=5, markup=False)
        self.query_one(GroupHeader).show_group(snap, now)

    def _hits_of(self, local_rank: int) -> int | None:
        return None if self.everywhere is None else self.everywhere.counts.get(local_rank, 0)

    def _feed(self, local_rank: int, snap: GroupSnapshot) -> RankFeed:
        """The rank's feed for this attempt: a group restart starts every pane over."""
        feed = self._feeds.get(local_rank)
        if feed is None or feed.generation != snap.generation:
            feed = RankFeed(self.engine, local_rank, snap.generation, snap.output_lines_kept)
            self._feeds[local_rank] = feed
            if local_rank == self.current and self._line_select is not None:
                self._line_select = None  # its rows were the old attempt's (set_ring drops the selection)
            self.pane(local_rank).log.set_ring(feed)
        return feed

    def _on_end(self, snap: GroupSnapshot) -> None:
        # The panel says how it ended: the toasts of the last commands ("SIGTERM → every rank")
        # would sit on its heading, in the corner where toasts show, for their few seconds.
        self.app.clear_notifications()
        if self.query_one("#stdin", Input).display:  # nothing reads it now; `q` typed in it would not quit
            self._close_input("#stdin")
        self.query_one(RootCausePanel).show(snap)
        self.ended = True
        self.note = None
        self.query_one(GroupHeader).show_group(snap, time.time())
        if snap.root_cause is not None and not self.zoomed:
            self.focus_rank(snap.root_cause.local_rank)  # the culprit's output is what one wants to read
        self.post_message(self.GroupEnded(snap))
