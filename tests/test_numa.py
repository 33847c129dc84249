"""--numa-binding exclusive and core-complex: torch's splits of a NUMA node between its GPUs.

The splits are pure functions of the topology (core/numa.py), compared here with torch's own
(torch/numa/binding.py) on made-up topologies: torch's reads of the GPUs and sysfs are replaced by
the same made-up data, its splitting logic runs as shipped. Then the real thing: the fake NVML
places GPUs at this machine's real PCI addresses, sysfs is read for real, and the ranks report the
CPUs they started on.
"""

from __future__ import annotations

import os

import pytest
from conftest import run_ranktop

binding = pytest.importorskip("torch.numa.binding")

from ranktop.core.numa import NumaError, complex_share, exclusive_share  # noqa: E402


def _ht(cores: int) -> dict[int, int]:
    """cores physical cores, two threads each: CPU c and c + cores share core c."""
    return {cpu: cpu % cores for cpu in range(2 * cores)}


# (id, GPU -> NUMA node, node -> CPUs, CPU -> core, CPU -> last-level cache, our affinity)
TOPOLOGIES = [
    ("16-cores-ht-4-gpus", [0] * 4, {0: set(range(32))}, _ht(16), {c: 0 for c in range(32)}, set(range(32))),
    ("10-cores-3-gpus-uneven", [0] * 3, {0: set(range(10))}, {c: c for c in range(10)},
     {c: 0 for c in range(10)}, set(range(10))),
    ("two-nodes-3-and-1-gpus", [0, 1, 0, 0], {0: set(range(8)), 1: set(range(8, 16))},
     {c: c for c in range(16)}, {c: c // 4 * 4 for c in range(16)}, set(range(16))),
    ("affinity-cuts-cores-and-a-complex", [0] * 6, {0: set(range(16))}, {c: c - c % 2 for c in range(16)},
     {c: c // 4 * 4 for c in range(16)}, set(range(16)) - {0, 1, 5, 9}),
    ("gpus-beyond-complexes", [0] * 5, {0: set(range(8))}, {c: c for c in range(8)},
     {c: 0 if c < 3 else 3 for c in range(8)}, set(range(8))),
    ("fewer-cores-than-gpus", [0] * 3, {0: set(range(4))}, _ht(2), {c: 0 for c in range(4)}, set(range(4))),
]


def _torch_split(monkeypatch, mode: str, gpu: int, nodes, node_cpus, core_of, complex_of, ours) -> set[int]:
    """torch's answer, its GPU and sysfs reads served from the made-up topology."""
    siblings = {cpu: {c for c in core_of if core_of[c] == core_of[cpu]} for cpu in core_of}
    caches = {cpu: {c for c in complex_of if complex_of[c] == complex_of[cpu]} for cpu in complex_of}
    monkeypatch.setattr(binding, "_get_numa_node_index_for_gpu_index", lambda *, gpu_index: nodes[gpu_index])
    monkeypatch.setattr(binding, "_get_gpu_count", lambda: len(nodes))
    monkeypatch.setattr(binding, "_get_allowed_logical_cpu_indices_for_numa_node",
                        lambda *, numa_node_index: node_cpus[numa_node_index] & ours)
    monkeypatch.setattr(binding, "_get_logical_cpu_indices_sharing_same_physical_core_as",
                        lambda *, logical_cpu_index: siblings[logical_cpu_index])
    monkeypatch.setattr(binding, "_get_logical_cpus_sharing_same_max_level_cache_as",
                        lambda *, logical_cpu_index: caches[logical_cpu_index])
    options = binding.NumaOptions(affinity_mode=binding.AffinityMode(mode))
    return set(binding._get_logical_cpus_to_bind_to(gpu_index=gpu, numa_options=options))


def _our_split(mode: str, gpu: int, nodes, node_cpus, core_of, complex_of, ours) -> set[int]:
    peers = [g for g, node in enumerate(nodes) if node == nodes[gpu]]
    cpus = node_cpus[nodes[gpu]] & ours
    if mode == "exclusive":
        return exclusive_share(cpus, core_of, peers.index(gpu), len(peers))
    return complex_share(cpus, complex_of, peers.index(gpu))


@pytest.mark.parametrize("mode", ["exclusive", "core-complex"])
@pytest.mark.parametrize("topology", TOPOLOGIES, ids=[t[0] for t in TOPOLOGIES])
def test_split_is_torchs(monkeypatch, mode, topology):
    _, nodes, *rest = topology
    for gpu in range(len(nodes)):
        try:
            theirs = _torch_split(monkeypatch, mode, gpu, nodes, *rest)
        except RuntimeError as exc:
            with pytest.raises(NumaError, match="physical core"):
                _our_split(mode, gpu, nodes, *rest)
            assert "physical cores" in str(exc)
            continue
        assert _our_split(mode, gpu, nodes, *rest) == theirs, (mode, gpu)


def test_uneven_split_gives_the_lowest_gpus_the_extra_core_and_keeps_siblings_together():
    # 5 cores, hyperthreads c and c+5; 2 GPUs: the first gets 3 cores, the second 2.
    core_of = {cpu: cpu % 5 for cpu in range(10)}
    assert exclusive_share(set(range(10)), core_of, 0, 2) == {0, 1, 2, 5, 6, 7}
    assert exclusive_share(set(range(10)), core_of, 1, 2) == {3, 4, 8, 9}
    with pytest.raises(NumaError, match="has 5 physical core"):
        exclusive_share(set(range(10)), core_of, 0, 6)


def _real_torch_split(monkeypatch, mode: str, gpus: int) -> dict[int, set[int]]:
    """torch's split of this machine: only its CUDA calls are served (every fake GPU sits at a real
    PCI device whose node sysfs gives); the CPUs, cores and caches it reads from the real sysfs."""
    from ranktop.core.gpu_fake import fake_device
    from ranktop.core.numa import numa_node_of, pci_address

    nodes = [numa_node_of(pci_address(fake_device(i).pci_bus_id)) for i in range(gpus)]
    monkeypatch.setattr(binding, "_get_numa_node_index_for_gpu_index", lambda *, gpu_index: nodes[gpu_index])
    monkeypatch.setattr(binding, "_get_gpu_count", lambda: gpus)
    options = binding.NumaOptions(affinity_mode=binding.AffinityMode(mode))
    return {g: set(binding._get_logical_cpus_to_bind_to(gpu_index=g, numa_options=options)) for g in range(gpus)}


WHERE = "import os\nprint('cpus', sorted(os.sched_getaffinity(0)), flush=True)\n"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split between two GPUs")
@pytest.mark.parametrize("mode", ["exclusive", "core-complex"])
def test_ranks_start_on_torchs_share_of_this_machine(monkeypatch, tmp_path, mode):
    """Two fake GPUs on this machine's node: each rank starts on the CPUs torch would give it."""
    expected = _real_torch_split(monkeypatch, mode, 2)
    script = tmp_path / "where.py"
    script.write_text(WHERE)
    res = run_ranktop("--headless", "--numa-binding", mode, "--nproc-per-node", "2", "--log-dir",
                      str(tmp_path / "logs"), str(script), env={**os.environ, "RANKTOP_FAKE_GPUS": "2"})
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert f"[default{rank}]:cpus {sorted(expected[rank])}" in res.stdout, res.stdout
    if mode == "exclusive" and _one_thread_per_core_single_node():
        # Here (2 CPUs, one NUMA node, no hyperthreads): one CPU each, not the same one.
        assert len(expected[0]) == len(expected[1]) == 1 and expected[0] != expected[1]


def _sys(path: str) -> str:
    with open(f"/sys/devices/system/{path}") as f:
        return f.read().strip()


def _one_thread_per_core_single_node() -> bool:
    return _sys("node/online") == "0" and len(os.sched_getaffinity(0)) == 2 and all(
        _sys(f"cpu/cpu{c}/topology/thread_siblings_list") == str(c) for c in os.sched_getaffinity(0))


def test_core_complex_here_is_the_l3_group():
    """Read sysfs directly: each CPU's level-3 cache group is what core-complex binds to."""
    from ranktop.core.gpu import numa_binding
    from ranktop.core.gpu_fake import FakeNvml
    from ranktop.core.numa import cpu_list

    plan = numa_binding("core-complex", 2, None, nvml=FakeNvml(2))
    for rank, cpus in plan.items():
        cache = f"cpu/cpu{min(cpus)}/cache"
        l3 = [e for e in os.listdir(f"/sys/devices/system/{cache}")
              if e.startswith("index") and _sys(f"{cache}/{e}/level") == "3"]
        if not l3:
            pytest.skip("no level-3 cache listed in sysfs here")
        group = cpu_list(_sys(f"{cache}/{l3[0]}/shared_cpu_list"))
        assert cpus == group & os.sched_getaffinity(0), (rank, cpus, group)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or _sys("node/online") != "0",
                    reason="needs two CPUs on one NUMA node")
def test_every_visible_gpu_takes_its_share_as_torch_counts_them():
    """torch shares a node between all visible GPUs on it, used by a rank or not; a GPU that
    CUDA_VISIBLE_DEVICES hides takes nothing."""
    from ranktop.core.gpu import numa_binding
    from ranktop.core.gpu_fake import FakeNvml

    ours = os.sched_getaffinity(0)
    assert numa_binding("exclusive", 1, None, nvml=FakeNvml(2)) == {0: frozenset({min(ours)})}
    assert numa_binding("exclusive", 1, "1", nvml=FakeNvml(3)) == {0: frozenset(ours)}
    with pytest.raises(NumaError, match=r"--numa-binding exclusive: local rank 1 has no GPU to follow \(cuda:1, "
                                        r"and 1 GPU\(s\) are visible\)"):
        numa_binding("exclusive", 2, "1,7", nvml=FakeNvml(3))
