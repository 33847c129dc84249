"""GPU sampling through NVML (SPEC 2.6).

Everything talks to a pynvml-shaped module object: the real `pynvml` (package nvidia-ml-py,
imported lazily so that a machine without it still runs), or `FakeNvml` for tests and demos.
The code that reads a device is the same either way; only the module object differs.

NVML is initialised once. If that fails (no driver, no library, no device) the monitor says so
in `status` and never tries again: a supervisor must not hammer a broken driver every second.
An error on one device during a sample only blanks that device for that sample.

`RANKTOP_FAKE_GPUS=N` selects N fake devices (see `FakeNvml.from_env`) so the TUI, screenshots
and end-to-end tests can show GPU columns on machines without a GPU.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ranktop.core.state import GpuSample

FAKE_ENV = "RANKTOP_FAKE_GPUS"
NO_GPU = "no GPU"

# NVML's error codes that mean "there is no usable NVIDIA GPU here" rather than "something broke".
_ERROR_NOT_SUPPORTED = 3
_ERROR_DRIVER_NOT_LOADED = 9
_ERROR_LIBRARY_NOT_FOUND = 12
_NO_GPU_CODES = (_ERROR_DRIVER_NOT_LOADED, _ERROR_LIBRARY_NOT_FOUND)

GiB = 1 << 30
MiB = 1 << 20


def _describe(exc: BaseException) -> str:
    # pynvml's __str__ asks the library for the text, which can itself fail; never let that escape.
    try:
        text = str(exc)
    except Exception:
        text = ""
    return text or type(exc).__name__


@dataclass(frozen=True)
class DeviceReading:
    """One device in one sample; `error` is set (and the values None) when NVML failed on it."""

    index: int
    util_percent: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    procs: Mapping[int, int | None] = field(default_factory=dict)  # pid -> bytes (None: not reported)
    error: str | None = None


@dataclass(frozen=True)
class RankQuery:
    """What the monitor needs to know about a rank to find its GPU."""

    pids: frozenset[int]  # the rank's process tree: its pid and descendants
    visible_devices: str | None = None  # the rank's CUDA_VISIBLE_DEVICES (None: unset)


class GpuMonitor:
    """Reads every device once per `sample()` and tells each rank which GPU is its own."""

    def __init__(self, nvml: Any = None):
        self._nvml = nvml  # None: import pynvml on start()
        self._lock = threading.Lock()
        self._started = False
        self._handles: dict[int, Any] = {}
        self._uuids: dict[int, str] = {}
        self._count = 0
        self._init_status: str | None = None
        self._device_errors: dict[int, str] = {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GpuMonitor:
        """The real NVML, or the fake when RANKTOP_FAKE_GPUS is set."""
        fake = FakeNvml.from_env(os.environ if environ is None else environ)
        return cls(fake)

    # ----- life cycle --------------------------------------------------------------------------
    def start(self) -> str | None:
        """Initialise NVML once (later calls return the first outcome): None when GPUs are usable."""
        with self._lock:
            if not self._started:
                self._started = True
                self._init_status = self._init()
            return self._init_status

    def _init(self) -> str | None:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                return f"{NO_GPU} (nvidia-ml-py not installed)"
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            return NO_GPU if getattr(exc, "value", None) in _NO_GPU_CODES else f"NVML error: {_describe(exc)}"
        try:
            self._count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:
            self._shutdown()
            return f"NVML error: {_describe(exc)}"
        for i in range(self._count):
            try:
                self._handles[i] = nvml.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:  # one bad device does not hide the others
                self._device_errors[i] = _describe(exc)
        if not self._count:
            self._shutdown()
            return NO_GPU
        return None

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass

    def close(self) -> None:
        """Shut NVML down if we brought it up; the monitor reads nothing after this."""
        with self._lock:
            if self.ok:
                self._shutdown()
            self._started = True
            self._init_status = self._init_status or "closed"

    @property
    def ok(self) -> bool:
        return self._started and self._init_status is None

    @property
    def count(self) -> int:
        return self._count if self.ok else 0

    def status(self) -> str | None:
        """None when every device answered last time; otherwise what is wrong, in a few words."""
        if self._init_status is not None:
            return self._init_status
        errors = dict(self._device_errors)
        if not errors:
            return None
        return "; ".join(f"GPU {i}: {msg}" for i, msg in sorted(errors.items()))

    # ----- sampling ----------------------------------------------------------------------------
    def read_devices(self) -> dict[int, DeviceReading]:
        """One reading per device; never raises (a failing device comes back with `error`)."""
        if not self.ok:
            return {}
        readings, errors = {}, {}
        for i in range(self._count):
            handle = self._handles.get(i)
            if handle is None:
                errors[i] = self._device_errors.get(i, "no handle")
                readings[i] = DeviceReading(i, error=errors[i])
                continue
            try:
                readings[i] = self._read_device(i, handle)
            except Exception as exc:
                errors[i] = _describe(exc)
                readings[i] = DeviceReading(i, error=errors[i])
        self._device_errors = errors
        return readings

    def _read_device(self, index: int, handle: Any) -> DeviceReading:
        nvml = self._nvml
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        util = _unless_unsupported(lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        procs: dict[int, int | None] = {}
        for info in _unless_unsupported(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle)) or ():
            used = getattr(info, "usedGpuMemory", None)
            # A process can hold several contexts on one device: add them up.
            prev = procs.get(info.pid)
            procs[info.pid] = used if prev is None else prev + (used or 0)
        return DeviceReading(index, util, int(mem.used), int(mem.total), procs)

    def uuid(self, index: int) -> str | None:
        if index not in self._uuids and index in self._handles:
            try:
                value = self._nvml.nvmlDeviceGetUUID(self._handles[index])
                self._uuids[index] = value.decode() if isinstance(value, bytes) else str(value)
            except Exception:
                return None
        return self._uuids.get(index)

    def sample(self, ranks: Mapping[int, RankQuery]) -> dict[int, GpuSample | None]:
        """Each local rank's GPU (None when no GPU can be told for it), from one device reading."""
        readings = self.read_devices()
        if not readings:
            return {r: None for r in ranks}
        return {r: rank_sample(r, q, readings, self.uuid) for r, q in ranks.items()}


def _unless_unsupported(read: Callable[[], Any]) -> Any:
    """`read()`, or None where the device does not support it (utilisation of a MIG-mode GPU)."""
    try:
        return read()
    except Exception as exc:
        if getattr(exc, "value", None) == _ERROR_NOT_SUPPORTED:
            return None
        raise


def rank_sample(
    local_rank: int,
    query: RankQuery,
    readings: Mapping[int, DeviceReading],
    uuid_of: Callable[[int], str | None] = lambda _i: None,
) -> GpuSample | None:
    """The rank's GPU: where NVML sees its processes, else where LOCAL_RANK points."""
    expected = device_for_local_rank(local_rank, query.visible_devices, len(readings), uuid_of)
    index, proc_mem = match_processes(query.pids, readings, prefer=expected)
    if index is None:
        index = expected
    if index is None or index not in readings:
        return None
    dev = readings[index]
    return GpuSample(index=index, util_percent=dev.util_percent, mem_used=dev.mem_used,
                     mem_total=dev.mem_total, proc_mem=proc_mem)


def match_processes(
    pids: Iterable[int], readings: Mapping[int, DeviceReading], prefer: int | None = None
) -> tuple[int | None, int | None]:
    """(device, bytes the tree uses there) for the device holding most of the tree's memory.

    A rank often also holds a small context on device 0 by accident (the classic `cuda()` before
    `set_device`), so "most memory" rather than "first seen" finds the device it really uses.
    """
    pids = set(pids)
    best: tuple[int | None, int | None] = (None, None)
    best_key: tuple | None = None
    for index, dev in readings.items():
        mine = [dev.procs[p] for p in pids & dev.procs.keys()]
        if not mine:
            continue
        known = [m for m in mine if m is not None]
        used = sum(known) if known else None
        key = (used or 0, index == prefer, -index)
        if best_key is None or key > best_key:
            best, best_key = (index, used), key
    return best


def device_for_local_rank(
    local_rank: int,
    visible_devices: str | None,
    count: int,
    uuid_of: Callable[[int], str | None] = lambda _i: None,
) -> int | None:
    """The NVML index a rank using cuda:LOCAL_RANK would land on, or None when it cannot be told.

    CUDA_VISIBLE_DEVICES renumbers devices: the rank's cuda:k is its k-th entry. A single entry
    means every rank sees just that one device (set per rank, or all ranks sharing it).
    """
    if visible_devices is None:
        return local_rank if 0 <= local_rank < count else None
    entries = [e.strip() for e in visible_devices.split(",") if e.strip()]
    if not entries:
        return None  # "" hides every device
    entry = entries[0] if len(entries) == 1 else entries[local_rank] if local_rank < len(entries) else None
    if entry is None:
        return None
    if entry.lstrip("-").isdigit():
        index = int(entry)
        return index if 0 <= index < count else None
    if entry.startswith("GPU-"):
        # CUDA accepts any unique prefix of the UUID.
        for index in range(count):
            full = uuid_of(index)
            if full and full.startswith(entry):
                return index
    return None  # MIG instances and anything else: no device-level answer


def device_count(nvml: Any = None) -> int:
    """How many GPUs NVML sees (honours RANKTOP_FAKE_GPUS); 0 without a driver or on any error."""
    monitor = GpuMonitor(nvml) if nvml is not None else GpuMonitor.from_env()
    try:
        monitor.start()
        return monitor.count
    finally:
        monitor.close()


# ----- the fake at the pynvml boundary ----------------------------------------------------------
class FakeNvmlError(Exception):
    """Shaped like pynvml.NVMLError: carries NVML's numeric `value`."""

    def __init__(self, value: int, text: str = ""):
        super().__init__(value)
        self.value = value
        self.text = text

    def __str__(self) -> str:
        return self.text or f"NVML Error with code {self.value}"


@dataclass
class FakeDevice:
    util: float = 0.0
    mem_used: int = 0
    mem_total: int = 80 * GiB
    uuid: str = ""
    error: FakeNvmlError | None = None  # raised by every query of this device while set
    util_supported: bool = True  # False: utilisation raises Not Supported, as on a MIG-mode GPU


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
    NVML_ERROR_DRIVER_NOT_LOADED = _ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = _ERROR_LIBRARY_NOT_FOUND
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
            return cls(init_error=FakeNvmlError(_ERROR_LIBRARY_NOT_FOUND, f"bad {FAKE_ENV}={text!r}"))
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

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802
        self.calls["nvmlDeviceGetUtilizationRates"] += 1
        dev = self._device(handle)
        if not dev.util_supported:
            raise FakeNvmlError(_ERROR_NOT_SUPPORTED, "Not Supported")
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
class _Util:
    gpu: int
    memory: int


@dataclass(frozen=True)
class _Mem:
    total: int
    used: int
    free: int


def fake_device(index: int) -> FakeDevice:
    """Deterministic, distinct values per device, so screenshots and tests can tell them apart."""
    return FakeDevice(util=float((35 + 20 * index) % 100), mem_used=(12 + 7 * index) * GiB, mem_total=80 * GiB,
                      uuid=f"GPU-fake{index:04d}-0000-0000-0000-000000000000")


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
        import time

        # One scan of our children serves every device of the same sample.
        now = time.monotonic()
        if self._scan is None or now - self._scanned_at > 0.2:
            self._scan, self._scanned_at = self._scan_children(), now
        return {pid: mem for pid, (lr, mem) in self._scan.items() if lr % self.n == device}

    def _scan_children(self) -> dict[int, tuple[int, int]]:
        import psutil

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
        import psutil

        try:
            key = (proc.pid, proc.create_time())
            if key not in self._local_rank:
                value = proc.environ().get("LOCAL_RANK")
                self._local_rank[key] = int(value) if value and value.isdigit() else None
            return key, self._local_rank[key]
        except (psutil.Error, OSError):
            return None, None
