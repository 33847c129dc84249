"""Stack dumps of hung ranks (SPEC 2.7): py-spy on every rank at once, grouped by main-thread stack.

The odd rank out is usually the culprit: when ranks 0-2 wait in `all_reduce` and rank 3 sits in
`load_batch`, the group of one is what to look at. Everything here is engine code shared by the
TUI (StacksScreen) and `ranktop stacks`; a failure to dump one rank is a per-rank status with a
reason and a hint, never an exception.

The fallback that needs no ptrace is SIGUSR1: Python ranks started by ranktop register
faulthandler for it (see `core.spec.faulthandler_env` and core/faulthandler_boot/sitecustomize.py), so the
rank prints its own stacks to stderr, which lands in its log and its pane.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
from ranktop.core.errors import ERROR_FILE_ENV
from ranktop.core.events import EventLog
from ranktop.core.layout import EVENTS, STACKS, Dir, RunDir, dump_log_path, run_dir_of_error_file

DUMP_TIMEOUT = 5.0  # seconds one py-spy may take; a process in uninterruptible sleep can hold it

PTRACE_HINT = (
    "py-spy needs ptrace permission: run as root or as the ranks' user (sudo ranktop stacks ...), "
    "allow it with `sudo sysctl kernel.yama.ptrace_scope=0`, or in Docker start the container with "
    "`--cap-add SYS_PTRACE`; the SIGUSR1 fallback needs no ptrace (`ranktop stacks --signal`)"
)
NO_PY_SPY_HINT = "install py-spy (`pip install py-spy`) or use the SIGUSR1 fallback (`ranktop stacks --signal`)"


class StackStatus(str, enum.Enum):
    OK = "ok"
    NATIVE = "native"  # a binary rank with no Python in it
    NOT_PYTHON = "not-python"  # py-spy found no interpreter in the process
    GONE = "gone"  # exited before or during the dump
    NO_PERMISSION = "no-permission"
    NO_PY_SPY = "no-py-spy"
    FAILED = "failed"  # anything else py-spy reported, or it timed out


@dataclass(frozen=True)
class Frame:
    name: str
    filename: str
    short_filename: str
    line: int

    @property
    def label(self) -> str:
        return f"{self.name} ({self.short_filename}:{self.line})"


@dataclass(frozen=True)
class ThreadStack:
    """One thread's frames, outermost call first (the order of a Python traceback)."""

    name: str
    thread_id: int
    os_thread_id: int | None
    active: bool | None  # py-spy: on CPU now (spinning) or idle (blocked); None: not known (faulthandler)
    owns_gil: bool
    is_main: bool
    frames: tuple[Frame, ...]

    @property
    def key(self) -> tuple:
        return tuple((f.name, f.filename, f.line) for f in self.frames)


@dataclass(frozen=True)
class RankStack:
    rank: int
    local_rank: int | None
    pid: int
    status: StackStatus
    threads: tuple[ThreadStack, ...] = ()
    reason: str | None = None
    hint: str | None = None
    dumped_pid: int | None = None  # the Python process dumped, when not the rank itself (native rank)
    cpu_percent: float | None = None  # from the stats sampler, when the agent has one
    stall_seconds: float | None = None

    @property
    def main(self) -> ThreadStack | None:
        return next((t for t in self.threads if t.is_main), None)

    @property
    def others(self) -> tuple[ThreadStack, ...]:
        return tuple(t for t in self.threads if not t.is_main)


@dataclass(frozen=True)
class StackGroup:
    """Ranks whose main threads have the identical stack."""

    ranks: tuple[int, ...]
    frames: tuple[Frame, ...]
    odd: bool  # a minority group: look here first
    active: tuple[int, ...] = ()  # ranks whose main thread was on CPU


@dataclass
class TreeNode:
    """The merged call tree: each frame with the ranks whose main thread passes through it."""

    frame: Frame | None  # None for the root
    ranks: list[int] = field(default_factory=list)
    children: list[TreeNode] = field(default_factory=list)

    def child(self, frame: Frame) -> TreeNode:
        key = (frame.name, frame.filename, frame.line)
        for node in self.children:
            if (node.frame.name, node.frame.filename, node.frame.line) == key:
                return node
        node = TreeNode(frame)
        self.children.append(node)
        return node


@dataclass(frozen=True)
class StackReport:
    taken_at: float
    elapsed_s: float
    ranks: tuple[RankStack, ...]
    groups: tuple[StackGroup, ...]
    tree: TreeNode
    saved_txt: str | None = None
    saved_json: str | None = None

    @property
    def odd_ranks(self) -> list[int]:
        return sorted(r for g in self.groups if g.odd for r in g.ranks)

    @property
    def problems(self) -> list[RankStack]:
        return [r for r in self.ranks if r.status != StackStatus.OK]

    def summary(self) -> str:
        ok = len(self.ranks) - len(self.problems)
        text = f"{ok} of {len(self.ranks)} ranks dumped, {len(self.groups)} distinct stack(s)"
        if self.odd_ranks:
            text += f"; odd one out: {rank_list(self.odd_ranks)}"
        elif len(self.groups) > 1:
            text += "; no majority stack"
        return text


# ----- finding py-spy and running it ----------------------------------------------------------
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
             timeout: float = DUMP_TIMEOUT) -> RankStack:
    """One process's stacks via `py-spy dump --json`; every failure becomes a status."""
    base = {"rank": rank, "local_rank": local_rank, "pid": pid}
    target = pid
    if native:
        child = python_descendant(pid)
        if child is None:
            return RankStack(**base, status=StackStatus.NATIVE,
                             reason="native binary rank: no Python stack to show",
                             hint=f"for native frames: gdb -p {pid} -batch -ex 'thread apply all bt'")
        target = child
    gone = _gone_reason(target)
    if gone:
        return RankStack(**base, status=StackStatus.GONE, reason=gone)
    spy = find_py_spy(os.environ.get("RANKTOP_PY_SPY"))
    if spy is None:
        return RankStack(**base, status=StackStatus.NO_PY_SPY, reason="py-spy not found", hint=NO_PY_SPY_HINT)
    try:
        out = subprocess.run([spy, "dump", "--pid", str(target), "--json"], capture_output=True, text=True,
                             timeout=timeout, env=_spy_env(), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return RankStack(**base, status=StackStatus.FAILED, reason=f"py-spy did not answer within {timeout:g}s",
                         hint="the process may be in uninterruptible sleep (D state); try the SIGUSR1 fallback")
    except OSError as exc:
        return RankStack(**base, status=StackStatus.NO_PY_SPY, reason=f"cannot run py-spy: {exc}",
                         hint=NO_PY_SPY_HINT)
    dumped = target if target != pid else None
    if out.returncode == 0:
        try:
            threads = parse_py_spy_json(out.stdout, target)
        except (ValueError, KeyError, TypeError) as exc:
            return RankStack(**base, status=StackStatus.FAILED, reason=f"unreadable py-spy output: {exc}")
        return RankStack(**base, status=StackStatus.OK, threads=threads, dumped_pid=dumped)
    status, reason, hint = classify_py_spy_error(out.stderr, target)
    return RankStack(**base, status=status, reason=reason, hint=hint, dumped_pid=dumped)


def classify_py_spy_error(stderr: str, pid: int) -> tuple[StackStatus, str, str | None]:
    """Turn py-spy's error text into (status, one-line reason, hint)."""
    text = stderr.strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "py-spy failed")
    lowered = text.lower()
    gone = _gone_reason(pid)
    if gone:
        return StackStatus.GONE, gone, None
    if "permission denied" in lowered or "operation not permitted" in lowered:
        return StackStatus.NO_PERMISSION, "no permission to read the process (ptrace)", PTRACE_HINT
    if "python version" in lowered or "python interpreter" in lowered or "find python" in lowered:
        return StackStatus.NOT_PYTHON, "not a Python process (py-spy found no interpreter)", None
    return StackStatus.FAILED, first.removeprefix("Error: "), None


def _gone_reason(pid: int) -> str | None:
    """Why `pid` cannot be dumped because it is no longer running, or None while it runs."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "process gone (it exited before or during the dump)"
    except psutil.Error:
        return None
    if status == psutil.STATUS_ZOMBIE:
        return "process exited (not reaped yet)"
    return None


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
    """py-spy's --json (a list of threads, innermost frame first) -> our threads, main first."""
    raw = json.loads(text)
    threads = []
    main_found = False
    for t in raw:
        frames = tuple(Frame(f["name"], f.get("filename") or "?", f.get("short_filename") or f.get("filename") or "?",
                             int(f.get("line") or 0)) for f in reversed(t.get("frames") or []))
        is_main = not main_found and (t.get("os_thread_id") == pid or t.get("thread_name") == "MainThread")
        main_found = main_found or is_main
        threads.append(ThreadStack(t.get("thread_name") or "", int(t.get("thread_id") or 0), t.get("os_thread_id"),
                                   bool(t.get("active")), bool(t.get("owns_gil")), is_main, frames))
    if threads and not main_found:
        # CPython lists the newest thread first, so the oldest (the main thread) is last.
        last = threads[-1]
        threads[-1] = ThreadStack(last.name, last.thread_id, last.os_thread_id, last.active, last.owns_gil, True,
                                  last.frames)
    threads.sort(key=lambda t: not t.is_main)
    return tuple(threads)


# ----- many ranks at once ---------------------------------------------------------------------
def dump_pids(pids: Mapping[int, int], *, local_ranks: Mapping[int, int] | None = None,
              native: Iterable[int] = (), extra: Mapping[int, dict] | None = None,
              run_dir: RunDir | None = None, events: EventLog | None = None, source: str = "api") -> StackReport:
    """Dump `pids` ({rank: pid}) concurrently, group them, and save the report under `run_dir`.

    `events` is the run's open EventLog; without one and with a run dir, the event is appended
    to that run's events.jsonl (another process's run, for `ranktop stacks`).
    """
    started, taken_at = time.perf_counter(), time.time()
    native, extra, local_ranks = set(native), extra or {}, local_ranks or {}
    order = sorted(pids)
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(order)))) as pool:
        futures = [pool.submit(dump_pid, pids[r], r, local_ranks.get(r), native=r in native) for r in order]
        stacks = [f.result() for f in futures]
    stacks = [_with_extra(s, extra.get(s.rank)) for s in stacks]
    report = build_report(stacks, taken_at, time.perf_counter() - started)
    if run_dir:
        report = save_report(report, run_dir, events, source)
    return report


def _with_extra(stack: RankStack, fields: dict | None) -> RankStack:
    return dataclasses.replace(stack, **fields) if fields else stack


def build_report(stacks: list[RankStack], taken_at: float, elapsed_s: float) -> StackReport:
    """Group by identical main-thread stack; smaller groups than the largest one are odd."""
    by_key: dict[tuple, list[RankStack]] = {}
    for s in stacks:
        if s.status == StackStatus.OK and s.main is not None:
            by_key.setdefault(s.main.key, []).append(s)
    sizes = sorted((len(v) for v in by_key.values()), reverse=True)
    # Odd only against a clear majority: with a tie for the largest group no one stands out.
    clear = len(sizes) > 1 and sizes[0] > sizes[1]
    groups = [
        StackGroup(tuple(s.rank for s in members), members[0].main.frames, clear and len(members) < sizes[0],
                   tuple(s.rank for s in members if s.main.active))
        for members in by_key.values()
    ]
    groups.sort(key=lambda g: (-len(g.ranks), g.ranks))
    tree = TreeNode(None)
    for s in stacks:
        if s.status == StackStatus.OK and s.main is not None:
            node = tree
            node.ranks.append(s.rank)
            for frame in s.main.frames:
                node = node.child(frame)
                node.ranks.append(s.rank)
    return StackReport(taken_at, elapsed_s, tuple(stacks), tuple(groups), tree)


# ----- the agent's ranks ----------------------------------------------------------------------
def dump_agent_stacks(agent: Any, local_ranks: Iterable[int] | None = None) -> StackReport:
    """Dump the agent's live ranks (all, or these local ranks); saved and logged in its run dir."""
    snap = agent.snapshot()
    wanted = set(local_ranks) if local_ranks is not None else None
    pids, local, native, extra, absent = {}, {}, set(), {}, []
    for r in snap.ranks:
        if wanted is not None and r.local_rank not in wanted:
            continue
        local[r.rank] = r.local_rank
        extra[r.rank] = {"cpu_percent": r.cpu_percent, "stall_seconds": r.stall_seconds}
        if r.pid is None or not r.state.alive:
            absent.append(RankStack(r.rank, r.local_rank, r.pid or 0, StackStatus.GONE,
                                    reason=f"not running ({r.state.value})"))
            continue
        pids[r.rank] = r.pid
        if r.native:
            native.add(r.rank)
    started, taken_at = time.perf_counter(), time.time()
    report = dump_pids(pids, local_ranks=local, native=native, extra=extra)
    stacks = sorted([*report.ranks, *absent], key=lambda s: s.rank)
    report = build_report(stacks, taken_at, time.perf_counter() - started)
    return save_report(report, agent.layout, agent.events, "agent")


# ----- saving ---------------------------------------------------------------------------------
def save_report(report: StackReport, run_dir: RunDir, events: EventLog | None = None,
                source: str = "api") -> StackReport:
    """Write <run dir>/stacks/<timestamp>.{txt,json} and a `stacks_dumped` event; best effort."""
    stamp = datetime.datetime.fromtimestamp(report.taken_at).strftime("%Y%m%d-%H%M%S-%f")[:-3]
    folder = os.path.join(run_dir.path, STACKS)
    txt, js = os.path.join(folder, stamp + ".txt"), os.path.join(folder, stamp + ".json")
    saved = dataclasses.replace(report, saved_txt=txt, saved_json=js)
    try:
        held = run_dir.stacks()
        try:
            _write_new(held, stamp + ".json", json.dumps(report_to_dict(saved), indent=1))
            _write_new(held, stamp + ".txt", format_report(saved, threads=True) + "\n")
        finally:
            held.close()
    except OSError:
        return report  # a read-only log dir must not cost the user the view itself
    fields = {"file": txt, "ranks": [s.rank for s in report.ranks], "groups": len(report.groups),
              "odd_ranks": report.odd_ranks, "problems": {s.rank: s.status.value for s in report.problems},
              "elapsed_s": round(report.elapsed_s, 4), "source": source}
    if events is not None:
        events.write("stacks_dumped", **fields)
    elif (fd := run_dir.open_events(create=False)) is not None:
        theirs = EventLog(fd)
        try:
            theirs.write("stacks_dumped", **fields)
        finally:
            theirs.close()
    return saved


def _write_new(folder: Dir, name: str, text: str) -> None:
    with os.fdopen(folder.open_new(name), "w") as f:
        f.write(text)


def report_to_dict(report: StackReport) -> dict:
    data = asdict(report)
    data["odd_ranks"] = report.odd_ranks
    return data


# ----- the grouped text view ------------------------------------------------------------------
def rank_list(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2,5'; [3] -> 'rank 3'."""
    rs = sorted(set(ranks))
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(parts)


def rank_facts(s: RankStack) -> str:
    """' (pid 12, cpu 98%, stalled 31s, idle)' — what tells spinning from blocked."""
    facts = [f"pid {s.pid}"]
    if s.dumped_pid:
        facts.append(f"Python child {s.dumped_pid}")
    if s.cpu_percent is not None:
        facts.append(f"cpu {s.cpu_percent:.0f}%")
    if s.stall_seconds is not None:
        facts.append(f"silent {s.stall_seconds:.0f}s")
    if s.main is not None and s.main.active is not None:
        facts.append("on CPU" if s.main.active else "idle")
    return ", ".join(facts)


def format_report(report: StackReport, *, threads: bool = False) -> str:
    """The grouped view: groups (odd ones marked), the merged tree, per-rank problems."""
    when = datetime.datetime.fromtimestamp(report.taken_at).strftime("%H:%M:%S")
    out = [f"stacks at {when} ({report.elapsed_s:.2f}s): {report.summary()}"]
    if report.saved_txt:
        out.append(f"saved: {report.saved_txt}")
    by_rank = {s.rank: s for s in report.ranks}
    for g in report.groups:
        mark = "  <-- ODD ONE OUT" if g.odd else ""
        out += ["", f"== {rank_list(g.ranks)} ({len(g.ranks)}){mark}"]
        out += [f"   {rank_list([r])}: {rank_facts(by_rank[r])}" for r in g.ranks if len(g.ranks) <= 8]
        out += [f"     {f.label}" for f in g.frames] or ["     (no Python frames)"]
    if report.tree.children:
        out += ["", "call tree (main threads; ranks under each frame):"]
        out += _tree_lines(report.tree, set(report.odd_ranks), 1)
    if report.problems:
        out += ["", "not dumped:"]
        for s in report.problems:
            out.append(f"   {rank_list([s.rank])} (pid {s.pid}): {s.status.value}: {s.reason}")
            if s.hint:
                out.append(f"      hint: {s.hint}")
    if threads:
        out += _thread_lines(report)
    return "\n".join(out)


def _tree_lines(node: TreeNode, odd: set[int], depth: int) -> list[str]:
    lines = []
    for child in node.children:
        flag = "  <-- odd" if odd and set(child.ranks) <= odd and len(child.ranks) < len(node.ranks) else ""
        lines.append(f"{'  ' * depth}{child.frame.label}  [{rank_list(child.ranks)}]{flag}")
        lines += _tree_lines(child, odd, depth + 1)
    return lines


def other_thread_groups(report: StackReport) -> list[tuple[str, tuple[Frame, ...], list[int]]]:
    """Non-main threads grouped across ranks by (thread name, stack): [(name, frames, ranks)]."""
    groups: dict[tuple, tuple[str, tuple[Frame, ...], list[int]]] = {}
    for s in report.ranks:
        for t in s.others:
            entry = groups.setdefault((t.name, t.key), (t.name, t.frames, []))
            entry[2].append(s.rank)
    return sorted(groups.values(), key=lambda g: (g[2][0], g[0]))


def _thread_lines(report: StackReport) -> list[str]:
    groups = other_thread_groups(report)
    if not groups:
        return ["", "other threads: none"]
    out = ["", "other threads:"]
    for name, frames, ranks in groups:
        out.append(f"-- thread {name!r} in {rank_list(ranks)}")
        out += [f"     {f.label}" for f in frames] or ["     (no Python frames)"]
    return out


# ----- the SIGUSR1 fallback -------------------------------------------------------------------
def catches_signal(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (SigCgt in /proc), i.e. it will not die of it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def signal_pids(pids: Mapping[int, int], sig: int = signal.SIGUSR1) -> dict[int, str]:
    """Send `sig` to each rank process (not its group) that catches it; {rank: what happened}.

    Only the rank process: its children (data loader workers, compilers) did not necessarily
    register faulthandler, and SIGUSR1's default action would kill them. A rank that does not
    catch the signal is skipped for the same reason.
    """
    outcome = {}
    for rank, pid in sorted(pids.items()):
        if _gone_reason(pid):
            outcome[rank] = "gone"
        elif not catches_signal(pid, sig):
            outcome[rank] = "skipped: it does not handle SIGUSR1 (faulthandler off, or not Python)"
        else:
            try:
                os.kill(pid, sig)
                outcome[rank] = "sent"
            except ProcessLookupError:
                outcome[rank] = "gone"
            except PermissionError:
                outcome[rank] = "no permission to signal it"
    return outcome


def signal_dump(agent: Any) -> dict[int, str]:
    """SIGUSR1 to every live rank that handles it; each writes its stacks to its stderr (log, pane)."""
    snap = agent.snapshot()
    pids = {r.rank: r.pid for r in snap.ranks if r.pid is not None and r.state.alive}
    outcome = signal_pids(pids)
    agent.events.write("stacks_signalled", signal="SIGUSR1", ranks=outcome)
    return outcome


# ----- finding a running group's ranks from outside -------------------------------------------
def _read_events(path: str) -> list[dict]:
    events = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a line being written right now
    return events


def live_ranks_in_run_dir(run_dir: str) -> tuple[dict[int, int], dict[int, int]]:
    """({rank: pid}, {rank: local_rank}) of the latest attempt's ranks that still run."""
    events = _read_events(os.path.join(run_dir, EVENTS))
    run_id = next((e.get("run_id") for e in events if e.get("event") == "run_started"), None)
    latest = max((e.get("attempt", 0) for e in events if e.get("event") == "started"), default=None)
    pids, local, exited = {}, {}, set()
    for e in events:
        if e.get("event") == "started" and e.get("attempt", 0) == latest:
            pids[e["rank"]], local[e["rank"]] = e["pid"], e["local_rank"]
        elif e.get("event") == "exited":
            exited.add(e.get("pid"))
    live = {r: p for r, p in pids.items() if p not in exited and _is_our_rank(p, run_id)}
    return live, {r: local[r] for r in live}


def _is_our_rank(pid: int, run_id: str | None) -> bool:
    """Alive, and (when we may read its environment) really that run's rank, not a reused pid."""
    if _gone_reason(pid):
        return False
    try:
        env = psutil.Process(pid).environ()
    except psutil.AccessDenied:
        return True
    except psutil.Error:
        return False
    return run_id is None or env.get("TORCHELASTIC_RUN_ID") == run_id


def find_run_dir(path: str) -> str | None:
    """`path` if it is a run directory, else its newest run directory with live ranks (a log root)."""
    if os.path.isfile(os.path.join(path, EVENTS)):
        return path
    try:
        runs = [os.path.join(path, d) for d in os.listdir(path)]
    except OSError:
        return None
    runs = [d for d in runs if os.path.isfile(os.path.join(d, EVENTS))]
    runs.sort(key=lambda d: os.path.getmtime(os.path.join(d, EVENTS)), reverse=True)
    return next((d for d in runs if live_ranks_in_run_dir(d)[0]), runs[0] if runs else None)


def ranks_of_pid(pid: int) -> tuple[dict[int, int], dict[int, int], str | None]:
    """A rank pid -> that rank; a ranktop pid -> its rank children. ({rank: pid}, {rank: local}, run_dir).

    Only direct children count as ranks: a rank's own children (data loader workers) inherit
    RANK too but are not ranks.
    """
    proc = psutil.Process(pid)
    env = _environ(proc)
    if "RANK" in env and "LOCAL_RANK" in env:
        rank = int(env["RANK"])
        return {rank: pid}, {rank: int(env["LOCAL_RANK"])}, _run_dir_from_env(env)
    pids, local, run_dir = {}, {}, None
    for child in proc.children():
        cenv = _environ(child)
        if "RANK" in cenv and "LOCAL_RANK" in cenv and not _gone_reason(child.pid):
            pids[int(cenv["RANK"])], local[int(cenv["RANK"])] = child.pid, int(cenv["LOCAL_RANK"])
            run_dir = run_dir or _run_dir_from_env(cenv)
    return pids, local, run_dir


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except psutil.Error:
        return {}


def _run_dir_from_env(env: Mapping[str, str]) -> str | None:
    path = env.get(ERROR_FILE_ENV)
    if not path:
        return None
    run_dir = run_dir_of_error_file(path)
    return run_dir if os.path.isfile(os.path.join(run_dir, EVENTS)) else None


# ----- the SIGUSR1 fallback as a grouped view -------------------------------------------------
_FH_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')


def parse_faulthandler(text: str) -> tuple[ThreadStack, ...]:
    """faulthandler's dump (all threads, most recent call first) -> threads, main first.

    The thread that ran the handler ("Current thread") is the main thread: Linux delivers a
    signal sent to a process to its main thread when that thread does not block it, and Python
    threads do not. faulthandler prints no thread names, so other threads are grouped by stack.
    """
    blocks: dict[int, tuple[bool, list[Frame]]] = {}  # by thread id: a second dump replaces the first
    frames: list[Frame] | None = None
    for line in text.splitlines():
        head = _FH_HEADER.match(line.strip())
        if head:
            frames = []
            blocks.pop(int(head.group(2), 16), None)
            blocks[int(head.group(2), 16)] = (head.group(1) == "Current thread", frames)
            continue
        frame = _FH_FRAME.match(line)
        if frame and frames is not None:
            path = frame.group(1)
            frames.append(Frame(frame.group(3), path, os.path.basename(path), int(frame.group(2))))
    threads = [ThreadStack("" if current else "(unnamed)", tid, None, None, False, current, tuple(reversed(fs)))
               for tid, (current, fs) in blocks.items()]
    threads.sort(key=lambda t: not t.is_main)
    return tuple(threads)


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def signal_report(pids: Mapping[int, int], dump_logs: Mapping[int, str], *,
                  local_ranks: Mapping[int, int] | None = None, timeout: float = 3.0,
                  run_dir: RunDir | None = None, events: EventLog | None = None,
                  source: str = "signal") -> StackReport:
    """The grouped view without ptrace: SIGUSR1 to each rank, then read its dump from the log its
    stderr goes to (`layout.dump_log_path`).

    A rank's dump is taken as complete once the new part of that log holds a stack and stops growing.
    """
    started, taken_at = time.perf_counter(), time.time()
    offsets = {r: _size(dump_logs.get(r, "")) for r in pids}
    outcome = signal_pids(pids)
    pending = {r for r, what in outcome.items() if what == "sent"}
    texts: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        time.sleep(0.03)
        for r in list(pending):
            text = _read_from(dump_logs.get(r, ""), offsets[r])
            if "(most recent call first):" in text and texts.get(r) == text:
                pending.discard(r)  # unchanged since the last look: the handler is done
            texts[r] = text
    found = []
    for r in sorted(pids):
        base = {"rank": r, "local_rank": (local_ranks or {}).get(r), "pid": pids[r]}
        threads = parse_faulthandler(texts.get(r, "")) if outcome[r] == "sent" else ()
        if threads:
            found.append(RankStack(**base, status=StackStatus.OK, threads=threads))
        elif outcome[r] == "gone":
            found.append(RankStack(**base, status=StackStatus.GONE, reason="process gone"))
        elif outcome[r] == "sent":
            found.append(RankStack(**base, status=StackStatus.FAILED,
                                   reason=f"no stack in its log within {timeout:g}s",
                                   hint="a Python handler for SIGUSR1 in the program replaces faulthandler's"))
        else:
            found.append(RankStack(**base, status=StackStatus.NOT_PYTHON, reason=outcome[r],
                                   hint="start the ranks with ranktop (faulthandler is on unless --no-faulthandler)"))
    report = build_report(found, taken_at, time.perf_counter() - started)
    return save_report(report, run_dir, events, source) if run_dir else report


def signal_agent_report(agent: Any, local_ranks: Iterable[int] | None = None, timeout: float = 3.0) -> StackReport:
    """`signal_report` for the agent's live ranks (the TUI's fallback when py-spy cannot attach)."""
    snap = agent.snapshot()
    wanted = set(local_ranks) if local_ranks is not None else None
    live = [r for r in snap.ranks if r.pid and r.state.alive and (wanted is None or r.local_rank in wanted)]
    logs = {r.rank: dump_log_path(os.path.join(agent.attempt_dir(), str(r.local_rank))) for r in live}
    return signal_report({r.rank: r.pid for r in live}, logs, local_ranks={r.rank: r.local_rank for r in live},
                         timeout=timeout, run_dir=agent.layout, events=agent.events, source="signal")
