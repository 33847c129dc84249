"""Earlier attempts' output: the engine keeps only the running attempt's lines, so a rank's output
from an attempt before a group restart is read back from its log files (`attempt_<k>/<local
rank>/stdout.log` and `stderr.log` under the run directory) for the pane's attempt switcher.
"""

from __future__ import annotations

import os
import re

from ranktop.core.layout import tail_lines_below
from ranktop.core.output import RING_BYTES, RanktopLine, as_shown

_ATTEMPT = re.compile(r"attempt_(\d{1,9})(?:\.(\d{1,9}))?")


def attempt_dirs(run_dir: str | None, newest: int | None = None) -> list[str]:
    """The run's attempt directories, oldest first (attempt_0, attempt_1, attempt_1.1, ...), up
    to attempt `newest` (the engine's own: a rank may make an attempt_9 in the run directory).
    Only real directories: a symlink in their place is not one of ours."""
    if not run_dir:
        return []
    try:
        entries = list(os.scandir(run_dir))
    except OSError:
        return []
    found = [(m, entry.name) for entry in entries
             if (m := _ATTEMPT.fullmatch(entry.name)) and _real_dir(entry)
             and (newest is None or int(m.group(1)) <= newest)]
    found.sort(key=lambda pair: (int(pair[0].group(1)), int(pair[0].group(2) or 0)))
    return [os.path.join(run_dir, name) for _m, name in found]


def _real_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


class FileFeed:
    """One rank's logs of a finished attempt, in the shape a LogView polls (version, since, maxlen):
    stdout's lines, then stderr's under a marker (the files do not keep their interleaving)."""

    def __init__(self, attempt_dir: str, local_rank: int, maxlen: int) -> None:
        run_dir, self.name = os.path.split(attempt_dir)
        self.maxlen, self.max_bytes = maxlen, RING_BYTES
        half = RING_BYTES // 2
        out = tail_lines_below(run_dir, [self.name, str(local_rank), "stdout.log"], half)
        err = tail_lines_below(run_dir, [self.name, str(local_rank), "stderr.log"], half)
        # A progress bar redrawn with '\r' shows as its last state, as the live pane showed it
        # (the file keeps every redraw), and a line is cut where the ring cuts it.
        out, err = [as_shown(line) for line in out], [as_shown(line) for line in err]
        # The marker and the note are ranktop's own lines: the pane draws them as no rank line can be.
        lines = out + ([RanktopLine(f"──── {self.name} stderr.log ────".encode()), *err] if err else [])
        self.lines = lines[-maxlen:] or [RanktopLine(f"({self.name}: no output in its log files)".encode())]
        self.version = 0

    def since(self, seen: int) -> tuple[int, int, list[bytes], list[bytes]]:
        return self.version, len(self.lines), self.lines[seen:], []

