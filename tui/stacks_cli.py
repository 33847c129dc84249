"""`ranktop stacks [RUN | run dir | log dir | pid]`: the grouped stack view of a running group, from
another terminal. A run served on this host (see `ranktop ls`) is dumped by its own engine, also
where a pid or a directory leads to its ranks; otherwise the ranks are found from the files and
/proc. Run ids are looked up as attach and logs look them up (tui/runs_cli.py), ended runs
included. No Textual here: it must start fast and work over any SSH session.

Exit status: 0 dumped (even when some ranks could not be), 1 nothing running to dump,
2 bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
from ranktop.core import stacks
from ranktop.core.errors import UsageError
from ranktop.core.layout import RunDir, default_log_root, dump_log_path, latest_attempt_path
from ranktop.core.sanitize import clean, quoted
from ranktop.core.stacks.procs import HeldProcess
from ranktop.core.stdio import print_out
from ranktop.tui.usage import UsageParser, usage_error

if TYPE_CHECKING:  # (for the annotations: imported where used, as this module imports the client)
    from ranktop.core.client import FinalEngine, ServedRun


def build_parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="ranktop stacks", allow_abbrev=False,
                    description="Dump and group the Python stacks of a running group's ranks (py-spy).")
    p.add_argument("target", nargs="?", default=None,
                   help="a run (its id, a prefix of it; a served run is dumped by its engine), a run directory, "
                        "a log directory (newest live run), a ranktop pid or a rank pid (those of a served run are "
                        "dumped by its engine too; default: the newest running served run, else the newest live run "
                        "in $TMPDIR/ranktop-UID)")
    p.add_argument("--threads", action="store_true", help="also show threads other than the main thread")
    p.add_argument("--json", action="store_true", help="print the raw report as JSON")
    p.add_argument("--signal", action="store_true",
                   help="no py-spy, no ptrace: SIGUSR1 makes each rank print its stacks (faulthandler) to its stderr log, "
                        "read back from there")
    p.add_argument("--native", action="store_true",
                   help="also the C/C++ frames (py-spy --native): where torch or gloo waits; about a second a rank")
    p.add_argument("--no-save", action="store_true", help="do not write the dump under the run directory")
    return p


class BadTarget(Exception):
    pass


PID_MAX = 2**31 - 1  # what kill(2) takes; Linux's own pid_max is at most 4194304


def _is_pid(target: str) -> bool:
    """ASCII digits: `isdigit` alone also takes ² and other scripts' digits, which int() refuses."""
    return target.isascii() and target.isdigit()


def _live_pid(target: str) -> bool:
    """Whether the digits `target` are the pid of a running process."""
    # (length first: int() refuses 4300+ digits)
    return len(target) <= len(str(PID_MAX)) and int(target) <= PID_MAX and psutil.pid_exists(int(target))


def resolve(target: str | None) -> tuple[dict[int, int], dict[int, int], str | None, dict[int, HeldProcess]]:
    """({rank: pid}, {rank: local_rank}, run_dir or None, {rank: its process, held since it was
    checked: a run directory's, the caller closes them}) for a path or a pid (None: the default
    log directory); BadTarget if neither."""
    defaulted = target is None
    if target is None:
        target = default_log_root()
        if not os.path.isdir(target):
            raise BadTarget(_no_runs_in(target))
    if _is_pid(target):
        if not _live_pid(target):
            raise BadTarget(f"bad target {target[:40]}: no process with that pid")
        pid = int(target)
        try:
            pids, local, run_dir = stacks.ranks_of_pid(pid)
        except psutil.Error as exc:
            raise BadTarget(f"bad target {target}: cannot inspect that process ({exc})") from None
        # Neither a rank nor a ranktop with ranks: dump the process itself as the one "rank".
        return (pids or {0: pid}), local, run_dir, {}
    if not os.path.isdir(target):
        raise BadTarget(f"bad target {quoted(target)}: expected a run directory, a log directory or a pid")
    run_dir = stacks.find_run_dir(target)
    if run_dir is None and defaulted:  # (the default root, made by an earlier run, emptied since)
        raise BadTarget(_no_runs_in(target))
    if run_dir is None:
        raise BadTarget(f"bad target {quoted(target)}: no events.jsonl there or in its subdirectories (not a ranktop log dir)")
    try:
        pids, local, held = stacks.live_ranks_in_run_dir(run_dir)
    except (stacks.ForeignRanks, stacks.RanksNotHeld) as exc:
        raise BadTarget(f"bad target {quoted(run_dir)}: {exc}") from None
    return pids, local, run_dir, held


def _no_runs_in(root: str) -> str:
    return f"no target given and no runs in {root}: give a run directory, a log directory or a pid"


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.native and ns.signal:
        return usage_error("--native needs py-spy: --signal's faulthandler prints Python frames only")
    from ranktop.core.client import FinalEngine, ServedRun, served_runs

    runs = served_runs()  # (once: each silent engine costs its time-out)
    if ns.target is not None and _is_pid(ns.target) and _live_pid(ns.target):
        return _dump_found(ns.target, ns, runs)  # (a pid wins over a run id that starts with its digits)
    named = _newest_run(runs, ns) if ns.target is None else _named_run(ns.target, runs)
    if isinstance(named, int):
        return named
    if isinstance(named, FinalEngine):  # its ranks have all ended: final.json is written after them
        return _no_ranks(named)
    if isinstance(named, ServedRun) and not ns.signal and (run_dir := _silent_runs_dir(named, ns.target or named.run_id)):
        # Its ranks are dumped from here, as given a pid: a hang may be its engine's own (stopped,
        # swamped), and it was only said not to answer, where py-spy could still read its ranks.
        # (Not --signal's dumps: they reach the ranks' logs through that engine.)
        print(clean(f"ranktop stacks: {named.run_id}: the engine at {named.path} does not answer: "
                    "its ranks are dumped from here"), file=sys.stderr)
        return _dump_found(run_dir, ns, runs)
    if isinstance(named, ServedRun):
        return _through_engine(named, ns)
    if isinstance(named, _Unfinished):  # read as its directory is: a rank may outlive its engine
        return _dump_found(named.run_dir, ns, runs, unfinished=True)
    return _dump_found(named, ns, runs)


def _newest_run(runs: Sequence[ServedRun], ns: argparse.Namespace) -> ServedRun | str | None | int:
    """No target: the newest running served run, as `_named_run` finds it, where a run whose
    engine does not answer counts by when that engine started, as against the engine of the run
    found (it cannot say when its run did, and `ls` lists it last): the newest run is likely the
    hung one. One newer than the run found is dumped instead (from here) where its id names its
    directory in the default log directory; else the run found is, after one line that names
    both: it was dumped with nothing said but its `saved:` path."""
    from ranktop.core.client import NOT_ANSWERING, ServedRun

    named = _named_run(None, runs)
    answering = isinstance(named, ServedRun) and named.seen
    # (both by their engines' starts, as the kernel tells them: its clock and time.time() differ
    # by up to a second, its boot time's fraction)
    started = _engine_started(named) if answering else None
    if answering and started is None:
        return named
    silent = [(when, run) for run in runs if run.snapshot.get("state") == NOT_ANSWERING
              and (when := _engine_started(run)) is not None and (started is None or when > started)]
    if not silent:
        return named
    newer = max(silent, key=lambda found: found[0])[1]
    if not answering or (not ns.signal and _silent_runs_dir(newer, newer.run_id)):
        return newer
    print(clean(f"ranktop stacks: {newer.run_id}, the newest run, does not answer (the engine at {newer.path}): "
                f"dumping {named.run_id}, the newest that does"
                + ("" if ns.signal else f"; give {newer.run_id}'s run directory to dump its ranks from here")),
          file=sys.stderr)
    return named


def _engine_started(run: ServedRun) -> float | None:
    """When the engine serving `run` started (its socket's listener), or None where unknown."""
    if run.pid is None:
        return None
    try:
        return psutil.Process(run.pid).create_time()
    except psutil.Error:
        return None


def _silent_runs_dir(run: ServedRun, target: str | None) -> str | None:
    """The run directory of `run`, whose engine does not answer, where `target` names it (that
    directory, or its id under the default log root) and its engine wrote it (its run_started
    names the engine's pid); else None."""
    from ranktop.core.client import NOT_ANSWERING, run_dir_of
    from ranktop.core.events import run_started

    if run.snapshot.get("state") != NOT_ANSWERING or target is None or run.pid is None:
        return None
    run_dir = run_dir_of(target)
    started = run_started(run_dir) if run_dir is not None else None
    return run_dir if started is not None and started.get("pid") == run.pid else None


@dataclass(frozen=True)
class _Unfinished:
    """A run that is not served and left no final.json: its engine went away before the run's end."""

    run_dir: str


def _named_run(target: str | None, runs: Sequence[ServedRun]) -> ServedRun | FinalEngine | _Unfinished | str | None | int:
    """What `target` names, as attach and logs look it up (runs_cli.pick_run): the served run (a
    run id, a prefix of one, its directory; None: the newest running one), else the final view of
    the ended run it names, or the run that left no final.json; a path (a run directory, a log
    directory) or None (no run served) to read from the files and /proc, as before; else
    the status of the one line printed. Digits that no process has are a run id's (a prefix of
    20261127-154636-ea7d, say), and, where they name no run either, the pid's line says so."""
    from ranktop.core.client import SeveralRuns, find_run, run_dir_of
    from ranktop.tui.runs_cli import no_run_words, pick_ended_run

    try:
        return find_run(target, runs)
    except ValueError as exc:
        not_served = exc
    if target is None or (os.path.exists(target) and run_dir_of(target) in (None, target)):
        return target  # (a bare name is a run id under the default log root first, as for attach)
    if isinstance(not_served, SeveralRuns):
        return usage_error(str(not_served))
    ended = pick_ended_run(target)
    if ended is not None:
        return _Unfinished(ended) if isinstance(ended, str) else ended
    if _is_pid(target):
        return usage_error(f"bad target {target[:40]}: no process with that pid")
    return usage_error(f"{no_run_words(str(not_served), 'stacks', runs)} (or give a run directory, a log directory or a pid)")


def _dump_found(target: str | None, ns: argparse.Namespace, runs: Sequence[ServedRun],
                unfinished: bool = False) -> int:
    """Dump the ranks a pid or a directory leads to: through their engine where a served run has
    them, as `ranktop stacks RUN` does (only it knows their cpu%, how long each has been silent,
    the prompt each waits at); else from here, read from /proc and the run's files. `unfinished`:
    `target` is the run directory of a run already found to have left no final.json."""
    try:
        pids, local, run_dir, held = resolve(target)
    except BadTarget as exc:
        return usage_error(str(exc))
    try:
        served = _served_ranks(pids, runs) if pids else _served_run_dir(run_dir, runs)
        if served is not None:
            run, local_ranks = served
            return _through_engine(run, ns, local_ranks)
        return _dump_here(pids, local, run_dir, held, ns, unfinished)
    finally:
        stacks.close_all(held)


def _served_run_dir(run_dir: str | None, runs: Sequence[ServedRun]) -> tuple[ServedRun, None] | None:
    """The served run whose engine writes `run_dir`, where none of its ranks runs (a round forming,
    a restart under way): its engine says so, as for the run named by its id. Without it, the
    line was that of a run whose engine went away (killed?), of a run being served."""
    if run_dir is None:
        return None
    here = os.path.realpath(run_dir)
    return next(((run, None) for run in runs if run.seen and run.snapshot.get("log_dir")
                 and os.path.realpath(run.snapshot["log_dir"]) == here), None)


def _served_ranks(pids: dict[int, int], runs: Sequence[ServedRun]) -> tuple[ServedRun, tuple[int, ...] | None] | None:
    """The served run whose engine names some of `pids` ({rank: pid}) among its ranks, with their
    local ranks (None: all its ranks), or None. Only an engine that answered counts: one that
    does not (stopped, swamped) would not dump them either, and /proc still can."""
    wanted = set(pids.values())
    for run in runs:
        ranks = run.snapshot.get("ranks") or []
        local = tuple(r["local_rank"] for r in ranks if r.get("pid") in wanted)
        if local:
            return run, (None if len(local) == len(ranks) else local)
    return None


def _dump_here(pids: dict[int, int], local: dict[int, int], run_dir: str | None, held: dict[int, HeldProcess],
               ns: argparse.Namespace, unfinished: bool = False) -> int:
    """Dump the ranks found from here (py-spy, or SIGUSR1 with --signal); the exit status."""
    if not pids:  # (only a directory leads to none: a pid is a rank itself at least)
        return _no_ranks_in(run_dir or "", unfinished)
    save_to = None if ns.no_save or not run_dir else _save_dir(run_dir)
    try:
        if ns.signal:
            return _signal(pids, local, run_dir, save_to, held, ns)
        report = stacks.dump_pids(pids, local_ranks=local, run_dir=save_to, source="cli", native_frames=ns.native,
                                  held=held)
    finally:
        if save_to is not None:
            save_to.close()
    return _show(report, ns)


def _save_dir(run_dir: str) -> RunDir | None:
    """The run directory, held, to save the dump in; None (and a line on stderr saying why) where
    it is not one of ours that no one else controls: a path through another user's directory
    could lead anywhere, a private directory of ours included."""
    try:
        return RunDir.open_existing(run_dir)
    except UsageError as exc:
        print(clean(f"ranktop stacks: {exc}"), file=sys.stderr)
        return None


def _no_ranks_in(run_dir: str, unfinished: bool) -> int:
    """The line for a run directory none of whose ranks runs, as for its run named by its id: how
    attach and logs say the run ended (`unfinished`: it was found already to have left no
    final.json), so that a run reads the same whichever way it is named; 1, or the status of
    their line where its final.json is not to be shown."""
    from ranktop.tui.runs_cli import pick_ended_run

    path = os.path.abspath(run_dir)  # (a path: a bare name is a run id under the default log root first)
    ended = path if unfinished else pick_ended_run(path)
    if isinstance(ended, int):
        return ended
    return _no_ranks(path if ended is None else ended)  # (None: its events.jsonl went since)


def _no_ranks(ended: FinalEngine | str) -> int:
    """`ranktop stacks: ` and how attach and logs say the run ended (`ended`: its final view,
    closed here, or the run directory of one that left no final.json), then `: no ranks to
    dump`; 1."""
    from ranktop.tui.runs_cli import ended_run_words

    try:
        print(f"ranktop stacks: {ended_run_words(ended)}: no ranks to dump", file=sys.stderr)
    finally:
        if not isinstance(ended, str):
            ended.close()
    return 1


def _through_engine(run: ServedRun, ns: argparse.Namespace, local_ranks: tuple[int, ...] | None = None) -> int:
    """The run's own engine dumps (it knows its ranks, their logs and the run directory): all its
    ranks, or `local_ranks`."""
    from ranktop.core.client import RunGone, dump_stacks

    args = {**({"save": False} if ns.no_save else {}), **({"native_frames": True} if ns.native else {}),
            **({"local_ranks": list(local_ranks)} if local_ranks is not None else {})}
    try:
        ack = dump_stacks(run.path, "SignalDump" if ns.signal else "DumpStacks", args)
    except RunGone as exc:
        ended = _ended_meanwhile(run)
        if ended is not None:  # it ended as we asked (a stop came first): say how, as for an ended run
            return _no_ranks(ended)
        print(clean(f"ranktop stacks: {run.run_id}: {exc}"), file=sys.stderr)
        return 1
    if ack.report is None:
        print(clean(f"ranktop stacks: {run.run_id}: {ack.message}"), file=sys.stderr)
        return 1
    return _show(ack.report, ns)


def _ended_meanwhile(run: ServedRun) -> FinalEngine | None:
    """The final view of a served run whose engine left as its stacks were asked for, where that
    engine wrote one (the run ended); None where it did not (killed), or a rank planted it."""
    from ranktop.core.client import NotEnginesFinal, final_view_of

    try:
        return final_view_of(run.snapshot.get("log_dir"), run.snapshot.get("final_seal"))
    except NotEnginesFinal:
        return None


def _signal(pids: dict[int, int], local: dict[int, int], run_dir: str | None, save_to: RunDir | None,
            held: dict[int, HeldProcess], ns: argparse.Namespace) -> int:
    """SIGUSR1 to every rank; with the run dir known, read the dumps back from the logs."""
    attempt = latest_attempt_path(run_dir) if run_dir else None
    if attempt is None or set(local) != set(pids):
        outcome = stacks.signal_pids(pids, held=held)
        for rank, what in outcome.items():
            print_out(f"rank {rank} (pid {pids[rank]}): {what}")
        sent = "sent" in outcome.values()
        print_out("the stacks go to each rank's stderr" if sent else "nothing was sent: without --signal, py-spy reads the stacks")
        return 0 if sent else 1  # as a dump of which not one rank's stacks came
    logs = {r: dump_log_path(os.path.join(attempt, str(local[r]))) for r in pids}
    report = stacks.signal_report(pids, logs, local_ranks=local, run_dir=save_to, source="cli-signal", held=held)
    return _show(report, ns)


def _show(report: stacks.StackReport, ns: argparse.Namespace) -> int:
    """The grouped report on stdout, or as JSON with --json; the exit status: 1 when not one
    rank's stacks came (every rank's line says why), so that a script can tell."""
    if ns.json:
        print_out(json.dumps(stacks.report_to_dict(report), indent=1, default=str))
    else:
        print_out(clean(stacks.format_report(report, threads=ns.threads), newlines=True))
    return 0 if any(rank.threads for rank in report.ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
