"""`--numa-binding`: each rank runs on the CPUs near its GPU, as torchrun's binding places it.

A rank using cuda:LOCAL_RANK (CUDA_VISIBLE_DEVICES renumbers) has its GPU on a PCI bus; the bus
belongs to a NUMA node (`/sys/bus/pci/devices/<address>/numa_node`, -1 on a one-node machine,
read as node 0). `node` binds the rank to that node's CPUs, `socket` to every node on the same
physical package; both within the CPUs ranktop itself may use. The binding is the CPU affinity
the rank starts with (its spawning thread's, inherited by fork): its later threads keep it.
torch's `exclusive` and `core-complex` split a node's cores between its GPUs; ranktop refuses
them in one line rather than bind differently from torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable

MODES = ("node", "socket", "exclusive", "core-complex")
SUPPORTED = ("node", "socket")
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


def cpus_near(address: str, mode: str) -> set[int]:
    """The CPUs a rank whose GPU is at PCI `address` gets in `mode`, within our own affinity."""
    node = numa_node_of(address)
    cpus = node_cpus(node)
    if mode == "socket" and cpus:
        socket = _socket_of(min(cpus))
        cpus = set().union(*(c for n in _nodes() if (c := node_cpus(n)) and _socket_of(min(c)) == socket))
    allowed = cpus & os.sched_getaffinity(0)
    if not allowed:
        raise NumaError(f"NUMA node {node} has no CPU ranktop may run on (its CPUs {sorted(cpus)}, "
                        f"ours {sorted(os.sched_getaffinity(0))})")
    return allowed


def plan(mode: str, local_world_size: int, gpu_of: Callable[[int], int | None],
         bus_id_of: Callable[[int], str | bytes]) -> dict[int, frozenset[int]]:
    """{local rank: its CPUs}. `gpu_of(local_rank)` is the NVML index the rank lands on (None:
    cannot be told), `bus_id_of(index)` that device's PCI bus id. NumaError in one line."""
    if mode not in SUPPORTED:
        raise NumaError(f"--numa-binding {mode}: not supported by ranktop (it splits a node's cores between its "
                        f"GPUs); use {' or '.join(SUPPORTED)}, or numactl inside the rank's command")
    binding = {}
    for local_rank in range(local_world_size):
        gpu = gpu_of(local_rank)
        if gpu is None:
            raise NumaError(f"--numa-binding {mode}: local rank {local_rank} has no GPU to follow "
                            "(more ranks than visible GPUs, or CUDA_VISIBLE_DEVICES names a MIG instance)")
        binding[local_rank] = frozenset(cpus_near(pci_address(bus_id_of(gpu)), mode))
    return binding
