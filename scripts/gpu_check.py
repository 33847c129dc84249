"""Check ranktop's real NVML path on a machine with a GPU, by hand: CI has none, and the tests use
the pynvml-shaped fake (core/gpu_fake.py). Needs torch with CUDA, and tmux for the terminal check.

    python scripts/gpu_check.py [--out DIR] [--seconds 25]

Each check prints one line, PASS or FAIL, and the exit status is 0 when all passed:
  nvml   NVML starts and counts the devices torch counts; `--nproc-per-node gpu` starts that many
  match  two ranks doing CUDA work on the first GPU (rank r holds r+1 GiB and multiplies matrices)
         are matched to it through NVML's compute processes (rank 1 too, whose LOCAL_RANK alone
         would name a second device), with utilisation and at least its own allocation as its memory
  tui    the same ranks under `ranktop --tui` in tmux show gpu0 in each pane's title, with the
         rank's GiB, at 160x48, and `g0` at 80x24, and the TUI leaves at the end (--exit-on-end);
         the captures go to --out
  svg    the app's own SVG screenshot of such a run, to --out (README's real-GPU picture)
and after each, no process of its run is left.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from ranktop.core.agent import LocalAgent
from ranktop.core.engine import LocalEngine
from ranktop.core.gpu import GiB, GpuMonitor, device_count
from ranktop.core.spec import WorkerSpec
from ranktop.core.stats import StatsSampler

# Rank r holds r+1 GiB on the first GPU (every rank there, whatever its LOCAL_RANK) and keeps it
# busy with matrix products for argv[1] seconds. Without CUDA it spins on the CPU instead, so the
# script's own plumbing can be tried on a box with no GPU (with RANKTOP_FAKE_GPUS).
LOAD = """\
import os, sys, time
import torch
local = int(os.environ["LOCAL_RANK"])
end = time.monotonic() + float(sys.argv[1])
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(0)
    held = torch.empty((local + 1) << 30, dtype=torch.uint8, device="cuda")
a = torch.randn(2048, 2048, device="cuda" if cuda else "cpu")
print(f"rank {local}: holding {local + 1 if cuda else 0} GiB on {'cuda:0' if cuda else 'no GPU'}", flush=True)
step = 0
while time.monotonic() < end:
    for _ in range(10):
        a = torch.tanh(a @ a)
    if cuda:
        torch.cuda.synchronize()
    step += 1
    if step % 50 == 0:
        print(f"step {step}", flush=True)
print("done", flush=True)
"""
RANKS = 2
GPU0_HELD = re.compile(r"(?<!\S)gpu0 \d+% [\d.]+G/")  # wide titles: the rank's GiB of memory too
# Narrow titles (80x24) say `g0 87%`: only the redrawn screen has it, not the wide one tmux cuts.
GPU0_NARROW = re.compile(r"(?<!\S)g0 \d+%")
TMUX = ["tmux", "-L", "ranktop-gpu-check"]
TUI_RUN = "gpu-check"  # the TUI check's run id, to stop it by name


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def report(self, name: str, ok: bool, detail: str) -> bool:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)
        return ok


def wait_for(condition: Callable[[], object], timeout: float, step: float = 0.2) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(step)
    return None


def left_running(marker: str) -> list[int]:
    """Processes still running the load script (its path is in their command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or ()) and proc.pid != os.getpid():
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def no_orphans(checks: Checks, name: str, marker: str) -> None:
    gone = wait_for(lambda: not left_running(marker), timeout=15)
    checks.report(f"{name} leaves nothing", bool(gone), "no rank left" if gone else f"left running: {left_running(marker)}")


def ranktop_cli() -> list[str]:
    # Run from a scratch directory, so a checkout's ranktop/ there cannot shadow the installed one.
    return [sys.executable, "-m", "ranktop"]


# ----- the checks -------------------------------------------------------------------------------
def check_nvml(checks: Checks, work: Path) -> None:
    monitor = GpuMonitor.from_env()
    status = monitor.start()
    if not checks.report("nvml starts", status is None, status or f"{monitor.count} device(s)"):
        return
    readings = monitor.read_devices()
    for index, reading in sorted(readings.items()):
        print(f"     gpu{index}: {reading}")
    monitor.close()
    torch_count = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                                 capture_output=True, text=True).stdout.strip()
    checks.report("nvml counts as torch", str(device_count()) == torch_count,
                  f"NVML {device_count()}, torch {torch_count or '?'}")
    script = work / "world.py"
    script.write_text("import os; print('WORLD_SIZE=' + os.environ['WORLD_SIZE'], flush=True)\n")
    done = subprocess.run([*ranktop_cli(), "--headless", "--nproc-per-node", "gpu", "--log-dir", str(work / "logs-gpu"),
                           str(script)], cwd=work, capture_output=True, text=True, timeout=120)
    said = done.stdout.count(f"WORLD_SIZE={device_count()}")
    checks.report("--nproc-per-node gpu", done.returncode == 0 and said == device_count(),
                  f"exit {done.returncode}, {said} rank(s) said WORLD_SIZE={device_count()}"
                  + ("" if done.returncode == 0 else f": {done.stderr.strip()[-300:]}"))


def ranks_on_gpu0(snapshot) -> bool:
    return all(r.gpu is not None and r.gpu.index == 0 and (r.gpu.proc_mem or 0) >= (r.local_rank + 1) * GiB
               for r in snapshot.ranks)


def check_match(checks: Checks, work: Path, load: Path, seconds: float) -> None:
    spec = WorkerSpec(role="default", local_world_size=RANKS, entrypoint=sys.executable,
                      args=("-u", str(load), str(seconds)), max_restarts=0)
    sampler = StatsSampler(interval=0.5)
    engine = LocalEngine(LocalAgent(spec, log_dir=str(work / "logs-match"), console=False, shutdown_timeout=5.0,
                                    sampler=sampler))
    sampler.attach(engine)
    engine.start()
    busiest = 0.0
    try:
        def matched() -> bool:
            nonlocal busiest
            snapshot = engine.snapshot()
            busiest = max([busiest, *(r.gpu.util_percent or 0 for r in snapshot.ranks if r.gpu)])
            return ranks_on_gpu0(snapshot) and busiest > 0
        ok = wait_for(matched, timeout=seconds + 30)
        for r in engine.snapshot().ranks:
            print(f"     rank {r.local_rank} pid {r.pid}: {r.gpu}")
        checks.report("ranks matched to their GPU", bool(ok),
                      f"both on gpu0 with their allocation, busiest {busiest:.0f}%" if ok
                      else f"not within {seconds + 30:.0f} s; sampler: {sampler.gpu_status() or 'ok'}")
    finally:
        engine.close()
        sampler.close()
    no_orphans(checks, "match", str(load))


def tmux(*args: str) -> str:
    return subprocess.run([*TMUX, *args], capture_output=True, text=True).stdout


def check_tui(checks: Checks, work: Path, load: Path, seconds: float, out: Path) -> None:
    if not shutil.which("tmux"):
        checks.report("tui", False, "tmux is not installed")
        return
    argv = [*ranktop_cli(), "--tui", "--exit-on-end", "--nproc-per-node", str(RANKS), "--run-id", TUI_RUN,
            "--log-dir", str(work / "logs-tui"), str(load), str(seconds)]
    tmux("new-session", "-d", "-s", "gpu", "-x", "160", "-y", "48", "-c", str(work), "exec " + shlex.join(argv))
    try:
        for size, (cols, rows) in (("160x48", (160, 48)), ("80x24", (80, 24))):
            if size != "160x48":
                tmux("resize-window", "-t", "gpu", "-x", str(cols), "-y", str(rows))
            screen = wait_for(lambda shown=GPU0_HELD if cols >= 160 else GPU0_NARROW:
                              len(shown.findall(s := tmux("capture-pane", "-p", "-t", "gpu"))) >= RANKS and s,
                              timeout=seconds + 30, step=0.5)
            last = screen or tmux("capture-pane", "-p", "-t", "gpu")
            (out / f"gpu-tui-{size}.txt").write_text(last)
            checks.report(f"tui {size}", bool(screen), "gpu 0 in every pane's title" if screen
                          else f"not in both titles; the screen is in {out / f'gpu-tui-{size}.txt'}")
        ended = wait_for(lambda: "gpu" not in tmux("list-sessions", "-F", "#{session_name}"), timeout=seconds + 60)
        checks.report("tui leaves at the end", bool(ended), "--exit-on-end left" if ended else "still on screen")
    finally:
        tmux("kill-server")  # a TUI still up only detaches (its run goes on): stop the run too
        subprocess.run([*ranktop_cli(), "stop", TUI_RUN], cwd=work, capture_output=True, timeout=60)
    no_orphans(checks, "tui", str(load))


def check_svg(checks: Checks, work: Path, load: Path, seconds: float, out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from screenshots import shoot, until

    async def scene(app, pilot) -> None:
        await until(pilot, lambda: ranks_on_gpu0(app.engine.snapshot()), timeout=seconds + 30)
        await pilot.pause(1.2)  # one more sample, so cpu% and utilisation are steady figures

    try:
        svg = shoot("real-gpu", RANKS, (str(seconds),), scene, out, str(work / "logs-svg"), script=str(load))
        checks.report("svg", True, str(svg))
    except TimeoutError:
        checks.report("svg", False, "the ranks were not matched to gpu0 in time")
    no_orphans(checks, "svg", str(load))


def main(argv: list[str] | None = None) -> int:
    # timeout(1) (bench/gpu_host.sh) ends a step with SIGTERM: raised here as SystemExit, so that the
    # finally blocks still close this script's tmux server and stop the run inside it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="where the captures and the SVG go (default: here)")
    parser.add_argument("--seconds", type=float, default=25.0, help="how long each rank works (default 25)")
    parser.add_argument("--only", action="append", choices=("nvml", "match", "tui", "svg"), help="repeatable")
    ns = parser.parse_args(argv)
    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="ranktop-gpu-check-") as tmp:
        work = Path(tmp)
        load = work / "cuda_load.py"
        load.write_text(LOAD)
        for name in ns.only or ("nvml", "match", "tui", "svg"):
            if name == "nvml":
                check_nvml(checks, work)
            elif name == "match":
                check_match(checks, work, load, ns.seconds)
            elif name == "tui":
                check_tui(checks, work, load, ns.seconds, out)
            else:
                check_svg(checks, work, load, ns.seconds, out)
    print("all checks passed" if not checks.failed else f"failed: {', '.join(checks.failed)}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
