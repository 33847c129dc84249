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
from ranktop.core.sanitize import clean
from ranktop.core.stacks import StackReport, TreeNode
from ranktop.tui.panes import ACTS_ON_RANKS, CalmFooter, can_act
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.dom import DOMNode
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
    """The groups of ranks with the same stack, the odd one out first. Their lines wrap, so the
    sideways keys a VerticalScroll has skip to the view, which scrolls the call tree."""

    BINDINGS = [
        Binding("up", "scroll_up", "Scroll the groups", show=False),
        Binding("down", "scroll_down", "Scroll the groups", show=False),
        Binding("pageup", "page_up", "A page up / down", show=False),
        Binding("pagedown", "page_down", "A page up / down", show=False),
        Binding("home", "scroll_home", "Top / bottom", show=False),
        Binding("end", "scroll_end", "Top / bottom", show=False),
    ]
    SIDEWAYS = ("scroll_left", "scroll_right", "page_left", "page_right")  # inherited: left out of the help


# The groups box's title: which threads it shows (t switches), and what t shows instead.
GROUPS_TITLES = {False: "main threads (t: other threads)", True: "other threads (t: main threads)"}
# The call tree's, by whether C frames are asked for: what n does next. A border title, as the
# groups': the root's label was cut at 80 columns and scrolled away with the tree.
TREE_TITLES = {False: "call tree (n: C frames)", True: "call tree (n: Python only)"}


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
        # A final view (its engine gone) has no rank to dump: it shows the last dump saved during
        # the run, so g and n, which would dump again, are not offered.
        self.redumps = getattr(engine, "redumps", True)

    def compose(self) -> ComposeResult:
        yield Static("dumping stacks…", id="stacks-summary")
        with Horizontal(id="stacks-body"):
            yield StackGroups(id="stacks-groups")
            yield CallTree(Text(""), id="stacks-tree")
        yield Static(id="stacks-problems")
        yield CalmFooter(hidden=() if can_act(self.app) else ACTS_ON_RANKS)  # the keys that fit whole

    def on_mount(self) -> None:
        self.query_one("#stacks-problems").display = False
        self.query_one(CallTree).border_title = TREE_TITLES[self.native_frames]
        self.action_dump()

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
        self.query_one("#stacks-summary", Static).update(Text(clean(status)))
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
        self.query_one("#stacks-summary", Static).update(Text(clean(message), style="bold red"))
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
            summary.append(f"   saved: {clean(report.saved_txt)}", style="dim")
        elif report.save_error:
            summary.append(f"   {clean(report.save_error)}", style="yellow")
        self.query_one("#stacks-summary", Static).update(summary)
        self._render_groups()
        self._render_tree(report)
        self._render_problems(report)
        self.refresh_bindings()  # (a final view offers t once there is a dump to show)

    def _render_groups(self) -> None:
        box = self.query_one("#stacks-groups", StackGroups)
        box.border_title = GROUPS_TITLES[self.show_threads]
        box.remove_children()
        if self.report is None:
            return
        if self.show_threads:
            box.mount_all(self._thread_widgets(self.report))
        else:
            box.mount_all(self._group_widgets(self.report))

    def _group_widgets(self, report: StackReport) -> list[Static]:
        by_rank = {s.rank: s for s in report.ranks}
        widgets = []
        for g in sorted(report.groups, key=lambda g: not g.odd):  # the odd one out first (below the fold at 80x24)
            body = Text()
            for r in g.ranks:
                body.append(f"{stacks.rank_list([r])}: {clean(stacks.rank_facts(by_rank[r]))}\n", style="dim")  # (its children's names)
            for f in g.frames:
                body.append(f"  {clean(f.name)}", style="bold" if f is g.frames[-1] else "")
                body.append(f" ({clean(f.where)})\n" if f.where else "\n", style="dim")
            w = Static(body, classes="stack-group odd" if g.odd else "stack-group")
            w.border_title = stacks.rank_list(g.ranks) + (" — ODD ONE OUT" if g.odd else "")
            widgets.append(w)
        if not widgets:
            widgets.append(Static(Text("no Python stacks (see below)"), classes="stack-group"))
        return widgets

    def _thread_widgets(self, report: StackReport) -> list[Static]:
        widgets = []
        for name, frames, ranks in stacks.other_thread_groups(report):
            body = Text()
            for f in frames:
                body.append(f"  {clean(f.name)}")
                body.append(f" ({clean(f.where)})\n" if f.where else "\n", style="dim")
            w = Static(body or Text("(no Python frames)"), classes="stack-group thread")
            w.border_title = Text(f"thread {clean(name)!r} — {stacks.rank_list(ranks)}")  # Text: never markup
            widgets.append(w)
        return widgets or [Static(Text("no other threads"), classes="stack-group thread")]

    def _render_tree(self, report: StackReport) -> None:
        tree = self.query_one("#stacks-tree", Tree)
        tree.clear()
        tree.root.set_label(Text(stacks.rank_list(report.tree.ranks)))
        odd = set(report.odd_ranks)
        self._add_nodes(tree.root, report.tree, odd)
        tree.root.expand_all()

    def _add_nodes(self, parent: UITreeNode, node: TreeNode, odd: set[int]) -> None:
        for child in node.children:
            # The ranks first: a narrow tree cuts the end of a label, and the ranks are the point.
            is_odd = bool(odd) and set(child.ranks) <= odd
            label = Text(f"[{stacks.rank_list(child.ranks)}] ", style="bold red" if is_odd else "cyan")
            label.append(clean(child.frame.label))
            self._add_nodes(parent.add(label, expand=True), child, odd)

    def _render_problems(self, report: StackReport) -> None:
        box = self.query_one("#stacks-problems", Static)
        box.display = bool(report.problems)
        text = Text()
        for p in stacks.problem_groups(report):
            text.append(f"{p.who}: ", style="bold")
            text.append(f"{p.status.value}: {clean(p.reason or '', newlines=True)}\n")
            if p.hint:
                text.append(f"    {clean(p.hint)}\n", style="yellow")
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
        self.query_one(CallTree).border_title = TREE_TITLES[native]
        self.refresh_bindings()

    def action_show_threads(self, other: bool) -> None:
        self.show_threads = other
        self._render_groups()
        self.refresh_bindings()

    def action_signal(self) -> None:
        """No ptrace needed: SIGUSR1 makes each rank print its stacks; group what they printed."""
        self._ask_native(False)  # faulthandler prints Python frames only: n offers the C ones again
        self._fetch("SIGUSR1 sent; reading the ranks' stderr…", cmd.SignalDump)

    def action_tree(self, action: str) -> None:
        """A sideways key typed outside the call tree scrolls the tree."""
        getattr(self.query_one(CallTree), f"action_{action}")()

    def action_close(self) -> None:
        self.app.pop_screen()
