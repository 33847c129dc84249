"""What ranktop does before its first rank starts: versions side by side, in turns.

    python bench/bench_first_spawn.py --rounds 21 start=HEAD~3 now=.

Each version is installed as bench_ab.py installs it, and runs `--headless --nproc-per-node N`
of an empty script under a wrapper that stamps the first `Popen` of a rank: the wall and CPU
seconds from the wrapper's first line (the interpreter has started; `subprocess`, which ranktop
needs too, is imported in the count) to that spawn, the modules loaded by then, ranktop's
dataclasses made by then, and whether `dataclasses` itself was loaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ab import build_versions  # noqa: E402

WRAPPER = """\
import sys, time
wall, cpu = time.perf_counter(), time.process_time()
import runpy, subprocess
popen = subprocess.Popen.__init__
def first(self, args, *rest, **kw):
    if wall is not None and isinstance(args, list) and args[-1] == sys.argv[-1]:
        taken = (time.perf_counter() - wall, time.process_time() - cpu)
        made = {v for name, m in list(sys.modules.items()) if name.startswith("ranktop")
                for v in vars(m).values() if isinstance(v, type) and "__dataclass_fields__" in vars(v)}
        print("FIRST", *taken, len(sys.modules), len(made), "dataclasses" in sys.modules, file=sys.stderr, flush=True)
        globals()["wall"] = None
    popen(self, args, *rest, **kw)
subprocess.Popen.__init__ = first
sys.argv[0] = "ranktop"
runpy.run_module("ranktop", run_name="__main__")
"""


def first_spawn(python: str, ranks: int, base: str, script: str) -> list[str]:
    argv = [python, "-P", "-c", WRAPPER, "--headless", "--nproc-per-node", str(ranks),
            "--log-dir", os.path.join(base, "logs"), script]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    res = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, timeout=60, check=True)
    return next(line.split()[1:] for line in res.stderr.splitlines() if line.startswith("FIRST "))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="+", metavar="NAME=REV", help="a git revision, or . for this checkout")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--ranks", type=int, default=8)
    ns = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ranktop-first-spawn-") as base:
        script = os.path.join(base, "trivial.py")
        open(script, "w").close()
        pythons = build_versions(ns.versions, base)
        rows: dict[str, list[list[str]]] = {name: [] for name in pythons}
        for round_no in range(ns.rounds + 1):
            for name, python in pythons.items():
                row = first_spawn(python, ns.ranks, base, script)
                if round_no:  # the first round warms the page cache
                    rows[name].append(row)
    print(f"to the first of {ns.ranks} trivial ranks' spawn, headless, medians of {ns.rounds} rounds in turns:")
    for name, runs in rows.items():
        wall = sorted(float(r[0]) * 1000 for r in runs)
        cpu = sorted(float(r[1]) * 1000 for r in runs)
        modules, made, loaded = runs[-1][2:]
        print(f"  {name:8} wall {statistics.median(wall):5.1f} ms ({wall[0]:.1f}-{wall[-1]:.1f})   CPU "
              f"{statistics.median(cpu):5.1f} ms ({cpu[0]:.1f}-{cpu[-1]:.1f})   {modules} modules, "
              f"{made} dataclasses of ranktop's, dataclasses loaded: {loaded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
