"""The one interface between the engine and every UI: `Engine`, and `LocalEngine`, the in-process
implementation over a LocalAgent.

A UI reads `snapshot()` (a frozen GroupSnapshot) at its own pace, pulls a rank's output with
`output_since()`, and acts with `submit(command)` (core/commands.py). Everything that crosses the
interface is plain data (values of numbers, strings, bytes and tuples), so the same calls
can be served over a local socket to a UI in another process. Nothing here hands out a live
object: no agent, context, slot, ring or process.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from typing import Any, Protocol

from ranktop.core import commands as cmd
from ranktop.core.state import GroupSnapshot
from ranktop.core.value import Value

SIGNAL_DUMP_SECONDS = 3.0  # how long a SIGUSR1 dump is waited for in the ranks' logs
FIRST_LOOK_LINES = 300  # a new pane first asks for this many newest lines: more than the tallest pane shows
# A tail that asks for every line kept. Asked with it, a rank's lines are made for this look alone
# (a search of every rank), not in its ring, whose output stays as it waits (packed, core/packing.py).
EVERY_KEPT_LINE = 1 << 40


class OutputCursor(Value):
    """Where a reader of one rank's output is: `line` complete lines of attempt `generation` seen
    (line k is the k-th complete line the rank printed in that attempt), at ring `version`."""

    __slots__ = ("generation", "line", "version")

    def __init__(self, generation: int = -1, line: int = 0, version: int = -1) -> None:
        self.generation, self.line, self.version = generation, line, version


class Engine(Protocol):
    """What every UI (the TUI, tests, a future attached client) uses, and all it uses."""

    def snapshot(self) -> GroupSnapshot:
        """A consistent picture of the group now (cheap: a UI takes a few a second)."""
        ...

    def output_since(self, local_rank: int, cursor: OutputCursor | None,
                     tail: int | None = None) -> tuple[OutputCursor, list[bytes], list[bytes]]:
        """(new cursor, complete lines after `cursor` that are still kept, the unfinished last
        line of each stream). The first returned line is number `new.line - len(lines)`: when that
        is past `cursor.line`, lines went by unread; a cursor of another generation (None: none
        yet) starts over from the oldest kept line. `tail`: at most that many of the newest
        lines (a new pane's first screen, before it asks for the rest)."""
        ...

    def events_since(self, seen: int) -> tuple[int, list[str]]:
        """(events so far, the events.jsonl lines of those after the first `seen`, the newest
        few hundred at most): what a served run pushes to its subscribers as it happens."""
        ...

    def submit(self, command: cmd.Command) -> cmd.Ack:
        """Apply one command (a rank signal, a kill, a restart, a stop, a detach, a stack dump) and say how
        it went. A bad command changes nothing and is answered with a one-line reason."""
        ...

    def close(self) -> None:
        """The UI is going away: stop the run if it still runs (with the grace) and wait for it
        to end, bounded."""
        ...


class LocalEngine:
    """The engine in this process: the agent's run() in a thread of its own, behind `Engine`."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self._thread = threading.Thread(target=self._run, name="ranktop-engine", daemon=True)
        self.result: Any = None  # the agent's RunResult, once the run returned
        self.error: BaseException | None = None  # what the run raised instead, if it did
        self._ran_here = False  # run_here() returned

    def start(self, timeout: float = 5.0) -> LocalEngine:
        """Start the run; return once the first attempt's ranks exist (or `timeout` passed)."""
        self._thread.start()
        if getattr(self.agent, "rendezvous", None) is None:  # a rendezvous round may take minutes
            self.agent.wait_started(timeout)
        return self

    def _run(self) -> None:
        try:
            self.result = self.agent.run()
        except BaseException as exc:  # shown to the user through the snapshot, not lost in a thread
            self.error = exc

    def run_here(self) -> Any:
        """Run in the calling thread instead (headless: the main thread, which gets the signals);
        the agent's RunResult, or what it raised."""
        self._run()
        self._ran_here = True
        if self.error is not None:
            raise self.error
        return self.result

    def wait(self, timeout: float | None = None) -> bool:
        """Until the run returned (or `timeout`); whether it has."""
        self._thread.join(timeout)
        return self.ended

    @property
    def ended(self) -> bool:
        return self._ran_here or (self._thread.ident is not None and not self._thread.is_alive())

    # ----- the interface ------------------------------------------------------------------------
    def snapshot(self) -> GroupSnapshot:
        snap = self.agent.snapshot()
        if not self.ended:
            return dataclasses.replace(snap, ended=False, exit_status=None)
        status = self.result.exit_status if self.result is not None else 1
        return dataclasses.replace(snap, ended=True, exit_status=status,
                                   error=None if self.error is None else repr(self.error))

    def output_since(self, local_rank: int, cursor: OutputCursor | None,
                     tail: int | None = None) -> tuple[OutputCursor, list[bytes], list[bytes]]:
        # The one place that reads a rank's ring: what the UI gets is copies of its lines.
        pc = self.agent.pcontext
        if pc is None or not 0 <= local_rank < len(pc.slots):
            return OutputCursor(), [], []
        generation, ring = pc.generation, pc.slots[local_rank].ring
        seen = cursor.line if cursor is not None and cursor.generation == generation else 0
        version, total, lines, open_lines = ring.since(seen, tail)
        return OutputCursor(generation, total, version), lines, open_lines

    def events_since(self, seen: int) -> tuple[int, list[str]]:
        return self.agent.events.since(seen)

    def submit(self, command: cmd.Command) -> cmd.Ack:
        problem = cmd.problem(command, self.agent.spec.local_world_size)
        if problem is not None:
            return cmd.Ack(False, problem)
        if isinstance(command, (cmd.DumpStacks, cmd.SignalDump)):
            return self._stacks(command)
        return self.agent.submit(command)

    def close(self, wait: float | None = None) -> None:
        if not self._thread.is_alive():
            return
        self.agent.submit(cmd.Stop(signal.SIGTERM))
        self._thread.join(self.agent.shutdown_timeout + 5.0 if wait is None else wait)
        if self._thread.is_alive():
            self.agent.submit(cmd.KillGroup())
            self._thread.join(10.0)

    def rank_processes(self) -> dict[int, tuple[int, dict[str, str]]]:
        """For the stats sampler, which runs inside the engine's process: each running rank's pid
        and start environment."""
        return self.agent.rank_processes()

    # ----- stacks -------------------------------------------------------------------------------
    @property
    def redumps(self) -> bool:
        """Whether a stack view may ask for a new dump: not once the run has ended (no rank is
        left to dump: `0 of 4 ranks dumped`); it shows the last dump saved during the run."""
        return not self.ended

    def _stacks(self, command: cmd.DumpStacks | cmd.SignalDump) -> cmd.Ack:
        """Stack dumps read the ranks and change nothing in the group: they run in the caller's
        thread (the TUI's worker, the server's dump thread), never in the monitor loop, which must
        not wait on py-spy. Whatever goes wrong is the Ack: a client waits on that server thread
        for its answer."""
        from ranktop.core import stacks

        if self.ended and isinstance(command, cmd.DumpStacks):
            return self._last_dump()

        ranks = list(command.local_ranks) if command.local_ranks is not None else None
        if isinstance(command, cmd.SignalDump):  # the dump's lines are not the ranks speaking
            every = range(self.agent.spec.local_world_size)
            self.agent.hold_stall_clock(every if ranks is None else ranks, SIGNAL_DUMP_SECONDS + 1.0)
        try:
            if isinstance(command, cmd.DumpStacks):
                report = stacks.dump_agent_stacks(self.agent, ranks, save=command.save,
                                                  native_frames=bool(command.native_frames))
            else:
                report = stacks.signal_agent_report(self.agent, ranks, timeout=SIGNAL_DUMP_SECONDS, save=command.save)
        except Exception as exc:  # the group may be gone mid-dump: an answer, not a traceback
            return cmd.Ack(False, f"stack dump failed: {exc}")
        return cmd.Ack(True, report.summary(), report=report)

    def _last_dump(self) -> cmd.Ack:
        """The last dump saved in the run directory, as a final view shows it."""
        from ranktop.core.client import last_dump_in

        return last_dump_in(self.agent.run_dir, "the run has ended")
