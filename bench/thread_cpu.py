"""Per-thread CPU of a running process (ranktop, say), as % of one core over a window, with the
Python thread names py-spy reports. Run by hand beside a load:

    python bench/thread_cpu.py PID [SECONDS]

Reads /proc/PID/task/*/stat at both ends of the window; the names come from `py-spy dump`
(ptrace: run as the same user, or root), and are left blank when py-spy cannot attach.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time


def thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of each thread of pid."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def thread_names(pid: int) -> dict[int, str]:
    try:
        dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(tid): name for tid, name in re.findall(r'Thread (\d+) \(\w+\): "([^"]+)"', dump)}


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    pid, seconds = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    before, start = thread_seconds(pid), time.monotonic()
    time.sleep(seconds)
    after, wall = thread_seconds(pid), time.monotonic() - start
    names = thread_names(pid)
    total = 0.0
    for tid, used in sorted(after.items()):
        share = 100 * (used - before.get(tid, 0.0)) / wall
        total += share
        print(f"{tid:>8} {names.get(tid, ''):<20} {share:5.1f}%")
    print(f"{'':>8} {'total':<20} {total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
