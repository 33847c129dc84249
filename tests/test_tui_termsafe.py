"""Rank-supplied text in the TUI (Pilot, real ranks): the header's script name, the root-cause
panel's error.json message and traceback, the rank's output pane. What reaches the widgets has no
escape sequence and no control character, and is never read as Rich markup."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import drive, make_agent, until
from ranktop.core.agent import LocalAgent
from ranktop.core.engine import LocalEngine
from ranktop.core.spec import WorkerSpec
from ranktop.core.stacks import find_py_spy
from ranktop.tui.app import RanktopApp
from ranktop.tui.stacks_view import StacksScreen
from textual.geometry import Region

pytestmark = pytest.mark.timeout(60)

PAYLOAD = "cHduZWQ="  # base64 "pwned": what an OSC 52 clipboard write would carry
HOSTILE = "\\x1b]52;c;" + PAYLOAD + "\\x07\\x1b]0;EVIL-TITLE\\x07\\x1b[2J[link=http://evil]markup[/link]"
# Rank 0 prints the hostile text, then fails through @record, so error.json's message and
# traceback carry it too. It is named on a line of its own: Python 3.13's tracebacks show the
# source lines of `-c` code too, and the line that raised showed the payload's harmless text
# (`\x1b]52;c;cHduZWQ=`, a backslash and letters), which the checks below cannot tell apart.
FAILER = (
    "from ranktop.core.errors import record\n"
    f"HOSTILE = '{HOSTILE}'\n"
    "@record\ndef main():\n"
    "    print('out:' + HOSTILE + '\\x1b[31mred\\x1b[0m', flush=True)\n"
    "    raise ValueError('boom:' + HOSTILE)\n"
    "main()\n"
)
SCRIPT_NAME = "train\x1b]0;EVIL-TITLE\x07\x1b]52;c;" + PAYLOAD + "\x07[bold]x[/bold].py"
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def painted(widget) -> tuple[str, list]:
    """What the widget hands the compositor: its text, and the styles of its segments."""
    size = widget.size
    strips = widget.render_lines(Region(0, 0, size.width, size.height))
    segments = [segment for strip in strips for segment in strip]
    return "".join(segment.text for segment in segments), [segment.style for segment in segments]


def assert_safe(text: str, styles: list) -> None:
    assert not _CONTROL.findall(text), f"control characters reach the terminal: {text!r}"
    assert PAYLOAD not in text and "EVIL-TITLE" not in text
    assert not any(style is not None and style.link for style in styles), "a rank made a hyperlink"


def test_header_root_cause_and_pane_show_rank_text_safely(tmp_path):
    app = RanktopApp(LocalEngine(make_agent(tmp_path, FAILER, 1, name=SCRIPT_NAME, stall_timeout=60.0)))

    async def body(app, pilot):
        await until(pilot, lambda: app.main.ended and "boom:" in app.main.query_one("#root-cause-text").render().plain
                    and app.main.pane(0).log.line_count, what="group failed, its root cause and output shown")
        header = app.main.query_one("#header")
        text, styles = painted(header)
        assert_safe(text, styles)
        assert "train[bold]x[/bold].py" in text  # markup shown as typed, not applied

        panel = app.main.query_one("#root-cause-text")
        text, styles = painted(panel)
        assert_safe(text, styles)
        plain = panel.render().plain
        assert "ValueError: boom:[link=http://evil]markup[/link]" in plain
        assert "out:[link=http://evil]markup[/link]red" in plain
        assert not _CONTROL.findall(plain.replace("\n", ""))

        log = app.main.pane(0).log
        text, styles = painted(log)
        assert_safe(text, styles)
        assert "out:[link=http://evil]markup[/link]red" in text
        # (the rank's stdout line: its traceback on stderr may have been read before it)
        out_line = next(raw for raw in log._lines if raw.startswith(b"out:"))
        (red,) = [s for s in log._render_raw(out_line, 0)[0] if s.text == "red"]
        assert red.style.color is not None and red.style.color.name == "color(1)", "the rank's colour is kept"
        await pilot.press("q")

    drive(app, body)
    assert app.exit_status == 1


# A rank at a hostile file name, with a thread named with escape sequences: py-spy reports both raw.
WAITER = (
    "import subprocess, sys, threading, time\n"
    # a child process that names itself (its comm, 15 bytes) to retitle the terminal: the view
    # names a rank's children
    "child = subprocess.Popen([sys.executable, '-c', 'import ctypes, time; "
    "ctypes.CDLL(None).prctl(15, b\"\\\\x1b]0;EVIL-TITLE\\\\x07\", 0, 0, 0); time.sleep(3600)'])\n"
    "while not open(f'/proc/{child.pid}/comm', 'rb').read().startswith(b'\\x1b'):\n    time.sleep(0.01)\n"
    f"threading.Thread(target=time.sleep, args=(3600,), daemon=True, name='t\\x1b]52;c;{PAYLOAD}\\x07x').start()\n"
    "def wait_here():\n    time.sleep(3600)\n"
    "print('ready', flush=True)\nwait_here()\n"
)


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_stack_view_shows_hostile_file_and_thread_names_safely(tmp_path):
    script = tmp_path / f"w\x1b]0;EVIL-TITLE\x07\x1b]52;c;{PAYLOAD}\x07.py"
    script.write_text(WAITER)
    spec = WorkerSpec(role="default", local_world_size=1, entrypoint=sys.executable, args=("-u", str(script)),
                      name="waiter.py")
    app = RanktopApp(LocalEngine(LocalAgent(spec, log_dir=str(tmp_path / "logs"), console=False, shutdown_timeout=2.0)))

    async def body(app, pilot):
        await until(pilot, lambda: app.main.pane(0).log.line_count, what="rank ready")
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None,
                    what="stack report")
        screen = app.screen
        assert screen.report.ranks[0].status.value == "ok", screen.report.ranks[0]
        for show_threads in (False, True):
            if show_threads:
                await pilot.press("t")
            await until(pilot, lambda want=show_threads: (groups := screen.query(".stack-group")) and all(
                w.has_class("thread") == want and w.size.height for w in groups), what="the view redrawn")
            texts = [painted(widget) for widget in screen.query("Static, Tree")]
            for text, styles in texts:
                assert_safe(text, styles)
            shown = "".join(text for text, _ in texts)
            # the other threads' view: the call tree is the selected thread's, titled with its name
            assert ("Thread.run" in shown and "thread 't" in shown) if show_threads else (
                "wait_here" in shown and "w.py" in shown)
            assert show_threads or re.search(r"child \d+", shown), shown  # the child named (its name cleaned away)
            titles = [str(widget.border_title or "") for widget in screen.query(".stack-group")]
            assert not any(_CONTROL.findall(title) or PAYLOAD in title for title in titles), titles
        await pilot.press("escape", "q", "y")

    drive(app, body)
