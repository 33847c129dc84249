"""Two versions of ranktop side by side: launch + reap of N trivial ranks, in turns, with a bare
spawn of the same ranks as the reference. For a before/after on a box whose speed drifts.

    python bench/bench_ab.py --rounds 21 before=HEAD~3 after=HEAD     # git revisions
    python bench/bench_ab.py after=.                                  # this checkout as it is
    python bench/bench_ab.py --busy 1000 before=HEAD~3 after=.       # beside 1000 idle processes
    python bench/bench_ab.py --writes 400000 before=HEAD~3 after=.   # the output path's own CPU
    python bench/bench_ab.py --writes 400000 --streams redirects before=HEAD after=.  # no console
    python bench/bench_ab.py --writes 400000 --flood before=HEAD~1 after=.  # beside a flooding client
    python bench/bench_ab.py --writes 400000 --flood --flood-waits before=HEAD~1 after=.  # one that asks and waits

With --writes the ranks write that many short lines each (bench_launch's writes scenario, --tee 3
and log files, the console to /dev/null; --streams redirects: log files only), and what is
compared is ranktop's own CPU seconds for the job (what it and all it reaped used, less what the
ranks report for themselves) as well as the wall time. With --flood each version also runs the
job with a client that asks its engine for snapshots as fast as it can (bench/flood.py): what
that client costs the run's output, and how many answers it got a second; with --flood-waits
that client asks one request at a time, the next as soon as the last is answered.

Each version is built into a venv of its own as `pip install` leaves it (bench/compiled.py), so
neither pays for an editable checkout's finder. Every rank runs this interpreter, whichever
ranktop starts it (PYTHON_EXEC), so the versions differ in ranktop alone. One unmeasured round
first; then each round runs every version and the bare spawn once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_launch import WRITER, fresh_dir, launcher_cpu  # noqa: E402
from compiled import ROOT, installed_python  # noqa: E402
from flood import Flood  # noqa: E402

sys.path.pop(0)  # (ranktop's own process module is what this bench waits with)
from ranktop.core.process import wait_exit  # noqa: E402


def build(name: str, rev: str, base: str) -> str:
    """An installed copy of revision `rev` ("." for the checkout as it is); its Python."""
    source = str(ROOT)
    if rev != ".":
        source = os.path.join(base, f"{name}-src")
        os.makedirs(source)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", source], input=archive, check=True)
    return installed_python(os.path.join(base, name), source)


def build_versions(specs: list[str], base: str) -> dict[str, str]:
    """{name: its installed copy's Python} for each NAME=REV of `specs` (REV "." or none: the checkout)."""
    pythons = {}
    for spec in specs:
        name, _, rev = spec.partition("=")
        pythons[name] = build(name, rev or ".", base)
    return pythons


def run(argv: list[str], env: dict[str, str], count: int = 1) -> float:
    start = time.perf_counter()
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(count)]
    for proc in procs:
        if not wait_exit(proc, 60) or proc.returncode:
            raise RuntimeError(f"{argv[:4]} failed (exit {proc.returncode})")
    return time.perf_counter() - start


def compare_writes(pythons: dict[str, str], ns: argparse.Namespace, base: str) -> None:
    script = os.path.join(base, "writer.py")
    with open(script, "w") as f:
        f.write(WRITER)
    runtime = fresh_dir(base, "runtime")  # the flood finds the run's socket here, and no other run's
    os.chmod(runtime, 0o700)
    os.environ["XDG_RUNTIME_DIR"] = runtime  # (launcher_cpu's ranktop takes this environment)
    cases = [(name, flood) for name in pythons for flood in ((False, True) if ns.flood else (False,))]
    wall: dict[tuple, list[float]] = {case: [] for case in cases}
    cpu: dict[tuple, list[float]] = {case: [] for case in cases}
    answered: dict[tuple, list[float]] = {case: [] for case in cases}
    for round_no in range(ns.rounds + 1):
        for name, flooded in cases:
            logs, cpu_dir = fresh_dir(base, "logs"), fresh_dir(base, "cpu")
            argv = [pythons[name], "-P", "-m", "ranktop", "--headless", "--nproc-per-node", str(ns.ranks),
                    f"--{ns.streams}", "3", "--log-dir", logs, "--run-id", "ab", script, str(ns.writes), cpu_dir]
            flood = Flood(os.path.join(runtime, "ranktop", "ab.sock"), ns.flood_waits).start() if flooded else None
            try:
                elapsed, own = launcher_cpu(argv, cpu_dir)
            finally:
                if flood is not None:
                    flood.stop()
            if round_no:
                wall[name, flooded].append(elapsed)
                cpu[name, flooded].append(own)
                if flood is not None:
                    answered[name, flooded].append(flood.answers / max(flood.seconds, 1e-9))
    print(f"{ns.ranks} ranks x {ns.writes} write-only lines, --{ns.streams} 3 + logs, medians of {ns.rounds} rounds in turns:")
    for case in cases:
        label = f"{case[0]}{' +flood' if case[1] else ''}"
        asked = f"   flood answered {statistics.median(answered[case]):.0f}/s" if case[1] else ""
        print(f"  {label:16s} own CPU {statistics.median(cpu[case]):.3f} s   wall {statistics.median(wall[case]):.3f} s"
              f"   ({ns.ranks * ns.writes / statistics.median(wall[case]) / 1e6:.2f} M lines/s){asked}"
              f"   walls {' '.join(f'{v:.3f}' for v in wall[case])}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="+", metavar="NAME=REV", help="a git revision, or . for this checkout")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="N idle processes (sleep) on the box meanwhile, as on a busy host: the process "
                        "table every run reads at its end is that much longer")
    p.add_argument("--streams", choices=("tee", "redirects"), default="tee",
                   help="with --writes: --tee 3 (console and logs, the default) or --redirects 3 (logs only, "
                        "as a detached run or a TUI reads: the ring counts the lines itself)")
    p.add_argument("--writes", type=int, default=0, metavar="LINES",
                   help="compare the output path instead: each rank writes LINES short lines")
    p.add_argument("--flood", action="store_true",
                   help="with --writes: also run each version beside a client that floods its engine with requests")
    p.add_argument("--flood-waits", action="store_true",
                   help="with --flood: the client asks one request at a time, the next as soon as the last is answered")
    ns = p.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHON_EXEC"] = sys.executable
    with tempfile.TemporaryDirectory(prefix="ranktop-ab-") as base:
        script = os.path.join(base, "trivial.py")
        open(script, "w").close()
        pythons = build_versions(ns.versions, base)
        if ns.writes:
            compare_writes(pythons, ns, base)
            return 0
        contenders = {name: (lambda py=py: run([py, "-P", "-m", "ranktop", "--headless", "--nproc-per-node",
                                                 str(ns.ranks), "--log-dir", os.path.join(base, "logs"), script], env))
                      for name, py in pythons.items()}
        contenders["bare"] = lambda: run([sys.executable, "-u", script], env, count=ns.ranks)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        idle = [subprocess.Popen(["sleep", "3600"]) for _ in range(ns.busy)]
        try:
            for round_no in range(ns.rounds + 1):
                for name, once in contenders.items():
                    elapsed = once()
                    if round_no:
                        times[name].append(elapsed)
        finally:
            for proc in idle:
                proc.kill()
                proc.wait()
    bare = statistics.median(times["bare"])
    busy = f", beside {ns.busy} idle processes" if ns.busy else ""
    print(f"{ns.ranks} trivial ranks, launch + reap, medians of {ns.rounds} rounds in turns{busy}:")
    for name, values in times.items():
        median = statistics.median(values)
        gap = "" if name == "bare" else f"  (+{median - bare:.3f} s vs bare)"
        print(f"  {name:10s} {median:.3f} s{gap}   runs {' '.join(f'{v:.3f}' for v in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
