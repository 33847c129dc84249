"""events.jsonl: what happened in a run, one JSON object a line. The one writer of that file."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class EventLog:
    """Appends events to an events.jsonl opened for appending (see core/layout.py), from any
    thread. Each line is a single write to an O_APPEND descriptor, so lines written at the same
    time by this process and by another one (`ranktop stacks`) never mix."""

    def __init__(self, fd: int):
        self._fd = fd
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ts": round(time.time(), 6), "event": event, **fields}, default=str) + "\n"
        with self._lock:
            if self._fd >= 0:
                os.write(self._fd, line.encode())

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
