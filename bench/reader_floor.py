"""The least CPU any reader of bench_launch's writes job can spend in Python: 8 ranks x N short
lines, read in rounds every 5 ms from 1 MiB pipes, one loop that does nothing else. Three
levels, each adding what ranktop must do: only read; read and write the log files; read, write
the logs and prefix every line for the console (written to /dev/null). What ranktop's output
thread costs beyond the last is its own bookkeeping (ring, events, the rest).

    python bench/reader_floor.py [--lines 400000] [--runs 5]

Run by hand; prints the median CPU seconds of the reader (its getrusage over the loop) per level.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_launch import NPROC, WRITER  # noqa: E402

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
LEVELS = ("read", "logs", "logs+tee")


def reader_cpu(script: str, lines: int, base: str, level: str) -> float:
    """CPU seconds of one reader loop over the whole job at `level`."""
    null = os.open(os.devnull, os.O_WRONLY)
    ranks, pipes = [], {}
    for rank in range(NPROC):
        read_end, write_end = os.pipe()
        fcntl.fcntl(write_end, _F_SETPIPE_SZ, 1 << 20)
        ranks.append(subprocess.Popen([sys.executable, script, str(lines), base, str(rank)], stdout=write_end))
        os.close(write_end)
        os.set_blocking(read_end, False)
        log = os.open(os.path.join(base, f"{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        pipes[read_end] = (log, b"[default%d]:" % rank)
    buffer = memoryview(bytearray(1 << 20))
    before = resource.getrusage(resource.RUSAGE_SELF)
    while pipes:
        for fd, (log, prefix) in list(pipes.items()):
            try:
                count = os.readv(fd, [buffer])
            except BlockingIOError:
                continue
            if not count:
                os.close(fd)
                os.close(log)
                del pipes[fd]
                continue
            data = buffer[:count].tobytes()
            if level != "read":
                os.write(log, data)
            if level == "logs+tee":
                os.write(null, prefix + data.replace(b"\n", b"\n" + prefix))
        time.sleep(0.005)
    after = resource.getrusage(resource.RUSAGE_SELF)
    for rank in ranks:
        rank.wait()
    os.close(null)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=400_000)
    p.add_argument("--runs", type=int, default=5)
    ns = p.parse_args()
    cpu: dict[str, list[float]] = {level: [] for level in LEVELS}
    with tempfile.TemporaryDirectory(prefix="ranktop-floor-") as base:
        script = os.path.join(base, "writer.py")
        with open(script, "w") as f:
            f.write(WRITER)
        for _ in range(ns.runs):  # in turns, so a drift in the box's speed hits every level alike
            for level in LEVELS:
                cpu[level].append(reader_cpu(script, ns.lines, base, level))
    print(f"{NPROC} x {ns.lines} write-only lines, a reader that does nothing else, medians of {ns.runs} runs:")
    for level, seconds in cpu.items():
        print(f"  {level:9s} {statistics.median(seconds):.3f} s CPU   runs {' '.join(f'{s:.3f}' for s in seconds)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
