"""Textual's Linux driver, told when its terminal has gone.

A terminal that dies without a SIGHUP reaching ranktop (the shell ignored it: `trap '' HUP`,
zsh's NO_HUP, a wrapper that does not pass it on) fails every write with EIO. Textual's writer
thread dies of the first one, its queue of 30 writes fills, and the app's next write waits
forever: the TUI wedged, its input thread spinning on the dead terminal, and the process never
exited, not even on SIGTERM. Here a failed write is dropped and reported once, and the app
leaves as on a hang-up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import IO, Any

from textual.drivers.linux_driver import LinuxDriver


class TerminalFile:
    """The driver's output file: a write or flush that fails calls `lost` (once) instead of raising."""

    def __init__(self, file: IO[str], lost: Callable[[], None]) -> None:
        self._file = file
        self._lost = lost
        self._reported = threading.Event()

    def write(self, text: str) -> None:
        try:
            self._file.write(text)
        except OSError:
            self._report()

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError:
            self._report()

    def fileno(self) -> int:
        return self._file.fileno()

    def isatty(self) -> bool:
        return self._file.isatty()

    def _report(self) -> None:
        if not self._reported.is_set():
            self._reported.set()
            self._lost()


def hangup_aware(driver: type, lost: Callable[[], None]) -> type:
    """`driver` itself unless it is Textual's Linux terminal driver (the web driver needs none of this)."""
    if driver is not LinuxDriver:
        return driver

    class HangupAwareDriver(LinuxDriver):
        def __init__(self, app: Any, **kwargs: Any) -> None:
            super().__init__(app, **kwargs)
            self._file = TerminalFile(self._file, lost)

    return HangupAwareDriver
