"""One rank as an OS process: the only place where a rank is started, signalled and reaped.

Every rank is a session leader (start_new_session), so its pid is also its process group and
a signal to the group reaches everything the rank started. Popen without preexec_fn lets
CPython use vfork, which keeps starting many ranks cheap.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ranktop.core.guard import stat_fields
from ranktop.core.output import STDERR, STDOUT, OutputPump, StreamSink
from ranktop.core.strays import forget_own_child, note_own_child
from ranktop.core.value import Value

# `-c` puts the working directory first on sys.path (unless -P or -I, which the caller's flags may
# pass on); drop it so that nothing there can stand in for ranktop (the bootstrap restores the
# caller's sys.path before running the function).
_BOOTSTRAP = ("import sys; sys.path[:1] == [''] and sys.path.pop(0); "
              "from ranktop.core._bootstrap import main; main()")


class Launch(Value):
    """Everything needed to start one rank. `argv` is the full command line."""

    __slots__ = ("local_rank", "argv", "env", "sinks", "cwd", "pty", "stdin", "cpus")

    def __init__(self, local_rank: int, argv: list[str], env: dict[str, str], sinks: dict[int, StreamSink],
                 cwd: str | None = None, pty: tuple[int, int] | None = None, stdin: str = "null",
                 cpus: frozenset[int] | None = None) -> None:
        self.local_rank, self.argv, self.env, self.cwd = local_rank, argv, env, cwd
        self.sinks = sinks  # stream -> sink; a stream without one is inherited from us
        self.pty = pty  # (columns, rows): stdout and stderr go to one terminal, read into sinks[STDOUT]
        self.stdin = stdin  # "null": /dev/null; "inherit": ours (as torchrun); "pipe": typed through write_input
        self.cpus = cpus  # the CPU affinity it starts with (--numa-binding); None: ours


def _pipe_room(fd: int) -> float:
    """Bytes a write to pipe `fd` takes whole now, at least: its size less what is unread, counted
    in whole pages (the kernel keeps a pipe's bytes in pages, and a page partly read is still
    taken), and one page less for the last one's unused end. Unbounded where `fd` is no pipe."""
    try:
        size = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    except OSError:
        return float("inf")
    page = os.sysconf("SC_PAGE_SIZE")
    return max(0, size - -(-unread // page) * page - page)


def open_pty(columns: int, rows: int, typed: bool = False) -> tuple[int, int]:
    """A pseudo-terminal (master, slave) of the given size whose output arrives as written: no
    output processing, so a rank's '\n' is not turned into '\r\n' in its log file. `typed`: the
    UI types into it (the rank's stdin), so it echoes as a keyboard's terminal does; pdb's
    readline echoes only where the terminal did (with echo off the pane showed `(Pdb) ` and the
    answer, never the command)."""
    master, slave = os.openpty()
    try:
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST
        if typed:
            attrs[3] |= termios.ECHO
        else:  # nothing is typed into it; never echo if something were
            attrs[3] &= ~termios.ECHO
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    return master, slave


def python_call_argv(fn: Callable[..., Any], args: tuple, payload_path: str, result_path: str,
                     peers: list[tuple[str, str]] = (), start_method: str = "spawn") -> list[str]:
    """Command line that runs fn(*args) in a fresh interpreter, like multiprocessing's spawn.

    The function and its arguments are pickled to `payload_path`; the return value comes back
    through `result_path`, a file rather than a pipe, so a large result can never deadlock.
    `peers`: (result path, exit marker) of each other rank of the group, which the rank waits on
    after its function returned (see _bootstrap.wait_for_peers). `start_method` names the
    multiprocessing child it passes for (see core/mp_identity.py).
    """
    from ranktop.core.mp_identity import next_identity

    main = sys.modules.get("__main__")
    from_main = getattr(fn, "__module__", None) == "__main__"
    prep = {
        "sys_path": list(sys.path),
        "sys_argv": list(sys.argv),  # spawn's and fork's ranks see the caller's: argparse in fn reads it
        "cwd": os.getcwd(),
        # A function defined in the caller's script pickles as __main__.fn: the child must load
        # that script (as __mp_main__, so its `if __name__ == "__main__"` block stays quiet), by
        # its module name where it was run as `python -m pkg.mod`, as spawn loads it.
        "main_path": getattr(main, "__file__", None) if from_main else None,
        "main_name": _main_module_name(main) if from_main else None,
        "peers": list(peers),
        "process": next_identity(start_method),
    }
    import pickle  # function ranks only: a command line's start does not pay for it

    with open(payload_path, "wb") as f:
        pickle.dump(prep, f)
        _dump_call(fn, args, f)
    return [sys.executable, *_rank_interpreter_flags(), "-c", _BOOTSTRAP, payload_path, result_path]


def check_sendable(fn: Callable[..., Any], args: Mapping[int, Any]) -> None:
    """Raise, as a rank's start would, where `fn` or a rank's arguments cannot be sent to a new
    process, before its caller makes anything: pickled into nothing (one more pass, no copy kept)."""

    class Discard:
        def write(self, data: bytes) -> int:
            return len(data)

    for r in sorted(args):
        _dump_call(fn, args[r], Discard())


def _dump_call(fn: Callable[..., Any], args: Any, f: Any) -> None:
    """Pickle (fn, args) into `f`; what cannot be sent is one line naming the function or its arguments."""
    import pickle

    try:
        pickle.dump((fn, tuple(args)), f)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise _not_sendable(fn, exc) from exc
    except RuntimeError as exc:  # a multiprocessing Queue, Lock, Pipe: only a multiprocessing start may send one
        raise RuntimeError(f"cannot send the arguments of {getattr(fn, '__qualname__', fn)!r} to a new process: {exc} "
                           "(a function rank is started afresh, not by multiprocessing: pass a Manager's instead, "
                           "manager.Queue())") from None


def _main_module_name(main: Any) -> str | None:
    """The module name the caller's script runs under when started as `python -m pkg.mod` (its
    spec's), which a rank must import it by for its relative imports (`from . import x`) to
    resolve: loaded by path, it has no package. None for a script run by path, and for a zip or
    directory run as one (its spec is named __main__ itself)."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    return name if isinstance(name, str) and name != "__main__" else None


def _rank_interpreter_flags() -> list[str]:
    """The caller's interpreter options (-O, -W, -X dev, -P ...), as multiprocessing's spawn passes
    them on, so a rank runs under the same ones as torch's would; less those that would switch off
    the environment ranktop gives the rank: -E (and -I's share of it) ignore PYTHONUNBUFFERED and
    the PYTHONPATH entry of its stack-dump handler, and -S its sitecustomize and ranktop itself.
    The rank's sys.path is the caller's whatever its flags (the bootstrap sets it)."""
    flags = []
    for flag in subprocess._args_from_interpreter_flags():  # type: ignore[attr-defined]
        if flag == "-I":  # isolated: the rest of it (-P is 3.11's: 3.10 has no option for it)
            flags += ["-s", "-P"] if sys.version_info >= (3, 11) else ["-s"]
        elif flag not in ("-E", "-S"):
            flags.append(flag)
    return flags


def refuse_while_loading_main(what: str) -> None:
    """RuntimeError (one line) when called from a function rank's copy of its caller's script as
    the rank loads it: the script starts ranks without `if __name__ == "__main__":`, and each rank
    would start more. multiprocessing's spawn refuses the same, and torch's ranks fail with it."""
    bootstrap = sys.modules.get("ranktop.core._bootstrap")
    if getattr(bootstrap, "loading_main", False):
        raise RuntimeError(f"{what} was called while a rank loaded its caller's script to find its function: "
                           'start ranks only under `if __name__ == "__main__":`, as multiprocessing\'s spawn needs')


def _not_sendable(fn: Callable[..., Any], exc: Exception) -> Exception:
    """A ValueError that is also pickle's PicklingError, which torch's spawn raises for a lambda,
    naming what could not be pickled: the function, or else one of its arguments."""
    import pickle

    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError):
        what = f"{fn!r} (it must be importable by name)"
    else:
        what = f"the arguments of {getattr(fn, '__qualname__', fn)!r}"
    return _not_sendable_type()(f"cannot send {what} to a new process: {exc}")


@functools.cache
def _not_sendable_type() -> type[Exception]:
    import pickle  # made on first use: a command line's start does not import pickle

    class NotSendable(ValueError, pickle.PicklingError):
        """A function rank's function or arguments could not be pickled."""

    return NotSendable


@contextlib.contextmanager
def _affinity(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run the body (a spawn) on `cpus`: a child starts with its parent thread's affinity, so
    the rank and every thread it makes are bound from their first instruction. Only this thread
    moves, and only for the spawn."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)  # pid 0: the calling thread
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class RankProcess:
    """A started rank. Thin by design: the context above decides when to signal or restart."""

    def __init__(self, launch: Launch, pump: OutputPump):
        self.local_rank = launch.local_rank
        self.started_at = time.time()
        self._pump = pump
        self._input_fd: int | None = None
        master, slave, stdio = self._stdio(launch)
        self.popen = _popen(launch, stdio, master, slave)
        self.pid = self.popen.pid
        note_own_child(self.pid)  # not an orphan to adopt: we started it, Popen reaps it
        if launch.stdin == "pipe":
            self._take_input(master)
        self._pump_output(master)
        self.exited_at: float | None = None
        self.pidfd = _pidfd_open(self.pid)
        self._stopped = False  # as the kernel last told us (see stopped)
        self._stopped_lock = threading.Lock()

    def _stdio(self, launch: Launch) -> tuple[int | None, int | None, tuple[Any, Any, Any]]:
        """(the pty's master, its slave, the rank's stdin, stdout and stderr as Popen takes them);
        sets the sinks its output goes to."""
        master = slave = None
        stdin = {"null": subprocess.DEVNULL, "inherit": None, "pipe": subprocess.PIPE}[launch.stdin]
        if launch.pty is not None:
            # A terminal has one output: stderr joins stdout (the rank is not given it as its
            # controlling terminal, so it has isatty() and a size but no /dev/tty).
            master, slave = open_pty(*launch.pty, typed=launch.stdin == "pipe")
            stdout = stderr = slave
            if launch.stdin == "pipe":  # typed input goes to the terminal, as if from a keyboard
                stdin = slave
            self.sinks = {STDOUT: launch.sinks[STDOUT]}
        else:
            stdout = subprocess.PIPE if STDOUT in launch.sinks else None
            stderr = subprocess.PIPE if STDERR in launch.sinks else None
            self.sinks = launch.sinks
        return master, slave, (stdin, stdout, stderr)

    def _take_input(self, master: int | None) -> None:
        """Keep our own end of the rank's stdin (the pty's master, or the pipe), never blocking."""
        self._input_fd = os.dup(master) if master is not None else os.dup(self.popen.stdin.fileno())
        os.set_blocking(self._input_fd, False)  # a rank that does not read must never block us
        if self.popen.stdin is not None:
            self.popen.stdin.close()

    def _pump_output(self, master: int | None) -> None:
        """Hand the rank's terminal or pipes to the pump, each to its stream's sink."""
        if master is not None:
            self._pump.add(master, self.sinks[STDOUT])  # reading it past the last writer fails with EIO: the end
        for stream, pipe in ((STDOUT, self.popen.stdout), (STDERR, self.popen.stderr)):
            if pipe is not None:
                self._pump.add(os.dup(pipe.fileno()), self.sinks[stream])
                pipe.close()

    def write_input(self, data: bytes) -> int:
        """Write `data` to the rank's stdin now; the bytes written. To a pipe that is all of them
        or none: a line the pipe had room for only in part left that part in it, without its line
        break, and the rank read it with the next line typed, as one (a pasted line of 150 KB, then
        `c`). A terminal (--pty) takes what fits. OSError when it has no stdin of ours or the rank
        closed it."""
        if self._input_fd is None:
            raise OSError(errno.EBADF, "its stdin is not ranktop's to write")
        if len(data) > select.PIPE_BUF and len(data) > _pipe_room(self._input_fd):
            return 0  # (PIPE_BUF bytes or fewer go to a pipe whole or not at all anyway)
        try:
            return os.write(self._input_fd, data)
        except BlockingIOError:
            return 0  # its pipe is full: the rank is not reading

    def close_input(self) -> None:
        if self._input_fd is not None:
            os.close(self._input_fd)
            self._input_fd = None

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        """Reap if it exited; Popen's convention: -N when killed by signal N."""
        if self.popen.returncode is None and self.popen.poll() is not None:
            self.exited_at = time.time()
            self.close_pidfd()
            forget_own_child(self.pid)
        return self.popen.returncode

    def stopped(self) -> bool:
        """Whether the rank is stopped (SIGSTOP, SIGTSTP: `T` in /proc/PID/stat), from any thread.
        The kernel tells a parent of each stop and resumption of its child (waitid), which costs
        no /proc read: a snapshot of every rank, several times a second, read each one's stat.
        While it was last told stopped, its stat has the last word (a stopped rank that was
        killed tells nothing, and shows `Z` until it is reaped)."""
        with self._stopped_lock:
            try:
                told = os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WCONTINUED | os.WNOHANG)
            except ChildProcessError:  # reaped already
                return False
            if told is not None:
                self._stopped = told.si_code == os.CLD_STOPPED
            return self._stopped and kernel_state(self.pid) == "T"

    def signal_group(self, sig: int) -> bool:
        """Signal the rank's whole process group; False when nothing is left to signal."""
        return _deliver(os.killpg, self.pid, sig)

    def signal_leader(self, sig: int) -> bool:
        """Signal the rank process alone (not the helpers it started)."""
        return _deliver(os.kill, self.pid, sig)

    def output_drained(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        self._pump.wake()  # the rank is gone: read its pipes to their end now, not after a pause
        for sink in self.sinks.values():
            if not sink.done.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def output_done(self) -> bool:
        """Whether its pipes have been read to their end."""
        return all(sink.done.is_set() for sink in self.sinks.values())

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _popen(launch: Launch, stdio: tuple[Any, Any, Any], master: int | None, slave: int | None) -> subprocess.Popen:
    """The rank's process, in a session of its own; the pty's master is closed if it cannot be
    made, its slave either way (the rank has it now: its end of file is ours once the rank's
    tree closes it)."""
    stdin, stdout, stderr = stdio
    try:
        with _affinity(launch.cpus):
            return subprocess.Popen(
                launch.argv,
                env=launch.env,
                cwd=launch.cwd,
                stdin=stdin,  # the rank has its own session: a terminal it inherits is not its
                stdout=stdout,  # controlling one, so reading it raises no SIGTTIN
                stderr=stderr,
                start_new_session=True,
                close_fds=True,
            )
    except BaseException:
        if master is not None:
            os.close(master)
        raise
    finally:
        if slave is not None:
            os.close(slave)


def _deliver(send: Callable[[int, int], None], target: int, sig: int) -> bool:
    try:
        send(target, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        # A pid or group id is only reused once ours is gone; EPERM means a stranger owns it now.
        return False


def kernel_state(pid: int) -> str | None:
    """The process's state letter as the kernel reports it ("R", "S", "D" uninterruptible sleep,
    "T" stopped, "Z" zombie), or None when it is gone."""
    fields = stat_fields(pid)
    return fields[0].decode() if fields else None


def _pidfd_open(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (Linux 5.3+); None where unsupported."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def wait_exit(popen: subprocess.Popen, timeout: float) -> bool:
    """Reap `popen` within `timeout` seconds; False if it still runs then. Woken by the exit
    itself, through a pidfd: Popen.wait(timeout) polls with sleeps that double up to 50 ms, so
    it returns up to twice as late as the exit (what made a short run's end 0 or 50 ms late)."""
    fd = _pidfd_open(popen.pid) if popen.returncode is None else None
    if fd is not None:
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(timeout * 1000)
        finally:
            os.close(fd)
    try:
        popen.wait(timeout=0 if fd is not None else timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


SIGNAL_EXIT_OFFSET = 128


def exit_status_for_signal(sig: int) -> int:
    return SIGNAL_EXIT_OFFSET + int(sig)


# Signals a user sends to end a rank: its end is then no failure of its own.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGKILL, signal.SIGHUP, signal.SIGQUIT})
# Signals that ask the rank itself for something (a stack dump, a checkpoint). Its helpers, such as
# data loader workers, rarely handle them and would die of the default action.
LEADER_ONLY_SIGNALS = frozenset({signal.SIGUSR1, signal.SIGUSR2})
