"""What a TUI's rings hold once its ranks have gone quiet: run ranktop's TUI through this script,
and some seconds into the TUI's process (a fork of the one started) it appends one line to
$RINGS_OUT: the rings, their lines made into Python objects, the chunks still waiting (and how
many wait packed, core/packing.py), the bytes of output they keep and the memory that takes, its RSS.

    RINGS_OUT=FILE [RINGS_AFTER=4] python bench/rings_probe.py --tui --nproc-per-node 64 \\
        bench/gen_lines.py --lines 10000 --rate 0 --linger 9        # in a terminal (tmux)

With 64 quiet ranks of 10k lines, only the shown pane's 10k lines should be made (9b8f5eb and after);
before, every snapshot's look for a prompt made all 640k.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time


def look() -> None:
    time.sleep(float(os.environ.get("RINGS_AFTER", "4")))
    gc.unfreeze()  # ranktop freezes what its start-up made, and get_objects leaves the frozen out
    rings = [o for o in gc.get_objects() if type(o).__name__ == "LineRing"]
    views = []
    for ring in rings:  # (each read under its lock: the reader and the packer change them)
        with ring._lock:
            views.append((len(ring.lines), [chunk for _, chunk, _ in ring._chunks]))
    made = sum(lines for lines, _ in views)
    waiting = sum(len(chunks) for _, chunks in views)
    packed = sum(type(c).__name__ == "PackedChunk" for _, chunks in views for c in chunks)  # (since the 29th session)
    held = sum(r.held_bytes for r in rings) / 2**20
    stored = sum(getattr(r, "stored_bytes", r.held_bytes) for r in rings) / 2**20
    rss = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS"))
    with open(os.environ["RINGS_OUT"], "a") as f:
        f.write(f"python {sys.version.split()[0]}: {len(rings)} rings, {made} lines made, {waiting} chunks "
                f"waiting ({packed} packed), {held:.1f} MB of output kept in {stored:.1f} MB, RSS {int(rss) // 1024} MB\n")


if __name__ == "__main__":
    os.register_at_fork(after_in_child=lambda: threading.Thread(target=look, daemon=True).start())
    from ranktop.tui.cli import main

    sys.exit(main(sys.argv[1:]))
