"""The engine's memory over many fast group restarts. Run by hand:

    python bench/bench_restarts.py [--restarts 300] [--ranks 8] [--every 50] [--stall-timeout S]
                                   [--installed [SOURCE]] [--rounds N]

ranktop headless runs ranks that exit 1 at once (`--no-python false`) with `--max-restarts N`, so
the group restarts N times as fast as it can; each time ranktop says it restarts the group (a
line on its stderr), this reads its RSS (VmRSS of /proc/PID/status) and prints it every
`--every` restarts, then the growth from the first restart to the last. With --stall-timeout the
stats sampler runs too (headless samples stats only with one). Several --rounds print one line
each: run the versions to compare in turns.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compiled import add_installed_option, compile_ranktop, ranktop_python  # noqa: E402

_RESTART = re.compile(rb"restarting the group: attempt_(\d+)")


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def one_run(python: list[str], args: argparse.Namespace, logs: str) -> dict[int, int]:
    """attempt -> the engine's RSS in KiB as it said it restarts into that attempt."""
    cmd = [*python, "-m", "ranktop", "--headless", "--nproc-per-node", str(args.ranks),
           "--max-restarts", str(args.restarts), "--log-dir", logs]
    if args.stall_timeout is not None:
        cmd += ["--stall-timeout", str(args.stall_timeout)]
    cmd += ["--no-python", "false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    samples = {}
    assert proc.stderr is not None
    for line in proc.stderr:
        match = _RESTART.search(line)
        if match is not None and (rss := rss_kib(proc.pid)) is not None:
            samples[int(match.group(1))] = rss
    proc.wait()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stall-timeout", type=float, default=None)
    add_installed_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ranktop-bench-restarts-") as tmp:
        if args.installed is None:
            compile_ranktop()
        python = ranktop_python(os.path.join(tmp, "venv"), args.installed)
        for _ in range(args.rounds):
            logs = tempfile.mkdtemp(dir=tmp)
            samples = one_run(python, args, logs)
            if not samples:
                print("no restart seen")
                continue
            shown = [f"{k}: {samples[k] / 1024:.1f}" for k in sorted(samples) if k == 1 or k % args.every == 0]
            first, last = samples[min(samples)], samples[max(samples)]
            print(f"RSS MB at attempt  {'  '.join(shown)}  growth {(last - first) / 1024:+.1f} MB")
            sys.stdout.flush()
            subprocess.run(["rm", "-rf", logs], check=False)


if __name__ == "__main__":
    main()
