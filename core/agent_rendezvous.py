"""The agent's part in a multi-node run through torch's rendezvous: joining each round before the
group starts, watching the running round for its end (nodes joining, a node giving up, the store
lost), and, once the ranks are done, the exit barrier, giving up, or serving the store to the
other nodes. LocalAgent inherits these; they run in its monitor loop, on its state: they read
and set the agent's `state`, `spec`, `master_port` and `_node_error`, write its `events`, and
call its `_notice`, `_apply_commands` (a stop while no ranks run) and `_now_under_way`."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ranktop.core.context import PContext, RunProcsResult
from ranktop.core.rendezvous import (
    GAVE_UP_LINGER,
    STOP_COMMAND,
    STORE_CALL_THREAD,
    STORE_SILENT,
    USER_RESTART,
    USER_STOP,
    Done,
    RendezvousFailed,
    RoundEnd,
    RoundWatch,
    StoreCall,
)
from ranktop.core.root_cause import rank_failed
from ranktop.core.state import GroupState, RoundForming

SLOW_WAIT = 2.0  # a rendezvous round that takes longer is said to be waited for (headless)
WORD_WAIT = 2.0  # for a store call the monitor loop makes itself: the word of a user's R, a look (a store answers in milliseconds)
_OWN_PAUSE = 1.0  # a gap between the monitor loop's looks (0.1 s apart) this long: this node itself was paused
_BARRIER_GRACE = 1.0  # past the exit barrier's time-out, the wait for a store call of it that does not return
STOP_WORD_WAIT = 0.5  # for a stopped node's word to its round, which its ranks' signal waits for: a few uncontended store calls


class AgentRendezvous:
    """LocalAgent's rendezvous hooks (a part of it, not a class of its own to make)."""

    def _set_up_rendezvous_state(self) -> None:
        """What the rendezvous rounds and the exit barrier leave for the snapshot and the result."""
        self._watch: RoundWatch | None = None
        self._round_end = None  # a RoundEnd once the watch saw one for the running group
        self._end_note: str | None = None  # the exit barrier's end without every node, in words
        self._waiting: str | None = None  # while a rendezvous round forms: what for (Rendezvous.waiting_words)
        self._was_spare: str | None = None  # the words said while this node waited as a spare
        self._silent_said = False  # while a round forms: its store's silence was said
        self._silent_was: str | None = None  # the wait's words before that
        self._barrier_blocked = False  # the exit barrier was left with its store call still blocked
        self._joining_looked = self._silent_from = 0.0  # the last look while a round forms; this node's own resumption
        self._joining = False  # a round forms, and this node waits for it: the snapshot reads it live
        self._not_formed: RoundForming | None = None  # the round the run ended waiting for, if it did
        self._stop_told = False  # this node's stop was told to its round (it stepped out of it)
        self._step_out: _StepOut | None = None  # that word and step out, until the run's end waited for it

    def _join_round(self) -> bool:
        """Before each start of the group: the next round decides this node's ranks and master."""
        self.state = GroupState.RENDEZVOUS
        self.events.write("rendezvous_joining", rendezvous=self.rendezvous.describe(), attempt=self.attempt)
        waiting = self._waiting = self.rendezvous.waiting_words()
        self._joining = True
        self._now_under_way()
        try:  # headless says so once the wait is not a short one (a TUI shows it at once), unless a spare
            outcome = self._wait_unless_stopped(
                self.rendezvous.next_round, slow=lambda: self._waiting == waiting and self._notice(waiting),
                tick=self._joining_tick)
        finally:
            self._waiting, self._silent_said = None, False
        if outcome is None or isinstance(outcome, RendezvousFailed):  # the end view says which round it was
            # (without its count: a round that timed out has had its nodes step out of it, this one too)
            self._not_formed = dataclasses.replace(self.round_forming(), joined=None)
        self._joining = False
        if outcome is None:
            return False
        if isinstance(outcome, RendezvousFailed):
            self._node_error = str(outcome)
            self.events.write("rendezvous_failed", message=self._node_error)
            return False
        # Only now the last group's end is over: a round that fails (or a stop while it forms)
        # ends the run on that group, whose ranks ranktop stopped for another node's failure are
        # not to blame (they were, `killed by SIGTERM`, once a lost node's next round timed out).
        self._round_end = None
        p = self._asked_spec.fixed_master(outcome)
        self.spec = self.spec.placed(p)
        self.master_port = p.master_port
        self.events.write("rendezvous_joined", round=p.round, group_rank=p.group_rank, nodes=p.group_world_size,
                          base_rank=p.base_rank, world_size=p.world_size, master=f"{p.master_addr}:{p.master_port}")
        last = p.base_rank + self.spec.local_world_size - 1
        ranks = f"rank {last}" if last == p.base_rank else f"ranks {p.base_rank}-{last}"
        self._notice(f"{self.rendezvous.describe()} round {p.round}: this node is group rank {p.group_rank} "
                     f"of {p.group_world_size}, {ranks} of {p.world_size} "
                     f"(master {p.master_addr}:{p.master_port})")
        if odd_size := self.rendezvous.size_not_asked(p.group_world_size):
            self.events.write("rendezvous_size_not_asked", nodes=p.group_world_size)
            self._notice(odd_size)
        return True

    def round_forming(self) -> RoundForming | None:
        """What is known of the round this node is joining (None while it joins none): for the
        snapshot, from any thread, without a store call."""
        if not self._joining:
            return self._not_formed
        number, joined = self.rendezvous.forming()
        return RoundForming(number, joined, self.rendezvous.nodes_needed())

    def _joining_tick(self) -> RendezvousFailed | None:
        """At each look while a round forms: a spare's words, and the store's silence (which the
        spare's words, read from the last state the store gave, do not replace)."""
        if not self._silent_said:
            self._say_if_spare()
        return self._store_silent_while_joining()

    def _store_silent_while_joining(self) -> RendezvousFailed | None:
        """A store that has not answered for STORE_SILENT seconds while the round forms (its node
        paused, hung or cut off) is said once, and after the join time-out of silence the node gives
        up, as the round would have timed out: torch's handler waited in its store call for as long
        as the store's node stayed paused, saying nothing, past its join time-out."""
        now = time.monotonic()
        if now - self._joining_looked > _OWN_PAUSE:  # paused itself: its handler's last read says nothing of the store
            self._silent_from = now
        self._joining_looked = now
        silent = min(self.rendezvous.join_silent_for(), now - self._silent_from)
        if silent < STORE_SILENT:
            if self._silent_said:  # it answers again: the wait is the round's again
                self._silent_said, self._waiting = False, self._silent_was
                self._notice(f"the {self.rendezvous.describe()}'s store{self.rendezvous.endpoint_words()} answers "
                             f"again: {self._waiting}")
            return None
        limit = max(self.rendezvous.join_timeout() or 0.0, STORE_SILENT)
        rdzv, where = self.rendezvous.describe(), self.rendezvous.endpoint_words()
        if silent >= limit:
            return RendezvousFailed(f"the {rdzv} timed out: its store{where} has not answered for {limit:g} s, the "
                                    "join time-out (the node serving it paused, hung or cut off?)")
        if not self._silent_said:
            self._silent_said, self._silent_was = True, self._waiting
            self._waiting = (f"the {rdzv}'s store{where} has not answered for {STORE_SILENT:g} s (the node serving "
                             f"it paused, hung or cut off?): this node waits for it, and gives up after {limit:g} s "
                             "without an answer")
            self.events.write("rendezvous_store_lost", store=f"the {rdzv}'s store{where}", silent=True)
            self._notice(self._waiting)
        return None

    def _say_if_spare(self) -> None:
        """Once the round this node joins turns out full and running: say so, in place of the wait;
        once a spare is taken off the spare list (a node of the round left), the wait is a round's
        again, with its join time-out (torch starts it again then)."""
        words = self.rendezvous.spare_words()
        if words is not None and self._waiting != words:
            self._waiting, self._was_spare = words, words
            self.events.write("rendezvous_spare", message=words)
            self._notice(words)
        elif words is None and self._waiting is not None and self._waiting == self._was_spare:
            self._waiting = waiting = self.rendezvous.waiting_words()
            self.events.write("rendezvous_spare_admitted", message=waiting)
            self._notice(f"no longer a spare: {waiting}")

    def _wait_unless_stopped(self, call: Callable[[], Any], slow: Callable[[], None] | None = None,
                             tick: Callable[[], RendezvousFailed | None] | None = None) -> Any:
        """`call()`'s value, or the RendezvousFailed it raised; None if a stop came first. It runs
        in a thread: a store call blocks for as long as its timeout, and a stop must not wait.
        `slow` is called once if the call takes over SLOW_WAIT seconds, `tick` at each look: a
        RendezvousFailed it returns ends the wait with that failure."""
        store_call = StoreCall(call, RendezvousFailed)
        slow_at = time.monotonic() + SLOW_WAIT
        while not store_call.done.wait(0.1):
            if self._stop_asked():
                return None
            if slow is not None and time.monotonic() >= slow_at:
                slow()
                slow = None
            if tick is not None and (failed := tick()) is not None:
                return failed  # (the call is left blocked: store_call_left_blocked)
        return store_call.outcome(RendezvousFailed(f"the {self.rendezvous.describe()} failed"))

    def _stop_asked(self) -> bool:
        """While no ranks run (a rendezvous round, the exit barrier): take in pending signals and
        commands; stop now?"""
        self._apply_commands()
        return self._stop_requested

    def _start_watch(self) -> None:
        if self.rendezvous is not None:
            self._watch = RoundWatch(self.rendezvous, max(self.spec.monitor_interval, 0.5), self._wake_monitor)

    def _end_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _wake_monitor(self) -> None:
        self._waker.wake()

    def _check_round_end(self, pc: PContext) -> None:
        """While monitoring: nodes waiting to join, a node that gave up, or the loss of the store the
        ranks use too, end the running group."""
        if self._watch is not None and self.rendezvous.look_waited() > STORE_SILENT:
            self.rendezvous.store_not_answering()
        end = self._watch.end if self._watch is not None else None
        if end is None or self._round_end is not None or self._stop_requested:
            return
        self._round_end = end
        self.events.write("round_end", kind=end.kind, message=end.message)
        if end.kind in ("peer_gave_up", "store_lost"):
            closed = f"; the {self.rendezvous.describe()} is closed," if end.kind == "peer_gave_up" else ";"
            self._node_error = f"{end.message}{closed} this node stops"
            self.state = GroupState.STOPPING
        else:  # a peer's failure gets its one line when the restart is decided, as a rank's failure
            if end.kind == "nodes_joined":
                self._notice(f"{end.message}: restarting the group (no restart spent)")
            elif end.kind == "left_behind":
                self._say_left_behind()
            self.state = GroupState.RESTARTING
        pc.stop()

    def _say_left_behind(self) -> None:
        self._notice(f"{self._round_end.message}: stopping its ranks and joining the next round (no restart spent)")

    def _left_behind(self, failed: bool) -> bool:
        """The round went on without this node (its heartbeats lapsed: frozen, cut off): it joins the
        next round, spending no restart, as a node joining late; its ranks did nothing wrong, and a
        node out of restarts would close the rendezvous under the job that went on. Seen by the
        watch, or looked at now where the ranks failed first (their peers gone, as it resumed)."""
        if self.rendezvous is None:
            return False
        if failed and self._round_end is None:
            words = self._store_call_within(self.rendezvous.left_behind, WORD_WAIT)
            if words:
                self._round_end = RoundEnd("left_behind", words)
                self.events.write("round_end", kind="left_behind", message=words)
                self._say_left_behind()
        return self._round_end is not None and self._round_end.kind == "left_behind"

    def _nodes_joined(self, result: RunProcsResult) -> bool:
        """The group ended because nodes joined: stopped by us, not failed on its own, not done."""
        if self._round_end is None or self._round_end.kind != "nodes_joined" or not result.is_failed():
            return False
        return not self._own_failure()

    def _peers_word(self) -> str | None:
        """This node's ranks failed: was it because another node stopped its own for newcomers
        ("nodes_joined", restart free) or for its user's `R` (USER_RESTART), or a real failure
        ("failure": every node spends a restart)? The nodes agree on it; None without a rendezvous,
        or where the store gave no answer within WORD_WAIT (its node paused: the call waited as long
        as it stayed so, and the failure's end, stop signals too, with it)."""
        if self.rendezvous is None:
            return None
        return self._store_call_within(lambda: self.rendezvous.agree_on_end("failure"), WORD_WAIT)

    def _peer_restarted(self) -> bool:
        """Another node's user restarted the group (`R`): this node starts the next attempt too."""
        return self._round_end is not None and self._round_end.kind == "peer_restart"

    def _say_restart_group(self) -> str | None:
        """The user's `R` in a multi-node run: the other nodes learn that it was one, so that each
        starts the next attempt as this one does (TORCHELASTIC_RESTART_COUNT the same on every node),
        spending no restart; their ranks breaking meanwhile is no failure. The word waits WORD_WAIT
        at most: a store that does not answer left `R` unanswered and no stop taken.
        Where another node's word came first (its ranks failed, or it saw nodes join), this node
        takes that word, as every node does: the same attempt and restarts spent everywhere; so
        where the round watch had seen one already. Returns the words for the user then, else None."""
        if self.rendezvous is None:
            return None
        if not self._restart_overtaken():  # (the round watch may have seen it first: then it decides)
            agreed = self._store_call_within(lambda: self.rendezvous.agree_on_end(USER_RESTART), WORD_WAIT)
            if agreed not in ("failure", "nodes_joined", USER_STOP) or self._round_end is not None:
                return None
            where = self.rendezvous.describe()
            self._round_end = (self._peer_stopped_end() if agreed == USER_STOP else
                               RoundEnd("peer_failed", f"another node of the {where} failed") if agreed == "failure"
                               else RoundEnd("nodes_joined", f"nodes joined the {where}"))
            self.events.write("round_end", kind=self._round_end.kind, message=self._round_end.message,
                              overtook="user_restart")
        return f"{self._round_end.message} just before your R: {self._what_follows_the_word()}"

    def _tell_the_round_of_the_stop(self, signum: int | None) -> None:
        """This node's user stopped it (a stop signal `signum`, or a stop command: None) while its
        ranks run: before they stop, the round's other nodes are told (they saw it only as a lost
        node once its keep-alive heartbeats lapsed, 10-15 s with torch's defaults, and an elastic
        job's next round waited as long), and it steps out of the round. Only the word holds the
        ranks' signal, and for STOP_WORD_WAIT at most (a store that does not answer must not hold
        the stop), or until a kill now (a second Ctrl-C): their peers' collectives break once they
        stop, and those nodes must find the word then. The step out, which contends with every
        other node stepping out at once (a whole job stopped), goes on in the background, and the
        run's end waits for it (_step_out_ended). Once a run."""
        placed = self.spec.placement
        if self.rendezvous is None or self._watch is None or self._stop_told or placed is None:
            return
        self._stop_told = True
        if placed.group_world_size < 2:  # nobody to tell
            return
        how = STOP_COMMAND if signum is None else signal.Signals(signum).name
        step_out = self._step_out = _StepOut(self.rendezvous, how)
        in_time = step_out.said.wait_within(STOP_WORD_WAIT, cut_short=self._kill_now_pending)
        step_out.said_first = in_time and step_out.said_it  # (a word the store refused ends the wait too)

    def _step_out_ended(self) -> None:
        """The ranks are gone: wait for the stopped node's step out, until WORD_WAIT after the stop
        began (as long as the word and the step out were given before the ranks got their signal),
        and not at all once a kill now came (a second Ctrl-C: the user wants out now). Its event."""
        step_out, self._step_out = self._step_out, None
        if step_out is None:
            return
        step_out.done.wait_within(WORD_WAIT - step_out.waited(),
                                  cut_short=lambda: self._kill_now_pending() or self._killed_now)
        self.events.write("rendezvous_stepped_out", how=step_out.how, said_first=step_out.said_first,
                          stepped_out=step_out.stepped_out, seconds=round(step_out.waited(), 3))

    def _peer_was_stopped(self) -> None:
        """The group ended with another node's word that its user stopped it (USER_STOP): this
        node's ranks broke for that, or were stopped for it. The restart is spent as for a failure,
        but none of its ranks is to blame, and the words name the node stopped."""
        if self._round_end is not None and self._round_end.kind == "peer_stopped":
            return
        self._round_end = self._peer_stopped_end()
        self.events.write("round_end", kind="peer_stopped", message=self._round_end.message)

    def _peer_stopped_end(self) -> RoundEnd:
        words = (self._store_call_within(self.rendezvous.stopped_words, WORD_WAIT)
                 or f"another node of the {self.rendezvous.describe()} was stopped by its user")
        return RoundEnd("peer_stopped", words)

    def _what_follows_the_word(self) -> str:
        """What the other node's word, taken over the user's `R`, does to this node's run."""
        if self._round_end.kind == "nodes_joined":
            return "the group restarts for that, no restart spent"
        if self.restarts_spent < self.spec.max_restarts:
            return "the group restarts for that, a restart spent, as on every node"
        # (a failure with none left ends the run on every node: the R restarts nothing)
        return f"no restarts are left ({self.restarts_spent} of {self.spec.max_restarts} spent): the run ends for that"

    def _restart_overtaken(self) -> bool:
        """The user's `R` came just after another node's failure or newcomers: that decides."""
        return self._round_end is not None and self._round_end.kind in ("peer_failed", "peer_stopped", "nodes_joined")

    @staticmethod
    def _store_call_within(call: Callable[[], Any], seconds: float,
                           cut_short: Callable[[], bool] | None = None) -> Any:
        """`call()`'s value (a store call that catches its own errors) if it returns within
        `seconds`, and before `cut_short()` says to stop waiting, else None: a store that does not
        answer (its host hung) would hold the monitor loop for the store's time-out. The thread is
        left blocked, if it is, as a stop leaves a round's call (store_call_left_blocked)."""
        store_call = StoreCall(call)
        store_call.done.wait_within(seconds, cut_short)
        return store_call.outcome()

    def _leave_rendezvous(self, state: GroupState) -> None:
        """Success: wait at the exit barrier, then close. Giving up: tell the others, close. A stop
        (signal, user) leaves the rendezvous open: the other nodes may go on without this one."""
        if state == GroupState.SUCCEEDED:
            timeout = self.exit_barrier_timeout
            deadline = time.monotonic() + timeout
            self.state = GroupState.RENDEZVOUS
            end = self._at_exit_barrier(timeout)
            if end is not None:
                self._barrier_not_passed(end, timeout)
            self.state = GroupState.SUCCEEDED
            if end is not None and end.kind == "left_behind":  # the job went on: not ours to close
                if end.serves_store:
                    self._serve_the_others(deadline, timeout)
            elif self._barrier_blocked:  # its call holds the store's client: a close would wait behind it
                pass
            elif end is None or end.kind != "new_round":
                self.rendezvous.close()
            elif not self.rendezvous.elastic():  # the peers' round needs this node: tell them, close
                self._give_up("its ranks had finished when another node's failed, and the next round cannot "
                              "form without it")
            else:  # left open: the others form their round without this node
                self.rendezvous.leave_round()
                if end.serves_store:
                    self._serve_the_others(deadline, timeout)
        elif state == GroupState.FAILED and self._node_error is None:
            cause, spent = self.root_cause, f"no restarts left ({self.restarts_spent} of {self.spec.max_restarts} spent)"
            peer = cause is None and self._round_end is not None and self._round_end.kind in ("peer_failed", "peer_stopped")
            what = ("its ranks were stopped for another node's failure" if peer and self._round_end.kind == "peer_failed"
                    else "its ranks ended as another node's user stopped that node" if peer else
                    _failed_for_the_others(cause) if cause else "its ranks failed")
            others = self._give_up(f"{what}, {spent}")
            self.events.write("rendezvous_closed", reason="gave_up", others=others)
            if peer:  # no rank of ours to show: the one line says why this node ended
                self._node_error = f"{self._round_end.message}, and this node has {spent}"

    def _give_up(self, why: str) -> str | None:
        """rendezvous.give_up, its wait for the others to read why (up to GAVE_UP_LINGER) ended by
        a stop signal. The group has ended: a command meanwhile is answered at once, as after the
        run's end (`ranktop stop` waited 5 s for its answer, and took the engine for silent). Its
        store calls run in a thread: with the node serving the store paused (SIGSTOP, a paused VM),
        one waited as long as it stayed so, the stop signals not taken, and the run's end not
        said. A stop now ends the wait within STOP_WORD_WAIT ("stopped"), and it ends once the
        close's time-out and the linger are over ("store_silent"), the call left blocked."""
        self._stop_accepting()
        stop = threading.Event()
        gave_up = StoreCall(lambda: self.rendezvous.give_up(why, stopped=stop.is_set), Exception)
        bound = time.monotonic() + self.rendezvous.close_timeout() + GAVE_UP_LINGER + WORD_WAIT
        stopped_at = None
        while not gave_up.done.wait(0.1):
            now = time.monotonic()
            if stopped_at is None and self._pending_signals:
                stop.set()
                stopped_at = now
            if stopped_at is not None and now > stopped_at + STOP_WORD_WAIT:
                return "stopped"
            if now > bound:
                return "store_silent"
        outcome = gave_up.outcome()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _stop_heartbeats(self) -> None:
        """Once the run has ended, however it did: a node that lives on (the TUI on its end screen,
        a detached engine lingering) kept telling the others it was there, so a peer whose ranks
        sat in no collective, or waited at the exit barrier, never found it gone, and torch's
        warning for each heartbeat to a lost store was written over the TUI every 5 s. Bounded: the
        keep-alive thread may be in a store call to a paused node, which stopping it waits for."""
        self._store_call_within(self.rendezvous.stop_heartbeats, WORD_WAIT)

    def _at_exit_barrier(self, timeout: float) -> Any:
        """The exit barrier, saying what it waits for: the TUI at once, headless once the wait
        passes SLOW_WAIT (it showed `rendezvous` and nothing else, for up to `timeout` seconds). Its
        store calls run in a thread: one to a paused store's node (SIGSTOP, a paused VM) waits as
        long as it stays paused, and the monitor loop, waiting in it, took no stop signal, no
        command, and met no time-out. A stop now ends the wait within STOP_WORD_WAIT, and the
        time-out within _BARRIER_GRACE of it, the call left blocked (`_barrier_blocked`)."""
        waiting = self._waiting = (f"waiting at the exit barrier for the other nodes of the "
                                   f"{self.rendezvous.describe()} (gives up after {timeout:g} s)")
        began, stop = time.monotonic(), threading.Event()
        barrier = StoreCall(lambda: self.rendezvous.exit_barrier(timeout, stop.is_set), Exception)
        said, stopped_at = False, None
        try:
            while not barrier.done.wait(0.1):
                now = time.monotonic()
                if not said and now > began + SLOW_WAIT:
                    said = True
                    self._notice(waiting)
                if stopped_at is None and self._stop_asked():
                    stop.set()
                    stopped_at = now
                if stopped_at is not None and now > stopped_at + STOP_WORD_WAIT:
                    self._barrier_blocked = True
                    return RoundEnd("stopped", "stopped while waiting")
                if now > began + timeout + _BARRIER_GRACE:
                    self._barrier_blocked = True
                    return self.rendezvous.barrier_timed_out(timeout)
        finally:
            self._waiting = None
        outcome = barrier.outcome()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _serve_the_others(self, deadline: float, timeout: float) -> None:
        """An elastic job whose other nodes form a new round in the store this node serves: leaving
        would take it from under them. Stay until the job ends (the rendezvous closes) or the exit
        barrier's time runs out, saying why."""
        self._waiting = (f"serving the store of the {self.rendezvous.describe()} to the other nodes' new round "
                         f"(gives up after {timeout:g} s)")
        self.state = GroupState.RENDEZVOUS
        try:
            until = self.rendezvous.serve_store(deadline, self._stop_asked)
        finally:
            self._waiting, self.state = None, GroupState.SUCCEEDED
        self.events.write("store_served", until=until)
        if until in ("timeout", "unreadable"):
            why = f"after {timeout:g} s" if until == "timeout" else "as the rendezvous state could not be read"
            self._end_note = (f"exit barrier: stopped serving the {self.rendezvous.describe()}'s store {why}, "
                              "while the other nodes may still use it")
            self._notice(self._end_note)
        elif until == "peers_gone":
            self._end_note = (f"exit barrier: stopped serving the {self.rendezvous.describe()}'s store: no other "
                              "node is left (their keep-alive heartbeats stopped: they ended without closing it)")
            self._notice(self._end_note)

    def _every_node_dropped(self, words: str) -> None:
        """Said by the watch where the store never stopped answering (this node serves it)."""
        self.events.write("rendezvous_every_node_dropped", message=words)
        self._notice(f"this node (or every node) was paused or cut off past the keep-alive limit: {words}")

    def _peers_done(self, words: str) -> None:
        """Said by the watch: torchrun nodes of the round whose heartbeats stopped at their exit
        barrier, not taken for lost (Rendezvous._at_torchruns_exit_barrier)."""
        self.events.write("rendezvous_peers_at_exit_barrier", message=words)
        self._notice(words)

    def _state_refused(self, why: str) -> None:
        """torch's handler read a round state that ranktop kept it from loading (a peer's pickle):
        said once for each such state. While the ranks run it is this line, where torch logged a
        warning at each keep-alive heartbeat that failed for it; while a round forms, the round's
        failure says it."""
        self.events.write("rendezvous_state_refused", message=why)
        if self._watch is not None:
            self._notice(f"{self.rendezvous.describe()}: {why}; it is not read, so this node's keep-alive "
                         "heartbeats and its next round fail while it is there (the ranks run on)")

    def _barrier_not_passed(self, end: Any, timeout: float) -> None:
        """The exit barrier ended without every node (a RoundEnd): the event, and a line unless
        this node was stopped (the stop says so itself)."""
        if end.kind == "timeout":
            self.events.write("exit_barrier_timeout", timeout=timeout)
        else:
            self.events.write("exit_barrier_left", kind=end.kind, message=end.message)
        if end.kind != "stopped":
            closed = f"; the {self.rendezvous.describe()} is closed" if end.kind == "peer_gave_up" else ""
            self._end_note = f"exit barrier: {end.message}{closed}"
            self._notice(self._end_note)

    def _quiet_lost_heartbeats(self) -> Any:
        return self.rendezvous.quiet_lost_heartbeats() if self.rendezvous is not None else contextlib.nullcontext()

    def _no_round_can_form(self) -> bool:
        """The ranks failed with restarts left: can the next round form? Not once the connection to
        the rendezvous's store is broken (its host node gone): torch's TCPStore client never connects
        again, so the round would only fail, and the restart line would promise a restart that cannot
        come. The store is looked at now (the watch may not have looked since it went): a broken
        connection says so at once, while a store that is slow to answer (its host hung), or an
        etcd server that may come back, gets its round tried, as before, after WORD_WAIT at most."""
        if self.rendezvous is None or self._store_call_within(self.rendezvous.connection_broken, WORD_WAIT) is not True:
            return False
        left = self.spec.max_restarts - self.restarts_spent
        self._node_error = (f"not restarted, with {left} restart{'s' * (left != 1)} left: "
                            f"{self.rendezvous.store_lost_words()}, and no new round can form without it")
        self.events.write("group_not_restarted", reason="store_lost", store=self.rendezvous.store_lost)
        return True

    def _store_changed(self, lost: str | None) -> None:
        """The rendezvous's store stopped answering while the ranks run (or answers again): said
        once. torch's keep-alive thread logged a WARNING for each failed heartbeat meanwhile. Found
        lost once the ranks ended (_no_round_can_form's look): the run's end says it."""
        if lost is not None and self._watch is None:
            self.events.write("rendezvous_store_lost", store=lost)
            return
        if lost is None:
            dropped = self.rendezvous.every_node_dropped_unsaid()  # (the store's node was paused past the keep-alive limit)
            self.events.write("rendezvous_store_back", store=self.rendezvous.store_words(), every_node_dropped=bool(dropped))
            self._notice(f"{self.rendezvous.store_words()} answers again" + (
                f", but {dropped}" if dropped else ": keep-alive heartbeats and new rounds can reach it"))
            return
        self.events.write("rendezvous_store_lost", store=lost, silent=self.rendezvous.store_silent)
        if self.rendezvous.store_silent:  # its node paused, or hung: it may answer again, and is not acted on
            self._notice(f"{lost} has not answered for {STORE_SILENT:g} s (the node serving it paused, hung or cut "
                         "off?): this node's ranks run on, and ranktop says when it answers again")
        elif self.rendezvous.ranks_lose_the_store():  # theirs too: stopped once its connection is found broken
            self._notice(f"{self.rendezvous.store_lost_words()}: this node's ranks meet on it too, and are "
                         "stopped if it is found gone")
        else:
            self._notice(f"{self.rendezvous.store_lost_words()}: this node's ranks run on, but no new "
                         "round can form, so a failure of theirs ends the run")


class _StepOut:
    """A stopped node's word to its round, then its step out of it, in a thread of their own
    (named as every store call the monitor loop leaves blocked: store_call_left_blocked): the
    monitor loop waits for `said` before the ranks get their signal, for `done` once they are gone."""

    def __init__(self, rdzv: Any, how: str) -> None:
        self.how = how
        self.said, self.done = Done(), Done()
        self.said_it = self.stepped_out = False
        self.said_first = False  # said before the ranks got their signal (the monitor loop's wait for it)
        self._began = time.monotonic()
        threading.Thread(target=self._run, args=(rdzv,), name=STORE_CALL_THREAD, daemon=True).start()

    def _run(self, rdzv: Any) -> None:
        try:
            self.said_it = rdzv.say_stopped(self.how)
        finally:
            self.said.set()
        try:  # (a word that did not reach the store: neither will the step out)
            self.stepped_out = self.said_it and rdzv.leave_round()
        finally:
            self.done.set()

    def waited(self) -> float:
        """Seconds since the stop began."""
        return time.monotonic() - self._began


def _failed_for_the_others(cause: Any) -> str:
    """The other nodes' words for this node's root cause: `rank 0 failed (exit 1)`, and the user
    action here it followed (`after its user killed rank 1`): a person there reads it."""
    after = f" after its user {cause.user_action_what}" if cause.user_action_what else ""
    return rank_failed(cause) + after


def store_call_left_blocked() -> bool:
    """Is a rendezvous call that a stop walked away from still blocked in torch's store? Then
    finalizing the interpreter aborts the process (std::terminate on a thread still in C++), so a
    command line leaves with os._exit instead."""
    return any(t.name == STORE_CALL_THREAD and t.is_alive() for t in threading.enumerate())
