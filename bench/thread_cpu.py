"""Per-thread CPU of a running process (ranktop, say) over a window, as % of one core and in CPU
seconds (to the clock tick, 10 ms), with the Python thread names py-spy reports. Run by hand
beside a load:

    python bench/thread_cpu.py PID [SECONDS]
    python bench/thread_cpu.py --run -- COMMAND...   # its whole life, e.g. a headless ranktop

With --run the command is started here (its output goes where ours goes) and its threads are
sampled every 10 ms until it exits (the report goes to stderr); each thread's last sample is reported, in CPU seconds and as a
share of the command's wall time (a thread that ends between samples loses at most 10 ms).

Reads /proc/PID/task/*/stat at both ends of the window; the names come from `py-spy dump`
(ptrace: run as the same user, or root), and are left blank when py-spy cannot attach.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

# py-spy beside the interpreter running this (a virtual environment's bin/), else from PATH
_BESIDE = os.path.join(os.path.dirname(sys.executable), "py-spy")
PY_SPY = _BESIDE if os.path.exists(_BESIDE) else "py-spy"

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
        dump = subprocess.run([PY_SPY, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(tid): name for tid, name in re.findall(r'Thread (\d+) \(\w+\): "([^"]+)"', dump)}


def run_whole(cmd: list[str]) -> int:
    start = time.monotonic()
    proc = subprocess.Popen(cmd)
    last: dict[int, float] = {}
    names: dict[int, str] = {}
    while proc.poll() is None:
        try:
            last.update(thread_seconds(proc.pid))
        except OSError:
            break  # gone between poll and read
        if not names and time.monotonic() - start > 0.5:  # its threads are up by now
            names = thread_names(proc.pid)
        time.sleep(0.01)
    proc.wait()
    wall = time.monotonic() - start
    for tid, used in sorted(last.items()):
        print(f"{tid:>8} {names.get(tid, ''):<20} {used:7.3f} s {100 * used / wall:5.1f}%", file=sys.stderr)
    print(f"{'':>8} {'total':<20} {sum(last.values()):7.3f} s over {wall:.2f} s wall (exit {proc.returncode})",
          file=sys.stderr)
    return 0


def main() -> int:
    if sys.argv[1:2] in (["-h"], ["--help"]):  # (it was a ValueError: taken for a pid)
        print(__doc__)
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--run":
        return run_whole(sys.argv[3:] if sys.argv[2] == "--" else sys.argv[2:])
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
        seconds = used - before.get(tid, 0.0)
        total += seconds
        print(f"{tid:>8} {names.get(tid, ''):<20} {100 * seconds / wall:5.1f}% {seconds:6.2f} s")
    print(f"{'':>8} {'total':<20} {100 * total / wall:5.1f}% {total:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
