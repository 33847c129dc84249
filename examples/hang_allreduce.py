"""A hung gloo job to practise on: ranks 0-2 wait in all_reduce, rank 3 never gets its batch.

    ranktop --nproc-per-node 4 --stall-timeout 5 examples/hang_allreduce.py

After a few steps rank 3's prefetch thread stops delivering and its main thread blocks in
`load_batch` on the queue; everyone else is left waiting for it in `dist.all_reduce`. Press `D`
(all ranks) in the TUI, or run `ranktop stacks <run dir>` in another terminal: rank 3 is the odd
one out. `t` (`--threads`) shows why: rank 3's prefetch thread, marked and first, is stuck in
`fetch_from_storage`; enter zooms rank 3's pane. HANG_RANK and HANG_STEP change who hangs and when.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import torch
import torch.distributed as dist

HANG_RANK = int(os.environ.get("HANG_RANK", "3"))
HANG_STEP = int(os.environ.get("HANG_STEP", "3"))


def fetch_from_storage(step: int, rank: int) -> torch.Tensor:
    if rank == HANG_RANK and step >= HANG_STEP:
        time.sleep(24 * 3600)  # a storage read that never returns
    return torch.full((4,), float(step))


def prefetch(batches: queue.Queue, rank: int) -> None:
    step = 0
    while True:
        batches.put(fetch_from_storage(step, rank))
        step += 1


def load_batch(batches: queue.Queue) -> torch.Tensor:
    return batches.get()  # rank HANG_RANK blocks here once its prefetch thread is stuck


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches: queue.Queue = queue.Queue(maxsize=2)
    threading.Thread(target=prefetch, args=(batches, rank), name="prefetch", daemon=True).start()
    for step in range(1000):
        batch = load_batch(batches)
        dist.all_reduce(batch)
        print(f"rank {rank}: step {step} sum {batch[0].item():.0f}", flush=True)
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
