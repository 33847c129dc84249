"""Controls a person can trust (SPEC 8): destructive keys ask first, stops give the grace (to
stopped ranks too), Ctrl-C as q, restarts that show and say what they did, go to rank N, the
follow state in the titles. Real ranks wherever the effect is on ranks."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import textual.app
from conftest import ROOT, drive, make_agent, read_events, screen_rows, until, wait_for
from fake_engine import FakeEngine
from ranktop.core import commands as cmd
from ranktop.core.agent import LocalAgent
from ranktop.core.engine import LocalEngine
from ranktop.core.process import kernel_state
from ranktop.core.report import format_root_cause
from ranktop.core.spec import WorkerSpec
from ranktop.core.stacks import Frame, RankStack, StackStatus, ThreadStack, build_report, find_py_spy
from ranktop.core.state import GroupState, RankSnapshot, RankState
from ranktop.tui import main_screen
from ranktop.tui.app import QUIT_STATUS, RanktopApp
from ranktop.tui.commands import action_name, declared_bindings, help_groups
from ranktop.tui.details import RankDetails
from ranktop.tui.panes import (
    STATE_STYLE,
    GroupHeader,
    LiveText,
    RankList,
    fit_name,
    fit_path,
    header_text,
    list_order,
    rank_title,
    state_label,
    state_style,
)
from ranktop.tui.screens import SIDEWAYS, ConfirmQuit, HelpScreen, RootCausePanel, SignalPicker
from ranktop.tui.stacks_view import CallTree, StackGroups, StacksScreen
from rich.cells import cell_len
from test_stacks import stuck_prefetch_agent
from test_tui_app import TICKER, notes, palette_top, rank, ticker_agent
from test_tui_fake import drive as drive_fake
from test_tui_fake import shown_footer_keys
from test_tui_tmux import DEEP, Terminal
from textual import events

pytestmark = pytest.mark.timeout(60)


async def type_keys(pilot, *keys: str) -> None:
    """pilot.press(*keys) without Pilot's two waits for the app to go idle after each key but the
    last (20 ms or more each: most of what a test that types a search took). Only for keys whose
    handling is done when their event is (text into the focused input; V's up, which moves the
    selection and scrolls at once): each key event is sent as press sends it and handled in turn,
    animations are still waited out after each, and the last key is pressed as press does, so all
    were handled when it returns. (Page keys scroll later: a quick run of them ended elsewhere.)"""

    async def next_turn(*_args, **_kwargs) -> None:
        await asyncio.sleep(0)

    with mock.patch.object(textual.app, "wait_for_idle", next_turn):
        await pilot.press(*keys[:-1])
    await pilot.press(*keys[-1:])


async def search_for(pilot, key: str, text: str) -> None:
    """Open a search box with `key` (slash, ctrl+f), type `text` and run it."""
    await pilot.press(key)
    await type_keys(pilot, *text)
    await pilot.press("enter")


@pytest.fixture(autouse=True)
def patient_confirm(monkeypatch):
    """A second press of k/K/r/R confirms within 3 s; a loaded box may take longer between two
    keys, and these tests are about what the keys do, not about the window."""
    from ranktop.tui import main_screen

    monkeypatch.setattr(main_screen, "CONFIRM_SECONDS", 60.0)

# Rank 1 marks its first and second start; rank 0 fails once rank 1 came back (a peer that lost
# its collective partner, as gloo/NCCL would).
PEER_LOSS = (
    "import os, sys, time\nd = os.environ['MARKS']\nr = os.environ['RANK']\n"
    "if r == '1':\n"
    "    name = 'second' if os.path.exists(os.path.join(d, 'first')) else 'first'\n"
    "    open(os.path.join(d, name), 'w').close()\n"
    "print('rank', r, 'up', flush=True)\n"
    "while True:\n"
    "    if r == '0' and os.path.exists(os.path.join(d, 'second')):\n"
    "        print('peer lost', flush=True); sys.exit(3)\n"
    "    time.sleep(0.05)\n"
)
TRAP_TERM = ("import signal, sys, time\n"
             "def bye(*_):\n    print('checkpoint saved', flush=True); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, bye)\nprint('up', flush=True)\nwhile True:\n    time.sleep(0.1)\n")


def test_kill_group_asks_then_stops_with_sigterm_and_resumes_stopped_ranks(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, TRAP_TERM)))

    async def body(app, pilot):
        await until(pilot, lambda: all(b"up" in b"".join(app.engine.agent.output(r)) for r in (0, 1)), what="ranks up")
        pid = rank(app, 1).pid
        os.kill(pid, signal.SIGSTOP)  # stopped from elsewhere: ranktop did not pause it
        await until(pilot, lambda: kernel_state(pid) == "T", what="rank 1 stopped")
        await pilot.press("K")
        assert "Press K again" in notes(app) and rank(app, 0).state.alive
        await pilot.press("K")
        await until(pilot, lambda: app.main.ended, what="group stopped")
        # SIGTERM reached both (SIGCONT let the stopped one run its handler): no SIGKILL needed.
        for r in (0, 1):
            assert b"checkpoint saved" in b"".join(app.engine.agent.output(r)), r
        await pilot.press("q")

    drive(app, body)
    assert [e["signal"] for e in read_events(app.engine.agent.run_dir) if e["event"] == "user_stop"] == ["SIGTERM"]


@pytest.mark.parametrize("keys", [("K", "K"), ("q", "y")], ids=["K-then-q", "q-then-stop"])
def test_a_user_stop_exits_130_by_any_path(tmp_path, keys):
    """K (confirmed) then q used to exit 1, the status of a rank's failure, where q then stop
    exits 130: both are the user's stop, and exit as Ctrl-C does."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path)))

    async def body(app, pilot):
        await pilot.press(*keys)
        await until(pilot, lambda: app.engine.snapshot().ended, what="group stopped")
        if keys[0] == "K":  # K leaves the TUI open on the final states: q leaves
            assert app.is_running
            await pilot.press("q")
        await until(pilot, lambda: not app.is_running, what="the app left")

    drive(app, body)
    assert app.exit_status == QUIT_STATUS == 128 + signal.SIGINT
    assert [e["exit_status"] for e in read_events(app.engine.agent.run_dir) if e["event"] == "run_finished"] == [130]


def test_kill_key_confirms_only_on_the_same_rank(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path)))

    async def body(app, pilot):
        await pilot.press("0", "k", "1", "k")  # a k on another rank asks again, kills nothing
        assert rank(app, 0).state.alive and rank(app, 1).state.alive
        await pilot.press("k")
        await until(pilot, lambda: rank(app, 1).state == RankState.KILLED, what="rank 1 killed")
        assert rank(app, 0).state.alive

    drive(app, body)


def test_a_second_press_confirms_only_the_attempt_or_process_its_question_named():
    """R asked `Restart every rank as attempt_1?`; the group then restarted for a failure, and the
    second R made attempt_2 of the attempt just begun (in tmux: a rank failing 2 s after the
    first R). A k asked of a process since replaced killed the new one. Each asks again."""
    engine = FakeEngine(2)

    def group_restarted(attempt: int) -> None:  # the next attempt's ranks, as the engine shows them
        ranks = tuple(dataclasses.replace(r, pid=r.pid + 100 * attempt) for r in engine.group.ranks)
        engine.group = dataclasses.replace(engine.group, attempt=attempt, generation=attempt, ranks=ranks)

    async def body(app, pilot):
        await pilot.press("R")
        group_restarted(1)
        await pilot.press("R")
        await until(pilot, lambda: "Restart every rank as attempt_2?" in notes(app), what="asked again")
        assert engine.commands == []
        await pilot.press("R")
        await until(pilot, lambda: engine.commands == [cmd.RestartGroup()], what="the restart asked about")
        await pilot.press("1", "k")
        engine.set_rank(1, pid=4242)  # rank 1 started again (another view's r)
        await pilot.press("k")
        assert engine.commands == [cmd.RestartGroup()]  # (the question only, again)
        await pilot.press("k")
        await until(pilot, lambda: engine.commands[-1:] == [cmd.KillRank(1)], what="the kill asked about")
        assert len(engine.commands) == 2

    drive_fake(engine, body)


def test_rs_question_and_what_its_second_press_confirms_come_from_one_picture():
    """The engine runs on while R is asked: a restart that came after the question was worded
    (`attempt_1`) and before its answer was armed (a second snapshot) armed the attempt just
    begun, and the second R made attempt_2 of it, the mistake the question exists to prevent."""
    class RestartsAfterTheQuestion(FakeEngine):
        def snapshot(self):
            snap = super().snapshot()
            if sys._getframe(1).f_code.co_name == "action_restart_group" and self.group.attempt == 0:
                ranks = tuple(dataclasses.replace(r, pid=r.pid + 100) for r in self.group.ranks)
                self.group = dataclasses.replace(self.group, attempt=1, generation=1, ranks=ranks)
            return snap

    engine = RestartsAfterTheQuestion(2)

    async def body(app, pilot):
        await pilot.press("R")
        await until(pilot, lambda: "Restart every rank as attempt_1?" in notes(app), what="the question")
        await pilot.press("R")
        await until(pilot, lambda: "Restart every rank as attempt_2?" in notes(app), what="asked again")
        assert engine.commands == []

    drive_fake(engine, body)


def test_keys_typed_in_one_go_act_in_the_order_they_were_typed():
    """Keys that come together (typed fast, or while the TUI is busy drawing) are read back to
    back, and Textual acts on the grid's priority keys (arrows, n) as they come, on the others
    only after a trip through the focused pane: `x ↓ enter` moved the focus to rank 2 before x
    opened the picker, which sent SIGINT to rank 2 (in tmux too); `q n` left the question up;
    `/need` ran n, e, e and d (a stack dump) on the grid, and `i n enter` typed an empty line."""
    engine = FakeEngine(4)
    engine.print(0, "what we need")

    def typed_at_once(app, *keys: str) -> None:
        for key in keys:
            app.post_message(events.Key(key, key if len(key) == 1 else None))

    async def body(app, pilot):
        typed_at_once(app, "x", "down", "enter")
        await until(pilot, lambda: engine.commands, what="the signal")
        assert engine.commands == [cmd.SignalRank(0, signal.SIGTERM)] and app.main.current == 0
        typed_at_once(app, "q", "n")
        await pilot.pause()  # (both handled: the question asked and answered)
        await until(pilot, lambda: app.screen is app.main, what="the question answered")
        assert "no search in rank" not in notes(app)  # (n went to the grid, and the question stayed)
        typed_at_once(app, "slash", "n", "e", "e", "d", "enter")
        await until(pilot, lambda: app.main.pane(0).log.search_query, what="the search")
        assert app.main.pane(0).log.search_query == "need" and app.screen is app.main
        typed_at_once(app, "i", "n", "enter")
        await until(pilot, lambda: len(engine.commands) > 1, what="the line")
        assert engine.commands[1:] == [cmd.SendInput(0, "n\n")]

    drive_fake(engine, body)


def test_a_dialogs_late_answer_closes_no_other_screen():
    """An enter in the picker or on the quit question's `Cancel` answers a moment later, as a
    message; an esc or a ? typed with it came first. Textual's dismiss closed whatever was on top:
    the grid (ScreenStackError, the TUI ended), or the help, leaving the question up and answered,
    whose next answer ended the TUI (InvalidStateError). Found by mashing keys in tmux."""
    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press("x")
        for key in ("enter", "escape"):  # together: the picker's selection comes after the esc
            app.post_message(events.Key(key, None))
        await pilot.pause()
        await until(pilot, lambda: app.screen is app.main and len(app.screen_stack) == 1, what="the grid")
        await pilot.press("q")
        for key, char in (("enter", None), ("question_mark", "?")):  # Cancel's press comes after the help opened
            app.post_message(events.Key(key, char))
        await pilot.pause()
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help")
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what="the question under it")
        await pilot.press("n")
        await until(pilot, lambda: app.screen is app.main and len(app.screen_stack) == 1, what="the grid again")
        assert engine.commands == [] and app.is_running

    drive_fake(engine, body)


def test_q_between_two_attempts_asks_as_while_ranks_run():
    """q with no rank alive stopped the run at once, without a word: between two attempts (in
    tmux: a failure with restarts left, its sweep waiting on a helper that ignored SIGTERM) the
    restart never came, exit 130, where the question offers to stay or detach; likewise while a
    rendezvous round forms. It asks, saying that no rank runs but the run goes on."""
    engine = FakeEngine(2)
    engine.set_rank(0, state=RankState.KILLED, exitcode=-15, signal_name="SIGTERM")
    engine.set_rank(1, state=RankState.FAILED, exitcode=3)

    async def body(app, pilot):
        for state, ranks in ((GroupState.RUNNING, engine.group.ranks), (GroupState.RENDEZVOUS, ())):
            engine.group = dataclasses.replace(engine.group, state=state, ranks=ranks)
            await pilot.press("q")
            await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what=f"the question ({state.value})")
            shown = " ".join(str(w.render()) for w in app.screen.query("Static"))
            assert "No rank is running now, but the run has not ended" in shown, shown
            await pilot.press("n")
            await until(pilot, lambda: app.screen is app.main, what="stayed")
        assert engine.commands == []
        await pilot.press("q", "y")
        await until(pilot, lambda: engine.commands == [cmd.Stop(signal.SIGTERM)], what="the stop asked for")

    drive_fake(engine, body)


def test_ctrl_c_asks_like_q_and_twice_kills(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, TRAP_TERM.replace("sys.exit(0)", "time.sleep(60)"))))

    async def body(app, pilot):
        await pilot.press("ctrl+c")
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what="quit question")
        assert all(r.state.alive for r in app.engine.snapshot().ranks)
        await pilot.press("ctrl+c")  # the ranks ignore SIGTERM: only a kill ends them
        await until(pilot, lambda: app.engine.snapshot().ended, what="ranks killed")
        assert all(r.signal_name == "SIGKILL" for r in app.engine.snapshot().ranks)

    drive(app, body)
    assert app.exit_status == QUIT_STATUS


def test_restart_rank_separator_and_root_cause_names_the_restart(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path / "logs", PEER_LOSS, env={"MARKS": str(marks)})))

    async def body(app, pilot):
        await until(pilot, lambda: (marks / "first").exists(), what="rank 1 up")
        await pilot.press("1", "r", "r")
        await until(pilot, lambda: app.main.ended, what="rank 0 failed after the restart")
        output = b"".join(app.engine.agent.output(1)).decode()
        assert "restart 1 of this rank (ranktop)" in output
        assert output.index("restart 1 of this rank") < output.rindex("rank 1 up")
        panel = app.main.query_one("#root-cause-text").render().plain
        assert "rank 0" in panel and "after a user action: you restarted rank 1 at" in panel
        cause = app.engine.snapshot().root_cause
        assert cause.rank == 0 and "you restarted rank 1" in cause.user_action
        text = format_root_cause(cause, name="x", attempt=0, max_restarts=0)
        assert text.splitlines()[1].startswith("  root cause: after you restarted rank 1 at "), text

    drive(app, body)


def _agent(tmp_path, code: str, stall: float) -> LocalAgent:
    spec = WorkerSpec(role="default", local_world_size=1, entrypoint=sys.executable, args=("-u", "-c", code),
                      name="quiet.py")
    return LocalAgent(spec, log_dir=str(tmp_path), console=False, shutdown_timeout=2.0, stall_timeout=stall)


QUIET = "import time\nprint('one line', flush=True)\ntime.sleep(60)\n"


def test_restart_starts_the_stall_clock_again(tmp_path):
    engine = LocalEngine(_agent(tmp_path, QUIET, stall=1.5)).start()
    try:
        wait_for(lambda: engine.snapshot().ranks[0].state == RankState.STALLED, what="stalled")
        old = engine.snapshot().ranks[0].pid
        assert engine.submit(cmd.RestartRank(0)).ok
        wait_for(lambda: engine.snapshot().ranks[0].pid != old and engine.snapshot().ranks[0].state.alive,
                 what="restarted")
        assert engine.snapshot().ranks[0].state != RankState.STALLED  # the new process has not been silent yet
    finally:
        engine.close()


def test_our_own_signal_dump_does_not_clear_a_stall(tmp_path):
    engine = LocalEngine(_agent(tmp_path, QUIET, stall=1.0)).start()
    try:
        wait_for(lambda: engine.snapshot().ranks[0].state == RankState.STALLED, what="stalled")
        asked = time.time()
        ack = engine.submit(cmd.SignalDump())
        assert ack.ok and ack.report is not None and ack.report.ranks[0].threads  # it did print its stacks
        assert b"most recent call first" in b"".join(engine.agent.output(0))
        rank = engine.snapshot().ranks[0]
        assert rank.state == RankState.STALLED
        # Its last output is still its own line, from before the dump, as the stall says (the title's
        # age said `0s ago`)
        assert rank.last_output_at < asked and time.time() - rank.last_output_at >= rank.stall_seconds
        kinds = [e for e in open(os.path.join(engine.agent.run_dir, "events.jsonl")).read().splitlines()]
        assert not any('"stall_cleared"' in k for k in kinds)
    finally:
        engine.close()


def test_go_to_rank_digits_and_palette(monkeypatch):
    monkeypatch.setattr(main_screen, "DIGIT_SECONDS", 60.0)  # a loaded box may be slow between two keys
    engine = FakeEngine(32)

    async def body(app, pilot):
        main = app.main
        await pilot.press("1", "2")  # typed together: rank 12, not rank 2
        assert main.current == 12
        await pilot.press("g", *"27", "enter")
        assert main.current == 27 and not main.query_one("#goto").display
        await pilot.press("colon", *"99", "enter")
        assert main.current == 27 and "no rank 99 here: ranks are 0..31" in notes(app)
        await pilot.press("g")  # a paste too long for int() (4300 digits) ended the TUI in a ValueError
        main.query_one("#goto").post_message(events.Paste("1" * 5000))
        await until(pilot, lambda: len(main.query_one("#goto").value) == 5000, what="the pasted digits")
        await pilot.press("enter")
        await until(pilot, lambda: f"no rank {'1' * 19}… here" in notes(app), what="the note on the paste")
        assert main.current == 27 and app.is_running
        titles = [c.title for c in app.get_system_commands(main)]
        assert "Focus rank 31" in titles and "Focus rank 32" not in titles
        assert not any("Focus rank N" in t for t in titles)

    drive_fake(engine, body)


def test_follow_state_in_the_title():
    engine = FakeEngine(1)
    engine.print(0, *[f"line {i}" for i in range(100)])

    async def body(app, pilot):
        await until(pilot, lambda: app.main.pane(0).log.line_count == 100, what="lines")
        await until(pilot, lambda: "following" in app.main.pane(0).title, what="following")
        await pilot.press("f")
        await until(pilot, lambda: "paused at line" in app.main.pane(0).title, what="paused shown")
        assert "paused at line" in notes(app)
        await pilot.press("home")
        await until(pilot, lambda: "paused at line 1 " in app.main.pane(0).title, what="top line shown")
        await pilot.press("end")
        await until(pilot, lambda: "following" in app.main.pane(0).title, what="following again")

    drive_fake(engine, body)


def _snap(state: RankState, **kw) -> RankSnapshot:
    base = dict(rank=0, local_rank=0, pid=1, state=state, exitcode=None, signal_name=None, restarts=0,
                started_at=0.0, ended_at=None, last_output_at=None, output_version=0)
    return RankSnapshot(**{**base, **kw})


def test_no_color_drops_colours_but_keeps_reverse(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    stalled = _snap(RankState.STALLED, stall_seconds=12.0)
    assert state_label(stalled) == "stalled 12s" and state_style(stalled) == "bold reverse"
    assert state_style(_snap(RankState.KILLED, exitcode=-15, signal_name="SIGTERM")) == "italic"


def test_a_view_that_lost_its_engine_says_unknown_and_what_it_last_saw():
    """The picture an attached view keeps once its engine has gone before the run's end said
    `running`, `2/2 alive` and `3s ago` (its clock on): the ranks alive in it are `unknown` with
    the pid last seen, the header says the engine was lost, and the elapsed time stops."""
    engine = FakeEngine(2)
    engine.set_rank(0, last_output_at=time.time(), paused=True, kill_at=time.time() + 5)
    engine.set_rank(1, state=RankState.FAILED, exitcode=1)
    seen = engine.snapshot()
    lost = seen.engine_lost("Connection refused")
    assert lost.end_unknown and not seen.end_unknown and lost.ended_at == seen.taken_at
    later = seen.taken_at + 100
    head = header_text(lost, later).plain
    assert " unknown " in head and "engine lost: 1/2 alive when last seen" in head, head
    assert "running" not in head and "0:00:00" in head and "SIGKILL" not in head
    title = rank_title(lost.ranks[0], later).plain
    assert " unknown " in title and "last seen: pid 1000" in title and "ago" not in title, title
    assert " seen 1000" in rank_title(lost.ranks[0], later, narrow=True).plain
    assert state_label(lost.ranks[1]) == "exit 1" and "pid 1001" in rank_title(lost.ranks[1], later).plain
    assert [r.rank for r in list_order(lost.ranks, "state", "all", later)] == [1, 0]
    assert list_order(lost.ranks, "rank", "running", later) == []


def test_state_words_and_looks_without_colour():
    assert state_label(_snap(RankState.FAILED, exitcode=1)) == "exit 1"
    assert state_label(_snap(RankState.FAILED, exitcode=-11, signal_name="SIGSEGV")) == "failed SIGSEGV"
    # Under NO_COLOR colours go: the states that need a look are reversed, and kills are not red.
    for state in (RankState.FAILED, RankState.STALLED, RankState.UNREAPABLE):
        assert "reverse" in STATE_STYLE[state]
    assert "red" not in STATE_STYLE[RankState.KILLED]
    dead = _snap(RankState.FAILED, exitcode=1, last_output_at=100.0, ended_at=100.0)
    assert "ago" not in rank_title(dead, now=500.0).plain
    alive = _snap(RankState.RUNNING, last_output_at=100.0)
    assert "6m40s ago" in rank_title(alive, now=500.0).plain


def test_the_ages_of_quiet_ranks_turn_together_as_the_clock_turns_a_second():
    """Each rank's age was counted from its own moment: 64 quiet ranks turned at 64 moments a
    second, and the rank list changed, so was drawn anew, at every 4 Hz tick. Counted in the
    clock's whole seconds, all turn at once, once a second."""
    from ranktop.tui.panes import human_age, last_output_age

    ranks = [_snap(RankState.RUNNING, rank=r, last_output_at=100.0 + r / 10) for r in range(10)]
    shown = {now: {human_age(last_output_age(s, now)) for s in ranks} for now in (100.95, 101.05, 101.55, 102.0)}
    assert shown == {100.95: {"0s"}, 101.05: {"1s"}, 101.55: {"1s"}, 102.0: {"2s"}}


def test_a_title_too_wide_for_its_pane_drops_its_labels_before_its_facts():
    """A pane a little wider than the label-free threshold (80 columns, a 2x2 grid at 160) cut its
    labelled title at the edge: the GPU's memory and the last output's age were gone."""
    snap = _snap(RankState.RUNNING, last_output_at=100.0, cpu_percent=12.0, rss=15 << 20)
    wide = rank_title(snap, now=500.0).plain
    assert "cpu 12%" in wide and "6m40s ago" in wide  # room enough: the labels stay
    fitted = rank_title(snap, now=500.0, width=cell_len(wide) - 1).plain
    assert "cpu" not in fitted and "6m40s" in fitted and cell_len(fitted) <= cell_len(wide) - 1


def test_a_long_log_path_gives_up_its_start_to_fit_not_the_file_it_names():
    deep = "/mnt/shared/" + "a-long-directory-name/" * 6 + "run42"
    log = f"{deep}/attempt_0/1/stdout.log"
    snap = _snap(RankState.RUNNING, stdout_log=log)
    title = rank_title(snap, now=0.0, log_path=log, width=100).plain
    assert "  log …/a-long" in title and title.endswith("/run42/attempt_0/1/stdout.log")
    assert 100 - len("a-long-directory-name/") < cell_len(title) <= 100  # as much of it as fits
    assert rank_title(snap, now=0.0, log_path=log).plain.endswith(f"  log {log}")  # width unknown: whole
    group = FakeEngine(1).snapshot()
    header = header_text(dataclasses.replace(group, log_dir=deep), now=0.0, width=120).plain
    assert "  logs …/a-long" in header and header.endswith("/run42")
    assert 120 - len("a-long-directory-name/") < cell_len(header) <= 120
    # Room for not even the last name: that name still, which the line's own ellipsis then cuts.
    assert fit_path("/x/" + "n" * 40, 10) == "…/" + "n" * 40
    assert fit_path("/short/path", 11) == "/short/path"
    assert fit_path("no-directory-in-it", 5) == "no-directory-in-it" and fit_path("/a/bb/", 5) == "…/bb"


def test_attempt_named_as_its_directory(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, TICKER, n=1, max_restarts=2)))

    async def body(app, pilot):
        await until(pilot, lambda: "attempt_0 (2 restarts left)" in app.main.query_one("#header").render().plain,
                    what="attempt named as its directory")
        assert os.path.isdir(os.path.join(app.engine.agent.run_dir, "attempt_0"))

    drive(app, body)


# ----- in a real terminal ----------------------------------------------------------------------
TWO_STEPS = ("import os, sys, time\nr = os.environ['RANK']\nprint('hello from', r, flush=True)\n"
             "if r == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
             "    time.sleep(0.3); sys.exit(4)\n"
             "while not os.path.exists(os.environ['DONE']):\n    time.sleep(0.05)\n")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_small_terminal_ctrl_c_and_the_report_left_behind(tmp_path):
    script = tmp_path / "ticker.py"
    script.write_text(TRAP_TERM.replace("sys.exit(0)", "time.sleep(60)"))  # only SIGKILL ends it
    status = tmp_path / "status"
    command = (f"cd {ROOT} && {sys.executable} -m ranktop --tui --nproc-per-node 2 --shutdown-timeout 20 "
               f"--log-dir {tmp_path / 'logs'} {script}; echo $? > {status}; sleep 30")
    term = Terminal(command, width=80, height=24)
    try:
        term.wait_screen(" 1/1  running")
        screen = term.wait_screen("? Help")  # the footer is built once the screen's bindings settle
        footer = screen.rstrip("\n").split("\n")[-1]
        assert "q Quit" in footer and "? Help" in footer  # the essentials survive 80 columns
        term.press("C-c")
        term.wait_screen("still running")
        term.press("C-c")  # twice: kill now
        wait_for(lambda: status.exists() and status.read_text().strip(), timeout=15, what="ranktop exited")
        assert status.read_text().strip() == "130"
        run_dir = next((tmp_path / "logs").iterdir())
        wait_for(lambda: f"ticker.py stopped on request; logs in {run_dir}" in term.screen().replace("\n", ""),
                 what="the end report left in the terminal")
        assert '"signal": "SIGKILL", "by_us": true' in (run_dir / "events.jsonl").read_text()  # not the grace
    finally:
        term.close()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_earlier_attempt_failure_stays_in_sight(tmp_path):
    script = tmp_path / "two_steps.py"
    script.write_text(TWO_STEPS)
    done = tmp_path / "done"
    status = tmp_path / "status"
    command = (f"cd {ROOT} && {sys.executable} -m ranktop --tui --exit-on-end --nproc-per-node 2 --max-restarts 1 "
               f"--env DONE={done} --log-dir {tmp_path / 'logs'} {script}; echo $? > {status}; sleep 30")
    term = Terminal(command)
    try:
        term.wait_screen("attempt_1")
        term.wait_screen("earlier: attempt_0: rank 1 failed (exit 4)", "attempt_1 (0 restarts left)")
        done.write_text("")
        wait_for(lambda: status.exists() and status.read_text().strip(), timeout=15, what="ranktop exited")
        assert status.read_text().strip() == "0"
        text = term.screen().replace("\n", "")
        assert "two_steps.py succeeded: all ranks exited 0; logs in" in text
        assert "earlier attempts: attempt_0: rank 1 failed (exit 4)" in text
    finally:
        term.close()


FAILER = ("import os, sys, time\nprint('rank', os.environ['RANK'], 'up', flush=True)\n"
          "if os.environ['RANK'] == '1':\n    time.sleep(0.2)\n    raise ValueError('boom 42')\ntime.sleep(60)\n")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def _in_front(pid: int) -> bool:
    """Whether `pid`'s process group is its terminal's foreground group (/proc/PID/stat's pgrp, tpgid)."""
    from ranktop.core.guard import stat_fields

    fields = stat_fields(pid)
    return fields is not None and fields[2] == fields[5]


def test_copy_the_root_cause_through_osc52_and_open_the_log_in_a_pager(tmp_path):
    script = tmp_path / "failer.py"
    script.write_text(FAILER)
    copied = tmp_path / "copied.log"
    pager = tmp_path / "pager.sh"  # a pager that keeps what it was given, and waits (as less does)
    pager_pid = tmp_path / "pager.pid"
    pager.write_text(f"#!/bin/sh\necho $$ > {pager_pid}\ncat \"$1\" > {copied}\nsleep 30\n")
    pager.chmod(0o755)
    command = (f"cd {ROOT} && PAGER={pager} {sys.executable} -m ranktop --tui --nproc-per-node 2 "
               f"--log-dir {tmp_path / 'logs'} {script}; sleep 30")
    term = Terminal(command)
    try:
        term._tmux("set-option", "-s", "set-clipboard", "on")
        term.wait_screen("ROOT CAUSE")
        term.press("y")
        term.wait_screen("root cause copied")
        buffer = wait_for(lambda: (b := term._tmux("show-buffer")) and "boom 42" in b and b, what="tmux buffer")
        assert "root cause: rank 1" in buffer and "ValueError: boom 42" in buffer
        # The culprit's last line, selected from the keyboard. (No arrow key here: under load tmux
        # may hand its escape sequence over in two reads, a lone Esc first; Pilot tests the arrows.)
        term.press("V", "y")
        wait_for(lambda: term._tmux("show-buffer") == "ValueError: boom 42", what="the selection in tmux's buffer")
        # A mouse drag as the terminal reports it (SGR 1006: press, motion with the button held,
        # release; 1-based columns and rows) across "raise ValueError..." and the next line.
        screen = term.screen().splitlines()
        row = next(i for i, line in enumerate(screen) if "raise ValueError('boom 42')" in line)
        col = screen[row].index("raise ValueError")
        term._tmux("send-keys", "-t", "t", "-l", f"\x1b[<0;{col + 1};{row + 1}M\x1b[<32;{col + 4};{row + 2}M"
                   f"\x1b[<0;{col + 4};{row + 2}m")
        term.press("y")
        wait_for(lambda: term._tmux("show-buffer").startswith("raise ValueError('boom 42')\n"),
                 what="the dragged text in tmux's buffer")
        term.press("z")  # zoomed, the title says where the rank's log is
        term.wait_screen("attempt_0/1/stdout.log")
        term.press("o")  # the culprit is focused: its stdout log goes to the pager, then the TUI is back
        wait_for(lambda: copied.exists() and "rank 1 up" in copied.read_text(), what="the pager got the log")
        # (the pager may run before ranktop has given it the terminal: a Ctrl-C then is ranktop's)
        wait_for(lambda: _in_front(int(pager_pid.read_text())), what="the pager in the terminal's foreground")
        # Ctrl-C, the way out of less's F, reaches the pager alone: it reached ranktop too, which
        # took it for a stop (a run still going was stopped; this one, over, left the TUI).
        term.press("C-c")
        term.wait_screen("ROOT CAUSE")
        term.press("?")
        term.wait_screen("ranktop keys")
    finally:
        term.close()


def _one_rank_with_a_log(tmp_path: Path) -> tuple[FakeEngine, Path]:
    """A fake engine of one rank whose stdout.log (one line) `o` opens."""
    log = tmp_path / "stdout.log"
    log.write_text("rank 0 up\n")
    engine = FakeEngine(1)
    engine.set_rank(0, stdout_log=str(log))
    return engine, log


def test_a_pager_that_cannot_be_split_into_words_is_one_line_and_the_tui_goes_on(tmp_path, monkeypatch):
    """o split $PAGER as a shell would: PAGER='"' raised ValueError (No closing quotation), a
    traceback that ended the TUI, and the run with it."""
    engine, log = _one_rank_with_a_log(tmp_path)
    monkeypatch.setenv("PAGER", 'less "-R')

    async def body(app, pilot):
        await pilot.press("o")
        await until(pilot, lambda: "bad $PAGER" in notes(app), what="the line about $PAGER")
        assert f"""bad $PAGER 'less "-R': No closing quotation; the log: {log}""" in notes(app)
        assert app.is_running and engine.commands == []

    drive_fake(engine, body)


def test_a_pager_that_cannot_be_run_is_one_line_and_the_tui_comes_back(tmp_path, monkeypatch):
    """Found by fuzzing `o`: a $PAGER not on PATH raised inside Textual's suspend, which resumes
    the TUI only when its block ends normally: the screen stayed blank and no key was read, for
    good. (Pilot's driver is told it can suspend, to count the suspends and resumes.)"""
    from textual.drivers.headless_driver import HeadlessDriver

    engine, log = _one_rank_with_a_log(tmp_path)
    monkeypatch.setenv("PAGER", "no-such-pager-of-ranktop -R")

    async def body(app, pilot):
        await pilot.press("o")
        await until(pilot, lambda: "cannot run" in notes(app), what="the line about the pager")
        assert suspended.call_count == resumed.call_count == 1 and app.is_running
        assert notes(app) == f"cannot run 'no-such-pager-of-ranktop': No such file or directory; the log: {log}"

    with (mock.patch.object(HeadlessDriver, "can_suspend", True),
          mock.patch.object(HeadlessDriver, "suspend_application_mode") as suspended,
          mock.patch.object(HeadlessDriver, "resume_application_mode") as resumed):
        drive_fake(engine, body)


def test_copy_key_without_a_root_cause_says_so():
    async def body(app, pilot):
        await pilot.press("y")
        assert "no root cause to copy" in notes(app) and app.clipboard == ""

    drive_fake(FakeEngine(2), body)


def test_rank_list_sorts_and_filters_by_state():
    engine = FakeEngine(32)
    engine.set_rank(7, state=RankState.FAILED, exitcode=1)
    engine.set_rank(20, state=RankState.STALLED, stall_seconds=61.0)

    async def body(app, pilot):
        main = app.main
        listing = main.query_one(RankList)
        await until(pilot, lambda: listing.order[:3] == [0, 1, 2], what="rank order")
        await pilot.press("s")  # by state: the failed and the stalled first
        await until(pilot, lambda: listing.order[:2] == [7, 20], what="state order")
        assert "by state" in main.query_one("#rank-list-head", LiveText).plain
        await pilot.press("v")  # problems only
        await until(pilot, lambda: listing.order == [7, 20], what="problems only")
        await pilot.press("down")  # the arrows walk the list as shown
        assert main.current == 7
        await pilot.press("down")
        assert main.current == 20
        await pilot.press("v", "v", "s", "s", "s")  # back to every rank, by rank
        await until(pilot, lambda: len(listing.order) == 32 and listing.order[0] == 0, what="all again")

    drive_fake(engine, body)


def test_a_click_on_the_rank_list_picks_the_rank_of_its_row_with_a_long_header():
    """`32/32 by state, running  (s sort, v filter)` is wider than the list: it wrapped onto a
    second row, and every click picked the rank one row above the one clicked."""
    engine = FakeEngine(32)
    engine.set_rank(7, state=RankState.FAILED, exitcode=1)

    async def body(app, pilot):
        listing, head = app.main.query_one(RankList), app.main.query_one("#rank-list-head", LiveText)
        await pilot.press("s", "v", "v")  # by state, running only: the longest header
        await until(pilot, lambda: "by state, running" in head.plain, what="the running ranks by state")
        assert head.size.height == 1 and listing.size.height == len(listing.order)  # one row each
        # (each click's Picked may still be queued when the click returns: waited for; each click
        # moves the focus, from rank 0, where it starts, and back)
        await pilot.click("#rank-list", offset=(3, 7))  # the eighth rank's row: rank 7 failed, is not listed
        await until(pilot, lambda: app.main.current == listing.order[7] == 8, what="the eighth row's rank")
        await pilot.click("#rank-list", offset=(3, 0))  # the first rank's row
        await until(pilot, lambda: app.main.current == listing.order[0] == 0, what="the first row's rank")

    drive_fake(engine, body, size=(80, 24))


def test_search_every_rank_counts_and_steps_across_ranks():
    engine = FakeEngine(3)
    engine.print(0, "a needle", "hay", "needle again")
    engine.print(1, "only hay")
    engine.print(2, "NEEDLE in caps")

    async def body(app, pilot):
        main = app.main
        await until(pilot, lambda: main.pane(0).log.line_count == 3, what="lines in")
        await pilot.press("1", "ctrl+f")
        await type_keys(pilot, *"needle")
        await pilot.press("enter")
        assert "3 matches for 'needle' in 2 ranks: 0 (2), 2 (1)" in notes(app)
        assert main.current == 2  # rank 1 has none: the next rank that has
        await until(pilot, lambda: " 1 hit " in main.pane(2).title and " 0 hits " in main.pane(1).title
                    and " 2 hits " in main.pane(0).title, what="hit counts in the titles")
        await pilot.press("n")  # rank 2's only match: on to rank 0's first
        assert main.current == 0 and main.pane(0).log.search_query == "needle"
        await pilot.press("n")  # rank 0's second match
        assert main.current == 0
        await pilot.press("n")  # and round to rank 2
        assert main.current == 2
        await pilot.press("N")  # back: rank 0's last match
        assert main.current == 0
        await pilot.press("slash", "escape")  # an ordinary search, cancelled: the counts stay
        await pilot.press("slash")
        await type_keys(pilot, *"hay")
        await pilot.press("enter")  # a search of this rank ends the one of every rank
        await until(pilot, lambda: "hit" not in main.pane(1).title, what="counts gone")

    drive_fake(engine, body)


def test_n_and_n_say_which_match_they_are_on_and_where_they_wrap():
    """n / N with every match on screen moved only its colour: each step says which match it is
    on, a wrap round says so, and n with no search says how to start one (it did nothing; the
    palette's `Next match` too)."""
    engine = FakeEngine(2)
    engine.print(0, "a needle", "hay", "needle two", "hay", "needle three")

    async def body(app, pilot):
        main = app.main
        await until(pilot, lambda: main.pane(0).log.line_count == 5, what="lines in")
        await pilot.press("n")
        assert "no search in rank 0: / searches it, ctrl+f every rank" in notes(app)
        await pilot.press("slash")
        await type_keys(pilot, *"needle")
        await pilot.press("enter")  # on the newest, the third
        app.clear_notifications()
        await pilot.press("n")
        assert "match 1 of 3 in rank 0  (wrapped round to the oldest)" in notes(app)
        await pilot.press("n")
        assert "match 2 of 3 in rank 0" in notes(app) and "wrapped" not in notes(app).splitlines()[-1]
        await pilot.press("N", "N")
        assert notes(app).splitlines()[-1] == "match 3 of 3 in rank 0  (wrapped round to the newest)"
        app.clear_notifications()
        await pilot.press("ctrl+f")
        await type_keys(pilot, *"needle")
        await pilot.press("enter", "n")  # every rank: rank 1 has none, round to rank 0's first
        assert notes(app).splitlines()[-1] == "match 1 of 3 in rank 0"

    drive_fake(engine, body)


PROMPT = ("import sys, time\nprint('a needle', *(f'hay {i}' for i in range(30)), sep='\\n', flush=True)\n"
          "sys.stdout.write('Continue with the needle? [y/N] '); sys.stdout.flush()\ntime.sleep(3600)\n")


def test_n_and_n_step_to_a_match_in_the_unfinished_last_line_and_say_so(tmp_path):
    """A match in the rank's unfinished last line (a prompt, a progress bar) was shown by the
    search, but n / N went past it and said nothing, and where it was the only one they did not
    move there either. It is a match like any other: counted, stepped to, said."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, PROMPT, n=1)))

    async def body(app, pilot):
        log = app.main.pane(0).log
        await until(pilot, lambda: log.line_count == 32, what="the lines and the prompt")
        await pilot.press("slash")
        await type_keys(pilot, *"needle")
        await pilot.press("enter")
        assert log.match_position == (2, 2)  # the newest: the prompt
        app.clear_notifications()
        await pilot.press("N")
        assert notes(app).splitlines()[-1] == "match 1 of 2 in rank 0"
        await pilot.press("n")
        assert notes(app).splitlines()[-1] == "match 2 of 2 in rank 0"  # it went on past the complete one
        await pilot.press("n")
        assert notes(app).splitlines()[-1] == "match 1 of 2 in rank 0  (wrapped round to the oldest)"
        await pilot.press("slash")
        await type_keys(pilot, *"continue")
        await pilot.press("enter")  # its only match
        app.clear_notifications()
        await pilot.press("home")
        await until(pilot, lambda: not any("Continue" in row for row in screen_rows(app)), what="scrolled away")
        await pilot.press("n")  # n brings the prompt back into sight
        assert notes(app).splitlines()[-1] == "match 1 of 1 in rank 0  (wrapped round to the oldest)"
        await until(pilot, lambda: any("Continue with the needle?" in row for row in screen_rows(app)), what="shown")
        await pilot.press("N")
        assert notes(app).splitlines()[-1] == "match 1 of 1 in rank 0  (wrapped round to the newest)"

    drive(app, body, size=(80, 8))


def test_n_held_down_shows_one_toast_of_where_it_is():
    """Each n / N added a toast of its own: n held down through a long search piled dozens in the
    corner (over the pane's lines) for their two seconds. A step's toast takes the last one's place;
    any other toast (a question waiting for its second key) stays."""
    engine = FakeEngine(2)
    engine.print(0, *(f"needle {i}" for i in range(30)))

    async def body(app, pilot):
        main = app.main
        await until(pilot, lambda: main.pane(0).log.line_count == 30, what="lines in")
        await pilot.press("slash")
        await type_keys(pilot, *"needle")
        await pilot.press("enter")
        await pilot.press("k")  # a question, answered by a second k
        await pilot.press(*"n" * 12)
        await pilot.pause()
        shown = [str(n.message) for n in app._notifications]
        assert [m for m in shown if m.startswith("match ")] == ["match 12 of 30 in rank 0"], shown
        assert any("Press k again" in m for m in shown), shown

    drive_fake(engine, body)


def test_a_paused_wrapped_pane_keeps_its_place_when_zoomed_in_and_out():
    """A pane scrolled back, with long lines wrapped, shows the same lines after a zoom and back
    (its rows are re-wrapped at the new width: it kept the row offset, so zooming out of line 140
    showed line 68)."""
    engine = FakeEngine(4)
    engine.print(0, *[f"line {i:03d} " + "x" * 90 for i in range(300)])

    async def body(app, pilot):
        app.animation_level = "none"  # each page lands at once: each page's scroll took ~0.4 s to play
        main = app.main
        log = main.pane(0).log
        await until(pilot, lambda: log.line_count == 300, what="lines in")
        await pilot.press("w")  # wrap on: a line takes two rows in the grid, one zoomed
        await until(pilot, lambda: log.wrap and log.row_count > 500, what="lines wrapped")
        await pilot.press("home", *["pagedown"] * 6)
        paused = log.position_text
        assert paused.startswith("paused at line ") and paused != "paused at line 1"
        await pilot.press("z")
        await until(pilot, lambda: main.zoomed and log.row_count == 300, what="zoomed, one row a line")
        assert log.position_text == paused
        await pilot.press("escape")
        await until(pilot, lambda: not main.zoomed and log.row_count > 500, what="back in the grid")
        assert log.position_text == paused

    drive_fake(engine, body)


def test_a_match_far_into_a_wrapped_line_stays_in_view_through_w_a_resize_and_n():
    """With wrap on, the view took a match as shown when its line's first row was: a match near
    the end of a line wrapped onto 40 rows stayed off screen after `w`, a resize or n / N (only the
    line's first rows showed). The row holding the match comes into view, and a step to a match
    already shown does not move the view."""
    engine = FakeEngine(1)
    # At 2400 columns, a multiple of both text widths (60, then 80): the marker starts a row at
    # each width, so it reads whole on one row of the screen.
    engine.print(0, *(f"step {i}" for i in range(5)), "." * 2400 + "MARKER" + "." * 20,
                 *(f"step {i}" for i in range(6, 16)))

    async def body(app, pilot):
        def marker_shown() -> bool:
            return any("MARKER" in row for row in screen_rows(app))

        app.animation_level = "none"
        log = app.main.pane(0).log
        await until(pilot, lambda: log.line_count == 16, what="lines in")
        assert log.text_width == 60
        await pilot.press("slash")
        await type_keys(pilot, *"marker")
        await pilot.press("enter")  # unwrapped: the pane scrolls sideways to it (after a refresh)
        await until(pilot, lambda: not log.follow and marker_shown(), what="the marker scrolled to")
        await pilot.press("w")  # the line wrapped onto 41 rows, the marker on the 41st; the top line stays
        await until(pilot, lambda: log.wrap and log.row_count == 15 + 41, what="the line wrapped")
        await pilot.pause()
        assert marker_shown()
        await pilot.resize_terminal(81, 16)  # wrapped anew onto 31 rows, the marker on the 31st
        await until(pilot, lambda: log.row_count == 15 + 31, what="wrapped anew at 80")
        await pilot.pause()
        assert marker_shown()
        await pilot.press("home")
        assert not marker_shown()
        await pilot.press("n")  # its only match: n goes round to it
        assert marker_shown()
        log.scroll_to(y=log.scroll_offset.y - 3, animate=False, immediate=True)  # as the wheel: off the middle
        await pilot.pause()
        assert marker_shown()
        shown_at = log.scroll_offset.y
        await pilot.press("N", "n")  # already in view: the view stays
        assert marker_shown() and log.scroll_offset.y == shown_at

    drive_fake(engine, body, size=(61, 16))


ATTEMPTS = ("import os, sys, time\nk = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
            "print('rank', os.environ['RANK'], 'in attempt', k, flush=True)\n"
            "if k == '0' and os.environ['RANK'] == '1':\n    print('dying', file=sys.stderr, flush=True); sys.exit(5)\n"
            "time.sleep(60)\n")


def test_attempt_switcher_reads_earlier_attempts_from_the_logs(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, ATTEMPTS, max_restarts=1)))

    async def body(app, pilot):
        main = app.main
        await until(pilot, lambda: app.engine.snapshot().attempt == 1 and main.pane(1).log.line_count == 1,
                    what="attempt 1 running")
        await pilot.press("1", "left_square_bracket")
        log = main.pane(1).log
        await until(pilot, lambda: "attempt_0 (log files" in main.pane(1).title, what="viewing attempt_0")
        lines = [bytes(line) for line in log._lines]
        assert lines == [b"rank 1 in attempt 0", "──── attempt_0 stderr.log ────".encode(), b"dying"]
        await pilot.press("right_square_bracket")  # back to the live attempt
        await until(pilot, lambda: "following" in main.pane(1).title and log.line_count == 1, what="live again")
        assert [bytes(line) for line in log._lines] == [b"rank 1 in attempt 1"]

    drive(app, body)


BARS = ("import os, sys, time\nk = os.environ['TORCHELASTIC_RESTART_COUNT']\nprint('attempt', k, flush=True)\n"
        "sys.stderr.write('epoch 1 |#.| 1/2\\repoch 1 |##| 2/2\\n'); sys.stderr.flush()\n"
        "if k == '0':\n    sys.exit(5)\n"
        "time.sleep(60)\n")


def test_an_earlier_attempts_progress_bar_shows_its_last_state_as_the_live_pane_does(tmp_path):
    """`[` reads an attempt's stderr.log back: a bar redrawn with '\\r' shows its last state (every
    redraw showed, in one row, each after a `␍`)."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, BARS, n=1, max_restarts=1)))

    async def body(app, pilot):
        main = app.main
        log = main.pane(0).log
        await until(pilot, lambda: [bytes(line) for line in log._lines] == [b"attempt 1", b"epoch 1 |##| 2/2"],
                    what="attempt 1's lines in the live pane, its bar as its last state")
        await pilot.press("left_square_bracket")
        await until(pilot, lambda: "attempt_0 (log files" in main.pane(0).title, what="viewing attempt_0")
        assert [bytes(line) for line in log._lines] == [
            b"attempt 0", "──── attempt_0 stderr.log ────".encode(), b"epoch 1 |##| 2/2"]
        assert log.row_text(2) == "epoch 1 |##| 2/2"  # (drawn as `epoch 1 |#.| 1/2␍epoch 1 |##| 2/2`)

    drive(app, body)


def test_regular_expression_searches_and_a_bad_one():
    engine = FakeEngine(2)
    engine.print(0, "step 1 loss 0.5", "step 2 loss nan", "eval")
    engine.print(1, "step 1 loss 0.4")

    async def body(app, pilot):
        main = app.main
        await until(pilot, lambda: main.pane(0).log.line_count == 3, what="lines in")
        await search_for(pilot, "ctrl+f", "re:loss [0-9.]+$")
        assert "2 matches for 're:loss [0-9.]+$' in 2 ranks: 0 (1), 1 (1)" in notes(app)
        await search_for(pilot, "slash", "re:LOSS (nan|inf)")  # any case
        assert "1 match for 're:LOSS (nan|inf)' in rank 0" in notes(app)
        await search_for(pilot, "slash", "re:loss [")
        assert "bad regular expression 'loss [': unterminated character set" in notes(app)
        await search_for(pilot, "slash", "re:a{99999999999}")  # OverflowError in re: the app died
        assert "bad regular expression 'a{99999999999}': too large or too deeply nested" in notes(app)

    drive_fake(engine, body)


@pytest.mark.timeout(20)  # (without the time limit the first search never came back)
def test_a_pattern_that_backtracks_without_end_is_given_up_and_said_once():
    """`re:(a*)*b` on a line of 5,000 `a`s never ended in re, which held the GIL: the TUI froze,
    and in a TUI run the engine's output thread too (the ranks blocked on full pipes). The regex
    package reads it at once; `(a+)+b` backtracks there as well, and its match is given up after
    250 ms: the pattern matches nothing from there on (a search, new lines, the highlighting), the
    screen says so once, and the keys work."""
    engine = FakeEngine(3)
    engine.print(0, "aab", "a" * 5000, "ab")
    stopped = "the pattern 're:(a+)+b' took over 250 ms on one line of rank 0: stopped (no more matches counted)"

    async def body(app, pilot):
        main = app.main
        await until(pilot, lambda: main.pane(0).log.line_count == 3, what="lines in")
        await search_for(pilot, "slash", "re:(a*)*b")
        assert "2 matches for 're:(a*)*b' in rank 0" in notes(app)
        await search_for(pilot, "slash", "re:(a+)+b")
        await until(pilot, lambda: stopped in notes(app), timeout=5, what="the note on the pattern given up")
        assert "1 match for 're:(a+)+b' in rank 0" in notes(app)  # (the line before it)
        engine.print(0, "aaab")  # a new line: not matched, and nothing more said
        await pilot.press("2")
        await until(pilot, lambda: main.current == 2, timeout=5, what="the key after it")
        await until(pilot, lambda: main.pane(0).log.line_count == 4, what="the new line in")
        assert main.pane(0).log._matches() == [main.pane(0).log._first]  # "aab" only
        said = [n for n in app._notifications if stopped in str(n.message)]
        await pilot.press("ctrl+f")  # every rank: given up in rank 0, the ranks after it not searched
        await type_keys(pilot, *"re:(a+)+b")
        await pilot.press("enter")
        # (the same words again: one toast, the new one, in place of the first)
        again = await until(pilot, lambda: [n for n in app._notifications if stopped in str(n.message) and n not in said],
                            timeout=5, what="the note again, for the new search")
        assert "1 match for 're:(a+)+b' in 1 rank: 0 (1)" in notes(app)
        await pilot.pause(0.2)
        # once, though rank 0's pane met the line again (a third saying would have replaced it)
        assert [n for n in app._notifications if stopped in str(n.message)] == again

    drive_fake(engine, body)


def test_a_pattern_slow_on_every_line_is_given_up_once_its_slow_matches_add_up():
    """A pattern slow on each line but never past the time limit on one (`(.* ){8}\\d{9}` takes
    ~0.1 s a training log line) was never given up: a search over a ring of 10,000 lines froze the
    TUI for minutes. Matches slower than `slow_match` add up, and past `slow_budget` the pattern is
    given up as a timeout gives it up (the thresholds set to 0 here: every match counts, and the
    first spends the budget)."""
    from ranktop.tui.bounded_regex import BoundedPattern, stopped_line
    from ranktop.tui.usage import compiled_regex

    pattern = BoundedPattern.compile("lo+ss")
    pattern.slow_match = pattern.slow_budget = 0.0
    assert pattern.search("a loss").group() == "loss"  # (the match that spent the budget is kept)
    assert pattern.stopped and pattern.search("a loss") is None and list(pattern.finditer("a loss")) == []
    assert stopped_line("the pattern 're:lo+ss'", pattern, 3, "no more matches counted") == (
        "the pattern 're:lo+ss' took over 0 s within 10 s on lines of rank 3: stopped (no more matches counted)")
    fresh = BoundedPattern.compile("lo+ss")  # the real thresholds: a quick match counts for nothing
    assert [m.group() for m in fresh.finditer("loss, looss")] == ["loss", "looss"] and not fresh.stopped
    assert compiled_regex("lo+ss") is compiled_regex("lo+ss")  # one object a text: n / N reuse it


def test_v_selects_lines_beyond_the_screen_and_y_copies_them_as_shown():
    engine = FakeEngine(2)
    engine.print(0, *[f"line {i}" for i in range(100)], "bell\x07 and \x1b]52;c;evil\x07 gone", "last")

    async def body(app, pilot):
        main = app.main
        await until(pilot, lambda: main.pane(0).log.line_count == 102, what="the lines in rank 0's pane")
        await pilot.press("slash", "V")  # in the search box V is a letter, not a selection
        await until(pilot, lambda: main.query_one("#search").value == "V", what="V typed into the search")
        assert not main.selections
        await pilot.press("escape")
        await pilot.press("V")
        await until(pilot, lambda: bool(main.selections), what="the bottom line selected")
        await type_keys(pilot, *["up"] * 60)  # past the top of the pane: the view follows the selection
        log = main.pane(0).log
        marked = main.get_component_rich_style("screen--selection", partial=True).bgcolor
        shown = log.render_line(41 - round(log.scroll_offset.y))  # the selection's first row, in view
        assert any(seg.style and seg.style.bgcolor == marked for seg in shown)  # drawn as selected
        await pilot.press("y")
        await until(pilot, lambda: "copied" in notes(app), what="the copy said")
        assert not main.selections  # copying ends the selection

    app = drive_fake(engine, body)
    copied = app.clipboard.split("\n")
    assert copied[0] == "line 41" and copied[-2] == "bell␇ and  gone" and copied[-1] == "last"
    assert len(copied) == 61 and "\x1b" not in app.clipboard and "\x07" not in app.clipboard


def test_a_mouse_drag_selects_text_in_a_pane_and_y_copies_it():
    engine = FakeEngine(2)
    engine.print(1, "alpha beta gamma", "delta epsilon")

    async def body(app, pilot):
        main = app.main
        log = main.pane(1).log
        await until(pilot, lambda: log.line_count == 2, what="rank 1's lines")
        first = log.row_count - 2 - round(log.scroll_offset.y)  # the screen row of "alpha..."
        await pilot.mouse_down(log, offset=(6, first))
        await pilot.hover(log, offset=(4, first + 1))
        await pilot.mouse_up(log, offset=(4, first + 1))  # the cell under the pointer is in
        await until(pilot, lambda: bool(main.selections), what="a selection")
        await pilot.press("y")
        await until(pilot, lambda: "copied" in notes(app), what="the copy said")

    app = drive_fake(engine, body)
    assert app.clipboard == "beta gamma\ndelta"


def test_a_copy_is_what_the_pane_highlights_over_wide_characters_and_line_separators():
    """Found by fuzzing selections over hostile output. The selection counts characters and the
    pane cuts rows by cells: over `日本語` the highlight was the wrong characters, and scrolled
    sideways past a wide character the mouse started the selection characters away from the one
    under it. The copy split its rows with str.splitlines, which also breaks at U+2028 / U+2029:
    the rows after one came out shifted and cut. A drag let go below the last row cut that row
    at the column let go at, where the highlight took it whole. A row that rich counts a cell
    shorter than its strip (a zero-width joiner before a wide character, at the pane's edge)
    ended the TUI once selected (ValueError: not enough values to unpack). (Where the C library
    counts U+2028 and U+2029 as no printable character, the pane shows them as `�`: see
    cells.agreed_widths; and it drops the joiner.)"""
    from ranktop.tui.cells import agreed_widths
    from rich.cells import cell_len

    engine = FakeEngine(1)
    engine.print(0, "日本語テキスト abc def", "a\u2028b\u2029c second", "third line")

    async def drag(pilot, log, start: tuple[int, int], end: tuple[int, int]) -> None:
        await pilot.mouse_down(log, offset=start)
        await pilot.hover(log, offset=end)
        await pilot.mouse_up(log, offset=end)

    async def copied(app, pilot) -> str:
        await until(pilot, lambda: bool(app.main.selections), what="a selection")
        await pilot.press("y")
        await until(pilot, lambda: not app.main.selections, what="the copy")
        return app.clipboard

    async def body(app, pilot):
        log = app.main.pane(0).log
        await until(pilot, lambda: log.line_count == 3, what="rank 0's lines")
        top = log.row_count - 3 - round(log.scroll_offset.y)  # the screen row of the first line
        marked = app.main.get_component_rich_style("screen--selection", partial=True).bgcolor
        await drag(pilot, log, (4, top), (7, top))  # cells 4-7: 語 and テ
        await until(pilot, lambda: bool(app.main.selections), what="a selection")
        lit = "".join(s.text for s in log.render_line(top) if s.style and s.style.bgcolor == marked)
        assert (lit, await copied(app, pilot)) == ("語テキ", "語テキ")  # it lit 本語
        await drag(pilot, log, (0, top + 1), (3, top + 2))
        assert await copied(app, pilot) == agreed_widths("a\u2028b\u2029c second") + "\nthir"  # was 'a\nb'
        second = cell_len(agreed_widths("a\u2028b\u2029c "))  # (the cell `second` starts at)
        await drag(pilot, log, (second, top + 1), (3, top + 5))  # let go below the last row
        assert await copied(app, pilot) == "second\nthird line"  # was 'second\nthi'
        width = log.text_width
        engine.print(0, "x" * (width - 2) + "\u200dテキスト", "一二三四五六七八九十" * 8)
        await until(pilot, lambda: log.line_count == 5, what="two more lines")
        await pilot.press("V", "up", "y")  # the joiner's row selected: it ended the TUI
        assert app.clipboard.startswith("xxx") and app.clipboard.endswith("九十")
        log.scroll_to(x=5, animate=False)  # the last row from its 6th cell, the right half of 三
        await pilot.pause()
        last = log.row_count - 1 - round(log.scroll_offset.y)
        await drag(pilot, log, (1, last), (3, last))  # the row's cells 6-8: 四 and 五
        assert await copied(app, pilot) == "四五"  # it took the 6th character on: 七八

    drive_fake(engine, body, size=(80, 20))


def test_a_row_scrolled_past_an_emoji_sequence_shows_and_highlights_what_a_copy_takes():
    """Found by fuzzing selections: rich's crop splits a row character by character, so it cut
    👨‍👩‍👧 (one cluster of two cells) after 👨. A coloured row scrolled sideways past it showed its
    text a cell off, and a selection lit other cells than the ones it copies (`loss 0.123␈l` where
    the copy took `oss 0.123␈loss`). Rows are cut between whole clusters now. (The pane drops the
    joiners now, cells.agreed_widths: the family shows as its three emoji, two cells each, and is
    copied so.)"""
    engine = FakeEngine(1)
    line = "👨\u200d👩\u200d👧loss 0.123\x08loss 0.123 end " + "x" * 100
    engine.print(0, f"\x1b[32m{line}\x1b[0m", "second line")

    async def body(app, pilot):
        log = app.main.pane(0).log
        await until(pilot, lambda: log.line_count == 2, what="rank 0's lines")
        log.scroll_to(x=6, animate=False)  # the family is cells 0-5: the row from its first `l`
        await pilot.pause()
        row = log.row_count - 2 - round(log.scroll_offset.y)
        cells = list(log.render_line(row))[:-1]  # (not the scrollbar's column)
        shown = "".join(s.text for s in cells)
        assert shown.startswith("‹oss 0.123␈loss 0.123 end xxx")  # (the cut mark over the `l`)
        assert (len(shown), shown[-1]) == (log.text_width, "›")  # it took the 👩‍👧 for two more cells
        await pilot.press("V", "up")  # both lines selected, the emoji's row whole
        await until(pilot, lambda: bool(app.main.selections), what="a selection")
        marked = app.main.get_component_rich_style("screen--selection", partial=True).bgcolor
        lit = "".join(s.text for s in log.render_line(row) if s.style and s.style.bgcolor == marked)
        assert lit == shown  # every cell of the row, none past it
        await pilot.press("y")
        await until(pilot, lambda: not app.main.selections, what="the copy")
        assert app.clipboard == line.replace("\x08", "␈").replace("\u200d", "") + "\nsecond line"

    drive_fake(engine, body, size=(80, 20))


def test_a_copy_of_long_wrapped_lines_parses_each_line_once():
    """Found by fuzzing selections: a copy took each selected row's text by parsing its whole line
    and cutting it into rows again, so a wrapped line of 10,000 characters (125 rows at 80 columns)
    was parsed 125 times: a triple click and `y` over a few such lines froze the TUI for seconds.
    Each line is parsed once now. And a copy is the lines as the rank wrote them: it had a line
    break at each row's end, where the pane wrapped them, from a drag within a line too."""
    from ranktop.tui import logview
    from textual.geometry import Offset
    from textual.selection import Selection

    engine = FakeEngine(1)
    lines = [f"{i}" + "日本語 text " * 1000 for i in range(3)]
    engine.print(0, *lines)

    async def body(app, pilot):
        log = app.main.pane(0).log
        await until(pilot, lambda: log.line_count == 3, what="rank 0's lines")
        await pilot.press("w")
        await until(pilot, lambda: log.row_count > 300, what="the lines wrapped")
        log.select_rows(0, log.row_count - 1)
        with mock.patch.object(logview, "parse_line", wraps=logview.parse_line) as parse:
            text = app.main.get_selected_text()
        assert parse.call_count == 3 and text == "\n".join(lines)  # (was a break every 80 cells or so)
        first = len(log.row_text(0))  # a drag from the 3rd character of line 0's first row to its third row's 4th
        app.main.selections = {log: Selection(Offset(2, 0), Offset(4, 2))}
        assert app.main.get_selected_text() == lines[0][2 : first + len(log.row_text(1)) + 4]

    drive_fake(engine, body, size=(80, 20))


def test_a_group_restart_drops_a_selection_of_the_old_attempts_lines():
    import dataclasses

    engine = FakeEngine(2)
    engine.print(0, *[f"old {i}" for i in range(5)])

    async def body(app, pilot):
        main = app.main
        await until(pilot, lambda: main.pane(0).log.line_count == 5, what="rank 0's lines")
        await pilot.press("V", "up")
        await until(pilot, lambda: bool(main.selections), what="a selection")
        with engine._lock:  # the group restarts: new rings, new line numbers
            engine.group = dataclasses.replace(engine.group, generation=1)
            engine.lines[0] = [b"new 0"]
        await until(pilot, lambda: not main.selections, what="the selection dropped with the old ring")
        await pilot.press("y")  # nothing selected any more: y is the root cause key again
        await until(pilot, lambda: "no root cause to copy" in notes(app), what="y back to its own job")

    drive_fake(engine, body)


async def _open_stack_view(app, pilot) -> None:
    """`d` once rank 0 has printed, and the stack view with its report."""
    await until(pilot, lambda: app.main.pane(0).log.line_count, what="the rank up")
    await pilot.press("d")
    await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None,
                what="stack report")


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_the_stack_views_call_tree_scrolls_sideways_and_its_help_lists_its_keys(tmp_path):
    """At 80 columns the tree cut every long frame, and → and ctrl+PgDn did nothing: the focus
    starts on the groups, which do not scroll sideways. `?` there listed four keys, below every
    key of the grid; the palette offered the grid's actions, which acted unseen below it."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, DEEP, n=1)))

    async def body(app, pilot):
        await _open_stack_view(app, pilot)
        tree = app.screen.query_one(CallTree)
        await until(pilot, lambda: tree.max_scroll_x > 0, what="a tree wider than its box")
        assert app.focused is app.screen.query_one(StackGroups)  # where the focus starts: lines that wrap
        await pilot.press("right", "right")  # the groups' own sideways keys skip: the tree's
        assert tree.scroll_x == 2
        await pilot.press("ctrl+pagedown")
        assert tree.scroll_x > 2 + tree.scrollable_content_region.width // 2
        sideways = tree.scroll_x
        await pilot.press("tab")
        assert app.focused is tree
        await pilot.press("down", "end")  # the cursor moves down: the sideways offset stays
        assert tree.cursor_line == tree.last_line and tree.scroll_x == sideways
        await pilot.press("ctrl+pageup", "left")
        assert tree.scroll_x < sideways
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        shown = [row.strip() for row in screen_rows(app)]
        first = next(i for i, row in enumerate(shown) if "ranktop keys" in row)
        assert "Stack view (d / D)" in shown[first + 2]  # its own keys first, not the grid's
        groups = app.screen.groups  # (title, [(keys, description)]) as the help shows them
        assert [title for title, _ in groups[:3]] == ["Stack view (d / D)", "Call tree (tab)", "Rank groups"]
        listed = {description: keys for _, rows in groups[:3] for keys, description in rows}
        view = app.screen_stack[-2]
        keys = {key for shown in listed.values() for key in shown.split(" / ")}
        for node in (tree, view.query_one(StackGroups), view):  # every key that works there is listed
            for binding in declared_bindings(node):
                if binding.action != "screen.copy_text":  # (Textual's ctrl+c: the app's, listed below)
                    assert app.get_key_display(binding) in keys, binding
        assert listed["Scroll the call tree sideways"] == "← / →"
        assert listed["A page sideways in the call tree"] == "^pgup / ^pgdn"
        await pilot.press("escape")
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {"Other threads", "Dump again"} <= titles and "Zoom" not in titles  # the grid's acted unseen
        await pilot.press("ctrl+p")
        await type_keys(pilot, *"other threads")
        await until(pilot, lambda: palette_top(app).startswith("Other threads"), what="the palette's entry")
        await pilot.press("enter")
        await until(pilot, lambda: app.screen_stack[-1].show_threads, what="the other threads shown")
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main, what="back on the grid")
        assert not app.main.zoomed

    drive(app, body, size=(80, 24))


def test_arrows_move_only_among_the_ranks_the_filtered_list_shows(tmp_path):
    """With the problems filter the list showed `0/8 … problems`, yet ↑/↓ moved the focus (and
    the pane) to ranks it did not show; now they walk the ranks it shows, and with none do nothing."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, n=8)))

    async def body(app, pilot):
        main, listing = app.main, app.main.query_one(RankList)
        head = main.query_one("#rank-list-head", LiveText)
        assert main.compact  # 8 panes do not fit 80x24
        await pilot.press("s", "v")  # by state, problems only: every rank runs
        await until(pilot, lambda: head.plain.startswith(" 0/8 by state, problems"), what="an empty list")
        await pilot.press("down", "down", "right", "up", "left")
        assert main.current == 0 and main.pane(0).display and not main.pane(2).display
        await pilot.press("5", "x", "7")  # SIGSTOP to rank 5: paused, a problem
        await until(pilot, lambda: listing.order == [5], what="the paused rank listed alone")
        await pilot.press("0", "down")  # from a rank the list hides: onto the one it shows
        assert main.current == 5
        await pilot.press("down", "up", "right", "left")  # the only one: nowhere else to go
        assert main.current == 5
        await pilot.press("x", "8")  # SIGCONT: no problem left
        await until(pilot, lambda: head.plain.startswith(" 0/8 "), what="the list empty again")
        await pilot.press("up", "up")
        assert main.current == 5

    drive(app, body, size=(80, 24))


def test_sort_and_filter_say_where_the_rank_list_shows_when_it_is_not_on_screen(tmp_path):
    """`s` and `v` where the list was not shown said `zoom out or enlarge to see it`: a larger
    terminal fits the panes and so hides the list, and zoomed in the compact layout they said
    nothing, the list hidden by the zoom."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, n=8)))

    async def body(app, pilot):
        main = app.main
        assert main.compact  # 8 panes do not fit 80x24: the list is shown
        await pilot.press("s")
        await until(pilot, lambda: "rank list sorted by state" in notes(app), what="the sort's note")
        assert notes(app).endswith("rank list sorted by state")  # on screen: nothing to add
        await pilot.press("z", "v")
        await until(pilot, lambda: "with a problem" in notes(app), what="the filter's note")
        assert notes(app).endswith("rank list shows ranks with a problem (zoomed: esc shows the list)")
        await pilot.press("escape")
        await pilot.resize_terminal(160, 48)  # 8 panes fit: a grid, no list
        await until(pilot, lambda: not main.compact, what="the grid")
        await pilot.press("s")
        await until(pilot, lambda: "sorted by cpu" in notes(app), what="the sort's note")
        assert notes(app).endswith("rank list sorted by cpu (the list shows only where the panes do not fit)")
        assert "enlarge" not in notes(app)

    drive(app, body, size=(80, 24))


DEEP_FAILURE = ("import os, time\nfrom ranktop.core.errors import record\n"
                "def deeper(n):\n    if n == 0:\n        raise RuntimeError('rank 2 broke')\n    deeper(n - 1)\n"
                "@record\ndef main():\n    print('rank', os.environ['RANK'], 'up', flush=True)\n"
                "    if os.environ['RANK'] == '2':\n        time.sleep(0.3)\n        deeper(8)\n"
                "    time.sleep(60)\nmain()\n")


def test_the_end_report_scrolls_from_the_keyboard_and_its_keys_are_in_the_help(tmp_path):
    """At 80x24 the end report is cut (4 lines of a traceback showed) and only the mouse wheel
    scrolled it. E gives it the focus (its title says its keys), its keys scroll it, esc goes back."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, DEEP_FAILURE, n=4)))
    app.animation_level = "none"  # end and page scrolls land at once (each took ~1 s to play)

    async def body(app, pilot):
        panel = app.main.query_one(RootCausePanel)
        await until(pilot, lambda: app.main.ended and panel.max_scroll_y > 0, what="a failed run's end report, cut")
        await until(pilot, lambda: panel.border_title == "E: scroll", what="its title saying how to scroll it")
        culprit = app.main.current
        await pilot.press("E")
        await until(pilot, lambda: app.focused is panel, what="the end report focused")
        assert "esc: back" in panel.border_title
        await pilot.press("end")
        assert panel.scroll_y == panel.max_scroll_y
        await pilot.press("up")  # the report's, not the grid's (which moves between ranks)
        assert panel.scroll_y == panel.max_scroll_y - 1 and app.main.current == culprit
        await pilot.press("pageup", "home")
        assert panel.scroll_y == 0
        await pilot.press("down")
        assert panel.scroll_y == 1
        await pilot.press("escape")
        assert app.focused is app.main.pane(culprit).log and panel.border_title == "E: scroll"
        await pilot.press("up")  # the grid's again
        assert app.main.current == culprit - 2 and panel.scroll_y == 1
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        (rows,) = [rows for title, rows in app.screen.groups if title.startswith("End report")]
        keys = {key for shown, _ in rows for key in shown.split(" / ")}
        for binding in declared_bindings(panel):
            if action_name(binding.action) not in SIDEWAYS:
                assert app.get_key_display(binding) in keys, binding

    drive(app, body, size=(80, 24))


@pytest.mark.parametrize("opener", ["x", "m", "q"])
def test_question_mark_in_a_dialog_lists_that_dialogs_keys_first(tmp_path, opener):
    """? did nothing in the signal picker, the rank details and the quit question: a dialog
    hides the app's keys. Now each has its own, which lists its keys (and its widgets') first."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path)))
    dialogs = {"x": SignalPicker, "m": RankDetails, "q": ConfirmQuit}

    async def body(app, pilot):
        await pilot.press(opener)
        dialog = await until(pilot, lambda: isinstance(app.screen, dialogs[opener]) and app.screen, what="the dialog")
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help over the dialog")
        own = dialog.key_sections()
        assert [title for title, _ in app.screen.groups[:len(own)]] == [title for title, _, _ in own]
        listed = {key for _, rows in app.screen.groups[:len(own)] for shown, _ in rows for key in shown.split(" / ")}
        listed |= {str(d) for key in listed if re.fullmatch(r"\d-\d", key) for d in range(int(key[0]), int(key[2]) + 1)}
        focused = type(dialog.focused) if dialog.focused is not None else None
        for title, node, hidden in own:  # every key of the dialog, and of what has the focus in it
            for binding in declared_bindings(node):
                if action_name(binding.action) not in hidden:
                    assert app.get_key_display(binding) in listed, (title, binding)
        assert focused is None or any(type(node) is focused for _, node, _ in own)
        assert {"?", "esc"} <= listed
        await pilot.press("escape")  # the help goes: the dialog is still there, and works
        await until(pilot, lambda: app.screen is dialog, what="back in the dialog")
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main, what="the dialog closed")
        assert all(r.state.alive for r in app.engine.snapshot().ranks)

    drive(app, body, size=(80, 24))


IGNORES_TERM = TRAP_TERM.replace("sys.exit(0)", "time.sleep(60)")  # only SIGKILL ends it


@pytest.mark.parametrize("keys", [("q", "y"), ("K", "K")], ids=["q-then-stop", "K-twice"])
def test_a_graceful_stop_counts_down_to_its_sigkill(tmp_path, keys):
    """`stopping… (q again: kill now)` gave no sign, for the whole grace, of when the SIGKILL
    would come. The header counts the seconds down, from the engine's kill deadline."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, IGNORES_TERM, shutdown_timeout=20.0)))
    header = None

    def countdown() -> int | None:
        found = re.search(r"SIGKILL in (\d+)s", header.plain)
        return None if found is None else int(found[1])

    async def body(app, pilot):
        nonlocal header
        header = app.main.query_one(GroupHeader)
        await until(pilot, lambda: all(b"up" in b"".join(app.engine.agent.output(r)) for r in (0, 1)), what="ranks up")
        assert countdown() is None
        await pilot.press(*keys)
        first = await until(pilot, countdown, what="the countdown")
        assert first <= 20 and ("q again: kill now" in header.plain) == (keys[0] == "q")
        snap = app.engine.snapshot()
        assert all(snap.taken_at < r.kill_at <= snap.taken_at + 20 for r in snap.ranks)
        await until(pilot, lambda: (left := countdown()) is not None and left < first, what="the countdown going down")
        app.engine.submit(cmd.KillGroup())
        await until(pilot, lambda: app.engine.snapshot().ended, what="ranks killed")
        assert all(r.kill_at is None for r in app.engine.snapshot().ranks)
        if keys[0] == "K":  # (q's stop leaves the TUI at the end; K's stays on the final view)
            await until(pilot, lambda: app.main.ended and countdown() is None, what="no countdown at the end")

    drive(app, body)


def test_the_header_counts_down_to_the_soonest_and_the_last_sigkill_where_they_differ(tmp_path):
    """Rank 1 restarted (its SIGKILL due at the end of its grace), then the group stopped: the
    header said `SIGKILL in 17s`, rank 1's deadline, as if the whole group's; rank 0's came 3 s
    later. Where the deadlines differ it says both ends, `SIGKILL in 17-20s`."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, IGNORES_TERM, shutdown_timeout=20.0)))

    async def body(app, pilot):
        header = app.main.query_one(GroupHeader)

        def countdown() -> tuple[int, int] | None:
            found = re.search(r"SIGKILL in (\d+)(?:-(\d+))?s", header.plain)
            return None if found is None else (int(found[1]), int(found[2] or found[1]))

        await until(pilot, lambda: all(b"up" in b"".join(app.engine.agent.output(r)) for r in (0, 1)), what="ranks up")
        assert app.engine.submit(cmd.RestartRank(1)).ok
        await until(pilot, lambda: "rank 1 SIGKILL in" in header.plain, what="rank 1's countdown")
        await until(pilot, lambda: (left := countdown()) is not None and left[0] <= 18, what="2 s of rank 1's grace gone")
        assert app.engine.submit(cmd.Stop(signal.SIGTERM)).ok  # rank 0's grace starts now: 20 s
        soonest, last = await until(pilot, lambda: (left := countdown()) and left[0] < left[1] and left, what="both")
        snap = app.engine.snapshot()
        apart = snap.ranks[0].kill_at - snap.ranks[1].kill_at  # each end rounded up: 2.3 s apart reads 2 or 3
        assert math.floor(apart) <= last - soonest <= math.ceil(apart) and last <= 20
        assert f"SIGKILL in {soonest}-{last}s" in header.plain and "rank" not in header.plain.split("SIGKILL")[0][-8:]
        app.engine.submit(cmd.KillGroup())
        await until(pilot, lambda: app.engine.snapshot().ended, what="ranks killed")

    drive(app, body)


def test_a_rank_whose_end_is_held_as_maybe_a_stop_from_outside_says_so(tmp_path, monkeypatch):
    """A rank that dies of a SIGTERM ranktop did not send is held a second as maybe the first
    sign of a stop of the whole job (Slurm, systemd signal every process at once): its pane said
    `failed SIGTERM`, in red, for that second, and then `killed SIGTERM` once the stop came. It
    says `ended SIGTERM`, as a stopping rank is drawn, until the engine knows which it is."""
    monkeypatch.setattr("ranktop.core.agent.OUTSIDE_STOP_WINDOW", 60.0)  # (the window held open: no race)
    dies = ("import os, signal, time\nprint('up', flush=True)\n"
            "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(60)\n")
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, dies)))

    async def body(app, pilot):
        await until(pilot, lambda: "ended SIGTERM" in app.main.pane(1).title, what="rank 1's held end")
        held = app.engine.snapshot().ranks[1]
        assert held.state == RankState.FAILED and held.end_held  # (the engine's state: not yet judged)
        assert state_label(held) == "ended SIGTERM" and state_style(held) == STATE_STYLE[RankState.STOPPING]
        assert "failed" not in app.main.pane(1).title
        assert app.engine.submit(cmd.Stop(signal.SIGTERM)).ok  # the stop from outside reaches ranktop
        await until(pilot, lambda: app.engine.snapshot().ended, what="the group stopped")
        await until(pilot, lambda: "killed SIGTERM" in app.main.pane(1).title, what="rank 1 part of the stop")
        assert not app.engine.snapshot().ranks[1].end_held

    drive(app, body)


THREADED = ("import threading, time\n"
            "threading.Thread(target=lambda: time.sleep(3600), name='helper', daemon=True).start()\n"
            "print('up', flush=True)\ntime.sleep(3600)\n")


def offered(app) -> dict[str, str]:
    """What the stack view's help and its palette both offer for t and n: {key: description}."""
    (_, rows), *_ = help_groups(app, app.screen.key_sections())
    helped = {keys: description for keys, description in rows if keys in ("t", "n")}
    titles = {c.title for c in app.get_system_commands(app.screen)}
    assert set(helped.values()) <= titles and not {"Main threads", "Other threads", "C frames",
                                                    "Python frames"} - set(helped.values()) & titles, titles
    return helped


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_the_stack_view_says_which_threads_it_shows(tmp_path):
    """The footer always read `t Other threads`, whichever was shown; only the contents told.
    Now the groups' title says which threads they are, and the footer what t shows instead."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, THREADED, n=1)))

    async def body(app, pilot):
        await _open_stack_view(app, pilot)
        groups = app.screen.query_one(StackGroups)

        def footer() -> str:
            return screen_rows(app)[-1]

        assert groups.border_title.startswith("main threads") and "t Other threads" in footer()
        assert offered(app) == {"t": "Other threads", "n": "C frames"}
        await pilot.press("t")
        await until(pilot, lambda: "t Main threads" in footer(), what="the footer's t for the main threads")
        assert groups.border_title.startswith("other threads") and app.screen.show_threads
        assert "thread 'helper'" in str(groups.children[0].border_title)
        # The help and the palette said `t Other threads` whatever was shown (and `n Python
        # frames` before any C frame was): they offer what the key does now, as the footer does.
        assert offered(app) == {"t": "Main threads", "n": "C frames"}
        await pilot.press("t")
        await until(pilot, lambda: "t Other threads" in footer(), what="back to the main threads")
        assert groups.border_title.startswith("main threads") and not app.screen.show_threads

    drive(app, body, size=(80, 24))


def test_the_stack_view_at_80x24_says_why_ranks_were_not_dumped_once_and_that_nothing_was_saved(tmp_path):
    """Four native ranks were four `rank N (pid P): native` entries, each with its own gdb hint, the
    last ones cut off at 80x24; the tree's title read `call tree — ranks `; and a dump that could
    not be saved (its run directory deleted) showed no word of it."""
    agent = make_agent(tmp_path, n=4, entrypoint="/bin/sleep", args=("3600",), stall_timeout=60.0)
    app = RanktopApp(LocalEngine(agent))

    async def body(app, pilot):
        shutil.rmtree(agent.run_dir)
        await pilot.press("D")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None,
                    what="stack report")
        pids = ", ".join(str(r.pid) for r in app.engine.snapshot().ranks)

        def shown() -> str:  # the screen's text, its wrapped lines joined
            return re.sub(r"\s+", " ", " ".join(row.strip(" │╭╮╰╯─") for row in screen_rows(app)))

        await until(pilot, lambda: "not saved in" in shown(), what="the save's failure shown")
        rows = shown()
        assert f"ranks 0-3 (pids {pids}): native: native binary rank" in rows
        assert rows.count("gdb -p <pid> -batch") == 1 and "No such file or directory" in rows
        assert "call tree (n: C frames)" in rows and "no ranks" in rows

    drive(app, body, size=(80, 24))


IN_PAUSE = "import ctypes\nprint('up', flush=True)\nctypes.CDLL(None).pause()\n"


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_n_in_the_stack_view_dumps_again_with_the_c_frames_and_back(tmp_path):
    """The view showed Python frames only: a rank waiting in a C call (gloo, a C library)
    showed the Python line that entered it, never where it waited."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, IN_PAUSE, n=1)))

    def labels(app) -> list[str]:
        tree, out = app.screen.query_one(CallTree), []
        nodes = [tree.root]
        while nodes:
            node = nodes.pop()
            out.append(str(node.label))
            nodes.extend(node.children)
        return out

    async def body(app, pilot):
        await _open_stack_view(app, pilot)
        screen = app.screen
        await until(pilot, lambda: any("<module>" in label for label in labels(app)), what="rank 0 in pause()")
        tree = screen.query_one(CallTree)
        assert not screen.report.native_frames and tree.border_title == "call tree (n: C frames)"
        python_only = screen.report
        await pilot.press("n")
        await until(pilot, lambda: screen.report is not python_only, what="the dump with C frames")
        assert screen.report.native_frames and tree.border_title == "call tree (n: Python only)"
        # on the tree's border, whole at 80 columns (the root's label read `(n: Python onl`)
        assert any("call tree (n: Python only)" in row for row in screen_rows(app)), screen_rows(app)
        assert any("pause (libc" in label for label in labels(app)), labels(app)
        assert "with C frames" in screen_rows(app)[0]
        native = screen.report
        await pilot.press("n")
        await until(pilot, lambda: screen.report is not native, what="Python frames only again")
        assert not screen.report.native_frames and not any("libc" in label for label in labels(app))

    drive(app, body, size=(80, 24))


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_u_after_n_shows_python_frames_and_n_offers_the_c_frames_again(tmp_path):
    """SIGUSR1's faulthandler prints Python frames only: after `n` then `u`, the tree's title
    said `n: C frames` while the help and the palette said `n Python frames`, and n dumped the
    Python frames again, the same as shown."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, TICKER, n=1)))

    async def body(app, pilot):
        await _open_stack_view(app, pilot)
        screen, tree = app.screen, app.screen.query_one(CallTree)
        await pilot.press("n")
        await until(pilot, lambda: screen.report.native_frames, what="the dump with C frames")
        assert offered(app)["n"] == "Python frames" and tree.border_title == "call tree (n: Python only)"
        native = screen.report
        await pilot.press("u")
        await until(pilot, lambda: screen.report is not native, what="the SIGUSR1 dump")
        assert not screen.report.native_frames
        assert offered(app)["n"] == "C frames" and tree.border_title == "call tree (n: C frames)"

    drive(app, body, size=(80, 24))


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_n_twice_shows_the_python_frames_though_the_c_frames_came_last(tmp_path):
    """n starts a dump with C frames (slow: symbols), n again one without (fast); the first
    answered last and replaced the second: C frames shown, while every key said Python frames
    were. The engine here is real, its C-frames answer held until the later dump has answered."""
    import threading

    engine = LocalEngine(ticker_agent(tmp_path, TICKER, n=1))
    submit, native_asked, python_answered, native_thread = engine.submit, threading.Event(), threading.Event(), []

    def in_order(command):
        if isinstance(command, cmd.DumpStacks) and command.native_frames:
            native_thread.append(threading.current_thread())  # a thread of a pool: it lives on
            native_asked.set()
            python_answered.wait(30)
            return submit(command)
        ack = submit(command)
        if native_asked.is_set():
            python_answered.set()
        return ack

    def native_done() -> bool:
        """Whether the worker that asked for the C frames is through with its answer (its
        thread has left the view's code: shown or dropped)."""
        frame = sys._current_frames().get(native_thread[0].ident)
        while frame is not None:
            if frame.f_code.co_filename in (__file__, sys.modules[StacksScreen.__module__].__file__):
                return False
            frame = frame.f_back
        return True

    engine.submit = in_order
    app = RanktopApp(engine)

    async def body(app, pilot):
        await _open_stack_view(app, pilot)
        screen = app.screen
        first = screen.report
        await pilot.press("n")
        await until(pilot, native_asked.is_set, what="the dump with C frames asked")
        await pilot.press("n")
        await until(pilot, lambda: screen.report is not first, what="the dump without")
        await until(pilot, native_done, what="the dump with C frames answered")
        await pilot.pause()
        assert not screen.native_frames and not screen.report.native_frames
        assert "with C frames" not in screen_rows(app)[0]

    drive(app, body, size=(80, 24))


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
@pytest.mark.parametrize("size", [(60, 20), (40, 12)], ids=["60x20", "40x12"])
def test_the_stack_view_shares_a_narrow_terminal_between_groups_and_tree(tmp_path, size):
    """The groups kept 40 columns whatever the width: at 60 the call tree had 20, at 40 none (off
    the screen). Under 80 columns the two share the width, the groups at most half."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, DEEP, n=1)))
    width = size[0]

    async def body(app, pilot):
        await _open_stack_view(app, pilot)
        groups, tree = app.screen.query_one(StackGroups), app.screen.query_one(CallTree)
        await until(pilot, lambda: tree.region.width > 0, what="the call tree laid out")
        assert groups.region.x == 0 and groups.region.right == tree.region.x and tree.region.right == width
        assert width * 0.4 <= groups.region.width <= width // 2, (groups.region, tree.region)
        rows = screen_rows(app)
        assert any("call tree" in row[tree.region.x:] for row in rows)  # its title, on screen

    drive(app, body, size=size)


def _tree_labels(tree: CallTree) -> list:
    """Every label of the call tree (rich Text), the root's first."""
    out, nodes = [], [tree.root]
    while nodes:
        node = nodes.pop(0)
        out.append(node.label)
        nodes.extend(node.children)
    return out


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_the_stack_view_leads_from_the_odd_thread_to_its_ranks_output(tmp_path):
    """Rank 2's prefetch thread is stuck (its main thread only waits for it). After `t` the
    threads were listed by rank, none marked, the call tree still the main threads'; and no key
    went from a group to its rank's output. Now the odd thread is marked and first, the tree is
    the selected thread's, and enter zooms the selected group's first rank (of a thread some ranks
    lack: the first of those)."""
    app = RanktopApp(LocalEngine(stuck_prefetch_agent(tmp_path, stall_timeout=60.0)))

    async def body(app, pilot):
        await until(pilot, lambda: all(b"ready" in b"".join(app.engine.agent.output(r)) for r in range(3)),
                    what="the ranks waiting")
        await pilot.press("D")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None,
                    what="stack report")
        screen = app.screen
        box, tree = screen.query_one(StackGroups), screen.query_one(CallTree)

        def titles() -> list[str]:
            return [str(w.border_title) for w in box.children]

        def shown() -> str:
            return " ".join(screen_rows(app))

        await until(pilot, lambda: "enter: rank 2's output" in shown(), what="the selected group's bottom border")
        assert titles() == ["rank 2 — ODD ONE OUT", "ranks 0-1"] and str(tree.root.label) == "ranks 0-2"
        assert [w.has_class("selected") for w in box.children] == [True, False]
        await pilot.press("t")
        await until(pilot, lambda: box.children and all(w.has_class("thread") for w in box.children),
                    what="the other threads")
        # (each title as much of these as its border holds whole: see the test at 60 to 200 columns)
        assert [w.titles[0] for w in box.children] == [
            "thread 'prefetch' — rank 2 — ODD ONE OUT", "thread 'writer' — ranks 0-1 — not in rank 2",
            "thread 'prefetch' — ranks 0-1"]
        assert all(title in w.titles for title, w in zip(titles(), box.children, strict=True)), titles()
        assert [w.has_class("odd") for w in box.children] == [True, True, False]
        # (80 columns cut the title after the thread's name): its first line, which wraps
        assert box.children[0].content.plain.startswith("ODD ONE OUT: ranks 0-1 are elsewhere\n")
        assert box.children[1].content.plain.startswith("not in rank 2\n")
        # The call tree is the selected thread's, in every rank: it forks where rank 2's went.
        labels = _tree_labels(tree)
        assert str(labels[0]) == "thread 'prefetch': ranks 0-2"
        (stuck,) = [label for label in labels if "fetch_from_storage" in str(label)]
        assert str(stuck).startswith("[rank 2] ") and stuck.style == "bold red"
        assert any(str(label).startswith("[ranks 0-1] Queue.put") for label in labels)
        await pilot.click(box.children[1], offset=(2, 1))  # (its top, below the first group)
        await until(pilot, lambda: str(tree.root.label) == "thread 'writer': ranks 0-1", what="the tree follows")
        assert [w.has_class("selected") for w in box.children] == [False, True, False]
        # A thread rank 2 lacks: enter goes to rank 2, the odd one there (it went to rank 0, which has it).
        await until(pilot, lambda: "enter: rank 2 (lacks it)" in shown(), what="the bottom border's rank 2")
        # No box ends in a blank line (each line of its text ended in a newline, the last too).
        assert not any(w.content.plain.endswith("\n") for w in box.children)
        await pilot.press("down", "up", "up")
        await until(pilot, lambda: str(tree.root.label).startswith("thread 'prefetch': ranks 0-2"), what="up, down")
        assert [w.has_class("selected") for w in box.children] == [True, False, False]
        await pilot.press("tab", "enter")  # in the tree enter folds a frame, as before
        assert app.screen is screen and not tree.cursor_node.is_expanded
        await pilot.press("shift+tab", "enter")
        await until(pilot, lambda: app.screen is app.main, what="back on the grid")
        main = app.main
        assert main.zoomed and main.current == 2 and app.focused is main.pane(2).log
        await pilot.press("z", "D")  # the writer's group (rank 2 lacks it): enter to rank 2
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None,
                    what="stack report")
        await pilot.press("t")
        box = app.screen.query_one(StackGroups)
        await until(pilot, lambda: len(box.children) == 3 and box.children[0].has_class("selected"), what="the threads")
        await pilot.press("down", "enter")
        await until(pilot, lambda: app.screen is app.main, what="back on the grid")
        assert main.zoomed and main.current == 2
        # From the main threads' view too, a group of several: its first rank.
        await pilot.press("escape", "D")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None,
                    what="stack report")
        box = app.screen.query_one(StackGroups)
        await until(pilot, lambda: box.children and box.children[0].has_class("selected"), what="the first selected")
        await pilot.press("end", "enter")
        await until(pilot, lambda: app.screen is app.main, what="back on the grid")
        assert main.zoomed and main.current == 0

    drive(app, body, size=(80, 24))


class _DumpingEngine(FakeEngine):
    """A fake engine whose stack dump is `stacks`: a report made to measure."""

    def __init__(self, stacks: list[RankStack]) -> None:
        super().__init__(len(stacks))
        self.stacks = stacks

    def submit(self, command: cmd.Command) -> cmd.Ack:
        if isinstance(command, cmd.DumpStacks):
            return cmd.Ack(True, "dumped", build_report(self.stacks, time.time(), 0.1))
        return super().submit(command)


def rank_stack(rank: int) -> RankStack:
    """Rank `rank` dumped in a stack of its own (`step_<rank>`): one group per rank."""
    frames = (Frame("main", "/t.py", "t.py", 1), Frame(f"step_{rank}", "/t.py", "t.py", 2))
    return RankStack(rank, rank, 1000 + rank, StackStatus.OK, (ThreadStack("MainThread", 1, None, False, False, True, frames),))


def test_a_box_that_stands_for_no_group_is_not_selected_and_boxes_end_at_their_last_line():
    """`no other threads` (and `no Python stacks (see below)`) got the selected group's double
    border, though enter has nowhere to go from it; and every group's box ended in a blank line."""
    engine = _DumpingEngine([rank_stack(0), rank_stack(1)])

    async def body(app, pilot):
        await pilot.press("D")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None, what="the dump")
        box = app.screen.query_one(StackGroups)
        await until(pilot, lambda: "enter: rank 0's output" in " ".join(screen_rows(app)), what="the first selected")
        rows = screen_rows(app)
        (bottom,) = [i for i, row in enumerate(rows) if "enter: rank 0's output" in row]
        assert "step_0 (t.py:2)" in rows[bottom - 1], rows[bottom - 1]  # its last frame, then its border
        await pilot.press("t")
        await until(pilot, lambda: "no other threads" in " ".join(screen_rows(app)), what="no other threads")
        await pilot.pause()
        (none,) = box.children
        assert not none.has_class("selected") and "enter:" not in " ".join(screen_rows(app))
        assert not any("═" in row for row in screen_rows(app)), screen_rows(app)  # no double border
        await pilot.press("enter")
        await until(pilot, lambda: "no group of ranks to go to" in notes(app), what="enter's answer")
        assert isinstance(app.screen, StacksScreen)
        engine.stacks = [dataclasses.replace(s, status=StackStatus.GONE, threads=()) for s in engine.stacks]
        await pilot.press("t", "g")
        await until(pilot, lambda: "no Python stacks (see below)" in " ".join(screen_rows(app)), what="no stacks")
        await pilot.pause()
        assert not box.children[0].has_class("selected") and not any("═" in row for row in screen_rows(app))

    drive_fake(engine, body, size=(80, 24))


def writer_lacking_stack(rank: int, lacks_writer: bool) -> RankStack:
    """Rank `rank`'s main thread and, unless it `lacks_writer`, a `writer` thread."""
    main = rank_stack(rank).threads
    writer = ThreadStack("writer", 2, None, False, False, False, (Frame("write_logs", "/t.py", "t.py", 9),))
    return dataclasses.replace(rank_stack(rank), threads=main if lacks_writer else (*main, writer))


@pytest.mark.parametrize("size", [(60, 20), (80, 24), (200, 50)])
def test_the_stack_views_titles_and_enter_hint_are_whole_from_60_to_200_columns(size):
    """At 60 columns the selected group's bottom border read `enter: rank 2 (lacks …`, the
    groups' title `other threads (t: main thre…` and a thread group's `thread 'writer' — ran…`:
    each says as much as its border holds whole, its least useful words going first (of a thread
    group's, `thread`, which the groups' title says, then how it is odd, which its first line says).
    The help offers what t does now, as the footer does, at every width."""
    engine = _DumpingEngine([writer_lacking_stack(r, lacks_writer=r == 12) for r in (10, 11, 12)])

    async def body(app, pilot):
        await pilot.press("D")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None, what="the dump")
        box = app.screen.query_one(StackGroups)

        def hint_and_title() -> tuple[str, str]:
            return str(box.children[box.selected].border_subtitle), str(box.border_title)

        def whole_on_screen() -> bool:
            rows = screen_rows(app)
            return all(any(words in row for row in rows) for words in hint_and_title())

        await until(pilot, lambda: hint_and_title()[0] and whole_on_screen(), what="the selected group's hint")
        wide = size[0] >= 80
        # (at 60 columns `enter: rank 10's output` fits where the groups need no scrollbar)
        assert hint_and_title()[0] in ("enter: rank 10's output", *(() if wide else ("⏎ rank 10's output",)))
        assert hint_and_title()[1] == ("main threads (t: other threads)" if wide else "main threads (t: others)")
        await pilot.press("t")
        await until(pilot, lambda: "'writer' — ranks 10-11" in str(box.children[0].border_title)
                    and box.children[0].border_subtitle, what="the other threads")
        assert hint_and_title() == ("enter: rank 12 (lacks it)" if wide else "⏎ rank 12 (lacks it)",
                                    "other threads (t: main threads)" if wide else "other threads (t: main)")
        assert whole_on_screen(), screen_rows(app)
        thread_title = str(box.children[0].border_title)
        assert thread_title == {200: "thread 'writer' — ranks 10-11 — not in rank 12"}.get(size[0], "'writer' — ranks 10-11")
        assert any(thread_title in row for row in screen_rows(app)), screen_rows(app)
        await pilot.press("question_mark")  # the help's t, as the footer's, is what t does now
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help")
        helped = " ".join(screen_rows(app))
        assert re.search(r"\bt +Main threads", helped) and "Other threads" not in helped, helped
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen), what="back in the stack view")
        if not wide:  # the terminal widened: the words come back
            await pilot.resize_terminal(80, 24)
            await until(pilot, lambda: hint_and_title() == ("enter: rank 12 (lacks it)", "other threads (t: main threads)"),
                        what="the long words at 80 columns")

    drive_fake(engine, body, size=size)


def test_a_page_of_the_stack_groups_selects_the_group_it_brings_into_sight():
    """PgDn scrolled the groups a page and left the selection behind, out of sight: enter then
    zoomed a rank of a group no longer shown, and ↓ jumped back up to the one after it. Now PgDn
    and PgUp select the first group in sight after the page, as a list's page keys move its
    cursor; where the groups fit, the last / the first."""
    engine = _DumpingEngine([rank_stack(r) for r in range(12)])

    async def body(app, pilot):
        await pilot.press("D")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None, what="the dump")
        box = app.screen.query_one(StackGroups)
        await until(pilot, lambda: box.children and box.children[0].has_class("selected"), what="the first selected")

        def in_sight(index: int) -> bool:  # its top: below the title's row, which hides what scrolls under it
            region, shown = box.children[index].region, box.content_region
            return region.height > 0 and shown.y <= region.y < shown.bottom

        await pilot.press("pagedown")
        await until(pilot, lambda: box.scroll_y > 0, what="a page down")
        await pilot.pause()
        assert box.selected > 0 and in_sight(box.selected), (box.selected, box.scroll_y)
        first_in_sight = box.selected
        assert not any(in_sight(i) for i in range(first_in_sight)), box.scroll_y
        await pilot.press("pageup")
        await until(pilot, lambda: box.selected == 0 and box.scroll_y == 0, what="a page up")
        await pilot.press("pagedown", "enter")
        await until(pilot, lambda: app.screen is app.main, what="back on the grid")
        assert app.main.zoomed and app.main.current == first_in_sight
        # A group taller than the page: PgDn reads on through it, still selected.
        deep = tuple(Frame(f"f{i}", "/t.py", "t.py", i) for i in range(60))
        engine.stacks[0] = dataclasses.replace(engine.stacks[0], threads=(ThreadStack("MainThread", 1, None, False, False, True, deep),))
        await pilot.press("escape", "D")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None, what="the dump")
        box = app.screen.query_one(StackGroups)
        await until(pilot, lambda: box.children and box.children[0].has_class("selected"), what="the first selected")
        await pilot.press("pagedown")
        await until(pilot, lambda: box.scroll_y > 0, what="a page down")
        assert box.selected == 0 and box.children[0].border_title == "rank 0"
        await pilot.press("pagedown")
        await until(pilot, lambda: box.scroll_y > 21, what="another page down")
        assert box.selected == 0

    drive_fake(engine, body, size=(80, 24))


def test_the_header_keeps_its_parts_while_the_countdown_and_the_alive_count_tick_down():
    """The header's parts are dropped whole to fit; a stop's countdown going from 10s to 9s, or
    the alive count from 10/10 to 9/10, gave a cell back and a part came in mid-stop (the clock,
    the GPU status, a longer log dir) at about one width in three: the line jumped under the
    numbers being watched. Room is kept for them as they were at their widest."""
    base = dataclasses.replace(FakeEngine(10).snapshot(), log_dir="/tmp/ranktop-0/20261127-061423-e158",
                               gpu_status="no GPU", max_restarts=3, started_at=0.0, shutdown_timeout=10.0)

    def stopping(left: int):
        return dataclasses.replace(base, state=GroupState.STOPPING,
                                   ranks=tuple(dataclasses.replace(r, kill_at=100.0 + left) for r in base.ranks))

    def alive(count: int):
        return dataclasses.replace(base, ranks=tuple(dataclasses.replace(r, state=RankState.FAILED, exitcode=1)
                                                     if r.rank >= count else r for r in base.ranks))

    def shape(group, width: int) -> str:  # the header, its ticking numbers aside
        return re.sub(r"SIGKILL in \d+s|\d+/10 alive", "#", header_text(group, 100.0, width=width).plain).rstrip()

    for width in range(40, 201):
        assert shape(stopping(10), width) == shape(stopping(9), width) == shape(stopping(0), width), width
        assert shape(alive(10), width) == shape(alive(9), width), width
        assert header_text(alive(10), 100.0, width=width).cell_len <= width or width < 60, width


def test_the_header_keeps_its_parts_when_a_stops_countdown_turns_into_a_range():
    """A stop whose ranks' deadlines come to differ (a rank's process gone, the rest of its group
    given a shorter grace) counts down `SIGKILL in 3-10s`: wider than `SIGKILL in 10s`, it took
    the place of the parts last in line (the clock, the GPU status) mid-stop, as neither the room
    kept for the ticking numbers nor anything else had it. The room kept covers the range too."""
    base = dataclasses.replace(FakeEngine(10).snapshot(), log_dir="/tmp/ranktop-0/20261127-061423-e158",
                               gpu_status="no GPU", max_restarts=3, started_at=0.0, shutdown_timeout=10.0,
                               state=GroupState.STOPPING)

    def stopping(*left: int):  # each rank's seconds left, the last repeated
        lefts = [*left, *[left[-1]] * (len(base.ranks) - len(left))]
        return dataclasses.replace(base, ranks=tuple(dataclasses.replace(r, kill_at=100.0 + s)
                                                     for r, s in zip(base.ranks, lefts, strict=True)))

    def shape(group, width: int) -> str:  # the header, its countdown aside
        return re.sub(r"SIGKILL in \d+(-\d+)?s", "#", header_text(group, 100.0, width=width).plain).rstrip()

    assert "SIGKILL in 3-10s" in header_text(stopping(3, 10), 100.0, width=200).plain
    for width in range(40, 201):
        steady = shape(stopping(10), width)
        assert shape(stopping(3, 10), width) == shape(stopping(9, 10), width) == shape(stopping(0, 1), width) \
            == steady, width


LONG_NAME = "a_training_script_with_a_very_long_descriptive_name_v2_bf16.py"  # 62 cells
STOP_NOTE = "stopping… (q again: kill now)"


def test_a_long_name_gives_up_its_middle_so_the_state_and_a_stops_countdown_show():
    """A 62-character script name was never shortened: at 40 columns it pushed the state and a
    stop's countdown past the edge (`SIGKILL in 1…`). It gives up its middle: its start (which
    script) and its end (which variant) stay; below 8 cells the `ranktop` badge goes first."""
    base = dataclasses.replace(FakeEngine(4, name=LONG_NAME).snapshot(), gpu_status="no GPU", started_at=0.0,
                               shutdown_timeout=30.0)
    stopping = dataclasses.replace(base, state=GroupState.STOPPING,
                                   ranks=tuple(dataclasses.replace(r, kill_at=107.0) for r in base.ranks))
    for width in range(40, 201):
        running = header_text(base, 100.0, width=width).plain
        assert running.startswith(" ranktop  a_training") and " running " in running, width
        assert cell_len(running) <= width and "4/4 alive" in running or width < 70, (width, running)
        shown = header_text(stopping, 100.0, note=STOP_NOTE, width=width).plain[:width]
        assert " stopping   SIGKILL in 7s" in shown and (STOP_NOTE in shown or width < 67), (width, shown)
        name = shown.split("  stopping ")[0].removeprefix(" ranktop ").strip()
        assert name == LONG_NAME or (name.endswith(".py") and "…" in name and 8 <= cell_len(name) < 62), (width, name)
        assert shown.startswith(" ranktop ") == (width >= 79), (width, shown)  # under: the badge went for the name (and the room kept for `SIGKILL in 30-30s`)
    # Room for it whole: whole, and no part gone for it; 24 cells kept before a part goes.
    assert LONG_NAME in header_text(base, 100.0, width=160).plain
    at_80 = " ranktop  a_training_scr…ame_v2_bf16.py  running   attempt_0  0:01:40  4/4 alive"
    assert header_text(base, 100.0, width=80).plain == at_80
    short = header_text(dataclasses.replace(base, name="train.py"), 100.0, width=40).plain
    assert short.startswith(" ranktop  train.py  running ")
    assert fit_name("训练脚本训练脚本训练脚本.py", 12) == "训练脚…本.py" and fit_name("abc", 1) == "…"


def test_an_earlier_attempt_the_user_restarted_gives_way_where_a_failed_one_stays():
    """After an `R` the header's `earlier: attempt_0: restarted by the user` was kept whatever the
    width, as a failure is: at 80 columns it took the room of the attempt, the clock and the live
    ranks' count. An attempt that ended in no failure is news that gives way before those; one
    that failed (also one the user then restarted) stays, whatever goes for it, its words giving
    up their end for the room of the line (the line's own ellipsis cut them there)."""
    base = dataclasses.replace(FakeEngine(4).snapshot(), gpu_status="no GPU", started_at=0.0, attempt=1,
                               log_dir="/tmp/ranktop-0/20261127-061423-e158")
    calm = dataclasses.replace(base, earlier_attempts=("attempt_0: restarted by the user",), user_restarts=1)
    failed = dataclasses.replace(base, earlier_attempts=("attempt_0: rank 1 failed (exit 1), then restarted by the user",),
                                 user_restarts=1)
    assert "earlier: attempt_0: restarted by the user" in header_text(calm, 100.0, width=160).plain
    at_80 = header_text(calm, 100.0, width=80).plain
    assert "earlier" not in at_80 and "attempt_1" in at_80 and "0:01:40" in at_80 and "4/4 alive" in at_80, at_80
    assert "earlier: attempt_0: rank 1 failed (exit 1), then r…" in header_text(failed, 100.0, width=80).plain
    assert header_text(failed, 100.0, width=60).plain == " fake.py  running   earlier: attempt_0: rank 1 failed (exit…"
    both = dataclasses.replace(calm, earlier_attempts=("attempt_0: rank 1 failed (exit 1)", "attempt_1: restarted by the user"))
    assert "earlier: attempt_1: restarted by the user (+1)" in header_text(both, 100.0, width=80).plain


def test_a_huge_hostile_name_fits_the_header_safely():
    """The header's name and earlier attempts come from the run (an attach client reads them off
    the engine's socket): a name of 100k characters of escape sequences, wide and bidi characters
    gives up its middle like any long one, with no control character left, and the state stays."""
    hostile = "\x1b]0;EVIL\x07\x1b[2J\x9b31m训练\u202e" * 8000 + ".py"
    base = dataclasses.replace(FakeEngine(4, name=hostile).snapshot(), started_at=0.0, attempt=1,
                               earlier_attempts=("attempt_0: rank 1 failed \x1b[31m(exit 1)\x07",))
    for width in (40, 80, 200):
        shown = header_text(base, 100.0, width=width).plain
        assert " running " in shown[:width] and "…" in shown and (cell_len(shown) <= width or width < 80), (width, shown)
        assert shown.split("  running ")[0].endswith(".py"), (width, shown)
        assert not re.search(r"[\x00-\x1f\x7f-\x9f\u202e]", shown), (width, shown)
    assert "earlier: attempt_0: rank 1 failed" in header_text(base, 100.0, width=200).plain


def test_the_header_row_shows_a_long_names_state_and_countdown_at_40_columns():
    """On screen the header wrapped at a word too: behind a long name the state went to a second
    row, which its one row does not show (`ranktop  a_training_…` and nothing else at 40 columns)."""
    engine = FakeEngine(2, name=LONG_NAME)

    async def body(app, pilot):
        await until(pilot, lambda: " running " in screen_rows(app)[0], what="the state in the header row")
        for r in range(2):
            engine.set_rank(r, kill_at=time.time() + 30)
        engine.group = dataclasses.replace(engine.group, state=GroupState.STOPPING)
        app.main.note = STOP_NOTE
        await until(pilot, lambda: re.search(r" stopping   SIGKILL in \d+s  s", screen_rows(app)[0]),
                    what="the state and the countdown in the header row")
        assert screen_rows(app)[0].startswith(" a_tr….py  stopping"), screen_rows(app)[0]

    drive_fake(engine, body, size=(40, 24))


def test_the_selected_stack_group_stays_in_sight_when_the_terminal_shrinks():
    """At 160x48 every group fits; shrunk to 80x24 the groups kept their scroll at the top and the
    selected one, where enter goes, was out of sight below. It is brought back into sight."""
    async def body(app, pilot):
        await pilot.press("D")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None, what="the dump")
        box = app.screen.query_one(StackGroups)
        await until(pilot, lambda: box.children and box.children[0].has_class("selected"), what="the first selected")
        await pilot.press("end")
        await until(pilot, lambda: box.selected == 5, what="the last selected")
        await pilot.resize_terminal(80, 24)

        def in_sight() -> bool:
            region = box.children[box.selected].region
            return region.height > 0 and box.region.y <= region.y and region.bottom <= box.region.bottom

        await until(pilot, in_sight, what="the selected group in sight")

    drive_fake(_DumpingEngine([rank_stack(r) for r in range(6)]), body, size=(160, 48))


UNTIL_GO_FILE = ("import os, pathlib, time\nprint('up', flush=True)\n"
                 "while not pathlib.Path(os.environ['GO']).exists():\n    time.sleep(0.05)\n")


def until_go_app(tmp_path, monkeypatch) -> RanktopApp:
    """Two ranks that run until tmp_path/go exists."""
    monkeypatch.setenv("GO", str(tmp_path / "go"))
    return RanktopApp(LocalEngine(ticker_agent(tmp_path, UNTIL_GO_FILE, n=2)))


def stacks_summary(app: RanktopApp) -> str:
    return str(app.screen.query_one("#stacks-summary").render())


async def dump_all_ranks(app, pilot) -> None:
    """`D` once both ranks printed, and the stack view with its report."""
    await until(pilot, lambda: all(app.main.pane(r).log.line_count for r in (0, 1)), what="the ranks up")
    await pilot.press("D")
    await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None,
                what="stack report")


def footer_descriptions(app: RanktopApp) -> set[str]:
    return {key.description for key in shown_footer_keys(app)}


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_the_stack_view_of_a_tui_whose_run_ended_shows_the_last_dump_saved(tmp_path, monkeypatch):
    """Once its run had ended, the TUI's `d` dumped again ranks that were gone (`0 of 2 ranks
    dumped`) and offered `g`: it shows the last dump saved during the run, as a final view does."""
    app = until_go_app(tmp_path, monkeypatch)

    async def body(app, pilot):
        await dump_all_ranks(app, pilot)
        assert "2 of 2 ranks dumped" in stacks_summary(app) and "saved: " in stacks_summary(app)
        await pilot.press("escape")
        (tmp_path / "go").touch()
        await until(pilot, lambda: app.engine.ended, what="the run's end")
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and "its last dump" in stacks_summary(app),
                    what="the last dump shown")
        summary = stacks_summary(app)
        assert "the run has ended: its last dump, taken at" in summary and "2 of 2 ranks dumped" in summary
        await pilot.pause(0.2)  # (the footer settles)
        footer = footer_descriptions(app)
        assert "Dump again" not in footer and "Other threads" in footer, footer
        # Nor does the tree's title offer n (`call tree (n: C frames)`): it would dump again too.
        assert app.screen.query_one(CallTree).border_title == "call tree"

    drive(app, body)


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_a_stack_view_open_when_the_run_ends_offers_no_new_dump(tmp_path, monkeypatch):
    """The view read once, as it opened, whether it could dump again: open through the run's end,
    it went on offering `g` (which dumped ranks that were gone). `g` and the SIGUSR1 fallback go
    from its footer once the run has ended, and the dump it shows stays."""
    app = until_go_app(tmp_path, monkeypatch)

    async def body(app, pilot):
        await dump_all_ranks(app, pilot)
        assert "Dump again" in footer_descriptions(app)
        (tmp_path / "go").touch()
        shown = stacks_summary(app)
        await until(pilot, lambda: app.engine.ended, what="the run's end")

        def footer_after_the_end() -> bool:  # (an empty footer, mid-refresh, is no answer)
            footer = footer_descriptions(app)
            return "Other threads" in footer and not footer & {"Dump again", "SIGUSR1 fallback"}

        await until(pilot, footer_after_the_end, what="g and u gone from the footer, t still there")
        await until(pilot, lambda: app.screen.query_one(CallTree).border_title == "call tree", 5,
                    what="n gone from the tree's title too (`call tree (n: C frames)`)")
        await pilot.press("g")
        await pilot.pause(0.3)
        assert stacks_summary(app) == shown  # (no dump of ranks that are gone)

    drive(app, body)
