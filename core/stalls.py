"""Stall and prompt detection: when a rank last spoke, how long it has been silent, and the
stall_detected / stall_cleared / waits_for_input events (with the agent's on_stalls hook) that the
monitor loop raises from it on each pass.

The monitor loop owns a StallWatch and is the only thread that changes it, with one exception:
`hold` (the agent's `hold_stall_clock`), which the thread that is about to have ranks print their
stacks calls (the engine's stack dumps never run in the loop). It sets whole entries of
`_dump_holds`, one dict item each, which the GIL makes atomic; the loop only reads them, and a
hold only moves the time a rank counts as having last spoken (to before its dump)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ranktop.core.events import EventLog
from ranktop.core.prompts import PROMPT_LOOK
from ranktop.core.state import RankSnapshot

SUSPENDED_GAP = 2.0  # seconds a monitor pass may come late before ranktop counts as having been stopped
# Seconds a rank reported stalled that ends on its own may take to have its pipes read to their
# end: its last lines tell whether it spoke again before it ended (a helper that holds them open
# costs this wait once).
END_DRAIN = 0.2


class StallWatch:
    """A rank is stalled once it printed nothing for `timeout` seconds (None: never). It holds no
    reference to its agent: what it needs of the agent's comes with each call."""

    def __init__(self, timeout: float | None, events: EventLog,
                 on_stalls: Callable[[list[RankSnapshot]], None] | None, sampler: Any) -> None:
        self.timeout = timeout
        self._events = events
        # Called once a pass with what the pass reported (stalls, prompts), so that a caller's
        # line about all of them comes after the pass's last, not between two ranks' lines.
        self._on_stalls = on_stalls
        self._sampler = sampler  # core.stats.StatsSampler or None
        # Local ranks reported stalled -> when to look again whether one waits for input (monotonic;
        # None once it was said to): a rank may reach its prompt after it was reported stalled.
        self._stalled: dict[int, float | None] = {}
        # Local ranks reported stalled -> when each had last spoken as it was (None: never): one
        # that ends has spoken again if it printed after that.
        self._quiet_since: dict[int, float | None] = {}
        self._drain_until: float | None = None  # (monotonic) the end of this pass's wait for ended ranks' pipes
        # When the monitor last passed (monotonic), and since when ranks may count as silent (wall
        # time): a pass far later than its wait means ranktop itself was stopped (Ctrl-Z, SIGSTOP)
        # or the machine slept, and the ranks' silence meanwhile is not theirs (`note_gap`).
        self._last_pass: float | None = None
        self._silence_from = 0.0
        # local rank -> (pid, its last output before a stack dump we asked for, until when the
        # dump's own lines may come): a dump does not count as the rank speaking
        self._dump_holds: dict[int, tuple[int, float | None, float]] = {}

    def new_group(self) -> None:
        """The group starts (again): no rank of it was reported stalled."""
        self._stalled.clear()
        self._quiet_since.clear()

    def check(self, slots: Sequence[Any], snapshot: Callable[[Any, float], RankSnapshot],
              global_rank: Callable[[int], int]) -> None:
        """One monitor pass: report the ranks that went silent, clear those that spoke again, and
        look whether a stalled rank has come to wait for input. `snapshot(slot, now)` is the
        agent's rank snapshot."""
        self._drain_until = None  # (a new pass: rank_ended's wait starts again)
        timeout = self.timeout
        now = time.time()
        reported: list[RankSnapshot] = []
        for slot in slots:
            r = slot.local_rank
            silent = self.silent_for(slot, now)
            # (a rank being stopped is quiet because of that: a stall said then, its line `no output
            # for 0s`, came for every rank that took its grace to end, and at a pdb prompt)
            if slot.alive and silent >= timeout and r not in self._stalled and not slot.being_stopped:
                snap = snapshot(slot, now)
                # A short stall time beat the sampler's second look: "cpu -" tells nothing. (A rank
                # at a prompt is reported without its cpu: it waits for someone to type.)
                if snap.cpu_percent is None and not snap.input_prompt and silent < timeout + self._cpu_wait():
                    continue
                self._stalled[r] = None if snap.input_prompt else time.monotonic() + PROMPT_LOOK
                self._quiet_since[r] = self.spoke_at(slot)
                self._events.write("stall_detected", rank=snap.rank, local_rank=r, silent_s=round(silent, 1),
                                   input_prompt=snap.input_prompt, cpu_percent=snap.cpu_percent,
                                   gpu_util=snap.gpu.util_percent if snap.gpu else None)
                reported.append(snap)
            elif r in self._stalled and (silent < timeout or not slot.alive):
                del self._stalled[r]
                self._quiet_since.pop(r, None)
                if slot.alive:  # (an ended rank's stall was answered as it ended: rank_ended)
                    self._events.write("stall_cleared", rank=global_rank(r), local_rank=r)
            elif (look := self._stalled.get(r)) is not None and time.monotonic() >= look:
                snap = snapshot(slot, now)
                if self._prompt_after_stall(slot, silent, snap):
                    reported.append(snap)
        if reported and self._on_stalls:
            self._on_stalls(reported)

    def rank_ended(self, slots: Sequence[Any], local_rank: int, rank: int) -> bool:
        """A rank's process ended; its `exited` event is written next. A rank reported stalled
        that printed since is cleared first (`stall_cleared`), as the next pass would have done
        had it lived to it; True when it ended still stalled, which its `exited` event says. So
        each stall_detected is answered: a rank that printed and ended within one monitor pass of
        its report left its stall open."""
        if local_rank not in self._stalled:
            return False
        del self._stalled[local_rank]
        quiet_since = self._quiet_since.pop(local_rank, None)
        slot = slots[local_rank]
        if not slot.stopped_by_us:  # (ranks we stop end by the dozen: none waits on another's pipes)
            slot.proc.output_drained(self._drain_left())
        if (self.spoke_at(slot) or 0.0) > (quiet_since or 0.0):
            self._events.write("stall_cleared", rank=rank, local_rank=local_rank)
            return False
        return True

    def _drain_left(self) -> float:
        """What is left of END_DRAIN for this monitor pass: one wait for all the ranks that end in
        it, whose pipes the output thread reads meanwhile. It was END_DRAIN for each, in turn, in
        the pass that reaps them (the context's lock held): where a child held a rank's pipes
        open, 64 stalled ranks ending at once held commands and a stop 12.8 s."""
        now = time.monotonic()
        if self._drain_until is None:
            self._drain_until = now + END_DRAIN
        return max(0.0, self._drain_until - now)

    def _prompt_after_stall(self, slot: Any, silent: float, snap: RankSnapshot) -> bool:
        """A rank reported stalled that has come to wait for input since (its own input() after a
        long silent step): said once, as a stall at a prompt is. True when it is to be said."""
        r = slot.local_rank
        if not snap.input_prompt:
            self._stalled[r] = time.monotonic() + PROMPT_LOOK
            return False
        self._stalled[r] = None
        self._events.write("waits_for_input", rank=snap.rank, local_rank=r, silent_s=round(silent, 1),
                           input_prompt=snap.input_prompt)
        return True

    def _cpu_wait(self) -> float:
        """How long a stall's report may wait for the rank's cpu% (two samples of the sampler;
        past that, the sampler cannot read the rank and the report goes without it)."""
        return 2.5 * self._sampler.interval if self._sampler is not None else 0.0

    def note_gap(self, idle: float) -> None:
        """A monitor pass `SUSPENDED_GAP` later than its wait of `idle`: ranktop was stopped (Ctrl-Z
        on a headless run, or the TUI's; SIGSTOP) or the machine slept. Its ranks ran on, and what
        they printed meanwhile waited in their pipes: their silence is counted from now, where
        `fg` used to bring `rank 1 stalled: no output for 6s`."""
        now = time.monotonic()
        if self._last_pass is not None and now - self._last_pass > idle + SUSPENDED_GAP:
            self._silence_from = time.time()
            self._events.write("ranktop_suspended", seconds=round(now - self._last_pass, 1))
        self._last_pass = now

    def silent_for(self, slot: Any, now: float) -> float:
        """Seconds since the rank last printed (since it started, if it never did, or since it
        was restarted: the ring holds the previous process's output too; or since ranktop was
        back from a suspension)."""
        return now - max(self.spoke_at(slot) or 0.0, slot.proc.started_at, self._silence_from)

    def spoke_at(self, slot: Any) -> float | None:
        """When the rank last printed, leaving out the stack dumps we asked it for."""
        last = slot.ring.last_output_at
        hold = self._dump_holds.get(slot.local_rank)
        if hold is None or slot.proc is None or hold[0] != slot.proc.pid:
            return last
        _pid, before, until = hold
        return before if last is not None and last <= until else last

    def hold(self, slots: Sequence[Any], local_ranks: Iterable[int], seconds: float) -> None:
        """We are about to make these ranks print their stacks (SIGUSR1): output in the next
        `seconds` is the dump, not the rank speaking, and must not clear a stall. Called from the
        thread that dumps (see the module's docstring)."""
        until = time.time() + seconds
        for r in local_ranks:
            slot = slots[r]
            if slot.proc is not None:
                self._dump_holds[r] = (slot.proc.pid, self.spoke_at(slot), until)
