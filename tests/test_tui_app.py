"""The Textual app driven by Pilot around a real LocalAgent: every key's effect on real ranks,
on the pane titles, and in events.jsonl."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from conftest import drive, make_agent, read_events, screen_rows, until, wait_for
from fake_engine import FakeEngine
from ranktop.core.agent import LocalAgent
from ranktop.core.engine import LocalEngine
from ranktop.core.process import kernel_state
from ranktop.core.state import GroupState, RankState
from ranktop.tui.app import QUIT_STATUS, RanktopApp
from ranktop.tui.main_screen import plan_grid
from ranktop.tui.panes import RankList, RankPane
from ranktop.tui.screens import ConfirmQuit, HelpScreen, SignalPicker
from textual.command import CommandList

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def patient_confirm(monkeypatch):
    """A second press of k/K/r/R confirms within 3 s; a loaded box may take longer between two
    keys, and these tests are about what the keys do, not about the window."""
    from ranktop.tui import main_screen

    monkeypatch.setattr(main_screen, "CONFIRM_SECONDS", 60.0)

# A rank that says hello, then ticks until it is told to stop (SIGTERM's default action ends it).
TICKER = "import os, time\nprint('hello from', os.environ['RANK'], flush=True)\nwhile True:\n    time.sleep(0.1)\n"
FAILER = (
    "import os, time\nfrom ranktop.core.errors import record\n@record\ndef main():\n"
    "    print('rank', os.environ['RANK'], 'up', flush=True)\n"
    "    if os.environ['RANK'] == '1':\n        time.sleep(0.3)\n        raise ValueError('boom 42')\n"
    "    time.sleep(60)\nmain()\n"
)


def ticker_agent(tmp_path: Path, code: str = TICKER, n: int = 2, **kw) -> LocalAgent:
    return make_agent(tmp_path, code, n, name="ticker.py", stall_timeout=60.0, **kw)


def rank(app: RanktopApp, local_rank: int):
    return app.engine.snapshot().ranks[local_rank]


def title(app: RanktopApp, local_rank: int) -> str:
    return app.main.pane(local_rank).title


def palette_top(app: RanktopApp) -> str:
    """The highlighted entry of the open command palette, '' while it shows none."""
    lists = app.screen.query(CommandList)
    if not lists or lists.first().highlighted is None:
        return ""
    found = lists.first()
    return str(found.get_option_at_index(found.highlighted).prompt)


def notes(app: RanktopApp) -> str:
    """Every notification shown so far, as one text."""
    return "\n".join(str(n.message) for n in app._notifications)


async def quit_confirmed(app: RanktopApp, pilot) -> None:
    await pilot.press("q")
    await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what="quit confirmation")
    await pilot.press("y")
    await until(pilot, lambda: app.ended, what="ranks stopped after quit")


def test_kill_rank_key_then_quit_confirm_stops_the_rest(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path)))

    async def body(app, pilot):
        await until(pilot, lambda: "hello from 1" in b"".join(app.engine.agent.output(1)).decode(), what="rank 1 output")
        await pilot.press("1")
        assert app.main.current == 1 and app.main.pane(1).has_class("focused")
        await pilot.press("k")  # destructive: the first press only asks
        assert rank(app, 1).state.alive and "Press k again" in notes(app)
        await pilot.press("k")
        await until(pilot, lambda: rank(app, 1).state == RankState.KILLED, what="rank 1 killed")
        await until(pilot, lambda: "killed SIGKILL" in title(app, 1), what="title shows the kill")
        assert rank(app, 0).state.alive
        assert any(e["event"] == "signalled" and e["signal"] == "SIGKILL" and e["local_rank"] == 1
                   for e in read_events(app.engine.agent.run_dir))
        await quit_confirmed(app, pilot)
        assert rank(app, 0).state == RankState.KILLED

    drive(app, body)
    assert app.exit_status == QUIT_STATUS
    assert any(e["event"] == "user_stop" for e in read_events(app.engine.agent.run_dir))


def test_quit_can_be_cancelled(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, n=1)))

    async def body(app, pilot):
        assert app.screen_stack == [app.main]  # the main screen is the first and only one: no blank one below
        await pilot.press("q")
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit), what="quit confirmation")
        await pilot.press("n")
        await until(pilot, lambda: app.screen is app.main, what="back on the grid")
        assert rank(app, 0).state.alive and not app.user_quit

    drive(app, body)


def test_enter_in_the_quit_question_stays_and_stops_nothing(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, n=2)))
    app.can_detach = True  # all three answers offered: the focus is still on the harmless one

    async def body(app, pilot):
        pids = [r.pid for r in app.engine.snapshot().ranks]
        await pilot.press("q")
        # (the question is on the stack at once; its focus is set once it has composed, a moment later)
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit) and app.screen.focused, what="quit confirmation")
        assert app.screen.focused.id == "quit-stay"
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is app.main, what="back on the grid")
        assert app.is_running and not app.user_quit and app.detached is None
        assert [r.pid for r in app.engine.snapshot().ranks] == pids
        assert all(r.state == RankState.RUNNING and kernel_state(r.pid) not in (None, "Z", "T") for r in
                   app.engine.snapshot().ranks)
        assert not any(e["event"] in ("user_stop", "signalled") for e in read_events(app.engine.agent.run_dir,
                                                                                       while_written=True))

    drive(app, body)


def test_the_first_frame_ends_start_up_for_the_collector():
    # `ranktop` holds cyclic collections while it starts (core/collector.py); the TUI's first
    # frame is where start-up ends, so collections must be back from there on.
    import gc

    from ranktop.core import collector

    app = RanktopApp(FakeEngine(2))
    collector.hold()
    try:
        async def body(app, pilot):
            await until(pilot, gc.isenabled, what="collections back after the first frame")
            assert gc.get_freeze_count() > 0  # what start-up made is out of the collector's sight

        drive(app, body)
    finally:
        gc.enable()
        gc.unfreeze()  # (this test process is not a ranktop)


COUNTER = "import time\nn = 0\nwhile True:\n    print('tick', n, flush=True)\n    n += 1\n    time.sleep(0.02)\n"


def test_signal_picker_stop_cont_and_group_term(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, COUNTER)))

    def printed(r: int) -> int:
        return len(app.engine.agent.output(r))

    async def body(app, pilot):
        pid = rank(app, 0).pid
        await until(pilot, lambda: printed(0) > 3, what="rank 0 ticking")
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, SignalPicker), what="signal picker")
        await pilot.press("7")  # SIGSTOP
        await until(pilot, lambda: kernel_state(pid) == "T", what="rank 0 stopped by SIGSTOP")
        await until(pilot, lambda: " paused " in title(app, 0), what="title shows paused")
        assert rank(app, 0).paused and not rank(app, 1).paused
        # A line rank 0 wrote just before it stopped may still be in the pipe: once rank 1 printed
        # more after the stop, the output thread has read it.
        others = printed(1)
        await until(pilot, lambda: printed(1) > others + 3, what="rank 1 printed after the stop")
        frozen, others = printed(0), printed(1)
        await until(pilot, lambda: printed(1) > others + 10, what="rank 1 keeps printing meanwhile")
        assert printed(0) == frozen  # a stopped rank prints nothing: it really is stopped
        await pilot.press("x", "8")  # SIGCONT
        await until(pilot, lambda: kernel_state(pid) != "T", what="rank 0 resumed")
        await until(pilot, lambda: printed(0) > frozen + 3, what="rank 0 prints again")
        await until(pilot, lambda: " running " in title(app, 0), what="title shows running again")
        assert not rank(app, 0).paused
        await pilot.press("x", "g", "2")  # SIGTERM to the whole group
        await until(pilot, lambda: app.ended, what="group ended")
        await until(pilot, lambda: app.main.ended, what="end noticed")
        assert all(r.state == RankState.KILLED and r.signal_name == "SIGTERM" for r in app.engine.snapshot().ranks)
        assert "killed SIGTERM" in title(app, 1)
        assert app.main.query_one("#root-cause").display
        sent = [(e["local_rank"], e["signal"]) for e in read_events(app.engine.agent.run_dir) if e["event"] == "signalled"]
        assert sent == [(0, "SIGSTOP"), (0, "SIGCONT"), (0, "SIGTERM"), (1, "SIGTERM")]
        await pilot.press("q")  # nothing runs: no confirmation
        await until(pilot, lambda: not app.is_running, what="app closed")

    drive(app, body)


def test_a_rank_stopped_and_resumed_from_outside_shows_the_kernels_state(tmp_path):
    """Two SIGSTOPs and one SIGCONT by hand (`kill`, not `x`): the kernel has the rank running
    again, and so do the engine and its title. The pause is read from the kernel: a stop from
    outside showed `running` meanwhile, and `x` SIGSTOP then a `kill -CONT` from outside left
    `paused` shown on a running rank."""
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, COUNTER)))

    def stopped() -> bool:
        return kernel_state(rank(app, 0).pid) == "T"

    async def says(pilot, paused: bool) -> None:
        word, what = (" paused ", "paused") if paused else (" running ", "running")
        await until(pilot, lambda: rank(app, 0).paused == paused and word in title(app, 0), what=f"title {what}")
        assert stopped() == paused and rank(app, 0).state == RankState.RUNNING, title(app, 0)
        assert not rank(app, 1).paused and " running " in title(app, 1)

    async def body(app, pilot):
        # (both running first: under load rank 1's title still said `starting` at the first check)
        await until(pilot, lambda: all(" running " in title(app, r) for r in (0, 1)), what="both ranks running")
        pid = rank(app, 0).pid
        os.kill(pid, signal.SIGSTOP)
        os.kill(pid, signal.SIGSTOP)
        await until(pilot, stopped, what="rank 0 stopped by the kernel")
        await says(pilot, paused=True)
        os.kill(pid, signal.SIGCONT)  # one SIGCONT ends any number of stops
        await until(pilot, lambda: not stopped(), what="rank 0 resumed by the kernel")
        await says(pilot, paused=False)
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, SignalPicker), what="signal picker")
        await pilot.press("7")  # SIGSTOP, by ranktop this time
        await says(pilot, paused=True)
        os.kill(pid, signal.SIGCONT)  # ... and SIGCONT from outside
        await says(pilot, paused=False)
        await pilot.press("x", "g", "2")  # SIGTERM to the whole group
        await until(pilot, lambda: app.ended, what="group ended")
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, what="app closed")

    drive(app, body)


def test_the_header_names_the_ranks_python_when_it_is_not_ranktops_own(tmp_path):
    """PYTHON_EXEC, or another env's python: the header says which interpreter the ranks run."""
    other = tmp_path / "env" / "bin" / "python3"
    other.parent.mkdir(parents=True)
    other.symlink_to(sys.executable)
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path / "logs", entrypoint=str(other))))

    async def body(app, pilot):
        await until(pilot, lambda: f"python {other}" in app.main.query_one("#header").render().plain,
                    what="the header names the ranks' python")
        assert rank(app, 0).state.alive and not rank(app, 0).native  # a Python rank: py-spy reads its stack

    drive(app, body)
    own = RanktopApp(LocalEngine(ticker_agent(tmp_path / "own")))  # ranktop's own interpreter: not said

    async def plain(app, pilot):
        assert " python " not in app.main.query_one("#header").render().plain

    drive(own, plain)


def test_restart_rank_then_restart_group(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path)))

    async def body(app, pilot):
        old = rank(app, 1).pid
        await pilot.press("1", "r")
        assert "peers share MASTER_ADDR" in notes(app) and rank(app, 1).pid == old  # warned, not yet done
        await pilot.press("r")
        await until(pilot, lambda: rank(app, 1).pid not in (None, old) and rank(app, 1).state.alive,
                    what="rank 1 restarted")
        assert rank(app, 1).restarts == 1
        await until(pilot, lambda: "⟳1" in title(app, 1) and f"pid {rank(app, 1).pid}" in title(app, 1),
                    what="title shows the new pid and restart")
        await pilot.press("R", "R")
        await until(pilot, lambda: app.engine.agent.attempt == 1 and all(r.pid and r.state.alive for r in
                                                                   app.engine.snapshot().ranks),
                    what="attempt 1 running")
        await until(pilot, lambda: "attempt_1" in app.main.query_one("#header").render().plain,
                    what="header shows attempt_1, as its directory is named")
        assert "earlier: attempt_0: restarted by the user" in app.main.query_one("#header").render().plain
        kinds = [e["event"] for e in read_events(app.engine.agent.run_dir)]
        assert "user_restart_rank" in kinds and "user_restart_group" in kinds and "group_restart" in kinds

    drive(app, body)


def test_kill_group_key_stays_open_on_final_states(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, n=3)))

    async def body(app, pilot):
        await pilot.press("K", "K")
        await until(pilot, lambda: app.main.ended, what="group ended")
        snap = app.engine.snapshot()
        assert snap.state == GroupState.STOPPED
        assert all(r.state == RankState.KILLED for r in snap.ranks)
        assert app.is_running  # stays open on the final states
        assert "killed SIGTERM" in title(app, 2)  # K stops with SIGTERM first: the ticker ends on it
        await pilot.press("k")  # nothing to kill any more: a warning, no crash
        await pilot.press("q")

    drive(app, body)
    assert any(e["event"] == "user_stop" and e["signal"] == "SIGTERM" for e in read_events(app.engine.agent.run_dir))


def test_failed_rank_root_cause_panel_and_exit_status(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, FAILER)))

    async def body(app, pilot):
        await until(pilot, lambda: app.main.ended, what="group failed")
        panel = "\n".join(app.main.query_one(part).render().plain for part in ("#root-cause-head", "#root-cause-text"))
        assert "ROOT CAUSE" in panel and "rank 1" in panel and "exit code 1" in panel
        assert "ValueError" in panel and "boom 42" in panel
        assert "last output of rank 1:" in panel and "last output of rank 0" not in panel
        assert app.main.current == 1  # the culprit is focused
        assert "exit 1" in title(app, 1) and "killed SIGTERM" in title(app, 0)
        assert " ago" not in title(app, 1)  # a dead rank is not "0s ago"
        await pilot.press("e")
        assert not app.main.query_one("#root-cause").display
        await pilot.press("q")

    drive(app, body)
    assert app.exit_status == 1


def test_exit_on_end_closes_at_once(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, "print('done')")), exit_on_end=True)

    async def main():
        app.engine.start()  # the app is handed a running engine
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: not app.is_running, what="app closed by itself")

    asyncio.run(main())
    assert app.exit_status == 0


def test_focus_keys_zoom_and_mouse():
    app = RanktopApp(FakeEngine(4))  # keys and layout only: no real ranks needed

    async def body(app, pilot):
        main = app.main
        assert (main.cols, main.compact) == (2, False)
        await pilot.press("right")
        assert main.current == 1
        await pilot.press("down")
        assert main.current == 3
        await pilot.press("left", "up")
        assert main.current == 0
        await pilot.press("tab", "tab")
        assert main.current == 2
        await pilot.press("shift+tab")
        assert main.current == 1
        await pilot.press("z")
        assert main.zoomed and [r for r in range(4) if main.pane(r).display] == [1]
        await pilot.press("down")  # zoomed, the arrows scroll the pane: the rank stays
        assert main.current == 1
        await pilot.press("tab")  # tab moves the zoom to the next rank
        assert main.current == 2 and [r for r in range(4) if main.pane(r).display] == [2]
        await pilot.press("escape")
        assert not main.zoomed and all(main.pane(r).display for r in range(4))
        await pilot.press("enter")
        assert main.zoomed
        await pilot.press("z")
        await pilot.click("#pane-3", offset=(5, 3))
        # (the rank is the focused one once the click's DescendantFocus or Picked reaches the screen:
        # on a loaded worker both can still be queued when the click returns)
        await until(pilot, lambda: main.current == 3 and isinstance(app.focused.parent, RankPane), what="rank 3 clicked")

    drive(app, body)


@pytest.mark.timeout(30)  # (re held the GIL through `re:(a+)+b`, which never ended)
def test_search_follow_and_wrap_keys(tmp_path):
    """/, n, f, w and esc on a real rank's output; then a `re:` pattern that backtracks without end
    on the rank's line of 5,000 `a`s: re held the GIL while it matched, so the engine's output
    thread stopped reading the rank (its log file stopped growing, its pipe filled) and the TUI
    froze until SIGKILL. The match is given up after 250 ms, and the rank's ticks go on being logged."""
    code = ("import itertools, time\nfor i in range(300):\n    print(f'line {i}', flush=True)\n"
            "print('needle here')\nprint('a' * 5000)\n"
            "for i in itertools.count():\n    print(f'tick {i}', flush=True)\n    time.sleep(0.05)\n")
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, code, n=1)))

    async def body(app, pilot):
        await until(pilot, lambda: app.main.pane(0).log.line_count >= 302, what="output in the pane")
        log = app.main.pane(0).log
        await pilot.press("slash")
        assert app.main.query_one("#search").display
        await pilot.press(*"line 12", "enter")  # typed into the input, not taken as rank keys
        assert app.main.current == 0 and not app.main.query_one("#search").display
        assert log.search_query == "line 12" and app.focused is log
        assert not log.follow  # a search jumps to the match and stops following
        await pilot.press("n")
        await pilot.press("f")
        assert log.follow
        wrap = log.wrap
        await pilot.press("w")
        assert log.wrap != wrap
        await pilot.press("slash", "escape")
        assert not app.main.query_one("#search").display and app.focused is log
        logged = Path(app.engine.agent.attempt_dir(0)) / "0" / "stdout.log"
        await pilot.press("slash")
        app.main.query_one("#search").value = "re:(a+)+b"  # (typed, each key waits for the app to go idle)
        await pilot.press("enter")
        await until(pilot, lambda: "re:(a+)+b' took over 250 ms on one line of rank 0" in notes(app), what="the note")
        ticks = logged.read_bytes().count(b"tick ")
        await until(pilot, lambda: logged.read_bytes().count(b"tick ") >= ticks + 5, what="ticks logged after it")

    drive(app, body)


def test_help_screen_and_palette_list_every_key(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path, n=2)))

    async def body(app, pilot):
        await pilot.press("question_mark")
        keys = ("Zoom", "Search", "Signal", "Kill rank", "Stop group", "Restart rank", "Restart group",
                "Follow", "Wrap", "Next match", "Quit", "Move focus between panes", "Focus rank N",
                "Stacks", "Page Up", "Stack view", "Other threads", "Signal picker", "Rank / whole group")

        def not_shown() -> list[str]:
            shown = app.export_screenshot()
            return [text for text in keys if text.replace(" ", "&#160;") not in shown and text not in shown]

        # (on the stack at once; drawn a moment later, which a loaded worker can leave for after the wait)
        await until(pilot, lambda: isinstance(app.screen, HelpScreen) and not not_shown(), what="help with every key")
        await pilot.press("escape")
        titles = {c.title for c in app.get_system_commands(app.main)}
        assert {"Kill rank", "Restart group", "Signal…", "Follow", "Wrap", "Quit", "Help"} <= titles
        # Run one through the palette itself: it must act on the focused rank.
        await pilot.press("1", "ctrl+p")
        await pilot.press(*"kill rank")
        await until(pilot, lambda: palette_top(app).startswith("Kill rank"), what="'Kill rank' on top of the palette")
        await pilot.press("enter")
        # The palette asks as the key does, once it has closed and run the command (a k while it
        # was still open went into its input on a loaded worker): a second k confirms.
        await until(pilot, lambda: app.screen is app.main and app.main._armed is not None, what="'Kill rank' asking")
        assert app.main._armed[:2] == ("kill_rank", 1)
        await pilot.press("k")
        await until(pilot, lambda: rank(app, 1).state == RankState.KILLED, what="palette killed rank 1")

    drive(app, body)


def test_compact_list_past_what_fits():
    """At 80x24 the 32 ranks' list scrolls: its header row (order and filter) stays on top. It
    was the list's first row, and a rank far down (31, or one sorted there) scrolled it away."""
    app = RanktopApp(FakeEngine(32))

    async def body(app, pilot):
        main = app.main
        assert main.compact
        assert main.query_one("#rank-list-box").display
        assert [r for r in range(32) if main.pane(r).display] == [0]
        await until(pilot, lambda: "31" in main.query_one(RankList).plain, what="all ranks listed")
        await pilot.press("down", "down")
        assert main.current == 2 and [r for r in range(32) if main.pane(r).display] == [2]
        await pilot.click("#rank-list", offset=(3, 5))  # row 0 is rank 0's: the header is above the list
        await until(pilot, lambda: main.current == 5, what="rank 5 picked")  # (its Picked may still be queued)
        await pilot.press("s", "s", "s", "3", "1")  # by quiet, then rank 31: the last row
        await until(pilot, lambda: screen_rows(app)[-2].startswith("▶31 running"), what="the list scrolled to 31")
        assert screen_rows(app)[1].startswith(" 32/32 by quiet  (s sort")
        first = int(screen_rows(app)[2].split()[0])  # the top rank row on screen, under the header
        assert first > 0  # scrolled
        await pilot.click(offset=(3, 2))
        await until(pilot, lambda: main.current == first, what="the clicked rank picked")
        assert screen_rows(app)[1].startswith(" 32/32 by quiet")

    drive(app, body, size=(80, 24))


@pytest.mark.parametrize(("n", "expected"), [(1, (1, 1)), (4, (2, 2)), (8, (4, 2)), (16, (4, 4)), (32, None),
                                             (64, None)])
def test_plan_grid_in_160x48(n, expected):
    assert plan_grid(n, 160, 46) == expected


def test_fake_nvml_values_reach_the_right_rank(tmp_path, monkeypatch):
    from ranktop.core.stats import StatsSampler

    monkeypatch.setenv("RANKTOP_FAKE_GPUS", "4")
    sampler = StatsSampler(interval=0.2)
    agent = ticker_agent(tmp_path, n=3, sampler=sampler)
    sampler.attach(agent)
    app = RanktopApp(LocalEngine(agent))

    async def body(app, pilot):
        # Device i reports util (35 + 20 i) % 100 and the rank's own 1.5 GiB + 256 MiB * LOCAL_RANK.
        # Three panes in 160 columns get the narrow title: "g2" for GPU 2.
        await until(pilot, lambda: " g2 75% 2.0G/80.0G" in title(app, 2), what="rank 2's fake GPU")
        assert " g0 35% 1.5G/80.0G" in title(app, 0)
        assert " g1 55% 1.8G/80.0G" in title(app, 1)
        assert "no GPU" not in app.main.query_one("#header").render().plain

    try:
        drive(app, body)
    finally:
        sampler.close()


def test_flood_every_byte_logged_and_keys_still_work(tmp_path):
    # 8 ranks print as fast as they can until the test says stop, then report how many lines they
    # wrote: the keys are pressed while every rank is still flooding, however slow the machine.
    stop = tmp_path / "stop"
    code = ("import os, sys, time\nend = time.time() + 60\nn = 0\nw = sys.stdout.write\n"
            f"while time.time() < end and not os.path.exists({str(stop)!r}):\n"
            "    for _ in range(200):\n        w(f'flood line {n} ' + 'x' * 60 + '\\n')\n"
            "        n += 1\nsys.stdout.flush()\nsys.stderr.write(f'TOTAL {n}\\n')\n")
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path / "logs", code, n=8)))

    async def body(app, pilot):
        await until(pilot, lambda: all(r.last_output_at for r in app.engine.snapshot().ranks), what="flood started")
        await pilot.press("3", "z")
        assert app.main.zoomed and app.main.current == 3
        assert all(r.state.alive for r in app.engine.snapshot().ranks)  # the keys acted mid-flood
        stop.touch()
        await until(pilot, lambda: app.ended, timeout=60, what="flood over")

    drive(app, body)
    attempt = Path(app.engine.agent.attempt_dir(0))
    for r in range(8):
        total = int((attempt / str(r) / "stderr.log").read_text().split()[-1])
        with open(attempt / str(r) / "stdout.log", "rb") as f:
            lines = f.read().splitlines()
        assert len(lines) == total and total >= 200
        assert lines[-1].startswith(f"flood line {total - 1} ".encode())


def test_sigterm_to_ranktop_stops_ranks_and_exits_143(tmp_path):
    app = RanktopApp(LocalEngine(ticker_agent(tmp_path)))

    async def body(app, pilot):
        app.stop_on_signal(signal.SIGTERM)  # what run_tui's handler calls
        await until(pilot, lambda: not app.is_running, what="app closed after SIGTERM")

    drive(app, body)
    assert app.exit_status == 128 + signal.SIGTERM
    wait_for(lambda: all(not r.state.alive for r in app.engine.snapshot().ranks), what="ranks gone")
