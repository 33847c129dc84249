"""The `ranktop` command line: torchrun's flags, then the TUI or the headless runner.

Nothing here imports Textual unless the TUI is chosen: `--headless` must start fast.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from ranktop.core.errors import UsageError

from ranktop import __version__ as VERSION

USAGE_EXIT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, no usage dump: the message already names the bad value.
        self.exit(USAGE_EXIT, f"ranktop: error: {message}\n")


def _both(name: str) -> list[str]:
    """torchrun accepts --nproc-per-node and --nproc_per_node; so do we."""
    dashed = "--" + name
    underscored = "--" + name.replace("-", "_")
    return [dashed] if dashed == underscored else [dashed, underscored]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ranktop",
        description="Launch and watch one process per rank (torchrun-compatible), in a TUI or headless.",
        allow_abbrev=False,
    )
    add = p.add_argument
    add(*_both("nproc-per-node"), default="1", metavar="N|auto|cpu|gpu", help="ranks on this node (default 1)")
    add("-j", dest="jobs", metavar="[MIN:]NxM", help="TorchX style: N nodes x M ranks per node")
    add("--nnodes", default="1", help="number of nodes, N or MIN:MAX (elastic with --rdzv-backend; static: MAX)")
    add(*_both("node-rank"), type=int, default=0, help="this node's rank (default 0)")
    add(*_both("master-addr"), default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    add(*_both("master-port"), type=int, default=None,
        help="port on node 0 (default: a free port on one node, 29500 with several)")
    add("--standalone", action="store_true", help="single node, pick a free port")
    add(*_both("rdzv-backend"), default=None, metavar="NAME",
        help="rendezvous through torch: c10d, etcd, etcd-v2, static or a torchrun plugin "
             "(default: ranktop's static form, no torch needed)")
    add(*_both("rdzv-endpoint"), default="", metavar="HOST[:PORT]", help="where the rendezvous is served")
    add(*_both("rdzv-id"), default="none", metavar="ID",
        help="the job's id, the same on every node (TORCHELASTIC_RUN_ID and the run directory's name)")
    add(*_both("rdzv-conf"), default="", metavar="K=V,...",
        help="rendezvous settings, e.g. join_timeout=600,last_call_timeout=30,close_timeout=30,is_host=1")
    add(*_both("local-addr"), default=None, metavar="ADDR",
        help="this node's address in the rendezvous (default: its fully qualified host name)")
    add("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    add(*_both("no-python"), action="store_true", help="run the script as a binary, not with python")
    add(*_both("max-restarts"), type=int, default=0, help="group restarts on failure (default 0)")
    add(*_both("monitor-interval"), type=float, default=0.1, help="seconds between monitor passes")
    add(*_both("log-dir"), default=None, help="where run directories go (default $TMPDIR/ranktop-UID)")
    add("--run-id", default=None, help="name of the run directory and TORCHELASTIC_RUN_ID")
    add("-r", "--redirects", default="0", help="streams to files only: 0-3 or a map like 0:3,1:1")
    add("-t", "--tee", default="0", help="streams to files and console: 0-3 or a map (files are always kept)")
    add(*_both("local-ranks-filter"), default=None, metavar="R[,R...]", help="only these local ranks print")
    add("--role", default="default", help="role name (ROLE_NAME, default 'default')")
    add(*_both("log-line-prefix-template"), default=None,
        help="console prefix, e.g. '[${role_name}${rank}]:' (also $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)")
    add(*_both("shutdown-timeout"), type=float, default=10.0, help="grace before SIGKILL (default 10 s)")
    add("--env", action="append", default=[], metavar="K=V", help="extra variable for every rank (repeatable)")
    add("--debug", action="store_true", help="set CUDA/NCCL/torch.distributed debug variables")
    add(*_both("stall-timeout"), type=float, default=None,
        help="seconds without output before a rank is shown stalled (headless: off)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--headless", action="store_true", help="no TUI: prefixed output, like torchrun")
    mode.add_argument("--tui", action="store_true", help="the TUI even when stdout is not a terminal")
    add("--exit-on-end", action="store_true", help="TUI: close as soon as the group ends")
    add("--pty", action="store_true",
        help="give each rank a pseudo-terminal (isatty() true; stderr merged into stdout.log)")
    add(*_both("no-faulthandler"), action="store_true",
        help="do not make SIGUSR1 dump a Python rank's stacks (faulthandler)")
    add("--version", action="version", version=f"ranktop {VERSION}")
    add("training_script", help="the script (or binary with --no-python, module with -m)")
    add("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_nproc(value: str) -> int:
    text = value.strip().lower()
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        from ranktop.core.gpu import device_count

        n = device_count()
        if n:
            return n
        if text == "gpu":
            raise UsageError("bad --nproc-per-node gpu: no GPU found (NVML sees none)")
        return os.cpu_count() or 1
    if not text.lstrip("-").isdigit() or int(text) < 1:
        raise UsageError(f"bad --nproc-per-node {value!r}: expected a positive whole number, auto, cpu or gpu")
    return int(text)


def parse_nnodes_flag(value: str) -> int:
    return parse_nnodes_range(value)[1]


def parse_nnodes_range(value: str) -> tuple[int, int]:
    """--nnodes N or MIN:MAX -> (MIN, MAX); elastic between them with a rendezvous backend."""
    lo, sep, hi = value.partition(":")
    if not (lo.isdigit() and (not sep or hi.isdigit())) or not 1 <= int(lo) <= int(hi or lo):
        raise UsageError(f"bad --nnodes {value!r}: expected N or MIN:MAX with 1 <= MIN <= MAX")
    return int(lo), int(hi or lo)


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"bad --env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def parse_ranks(value: str | None) -> set[int] | None:
    if value is None:
        return None
    try:
        return {int(v) for v in value.split(",") if v.strip()}
    except ValueError:
        raise UsageError(f"bad --local-ranks-filter {value!r}: expected local ranks like 0 or 0,2") from None


def entrypoint_and_args(ns: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    script, rest = ns.training_script, tuple(ns.training_script_args)
    if ns.no_python:
        if ns.module:
            raise UsageError("--no-python and --module exclude each other")
        path = shutil.which(script) if os.sep not in script else script
        if path is None or not os.path.exists(path):
            raise UsageError(f"bad binary {script!r}: not found")
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            raise UsageError(f"bad binary {script!r}: not executable (chmod +x it, or drop --no-python)")
        return path, rest
    if ns.module:
        return sys.executable, ("-u", "-m", script, *rest)
    if not os.path.isfile(script):
        raise UsageError(f"bad script {script!r}: no such file")
    return sys.executable, ("-u", script, *rest)


def build_spec(ns: argparse.Namespace):
    from ranktop.core.spec import DEBUG_ENV, Std, WorkerSpec, check_port, parse_nnodes

    if ns.jobs:
        try:
            min_nodes, nnodes, nproc, _ = parse_nnodes(ns.jobs)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    else:
        (min_nodes, nnodes), nproc = parse_nnodes_range(ns.nnodes), parse_nproc(ns.nproc_per_node)
    if ns.master_port is not None:
        check_port(ns.master_port)
    try:
        redirects, tee = Std.from_str(ns.redirects), Std.from_str(ns.tee)
    except ValueError as exc:
        raise UsageError(f"bad -r/-t: {exc}") from None
    for flag, value in (("--redirects", redirects), ("--tee", tee)):
        if isinstance(value, dict) and not set(value) <= set(range(nproc)):
            raise UsageError(f"bad {flag}: names local rank(s) {sorted(set(value) - set(range(nproc)))}, "
                             f"local ranks are 0..{nproc - 1}")
    entrypoint, args = entrypoint_and_args(ns)
    env = {**(DEBUG_ENV if ns.debug else {}), **parse_env(ns.env)}
    port = ns.master_port
    if port is None and nnodes > 1 and not ns.standalone:
        port = 29500  # like torchrun: every node must agree on it without talking first
    elastic = uses_rendezvous(ns)
    spec = WorkerSpec(
        role=ns.role, local_world_size=nproc, entrypoint=entrypoint, args=args,
        max_restarts=ns.max_restarts, monitor_interval=ns.monitor_interval, nnodes=nnodes,
        # torchrun ignores --node-rank with a dynamic rendezvous: the round gives the group rank.
        node_rank=ns.node_rank if not elastic or ns.rdzv_backend == "static" else 0,
        master_addr=ns.master_addr, master_port=port, env=env,
        redirects=redirects, tee=tee, local_ranks_filter=parse_ranks(ns.local_ranks_filter),
        run_id=ns.run_id or (ns.rdzv_id if elastic and ns.rdzv_id != "none" else None),
        name=os.path.basename(ns.training_script), pty=ns.pty,
    )
    if elastic:  # last: the c10d host starts its store here, once every other value is known good
        spec.rdzv_handler = rendezvous_handler(ns, min_nodes, nnodes, port)
    return spec


def uses_rendezvous(ns: argparse.Namespace) -> bool:
    """torch's rendezvous runs the nodes: a --rdzv-backend was named, and it is not the static
    one with torch missing (ranktop's own static form gives the same ranks without torch)."""
    if ns.standalone or ns.rdzv_backend is None:
        return False
    if ns.rdzv_backend == "static":
        import importlib.util

        try:
            return importlib.util.find_spec("torch") is not None
        except ValueError:  # torch in sys.modules as None: it cannot be imported
            return False
    return True


def rendezvous_handler(ns: argparse.Namespace, min_nodes: int, max_nodes: int, master_port: int | None):
    from ranktop.core.rendezvous import create_handler, parse_rdzv_conf
    from ranktop.core.spec import free_port

    conf: dict = parse_rdzv_conf(ns.rdzv_conf)
    endpoint = ns.rdzv_endpoint
    if ns.rdzv_backend == "static":  # as torchrun: the master's address, and the node rank from the flags
        conf["rank"] = ns.node_rank
        endpoint = endpoint or f"{ns.master_addr}:{master_port or free_port()}"
    return create_handler(ns.rdzv_backend, endpoint, ns.rdzv_id, min_nodes, max_nodes,
                          conf=conf, local_addr=ns.local_addr)


def want_tui(ns: argparse.Namespace) -> bool:
    if ns.headless:
        return False
    return ns.tui or sys.stdout.isatty()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "stacks":
        from ranktop.tui.stacks_cli import main as stacks_main

        return stacks_main(argv[1:])
    ns = build_parser().parse_args(argv)
    from ranktop.core.rendezvous import RendezvousFailed

    try:
        spec = build_spec(ns)
        if want_tui(ns):
            from ranktop.tui.app import run_tui

            return run_tui(spec, ns)
        return run_headless(spec, ns)
    except UsageError as exc:
        print(f"ranktop: error: {exc}", file=sys.stderr)
        return USAGE_EXIT
    except RendezvousFailed as exc:  # e.g. the endpoint cannot be reached: not a usage error
        print(f"ranktop: error: {exc}", file=sys.stderr)
        return 1


def run_headless(spec, ns: argparse.Namespace) -> int:
    from ranktop.core.agent import LocalAgent
    from ranktop.core.report import format_root_cause

    def on_stall(snap) -> None:
        cpu = "-" if snap.cpu_percent is None else f"{snap.cpu_percent:.0f}%"
        gpu = "-" if snap.gpu is None or snap.gpu.util_percent is None else f"{snap.gpu.util_percent:.0f}%"
        print(f"ranktop: rank {snap.rank} stalled: no output for {snap.stall_seconds or 0:.0f}s "
              f"(cpu {cpu}, gpu {gpu}, pid {snap.pid})", file=sys.stderr, flush=True)

    sampler = None
    if ns.stall_timeout:
        from ranktop.core.stats import StatsSampler

        sampler = StatsSampler()
    agent = LocalAgent(spec, log_dir=ns.log_dir, log_line_prefix_template=ns.log_line_prefix_template,
                       shutdown_timeout=ns.shutdown_timeout, stall_timeout=ns.stall_timeout,
                       sampler=sampler, on_stall=on_stall, faulthandler=not ns.no_faulthandler,
                       on_notice=lambda text: print(f"ranktop: {text}", file=sys.stderr, flush=True),
                       color=sys.stdout.isatty() and "NO_COLOR" not in os.environ)
    if sampler is not None:
        sampler.attach(agent)
    try:
        result = agent.run()
    finally:
        if sampler is not None:
            sampler.close()
    if result.root_cause is not None and result.stop_signal is None:
        print(format_root_cause(result.root_cause, name=spec.display_name(), attempt=agent.attempt,
                                max_restarts=spec.max_restarts), file=sys.stderr)
    elif result.stop_signal is not None:
        print(f"ranktop: stopped by {signal.Signals(result.stop_signal).name}; logs in {agent.run_dir}",
              file=sys.stderr)
    if result.rendezvous_error and result.stop_signal is None:
        print(f"ranktop: error: {result.rendezvous_error}", file=sys.stderr)
    return result.exit_status


if __name__ == "__main__":
    sys.exit(main())
