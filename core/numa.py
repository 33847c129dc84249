"""`--numa-binding`: each rank runs on the CPUs near its GPU, as torchrun's binding places it.

A rank using cuda:LOCAL_RANK (CUDA_VISIBLE_DEVICES renumbers) has its GPU on a PCI bus; the bus
belongs to a NUMA node (`/sys/bus/pci/devices/<address>/numa_node`, -1 on a one-node machine,
read as node 0). `node` binds the rank to that node's CPUs, `socket` to every node on the same
physical package; both within the CPUs ranktop itself may use. The binding is the CPU affinity
the rank starts with (its spawning thread's, inherited by fork): its later threads keep it.

`exclusive` and `core-complex` share a node out between the GPUs on it, as torch decides: the
GPUs counted are all those visible (cuda:0..N-1, not only the ones ranks use), a rank's share is
picked by the rank of its cuda index among them. `exclusive` deals out whole physical cores
(hyperthread siblings stay together), in order, the lowest GPUs one extra core each when they do
not divide evenly, and refuses when the node has fewer cores than GPUs. `core-complex` gives each
GPU one group of CPUs sharing the last-level cache, the biggest groups first, round robin when
there are more GPUs than groups. The splits are pure functions of the topology (tested against
torch's own); reading that topology from sysfs stays separate.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from ranktop.core.sanitize import quoted

MODES = ("node", "socket", "exclusive", "core-complex")
SPLITS = ("exclusive", "core-complex")  # the modes that share a node between its GPUs
SYS = "/sys"


class NumaError(Exception):
    """The binding cannot be worked out; the message is the one line to show."""


def pci_address(bus_id: str | bytes) -> str:
    """NVML's "00000000:DC:00.0" as sysfs names it: "0000:dc:00.0"."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    try:
        domain, bus, slot = text.strip().split(":")
        return f"{int(domain, 16) & 0xFFFF:04x}:{bus.lower()}:{slot.lower()}"
    except ValueError:
        raise NumaError(f"unexpected PCI bus id {text!r} from NVML") from None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        raise NumaError(f"cannot read {path}: {exc.strerror or exc}") from None


def cpu_list(text: str) -> set[int]:
    """The kernel's "0-3,8-11" as a set."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def numa_node_of(address: str) -> int:
    return max(int(_read(f"{SYS}/bus/pci/devices/{address}/numa_node")), 0)


def node_cpus(node: int) -> set[int]:
    return cpu_list(_read(f"{SYS}/devices/system/node/node{node}/cpulist"))


def _nodes() -> list[int]:
    return sorted(cpu_list(_read(f"{SYS}/devices/system/node/online")))


def _socket_of(cpu: int) -> int:
    return int(_read(f"{SYS}/devices/system/cpu/cpu{cpu}/topology/physical_package_id"))


def _within_ours(node: int, cpus: set[int]) -> set[int]:
    allowed = cpus & os.sched_getaffinity(0)
    if not allowed:
        raise NumaError(f"NUMA node {node} has no CPU ranktop may run on (its CPUs {sorted(cpus)}, "
                        f"ours {sorted(os.sched_getaffinity(0))})")
    return allowed


def cpus_near(address: str, mode: str) -> set[int]:
    """The CPUs a rank whose GPU is at PCI `address` gets in `node` or `socket` mode, within our own affinity."""
    node = numa_node_of(address)
    cpus = node_cpus(node)
    if mode == "socket" and cpus:
        socket = _socket_of(min(cpus))
        cpus = set().union(*(c for n in _nodes() if (c := node_cpus(n)) and _socket_of(min(c)) == socket))
    return _within_ours(node, cpus)


# ----- splitting a node between its GPUs (pure: the topology comes in as data) ----------------------

def exclusive_share(cpus: set[int], core_of: Mapping[int, int], nth: int, gpus: int) -> set[int]:
    """The CPUs of the `nth` (from 0) of `gpus` GPUs on a node whose usable CPUs are `cpus`;
    `core_of[cpu]` names its physical core (any one id per core). Whole cores in order of their
    id, the first `cores % gpus` GPUs one more each. NumaError when a GPU would get no core."""
    cores: dict[int, set[int]] = {}
    for cpu in cpus:
        cores.setdefault(core_of[cpu], set()).add(cpu)
    ordered = [cores[c] for c in sorted(cores)]
    each, extra = divmod(len(ordered), gpus)
    if each < 1:
        raise NumaError(f"its NUMA node has {len(ordered)} physical core(s) ranktop may use for {gpus} GPUs, "
                        "and exclusive gives each GPU at least one core of its own (torch refuses too)")
    start = nth * each + min(nth, extra)
    return set().union(*ordered[start:start + each + (nth < extra)])


def complex_share(cpus: set[int], complex_of: Mapping[int, int], nth: int) -> set[int]:
    """The CPUs of the `nth` GPU on a node whose usable CPUs are `cpus`; `complex_of[cpu]` names
    the last-level cache it shares (any one id per cache). Groups with more usable CPUs first
    (ties: lower id), round robin past the last."""
    groups: dict[int, set[int]] = {}
    for cpu in cpus:
        groups.setdefault(complex_of[cpu], set()).add(cpu)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    return ordered[nth % len(ordered)][1]


# ----- the topology those need, from sysfs -----------------------------------------------------------

def core_id(cpu: int) -> int:
    """One id per physical core: the lowest CPU among its hyperthread siblings."""
    return min(cpu_list(_read(f"{SYS}/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")))


def complex_id(cpu: int) -> int:
    """One id per core complex: the lowest CPU sharing this one's highest-level data or unified cache."""
    base = f"{SYS}/devices/system/cpu/cpu{cpu}/cache"
    try:
        entries = sorted((e for e in os.listdir(base) if e.startswith("index") and e[5:].isdecimal()),
                         key=lambda e: int(e[5:]))
    except OSError as exc:
        raise NumaError(f"cannot read {base}: {exc.strerror or exc}") from None
    best: tuple[int, str] | None = None
    for entry in entries:
        if _read(f"{base}/{entry}/type") in ("Unified", "Data"):
            level = int(_read(f"{base}/{entry}/level"))
            if best is None or level > best[0]:
                best = (level, entry)
    if best is None:
        raise NumaError(f"{base} lists no data or unified cache, so CPU {cpu}'s core complex cannot be told")
    return min(cpu_list(_read(f"{base}/{best[1]}/shared_cpu_list")))


def split_share(mode: str, node: int, nth: int, gpus: int) -> set[int]:
    """The `nth` of `gpus` GPUs' share of NUMA `node`, within our own affinity."""
    cpus = _within_ours(node, node_cpus(node))
    if mode == "exclusive":
        return exclusive_share(cpus, {c: core_id(c) for c in cpus}, nth, gpus)
    return complex_share(cpus, {c: complex_id(c) for c in cpus}, nth)


def plan(mode: str, local_world_size: int, gpu_of: Callable[[int], int | None],
         bus_id_of: Callable[[int], str | bytes], visible: int | None = None) -> dict[int, frozenset[int]]:
    """{local rank: its CPUs}. `gpu_of(k)` is the NVML index cuda:k lands on (None: cannot be
    told), `bus_id_of(index)` that device's PCI bus id, `visible` how many cuda:k there are (the
    split modes share a node between all of them; None: as many as ranks). NumaError in one line."""
    if mode not in MODES:
        raise NumaError(f"bad --numa-binding {quoted(mode)}: expected one of {', '.join(MODES)}")

    def address(cuda: int) -> str:
        gpu = gpu_of(cuda)
        if gpu is None:
            raise NumaError(f"--numa-binding {mode}: local rank {cuda} has no GPU to follow "
                            "(more ranks than visible GPUs, or CUDA_VISIBLE_DEVICES names a MIG instance)")
        return pci_address(bus_id_of(gpu))

    if mode not in SPLITS:
        return {r: frozenset(cpus_near(address(r), mode)) for r in range(local_world_size)}
    # torch binds cuda:LOCAL_RANK and shares its node with every visible GPU on it.
    gpus = local_world_size if visible is None else visible
    nodes = [numa_node_of(address(cuda)) for cuda in range(gpus)]
    binding = {}
    for local_rank in range(local_world_size):
        if local_rank >= gpus:
            raise NumaError(f"--numa-binding {mode}: local rank {local_rank} has no GPU to follow "
                            f"(cuda:{local_rank}, and {gpus} GPU(s) are visible)")
        peers = [cuda for cuda, node in enumerate(nodes) if node == nodes[local_rank]]
        try:
            share = split_share(mode, nodes[local_rank], peers.index(local_rank), len(peers))
        except NumaError as exc:
            raise NumaError(f"--numa-binding {mode}: GPU cuda:{local_rank}: {exc}") from None
        binding[local_rank] = frozenset(share)
    return binding
