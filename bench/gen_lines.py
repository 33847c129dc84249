"""Load for the TUI benchmark: one rank printing training-log-like lines at a steady rate (or as
fast as it can), then optionally lingering so its pane stays up.

    python gen_lines.py --lines 20000 --rate 1000 [--rank R] [--linger S]

Lines are deterministic (`line(rank, i)`), so the benchmark can check the log files byte for byte.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

BATCH_SECONDS = 0.01  # write what is due every 10 ms: 10 lines a batch at 1000 lines/s


def line(rank: int, i: int) -> bytes:
    loss = 2.5 / (1 + i * 1e-3)
    return (f"[rank {rank}] step {i:>7} loss {loss:.5f} lr 3.0e-04 grad_norm {1 + (i % 97) / 97:.3f} "
            f"tok/s {41000 + (i * 37) % 900}\n").encode()


def expected(rank: int, lines: int) -> bytes:
    return b"".join(line(rank, i) for i in range(lines))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lines", type=int, required=True)
    p.add_argument("--rate", type=float, default=0, help="lines per second; 0 = as fast as possible")
    p.add_argument("--rank", type=int, default=None, help="default: $RANK")
    p.add_argument("--linger", type=float, default=0, help="seconds to stay alive after the last line")
    a = p.parse_args()
    rank = a.rank if a.rank is not None else int(os.environ.get("RANK", "0"))
    out = sys.stdout.buffer
    start, i = time.monotonic(), 0
    while i < a.lines:
        due = a.lines if not a.rate else min(a.lines, int((time.monotonic() - start) * a.rate) + 1)
        if due > i:
            stop = min(due, i + 5000)
            out.write(b"".join(line(rank, k) for k in range(i, stop)))
            out.flush()
            i = stop
        else:
            time.sleep(BATCH_SECONDS)
    time.sleep(a.linger)


if __name__ == "__main__":
    main()
