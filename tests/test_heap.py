"""Free pages in the middle of the heap go back to the system when asked (core/heap.py): what a
packing of the rings' output, or NVML's initialisation, frees would otherwise stay in the RSS."""

from __future__ import annotations

import pytest
from ranktop.core.heap import _malloc_trim, give_back_free_memory


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(_malloc_trim() is None, reason="not glibc: nothing to trim with")
def test_blocks_freed_between_blocks_kept_go_back_to_the_system():
    kept, freed = [], []
    for _ in range(600):  # 60 MB in blocks below malloc's mmap threshold, each before one that stays
        freed.append(bytearray(100_000))
        kept.append(bytearray(2_000))
    del freed
    before = rss()
    give_back_free_memory()
    assert before - rss() > 30 << 20, (before, rss())
    assert len(kept) == 600
