"""The stats sampler's tick beside a busy process table. Run by hand:

    python bench/bench_stats_tick.py [--extra 0,2000] [--ranks 8] [--threads 1] [--ticks 20]
                                     [--rounds 2] NAME=SOURCE ...

SOURCE is a checkout (`.` for this one): each is installed in a venv of its own
(`compiled.installed_python`). For each number of extra processes (idle `sleep`s started here, in
a process group of their own, and killed at the end) and each round, each version in turn runs
`--ranks` ranks (`sleep`, or a Python with `--threads` threads asleep and one child `sleep`) under
a StatsSampler fed by a stand-in for the engine, and times `tick()` with `time.thread_time`,
ticks 0.5 s apart as the sampler's own thread would find /proc (cold): the median in ms.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compiled import installed_python  # noqa: E402

_RANK = """
import subprocess, sys, threading, time
for _ in range(int(sys.argv[1]) - 1):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
subprocess.Popen(["sleep", "600"])  # a child: the tree is walked below the rank
print("up", flush=True)
time.sleep(600)
"""

_TIMER = """
import os, statistics, subprocess, sys, time
from ranktop.core.stats import StatsSampler
ranks, threads, ticks, rank_code = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if threads:
    procs = [subprocess.Popen([sys.executable, "-c", rank_code, str(threads)], stdout=subprocess.PIPE,
                              start_new_session=True) for _ in range(ranks)]
    for p in procs:
        p.stdout.readline()
else:
    procs = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(ranks)]
class Source:
    def rank_processes(self):
        return {r: (p.pid, {}) for r, p in enumerate(procs)}
sampler = StatsSampler(interval=0.5)
sampler._agent = Source()
times = []
try:
    for _ in range(ticks + 1):
        began = time.thread_time()
        sampler.tick()
        times.append(time.thread_time() - began)
        time.sleep(0.5)
    assert all(sampler.latest(r) is not None for r in range(ranks)), "a rank was not sampled"
    nprocs = sampler.latest(0).nprocs
finally:
    for p in procs:
        os.killpg(p.pid, 9)
        p.wait()
print(f"{statistics.median(times[1:]) * 1000:.2f} ms (tree of rank 0: {nprocs} processes)")
"""


def start_extra(count: int) -> subprocess.Popen | None:
    """`count` idle processes in a group of their own: one shell that starts them and waits."""
    if not count:
        return None
    script = f"for i in $(seq {count}); do sleep 600 & done; echo up; wait"
    shell = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    assert shell.stdout is not None
    shell.stdout.readline()
    return shell


def stop_extra(shell: subprocess.Popen | None) -> None:
    if shell is not None:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+", metavar="NAME=SOURCE")
    parser.add_argument("--extra", default="0,2000", help="extra idle processes, comma-separated levels")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="ranks as Pythons with this many threads (0: sleep)")
    parser.add_argument("--ticks", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ranktop-bench-stats-") as tmp:
        pythons = {}
        for version in args.versions:
            name, source = version.split("=", 1)
            pythons[name] = installed_python(os.path.join(tmp, name), source)
        for extra in (int(level) for level in args.extra.split(",")):
            shell = start_extra(extra)
            try:
                for _ in range(args.rounds):
                    for name, python in pythons.items():
                        out = subprocess.run([python, "-P", "-c", _TIMER, str(args.ranks), str(args.threads),
                                              str(args.ticks), _RANK], capture_output=True, text=True, check=True)
                        print(f"extra {extra:5d}  {name:8s} tick {out.stdout.strip()}", flush=True)
            finally:
                stop_extra(shell)


if __name__ == "__main__":
    main()
