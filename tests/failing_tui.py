"""`python tests/failing_tui.py ARGS` is `ranktop ARGS` with a bug planted in its TUI: `z` raises.
For the tests of what a run does when the TUI that shows it fails (it goes on without it)."""

import sys

from ranktop.tui import main_screen
from ranktop.tui.cli import main


def _fail(self) -> None:
    raise RuntimeError("a bug at z")


main_screen.MainScreen.action_zoom = _fail
sys.exit(main())
