"""A fake Engine for TUI tests that check rendering and keys, not real ranks: it holds a group
picture the test sets, serves output lines the test appends, and records every command the UI
submits (applying the few effects a screen shows: pause, kill, stop). Tests that need real
processes, pipes or signals use LocalEngine instead."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time

from ranktop.core import commands as cmd
from ranktop.core.engine import OutputCursor
from ranktop.core.state import GroupSnapshot, GroupState, RankSnapshot, RankState, RootCause


class FakeEngine:
    def __init__(self, n: int = 2, *, name: str = "fake.py", world_size: int | None = None) -> None:
        now = time.time()
        self.lines: dict[int, list[bytes]] = {r: [] for r in range(n)}
        self.commands: list[cmd.Command] = []  # in the order they were applied
        self.asked: list[cmd.Command] = []  # in the order they reached submit(), before its lock
        self.events: list[str] = []  # events.jsonl lines, as a test adds them
        self.closed = False
        self._lock = threading.Lock()
        ranks = tuple(RankSnapshot(rank=r, local_rank=r, pid=1000 + r, state=RankState.RUNNING, exitcode=None,
                                   signal_name=None, restarts=0, started_at=now, ended_at=None, last_output_at=None,
                                   output_version=0) for r in range(n))
        self.group = GroupSnapshot(name=name, role="default", run_id="fake", state=GroupState.RUNNING,
                                   world_size=world_size or n, local_world_size=n, node_rank=0, nnodes=1, attempt=0,
                                   max_restarts=0, started_at=now, ended_at=None, log_dir="/tmp/fake-run",
                                   ranks=ranks, shutdown_timeout=3.0)

    # ----- what a test does -----------------------------------------------------------------------
    def print(self, local_rank: int, *lines: str) -> None:
        with self._lock:
            self.lines[local_rank].extend(line.encode() for line in lines)
            self._set_rank(local_rank, last_output_at=time.time(),
                           output_version=self.group.ranks[local_rank].output_version + 1)

    def set_rank(self, local_rank: int, **changes) -> None:
        with self._lock:
            self._set_rank(local_rank, **changes)

    def end(self, group_state: GroupState, exit_status: int, root_cause: RootCause | None = None,
            group_fields: dict | None = None, **rank_changes) -> None:
        """The end, in one snapshot with `group_fields` (why it ended, say) and the ranks' changes."""
        with self._lock:
            for r in range(len(self.group.ranks)):
                self._set_rank(r, **rank_changes)
            self.group = dataclasses.replace(self.group, state=group_state, ended=True, exit_status=exit_status,
                                             ended_at=time.time(), root_cause=root_cause, **(group_fields or {}))

    def _set_rank(self, local_rank: int, **changes) -> None:
        ranks = list(self.group.ranks)
        ranks[local_rank] = dataclasses.replace(ranks[local_rank], **changes)
        self.group = dataclasses.replace(self.group, ranks=tuple(ranks))

    def start(self) -> FakeEngine:
        return self  # nothing runs: the test moves the picture itself

    # ----- the Engine interface -------------------------------------------------------------------
    def snapshot(self) -> GroupSnapshot:
        with self._lock:
            return dataclasses.replace(self.group, taken_at=time.time())

    def output_since(self, local_rank: int, cursor: OutputCursor | None,
                     tail: int | None = None) -> tuple[OutputCursor, list[bytes], list[bytes]]:
        with self._lock:
            lines = self.lines[local_rank]
            seen = cursor.line if cursor is not None and cursor.generation == self.group.generation else 0
            if tail is not None:
                seen = max(seen, len(lines) - tail)
            version = self.group.ranks[local_rank].output_version
            return OutputCursor(self.group.generation, len(lines), version), lines[seen:], []

    def events_since(self, seen: int) -> tuple[int, list[str]]:
        return len(self.events), self.events[seen:]

    def submit(self, command: cmd.Command) -> cmd.Ack:
        problem = cmd.problem(command, self.group.local_world_size)
        if problem is not None:
            return cmd.Ack(False, problem)
        self.asked.append(command)
        with self._lock:
            self.commands.append(command)
            if isinstance(command, cmd.SignalRank) and command.signal in (signal.SIGSTOP, signal.SIGCONT):
                self._set_rank(command.local_rank, paused=command.signal == signal.SIGSTOP)
            elif isinstance(command, cmd.KillRank):
                self._set_rank(command.local_rank, state=RankState.KILLED, exitcode=-9, signal_name="SIGKILL")
        return cmd.Ack(True, f"fake: {type(command).__name__}")

    def close(self) -> None:
        self.closed = True
