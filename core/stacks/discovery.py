"""Finding a running group's ranks from outside (`ranktop stacks PID|DIR`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import psutil
from ranktop.core.errors import ERROR_FILE_ENV
from ranktop.core.layout import EVENTS, run_dir_of_error_file
from ranktop.core.stacks.procs import environ, gone_reason


def _read_events(path: str) -> list[dict]:
    events = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a line being written right now
    return events


def live_ranks_in_run_dir(run_dir: str) -> tuple[dict[int, int], dict[int, int]]:
    """({rank: pid}, {rank: local_rank}) of the latest attempt's ranks that still run."""
    events = _read_events(os.path.join(run_dir, EVENTS))
    run_id = next((e.get("run_id") for e in events if e.get("event") == "run_started"), None)
    latest = max((e.get("attempt", 0) for e in events if e.get("event") == "started"), default=None)
    pids, local, exited = {}, {}, set()
    for e in events:
        if e.get("event") == "started" and e.get("attempt", 0) == latest:
            pids[e["rank"]], local[e["rank"]] = e["pid"], e["local_rank"]
        elif e.get("event") == "exited":
            exited.add(e.get("pid"))
    live = {r: p for r, p in pids.items() if p not in exited and _is_our_rank(p, run_id)}
    return live, {r: local[r] for r in live}


def _is_our_rank(pid: int, run_id: str | None) -> bool:
    """Alive, and (when we may read its environment) really that run's rank, not a reused pid."""
    if gone_reason(pid):
        return False
    try:
        env = psutil.Process(pid).environ()
    except psutil.AccessDenied:
        return True
    except psutil.Error:
        return False
    return run_id is None or env.get("TORCHELASTIC_RUN_ID") == run_id


def find_run_dir(path: str) -> str | None:
    """`path` if it is a run directory, else its newest run directory with live ranks (a log root)."""
    if os.path.isfile(os.path.join(path, EVENTS)):
        return path
    try:
        runs = [os.path.join(path, d) for d in os.listdir(path)]
    except OSError:
        return None
    runs = [d for d in runs if os.path.isfile(os.path.join(d, EVENTS))]
    runs.sort(key=lambda d: os.path.getmtime(os.path.join(d, EVENTS)), reverse=True)
    return next((d for d in runs if live_ranks_in_run_dir(d)[0]), runs[0] if runs else None)


def ranks_of_pid(pid: int) -> tuple[dict[int, int], dict[int, int], str | None]:
    """A rank pid -> that rank; a ranktop pid -> its rank children. ({rank: pid}, {rank: local}, run_dir).

    Only direct children count as ranks: a rank's own children (data loader workers) inherit
    RANK too but are not ranks.
    """
    proc = psutil.Process(pid)
    env = environ(proc)
    if "RANK" in env and "LOCAL_RANK" in env:
        rank = int(env["RANK"])
        return {rank: pid}, {rank: int(env["LOCAL_RANK"])}, _run_dir_from_env(env)
    pids, local, run_dir = {}, {}, None
    for child in proc.children():
        cenv = environ(child)
        if "RANK" in cenv and "LOCAL_RANK" in cenv and not gone_reason(child.pid):
            pids[int(cenv["RANK"])], local[int(cenv["RANK"])] = child.pid, int(cenv["LOCAL_RANK"])
            run_dir = run_dir or _run_dir_from_env(cenv)
    return pids, local, run_dir


def _run_dir_from_env(env: Mapping[str, str]) -> str | None:
    path = env.get(ERROR_FILE_ENV)
    if not path:
        return None
    run_dir = run_dir_of_error_file(path)
    return run_dir if os.path.isfile(os.path.join(run_dir, EVENTS)) else None
