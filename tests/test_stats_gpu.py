"""cpu%, rss and GPU per rank: real ranks, real process trees; NVML faked at the pynvml boundary."""

from __future__ import annotations

import time

import psutil
import pytest
from conftest import Running, make_agent, wait_for
from ranktop.core.gpu import (
    FAKE_ENV,
    GiB,
    GpuMonitor,
    MiB,
    device_count,
    device_for_local_rank,
)
from ranktop.core.gpu_fake import FakeDevice, FakeNvml, FakeNvmlError
from ranktop.core.stats import StatsSampler, process_tree

SLEEP = "import time; time.sleep(120)"
SPIN_RANK0 = "import os, time\nif os.environ['LOCAL_RANK'] == '0':\n    while True: pass\ntime.sleep(120)"
# The rank itself stays small; its child holds ~100 MB of touched (resident) memory.
CHILD_ALLOCATES = (
    "import subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "\"import time; b = b'x' * (100 << 20); print('allocated', flush=True); time.sleep(120)\"])\n"
    "child.wait()"
)
INTERVAL = 0.1  # fast ticks keep the tests short; the product default is 1 s


def stats(sampler: StatsSampler, r: int, pred) -> bool:
    s = sampler.latest(r)
    return s is not None and bool(pred(s))


def child_pids(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def child_names(pid: int) -> list[str]:
    """The names of `pid`'s children (its direct ones), gone or not."""
    try:
        return sorted(c.name() for c in psutil.Process(pid).children())
    except psutil.Error:
        return []


# ----- cpu and memory --------------------------------------------------------------------------
def test_spinning_rank_shows_high_cpu_and_sleeping_rank_near_zero(tmp_path):
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(FakeNvml(0)))
    with Running(make_agent(tmp_path, SPIN_RANK0, n=2, sampler=sampler)) as agent:
        wait_for(lambda: stats(sampler, 0, lambda s: s.cpu_percent is not None and s.cpu_percent > 40)
                 and stats(sampler, 1, lambda s: s.cpu_percent is not None and s.cpu_percent < 10),
                 timeout=20, what="rank 0 busy and rank 1 idle")
        pids = [r.pid for r in agent.snapshot().ranks]
        assert [sampler.latest(r).pid for r in (0, 1)] == pids
        # The agent's snapshots carry the same numbers to the UI.
        wait_for(lambda: (agent.snapshot().ranks[0].cpu_percent or 0) > 40, what="cpu% in the snapshot")
        # Once the ranks are gone there is nothing to report for them.
        agent.kill_group()
        wait_for(lambda: sampler.latest(0) is None and sampler.latest(1) is None, what="stats dropped after exit")


def test_an_ended_rank_shows_no_stats_even_where_its_last_sample_remains(tmp_path):
    """A sampler that stopped (its run ending, a detached run lingering) keeps its last sample;
    `ranktop attach` and final.json showed `killed SIGTERM  0% 291M` for ranks long gone."""
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(FakeNvml(0)))
    with Running(make_agent(tmp_path, SPIN_RANK0, n=2, sampler=sampler)) as agent:
        wait_for(lambda: all(stats(sampler, r, lambda s: s.rss > 0) for r in (0, 1)), timeout=20, what="sampled")
        sampler.close()  # no pass after this one: the samples of the live ranks stay
        agent.kill_group()
        wait_for(lambda: all(r.exitcode is not None for r in agent.snapshot().ranks), what="the ranks ended")
        assert sampler.latest(0) is not None  # (what the snapshot must not show)
        assert all(r.cpu_percent is None and r.rss is None and r.gpu is None for r in agent.snapshot().ranks)


def test_rss_is_summed_over_the_rank_process_tree(tmp_path):
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(FakeNvml(0)))
    with Running(make_agent(tmp_path, CHILD_ALLOCATES, n=1, sampler=sampler)) as agent:
        wait_for(lambda: any(b"allocated" in line for line in agent.output(0)), timeout=20, what="child allocated")
        pid = agent.snapshot().ranks[0].pid
        wait_for(lambda: stats(sampler, 0, lambda s: s.nprocs >= 2 and s.rss >= 100 * MiB),
                 timeout=10, what="tree rss >= 100 MiB")
        # The rank's own process is far below that: the child's memory is what was counted.
        assert psutil.Process(pid).memory_info().rss < 60 * MiB


def test_restarted_rank_is_sampled_under_its_new_pid(tmp_path):
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(FakeNvml(0)))
    with Running(make_agent(tmp_path, SLEEP, n=1, sampler=sampler)) as agent:
        first = wait_for(lambda: agent.snapshot().ranks[0].pid, what="rank started")
        wait_for(lambda: stats(sampler, 0, lambda s: s.pid == first), what="first pid sampled")
        agent.restart_rank(0)
        second = wait_for(lambda: (p := agent.snapshot().ranks[0].pid) != first and p, timeout=15, what="new pid")
        wait_for(lambda: stats(sampler, 0, lambda s: s.pid == second and s.cpu_percent is not None),
                 timeout=10, what="new pid sampled")


# The rank sleeps; its child holds ~40 MB and spins, and so does the child's own child.
BUSY_TREE = (
    "import subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "\"import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'while True: pass']); "
    "held = b'x' * (40 << 20)\\nwhile True: pass\"])\n"
    "child.wait()"
)


def tree_figures(tree: list[psutil.Process]) -> tuple[list[float], list[int]]:
    """psutil's own figures for each process: user+system seconds, and rss."""
    times = [p.cpu_times() for p in tree]
    return [t.user + t.system for t in times], [p.memory_info().rss for p in tree]


def tick_between_figures(sampler: StatsSampler, tree: list[psutil.Process]) -> dict:
    """One tick of `sampler`, with psutil's figures and the clock read just before and after it."""
    (cpu_before, rss_before), began = tree_figures(tree), time.monotonic()
    sampler.tick()
    ended, (cpu_after, rss_after) = time.monotonic(), tree_figures(tree)
    return {"began": began, "ended": ended, "cpu_before": cpu_before, "rss_before": rss_before,
            "cpu_after": cpu_after, "rss_after": rss_after}


def test_a_busy_trees_cpu_and_rss_are_psutils_figures_from_one_read_per_process(tmp_path):
    """The sampler reads each process's stat once per tick for its cpu time and rss; what it
    reports for a rank's tree lies within psutil's figures read just before and after each tick."""
    sampler = StatsSampler(interval=3600, gpu=GpuMonitor(FakeNvml(0)))  # ticked by hand after the first
    with Running(make_agent(tmp_path, BUSY_TREE, n=1, sampler=sampler)) as agent:
        wait_for(lambda: sampler.ticks >= 1, what="the sampler's own first tick")
        pid = wait_for(lambda: agent.snapshot().ranks[0].pid, what="rank started")
        wait_for(lambda: len(child_pids(pid)) == 2, timeout=20, what="the rank's child and grandchild")
        tree = [psutil.Process(p) for p in (pid, *child_pids(pid))]
        wait_for(lambda: tree_figures(tree)[1][1] >= 40 * MiB, what="the child's memory")
        first = tick_between_figures(sampler, tree)
        wait_for(lambda: sum(tree_figures(tree)[0]) >= sum(first["cpu_after"]) + 0.5, what="some CPU used")
        second = tick_between_figures(sampler, tree)
        got = sampler.latest(0)
        assert (got.pid, got.nprocs) == (pid, 3)
        rss_before, rss_after = second["rss_before"], second["rss_after"]
        assert sum(map(min, rss_before, rss_after)) <= got.rss <= sum(map(max, rss_before, rss_after))
        # Each tick read the counters between psutil's two reads around it, and its clock too.
        lowest = (sum(second["cpu_before"]) - sum(first["cpu_after"])) / (second["ended"] - first["began"])
        highest = (sum(second["cpu_after"]) - sum(first["cpu_before"])) / (second["began"] - first["ended"])
        assert 100 * lowest - 0.1 <= got.cpu_percent <= 100 * highest + 0.1, (lowest, got.cpu_percent, highest)


# The rank is a subreaper (as a process manager inside a rank is); a thread other than its first
# starts a child and stays, and a daemon (its parent exits at once) is re-parented to the rank.
SUBREAPER_RANK = (
    "import ctypes, subprocess, sys, threading, time\n"
    "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"
    "threading.Thread(target=lambda: (subprocess.Popen(['sleep', '120']), time.sleep(120)), daemon=True).start()\n"
    "subprocess.run([sys.executable, '-c', \"import subprocess; subprocess.Popen(['sleep', '120'])\"])\n"
    "time.sleep(120)"
)


def test_a_ranks_tree_is_walked_through_every_thread_and_what_was_re_parented_to_it(tmp_path):
    """A tick walks each rank's tree down its processes' children files, not the node's whole
    process table: a child started by a thread other than the first is in that thread's file
    only, and a daemon whose parent exited is the child of the subreaper it went to. Each is
    counted, once."""
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(FakeNvml(0)))
    with Running(make_agent(tmp_path, SUBREAPER_RANK, n=1, sampler=sampler)) as agent:
        pid = wait_for(lambda: agent.snapshot().ranks[0].pid, what="rank started")
        wait_for(lambda: child_names(pid) == ["sleep", "sleep"], timeout=20, what="the thread's child and the daemon")
        wait_for(lambda: stats(sampler, 0, lambda s: s.nprocs == 3), timeout=10, what="both counted")
        ticks = sampler.ticks
        wait_for(lambda: sampler.ticks >= ticks + 3, what="more ticks")
        assert sampler.latest(0).nprocs == 3


def test_a_cycle_of_parents_in_a_table_read_while_pids_are_reused_ends_the_tree_walk():
    children = {10: [11], 11: [12], 12: [11, 13]}
    assert sorted(process_tree(10, children)) == [10, 11, 12, 13]


# ----- GPU: matching ranks to devices -----------------------------------------------------------
def test_gpu_found_from_nvml_process_list_of_the_rank_tree(tmp_path):
    fake = FakeNvml(2)
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(fake))
    code = "import os, subprocess, sys\nif os.environ['LOCAL_RANK'] == '0':\n" \
           "    subprocess.run([sys.executable, '-c', 'import time; time.sleep(120)'])\nimport time; time.sleep(120)"
    with Running(make_agent(tmp_path, code, n=2, sampler=sampler)) as agent:
        pid0, pid1 = wait_for(lambda: all(r.pid for r in agent.snapshot().ranks)
                              and [r.pid for r in agent.snapshot().ranks], what="pids")
        grandchild = wait_for(lambda: child_pids(pid0), what="rank 0's child")[0]
        # Crossed on purpose (rank 0 on GPU 1), so LOCAL_RANK alone would give the wrong answer.
        # Rank 0 also holds a small stray context on GPU 0: the device with most of its memory wins.
        fake.procs[1] = {grandchild: 3 * GiB}
        fake.procs[0] = {pid1: 2 * GiB, pid0: 300 * MiB}
        wait_for(lambda: stats(sampler, 0, lambda s: s.gpu and s.gpu.index == 1)
                 and stats(sampler, 1, lambda s: s.gpu and s.gpu.index == 0), what="ranks matched to GPUs")
        g0, g1 = sampler.latest(0).gpu, sampler.latest(1).gpu
        assert (g0.util_percent, g0.mem_used, g0.mem_total, g0.proc_mem) == (55.0, 19 * GiB, 80 * GiB, 3 * GiB)
        assert (g1.util_percent, g1.mem_used, g1.proc_mem) == (35.0, 12 * GiB, 2 * GiB)
        assert sampler.gpu_status() is None
        assert agent.snapshot().ranks[0].gpu.index == 1


@pytest.mark.parametrize(
    ("devices", "visible", "expected"),
    [(4, "3,1", [3, 1]), (1, None, [0, None])],
    ids=["CUDA_VISIBLE_DEVICES", "unset: index = local rank"],
)
def test_gpu_falls_back_to_local_rank(tmp_path, monkeypatch, devices, visible, expected):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(FakeNvml(devices)))  # no processes listed
    env = {"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}
    with Running(make_agent(tmp_path, SLEEP, n=2, env=env, sampler=sampler)):
        wait_for(lambda: all(stats(sampler, r, lambda s: s.cpu_percent is not None) for r in (0, 1)),
                 what="both ranks sampled")
        got = [g.index if (g := sampler.latest(r).gpu) else None for r in (0, 1)]
        assert got == expected
        assert sampler.latest(0).gpu.proc_mem is None  # NVML did not list the rank: its own usage is unknown


def test_device_for_local_rank_rules():
    uuids = {0: "GPU-aaaa-1111", 1: "GPU-bbbb-2222"}.get
    assert device_for_local_rank(2, None, 4) == 2
    assert device_for_local_rank(4, None, 4) is None
    assert device_for_local_rank(1, "2,3", 4) == 3
    assert device_for_local_rank(5, "2,3", 4) is None  # more ranks than visible devices
    assert device_for_local_rank(3, "2", 4) == 2  # one visible device: every rank's cuda:0
    assert device_for_local_rank(0, "", 4) is None  # nothing visible
    assert device_for_local_rank(0, "7", 4) is None  # no such device
    assert device_for_local_rank(1, "GPU-aaaa,GPU-bbbb", 2, uuids) == 1  # UUID prefixes
    assert device_for_local_rank(0, "MIG-1234", 2, uuids) is None


def test_the_sampler_as_ranktop_makes_it_reads_nvml_at_most_once_a_second(tmp_path):
    """SPEC 2.6: stats and NVML are sampled at most once a second. The sampler as the command line
    and the TUI make it (no interval given): three reads of a device's utilisation are at least
    two seconds apart, however fast or slow the box (the other tests tick every 0.1 s)."""
    fake = FakeNvml(1)
    sampler = StatsSampler(gpu=GpuMonitor(fake))
    seen: list[float] = []  # when each read was first seen, polled every 20 ms

    def reads() -> bool:
        while len(seen) < fake.calls["nvmlDeviceGetUtilizationRates"]:
            seen.append(time.monotonic())
        return len(seen) >= 3

    with Running(make_agent(tmp_path, SLEEP, n=1, sampler=sampler)):
        wait_for(reads, timeout=20, what="three reads of the device")
    assert seen[2] - seen[0] >= 2 - 0.05, seen  # (a read seen up to one poll late: 20 ms, and a margin)


# ----- GPU: failures ----------------------------------------------------------------------------
def test_no_nvml_says_no_gpu_once_and_keeps_sampling_cpu(tmp_path):
    fake = FakeNvml(init_error=FakeNvmlError(FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"))
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(fake))
    with Running(make_agent(tmp_path, SLEEP, n=1, sampler=sampler)) as agent:
        wait_for(lambda: stats(sampler, 0, lambda s: s.cpu_percent is not None), what="cpu sampled")
        ticks = sampler.ticks
        wait_for(lambda: sampler.ticks >= ticks + 3, what="more ticks")
        assert sampler.gpu_status() == "no GPU"
        assert agent.snapshot().gpu_status == "no GPU"
        assert sampler.latest(0).gpu is None
        assert fake.calls["nvmlInit"] == 1  # never retried
        assert sampler.last_error is None


@pytest.mark.parametrize(
    ("fake", "status"),
    [
        (FakeNvml(0), "no GPU"),
        (FakeNvml(init_error=FakeNvmlError(FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded")), "no GPU"),
        (FakeNvml(init_error=FakeNvmlError(999, "Unknown Error")), "NVML error: Unknown Error"),
    ],
    ids=["zero devices", "driver not loaded", "other error"],
)
def test_init_outcomes(fake, status):
    monitor = GpuMonitor(fake)
    assert monitor.start() == status
    assert monitor.start() == status and fake.calls["nvmlInit"] == 1
    assert monitor.read_devices() == {} and monitor.count == 0
    monitor.close()
    assert device_count(FakeNvml(3)) == 3 and device_count(fake) == 0


def test_nvml_error_on_one_device_mid_run_spares_the_others(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml(2)
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(fake))
    with Running(make_agent(tmp_path, SLEEP, n=2, sampler=sampler)):
        wait_for(lambda: all(stats(sampler, r, lambda s: s.gpu and s.gpu.util_percent is not None) for r in (0, 1)),
                 what="both GPUs sampled")
        fake.devices[0].error = FakeNvmlError(FakeNvml.NVML_ERROR_GPU_IS_LOST, "GPU is lost")
        wait_for(lambda: stats(sampler, 0, lambda s: s.gpu and s.gpu.util_percent is None), what="GPU 0 blanked")
        assert sampler.gpu_status() == "GPU 0: GPU is lost"
        assert sampler.latest(1).gpu.util_percent == 55.0
        assert sampler.latest(0).cpu_percent is not None  # cpu/rss unaffected
        fake.devices[0].error = None  # a transient error clears by itself
        wait_for(lambda: stats(sampler, 0, lambda s: s.gpu and s.gpu.util_percent == 35.0), what="GPU 0 back")
        wait_for(lambda: sampler.gpu_status() is None, what="status cleared")
        assert fake.calls["nvmlInit"] == 1 and sampler.last_error is None


def test_unsupported_utilisation_is_blank_not_an_error():
    fake = FakeNvml(2)
    fake.devices[1].util_supported = False
    monitor = GpuMonitor(fake)
    assert monitor.start() is None
    readings = monitor.read_devices()
    assert readings[1].util_percent is None and readings[1].mem_used == 19 * GiB and readings[1].error is None
    assert readings[0].util_percent == 35.0 and monitor.status() is None
    monitor.close()
    assert monitor.read_devices() == {} and fake.calls["nvmlShutdown"] == 1


def test_real_pynvml_backend_without_a_gpu_is_no_gpu(monkeypatch):
    monkeypatch.delenv(FAKE_ENV, raising=False)
    monitor = GpuMonitor()  # the real pynvml
    status = monitor.start()
    try:
        if status is None:  # a machine with NVIDIA GPUs: the same code must read them
            assert monitor.count >= 1 and device_count() == monitor.count
            assert all(d.error is None and d.mem_total for d in monitor.read_devices().values())
        else:
            assert status == "no GPU"
            assert device_count() == 0
            assert monitor.read_devices() == {}
    finally:
        monitor.close()


# ----- RANKTOP_FAKE_GPUS ------------------------------------------------------------------------
def test_fake_gpus_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_ENV, "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_count() == 2
    from ranktop.tui.cli import parse_nproc

    assert parse_nproc("gpu") == 2
    sampler = StatsSampler(interval=INTERVAL)  # default monitor: picks the fake up from the environment
    with Running(make_agent(tmp_path, SLEEP, n=3, sampler=sampler)) as agent:
        # Each rank is listed on device LOCAL_RANK % 2, using 1.5 GiB + 256 MiB * LOCAL_RANK.
        wait_for(lambda: all(stats(sampler, r, lambda s: s.gpu and s.gpu.proc_mem) for r in range(3)),
                 what="fake GPUs matched")
        gpus = [r.gpu for r in agent.snapshot().ranks]
        assert [g.index for g in gpus] == [0, 1, 0]
        assert [g.proc_mem for g in gpus] == [int(1.5 * GiB) + 256 * MiB * r for r in range(3)]
        assert [g.util_percent for g in gpus] == [35.0, 55.0, 35.0]
        assert sampler.gpu_status() is None


def test_fake_gpus_zero_means_no_gpu(monkeypatch):
    monkeypatch.setenv(FAKE_ENV, "0")
    assert device_count() == 0
    sampler = StatsSampler(interval=INTERVAL)
    sampler.attach(None)  # nothing to sample at all: still no crash
    try:
        wait_for(lambda: sampler.gpu_status() == "no GPU", what="no GPU status")
    finally:
        sampler.close()


class CountsTooMany(FakeNvml):
    """An NVML whose device count no node has."""

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - pynvml's name
        return 10**9


def test_an_nvml_that_counts_a_billion_devices_is_an_error_and_cpu_is_still_sampled(tmp_path):
    """The sampler asked for a handle of each of them before its first tick: no cpu% or rss ever."""
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(CountsTooMany(1)))
    with Running(make_agent(tmp_path, SLEEP, n=1, sampler=sampler)):
        wait_for(lambda: stats(sampler, 0, lambda s: s.cpu_percent is not None), timeout=20, what="cpu sampled")
        assert sampler.gpu_status() == "NVML error: it counts 1000000000 devices"
        assert sampler.latest(0).gpu is None


def test_nvml_values_no_device_has_are_unknown_and_its_error_text_is_cleaned(tmp_path, monkeypatch):
    """A 300-digit utilisation, negative memory, a process that is no pid, an error with escapes
    and 10,000 characters: each went as it was to the rank's title and the header."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    lost = FakeNvmlError(FakeNvml.NVML_ERROR_GPU_IS_LOST, "\x1b]0;owned\x07GPU is lost\n" + "y" * 10_000)
    fake = FakeNvml([FakeDevice(util=1e300, mem_used=-5), FakeDevice(util=-3, mem_total=-1), FakeDevice(error=lost)])
    sampler = StatsSampler(interval=INTERVAL, gpu=GpuMonitor(fake))
    with Running(make_agent(tmp_path, SLEEP, n=2, sampler=sampler)) as agent:
        pid0 = wait_for(lambda: agent.snapshot().ranks[0].pid, what="rank 0's pid")
        fake.procs[0] = {pid0: -7, "not a pid": 5}
        wait_for(lambda: all(stats(sampler, r, lambda s: s.gpu is not None) for r in (0, 1)), what="GPUs sampled")
        g0, g1 = sampler.latest(0).gpu, sampler.latest(1).gpu
        assert (g0.index, g0.util_percent, g0.mem_used, g0.mem_total, g0.proc_mem) == (0, None, None, 80 * GiB, None)
        assert (g1.index, g1.util_percent, g1.mem_total) == (1, None, None)
        status = sampler.gpu_status()
        assert status.startswith("GPU 2: GPU is lost␊yyy") and len(status) == len("GPU 2: ") + 200, status[:80]
