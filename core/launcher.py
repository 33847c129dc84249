"""torch 2.13's programmatic launcher (`torch.distributed.launcher.api`): `LaunchConfig`,
`elastic_launch(config, entrypoint)(*args)` and `launch_agent`, run by ranktop's
LocalElasticAgent (its one monitor loop, its restarts, its run directory).

One node with no rendezvous endpoint (the default config) runs here alone, on a free port, and
needs no torch: torch's default backend, etcd, would look for a server that is not there. An
endpoint goes through torch's rendezvous as `--rdzv-*` does (core/rendezvous.py); the static
backend without torch installed is ranktop's own static form, as on the command line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ranktop.core.errors import ChildFailedError, SignalException, UsageError
from ranktop.core.limits import COUNT, MONITOR_SECONDS, NNODES, NPROC, SECONDS, check_timeout
from ranktop.core.sanitize import quoted

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torch's: the grace when the config names none


@dataclass
class LaunchConfig:
    """torch's launch configuration, field for field and default for default."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: Any = None  # a LogsSpecs (ranktop's or torch's DefaultLogsSpecs); None: a fresh temporary one
    run_id: str = ""  # "": a fresh one, written back here as torch does
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1  # torch's legacy spelling of rdzv_configs["timeout"]
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)  # kept; ranktop has no metrics handlers
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: float | None = None  # None: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30

    def __post_init__(self) -> None:
        if not isinstance(self.rdzv_configs, dict):
            raise UsageError(f"bad rdzv_configs {self.rdzv_configs!r}: expected a dict")
        from ranktop.core.rendezvous import RDZV_TIMEOUT

        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        else:
            self.rdzv_configs.setdefault("timeout", RDZV_TIMEOUT)
        if self.logs_specs is None:
            from ranktop.core.logs_specs import DefaultLogsSpecs

            self.logs_specs = DefaultLogsSpecs()
        if self.shutdown_timeout is None:
            self.shutdown_timeout = _shutdown_timeout_from_env()
        else:
            check_timeout("shutdown_timeout", self.shutdown_timeout)


def _shutdown_timeout_from_env() -> float:
    """torch's grace where the config names none; a bad value is named as the variable, as the
    command line names it."""
    text = os.environ.get(SHUTDOWN_TIMEOUT_ENV, "30")
    try:
        return float(SECONDS.parse(SHUTDOWN_TIMEOUT_ENV, text))
    except UsageError:
        raise UsageError(f"bad {SHUTDOWN_TIMEOUT_ENV}={quoted(text)}: expected {SECONDS.describe()}") from None


class elastic_launch:  # noqa: N801 - torch's name
    """`elastic_launch(config, entrypoint)(*args)`: run `entrypoint` (a function, or a binary given
    by path) on `config.nproc_per_node` ranks; returns {global rank: return value} (None for a
    binary). A failed group raises ChildFailedError; a stop signal to the caller SignalException."""

    def __init__(self, config: LaunchConfig, entrypoint: Callable[..., Any] | str | None,
                 health_check_server: Any = None) -> None:
        self._config = config
        self._entrypoint = entrypoint
        self._health_check_server = health_check_server

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args), health_check_server=self._health_check_server)


def launch_agent(config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, args: list[Any],
                 health_check_server: Any = None) -> dict[int, Any]:
    """elastic_launch's work: one agent run of `entrypoint(*args)` as `config` says."""
    from ranktop.core.agent import LocalElasticAgent, new_run_id
    from ranktop.core.signals import parse_signal_names

    _check(config)
    extra_signals = parse_signal_names(config.signals_to_handle, "signals_to_handle")
    if not config.run_id:
        config.run_id = new_run_id()
    spec = _worker_spec(config, entrypoint, args)
    try:
        agent = LocalElasticAgent(
            spec, config.logs_specs, config.start_method, log_line_prefix_template=config.log_line_prefix_template,
            shutdown_timeout=config.shutdown_timeout, health_check_server=health_check_server,
            signals_to_handle=extra_signals, numbered_run_dir=True)
        result = agent.run()  # SignalException, or a rank's start OSError, as torch's agent raises
        if result.is_failed() and not result.failures:  # no rank to blame: the rendezvous failed
            from ranktop.core.rendezvous import RendezvousFailed

            raise RendezvousFailed(result.rendezvous_error or "the rendezvous failed")
    except SignalException:
        raise  # the rendezvous stays open, as torch's: the other nodes may scale on without this one
    except BaseException:
        # torch's closes it on any other way out, so the other nodes learn at once (a c10d host's
        # store is served from this process); the agent itself closes it only after a success or
        # a rank's failure
        _close_rendezvous(spec.rdzv_handler)
        raise
    if result.failures:
        raise ChildFailedError(entrypoint_name(entrypoint, args), result.failures)
    return result.return_values


def entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: list[Any]) -> str:
    """ChildFailedError's name, torch's rule: a function's __name__; for a binary its path, or, when
    it is this Python, its first argument that is not an option (the script, or the -c code)."""
    if callable(entrypoint):
        return getattr(entrypoint, "__name__", repr(entrypoint))
    if not isinstance(entrypoint, str):
        return ""
    if entrypoint == sys.executable:
        return next((str(a) for a in args if not str(a).startswith("-")), "")
    return entrypoint


def _check(config: LaunchConfig) -> None:
    """Each value as one line naming its field, before anything starts (a c10d host's store)."""
    NNODES.check("min_nodes", config.min_nodes)
    NNODES.check("max_nodes", config.max_nodes)
    if config.min_nodes > config.max_nodes:
        raise UsageError(f"bad min_nodes {config.min_nodes}: more than max_nodes {config.max_nodes}")
    NPROC.check("nproc_per_node", config.nproc_per_node)
    COUNT.check("max_restarts", config.max_restarts)
    MONITOR_SECONDS.check("monitor_interval", config.monitor_interval)
    check_timeout("shutdown_timeout", config.shutdown_timeout)
    for name in ("run_id", "role", "rdzv_backend", "rdzv_endpoint", "signals_to_handle"):
        if not isinstance(getattr(config, name), str):
            raise UsageError(f"bad {name} {getattr(config, name)!r}: expected a str")
    if not config.rdzv_backend:
        raise UsageError("bad rdzv_backend '': expected c10d, etcd, etcd-v2, static or a torchrun plugin's name")
    if config.run_id:
        from ranktop.core.layout import check_run_id
        from ranktop.core.rendezvous import check_rdzv_id

        check_run_id(config.run_id, "run_id")
        check_rdzv_id(config.run_id, config.rdzv_backend, "run_id")


def _worker_spec(config: LaunchConfig, entrypoint: Any, args: list[Any]) -> Any:
    """The agent's WorkerSpec; for a rendezvous, its handler is made last (a c10d host starts its store)."""
    from ranktop.core.spec import WorkerSpec

    placement = _static_placement(config)
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint, args=tuple(args),
        max_restarts=config.max_restarts, monitor_interval=config.monitor_interval, **placement,
        # As torch's launcher sets it in its own environment: the ranks see which signals are handled
        env={"TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle},
        local_addr=config.local_addr, event_log_handler=config.event_log_handler,
        numa_options=config.numa_options, duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters, virtual_local_rank=config.virtual_local_rank,
    )
    if "run_id" not in placement:
        spec.rdzv_handler = _rendezvous_handler(config)
    return spec


def _static_placement(config: LaunchConfig) -> dict[str, Any]:
    """WorkerSpec's fields for a run without torch's rendezvous: one node with no endpoint, or the
    static backend where torch is not installed. Empty: torch's rendezvous places the ranks."""
    from ranktop.core.rendezvous import check_endpoint, static_master, torch_installed

    endpoint = config.rdzv_endpoint.strip()
    if config.max_nodes == 1 and not endpoint:
        return {"master_addr": config.local_addr or "127.0.0.1", "run_id": config.run_id}
    check_endpoint(endpoint, config.max_nodes, "rdzv_endpoint")
    if config.rdzv_backend != "static" or torch_installed():
        return {}
    host, port = static_master(endpoint, "rdzv_endpoint")
    node_rank = COUNT.parse("rdzv_configs['rank']", str(config.rdzv_configs.get("rank", "")))
    return {"nnodes": config.max_nodes, "node_rank": node_rank, "master_addr": host, "master_port": port,
            "run_id": config.run_id}


def _rendezvous_handler(config: LaunchConfig) -> Any:
    from ranktop.core.rendezvous import create_handler

    return create_handler(config.rdzv_backend, config.rdzv_endpoint.strip(), config.run_id, config.min_nodes,
                          config.max_nodes, conf=dict(config.rdzv_configs), local_addr=config.local_addr)


def _close_rendezvous(handler: Any) -> None:
    if handler is not None:
        try:
            handler.shutdown()
        except Exception:  # noqa: BLE001 - closing on the way out of another error: that one is raised
            pass


__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]
