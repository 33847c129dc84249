"""The Textual app around one LocalAgent, and `run_tui`, the CLI's entry point for the TUI.

The agent's monitor loop runs in a background thread; the app only reads snapshots and sends
commands. The exit status is the headless one (0 / 1 / 128+N); quitting while ranks run stops
them with the shutdown grace and exits 130, as an interrupted headless run would.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Iterable
from typing import Any

from ranktop.tui.commands import help_groups, palette_commands
from ranktop.tui.main_screen import MainScreen
from ranktop.tui.panes import LogView
from ranktop.tui.screens import ConfirmQuit, HelpScreen
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

QUIT_STATUS = 128 + signal.SIGINT  # the user interrupted the run from the TUI
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class RanktopApp(App):
    """One live pane per rank of `agent`. Starts `agent.run()` in a thread when mounted."""

    CSS_PATH = "app.tcss"
    TITLE = "ranktop"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
    ]

    def __init__(self, agent: Any, *, exit_on_end: bool = False) -> None:
        super().__init__()
        self.agent = agent
        self.exit_on_end = exit_on_end
        self.result: Any = None  # the agent's RunResult once run() returned
        self.error: BaseException | None = None
        self.user_quit = False  # the user asked to quit while ranks ran
        self._exit_when_ended = exit_on_end
        self._runner = threading.Thread(target=self._run_agent, name="ranktop-agent", daemon=True)
        self.main: MainScreen | None = None

    # ----- the agent thread -------------------------------------------------------------------
    def _run_agent(self) -> None:
        try:
            self.result = self.agent.run()
        except BaseException as exc:  # shown to the user rather than lost in a thread
            self.error = exc

    @property
    def agent_done(self) -> bool:
        return self._runner.ident is not None and not self._runner.is_alive()

    def on_mount(self) -> None:
        self._runner.start()
        if getattr(self.agent, "rendezvous", None) is None:  # a rendezvous may take minutes: show it
            self.agent.wait_started(timeout=5.0)  # a spawn takes milliseconds; the panes want rings
        self.main = MainScreen(self.agent)
        self.push_screen(self.main)

    def group_ended(self) -> None:
        """Called by the main screen once the agent's run returned."""
        if self.error is not None:
            self.notify(f"ranktop failed: {self.error!r}", severity="error", timeout=30)
        elif self.result is not None and self.result.rendezvous_error:
            self.notify(self.result.rendezvous_error, severity="error", timeout=30)
        if self._exit_when_ended:
            self.exit(self.exit_status)

    @property
    def exit_status(self) -> int:
        if self.result is None:
            return 1
        if self.user_quit and self.result.stop_signal is None:
            return QUIT_STATUS
        return self.result.exit_status

    # ----- stopping ---------------------------------------------------------------------------
    def stop_on_signal(self, signum: int) -> None:
        """SIGTERM/SIGHUP/SIGINT to ranktop: the agent's rule, as headless (forwarded with the
        grace, then SIGKILL; a repeated SIGHUP/SIGTERM within a second is the same event, only a
        second SIGINT kills at once), and leave as soon as the ranks are gone."""
        self._exit_when_ended = True
        if signum == signal.SIGHUP:
            _detach_terminal()
        self.agent.handle_signal(signum)  # records 128+N and wakes the agent's loop
        if self.agent_done:
            self.call_later(self.exit, self.exit_status)

    def action_quit(self) -> None:
        if self.agent_done:
            self.exit(self.exit_status)
            return
        if self.user_quit:  # a second q while stopping: do not wait for the grace
            self.agent.kill_group()
            return
        alive = sum(1 for r in self.agent.snapshot().ranks if r.state.alive)
        if not alive:
            self._stop_and_exit()
            return
        self.push_screen(ConfirmQuit(alive, self.agent.shutdown_timeout),
                         lambda yes: yes and self._stop_and_exit())

    def _stop_and_exit(self) -> None:
        self.user_quit = True
        self._exit_when_ended = True
        self.agent.stop(signal.SIGTERM)
        if self.main is not None:
            self.main.note = "stopping… (q again: kill now)"
            self.main.tick()

    def on_unmount(self) -> None:
        # Whatever ended the app (an exception, a test leaving its context), no rank outlives it.
        if self._runner.is_alive():
            self.agent.stop(signal.SIGTERM)
            self._runner.join(self.agent.shutdown_timeout + 5.0)
            if self._runner.is_alive():
                self.agent.kill_group()
                self._runner.join(10.0)

    # ----- help and palette -------------------------------------------------------------------
    def _sections(self, screen: Screen | None = None) -> list[tuple[str, Any, tuple[str, ...]]]:
        main = self.main
        sections: list[tuple[str, Any, tuple[str, ...]]] = []
        if main is not None:
            sections.append(("Ranks", main, ("copy_text",)))
            log = main.pane(main.current).log if main.is_mounted else None
            if log is not None:
                # The screen's arrow keys take precedence over the log's: do not list what never fires.
                sections.append(("Pane output", log, ("scroll_up", "scroll_down", "scroll_left", "scroll_right")))
        sections.append(("App", self, ()))
        return sections

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen(help_groups(self, self._sections())))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from palette_commands(self, self._sections(screen))
        yield from super().get_system_commands(screen)


def _detach_terminal() -> None:
    """The terminal hung up: send what Textual still writes (its shutdown sequence) to /dev/null,
    so a write to the dead terminal cannot wedge its writer thread and keep us from exiting."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            os.dup2(devnull, fd)
        except OSError:
            pass
    os.close(devnull)


def _tui_agent(spec: Any, ns: argparse.Namespace, color: bool) -> tuple[Any, Any]:
    from ranktop.core.agent import LocalAgent

    try:
        from ranktop.core.stats import StatsSampler
    except ImportError:  # stats are optional: titles show '-' without them
        StatsSampler = None  # noqa: N806
    sampler = StatsSampler() if StatsSampler is not None else None
    agent = LocalAgent(spec, log_dir=ns.log_dir, log_line_prefix_template=ns.log_line_prefix_template,
                       shutdown_timeout=ns.shutdown_timeout, stall_timeout=ns.stall_timeout or 60.0,
                       console=False, color=color, sampler=sampler,
                       faulthandler=not getattr(ns, "no_faulthandler", False))
    if sampler is not None:
        sampler.attach(agent)
    return agent, sampler


def run_tui(spec: Any, ns: argparse.Namespace) -> int:
    """Run `spec` under the TUI; returns the exit status headless would have returned."""
    no_color = os.environ.get("NO_COLOR") is not None
    if no_color:  # Textual consumes NO_COLOR; the ranks must still see it
        spec = dataclasses.replace(spec, env={**spec.env, "NO_COLOR": os.environ["NO_COLOR"]})
    agent, sampler = _tui_agent(spec, ns, color=not no_color)
    app = RanktopApp(agent, exit_on_end=getattr(ns, "exit_on_end", False))
    previous = {sig: signal.signal(sig, lambda signum, _frame: app.stop_on_signal(signum)) for sig in _STOP_SIGNALS}
    try:
        app.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if sampler is not None:
            sampler.close()
    if app.error is not None:
        raise app.error
    if app.result is not None and app.result.rendezvous_error and app.result.stop_signal is None:
        print(f"ranktop: error: {app.result.rendezvous_error}", file=sys.stderr)  # the TUI is gone now
    return app.exit_status


__all__ = ["LogView", "RanktopApp", "run_tui"]
