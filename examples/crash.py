"""One rank crashes, the others wait: shows failure handling, the root-cause report and restarts.

    ranktop --nproc-per-node 4 examples/crash.py                     # rank 1 raises ValueError
    ranktop --nproc-per-node 4 examples/crash.py --rank 3            # rank 3 instead (or CRASH_RANK=3)
    ranktop --nproc-per-node 4 --max-restarts 1 examples/crash.py --first-attempt-only
                                                                     # crashes once, attempt 1 succeeds

The failing rank prints a few lines first and raises from a function wrapped with `record`, so
its error.json holds the traceback. The others sleep until they are stopped (SIGTERM from the
launcher when the crash stops the group), or finish after a few lines when nothing crashes (a
restart with --first-attempt-only, or a --rank the group does not have).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

try:
    from ranktop.core.errors import record
except ImportError:  # pragma: no cover - only outside the repo
    def record(fn):
        return fn


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="One rank raises ValueError; the others wait to be stopped.")
    p.add_argument("--rank", type=int, default=int(os.environ.get("CRASH_RANK", "1")),
                   help="global rank that crashes (default $CRASH_RANK or 1)")
    p.add_argument("--lines", type=int, default=3, help="lines the crashing rank prints first")
    p.add_argument("--sleep", type=float, default=300.0, help="how long the other ranks wait (s)")
    p.add_argument("--first-attempt-only", action="store_true",
                   help="crash only when TORCHELASTIC_RESTART_COUNT is 0, so a restart succeeds")
    return p.parse_args()


@record
def main() -> int:
    args = parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A --rank the group does not have crashes nowhere: waiting for a crash would be 300 s of nothing.
    crashes = 0 <= args.rank < world and not (args.first_attempt_only and attempt > 0)
    print(f"rank {rank}: attempt {attempt}, pid {os.getpid()}", flush=True)
    if crashes and rank == args.rank:
        for i in range(args.lines):
            print(f"rank {rank}: working ({i + 1}/{args.lines})", flush=True)
            time.sleep(0.05)
        raise ValueError(f"rank {rank} hit a bad batch (attempt {attempt})")
    if not crashes:
        nowhere = "" if 0 <= args.rank < world else f" (no rank {args.rank}: the ranks are 0..{world - 1})"
        print(f"rank {rank}: attempt {attempt} runs clean{nowhere}, done", flush=True)
        return 0
    print(f"rank {rank}: waiting up to {args.sleep:.0f}s", flush=True)
    time.sleep(args.sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
