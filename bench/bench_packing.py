"""What packing a ring's waiting output costs (core/packing.py), per kind of output, beside zlib's
fastest level on the same 64 KiB blocks with no look at the head first (the reference):

    python bench/bench_packing.py [--mb 8] [--repeats 5]

Per kind: MB of output packed per second of one core, and the share of its bytes it is kept in
(1.00: left as it came). The packer's worst case is the slowest of these times the output that
stays in the rings a few of its looks (README, *Scrollback at rest*).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_lines import line  # noqa: E402
from ranktop.core.packing import pack  # noqa: E402

BLOCK = 64 << 10  # what the ring gathers small reads into


def kinds(size: int) -> dict[str, bytes]:
    log = b"".join(line(3, i) for i in range(size // 70 + 1))[:size]
    return {"training log": log, "hex dump": os.urandom(size // 2).hex().encode(), "random bytes": os.urandom(size)}


def rate(blocks: list[bytes], work, repeats: int) -> tuple[float, float]:
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        kept = sum(work(b) for b in blocks)
        best = min(best, time.thread_time() - started)
    total = sum(map(len, blocks))
    return total / best / 1e6, kept / total


def packed_size(block: bytes) -> int:
    done = pack(block)
    return len(block) if done is None else done.stored


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    print(f"{'output':<14} {'packed MB/s':>12} {'kept in':>8} {'zlib MB/s':>10} {'zlib kept':>10}")
    for name, data in kinds(a.mb << 20).items():
        blocks = [data[i : i + BLOCK] for i in range(0, len(data), BLOCK)]
        ours, kept = rate(blocks, packed_size, a.repeats)
        ref, ref_kept = rate(blocks, lambda b: len(zlib.compress(b, 1)), a.repeats)
        print(f"{name:<14} {ours:>12.0f} {kept:>8.2f} {ref:>10.0f} {ref_kept:>10.2f}")


if __name__ == "__main__":
    main()
