"""Attach benchmark, run by hand: a real headless run of 8 ranks at 1000 lines/s each, served on
its socket, and real `ranktop attach` clients in tmux (real terminals).

    python bench/bench_attach.py                 # about a minute
    python bench/bench_attach.py --window 20     # longer CPU windows, steadier figures
    python bench/bench_attach.py --installed     # ranktop as `pip install` leaves it, not this checkout

1. First frame: from starting `ranktop attach`, once the run has printed for `--history` seconds
   (by default enough to fill every rank's 10k-line ring), to the first screen that shows a line of every
   rank (tmux capture-pane every 20 ms), beside the same for a fresh local `ranktop --tui` of the
   same job (its reference: a TUI that owns its engine). Target 0.5 s.
2. Engine CPU per client: the headless engine's own CPU (user+system of that one process, not
   its ranks) over a window with 0, 1 and 4 clients attached; the extra per client as % of one
   core. Target at most 3 %.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from compiled import add_installed_option, compile_ranktop, ranktop_python

ROOT = Path(__file__).resolve().parent.parent
SOCKET = "ranktop-bench-attach"  # our own tmux server: other sessions are left alone
RANKS, RATE = 8, 1000
RANK_SCRIPT = """\
import os, sys, time
rank, rate = os.environ["RANK"], {rate}
start, n = time.monotonic(), 0
while True:
    n += 1
    sys.stdout.write(f"r{{rank}} line {{n}}\\n")
    sys.stdout.flush()
    ahead = n / rate - (time.monotonic() - start)
    if ahead > 0:
        time.sleep(ahead)
"""


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, *args], capture_output=True, text=True).stdout


def shows_every_rank(session: str) -> bool:
    screen = tmux("capture-pane", "-p", "-t", session)
    return all(f"r{r} line" in screen for r in range(RANKS))


def time_to_every_rank(session: str, command: str, timeout: float = 30.0) -> float:
    start = time.monotonic()
    tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "48", command)
    while time.monotonic() - start < timeout:
        if shows_every_rank(session):
            return time.monotonic() - start
        time.sleep(0.02)
    raise SystemExit(f"{session}: no frame showed every rank within {timeout:g} s")


def engine_cpu(pid: int, window: float) -> float:
    """% of one core the engine process used over `window` seconds."""
    proc = psutil.Process(pid)
    before, start = proc.cpu_times(), time.monotonic()
    time.sleep(window)
    after, took = proc.cpu_times(), time.monotonic() - start
    return 100.0 * ((after.user + after.system) - (before.user + before.system)) / took


def main() -> None:
    # timeout(1) (bench/gpu_host.sh) ends a step with SIGTERM: raised here as SystemExit, so that the
    # finally blocks still close this script's tmux server and stop the run inside it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=10.0, help="seconds per CPU measurement (default 10)")
    ap.add_argument("--repeats", type=int, default=5, help="attaches timed (default 5)")
    ap.add_argument("--history", type=float, default=12.0,
                    help="seconds the run prints before the first attach (default 12: every rank's 10k-line ring is full)")
    add_installed_option(ap)
    ns = ap.parse_args()
    compile_ranktop()
    work = Path(tempfile.mkdtemp(prefix="ranktop-bench-attach-"))
    python = ranktop_python(str(work / "installed"), ns.installed)
    runtime = work / "runtime"
    runtime.mkdir(mode=0o700)
    script = work / "writer.py"
    script.write_text(RANK_SCRIPT.format(rate=RATE))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    py = shlex.join(python)

    def stop_local() -> None:
        # Closing its terminal only detaches a local run (it goes on in the background): stop it.
        tmux("kill-session", "-t", "local")
        subprocess.run([*python, "-m", "ranktop", "stop", "local"], cwd=ROOT, env=env, capture_output=True)

    envs = f"XDG_RUNTIME_DIR={shlex.quote(str(runtime))}"
    job = f"--nproc-per-node {RANKS} --log-dir {shlex.quote(str(work / 'logs'))}"
    engine = subprocess.Popen([*python, "-m", "ranktop", "--headless", *job.split(), "--run-id", "bench",
                               str(script)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not (runtime / "ranktop" / "bench.sock").exists():
            if time.monotonic() > deadline:
                raise SystemExit("the run was never served")
            time.sleep(0.05)
        time.sleep(ns.history)  # attach to a run that has printed a while, as one does
        local = time_to_every_rank("local", f"cd {ROOT} && {envs} {py} -m ranktop --tui {job} --run-id local "
                                            f"{shlex.quote(str(script))}")
        stop_local()
        attaches = []
        for k in range(ns.repeats):
            attaches.append(time_to_every_rank(f"a{k}", f"cd {ROOT} && {envs} {py} -m ranktop attach bench"))
            tmux("kill-session", "-t", f"a{k}")
            time.sleep(0.5)
        attaches.sort()
        print(f"first frame showing all {RANKS} ranks   attach {statistics.median(attaches):.2f} s "
              f"(median of {ns.repeats}, {attaches[0]:.2f}-{attaches[-1]:.2f}: {' '.join(f'{a:.2f}' for a in attaches)})   "
              f"(local --tui of the same job {local:.2f} s; target 0.5 s)")
        time.sleep(1.0)
        idle = engine_cpu(engine.pid, ns.window)
        figures = [f"0 clients {idle:.1f}%"]
        for clients in (1, 4):
            for k in range(clients):
                time_to_every_rank(f"c{clients}-{k}", f"cd {ROOT} && {envs} {py} -m ranktop attach bench")
            used = engine_cpu(engine.pid, ns.window)
            figures.append(f"{clients} client(s) {used:.1f}% (+{(used - idle) / clients:.1f}% each)")
            for k in range(clients):
                tmux("kill-session", "-t", f"c{clients}-{k}")
            time.sleep(1.0)
        print(f"engine CPU, {RANKS} ranks x {RATE} lines/s, % of one core over {ns.window:g} s: "
              + "   ".join(figures) + "   (target: at most +3% per client)")
    finally:
        stop_local()  # also when the local TUI never showed every rank
        tmux("kill-server")
        engine.terminate()
        engine.wait(30)


if __name__ == "__main__":
    main()
