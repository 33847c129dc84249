"""py-spy: find it, dump one process with it, and dump many ranks at once.

Every failure to dump a rank becomes a status with a reason and a hint, never an exception.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
from ranktop.core.events import EventLog
from ranktop.core.layout import RunDir
from ranktop.core.sanitize import clean
from ranktop.core.stacks.grouping import build_report
from ranktop.core.stacks.model import Frame, RankStack, StackReport, StackStatus, ThreadStack, snapshot_facts
from ranktop.core.stacks.procs import HeldProcess, children_of, gone_reason, is_paused, tracer_of
from ranktop.core.stacks.saving import save_report
from ranktop.core.strays import own_tool

DUMP_TIMEOUT = 5.0  # seconds one py-spy may take; a process in uninterruptible sleep can hold it
NATIVE_DUMP_TIMEOUT = 20.0  # with --native py-spy unwinds and symbolises libtorch: about 1 s a rank alone
PAUSED_NATIVE = "paused (stopped by a signal): py-spy reads no C frames of a stopped process"
UNNAMED_NATIVE = "??"  # a C frame py-spy found no symbol for: its name is its address, which differs per process

PTRACE_HINT = (
    "py-spy needs ptrace permission: run as root or as the ranks' user (sudo ranktop stacks ...), "
    "allow it with `sudo sysctl kernel.yama.ptrace_scope=0`, or in Docker start the container with "
    "`--cap-add SYS_PTRACE`; the SIGUSR1 fallback needs no ptrace (`u` in the stack view, "
    "`ranktop stacks --signal`)"
)
# Another py-spy's dump holds a process for a moment (two `ranktop stacks` at once): waited for at
# most this share of what is left of the dump's time, then py-spy is run once more.
TRACER_WAIT_SHARE = 0.5
NO_PY_SPY_HINT = ("install py-spy (`pip install py-spy`) or use the SIGUSR1 fallback (`u` in the stack view, "
                  "`ranktop stacks --signal`)")


@functools.lru_cache(maxsize=4)
def find_py_spy(override: str | None = None) -> str | None:
    """The py-spy binary: $RANKTOP_PY_SPY, next to our interpreter (a venv's bin), else PATH.

    Next to sys.executable comes first because a PATH hit may be a version-manager shim that
    costs a shell start per call (measured: 8 dumps 0.04 s direct, 0.26 s through a pyenv shim).
    """
    if override:
        return override if os.access(override, os.X_OK) else None
    local = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(local, os.X_OK):
        return local
    return shutil.which("py-spy")


def _spy_env() -> dict[str, str]:
    env = dict(os.environ)
    env["RUST_BACKTRACE"] = "0"  # its error is one line; a Rust backtrace would only bury it
    return env


def dump_pid(pid: int, rank: int = 0, local_rank: int | None = None, *, native: bool = False,
             native_frames: bool = False, timeout: float | None = None) -> RankStack:
    """One process's stacks via `py-spy dump --json` (`native`: the rank is a binary, dump the
    Python under it; `native_frames`: the C/C++ frames too); every failure becomes a status."""
    timeout = timeout or (NATIVE_DUMP_TIMEOUT if native_frames else DUMP_TIMEOUT)
    base = {"rank": rank, "local_rank": local_rank, "pid": pid}
    target = pid
    if native:
        child = python_descendant(pid)
        if child is None:
            return RankStack(**base, status=StackStatus.NATIVE,
                             reason="native binary rank: no Python stack to show",
                             hint=f"for native frames: gdb -p {pid} -batch -ex 'thread apply all bt'")
        target = child
    gone = gone_reason(target)
    if gone:
        return RankStack(**base, status=StackStatus.GONE, reason=gone)
    spy = find_py_spy(os.environ.get("RANKTOP_PY_SPY"))
    if spy is None:
        return RankStack(**base, status=StackStatus.NO_PY_SPY, reason="py-spy not found", hint=NO_PY_SPY_HINT)
    # A stopped process cannot be suspended as py-spy suspends one (`Failed to suspend process`):
    # it is read as it stands, which it does while stopped. Its C frames need the suspension.
    paused = is_paused(target)
    if paused and native_frames:
        return RankStack(**base, status=StackStatus.FAILED, paused=True, reason=PAUSED_NATIVE,
                         hint=f"its Python frames are read without --native (n again in the stack view); "
                              f"kill -CONT {target} lets it run on")
    argv = [spy, "dump", "--pid", str(target), "--json", *(["--native"] if native_frames else []),
            *(["--nonblocking"] if paused else [])]
    try:
        returncode, stdout, stderr = _run_py_spy_once_more_if_held(argv, target, timeout)
    except subprocess.TimeoutExpired:
        return RankStack(**base, status=StackStatus.FAILED, reason=f"py-spy did not answer within {timeout:g}s",
                         hint="the process may be in uninterruptible sleep (D state); try the SIGUSR1 fallback")
    except TooMuchOutput:
        return RankStack(**base, status=StackStatus.FAILED,
                         reason=f"py-spy's answer is over {MAX_PY_SPY_OUTPUT >> 20} MiB: not read",
                         hint="the SIGUSR1 fallback prints at most 100 threads of 100 frames")
    except OSError as exc:
        return RankStack(**base, status=StackStatus.NO_PY_SPY, reason=f"cannot run py-spy: {exc}",
                         hint=NO_PY_SPY_HINT)
    dumped = target if target != pid else None
    if returncode == 0:
        try:
            threads = parse_py_spy_json(stdout, target)
        except (ValueError, KeyError, TypeError) as exc:
            return RankStack(**base, status=StackStatus.FAILED, reason=f"unreadable py-spy output: {exc}")
        return RankStack(**base, status=StackStatus.OK, threads=threads, dumped_pid=dumped,
                         children=children_of(target), paused=paused)
    status, reason, hint = classify_py_spy_error(stderr, target)
    return RankStack(**base, status=status, reason=reason, hint=hint, dumped_pid=dumped)


MAX_PY_SPY_OUTPUT = 64 << 20  # bytes: a rank's frames and names are its to choose, and its dump is read whole


class TooMuchOutput(Exception):
    """py-spy wrote more than MAX_PY_SPY_OUTPUT bytes: not read on (eight ranks at once would hold it all)."""


def _run_py_spy_once_more_if_held(argv: list[str], pid: int, timeout: float) -> tuple[int, str, str]:
    """_run_py_spy, run once more where it could not suspend `pid` because another py-spy held it
    (another dump of it at that moment), once that one has let go: within `timeout` in all."""
    deadline = time.monotonic() + timeout
    returncode, stdout, stderr = _run_py_spy(argv, timeout)
    if returncode != 0 and _suspend_refused(stderr) and _let_go(pid, deadline):
        returncode, stdout, stderr = _run_py_spy(argv, max(0.0, deadline - time.monotonic()))
    return returncode, stdout, stderr


def _suspend_refused(stderr: str) -> bool:
    """py-spy's error where the kernel refused to let it attach (EPERM): a process another tracer
    holds, or one it may not trace at all. (Where it may not even read the process, it says
    `Permission Denied: Try running again with elevated permissions`.)"""
    lowered = stderr.lower()
    return "failed to suspend process" in lowered or "operation not permitted" in lowered


def _let_go(pid: int, deadline: float) -> bool:
    """Whether `pid` has no tracer, or only another py-spy that lets go of it within its share of
    the time to `deadline` (a debugger or strace holds it for as long as a person wants)."""
    wait_until = time.monotonic() + TRACER_WAIT_SHARE * max(0.0, deadline - time.monotonic())
    while (tracer := tracer_of(pid)) is not None:
        if tracer[1] != "py-spy" or time.monotonic() >= wait_until:
            return False
        time.sleep(0.02)
    return True


def _run_py_spy(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of py-spy within `timeout` (TimeoutExpired) and at most
    MAX_PY_SPY_OUTPUT bytes (TooMuchOutput); bytes that are not UTF-8 read as U+FFFD (a
    process's names are not always text, and subprocess.run's text mode raised on them)."""
    deadline = time.monotonic() + timeout
    with own_tool():
        # A group of its own: what it started goes with it (a wrapper script's child held its
        # pipes, and outlived the dump). In our session still: a child outside it is an orphan
        # to the engine, which adopted py-spy and could reap it from under Popen.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=_spy_env(), **_own_group())
        try:
            out, err = _read_until_closed(proc, deadline, argv, timeout)
            returncode = proc.wait(max(0.0, deadline - time.monotonic()))
        finally:
            _end(proc)
    return returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _own_group() -> dict:
    """Popen's arguments for a process group of its own (3.11's process_group; 3.10 has none)."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # (a bare system call in the child: no lock to deadlock on)


def _end(proc: subprocess.Popen) -> None:
    """py-spy's pipes closed and, unless it was waited for, its process group killed (py-spy and
    whatever it started: a script standing in for it, its `sleep`), waiting a second at most: one
    that outlives SIGKILL is stuck in the kernel, and the dump must not hang on it (Popen's own
    context manager waits without a limit)."""
    proc.stdout.close()
    proc.stderr.close()
    if proc.returncode is None:  # not reaped yet: its pid, the group's id, is no one else's
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            proc.wait(1)
        except subprocess.TimeoutExpired:
            pass  # (reaped by the subprocess module later, once it dies)


def _read_until_closed(proc: subprocess.Popen, deadline: float, argv: list[str],
                       timeout: float) -> tuple[bytes, bytes]:
    """Both of `proc`'s pipes read to their end, together (either may fill while the other is read)."""
    pipes = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    size = 0
    with selectors.DefaultSelector() as selector:
        for fd in pipes:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(argv, timeout)
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                size += len(chunk)
                if size > MAX_PY_SPY_OUTPUT:
                    raise TooMuchOutput
                pipes[key.fd].append(chunk)
    return b"".join(pipes[proc.stdout.fileno()]), b"".join(pipes[proc.stderr.fileno()])


def classify_py_spy_error(stderr: str, pid: int) -> tuple[StackStatus, str, str | None]:
    """Turn py-spy's error text into (status, one-line reason, hint)."""
    text = stderr.strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "py-spy failed")
    lowered = text.lower()
    gone = gone_reason(pid)
    if gone:
        return StackStatus.GONE, gone, None
    if _suspend_refused(text) and (tracer := tracer_of(pid)) is not None:
        tracer_pid, name = tracer
        return (StackStatus.FAILED, f"traced by another process, {clean(name)} (pid {tracer_pid}): py-spy cannot "
                "suspend it while it is", f"dump it once {clean(name)} lets go of it (a debugger's `detach`, "
                "strace's Ctrl-C)")
    if "permission denied" in lowered or "operation not permitted" in lowered:
        return StackStatus.NO_PERMISSION, "no permission to read the process (ptrace)", PTRACE_HINT
    if "python version" in lowered or "python interpreter" in lowered or "find python" in lowered:
        return StackStatus.NOT_PYTHON, "not a Python process (py-spy found no interpreter)", None
    return StackStatus.FAILED, first.removeprefix("Error: "), None


def python_descendant(pid: int) -> int | None:
    """A `--no-python` rank's Python: itself (a script with a python shebang), else the shallowest
    Python process under it (a shell script that runs python)."""
    try:
        proc = psutil.Process(pid)
        candidates = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return None
    for child in candidates:
        try:
            if os.path.basename(child.exe() or child.name()).startswith("python"):
                return child.pid
        except psutil.Error:
            continue
    return None


def parse_py_spy_json(text: str, pid: int) -> tuple[ThreadStack, ...]:
    """py-spy's --json (a list of threads, innermost frame first) -> our threads, main first.
    Every value is checked (ValueError names the first of the wrong kind), each name cut to
    MAX_NAME characters and each thread to MAX_FRAMES frames: the names are the rank's to choose,
    and a deep recursion is thousands of frames."""
    raw = json.loads(text)
    threads = []
    main_found = False
    for t in _of_kind(raw, list, "the dump"):
        t = _of_kind(t, dict, "a thread")
        frames = tuple(_frame(f) for f in reversed(_of_kind(t.get("frames") or [], list, "frames")))  # (cut by ThreadStack)
        os_thread_id = _number(t.get("os_thread_id"), "os_thread_id", None)
        name = _name(t.get("thread_name"), "thread_name", "")
        is_main = not main_found and (os_thread_id == pid or name == "MainThread")
        main_found = main_found or is_main
        threads.append(ThreadStack(name, _number(t.get("thread_id"), "thread_id", 0), os_thread_id,
                                   bool(t.get("active")), bool(t.get("owns_gil")), is_main, frames))
    if threads and not main_found:
        # CPython lists the newest thread first, so the oldest (the main thread) is last.
        last = threads[-1]
        threads[-1] = ThreadStack(last.name, last.thread_id, last.os_thread_id, last.active, last.owns_gil, True,
                                  last.frames)
    threads.sort(key=lambda t: not t.is_main)
    return tuple(threads)


MAX_NAME = 4096  # characters of a function, file or thread name (py-spy's own limit on what it reads)


def _frame(raw: object) -> Frame:
    f = _of_kind(raw, dict, "a frame")
    filename = _name(f.get("filename"), "filename", "?")
    return Frame(_frame_name(_name(f.get("name"), "name", "?")), filename,
                 _name(f.get("short_filename"), "short_filename", filename), _number(f.get("line"), "line", 0))


def _of_kind(value: object, kind: type, what: str):
    if not isinstance(value, kind):
        raise ValueError(f"{what} is of type {type(value).__name__}, not {kind.__name__}")
    return value


def _name(value: object, what: str, default: str) -> str:
    """A name py-spy read from the process: text, cut to MAX_NAME; `default` where it is empty."""
    return _of_kind(value, str, what)[:MAX_NAME] if value else default


def _number(value: object, what: str, default: int | None) -> int | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is of type {type(value).__name__}, not a whole number")
    return value


# ----- many ranks at once ---------------------------------------------------------------------
def _frame_name(name: str) -> str:
    """A native frame without a symbol is named by its address: `??`, so that ranks stopped in the
    same place group together (each process has its libraries at other addresses)."""
    return UNNAMED_NATIVE if name.startswith("0x") and all(c in "0123456789abcdefABCDEF" for c in name[2:]) else name


def dump_pids(pids: Mapping[int, int], *, local_ranks: Mapping[int, int] | None = None,
              native: Iterable[int] = (), extra: Mapping[int, dict] | None = None,
              run_dir: RunDir | None = None, events: EventLog | None = None, source: str = "api",
              native_frames: bool = False, held: Mapping[int, HeldProcess] | None = None) -> StackReport:
    """Dump `pids` ({rank: pid}) concurrently, group them, and save the report under `run_dir`.
    `held`: {rank: its process, held since it was checked}; a rank's whose process exited before
    its dump was read is not shown (its pid may have named another process by then).

    `events` is the run's open EventLog; without one and with a run dir, the event is appended
    to that run's events.jsonl (another process's run, for `ranktop stacks`).
    """
    started, taken_at = time.perf_counter(), time.time()
    native, extra, local_ranks = set(native), extra or {}, local_ranks or {}
    order = sorted(pids)
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(order)))) as pool:
        futures = [pool.submit(dump_pid, pids[r], r, local_ranks.get(r), native=r in native,
                               native_frames=native_frames) for r in order]
        stacks = [f.result() for f in futures]
    stacks = [_with_extra(_still_held(s, (held or {}).get(s.rank)), extra.get(s.rank)) for s in stacks]
    report = dataclasses.replace(build_report(stacks, taken_at, time.perf_counter() - started),
                                 native_frames=native_frames)
    if run_dir:
        report = save_report(report, run_dir, events, source)
    return report


REPLACED = ("process exited during the dump: its pid may have named another process by then, so what was "
            "dumped is not shown")


def _still_held(stack: RankStack, process: HeldProcess | None) -> RankStack:
    """`stack`, unless the process checked before the dump has exited since (checked after it)."""
    if process is None or process.alive():
        return stack
    return RankStack(stack.rank, stack.local_rank, stack.pid, StackStatus.GONE, reason=REPLACED)


def _with_extra(stack: RankStack, fields: dict | None) -> RankStack:
    return dataclasses.replace(stack, **fields) if fields else stack


# ----- the agent's ranks ----------------------------------------------------------------------
def dump_agent_stacks(agent: Any, local_ranks: Iterable[int] | None = None, *, save: bool = True,
                      native_frames: bool = False) -> StackReport:
    """Dump the agent's live ranks (all, or these local ranks; `native_frames`: with their C/C++
    frames); saved and logged in its run dir unless not `save`."""
    snap = agent.snapshot()
    wanted = set(local_ranks) if local_ranks is not None else None
    pids, local, native, extra, absent = {}, {}, set(), {}, []
    for r in snap.ranks:
        if wanted is not None and r.local_rank not in wanted:
            continue
        local[r.rank] = r.local_rank
        extra[r.rank] = snapshot_facts(r)
        if r.pid is None or not r.state.alive:
            absent.append(RankStack(r.rank, r.local_rank, r.pid or 0, StackStatus.GONE,
                                    reason=f"not running ({r.state.value})"))
            continue
        pids[r.rank] = r.pid
        if r.native:
            native.add(r.rank)
    started, taken_at = time.perf_counter(), time.time()
    report = dump_pids(pids, local_ranks=local, native=native, extra=extra, native_frames=native_frames)
    stacks = sorted([*report.ranks, *absent], key=lambda s: s.rank)
    report = dataclasses.replace(build_report(stacks, taken_at, time.perf_counter() - started),
                                 native_frames=native_frames)
    return save_report(report, agent.layout, agent.events, "agent") if save else report
