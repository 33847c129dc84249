"""ranktop's launch engine. Never imports Textual; usable alone as a library.

Names are loaded on first use so that a rank's bootstrap, which imports `core.errors`, and the
headless command line pay only for what they touch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Std": "ranktop.core.spec",
    "WorkerSpec": "ranktop.core.spec",
    "parse_nnodes": "ranktop.core.spec",
    "free_port": "ranktop.core.spec",
    "start_processes": "ranktop.core.processes_api",
    "PContext": "ranktop.core.context",
    "MultiprocessContext": "ranktop.core.context",
    "SubprocessContext": "ranktop.core.context",
    "RunProcsResult": "ranktop.core.context",
    "set_start_method": "ranktop.core.context",
    "ProcessFailure": "ranktop.core.errors",
    "BadErrorFile": "ranktop.core.errors",
    "record": "ranktop.core.errors",
    "read_error_file": "ranktop.core.errors",
    "write_error_file": "ranktop.core.errors",
    "WorkerError": "ranktop.core.errors",
    "MainProcessError": "ranktop.core.errors",
    "UsageError": "ranktop.core.errors",
    "LocalAgent": "ranktop.core.agent",
    "RunResult": "ranktop.core.agent",
    "WorkerState": "ranktop.core.agent",
    "launch": "ranktop.core.launch",
    "RankState": "ranktop.core.state",
    "GroupState": "ranktop.core.state",
    "RankSnapshot": "ranktop.core.state",
    "GroupSnapshot": "ranktop.core.state",
    "RootCause": "ranktop.core.state",
    "GpuSample": "ranktop.core.state",
    # torch 2.13's names (torch.distributed.elastic.multiprocessing, its errors, the agent)
    "LogsSpecs": "ranktop.core.logs_specs",
    "LogsDest": "ranktop.core.logs_specs",
    "DefaultLogsSpecs": "ranktop.core.logs_specs",
    "to_map": "ranktop.core.logs_specs",
    "SignalException": "ranktop.core.errors",
    "ChildFailedError": "ranktop.core.errors",
    "ErrorHandler": "ranktop.core.errors",
    "get_error_handler": "ranktop.core.errors",
    "LocalElasticAgent": "ranktop.core.agent",
    "WorkerGroup": "ranktop.core.agent",
    "Worker": "ranktop.core.agent",
    # torch.distributed.launcher.api's
    "LaunchConfig": "ranktop.core.launcher",
    "elastic_launch": "ranktop.core.launcher",
    "launch_agent": "ranktop.core.launcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ranktop.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
