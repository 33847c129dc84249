"""The small screens on top of the grid: help, signal picker, quit confirmation, and the
root-cause panel shown once the group has ended."""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Any

from ranktop.core.errors import describe_exit
from ranktop.core.report import failed_at, root_cause_lines
from ranktop.core.state import GroupSnapshot, GroupState, RootCause
from ranktop.tui.cells import drawable
from ranktop.tui.panes import can_act, human_duration
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.await_complete import AwaitComplete
from textual.binding import Binding
from textual.command import CommandList, CommandPalette
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.dom import DOMNode
from textual.geometry import Size
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Button, OptionList, Static
from textual.widgets.option_list import Option

PICKER_SIGNALS = ("SIGINT", "SIGTERM", "SIGKILL", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGSTOP", "SIGCONT")
_SIGNAL_HELP = {
    "SIGINT": "interrupt, like Ctrl-C",
    "SIGTERM": "ask to terminate",
    "SIGKILL": "kill now, cannot be caught",
    "SIGHUP": "hang up",
    "SIGUSR1": "user signal 1",
    "SIGUSR2": "user signal 2",
    "SIGSTOP": "pause the process",
    "SIGCONT": "resume a paused process",
}


class ClosesOnTop:
    """A screen of ours on top of another: it closes only while it is the one on top. Textual's
    dismiss closes whatever screen is on top, and an answer can come a moment after its key, as
    a message (a button's press, a list's selection, the palette's choice): an Enter on the quit
    question's `Cancel` whose press came after the question had been answered (n) and asked
    again (q) closed the new question, and the next answer then closed the grid below it
    (ScreenStackError) or answered a question a second time (InvalidStateError), each a
    traceback that ended the TUI (found by mashing keys in tmux). Such a late answer is dropped."""

    def dismiss(self, result: Any = None) -> AwaitComplete:
        if not self.is_active:  # (another screen is on top, or this one has closed already)
            return AwaitComplete.nothing()
        return super().dismiss(result)


TWO_COLUMN_HELP = 116  # terminal columns the two-column key table needs


class HelpScreen(ClosesOnTop, ModalScreen[None]):
    """Every key, grouped by the widget that owns it (the same bindings the palette lists)."""

    BINDINGS = [
        Binding("escape,q,question_mark", "dismiss", "Close help"),
        Binding("ctrl+c", "app.help_quit", show=False),  # a modal hides the app's keys: Ctrl-C still stops
    ]

    def __init__(self, groups: Iterable[tuple[str, list[tuple[str, str]]]], here: int = 1) -> None:
        """`here`: how many of the groups, from the first, are the keys of the screen below (the
        left column of the two)."""
        super().__init__()
        self.groups = list(groups)
        self.here = here

    def compose(self) -> ComposeResult:
        extra = [("mouse", "click a pane or a rank to focus it"), ("wheel", "scroll the pane under the mouse"),
                 ("ctrl+p", "command palette: every action by name")]
        if can_act(self.app):  # (a read-only or ended view leaves them out)
            extra.append(("k K r R", "ask first: press the key again within 3 s"))
        with VerticalScroll(id="help-box"):
            yield Static(Text("ranktop keys  (esc to close)", style="bold"), classes="dialog-title")
            groups = [*self.groups, ("Mouse", extra)]
            self.two_columns = self.app.size.width >= TWO_COLUMN_HELP
            if self.two_columns:
                yield Static(_key_table(groups[:self.here], groups[self.here:]))
            else:  # a small terminal: one column, scrolled with the arrows
                yield Static(_key_table(groups, []))

    def on_resize(self) -> None:
        # Laid out again where the terminal now takes the other layout: opened at 160 columns
        # and narrowed to 80, it kept two columns of words wrapped one or two a row.
        if (self.app.size.width >= TWO_COLUMN_HELP) != self.two_columns:
            self.refresh(recompose=True)

    def action_dismiss(self) -> None:
        self.dismiss(None)


def _key_rows(groups: list[tuple[str, list[tuple[str, str]]]]) -> list[tuple[Text | str, str]]:
    rows: list[tuple[Text | str, str]] = []
    for index, (title, group_rows) in enumerate(groups):
        if index:
            rows.append(("", ""))
        rows.append((Text(title, style="bold underline"), ""))
        rows.extend(group_rows)
    return rows


def _key_table(left: list, right: list) -> Table:
    """Two columns of (keys, description) groups side by side, each laid out on its own: a
    description that wraps on one side leaves no blank rows on the other."""
    if not right:
        return _key_column(left)
    table = Table.grid(padding=(0, 2))
    table.add_column(ratio=1)
    table.add_column(ratio=1)
    table.add_row(_key_column(left), _key_column(right))
    return table


def _key_column(groups: list) -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(style="bold cyan", no_wrap=True, min_width=16)
    # (No minimum: one wider than half of a 160-column help cut its longer descriptions short.)
    table.add_column(no_wrap=False)
    for keys, description in _key_rows(groups):
        table.add_row(keys, description)
    return table


# A modal hides the app's keys: each has its own ? (the app's help, its own keys first).
MODAL_HELP = Binding("question_mark", "app.help", "Help: this screen's keys first", show=False)
# Every screen's keys: where nothing but one widget takes the focus they do nothing to see.
SCREEN_KEYS = ("focus_next", "focus_previous", "copy_text")
# A scrolling widget's sideways keys (Textual's): left out of the help where nothing is that wide.
SIDEWAYS = ("scroll_left", "scroll_right", "page_left", "page_right")


def shows_rows(options: OptionList) -> bool:
    """Whether an option list shows any row: squeezed to nothing (a terminal of 4 rows, or 12
    columns) it has none laid out, and Textual's page keys look up the highlighted one's row
    there (KeyError, which ended the TUI). Its other keys need no row."""
    return bool(options.scrollable_content_region)


class SignalList(OptionList):
    """The picker's signals. Its keys are OptionList's, named for what they do here."""

    BINDINGS = [
        Binding("up", "cursor_up", "Move between the signals", show=False),
        Binding("down", "cursor_down", "Move between the signals", show=False),
        Binding("home", "first", "First / last signal", show=False),
        Binding("end", "last", "First / last signal", show=False),
        Binding("pageup", "page_up", "A page up / down", show=False),
        Binding("pagedown", "page_down", "A page up / down", show=False),
        Binding("enter", "select", "Send the highlighted signal", show=False),
    ]

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return shows_rows(self) if action in ("page_up", "page_down") else True


class Palette(ClosesOnTop, CommandPalette):
    """Textual's command palette, whose page keys wait for its list to show a row (shows_rows)."""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "command_list" and parameters and parameters[0] in ("page_up", "page_down"):
            return shows_rows(self.query_one(CommandList))
        return super().check_action(action, parameters)


class SignalPicker(ClosesOnTop, ModalScreen[tuple[int, bool] | None]):
    """Pick a signal for the focused rank, or (g) for the whole group. Dismisses (signum, whole_group)."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        # A modal hides the app's keys: Ctrl-C still stops.
        Binding("ctrl+c", "app.help_quit", "Stop and quit, as q (asks first)", show=False),
        Binding("g", "toggle_scope", "Rank / whole group"),
        *[Binding(str(i + 1), f"pick({i})", "Send the list's signal N", show=False)
          for i in range(len(PICKER_SIGNALS))],
        MODAL_HELP,
    ]
    # The box is 16 rows tall: below 18 its list gets less room (app.tcss).
    VERTICAL_BREAKPOINTS = [(0, "-short"), (18, "-tall")]

    def __init__(self, rank: int, local_rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.local_rank, self.world = rank, local_rank, world
        self.whole_group = False

    def compose(self) -> ComposeResult:
        options = [
            Option(Text.assemble((f"{i + 1} ", "dim"), (f"{name:<8}", "bold"), f"  {_SIGNAL_HELP[name]}"), id=name)
            for i, name in enumerate(PICKER_SIGNALS)
        ]
        with Vertical(id="picker-box"):
            yield Static(self._scope_text(), id="picker-scope")
            yield SignalList(*options, id="picker-list")
            yield Static(Text("enter/1-8 send  g rank/group  esc cancel  ? keys", style="dim"))

    def key_sections(self, hidden: tuple[str, ...] = ()) -> list[tuple[str, DOMNode, tuple[str, ...]]]:
        """Its keys for the help: the picker's, then its list's."""
        return [("Signal picker (x)", self, (*hidden, *SCREEN_KEYS)),
                ("Signal list", SignalList(), SIDEWAYS)]

    def _scope_text(self) -> Text:
        target = "every rank of the group" if self.whole_group else f"rank {self.rank} (local {self.local_rank})"
        return Text.assemble(("Send a signal to ", "bold"), (target, "bold reverse"))

    def action_toggle_scope(self) -> None:
        self.whole_group = not self.whole_group
        self.query_one("#picker-scope", Static).update(self._scope_text())

    def action_pick(self, index: int) -> None:
        self.dismiss((int(signal.Signals[PICKER_SIGNALS[index]]), self.whole_group))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss((int(signal.Signals[event.option.id]), self.whole_group))

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmQuit(ClosesOnTop, ModalScreen[str | None]):
    """Quitting stops running ranks: say so and ask. Where the run can go on without this
    terminal, detaching is offered too. Answers "stop", "detach" or None (stay). The focus starts
    on the harmless answer: an Enter typed by habit (or meant for the screen below) stops nothing."""

    BINDINGS = [
        Binding("y", "answer('stop')", "Stop and quit"),
        Binding("d", "detach", "Detach: leave, the run goes on"),
        Binding("n,escape", "answer(None)", "Stay"),
        Binding("left,shift+tab", "app.focus_previous", "Previous answer", show=False),
        Binding("right,tab", "app.focus_next", "Next answer", show=False),
        Binding("ctrl+c", "app.help_quit", "Stop now, do not wait for the grace", show=False),
        MODAL_HELP,
    ]
    AUTO_FOCUS = "#quit-stay"
    # Under 60 columns the three answers go one a row; under 16 rows the box sheds its padding
    # and the detach's explanation (the button stays), so the answers stay on screen (app.tcss).
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (60, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (16, "-tall")]

    def __init__(self, alive: int, grace: float, *, can_detach: bool = False) -> None:
        super().__init__()
        self.alive, self.grace, self.can_detach = alive, grace, can_detach

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            if self.alive:
                yield Static(Text(f"{self.alive} rank(s) still running.", style="bold"))
                yield Static(f"Stop them (SIGTERM, SIGKILL after {self.grace:g} s) and quit?")
            else:  # between two attempts, or waiting for a rendezvous round
                yield Static(Text("No rank is running now, but the run has not ended:", style="bold"))
                yield Static("a restart or the next rendezvous round may start its ranks again. Stop the run and quit?")
            if self.can_detach:
                yield Static("Or detach: this screen goes, the run goes on (ranktop attach shows it again).",
                             id="confirm-detach-why")
            with Horizontal(id="confirm-buttons"):
                yield Button("Stop and quit (y)", variant="error", id="quit-stop", compact=True)
                if self.can_detach:
                    yield Button("Detach (d)", variant="primary", id="quit-detach", compact=True)
                yield Button("Cancel (n)", id="quit-stay", compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_answer(_QUIT_ANSWERS[event.button.id or ""])

    def key_sections(self, hidden: tuple[str, ...] = ()) -> list[tuple[str, DOMNode, tuple[str, ...]]]:
        """Its keys for the help: the question's (←/→ and tab move between the answers), then
        the focused answer's (enter)."""
        cannot = () if self.can_detach else ("detach",)  # (d is offered only where the run can go on)
        return [("Quit question", self, (*hidden, "copy_text", *cannot)), ("The focused answer", Button(""), ())]

    def action_detach(self) -> None:
        self.action_answer("detach")

    def action_answer(self, answer: str | None) -> None:
        if answer == "detach" and not self.can_detach:
            return
        self.dismiss(answer)


_QUIT_ANSWERS = {"quit-stop": "stop", "quit-detach": "detach", "quit-stay": None}


_CAUSE_STYLES = {"message": "bold", "traceback": "red", "more": "dim", "tail-head": "dim", "file": "dim",
                 "stopped": "yellow"}


def root_cause_text(group: GroupSnapshot, *, max_traceback: int = 10, max_tail: int = 6) -> Text:
    """How the run ended, for the panel under the grid: the culprit rank first, then the evidence.
    Its first line is the heading (root_cause_heading): the panel keeps it to one line."""
    return Text("\n").join([root_cause_heading(group),
                            root_cause_body(group, max_traceback=max_traceback, max_tail=max_tail)])


def root_cause_heading(group: GroupSnapshot) -> Text:
    """One line: how the group ended, and the culprit where there is one. What may run long (an
    error's words, earlier attempts) goes on the lines below it."""
    text = Text()
    elapsed = human_duration((group.ended_at or group.started_at) - group.started_at)
    cause = group.root_cause
    if group.state == GroupState.SUCCEEDED:
        text.append(" DONE: all ranks exited 0 ", style="bold reverse blue")
        text.append(f"  {drawable(group.name)} finished in {elapsed}")
    elif group.end_unknown:
        text.append(" END UNKNOWN ", style="bold reverse yellow")
        text.append(f"  {drawable(group.name)}")
    elif _failed_to_start(group):
        text.append(" FAILED ", style="bold white on red")  # no rank to blame: the rendezvous, a start
        text.append(f"  {drawable(group.name)} after {elapsed}")
    elif cause is None or group.state == GroupState.STOPPED:
        # Stopped on request (a key, a signal to ranktop): the ranks' ends are effects, not a cause,
        # unless one had failed on its own before the stop (its evidence follows, below).
        text.append(f" {group.state.value.upper()} ", style="bold reverse yellow")  # on request: not a failure
        text.append(f"  {drawable(group.name)} stopped on request after {elapsed}")
        if cause is not None:
            acted = f"you {drawable(cause.user_action_what)} and " if cause.user_action_what else ""
            text.append(f", after {acted}rank {cause.rank} failed ({describe_exit(cause.exitcode, cause.signal_name)})",
                        style="bold red")
    else:
        text.append(" ROOT CAUSE ", style="bold white on red")
        if cause.user_action_what:  # the person who acted reads first that the failure followed it
            text.append(f"  after you {drawable(cause.user_action_what)}:", style="bold yellow")
        text.append(f"  rank {cause.rank} ", style="bold")
        text.append(describe_exit(cause.exitcode, cause.signal_name), style="bold red")
        where = f"pid {cause.pid}" if cause.local_rank == cause.rank else f"local {cause.local_rank}, pid {cause.pid}"
        attempt = group.attempt if cause.attempt is None else cause.attempt  # (the run may be on a later one)
        text.append(f" at {failed_at(cause)}, attempt_{attempt} ({where})")  # least needed last: cut first
    return text


def _failed_to_start(group: GroupSnapshot) -> bool:
    return group.root_cause is None and group.state == GroupState.FAILED and bool(group.rendezvous_error)


def panel_says_rendezvous_error(group: GroupSnapshot) -> bool:
    """Whether the end panel says the rendezvous's error: why no rank started, or why no attempt
    ran after the failure it names (root_cause_body)."""
    if group.state == GroupState.SUCCEEDED or group.end_unknown:
        return False
    return _failed_to_start(group) or (group.root_cause is not None and bool(group.rendezvous_error)
                                       and group.stop_signal is None)


def root_cause_body(group: GroupSnapshot, *, max_traceback: int = 10, max_tail: int = 6) -> Text:
    """The lines under the heading: why, the evidence, what was left behind."""
    text = Text()
    cause = group.root_cause
    if group.state == GroupState.SUCCEEDED:
        if group.earlier_attempts:  # (as the header says it: a start for joining nodes spends no restart)
            text.append("  earlier: " + drawable(group.earlier_words) + "\n", style="bold yellow")
        if group.end_note:  # how the exit barrier ended: a toast said it once
            text.append(f"  {drawable(group.end_note)}\n", style="yellow")
    elif group.end_unknown:
        text.append(f"  {drawable(group.error or 'its engine went away')}; `ranktop ls` says whether it still runs\n")
    elif _failed_to_start(group):
        text.append(f"  {drawable(group.rendezvous_error)}\n")
    elif cause is not None:
        _append_evidence(text, cause, max_traceback=max_traceback, max_tail=max_tail)
        if panel_says_rendezvous_error(group):  # why no later attempt ran
            text.append(f"  then: {drawable(group.rendezvous_error)}\n", style="bold red")
    elif group.user_ended:  # no failure: the user ended them
        text.append(f"  you ended rank{'s' * (len(group.user_ended) > 1)} {', '.join(map(str, group.user_ended))} "
                    "(a kill or your signal): no failure\n", style="yellow")
    for rank in group.ranks:
        if rank.local_rank in group.unreapable:
            text.append(f"  rank {rank.rank} (pid {rank.pid}) outlived SIGKILL (stuck in the kernel): "
                        "left to the orphan guard\n", style="bold magenta")
    if group.log_dir:
        text.append(f"\n  logs {drawable(group.log_dir)}   ", style="dim")
    text.append("q quits, e hides this", style="dim")
    return text


def _append_evidence(text: Text, cause: RootCause, *, max_traceback: int, max_tail: int) -> None:
    if cause.user_action:  # the failure may be its effect: first, before the evidence
        text.append(f"  after a user action: {drawable(cause.user_action)}\n", style="bold yellow")
    for line in root_cause_lines(cause, max_traceback=max_traceback, max_tail=max_tail):
        text.append(line.indent)
        if line.kind == "tail":
            text.append(Text.from_ansi(drawable(line.text, sgr=True)))
        else:
            text.append(drawable(line.text, newlines=True), style=_CAUSE_STYLES.get(line.kind, ""))
        text.append("\n")


class HangingLines(Widget):
    """Lines whose rows past the first hang under the line's text, as indented as its first row:
    Textual and Rich wrap every row from the left edge, where the rows of an indented item (an
    error's words, a rank's long output line, a path) read as items of their own. The rows are
    wrapped here, for the width laid out, so that a selection copies what is shown."""

    DEFAULT_CSS = "HangingLines { height: auto; }"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._lines: list[Content] = []
        self._rows: tuple[int, list[Content]] | None = None  # the width last wrapped for, and its rows

    def update(self, text: Text) -> None:
        self._lines = Content.from_rich_text(text, console=self.app.console).split("\n", allow_blank=True)
        self._rows = None
        self.refresh(layout=True)

    def rows(self, width: int) -> list[Content]:
        """The lines in rows of `width` cells (its layout asks for several widths)."""
        if self._rows is None or self._rows[0] != width:
            self._rows = (width, [row for line in self._lines for row in hanging_rows(line, width)])
        return self._rows[1]

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self.rows(width)) if width > 0 else 0

    def render(self) -> Content:
        return Content("\n").join(self.rows(self.content_size.width))


def hanging_rows(line: Content, width: int) -> list[Content]:
    """`line` in rows of `width` cells, those after the first indented as its first: by at most
    half the width (a rank's line may start with any number of spaces; those past it go)."""
    if width <= 0:  # (not laid out yet: as it is)
        return [line]
    plain = line.plain
    indent = len(plain) - len(plain.lstrip(" "))
    if indent == len(plain):  # (a blank line: a row of its own)
        return [Content("")]
    hang = min(indent, width // 2)
    return [row.pad_left(hang) for row in line[indent:].wrap(width - hang)]


class RootCausePanel(VerticalScroll):
    """Docked under the grid once the group ends; stays until the user quits (or hides it with e).
    `end_panel_hidden` is the screen's, bound down to it. `show` sets `ended` at once rather than
    through a binding, which Textual sets up after the screen's first read: an ended run's final
    view would have drawn its first frame without the panel. A small terminal cuts it: the
    screen's E (or a click) gives it the focus, and its keys scroll it; its title says which."""

    BINDINGS = [
        Binding("up", "scroll_up", "Scroll the end report", show=False),
        Binding("down", "scroll_down", "Scroll the end report", show=False),
        Binding("pageup", "page_up", "A page up / down", show=False),
        Binding("pagedown", "page_down", "A page up / down", show=False),
        Binding("home", "scroll_home", "Top / bottom", show=False),
        Binding("end", "scroll_end", "Top / bottom", show=False),
        Binding("escape", "screen.focus_pane", "Back to the rank's pane", show=False),
    ]
    TITLE = "E: scroll"
    FOCUSED_TITLE = "↑ ↓ PgUp PgDn Home End: scroll, esc: back"

    ended: reactive[bool] = reactive(False, init=False)
    end_panel_hidden: reactive[bool] = reactive(False, init=False)

    def _show_or_hide(self) -> None:
        self.display = self.ended and not self.end_panel_hidden

    watch_ended = watch_end_panel_hidden = _show_or_hide

    def compose(self) -> ComposeResult:
        yield Static("", id="root-cause-head", markup=False)  # one line, cut with an ellipsis (app.tcss)
        yield HangingLines(id="root-cause-text")

    def _say_keys(self, focused: bool | None = None) -> None:
        """Its keys in its title: while it has the focus, or is cut (a report that fits needs none).
        (A handler of Focus runs before Textual's own, which sets has_focus: it is told.)"""
        focused = self.has_focus if focused is None else focused
        self.border_title = self.FOCUSED_TITLE if focused else self.TITLE if self.max_scroll_y > 0 else None

    def on_focus(self) -> None:
        self._say_keys(True)

    def on_blur(self) -> None:
        self._say_keys(False)

    def on_resize(self) -> None:
        self._say_keys()

    def show(self, group: GroupSnapshot) -> None:
        self.query_one("#root-cause-head", Static).update(root_cause_heading(group))
        self.query_one("#root-cause-text", HangingLines).update(root_cause_body(group))
        self.ended = True
        self.call_after_refresh(self._say_keys)  # once laid out: whether it is cut
        self.set_class(group.state not in (GroupState.SUCCEEDED, GroupState.STOPPED), "bad")
        self.set_class(group.state == GroupState.STOPPED, "stopped")  # on request: not a failure
