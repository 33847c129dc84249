"""Stack dump benchmark: time from "dump" to the grouped view for 8 ranks (target: at most 0.3 s).

    python bench/bench_stacks.py            # 8 ranks, 9 repeats
    python bench/bench_stacks.py -n 16 -r 5
    python bench/bench_stacks.py --torch    # ranks that imported torch (bigger processes; slow to start)

Each rank is a real Python process under LocalAgent, blocked in a function three frames deep
with a second thread, one rank elsewhere (so grouping has work to do). Two figures:
  engine  dump_pids() + format_report(): py-spy on every rank at once, grouping, the text view
  agent   dump_agent_stacks() + format_report(): the same plus the snapshot, saving the .txt/.json
          under the run dir and the stacks_dumped event (what the TUI's D key and the CLI do)
Also one sequential run (one py-spy after the other) for comparison. Medians after one warm-up.
Run by hand, not by the tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import threading
import time

from compiled import compile_ranktop
from ranktop.core import stacks
from ranktop.core.agent import LocalAgent
from ranktop.core.spec import WorkerSpec

TARGET_S = 0.3

RANK = """
import os, threading, time
{imports}
def background():
    while True:
        time.sleep(1)

def wait_collective():
    time.sleep(3600)

def step():
    if os.environ["RANK"] == "1":
        return load_batch()
    return wait_collective()

def load_batch():
    time.sleep(3600)

threading.Thread(target=background, name="background", daemon=True).start()
print("ready", flush=True)
step()
"""


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up: page cache, py-spy's first start
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--nproc", type=int, default=8)
    p.add_argument("-r", "--repeats", type=int, default=9)
    p.add_argument("--torch", action="store_true", help="ranks import torch first")
    ns = p.parse_args()
    compile_ranktop()

    code = textwrap.dedent(RANK.format(imports="import torch" if ns.torch else ""))
    spec = WorkerSpec(role="default", local_world_size=ns.nproc, entrypoint=sys.executable, args=("-u", "-c", code))
    with tempfile.TemporaryDirectory(prefix="ranktop-bench-stacks-") as logs:
        agent = LocalAgent(spec, log_dir=logs, console=False, shutdown_timeout=2)
        runner = threading.Thread(target=agent.run)
        runner.start()
        try:
            agent.wait_started(10)
            deadline = time.monotonic() + 300
            while not all(any(b"ready" in line for line in agent.output(r)) for r in range(ns.nproc)):
                if time.monotonic() > deadline:
                    print("ranks did not get ready", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            pids = {r.rank: r.pid for r in agent.snapshot().ranks}
            check = stacks.dump_pids(pids)
            assert not check.problems and check.odd_ranks == [1], stacks.format_report(check)

            engine, _ = median_time(lambda: stacks.format_report(stacks.dump_pids(pids)), ns.repeats)
            full, _ = median_time(lambda: stacks.format_report(stacks.dump_agent_stacks(agent)), ns.repeats)
            t = time.perf_counter()
            for rank, pid in pids.items():
                stacks.dump_pid(pid, rank)
            sequential = time.perf_counter() - t
        finally:
            agent.stop(grace=1)
            runner.join(30)

    kind = "torch" if ns.torch else "python"
    print(f"stacks of {ns.nproc} {kind} ranks, median of {ns.repeats} (cpus: {os.cpu_count()}, "
          f"py-spy: {stacks.find_py_spy()})")
    print(f"  engine (dump_pids + format_report)         {engine:.3f} s   target <= {TARGET_S} s  "
          f"{'OK' if engine <= TARGET_S else 'MISSED'}")
    print(f"  agent  (dump_agent_stacks, saved + event)  {full:.3f} s   target <= {TARGET_S} s  "
          f"{'OK' if full <= TARGET_S else 'MISSED'}")
    print(f"  for comparison: one py-spy after another   {sequential:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
