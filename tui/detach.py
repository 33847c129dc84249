"""Leaving a TUI run in the background, as `q` → detach offers.

A shell gives its prompt back only when the process it started exits, and the ranks must stay
children of the process that runs their engine. So before anything starts, the TUI process forks:
the parent (the pid the shell and any scheduler see) only waits, and passes on every signal it
gets; the child runs the engine and the TUI. On detach the child lets go of the terminal (its
stdio to /dev/null, a session of its own) and tells the parent, which exits 0: the prompt is
back and the run goes on, reachable with `ranktop attach`. Otherwise the parent exits with the
child's status, so `$?` is what it would have been without the fork. As PID 1 (a container's
command) the parent is the namespace's init: it reaps orphans, and stays after a detach.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import termios
import threading
from collections.abc import Iterator

from ranktop.core.guard import stat_fields
from ranktop.core.strays import prctl

DETACHED = signal.SIGRTMIN  # child -> parent: "I let go of the terminal"
DETACHED_FAILED = signal.SIGRTMIN + 1  # the same after the TUI failed: the parent exits 1, not 0
# parent -> child: a SIGINT the parent got, passed on. Not as SIGINT: one sent to both processes at
# once (the whole job) would reach the child twice, a second interrupt, which kills without the
# grace; the child takes one of each kind as one (core.signals.InterruptPairs).
PASSED_ON_INTERRUPT = signal.SIGRTMIN + 2
# Passed on when another process sends them (kill, a scheduler); Ctrl-C and Ctrl-\ from the
# terminal (outside the TUI's raw mode) reach the child from the terminal itself, once. A hang-up
# is always passed on: when we lead the session, the kernel tells only us.
_PASSED_ON = {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}
# SIGTSTP (Ctrl-Z outside raw mode, `kill -TSTP` to the job) must not stop this process before
# the child: the shell would take the terminal back while the TUI still restores it, the TUI
# would stop on SIGTTOU halfway and, resumed by `fg`, stop again for good. The child stops first
# (Textual gives the terminal back, then stops), and this process follows it (`_follow_stop`).
# It is not passed on: sent to the job, the child has it already, and a second one pending would
# suspend the TUI again right after `fg`.
_WAITED = _PASSED_ON | {signal.SIGCHLD, DETACHED, DETACHED_FAILED, signal.SIGTSTP}
_SI_KERNEL = 0x80  # siginfo's si_code for a signal the kernel raised (the terminal's)
_PR_SET_PDEATHSIG = 1


class Detacher:
    """The child's end: `release()` once the terminal is let go, and the waiting parent exits."""

    def __init__(self, parent: int) -> None:
        self._parent: int | None = parent

    def release(self, failed: bool = False) -> None:
        """`failed`: the TUI failed and the run went on without it; the shell sees 1, not 0."""
        _on_parent_death(0)  # the parent is about to leave, as asked
        # Only to the parent that waits: once it is gone our new parent is a subreaper or init.
        if self._parent is not None and os.getppid() == self._parent:
            os.kill(self._parent, DETACHED_FAILED if failed else DETACHED)
        self._parent = None


def hold_terminal() -> Detacher | None:
    """Fork: in the child, return its Detacher; the parent never returns (it exits as the child
    does, or with 0 when the child detaches). None, and no fork, where forking is not safe
    (threads already running)."""
    if _threads() > 1:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    modes = _terminal_modes()
    # Before the fork: nothing is missed, and the child has its handler for what is passed on
    # before one can come (its default action would end it).
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED | {PASSED_ON_INTERRUPT})
    pid = os.fork()
    if pid == 0:
        signal.signal(PASSED_ON_INTERRUPT, _interrupted_through_the_parent)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        _on_parent_death(signal.SIGHUP)  # the parent killed (SIGKILL): detach, as on a hang-up
        return Detacher(parent)
    code = _wait_for(pid)
    if code < 0:  # killed (kill -9 of the pid ranktop ls shows, the OOM killer): it left the terminal as it was
        _give_terminal_back(modes)
        print(f"ranktop: the TUI and its engine (pid {pid}) were killed by {signal.Signals(-code).name}; "
              "the orphan guard stops the ranks", file=sys.stderr, flush=True)
    os._exit(128 - code if code < 0 else code)


def _interrupted_through_the_parent(_signum: int, _frame: object) -> None:
    """Until the run handles them: a SIGINT passed on is a SIGINT, as this process takes one now
    (a KeyboardInterrupt while ranktop loads; nothing where it is ignored)."""
    signal.raise_signal(signal.SIGINT)


def _threads() -> int:
    """This process's threads as the kernel counts them: C++ ones too (torch's TCPStore server),
    which `threading` does not know of. A fork keeps only the forking thread, and the locks the
    others held (Python 3.12 warns of such a fork: DeprecationWarning, `-W default`)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _wait_for(child: int) -> int:
    """The child's exit code once it exits (-N: killed by signal N), or once it detaches 0 (1
    where its TUI had failed).

    As PID 1 (a container's command: `docker run -it ... ranktop`) this process is the
    namespace's init: it reaps every orphan the namespace gives it, and a detach does not end
    it, since the kernel would take the namespace, the run's engine and ranks included, with it."""
    init = os.getpid() == 1
    while True:
        info = signal.sigwaitinfo(_WAITED)
        if info.si_signo == signal.SIGCHLD:
            status = _reap(child, every=init)
            if status is not None and os.WIFSTOPPED(status):
                _follow_stop(child, init)
            elif status is not None:
                return os.waitstatus_to_exitcode(status)
        elif info.si_signo == signal.SIGTSTP:
            continue
        elif info.si_signo in (DETACHED, DETACHED_FAILED):
            if info.si_pid == child and not init:
                return 0 if info.si_signo == DETACHED else 1
            if info.si_pid == child:
                print("ranktop: as PID 1 this process stays until the run ends: the container would end "
                      "with it", file=sys.stderr, flush=True)
        elif info.si_pid != child and (info.si_code != _SI_KERNEL or info.si_signo == signal.SIGHUP):
            try:
                os.kill(child, PASSED_ON_INTERRUPT if info.si_signo == signal.SIGINT else info.si_signo)
            except ProcessLookupError:
                pass


def _follow_stop(child: int, init: bool) -> None:
    """The child (the TUI) stopped for job control (Ctrl-Z): stop too, so that the shell sees its
    job stopped and gives its prompt back; once continued (`fg`, `bg` or `kill -CONT`), see that
    the child is too (a CONT sent to this pid alone would leave it stopped)."""
    if init:  # PID 1 cannot stop itself; the container's shell, if any, sees the child
        return
    os.kill(os.getpid(), signal.SIGSTOP)
    if (stat_fields(child) or [b""])[0] == b"T":  # still stopped
        try:
            os.kill(child, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _reap(child: int, every: bool) -> int | None:
    """The child's wait status if it has exited or stopped (job control); with `every`, each other
    exited child (an orphan given to init) is reaped on the way."""
    while True:
        try:
            pid, status = os.waitpid(-1 if every else child, os.WNOHANG | os.WUNTRACED)
        except ChildProcessError:
            return None
        if pid == child:
            return status
        if pid == 0:
            return None


# What Textual's driver undoes on its way out: the alternate screen, mouse and focus reporting,
# bracketed paste, in-band resize reports, the kitty keyboard protocol, the hidden cursor, and
# line wrap, which it turns off (left off, the shell's long lines were cut at the right edge).
_TUI_MODES_OFF = ("\x1b[?1000l\x1b[?1003l\x1b[?1015l\x1b[?1006l\x1b[?1016l\x1b[?2004l\x1b[?2048l\x1b[?1004l"
                  "\x1b[<u\x1b[?1049l\x1b[?25h\x1b[?7h")


def _terminal_modes() -> list | None:
    """The terminal's modes before the TUI changes them (raw input, no echo); None without one."""
    try:
        return termios.tcgetattr(0)
    except (termios.error, OSError):
        return None


def _give_terminal_back(modes: list | None) -> None:
    """The terminal as the TUI found it, for a TUI that could not leave it so (it was killed)."""
    try:
        terminal = next((fd for fd in (2, 1) if os.isatty(fd)), None)  # where the TUI drew
        if terminal is not None:
            os.write(terminal, _TUI_MODES_OFF.encode())
        if modes is not None:
            termios.tcsetattr(0, termios.TCSADRAIN, modes)
    except (termios.error, OSError):  # the terminal went too: nothing to give back
        pass


def _on_parent_death(signum: int) -> None:
    prctl(_PR_SET_PDEATHSIG, int(signum))


WEB_SERVER = "RANKTOP_WEB_SERVER"  # in a `ranktop web` tab's attach client: the pid of the server that started it


def leave_with_the_web_server() -> None:
    """In a `ranktop web` tab's attach client: a hang-up (leave as `d` does) when the server dies
    (SIGKILLed, OOM-killed), as its stop hangs up each client. Textual's web driver does not end at
    its input's end: the client ran on, orphaned, for good, one of the run's clients."""
    server = os.environ.pop(WEB_SERVER, None)
    if server is None:
        return
    _on_parent_death(signal.SIGHUP)
    if str(os.getppid()) != server:  # it died before we asked
        os.kill(os.getpid(), signal.SIGHUP)


def terminal_alive() -> bool:
    """Whether our terminal still answers: one that hung up fails every call (EIO). A SIGHUP
    may come while it lives: from the waiting parent's death (SIGKILLed), or a kill -HUP."""
    return _terminal_error() is None


def terminal_hung_up() -> bool:
    """Whether our terminal hung up (EIO), not merely absent (stderr no terminal: ENOTTY)."""
    return _terminal_error() == errno.EIO


def _terminal_error() -> int | None:
    """The errno asking stderr's terminal for its modes fails with; None where it answers."""
    try:
        termios.tcgetattr(2)
    except termios.error as exc:
        return exc.args[0]
    except OSError as exc:
        return exc.errno
    return None


def in_foreground(fd: int = 0) -> bool:
    """Whether this process's job holds terminal `fd` (asking does not stop a job in the background)."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


@contextlib.contextmanager
def from_the_background() -> Iterator[None]:
    """Write to the terminal even where another job holds it (a stop came while the TUI was
    suspended): a terminal set to `stty tostop` stops a background writer with SIGTTOU, and
    this one would stay stopped. Ignored only for the while: ranks started later inherit it."""
    if in_foreground():
        yield
        return
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTTOU, previous)


def detach_terminal(stdin: bool = False) -> None:
    """The terminal hung up: send what Textual still writes (its shutdown sequence) to /dev/null,
    so a write to the dead terminal cannot wedge its writer thread and keep us from exiting.
    `stdin` too once Textual's input thread is gone, so that nothing of ours holds the terminal."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2) if stdin else (1, 2):
        try:
            os.dup2(devnull, fd)
        except OSError:
            pass
    os.close(devnull)
