"""The Textual app around one Engine.

The app knows only the Engine interface (core/engine.py): `run_tui` (tui/run.py) starts a
LocalEngine (the agent's monitor loop in a thread of its own) and hands it over; the app reads
snapshots and submits commands. The exit status is the headless one (0 / 1 / 128+N); quitting
while ranks run stops them with the shutdown grace and exits 130, as an interrupted headless run
would.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from ranktop.core import collector
from ranktop.core import commands as cmd
from ranktop.core.engine import Engine
from ranktop.core.signals import NOTICE_SIGNALS
from ranktop.core.state import GroupSnapshot, GroupState
from ranktop.tui.bounded_regex import BoundedPattern
from ranktop.tui.cells import drawable
from ranktop.tui.commands import help_groups, palette_commands
from ranktop.tui.detach import detach_terminal, terminal_alive, terminal_hung_up
from ranktop.tui.driver import PASTED_ESC, hangup_aware
from ranktop.tui.main_screen import MainScreen
from ranktop.tui.pager import end_pager
from ranktop.tui.panes import ACTS_ON_RANKS, CalmFooter, LogView, alive_count, can_act, read_only
from ranktop.tui.screens import (
    SCREEN_KEYS,
    SIDEWAYS,
    ConfirmQuit,
    HelpScreen,
    Palette,
    RootCausePanel,
    SignalPicker,
    panel_says_rendezvous_error,
)
from ranktop.tui.sender import Answered, CommandSender
from textual import events, on
from textual.actions import ActionParseResult, parse
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.dom import DOMNode
from textual.notifications import Notify
from textual.screen import Screen

QUIT_STATUS = 128 + signal.SIGINT  # the user interrupted the run from the TUI
# A dialog's keys besides its own answers (the help lists them when ? is asked in it; the
# palette leaves them out: keys, not commands).
DIALOG_EXTRAS = ("pick", "help", "help_quit", *SCREEN_KEYS)
# Textual's own palette commands that ours cover: its Quit (ours asks before stopping ranks; it
# ran the same action under a second name), its Keys panel (? lists every key of every screen),
# its Maximize / Minimize (z zooms a pane). Its Theme and Screenshot stay: nothing of ours does that.
TEXTUALS_COVERED = frozenset({"Quit", "Keys", "Maximize", "Minimize"})


def pasted_text(text: str) -> str:
    """A paste (the terminal's bracketed paste, into a box: `i`, `/`, `g`, the palette) as safe text:
    its line breaks as `\\n`, its escape sequences dropped and its other controls shown as symbols,
    as the panes show a rank's output. Textual's Input took it as it came and drew it raw: a pasted
    `ESC ] 52 ; c ; ... ESC \\` wrote the terminal's clipboard, `ESC [ 2 J` cleared the screen, and
    `i` typed a pasted Ctrl-C or Ctrl-S into a --pty rank's terminal, whose line discipline acted on it
    (SIGINT to the rank; its output stopped). An ESC in it comes as PASTED_ESC (see TerminalInput)."""
    return drawable(text.replace(PASTED_ESC, "\x1b").replace("\r\n", "\n").replace("\r", "\n"), newlines=True)


def tui_exit_status(snap: GroupSnapshot, user_quit: bool) -> int:
    """The TUI's exit status for a run that ended as `snap` says, local or attached: the headless
    one, and 130 when the person at this TUI stopped it (not a signal to ranktop)."""
    if snap.exit_status is None:
        return 1
    if user_quit and snap.stop_signal is None:
        return QUIT_STATUS
    return snap.exit_status


class RanktopApp(App):
    """One live pane per rank of a running `engine` (already started)."""

    CSS_PATH = "app.tcss"
    TITLE = "ranktop"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("ctrl+c", "help_quit", "Stop and quit, as q (twice: kill now)", show=False, system=True),
        # As in any full-screen program: the raw terminal sends Ctrl-Z as a key, not as SIGTSTP.
        Binding("ctrl+z", "suspend_process", "Suspend to the shell (fg: back)",
                show=False),
    ]

    def __init__(self, engine: Engine, *, exit_on_end: bool = False, metric: BoundedPattern | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.metric = metric
        self.exit_on_end = exit_on_end
        self.user_quit = False  # the user asked to quit while ranks ran
        self.detached: str | None = None  # why the TUI left a run that goes on ("SIGHUP", "key")
        self.can_detach = False  # q may leave the run going (run_tui set up a process to hold it)
        self.not_served: str | None = None  # why the run has no socket (ls, attach and detach lack it)
        self.attached = False  # a client of a run served elsewhere (ranktop attach): detaching is leaving
        # run_tui carries the run on if the app fails (a bug of ours must not end a training run)
        self.outlives_failure = False
        self._exit_when_ended = exit_on_end
        self.main: MainScreen | None = None
        self._frame_shown = False  # the first frame is up (Ready)
        self._leave_when_ready: Callable[[], object] | None = None  # a hang-up came before it was
        self._hung_up = False  # the terminal hung up (its stderr now /dev/null)
        self._sender = CommandSender(engine.submit, self._deliver)

    def send(self, command: cmd.Command, answered: Answered | None = None, at_once: bool = False) -> None:
        """Hand `command` to the engine without waiting here for its answer (a stop or a group
        restart waits on the rendezvous's store, and what comes after it waits for it:
        tui/sender.py); `answered(ack)` runs in this thread once it comes. `at_once`: a kill now,
        past what waits to be sent."""
        self._sender.send(command, answered, at_once)

    def _deliver(self, answered: Answered, ack: cmd.Ack) -> None:
        """From the sender's thread: `answered(ack)` in the app's."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the app has left
                loop.call_soon_threadsafe(answered, ack)

    @property
    def offers_detach(self) -> bool:
        """Whether q may leave the run going. An attached client always can: that is detaching, for it."""
        return self.can_detach or self.attached

    @property
    def ended(self) -> bool:
        return self.engine.snapshot().ended

    async def run_action(self, action: str | ActionParseResult, default_namespace: DOMNode | None = None,
                         namespaces: Mapping[str, DOMNode] | None = None) -> bool:
        """Textual's, but a key the footer shows dimmed (check_action None: not now) still answers,
        where its node says why (answer_dimmed): Textual runs no disabled action, so the key, or
        the palette's command, did nothing at all, and said nothing."""
        if await super().run_action(action, default_namespace, namespaces):
            return True
        answer = getattr(default_namespace, "answer_dimmed", None)
        if answer is None:
            return False
        namespace, name, parameters = parse(action) if isinstance(action, str) else action
        return not namespace and answer(name, parameters)

    def get_default_screen(self) -> Screen:
        # The main screen is the bottom of the stack itself, not pushed over Textual's blank
        # default: that one was laid out, resized and painted for nothing before the first frame.
        self.main = MainScreen(self.engine, metric=self.metric)
        return self.main

    def on_mount(self) -> None:
        self.call_after_refresh(collector.release)  # the first frame ends start-up
        self.app_resume_signal.subscribe(self, self._redraw_after_suspend)

    def _redraw_after_suspend(self, _app: object) -> None:
        """Back from Ctrl-Z (`fg`): the terminal shows the shell's screen, and Textual repaints
        only what changed since, which left the panes' title row blank. Every widget again."""
        for widget in self.screen.walk_children():
            widget.refresh()
        self.screen.refresh(layout=True)

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Paste) and not event.is_forwarded:
            event.text = pasted_text(event.text)
        if isinstance(event, events.Key) and not event.is_forwarded and await self._grid_key(event):
            return
        await super().on_event(event)

    async def _grid_key(self, event: events.Key) -> bool:
        """A key typed at a rank's pane, acted on now, in the order the keys came: whether one of
        its bindings took it. Textual acts on a priority binding (the grid's arrows, n, N, V) as
        its key arrives, but on any other only once the key has gone to the focused pane and
        back, after the keys queued behind it: `x ↓ enter` typed in one go (or while the TUI was
        busy drawing) moved the focus to the rank below before x opened the picker, and sent
        SIGINT to that rank; `q n` left the quit question up, and `/` then `need` opened the
        stack view. A pane has no keys of its own but its bindings (no key_ methods, no typing),
        so nothing is lost by not sending the key through it."""
        main = self.main
        check = getattr(self, "_check_bindings", None)  # (Textual's own; without it, its usual way)
        if check is None or main is None or self.screen is not main or not isinstance(self.focused, LogView):
            return False
        self.app_focus = True  # (as Textual's own handling of a key does)
        return await check(event.key, priority=True) or await check(event.key)

    def on_ready(self) -> None:
        self._frame_shown = True
        if self.not_served:
            # It quotes an OS error, and a path in it (XDG_RUNTIME_DIR): plain, safe text, never markup.
            self.notify(drawable(f"{self.not_served}; q cannot detach it"), title="not served", severity="warning",
                        timeout=15, markup=False)
        if self._leave_when_ready is not None:
            self._leave_when_ready()

    @on(MainScreen.GroupEnded)
    def group_ended(self, event: MainScreen.GroupEnded) -> None:
        if not self.screen_stack:  # the app is closing (its screens gone): an end reported meanwhile has no view
            return
        # Nothing is left to act on: every open view's footer drops those keys (a stack view
        # opened while the run went on offered its SIGUSR1 fallback after the end).
        for screen in self.screen_stack:
            for footer in screen.query(CalmFooter):
                footer.hide(ACTS_ON_RANKS)
        # The questions the end made moot close, as the stdin box does: the quit question asked
        # about ranks that are gone (its `y` then closed it and did nothing: no end came after),
        # and the picker's signal could only be refused. The final view shows instead.
        if isinstance(self.screen, (ConfirmQuit, SignalPicker)):
            self.screen.dismiss(None)
        if event.snapshot.error is not None:
            # The error may quote rank-supplied text: shown as plain, safe text, never as markup.
            self.notify(drawable(f"ranktop failed: {event.snapshot.error}"), severity="error", timeout=30,
                        markup=False)
        elif event.snapshot.rendezvous_error and not panel_says_rendezvous_error(event.snapshot):
            # (where the end panel says it, a toast of the same words covered the panel's text for 30 s)
            self.notify(drawable(event.snapshot.rendezvous_error), severity="error", timeout=30, markup=False)
        if self._exit_when_ended:
            self.exit(self.exit_status)

    @property
    def exit_status(self) -> int:
        return tui_exit_status(self.engine.snapshot(), self.user_quit)

    def get_driver_class(self) -> type:
        return hangup_aware(super().get_driver_class(), self._terminal_lost)

    def _terminal_lost(self) -> None:
        """A write to the terminal failed (from Textual's writer thread): it is gone, though no
        SIGHUP came (the shell ignored it). Leave as on one: a local run goes on detached."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the app is leaving anyway
                loop.call_soon_threadsafe(self.stop_on_signal, signal.SIGHUP)

    # ----- stopping ---------------------------------------------------------------------------
    def stop_on_signal(self, signum: int) -> None:
        """SIGTERM/SIGINT to ranktop: the engine's rule, as headless (forwarded with the grace,
        then SIGKILL; only a second SIGINT kills at once), and leave as soon as the ranks are gone.
        SIGHUP (the terminal went away) detaches instead: the TUI leaves, the run goes on. A
        pager `o` opened is ended first: the TUI waited for it, however long, to act on either."""
        if signum not in NOTICE_SIGNALS:
            end_pager()
        if signum == signal.SIGTERM and (self._hung_up or terminal_hung_up()):
            # The terminal has hung up: this SIGTERM is its shell's, which sends its stopped jobs
            # (a TUI suspended with Ctrl-Z) SIGHUP and SIGTERM as it goes. The SSH link dropped;
            # nobody asked for a stop.
            signum = signal.SIGHUP
        if signum == signal.SIGHUP:
            if not terminal_alive():  # else (the waiting parent killed, a kill -HUP) Textual restores it
                self._hung_up = self._hung_up or terminal_hung_up()  # (stderr is /dev/null from here on)
                detach_terminal()
            if self.not_served is not None:
                # Detached, nothing could reach it (no socket): a hang-up stops it, as torchrun's does.
                self.engine.submit(cmd.Interrupt(signum))
                self.leave_when_ended()
                return
            # A run still going is detached; one already over has nothing left to reach but
            # its final.json, so ranktop just leaves.
            self.detached = None if self.main is not None and self.main.ended else "SIGHUP"
            leave = partial(self.exit, self.exit_status if not self.detached else 0)
            if self._frame_shown:
                self.call_later(leave)
            else:  # leaving while the first screen mounts broke its layout (a traceback on screen)
                self._leave_when_ready = leave
            return
        if signum in NOTICE_SIGNALS:  # for the ranks (Slurm's requeue notice): the run goes on
            self.engine.submit(cmd.Interrupt(signum))
            return
        self.engine.submit(cmd.Interrupt(signum))  # answered at once: safe from a signal handler
        self.leave_when_ended()

    def leave_on_signal(self, signum: int) -> None:
        """SIGTERM, SIGQUIT or a SIGHUP whose terminal lives (a kill -HUP) to a view that holds no
        run (`ranktop attach`, an ended run's final view): it leaves as `d` does, the run going on
        (a client stops a run only when asked), and gives the terminal back, exit 128+N. With
        their default actions it died in the TUI's alternate screen, mouse reporting on and the
        cursor hidden. A hang-up of a terminal that is gone ends it as before: nothing is left to
        give back, and writing there could only fail."""
        if signum == signal.SIGHUP and not terminal_alive():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        # A pager `o` opened is ended first, as stop_on_signal ends it: the TUI waits on it, and
        # the signal was acted on only once the user quit the pager.
        end_pager()
        leave = partial(self.exit, None, 128 + signum)
        if self._frame_shown:
            self.call_later(leave)
        else:  # leaving while the first screen mounts broke its layout (as for a hang-up above)
            self._leave_when_ready = leave

    def leave_when_ended(self) -> None:
        """A stop was asked for: leave once the group has ended. (No snapshot here: this runs in
        signal handlers, and it may take locks the interrupted code holds. If the screen already
        saw the end, leave now; if not, it will, and GroupEnded leaves then.)"""
        self._exit_when_ended = True
        if self.main is not None and self.main.ended:
            self.call_later(self.exit, self.exit_status)

    def action_quit(self) -> None:
        snap = self.engine.snapshot()
        if snap.ended:
            self.exit(self.exit_status)
            return
        if read_only(self):  # it can stop nothing, so there is nothing to ask: leaving is all q does
            self.exit(0)
            return
        if self.user_quit:  # a second q while stopping: do not wait for the grace
            self.send(cmd.KillGroup(), at_once=True)
            return
        if self.main is not None and self.main.group_stop_taken and snap.state == GroupState.STOPPING:
            # K's stop is under way: q leaves once it is over (q again kills now). It asked `Stop
            # them (SIGTERM, SIGKILL after 10 s) and quit?` of ranks stopping, their SIGKILL nearer.
            self._quit_once_stopped()
            return
        alive = alive_count(snap)
        if not alive and not self.attached and snap.state == GroupState.STOPPING:
            # Nothing runs and a stop is under way: there is nothing left to ask about. No rank
            # running is not enough: between two attempts (a failure's restart, an R) and while a
            # rendezvous round forms the run goes on, and q stopped it without a word, its restart
            # with it, where the question would have offered to detach.
            self._stop_and_exit()
            return
        self.push_screen(ConfirmQuit(alive, snap.shutdown_timeout, can_detach=self.offers_detach), self._quit_answer)

    def _quit_answer(self, answer: str | None) -> None:
        if answer == "stop":
            self._stop_and_exit()
        elif answer == "detach":
            self.detached = None if self.attached else "key"  # (an attached client holds no run)
            self.exit(0)

    def _stop_and_exit(self) -> None:
        if self.main is not None and self.main.ended:  # over meanwhile: nothing to stop, no end to wait for
            self.exit(self.exit_status)
            return
        self._quit_once_stopped()
        self.send(cmd.Stop(signal.SIGTERM), self._stop_answered)

    def _quit_once_stopped(self) -> None:
        self.user_quit = True
        self._exit_when_ended = True
        if self.main is not None:
            self.main.note = "stopping… (q again: kill now)"

    def _stop_answered(self, ack: cmd.Ack) -> None:
        """q's stop refused (an attached view whose engine did not answer of late refuses it
        without sending it) said so nowhere: the header said `stopping…` while the ranks ran on.
        It says why (MainScreen.stop_answered), and q asks again."""
        if self.main is not None and self.main.stop_answered(ack):
            self.user_quit = self._exit_when_ended = False

    def action_help_quit(self) -> None:
        """Ctrl-C (Textual's key for it; with text selected it copies instead): what torchrun
        users expect, as q: ask, then stop with the grace. A second Ctrl-C kills at once."""
        if isinstance(self.screen, ConfirmQuit):  # Ctrl-C twice: stop, and do not wait for the grace
            self.pop_screen()
            self._stop_and_exit()
            self.send(cmd.KillGroup(), at_once=True)
            return
        self.action_quit()

    def _handle_exception(self, error: Exception) -> None:
        # Textual's end for an unhandled exception (its traceback is printed once the screen is
        # restored). Decided here, before on_unmount would close the engine: where run_tui can
        # carry the run on, the app leaves it going, as a detach does.
        if self.outlives_failure and self.detached is None and not self.engine.snapshot().ended:
            self.detached = "failed"
        super()._handle_exception(error)

    def on_delivery_complete(self, event: events.DeliveryComplete) -> None:
        """The palette's Screenshot, saved: where, said as plain text. Textual's own toast read
        the path as markup: a run id such as `exp[lr=3e-4]` raised a MarkupError that ended the
        TUI and stopped the run, and one such as `x[b]` lost `[b]` from the path it named."""
        if event.name != "screenshot":
            return
        event.prevent_default()  # (Textual's handler, App's, comes after ours: it is not run)
        where = f" to {str(event.path)!r}" if event.path is not None else ""
        self.notify(drawable(f"Saved screenshot{where}"), title="Screenshot", markup=False)

    def on_notify(self, event: Notify) -> None:
        """One toast for the same words: an earlier one still shown goes, the new one has the full
        time. Keys pressed after the end (x k r R K i) each said `the group has ended: ...`, and at
        80x24 six of them stacked over most of the screen."""
        new = event.notification
        unnotify = getattr(self, "_unnotify", None)  # (Textual's own, private: without it, they stack as before)
        if unnotify is None:
            return
        for shown in list(self._notifications):
            if shown is not new and (shown.message, shown.title, shown.severity) == (new.message, new.title,
                                                                                        new.severity):
                unnotify(shown)

    def on_unmount(self) -> None:
        # Whatever ended the app (an exception, a test leaving its context), no rank outlives it;
        # only a lost terminal leaves the run going (run_tui serves and waits for it).
        self._sender.close()
        if not self.detached:
            self.engine.close()

    # ----- help and palette -------------------------------------------------------------------
    def _sections(self, palette: bool = False) -> list[tuple[str, Any, tuple[str, ...]]]:
        main = self.main
        acting = () if can_act(self) else ACTS_ON_RANKS  # keys that would do nothing here
        sections: list[tuple[str, Any, tuple[str, ...]]] = []
        if main is not None:
            hidden = ("copy_text", "quit", "help", *acting) + (("digit",) if palette else ())
            sections.append(("Ranks", main, hidden))
            log = main.pane(main.current).log if main.is_mounted else None
            if log is not None:
                # The screen's arrow keys and n/N take precedence over the log's: do not list what never fires.
                sections.append(("Pane output", log, ("scroll_up", "scroll_down", "scroll_left", "scroll_right",
                                                     "search_next", "search_prev")))
            if main.is_mounted and not palette:  # (its keys scroll what has the focus: no palette entries)
                panel = main.query_one(RootCausePanel)
                sections.append(("End report (E)", panel, SIDEWAYS))  # (its lines wrap)
        sections.append(self._app_section())
        if not palette:  # the other screens' keys too (the palette runs actions: only the ones here)
            sections += self._other_screens()
        return sections

    def _app_section(self) -> tuple[str, Any, tuple[str, ...]]:
        return ("App", self, () if can_act(self) else ("help_quit",))  # (^c leaves, as q, when nothing can be stopped)

    def _other_screens(self) -> list[tuple[str, Any, tuple[str, ...]]]:
        """Each other screen's own keys (those of the widgets in it are listed when ? is asked there)."""
        # What each has besides its answers (DIALOG_EXTRAS) is listed by ? there: here they would
        # push the last sections out of a 160x48 help.
        sections: list[tuple[str, Any, tuple[str, ...]]] = []
        if can_act(self):  # (a read-only or ended view neither offers x nor asks before q)
            question = ConfirmQuit(0, 0.0, can_detach=self.offers_detach)
            sections = [SignalPicker(0, 0, 1).key_sections(DIALOG_EXTRAS)[0], question.key_sections(DIALOG_EXTRAS)[0]]
        try:
            from ranktop.tui.stacks_view import StacksScreen
        except ImportError:
            return sections
        from ranktop.tui.details import RankDetails
        from ranktop.tui.metric import Tracker

        details = RankDetails(self.engine, Tracker(self.engine, None), 0).key_sections(DIALOG_EXTRAS)[0]
        # Its commands; its keys that move about in it (the tree's, the groups', the sideways
        # ones) are listed when ? is asked there.
        stacks = StacksScreen(self.engine).key_sections((*self._stack_view_hidden(), "tree"))[0]
        return [stacks, details, *sections]

    def _stack_view_hidden(self) -> tuple[str, ...]:
        return ("copy_text",) if can_act(self) else ("copy_text", *ACTS_ON_RANKS)  # (u, its SIGUSR1 fallback)

    def action_command_palette(self) -> None:
        """Textual's, with the palette whose page keys survive a terminal too short for its list."""
        if self.use_command_palette and not Palette.is_open(self):
            self.push_screen(Palette(id="--command-palette"))

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        sections = self._sections()
        here: list[tuple[str, Any, tuple[str, ...]]] = []
        screen = self.screen
        if hasattr(screen, "key_sections"):  # the stack view, a dialog: every key that works there first
            here = screen.key_sections(() if screen.is_modal else self._stack_view_hidden())
            sections = here + [section for section in sections if section[0] != here[0][0]]
        self.push_screen(HelpScreen(help_groups(self, sections), here=max(1, len(here))))

    def _palette_sections(self, screen: Screen) -> list[tuple[str, Any, tuple[str, ...]]]:
        """What the palette runs over `screen`: the grid's commands on the grid; elsewhere that
        screen's own, not the grid's, which would act unseen below it."""
        if not hasattr(screen, "key_sections"):
            return [] if screen.is_modal else self._sections(palette=True)
        if screen.is_modal:  # a dialog
            return screen.key_sections(DIALOG_EXTRAS)[:1]
        hidden = (*self._stack_view_hidden(), "tree", "focus_next", "focus_previous")  # keys, not acts
        return [screen.key_sections(hidden)[0], self._app_section()]  # the stack view, and the app's

    def deliver_screenshot(self, filename: str | None = None, path: str | None = None,
                           time_format: str | None = None) -> str | None:
        """The palette's Screenshot, saved in the run's directory, beside its logs: Textual's
        ~/Downloads is seldom there on a training box, and it said no more than `Failed to save
        screenshot`. (The current directory where the run's is not a directory here.)"""
        if path is None:
            run_dir = self.engine.snapshot().log_dir
            path = run_dir if run_dir and os.path.isdir(run_dir) else os.getcwd()
        return super().deliver_screenshot(filename, path, time_format)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from palette_commands(self, self._palette_sections(screen))
        if isinstance(screen, MainScreen):  # one "Focus rank N" per rank that exists, not per digit key
            for snap in screen.last.ranks:
                yield SystemCommand(f"Focus rank {snap.rank}", f"local rank {snap.local_rank} · keys: its number, or g",
                                    partial(screen.focus_rank, snap.local_rank))
        yield from (c for c in super().get_system_commands(screen) if c.title not in TEXTUALS_COVERED)


__all__ = ["LogView", "RanktopApp"]
