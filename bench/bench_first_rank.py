"""How soon the ranks start, run by hand: from a launcher's exec to its first rank running.

    python bench/bench_first_rank.py                 # 8 ranks, 9 rounds in turns
    python bench/bench_first_rank.py --installed     # ranktop as `pip install` leaves it
    python bench/bench_first_rank.py --ranks 2 --rounds 15 --no-torchrun

Launchers, each round in turns: ranktop headless, ranktop's TUI (in a tmux terminal of this
script's own), torchrun (when torch imports), and a bare spawn of the same ranks from sh. Each
is started as `sh -c 'date +%s.%N > t0; exec LAUNCHER ...'` and each rank is
`sh -c 'date +%s.%N > t_$RANK'`, so every launcher pays the same for the clocks. The figure is the
earliest rank's stamp less t0: what a launcher makes its ranks wait before they can begin.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from compiled import add_installed_option, compile_ranktop, ranktop_python  # noqa: E402

SOCKET = "ranktop-bench-first"  # our own tmux server: other tmux sessions are left alone
RANK = "date +%s.%N > {dir}/t_$RANK"


def launcher_argv(name: str, ranks: int, out: Path, ranktop: list[str]) -> str:
    """The shell command that starts `name`'s ranks, t0 stamped just before its exec."""
    rank = RANK.format(dir=out)
    logs = ["--log-dir", str(out / "logs")]
    if name == "bare":
        body = " ".join(f"RANK={r} sh -c {shlex.quote(rank)} &" for r in range(ranks)) + " wait"
        return f"date +%s.%N > {out}/t0; {body}"
    if name == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--no-python",
                "sh", "-c", rank]
    else:
        mode = ["--headless"] if name == "headless" else ["--tui", "--exit-on-end"]
        argv = [*ranktop, *mode, "--nproc-per-node", str(ranks), *logs, "--no-python", "sh", "-c", rank]
    return f"date +%s.%N > {out}/t0; exec {shlex.join(argv)}"


def first_rank(name: str, ranks: int, out: Path, ranktop: list[str]) -> float:
    """Seconds from t0 to the earliest rank's stamp, once the launcher has ended."""
    out.mkdir()
    command = launcher_argv(name, ranks, out, ranktop)
    if name == "tui":  # a real terminal: the TUI refuses to start without one
        done = out / "done"
        tmux("new-session", "-d", "-s", out.name, "-x", "160", "-y", "48", f"sh -c {shlex.quote(command)}; touch {done}")
        deadline = time.monotonic() + 60
        while not done.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: not done within 60 s")
            time.sleep(0.02)
    else:
        subprocess.run(["sh", "-c", command], check=True, timeout=60, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    stamps = [float(p.read_text()) for p in out.glob("t_*")]
    if len(stamps) != ranks:
        raise RuntimeError(f"{name}: {len(stamps)} of {ranks} ranks ran")
    return min(stamps) - float((out / "t0").read_text())


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, *args], check=True, capture_output=True, text=True).stdout


def main() -> int:
    # timeout(1) ends a bench with SIGTERM: raised as SystemExit, so the tmux server is closed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9, help="measured rounds (one unmeasured round first)")
    p.add_argument("--no-torchrun", action="store_true", help="skip torchrun even when torch is installed")
    add_installed_option(p)
    ns = p.parse_args()
    compile_ranktop()
    root = Path(tempfile.mkdtemp(prefix="ranktop-bench-first-"))
    ranktop = [sys.executable, "-m", "ranktop"]
    if ns.installed:
        ranktop = [*ranktop_python(str(root / "installed"), ns.installed), "-m", "ranktop"]
    names = ["headless", "tui", "bare"]
    if shutil.which("tmux") is None:
        names.remove("tui")
        print("bench_first_rank: no tmux: the TUI is left out", file=sys.stderr)
    if not ns.no_torchrun and importlib.util.find_spec("torch") is not None:
        names.insert(2, "torchrun")
    times: dict[str, list[float]] = {n: [] for n in names}
    try:
        for k in range(ns.rounds + 1):
            for name in names:  # in turns: the box's speed drifts
                took = first_rank(name, ns.ranks, root / f"{name}-{k}", ranktop)
                if k:  # the first round warms the page cache
                    times[name].append(took)
    finally:
        subprocess.run(["tmux", "-L", SOCKET, "kill-server"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    bare = statistics.median(times["bare"])
    print(f"first of {ns.ranks} ranks running, from the launcher's exec; medians of {ns.rounds} rounds in turns:")
    for name, took in times.items():
        versus = "" if name == "bare" else f"  (+{(statistics.median(took) - bare) * 1000:.0f} ms vs bare)"
        print(f"  {name:9} {statistics.median(took) * 1000:6.0f} ms{versus}   runs "
              + " ".join(f"{t * 1000:.0f}" for t in took))
    return 0


if __name__ == "__main__":
    sys.exit(main())
