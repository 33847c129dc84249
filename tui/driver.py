"""Textual's Linux driver, told when its terminal has gone.

A terminal that dies without a SIGHUP reaching ranktop (the shell ignored it: `trap '' HUP`,
zsh's NO_HUP, a wrapper that does not pass it on) fails every write with EIO. Textual's writer
thread dies of the first one, its queue of 30 writes fills, and the app's next write waits
forever: the TUI wedged, its input thread spinning on the dead terminal, and the process never
exited, not even on SIGTERM. Here a failed write is dropped and reported once, and the app
leaves as on a hang-up.

Two more things it takes from the terminal itself rather than the environment: the screen is
drawn in UTF-8 whatever the locale says (`LC_ALL=C` with `PYTHONUTF8=0`, `PYTHONIOENCODING=ascii`,
a Latin-1 locale: the frame came out as `\\u2588` escapes, one cell each counted as six), and
its size is the terminal's, not `COLUMNS`/`LINES` (an exported value drew the TUI in a corner
and never followed a resize).

A bracketed paste reaches the app as one paste, whatever it holds (TerminalInput): Textual's
parser ended it at an ESC in it, and took the rest for keys.

And job control: suspended (Ctrl-Z), the TUI stays off the terminal until its job is in the
foreground again. The engine runs in this process, so a process that job control woke in the
background (`bg`, or `kill %1`: SIGTERM then SIGCONT) must run on: Textual's own resume touched
the terminal there, and SIGTTOU stopped the process again, engine and all; its way out (the
terminal's modes restored once more) did the same, so a stop never ended the run.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import os
import signal
import termios
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from ranktop.tui.detach import from_the_background, in_foreground
from textual.drivers import linux_driver
from textual.drivers.linux_driver import LinuxDriver

_PASTE_START, _PASTE_END = "\x1b[200~", "\x1b[201~"  # a bracketed paste's marks, as the terminal sends them
PASTED_ESC = "\ufdd0"  # an ESC inside a bracketed paste, as Textual's parser is given it (a noncharacter)


class TerminalInput:
    """The decoder Textual's input thread reads the terminal with (`decode` is all it calls).

    It drops a byte that is not UTF-8 (a Latin-1 paste, a meta key sent as an 8-bit byte, 0xff):
    Textual's decodes strictly, and the UnicodeDecodeError ended its input thread in a panic,
    which ended the TUI and stopped the run; the keys around such a byte come through.

    And it hands each ESC inside a bracketed paste on as PASTED_ESC, which the app's paste
    handler (tui/app.py, pasted_text) takes back to ESC and drops with its sequence. Textual's
    parser took such an ESC for the start of a key sequence: the paste ended there, and the rest
    of it came as keys, an enter among them (`i`'s box sent each pasted line to the rank, unseen)
    and Ctrl-C (the stop question). An ESC at the end of a read that may begin the paste's end
    waits for the next read."""

    def __init__(self, encoding: str) -> None:
        self._decode = codecs.getincrementaldecoder(encoding)(errors="ignore").decode
        self._in_paste = False
        self._held = ""  # inside a paste, the start of its end mark that the read ended in
        self._seen = ""  # the last characters handed on outside a paste (a paste's start mark can be cut)

    def decode(self, data: bytes, final: bool = False) -> str:
        text, self._held = self._held + self._decode(data, final), ""
        out, at = [], 0
        while at < len(text):
            if not self._in_paste:
                found = (self._seen + text[at:]).find(_PASTE_START)
                if found < 0:
                    out.append(text[at:])
                    break
                end = at + found - len(self._seen) + len(_PASTE_START)
                out.append(text[at:end])
                at, self._in_paste, self._seen = end, True, ""
                continue
            escape = text.find("\x1b", at)
            if escape < 0:
                out.append(text[at:])
                break
            out.append(text[at:escape])
            if text.startswith(_PASTE_END, escape):
                out.append(_PASTE_END)
                at, self._in_paste = escape + len(_PASTE_END), False
            elif _PASTE_END.startswith(text[escape:]) and not final:
                self._held = text[escape:]
                break
            else:
                out.append(PASTED_ESC)
                at = escape + 1
        shown = "".join(out)
        if not self._in_paste:
            self._seen = (self._seen + shown)[-len(_PASTE_START) :]
        return shown


def _terminal_input(encoding: str) -> Callable[[], TerminalInput]:
    return functools.partial(TerminalInput, encoding)


linux_driver.getincrementaldecoder = _terminal_input  # (looked up as its input thread starts)


class TerminalFile:
    """The driver's output file: UTF-8 bytes to the terminal, and a write or flush that fails
    calls `lost` (once) instead of raising."""

    def __init__(self, file: IO[str], lost: Callable[[], None]) -> None:
        self._file = file
        self._lost = lost
        self._reported = threading.Event()
        # Bytes go to the binary buffer below the text layer, flushed first so nothing overtakes.
        self._bytes = getattr(file, "buffer", None)
        self.flush()

    def write(self, text: str) -> None:
        try:
            if self._bytes is None:
                self._file.write(text)
            else:  # (a lone surrogate, from a file name not in UTF-8, is one cell: so is '?')
                self._bytes.write(text.encode("utf-8", "replace"))
        except (OSError, ValueError):
            self._report()

    def flush(self) -> None:
        try:
            (self._bytes or self._file).flush()
        except (OSError, ValueError):
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

    class HangupAwareDriver(TerminalDriver):
        def __init__(self, app: Any, **kwargs: Any) -> None:
            super().__init__(app, **kwargs)
            self._file = TerminalFile(self._file, lost)

    return HangupAwareDriver


class TerminalDriver(LinuxDriver):
    """Textual's Linux driver, sized by the terminal itself and kept off it while its job is
    suspended or in the background."""

    def _get_terminal_size(self) -> tuple[int, int]:
        try:  # the terminal drawn on (stderr), asked directly: COLUMNS/LINES are only for the ranks
            width, height = os.get_terminal_size(self._file.fileno())
        except (OSError, ValueError):
            return super()._get_terminal_size()
        return (width or 80, height or 25)

    # ----- job control --------------------------------------------------------------------------
    _suspended = False  # Ctrl-Z gave the terminal back to the shell, and it is not taken again
    _leaving = False  # the app shuts down while suspended
    _watcher: threading.Thread | None = None
    _modes: list[Any] | None = None  # the terminal's modes as the TUI set them

    def _sigtstp_application(self, *_: Any) -> None:
        """SIGTSTP (Ctrl-Z, `kill -TSTP`): Textual gave the terminal back and stopped the process
        from within this handler, which runs wherever the main thread was. Midway through a frame's
        write it held the writer's queue lock, and the handler's own first write waited for that
        lock for ever: the TUI hung, never stopped, and the shell never had its prompt back. The
        app's event loop does it instead, between two of its steps; the process stops there."""
        if not (self._auto_restart and self._on_loop(super()._sigtstp_application)):
            # (App.suspend lent the terminal to another program: stopping is all; and once the
            # app has left, there is no screen to give back)
            os.kill(os.getpid(), signal.SIGSTOP)

    def _sigcont_application(self, *_: Any) -> None:
        """SIGCONT: the screen is taken back on the event loop too, for the same reason."""
        if self._auto_restart:
            self._on_loop(self._continued)

    def _continued(self) -> None:
        """Back from a stop: the screen is started again only if Ctrl-Z took it away. A SIGCONT that
        followed no suspend (`kill -STOP` then `kill -CONT`, or a CONT alone) started it all over as
        it ran: a second input thread read the keyboard, the modes kept for the exit were the TUI's
        own raw ones (the shell was left without echo), and at the exit the process waited for the
        first input thread until a key came, and lost that key."""
        if not self._auto_restart:  # (App.suspend began meanwhile: it starts the screen itself)
            return
        if self._suspended:
            super()._sigcont_application()
        elif self._drawing() and self._terminal_taken():
            # Stopped (SIGSTOP) while drawing, and a shell took the terminal meanwhile: as after a
            # Ctrl-Z, the screen goes and comes back once the job is in front (now, after `fg`).
            self._let_go()
            self.start_application_mode()

    def _terminal_taken(self) -> bool:
        """Whether another job holds the terminal, or has set its modes (the shell, at the stop)."""
        try:
            modes = termios.tcgetattr(self.fileno)
        except termios.error:  # (no terminal to take)
            return False
        return modes != self._modes or not in_foreground(self.fileno)

    def _let_go(self) -> None:
        """Off the terminal as a suspend leaves it, without a word to it: it is the shell's (modes set
        from the background would stop the process, SIGTTOU)."""
        signal.signal(signal.SIGWINCH, signal.SIG_DFL)
        self.exit_event.set()
        if self._key_thread is not None:
            self._key_thread.join()
        self.exit_event.clear()
        with from_the_background():  # (what the writer still holds: `stty tostop` would stop it)
            self.close()
        self._suspended = True
        self._must_signal_resume = True  # (the app redraws every row once back)

    def _on_loop(self, work: Callable[[], object]) -> bool:
        """Whether `work` will run on the app's event loop (safe from a signal handler: it takes no lock)."""
        if not self._loop.is_running():
            return False
        try:
            self._loop.call_soon_threadsafe(work)
        except RuntimeError:  # (closed meanwhile: the app has left)
            return False
        return True

    def suspend_application_mode(self) -> None:
        if not self._suspended:  # (a second SIGTSTP, sent to a job in the background)
            super().suspend_application_mode()
            self._suspended = True

    def start_application_mode(self) -> None:
        if self._suspended and not in_foreground(self.fileno):
            # Woken in the background (`bg`, a stop's SIGCONT): stay off the terminal and run on
            # (the engine is here); the screen comes back once the job is in front again.
            self._watch_for_foreground()
            return
        self._suspended = False
        super().start_application_mode()
        if not self._drawing():  # it found the job in the background after all (SIGTTOU), and stopped
            self._suspended = True
        with contextlib.suppress(termios.error):  # (the TUI's own modes: a stop's SIGCONT compares)
            self._modes = termios.tcgetattr(self.fileno)

    def _drawing(self) -> bool:
        return self._writer_thread is not None and self._writer_thread.is_alive()

    def stop_application_mode(self) -> None:
        if not self._suspended:  # (suspended, the terminal was given back already)
            super().stop_application_mode()

    def disable_input(self) -> None:
        if self._suspended:  # the app leaves (its input stopped at the suspend; a flush would touch the terminal)
            self._leaving = True
        else:
            super().disable_input()

    def write(self, data: str) -> None:
        if self._drawing():  # (suspended, its writer is gone: a frame would wait forever)
            super().write(data)

    def _watch_for_foreground(self) -> None:
        """`fg` on a job that runs sends no SIGCONT: the terminal's foreground job is watched."""
        loop = getattr(self._app, "_loop", None)
        if loop is not None and not (self._watcher is not None and self._watcher.is_alive()):
            self._watcher = threading.Thread(target=self._wait_for_foreground, args=(loop,), daemon=True,
                                             name="ranktop-foreground")
            self._watcher.start()

    def _wait_for_foreground(self, loop: Any) -> None:
        while self._suspended and not self._leaving:
            if in_foreground(self.fileno):
                with contextlib.suppress(RuntimeError):  # (the loop closed: the app has left)
                    loop.call_soon_threadsafe(self._back_in_front)
                return
            time.sleep(0.2)

    def _back_in_front(self) -> None:
        if self._suspended and not self._leaving:
            self.resume_application_mode()
