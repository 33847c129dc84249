"""Smallest real collective: every rank all_reduces its own rank number over gloo.

    ranktop --nproc-per-node 4 examples/allreduce.py

Uses the torchrun environment that ranktop sets (MASTER_ADDR/PORT, RANK, WORLD_SIZE).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)  # SUM by default
        expected = float(sum(range(world)))
        print(f"rank {rank}: sum={t.item()} (local_rank {os.environ.get('LOCAL_RANK')}, world {world})", flush=True)
        assert t.item() == expected, f"rank {rank}: got {t.item()}, expected {expected}"
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
