"""Earlier attempts' output: the engine keeps only the running attempt's lines, so a rank's output
from an attempt before a group restart is read back from its log files (`attempt_<k>/<local
rank>/stdout.log` and `stderr.log` under the run directory) for the pane's attempt switcher.
"""

from __future__ import annotations

import os
import re

from ranktop.core.layout import tail_lines_below
from ranktop.core.output import RING_BYTES

_ATTEMPT = re.compile(r"attempt_(\d+)(?:\.(\d+))?$")


def attempt_dirs(run_dir: str | None) -> list[str]:
    """The run's attempt directories, oldest first (attempt_0, attempt_1, attempt_1.1, ...)."""
    if not run_dir:
        return []
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    found = [(m, name) for name in names if (m := _ATTEMPT.match(name))]
    found.sort(key=lambda pair: (int(pair[0].group(1)), int(pair[0].group(2) or 0)))
    return [os.path.join(run_dir, name) for _m, name in found]


class FileFeed:
    """One rank's logs of a finished attempt, in the shape a LogView polls (version, since, maxlen):
    stdout's lines, then stderr's under a marker (the files do not keep their interleaving)."""

    def __init__(self, attempt_dir: str, local_rank: int, maxlen: int) -> None:
        run_dir, self.name = os.path.split(attempt_dir)
        self.maxlen, self.max_bytes = maxlen, RING_BYTES
        half = RING_BYTES // 2
        out = tail_lines_below(run_dir, [self.name, str(local_rank), "stdout.log"], half)
        err = tail_lines_below(run_dir, [self.name, str(local_rank), "stderr.log"], half)
        lines = out + ([f"──── {self.name} stderr.log ────".encode(), *err] if err else [])
        self.lines = lines[-maxlen:] or [f"({self.name}: no output in its log files)".encode()]
        self.version = 0

    def since(self, seen: int) -> tuple[int, int, list[bytes], list[bytes]]:
        return self.version, len(self.lines), self.lines[seen:], []
