"""Free pages in the middle of the heap go back to the system when asked (core/heap.py): what a
packing of the rings' output, or NVML's initialisation, frees would otherwise stay in the RSS.

The blocks are freed and trimmed in a fresh interpreter: in a test worker that has run hundreds
of tests, the heap's earlier holes and arenas decide where the blocks land (CI once saw a 540 MB
worker give back 19 MB of the 60), which says nothing about the trim."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ranktop.core.heap import _malloc_trim

FREE_AND_TRIM = """
import sys
from ranktop.core.heap import give_back_free_memory

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

kept, freed = [], []
for _ in range(600):  # 60 MB in blocks below malloc's mmap threshold, each before one that stays
    freed.append(bytearray(100_000))
    kept.append(bytearray(2_000))
del freed
before = rss()
if sys.argv[1] == "trim":
    give_back_free_memory()
print(before - rss(), len(kept))
"""


def given_back(how: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", FREE_AND_TRIM, how], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    freed, kept = map(int, run.stdout.split())
    assert kept == 600
    return freed


@pytest.mark.skipif(_malloc_trim() is None, reason="not glibc: nothing to trim with")
def test_blocks_freed_between_blocks_kept_go_back_to_the_system():
    assert given_back("trim") > 30 << 20
    assert given_back("no trim") < 10 << 20  # what the trim is for: free() alone keeps them
