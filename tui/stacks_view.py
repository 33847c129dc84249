"""The stack dump screen: groups of ranks with the same main-thread stack, the odd
one(s) out highlighted, the merged call tree, and why a rank could not be dumped.

The dump runs in a worker thread (py-spy takes tens of milliseconds per rank, all ranks at
once); this module only renders a core.stacks.StackReport and dispatches keys.
"""

from __future__ import annotations

import time

from ranktop.core import commands as cmd
from ranktop.core import stacks
from ranktop.core.engine import Engine
from ranktop.core.stacks import StackReport, TreeNode
from ranktop.tui.cells import drawable
from ranktop.tui.panes import ACTS_ON_RANKS, CalmFooter, can_act
from rich.cells import cell_len
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.dom import DOMNode
from textual.events import Click
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Static, Tree
from textual.widgets.tree import TreeNode as UITreeNode
from textual.worker import get_current_worker


class CallTree(Tree):
    """The merged call tree. Its keys are Textual's, named here for what they do in this tree
    ("Select" folds a frame); keys that share a description make one row of the help. Its
    sideways keys (a Tree scrolls as a ScrollableContainer does) are listed with the view's,
    which are the same keys from anywhere in the view."""

    BINDINGS = [
        Binding("pageup", "page_up", "A page up / down", show=False),
        Binding("pagedown", "page_down", "A page up / down", show=False),
        Binding("home", "scroll_home", "First / last frame", show=False),
        Binding("end", "scroll_end", "First / last frame", show=False),
        Binding("up", "cursor_up", "Move between frames", show=False),
        Binding("down", "cursor_down", "Move between frames", show=False),
        Binding("enter", "select_cursor", "Fold / unfold the frame", show=False),
        Binding("space", "toggle_node", "Fold / unfold the frame", show=False),
        Binding("shift+space", "toggle_expand_all", "Fold / unfold every frame", show=False),
        Binding("shift+left", "cursor_parent", "To the parent / the next ancestor", show=False),
        Binding("shift+right", "cursor_parent_next_sibling", "To the parent / the next ancestor", show=False),
        Binding("shift+up", "cursor_previous_sibling", "To the previous / next sibling", show=False),
        Binding("shift+down", "cursor_next_sibling", "To the previous / next sibling", show=False),
    ]


class StackGroups(VerticalScroll):
    """The groups of ranks with the same stack, the odd one out first, one of them selected:
    enter shows its rank's output (GroupBox), and in the other threads' view the call tree is its
    thread's. Their lines wrap, so the sideways keys a VerticalScroll has skip to the view,
    which scrolls the call tree."""

    BINDINGS = [
        Binding("up", "select(-1)", "Select the previous / next group", show=False),
        Binding("down", "select(1)", "Select the previous / next group", show=False),
        Binding("home", "select_end(False)", "Select the first / last group", show=False),
        Binding("end", "select_end(True)", "Select the first / last group", show=False),
        Binding("pageup", "select_page(-1)", "A page up / down, its first group selected", show=False),
        Binding("pagedown", "select_page(1)", "A page up / down, its first group selected", show=False),
    ]
    SIDEWAYS = ("scroll_left", "scroll_right", "page_left", "page_right")  # inherited: left out of the help

    class Selected(Message):
        """Another group was selected (keys or a click)."""

    selected = 0  # the index of the selected group among the children
    _titles: tuple[str, ...] = ()  # the box's title in fewer words each, longest first (set_titles)

    def action_select(self, step: int) -> None:
        self.select(self.selected + step)

    def action_select_end(self, last: bool) -> None:
        self.select(len(self.children) - 1 if last else 0)

    def action_select_page(self, step: int) -> None:
        """A page up or down, and the first group in sight there selected, as a list's page keys
        move its cursor (the selection left behind, out of sight, was where enter went); where
        the groups fit (nothing to page), the first / the last."""
        top = max(0, min(self.max_scroll_y, round(self.scroll_y) + step * self.scrollable_content_region.height))
        if top == round(self.scroll_y):
            self.action_select_end(step > 0)
            return
        self.scroll_to(y=top, animate=False, immediate=True)
        tops = [group.virtual_region.y for group in self.children]
        shown = [i for i, y in enumerate(tops) if top <= y < top + self.scrollable_content_region.height]
        # (else a group taller than the page fills it: the one the page is in, where it stays)
        self.select(shown[0] if shown else max(i for i, y in enumerate(tops) if y <= top), scroll=False)

    def select(self, index: int, *, announce: bool = True, scroll: bool = True) -> None:
        """Select the group at `index` (kept within the groups) and bring it into sight."""
        if not self.children:
            return
        before, self.selected = self.selected, max(0, min(len(self.children) - 1, index))
        self._mark()
        if scroll:
            self.scroll_to_widget(self.children[self.selected], animate=False)
        if announce and before != self.selected:
            self.post_message(self.Selected())

    def _mark(self) -> None:
        """The selected group's border is double (NO_COLOR too), and, while enter is the groups'
        (they have the focus), its bottom border says where enter goes. A box that stands for
        none (`no other threads`) has nowhere to go: it is never marked."""
        for i, group in enumerate(self.children):
            if isinstance(group, GroupBox):
                group.mark(selected=i == self.selected, hinted=i == self.selected and self.has_focus)

    def on_focus(self) -> None:
        self._mark()

    def set_titles(self, titles: tuple[str, ...]) -> None:
        """The title: the first of `titles` (longest first) that its top border holds whole."""
        self._titles = titles
        self._retitle()

    def _retitle(self) -> None:
        if self._titles:
            self.border_title = fitting(self._titles, self.outer_size.width, 2)  # (a line each side)

    def on_resize(self) -> None:
        """A smaller terminal could leave the selected group, where enter goes, out of sight."""
        self._retitle()
        if self.children:
            self.call_after_refresh(self.select, self.selected, announce=False)

    def on_blur(self) -> None:
        self._mark()

    def on_click(self, event: Click) -> None:
        widget = event.widget
        while widget is not None and widget.parent is not self:
            widget = widget.parent
        if widget is not None:
            self.select(self.children.index(widget))


class GroupBox(Static):
    """One group of ranks (or of threads) with the same stack; enter goes to `rank`: its first,
    or, of a thread some ranks lack (`lacking`), the first of those, the odd one there."""

    def __init__(self, body: Text, rank: int, *, odd: bool, lacking: bool = False,
                 classes: str = "stack-group", titles: tuple[str, ...] = ()) -> None:
        body.rstrip()  # (each line ends in a newline: the last made a blank line at the box's end)
        super().__init__(body, classes=f"{classes} odd" if odd else classes)
        self.rank = rank
        self.lacking = lacking
        self.hinted = False  # its bottom border says where enter goes
        self.titles = titles  # its top border's, longest first: the first it holds whole is shown
        self._show_title()

    @property
    def hints(self) -> tuple[str, ...]:
        """Where enter goes, longest first: the box's bottom border shows the first it holds whole
        (60 columns cut `enter: rank 2 (lacks …`). (A rank that lacks the thread: no room for
        "'s output" at 80 columns.)"""
        rank = stacks.rank_list([self.rank])
        where = f"{rank} (lacks it)" if self.lacking else f"{rank}'s output"
        return f"enter: {where}", f"⏎ {where}", f"⏎ {rank}"

    def mark(self, *, selected: bool, hinted: bool) -> None:
        self.set_class(selected, "selected")
        self.hinted = hinted
        self._show_hint()

    def _show_hint(self) -> None:
        # (a corner, a line and a space each side)
        self.border_subtitle = fitting(self.hints, self.outer_size.width, 6) if self.hinted else ""

    def _show_title(self) -> None:
        if self.titles:  # Text: never markup (a thread's name is the rank's)
            self.border_title = Text(fitting(self.titles, self.outer_size.width, 6))

    def on_resize(self) -> None:
        """A scrollbar that comes or goes, a resized terminal: the title and the hint that fit now."""
        self._show_title()
        self._show_hint()


def fitting(texts: tuple[str, ...], width: int, edges: int) -> str:
    """The first of `texts` (longest first) that a border `width` cells wide holds whole beside its
    `edges` cells, else the last; the first where nothing is laid out yet (a width of 0)."""
    if not width:
        return texts[0]
    room = width - edges
    return next((text for text in texts if cell_len(text) <= room), texts[-1])


ENDED_LOOK = 0.5  # seconds between the open view's looks for its run's end

# The groups box's title: which threads it shows (t switches), and what t shows instead; longest
# first, the one that fits is shown (60 columns cut `other threads (t: main thre…`).
GROUPS_TITLES = {False: ("main threads (t: other threads)", "main threads (t: others)", "main threads"),
                 True: ("other threads (t: main threads)", "other threads (t: main)", "other threads")}
# The call tree's, by whether C frames are asked for: what n does next. A border title, as the
# groups': the root's label was cut at 80 columns and scrolled away with the tree.
TREE_TITLES = {False: "call tree (n: C frames)", True: "call tree (n: Python only)"}
TREE_TITLE_AFTER_THE_END = "call tree"  # n would dump again: not offered


class StacksScreen(Screen):
    """Stacks of `local_ranks` (None: every rank) of the engine's running group."""

    CSS_PATH = "stacks.tcss"
    BINDINGS = [
        Binding("escape,q", "close", "Close"),
        # One key, two bindings: the footer names the view t shows next (check_action keeps the
        # one that applies); the groups' title says which is shown.
        Binding("t", "show_threads(False)", "Main threads"),
        Binding("t", "show_threads(True)", "Other threads"),
        Binding("g", "dump", "Dump again"),
        # Out of the footer (at 80 columns it pushed `? Help` out): the selected group's bottom
        # border says it. The call tree's own enter, with the focus there, folds a frame.
        Binding("enter", "to_rank", "Zoom the selected group's rank in the grid", show=False),
        # n as t, but out of the footer (at 80 columns it pushed `? Help` out): the tree's title
        # says what n does next. C frames take py-spy about a second a rank.
        Binding("n", "native_frames(True)", "C frames", show=False),
        Binding("n", "native_frames(False)", "Python frames", show=False),
        Binding("u", "signal", "SIGUSR1 fallback"),
        Binding("tab", "app.focus_next", "Between the groups and the call tree", show=False),
        Binding("shift+tab", "app.focus_previous", "Between the groups and the call tree", show=False),
        # The focus starts on the groups, whose lines wrap: their sideways keys do nothing (they
        # skip), and come here. They scroll the tree, where long frames are cut (80 columns).
        Binding("left", "tree('scroll_left')", "Scroll the call tree sideways", show=False),
        Binding("right", "tree('scroll_right')", "Scroll the call tree sideways", show=False),
        Binding("ctrl+pageup", "tree('page_left')", "A page sideways in the call tree", show=False),
        Binding("ctrl+pagedown", "tree('page_right')", "A page sideways in the call tree", show=False),
    ]

    def __init__(self, engine: Engine, local_ranks: list[int] | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.local_ranks = local_ranks
        self.report: StackReport | None = None
        self.show_threads = False
        self.native_frames = False  # n: py-spy --native, the C/C++ frames under the Python ones
        self._thread_groups: list[stacks.ThreadGroup] = []  # the other threads' view's groups, as listed

    @property
    def redumps(self) -> bool:
        """A final view (its engine gone), or one whose run has ended (since it opened, too), has
        no rank to dump: it shows the last dump saved during the run, so g and n, which would
        dump again, are not offered."""
        return getattr(self.engine, "redumps", True)

    def compose(self) -> ComposeResult:
        yield Static("dumping stacks…", id="stacks-summary")
        with Horizontal(id="stacks-body"):
            yield StackGroups(id="stacks-groups")
            yield CallTree(Text(""), id="stacks-tree")
        yield Static(id="stacks-problems")
        yield CalmFooter(hidden=() if can_act(self.app) else ACTS_ON_RANKS)  # the keys that fit whole

    def on_mount(self) -> None:
        self.query_one("#stacks-problems").display = False
        self._title_tree()
        self.action_dump()
        if self.redumps:  # the run may end while the view is open: g and n go then
            self._end_watch = self.set_interval(ENDED_LOOK, self._look_for_the_end)

    def _look_for_the_end(self) -> None:
        if not self.redumps:
            self._end_watch.stop()
            self._title_tree()
            self.refresh_bindings()

    def _title_tree(self) -> None:
        """What n does next, in the tree's title; nothing once there is no rank to dump (the
        title went on offering n after the footer, the help and the palette had dropped it)."""
        self.query_one(CallTree).border_title = TREE_TITLES[self.native_frames] if self.redumps \
            else TREE_TITLE_AFTER_THE_END

    # ----- the dump (worker thread) -------------------------------------------------------------
    def action_dump(self) -> None:
        status = "dumping stacks with C frames (about a second a rank)…" if self.native_frames else "dumping stacks…"
        self._fetch(status, cmd.DumpStacks)

    def key_sections(self, hidden: tuple[str, ...] = ()) -> list[tuple[str, DOMNode, tuple[str, ...]]]:
        """The keys that work in the stack view, for the help: the screen's, then the ones of
        the box that has the focus (tab moves it), each under its own title."""
        if not self.redumps:  # a final view's: g and n would dump again; t shows the last dump's threads
            hidden = (*hidden, "dump", "native_frames", *(() if self.report is not None else ("show_threads",)))
        return [("Stack view (d / D)", self, hidden),
                ("Call tree (tab)", CallTree(Text("")), StackGroups.SIDEWAYS),
                ("Rank groups", StackGroups(), StackGroups.SIDEWAYS)]

    def _fetch(self, status: str, command: type[cmd.DumpStacks] | type[cmd.SignalDump]) -> None:
        """Show `status`, then the report the engine answers `command` with, off the UI thread."""
        self.query_one("#stacks-summary", Static).update(Text(drawable(status)))
        ranks = tuple(self.local_ranks) if self.local_ranks is not None else None
        native = {"native_frames": True} if command is cmd.DumpStacks and self.native_frames else {}
        self._report_in_thread(command(ranks, **native))

    @work(thread=True, exclusive=True, group="stacks")
    def _report_in_thread(self, command: cmd.DumpStacks | cmd.SignalDump) -> None:
        ack = self.engine.submit(command)
        if get_current_worker().is_cancelled:  # a later key asked again (n twice: the C frames came last)
            return
        if ack.report is None:  # the group may be gone mid-dump: say so, keep the UI alive
            self.app.call_from_thread(self._failed, ack.message)
            return
        self.app.call_from_thread(self.show_report, ack.report)

    def _failed(self, message: str) -> None:
        self.query_one("#stacks-summary", Static).update(Text(drawable(message), style="bold red"))
        if not self.redumps:  # no stacks at all, nor any to come: the one line says why
            self.query_one("#stacks-body").display = False
            self.refresh_bindings()

    # ----- rendering ----------------------------------------------------------------------------
    def show_report(self, report: StackReport) -> None:
        self.report = report
        summary = Text(report.summary() + (", with C frames" if report.native_frames else ""), style="bold")
        if not self.redumps:
            taken = time.strftime("%H:%M:%S", time.localtime(report.taken_at))
            summary = Text.assemble(("the run has ended: its last dump, taken at ", "bold"), (taken, "bold"),
                                    (": ", "bold"), summary)
        if report.saved_txt:
            summary.append(f"   saved: {drawable(report.saved_txt)}", style="dim")
        elif report.save_error:
            summary.append(f"   {drawable(report.save_error)}", style="yellow")
        self.query_one("#stacks-summary", Static).update(summary)
        self._render_groups()
        self._render_tree()
        self._render_problems(report)
        self.refresh_bindings()  # (a final view offers t once there is a dump to show)

    def _render_groups(self) -> None:
        box = self.query_one("#stacks-groups", StackGroups)
        box.set_titles(GROUPS_TITLES[self.show_threads])
        box.remove_children()
        if self.report is None:
            return
        if self.show_threads:
            self._thread_groups = stacks.other_thread_groups(self.report)
            box.mount_all(self._thread_widgets(self._thread_groups))
        else:
            box.mount_all(self._group_widgets(self.report))
        box.selected = 0  # the odd one out, first
        box.call_after_refresh(box.select, 0, announce=False)

    def _group_widgets(self, report: StackReport) -> list[Static]:
        by_rank = {s.rank: s for s in report.ranks}
        widgets: list[Static] = []
        for g in report.groups_odd_first:  # the odd one out first (below the fold at 80x24)
            body = Text()
            for r in g.ranks:
                body.append(f"{stacks.rank_list([r])}: {drawable(stacks.rank_facts(by_rank[r]))}\n", style="dim")  # (its children's names)
            self._append_frames(body, g.frames)
            w = GroupBox(body, min(g.ranks), odd=g.odd)
            w.border_title = stacks.rank_list(g.ranks) + (" — ODD ONE OUT" if g.odd else "")
            widgets.append(w)
        if not widgets:
            widgets.append(Static(Text("no Python stacks (see below)"), classes="stack-group"))
        return widgets

    @staticmethod
    def _append_frames(body: Text, frames: tuple[stacks.Frame, ...]) -> None:
        """The frames, outermost first, the innermost (where it waits) in bold."""
        if not frames:
            body.append("  (no Python frames)\n", style="dim")
        for f in frames:
            body.append(f"  {drawable(f.name)}", style="bold" if f is frames[-1] else "")
            body.append(f" ({drawable(f.where)})\n" if f.where else "\n", style="dim")

    def _thread_widgets(self, groups: list[stacks.ThreadGroup]) -> list[Static]:
        widgets: list[Static] = []
        for g in groups:  # the odd ones first, as the main threads' odd one out
            body = Text()
            if g.odd:  # (also in the title, which 80 columns cut after the thread's name)
                body.append(f"{self._why_odd(g, groups)}\n", style="bold")
            self._append_frames(body, g.frames)
            # A thread some ranks lack: enter goes to one of those (why has rank 3 no prefetch thread?).
            widgets.append(GroupBox(body, min(g.missing or g.ranks), odd=g.odd, lacking=bool(g.missing),
                                    classes="stack-group thread", titles=self._thread_titles(g)))
        return widgets or [Static(Text("no other threads"), classes="stack-group thread")]

    @staticmethod
    def _thread_titles(group: stacks.ThreadGroup) -> tuple[str, ...]:
        """A thread group's titles, longest first: `thread` goes first (the groups' title says
        it), then how it is odd (its first line says it), then its ranks; its name stays."""
        name, ranks = repr(drawable(group.name)), stacks.rank_list(group.ranks)
        odd = f" — {group.odd_words}" if group.odd else ""
        return f"thread {name} — {ranks}{odd}", f"{name} — {ranks}{odd}", f"{name} — {ranks}", name

    @staticmethod
    def _why_odd(group: stacks.ThreadGroup, groups: list[stacks.ThreadGroup]) -> str:
        """'not in rank 3', or 'ODD ONE OUT: ranks 0-2 are elsewhere' (its name's other threads)."""
        if group.missing:
            return group.odd_words
        rest = {r for g in groups if g.name == group.name and g is not group for r in g.ranks} - set(group.ranks)
        return f"ODD ONE OUT: {stacks.rank_list(rest)} {'are' if len(rest) > 1 else 'is'} elsewhere"

    def _render_tree(self) -> None:
        """The main threads' merged tree; in the other threads' view, the tree of the selected
        group's thread, merged across the ranks that have a thread of its name."""
        tree = self.query_one("#stacks-tree", Tree)
        tree.clear()
        if self.report is None:
            return
        thread = self._selected_thread()
        if thread is None:
            node, odd, label = self.report.tree, set(self.report.odd_ranks), ""
        else:
            node = stacks.thread_tree(self.report, thread.name)
            odd = {r for g in self._thread_groups if g.name == thread.name and g.minority for r in g.ranks}
            label = f"thread {drawable(thread.name)!r}: "
        tree.root.set_label(Text(label + stacks.rank_list(node.ranks)))
        self._add_nodes(tree.root, node, odd)
        tree.root.expand_all()

    def _selected_thread(self) -> stacks.ThreadGroup | None:
        """The selected group of the other threads' view; None in the main threads' (or with none)."""
        if not self.show_threads or not self._thread_groups:
            return None
        selected = self.query_one(StackGroups).selected
        return self._thread_groups[min(selected, len(self._thread_groups) - 1)]

    def _add_nodes(self, parent: UITreeNode, node: TreeNode, odd: set[int]) -> None:
        for child in node.children:
            # The ranks first: a narrow tree cuts the end of a label, and the ranks are the point.
            is_odd = bool(odd) and set(child.ranks) <= odd
            label = Text(f"[{stacks.rank_list(child.ranks)}] ", style="bold red" if is_odd else "cyan")
            label.append(drawable(child.frame.label))
            self._add_nodes(parent.add(label, expand=True), child, odd)

    @on(StackGroups.Selected)
    def _selected(self) -> None:
        if self.show_threads:  # the tree is the selected thread's
            self._render_tree()

    def _render_problems(self, report: StackReport) -> None:
        box = self.query_one("#stacks-problems", Static)
        box.display = bool(report.problems)
        text = Text()
        for p in stacks.problem_groups(report):
            text.append(f"{p.who}: ", style="bold")
            text.append(f"{p.status.value}: {drawable(p.reason or '', newlines=True)}\n")
            if p.hint:
                text.append(f"    {drawable(p.hint)}\n", style="yellow")
        box.update(text)

    # ----- keys ---------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "show_threads":  # t: the other view than the one shown (a final view: of its last dump)
            return parameters[0] != self.show_threads and (self.redumps or self.report is not None)
        if action == "native_frames":
            return self.redumps and parameters[0] != self.native_frames
        if action == "dump":
            return self.redumps
        return True

    def action_native_frames(self, native: bool) -> None:
        """Dump again with (or without) the C/C++ frames: where torch, gloo or a C library waits."""
        self._ask_native(native)
        self.action_dump()

    def _ask_native(self, native: bool) -> None:
        """Whether the next dump has the C frames: n's meaning in the footer, help, palette and title."""
        self.native_frames = native
        self._title_tree()
        self.refresh_bindings()

    def action_show_threads(self, other: bool) -> None:
        self.show_threads = other
        self._render_groups()
        self._render_tree()  # it follows the view: the main threads', or the selected thread's
        self.refresh_bindings()

    async def action_to_rank(self) -> None:
        """Enter on a group: close the view, and focus and zoom the group's rank (GroupBox) in
        the grid: from the odd one out to its output in one key."""
        box = self.query_one(StackGroups)
        group = box.children[box.selected] if box.children else None
        if not isinstance(group, GroupBox):
            self.notify("no group of ranks to go to", severity="warning", timeout=3)
            return
        main = self.app.main
        if main is None or not main.shows_rank(group.rank):
            self.notify(f"{stacks.rank_list([group.rank])} has no pane here", severity="warning", timeout=3)
            return
        await self.app.pop_screen()
        main.zoom_to_rank(group.rank)

    def action_signal(self) -> None:
        """No ptrace needed: SIGUSR1 makes each rank print its stacks; group what they printed."""
        self._ask_native(False)  # faulthandler prints Python frames only: n offers the C ones again
        self._fetch("SIGUSR1 sent; reading the ranks' stderr…", cmd.SignalDump)

    def action_tree(self, action: str) -> None:
        """A sideways key typed outside the call tree scrolls the tree."""
        getattr(self.query_one(CallTree), f"action_{action}")()

    def action_close(self) -> None:
        self.app.pop_screen()
