"""SVG screenshots of the main screens with deterministic content: ranks that print fixed lines
and then wait. We assert on the text the SVG carries (times and pids vary, so no pixel golden)."""

from __future__ import annotations

import asyncio
import html
import re
import sys

import pytest
from conftest import until
from ranktop.core.agent import LocalAgent
from ranktop.core.engine import LocalEngine
from ranktop.core.spec import WorkerSpec
from ranktop.tui.app import RanktopApp
from ranktop.tui.panes import RankPane
from ranktop.tui.screens import HelpScreen, SignalPicker

pytestmark = pytest.mark.timeout(60)

FIXED = ("import os, time\nr = os.environ['RANK']\nfor i in range(5):\n    print(f'rank {r} line {i}', flush=True)\n"
         "print('\\x1b[31mred text\\x1b[0m', flush=True)\n"
         "if r == '1' and os.environ.get('FAIL'):\n    raise SystemExit(3)\ntime.sleep(60)\n")


def screen_text(svg: str) -> str:
    """The characters of an exported SVG, in order (what a person reads off the screenshot)."""
    return html.unescape("".join(re.findall(r">([^<]*)</text>", svg))).replace("\xa0", " ")


def shoot(tmp_path, steps, *, n: int = 3, env=None, size=(120, 36)) -> list[str]:
    spec = WorkerSpec(role="default", local_world_size=n, entrypoint=sys.executable, args=("-u", "-c", FIXED),
                      name="fixed.py", env=env or {})
    agent = LocalAgent(spec, log_dir=str(tmp_path), console=False, shutdown_timeout=2.0)
    app = RanktopApp(LocalEngine(agent))
    shots: list[str] = []

    async def main():
        app.engine.start()  # the app is handed a running engine
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.main is not None and app.main.is_mounted, what="main screen")
            for step in steps:
                await step(app, pilot)
                shots.append(app.export_screenshot())

    asyncio.run(main())
    return shots


async def all_printed(app, pilot):
    await until(pilot, lambda: all(b"red text" in b"".join(app.engine.agent.output(r)) for r in range(app.main.n)),
                what="every rank printed")
    await until(pilot, lambda: all(pane.log.line_count >= len(app.engine.agent.output(pane.local_rank))
                                   for pane in app.main.query(RankPane) if pane.display),
                what="every pane shown polled its rank's lines")
    # (a title follows its rank's state at the next tick, which a loaded box can bring after the lines)
    await until(pilot, lambda: all(" running " in pane.title for pane in app.main.query(RankPane) if pane.display),
                what="every pane shown titled running")
    await pilot.pause()  # let the pending repaint land before the screenshot


def test_grid_help_and_picker_screens(tmp_path):
    async def help_screen(app, pilot):
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")

    async def picker(app, pilot):
        await pilot.press("escape", "2", "x")
        await until(pilot, lambda: isinstance(app.screen, SignalPicker), what="picker")

    grid, helps, pick = shoot(tmp_path, [all_printed, help_screen, picker])
    grid_text = screen_text(grid)
    assert "fixed.py" in grid_text and "world 3" in grid_text and "attempt_0" in grid_text
    for r in range(3):
        assert f" {r}/{r}  running " in grid_text and f"rank {r} line 4" in grid_text
    assert "red text" in grid_text and "#" in grid  # ANSI colour survives into the SVG's styles
    help_text = screen_text(helps)
    assert "ranktop keys" in help_text and "Restart group" in help_text and "Next match" in help_text
    pick_text = screen_text(pick)
    assert "Send a signal to rank 2 (local 2)" in pick_text
    assert all(name in pick_text for name in ("SIGINT", "SIGTERM", "SIGKILL", "SIGHUP", "SIGUSR1", "SIGUSR2",
                                              "SIGSTOP", "SIGCONT"))


def test_root_cause_screen(tmp_path):
    async def ended(app, pilot):
        panel = app.main.query_one("#root-cause")
        await until(pilot, lambda: app.main.ended and panel.display and panel.region.height > 0,
                    what="group failed, root-cause panel laid out")
        await pilot.pause()  # let the pending repaint land before the screenshot

    (shot,) = shoot(tmp_path, [ended], env={"FAIL": "1"})
    text = screen_text(shot)
    assert "ROOT CAUSE" in text and "rank 1 exit code 3 at " in text and "attempt_0 (pid " in text
    assert " 1/1  exit 3 " in text and "killed SIGTERM" in text
    assert " failed " in text  # the header's group state


def test_compact_screen_for_many_ranks(tmp_path):
    async def listed(app, pilot):
        await all_printed(app, pilot)
        await until(pilot, lambda: app.main.compact and "15" in app.main.query_one("#rank-list").render().plain
                    and "▶ 0 running" in app.main.query_one("#rank-list").render().plain, what="rank list")
        await pilot.pause()

    (shot,) = shoot(tmp_path, [listed], n=16, size=(100, 30))
    text = screen_text(shot)
    assert "▶ 0 running" in text and " 15 " in text  # the list, with the focused rank marked
    assert " 0/0  running" in text and " 1/1  running" not in text  # only the focused pane is shown
