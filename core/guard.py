"""The orphan guard, a tiny watcher process that outlives ranktop by a moment, and the reading of
the process table that it shares with ranktop.

Each rank runs in a session of its own, so nothing the kernel does on ranktop's death reaches it,
and PR_SET_PDEATHSIG would only cover the rank itself, not what the rank started. So ranktop
starts this guard with a pipe on its stdin and tells it, while it runs:

    run TOKEN GRACE   first: the run's marker value and the grace between SIGTERM and SIGKILL
    spawning          a rank is being started (its `rank` line follows once it runs)
    rank PID START    a rank started; it leads its own session and process group
    gone PID          that rank was reaped, and ranktop took note of what was left in its
                      group and session (as `stray` lines)
    stray PID START   a process that left its rank's group: a helper that called setsid or
                      setpgid and was orphaned (ranktop, their subreaper, adopted it), or one
                      left behind when its rank ended
    tmp HEXPATH       the run's own directory under $TMPDIR where function ranks' arguments
                      and results travel as pickles (its path's bytes in hex: a path may hold
                      spaces); removed once the sweep is over
    done              ranktop is ending normally and has swept its strays itself

When the pipe reaches end of file (ranktop exited, normally or by SIGKILL), the guard sweeps:
every process in a live rank's group or session, every stray it was told about, every process
that still carries the run's marker variable, and everything below any of these in the parent
chain (a helper that cleared its environment and called setsid while its rank lives). Each gets
SIGTERM (and SIGCONT, should it be stopped), then SIGKILL after the grace. A rank ranktop was
starting as it died is not yet any of these: in a session of its own already, it closed its copy
of our pipe before its exec, which gives it the marker; after `spawning` without its `rank` line
the guard looks for the marker again until that exec is done (SPAWN_SETTLE_SECONDS at most).
Then it removes the `tmp` directories: a caller killed (or ended by an exception it never
caught) before close() left them, the pickled arguments of its ranks in them, in $TMPDIR for
good. A process is known by its pid AND its start time, and signalled through a pidfd opened
after checking both, so a pid reused by someone else is never signalled.

Runs as `python -I -S -c "...; import guard; guard.main()"` and imports only the standard library
(not even typing), so it starts fast: imported rather than run as a script, it starts from its
cached bytecode instead of compiling this file each time. ranktop imports the table helpers from
here so the two agree on what a stray is.

A guard learns its run from its first line, so ranktop can start one before it knows the run
(`prestart`): its interpreter then starts beside ranktop's own imports rather than beside the
ranks'. Without the `run` line (ranktop gave up first) it exits at end of file and touches nothing.
"""

from __future__ import annotations

import os
import sys
import time

try:  # the C half of `signal`: the same calls on plain ints, without the enums (~5 ms of start-up)
    import _signal as signal
except ImportError:  # (an interpreter without it)
    import signal

TYPE_CHECKING = False  # typing's flag without typing, whose import is ~15 ms of the guard's start-up
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Iterable  # (collections: ~2 ms more)

MARKER = "RANKTOP_GUARD_TOKEN"
RESCAN_SECONDS = 0.05  # how often a sweep looks for what is left (and for new forks)
GIVE_UP_SECONDS = 5.0  # after SIGKILL: a process in uninterruptible sleep may never go
SPAWN_SETTLE_SECONDS = 1.0  # how long a rank ranktop died starting is looked for (its exec takes ~1 ms)


class Proc:
    """One line of the process table: /proc/PID/stat's ids and start time (clock ticks since boot)."""

    __slots__ = ("pid", "ppid", "pgid", "sid", "start", "zombie")

    def __init__(self, pid: int, ppid: int, pgid: int, sid: int, start: int, zombie: bool) -> None:
        self.pid, self.ppid, self.pgid, self.sid, self.start, self.zombie = pid, ppid, pgid, sid, start, zombie


def status_fields(path: str, names: tuple[str, ...]) -> dict[str, str]:
    """The fields `names` of a /proc status file (`SigCgt`, `TracerPid`, `CapEff`) that it holds,
    as text; OSError where it cannot be read (the process is gone)."""
    return {name: value.strip() for name, value in
            (line.split(":", 1) for line in read_proc_file(path).decode(errors="replace").splitlines()
             if line.startswith(names)) if name in names}


def read_proc_file(path: str) -> bytes:
    """The whole of a /proc file. A process table is read at every end of a run, file by file:
    plain descriptors cost ~40% less than file objects there."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 1 << 16)
        if len(data) < 1 << 16:
            return data
        # A long environment: megabytes (a quarter of the stack limit), which any user's process
        # may have and the stray sweep reads. Joined once: adding each piece to the rest copied
        # it all again (5.6 MB: 28 ms a read, 1.6 ms joined).
        parts = [data]
        while more := os.read(fd, 1 << 20):
            parts.append(more)
        return b"".join(parts)
    finally:
        os.close(fd)


def thread_children(pid: int | str, tid: int) -> list[int]:
    """The children that thread `tid` of process `pid` ("self" for ours) started, or was given as
    a subreaper, from its /proc children file (Linux 3.5 with CONFIG_PROC_CHILDREN). OSError once
    the thread is gone."""
    return [int(child) for child in read_proc_file(f"/proc/{pid}/task/{tid}/children").split()]


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat from field 3 on (the state, the parent, ...), or None when it is gone."""
    try:
        data = read_proc_file(f"/proc/{pid}/stat")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields after it are split
    # after its last ')'.
    end = data.rfind(b")")
    return (data[end + 2:].split() or None) if end >= 0 else None


def read_proc(pid: int) -> Proc | None:
    fields = stat_fields(pid)
    if fields is None:
        return None
    # Field 3 is the state, 4 the parent, 5 the group, 6 the session, 22 the start time.
    return Proc(pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), fields[0] in (b"Z", b"X"))


def process_table(read: Callable[[int], object] = read_proc) -> dict:
    """pid -> what `read(pid)` makes of each live process (a Proc by default; the stats sampler
    keeps its CPU times and memory from the same read of its stat)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (proc := read(int(entry))) is not None:
            table[int(entry)] = proc
    return table


def descendants(table: dict[int, Proc], roots: Iterable[int]) -> set[int]:
    """Everything below `roots` in the parent chain (the roots not included)."""
    children: dict[int, list[int]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def younger_than(table: dict[int, Proc], start: int) -> list[int]:
    """The live processes of `table` that started at or after `start` (clock ticks since boot)."""
    return [p.pid for p in table.values() if p.start >= start and not p.zombie]


def marker_needle(token: str) -> bytes:
    """MARKER=token as it reads in /proc/PID/environ."""
    return f"{MARKER}={token}\0".encode()


def carries_marker(pid: int, needles: Iterable[bytes]) -> bool:
    """Does the environment of `pid` hold one of `needles` (False where we may not read it)?"""
    try:
        environ = read_proc_file(f"/proc/{pid}/environ") + b"\0"
    except OSError:
        return False
    return any(needle in environ for needle in needles)


def marked_pids(token: str, pids: Iterable[int] | None = None) -> set[int]:
    """Live processes whose environment holds MARKER=token (those we may read)."""
    needles = (marker_needle(token),)
    every = (int(e) for e in os.listdir("/proc") if e.isdigit())
    found = {pid for pid in (pids if pids is not None else every) if carries_marker(pid, needles)}
    found.discard(os.getpid())
    return found


def rank_leading(proc: Proc, ranks: dict[int, int], table: dict[int, Proc]) -> int | None:
    """The one of `ranks` (pid -> start time) whose process group or session `proc` is in."""
    for leader_pid in (proc.pgid, proc.sid):
        start = ranks.get(leader_pid)
        if start is None or proc.start < start:
            continue  # not a rank's id, or started before that rank: not from it
        leader = table.get(leader_pid)
        if leader is None or leader.start == start:  # else that pid names someone else now
            return leader_pid
    return None


def find_strays(
    table: dict[int, Proc],
    ranks: dict[int, int],
    strays: dict[int, int],
    marked: set[int] = frozenset(),
    skip: Iterable[int] = (),
) -> dict[int, int]:
    """Live processes (pid -> start time) that belong to the run: the ranks with their groups and
    sessions, the known `strays` (same start time: a reused pid is someone else), the `marked`
    ones, and all below any of these in the parent chain. Zombies are gone already."""
    skipped = set(skip)
    found = {}
    for proc in table.values():
        if proc.zombie or proc.pid in skipped:
            continue
        if rank_leading(proc, ranks, table) is not None or strays.get(proc.pid) == proc.start or proc.pid in marked:
            found[proc.pid] = proc.start
    for pid in descendants(table, list(found)) - skipped:
        if not table[pid].zombie:
            found[pid] = table[pid].start
    return found


def open_pidfd(pid: int, start: int) -> int | None:
    """A pidfd for `pid` if it is still the process that started at `start`, else None (also
    where the kernel has no pidfds). Checked after opening: from then on the descriptor names
    that process, whatever reuses the pid."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
    proc = read_proc(pid)
    if proc is None or proc.start != start:
        os.close(fd)
        return None
    return fd


def _pidfds_work() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (OSError, AttributeError):
        return False


PIDFDS = _pidfds_work()  # Linux 5.3 and later


def send_signal(pid: int, start: int, sig: int, fd: int | None = None) -> bool:
    """Send `sig` (and SIGCONT after SIGTERM: a stopped process could not act on it) to `pid` only
    if it is still the process that started at `start`: through `fd` or a pidfd opened for it.
    Without one (old kernels, or no descriptor to spare) the start time is checked just before
    signalling by pid."""
    own_fd = fd is None and PIDFDS
    if own_fd:
        fd = open_pidfd(pid, start)
    try:
        for each in (sig, signal.SIGCONT) if sig == signal.SIGTERM else (sig,):
            if fd is not None:
                signal.pidfd_send_signal(fd, each)
            elif (proc := read_proc(pid)) is not None and proc.start == start:
                os.kill(pid, each)
            else:
                return False
        return True
    except OSError:
        return False
    finally:
        if own_fd and fd is not None:
            os.close(fd)


def sweep(token: str, ranks: dict[int, int], strays: dict[int, int], grace: float,
          spawn_in_flight: bool = False) -> None:
    """SIGTERM everything that belongs to the run, SIGKILL what is left after `grace` seconds.
    `spawn_in_flight`: ranktop died starting a rank, which takes the marker only at its exec."""
    table = process_table()
    # Once (but for a rank still starting): what they start later is below them in the parent
    # chain. Only processes younger than this guard can carry the marker (the ranks start after
    # it): a busy host's other processes are not read.
    me = table.get(os.getpid())
    born = me.start if me is not None else 0
    marked = marked_pids(token, younger_than(table, born))
    settled = time.monotonic() + (SPAWN_SETTLE_SECONDS if spawn_in_flight else 0.0)
    signalled: dict[int, int] = {}
    deadline = None
    while True:
        found = find_strays(table, ranks, strays, marked, skip=(os.getpid(),))
        strays.update(found)  # known by identity from now on, wherever it moves
        now = time.monotonic()
        if not found and now >= settled:
            return
        if found:
            deadline = now + grace if deadline is None else deadline
            if now > deadline + GIVE_UP_SECONDS:
                return
            sig = signal.SIGKILL if now >= deadline else signal.SIGTERM
            for pid, start in found.items():
                if signalled.get(pid) != sig and send_signal(pid, start, sig):
                    signalled[pid] = sig
        time.sleep(RESCAN_SECONDS)
        table = process_table()
        if time.monotonic() < settled:  # the rank still starting may have its marker now
            marked |= marked_pids(token, [pid for pid in younger_than(table, born) if pid not in marked])


class Orders:
    """What ranktop told the guard, read to the end of the pipe. (A plain class: a NamedTuple's
    string annotations cost the guard's start-up a compile each.)"""

    __slots__ = ("token", "grace", "ranks", "strays", "tmp_dirs", "normal_exit", "spawning")

    def __init__(self) -> None:
        self.token: str | None = None  # None: never given a run
        self.grace = 0.0
        self.ranks: dict[int, int] = {}  # pid -> start time
        self.strays: dict[int, int] = {}
        self.tmp_dirs: list[bytes] = []
        self.normal_exit = False
        self.spawning = False  # a rank was being started, and its `rank` line has not come


def read_orders(lines: Iterable[bytes]) -> Orders:
    """ranktop's lines, to the end of the pipe; a line it cannot read is left out."""
    orders = Orders()
    for line in lines:
        words = line.split()
        if words == [b"done"]:
            orders.normal_exit = True
        elif len(words) == 3 and words[0] == b"run" and orders.token is None:
            try:
                orders.grace, orders.token = float(words[2]), words[1].decode("ascii")
            except ValueError:
                pass
        elif words == [b"spawning"]:
            orders.spawning = True
        elif len(words) == 3 and words[0] == b"rank":
            orders.ranks[int(words[1])] = int(words[2])
            orders.spawning = False
        elif len(words) == 2 and words[0] == b"gone":
            orders.ranks.pop(int(words[1]), None)
        elif len(words) == 3 and words[0] == b"stray":
            orders.strays[int(words[1])] = int(words[2])
        elif len(words) == 2 and words[0] == b"tmp":
            try:
                orders.tmp_dirs.append(bytes.fromhex(words[1].decode("ascii")))
            except ValueError:
                pass
    return orders


def remove_tmp_dir(path: bytes) -> None:
    """Remove one of the run's `tmp` directories: the files in it, then itself. It is flat (a
    rank's payload, result and exit marker), so nothing below is walked; never through a
    symlink at its name; whatever cannot go is left as it is (ranktop removed it already)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for name in os.listdir(fd):
            try:
                os.unlink(name, dir_fd=fd)
            except OSError:
                pass
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError:
        pass


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only end of file on stdin ends us
    orders = read_orders(sys.stdin.buffer)
    if orders.token is None and len(sys.argv) == 3:  # `guard.py TOKEN GRACE`: started by a ranktop
        orders.token, orders.grace = sys.argv[1], float(sys.argv[2])  # from before an upgrade in place
    if orders.token is None:
        return  # a spare that no run took: nothing carries a marker of ours
    # After a normal exit ranktop has reaped its ranks and swept with the grace already; only
    # what appeared meanwhile can be left.
    sweep(orders.token, orders.ranks, orders.strays, 0.5 if orders.normal_exit else orders.grace,
          spawn_in_flight=orders.spawning and not orders.normal_exit)
    for path in orders.tmp_dirs:  # only once no rank is left to read or write there
        remove_tmp_dir(path)


# ----- ranktop's side ----------------------------------------------------------------------------

_spare: subprocess.Popen | None = None  # a guard started ahead of its run


_RUN_GUARD = f"import sys; sys.path.append({os.path.dirname(os.path.abspath(__file__))!r}); import guard; guard.main()"


def _launch() -> subprocess.Popen:
    import subprocess  # (ranktop's side only: the guard itself never needs it)

    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _RUN_GUARD],  # stdlib only: no site
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to our terminal must not reach it
    )


def prestart() -> None:
    """Start the next run's guard now. On a small machine a Python start-up beside the ranks'
    slows their launch; one started while ranktop still imports its engine costs nothing there.
    Only a head start: if it cannot be started, the run starts its own."""
    global _spare
    if _spare is None:
        try:
            _spare = _launch()
        except OSError:
            pass


def spare_pid() -> int | None:
    """The spare guard's pid: our own child, not an orphan to adopt."""
    return _spare.pid if _spare is not None else None


def take(token: str, grace: float) -> subprocess.Popen:
    """A guard for the run marked `token`: the spare one if it is there and alive, else a new one."""
    global _spare
    guard, _spare = _spare, None
    line = f"run {token} {grace!r}\n".encode()
    if guard is not None and guard.poll() is None and _send(guard, line):
        return guard
    if guard is not None:
        guard.wait()  # it died (killed?): reap it and start another
    guard = _launch()
    _send(guard, line)  # one that dies at once: the run goes on without it, as when any line to it fails
    return guard


def _send(guard: subprocess.Popen, line: bytes) -> bool:
    try:
        guard.stdin.write(line)
        guard.stdin.flush()
        return True
    except OSError:
        return False


def discard_spare() -> None:
    """End a spare guard that no run took (the command line failed, say), and reap it."""
    import subprocess

    global _spare
    guard, _spare = _spare, None
    if guard is not None:
        guard.stdin.close()  # end of file without a run: it exits at once
        try:
            guard.wait(timeout=5)
        except subprocess.TimeoutExpired:  # stuck: it holds nothing of ours
            guard.kill()
            guard.wait()


if __name__ == "__main__":
    main()
