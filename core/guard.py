"""The orphan guard: a tiny watcher process that outlives ranktop by a moment.

Each rank runs in a session of its own, so nothing the kernel does on ranktop's death reaches it,
and PR_SET_PDEATHSIG would only cover the rank itself, not what the rank started. So ranktop
starts this guard with a pipe on its stdin and tells it every rank's process group. When that pipe
reaches end of file (ranktop exited, normally or by SIGKILL), the guard signals those groups and
every process that still carries the run's marker variable in its environment (grandchildren that
left the group with setsid keep it), waits the grace period, then SIGKILLs what is left.

Runs as `python -I guard.py TOKEN GRACE` and imports only the standard library, so it starts fast.
"""

from __future__ import annotations

import os
import signal
import sys
import time

MARKER = "RANKTOP_GUARD_TOKEN"


def marked_pids(token: str) -> set[int]:
    """Live processes whose environment holds MARKER=token (those we may read)."""
    needle = f"{MARKER}={token}\0".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    found.add(int(entry))
        except OSError:
            continue
    found.discard(os.getpid())
    return found


def _signal_all(pgids: set[int], pids: set[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _alive(pgids: set[int], token: str) -> tuple[set[int], set[int]]:
    live_groups = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            live_groups.add(pgid)
        except OSError:
            pass
    return live_groups, marked_pids(token)


def sweep(token: str, pgids: set[int], grace: float) -> None:
    groups, pids = _alive(pgids, token)
    if not groups and not pids:
        return
    _signal_all(groups, pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        groups, pids = _alive(groups, token)
        if not groups and not pids:
            return
        time.sleep(0.02)
    _signal_all(groups, pids, signal.SIGKILL)


def main() -> None:
    token, grace = sys.argv[1], float(sys.argv[2])
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only end of file on stdin ends us
    pgids: set[int] = set()
    normal_exit = False
    for line in sys.stdin.buffer:
        word = line.strip()
        if word == b"done":
            normal_exit = True
        elif word.startswith(b"+"):
            pgids.add(int(word[1:]))
        elif word.startswith(b"-"):
            pgids.discard(int(word[1:]))
    # After a normal exit ranktop has reaped its ranks already; only strays can be left.
    sweep(token, pgids, 0.5 if normal_exit else grace)


if __name__ == "__main__":
    main()
