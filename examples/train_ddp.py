"""A real (tiny) CPU DDP training run over gloo: a linear model learning y = 3x + 1.

    ranktop --nproc-per-node 2 examples/train_ddp.py --steps 20

Reads the torchrun environment that ranktop sets (MASTER_ADDR/PORT, RANK, WORLD_SIZE). Wrapped
with torch's @record so a crash leaves an error.json that ranktop's root-cause report shows.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    return p.parse_args()


def train(args: argparse.Namespace, rank: int, world: int) -> None:
    torch.manual_seed(0)  # same initial weights everywhere; DDP also broadcasts rank 0's
    model = DDP(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    data_gen = torch.Generator().manual_seed(1000 + rank)  # each rank sees its own shard
    for step in range(args.steps):
        x = torch.randn(args.batch, 1, generator=data_gen)
        loss = torch.nn.functional.mse_loss(model(x), 3 * x + 1)
        opt.zero_grad()
        loss.backward()  # DDP all_reduces the gradients here
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        print(f"rank {rank} step {step:3d} loss {loss.item():.4f} mean {mean.item():.4f}", flush=True)
    w, b = model.module.weight.item(), model.module.bias.item()
    print(f"rank {rank} done: w={w:.3f} b={b:.3f}", flush=True)


@record
def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}/{world} on {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
          f"(restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})", flush=True)
    try:
        train(args, rank, world)
        # DDP's model and reducer sit in reference cycles: free them while the process group is
        # still up, not at interpreter exit, where tearing them down can abort the rank.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
