"""A hang with its culprit in a thread other than the main one (examples/hang_allreduce.py without
torch): every rank's `prefetch` thread feeds its main thread batches; rank STUCK's never returns
from its storage read, so its main thread waits in `load_batch` while the others wait in
`all_reduce` (for it), their prefetch threads blocked on a full queue. Ranks other than STUCK
also run a `writer` thread, which STUCK lacks. It prints `ready` once each thread waits where
the dump is to find it."""

from __future__ import annotations

import os
import queue
import threading
import time

STUCK = int(os.environ.get("STUCK_RANK", "2"))
RANK = int(os.environ["RANK"])
never = threading.Event()  # what a stuck call waits on


def fetch_from_storage(step: int) -> int:
    if RANK == STUCK:
        never.wait()  # a storage read that never returns
    return step


def prefetch(batches: queue.Queue) -> None:
    step = 0
    while True:
        batches.put(fetch_from_storage(step))
        step += 1


def write_logs() -> None:
    never.wait()


def load_batch(batches: queue.Queue) -> int:
    return batches.get()


def all_reduce() -> None:
    never.wait()  # the collective that waits for rank STUCK


def waiting(condition: threading.Condition) -> None:
    """Until a thread waits on `condition` (its own waiters list: no sleep-and-hope)."""
    while not condition._waiters:  # type: ignore[attr-defined]
        time.sleep(0.005)


batches: queue.Queue = queue.Queue(maxsize=1)
threading.Thread(target=prefetch, args=(batches,), name="prefetch", daemon=True).start()
if RANK == STUCK:
    waiting(never._cond)  # type: ignore[attr-defined]
    print("ready", flush=True)
    load_batch(batches)
else:
    threading.Thread(target=write_logs, name="writer", daemon=True).start()
    waiting(batches.not_full)
    waiting(never._cond)  # type: ignore[attr-defined]
    print("ready", flush=True)
    all_reduce()
