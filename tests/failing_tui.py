"""`python tests/failing_tui.py ARGS` is `ranktop ARGS` with a bug planted in its TUI: `z` raises.
With RANKTOP_TEST_FAIL_AS_IT_CLOSES set, the app's shutdown raises too, after `z`'s error was
handled: an error that comes out of Textual's `App.run()` itself. For the tests of what a run
does when the TUI that shows it fails (it goes on without it)."""

import os
import sys

from ranktop.tui import main_screen
from ranktop.tui.app import RanktopApp
from ranktop.tui.cli import main


def _fail(self) -> None:
    raise RuntimeError("a bug at z")


main_screen.MainScreen.action_zoom = _fail

if os.environ.get("RANKTOP_TEST_FAIL_AS_IT_CLOSES"):
    _shutdown = RanktopApp._shutdown

    async def _fail_as_it_closes(self) -> None:
        await _shutdown(self)
        raise RuntimeError("a bug as it closed")

    RanktopApp._shutdown = _fail_as_it_closes

sys.exit(main())
