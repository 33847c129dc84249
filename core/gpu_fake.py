"""A pynvml-shaped fake NVML: the one fake the tests may use, and `RANKTOP_FAKE_GPUS=N` for demos.

`GpuMonitor` reads devices through whatever module object it is given, so the fake only has to
answer the same calls with the same shapes (and raise the same kind of error) as `pynvml`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil
from ranktop.core.gpu import (
    FAKE_ENV,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    GiB,
    MiB,
)
from ranktop.core.sanitize import quoted


class FakeNvmlError(Exception):
    """Shaped like pynvml.NVMLError: carries NVML's numeric `value`."""

    def __init__(self, value: int, text: str = ""):
        super().__init__(value)
        self.value = value
        self.text = text

    def __str__(self) -> str:
        return self.text or f"NVML Error with code {self.value}"


MAX_FAKE_DEVICES = 1024


@dataclass
class FakeDevice:
    util: float = 0.0
    mem_used: int = 0
    mem_total: int = 80 * GiB
    uuid: str = ""
    error: FakeNvmlError | None = None  # raised by every query of this device while set
    util_supported: bool = True  # False: utilisation raises Not Supported, as on a MIG-mode GPU
    pci_bus_id: str = "00000000:00:00.0"  # NVML's form; see fake_device


@dataclass
class _ProcInfo:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - pynvml's field name


class FakeNvml:
    """A pynvml-shaped module object with scriptable devices, processes and errors.

    `procs[i]` maps pid -> bytes for device i; `process_source`, when set, is called with the
    device index instead (used by RANKTOP_FAKE_GPUS to follow live processes). `calls` counts
    every NVML function called, so tests can check, e.g., that init is tried once.
    """

    NVMLError = FakeNvmlError
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = 15

    def __init__(
        self,
        devices: int | list[FakeDevice] = 0,
        *,
        init_error: FakeNvmlError | None = None,
        process_source: Callable[[int], Mapping[int, int | None]] | None = None,
    ):
        if isinstance(devices, int):
            devices = [fake_device(i) for i in range(devices)]
        self.devices = devices
        self.init_error = init_error
        self.process_source = process_source
        self.procs: dict[int, dict[int, int | None]] = {i: {} for i in range(len(devices))}
        self.calls: Counter[str] = Counter()
        self.initialised = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FakeNvml | None:
        """RANKTOP_FAKE_GPUS=N: N devices; device i reports the local processes whose LOCAL_RANK % N == i.

        None when the variable is unset (the caller then uses the real pynvml).
        """
        text = environ.get(FAKE_ENV, "").strip()
        if not text:
            return None
        try:
            n = max(0, int(text))
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_FAKE_DEVICES:  # (a huge N would build N devices first, for minutes)
            return cls(init_error=FakeNvmlError(NVML_ERROR_LIBRARY_NOT_FOUND,
                                                f"bad {FAKE_ENV}={quoted(text[:40])}: 0 to {MAX_FAKE_DEVICES} devices"))
        fake = cls(n)
        fake.process_source = _LocalRankProcesses(n)
        return fake

    # -- the pynvml surface -----------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise self.init_error
        self.initialised += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.calls["nvmlShutdown"] += 1
        self.initialised = max(0, self.initialised - 1)

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self.calls["nvmlDeviceGetCount"] += 1
        self._check_init()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        self.calls["nvmlDeviceGetHandleByIndex"] += 1
        self._check_init()
        if not 0 <= index < len(self.devices):
            raise FakeNvmlError(2, "Invalid Argument")
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        self.calls["nvmlDeviceGetUUID"] += 1
        return self._device(handle).uuid

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:  # noqa: N802
        self.calls["nvmlDeviceGetPciInfo"] += 1
        return _Pci(self._device(handle).pci_bus_id)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802
        self.calls["nvmlDeviceGetUtilizationRates"] += 1
        dev = self._device(handle)
        if not dev.util_supported:
            raise FakeNvmlError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
        return _Util(gpu=int(dev.util), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        self.calls["nvmlDeviceGetMemoryInfo"] += 1
        dev = self._device(handle)
        return _Mem(total=dev.mem_total, used=dev.mem_used, free=dev.mem_total - dev.mem_used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[_ProcInfo]:  # noqa: N802
        self.calls["nvmlDeviceGetComputeRunningProcesses"] += 1
        self._device(handle)
        procs = self.process_source(handle) if self.process_source else self.procs.get(handle, {})
        return [_ProcInfo(pid, mem) for pid, mem in dict(procs).items()]

    def _check_init(self) -> None:
        if not self.initialised:
            raise FakeNvmlError(1, "Uninitialized")

    def _device(self, handle: int) -> FakeDevice:
        self._check_init()
        dev = self.devices[handle]
        if dev.error is not None:
            raise dev.error
        return dev


@dataclass(frozen=True)
class _Pci:
    busId: str  # noqa: N815 - pynvml's field name


@dataclass(frozen=True)
class _Util:
    gpu: int
    memory: int


@dataclass(frozen=True)
class _Mem:
    total: int
    used: int
    free: int


def fake_device(index: int) -> FakeDevice:
    """Deterministic, distinct values per device, so screenshots and tests can tell them apart.
    Its PCI address is one of this machine's real devices (so --numa-binding reads real sysfs)."""
    return FakeDevice(util=float((35 + 20 * index) % 100), mem_used=(12 + 7 * index) * GiB, mem_total=80 * GiB,
                      uuid=f"GPU-fake{index:04d}-0000-0000-0000-000000000000", pci_bus_id=_real_pci_bus_id(index))


def _real_pci_bus_id(index: int) -> str:
    try:
        addresses = sorted(os.listdir("/sys/bus/pci/devices"))
    except OSError:
        addresses = []
    if not addresses:
        return "00000000:00:00.0"
    domain, bus, slot = addresses[index % len(addresses)].split(":")
    return f"0000{domain}:{bus.upper()}:{slot.upper()}"


class _LocalRankProcesses:
    """The fake's process list for RANKTOP_FAKE_GPUS: our children whose LOCAL_RANK % N is the device.

    That is what a torchrun-style job using cuda:LOCAL_RANK would show, so the process-list
    matching is exercised end to end. Each such process "uses" 1.5 GiB + 256 MiB * LOCAL_RANK.
    """

    def __init__(self, n: int):
        self.n = n
        self._local_rank: dict[tuple[int, float], int | None] = {}  # (pid, create_time) -> LOCAL_RANK
        self._scan: dict[int, tuple[int, int]] | None = None  # pid -> (LOCAL_RANK, bytes)
        self._scanned_at = 0.0

    def __call__(self, device: int) -> dict[int, int]:
        # One scan of our children serves every device of the same sample.
        now = time.monotonic()
        if self._scan is None or now - self._scanned_at > 0.2:
            self._scan, self._scanned_at = self._scan_children(), now
        return {pid: mem for pid, (lr, mem) in self._scan.items() if lr % self.n == device}

    def _scan_children(self) -> dict[int, tuple[int, int]]:
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return {}
        out, seen = {}, {}
        for child in children:
            key, lr = self._lookup(child)
            if key is not None:
                seen[key] = lr
            if lr is not None and self.n:
                out[child.pid] = (lr, int(1.5 * GiB) + 256 * MiB * lr)
        self._local_rank = seen  # forget processes that are gone
        return out

    def _lookup(self, proc: Any) -> tuple[tuple[int, float] | None, int | None]:
        try:
            key = (proc.pid, proc.create_time())
            if key not in self._local_rank:
                value = proc.environ().get("LOCAL_RANK")
                self._local_rank[key] = int(value) if value and value.isdigit() else None
            return key, self._local_rank[key]
        except (psutil.Error, OSError):
            return None, None
