"""`o`: a rank's log files in the user's $PAGER, run as a shell runs a job in the foreground.

The pager gets a process group of its own and the terminal's foreground, for as long as it runs.
It used to run in ranktop's own group, so the terminal's Ctrl-C (the way out of less's `F`, or
of a search) reached ranktop too, which took it for the user's stop and stopped the run; Ctrl-\\
did the same, and Ctrl-Z stopped ranktop, engine and all, with no shell to resume it. Now those
reach the pager alone. A pager that stops itself (less's Ctrl-Z) is given the terminal back and
continued: there is no shell here to take it over. A stop of ranktop (SIGTERM to it) ends the pager
(end_pager), so that the TUI comes back and leaves as the stop says.
"""

from __future__ import annotations

import os
import shlex
import signal
import termios
from collections.abc import Iterator
from contextlib import contextmanager


class _Pager:
    """The pager run_in_front waits for, while it runs (one at a time: the TUI waits on it)."""

    pid: int | None = None  # (and its group's id: posix_spawnp's setpgroup=0 gives it one of its own)
    ended = False  # end_pager sent it SIGTERM already


def pager_argv(paths: list[str]) -> list[str]:
    """$PAGER (`less` if unset or blank) split as a shell would, then `paths`; ValueError where it
    cannot be split (`PAGER='less "-R'`: No closing quotation)."""
    return [*(shlex.split(os.environ.get("PAGER") or "less") or ["less"]), *paths]


def run_in_front(argv: list[str]) -> str | None:
    """Run `argv` on our terminal as a job of its own in the foreground, until it exits; None, or
    why it could not be run (`No such file or directory`). Where we do not hold the terminal's
    foreground (no terminal), it is waited for all the same. end_pager ends it."""
    fd = _our_terminal()
    modes = _modes_of(fd)  # as the TUI left them for the pager: the shell's, from before ranktop
    try:
        # As subprocess starts a child: SIGPIPE and SIGXFSZ, which Python ignores, back to their
        # defaults (`yes | head` in a pager script would go on writing into a closed pipe), no
        # signal blocked.
        pid = os.posix_spawnp(argv[0], argv, os.environ, setpgroup=0, setsigmask=(),
                              setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except OSError as exc:
        return exc.strerror or str(exc)
    _Pager.pid, _Pager.ended = pid, False
    try:
        if fd is None:
            os.waitpid(pid, 0)
            return None
        _wait_in_front(fd, pid, modes)
        return None
    finally:
        _Pager.pid = None


def end_pager() -> None:
    """Ranktop is asked to stop (or leave) while the TUI waits on a pager: SIGTERM to the pager,
    and SIGCONT for one stopped; a second ask, SIGKILL, for a pager that does not end on SIGTERM.
    The TUI waited for the pager's exit, however long, the run stopped behind it. Safe from a
    signal handler (it only sends signals)."""
    pid = _Pager.pid
    if pid is None:
        return
    sigs = (signal.SIGKILL,) if _Pager.ended else (signal.SIGTERM, signal.SIGCONT)
    _Pager.ended = True
    for sig in sigs:
        try:
            os.killpg(pid, sig)  # what it started too (a $PAGER script's less)
        except OSError:  # (it is gone: it exited already)
            return


def _wait_in_front(fd: int, pid: int, modes: list | None) -> None:
    """Wait for `pid`, its group in the terminal's foreground meanwhile, then ours again, and the
    terminal's `modes` as they were before it, as a shell puts them back after a job. A pager
    that left them raw (killed, or a script's `stty raw`) had the TUI take raw modes for the
    ones to give back: every later pager ran raw, where Enter ends no line and Ctrl-C sends
    no signal (one that read a line waited for ever), and so did the shell after ranktop."""
    try:
        _give_terminal(fd, pid)
        while True:
            _, status = os.waitpid(pid, os.WUNTRACED)
            if not os.WIFSTOPPED(status):
                return
            _give_terminal(fd, pid)  # it stopped itself (Ctrl-Z): on again, in front
    finally:
        with _quiet_from_the_background():  # the pager's group held the terminal: ours is in the background
            os.tcsetpgrp(fd, os.getpgrp())
            if modes is not None:
                try:
                    termios.tcsetattr(fd, termios.TCSADRAIN, modes)
                except termios.error:  # (the terminal hung up meanwhile)
                    pass


def _give_terminal(fd: int, pid: int) -> None:
    """The terminal's foreground to `pid`'s group, which goes on: it may have stopped (SIGTTIN,
    SIGTTOU) on touching the terminal before it was in front."""
    with _quiet_from_the_background():
        try:
            os.tcsetpgrp(fd, pid)
        except OSError:  # (its group is gone: it exited already)
            return
    try:
        os.killpg(pid, signal.SIGCONT)
    except OSError:
        pass


def _modes_of(fd: int | None) -> list | None:
    if fd is None:
        return None
    try:
        return termios.tcgetattr(fd)
    except termios.error:
        return None


def _our_terminal() -> int | None:
    """A descriptor of the terminal whose foreground job we are, or None."""
    for fd in (0, 2, 1):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return fd
        except OSError:
            continue
    return None


@contextmanager
def _quiet_from_the_background() -> Iterator[None]:
    """tcsetpgrp from a background group is answered with SIGTTOU, which stops the process,
    unless the signal is blocked: blocked here, in this thread alone (ignoring it instead would
    be inherited by a rank started meanwhile)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTTOU})
