"""TUI benchmark, run by hand: the real `ranktop --tui` inside tmux (a real terminal),
beside a Textual app built on Textual's own Log widget and a bare grid of ranktop's LogView.

    python bench/bench_tui.py                    # everything (about 3 minutes)
    python bench/bench_tui.py --cases steady     # steady | burst | memory, comma separated
    python bench/bench_tui.py --apps ranktop,log # ranktop | log | logview
    python bench/bench_tui.py --cases memory --apps ranktop --memory-lines 100   # the app alone
    python bench/bench_tui.py --cases steady --apps ranktop --repeats 5          # the median of 5

Per case and app: the app process's own CPU (user+system of that one process, not its ranks) as %
of one core over the time the ranks were writing (and, `from exec`, all it used from its start to
their last line, over the same time), its peak RSS (VmHWM), the RSS of the waiting parent that
ranktop's TUI is forked from (`parent MB`: it stays to detach on q), and whether every rank's
stdout.log holds exactly the bytes its generator wrote.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from compiled import add_installed_option, compile_ranktop, ranktop_python  # noqa: E402
from gen_lines import expected  # noqa: E402

SOCKET = "ranktop-bench"  # our own tmux server: other tmux sessions are left alone
COLS, ROWS = 160, 48
TARGET_CPU, TARGET_MB = 8.0, 100.0  # issue 10's targets (the first release had 15% and 150 MB)


@dataclass
class Case:
    name: str
    ranks: int
    lines: int
    rate: float  # lines/s per rank; 0 = as fast as possible
    timeout: float
    # seconds each rank stays after its last line, as a training rank does after a burst of output:
    # the TUI is weighed while its ranks are alive and quiet, which is when it looks for prompts
    linger: float = 0
    settle: float = 2.0  # seconds from the ranks' last line to the weighing


@dataclass
class Result:
    case: str
    app: str
    cpu_percent: float | None = None  # of one core, while the ranks wrote
    # the same time, but with all the CPU the app had used since its exec (start-up before the
    # ranks' first line too: how much of it falls before that line depends on the order of start)
    cpu_from_exec: float | None = None
    seconds: float | None = None  # first byte in the logs to the last
    peak_mb: float | None = None
    rss_mb: float | None = None  # after the ranks were done and the screen had settled
    # the waiting parent the TUI was forked from (it stays to detach on q): its RSS at the same time
    parent_mb: float | None = None
    complete: bool = False
    note: str = ""


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, *args], check=True, capture_output=True, text=True).stdout


# How ranktop is started: `ranktop` from PATH, else this interpreter's; --installed sets it.
RANKTOP_HEAD = [exe] if (exe := shutil.which("ranktop")) else [sys.executable, "-m", "ranktop"]


def ranktop_argv(case: Case, log_dir: str) -> list[str]:
    return [*RANKTOP_HEAD, "--tui", "--nproc-per-node", str(case.ranks), "--log-dir", log_dir, "--run-id", "bench",
            "--shutdown-timeout", "2", str(BENCH / "gen_lines.py"), *gen_args(case)]


def grid_argv(widget: str, case: Case, log_dir: str) -> list[str]:
    return [sys.executable, str(BENCH / "textual_log_app.py"), "--widget", widget, "--ranks", str(case.ranks),
            "--log-dir", log_dir, *gen_args(case)]


def gen_args(case: Case) -> list[str]:
    return ["--lines", str(case.lines), "--rate", str(case.rate), *(["--linger", str(case.linger)] if case.linger else [])]


def own_cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def log_files(log_dir: Path) -> dict[int, Path]:
    return {int(p.parent.name): p for p in log_dir.glob("**/stdout.log") if p.parent.name.isdigit()}


def wait_for_tui_child(parent: psutil.Process, timeout: float = 10.0) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in parent.children():
            if "ranktop" in " ".join(child.cmdline()):
                return child
        time.sleep(0.02)
    return parent  # (no fork: threads were running, or an older ranktop)


def run_case(case: Case, app: str, log_dir: Path) -> Result:
    argv = ranktop_argv(case, str(log_dir)) if app == "ranktop" else grid_argv(app, case, str(log_dir))
    want = {r: len(expected(r, case.lines)) for r in range(case.ranks)}
    result = Result(case.name, app)
    pid = int(tmux("new-session", "-d", "-s", "bench", "-x", str(COLS), "-y", str(ROWS), "-c", str(ROOT),
                   "-P", "-F", "#{pane_pid}", "exec " + shlex.join(argv)).strip())
    proc = launcher = psutil.Process(pid)
    if app == "ranktop":  # the TUI runs in a child of the pid the shell started (so that q can detach)
        proc = wait_for_tui_child(proc)
        pid = proc.pid
    try:
        start = cpu_start = None
        deadline = time.monotonic() + case.timeout
        while time.monotonic() < deadline:
            files = log_files(log_dir)
            sizes = {r: p.stat().st_size for r, p in files.items()}
            if start is None and any(sizes.values()):
                start, cpu_start = time.monotonic(), own_cpu(proc)
            if all(sizes.get(r, 0) >= n for r, n in want.items()):
                break
            time.sleep(0.05)
        else:
            result.note = f"ranks not done after {case.timeout:.0f}s"
        if start is not None:
            result.seconds = time.monotonic() - start
            used = own_cpu(proc)
            result.cpu_percent = 100 * (used - cpu_start) / max(result.seconds, 1e-9)
            if launcher.pid != proc.pid:  # the waiting parent parsed the command line before it forked
                used += own_cpu(launcher)
            result.cpu_from_exec = 100 * used / max(result.seconds, 1e-9)
        time.sleep(case.settle)  # let the screen catch up with the last lines (and look at quiet ranks), then weigh it
        result.rss_mb = proc.memory_info().rss / 2**20
        result.peak_mb = vm_hwm(pid) / 2**20
        if launcher.pid != proc.pid:
            result.parent_mb = launcher.memory_info().rss / 2**20
        (log_dir / "screen.txt").write_text(tmux("capture-pane", "-p", "-t", "bench"))
        files = log_files(log_dir)
        result.complete = all(r in files and files[r].read_bytes() == expected(r, case.lines) for r in want)
    except psutil.NoSuchProcess:
        result.note = "the app exited early: see " + str(log_dir)
    finally:
        quit_app(proc)
    return result


def quit_app(proc: psutil.Process) -> None:
    """q (y if it asks to confirm); the tmux session goes if that did not end it."""
    try:
        family = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for keys in ("q", "y"):
        try:
            tmux("send-keys", "-t", "bench", keys)
            proc.wait(5)
            break
        except (psutil.TimeoutExpired, subprocess.CalledProcessError):
            continue
    subprocess.run(["tmux", "-L", SOCKET, "kill-session", "-t", "bench"], capture_output=True)
    for p in [proc, *family]:
        try:
            p.wait(10)
        except psutil.TimeoutExpired:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def gpu_stats() -> str:
    """What the TUI samples GPUs with, here: its memory counts NVML's own (~18 MB once initialised)."""
    from ranktop.core.gpu import GpuMonitor

    monitor = GpuMonitor.from_env()
    status, count = monitor.start(), monitor.count
    monitor.close()
    kind = "the fake (RANKTOP_FAKE_GPUS)" if os.environ.get("RANKTOP_FAKE_GPUS", "").strip() else "NVML"
    return status or f"{kind}, {count} device(s)"


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def table(results: list[Result]) -> str:
    head = ("case", "app", "CPU % of 1 core", "from exec", "seconds", "peak RSS MB", "RSS after MB", "parent MB", "all bytes",
            "note")
    rows = [head, tuple("-" * len(h) for h in head)]
    for r in results:
        rows.append((r.case, r.app, *("-" if c is None else f"{c:.1f}" for c in (r.cpu_percent, r.cpu_from_exec)),
                     "-" if r.seconds is None else f"{r.seconds:.1f}", mb(r.peak_mb), mb(r.rss_mb),
                     mb(r.parent_mb),                     "yes" if r.complete else "NO", r.note))
    return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in rows)


def main() -> int:
    # timeout(1) (bench/gpu_host.sh) ends a step with SIGTERM: raised here as SystemExit, so that the
    # finally blocks still close this script's tmux server and stop the run inside it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="steady,burst,memory")
    p.add_argument("--apps", default="ranktop,log,logview")
    p.add_argument("--seconds", type=float, default=20, help="steady case length (default 20)")
    p.add_argument("--memory-lines", type=int, default=10_000,
                   help="lines per rank in the memory case (default 10000; 100 shows the app's own size)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per case and app, taken in turns (default 1); the table gives each, then the median CPU")
    p.add_argument("--keep", action="store_true", help="keep the log directories")
    add_installed_option(p)
    ns = p.parse_args()
    compile_ranktop()
    if not shutil.which("tmux"):
        print("bench_tui: needs tmux", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="ranktop-bench-"))
    if ns.installed:
        global RANKTOP_HEAD
        RANKTOP_HEAD = [*ranktop_python(str(root / "installed"), ns.installed), "-m", "ranktop"]
    cases = {
        "steady": Case("steady 8 x 1000 lines/s", 8, int(1000 * ns.seconds), 1000, ns.seconds + 60),
        "burst": Case("burst 8 x 200k lines", 8, 200_000, 0, 300),
        "memory": Case(f"memory 64 x {ns.memory_lines:,} lines", 64, ns.memory_lines, 0, 300, linger=9, settle=5),
    }
    # Textual's Log only runs the steady case: it is the widget LogView replaces, compared at the
    # rate the CPU target is set for.
    plan = [(cases[c], a) for c in ns.cases.split(",") for a in ns.apps.split(",")
            if a == "ranktop" or (a == "logview" and c != "memory") or (a == "log" and c == "steady")]
    results = []
    try:
        for k, (case, app) in enumerate(plan * ns.repeats):  # in turns: the box's speed drifts
            log_dir = root / f"{case.name.split()[0]}-{app}-{k}"
            log_dir.mkdir()
            print(f"... {case.name}: {app}", file=sys.stderr, flush=True)
            results.append(run_case(case, app, log_dir))
            print(table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        subprocess.run(["tmux", "-L", SOCKET, "kill-server"], capture_output=True)
        if ns.keep:
            print(f"logs kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nTUI benchmark, {os.cpu_count()} cores, terminal {COLS}x{ROWS} in tmux, GPU stats: {gpu_stats()} "
          f"(targets: CPU <= {TARGET_CPU:.0f}% of one core at 8 x 1000 lines/s, every byte kept, "
          f"<= {TARGET_MB:.0f} MB with 64 x 10k lines)\n")
    print(table(results))
    if ns.repeats > 1:
        for case, app in plan:
            runs = [r for r in results if (r.case, r.app) == (case.name, app) and r.cpu_percent is not None]
            if runs:
                cpu, whole = [r.cpu_percent for r in runs], [r.cpu_from_exec for r in runs]
                print(f"{case.name}, {app}: median CPU {statistics.median(cpu):.1f}% of {len(cpu)} runs "
                      f"({min(cpu):.1f}-{max(cpu):.1f}); from exec {statistics.median(whole):.1f}% "
                      f"({min(whole):.1f}-{max(whole):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
