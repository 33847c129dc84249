"""Finding a running group's ranks from outside (`ranktop stacks PID|DIR`)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Mapping

import psutil
from ranktop.core.errors import ERROR_FILE_ENV
from ranktop.core.events import events_in, open_events_file, run_started
from ranktop.core.layout import EVENTS, MAX_RUNS_OPENED, newest_entries, run_dir_of_error_file
from ranktop.core.limits import raise_fd_limit
from ranktop.core.protocol import is_whole
from ranktop.core.stacks.procs import HeldProcess, close_all, environ, gone_reason


def _count(value: object) -> int | None:
    """`value` if it is a whole number, 0 or more (a rank, a pid, an attempt), else None."""
    return value if is_whole(value) and value >= 0 else None


class RanksNotHeld(Exception):
    """A rank's process that could not be held (a pidfd) to be checked and dumped; says why."""


class ForeignRanks(Exception):
    """A run directory's events.jsonl names a live process of another user than the file's own:
    whoever wrote the file may name only their own processes to dump or signal."""


def live_ranks_in_run_dir(run_dir: str) -> tuple[dict[int, int], dict[int, int], dict[int, HeldProcess]]:
    """({rank: pid}, {rank: local_rank}, {rank: its process, held}) of the latest attempt's ranks
    that still run; the caller closes what is held. An event with a field of the wrong kind
    counts as not written. ForeignRanks when one of them is not the own process of the user
    whose events.jsonl names it (see dump_refusal): a directory is anyone's to write, and root's
    `ranktop stacks` of it would ptrace (or SIGUSR1) whichever process its owner chose. Each is
    checked once held, so a pid that another process took since is not dumped in its name."""
    fd = open_events_file(os.path.join(run_dir, EVENTS))
    if fd is None:
        return {}, {}, {}
    try:
        owner = os.fstat(fd).st_uid
        pids, local = _live_ranks(events_in(fd))
    finally:
        os.close(fd)
    raise_fd_limit()  # a pidfd for each rank
    held = _held_and_checked(pids, owner)
    for rank in [rank for rank, process in held.items() if not process.alive()]:  # gone since: no rank to dump
        held.pop(rank).close()
    return {r: pids[r] for r in held}, {r: local[r] for r in held}, held


def _held_and_checked(pids: dict[int, int], owner: int) -> dict[int, HeldProcess]:
    """{rank: its process, held} of those of `pids` that still run, each checked once held
    (dump_refusal): ForeignRanks, nothing held, for the first that is not uid `owner`'s to dump."""
    held: dict[int, HeldProcess] = {}
    try:
        for rank, pid in sorted(pids.items()):
            with contextlib.suppress(ProcessLookupError):
                held[rank] = _hold(rank, pid)
            # (what was read of a pid whose process then exited may be another's: that one is gone)
            if rank in held and (why := dump_refusal(pid, owner)) is not None and held[rank].alive():
                raise ForeignRanks(f"its events.jsonl is uid {owner}'s and names rank {rank}, pid {pid}, {why}")
    except BaseException:
        close_all(held)
        raise
    return held


def _hold(rank: int, pid: int) -> HeldProcess:
    """Rank `rank`'s process, held; RanksNotHeld where it cannot be (out of file descriptors:
    thousands of ranks, or an events.jsonl naming as many)."""
    try:
        return HeldProcess(pid)
    except ProcessLookupError:
        raise
    except OSError as exc:
        if exc.errno in NOT_A_PROCESS:
            raise RanksNotHeld(f"rank {rank}, pid {pid}, is a thread's id, not a process's: nothing dumped") from None
        advice = ("raise the open-files limit (ulimit -n) or name one rank's pid"
                  if exc.errno in (errno.EMFILE, errno.ENFILE) else "name one rank's pid")
        raise RanksNotHeld(f"rank {rank}, pid {pid}, cannot be held from its check to its dump "
                           f"({exc.strerror}): nothing dumped; {advice}") from None


# pidfd_open's answer for a thread that leads no process (an events.jsonl may name any id): EINVAL,
# ENOENT on later kernels.
NOT_A_PROCESS = (errno.EINVAL, errno.ENOENT)


def dump_refusal(pid: int, owner: int) -> str | None:
    """Why `pid` is not uid `owner`'s own to dump, or None: the kernel lets a user trace only a
    process whose real, effective and saved uids are all theirs (not a setuid program that set
    its euid aside for a while), whose gids are all one (not a setgid program) and that is
    dumpable (not one that asked prctl(PR_SET_DUMPABLE, 0), nor one that changed its ids); root
    must not trace any other for them. None too once it is gone."""
    try:
        process = psutil.Process(pid)
        uids, gids = {*process.uids()}, tuple(process.gids())
        dumpable = os.stat(f"/proc/{pid}/status").st_uid == owner  # (the kernel gives root the files of one that is not)
    except (psutil.Error, OSError):
        return None
    if uids != {owner}:
        return f"which runs as uid {'/'.join(map(str, sorted(uids)))}: only uid {owner}'s processes are dumped from it"
    if len(set(gids)) > 1:
        return (f"whose real, effective and saved gids differ ({'/'.join(map(str, gids))}: a setgid program): "
                "it is not dumped")
    if not dumpable:
        return "which is not dumpable (prctl PR_SET_DUMPABLE 0, or it changed its ids): it is not dumped"
    return None


def _live_ranks(events: Iterable[dict]) -> tuple[dict[int, int], dict[int, int]]:
    run_id, latest, starts, exited = None, -1, {}, set()
    for e in events:
        if e.get("event") == "run_started" and run_id is None and isinstance(e.get("run_id"), str):
            run_id = e["run_id"]
        elif e.get("event") == "started":
            attempt, pid = _count(e.get("attempt", 0)), _count(e.get("pid"))
            rank, local = _count(e.get("rank")), _count(e.get("local_rank"))
            if None in (attempt, rank, local) or not pid or attempt < latest:
                continue  # pid 0 would signal our own process group
            if attempt > latest:
                latest, starts = attempt, {}
            starts[rank] = (pid, local)
        elif e.get("event") == "exited" and _count(e.get("pid")):
            exited.add(e["pid"])
    live = {r: (p, local) for r, (p, local) in starts.items() if p not in exited and _is_our_rank(p, run_id)}
    return {r: p for r, (p, _) in live.items()}, {r: local for r, (_, local) in live.items()}


def _is_our_rank(pid: int, run_id: str | None) -> bool:
    """Alive, and (when we may read its environment) really that run's rank, not a reused pid nor
    a process an events.jsonl without its run_started names."""
    if run_id is None or gone_reason(pid):
        return False
    try:
        env = psutil.Process(pid).environ()
    except psutil.AccessDenied:
        return True
    except psutil.Error:
        return False
    return env.get("TORCHELASTIC_RUN_ID") == run_id


def find_run_dir(path: str) -> str | None:
    """`path` if it is a run directory, else (a log root) the newest of its run directories
    with live ranks, else its newest. Only the MAX_RUNS_OPENED whose events were written last are
    read, as `newest_ended_runs` bounds its look: each read is an events.jsonl to its end, and a
    root used for months holds thousands of ended runs, all read when none was live."""
    if os.path.isfile(os.path.join(path, EVENTS)):
        return path
    runs = _written_last(path, MAX_RUNS_OPENED)
    return next((d for d in runs if _has_live_ranks(d)), runs[0] if runs else None)


def _has_live_ranks(run_dir: str) -> bool:
    try:
        pids, _, held = live_ranks_in_run_dir(run_dir)
    except ForeignRanks:  # not its owner's to name: passed over (said when it is named itself)
        return False
    except RanksNotHeld:  # live, only too many to hold: chosen, and the dump says why it cannot be
        return True
    close_all(held)
    return bool(pids)


def _written_last(root: str, count: int) -> list[str]:
    """The `count` run directories of `root` whose events.jsonl was written last, newest first,
    among its first MAX_ROOT_ENTRIES entries."""
    try:
        names = newest_entries(root, count, lambda entry: _events_written(os.path.join(root, entry.name)))
    except OSError:
        return []
    return [os.path.join(root, name) for name in names]


def _events_written(run_dir: str) -> float | None:
    """When `run_dir`'s events.jsonl was last written; None if it is no regular file, or no longer
    there (a run directory removed while we look: the log root may be shared)."""
    try:
        st = os.stat(os.path.join(run_dir, EVENTS))
    except OSError:
        return None
    return st.st_mtime if stat.S_ISREG(st.st_mode) else None


def ranks_of_pid(pid: int) -> tuple[dict[int, int], dict[int, int], str | None]:
    """A rank pid -> that rank; a ranktop pid (or the TUI's holder of one) -> its rank children.
    ({rank: pid}, {rank: local}, run_dir).

    Only direct children count as ranks: a rank's own children (data loader workers) inherit
    RANK too but are not ranks.
    """
    proc = psutil.Process(pid)
    env = environ(proc)
    if (ranks := _ranks_in(env)) is not None:
        return {ranks[0]: pid}, {ranks[0]: ranks[1]}, _run_dir_from_env(env, proc.ppid())
    found = _rank_children(proc)
    if not found[0]:
        # The TUI's ranktop forks so that q can detach: the pid the shell knows only holds the
        # terminal, and the ranks are its child's, a copy of it (the same command line).
        for child in proc.children():
            if _same_command(child, proc) and (found := _rank_children(child))[0]:
                break
    return found


def _same_command(a: psutil.Process, b: psutil.Process) -> bool:
    try:
        return a.cmdline() == b.cmdline()
    except psutil.Error:  # gone meanwhile, or not ours to read
        return False


def _rank_children(proc: psutil.Process) -> tuple[dict[int, int], dict[int, int], str | None]:
    pids, local, run_dir = {}, {}, None
    for child in proc.children():
        cenv = environ(child)
        if (ranks := _ranks_in(cenv)) is not None and not gone_reason(child.pid):
            pids[ranks[0]], local[ranks[0]] = child.pid, ranks[1]
            run_dir = run_dir or _run_dir_from_env(cenv, proc.pid)
    return pids, local, run_dir


def _ranks_in(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(RANK, LOCAL_RANK) of a rank's environment; None unless both are numbers (a process can
    rewrite what /proc shows of its environment)."""
    rank, local = (env.get(name, "") for name in ("RANK", "LOCAL_RANK"))
    return (int(rank), int(local)) if all(v.isdecimal() and len(v) < 10 for v in (rank, local)) else None


def _run_dir_from_env(env: Mapping[str, str], launcher_pid: int) -> str | None:
    """The run directory a rank's environment names, if the ranktop that started that run is
    `launcher_pid` (the rank's parent). Anyone can start a process whose environment names some
    other run's directory: the dump must not be saved there."""
    path = env.get(ERROR_FILE_ENV)
    if not path:
        return None
    run_dir = run_dir_of_error_file(path)
    first = run_started(run_dir)
    if first is None or first.get("pid") != launcher_pid:
        return None
    return run_dir
