"""The `ranktop` command line: torchrun's flags, then the TUI or the headless runner.

Nothing here imports Textual unless the TUI is chosen: `--headless` must start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import sys
from collections.abc import Callable, Mapping, Sequence

from ranktop.core import collector, guard, limits, numa
from ranktop.core.errors import UsageError
from ranktop.core.sanitize import check_console_prefix, clean, quoted
from ranktop.core.signals import NOTICE_SIGNALS, deaf_to, hold_early_stops, parse_signal_names
from ranktop.core.stdio import escape_unencodable, guard_streams, reopen_closed_streams, report_lost, terminal_problem
from ranktop.tui.usage import (
    BadValue,
    UnusableDefault,
    UsageParser,
    metric_pattern,
    run_command,
    usage_error,
    usage_line,
)

from ranktop.command import interrupted, is_interrupt


def _number(flag: str, bounds: limits.Bounds):
    """An argparse type: the number in the text, within `bounds`, else one line naming `flag`."""

    def parse(text: str) -> int | float:
        try:
            return bounds.parse(flag, text)
        except UsageError as exc:
            raise BadValue(str(exc)) from None

    return parse


def _signal_list(text: str) -> tuple[int, ...]:
    """An argparse type: torchrun's --signals-to-handle, 'SIGTERM,SIGUSR1', as signal numbers."""
    try:
        return parse_signal_names(text)
    except UsageError as exc:
        raise BadValue(str(exc)) from None


def _comma_list(text: str) -> list[str]:
    """torchrun's comma-separated list: ',,' stands for a comma inside an item; empty items go."""
    return [item.replace("\0", ",") for item in text.replace(",,", "\0").split(",") if item]


def _address(flag: str, *, empty_ok: bool = False):
    """An argparse type: a host name or an IP address (IPv6 bare or in brackets), else one line.
    torch takes anything and retries it until its time-out (`[::1` waited out a whole round).
    `empty_ok`: an empty value (`--master-addr=$MASTER_ADDR`, unset) is kept as it is: build_spec
    refuses an empty --master-addr only where the line uses it (torchrun runs a line that leaves it
    unused), and an empty --local-addr is none, as torch reads it."""
    shape = re.compile(r"\[[0-9A-Za-z.:%_-]+\]|[0-9A-Za-z.:%_-]+")

    def parse(text: str) -> str:
        if text == "" and empty_ok:
            return text
        if len(text) > 255 or not shape.fullmatch(text):
            raise BadValue(bad_address(flag, text))
        return text

    return parse


def bad_address(flag: str, text: str) -> str:
    return f"bad {flag} {quoted(text)}: expected a host name or an IP address (IPv6 bare or in brackets)"


class _Typed(argparse.Action):
    """Store the value, and note that it was typed: a default (or a PET_* one) may equal it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.typed = {*getattr(namespace, "typed", ()), self.dest}


def _both(name: str) -> list[str]:
    """torchrun accepts --nproc-per-node and --nproc_per_node; so do we."""
    dashed = "--" + name
    underscored = "--" + name.replace("-", "_")
    return [dashed] if dashed == underscored else [dashed, underscored]


# torchrun reads a default for these flags from PET_<DEST> (Kubeflow's PyTorchJob sets them):
# without that, every pod would run its own one-rank world and exit 0.
PET_FLAGS = frozenset({
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "standalone",
    "max_restarts", "monitor_interval", "start_method", "event_log_handler", "role", "module", "no_python",
    "run_path", "log_dir", "redirects", "tee", "local_ranks_filter", "duplicate_stdout_filters",
    "duplicate_stderr_filters", "node_rank", "master_addr", "master_port", "local_addr",
    "signals_to_handle", "shutdown_timeout", "virtual_local_rank",
})


def apply_pet_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Take each torchrun flag's default from PET_<DEST> when set. A flag given on the command line
    still wins, a bad value included; one the line leaves out is one line naming the variable once
    the line is parsed (it was said at once, so the flag could not override it as in torchrun)."""
    for action in parser._actions:
        name = f"PET_{action.dest.upper()}"
        if action.dest not in PET_FLAGS or name not in environ:
            continue
        text = environ[name]
        if action.nargs == 0:  # a switch: torchrun reads it as an integer, non-zero means on
            try:
                action.default = int(text) != 0
            except ValueError:  # (torchrun fails on it too, whatever the line says)
                parser.error(f"bad {name}={quoted(text)}: expected 0 or 1")
            continue
        action.default = _pet_default(action, name, text)


def _pet_default(action: argparse.Action, name: str, text: str) -> object:
    """PET_* `text` as the default of `action`, or an UnusableDefault saying why it is bad."""
    try:
        value = action.type(text) if action.type else text
        _PET_CHECKS.get(action.dest, _no_check)(value)
    except (BadValue, ValueError, TypeError) as exc:
        return UnusableDefault(f"bad {name}={quoted(text)}: {exc}")
    if action.choices and value not in action.choices:
        return UnusableDefault(f"bad {name}={quoted(text)}: expected one of {', '.join(action.choices)}")
    return value


def apply_shutdown_timeout_default(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """torchrun's grace comes from TORCH_ELASTIC_SHUTDOWN_TIMEOUT when the line gives none; a bad
    value is one line naming the variable. (Without it ranktop's default is 10 s, torchrun's 30.)"""
    text = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if text is None:
        return
    action = next(a for a in parser._actions if a.dest == "shutdown_timeout")
    try:
        action.default = action.type(text)
    except (BadValue, ValueError, TypeError) as exc:
        parser.error(f"bad TORCH_ELASTIC_SHUTDOWN_TIMEOUT={quoted(text)}: {exc}")


SUBCOMMANDS = """subcommands:
  ranktop ls [--json]       the runs served on this host, newest first
  ranktop attach [RUN] [--read-only] [--metric REGEX] [--exit-on-end]
                            the TUI of a run started elsewhere (q then d leaves it running)
  ranktop web [RUN] [--host H] [--port P] [--control]
                            the same TUI in browsers (textual-serve), read-only unless --control
  ranktop stop [RUN]        stop a run from any terminal (SIGTERM, SIGKILL after its grace)
  ranktop logs [RUN] [--rank R] [-f [--events]]
                            a run's output, prefixed, from its engine; -f follows it to the end
                            (--events: its events too)
  ranktop stacks [TARGET]   the grouped Python stacks of a running group's ranks (py-spy, or --signal);
                            TARGET: a served run, a run or log directory, or a pid (default: the newest run)
  ranktop SUBCOMMAND --help  each one's options"""


class _Version(argparse.Action):
    """--version, reading the package metadata only when asked (it costs ~60 ms at start-up)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import ranktop

        print(f"ranktop {ranktop.__version__}")
        parser.exit(0)


# ranktop's options that torchrun 2.13 does not have (tests/test_torchrun_parity.py checks the list
# against the installed torch's parser).
RANKTOP_ONLY = frozenset({
    "--debug", "--detach", "--detached-child", "--env", "--exit-on-end", "--headless", "--linger",
    "--log-line-prefix-template", "--log_line_prefix_template", "--metric", "--no-faulthandler",
    "--no_faulthandler", "--pty", "--run-id", "--sanitize-console", "--stall-timeout", "--stall_timeout",
    "--tui", "--use-env", "--use_env", "--version", "-j",
})


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The command line, its options in the order --help lists them; a default that torchrun
    reads from the environment (`environ`, else os.environ) is read from there."""
    p = UsageParser(
        prog="ranktop",
        description="Launch and watch one process per rank (torchrun-compatible), in a TUI or headless.",
        epilog=SUBCOMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.extra_options = RANKTOP_ONLY
    p.set_defaults(typed=frozenset())
    for add_options in (_add_world_options, _add_rendezvous_options, _add_script_options, _add_run_options,
                        _add_view_options, _add_rank_process_options, _add_torchrun_options):
        add_options(p)
    p.add_argument("--version", action=_Version, nargs=0, help="show ranktop's version and exit")
    p.add_argument("training_script", help="the script (or binary with --no-python, module with -m)")
    # argparse counts a REMAINDER positional as required: a line without a script was told it
    # lacked `training_script, training_script_args`, though the script's arguments are optional.
    p.add_argument("training_script_args", nargs=argparse.REMAINDER).required = False
    environ = os.environ if environ is None else environ
    apply_shutdown_timeout_default(p, environ)
    apply_pet_defaults(p, environ)  # PET_SHUTDOWN_TIMEOUT, then the flag, win over it, as in torchrun
    return p


def _add_world_options(parser: argparse.ArgumentParser) -> None:
    """How many nodes and ranks, and where node 0 is."""
    add = parser.add_argument
    add(*_both("nproc-per-node"), type=_nproc_text, default="1", metavar="N|auto|cpu|gpu|xpu", action=_Typed,
        help="ranks on this node (default 1)")
    add("-j", dest="jobs", metavar="[MIN:]NxM", help="TorchX style: N nodes x M ranks per node")
    add("--nnodes", default="1", action=_Typed,
        help="number of nodes, N or MIN:MAX (elastic with --rdzv-backend; static: MAX)")
    add(*_both("node-rank"), type=_number("--node-rank", limits.COUNT), default=0, help="this node's rank (default 0)")
    add(*_both("master-addr"), type=_address("--master-addr", empty_ok=True), default="127.0.0.1",
        help="address of node 0 (default 127.0.0.1)")
    add(*_both("master-port"), type=_number("--master-port", limits.PORT_OR_FREE), default=None,
        help="port on node 0 (default, or 0: a free port on one node; 29500 with several)")
    add("--standalone", action="store_true", help="single node, pick a free port")


def _add_rendezvous_options(parser: argparse.ArgumentParser) -> None:
    """How the nodes find each other through torch's rendezvous."""
    add = parser.add_argument
    add(*_both("rdzv-backend"), default=None, metavar="NAME",
        help="rendezvous through torch: c10d, etcd, etcd-v2, static or a torchrun plugin "
             "(default: ranktop's static form, no torch needed)")
    add(*_both("rdzv-endpoint"), default="", metavar="HOST[:PORT]", help="where the rendezvous is served")
    add(*_both("rdzv-id"), default="none", metavar="ID",
        help="the job's id, the same on every node (TORCHELASTIC_RUN_ID and the run directory's name)")
    add(*_both("rdzv-conf"), default="", metavar="K=V,...",
        help="rendezvous settings, e.g. join_timeout=600,last_call_timeout=30,close_timeout=30,is_host=1")
    # empty_ok: `--local_addr=$LOCAL_IP` unset is no address, as torch reads it (this host's name)
    add(*_both("local-addr"), type=_address("--local-addr", empty_ok=True), default=None, metavar="ADDR",
        help="this node's address in the rendezvous (default: its fully qualified host name)")


def _add_script_options(parser: argparse.ArgumentParser) -> None:
    """How the script is started: as a file, a module or a binary."""
    add = parser.add_argument
    add("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    add(*_both("no-python"), action="store_true", help="run the script as a binary, not with python")
    add(*_both("use-env"), action="store_true",
        help="torch.distributed.launch's: LOCAL_RANK in the environment, as every rank gets it anyway "
             "(no --local-rank argument is added, as in torchrun)")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """The run's restarts, files, console output and its ranks' environment."""
    add = parser.add_argument
    add(*_both("max-restarts"), type=_number("--max-restarts", limits.COUNT), default=0, help="group restarts on failure (default 0)")
    add(*_both("monitor-interval"), type=_number("--monitor-interval", limits.MONITOR_SECONDS), default=0.1, help="seconds between monitor passes")
    add(*_both("log-dir"), default=None, help="where run directories go (default $TMPDIR/ranktop-UID)")
    add("--run-id", default=None, help="name of the run directory and TORCHELASTIC_RUN_ID")
    add("-r", "--redirects", default="0", help="streams to files only: 0-3 or a map like 0:3,1:1")
    add("-t", "--tee", default="0", help="streams to files and console: 0-3 or a map (files are always kept)")
    add(*_both("local-ranks-filter"), default=None, metavar="R[,R...]", help="only these local ranks print")
    add("--role", default="default", help="role name (ROLE_NAME, default 'default')")
    add(*_both("log-line-prefix-template"), default=None,
        help="console prefix, e.g. '[${role_name}${rank}]:' (also $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)")
    add(*_both("shutdown-timeout"), type=_number("--shutdown-timeout", limits.SECONDS), default=10.0,
        help="grace before SIGKILL (default $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 10 s)")
    add("--env", action="append", default=[], metavar="K=V", help="extra variable for every rank (repeatable)")
    add("--debug", action="store_true", help="set CUDA/NCCL/torch.distributed debug variables")
    add(*_both("stall-timeout"), type=_number("--stall-timeout", limits.POSITIVE_SECONDS), default=None,
        help="seconds without output before a rank is shown stalled (headless: off; TUI, --detach: 60)")


def _add_view_options(parser: argparse.ArgumentParser) -> None:
    """How the run is shown: a TUI, headless, or detached in the background."""
    add = parser.add_argument
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--headless", action="store_true", help="no TUI: prefixed output, like torchrun")
    mode.add_argument("--tui", action="store_true", help="the TUI even when stdout is not a terminal")
    add("--sanitize-console", action="store_true",
        help="headless: pass rank output to the console through the TUI's filter (escape sequences other "
             "than colours dropped, control characters shown); the log files keep the raw bytes")
    add("--exit-on-end", action="store_true", help="TUI: close as soon as the group ends")
    add("--linger", type=_number("--linger", limits.SECONDS), default=600.0, metavar="S",
        help="a detached run's engine stays S seconds after the end, for ranktop attach/logs (default 600)")
    add("--detached-child", action="store_true", help=argparse.SUPPRESS)  # set by --detach
    add("--detach", action="store_true",
        help="start the run in the background at once (headless, output in its log files) and print "
             "how to reach it: ranktop attach/logs/stop")
    add("--metric", type=metric_pattern, default=None, metavar="REGEX",
        help="TUI: a number from each rank's output, e.g. 'loss ([0-9.eE+-]+)' (its first group, else the match)")


def _add_rank_process_options(parser: argparse.ArgumentParser) -> None:
    """What each rank's process gets: a terminal, a stack dump, the signals."""
    add = parser.add_argument
    add("--pty", action="store_true",
        help="give each rank a pseudo-terminal (isatty() true; stderr merged into stdout.log)")
    add(*_both("no-faulthandler"), action="store_true",
        help="do not make SIGUSR1 dump a Python rank's stacks (faulthandler)")
    add(*_both("signals-to-handle"), type=_signal_list, default="SIGTERM,SIGINT,SIGHUP,SIGQUIT", metavar="SIGS",
        help="signals ranktop handles: SIGINT/TERM/HUP/QUIT stop the run (forwarded, grace, SIGKILL); "
             "SIGUSR1/USR2 are passed on to every rank and the run goes on (Slurm's requeue notice)")


def _add_torchrun_options(parser: argparse.ArgumentParser) -> None:
    """torchrun's options for filtered output copies, its plugins, how ranks start and NUMA binding."""
    add = parser.add_argument
    for stream in ("stdout", "stderr"):
        add(*_both(f"duplicate-{stream}-filters"), type=_comma_list, default=[], metavar="A,B",
            help=f"{stream} lines of any rank containing one of these also go, prefixed, to "
                 f"attempt_<k>/filtered_{stream}.log (',,' is a comma)")
    add(*_both("event-log-handler"), default="null", choices=("null", "console", "dynamic_rendezvous"),
        help="torchrun's event handler: console also prints each events.jsonl event to stderr")
    add(*_both("logs-specs"), default=None, metavar="NAME",
        help="torchrun's LogsSpecs plugin name: default (the layout ranktop writes); any other is refused")
    add(*_both("start-method"), default="spawn", choices=("spawn", "fork", "forkserver"),
        help="accepted for torchrun: every rank is a fresh process either way")
    add(*_both("run-path"), action="store_true",
        help="run the script with runpy.run_path inside each rank's interpreter (torchrun --run-path)")
    add(*_both("virtual-local-rank"), action="store_true",
        help="LOCAL_RANK=0 in every rank, CUDA_VISIBLE_DEVICES narrowed to the rank's own GPU")
    add(*_both("numa-binding"), default=None, choices=numa.MODES,
        help="bind each rank to CPUs near its GPU, as torchrun: its NUMA node (node), package (socket), "
             "a share of the node's cores (exclusive) or of its cache groups (core-complex); needs NVIDIA GPUs")


_DEVICE_WORDS = ("auto", "cpu", "gpu", "xpu")  # --nproc-per-node counts these once the line is known


def _nproc_text(text: str) -> str:
    """An argparse type for --nproc-per-node (and PET_NPROC_PER_NODE): the text as given, when it
    is a count or a device word, else one line."""
    if text.strip().lower() not in _DEVICE_WORDS:
        _nproc_number(text)
    return text


def _nproc_number(value: str) -> int:
    try:
        n = int(value.strip())  # as torchrun reads it: "+2" and " 2" too
    except ValueError:
        n = None
    if n is None or not limits.NPROC.accepts(n):
        raise BadValue(f"bad --nproc-per-node {quoted(value)}: expected a positive whole number "
                       f"(at most {limits.MAX_NPROC_PER_NODE}), auto, cpu, gpu or xpu")
    return n


def parse_nproc(value: str) -> int:
    text = value.strip().lower()
    if text == "cpu":
        return _within_nproc(value, usable_cpus())
    if text in ("gpu", "auto"):
        from ranktop.core.gpu import device_count

        n = device_count(visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
        if n:
            return _within_nproc(value, n)
        if text == "gpu":
            raise UsageError("bad --nproc-per-node gpu: no GPU found (NVML sees none that "
                             "CUDA_VISIBLE_DEVICES allows)")
        return _within_nproc(value, usable_cpus())
    if text == "xpu":
        return _within_nproc(value, xpu_count())
    try:
        return _nproc_number(value)
    except BadValue as exc:  # (a value set after parsing, as -j sets it)
        raise UsageError(str(exc)) from None


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, cgroups, Slurm), as torch counts them for
    --nproc-per-node cpu: not every CPU of the machine."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def xpu_count() -> int:
    """Intel GPUs, as torchrun counts them: through torch's XPU backend."""
    import warnings

    try:
        with warnings.catch_warnings():  # torch warns at import time (e.g. no numpy): not ours to print
            warnings.simplefilter("ignore")
            import torch
    except ImportError as exc:
        from ranktop.core.rendezvous import torch_import_problem

        raise UsageError(f"bad --nproc-per-node xpu: counting XPUs needs torch, and {torch_import_problem(exc)}") from None
    if not torch.xpu.is_available():
        raise UsageError("bad --nproc-per-node xpu: no XPU found (torch.xpu sees none)")
    return torch.xpu.device_count()


def _within_nproc(value: str, n: int) -> int:
    if n > limits.MAX_NPROC_PER_NODE:
        raise UsageError(f"bad --nproc-per-node {value}: it means {n} ranks, more than the "
                         f"{limits.MAX_NPROC_PER_NODE} ranktop runs on one node; give a number")
    return n


def parse_nnodes_range(value: str) -> tuple[int, int]:
    """--nnodes N or MIN:MAX -> (MIN, MAX); elastic between them with a rendezvous backend."""
    lo, sep, hi = value.partition(":")
    try:
        ok = (lo.isdigit() and (not sep or hi.isdigit()) and limits.NNODES.accepts(int(hi or lo))
              and 1 <= int(lo) <= int(hi or lo))
    except ValueError:  # digits int() does not read: superscripts, or thousands of them
        ok = False
    if not ok:
        raise UsageError(f"bad --nnodes {quoted(value)}: expected N or MIN:MAX with 1 <= MIN <= MAX <= "
                         f"{limits.MAX_NNODES} (elastic with --rdzv-backend; static: MAX nodes)")
    return int(lo), int(hi or lo)


def parse_jobs(value: str) -> tuple[int, int, int]:
    """-j [[MIN:]MAX x]NPROC -> (min nodes, nodes, ranks per node): the Python API's rule."""
    from ranktop.core.spec import parse_nnodes

    lo, nnodes, nproc, _ = parse_nnodes(value)
    return lo, nnodes, nproc


def _check_jobs_agree(ns: argparse.Namespace, min_nodes: int, nnodes: int, nproc: int) -> None:
    """-j says how many nodes and ranks: a typed --nnodes or --nproc-per-node must say the same
    (it used to be dropped without a word)."""
    if "nnodes" in ns.typed and parse_nnodes_range(ns.nnodes) != (min_nodes, nnodes):
        nodes = f"{min_nodes}:{nnodes}" if min_nodes != nnodes else str(nnodes)
        raise UsageError(f"-j {ns.jobs} means --nnodes {nodes}, and --nnodes {ns.nnodes} was given too: "
                         "give one of them")
    if "nproc_per_node" in ns.typed and parse_nproc(ns.nproc_per_node) != nproc:
        raise UsageError(f"-j {ns.jobs} means --nproc-per-node {nproc}, and --nproc-per-node "
                         f"{ns.nproc_per_node} was given too: give one of them")


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"bad --env {quoted(pair)}: expected KEY=VALUE")
        env[key] = value
    return env


def parse_ranks(value: str | None) -> set[int] | None:
    if not value:  # as torchrun: empty is no filter
        return None
    try:
        ranks = {int(v) for v in value.split(",")}  # an empty item ("0,", ",") is an error, as in torchrun
    except ValueError:
        ranks = {-1}
    if not all(0 <= r < limits.MAX_NPROC_PER_NODE for r in ranks):  # (torchrun takes -1: then no rank prints)
        raise UsageError(f"bad --local-ranks-filter {quoted(value[:80])}: expected local ranks like 0 or 0,2")
    return ranks


def _no_check(value: object) -> None:
    pass


def _check_streams(text: str) -> None:
    """-r/-t's value as Std reads it (ValueError: one line)."""
    from ranktop.core.spec import Std

    Std.from_str(text)


# PET_* values of flags read only once the line is parsed, checked as they are taken: a bad one
# was named as its flag (`bad --nnodes ''`), which no line of a Kubeflow job holds.
_PET_CHECKS: dict[str, Callable[[str], object]] = {
    "nnodes": parse_nnodes_range, "redirects": _check_streams, "tee": _check_streams,
    "local_ranks_filter": parse_ranks, "role": lambda text: check_console_prefix("role", text),
}


# --run-path: the script runs inside the rank's interpreter through runpy, as torchrun's
# run_script_path does, instead of as `python script`. As there (a recorded function), an exception
# the script lets out is written to $TORCHELASTIC_ERROR_FILE in torch's format, so the report quotes
# it; as there, only an Exception: not a SystemExit, nor a KeyboardInterrupt (a Ctrl-C passed on to
# the ranks left an error.json in every rank's directory of a run the user stopped). Inline rather
# than imported: the ranks' Python may be an install without ranktop. A file already there (the
# script's own @record wrote it) is kept; none is written through.
RUN_PATH_CODE = """\
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name='__main__')
except Exception as exc:
    import json, os, time, traceback
    try:
        data = {'message': {'message': f'{type(exc).__name__}: {exc}', 'extraInfo': {
            'py_callstack': traceback.format_exc(), 'timestamp': str(int(time.time()))}}}
        fd = os.open(os.environ['TORCHELASTIC_ERROR_FILE'], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     0o600)
        with os.fdopen(fd, 'w') as f:
            json.dump(data, f)
    except Exception:
        pass  # no file, or one already there: the traceback still goes to stderr
    raise
"""


def python_for_ranks(environ: Mapping[str, str] | None = None) -> str:
    """The interpreter Python ranks run: $PYTHON_EXEC (torchrun's override), else the active
    virtualenv's or conda env's python when ranktop itself runs from another install (pipx),
    else ranktop's own."""
    environ = os.environ if environ is None else environ
    chosen = environ.get("PYTHON_EXEC")
    if chosen:
        path = shutil.which(chosen)
        if path is None:
            raise UsageError(f"bad PYTHON_EXEC={quoted(chosen)}: no such executable")
        return path
    for prefix in _active_envs(environ):
        if os.path.realpath(prefix) == os.path.realpath(sys.prefix):
            break  # the env `python` names is ranktop's own
        python = os.path.join(prefix, "bin", "python")
        if os.access(python, os.X_OK):
            return python
    return sys.executable


def _active_envs(environ: Mapping[str, str]) -> list[str]:
    """$VIRTUAL_ENV and $CONDA_PREFIX, where set, the one whose bin/ comes first on PATH first:
    a venv activated over conda's base env (which conda activates in every shell) leaves both
    set, and `python` is the venv's. Where PATH names neither (sudo's secure_path), VIRTUAL_ENV
    first."""
    prefixes = [p for p in (environ.get("VIRTUAL_ENV"), environ.get("CONDA_PREFIX")) if p]
    if len(prefixes) < 2:
        return prefixes
    path = [os.path.realpath(d) for d in environ.get("PATH", "").split(os.pathsep) if d]

    def place(prefix: str) -> int:
        bin_dir = os.path.realpath(os.path.join(prefix, "bin"))
        return path.index(bin_dir) if bin_dir in path else len(path)
    return sorted(prefixes, key=place)


def entrypoint_and_args(ns: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    script, rest = ns.training_script, tuple(ns.training_script_args)
    if ns.run_path:  # as torchrun: it takes precedence over --no-python and --module
        _check_script(script)
        return python_for_ranks(), ("-u", "-c", RUN_PATH_CODE, script, *rest)
    if ns.no_python:
        if ns.module:
            raise UsageError("--no-python and --module exclude each other")
        path = shutil.which(script) if os.sep not in script else script
        if path is None or not os.path.exists(path):
            raise UsageError(f"bad binary {quoted(script)}: not found")
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            raise UsageError(f"bad binary {quoted(script)}: not executable (chmod +x it, or drop --no-python)")
        return path, rest
    python = python_for_ranks()
    if ns.module:
        return python, ("-u", "-m", script, *rest)
    _check_script(script)
    return python, ("-u", script, *rest)


def _check_script(script: str) -> None:
    """What `python SCRIPT` runs: a file (a zipapp too), or a directory with a __main__.py."""
    if os.path.isdir(script):
        if not os.path.isfile(os.path.join(script, "__main__.py")):
            raise UsageError(f"bad script {quoted(script)}: a directory without a __main__.py")
    elif not os.path.isfile(script):
        raise UsageError(f"bad script {quoted(script)}: no such file")


def numa_binding(mode: str, nproc: int) -> dict[int, frozenset[int]]:
    """--numa-binding: the CPUs near each local rank's GPU (core/numa.py); a usage error in one
    line where that cannot be told (no GPU, an unsupported mode, unreadable topology)."""
    from ranktop.core.gpu import numa_binding as plan
    from ranktop.core.numa import NumaError

    try:
        return plan(mode, nproc, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except NumaError as exc:
        raise UsageError(str(exc)) from None


def check_logs_specs(name: str | None) -> None:
    # 'default' is the name torch registers for DefaultLogsSpecs, which is the layout ranktop writes.
    if name not in (None, "default"):
        raise UsageError(f"bad --logs-specs {quoted(name)}: ranktop writes its own log files (see --log-dir); "
                         "torchrun.logs_specs plugins are not loaded")


def build_spec(ns: argparse.Namespace, *, start_rendezvous: bool = True):
    """The WorkerSpec of the command line, every value checked. `start_rendezvous` False: the
    rendezvous values are checked but no handler is made (a c10d host would start its store)."""
    from ranktop.core.spec import WorkerSpec

    # The checks run in this order, which picks the one line said when several values are bad.
    check_logs_specs(ns.logs_specs)
    min_nodes, nnodes, nproc = _nodes_and_ranks(ns)
    if ns.rdzv_backend is None and (nnodes > 1 or ns.rdzv_endpoint) and not ns.standalone:
        # torchrun's default: its nodes and ranktop's can make one job; on one node an endpoint
        # alone is torchrun's static rendezvous too (it went unused)
        ns.rdzv_backend = "static"
    redirects, tee = _redirects_and_tee(ns)
    cpus = numa_binding(ns.numa_binding, nproc) if ns.numa_binding else None
    entrypoint, args = entrypoint_and_args(ns)
    env = _rank_env(ns, nproc)
    elastic = uses_rendezvous(ns)
    own_static = ns.rdzv_backend == "static" and not elastic  # ranktop's own static form (no torch)
    addr, port = _master_address(ns, nnodes, own_static)
    spec = WorkerSpec(
        role=ns.role, local_world_size=nproc, entrypoint=entrypoint, args=args,
        max_restarts=ns.max_restarts, monitor_interval=ns.monitor_interval, nnodes=nnodes,
        # torchrun ignores --node-rank with a dynamic rendezvous: the round gives the group rank.
        node_rank=ns.node_rank if not elastic or ns.rdzv_backend == "static" else 0,
        # Under a rendezvous each round gives the master; a spec's own would override it (torch's rule).
        master_addr=None if elastic else addr, master_port=None if elastic else port,
        env=env,
        redirects=redirects, tee=tee, local_ranks_filter=parse_ranks(ns.local_ranks_filter),
        # Under torch's rendezvous the agent takes the shared id from the round; here, from the line.
        run_id=ns.run_id if elastic else static_run_id(ns),
        name=os.path.basename(ns.training_script), pty=ns.pty,
        virtual_local_rank=ns.virtual_local_rank, cpu_affinity=cpus,
    )
    if elastic:  # last: the c10d host starts its store here, once every other value is known good
        spec.rdzv_handler = rendezvous_handler(ns, min_nodes, nnodes, port, check_only=not start_rendezvous)
    elif ns.rdzv_conf:  # no handler reads it (one node, --standalone, ranktop's own static form): still one line
        from ranktop.core.rendezvous import check_rdzv_conf

        check_rdzv_conf(ns.rdzv_conf, ns.rdzv_backend or "static")
    return spec


def _nodes_and_ranks(ns: argparse.Namespace) -> tuple[int, int, int]:
    """(min nodes, nodes, ranks per node) from -j, else --nnodes and --nproc-per-node."""
    if ns.jobs:
        min_nodes, nnodes, nproc = parse_jobs(ns.jobs)
        _check_jobs_agree(ns, min_nodes, nnodes, nproc)
    else:
        (min_nodes, nnodes), nproc = parse_nnodes_range(ns.nnodes), parse_nproc(ns.nproc_per_node)
    if ns.standalone and nnodes > 1:
        if min_nodes > 1:  # torchrun waits for nodes that cannot find its random local store
            raise UsageError(f"--standalone runs this one node, and --nnodes {ns.nnodes} asks for at least "
                             f"{min_nodes}: drop --standalone and name a --rdzv-endpoint every node reaches")
        min_nodes = nnodes = 1  # what torchrun ends with once its wait for more nodes is over
    return min_nodes, nnodes, nproc


def _redirects_and_tee(ns: argparse.Namespace):
    """-r and -t, read as torchrun reads them."""
    from ranktop.core.spec import Std

    try:
        return Std.from_str(ns.redirects), Std.from_str(ns.tee)
    except ValueError as exc:
        raise UsageError(f"bad -r/-t: {exc}") from None


def _rank_env(ns: argparse.Namespace, nproc: int) -> dict[str, str]:
    """The variables the line adds to every rank's environment: --debug's, --env's, OMP_NUM_THREADS."""
    from ranktop.core.spec import DEBUG_ENV

    env = {**(DEBUG_ENV if ns.debug else {}), **parse_env(ns.env)}
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:  # torchrun's command line sets this, not torch's agent
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _master_address(ns: argparse.Namespace, nnodes: int, own_static: bool) -> tuple[str, int | None]:
    """Where the ranks meet when no torch rendezvous names it: (MASTER_ADDR, MASTER_PORT), the port
    None for a free one."""
    addr, port = unbracketed(ns.master_addr), free_master_port(ns, nnodes)
    if port is None and nnodes > 1 and not ns.standalone:
        port = 29500  # like torchrun: every node must agree on it without talking first
    if on_a_local_store(ns, nnodes):
        addr, port = "127.0.0.1", None  # (None: a free port)
    elif not addr and master_addr_used(ns):
        raise UsageError(bad_address("--master-addr", addr))  # used: torch failed on it, or waited
    if own_static and ns.rdzv_endpoint:
        addr, port = own_static_master(ns.rdzv_endpoint, nnodes)
    return addr, port


def free_master_port(ns: argparse.Namespace, nnodes: int) -> int | None:
    """--master-port, with 0 (`--master_port=0`, written to dodge a busy port) read as a free one
    (None) on one node. torchrun takes 0 and passes it on: its agent's store takes a free port
    and its ranks, told MASTER_PORT=0, wait to connect until their time-out. With several nodes
    the others could not find that port: one line, where the port is used."""
    if ns.master_port != 0:
        return ns.master_port
    if nnodes > 1 and master_addr_used(ns) and not ns.standalone:
        raise UsageError("bad --master-port 0: port 0 (a free one) only works on one node: with "
                         f"{nnodes} nodes the others could not find it; name a port they all reach")
    return None


def master_addr_used(ns: argparse.Namespace) -> bool:
    """Whether the line's --master-addr is where the ranks meet (not on a local store): not under
    a dynamic rendezvous (the round names the master), nor where the static backend's endpoint
    names it (torchrun, and ranktop's own static form, meet there)."""
    if ns.rdzv_backend == "static":
        return not ns.rdzv_endpoint
    return not uses_rendezvous(ns)


def shared_run_id(ns: argparse.Namespace) -> str | None:
    """The run's id where every node of the job shares it: the --rdzv-id (not its default, none)
    of a line with a rendezvous backend (static, set for several nodes, included), or on one node
    with a --master-port, and no --run-id. torchrun runs that one node through its static
    rendezvous, whose id its ranks get; without a port, on a store of its own, it leaves the id
    unused. An empty one is none either: each node draws an id of its own, as torchrun's."""
    if ns.run_id is not None or ns.standalone or ns.rdzv_id in ("none", ""):
        return None
    if ns.rdzv_backend is None and ns.master_port is None:
        return None
    return ns.rdzv_id


def static_run_id(ns: argparse.Namespace) -> str | None:
    """The run id of a line that no torch rendezvous runs (ranktop's own static form, one node):
    --run-id, else the --rdzv-id every node shares, as under torch's static rendezvous (each node
    took an id of its own, and a one-node line's typed id was dropped)."""
    from ranktop.core.layout import check_run_id

    shared = shared_run_id(ns)
    return check_run_id(shared, "--rdzv-id") if shared is not None else ns.run_id


def own_static_master(endpoint: str, nnodes: int) -> tuple[str, int]:
    """Where the ranks of ranktop's own static form (no torch) meet when the line names the static
    backend's endpoint: there, as under torch's static backend and the API's own form (it went
    unused, and the ranks of every node met at --master-addr's 127.0.0.1:29500)."""
    from ranktop.core.rendezvous import check_endpoint, static_master

    check_endpoint(endpoint, nnodes)
    return static_master(endpoint)


def with_rendezvous(spec, ns: argparse.Namespace):
    """`spec` with its rendezvous started, where build_spec only checked it (built again)."""
    return build_spec(ns) if uses_rendezvous(ns) else spec


def on_a_local_store(ns: argparse.Namespace, nnodes: int) -> bool:
    """Whether torchrun would run this line on a store of its own at localhost:0, where the
    --master-addr (and, with --standalone, the --master-port) of the line go unused: --standalone,
    or one node with no port, rendezvous backend or endpoint named. A host there that was not this
    one left the ranks waiting for ever; a busy port failed their bind."""
    if ns.standalone:
        return True
    return nnodes == 1 and ns.master_port is None and ns.rdzv_backend is None and not ns.rdzv_endpoint


def unbracketed(addr: str) -> str:
    """--master-addr as the ranks' MASTER_ADDR: torchrun's help asks for an IPv6 address in
    brackets ([::1]), and its rendezvous gives the ranks the bare address, the form torch's store
    resolves (with the brackets the ranks waited for ever)."""
    return addr[1:-1] if addr.startswith("[") and addr.endswith("]") else addr


def uses_rendezvous(ns: argparse.Namespace) -> bool:
    """torch's rendezvous runs the nodes: a --rdzv-backend was named (more than one node and none
    named is torchrun's default, static), and it is not the static one with torch missing
    (ranktop's own static form gives the same ranks without torch)."""
    if ns.standalone or ns.rdzv_backend is None:
        return False
    if ns.rdzv_backend == "static":
        from ranktop.core.rendezvous import torch_installed

        return torch_installed()
    return True


def rendezvous_handler(ns: argparse.Namespace, min_nodes: int, max_nodes: int, master_port: int | None, *,
                       check_only: bool = False):
    from ranktop.core.agent import new_run_id
    from ranktop.core.layout import check_run_id
    from ranktop.core.rendezvous import check_endpoint, check_rdzv_id, create_handler, parse_rdzv_conf
    from ranktop.core.spec import free_port

    conf: dict = parse_rdzv_conf(ns.rdzv_conf)
    endpoint = ns.rdzv_endpoint
    # Empty (`--rdzv-id "$SLURM_ARRAY_TASK_ID"` outside an array job): torchrun draws a random id
    # for this node and runs; it was refused as a bad run id.
    rdzv_id = ns.rdzv_id or new_run_id()
    if rdzv_id != "none":  # it becomes the run's id, and its directory's name, on every node
        check_run_id(rdzv_id, "--rdzv-id")
    check_rdzv_id(rdzv_id, ns.rdzv_backend)  # and part of the rendezvous's key in the store
    check_endpoint(endpoint, max_nodes)
    if ns.rdzv_backend == "static":  # as torchrun: the master's address, and the node rank from the flags
        conf["rank"] = ns.node_rank
        endpoint = endpoint or f"{ns.master_addr}:{master_port or free_port()}"
    return create_handler(ns.rdzv_backend, endpoint, rdzv_id, min_nodes, max_nodes,
                          conf=conf, local_addr=ns.local_addr or None, check_only=check_only)


def _terminal_usable() -> bool:
    """Whether the TUI can run; if not, say in one line that the run goes on headless."""
    problem = terminal_problem()
    if problem is not None:
        print(f"ranktop: no terminal for the TUI ({problem}): running headless", file=sys.stderr, flush=True)
    return problem is None


def want_tui(ns: argparse.Namespace) -> bool:
    if ns.headless:
        return False
    return ns.tui or (sys.stdout.isatty() and not dumb_terminal())


def dumb_terminal() -> bool:
    """TERM=dumb (Emacs's M-x shell, some CI consoles): a terminal that acts on no escape
    sequence, so the TUI would be a stream of them and colours would show as `[31m`."""
    return os.environ.get("TERM") == "dumb"


def main(argv: Sequence[str] | None = None) -> int:
    hold_early_stops()  # as PID 1 (a container's command), an unhandled SIGTERM would be dropped
    collector.hold()  # released where start-up ends: the first frame, or the ranks started
    try:
        status = _run_command(argv)
    except BaseException as exc:  # a Ctrl-C before the command's own handling of it
        if not is_interrupt(exc):
            raise
        status = interrupted()
    finally:
        collector.release()
    if "ranktop.core.agent" in sys.modules:
        from ranktop.core.agent import store_call_left_blocked

        if store_call_left_blocked():
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):  # a dead console changes nothing here
                    stream.flush()
            os._exit(status)
    return status


def _run_command(argv: Sequence[str] | None) -> int:
    reopen_closed_streams()  # before any file is opened: a closed 0/1/2 would be taken by it
    escape_unencodable()
    guard_streams()  # a full disk or a hung-up terminal under stdout or stderr: one line at the end, no traceback
    argv = list(sys.argv[1:] if argv is None else argv)
    a_run = False  # a run ends with its own status, whatever its console took
    try:
        if argv and argv[0] in ("stacks", "ls", "stop", "logs", "attach", "web"):
            status = _subcommand(argv)
        else:
            ns = build_parser().parse_args(argv)
            a_run = not ns.detach
            status = _launch_command(ns, argv)
    except SystemExit as end:  # argparse's, after its words: --help, --version, bad usage
        status = _exit_status(end)
    return report_lost(status, keep_status=a_run)


def _exit_status(end: SystemExit) -> int:
    if end.code is None or isinstance(end.code, int):
        return end.code or 0
    print(end.code, file=sys.stderr)  # as Python says it at exit
    return 1


def _launch_command(ns: argparse.Namespace, argv: list[str]) -> int:
    refused = _detach_conflict(ns)
    if refused:
        return usage_error(refused)
    if not ns.detach and not want_tui(ns):
        guard.prestart()  # its interpreter starts while ours imports the engine, not beside the ranks
    try:
        return _launch(ns, argv)
    finally:
        guard.discard_spare()  # not taken: the command line or the rendezvous failed first


def _detach_conflict(ns: argparse.Namespace) -> str | None:
    """A TUI's flag given with --detach: the detached run has no TUI, so the flag would be lost
    without a word. Where `ranktop attach` takes it, say so."""
    if not ns.detach:
        return None
    if ns.tui:
        return ("--detach and --tui exclude each other: a detached run has no TUI; "
                "start it with --detach, then ranktop attach RUN shows it")
    for flag, given, as_attach in (("--metric", ns.metric is not None, "--metric REGEX"),
                                   ("--exit-on-end", ns.exit_on_end, "--exit-on-end")):
        if given:
            return (f"{flag} is for a TUI and a detached run has none: give it to the TUI that "
                    f"shows the run (ranktop attach RUN {as_attach})")
    return None


def _subcommand(argv: list[str]) -> int:
    try:
        if argv[0] == "stacks":
            from ranktop.tui.stacks_cli import main as stacks_main

            return stacks_main(argv[1:])
        from ranktop.tui.runs_cli import main as runs_main

        return runs_main(argv)
    except KeyboardInterrupt:  # Ctrl-C is how one leaves `logs -f` or a wait: no traceback, as a shell reports it
        return 128 + signal.SIGINT


def _launch(ns: argparse.Namespace, argv: list[str]) -> int:
    """Run the command line: in the background, in the TUI or headless. A bad value, or a
    rendezvous that fails, is one line."""
    from ranktop.core.rendezvous import RendezvousFailed

    try:
        return _start_run(ns, argv)
    except UsageError as exc:
        return usage_error(str(exc))
    except RendezvousFailed as exc:  # e.g. the endpoint cannot be reached: not a usage error
        print(usage_line(str(exc)), file=sys.stderr)  # (shown safely: torch's words may quote what was typed)
        return 1


def _start_run(ns: argparse.Namespace, argv: list[str]) -> int:
    # --detach: checked here, run by the background process; a c10d host's store must be its,
    # not this process's, which ends at once (the child then lost its rendezvous half the time).
    # The TUI's likewise: started after its fork, in the process that runs the engine (the store
    # serves from a thread of its own, which stayed in the waiting parent and ended on a detach).
    deferred = ns.detach or want_tui(ns)
    spec = build_spec(ns, start_rendezvous=not deferred)
    # As torchrun: the ranks (and a launcher nested in one) see which signals the agent handles.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(
        signal.Signals(sig).name for sig in ns.signals_to_handle)
    # ranktop owns this process: helpers that leave their rank are re-parented to us, not
    # to init, so they can be reaped, told to the guard and swept.
    from ranktop.core.strays import adopt_orphans

    if ns.detach:
        return start_detached(argv, ns)
    if want_tui(ns) and _terminal_usable():
        from ranktop.tui.detach import hold_terminal
        from ranktop.tui.run import run_tui

        detacher = hold_terminal()  # a child runs the TUI from here on, so that q can detach
        spec = with_rendezvous(spec, ns)
        adopt_orphans()
        return run_tui(spec, ns, detacher=detacher)
    spec = with_rendezvous(spec, ns) if deferred else spec
    adopt_orphans()
    return run_headless(spec, ns)


def start_detached(argv: list[str], ns: argparse.Namespace) -> int:
    """Run the same command line headless in a session of its own, with its stdio on /dev/null,
    and return once its engine serves the run (so `ranktop attach` works at once)."""
    import subprocess

    from ranktop.core.agent import new_run_id
    from ranktop.core.layout import check_run_id
    from ranktop.core.server import SocketDirError, remove_if_dead, socket_path

    # The run's id, as the child will take it: a multi-node run's is the rendezvous id, the same on
    # every node, so the child derives it itself; any other is fixed here, so we know its socket.
    shared = shared_run_id(ns)
    run_id = check_run_id(ns.run_id or shared or new_run_id())
    try:
        path = socket_path(run_id)  # a detached run nobody can reach is refused before it starts
        # So is one whose id a served run has: its socket is taken (the other run answered there,
        # and was said to be this one, started: `ranktop stop ID` would have stopped it).
        if shared is None and remove_if_dead(path):
            raise SocketDirError(f"{path} is in use: another run has this run id; pick another --run-id")
    except (SocketDirError, OSError) as exc:
        return usage_error(f"cannot serve a detached run: {exc}")
    script_at = argv.index(ns.training_script)  # what follows is the script's own arguments
    options = [a for a in argv[:script_at] if a not in ("--detach", "--tui", "--headless")]
    # An id chosen here is added (--run-id=ID in one word: one that starts with a dash is not taken
    # for an option); the user's own is among the options already, as typed, and `ps` shows it once.
    named = [] if shared or ns.run_id is not None else [f"--run-id={run_id}"]
    command = [sys.executable, "-m", "ranktop", "--headless", "--detached-child", *named, *options, *argv[script_at:]]
    # Its stderr comes here until it serves the run (then it is /dev/null): what stops it before
    # that (a bad --rdzv-backend, an endpoint out of reach) is said here, as without --detach.
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        return _wait_served(child, run_id, None if shared else path)
    finally:
        child.stderr.close()


def _wait_served(child, run_id: str, path: str | None) -> int:
    """Wait until the child serves the run, at `path`; with no path (a shared rendezvous id,
    which another node of the job on this host may serve already), under whichever name the
    child took: the run served by its pid."""
    import time

    said = _PipeTail(child.stderr.fileno())
    deadline = time.monotonic() + SERVE_WAIT_SECONDS
    try:
        while time.monotonic() < deadline:
            said.drain()  # torch may say a lot (a store out of reach): the pipe must never fill
            if child.poll() is not None:
                return _ended_before_served(child, run_id, said)
            name = _served_name(child, run_id, path)
            if name is not None:
                print(_started_message(name, child.pid))
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:  # only the wait ends (the run is in a session of its own): it was a traceback
        print(f"\nranktop: {run_id} (pid {child.pid}) goes on starting in the background, as Ctrl-C ended only "
              f"the wait for it: ranktop ls lists it once it is served; kill {child.pid} stops it", file=sys.stderr)
        return 128 + signal.SIGINT
    # Still starting (its rendezvous store not reached yet, say): not served, so not listed yet.
    print(f"ranktop: {run_id} (pid {child.pid}) is not served after {SERVE_WAIT_SECONDS:g} s: it is still "
          f"starting, and ranktop ls lists it once it is (a rendezvous store out of reach is waited for "
          f"until its time-out); kill {child.pid} stops it", file=sys.stderr)
    return 1


def _started_message(run_id: str, pid: int) -> str:
    """How --detach says where its run went: each command on a line of its own, after a label (on
    one line, `attach ... | logs ... -f | stop ...` read as a pipeline, and pasted ran one)."""
    return (f"ranktop: started {run_id} in the background (pid {pid})\n"
            f"  attach: {run_command('attach', run_id)}\n"
            f"  follow: {run_command('logs', run_id, '-f')}\n"
            f"  stop:   {run_command('stop', run_id)}")


def _ended_before_served(child, run_id: str, said: _PipeTail) -> int:
    """The background run ended before it was served: say how, and return its exit status."""
    said.drain()
    if child.returncode == 0:  # over before it was reached (--linger 0): it succeeded, not an error
        print(f"ranktop: {run_id} ran in the background and has already ended (exit 0)")
        return 0
    print(said.verdict() or f"ranktop: error: the run {run_id} ended at once (exit {child.returncode}); "
          "run it without --detach to see why", file=sys.stderr)
    return child.returncode or 1


def _served_name(child, run_id: str, path: str | None) -> str | None:
    """The name the child serves its run under by now (see _wait_served), else None."""
    from ranktop.core.client import served_runs

    if path is not None:
        return run_id if _served_now(path, child.pid) else None
    return next((r.run_id for r in served_runs() if r.pid == child.pid), None)


SERVE_WAIT_SECONDS = 30.0  # how long --detach waits for its background run to be served


def _served_now(path: str, pid: int) -> bool:
    """Whether the process `pid` serves the socket at `path` (another engine that took it
    meanwhile does not: the child cannot serve there)."""
    from ranktop.core.client import Connection, EngineRefused, RunGone

    try:
        with Connection(path, timeout=1.0) as conn:
            return conn.hello.get("pid") == pid
    except EngineRefused as refused:  # served, to a crowd already
        return refused.listener == pid
    except RunGone:
        return False


class _PipeTail:
    """The last few KiB of what a child wrote to a pipe, read without waiting: whatever it left
    running may hold the pipe open after it ended."""

    KEEP = 8192

    def __init__(self, fd: int) -> None:
        self.fd, self.data = fd, b""
        os.set_blocking(fd, False)

    def drain(self) -> None:
        try:
            while chunk := os.read(self.fd, 65536):
                self.data = (self.data + chunk)[-self.KEEP:]
        except BlockingIOError:
            pass

    def verdict(self) -> str:
        """ranktop's own lines of it (why the run could not start), else its last lines."""
        lines = clean(self.data.decode(errors="replace"), newlines=True).splitlines()
        ours = [line for line in lines if line.startswith("ranktop: ")]
        return "\n".join(ours or lines[-5:])


def serve_run(engine):
    """Serve the run on its socket (ranktop ls/stop/logs): (the server, None), or (None, why not)
    after a line saying so on stderr."""
    from ranktop.core.server import serve

    server, problem = serve(engine, engine.agent.served_names())
    if problem is not None:
        print(f"ranktop: {problem}", file=sys.stderr, flush=True)
    return server, problem


def _stderr_to_devnull() -> None:
    null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        sys.stderr.flush()
        os.dup2(null, 2)
    finally:
        os.close(null)


def run_headless(spec, ns: argparse.Namespace) -> int:
    """Run `spec` without a TUI, as torchrun does (rank output on the console, prefixed, an end
    report on stderr), served to ranktop ls/attach/stop once under way; its exit status."""
    from ranktop.core.engine import LocalEngine

    stall_timeout, sampler = _stall_timeout_and_sampler(ns)
    _say_before_start(spec, ns)
    stalls, serving = _StallNotices(), _HeadlessServing(ns.detached_child)
    agent = stalls.agent = _headless_agent(spec, ns, stall_timeout, sampler, stalls, serving)
    if sampler is not None:
        sampler.attach(agent)
    serving.engine = engine = LocalEngine(agent)
    if ns.detached_child:
        # Started to outlive its terminal: the run notes a hang-up (and SIGUSR1/2, Slurm's warnings)
        # and goes on, and the engine that lingers after it stays on them too. (The run puts these
        # handlers back at its end; with the defaults there, each killed the lingering engine, its
        # socket left behind.)
        deaf_to((signal.SIGHUP, *NOTICE_SIGNALS))
        serving.start()  # served before any rank speaks: our stderr is the parent's pipe until then
    # Start-up is over (before any attempt exists: an attempt frozen by gc.freeze would never be freed)
    collector.release()
    try:
        result = engine.run_here()  # the monitor loop in this thread, which gets the signals
        if serving.server is not None and ns.detached_child:
            serving.server.linger(ns.linger)  # clients still see the end; `ranktop stop` lets it go
    finally:
        if serving.server is not None:
            serving.server.close()
        if sampler is not None:
            sampler.close()
    _print_end_report(result, spec, agent, ns)
    return result.exit_status


def _stall_timeout_and_sampler(ns: argparse.Namespace):
    """A headless run's stall time-out, and the sampler of each rank's cpu, memory and GPU where
    it needs one (None where not)."""
    stall_timeout = ns.stall_timeout
    if ns.detached_child and stall_timeout is None:  # watched through `ranktop attach`: the TUI's default
        stall_timeout = limits.TUI_STALL_TIMEOUT
    if not (stall_timeout or ns.detached_child):  # (attach shows each rank's cpu, memory and GPU)
        return stall_timeout, None
    from ranktop.core.stats import StatsSampler

    return stall_timeout, StatsSampler()


def _say_before_start(spec, ns: argparse.Namespace) -> None:
    """What a headless run says on stderr before its ranks start: another interpreter, a lost
    --metric, a file-timer watchdog asked for."""
    from ranktop.core.agent import other_interpreter

    interpreter = other_interpreter(spec)
    if interpreter:
        print(f"ranktop: ranks run {clean(interpreter)}", file=sys.stderr)
    # torch's agent runs a watchdog then, which SIGKILLs a rank whose timer expired (and then
    # itself, leaving the other ranks running); ranktop runs none, and must not be silent about it
    if os.environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") == "1":
        print("ranktop: TORCHELASTIC_ENABLE_FILE_TIMER=1 ignored: ranktop runs no file-timer watchdog, so the "
              "ranks get no TORCHELASTIC_TIMER_FILE and their torch.distributed.elastic.timer timers are not "
              "enforced", file=sys.stderr)
    if ns.metric is not None and not ns.detached_child:  # (--detach refuses it: it has no TUI at all)
        print("ranktop: --metric ignored: a headless run has no TUI to show it in (ranktop attach RUN "
              "--metric REGEX does)", file=sys.stderr)


def _headless_agent(spec, ns: argparse.Namespace, stall_timeout: float | None, sampler, stalls: _StallNotices,
                    serving: _HeadlessServing):
    """The LocalAgent that runs `spec` headless, as the command line asks."""
    from ranktop.core.agent import LocalAgent

    return LocalAgent(spec, log_dir=ns.log_dir, log_line_prefix_template=ns.log_line_prefix_template,
                      shutdown_timeout=ns.shutdown_timeout, stall_timeout=stall_timeout,
                      sampler=sampler, on_stalls=stalls, faulthandler=not ns.no_faulthandler,
                      sanitize_console=ns.sanitize_console, signals_to_handle=ns.signals_to_handle,
                      echo_events=ns.event_log_handler == "console", hangup_stops=not ns.detached_child,
                      duplicate_filters={1: tuple(ns.duplicate_stdout_filters), 2: tuple(ns.duplicate_stderr_filters)},
                      color=_shown_in_colour(ns), on_under_way=None if ns.detached_child else serving.start,
                      typed_stdin=ns.detached_child,  # its stdin is /dev/null: attach's `i` types instead
                      numbered_run_dir=shared_run_id(ns) is not None,  # job42.1 beside a node's job42
                      log_dir_name="--log-dir")


def _shown_in_colour(ns: argparse.Namespace) -> bool:
    """Whether a headless run's rank output is shown in colour, so that its ranks get the colour
    hints: on a console that is a terminal, or, with --detach, in `ranktop attach`'s TUI (its
    ranks printed plain, while those of a TUI run detached with `q` kept their colours); never
    with NO_COLOR or TERM=dumb."""
    shown = ns.detached_child or sys.stdout.isatty()
    return shown and "NO_COLOR" not in os.environ and not dumb_terminal()


class _StallNotices:
    """The agent's on_stalls for a headless run: a console line for each stalled rank, or rank
    waiting for input; once a run, after the first stall, how to see where each rank is."""

    def __init__(self) -> None:
        self.agent = None  # the agent saying them, made after this (it is given this object)
        self.stacks_told = False

    def __call__(self, snaps) -> None:
        for snap in snaps:
            self.agent.say(_stall_line(snap))
        # Once a run, after the first stall lines: the next step of a hang, which headless has no key for
        if not self.stacks_told and any(not snap.input_prompt for snap in snaps):
            self.stacks_told = True
            self.agent.say(f"ranktop: where each rank is: ranktop stacks {shlex.quote(clean(self.agent.run_dir))} "
                           "(in another terminal)")


def _stall_line(snap) -> str:
    from ranktop.core.prompts import NO_PROMPT

    quiet = f"no output for {snap.stall_seconds or 0:.0f}s"
    if snap.input_prompt:  # pdb in a rank: not stalled, waiting for someone to type
        at = "on its stdin" if snap.input_prompt == NO_PROMPT else f"at its {clean(snap.input_prompt)} prompt"
        return f"ranktop: rank {snap.rank} waits for input {at}: {quiet} (pid {snap.pid})"
    cpu = "-" if snap.cpu_percent is None else f"{snap.cpu_percent:.0f}%"
    gpu = "-" if snap.gpu is None or snap.gpu.util_percent is None else f"{snap.gpu.util_percent:.0f}%"
    return f"ranktop: rank {snap.rank} stalled: {quiet} (cpu {cpu}, gpu {gpu}, pid {snap.pid})"


class _HeadlessServing:
    """A headless run's server (ranktop ls, attach, stop), started once the run is under way:
    `start` is the agent's on_under_way, or called before any rank starts in a detached child."""

    def __init__(self, detached_child: bool) -> None:
        self.detached_child = detached_child
        self.engine = None  # the engine served, made after this (its agent is given `start`)
        self.server = None

    def start(self) -> None:
        self.server, _ = serve_run(self.engine)
        if self.detached_child:  # served: the command that started us stops reading our stderr now
            _stderr_to_devnull()


def _print_end_report(result, spec, agent, ns: argparse.Namespace) -> None:
    """The end report on stderr, as torchrun's, with what the console did not show."""
    from ranktop.core.report import format_end_report
    from ranktop.core.stdio import write_within

    # The script's name is ours to print (the rank's own words stay raw, as torchrun prints them):
    # a name with escape sequences in it must not retitle the terminal.
    report = format_end_report(result, name=clean(spec.display_name()), attempt=agent.attempt,
                               max_restarts=spec.max_restarts, run_dir=agent.run_dir,
                               user_restarts=agent.user_restarts) or ""
    if report and ns.sanitize_console:  # it quotes error.json and the rank's last lines
        report = clean(report, sgr=True, newlines=True)
    if agent.console_unshown:
        report += "\n" + _unshown_output_line(agent)
    if report:
        write_within(sys.stderr, report.lstrip("\n") + "\n", agent.console_stall)  # a stuck stderr must not hang us


def _unshown_output_line(agent) -> str:
    """Why the last of the rank output never reached the console (the log files have it)."""
    why = (f"the console took nothing for {agent.console_stall:g}s after the run ended" if agent.console_cut_by is None
           else f"{signal.Signals(agent.console_cut_by).name} cut short the wait for the console after the run ended")
    return (f"ranktop: {why}: the last {agent.console_unshown} bytes of rank output were not shown; "
            "the log files have them")


if __name__ == "__main__":
    sys.exit(main())
