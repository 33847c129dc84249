"""`run_tui`, the command line's TUI run: the engine starts the ranks first, then Textual loads.

Importing Textual and the app takes longer than starting the ranks (0.13-0.23 s on a 2-core
box), so the ranks start before it, as `ranktop attach` connects before it: the ranks' own
start-up and the TUI's overlap. Nothing here imports Textual until the ranks run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from typing import Any

from ranktop.core import collector
from ranktop.core import commands as cmd
from ranktop.core.limits import TUI_STALL_TIMEOUT
from ranktop.core.sanitize import clean
from ranktop.core.signals import DUPLICATE_WINDOW, NOTICE_SIGNALS, InterruptPairs, take_early_stops
from ranktop.core.state import GroupSnapshot
from ranktop.tui.detach import PASSED_ON_INTERRUPT, Detacher, detach_terminal, from_the_background, terminal_alive
from ranktop.tui.usage import run_command

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def run_tui(spec: Any, ns: argparse.Namespace, detacher: Detacher | None = None) -> int:
    """Run `spec` under the TUI; returns the exit status headless would have returned."""
    no_color = os.environ.get("NO_COLOR") is not None
    if no_color:  # Textual consumes NO_COLOR; the ranks must still see it
        spec = dataclasses.replace(spec, env={**spec.env, "NO_COLOR": os.environ["NO_COLOR"]})
    engine, sampler = _tui_engine(spec, ns, color=not no_color)
    relay = _SignalRelay(engine)
    previous = relay.install(getattr(ns, "signals_to_handle", ()))
    server = None
    try:
        engine.start()
        from ranktop.tui.cli import serve_run

        server, problem = serve_run(engine)
        from ranktop.tui.app import RanktopApp  # Textual loads while the ranks start

        app = RanktopApp(engine, exit_on_end=getattr(ns, "exit_on_end", False), metric=getattr(ns, "metric", None))
        relay.hand_to(app)
        app.can_detach = detacher is not None and server is not None
        app.outlives_failure = True
        app.not_served = problem  # (its line on stderr is behind the TUI's screen)
        if server is not None:
            server.shown = True
        try:
            app.run()
        except Exception as error:  # (whatever Textual let out: the run goes on)
            _escaped(app, error)
        if server is not None:
            server.shown = False
        collector.release()  # (if the app never got to its first frame)
        failed = app.detached == "failed"
        if failed:
            _say_the_tui_failed(getattr(app, "_exception", None), engine, app.can_detach)
        if app.detached and (app.can_detach or not failed):
            _run_detached(engine, server, getattr(ns, "linger", 600.0), app.detached, detacher, relay)
        elif failed:
            _run_without_a_screen(engine, relay)
    finally:
        engine.close()
        if server is not None:
            server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sampler.close()
    if engine.error is not None:
        raise engine.error
    print_end_report(engine.snapshot())
    return app.exit_status if app.detached != "failed" else app.exit_status or 1  # never 0 after a traceback


class _SignalRelay:
    """The TUI run's handler of stop and notice signals: the app's once it is up; before that
    (while Textual loads) each is kept for the app, and the ranks get all but a hang-up at once;
    once the app has gone (detached, or failed), the engine's. A SIGINT that reached this process
    both itself and through the waiting parent is one, and so is a hang-up's SIGTERM that comes
    after the app has gone."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.app: Any = None
        self.early: list[int] = []  # signals that came while Textual loaded
        self.to_engine = False  # the app has gone: each signal is the engine's alone
        self.interrupts = InterruptPairs()
        self.hangup_at: float | None = None  # when the last SIGHUP came (monotonic)

    def __call__(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if signum in (signal.SIGINT, PASSED_ON_INTERRUPT):
            if self.interrupts.is_other_half(signum == PASSED_ON_INTERRUPT, now):
                return
            signum = signal.SIGINT
        if signum == signal.SIGHUP:
            self.hangup_at = now
        if self.to_engine:
            if signum == signal.SIGTERM and self.hangup_at is not None and now - self.hangup_at < DUPLICATE_WINDOW:
                # The SIGTERM a shell sends its stopped jobs with the SIGHUP as its terminal goes,
                # passed on by the waiting parent after the app, which took the first for the
                # hang-up's, had gone: it stopped the run that the hang-up had detached.
                signum = signal.SIGHUP
            self.engine.submit(cmd.Interrupt(signum))  # (answered at once: safe from a signal handler)
            return
        if self.app is not None:
            self.app.stop_on_signal(signum)
            return
        self.early.append(signum)
        if signum != signal.SIGHUP:  # the ranks get it at once, as from the app (a second Ctrl-C kills)
            self.engine.submit(cmd.Interrupt(signum))  # (answered at once: safe from a signal handler)

    def install(self, extra: tuple[int, ...]) -> dict[int, Any]:
        """Handle the stop signals, `extra` and the notices; returns the handlers they had."""
        # QUIT stops as TERM does; USR1/USR2 always (passed on where listed, else noted: never fatal)
        handled = dict.fromkeys((*_STOP_SIGNALS, PASSED_ON_INTERRUPT, *extra, *NOTICE_SIGNALS))
        previous = {sig: signal.signal(sig, self) for sig in handled}
        for signum in take_early_stops(handled):  # as PID 1: they came before these handlers (the agent's thread takes none)
            self(signum, None)
        return previous

    def hand_to(self, app: Any) -> None:
        """The app takes the signals from now on, and acts on those that came before."""
        self.app = app
        for signum in self.early:  # the ranks have had them: the app leaves, or detaches, as it would have
            if signum == signal.SIGHUP:
                app.stop_on_signal(signum)
            elif signum not in NOTICE_SIGNALS:
                app.leave_when_ended()


def _tui_engine(spec: Any, ns: argparse.Namespace, color: bool) -> tuple[Any, Any]:
    from ranktop.core.agent import LocalAgent
    from ranktop.core.engine import LocalEngine
    from ranktop.core.stats import StatsSampler
    from ranktop.tui.cli import shared_run_id

    sampler = StatsSampler()
    agent = LocalAgent(spec, log_dir=ns.log_dir, log_line_prefix_template=ns.log_line_prefix_template,
                       shutdown_timeout=ns.shutdown_timeout, stall_timeout=ns.stall_timeout or TUI_STALL_TIMEOUT,
                       console=False, color=color, sampler=sampler,
                       faulthandler=not getattr(ns, "no_faulthandler", False),
                       numbered_run_dir=shared_run_id(ns) is not None,  # job42.1 beside a node's job42
                       log_dir_name="--log-dir",
                       duplicate_filters={1: tuple(getattr(ns, "duplicate_stdout_filters", ())),
                                          2: tuple(getattr(ns, "duplicate_stderr_filters", ()))})
    engine = LocalEngine(agent)
    sampler.attach(engine)
    return engine, sampler


def print_end_report(group: GroupSnapshot) -> None:
    """The TUI is gone: leave what headless would have said (and the success line) in the
    terminal, so the root cause and the run directory outlive the screen."""
    from ranktop.core.report import report_after_tui

    if group.ended:
        report = report_after_tui(group)
        if report:
            with from_the_background():
                print(clean(report, sgr=True, newlines=True), file=sys.stderr, flush=True)


def _run_detached(engine: Any, server: Any, linger: float, reason: str, detacher: Detacher | None,
                  relay: _SignalRelay) -> None:
    """The TUI is gone (its terminal hung up, or the user detached); the ranks run on until they
    end or a stop comes (`ranktop stop`, SIGTERM), and the terminal is let go."""
    run_id = server.run_id if server is not None else engine.agent.run_id  # its name in ranktop ls
    if reason == "key" or terminal_alive():  # (a hang-up where the terminal lives: the parent killed)
        # (q offers detach only where the run is served)
        with from_the_background():
            print(f"ranktop: run {run_id} goes on in the background (pid {os.getpid()}); "
                  f"{run_command('attach', run_id)} shows it again, {run_command('stop', run_id)} ends it",
                  file=sys.stderr, flush=True)
    detach_terminal(stdin=True)  # Textual has stopped reading it: the dead terminal is nothing of ours now
    # Each signal is the engine's from now on: a later SIGHUP is noted in events.jsonl and the run
    # goes on. (Not SIG_IGN: ranks the run starts from now on would inherit it through exec and be
    # deaf to a hang-up of their own.)
    engine.submit(cmd.Detach(reason))
    relay.to_engine = True
    try:
        os.setsid()  # out of the terminal's session: its later hang-ups and job control are not ours
    except OSError:  # a process group leader already (no detacher fork): stdio is gone anyway
        pass
    if detacher is not None:
        detacher.release(failed=reason == "failed")  # the shell gets its prompt back
    while not engine.ended:
        engine.wait(1.0)  # in slices: the signal handlers run between them
    if server is not None:
        server.linger(linger)  # clients still see the end; `ranktop stop` lets it go


def _escaped(app: Any, error: Exception) -> None:
    """An error that came out of app.run() (Textual met another as it closed, after the first it
    handled): printed as Textual prints one, and the app taken as failed, as for that first, so
    that its run goes on (it was a raw traceback, and the run stopped by the exit)."""
    import traceback

    with from_the_background():
        traceback.print_exception(error, file=sys.stderr)
    if app.detached is None and app.outlives_failure and not app.engine.snapshot().ended:
        app.detached = "failed"
    if getattr(app, "_exception", None) is None:
        app._exception = error  # (named in the line that says the TUI failed)


def _say_the_tui_failed(error: BaseException | None, engine: Any, detaching: bool) -> None:
    """Under Textual's traceback: the TUI failed, but the run it showed goes on (a bug of ours
    must not end a training run)."""
    what = clean(f"{type(error).__name__}: {error}" if error is not None else "an error")[:200]
    where = "" if detaching else (f"here without a screen until its ranks end (Ctrl-C stops it); its output "
                                  f"is in the log files under {clean(str(engine.snapshot().log_dir))}")
    with from_the_background():
        print(f"ranktop: the TUI failed ({what}; its traceback is above): the run goes on {where}".rstrip(),
              file=sys.stderr, flush=True)


def _run_without_a_screen(engine: Any, relay: _SignalRelay) -> None:
    """The TUI failed where the run cannot be detached (not served, or no waiting parent to give
    the prompt back): it goes on in the foreground, its output in its log files, until its ranks
    end or a stop signal stops it as headless (a second Ctrl-C kills)."""
    relay.to_engine = True
    while not engine.ended:
        engine.wait(1.0)  # in slices: the signal handlers run between them
