"""Shared test plumbing: no orphans after any test, waiting on conditions with a deadline, and
the helpers several test files use (agents over real ranks, events.jsonl, the app, a pty).

Test files import this module as `conftest` (pytest puts tests/ first on sys.path), never as
`tests.conftest`: that would be a second copy of the module.

Every process a test starts inherits RANKTOP_TEST_ID from this session's environment (ranktop
passes the caller's environment on to ranks, and ranks to their children). After each test no
process carrying it may be left, apart from pytest itself. Under pytest-xdist (`make test` runs four
workers) each worker draws its own, so a worker's check never counts, or kills, the other's ranks.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import fcntl
import json
import os
import pty
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import textwrap
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import TypeVar

import pytest
from ranktop.core import packing
from ranktop.core.agent import LocalAgent, RunResult
from ranktop.core.process import kernel_state
from ranktop.core.spec import WorkerSpec

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
K = TypeVar("K")  # a name for each of several runs
NOBODY = 65534  # another user, for directories and links that are not ours
if os.environ.get("PYTEST_XDIST_WORKER"):  # a session of its own: one worker's check must not see the other's
    os.environ["RANKTOP_TEST_ID"] = uuid.uuid4().hex
TEST_ID = os.environ.setdefault("RANKTOP_TEST_ID", uuid.uuid4().hex)
MARK = f"RANKTOP_TEST_ID={TEST_ID}\0".encode()
# A suite run as a background job of a script (`make test &`: SIGINT and SIGQUIT ignored, as POSIX
# has it) or under nohup (SIGHUP ignored) passed that on to every process a test starts; `logs`,
# rightly, then kept Ctrl-C ignored, and the Ctrl-C tests waited out their 30 s. Each test's
# processes start as from a terminal: with these signals at their defaults (Python's for SIGINT).
for _sig, _default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGQUIT, signal.SIG_DFL),
                       (signal.SIGHUP, signal.SIG_DFL)):
    if signal.getsignal(_sig) is signal.SIG_IGN:
        signal.signal(_sig, _default)
# Runs are served from a runtime directory of this session's own (each worker's): two tests that
# give the same --run-id in two workers, or a developer's own detached runs, never meet there.
# Tests about that directory itself set XDG_RUNTIME_DIR for their ranktop.
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="ranktop-tests-")
atexit.register(shutil.rmtree, os.environ["XDG_RUNTIME_DIR"], ignore_errors=True)


def polls(timeout: float, what: str):
    """Yields once per try, and fails the test once `timeout` seconds have gone by: the one
    deadline loop behind wait_for and the async waits of the TUI tests."""
    deadline = time.monotonic() + timeout
    while True:
        yield
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")


def wait_for(condition, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll `condition` until it returns something truthy; fail the test after `timeout`."""
    for _ in polls(timeout, what):
        if value := condition():
            return value
        time.sleep(interval)


_UNREAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a pipe's bytes read past its last line


def read_line(pipe, timeout: float, what: str, equal_to: str | None = None) -> str:
    """The next line a child's pipe gives (its stdout or stderr, text or not), or with `equal_to`
    the first line equal to it, the lines before dropped; fails the test after `timeout`. It reads
    the descriptor itself and keeps what it read past the line for the next call on that pipe: the
    pipe's own readline() after select() could take in two lines, and the second then sat in
    Python's buffer, unseen by select(), so a wait for it timed out. Do not mix it with the pipe's
    own reads; communicate() after it reads the descriptor too, but not the bytes kept here."""
    unread = _UNREAD.setdefault(pipe, bytearray())
    for _ in polls(timeout, what):
        while b"\n" in unread:
            end = unread.index(b"\n") + 1
            line = unread[:end].decode(errors="replace")
            del unread[:end]
            if equal_to is None or line == equal_to:
                return line
        if select.select([pipe.fileno()], [], [], 0.1)[0]:
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:
                pytest.fail(f"the pipe closed while waiting for {what}: {bytes(unread)!r} left unread")
            unread += chunk


def marked_processes() -> dict[int, str]:
    """Live processes started (directly or not) by this test session, except pytest itself."""
    found = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if MARK not in f.read() + b"\0":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
    return found


def _reap_children() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


# The rings a test makes in this process are packed only when the test asks (LineRing.pack, or a
# RingPacker of its own): the process's packer looking at them on its own clock would make what a
# test sees of a ring's chunks depend on timing. (ranktop processes a test starts pack as ever.)
_PACKS_NOTHING = packing.RingPacker(every=24 * 3600)


@pytest.fixture(autouse=True)
def rings_packed_only_when_asked(monkeypatch):
    monkeypatch.setattr(packing, "_packer", _PACKS_NOTHING)


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    deadline = time.monotonic() + 8.0
    left = marked_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap_children()
        left = marked_processes()
    if left:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        pytest.fail(f"processes left behind: {left}")


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` (made here) with mount `options` (`size=256k`, `nr_inodes=64`),
    unmounted afterwards whatever the test did; the test is skipped where mounting is not allowed."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def pids_cgroup(limit: int):
    """A pids cgroup of its own (v1's pids hierarchy, or v2's) allowing `limit` processes and
    threads, its path yielded: a command joins it with `sh -c 'echo $$ > DIR/cgroup.procs && exec
    ...'`. Removed afterwards, once empty; the test is skipped where none can be made."""
    name = f"ranktop-test-{uuid.uuid4().hex[:8]}"
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        group = os.path.join(base, name)
        try:
            os.mkdir(group)
        except OSError:
            continue
        if os.path.exists(os.path.join(group, "pids.max")):
            break
        os.rmdir(group)
    else:
        pytest.skip("no pids cgroup can be made here")
    try:
        with open(os.path.join(group, "pids.max"), "w") as f:
            f.write(str(limit))
        yield group
    finally:
        wait_for(lambda: not Path(group, "cgroup.procs").read_text().strip(), timeout=10, what="the cgroup empty")
        os.rmdir(group)


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM a helper process a test started (a server, a browser), SIGKILL after `grace`; reaped."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def freeze(pid: int) -> None:
    """SIGSTOP `pid`, and return once every thread of it has stopped. kill() returns once the stop
    is sent, not done: the one thread the kernel tells stops the others only when it next runs, and
    until then another thread (a store's or a socket's server) can still answer a call (38 calls of
    50 made at once, here). A process that ended meanwhile needs no wait."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: all_threads_stopped(pid), what=f"every thread of process {pid} stopped")


def all_threads_stopped(pid: int) -> bool:
    """Whether no thread of `pid` can run: each stopped (T, t), or dead (Z, X), or gone."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    # (/proc/TID/stat holds a thread's own state: read with the engine's own parser; None once it ended)
    return all(kernel_state(int(tid)) in (None, "T", "t", "Z", "X") for tid in threads)


def run_side_by_side(runs: dict[K, dict], timeout: float) -> dict[K, subprocess.CompletedProcess]:
    """Each of `runs` (a name -> subprocess.Popen's keyword arguments, `args` among them) run to
    the end, all at once, their output captured as text: as subprocess.run each, one after the
    other, but their waits on their ranks overlap. Worth it only where the runs wait more than they
    compute: runs that each import torch measured no faster side by side on 2 cores. Past `timeout`
    seconds all are killed and TimeoutExpired raised."""
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        started = {}
        try:
            for name, popen_kwargs in runs.items():
                # files, not pipes: a process is never held up by a pipe read only after another's end
                out, err = (stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
                started[name] = (subprocess.Popen(**popen_kwargs, stdout=out, stderr=err, text=True), out, err)
            for proc, _, _ in started.values():
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for proc, _, _ in started.values():  # (only any left after a timeout or a failed start)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        done = {}
        for name, (proc, out, err) in started.items():
            out.seek(0)
            err.seek(0)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
        return done


def ranktop_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ranktop", *args]


def ranktop_cmd_without(module: str, *args: str) -> list[str]:
    """The command line run as if `module` were not installed (python's own way to make a module
    unimportable: sys.modules[name] = None)."""
    hide = (f"import runpy, sys; sys.modules[{module!r}] = None; "
            "runpy.run_module('ranktop', run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", hide, *args]


def run_ranktop(*args: str, timeout: float = 60, without: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run the real command line to the end, capturing its output as text (`without`: as if that
    module were not installed)."""
    kwargs.setdefault("cwd", ROOT)
    cmd = ranktop_cmd_without(without, *args) if without else ranktop_cmd(*args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def no_ranks_left(run_dir: str | Path) -> str:
    """What `ranktop stacks` says of the run in `run_dir` (absolute) that left no final.json (its
    engine killed, or its events.jsonl made by hand) once no rank of it runs, however it is named:
    attach's and logs' line for that run, then stacks' own ending."""
    return (f"ranktop stacks: {os.path.basename(run_dir)} is not served and left no final.json: its engine went "
            f"away before the run's end (killed?), so how the run ended is unknown; its log files are under "
            f"{run_dir}: no ranks to dump\n")


@pytest.fixture
def examples() -> Path:
    return ROOT / "examples"


# ----- agents over real ranks -------------------------------------------------------------------
_SPEC_FIELDS = {f.name for f in dataclasses.fields(WorkerSpec)}


def make_agent(tmp_path: Path, code: str | None = None, n: int = 2, *, entrypoint: str = PY,
               args: tuple | None = None, **kw) -> LocalAgent:
    """A LocalAgent logging under `tmp_path` for `n` ranks: Python running `code` unbuffered, or
    `entrypoint` with `args`. Keywords that name a WorkerSpec field (env, pty, name, max_restarts,
    ...) go to the spec, the rest to the agent; no console tee and a 2 s grace unless told."""
    spec_kw = {k: kw.pop(k) for k in list(kw) if k in _SPEC_FIELDS}
    if args is None:
        args = ("-u", "-c", textwrap.dedent(code))
    spec = WorkerSpec(role="default", local_world_size=n, entrypoint=entrypoint, args=tuple(args), **spec_kw)
    kw.setdefault("console", False)
    kw.setdefault("shutdown_timeout", 2.0)
    return LocalAgent(spec, log_dir=str(tmp_path), **kw)


class Running:
    """An agent's monitor loop in a thread, as the TUI runs it, with its sampler (if any) attached
    before the run starts. `join` waits for the run's own end; as a context manager, whatever
    still runs is killed on the way out."""

    def __init__(self, agent: LocalAgent):
        self.agent, self.result = agent, None
        if agent.sampler is not None:
            agent.sampler.attach(agent)  # pcontext is still None here: the sampler must cope
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert agent.wait_started(15), "the agent did not start"

    def _run(self) -> None:
        self.result = self.agent.run()

    def join(self, timeout: float = 30) -> RunResult:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "agent did not finish"
        return self.result

    def rank(self, r: int):
        return self.agent.snapshot().ranks[r]

    def __enter__(self) -> LocalAgent:
        return self.agent

    def __exit__(self, *exc) -> None:
        self.agent.kill_group()
        self.thread.join(20)
        if self.agent.sampler is not None:
            self.agent.sampler.close()
        assert not self.thread.is_alive(), "agent did not finish"


def read_events(run_dir: str | Path, *, while_written: bool = False) -> list[dict]:
    """The run's events.jsonl, every line parsed: a torn line fails the test. `while_written`:
    the run may still be writing it, so a missing file is no events and an unfinished last line
    is left for later."""
    path = os.path.join(run_dir, "events.jsonl")
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        if while_written:
            return []
        raise
    if while_written and lines and not lines[-1].endswith(b"\n"):
        lines.pop()
    return [json.loads(line) for line in lines]


# ----- the app under Pilot ----------------------------------------------------------------------
async def until(pilot, condition, timeout: float = 10.0, what: str = "condition"):
    """Like wait_for, but lets the app run (timers, messages) while waiting."""
    for _ in polls(timeout, what):
        if value := condition():
            return value
        await pilot.pause(0.02)


def screen_rows(app) -> list[str]:
    """The screen as a person reads it, one string per row: every layer composed, toasts and
    dialogs over the panes. (Textual has no public reader of its composed frame.)"""
    return ["".join(segment.text for segment in strip) for strip in app.screen._compositor.render_strips()]


def drive(app, body, size=(160, 48)) -> None:
    """Run `body(app, pilot)` inside a RanktopApp over a real engine, once the main screen is up and
    every rank started; the app's unmount stops whatever still runs."""

    async def main():
        app.engine.start()  # the app is handed a running engine
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.main is not None and app.main.is_mounted, what="main screen")
            await until(pilot, lambda: all(r.pid for r in app.engine.snapshot().ranks), what="ranks started")
            await body(app, pilot)

    asyncio.run(main())


# ----- a real terminal --------------------------------------------------------------------------
def run_in_pty(argv: list[str], cwd: Path, until: bytes, keys: bytes = b"", timeout: float = 60.0,
               stdin_closed: bool = False, env: dict[str, str | None] | None = None) -> tuple[bytes, int]:
    """Run argv on a 160x48 pseudo-terminal; once `until` was written, type `keys`. Returns every
    byte written to the terminal and the exit status. `env` is added to the environment (a value
    of None removes the variable)."""
    pid, master = pty.fork()
    if pid == 0:  # the child: the pty is its stdin, stdout and stderr
        try:
            os.chdir(cwd)
            if stdin_closed:
                os.close(0)
            environ = {**os.environ, "TERM": "xterm-256color", "PYTHONPATH": str(ROOT), **(env or {})}
            os.execve(argv[0], argv, {k: v for k, v in environ.items() if v is not None})
        finally:
            os._exit(127)
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 48, 160, 0, 0))
    out, typed = bytearray(), False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not typed and until in out:
                os.write(master, keys)
                typed = True
            ready, _, _ = select.select([master], [], [], 0.1)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child side closed
                break
            if not chunk:
                break
            out += chunk
        else:
            os.kill(pid, signal.SIGTERM)  # ranktop stops its ranks with the grace
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(master)
    return bytes(out), os.waitstatus_to_exitcode(status)


def mode_of(path) -> int:
    """The permission bits of `path` itself (a link's own, not its target's)."""
    return os.lstat(path).st_mode & 0o7777


def has_torch_elastic() -> bool:
    """Whether torch's elastic API can be run beside ranktop's here."""
    try:
        import torch.distributed.elastic.multiprocessing  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def torch_installed():
    """Skips a test where torch is not importable (its APIs, its rendezvous, parity with torchrun)."""
    pytest.importorskip("torch")


# ----- another user -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OtherUser:
    """A real user of the host's other than root (made for the test, removed after it), and how
    to run ranktop as them: this interpreter is under /root, which they may not enter, so they run
    the system's Python of the same version with the venv's packages."""

    name: str
    uid: int
    gid: int
    python: str

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["runuser", "-u", self.name, "--", *argv], capture_output=True, text=True, **kwargs)

    def ranktop(self, *args: str) -> list[str]:
        """The command line that runs `ranktop ARGS` as this user (with runuser)."""
        start = (f"import runpy, site, sys; site.addsitedir({SITE_PACKAGES!r}); sys.argv[0] = 'ranktop'; "
                 "runpy.run_module('ranktop', run_name='__main__', alter_sys=True)")
        return ["runuser", "-u", self.name, "--", self.python, "-c", start, *args]


SITE_PACKAGES = os.path.join(sys.prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")


@pytest.fixture
def other_user():
    """OtherUser `h22user`; the test is skipped where it cannot be made (not root, no useradd, or
    no system Python of this version)."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("making another user needs root, useradd and runuser")
    python = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python} to run ranktop as another user with")
    name = "h22user" + os.environ.get("PYTEST_XDIST_WORKER", "")  # (each worker its own)
    made = subprocess.run(["useradd", "-M", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make user {name}: {made.stderr.strip()}")
    try:
        import pwd

        entry = pwd.getpwnam(name)
        yield OtherUser(name, entry.pw_uid, entry.pw_gid, python)
    finally:
        subprocess.run(["userdel", name], capture_output=True)
