"""The output path when the disk under the logs fills up: ranks keep running, nothing hangs, the
loss is reported (console, events, TUI, end report) and counted to the byte, and exit status is 1.
A small tmpfs stands in for the full disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, ranktop_cmd, read_events, run_ranktop, tmpfs, wait_for
from ranktop.core.events import EventLog
from ranktop.core.state import GroupSnapshot, GroupState, LogLoss, RankSnapshot, RankState
from ranktop.tui.panes import header_text, rank_title

DISK_BYTES = 256 << 10
MB = 1 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs, unmounted afterwards whatever the test did."""
    with tmpfs(tmp_path / "disk", f"size={DISK_BYTES}") as disk:
        yield disk


def _fill(path, size: int | None = None) -> None:
    """Write a ballast file of `size` bytes, or until the disk is full when None."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        block = b"b" * 4096
        written = 0
        while size is None or written < size:
            try:
                written += os.write(fd, block[: 4096 if size is None else min(4096, size - written)])
            except OSError:
                break
    finally:
        os.close(fd)



# Writes 3 MiB (three pipes' worth: it would block if ranktop stopped reading), then waits for the
# ballast to go so that ranktop can write its events again, then exits 0.
_FLOOD = """
import os, sys, time
ballast = sys.argv[1]
for _ in range(48):
    os.write(1, b"x" * 65535 + b"\\n")
deadline = time.monotonic() + 60
while os.path.exists(ballast) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


def test_disk_full_midway_is_reported_counted_and_exits_1(small_disk, tmp_path):
    ballast = small_disk / "ballast"
    _fill(ballast, 160 << 10)
    script = tmp_path / "flood.py"
    script.write_text(_FLOOD)
    proc = subprocess.Popen(ranktop_cmd("--nproc-per-node", "1", "-r", "1", "--log-dir", str(small_disk),
                                        "--run-id", "full", str(script), str(ballast)),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.decode() for line in proc.stderr), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("cannot write" in line for line in lines), timeout=30, what="the log error line")
        ballast.unlink()  # room for the events from here on; the log file stays short
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        reader.join(10)
    stderr = "".join(lines)
    log = small_disk / "full" / "attempt_0" / "0" / "stdout.log"
    saved = log.stat().st_size
    lost = 48 * 65536 - saved
    assert 0 < saved < 48 * 65536
    error_lines = [line for line in lines if "cannot write" in line]
    assert len(error_lines) == 1, stderr  # once per file
    # -r 1: the output goes to the log only, so it is not "shown" anywhere else either
    assert error_lines[0].strip() == (f"ranktop: rank 0: cannot write {log}: No space left on device; its output is "
                                      "still read (so that the rank goes on), but no longer saved there")
    assert f"{log}: No space left on device, {lost} bytes lost (rank 0)" in stderr
    assert "Traceback" not in stderr
    events = read_events(small_disk / "full")
    failed = [e for e in events if e["event"] == "log_write_failed"]
    assert [(e["rank"], e["path"], e["error"]) for e in failed] == [(0, str(log), "No space left on device")]
    finished = events[-1]
    assert finished["event"] == "run_finished" and finished["exit_status"] == 1
    assert finished["incomplete_logs"] == [
        {"rank": 0, "path": str(log), "error": "No space left on device", "bytes_lost": lost}]
    assert [e["exitcode"] for e in events if e["event"] == "exited"] == [0]  # the rank never blocked


def test_disk_full_at_start_is_one_line_exit_2(small_disk, tmp_path):
    _fill(small_disk / "ballast")
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    done = run_ranktop("--nproc-per-node", "2", "--log-dir", str(small_disk), "--run-id", "r1", str(script))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("ranktop: error: ")
    assert "No space left on device" in done.stderr
    assert sorted(os.listdir(small_disk)) == ["ballast"]  # no half-made run left behind


def test_log_files_that_cannot_be_made_at_a_ranks_start_are_reported_not_a_traceback(tmp_path):
    """Out of inodes after the run directory and rank 0's logs were made (another user can fill
    a shared tmpfs so): opening rank 1's log failed before its sink knew whether it had a
    console, and ranktop ended in an AttributeError traceback with its ranks running."""
    script = tmp_path / "hello.py"
    script.write_text("import os; print('hello from', os.environ['LOCAL_RANK'])\n")
    with tmpfs(tmp_path / "disk", "size=64k,nr_inodes=8") as disk:  # the root, run, events, attempt, 0, 1, 0's two logs
        done = run_ranktop("--headless", "--nproc-per-node", "2", "--log-dir", str(disk), "--run-id", "r", str(script))
        log = disk / "r" / "attempt_0" / "1" / "stdout.log"
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert (f"ranktop: rank 1: cannot write {log}: No space left on device; its output is still read and "
                "shown, but no longer saved there\n") in done.stderr
        assert "[default1]:hello from 1\n" in done.stdout
        lost = [e for e in read_events(disk / "r") if e["event"] == "log_write_failed"]
        assert {(e["rank"], e["path"], e["shown"]) for e in lost} >= {(1, str(log), True)}


def test_an_attempt_directory_that_cannot_be_made_at_a_restart_is_reported_not_a_traceback(tmp_path):
    """Out of inodes once the first attempt's files were made (or the run directory removed
    under the run): making attempt_1 for the restart raised out of the agent, a traceback, the
    run left without run_finished or an end report. Its ranks run as those whose log files
    cannot be made do: shown, not saved, one line each, exit status 1."""
    script = tmp_path / "again.py"
    script.write_text("import os, sys\nprint('try', os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
                      "sys.exit(3 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n")
    # the root, run, events, attempt_0, 0 and its two logs: no inode left for attempt_1
    with tmpfs(tmp_path / "disk", "size=64k,nr_inodes=7") as disk:
        done = run_ranktop("--headless", "--nproc-per-node", "1", "--max-restarts", "1", "--log-dir", str(disk),
                           "--run-id", "r", str(script))
        log = disk / "r" / "attempt_1" / "0" / "stdout.log"
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert (f"ranktop: rank 0: cannot write {log}: No space left on device; its output is still read and "
                "shown, but no longer saved there\n") in done.stderr
        assert "[default0]:try 1\n" in done.stdout
        events = read_events(disk / "r")
        assert events[-2]["event"] == "run_finished" and events[-2]["state"] == "SUCCEEDED", events[-2:]
        assert events[-1]["event"] == "final_write_failed"  # no inode for it either
        # That went without a word, and logs took the run for one whose engine was killed.
        assert (f"ranktop: {disk / 'r' / 'final.json'} was not written (No space left on device): once this "
                "ranktop has exited, attach and logs cannot show how the run ended\n") in done.stderr
        logs = run_ranktop("logs", str(disk / "r"))
        assert logs.returncode == 1 and logs.stderr == (
            "ranktop: r is not served and left no final.json: its engine could not write it (No space left on "
            "device), so no view of its end can be shown; events.jsonl says it ended SUCCEEDED; its log files are "
            f"under {disk / 'r'}\n"), logs.stderr


def test_event_log_holds_lines_back_while_full_and_never_tears_one(small_disk):
    events = EventLog(os.open(small_disk / "events.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    try:
        events.write("first")
        _fill(small_disk / "ballast")
        events.write("while_full", blob="y" * 10_000)
        events.write("still_full")
        assert [e["event"] for e in read_events(small_disk)] == ["first"]
        with pytest.raises(OSError):
            events.write("strict", strict=True)
        os.unlink(small_disk / "ballast")
        events.write("after")
    finally:
        events.close()
    assert [e["event"] for e in read_events(small_disk)] == ["first", "while_full", "still_full", "strict", "after"]


def _rank(**fields) -> RankSnapshot:
    return RankSnapshot(rank=0, local_rank=0, pid=123, state=RankState.RUNNING, exitcode=None, signal_name=None,
                        restarts=0, started_at=time.time(), ended_at=None, last_output_at=None,
                        output_version=1, **fields)


def test_header_and_pane_title_show_a_log_that_misses_output():
    loss = LogLoss(rank=0, path="/l/0/stdout.log", error="No space left on device", bytes_lost=3 * MB)
    group = GroupSnapshot(name="train.py", role="default", run_id="r", state=GroupState.RUNNING, world_size=1,
                          local_world_size=1, node_rank=0, nnodes=1, attempt=0, max_restarts=0,
                          started_at=time.time(), ended_at=None, log_dir="/l",
                          ranks=(_rank(log_bytes_lost=3 * MB, log_error=loss.error),), incomplete_logs=(loss,))
    now = time.time()
    assert "1 log(s) incomplete: No space left on device, 3M not saved" in header_text(group, now).plain
    assert "log: No space left on device, 3M lost" in rank_title(group.ranks[0], now).plain
    whole = _rank()
    assert "log:" not in rank_title(whole, now).plain
    assert "incomplete" not in header_text(GroupSnapshot(**{**group.__dict__, "incomplete_logs": ()}), now).plain


def test_run_result_with_lost_output_exits_1_unless_a_signal_stopped_it():
    from ranktop.core.agent import RunResult, WorkerState

    loss = (LogLoss(0, "/l", "No space left on device", 5),)
    assert RunResult(WorkerState.SUCCEEDED).exit_status == 0
    assert RunResult(WorkerState.SUCCEEDED, incomplete_logs=loss).exit_status == 1
    assert RunResult(WorkerState.STOPPED, stop_signal=signal.SIGTERM, incomplete_logs=loss).exit_status == 143


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_a_final_view_that_cannot_be_written_whole_is_not_left_half_written(small_disk, tmp_path):
    """The rank fills the disk as it ends: final.json cannot be written. It used to be left empty,
    and `ranktop attach RUN_DIR` then failed on it with a JSON error."""
    script = tmp_path / "fill.py"
    script.write_text("import os, sys\nfd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)\n"
                      "try:\n    while True:\n        os.write(fd, b'b' * 4096)\nexcept OSError:\n    pass\n")
    done = subprocess.run(ranktop_cmd("--headless", "--log-dir", str(small_disk), "--run-id", "full", str(script),
                                      str(small_disk / "ballast")), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    assert not (small_disk / "full" / "final.json").exists()
