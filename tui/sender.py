"""The commands of the keys that act (x, k, r, R, K, q, Ctrl-C, `i`'s line), which the UI thread
must not wait for: a stop or a group restart in a multi-node run has the engine's monitor loop tell
the other nodes through the rendezvous's store before it answers, the loop answers in order, and a
store that does not answer (the node serving it hung) held the answer, and with it every key and
every frame of the TUI. `CommandSender` hands them to the engine from a thread of its own, one at a
time in the order they were sent, and gives each answer back to the UI's thread; a kill now (a
second q or Ctrl-C) goes at once, past what waits."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from ranktop.core import commands as cmd

Answered = Callable[[cmd.Ack], object]


class CommandSender:
    """`send(command, answered)`: `submit(command)` in the sender's thread; `answered(ack)`, if
    given, through `deliver` (which runs it in the UI's thread). The thread starts with the first
    command and ends at `close()`, once what was sent before has been submitted."""

    def __init__(self, submit: Callable[[cmd.Command], cmd.Ack], deliver: Callable[[Answered, cmd.Ack], None]) -> None:
        self._submit, self._deliver = submit, deliver
        self._queue: queue.SimpleQueue[tuple[cmd.Command, Answered | None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def send(self, command: cmd.Command, answered: Answered | None = None, at_once: bool = False) -> None:
        """`at_once`: ahead of what waits to be sent, in a thread of its own (a kill now: the engine
        cuts its wait for a stop's word short when a kill comes behind it, which it never did
        while the kill waited here for the stop's answer)."""
        if at_once:
            threading.Thread(target=self._submit_one, args=(command, answered), name="ranktop-tui-kill",
                             daemon=True).start()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ranktop-tui-commands", daemon=True)
            self._thread.start()
        self._queue.put((command, answered))

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._submit_one(*item)

    def _submit_one(self, command: cmd.Command, answered: Answered | None) -> None:
        try:
            ack = self._submit(command)
        except Exception as exc:  # noqa: BLE001 - the next command must still be sent
            ack = cmd.Ack(False, f"{type(command).__name__} failed: {exc}")
        if answered is not None:
            self._deliver(answered, ack)
