"""GPU sampling through NVML.

Everything talks to a pynvml-shaped module object: the real `pynvml` (package nvidia-ml-py,
imported lazily so that a machine without it still runs), or `ranktop.core.gpu_fake.FakeNvml` for tests and demos.
The code that reads a device is the same either way; only the module object differs.

NVML is initialised once. If that fails (no driver, no library, no device) the monitor says so
in `status` and never tries again: a supervisor must not hammer a broken driver every second.
An error on one device during a sample only blanks that device for that sample.

`RANKTOP_FAKE_GPUS=N` selects N fake devices (see `gpu_fake.FakeNvml.from_env`) so the TUI, screenshots
and end-to-end tests can show GPU columns on machines without a GPU.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ranktop.core.heap import give_back_free_memory
from ranktop.core.sanitize import clean
from ranktop.core.state import GpuSample

FAKE_ENV = "RANKTOP_FAKE_GPUS"
NO_GPU = "no GPU"

# NVML's error codes that mean "there is no usable NVIDIA GPU here" rather than "something broke".
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
_NO_GPU_CODES = (NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND)

GiB = 1 << 30
MiB = 1 << 20


MAX_DEVICES = 1024  # a count past this is no node's: its loop of handles would hold the sampler for good
MAX_ERROR = 200  # characters of an NVML error's text, shown in the header


def _describe(exc: BaseException) -> str:
    # pynvml's __str__ asks the library for the text, which can itself fail; never let that escape.
    # The header shows it as it is: nothing in it may act on the terminal, nor fill the line.
    try:
        text = clean(str(exc))[:MAX_ERROR]
    except Exception:
        text = ""
    return text or type(exc).__name__


def _percent(value: Any) -> float | None:
    """A utilisation NVML gave: 0-100, else unknown (not a 300-digit or a negative number in a title)."""
    return float(value) if isinstance(value, (int, float)) and 0 <= value <= 100 else None


def _bytes(value: Any) -> int | None:
    """An amount of memory NVML gave: a whole number of bytes, 0 or more, else unknown."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


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
        environ = os.environ if environ is None else environ
        if not environ.get(FAKE_ENV, "").strip():
            return cls()
        from ranktop.core.gpu_fake import FakeNvml  # demos and tests only: never on the real path

        return cls(FakeNvml.from_env(environ))

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
            import pynvml  # here, not at the top: only a run that samples GPUs pays for it

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
        if not 0 <= self._count <= MAX_DEVICES:
            count, self._count = self._count, 0
            self._shutdown()
            return f"NVML error: it counts {count} devices"
        for i in range(self._count):
            try:
                self._handles[i] = nvml.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:  # one bad device does not hide the others
                self._device_errors[i] = _describe(exc)
        # nvmlInit leaves its scratch freed in the middle of the heap: trimmed, an H200 host's
        # process gave back 9 MB of the 18 it had grown by (a probe, twenty-eighth session).
        give_back_free_memory()
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
        util = _unless_unsupported(lambda: _percent(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        procs: dict[int, int | None] = {}
        for info in _unless_unsupported(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle)) or ():
            used, pid = _bytes(getattr(info, "usedGpuMemory", None)), _bytes(getattr(info, "pid", None))
            if pid is None:
                continue
            # A process can hold several contexts on one device: add them up.
            prev = procs.get(pid)
            procs[pid] = used if prev is None else prev + (used or 0)
        return DeviceReading(index, util, _bytes(mem.used), _bytes(mem.total), procs)

    def uuid(self, index: int) -> str | None:
        if index not in self._uuids and index in self._handles:
            try:
                value = self._nvml.nvmlDeviceGetUUID(self._handles[index])
                self._uuids[index] = value.decode() if isinstance(value, bytes) else str(value)
            except Exception:
                return None
        return self._uuids.get(index)

    def pci_bus_id(self, index: int) -> str:
        """The device's PCI bus id as NVML gives it ("00000000:DC:00.0"); raises if it cannot."""
        value = self._nvml.nvmlDeviceGetPciInfo(self._handles[index]).busId
        return value.decode() if isinstance(value, bytes) else str(value)

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
        if getattr(exc, "value", None) == NVML_ERROR_NOT_SUPPORTED:
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
    index = _device_index(entry)
    if index is not None:
        return index if 0 <= index < count else None
    if entry.startswith("GPU-"):
        # CUDA accepts any unique prefix of the UUID.
        for index in range(count):
            full = uuid_of(index)
            if full and full.startswith(entry):
                return index
    return None  # MIG instances and anything else: no device-level answer


def numa_binding(mode: str, local_world_size: int, visible: str | None, nvml: Any = None) -> dict[int, frozenset[int]]:
    """--numa-binding: {local rank: the CPUs near its GPU} (core/numa.py); NumaError in one line,
    also when NVML sees no GPU to follow."""
    from ranktop.core.numa import NumaError, plan

    monitor = GpuMonitor(nvml) if nvml is not None else GpuMonitor.from_env()
    try:
        problem = monitor.start()
        if problem is not None:
            raise NumaError(f"--numa-binding {mode}: it binds each rank to its GPU's NUMA node, and NVML "
                            f"says: {problem}")

        def bus_id(index: int) -> str:
            try:
                return monitor.pci_bus_id(index)
            except Exception as exc:
                raise NumaError(f"--numa-binding {mode}: GPU {index}'s PCI address: {_describe(exc)}") from None

        return plan(mode, local_world_size, lambda r: device_for_local_rank(r, visible, monitor.count, monitor.uuid),
                    bus_id, monitor.count if visible is None else count_visible(visible, monitor.count))
    finally:
        monitor.close()


def numa_options_binding(options: Any, local_world_size: int) -> dict[int, frozenset[int]] | None:
    """torch's NumaOptions (WorkerSpec.numa_options, start_processes' numa_options): the binding
    --numa-binding gives for its affinity mode. Where none can be told: None if the options allow
    falling back (torch then silences its binding's errors), else NumaError "numa_options: why"."""
    from ranktop.core.numa import NumaError

    if options is None:
        return None
    mode = getattr(options, "affinity_mode", None)
    mode = getattr(mode, "value", mode)  # torch's AffinityMode is a str enum
    if not isinstance(mode, str):
        raise TypeError(f"numa_options must be a torch NumaOptions (with an affinity_mode), got {options!r}")
    try:
        return numa_binding(mode, local_world_size, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except NumaError as exc:
        if getattr(options, "should_fall_back_if_binding_fails", False):
            return None
        raise NumaError(f"numa_options: {exc}") from None


def _device_index(entry: str) -> int | None:
    """A CUDA_VISIBLE_DEVICES entry read as an index (-1 too: it hides what follows), else None.
    ASCII digits only: `isdigit` also takes ² and other scripts' digits, which int() refuses."""
    digits = entry[1:] if entry.startswith("-") else entry
    return int(entry) if digits.isascii() and digits.isdigit() and len(digits) <= 9 else None


def device_count(nvml: Any = None, visible: str | None = None) -> int:
    """How many GPUs this process may use: those NVML sees (honours RANKTOP_FAKE_GPUS), narrowed
    by `visible` (a CUDA_VISIBLE_DEVICES value; None: unset). 0 without a driver or on any error."""
    monitor = GpuMonitor(nvml) if nvml is not None else GpuMonitor.from_env()
    try:
        monitor.start()
        total = monitor.count
    finally:
        monitor.close()
    return total if visible is None else count_visible(visible, total)


def count_visible(visible: str, total: int) -> int:
    """CUDA's reading of CUDA_VISIBLE_DEVICES: entries up to the first one that names no device
    (a bad index, a repeat, anything that is neither an index nor a GPU-/MIG- UUID) count."""
    seen: set[str] = set()
    for entry in (e.strip() for e in visible.split(",")):
        index = _device_index(entry)
        is_index = index is not None and 0 <= index < total
        if not (is_index or entry.startswith(("GPU-", "MIG-"))) or entry in seen:
            break
        seen.add(entry)
    return min(len(seen), total)
