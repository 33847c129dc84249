"""Pilot tests of what the TUI shows and sends, over the fake Engine (tests/fake_engine.py): the
screen knows only the interface, so rendering and keys need no real ranks."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
import signal
import threading
import time

import pytest
from conftest import screen_rows, until
from fake_engine import FakeEngine
from ranktop.core import commands as cmd
from ranktop.core.engine import FIRST_LOOK_LINES
from ranktop.core.state import GroupState, RankState, RootCause, RoundForming
from ranktop.tui.app import DIALOG_EXTRAS, RanktopApp
from ranktop.tui.commands import described
from ranktop.tui.details import RankDetails
from ranktop.tui.main_screen import MainScreen
from ranktop.tui.panes import GroupHeader, RankPane, header_text
from ranktop.tui.screens import ConfirmQuit, HelpScreen, RootCausePanel, SignalPicker, root_cause_body
from ranktop.tui.stacks_view import StacksScreen
from test_tui_app import notes, palette_top
from textual.command import CommandList, CommandPalette
from textual.css.query import NoMatches
from textual.widgets import Button
from textual.widgets._footer import FooterKey

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def patient_confirm(monkeypatch):
    """A second press of k/K/r/R confirms within 3 s; a loaded box may take longer between two
    keys, and these tests are about what the keys do, not about the window."""
    from ranktop.tui import main_screen

    monkeypatch.setattr(main_screen, "CONFIRM_SECONDS", 60.0)


def drive(engine: FakeEngine, body, size: tuple[int, int] = (160, 48), *, toasts: bool = False,
          **app_kw) -> RanktopApp:
    """`toasts`: show notifications on the screen (Pilot's run leaves them out by default)."""
    app = RanktopApp(engine, **app_kw)

    async def main():
        async with app.run_test(size=size, notifications=toasts) as pilot:
            await until(pilot, lambda: app.main is not None and app.main.is_mounted, what="main screen")
            await body(app, pilot)

    asyncio.run(main())
    return app


def end_panel(app: RanktopApp) -> str:
    """The end panel's text: its one-line heading, then the rest."""
    return "\n".join(app.main.query_one(f"#root-cause-{part}").render().plain for part in ("head", "text"))


def test_keys_submit_one_command_each_and_show_the_answer():
    engine = FakeEngine(3)

    async def body(app, pilot):
        await pilot.press("2", "k", "k")
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, SignalPicker), what="picker")
        await pilot.press("7")  # SIGSTOP to rank 2
        await pilot.press("x", "g", "8")  # SIGCONT to the group
        await pilot.press("0", "r", "r", "R", "R", "K", "K")
        await until(pilot, lambda: len(engine.commands) == 6, what="six commands")

    drive(engine, body)
    assert engine.commands == [cmd.KillRank(2), cmd.SignalRank(2, signal.SIGSTOP), cmd.SignalGroup(signal.SIGCONT),
                               cmd.RestartRank(0), cmd.RestartGroup(), cmd.Stop(signal.SIGTERM)]
    assert engine.closed  # the app let go of its engine on the way out


class HeldStop(FakeEngine):
    """A multi-node run whose store hangs (its node SIGSTOPped): the engine's monitor loop answers a
    stop or a group restart only once it has told the other nodes, waiting on the store, and
    answers in order, so a command that comes meanwhile waits too; here, until the test lets them
    (or for 30 s)."""

    def __init__(self) -> None:
        super().__init__(3)
        self.answer = threading.Event()
        self.held: list[cmd.Command] = []  # the commands whose answer is held now, in the order they came
        self._turn = threading.Condition()

    def submit(self, command: cmd.Command) -> cmd.Ack:
        with self._turn:
            if not self.held and not isinstance(command, (cmd.Stop, cmd.KillGroup, cmd.RestartGroup)):
                return super().submit(command)
            self.held.append(command)
        self.answer.wait(30)
        with self._turn:  # answered in the order they came
            self._turn.wait_for(lambda: self.held[0] is command, timeout=30)
            ack = super().submit(command)
            self.held.remove(command)
            self._turn.notify_all()
        return ack


@pytest.mark.parametrize("keys, held, sent", [
    (("K", "K"), [cmd.Stop(signal.SIGTERM)], [cmd.Stop(signal.SIGTERM)]),
    (("q", "y"), [cmd.Stop(signal.SIGTERM)], [cmd.Stop(signal.SIGTERM)]),
    # the kill reaches the engine while the stop waits, which cuts its wait for the store short
    (("ctrl+c", "ctrl+c"), [cmd.Stop(signal.SIGTERM), cmd.KillGroup()], [cmd.Stop(signal.SIGTERM), cmd.KillGroup()]),
    (("R", "R"), [cmd.RestartGroup()], [cmd.RestartGroup()]),
    # keys that act after it wait their turn, but not on the UI's thread: k, x, i's line did
    (("R", "R", "0", "k", "k", "i", "l", "enter", "escape"), [cmd.RestartGroup()],
     [cmd.RestartGroup(), cmd.KillRank(0), cmd.SendInput(0, "l\n")]),
], ids=["K", "q-then-stop", "ctrl-c-twice", "R", "R-then-k-and-i"])
def test_keys_go_on_while_a_stop_waits_on_a_store_that_does_not_answer(keys, held, sent):
    """q, K and Ctrl-C sent the stop from the UI's thread and waited for the engine's answer, as R
    did its group restart: with the rendezvous's store not answering, the engine's monitor loop
    answered only once its word to the other nodes gave up, and the TUI took no key and drew no
    frame meanwhile (up to 2 s); so did any key that acts, pressed after one. The UI now only
    sends them: it shows the stop at once, goes on taking keys, and shows the answer when it comes."""
    engine = HeldStop()
    restart = keys[0] == "R"
    # (a kill sent at once may reach the engine before the stop sent a moment earlier: either order)
    seen = (lambda commands: commands) if keys[0] != "ctrl+c" else (lambda commands: sorted(commands, key=repr))

    async def body(app, pilot):
        header = app.main.query_one(GroupHeader)
        await pilot.press(*keys)
        await until(pilot, lambda: seen(engine.held) == seen(held), what="the commands sent, their answers held")
        assert restart or "stopping…" in header.render().plain  # at once, before any answer
        await pilot.press("2")  # a key while the answers are held: taken
        await until(pilot, lambda: app.main.current == 2, what="rank 2 focused")
        assert seen(engine.held) == seen(held) and not engine.commands, engine.held  # (a UI that waited saw them answered)
        engine.answer.set()
        await until(pilot, lambda: seen(engine.commands) == seen(sent), what="every command applied, in order")
        if keys[0] in ("K", "R"):  # (q and Ctrl-C leave once the run has ended: no answer to show)
            words = "fake: RestartGroup" if restart else "fake: Stop"
            await until(pilot, lambda: words in notes(app), what="the answer shown")

    drive(engine, body)


class SilentEngine(FakeEngine):
    """An attached view's engine that did not answer of late: the client refuses a stop without
    sending it (RemoteEngine.submit's EngineSilent)."""

    def submit(self, command: cmd.Command) -> cmd.Ack:
        if isinstance(command, (cmd.Stop, cmd.KillGroup)):
            return cmd.Ack(False, "the run's engine does not answer")
        return super().submit(command)


@pytest.mark.parametrize("keys", [("q", "y"), ("K", "K")], ids=["q", "K"])
def test_a_stop_refused_says_so_and_takes_its_stopping_back(keys):
    """A stop refused was said nowhere after q (its answer was not read), and K's answer left the
    header's `stopping…`: the ranks ran on under it. The refusal is said, the header takes it back,
    and q asks again."""
    engine = SilentEngine(2)

    async def body(app, pilot):
        header = app.main.query_one(GroupHeader)
        await pilot.press(*keys)
        await until(pilot, lambda: "the run's engine does not answer" in notes(app), what="the refusal said")
        await until(pilot, lambda: "stopping" not in header.render().plain, what="stopping… taken back")
        assert app.is_running and not app.user_quit and not engine.commands
        await pilot.press("q")
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what="q asking again")
        await pilot.press("d")

    drive(engine, body)


def test_a_digit_that_names_no_rank_says_so(monkeypatch):
    """7 with ranks 0..3 did nothing, without a word. The start of a rank's number (1 on a node of
    ranks 8..15) is said only once no digit has come after it: 1 2 is still rank 12."""
    from ranktop.tui import main_screen

    monkeypatch.setattr(main_screen, "DIGIT_SECONDS", 60.0)  # a loaded box may be slow between two keys

    async def four_ranks(app, pilot):
        await pilot.press("2", "7")  # 27 is no rank either: 7 alone
        await until(pilot, lambda: "no rank 7 here: ranks are 0..3" in notes(app), what="the note on 7")
        assert app.main.current == 2

    drive(FakeEngine(4), four_ranks)
    second_node = FakeEngine(8, world_size=16)
    for local in range(8):
        second_node.set_rank(local, rank=8 + local)

    async def ranks_8_to_15(app, pilot):
        await pilot.press("1", "2")
        await until(pilot, lambda: app.main.current == 4, what="rank 12 focused")
        assert "no rank" not in notes(app)
        monkeypatch.setattr(main_screen, "DIGIT_SECONDS", 0.2)
        await pilot.press("1")  # and nothing after it
        await until(pilot, lambda: "no rank 1 here: ranks are 8..15" in notes(app), what="the note on 1")
        assert app.main.current == 4

    drive(second_node, ranks_8_to_15)


def test_output_titles_and_paused_come_from_the_engine():
    engine = FakeEngine(2)
    engine.print(1, "first line", "second line")

    async def body(app, pilot):
        await until(pilot, lambda: app.main.pane(1).log.line_count == 2, what="rank 1's lines in its pane")
        engine.print(1, "third line")
        await until(pilot, lambda: app.main.pane(1).log.line_count == 3, what="a new line arrives")
        assert app.main.pane(0).log.line_count == 0
        engine.set_rank(0, paused=True)
        await until(pilot, lambda: " paused " in app.main.pane(0).title, what="paused in the title")
        engine.set_rank(0, state=RankState.UNREAPABLE, paused=False)
        await until(pilot, lambda: " unreapable " in app.main.pane(0).title, what="unreapable in the title")

    drive(engine, body)


def test_a_panes_own_rows_drawn_blank_change_nothing_on_the_screen(monkeypatch):
    """A rank pane is drawn as blank rows (RankPane.BLANK), not styled row by row under its title
    and output: the screen is the same, cell for cell and style for style, as with Textual's
    own drawing of it, the focused pane's included."""
    from ranktop.tui.panes import RankPane

    engine = FakeEngine(8)
    for r in range(8):
        engine.print(r, *(f"rank {r} line {i}" for i in range(30)))

    def frame(app) -> list[list]:
        return [list(strip) for strip in app.screen._compositor.render_strips()]

    async def body(app, pilot):
        await until(pilot, lambda: all(app.main.pane(r).log.line_count == 30 for r in range(8)), what="every pane filled")
        assert RankPane.BLANK and all(app.main.pane(r).region for r in range(8))  # all eight on the screen
        blank = frame(app)
        monkeypatch.setattr(RankPane, "BLANK", False)
        assert frame(app) == blank

    drive(engine, body)


def test_the_end_panel_names_an_unreapable_rank():
    engine = FakeEngine(2)

    async def body(app, pilot):
        engine.set_rank(1, state=RankState.UNREAPABLE)
        engine.set_rank(0, state=RankState.KILLED, exitcode=-9, signal_name="SIGKILL")
        engine.end(GroupState.STOPPED, 137)
        await until(pilot, lambda: app.main.ended, what="the end noticed")
        panel = app.main.query_one("#root-cause-text").render().plain
        assert "rank 1 (pid 1001) outlived SIGKILL" in panel and "rank 0 (pid" not in panel
        assert app.is_running  # stays open on the final states

    drive(engine, body)


@pytest.mark.parametrize("key, dialog", [("q", ConfirmQuit), ("x", SignalPicker)])
def test_the_end_closes_the_quit_question_and_the_picker_it_made_moot(key, dialog):
    """The quit question stayed up over the final view saying `2 rank(s) still running`, and its
    `y` then closed it and did nothing (it waited for an end that had come); the picker's signal
    could only be refused. Both close at the end, and the end report shows."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        app.can_detach = True
        await pilot.press(key)
        await until(pilot, lambda: isinstance(app.screen, dialog), what="the dialog")
        engine.end(GroupState.FAILED, 1, state=RankState.FAILED, exitcode=1)
        await until(pilot, lambda: app.screen is app.main, what="the dialog closed at the end")
        assert app.main.query_one(RootCausePanel).display and "FAILED" in end_panel(app)
        assert engine.commands == [] and app.is_running  # nothing sent, the final view stays

    drive(engine, body)


def test_stop_and_quit_answered_after_the_end_quits():
    """An answer already on its way when the end came (a `y` typed as it closed): it quits with
    the run's status, where it waited for an end that had come already."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        engine.end(GroupState.FAILED, 1, state=RankState.FAILED, exitcode=1)
        await until(pilot, lambda: app.main.ended, what="the end noticed")
        app._quit_answer("stop")
        await until(pilot, lambda: not app.is_running, what="the app gone")

    app = drive(engine, body)
    assert app.return_value == 1 and engine.commands == []


def test_typing_into_a_rank_after_the_end_says_there_is_none_to_type_into():
    """`i` in the final view said `nothing left to signal or restart`, which it had not asked."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        engine.end(GroupState.SUCCEEDED, 0, state=RankState.SUCCEEDED, exitcode=0)
        await until(pilot, lambda: app.main.ended, what="the end noticed")
        await pilot.press("i")
        await until(pilot, lambda: "type into" in notes(app), what="i's answer")
        assert "the group has ended" in notes(app) and not app.main.query_one("#stdin").display

    drive(engine, body)


@pytest.mark.parametrize("state, fields, shown", [
    # A rank that could not be started (or a rendezvous): no rank to blame, and no stop asked for.
    (GroupState.FAILED, {"rendezvous_error": "cannot start local rank 0: Permission denied"},
     "FAILED   fake.py after 0:00:00\n  cannot start local rank 0: Permission denied"),
    # An attached view that lost its engine before the end: not "stopped on request".
    (GroupState.RUNNING, {"error": "lost the run's engine before its end (Connection refused)"},
     "END UNKNOWN   fake.py\n  lost the run's engine before its end (Connection refused); "
     "`ranktop ls` says whether it still runs"),
])
def test_the_end_panel_says_why_a_run_ended_with_no_rank_to_blame(state, fields, shown):
    engine = FakeEngine(2)

    async def body(app, pilot):
        engine.end(state, 1, group_fields=fields)  # (set after the end, a view that read between never saw it)
        await until(pilot, lambda: app.main.ended, what="the end noticed")
        # (the clock is the fake run's age, which a loaded box's slow start moves past 0:00:00)
        await until(pilot, lambda: shown in re.sub(r"after \d+:\d\d:\d\d", "after 0:00:00", end_panel(app)),
                    what="why, in the end panel")
        assert "stopped on request" not in end_panel(app)
        # The app has handled the end (its footer left out the keys that act), and no toast says
        # the panel's words again: a 30 s one of the rendezvous's error sat on the panel, its
        # text cut under it (a peer node's K, tmux at 160 columns).
        await until(pilot, lambda: "k" not in [key.key for key in shown_footer_keys(app)],
                    what="the end handled by the app")
        await pilot.pause()
        assert fields.get("rendezvous_error", "no rendezvous error") not in notes(app), notes(app)

    drive(engine, body)


def test_the_same_words_again_are_one_toast_not_a_stack():
    """Each key that acts, pressed after the end, said `the group has ended: ...`: six keys, six
    toasts of the same words, over most of an 80x24 screen. One toast, its time anew."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        engine.end(GroupState.STOPPED, 143)
        await until(pilot, lambda: app.main.ended, what="the end noticed")
        await pilot.press("k", "r", "R", "K", "x")
        words = "the group has ended: no rank left to signal, restart or type into (q quits)"
        await until(pilot, lambda: words in notes(app), what="the refusal said")
        await pilot.pause()
        assert [n.message for n in app._notifications].count(words) == 1, notes(app)
        app.notify("another", severity="warning")
        await until(pilot, lambda: "another" in notes(app), what="other words")
        assert [n.message for n in app._notifications].count(words) == 1  # (others stay beside it)

    drive(engine, body, size=(80, 24))


def test_a_run_end_handled_after_the_app_closed_its_screens_is_ignored():
    """The app handles the main screen's GroupEnded from its own queue: an end that came just as
    the app closed (q as the run ended) was handled with no screen left, and raised
    ScreenStackError out of the app's exit."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        pass

    app = drive(engine, body)
    assert app.screen_stack == []
    engine.end(GroupState.FAILED, 1)
    app.group_ended(MainScreen.GroupEnded(engine.snapshot()))  # (raised before)


def test_exit_on_end_leaves_with_the_engines_status():
    engine = FakeEngine(2)

    async def body(app, pilot):
        engine.end(GroupState.FAILED, 1, state=RankState.FAILED, exitcode=1)
        await until(pilot, lambda: not app.is_running, what="the app left once the group ended")

    app = drive(engine, body, exit_on_end=True)
    assert app.exit_status == 1 and app.main.ended


def test_q_after_k_asks_nothing_and_leaves_once_the_group_has_stopped():
    """q while K's stop ran asked `2 rank(s) still running. Stop them (SIGTERM, SIGKILL after 3 s)
    and quit?` of ranks already stopping (tmux, ranks that ignore SIGTERM). It leaves once the stop
    is over, as after q's own `y`, and q again kills now."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press("K", "K")
        await until(pilot, lambda: "fake: Stop" in notes(app), what="K's stop taken")
        engine.group = dataclasses.replace(engine.group, state=GroupState.STOPPING)
        await pilot.press("q")
        header = app.main.query_one(GroupHeader)
        await until(pilot, lambda: "q again: kill now" in header.render().plain, what="q's note")
        assert app.screen is app.main and app.user_quit  # no question
        await pilot.press("q")
        await until(pilot, lambda: cmd.KillGroup() in engine.commands, what="the kill")
        assert engine.commands == [cmd.Stop(signal.SIGTERM), cmd.KillGroup()]  # (no second stop)
        engine.end(GroupState.STOPPED, 130)
        await until(pilot, lambda: not app.is_running, what="app closed once stopped")

    app = drive(engine, body)
    assert app.exit_status == 130


def test_quit_confirmation_names_the_engines_grace_and_stops_through_it():
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press("q")
        await until(pilot, lambda: app.screen is not app.main, what="confirmation")
        shown = " ".join(str(w.render()) for w in app.screen.query("Static"))
        assert "2 rank(s) still running" in shown and "SIGKILL after 3 s" in shown  # the engine's grace
        await pilot.press("y")
        await until(pilot, lambda: cmd.Stop(signal.SIGTERM) in engine.commands, what="stop submitted")
        assert "stopping" in app.main.query_one("#header").render().plain
        engine.end(GroupState.STOPPED, 1)
        await until(pilot, lambda: not app.is_running, what="app closed once stopped")

    app = drive(engine, body)
    assert app.exit_status == 130


def test_note_and_end_state_are_bound_down_to_the_header_and_the_panel():
    engine = FakeEngine(2)

    async def body(app, pilot):
        header, panel = app.main.query_one("#header"), app.main.query_one("#root-cause")
        app.main.note = "a note from the screen"
        await until(pilot, lambda: "a note from the screen" in header.plain, what="the note in the header")
        assert header.note == "a note from the screen" and not panel.display
        await pilot.press("e")  # nothing to show yet: it says so rather than nothing
        await until(pilot, lambda: "the run has not ended" in notes(app), what="e's answer while running")
        engine.end(GroupState.FAILED, 1, state=RankState.FAILED, exitcode=1)
        await until(pilot, lambda: panel.display, what="the end panel shown")
        assert header.ended and panel.ended and "a note from the screen" not in header.plain
        await pilot.press("e")
        await until(pilot, lambda: not panel.display, what="e hides the panel")
        assert panel.end_panel_hidden
        await pilot.press("e")
        await until(pilot, lambda: panel.display, what="e shows it again")

    drive(engine, body)


def test_q_offers_detach_only_where_the_run_can_go_on():
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press("q")
        await until(pilot, lambda: app.screen is not app.main, what="the quit question")
        assert not app.screen.query("#quit-detach")
        await pilot.press("d")  # not offered: nothing happens
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main, what="back to the ranks")
        app.can_detach = True
        await pilot.press("q")
        await until(pilot, lambda: app.screen is not app.main, what="the quit question again")
        assert app.screen.query("#quit-detach")
        await pilot.press("d")
        await until(pilot, lambda: not app.is_running, what="the app left")

    app = drive(engine, body)
    assert app.detached == "key" and engine.commands == [] and not engine.closed  # the run goes on


def test_the_not_served_toast_shows_a_hostile_reason_as_plain_safe_text():
    """Why the run has no socket quotes an OS error, and a path in it (XDG_RUNTIME_DIR) may hold
    markup or escapes: the toast shows them as text, never acts on them."""
    engine = FakeEngine(1)
    app = RanktopApp(engine)
    app.not_served = "not serving this run: [Errno 13] Permission denied: '/run/[/]x\x1b]0;pwned\x07[bold]y'"

    async def main():
        async with app.run_test(size=(160, 48), notifications=True) as pilot:
            await until(pilot, lambda: "not serving" in notes(app), what="the not-served toast")
            await pilot.pause()
            shown = "\n".join(screen_rows(app))
            assert "[Errno 13]" in shown and "[/]x" in shown and "[bold]y" in shown
            assert "\x1b" not in notes(app) and "pwned" not in notes(app)

    asyncio.run(main())


def test_output_that_came_before_the_first_layout_is_shown_from_its_tail():
    engine = FakeEngine(1)
    engine.print(0, *[f"line {i}" for i in range(200)])  # all of it before the pane has a size

    async def body(app, pilot):
        log = app.main.pane(0).log
        await until(pilot, lambda: log.line_count == 200 and log.max_scroll_y > 0, what="the lines laid out")
        await until(pilot, lambda: round(log.scroll_offset.y) == log.max_scroll_y, what="the view at the tail")
        assert log.follow and log.position_text == "following"

    drive(engine, body, size=(100, 30))


def test_a_pane_shows_the_newest_lines_first_and_then_the_whole_scrollback():
    engine = FakeEngine(2)
    for r in range(2):
        engine.print(r, *[f"r{r} line {i}" for i in range(5000)])
    asked: list[tuple[int, int | None]] = []
    output_since = engine.output_since
    engine.output_since = lambda r, cursor, tail=None: asked.append((r, tail)) or output_since(r, cursor, tail)

    async def body(app, pilot):
        logs = [app.main.pane(r).log for r in range(2)]
        await until(pilot, lambda: all(log.line_count == 5000 for log in logs), what="every line")
        for r, log in enumerate(logs):
            assert [tail for rank, tail in asked if rank == r][:2] == [FIRST_LOOK_LINES, None]
            assert log.row_text(0) == f"r{r} line 0" and log.row_text(4999) == f"r{r} line 4999"
            await until(pilot, lambda log=log: round(log.scroll_offset.y) == log.max_scroll_y, what="the view at the tail")
        engine.print(1, "r1 line 5000")
        await until(pilot, lambda: logs[1].line_count == 5001, what="a new line after the scrollback")

    drive(engine, body, size=(100, 30))


def test_the_first_frame_holds_output_without_waiting_for_a_tick(monkeypatch):
    from ranktop.tui import main_screen

    monkeypatch.setattr(main_screen, "TICK_SECONDS", 3600.0)  # no timer tick comes during the test
    engine = FakeEngine(4)
    for r in range(4):
        engine.print(r, f"hello from {r}")

    async def body(app, pilot):
        await until(pilot, lambda: all(app.main.pane(r).log.line_count == 1 for r in range(4)),
                    what="every pane filled by the screen's first read")
        assert all(app.main.pane(r).log.row_text(0) == f"hello from {r}" for r in range(4))

    drive(engine, body, size=(160, 48))


def test_the_focused_pane_takes_new_lines_every_tick_the_others_every_second(monkeypatch):
    # The other panes' lines and titles change together, on every other tick, so that a tick
    # between repaints only the focused pane (Textual redraws the box around all that changed).
    from ranktop.tui import main_screen

    monkeypatch.setattr(main_screen, "TICK_SECONDS", 3600.0)  # the test calls the ticks itself
    engine = FakeEngine(3)

    async def body(app, pilot):
        screen = app.main
        logs = [screen.pane(r).log for r in range(3)]
        if screen._reads % main_screen.UNFOCUSED_EVERY == 0:
            screen.tick()  # line up on a tick that is not the unfocused panes' turn
        for r in range(3):
            engine.print(r, f"new on {r}")
            engine.set_rank(r, restarts=3)
        screen.tick()
        assert [log.line_count for log in logs] == [1, 0, 0]  # rank 0 has the focus
        assert ["⟳3" in screen.pane(r).title for r in range(3)] == [True, False, False]
        screen.tick()
        assert [log.line_count for log in logs] == [1, 1, 1]
        assert ["⟳3" in screen.pane(r).title for r in range(3)] == [True, True, True]
        await pilot.press("z")  # zoom on rank 0: the others are hidden...
        for r in range(3):
            engine.print(r, f"more on {r}")
        if screen._reads % main_screen.UNFOCUSED_EVERY == 0:
            screen.tick()
        await pilot.press("z")  # ...and shown again: filled on the next tick, though not their turn
        screen.tick()
        assert [log.line_count for log in logs] == [2, 2, 2]
        if screen._reads % main_screen.UNFOCUSED_EVERY == 0:
            screen.tick()
        engine.end(GroupState.SUCCEEDED, 0, state=RankState.SUCCEEDED, exitcode=0)
        screen.tick()  # not the others' turn, but the group's end shows on every pane at once
        assert all("exited 0" in screen.pane(r).title for r in range(3))

    drive(engine, body, size=(160, 48))


def test_the_compact_view_mounts_a_ranks_pane_only_once_it_is_shown_and_keeps_it():
    """Past what fits, a pane is made the first time its rank is shown (a digit, a click in the
    list, g, a search's jump), with its output, and kept: a rank never shown costs no widgets, and
    a pane scrolled back is where it was when its rank is shown again."""
    engine = FakeEngine(40)
    for r in range(40):
        engine.print(r, *(f"rank {r} line {i}" for i in range(200)))
    engine.print(17, "a needle")

    def mounted(main: MainScreen) -> list[int]:
        return [pane.local_rank for pane in main.query(RankPane)]

    async def body(app, pilot):
        def on_screen(text: str) -> bool:
            return any(text in row for row in screen_rows(app))

        main = app.main
        assert main.compact and mounted(main) == [0]
        await pilot.press("7")
        await until(pilot, lambda: on_screen("rank 7 line 199"), what="rank 7's output on the screen")
        assert mounted(main) == [0, 7] and app.focused is main.pane(7).log
        await pilot.press("home")  # rank 7's pane, made just now, scrolled back to its top
        await until(pilot, lambda: "paused at line 1 " in main.pane(7).title, what="rank 7 paused at its top")
        await pilot.click("#rank-list", offset=(3, 12))  # row 0 is rank 0's (the header is above it)
        await until(pilot, lambda: on_screen("rank 12 line 199"), what="rank 12's output on the screen")
        await pilot.press("g", *"35", "enter")
        await until(pilot, lambda: on_screen("rank 35 line 199"), what="rank 35's output on the screen")
        await pilot.press("ctrl+f", *"needle", "enter")  # clears the search of the panes made, no others
        await until(pilot, lambda: main.current == 17 and main.pane(17).log.search_query == "needle",
                    what="the search's jump to rank 17")
        assert mounted(main) == [0, 7, 12, 17, 35]
        await pilot.press("7")
        await until(pilot, lambda: on_screen("rank 7 line 0"), what="rank 7 shown again")
        log = main.pane(7).log
        assert round(log.scroll_offset.y) == 0 and not log.follow and mounted(main) == [0, 7, 12, 17, 35]
        assert [r for r in mounted(main) if main.pane(r).display] == [7]

    drive(engine, body, size=(160, 48))


LINES_EACH = FIRST_LOOK_LINES + 300  # a match at line 150 is older than a new pane's first look


def print_with_matches(engine: FakeEngine, ranks: tuple[int, ...], at: int = 150) -> None:
    """LINES_EACH lines on every rank; on `ranks`, line `at` holds the word 'zebra'."""
    for r in range(len(engine.lines)):
        lines = [f"rank {r} line {i}" for i in range(1, LINES_EACH + 1)]
        if r in ranks:
            lines[at - 1] += " zebra"
        engine.print(r, *lines)


async def shows_its_match(app: RanktopApp, pilot, rank: int, at: int = 150) -> None:
    """Rank `rank` is focused, its match's line is on the screen, and its title's position (the
    top line) is above that line, within the pane's height: not line 1."""
    main = app.main

    def shown() -> bool:
        found = re.search(r"paused (?:at line|@) (\d+) ", main.pane(rank).title)
        height = main.pane(rank).log.scrollable_content_region.height
        return (main.current == rank and found is not None and 1 < int(found[1]) <= at < int(found[1]) + height
                and any(f"rank {rank} line {at} zebra" in row for row in screen_rows(app)))

    await until(pilot, shown, what=f"rank {rank}'s match on the screen and in its title's position")


def test_a_search_of_every_rank_shows_the_match_in_a_pane_never_shown_or_hidden():
    """In the compact view a search's jump (and n / N on across ranks) to a rank whose pane was
    never shown, made for the jump, showed it paused at line 1: the match was asked for before
    the pane had a size (Textual scrolled nothing) and before it had its whole scrollback (only
    the first look's newest lines, which a match at line 150 is older than). A pane made before
    and hidden since shows its match too."""
    engine = FakeEngine(40)
    print_with_matches(engine, (7, 23, 31))

    async def body(app, pilot):
        main = app.main
        assert main.compact
        await pilot.press("7")  # rank 7's pane made and filled, then hidden
        await until(pilot, lambda: main.pane(7).log.line_count == LINES_EACH, what="rank 7's whole output")
        await pilot.press("0")
        await until(pilot, lambda: main.current == 0 and not main.pane(7).display, what="rank 7 hidden")
        await pilot.press("ctrl+f", *"zebra", "enter")  # from rank 0: rank 7's, hidden since
        await shows_its_match(app, pilot, 7)
        assert 23 not in main._panes and 31 not in main._panes
        await pilot.press("n")  # on to rank 23, never shown
        await shows_its_match(app, pilot, 23)
        await pilot.press("n")  # and rank 31, never shown
        await shows_its_match(app, pilot, 31)
        await pilot.press("N")  # back to rank 23, hidden since
        await shows_its_match(app, pilot, 23)

    drive(engine, body, size=(160, 48))


def test_a_search_of_every_rank_shows_the_match_in_the_grid():
    """In the grid every pane is laid out and filled: the jump and n / N show the match there too."""
    engine = FakeEngine(4)
    print_with_matches(engine, (1, 3))

    async def body(app, pilot):
        assert not app.main.compact
        await pilot.press("ctrl+f", *"zebra", "enter")
        await shows_its_match(app, pilot, 1)
        await pilot.press("n")
        await shows_its_match(app, pilot, 3)
        await pilot.press("N")
        await shows_its_match(app, pilot, 1)

    drive(engine, body, size=(160, 48))


def test_the_footer_is_rebuilt_once_per_burst_and_only_when_its_keys_change():
    from ranktop.tui.panes import CalmFooter
    from textual.widgets._footer import FooterKey

    engine = FakeEngine(4)

    async def body(app, pilot):
        footer = app.main.query_one(CalmFooter)
        await until(pilot, lambda: footer.query(FooterKey), what="the footer's keys")
        rebuilt = []
        real = footer.recompose

        async def counted():
            rebuilt.append(1)
            await real()

        footer.recompose = counted
        for _ in range(4):  # a burst, as opening a screen makes, that changes no key the footer shows
            footer.bindings_changed(app.main)
        await pilot.press("right")  # another pane has the focus: the same keys
        await pilot.pause(3 * CalmFooter.SETTLE_SECONDS)
        assert rebuilt == []
        def keys() -> str:
            return " ".join(str(k.description) for k in footer.query(FooterKey))

        assert "Quit" in keys()
        await pilot.press("slash")  # typing a search: the grid's keys give way to the input's
        for _ in range(3):
            footer.bindings_changed(app.main)
        await until(pilot, lambda: rebuilt, what="a rebuild")
        await pilot.pause(3 * CalmFooter.SETTLE_SECONDS)
        assert len(rebuilt) == 1 and "Quit" not in keys()

    drive(engine, body)


# ----- what fits a small terminal (80x24) --------------------------------------------------------
def test_the_quit_question_shows_its_answers_on_one_row_within_80_columns():
    engine = FakeEngine(2)

    async def body(app, pilot):
        app.can_detach = True
        await pilot.press("q")
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what="the quit question")
        await pilot.pause()
        box = app.screen.query_one("#confirm-box").region
        buttons = [app.screen.query_one(f"#quit-{name}", Button) for name in ("stop", "detach", "stay")]
        regions = [button.region for button in buttons]
        assert len({region.y for region in regions}) == 1  # one row
        assert all(box.contains_region(region) and region.right <= 80 for region in regions)
        assert all(3 <= right.x - left.right <= 6 for left, right in itertools.pairwise(regions))  # a few apart
        row = screen_rows(app)[regions[0].y]
        for button in buttons:
            assert str(button.label) in row  # each label whole, nothing over it
        await until(pilot, lambda: app.screen.focused, what="the question's focus")  # (set once it has composed)
        assert app.screen.focused is buttons[2]  # the harmless answer: Enter stays
        await pilot.press("left", "left")
        assert app.screen.focused is buttons[0]
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main, what="back to the ranks")
        assert engine.commands == []

    drive(engine, body, size=(80, 24))



def test_the_quit_question_stacks_its_answers_where_a_row_does_not_hold_them():
    """Under 60 columns the third answer, `Cancel (n)`, where the focus starts, was cut off the
    right edge: one answer a row, each whole on screen, the focus on one you can see."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        app.can_detach = True
        await pilot.press("q")
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what="the quit question")
        await pilot.resize_terminal(44, 24)  # asked wide, then narrowed: the row breaks
        await pilot.pause()
        buttons = [app.screen.query_one(f"#quit-{name}", Button) for name in ("stop", "detach", "stay")]
        await until(pilot, lambda: len({b.region.y for b in buttons}) == 3, what="one answer a row")
        rows = screen_rows(app)
        for button in buttons:
            assert button.region.right <= 44 and str(button.label) in rows[button.region.y]
        assert app.screen.focused is buttons[2]
        await pilot.resize_terminal(80, 24)  # and back on one row
        await until(pilot, lambda: len({b.region.y for b in buttons}) == 1, what="the answers on one row again")
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main, what="back to the ranks")
        assert engine.commands == []

    drive(engine, body, size=(80, 24))


def test_the_quit_question_keeps_its_answers_on_screen_in_a_short_terminal():
    """At 40x10 the box ran off the bottom with `Detach` and `Cancel`, the focused one: under 16
    rows it sheds its padding and the detach's explanation (the answer stays)."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        app.can_detach = True
        await pilot.press("q")
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what="the quit question")
        buttons = [app.screen.query_one(f"#quit-{name}", Button) for name in ("stop", "detach", "stay")]
        await until(pilot, lambda: all(b.region.bottom <= 10 and b.region.height for b in buttons),
                    what="every answer within the 10 rows")
        rows = screen_rows(app)
        assert all(str(b.label) in rows[b.region.y] for b in buttons)
        await until(pilot, lambda: app.screen.focused, what="the question's focus")  # (set once it has composed)
        assert app.screen.focused is buttons[2]
        why = app.screen.query_one("#confirm-detach-why")
        assert not why.display
        await pilot.resize_terminal(80, 24)  # room again: the explanation is back
        await until(pilot, lambda: why.display, what="the detach explained again")

    drive(engine, body, size=(40, 10))

def test_the_signal_picker_fits_a_small_terminal_and_still_sends():
    """At 40x12 the picker ran off the right edge and its title off the top (64 columns, 16 rows):
    now all of it is on screen, its list scrolling, and the last signal is still one key away."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, SignalPicker), what="the picker")
        await pilot.resize_terminal(40, 12)  # opened at 80x24, then the terminal shrank
        await pilot.pause()
        box = app.screen.query_one("#picker-box")
        await until(pilot, lambda: box.region.bottom <= 12 and box.region.y >= 0, what="the picker within 12 rows")
        assert box.region.right <= 40
        rows = screen_rows(app)
        assert "Send a signal to" in rows[app.screen.query_one("#picker-scope").region.y]
        assert any("esc" in row and "g rank/group" in row for row in rows)  # its hint too
        await pilot.press("end", "enter")  # the list's last entry, scrolled to
        await until(pilot, lambda: engine.commands, what="a signal sent")
        assert engine.commands == [cmd.SignalRank(0, signal.SIGCONT)]

    drive(engine, body, size=(80, 24))


def test_the_signal_picker_and_the_palette_take_their_keys_in_a_terminal_too_small_for_their_lists():
    """At 10 columns `x` ended the TUI: laying out the picker's list wrapped its signals to a
    width of 0 (Textual's OptionList: ValueError). Where a list shows no row at all (the picker's
    in 5 rows or 12 columns, the palette's in 4 rows), PgDn and PgUp looked up a row that was not
    there (KeyError), which ended it too. Found by fuzzing the TUI with resize storms. Both keep
    working, and the picker still sends once the terminal is larger."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.resize_terminal(10, 24)
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, SignalPicker), what="the picker")
        await pilot.press("pagedown", "end")
        for size in ((12, 24), (80, 5)):
            await pilot.resize_terminal(*size)
            await pilot.press("pagedown", "pageup")
        await pilot.resize_terminal(80, 24)
        await pilot.press("home", "enter")
        await until(pilot, lambda: engine.commands, what="a signal sent")
        assert engine.commands == [cmd.SignalRank(0, signal.SIGINT)]
        await pilot.resize_terminal(80, 4)
        await pilot.press("ctrl+p")
        await until(pilot, lambda: isinstance(app.screen, CommandPalette), what="the palette")
        await pilot.press("pagedown", "pageup")
        await pilot.pause()
        assert isinstance(app.screen, CommandPalette) and app.return_code is None

    drive(engine, body, size=(80, 24))


def test_the_details_view_scrolls_to_its_histories_in_a_short_terminal():
    """In a short terminal the histories, the view's point, were cut off under the log paths with
    no way down to them: the view scrolls, and has the focus to."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press("m")
        await until(pilot, lambda: isinstance(app.screen, RankDetails), what="the details")
        text = app.screen.query_one("#details-text")
        await until(pilot, lambda: "output" in text.render().plain, what="the histories")
        assert not any("esc: close" in row for row in screen_rows(app))  # the view's last line
        await pilot.press("end")
        await until(pilot, lambda: any("esc: close" in row for row in screen_rows(app)),
                    what="the view's end scrolled into sight")
        assert any(row.strip(" █").startswith("output") for row in screen_rows(app))
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main, what="back to the ranks")

    drive(engine, body, size=(60, 12))


def test_the_details_lines_fit_beside_the_scrollbar_of_a_short_terminal():
    """Its lines were as wide as the box, scrollbar included: where one showed, each history's
    last value wrapped onto a row of its own (`max` / `0%`)."""
    engine = FakeEngine(2)
    engine.set_rank(0, cpu_percent=5.0, rss=11 << 20)
    whole = re.compile(r"cpu +\S+ +now +5% +min +5% +max +5%")

    async def body(app, pilot):
        await pilot.press("m")
        await until(pilot, lambda: isinstance(app.screen, RankDetails), what="the details")
        text = app.screen.query_one("#details-text")
        # Three samples: redrawn since it was laid out (its first lines, before, were 76 wide)
        await until(pilot, lambda: "cpu         ▁▁▁" in text.render().plain, timeout=10, what="three samples")
        await pilot.pause()
        assert any(whole.search(row) for row in screen_rows(app))  # the cpu history whole on its row
        box = app.screen.query_one("#details-box")
        assert box.show_vertical_scrollbar  # (the case: a scrollbar, 10 rows)
        await pilot.resize_terminal(120, 10)  # wider: its lines follow the new width
        await until(pilot, lambda: any(whole.search(row) and len(row.rstrip()) > 105 for row in screen_rows(app)),
                    what="the lines redrawn for the new width")
        # A resize's redraw is no sample of the output rate: each took one, over the few ms since
        # the last (1 line in 0.1 s: 9.0/s for a rank printing 2 a second, or 0/s).
        out = app.main.tracker.ranks[0].history["out"]
        taken, started = len(out), time.monotonic()
        for width in (110, 100, 90) * 4:
            engine.print(0, "a line")
            await pilot.resize_terminal(width, 10)
            await pilot.pause()
        assert len(out) - taken <= time.monotonic() - started + 1, list(out)

    drive(engine, body, size=(100, 10))

def test_the_rank_list_leaves_the_focused_pane_half_a_narrow_terminal():
    """The list took 36 columns at any width: at 40, 4 were left of the focused pane."""
    engine = FakeEngine(4)

    async def body(app, pilot):
        await pilot.pause()
        rank_list = app.main.query_one("#rank-list-box")
        assert rank_list.display
        pane = app.main.pane(0)
        await until(pilot, lambda: pane.region.width >= 19, what="half the width for the pane")
        assert rank_list.region.width <= 20
        await pilot.resize_terminal(120, 12)  # wide but short: the list is at its own width again
        await until(pilot, lambda: rank_list.region.width == 36, what="the list at 36 columns")

    drive(engine, body, size=(40, 12))

def shown_footer_keys(app: RanktopApp) -> list[FooterKey]:
    return [key for key in app.screen.query(FooterKey) if not key.has_class("-command-palette") and key.display]


def assert_footer_whole(app: RanktopApp, width: int) -> None:
    """Every key the footer shows reads whole on its row, left of the palette key."""
    footer_row = screen_rows(app)[-1]
    palette = app.screen.query_one(FooterKey.__name__ + ".-command-palette").region
    for key in shown_footer_keys(app):
        assert key.region.right <= palette.x <= width
        assert f"{key.key_display} {key.description}" in footer_row, (key.description, footer_row)
    assert footer_row.rstrip().endswith("^p palette")


def footer_whole(app: RanktopApp, width: int) -> bool:
    """assert_footer_whole as a condition to wait on: the footer is rebuilt once per burst of
    binding changes, a frame or so after a resize or a new screen."""
    try:
        assert_footer_whole(app, width)
    except (AssertionError, NoMatches):
        return False
    return True


def test_the_footer_shows_only_keys_that_fit_whole_and_every_key_still_works():
    engine = FakeEngine(2)

    async def body(app, pilot):
        await until(pilot, lambda: shown_footer_keys(app), what="the footer's keys")
        await until(pilot, lambda: footer_whole(app, 80), what="the footer's keys whole at 80 columns")
        shown = [key.description for key in shown_footer_keys(app)]
        assert shown[:2] == ["Quit", "Help"] and "Restart rank" not in shown
        # A hang's way in fits (it came last, past the fold at 80 columns)
        assert shown[:5] == ["Quit", "Help", "Zoom", "Search", "Stacks"] and "Kill rank" in shown, shown
        await pilot.press("r", "r")  # not in the footer at this width: works all the same
        await until(pilot, lambda: engine.commands == [cmd.RestartRank(0)], what="r r restarted rank 0")
        await pilot.resize_terminal(160, 48)
        await until(pilot, lambda: "Restart group" in [key.description for key in shown_footer_keys(app)],
                    what="every key at 160 columns")
        assert_footer_whole(app, 160)
        await pilot.resize_terminal(60, 24)
        await until(pilot, lambda: len(shown_footer_keys(app)) < len(shown), what="fewer keys at 60 columns")
        await until(pilot, lambda: footer_whole(app, 60), what="the footer's keys whole at 60 columns")
        await pilot.resize_terminal(80, 24)
        await pilot.press("d")  # the stack view's footer too
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and shown_footer_keys(app), what="stacks")
        await until(pilot, lambda: footer_whole(app, 80), what="the footer's keys whole at 80 columns")
        assert [key.description for key in shown_footer_keys(app)][:2] == ["Close", "Other threads"]

    drive(engine, body, size=(80, 24))


def test_a_read_only_view_leaves_out_the_keys_that_act_on_ranks():
    """Its footer, help and palette list only keys that do something there; the others still
    answer (the engine says that nothing was done)."""
    engine = FakeEngine(2)
    engine.read_only = True  # as RemoteEngine for `ranktop web` without --control
    acting = {"Signal…", "Kill rank", "Stop group", "Restart rank", "Restart group", "Type into the rank's stdin"}

    async def body(app, pilot):
        await until(pilot, lambda: "Stacks" in [key.description for key in shown_footer_keys(app)],
                    what="the footer's keys")
        shown = [key.description for key in shown_footer_keys(app)]
        assert shown[:2] == ["Quit", "Help"] and "Stacks" in shown
        assert not acting & set(shown)
        titles = {c.title for c in app.get_system_commands(app.main)}
        assert "Zoom" in titles and not {t.split(" (")[0] for t in titles} & acting, titles
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        help_text = "\n".join(screen_rows(app))
        assert "Zoom" in help_text and "Other threads" in help_text
        for text in ("Kill rank", "Restart group", "Signal picker", "SIGUSR1 fallback", "ask first", "stdin",
                     "Stop and quit", "Quit question"):
            assert text not in help_text, text
        await pilot.press("escape")
        # Still bound, they say at once that nothing was done: no question first, no picker, no input box.
        await refused_at_once(app, pilot, engine, ("k", "x", "i", "R"), "read-only view: nothing was done")
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen)
                    and "Dump again" in [key.description for key in shown_footer_keys(app)], what="stacks")
        shown = [key.description for key in shown_footer_keys(app)]
        assert "Dump again" in shown and "SIGUSR1 fallback" not in shown
        await pilot.press("escape", "q")  # it can stop nothing: q leaves at once, without asking or a stop
        await until(pilot, lambda: app.return_code == 0, what="q to leave the view")
        assert not isinstance(app.screen, ConfirmQuit)
        assert not [c for c in engine.commands if isinstance(c, (cmd.Stop, cmd.KillGroup))]

    drive(engine, body)


async def refused_at_once(app, pilot, engine: FakeEngine, keys: tuple[str, ...], words: str) -> None:
    """Each of `keys` says `words` at once: no question first, no picker, no input box, no command."""
    for key in keys:
        app.clear_notifications()
        await pilot.press(key)
        await until(pilot, lambda: words in notes(app), what=f"{key}'s answer")
        assert "again to confirm" not in notes(app) and app.screen is app.main, key
        assert not app.main.query_one("#stdin").display and engine.commands == [], key


def footer_dimmed(app: RanktopApp) -> dict[str, bool]:
    """Each key the footer shows, by its description: whether it is dimmed (check_action None)."""
    return {key.description: key.has_class("-disabled") for key in shown_footer_keys(app)}


RANK_KEYS_SHOWN = ("Signal…", "Kill rank", "Restart rank", "Restart group")


def test_keys_that_can_act_on_no_rank_now_are_dimmed_and_say_so_at_once():
    """While the first rendezvous round forms no rank has started: k asked `Kill rank 0 (SIGKILL)?
    Press k again to confirm.` of a rank that did not exist (r, R the same; x opened the picker,
    i the input box), and only then did the engine answer that there was nothing to act on. They
    say so at once; K, a stop, which ends the wait, still asks and is sent. The footer dims those
    keys (it showed them as if they acted) and shows them whole once the ranks run; a rank that is
    not running dims k and i (nothing to kill or to type into), which say so at once too, and a
    later round forming dims them all again. Where not every key fits (80 columns), the dimmed
    ones give way first: they took the room of K, the one key that acts while a round forms."""
    engine = FakeEngine(2)
    started = engine.group
    engine.group = dataclasses.replace(started, state=GroupState.RENDEZVOUS, ranks=())

    async def body(app, pilot):
        # (the footer is rebuilt a moment after a change: read once every key is in it)
        await until(pilot, lambda: {*RANK_KEYS_SHOWN, "Stop group"} <= set(footer_dimmed(app)), what="the footer's keys")
        dimmed = footer_dimmed(app)
        assert [dimmed[d] for d in RANK_KEYS_SHOWN] == [True] * 4, dimmed
        assert not any(dimmed[d] for d in ("Quit", "Help", "Zoom", "Search", "Stacks", "Stop group")), dimmed
        assert not app.screen.active_bindings["i"].enabled  # (not in the footer: the palette runs it)
        await pilot.resize_terminal(80, 24)  # too narrow for all: the dimmed keys give way to K, which acts
        await until(pilot, lambda: "Stop group" in footer_dimmed(app), what="K in the footer at 80 columns")
        assert not any(footer_dimmed(app).values()), footer_dimmed(app)
        await pilot.resize_terminal(160, 48)
        await until(pilot, lambda: all(footer_dimmed(app).get(d) for d in RANK_KEYS_SHOWN), what="the dimmed keys back")
        await refused_at_once(app, pilot, engine, ("k", "r", "R", "x", "i"), "no ranks to act on yet")
        app.clear_notifications()
        assert await app.run_action("restart_group", app.main)  # as the palette runs it
        await until(pilot, lambda: "no ranks to act on yet" in notes(app), what="the palette's answer")
        assert engine.commands == []
        engine.group = dataclasses.replace(started, ranks=started.ranks)  # the round formed: the ranks run
        await until(pilot, lambda: not any(footer_dimmed(app).values()), what="the rank keys shown whole")
        engine.set_rank(1, state=RankState.FAILED, exitcode=1)
        await pilot.press("1")
        # (each footer rebuild settles a moment after the change that asked for it: waited for whole)
        await until(pilot, lambda: footer_dimmed(app).get("Kill rank") and not any(
            footer_dimmed(app).get(d, True) for d in ("Signal…", "Restart rank", "Restart group")),
            what="k dimmed on a rank not running, x r R whole")
        await refused_at_once(app, pilot, engine, ("k", "i"), "rank 1 is not running (failed)")
        engine.group = dataclasses.replace(engine.group, state=GroupState.RENDEZVOUS)  # the next round forms
        await until(pilot, lambda: all(footer_dimmed(app).get(d) for d in RANK_KEYS_SHOWN), what="every rank key dimmed")
        await refused_at_once(app, pilot, engine, ("R",), "no ranks to act on until it forms")
        await pilot.press("K")
        await until(pilot, lambda: "Press K again to confirm" in notes(app), what="the stop's question")
        await pilot.press("K")
        await until(pilot, lambda: engine.commands == [cmd.Stop(signal.SIGTERM)], what="the stop")

    drive(engine, body)


def test_the_root_cause_heading_names_the_attempt_its_rank_failed_in():
    """A restart spent on a failure whose next rendezvous round never formed (a peer node lost):
    the run ends on attempt_1, whose ranks never started; the heading said attempt_1. Why the run
    then ended (the round timed out) is in the panel under the evidence: it was a toast only, gone
    after 30 s, and the panel left the end of attempt_1 unexplained (the report said it)."""
    engine = FakeEngine(2)
    engine.group = dataclasses.replace(engine.group, attempt=1, max_restarts=1)
    cause = RootCause(rank=1, local_rank=1, pid=4967, exitcode=1, signal_name=None, message="", traceback=None,
                      timestamp=time.time(), error_file=None, attempt=0)
    timed_out = "the c10d rendezvous 'job42' timed out: not enough nodes joined"

    async def body(app, pilot):
        engine.end(GroupState.FAILED, 1, root_cause=cause, group_fields={"rendezvous_error": timed_out})
        head = app.main.query_one("#root-cause-head")
        await until(pilot, lambda: head.region.height, what="the end panel")
        await pilot.pause()
        rows = screen_rows(app)
        assert "attempt_0 (pid 4967)" in rows[head.region.y]
        assert f"then: {timed_out}" in [row.strip() for row in rows[head.region.y:]], rows
        await until(pilot, lambda: "k" not in [key.key for key in shown_footer_keys(app)],
                    what="the end handled by the app")
        await pilot.pause()
        assert timed_out not in notes(app), notes(app)  # (a toast of it covered the panel's text)

    drive(engine, body)


def test_the_root_cause_heading_is_one_line_at_80_columns():
    engine = FakeEngine(4)
    cause = RootCause(rank=2, local_rank=2, pid=4967, exitcode=1, signal_name=None,
                      message="RuntimeError: loss became NaN at step 133 on rank 2", traceback=None,
                      timestamp=time.time(), error_file=None, last_lines=("step 132",))

    async def body(app, pilot):
        engine.end(GroupState.FAILED, 1, root_cause=cause)
        head = app.main.query_one("#root-cause-head")
        await until(pilot, lambda: head.region.height, what="the end panel")
        await pilot.pause()
        assert head.region.height == 1
        rows = screen_rows(app)
        heading = rows[head.region.y]
        assert heading.startswith("  ROOT CAUSE   rank 2 exit code 1 at ") and "attempt_0 (pid 4967)" in heading
        assert rows[head.region.y + 1].strip() == "RuntimeError: loss became NaN at step 133 on rank 2"
        assert "q quits, e hides this" in rows[-2]  # the panel's last line, above the footer
        # A longer heading than the row holds: cut with an ellipsis, never wrapped.
        long_name = dataclasses.replace(cause, local_rank=0, rank=1234567)
        app.main.query_one(RootCausePanel).show(dataclasses.replace(engine.snapshot(), root_cause=long_name))
        await pilot.pause()
        assert head.region.height == 1 and screen_rows(app)[head.region.y].rstrip().endswith("…")

    drive(engine, body, size=(80, 24))


def test_the_end_panels_wrapped_lines_hang_under_their_text_at_80_columns():
    """At 80 columns a line of the end panel too long for it (the error's words, a frame of a
    rank's traceback, the logs line) went on at the panel's left edge, where its rows read as
    items of their own. Its rows after the first hang under its text; under at most half the
    width, for a rank's line that starts with 200 spaces."""
    engine = FakeEngine(2)
    engine.group = dataclasses.replace(engine.group, log_dir="/tmp/ranktop-0/" + "a-long-run-directory-" * 2 + "e158")
    message = ("RuntimeError: the loss became NaN at step 133 while the gradient of the attention layer's "
               "output projection overflowed in bf16")
    frame = '    raise RuntimeError(f"the loss became NaN at step {n} while the gradient of the attention layer")'
    cause = RootCause(rank=1, local_rank=1, pid=4967, exitcode=1, signal_name=None, message=message, traceback=None,
                      timestamp=time.time(), error_file=None, last_lines=("step 132", frame, " " * 200 + "deep"))

    async def body(app, pilot):
        engine.end(GroupState.FAILED, 1, root_cause=cause)
        panel = app.main.query_one(RootCausePanel)
        await until(pilot, lambda: panel.region.height, what="the end panel")
        await pilot.pause()

        def shown() -> list[str]:  # the rows of its text in view, from their left edge
            region = panel.content_region.intersection(app.main.query_one("#root-cause-text").region)
            return [row[region.x:region.right].rstrip() for row in screen_rows(app)[region.y:region.bottom]]

        assert shown()[:2] == ["  RuntimeError: the loss became NaN at step 133 while the gradient of the",
                               "  attention layer's output projection overflowed in bf16"], shown()
        await pilot.press("E", "end")  # the rest, as a person scrolls to it
        await pilot.pause()
        assert shown() == [
            "  last output of rank 1:",
            "    step 132",
            '        raise RuntimeError(f"the loss became NaN at step {n} while the',
            '        gradient of the attention layer")',
            " " * 38 + "deep",  # (half the 76 columns its scrollbar leaves it)
            "",
            "  logs /tmp/ranktop-0/a-long-run-directory-a-long-run-directory-e158   q",
            "  quits, e hides this",
        ], shown()

    drive(engine, body, size=(80, 24))


def test_the_header_keeps_no_gpu_at_80_columns():
    """On a laptop or a CPU box the header's `no GPU` says why the panes show no GPU; at 80 columns
    it was the first part to go (`(1 restart left)` took its room), and the panes' missing GPU
    facts read as a sampler gone wrong. It stays longer than the world, the node, the log dir and
    the restarts left, which say `(1 left)` to stay with it; an NVML error keeps its reason for a
    wider terminal (and the details, m). At 160 columns all show, whole."""
    engine = FakeEngine(2)
    engine.group = dataclasses.replace(engine.group, gpu_status="no GPU", max_restarts=1)

    async def body(app, pilot):
        await until(pilot, lambda: "alive" in screen_rows(app)[0], what="the header")
        clock = r"\d+:\d\d:\d\d"
        assert re.fullmatch(rf" ranktop  fake\.py  running   attempt_0 \(1 left\)  {clock}  2/2 alive  no GPU *",
                            screen_rows(app)[0]), screen_rows(app)[0]
        why = "NVML error: Driver/library version mismatch"
        engine.group = dataclasses.replace(engine.group, gpu_status=why)
        await until(pilot, lambda: "NVML error" in screen_rows(app)[0], what="the NVML error")
        assert re.fullmatch(rf" ranktop  fake\.py  running   attempt_0 \(1 left\)  {clock}  2/2 alive  NVML error *",
                            screen_rows(app)[0]), screen_rows(app)[0]
        await pilot.resize_terminal(160, 48)
        await until(pilot, lambda: why in screen_rows(app)[0], what="the header at 160 columns")
        assert re.fullmatch(rf" ranktop  fake\.py  running   attempt_0 \(1 restart left\)  world 2  node 0/1  {clock}"
                            rf"  2/2 alive  {why}  logs /tmp/fake-run *", screen_rows(app)[0]), screen_rows(app)[0]

    drive(engine, body, size=(80, 24))


def test_a_peers_stop_in_the_header_gives_up_its_words_before_the_attempt_the_clock_and_the_round():
    """A fixed-size c10d job, --max-restarts 1: a peer's K made this node restart and wait for the
    next round. The header kept the 120 cells of `earlier: attempt_0: node localhost ... was stopped
    by its user (K, q or ranktop stop)` whole, and at 160 columns that pushed out the badge, the
    attempt, the clock and `round 1 forming: 1 of 2 nodes`. Its words give up their end now; at 80
    columns the badge goes for the forming round, which goes last."""
    engine = FakeEngine(2, name="train.py")
    stopped = ("attempt_0: node localhost (group rank 1) of the c10d rendezvous 'job42' was stopped by its user "
               "(K, q or ranktop stop)")
    for r in range(2):
        engine.set_rank(r, state=RankState.KILLED, exitcode=-15, signal_name="SIGTERM")
    engine.group = dataclasses.replace(engine.group, state=GroupState.RENDEZVOUS, attempt=1, max_restarts=1,
                                       nnodes=2, world_size=4, round=0, forming=RoundForming(1, 1, "2"),
                                       earlier_attempts=(stopped,), gpu_status="no GPU")
    clock = r"\d+:\d\d:\d\d"

    async def body(app, pilot):
        await until(pilot, lambda: "forming" in screen_rows(app)[0], what="the forming round in the header")
        row = screen_rows(app)[0]
        assert re.fullmatch(r" ranktop  train\.py  rendezvous   attempt_1 \(0 left\)  earlier: attempt_0: node "
                            rf"localhost [^…]*…  round 1 forming: 1 of 2 nodes  {clock}  0/2 alive  no GPU *", row), row
        await pilot.resize_terminal(80, 24)
        await until(pilot, lambda: "train.py" in screen_rows(app)[0] and "ranktop" not in screen_rows(app)[0],
                    what="the header at 80 columns")
        row = screen_rows(app)[0]
        assert re.fullmatch(r" train\.py  rendezvous   earlier: attempt_0: node…  round 1 forming: 1 of 2 nodes *",
                            row), row

    drive(engine, body, size=(160, 48))


def test_the_stop_toast_leaves_the_end_panels_state_in_sight():
    engine = FakeEngine(4)

    async def body(app, pilot):
        await pilot.press("K", "K")
        await until(pilot, lambda: cmd.Stop(signal.SIGTERM) in engine.commands, what="stop submitted")
        await until(pilot, lambda: "fake: Stop" in "\n".join(screen_rows(app)), what="its answer, in a toast")
        engine.end(GroupState.STOPPED, 143, state=RankState.KILLED, exitcode=-15, signal_name="SIGTERM")
        head = app.main.query_one("#root-cause-head")
        await until(pilot, lambda: head.region.height, what="the end panel")
        await pilot.pause()  # one frame: the toast (3 s) would still be up
        rows = screen_rows(app)
        assert "fake: Stop" not in "\n".join(rows)
        # (after 0:00:0N: the fake's run began when it was made, before a loaded box started the app)
        assert re.fullmatch(r"  STOPPED   fake\.py stopped on request after 0:00:0\d", rows[head.region.y].rstrip())

    drive(engine, body, size=(80, 24), toasts=True)


def test_the_details_say_no_gpu_where_there_is_none():
    engine = FakeEngine(2)
    engine.group = dataclasses.replace(engine.group, gpu_status="no GPU")

    async def body(app, pilot):
        await pilot.press("m")
        await until(pilot, lambda: isinstance(app.screen, RankDetails), what="the details")
        text = app.screen.query_one("#details-text")
        await until(pilot, lambda: "gpu util" in text.render().plain, what="the histories")
        lines = text.render().plain.splitlines()
        assert [line.split(None, 2)[2] for line in lines if line.startswith("gpu ")] == ["no GPU", "no GPU"]
        assert "no samples yet" in text.render().plain  # (the others: not read yet)

    drive(engine, body, size=(80, 24))


def test_the_end_panel_of_a_success_lists_the_earlier_starts_as_the_header_does():
    """It said `after 1 restart: attempt_0: restarted, nodes joined`, though a start for nodes that
    joined spends no restart (the header says `earlier:` and the restarts left)."""
    group = dataclasses.replace(FakeEngine().group, state=GroupState.SUCCEEDED, ended=True, exit_status=0,
                                earlier_attempts=("attempt_0: restarted, nodes joined", "attempt_0: rank 1 failed (exit 4)"))
    shown = root_cause_body(group).plain
    assert shown.startswith("  earlier: attempt_0: restarted, nodes joined; attempt_0: rank 1 failed (exit 4)\n"), shown
    assert "restart:" not in shown and "restarts:" not in shown


def test_hundreds_of_earlier_attempts_keep_the_header_and_the_end_panel_short():
    """300 group restarts made the end panel's `earlier:` line 27 KB long (and each snapshot carried
    it): the first, the last three and a count of those between now, as the end report says them.
    The header counts them all; one that failed among those left out keeps it in sight."""
    kept = tuple(f"attempt_{k}: restarted by the user" for k in (0, 297, 298, 299))
    group = dataclasses.replace(FakeEngine(4).group, state=GroupState.SUCCEEDED, ended=True, exit_status=0,
                                started_at=0.0, attempt=300, user_restarts=300, earlier_attempts=kept,
                                earlier_left_out=296)
    assert root_cause_body(group).plain.startswith(
        "  earlier: attempt_0: restarted by the user; ... 296 more (events.jsonl) ...; attempt_297: restarted by "
        "the user; attempt_298: restarted by the user; attempt_299: restarted by the user\n")
    assert "earlier: attempt_299: restarted by the user (+299)" in header_text(group, 100.0, width=200).plain
    assert "earlier" not in header_text(group, 100.0, width=80).plain  # all calm: it gives way
    failed = dataclasses.replace(group, earlier_left_out_calm=False)
    assert "earlier: attempt_299: restarted by the user (+299)" in header_text(failed, 100.0, width=80).plain


def test_views_open_across_the_end_drop_the_keys_that_act_on_ranks():
    """A stack view opened while the run went on kept `u SIGUSR1 fallback` in its footer after
    the end (its ? help had dropped it), and the help's Mouse section still said that k K r R
    ask first, keys the end had taken out of the footer and the rest of the help."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen)
                    and "SIGUSR1 fallback" in {k.description for k in shown_footer_keys(app)}, what="stack view")
        engine.end(GroupState.SUCCEEDED, 0, state=RankState.SUCCEEDED, exitcode=0)
        await until(pilot, lambda: app.main.ended, what="the run's end")
        await until(pilot, lambda: (shown := {k.description for k in shown_footer_keys(app)})
                    and "Dump again" in shown and "SIGUSR1 fallback" not in shown, what="the stack view's footer")
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        help_text = "\n".join(screen_rows(app))
        assert "Mouse" in help_text and "ask first" not in help_text and "SIGUSR1" not in help_text
        await pilot.press("escape", "escape")
        await until(pilot, lambda: app.screen is app.main and (shown := {k.description for k in shown_footer_keys(app)})
                    and "Zoom" in shown and "Kill rank" not in shown, what="the grid's footer")

    drive(engine, body, size=(160, 90))  # (tall: the help's last section, Mouse, in sight)


def test_the_two_column_help_wraps_its_descriptions_whole():
    """At 160x48 the stack view's help showed `Between the groups and the call tre`: each column
    asked for more than half of the help's width, and the table cut what did not fit."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen), what="stack view")
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        rows = screen_rows(app)
        top = next(row for row in rows if "Stack view (d / D)" in row)
        left, right = top.index("Stack view (d / D)"), top.index("Ranks")  # where each column starts
        column = " ".join(" ".join(row[left:right].split()) for row in rows)  # its rows, one after the other
        for title, rows_of in app.screen.groups[:3]:  # the stack view's own keys: that column
            for _, description in rows_of:
                assert description in column, (title, description)

    drive(engine, body)


def test_the_help_takes_the_layout_of_the_terminals_new_size():
    """Opened at 160 columns and narrowed to 80, the help kept its two columns, its words wrapped
    one or two a row (`Focus previous` over `rank`); widened again, it has two."""
    engine = FakeEngine(2)

    def columns(app) -> bool | None:
        """Whether the second column's first heading is beside the first's; None while the screen
        shows no first heading (a frame drawn mid-resize: a loaded box drew one)."""
        row = next((row for row in screen_rows(app) if "Ranks" in row), None)
        return None if row is None else "Pane output" in row

    async def body(app, pilot):
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        assert columns(app) is True
        await pilot.resize_terminal(80, 24)
        await until(pilot, lambda: columns(app) is False, what="one column at 80")
        assert any("Focus previous rank" in row for row in screen_rows(app))
        await pilot.resize_terminal(160, 48)
        await until(pilot, lambda: columns(app) is True, what="two columns again")

    drive(engine, body)


@pytest.mark.parametrize("opener,closer", [("m", "Close the details"), ("x", "Cancel"), ("q", "Stay"),
                                           ("question_mark", None)])
def test_the_palette_over_a_dialog_offers_its_commands_not_the_grids(opener, closer):
    """ctrl+p over the rank details, the signal picker, the quit question or the help offered
    the grid's actions: `Zoom` from it zoomed the grid unseen below the dialog. A dialog's own
    commands are offered (the help has none), and run on it."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press(opener)
        dialog = await until(pilot, lambda: app.screen.is_modal and app.screen, what="the dialog")
        titles = {c.title for c in app.get_system_commands(dialog)}
        assert not titles & {"Zoom", "Kill rank", "Stop group", "Focus rank 1", "Search"}, titles
        if closer is None:
            return
        # (what the dialog itself leaves out: the quit question's d where it offers no detach)
        hidden = dialog.key_sections(DIALOG_EXTRAS)[0][2] if hasattr(dialog, "key_sections") else DIALOG_EXTRAS
        own = {description for _, description, _ in described(app, dialog, hidden=hidden)}
        assert closer in own <= titles, titles
        await pilot.press("ctrl+p", *closer.lower())
        await until(pilot, lambda: palette_top(app).startswith(closer), what="the dialog's own command")
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is app.main, what="the dialog closed")
        assert not app.main.zoomed and engine.commands == []

    drive(engine, body)


def palette_titles(app: RanktopApp) -> list[str]:
    """The first line (the title) of every entry the open command palette lists."""
    lists = app.screen.query(CommandList)
    if not lists:
        return []
    found = lists.first()
    return [str(found.get_option_at_index(i).prompt).split("\n")[0].strip() for i in range(found.option_count)]


def test_the_palette_lists_no_second_quit_or_keys_panel_of_textuals():
    """ctrl+p listed Textual's own Quit, Keys and Maximize beside ours (q Quit, ? Help, z Zoom):
    two Quits, and a keys panel that knew none of ranktop's screens. Its Theme and Screenshot,
    which nothing of ours does, stay."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press("ctrl+p")
        titles = await until(pilot, lambda: palette_titles(app), what="the palette's list")
        assert titles.count("Quit") == 1 and titles.count("Help") == 1 and "Zoom" in titles, titles
        assert not {"Keys", "Maximize", "Minimize"} & set(titles), titles
        assert {"Theme", "Screenshot"} <= set(titles), titles
        await pilot.press(*"quit")
        await until(pilot, lambda: palette_top(app).startswith("Quit"), what="'quit' searched")
        assert [t for t in palette_titles(app) if t.startswith("Quit")] == ["Quit"]
        await pilot.press("enter")  # ours: it asks first, ranks being alive
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what="the quit question")

    drive(engine, body)


def test_the_palettes_screenshot_is_saved_in_the_runs_directory(tmp_path, monkeypatch):
    """Textual saved it in ~/Downloads, which a training box seldom has: `Failed to save screenshot`.
    Its toast read the path as markup: a run id `exp[lr=3e-4]` raised a MarkupError that ended the
    TUI and stopped the run."""
    monkeypatch.setenv("HOME", str(tmp_path / "home-without-downloads"))
    run_dir = tmp_path / "exp[lr=3e-4]"
    run_dir.mkdir()
    engine = FakeEngine(2)
    engine.group = dataclasses.replace(engine.group, log_dir=str(run_dir))

    async def body(app, pilot):
        await pilot.press("ctrl+p")
        await until(pilot, lambda: palette_titles(app), what="the palette's list")
        await pilot.press(*"screenshot")
        await until(pilot, lambda: palette_top(app).startswith("Screenshot"), what="'screenshot' searched")
        await pilot.press("enter")
        saved = await until(pilot, lambda: list(run_dir.glob("*.svg")), what="an SVG in the run's directory")
        await until(pilot, lambda: "Saved screenshot to" in notes(app), what="where it went, said")
        await until(pilot, lambda: any("Saved screenshot to" in row for row in screen_rows(app)),
                    what="the toast drawn")
        assert str(saved[0]) in notes(app) and "<svg" in saved[0].read_text()
        assert app.is_running and app.return_code is None

    drive(engine, body, toasts=True)


@pytest.mark.parametrize("can_detach", [False, True])
def test_the_quit_questions_help_lists_detach_only_where_it_is_offered(can_detach):
    """`?` over the quit question, and the grid's help, listed `d Detach` also where the question
    offers no detach (a run that is not served, a process that could not fork)."""
    engine = FakeEngine(2)

    async def whole_help(pilot) -> str:
        """Every row the help shows, paged through to its end (it is taller than the screen)."""
        await until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen), what="the help")
        box = pilot.app.screen.query_one("#help-box")
        seen = "\n".join(screen_rows(pilot.app))
        for _ in range(20):  # (a help that never reaches its end fails below, not hangs)
            if box.scroll_y >= box.max_scroll_y:
                break
            await pilot.press("pagedown")
            await pilot.pause()
            seen += "\n".join(screen_rows(pilot.app))
        assert box.scroll_y >= box.max_scroll_y, "the help never scrolled to its end"
        return seen

    async def body(app, pilot):
        app.can_detach = can_detach
        await pilot.press("question_mark")
        assert ("Detach:" in await whole_help(pilot)) == can_detach
        await pilot.press("escape", "q")
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what="the quit question")
        assert ("Detach (d)" in "\n".join(screen_rows(app))) == can_detach
        await pilot.press("question_mark")
        assert ("Detach:" in await whole_help(pilot)) == can_detach

    drive(engine, body)


def test_a_store_that_does_not_answer_is_said_silent_not_lost():
    """A look at the rendezvous's store that waits for its answer (the node serving it paused, or
    hung) is not a broken connection (its node gone): the toast said `no new round can form` and
    the header `store lost` for a store that may well answer again; a broken one still says so."""
    engine = FakeEngine(2)
    store = "the c10d rendezvous 'j''s store at node0:29400"

    async def body(app, pilot):
        with engine._lock:
            engine.group = dataclasses.replace(engine.group, store_lost=store, store_silent=True)
        await until(pilot, lambda: "store silent" in app.main.query_one("#header").render().plain, what="silent")
        await until(pilot, lambda: "does not answer" in notes(app), what="its toast")
        assert f"{store} does not answer (the node serving it paused, hung or cut off?): this node's ranks run on" \
            in notes(app) and "no new round can form" not in notes(app) and "store lost" not in app.main.query_one(
                "#header").render().plain
        with engine._lock:
            engine.group = dataclasses.replace(engine.group, store_lost=None, store_silent=False)
        await until(pilot, lambda: "answers again" in notes(app), what="back")
        with engine._lock:
            engine.group = dataclasses.replace(engine.group, store_lost=store)
        await until(pilot, lambda: "store lost" in app.main.query_one("#header").render().plain, what="lost")
        await until(pilot, lambda: f"lost {store}: this node's ranks run on, but no new round can form" in notes(app),
                    what="the lost store's toast")

    drive(engine, body)
