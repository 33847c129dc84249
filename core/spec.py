"""What to run and how: stream flags, the -j syntax, the worker spec and each rank's environment."""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import signal
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from string import Template
from typing import Any

from ranktop.core.errors import UsageError
from ranktop.core.layout import check_run_id
from ranktop.core.limits import COUNT, MAX_NNODES, MAX_NPROC_PER_NODE, MONITOR_SECONDS, NNODES, NPROC, PORT
from ranktop.core.sanitize import quoted


class Std(enum.IntFlag):
    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """'3' -> Std.ALL; '0:1,1:2' -> {0: Std.OUT, 1: Std.ERR}. Anything else raises ValueError."""
        text = vm.strip()
        if re.fullmatch(r"[0-3]", text):
            return cls(int(text))
        if re.fullmatch(r"\d+:[0-3](,\d+:[0-3])*", text):
            pairs = (item.split(":") for item in text.split(","))
            try:
                return {int(rank): cls(int(flag)) for rank, flag in pairs}
            except ValueError:  # a rank of more digits than int() reads (4300): Python's words said only that
                pass
        raise ValueError(
            f"bad stream spec {quoted(vm)}: expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) "
            "or a per-rank map like '0:3,1:1'"
        )


def per_rank(value: Std | Mapping[int, Std], nprocs: int) -> dict[int, Std]:
    """Expand a Std or a partial per-rank map to a full map (missing ranks get NONE). As in
    torchrun, a map may name ranks this node does not have: they are ignored, so one command
    line serves nodes with different numbers of ranks."""
    if isinstance(value, Mapping):
        return {r: Std(value.get(r, Std.NONE)) for r in range(nprocs)}
    return {r: Std(value) for r in range(nprocs)}


_NNODES_FORMS = "N, NxM or MIN:MAXxM (e.g. 4, 2x8, 1:4x8)"


def parse_nnodes(j: str) -> tuple[int, int, int, str]:
    """TorchX's -j: '[[MIN:]MAX x]NPROC' -> (min_nnodes, max_nnodes, nproc_per_node, nnodes_repr).
    One rule for the API and the command line's -j, torchrun's (0 < MIN <= MAX): TorchX's took 0
    nodes and MIN above MAX. A UsageError (a ValueError, as TorchX raises) in one line."""
    m = re.fullmatch(r"(?:(?:(\d+):)?(\d+)x)?(\d+)", j.strip())
    if not m:
        raise UsageError(f"bad -j {quoted(j)}: expected {_NNODES_FORMS}")
    lo, hi, nproc = m.group(1), m.group(2), m.group(3)
    try:
        counts = int(lo or hi or 1), int(hi or 1), int(nproc)
    except ValueError:  # digits int() does not read: thousands of them
        counts = (0, 0, 0)
    if not (NPROC.accepts(counts[2]) and NNODES.accepts(counts[1]) and 1 <= counts[0] <= counts[1]):
        raise UsageError(f"bad -j {quoted(j)}: expected 1 <= MIN <= MAX <= {MAX_NNODES} nodes "
                         f"and 1 to {MAX_NPROC_PER_NODE} ranks per node")
    return *counts, f"{lo}:{hi}" if lo is not None else hi or "1"


def parse_signal(name: str | int) -> signal.Signals:
    """'TERM', 'SIGTERM', 'sigterm' or 15 -> signal.SIGTERM; else UsageError naming the choices."""
    text = str(name).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise UsageError(f"unknown signal {quoted(name)}: use a name like TERM, INT, KILL, USR1 or a number") from None


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago (bind to 0 and let the kernel pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(port: int) -> int:
    return PORT.check("--master-port", port)


Entrypoint = Callable[..., Any] | str


def checked_entrypoint(entrypoint: object) -> Entrypoint:
    """A function as given, or a binary's path as text: bytes and os.PathLike decoded as Popen
    decodes them (str() made b"/bin/echo" of bytes, a path no exec finds); anything else is a
    one-line TypeError before anything starts."""
    if callable(entrypoint) or isinstance(entrypoint, str):
        return entrypoint  # type: ignore[return-value]
    if isinstance(entrypoint, (bytes, os.PathLike)):
        return os.fsdecode(entrypoint)
    raise TypeError(f"entrypoint must be a function or a binary's path (str, bytes or os.PathLike), "
                    f"not {type(entrypoint).__name__} {repr(entrypoint)[:80]}")
EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")  # the names torch registers


@dataclass(frozen=True)
class Placement:
    """Where this node's ranks sit in the whole job, as one rendezvous round decided it."""

    group_rank: int  # this node's rank among the nodes (GROUP_RANK)
    group_world_size: int  # the number of nodes in the round
    base_rank: int  # the global rank of local rank 0
    world_size: int
    base_role_rank: int  # the role rank of local rank 0
    role_world_size: int
    master_addr: str
    master_port: int
    run_id: str  # the rendezvous's run id (TORCHELASTIC_RUN_ID), the same on every node
    round: int  # the rendezvous round, the same on every node of the round
    use_agent_store: bool  # the ranks reach the store that group rank 0's agent serves


@dataclass
class WorkerSpec:
    """One role's ranks on this node: what to run and how often it may be restarted."""

    role: str
    local_world_size: int
    entrypoint: Entrypoint | None = None  # required: given here, or as torch's older `fn`
    args: tuple = ()
    max_restarts: int = 0
    monitor_interval: float = 0.1
    nnodes: int = 1
    node_rank: int = 0
    # Both as torch's: where set, the ranks' MASTER_ADDR/PORT even under a rendezvous; None: 127.0.0.1
    # and a free port alone, the round's master under a rendezvous.
    master_addr: str | None = None
    master_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra variables for every rank
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.ALL
    local_ranks_filter: set[int] | None = None  # which ranks reach the console; None = all
    run_id: str | None = None
    name: str | None = None  # shown as the job name; defaults to the entrypoint's name
    pty: bool = False  # give each rank a pseudo-terminal for stdout and stderr (merged) instead of pipes
    # Every rank sees LOCAL_RANK=0 and only its own GPU (CUDA_VISIBLE_DEVICES narrowed to it).
    virtual_local_rank: bool = False
    # --numa-binding: the CPUs each local rank starts on (core/numa.py); None: ranktop's own.
    cpu_affinity: dict[int, frozenset[int]] | None = None
    # torch's RendezvousHandler (torch's WorkerSpec has it too): the nodes, ranks and master come
    # from its rounds instead of the static fields above. The agent joins each round.
    rdzv_handler: Any = None
    placement: Placement | None = None  # the current round's, set by the agent via `placed`
    # torch's WorkerSpec fields, so that code written for torch's agent runs unchanged (by keyword:
    # ranktop's positional order is its own):
    fn: Callable[..., Any] | None = None  # torch's deprecated name for the entrypoint
    local_addr: str | None = None  # kept, as torch's agent keeps it: the rendezvous handler uses the address
    event_log_handler: str = "null"  # "console": the agent also says each event (--event-log-handler)
    numa_options: Any = None  # torch's NumaOptions: its affinity mode binds the ranks as --numa-binding does
    duplicate_stdout_filters: list[str] | None = None  # as --duplicate-stdout-filters
    duplicate_stderr_filters: list[str] | None = None

    def __post_init__(self) -> None:
        if self.entrypoint is None:
            self.entrypoint = self.fn
        if self.entrypoint is None:
            raise UsageError("WorkerSpec needs an entrypoint: a binary's path or a function")
        self.entrypoint = checked_entrypoint(self.entrypoint)
        if self.event_log_handler not in EVENT_LOG_HANDLERS:
            raise UsageError(f"bad event_log_handler {quoted(self.event_log_handler)}: expected one of "
                             f"{', '.join(EVENT_LOG_HANDLERS)}")
        # The command line checks its flags first; this keeps the Python API from being given
        # nan, a negative count or a million ranks either.
        NPROC.check("local_world_size", self.local_world_size)
        NNODES.check("nnodes", self.nnodes)
        COUNT.check("node_rank", self.node_rank)
        if self.run_id is not None:
            check_run_id(self.run_id)
        if self.node_rank >= self.nnodes:
            raise UsageError(f"bad --node-rank {self.node_rank} for --nnodes {self.nnodes}: expected 0..{self.nnodes - 1}")
        COUNT.check("max_restarts", self.max_restarts)
        MONITOR_SECONDS.check("monitor_interval", self.monitor_interval)
        if self.master_port is not None:
            check_port(self.master_port)
        if self.virtual_local_rank:
            visible_device(self.local_world_size - 1)  # every rank must have a device of its own

    @property
    def world_size(self) -> int:
        if self.placement is not None:
            return self.placement.world_size
        return self.nnodes * self.local_world_size

    def global_rank(self, local_rank: int) -> int:
        if self.placement is not None:
            return self.placement.base_rank + local_rank
        return self.node_rank * self.local_world_size + local_rank

    @property
    def role_world_size(self) -> int:
        return self.placement.role_world_size if self.placement is not None else self.world_size

    def role_rank(self, local_rank: int) -> int:
        if self.placement is not None:
            return self.placement.base_role_rank + local_rank
        return self.global_rank(local_rank)

    def placed(self, placement: Placement) -> WorkerSpec:
        """This spec with its node, ranks and master taken from a rendezvous round (the placement's
        master already carries the spec's own, where it set one: see `fixed_master`)."""
        return dataclasses.replace(
            self, node_rank=placement.group_rank, nnodes=placement.group_world_size,
            master_addr=placement.master_addr, master_port=placement.master_port, placement=placement,
        )

    def fixed_master(self, placement: Placement) -> Placement:
        """The round's placement with this spec's master_addr/master_port where it set them, as
        torch's agent lets them override the rendezvous's."""
        return dataclasses.replace(placement, master_addr=self.master_addr or placement.master_addr,
                                   master_port=self.master_port or placement.master_port)

    def get_entrypoint_name(self) -> str:
        """torch's: the function's qualified name, or the binary's file name."""
        if callable(self.entrypoint):
            return getattr(self.entrypoint, "__qualname__", None) or getattr(self.entrypoint, "__name__", "fn")
        return os.path.basename(str(self.entrypoint))

    def display_name(self) -> str:
        return self.name or self.get_entrypoint_name()


def rank_env(
    spec: WorkerSpec,
    local_rank: int,
    *,
    master_port: int,
    restart_count: int,
    run_id: str,
    error_file: str,
    color: bool = False,
) -> dict[str, str]:
    """The variables a rank gets on top of the caller's environment (torchrun's names, so a script written for torchrun runs unchanged)."""
    rank = spec.global_rank(local_rank)
    env = {
        "RANK": rank,
        "LOCAL_RANK": local_rank,
        "GROUP_RANK": spec.node_rank,
        "ROLE_RANK": spec.role_rank(local_rank),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": spec.local_world_size,
        "WORLD_SIZE": spec.world_size,
        "GROUP_WORLD_SIZE": spec.nnodes,
        "ROLE_WORLD_SIZE": spec.role_world_size,
        "MASTER_ADDR": spec.master_addr or "127.0.0.1",
        "MASTER_PORT": master_port,
        "TORCHELASTIC_RESTART_COUNT": restart_count,
        "TORCHELASTIC_MAX_RESTARTS": spec.max_restarts,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "PYTHONUNBUFFERED": "1",
        # rank 0 hosts the ranks' store (plain env://); a caller that is itself a torchrun worker has
        # "True" here, and torch then left every rank waiting for an agent's store that is not there
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    if spec.placement is not None:
        env["TORCHELASTIC_RUN_ID"] = spec.placement.run_id
        env["TORCHELASTIC_USE_AGENT_STORE"] = spec.placement.use_agent_store  # "True"/"False", as torch reads it
    if spec.virtual_local_rank:
        env["LOCAL_RANK"] = 0
        env["CUDA_VISIBLE_DEVICES"] = visible_device(local_rank)
    if color:
        env["FORCE_COLOR"] = "1"
        env.setdefault("COLUMNS", os.environ.get("COLUMNS", "120"))
    out = {k: str(v) for k, v in env.items()}
    out.update(spec.env)
    return out


def rank_args(args: tuple, local_rank: int) -> tuple:
    """A rank's arguments as torch's agent (torchrun's too) gives them: `${local_rank}` or
    `$local_rank` in a text argument is the rank's local rank (torch.distributed.launch's macro),
    and `$$` is `$` (string.Template's escape, which torch's substitution applies); anything else
    as given."""
    return tuple(Template(arg).safe_substitute(local_rank=str(local_rank)) if isinstance(arg, str) else arg
                 for arg in args)


def visible_device(local_rank: int) -> str:
    """The device a rank gets with a virtual local rank: the LOCAL_RANK-th entry of ranktop's own
    CUDA_VISIBLE_DEVICES, or the index itself when that is unset."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(local_rank)
    devices = visible.split(",")
    if local_rank >= len(devices):
        raise UsageError(f"bad --virtual-local-rank with {local_rank + 1} ranks: CUDA_VISIBLE_DEVICES="
                         f"{quoted(visible)} lists {len(devices)} device(s), one per rank is needed")
    return devices[local_rank].strip()


def pty_size(env: dict[str, str]) -> tuple[int, int]:
    """(columns, rows) for a rank's pseudo-terminal: its COLUMNS and LINES, else 120 x 40."""
    def number(name: str, default: int) -> int:
        value = env.get(name, "")
        return int(value) if value.isdigit() and 0 < int(value) < 10_000 else default
    return number("COLUMNS", 120), number("LINES", 40)


FAULTHANDLER_ENV = "RANKTOP_FAULTHANDLER"
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faulthandler_boot")


def faulthandler_env(enabled: bool, base_env: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to a Python rank's environment so SIGUSR1 dumps its stacks to stderr.

    `base_env` is the environment the rank would get otherwise (for its PYTHONPATH). Our
    sitecustomize goes first on the path and then runs the one it shadows, if any.
    """
    if not enabled:
        return {}
    current = base_env.get("PYTHONPATH", "")
    # No trailing separator: an empty PYTHONPATH entry would put the cwd on sys.path.
    path = BOOT_DIR + (os.pathsep + current if current else "")
    return {FAULTHANDLER_ENV: "1", "PYTHONPATH": path}


DEBUG_ENV = {
    "CUDA_LAUNCH_BLOCKING": "1",
    "NCCL_DESYNC_DEBUG": "1",
    "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
    "TORCH_SHOW_CPP_STACKTRACES": "1",
}
