"""ranktop's launch engine. Never imports Textual; usable alone as a library.

Names are loaded on first use so that a rank's bootstrap, which imports `core.errors`, and the
headless command line pay only for what they touch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Std": "core.spec",
    "WorkerSpec": "core.spec",
    "parse_nnodes": "core.spec",
    "free_port": "core.spec",
    "start_processes": "core.context",
    "PContext": "core.context",
    "MultiprocessContext": "core.context",
    "SubprocessContext": "core.context",
    "RunProcsResult": "core.context",
    "set_start_method": "core.context",
    "ProcessFailure": "core.errors",
    "record": "core.errors",
    "read_error_file": "core.errors",
    "write_error_file": "core.errors",
    "WorkerError": "core.errors",
    "MainProcessError": "core.errors",
    "UsageError": "core.errors",
    "LocalAgent": "core.agent",
    "RunResult": "core.agent",
    "WorkerState": "core.agent",
    "launch": "core.launch",
    "RankState": "core.state",
    "GroupState": "core.state",
    "RankSnapshot": "core.state",
    "GroupSnapshot": "core.state",
    "RootCause": "core.state",
    "GpuSample": "core.state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'core' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
