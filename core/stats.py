"""Per-rank cpu%, rss and GPU, sampled by one background thread.

The UI never waits on this: `latest()` returns what the last tick found. A tick asks its source
(the engine, or an agent) for each running rank's pid and start environment with
`rank_processes()` (a restart brings new pids, so nothing is remembered across ticks but the
per-process counters), walks each rank's process tree down from the rank through the /proc
children files of each process's threads (never the whole process table: that grew with the
node, 2000 idle processes elsewhere made a tick of 8 ranks ~10x dearer), and asks the GPU monitor
about the same trees.

cpu% is per process tree, 100 = one core busy (like `top`); rss is summed over the tree, so
memory shared between a rank and its children (fork, shared memory) is counted more than once.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import psutil
from ranktop.core.gpu import GpuMonitor, RankQuery
from ranktop.core.guard import process_table, read_proc_file, stat_fields, thread_children
from ranktop.core.state import GpuSample

_CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class RankStats:
    pid: int
    cpu_percent: float | None  # None until a rank has been seen twice
    rss: int | None  # bytes
    gpu: GpuSample | None
    nprocs: int  # processes in the rank's tree (the rank itself included)
    sampled_at: float  # time.time()


# A process is known by (pid, start time in clock ticks) so that a reused pid is a new process.
ProcKey = tuple[int, int]

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class ProcSample(NamedTuple):
    """One process as one read of its /proc/PID/stat found it."""

    ppid: int
    start: int  # clock ticks since boot
    cpu: float  # user + system seconds so far
    rss: int  # bytes, roughly (resident_bytes has them exactly)
    threads: int = 1


def resident_bytes(pid: int) -> int | None:
    """`pid`'s resident memory from /proc/PID/statm, as psutil's memory_info() reads it; None when
    it is gone. Not stat's rss field: on recent kernels (6.18 here) that reads the per-CPU memory
    counters without adding what each CPU holds back (56 pages short here on a 2-core box, up to
    a batch of pages per CPU on a big node), where statm sums them."""
    try:
        return int(read_proc_file(f"/proc/{pid}/statm").split()[1]) * _PAGE
    except (OSError, IndexError):  # gone (also between the open and the read)
        return None


def read_sample(pid: int) -> ProcSample | None:
    """What the sampler needs of `pid` from its stat; None when it is gone. The table's one read
    of each process holds the CPU times that psutil's cpu_times() read again for each rank's."""
    fields = stat_fields(pid)
    if fields is None or len(fields) < 22:
        return None
    # Fields 4 (the parent), 14 and 15 (user and system time), 20 (threads), 22 (start) and 24
    # (rss, in pages), counted from 1 with the pid; stat_fields starts at field 3.
    cpu = (int(fields[11]) + int(fields[12])) / _TICKS
    return ProcSample(int(fields[1]), int(fields[19]), cpu, int(fields[21]) * _PAGE, int(fields[17]))


@functools.cache
def children_files() -> bool:
    """Whether this kernel has /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN); without
    them a tick reads the whole process table."""
    return os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children")


def scan_trees(roots: Iterable[int]) -> tuple[dict[int, ProcSample], dict[int, list[int]]]:
    """(pid -> ProcSample, pid -> its children) for `roots` and everything below them, walked
    down through the children files: a few reads per process of the ranks' trees, where the table
    read every process of the node. Each process is read once and listed under one parent only:
    a child re-parented while the walk reads (its parent exited, it went to a subreaper in the
    tree) can show in both parents' files, and a reused pid can make a cycle."""
    table: dict[int, ProcSample] = {}
    children: dict[int, list[int]] = {}
    todo = list(roots)
    listed = set(todo)
    while todo:
        pid = todo.pop()
        proc = read_sample(pid)
        if proc is None:
            continue  # gone (its children went to a subreaper: ranktop, or one in the tree)
        table[pid] = proc
        children[pid] = [child for child in children_of_process(pid, proc.threads) if child not in listed]
        listed.update(children[pid])
        todo.extend(children[pid])
    return table, children


def children_of_process(pid: int, threads: int) -> list[int]:
    """`pid`'s children: each is in the children file of the thread that started it (or, as a
    subreaper's orphan, that was given it), so a process of several threads has each read
    (`threads`, as its stat said just before: one file for most processes, no listing)."""
    tids = [pid] if threads == 1 else _threads_of(pid)
    found: list[int] = []
    for tid in tids:
        try:
            found += thread_children(pid, tid)
        except (OSError, ValueError):  # the thread or the process ended meanwhile
            continue
    return found


def _threads_of(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def scan_processes() -> dict[int, ProcSample]:
    """pid -> ProcSample for every process, from one pass over /proc (the guard's walk of the
    table, which ranktop's sweeps share).

    A tick reads the table only where the kernel has no children files (`children_files`).
    """
    try:
        return process_table(read_sample)
    except OSError:  # no /proc to list
        return _scan_with_psutil()


def _scan_with_psutil() -> dict[int, ProcSample]:
    table = {}
    boot = psutil.boot_time()
    for p in psutil.process_iter(["ppid", "create_time", "cpu_times", "memory_info"]):
        times, memory = p.info["cpu_times"], p.info["memory_info"]
        if times is None or memory is None:
            continue  # not ours to read
        start = int(((p.info["create_time"] or boot) - boot) * _TICKS)
        table[p.pid] = ProcSample(p.info["ppid"] or 0, start, times.user + times.system, memory.rss)
    return table


def children_of(table: Mapping[int, ProcSample]) -> dict[int, list[int]]:
    """pid -> its children's pids in `table`: made once per tick, for every rank's tree."""
    children: dict[int, list[int]] = {}
    for pid, proc in table.items():
        children.setdefault(proc.ppid, []).append(pid)
    return children


def process_tree(root: int, children: Mapping[int, list[int]]) -> list[int]:
    """`root` and all its descendants in `children` (children_of's map), root first, each once:
    a table read while pids are reused can show a cycle of parents."""
    out, todo, found = [], [root], {root}
    while todo:
        pid = todo.pop()
        out.append(pid)
        for child in children.get(pid, ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return out


def _born_within(start: int, seconds: float) -> bool:
    """Did a process that started at `start` (clock ticks since boot) start in the last `seconds`?
    One tick of slack: the start is counted in whole ticks."""
    return (start + 1) / _TICKS >= time.clock_gettime(time.CLOCK_BOOTTIME) - seconds


@dataclass
class _Counter:
    """What we keep about one process between ticks: its cpu time at the last tick."""

    cpu: float  # user+system seconds
    visible_devices: str | None = None
    env_read: bool = False


class StatsSampler:
    """The one sampling thread: `attach(engine)`, then `latest(local_rank)` from any thread."""

    def __init__(self, interval: float = 1.0, gpu: GpuMonitor | None = None):
        self.interval = interval
        self.gpu = gpu if gpu is not None else GpuMonitor.from_env()
        self.ticks = 0  # completed ticks; tests wait on it
        self.last_error: str | None = None  # the last unexpected error inside a tick, for debugging
        self._agent: Any = None
        self._latest: dict[int, RankStats] = {}
        self._counters: dict[ProcKey, _Counter] = {}
        self._last_tick: float | None = None  # monotonic
        self._gpu_started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- the interface -----------------------------------------------------------------------
    def attach(self, agent: Any) -> StatsSampler:
        """Sample the ranks of `agent` (anything with `rank_processes()`: a LocalEngine or its agent)
        from now on; fine before the run started (nothing to see yet)."""
        self._agent = agent
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ranktop-stats", daemon=True)
            self._thread.start()
        return self

    def latest(self, local_rank: int) -> RankStats | None:
        """The last sample of a live rank; None before the first one or once it exited."""
        return self._latest.get(local_rank)

    def gpu_status(self) -> str | None:
        """Why there is no GPU data ("no GPU", "NVML error: ..."); None while GPUs are fine or not asked yet."""
        return self.gpu.status() if self._gpu_started else None

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # A wedged GPU can hang an NVML call: do not hang with it (the thread is a daemon).
            thread.join(timeout=max(5.0, 2 * self.interval))
            if thread.is_alive():
                return  # shutting NVML down under a call in flight is worse than leaving it
        self.gpu.close()

    # ----- the thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        # NVML's first init can take seconds on a big node: that is why it happens here.
        try:
            self.gpu.start()
        except Exception as exc:  # GpuMonitor catches NVML's errors; this is a last line of defence
            self.last_error = f"GPU init: {exc!r}"
        self._gpu_started = True
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.tick()
            except Exception as exc:  # a sampler must never take the supervisor down
                self.last_error = repr(exc)
            self.ticks += 1
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - began)))

    def tick(self) -> None:
        """One sample of every live rank (called by the thread; public for callers without one)."""
        ranks = _live_ranks(self._agent)
        now = time.monotonic()
        elapsed = None if self._last_tick is None else now - self._last_tick
        roots = {r: pid for r, (pid, _env) in ranks.items()}
        table, children = _read_trees(roots.values())
        seen: dict[ProcKey, _Counter] = {}
        found: dict[int, tuple[int, float | None, int, list[int]]] = {}
        for r, pid in roots.items():
            if pid not in table:
                continue  # exited between the slot read and the scan
            tree = process_tree(pid, children)
            cpu, rss = self._measure_tree(tree, table, seen, elapsed)
            found[r] = (pid, cpu, rss, tree)
        self._counters = seen  # forget processes that are gone
        self._last_tick = now
        gpus = self._sample_gpus(ranks, found, table)
        stamp = time.time()
        self._latest = {
            r: RankStats(pid=pid, cpu_percent=cpu, rss=rss, gpu=gpus.get(r), nprocs=len(tree), sampled_at=stamp)
            for r, (pid, cpu, rss, tree) in found.items()
        }

    def _measure_tree(
        self, tree: list[int], table: Mapping[int, ProcSample], seen: dict[ProcKey, _Counter],
        elapsed: float | None,
    ) -> tuple[float | None, int]:
        cpu_delta, rss, baseline = 0.0, 0, False
        for i, pid in enumerate(tree):
            proc = table[pid]
            key = (pid, proc.start)
            counter = self._counters.get(key)
            if counter is not None:
                cpu_delta += max(0.0, proc.cpu - counter.cpu)
                baseline = baseline or i == 0
                counter.cpu = proc.cpu
            else:
                counter = _Counter(proc.cpu)
                if elapsed is not None and _born_within(proc.start, elapsed):
                    cpu_delta += proc.cpu  # all of a newcomer's cpu time falls into this interval
            resident = resident_bytes(pid)
            rss += proc.rss if resident is None else resident
            seen[key] = counter
        # The rank's own process needs two samples; before that its cpu% would be a guess.
        cpu = round(100.0 * cpu_delta / elapsed, 1) if baseline and elapsed else None
        return cpu, rss

    # ----- GPU ---------------------------------------------------------------------------------
    def _sample_gpus(self, ranks: dict, found: dict, table: Mapping[int, ProcSample]) -> dict[int, GpuSample | None]:
        if not found or not self.gpu.ok:
            return {}
        queries = {
            r: RankQuery(frozenset(tree), self._visible_devices(ranks[r][1], (pid, table[pid].start)))
            for r, (pid, _cpu, _rss, tree) in found.items()
        }
        try:
            return self.gpu.sample(queries)
        except Exception as exc:  # GpuMonitor handles NVML errors; anything else must not stop cpu/rss
            self.last_error = f"GPU sample: {exc!r}"
            return {}

    def _visible_devices(self, started_env: Mapping[str, str], key: ProcKey) -> str | None:
        """The rank's CUDA_VISIBLE_DEVICES as it was started (read once per process)."""
        counter = self._counters.get(key)
        if counter is not None and counter.env_read:
            return counter.visible_devices
        try:
            value = psutil.Process(key[0]).environ().get(_CUDA_VISIBLE) if counter is not None else None
        except psutil.Error:
            # Not readable: the environment we gave it says the same unless the rank changed it.
            env = {**os.environ, **started_env}
            value = env.get(_CUDA_VISIBLE)
        if counter is not None:
            counter.visible_devices, counter.env_read = value, True
        return value


def _read_trees(roots: Iterable[int]) -> tuple[Mapping[int, ProcSample], Mapping[int, list[int]]]:
    """What a tick knows of the processes: those of the ranks' trees (scan_trees), or the whole
    table where the kernel has no children files; nothing without ranks."""
    roots = list(roots)
    if not roots:
        return {}, {}
    if children_files():
        return scan_trees(roots)
    table = scan_processes()
    return table, children_of(table)


def _live_ranks(source: Any) -> dict[int, tuple[int, Mapping[str, str]]]:
    """local rank -> (pid, the environment it was started with) of each running rank, as the
    engine (or its agent) tells it; nothing when there is no source yet."""
    if source is None:
        return {}
    return source.rank_processes()
