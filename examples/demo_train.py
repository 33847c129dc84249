"""A fake training run for demos: looks like training, needs nothing but Python.

    ranktop --nproc-per-node 4 examples/demo_train.py
    ranktop --nproc-per-node 4 examples/demo_train.py --fail-rank 2     # rank 2 crashes mid-run
    ranktop --nproc-per-node 4 examples/demo_train.py --hang-rank 1     # rank 1 stops talking

Each rank prints a banner, then per step a log line with its loss (about 10 lines a second),
a yellow warning now and then, and a tqdm-like progress bar redrawn with '\\r' on stderr that
only ends its line when the epoch ends. The default run takes about 40 seconds.
Colours follow the usual conventions: NO_COLOR turns them off, FORCE_COLOR (set by ranktop
when it shows colour) or a terminal turns them on.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

try:  # error.json for the root-cause report; the demo still runs without ranktop installed
    from ranktop.core.errors import record
except ImportError:  # pragma: no cover - only outside the repo
    def record(fn):
        return fn


def use_color(mode: str) -> bool:
    if mode != "auto":
        return mode == "always"
    if os.environ.get("NO_COLOR"):
        return False
    return bool(os.environ.get("FORCE_COLOR")) or sys.stdout.isatty()


class Paint:
    """ANSI SGR codes, or nothing at all when colour is off."""

    def __init__(self, on: bool):
        self.on = on

    def __call__(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.on else text

    def ok(self, text: str) -> str:
        return self(text, "32")

    def warn(self, text: str) -> str:
        return self(text, "33")

    def bad(self, text: str) -> str:
        return self(text, "1;31")

    def dim(self, text: str) -> str:
        return self(text, "2")

    def head(self, text: str) -> str:
        return self(text, "1;36")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A fake training run (no torch needed).")
    p.add_argument("--steps", type=int, default=400, help="total steps (default 400, ~40 s)")
    p.add_argument("--epoch-steps", type=int, default=100, help="steps per epoch (default 100)")
    p.add_argument("--rate", type=float, default=10.0, help="steps per second (default 10)")
    p.add_argument("--fail-rank", type=int, default=None, help="this global rank raises an exception")
    p.add_argument("--fail-step", type=int, default=None, help="step at which it fails (default steps/3)")
    p.add_argument("--hang-rank", type=int, default=None, help="this global rank stops making progress")
    p.add_argument("--hang-step", type=int, default=None, help="step at which it hangs (default steps/3)")
    p.add_argument("--slow-rank", type=int, default=None, help="this global rank steps at half the rate")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    return p.parse_args(argv)


def banner(paint: Paint, rank: int, world: int, args: argparse.Namespace) -> None:
    local = os.environ.get("LOCAL_RANK", "0")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(paint.head(f"== demo_train · rank {rank}/{world} (local {local}) · pid {os.getpid()} · attempt {attempt} =="))
    master = f"{os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')}"
    print(paint.dim(f"   master {master} · {args.steps} steps · {args.epoch_steps} per epoch · lr 3e-4"))


def progress_bar(epoch: int, done: int, total: int, rate: float, width: int = 24) -> str:
    filled = int(width * done / total)
    bar = "#" * filled + "." * (width - filled)
    return f"\repoch {epoch} |{bar}| {done}/{total} [{rate:4.1f} it/s]"


def read_next_batch() -> None:
    """Where the hung rank gets stuck: a data loader that never returns (stands out in a stack dump)."""
    while True:
        time.sleep(3600)


def wait_for_peers(deadline: float) -> None:
    """What the healthy ranks do when one rank hangs: block in the 'collective' until stopped."""
    while time.monotonic() < deadline:
        time.sleep(0.5)


def train(args: argparse.Namespace, paint: Paint, rank: int, world: int) -> None:
    rng = random.Random(1234 + rank)
    fail_step = args.fail_step if args.fail_step is not None else args.steps // 3
    hang_step = args.hang_step if args.hang_step is not None else args.steps // 3
    period = 1.0 / args.rate * (1.0 + 0.03 * rank)  # ranks drift apart a little, like real ones
    if rank == args.slow_rank:
        period *= 2  # a straggler (a slow GPU, a busy host): what --metric makes visible
    started = time.monotonic()
    epoch_loss = 0.0
    for step in range(args.steps):
        epoch, in_epoch = step // args.epoch_steps + 1, step % args.epoch_steps + 1
        if rank == args.fail_rank and step == fail_step:
            sys.stderr.write("\n")  # end the progress bar's line before the traceback
            raise RuntimeError(f"loss became NaN at step {step} on rank {rank} (simulated failure)")
        if rank == args.hang_rank and step == hang_step:
            print(paint.warn(f"step {step}: loading next batch ..."), flush=True)
            read_next_batch()
        if args.hang_rank is not None and rank != args.hang_rank and step == hang_step + 1:
            print(paint.dim(f"step {step}: all_reduce: waiting for rank {args.hang_rank}"), flush=True)
            wait_for_peers(time.monotonic() + 3600)
        loss = 2.5 * math.exp(-step / (args.steps / 3)) + 0.05 + rng.gauss(0, 0.03)
        epoch_loss += loss
        status = paint.ok("ok")
        if rng.random() < 0.03:
            status = paint.warn(f"warning: grad norm {rng.uniform(8, 40):.1f} clipped to 5.0")
        print(f"epoch {epoch} step {step:4d} loss {loss:.4f} lr 3.0e-04 {status}", flush=True)
        rate = step / max(time.monotonic() - started, 1e-6)  # over the steps already slept through
        sys.stderr.write(progress_bar(epoch, in_epoch, args.epoch_steps, rate))
        sys.stderr.flush()
        if in_epoch == args.epoch_steps or step == args.steps - 1:
            sys.stderr.write("\n")
            mean = epoch_loss / in_epoch
            print(paint.ok(f"epoch {epoch} done: mean loss {mean:.4f} · val acc {min(0.99, 1 - mean / 3):.3f}"),
                  flush=True)
            epoch_loss = 0.0
        time.sleep(period * rng.uniform(0.8, 1.2))


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    paint = Paint(use_color(args.color))
    banner(paint, rank, world, args)
    try:
        train(args, paint, rank, world)
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        print(paint.warn(f"rank {rank}: interrupted, exiting"), flush=True)
        return 130
    print(paint.ok(f"rank {rank}: training finished"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
