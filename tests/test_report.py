"""How a run ended is told once (core/report.py, core/errors.py): the headless report and the
TUI's root-cause panel show the same evidence, in the same words."""

from __future__ import annotations

import dataclasses
import signal

from ranktop.core.agent import RunResult
from ranktop.core.errors import describe_exit, killed_by
from ranktop.core.report import format_end_report, format_root_cause, report_after_tui, root_cause_lines
from ranktop.core.root_cause import rank_failed
from ranktop.core.state import EarlierAttempts, GroupSnapshot, GroupState, RootCause
from ranktop.tui.screens import root_cause_text

TRACEBACK = "Traceback (most recent call last):\n" + "".join(f'  File "t.py", line {i}, in f{i}\n' for i in range(12)) \
    + "ValueError: boom"


def _cause(**kw) -> RootCause:
    fields = dict(rank=1, local_rank=1, pid=42, exitcode=1, signal_name=None, message="ValueError: boom",
                  traceback=TRACEBACK, timestamp=0.0, error_file="/logs/r/attempt_0/1/error.json",
                  last_lines=("step 9", "about to fail"))
    return RootCause(**{**fields, **kw})


def test_one_wording_for_how_a_process_ended():
    assert describe_exit(3) == "exit code 3" and describe_exit(3, sentence=True) == "exited with code 3"
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(-9, sentence=True) == "was killed by SIGKILL"
    assert killed_by(-int(signal.SIGSEGV)) == "SIGSEGV" and killed_by(0) is None and killed_by(None) is None


def test_headless_report_and_tui_panel_show_the_same_evidence():
    cause = _cause()
    headless = format_root_cause(cause, name="t.py", attempt=0, max_restarts=0)
    panel = root_cause_text(_group(cause)).plain
    for line in root_cause_lines(cause, max_traceback=10, max_tail=6):
        assert line.text in panel, line
    for line in root_cause_lines(cause):
        assert line.indent + line.text in headless, line
    assert "exited with code 1" in headless and "exit code 1" in panel
    # The panel keeps the traceback's last lines and says how many it left out.
    assert "… 4 more traceback lines in error.json" in panel and "more traceback" not in headless


def _group(cause: RootCause) -> GroupSnapshot:
    return GroupSnapshot(name="t.py", role="default", run_id="r", state=GroupState.FAILED, world_size=2,
                         local_world_size=2, node_rank=0, nnodes=1, attempt=0, max_restarts=0, started_at=0.0,
                         ended_at=1.0, log_dir="/logs/r", ranks=(), root_cause=cause)


def test_a_time_no_clock_shows_and_a_signal_that_names_none_are_said_so():
    # Values an ended run's final.json may hold (anyone who could write its directory wrote them).
    for timestamp in (1e300, -1e300, float("nan"), float("inf")):
        cause = _cause(timestamp=timestamp)
        assert "exited with code 1 at an unknown time" in format_root_cause(cause, name="t.py", attempt=0,
                                                                           max_restarts=0)
        assert "exit code 1 at an unknown time" in root_cause_text(_group(cause)).plain
    stopped = dataclasses.replace(_group(None), state=GroupState.STOPPED, stop_signal=99999, ended=True)
    assert report_after_tui(stopped) == "ranktop: stopped by signal 99999; logs in /logs/r"
    assert report_after_tui(dataclasses.replace(stopped, stop_signal=15)) == "ranktop: stopped by SIGTERM; logs in /logs/r"
    # A rank that had failed on its own before the stop is still named, under the stop's words.
    failed_first = report_after_tui(dataclasses.replace(stopped, root_cause=_cause()))
    assert failed_first.startswith("ranktop: t.py failed in attempt_0 (1 of 1 attempts), then was stopped by signal 99999\n"), failed_first
    panel = root_cause_text(dataclasses.replace(stopped, root_cause=_cause())).plain  # the TUI's: the evidence too
    assert "stopped on request after 0:00:01, after rank 1 failed (exit code 1)" in panel and "ValueError: boom" in panel, panel


def test_the_headline_names_the_attempt_as_its_directory_is_named():
    # It counted from 1 ("attempt 2 of 4") where every other view names attempt_1: a reader looked
    # for a directory that is not there. Here the run is on attempt_2 (one of them a user's `R`),
    # whose ranks never started, and the failure was in attempt_1.
    group = dataclasses.replace(_group(_cause(attempt=1)), attempt=2, max_restarts=2, user_restarts=1, ended=True)
    headline = report_after_tui(group).splitlines()[0]
    assert headline == "ranktop: t.py failed in attempt_1 (2 of 4 attempts)", headline
    assert ", attempt_1 (pid 42)" in root_cause_text(group).plain  # the TUI's heading: the same name
    acted = _cause(user_action_what="killed rank 3", user_action="you killed rank 3 at 12:03:04")
    headline = format_root_cause(acted, name="t.py", attempt=0, max_restarts=0, then="stopped by SIGINT").splitlines()[0]
    assert headline == "ranktop: t.py failed after you killed rank 3 in attempt_0 (1 of 1 attempts), then was stopped by SIGINT"


def test_the_earlier_attempts_line_leaves_out_the_attempt_the_root_cause_names():
    """A restart spent on a failure whose next round never formed (the other node lost, the
    rendezvous timed out) leaves the run on an attempt no rank started, the failed one among its
    earlier attempts: the report named it twice, `failed in attempt_0 (1 of 2 attempts)` and
    `earlier attempts: attempt_0: rank 1 failed (exit 1)`. Only the attempts before it are listed,
    and starts of it that ended calmly (restarted for nodes that joined), as the engine words them."""

    def ended_on_a_round_never_formed(cause: RootCause, *before: str) -> GroupSnapshot:
        earlier = EarlierAttempts()
        for words in (*before, f"attempt_{cause.attempt}: {rank_failed(cause)}"):  # (LocalAgent._attempts)
            earlier.add(words)
        return dataclasses.replace(_group(cause), attempt=cause.attempt + 1, max_restarts=cause.attempt + 1, ended=True,
                                   rendezvous_error="the c10d rendezvous 'j' timed out: not enough nodes joined",
                                   earlier_attempts=earlier.kept(), earlier_left_out=earlier.left_out)

    first = report_after_tui(ended_on_a_round_never_formed(_cause(attempt=0)))
    assert first.startswith("ranktop: t.py failed in attempt_0 (1 of 2 attempts)\n"), first
    assert "earlier attempts" not in first and "attempt_0: " not in first, first
    assert first.endswith("\n  logs: /logs/r\nranktop: error: the c10d rendezvous 'j' timed out: not enough nodes joined")
    joined = report_after_tui(ended_on_a_round_never_formed(_cause(attempt=0), "attempt_0: restarted, nodes joined"))
    assert "\n  earlier attempts: attempt_0: restarted, nodes joined\n" in joined, joined
    before = [f"attempt_{k}: rank 0 failed (exit 3)" for k in range(5)]
    later = report_after_tui(ended_on_a_round_never_formed(_cause(attempt=5), *before))
    assert later.startswith("ranktop: t.py failed in attempt_5 (6 of 7 attempts)\n"), later
    assert ("\n  earlier attempts: attempt_0: rank 0 failed (exit 3); ... 2 more (events.jsonl) ...; attempt_3: rank 0 "
            "failed (exit 3); attempt_4: rank 0 failed (exit 3)\n") in later, later
    # The cause's attempt among those left out (only the first and the last few are kept), every
    # kept one after it dropped: the count of those left out is no count of those before it.
    middle = dataclasses.replace(_group(_cause(attempt=3)), attempt=10, max_restarts=10, ended=True,
                                 earlier_attempts=tuple(f"attempt_{k}: rank 0 failed (exit 3)" for k in (0, 7, 8, 9)),
                                 earlier_left_out=6)
    assert "\n  earlier attempts: attempt_0: rank 0 failed (exit 3); ... some more (events.jsonl) ...\n" in \
        report_after_tui(middle) + "\n"
    # A run that ends in the attempt that failed lists every earlier one, as it did.
    ended_there = dataclasses.replace(_group(_cause(attempt=1)), attempt=1, max_restarts=1, ended=True,
                                      earlier_attempts=("attempt_0: rank 1 failed (exit 1)",))
    assert report_after_tui(ended_there).endswith("\n  logs: /logs/r\n  earlier attempts: attempt_0: rank 1 failed (exit 1)")


def test_a_rendezvous_error_with_no_rank_to_blame_heads_the_report_a_tui_leaves():
    """A node whose peer was stopped by its user (K) after an R, no restart left: the TUI left
    `  earlier attempts: attempt_0: restarted by the user` first, indented under nothing, then
    the error, and no word of where the logs are. Headless's report names the directory under
    the error too, as under a failed rank's headline (it ended on the error alone)."""
    peer_stopped = ("node localhost (group rank 0) of the c10d rendezvous 'j' was stopped by its user (K, q or "
                    "ranktop stop), and this node has no restarts left (0 of 0 spent)")
    group = dataclasses.replace(_group(None), attempt=1, ended=True, rendezvous_error=peer_stopped,
                                earlier_attempts=("attempt_0: restarted by the user",))
    assert report_after_tui(group).splitlines() == [
        f"ranktop: error: {peer_stopped}", "  logs: /logs/r", "  earlier attempts: attempt_0: restarted by the user"]
    headless = format_end_report(RunResult(GroupState.FAILED, rendezvous_error=peer_stopped), name="t.py",
                                 attempt=1, max_restarts=0, run_dir="/logs/r")
    assert headless.splitlines() == [f"ranktop: error: {peer_stopped}", "  logs: /logs/r"], headless


def test_a_failure_without_an_error_file_still_says_where_the_logs_are():
    killed = _cause(exitcode=-9, signal_name="SIGKILL", message="", traceback="", error_file=None)
    after_tui = report_after_tui(dataclasses.replace(_group(killed), ended=True))
    assert after_tui.splitlines()[-1] == "  logs: /logs/r" and "error file" not in after_tui
    # With an error file, the run directory is still what the logs line names (not the rank's).
    assert format_root_cause(_cause(), name="t.py", attempt=0, max_restarts=0,
                             run_dir="/logs/r").splitlines()[-1] == "  logs: /logs/r"


def test_every_line_of_a_many_line_message_keeps_the_indent():
    """gloo's messages run over several lines; the lines after the first started at column 0, in
    the headless report and in the TUI's panel."""
    message = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer\n typically caused by a remote worker crashing"
    cause = _cause(message=message, traceback=None)
    report = format_root_cause(cause, name="t.py", attempt=0, max_restarts=0).splitlines()
    assert "  RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer" in report
    assert "   typically caused by a remote worker crashing" in report
    shown = root_cause_text(_group(cause)).plain.splitlines()
    assert any(line.startswith("  ") and "typically caused" in line for line in shown), shown


def test_a_message_of_many_lines_is_shown_in_part_with_how_many_were_left_out():
    """error.json is the rank's to write: a message of 100,000 lines filled the report and the panel."""
    cause = _cause(message="line\n" * 100_000, traceback=None)
    report = format_root_cause(cause, name="t.py", attempt=0, max_restarts=0).splitlines()
    assert report.count("  line") == 20 and "  … 99980 more message lines in error.json" in report
    assert len(root_cause_text(_group(cause)).plain.splitlines()) < 40


def test_the_hint_to_get_a_traceback_is_left_out_where_the_rank_printed_one():
    """A script's uncaught exception (gloo's `Connection closed by peer` after a peer was killed)
    is in the rank's output; the report still said `exited with code 1. To see the traceback,
    wrap the rank's main function in @ranktop.core.record`, under a headline with the same code."""
    hint = "exited with code 1. To see the traceback, wrap the rank's main function in @ranktop.core.record (or torch's @record)."
    printed = ("step 2", "[rank2]: Traceback (most recent call last):", '[rank2]:   File "t.py", line 3, in <module>',
               "[rank2]: RuntimeError: Connection closed by peer")
    cause = _cause(message=hint, traceback=None, error_file=None, last_lines=printed[-2:], failed_tails=((1, printed),))
    report = format_root_cause(cause, name="t.py", attempt=0, max_restarts=0)
    assert "To see the traceback" not in report and "exited with code 1" in report, report
    assert "    [rank2]: RuntimeError: Connection closed by peer" in report
    assert "To see the traceback" not in root_cause_text(_group(cause)).plain
    # A rank that printed no traceback still gets the hint.
    quiet = _cause(message=hint, traceback=None, error_file=None, last_lines=("step 2",))
    assert "  " + hint in format_root_cause(quiet, name="t.py", attempt=0, max_restarts=0).splitlines()
