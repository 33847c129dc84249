"""`ranktop ls`, `attach`, `stop`, `logs` (and `web`, tui/web.py): reach a run from any terminal of its user,
through the socket its engine serves (core/server.py). Never imports Textual."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from ranktop.core import collector, protocol
from ranktop.core.client import (
    BadFinalFile,
    Connection,
    Dropped,
    EngineRefused,
    EngineSilent,
    FinalEngine,
    NotEnginesFinal,
    RunGone,
    ServedRun,
    SeveralRuns,
    engine_answers,
    final_run,
    final_view_of,
    find_run,
    run_dir_of,
    served_runs,
    unlisted_why,
    wait_ended,
    wait_gone,
)
from ranktop.core.layout import EVENTS, default_log_root, default_root_problem, newest_ended_runs, tail_lines_below
from ranktop.core.output import RanktopLine
from ranktop.core.sanitize import clean, clean_console
from ranktop.core.signals import NOTICE_SIGNALS, deaf_to
from ranktop.core.state import world_undecided
from ranktop.core.stdio import lose, print_err, print_out, terminal_problem, to_devnull
from ranktop.tui.detach import leave_with_the_web_server
from ranktop.tui.usage import UsageParser, metric_pattern, run_command, usage_error

INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C ended the command, as a shell reports it
_RUN_HELP = "a run id, a unique prefix of one, or its run directory (default: the newest running run)"


def main(argv: Sequence[str]) -> int:
    command, rest = argv[0], list(argv[1:])
    if command != "attach":  # (attach's start-up ends with its first frame, as the TUI's does)
        collector.release()
    if command == "web":
        from ranktop.tui.web import main as web

        return web(rest)
    return {"ls": ls, "stop": stop, "logs": logs, "attach": attach}[command](rest)


def run_parser(prog: str, description: str) -> UsageParser:
    """A parser for a subcommand that acts on one served run (its RUN argument first)."""
    p = UsageParser(prog=prog, description=description)
    p.add_argument("run", nargs="?", default=None, help=_RUN_HELP)
    return p


def pick_run(target: str | None, command: str = "attach") -> ServedRun | FinalEngine | int:
    """The served run `target` names; else the final view of the ended run it names (its engine
    has gone: its directory holds final.json); else the one line saying why not, as a status,
    which names the runs that ended last and how `command` reaches them."""
    runs = served_runs()
    try:
        return find_run(target, runs)
    except SeveralRuns as exc:  # not an ended run that the prefix names too
        return usage_error(str(exc))
    except ValueError as exc:
        not_served = str(exc)
    ended = pick_ended_run(target)
    if isinstance(ended, str):
        print(f"ranktop: {ended_run_words(ended)}", file=sys.stderr)
        return 1
    return usage_error(no_run_words(not_served, command, runs)) if ended is None else ended


def pick_ended_run(target: str | None) -> FinalEngine | str | int | None:
    """The ended run `target` names (its run directory, or its id or a unique prefix of one among
    the ended runs under the default log root): its final view; its run directory where it left
    no final.json (its engine went away before the run's end); None where it names none; else the
    status of the one line printed (a prefix of several ended runs, a final.json not to be shown)."""
    try:
        view = ended_view(target)
    except NotEnginesFinal as planted:  # as if there were none: how the run ended is unknown
        print_err(clean(f"ranktop: {planted}"))
        view = None
    except BadFinalFile as bad:
        return usage_error(str(bad))
    if view is not None:
        return view
    return run_dir_of(target) if target else None


def no_run_words(not_served: str, command: str, served: Sequence[ServedRun] = ()) -> str:
    """The line for a name that no run has, served or ended (find_run's `not_served` first, which
    lists the `served` runs: they are left out of the ended ones)."""
    if not served and (why := unlisted_why()) is not None:  # (none can be found, whatever serves)
        not_served = f"{not_served} (ranktop cannot look for them: {why})"
    return f"{not_served}; {ended_runs_words(command, served)}"


NEWEST_ENDED_NAMED = 3  # ended runs a "no run" line names: the newest is most likely the one meant


def ended_runs_words(command: str, served: Sequence[ServedRun] = ()) -> str:
    """For someone back after their run's engine left: the runs that ended last under the default
    log root, and the exact command that reaches the newest, by its directory and by its id; or
    that none ended there, so an ended run is named by its directory. Runs `served` (listed
    before these words) are left out."""
    if (named := newest_ended_words(command, served)) is not None:
        return named
    root = default_log_root()
    if (problem := default_root_problem()) is not None:  # (not empty: not ours to read)
        return clean(f"the default log root {root}{problem}, so no run is named from it; an ended run is "
                     "named by its run directory")
    if newest_ended_runs(1):  # only runs still served ended there (a TUI showing the end)
        return f"no other run has ended under {root}; an ended run elsewhere is named by its run directory"
    return f"none has ended under {root} either; an ended run elsewhere is named by its run directory"


def newest_ended_words(command: str, served: Sequence[ServedRun] = ()) -> str | None:
    """The runs that ended last under the default log root and how `command` reaches the newest;
    None where none did. Those still served are left out: an ended run whose TUI shows its end, or
    whose engine lingers, still answers, and the served runs the line lists named it already."""
    ended = _ended_not_served(served)
    if not ended:
        return None
    root, now = default_log_root(), time.time()
    named = ", ".join(f"{name} ({_age(max(0.0, now - when))} ago)" for name, when in ended)
    newest = ended[0][0]
    return clean(f"ended under {root}, newest first: {named}; {run_command(command, os.path.join(root, newest))} "
                 f"reaches the newest, as does its id: {run_command(command, newest)}")


def _ended_not_served(served: Sequence[ServedRun]) -> list[tuple[str, float]]:
    """newest_ended_runs' NEWEST_ENDED_NAMED, less the runs `served` from those directories."""
    root = default_log_root()
    dirs = {os.path.realpath(log_dir) for run in served if isinstance(log_dir := run.snapshot.get("log_dir"), str)}
    ended = newest_ended_runs(NEWEST_ENDED_NAMED + len(dirs))
    return [(name, when) for name, when in ended if os.path.realpath(os.path.join(root, name)) not in dirs][
        :NEWEST_ENDED_NAMED]


def ended_run_words(ended: FinalEngine | str) -> str:
    """How attach, logs, stop and stacks say that the run pick_ended_run found has ended, with no
    `ranktop: ` before it: its final state, from `ended`, its final view; or, for `ended` the run
    directory of one that left no final.json, that its engine went away before the run's end
    (SIGKILL, the OOM killer), so nothing says how it ended."""
    if isinstance(ended, FinalEngine):
        return final_words(ended)
    name = clean(os.path.basename(os.path.normpath(ended)))
    logs = f"its log files are under {clean(os.path.abspath(ended))}"
    if (unwritten := _final_write_failed(ended)) is not None:
        state, why = unwritten
        return clean(f"{name} is not served and left no final.json: its engine could not write it ({why}), "
                     f"so no view of its end can be shown; events.jsonl says it ended {state}; {logs}")
    return (f"{name} is not served and left no final.json: its engine went away before the run's end "
            f"(killed?), so how the run ended is unknown; {logs}")


def _final_write_failed(run_dir: str) -> tuple[str, str] | None:
    """(the state run_finished gives, why) where events.jsonl ends in the engine's own word that
    final.json could not be written (a full disk): the engine did reach the run's end. The file
    is the run's, read as a log is: its last 64 KiB, nothing followed."""
    events = []
    for line in tail_lines_below(run_dir, [EVENTS], 64 << 10)[-2:]:
        with contextlib.suppress(ValueError, RecursionError):
            events.append(json.loads(line))
    if len(events) == 2 and all(isinstance(e, dict) for e in events) \
            and [e.get("event") for e in events] == ["run_finished", "final_write_failed"]:
        return str(events[0].get("state", "?")), str(events[1].get("error", "?"))
    return None


def ended_view(target: str | None) -> FinalEngine | None:
    """The final view of the ended run `target` names (a run directory, or a run id under the
    default log root), or None. BadFinalFile if its final.json cannot be shown."""
    final = final_run(target)
    return None if final is None else FinalEngine(final)


def ended_words(run_id: str, state: str, *, already: bool = False) -> str:
    """How a command that came after the end says so: the run and its final state."""
    return clean(f"{run_id} {'had already' if already else 'has'} ended ({state}); its engine has left")


def final_words(view: FinalEngine, *, already: bool = False) -> str:
    snap = view.snapshot()
    return ended_words(snap.run_id, snap.state.value, already=already)


# ----- ls ---------------------------------------------------------------------------------------
def ls(argv: list[str]) -> int:
    p = UsageParser(prog="ranktop ls", description="The runs served on this host, newest first.")
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    ns = p.parse_args(argv)
    runs = served_runs()
    if not runs and (why := unlisted_why()) is not None:  # ("no runs are served" would hide why)
        return usage_error(f"cannot list the runs served on this host: {why}")
    if ns.json:
        print_out(json.dumps([{"run_id": r.run_id, "pid": r.pid, "socket": r.path, "clients": r.clients,
                               "full": r.full, "log_dir": r.snapshot.get("log_dir"), **_facts(r)} for r in runs]))
        return 0
    if not runs:  # (the first thing typed by someone back after the engine left: which run was theirs)
        ended = newest_ended_words("attach")
        print_out("no runs are served on this host" + (f"; {ended}" if ended else ""))
        return 0
    rows = [("RUN", "SCRIPT", "WORLD", "STATE", "AGE", "CLIENTS", "LOGS")]
    rows += [_row(r) for r in runs]
    rows = [tuple(_as_printed(clean(cell)) for cell in row) for row in rows]  # names come from the runs: shown safely
    print_out(_table(rows))
    return 0


def _clients(run: ServedRun) -> str:
    """The CLIENTS cell: how many, `full` once it serves all it serves for long (attach and logs -f
    cannot get in; ls and stop still can), `?` where its engine did not say."""
    return "full" if run.full else str(run.clients) if run.seen else "?"


def _as_printed(cell: str) -> str:
    """`cell` as stdout writes it: what its encoding lacks (an é on an ASCII console) as `\\xe9`,
    so that a column is as wide as what the terminal shows of it."""
    encoding = sys.stdout.encoding or "utf-8"
    return cell.encode(encoding, "backslashreplace").decode(encoding)


def _table(rows: list[tuple[str, ...]]) -> str:
    """The rows in columns two spaces apart, each as wide as its widest cell on the terminal (a
    wide character takes two cells); the last column is not padded."""
    from rich.cells import cell_len

    widths = [max(cell_len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell + " " * (w - cell_len(cell)) for cell, w in zip(row, widths, strict=False))
                     + "  " + row[-1] for row in rows)


def _facts(run: ServedRun) -> dict:
    snap = run.snapshot
    started = snap.get("started_at")  # NaN where the engine's was no time: unknown, shown as "?"
    # A round that forms (or never formed) decides the world: the one in the snapshot is the last round's
    forming = snap.get("forming") is not None
    undecided = forming or world_undecided(snap.get("state"), snap.get("round"), bool(snap.get("ranks")))
    last = snap.get("world_size") if forming and snap.get("round") is not None else None
    return {"script": snap.get("name"), "world": None if undecided else snap.get("world_size"), "last_world": last,
            "state": snap.get("state"), "age": _since(started),
            "ended_ago": _since(snap.get("ended_at")) if snap.get("ended") else None}


def _since(when: float | None) -> str | None:
    """How long ago `when` (a time.time()) was, as `ls` says it; None where unknown (NaN: an
    engine's time that was no time), 0 for a time ahead of this host's clock."""
    return None if when is None or not math.isfinite(when) else _age(max(0.0, time.time() - when))


def _row(run: ServedRun) -> tuple[str, ...]:
    """A run's row. AGE: how long it has been running; of an ended run (its engine lingers), how
    long ago it ended, which is what someone back after it asks (and `--linger` counts from)."""
    facts = {k: "?" if v is None else str(v) for k, v in _facts(run).items()}
    age = f"ended {facts['ended_ago']} ago" if run.snapshot.get("ended") else facts["age"]
    world = facts["world"] if facts["last_world"] == "?" else f"? (last {facts['last_world']})"
    return (run.run_id, facts["script"], world, facts["state"], age, _clients(run),
            run.snapshot.get("log_dir") or "")


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


# ----- attach -----------------------------------------------------------------------------------
def attach(argv: list[str]) -> int:
    p = run_parser("ranktop attach", "The TUI of a run started elsewhere (it goes on when you leave).")
    p.add_argument("--read-only", action="store_true", help="watch only: keys that act on ranks do nothing")
    p.add_argument("--metric", type=metric_pattern, default=None, metavar="REGEX",
                   help="a number from each rank's output, as the run's own --metric")
    p.add_argument("--exit-on-end", action="store_true", help="leave as soon as the run ends")
    ns = p.parse_args(argv)
    leave_with_the_web_server()
    run = pick_run(ns.run)
    if isinstance(run, int):
        return run
    problem = _no_terminal()
    if problem is not None:  # Textual would draw into a pipe, and wait for keys that never come
        if isinstance(run, FinalEngine):
            run.close()
        follow = run_command("logs", ns.run, "-f") if ns.run else "ranktop logs -f"
        return usage_error(f"ranktop attach needs a terminal ({problem}): {follow} prints a run's output instead")
    if isinstance(run, FinalEngine):  # an ended run whose engine has gone: its final view
        from ranktop.tui.app import RanktopApp

        return _show(RanktopApp(run, metric=ns.metric))
    connecting = _Connecting(run.path, ns.read_only)
    connecting.start()
    from ranktop.tui.app import RanktopApp, tui_exit_status  # Textual loads while the engine answers
    from ranktop.tui.run import print_end_report

    connecting.join()
    engine = connecting.engine
    if isinstance(connecting.problem, RunGone):
        print(clean(f"ranktop: {run.run_id}: {connecting.problem}"), file=sys.stderr)
        return 1
    if connecting.problem is not None:
        raise connecting.problem  # not ours to word: raised here, as it was before the thread
    app = RanktopApp(engine, exit_on_end=ns.exit_on_end, metric=ns.metric)
    app.attached = True
    try:
        with _leaving_on_signals(app):
            app.run()
    finally:
        engine.close()
    if not engine.last.ended:  # the last snapshot the TUI took
        print(clean(f"ranktop: left {run.run_id}; it runs on ({run_command('attach', run.run_id)}, "
                    f"{run_command('stop', run.run_id)})"),
              file=sys.stderr)
        return app.return_code or 0  # 1 when the TUI itself failed: never a clean exit after a traceback
    if engine.last.error is not None:  # its engine went away before we saw the end
        print(clean(f"ranktop: {run.run_id}: {engine.last.error}; ranktop ls says whether it still runs"),
              file=sys.stderr)
        return app.return_code or 1  # how the run ended is unknown: not a clean exit
    print_end_report(engine.last)
    # The local TUI's rule: 130 for a stop asked for here, else the run's own status.
    return app.return_code or tui_exit_status(engine.last, app.user_quit)


class _Connecting(threading.Thread):
    """A RemoteEngine built in a thread, with every rank's first screenful fetched: importing
    Textual takes most of attach's start, and the engine's answers need not wait for it."""

    def __init__(self, path: str, read_only: bool) -> None:
        super().__init__(name="ranktop-connect", daemon=True)
        self.path, self.read_only = path, read_only
        self.engine = None
        self.problem: Exception | None = None  # what building it raised, for the main thread

    def run(self) -> None:
        from ranktop.core.client import RemoteEngine

        try:
            self.engine = RemoteEngine(self.path, read_only=self.read_only, look_ahead=True)
        except Exception as exc:  # noqa: BLE001 - handed to the main thread, which raises what it does not word
            self.problem = exc


def _no_terminal() -> str | None:
    """Why attach cannot show its TUI here, or None. Under textual-serve (`ranktop web`) the
    driver is Textual's web driver, which needs no terminal."""
    if os.environ.get("TEXTUAL_DRIVER"):
        return None
    return terminal_problem() or (None if os.isatty(1) else "stdout is not a terminal")


@contextlib.contextmanager
def _leaving_on_signals(app) -> Iterator[None]:
    """While `app` runs, SIGTERM, SIGINT, SIGQUIT and SIGHUP make it leave (RanktopApp.leave_on_signal),
    and SIGUSR1/SIGUSR2 (Slurm's warning to a whole step) change nothing: their default action
    killed it in the TUI's alternate screen. (A SIGINT, `kill -INT` or a Ctrl-C before the TUI
    reads keys, was a KeyboardInterrupt in Textual's loop, which left as `d` does, exit 0.)"""
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda signum, _frame: app.leave_on_signal(signum)) for sig in stops}
    previous.update(deaf_to(NOTICE_SIGNALS))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _show(app) -> int:
    """An ended run's final view (its engine gone); its exit status is the run's, as attach's is
    to a run that ended under it or whose engine lingers after the end (it was 0 here and 1 there
    for one failed run)."""
    from ranktop.tui.app import tui_exit_status
    from ranktop.tui.run import print_end_report

    app.attached = True
    with _leaving_on_signals(app):
        app.run()
    snap = app.engine.snapshot()
    print_end_report(snap)
    return app.return_code or tui_exit_status(snap, user_quit=False)  # (nothing runs here for q to stop)


# ----- stop -------------------------------------------------------------------------------------
def stop(argv: list[str]) -> int:
    p = run_parser("ranktop stop", "Stop a run: SIGTERM to every rank, SIGKILL after its grace.")
    ns = p.parse_args(argv)
    run = pick_run(ns.run, "attach")  # (an ended run has nothing to stop: its final view is what is left)
    if isinstance(run, int):
        return run
    if isinstance(run, FinalEngine):  # nothing left to stop: what it asked for
        print(f"ranktop: {final_words(run, already=True)}")
        run.close()
        return 0
    try:
        with Connection(run.path) as conn:
            snap = conn.snapshot()
            ack = conn.command("Stop")  # an ended run's engine leaves at once, and says so
    except RunGone as exc:
        print(clean(f"ranktop: {run.run_id}: {exc}"), file=sys.stderr)
        return 1
    if not ack.get("ok"):
        print(clean(f"ranktop: {run.run_id}: {ack.get('message')}"), file=sys.stderr)
        return 1
    grace = snap.get("shutdown_timeout") or 10.0
    shown = bool(ack.get("stays"))  # its TUI shows the end until quit: the ranks are what must go
    try:
        gone = (wait_ended if shown else wait_gone)(run.path, grace + 15.0)
    except KeyboardInterrupt:  # the stop was sent: only the waiting for it ends here
        print("\n" + clean(f"ranktop: {run.run_id} goes on stopping (SIGKILL after its {grace:g}s grace); ranktop ls "
                           "shows it"), file=sys.stderr)
        return INTERRUPTED
    if not gone:
        print(clean(f"ranktop: {run.run_id} is still there {grace + 15:g}s after the stop"), file=sys.stderr)
        return 1
    on_screen = "the TUI that started it shows the end until it is quit"
    if snap.get("ended") and shown:
        print(clean(f"ranktop: {run.run_id} had already ended ({snap.get('state')}); {on_screen}"))
    elif snap.get("ended"):  # a lingering engine of a run that was over: it let the engine go
        print(f"ranktop: {ended_words(run.run_id, str(snap.get('state')), already=True)}")
    elif shown:
        print(clean(f"ranktop: stopped {run.run_id} ({on_screen})"))
    else:
        print(clean(f"ranktop: stopped {run.run_id}"))
    return 0


# ----- logs -------------------------------------------------------------------------------------
def logs(argv: list[str]) -> int:
    p = run_parser("ranktop logs", "A run's output, prefixed with each rank, from its engine.")
    p.add_argument("--rank", type=int, default=None,
                   help="only this rank, as its lines are prefixed (on a node of several, its global rank)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the run ends")
    p.add_argument("--events", action="store_true",
                   help="with -f: also print the run's events as they happen (restarts, signals, exits), each as "
                        "'[ranktop]:' and its events.jsonl line")
    ns = p.parse_args(argv)
    if ns.events and not ns.follow:
        return usage_error("--events needs -f: the events so far are in events.jsonl in the run directory")
    # A hang-up that whoever started logs chose to ignore (nohup), or a Ctrl-C (a background job
    # of a script), stays ignored. The handler is not put back: the default, back while logs still
    # ended, killed it on the next signal (no totals, no 128+N), and a second Terminated (or
    # KeyboardInterrupt, Ctrl-C held down) out of a `finally` on the way was a traceback.
    ending = _Ending()
    handled = [sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
               if signal.getsignal(sig) is not signal.SIG_IGN]
    try:
        for sig in handled:  # (in the try: a SIGTERM that comes before the try began was a traceback)
            signal.signal(sig, ending)
        try:
            return _logs(ns)
        finally:
            ending.armed = False  # (a signal before this line still ends logs, caught just below)
    except Terminated as end:  # the totals of the lines not shown are said on the way (finally)
        return 128 + end.signum
    finally:
        # Held, pending, from here to the exit: Python puts the defaults back as it exits, and one
        # coming then would kill logs, its status lost.
        signal.pthread_sigmask(signal.SIG_BLOCK, handled)


class _Ending:
    """The SIGINT, SIGTERM and SIGHUP handler of `logs`: the first signal while it is armed ends
    logs (Terminated); any other is ignored, as logs is ending already."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, signum: int, _frame: object) -> None:
        if self.armed:
            self.armed = False
            raise Terminated(signum)


class Terminated(BaseException):  # (not an Exception: no `except Exception` on the way takes it)
    """Ctrl-C, SIGTERM (`kill`, `timeout`, a supervisor) or SIGHUP (the SSH link or the terminal
    gone) came: `logs` ends, exit 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class OutputFailed(Exception):
    """stdout (or stderr, for an ended run's stderr.log) took no more: a terminal hung up (EIO), a
    full disk; the message is the system's why. A reader that left (EPIPE) is BrokenPipeError."""


def _write(stream, lines: Iterable[bytes]) -> None:
    """`lines` to the binary `stream`, at once; OutputFailed where stdout cannot take them. A
    stderr that cannot is noted (see core/stdio.py), and said on stdout at the end."""
    try:
        stream.writelines(lines)
        stream.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        if stream is sys.stdout.buffer:
            raise OutputFailed(exc.strerror or str(exc)) from None
        lose("stderr", exc)


def _logs(ns: argparse.Namespace) -> int:
    run = pick_run(ns.run, "logs")
    if isinstance(run, int):
        return run
    try:
        if isinstance(run, FinalEngine):
            try:
                return _print_final_logs(run, ns.rank)
            finally:
                run.close()
        return _served_logs(run, ns)
    except BrokenPipeError:  # `ranktop logs | head`
        return 0
    except OutputFailed as exc:  # (stdout pointed at /dev/null: the flush at exit fails no more)
        to_devnull(sys.stdout)
        name = run.run_id if isinstance(run, ServedRun) else run.snapshot().run_id
        print_err(clean(f"ranktop: {name}: logs cannot write its output ({exc})"))
        return 1


def _served_logs(run: ServedRun, ns: argparse.Namespace) -> int:
    try:
        with Connection(run.path) as conn:
            return _print_logs(conn, run, ns.rank, ns.follow, ns.events)
    except (EngineSilent, EngineRefused) as exc:  # stopped, swamped or full: nothing was printed, and the run is there
        print(clean(f"ranktop: {run.run_id}: {exc}"), file=sys.stderr)
        return 1
    except RunGone as gone:  # before the first answer: the run ended as logs came
        return _connection_ended(run, ns.rank, gone, printed=False, follow=ns.follow)


def _shown(out_is_terminal: bool) -> Callable[[bytes], bytes]:
    """How a rank's line is written: raw to a pipe or a file (as its log holds it), through the
    panes' filter to a terminal, so that nothing a rank prints drives the terminal of whoever reads
    its logs (a clipboard write, a title, a clear screen); colours are kept."""
    return clean_console if out_is_terminal else bytes


def _rank_lines(prefix: bytes, shown: Callable[[bytes], bytes], lines: list[bytes]) -> Iterator[bytes]:
    """What `logs` prints of a rank's lines: the rank's own, as its log files hold them; not the
    lines ranktop added to its pane (a restart's separator: `--events` has the restarts)."""
    return (prefix + shown(line) + b"\n" for line in lines if type(line) is not RanktopLine)


def _prefixes(run_id: str, ranks: list[tuple[int, int]], only: int | None) -> dict[int, bytes] | int:
    """{local rank: its `[rank]:` prefix} for the (local rank, rank) pairs `--rank` keeps: the rank
    its lines are prefixed with (a node of several has ranks 8-15, say, whose `[12]:` lines took
    --rank 4); the usage error's status for a --rank the run does not have."""
    kept = {local: f"[{rank}]:".encode() for local, rank in ranks if only is None or rank == only}
    if only is not None and not kept:
        numbers = sorted(rank for _, rank in ranks)
        has = f"the ranks of {run_id} are {numbers[0]}..{numbers[-1]}" if numbers else f"{run_id} has no ranks"
        return usage_error(f"bad --rank {only}: {has}")
    return kept


def _print_final_logs(view: FinalEngine, only: int | None) -> int:
    """An ended run whose engine has gone, from its log files: each rank's stdout.log on stdout and
    its stderr.log (where a traceback is) on stderr, the last MiB of each, prefixed as the engine's
    output is, as a headless run showed them; then one line saying where all of it is."""
    snap = view.snapshot()
    prefixes = _prefixes(clean(snap.run_id), [(r.local_rank, r.rank) for r in snap.ranks], only)
    if isinstance(prefixes, int):
        return prefixes
    sys.stdout.flush()
    for stream, lines_of in ((sys.stdout, lambda r: view.output_since(r, None)[1]), (sys.stderr, view.stderr_tail)):
        out, shown = stream.buffer, _shown(stream.isatty())
        for local, prefix in prefixes.items():
            _write(out, (prefix + shown(line) + b"\n" for line in lines_of(local)))
    for local, name, why in view.left_out:  # (a rank may have swapped its own log for a FIFO, a link)
        if local in prefixes:
            rank = next((r.rank for r in snap.ranks if r.local_rank == local), local)
            print_err(clean(f"ranktop: {snap.run_id}: rank {rank}'s {name} was left out: {why}"))
    of_attempt = f" of attempt_{snap.attempt}, the last of {snap.attempt + 1} attempts" if snap.attempt else ""
    print_err(f"ranktop: {final_words(view)}: that was the last MiB of each rank's stdout.log and stderr.log"
              f"{of_attempt}; all its log files are under {clean(snap.log_dir or '?')}")
    return 0


def _print_logs(conn: Connection, run: ServedRun, only: int | None, follow: bool, events: bool = False) -> int:
    ranks = run.snapshot.get("ranks") or []
    prefixes = _prefixes(clean(run.run_id), [(r["local_rank"], r["rank"]) for r in ranks], only)
    if isinstance(prefixes, int):
        return prefixes
    if attempt := run.snapshot.get("attempt"):  # the rings hold the running attempt's output only
        print_err(clean(f"ranktop: {run.run_id} is on attempt_{attempt}: the output of earlier attempts is in their "
                        f"log files under {run.snapshot.get('log_dir')}"))
    out, shown = sys.stdout.buffer, _shown(sys.stdout.isatty())
    unshown = _Unshown(run, {r["local_rank"]: r["rank"] for r in ranks})
    if follow:  # what the ranks' rings hold, then live, pushed by the engine until the run ends
        conn.subscribe(sorted(prefixes))  # (RunGone here: nothing printed yet, as for the connection's)
        return _follow(conn, run, only, prefixes, events, unshown)
    asking = _Asking(conn, run.path)
    try:
        for local, prefix in prefixes.items():
            cursor = (-1, 0)
            while True:
                answer, lines, _open = asking.output(local, *cursor)
                cursor, before = (answer["generation"], answer["line"]), cursor
                unshown.took({**answer, "rank": local})
                _write(out, _rank_lines(prefix, shown, lines))
                if not answer.get("more") or cursor == before:  # (an engine that says "more" and gives none: no loop)
                    break
    except RunGone as gone:
        if isinstance(gone, (EngineSilent, EngineRefused)):
            raise
        return _connection_ended(run, only, gone, printed=unshown.took_any, follow=False)
    finally:
        asking.close()
        unshown.say_totals()  # (a running rank's ring can move on between two answers, too)
    return 0


class _Asking:
    """`logs`' requests, on a new connection where the engine ended the one it had but still
    answers: it drops a client that asked nothing for a while, as `logs | less` does while the
    person reads (its ring moved on meanwhile: _Unshown counts what went by)."""

    def __init__(self, conn: Connection, path: str) -> None:
        self.first, self.conn, self.path = conn, conn, path

    def output(self, local: int, generation: int, line: int) -> tuple[dict, list[bytes], list[bytes]]:
        try:
            return self.conn.output(local, generation, line)
        except EngineSilent:
            raise
        except RunGone:
            if not engine_answers(self.path):
                raise
        self.close()
        self.conn = Connection(self.path)
        return self.conn.output(local, generation, line)

    def close(self) -> None:
        if self.conn is not self.first:  # (the first is the caller's to close)
            self.conn.close()


def _follow(conn: Connection, run: ServedRun, only: int | None, prefixes: dict[int, bytes], events: bool,
            unshown: _Unshown) -> int:
    """`logs -f` once subscribed: each push as it comes, then how the run ended, on stderr (over
    SSH nothing else would tell), or that its engine was lost before the end, exit 1."""
    out, shown = sys.stdout.buffer, _shown(sys.stdout.isatty())
    try:
        for message, lines in conn.pushed():
            if message["type"] == "ended":
                unshown.say_totals()
                print_err(clean(f"ranktop: {run.run_id} has ended ({message.get('state')}, exit status "
                                f"{message.get('exit_status')}); its log files are under {_log_dir(run)}"))
                return 0
            if events and message["type"] == "event":  # JSON escapes every control character: safe to show
                _write(out, [b"[ranktop]:" + json.dumps(message["event"]).encode() + b"\n"])
            if lines and (prefix := prefixes.get(message.get("rank"))) is not None:  # (a rank it was not asked for)
                unshown.took(message)
                _write(out, _rank_lines(prefix, shown, lines))
        return 0  # (not reached: pushes end with "ended", or RunGone when the engine leaves)
    except RunGone as gone:
        unshown.say_totals()  # (before the last line, as at the end)
        return _connection_ended(run, only, gone, printed=unshown.took_any, follow=True)
    finally:
        unshown.say_totals()


def _log_dir(run: ServedRun) -> str:
    return clean(str(run.snapshot.get("log_dir") or "?"))


def _connection_ended(run: ServedRun, only: int | None, gone: RunGone, *, printed: bool, follow: bool) -> int:
    """What `logs` says where its connection ended before the end of what it was printing: that
    the engine dropped this client (the run goes on), or how the run ended, from the final.json
    its engine left (it had ended as logs came, or logs -f took nothing for a while at the end
    and was not waited for: the "ended" push never came); with nothing printed yet, the ended
    run's output from its log files, as `logs` of an ended run prints it. Its exit status."""
    if isinstance(gone, Dropped) or engine_answers(run.path):  # this connection ended, not the engine
        why = f" ({gone})" if isinstance(gone, Dropped) else ""
        again = run_command("logs", run.run_id, *(["-f"] if follow else []))
        print_err(clean(f"ranktop: {run.run_id}: the run's engine ended this connection{why}; the run goes on, and "
                        f"{again} {'follows' if follow else 'prints'} it again"))
        return 1
    try:
        view = final_view_of(run.snapshot.get("log_dir"), run.snapshot.get("final_seal"))
    except NotEnginesFinal as planted:  # as if there were none: how the run ended is unknown
        print_err(clean(f"ranktop: {run.run_id}: {planted}"))
        view = None
    if view is None:  # killed before the end: how the run ended is unknown, as attach says
        print_err(clean(f"ranktop: {run.run_id}: lost the run's engine before its end ({gone}); its log files are "
                        f"under {_log_dir(run)}"))
        return 1
    try:
        if not printed:
            return _print_final_logs(view, only)
        snap = view.snapshot()
        print_err(clean(f"ranktop: {run.run_id} has ended ({snap.state.value}, exit status {snap.exit_status}); its "
                        f"engine left before logs took all of its output: the rest is in its log files under "
                        f"{snap.log_dir}"))
        return 0
    finally:
        view.close()


class _Unshown:
    """The lines of each rank that `logs` never got: its ring keeps the newest lines only, so
    those that went by before logs asked (or between two pushes, under a burst) are gone from it.
    The printed lines alone cannot show the hole, so stderr says how many and where all of them
    are: at a rank's first hole, and in all at the end where it had more than one."""

    def __init__(self, run: ServedRun, ranks: dict[int, int]) -> None:
        self.run_id, self.log_dir = clean(run.run_id), clean(str(run.snapshot.get("log_dir") or "?"))
        self.ranks = ranks  # {local rank: its rank}
        self.expected: dict[int, tuple[int, int]] = {}  # {local rank: (generation, the line due next)}
        self.missed: dict[int, int] = {}
        self.said: dict[int, int] = {}

    @property
    def took_any(self) -> bool:
        """Whether lines of any rank were taken (and printed)."""
        return bool(self.expected)

    def took(self, head: dict) -> None:
        """Count the hole before the lines of an output answer or push (`rank`: the local rank)."""
        local, generation, after, count = (head.get(k) for k in ("rank", "generation", "line", "lines"))
        if not all(protocol.is_whole(n) for n in (generation, after, count)):  # (a push is not checked as an answer is)
            return
        due_generation, due = self.expected.get(local, (generation, 0))
        first = after - count  # (a new generation, a restart, starts over from its line 0)
        hole = first - (due if due_generation == generation else 0)
        self.expected[local] = (generation, after)
        if hole > 0:
            self.missed[local] = self.missed.get(local, 0) + hole
            if local not in self.said:
                self._say(local, "")

    def say_totals(self) -> None:
        for local, missed in self.missed.items():
            if missed > self.said.get(local, 0):
                self._say(local, "in all ")

    def _say(self, local: int, in_all: str) -> None:
        self.said[local] = missed = self.missed[local]
        print_err(f"ranktop: {self.run_id}: {missed} lines of rank {self.ranks.get(local, local)} {in_all}were not "
                  f"shown: the engine keeps each rank's newest lines only, and these went by before logs took them; "
                  f"all of them are in the log files under {self.log_dir}")
