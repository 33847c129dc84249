"""`ranktop --tui` in a real terminal (tmux): read the screen, press keys, quit cleanly."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, marked_processes, ranktop_cmd, read_events, read_line, run_ranktop, stop_process, wait_for
from ranktop.core.process import kernel_state
from ranktop.core.stacks import find_py_spy

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]

# Frames far wider than the call tree at 80 columns: a deep recursion through a long name
# (tests/test_tui_controls.py uses it too).
DEEP = ("import time\n"
        "def a_function_whose_name_is_far_too_long_for_a_call_tree_in_eighty_columns(n):\n"
        "    if n == 0:\n        print('deep', flush=True)\n        time.sleep(3600)\n"
        "    a_function_whose_name_is_far_too_long_for_a_call_tree_in_eighty_columns(n - 1)\n"
        "a_function_whose_name_is_far_too_long_for_a_call_tree_in_eighty_columns(8)\n")

SCRIPT = "import os, time\nprint('hello from', os.environ['RANK'], flush=True)\nwhile True:\n    time.sleep(0.1)\n"


class Terminal:
    """One tmux server of our own (-L): it inherits this environment, and dies with the test."""

    def __init__(self, command: str, width: int = 160, height: int = 48):
        self.socket = f"ranktop-test-{uuid.uuid4().hex[:8]}"
        self._tmux("new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height), command)

    def _tmux(self, *args: str) -> str:
        # Without COLUMNS/LINES (pytest's process has them, 80x24): the app inside would take them
        # over the terminal's real size.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True,
                              env=env).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "t")

    def pane_pid(self) -> str:
        """The pid of the command the terminal runs (a shell, for a test that types into one)."""
        return self._tmux("display-message", "-p", "-t", "t", "#{pane_pid}").strip()

    def press(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def resize(self, width: int, height: int) -> None:
        self._tmux("resize-window", "-t", "t", "-x", str(width), "-y", str(height))

    def wait_screen(self, *texts: str, timeout: float = 15.0) -> str:
        """The screen once it shows every one of `texts` (tmux may be caught halfway through a frame).
        A time-out shows the last screen: what was there instead is how a failure in CI is read."""
        last = ""

        def shown() -> str | bool:
            nonlocal last
            last = self.screen()
            return all(t in last for t in texts) and last

        try:
            return wait_for(shown, timeout, what=f"{' and '.join(map(repr, texts))} on screen")
        except pytest.fail.Exception as failed:
            raise pytest.fail.Exception(f"{failed.msg}; the screen then:\n{last.rstrip()}") from None

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def test_tui_in_tmux_keys_and_clean_quit(tmp_path):
    script = tmp_path / "ticker.py"
    script.write_text(SCRIPT)
    status = tmp_path / "status"
    command = (f"cd {ROOT} && {sys.executable} -m ranktop --tui --nproc-per-node 2 --shutdown-timeout 3 "
               f"--log-dir {tmp_path / 'logs'} {script}; echo $? > {status}; sleep 30")
    term = Terminal(command)
    try:
        term.wait_screen("hello from 1", "ticker.py", "world 2", "attempt_0", " 0/0 ", " 1/1 ", "running")
        # Bytes that are not UTF-8 (a Latin-1 paste, a meta key sent as 8 bits): Textual's strict
        # decoding ended its input thread in a panic, which ended the TUI and stopped the run. The
        # keys that come with them, 1 and z here (focus rank 1 and zoom it: rank 0's pane goes
        # away), come through.
        term._tmux("send-keys", "-t", "t", "-H", "e9", "ff", "31", "7a")
        wait_for(lambda: " 0/0 " not in term.screen(), what="zoomed onto rank 1")
        assert " 1/1 " in term.screen()
        term.press("?")
        term.wait_screen("ranktop keys")
        term.press("Escape", "Escape")
        wait_for(lambda: " 0/0 " in (shown := term.screen()) and "ranktop keys" not in shown, what="back on the grid")
        term.press("q")
        term.wait_screen("still running")
        term.press("y")
        wait_for(lambda: status.exists() and status.read_text().strip(), timeout=15, what="ranktop exited")
        assert status.read_text().strip() == "130"
        assert any(e["event"] == "user_stop" for e in read_events(next((tmp_path / "logs").iterdir())))
    finally:
        term.close()


def _tui_whose_rank_signals_ranktop(tmp_path, name: str) -> tuple[Terminal, Path]:
    """A one-rank TUI run in tmux whose rank sends ranktop signal `name` as its first act, mostly
    while Textual still loads; and the file its exit status goes to."""
    script = tmp_path / "signaller.py"
    script.write_text(f"import os, signal, time\nos.kill(os.getppid(), signal.{name})\n"
                      "print('sent', flush=True)\nwhile True:\n    time.sleep(0.1)\n")
    status = tmp_path / "status"
    command = (f"cd {ROOT} && {sys.executable} -m ranktop --tui --nproc-per-node 1 --shutdown-timeout 3 "
               f"--log-dir {tmp_path / 'logs'} {script}; echo $? > {status}; sleep 30")
    return Terminal(command), status


def test_a_sigterm_while_textual_loads_stops_the_run_once_the_tui_is_up(tmp_path):
    """The ranks start before Textual is imported (that takes longer than their start): a stop
    signal that comes meanwhile, here from a rank's first line, is kept and acted on by the app,
    as one that comes later: the ranks get it, and ranktop exits as a stopped run does."""
    term, status = _tui_whose_rank_signals_ranktop(tmp_path, "SIGTERM")
    try:
        wait_for(lambda: status.exists() and status.read_text().strip(), timeout=30, what="ranktop exited")
        assert status.read_text().strip() == str(128 + signal.SIGTERM)
        events = read_events(next((tmp_path / "logs").iterdir()))
        assert [e["signal"] for e in events if e["event"] == "signal_received"] == ["SIGTERM"], events
        (exited,) = [e for e in events if e["event"] == "exited"]
        assert exited["signal"] == "SIGTERM", exited
    finally:
        term.close()


def test_a_hangup_while_textual_loads_detaches_once_the_first_frame_is_up(tmp_path):
    """A SIGHUP before the first frame (here from a rank's first line) detaches as a later one
    does. Leaving while the first screen mounted broke its layout: a NoMatches traceback on screen."""
    term, status = _tui_whose_rank_signals_ranktop(tmp_path, "SIGHUP")
    try:
        wait_for(lambda: status.exists() and status.read_text().strip(), timeout=30, what="ranktop detached")
        shown = term.screen()
        run_dir = next((tmp_path / "logs").iterdir())
        try:
            assert status.read_text().strip() == "0" and "goes on in the background" in shown, shown
            assert "Traceback" not in shown and "NoMatches" not in shown and "Error" not in shown, shown
            assert any(e["event"] == "detached" and e["reason"] == "SIGHUP" for e in read_events(run_dir))
        finally:
            stopped = run_ranktop("stop", run_dir.name)  # the run went on: ours to end
    finally:
        term.close()
    assert stopped.returncode == 0, stopped.stderr


def _one_rank_tui(tmp_path: Path, code: str, *flags: str, env: str = "", size=(160, 48),
                  name: str = "rank.py") -> tuple[Terminal, Path]:
    """`ranktop --tui` of one rank running `code` (as `name`) in a terminal of `size`; the file
    its shell writes ranktop's exit status to."""
    script = tmp_path / name
    script.write_text(code)
    status = tmp_path / "status"
    command = (f"cd {ROOT} && {env}{sys.executable} -m ranktop --tui --nproc-per-node 1 {' '.join(flags)} "
               f"--log-dir {tmp_path / 'logs'} {script}; echo $? > {status}; sleep 30")
    return Terminal(command, *size), status


def test_a_sigint_to_every_process_of_the_tuis_job_is_one_interrupt(tmp_path):
    """`kill -INT %1`, `pkill -INT ranktop`, a scheduler's SIGINT to each process of the job: it
    reaches the TUI's process itself and through the waiting parent the shell started, which
    passes its own on. The two were a second interrupt, which kills at once: the rank, saving
    its checkpoint on SIGINT, was SIGKILLed 1 ms later, its grace never given."""
    code = ("import signal, sys, time\n"
            "def save(*_):\n    time.sleep(0.5)\n    print('saved', flush=True)\n    sys.exit(0)\n"
            "signal.signal(signal.SIGINT, save)\nprint('rank is up', flush=True)\nwhile True:\n    time.sleep(0.1)\n")
    term, status = _one_rank_tui(tmp_path, code, "--shutdown-timeout", "10")
    try:
        term.wait_screen("rank is up", " 0/0 ")
        (waiter,) = _children(int(term.pane_pid()))
        (tui,) = _children(waiter)
        run_dir = _run_dir(tmp_path)
        os.kill(tui, signal.SIGINT)
        # The other half once the first is taken: the two, a millisecond apart, are often taken as
        # one anyway, Python running a handler once for what came while its main thread was busy.
        wait_for(lambda: any(e["event"] == "signal_received" for e in read_events(run_dir)), what="the SIGINT taken")
        os.kill(waiter, signal.SIGINT)
        wait_for(lambda: status.exists() and status.read_text().strip(), timeout=20, what="ranktop exited")
        assert status.read_text().strip() == str(128 + signal.SIGINT)
        events = read_events(run_dir)
        received = [(e["signal"], e["action"]) for e in events if e["event"] == "signal_received"]
        assert received == [("SIGINT", "forward")], received
        (exited,) = [e for e in events if e["event"] == "exited"]
        assert exited["exitcode"] == 0, exited  # it saved and ended: not SIGKILLed
    finally:
        term.close()


def test_a_sigterm_while_the_pager_is_open_ends_it_and_stops_the_run(tmp_path):
    """Found by fuzzing `o`: the TUI waits on its pager (a job of its own, in the terminal's
    foreground), and a SIGTERM to ranktop meanwhile stopped the ranks but left the TUI, pager and
    all, until the pager was quit. The pager is ended: the screen is the shell's again, and
    ranktop exits as a stopped run does."""
    started = tmp_path / "pager.pid"
    pager = tmp_path / "pager.sh"  # a pager that waits, as less does
    pager.write_text(f"#!/bin/sh\necho $$ > {started}.new && mv {started}.new {started}\nexec sleep 30\n")
    pager.chmod(0o755)
    term, status = _one_rank_tui(tmp_path, SCRIPT, "--shutdown-timeout 3", env=f"PAGER={pager} ")
    try:
        term.wait_screen("hello from 0", " 0/0 ")
        (ranktop,) = _children(int(term.pane_pid()))  # the process the terminal's shell started
        term.press("o")
        wait_for(started.exists, what="the pager started")
        pager_pid = int(started.read_text())
        os.kill(ranktop, signal.SIGTERM)
        wait_for(lambda: status.exists() and status.read_text().strip(), timeout=15, what="ranktop exited")
        assert status.read_text().strip() == str(128 + signal.SIGTERM)
        assert kernel_state(pager_pid) is None  # ended, and reaped by ranktop
        events = read_events(next((tmp_path / "logs").iterdir()))
        assert [e["signal"] for e in events if e["event"] == "signal_received"] == ["SIGTERM"], events
        term.wait_screen("ranktop: stopped by SIGTERM; logs in")  # its last line, on the shell's screen again
    finally:
        term.close()


def test_a_pager_that_leaves_the_terminal_raw_has_it_put_back(tmp_path):
    """Found by fuzzing `o`: a pager that exits with the terminal's modes raw (killed, or a
    script's `stty raw`) had the TUI take those for the modes to give back. Every later pager ran
    raw (Enter ended no line, Ctrl-C sent no signal: one that read a line waited for ever), and
    so did the shell after ranktop. The modes from before the pager are put back, as a shell does."""
    done = tmp_path / "pager.done"
    pager = tmp_path / "pager.sh"
    pager.write_text(f"#!/bin/sh\nstty raw -echo\ntouch {done}\n")
    pager.chmod(0o755)
    term, status = _one_rank_tui(tmp_path, SCRIPT, "--shutdown-timeout 3", env=f"PAGER={pager} ")
    try:
        term.wait_screen("hello from 0", " 0/0 ")
        term.press("o")
        wait_for(done.exists, what="the pager ran")
        term.wait_screen("hello from 0", " 0/0 ")  # the TUI back
        term.press("q")
        term.wait_screen("still running")
        term.press("y")
        wait_for(lambda: status.exists() and status.read_text().strip(), timeout=15, what="ranktop exited")
        tty = term._tmux("display-message", "-p", "-t", "t", "#{pane_tty}").strip()
        modes = subprocess.run(["stty", "-F", tty, "-a"], capture_output=True, text=True, check=True).stdout.split()
        assert "icanon" in modes and "isig" in modes and "echo" in modes, modes  # (raw: -icanon -isig -echo)
    finally:
        term.close()


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_the_stack_views_tree_scrolls_sideways_by_a_real_terminals_keys(tmp_path):
    """ctrl+PgDn and → as a terminal sends them scroll the call tree, where the view opens (the
    focus on the groups, where they did nothing): at 80 columns the ends of the frames, cut
    until then, come into sight."""
    term, status = _one_rank_tui(tmp_path, DEEP, "--shutdown-timeout", "3", size=(80, 24), name="deep.py")
    try:
        term.wait_screen("deep")
        term.press("d")
        shown = term.wait_screen("call tree", "[rank 0] <module>")

        def frame_ends_in_the_tree() -> int:  # the tree is the right half
            return sum("(deep.py:6)" in row[40:] for row in term.screen().splitlines())

        assert "(deep.py:7)" in shown and frame_ends_in_the_tree() == 0  # cut at 80 columns
        term.press("C-PageDown", "Right", "C-PageDown")
        # (pressed again while they do not show: keys that came while a loaded box was still laying
        # out the tree scrolled only as far as its width was then)
        wait_for(lambda: frame_ends_in_the_tree() >= 3 or term.press("C-PageDown"), interval=0.5,
                 what="the ends of the frames in the tree")
        term.press("Escape")
        term.wait_screen("0/0")
        term.press("q")
        term.wait_screen("still running")
        term.press("y")
        wait_for(lambda: status.exists() and status.read_text().strip(), timeout=15, what="ranktop exited")
    finally:
        term.close()  # (a hang-up: a run still going goes on detached, and is ended here)
        if not status.exists() and (tmp_path / "logs").exists():
            run_ranktop("stop", next((tmp_path / "logs").iterdir()).name)


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_stacks_given_the_pid_the_shell_started_dumps_the_tuis_ranks(tmp_path):
    """The TUI's ranktop forks (so that q can detach): the pid the shell knows ($!, ps) only holds
    the terminal, and its ranks are its child's. `ranktop stacks PID` dumped that holder as
    'rank 0' (py-spy) or skipped it (--signal)."""
    script = tmp_path / "wait.py"
    script.write_text("import time\ndef wait_here():\n    time.sleep(3600)\nprint('ready', flush=True)\nwait_here()\n")
    pid_file, logs = tmp_path / "pid", tmp_path / "logs"
    term = Terminal(f"cd {ROOT} && echo $$ > {pid_file} && exec {sys.executable} -m ranktop --tui --nproc-per-node 2 "
                    f"--shutdown-timeout 3 --log-dir {logs} --run-id r1 {script}")
    try:
        outs = [logs / "r1" / "attempt_0" / str(r) / "stdout.log" for r in range(2)]
        wait_for(lambda: all(o.exists() and "ready" in o.read_text() for o in outs), 20, what="both ranks ready")
        holder = pid_file.read_text().strip()
        for how in ((), ("--signal",)):
            out = run_ranktop("stacks", *how, holder, timeout=30)
            assert out.returncode == 0 and "ranks 0-1 (2)" in out.stdout and "wait_here" in out.stdout, out
        assert len(list((logs / "r1" / "stacks").glob("*.txt"))) == 2  # saved in the run's directory
    finally:
        stopped = run_ranktop("stop", "r1")
        term.close()
    assert stopped.returncode == 0, stopped.stderr


def test_a_tui_run_that_cannot_be_served_says_so_on_its_screen(tmp_path):
    """A socket path over the 107 bytes Unix allows (a deep $XDG_RUNTIME_DIR): the run is not
    served, and the line saying so went to stderr, behind the TUI's screen; q just did not offer
    to detach, without a word."""
    runtime = tmp_path / ("r" * 100)
    runtime.mkdir(mode=0o700)
    term, status = _one_rank_tui(tmp_path, SCRIPT, env=f"XDG_RUNTIME_DIR={runtime} ", size=(120, 30))
    try:
        shown = " ".join(line.strip(" ▌") for line in term.wait_screen("hello from 0", "not served").splitlines())
        assert "use a shorter $XDG_RUNTIME_DIR" in shown and "q cannot detach it" in shown
        term.press("q")
        shown = term.wait_screen("Stop and quit")
        assert "Detach" not in shown
        term.press("n")
        # A hang-up stops it: detached, nothing could ever reach it (it went on, out of reach).
        pid = int(next(e["pid"] for e in wait_for(lambda: read_events(next((tmp_path / "logs").iterdir())),
                                                  what="its events") if e["event"] == "started"))
        term.close()  # (its shell goes with the terminal: no status; what is left of the run, if anything)
        wait_for(lambda: not marked_processes(), timeout=20, what="ranktop and its rank gone")
        assert not os.path.exists(f"/proc/{pid}")
    finally:
        term.close()


def test_a_tui_that_fails_where_its_run_cannot_detach_carries_it_on_in_the_foreground(tmp_path):
    """Not served (a socket path too long), the run has no background to go to when its TUI fails
    (tests/failing_tui.py: `z` raises): it goes on in the terminal without a screen, where Ctrl-C
    stops it as headless (130); it ended with the TUI."""
    runtime = tmp_path / ("r" * 100)
    runtime.mkdir(mode=0o700)
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    status = tmp_path / "status"
    term = Terminal(f"cd {ROOT} && XDG_RUNTIME_DIR={runtime} {sys.executable} tests/failing_tui.py --tui "
                    f"--nproc-per-node 1 --log-dir {tmp_path / 'logs'} {script}; echo $? > {status}; sleep 30",
                    120, 30)
    try:
        term.wait_screen("hello from 0", "not served")
        term.press("z")
        shown = "".join(term.wait_screen("Ctrl-C stops it").split())  # (lines wrap at 120 columns)
        run_dir = next((tmp_path / "logs").iterdir())
        said = ("ranktop: the TUI failed (RuntimeError: a bug at z; its traceback is above): the run goes on here "
                f"without a screen until its ranks end (Ctrl-C stops it); its output is in the log files under {run_dir}")
        assert "".join(said.split()) in shown
        (pid,) = [e["pid"] for e in read_events(run_dir) if e["event"] == "started"]
        assert not [e for e in read_events(run_dir) if e["event"] == "exited"]
        os.kill(pid, 0)
        term.press("C-c")
        wait_for(lambda: status.exists() and status.read_text().strip(), what="ranktop's exit status")
        assert status.read_text().strip() == "130"
        assert "ranktop: stopped by SIGINT" in term.screen()
        assert not os.path.exists(f"/proc/{pid}")
    finally:
        term.close()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_ctrl_z_suspends_the_tui_to_the_shell_and_fg_brings_it_back_whole(tmp_path):
    """In a shell with job control: Ctrl-Z (a key in the TUI's raw mode) did nothing, and a
    SIGTSTP to the job (`kill -TSTP -PGID`) stopped the process the shell waits for before the
    TUI had given the terminal back, so `fg` left the TUI stopped for good on a blank screen.
    A SIGCONT that follows no Ctrl-Z (alone, or after `kill -STOP`) started the screen over as it
    ran: a second input thread, and at the exit the process waited on the first till a key came."""
    script = tmp_path / "ticker.py"
    script.write_text(SCRIPT)
    status = tmp_path / "status"
    term = Terminal("bash --norc --noprofile")
    try:
        term.press(f"cd {ROOT} && {sys.executable} -m ranktop --tui --nproc-per-node 2 --shutdown-timeout 3 "
                   f"--run-id jc --log-dir {tmp_path / 'logs'} {script}", "Enter")  # (alone: a list goes on past a stop)
        term.wait_screen("hello from 1", " 1/1 ")
        shell = int(term.pane_pid())
        (waiter,) = _children(shell)  # the process the shell started and waits for
        (tui,) = _children(waiter)  # the TUI and its engine
        ranks = [e["pid"] for e in read_events(next((tmp_path / "logs").iterdir())) if e["event"] == "started"]
        threads = _threads(tui)
        os.kill(tui, signal.SIGCONT)  # (its handler's work is on the loop before the key's)
        term.press("z")
        wait_for(lambda: " 1/1 " not in term.screen(), what="zoomed onto rank 0")
        assert _threads(tui) == threads
        term.press("z")
        term.wait_screen(" 1/1 ")
        # ... and `kill -STOP` of the TUI: the shell takes the terminal (its modes too) till `fg`
        for suspend in (lambda: os.killpg(os.getpgid(waiter), signal.SIGTSTP), lambda: term.press("C-z"),
                        lambda: os.kill(tui, signal.SIGSTOP)):
            suspend()
            term.wait_screen("Stopped")  # the shell has its prompt back
            assert kernel_state(waiter) == "T" and kernel_state(tui) == "T"
            assert all(kernel_state(pid) != "T" for pid in ranks)  # the ranks run on, as under torchrun
            term.press("clear", "Enter")
            wait_for(lambda: "Stopped" not in term.screen(), what="the screen cleared")
            term.press("fg", "Enter")
            term.wait_screen("hello from 1", " 0/0 ", " 1/1 ", "running", "world 2")  # every row redrawn
            assert kernel_state(waiter) != "T" and kernel_state(tui) != "T"
        assert _threads(tui) == threads
        term.press("q")  # (a key, not a line: the TUI's modes are back)
        term.wait_screen("still running")
        term.press("y")
        wait_for(lambda: not os.path.exists(f"/proc/{waiter}"), timeout=15, what="ranktop exited")
        term.press(f"echo $? > {status}", "Enter")  # fg's status: the job's
        wait_for(lambda: status.exists() and status.read_text().strip(), what="the status written")
        assert status.read_text().strip() == "130"
    finally:
        term.close()
        if not status.exists():  # (the terminal's end detached the run)
            run_ranktop("stop", "jc")


# A TUI's driver in application mode (its writer thread drawing) whose main thread holds the
# writer's queue lock, as it does midway through a frame's write, when SIGTSTP comes; it prints
# once the handler has returned, and whether the driver suspended once its loop had a turn.
SIGTSTP_MID_WRITE = """
import asyncio, os, signal
from textual.drivers._writer_thread import WriterThread
from ranktop.tui.driver import TerminalDriver

class App:  # all the driver asks of its app here
    _loop = None

async def main():
    driver = TerminalDriver(App())
    driver._writer_thread = WriterThread(open(os.devnull, "w"))
    driver._writer_thread.start()
    with driver._writer_thread._queue.mutex:
        signal.raise_signal(signal.SIGTSTP)  # (its Python handler runs here, before this returns)
    print("handled", flush=True)
    await asyncio.sleep(0.1)  # the loop's turn: the terminal given back, the stop, and after SIGCONT the resume
    print("suspended", driver._suspended, "drawing", driver._drawing(), flush=True)

asyncio.run(main())
"""


def test_a_sigtstp_midway_through_a_write_suspends_the_tui_on_its_loop(tmp_path):
    """Textual gave the terminal back from within its SIGTSTP handler, which runs wherever the main
    thread was: midway through a frame's write (the writer's queue lock held), its own first write
    waited for that lock for ever. The TUI hung, never stopped, and the shell never had its prompt
    back (test_ctrl_z_suspends_... timed out waiting for `Stopped`: 5 runs in 85 under load). The
    handler now leaves that work to the app's event loop; the process stops there."""
    child = subprocess.Popen([sys.executable, "-c", SIGTSTP_MID_WRITE], cwd=ROOT, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, text=True)
    try:
        read_line(child.stdout, 30, "the SIGTSTP handler to return", equal_to="handled\n")
        wait_for(lambda: kernel_state(child.pid) == "T", what="the process stopped, from its loop")
        os.kill(child.pid, signal.SIGCONT)
        assert read_line(child.stdout, 30, "its state") == "suspended True drawing False\n"
        assert child.wait(30) == 0
    finally:
        stop_process(child)
        child.stdout.close()


# 50 lines a second, each rank: the 2000 bytes the bg test waits to see logged come in 2-3 s (at
# 20 a second they took 6), still far more than the ranks wrote while the job was stopped.
TICKER = "import itertools, time\nfor n in itertools.count():\n    print('tick', n, flush=True)\n    time.sleep(0.02)\n"


def _suspended_tui(tmp_path: Path) -> tuple[Terminal, int, int, list[int]]:
    """A two-rank TUI run in a shell with job control, suspended with Ctrl-Z: the terminal, the
    process the shell waits for, the TUI's, and the ranks'."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    term = Terminal("bash --norc --noprofile")
    term.press(f"cd {ROOT} && {sys.executable} -m ranktop --tui --nproc-per-node 2 --shutdown-timeout 3 "
               f"--log-dir {tmp_path / 'logs'} {script}", "Enter")
    term.wait_screen("tick 3", " 1/1 ")
    (waiter,) = _children(int(term.pane_pid()))
    (tui,) = _children(waiter)
    ranks = [e["pid"] for e in read_events(_run_dir(tmp_path)) if e["event"] == "started"]
    term.press("C-z")
    term.wait_screen("Stopped")
    wait_for(lambda: kernel_state(waiter) == "T" and kernel_state(tui) == "T", what="the job stopped")
    return term, waiter, tui, ranks


def _run_dir(tmp_path: Path) -> Path:
    return next((tmp_path / "logs").iterdir())


def _logged(tmp_path: Path) -> int:
    """Bytes of the ranks' output the engine has written to the run's logs."""
    return sum(p.stat().st_size for p in _run_dir(tmp_path).rglob("stdout.log"))


def _kill_job_and_wait(term: Terminal, tmp_path: Path, waiter: int, tui: int, ranks: list[int]) -> str:
    """`kill %1` (SIGTERM, and SIGCONT to a stopped job) and the job's status as `wait` gives it."""
    status = tmp_path / "status"
    term.press(f"kill %1; wait -f %1; echo $? > {status}", "Enter")  # (-f: till it ends, not just continues)
    wait_for(lambda: status.exists() and status.read_text().strip(), timeout=20, what="the job's status")
    assert [(pid, kernel_state(pid)) for pid in (waiter, tui, *ranks) if os.path.exists(f"/proc/{pid}")] == []
    return status.read_text().strip()


def test_kill_of_a_suspended_tui_job_stops_its_run_as_in_the_foreground(tmp_path):
    """bash's `kill %1` sends SIGTERM and SIGCONT: the TUI, woken in the background, set the
    terminal's modes back, and SIGTTOU stopped it again, engine and all: `Stopped (tty output)`,
    both ranks running, and the run ended only at `fg`."""
    term, waiter, tui, ranks = _suspended_tui(tmp_path)
    try:
        assert _kill_job_and_wait(term, tmp_path, waiter, tui, ranks) == "143"
        assert any(e["event"] == "signal_received" and e["signal"] == "SIGTERM" for e in read_events(_run_dir(tmp_path)))
    finally:
        term.close()


def test_bg_keeps_a_suspended_tuis_run_going_and_fg_brings_the_tui_back(tmp_path):
    """`bg` stopped the job again at once (SIGTTOU), its engine with it: the ranks' output went
    unread until `fg`. Now the TUI stays off the terminal and its engine runs; `fg` (no SIGCONT
    for a job that runs) brings the screen back, and `kill %1` stops the run. The same for a TUI
    stopped by `kill -STOP` and continued alone while the shell holds the terminal."""
    term, waiter, tui, ranks = _suspended_tui(tmp_path)
    try:
        term.press("bg", "Enter")
        before = _logged(tmp_path)
        wait_for(lambda: _logged(tmp_path) > before + 2000, timeout=15, what="the engine logging in the background")
        assert kernel_state(waiter) != "T" and kernel_state(tui) != "T"
        term.press("clear", "Enter")
        wait_for(lambda: "tick" not in term.screen(), what="the screen cleared")
        term.press("fg", "Enter")
        term.wait_screen("tick", " 0/0 ", " 1/1 ", "running")
        # `kill -STOP` of the TUI (the shell takes the terminal), then `kill -CONT` of it alone: it
        # set the terminal's modes from the background, and SIGTTOU stopped it again, engine and all
        os.kill(tui, signal.SIGSTOP)
        term.wait_screen("Stopped")
        os.kill(tui, signal.SIGCONT)
        before = _logged(tmp_path)
        wait_for(lambda: _logged(tmp_path) > before + 2000, timeout=15, what="the engine logging off the screen")
        term.press("clear", "Enter")  # (the shell wrote over the TUI's last frame: that is still there)
        wait_for(lambda: "tick" not in term.screen(), what="the screen cleared")
        term.press("fg", "Enter")
        term.wait_screen("tick", " 0/0 ", " 1/1 ", "running")
        term.press("C-z")
        term.wait_screen("Stopped")
        term.press("bg", "Enter")
        wait_for(lambda: kernel_state(tui) != "T", what="the TUI running in the background")
        assert _kill_job_and_wait(term, tmp_path, waiter, tui, ranks) == "143"
    finally:
        term.close()


def test_a_suspended_tuis_run_outlives_its_terminal(tmp_path):
    """Ctrl-Z, then the SSH link drops: bash sends its stopped jobs SIGHUP, then SIGTERM, as its
    terminal goes, and the SIGTERM stopped the run (exit 143), where a TUI in the foreground
    detaches. A SIGTERM that finds the terminal hung up is the hang-up's: the run goes on."""
    term, waiter, tui, ranks = _suspended_tui(tmp_path)
    run_dir = _run_dir(tmp_path)
    try:
        shell = int(term.pane_pid())
        term.close()  # the terminal goes, and its shell with it
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in (shell, waiter)), timeout=15,
                 what="the shell gone, and the process it waited for")
        wait_for(lambda: any(e["event"] == "detached" for e in read_events(run_dir)), what="the run detached")
        assert all(kernel_state(pid) not in (None, "Z") for pid in (tui, *ranks))
        # The copies the waiting parent passes on can come after the app has gone, on a busy box:
        # that SIGTERM stopped the run the hang-up had detached (once in a loaded full run).
        os.kill(tui, signal.SIGHUP)
        os.kill(tui, signal.SIGTERM)
        noted = wait_for(lambda: [e for e in read_events(run_dir) if e["event"] == "signal_received"][1:],
                         what="both copies noted")
        assert [e["signal"] for e in read_events(run_dir) if e["event"] == "signal_received"] == ["SIGHUP", "SIGHUP"]
        assert noted[0]["action"] == "ignored" and not [e for e in read_events(run_dir) if e["event"] == "user_stop"]
        assert all(kernel_state(pid) not in (None, "Z") for pid in (tui, *ranks))
    finally:
        stopped = run_ranktop("stop", run_dir.name)
    assert stopped.returncode == 0, stopped.stderr
    events = [e for e in read_events(run_dir) if e["event"] in ("signal_received", "detached", "user_stop", "run_finished")]
    assert [e["event"] for e in events] == ["detached", "signal_received", "signal_received", "user_stop",
                                            "run_finished"], events  # (the stop: ours)
    assert events[0]["reason"] == "SIGHUP"


def test_the_tui_does_not_fork_while_a_thread_python_does_not_know_of_runs():
    """A C/C++ thread (torch's TCPStore server) is not in `threading`: the fork that lets q detach
    went ahead with it alive, and it stayed behind in the waiting parent (Python 3.12 warns of
    such a fork). Here `_thread`'s thread, which `threading` does not know of either."""
    code = ("import _thread, os, time\n"
            "_thread.start_new_thread(time.sleep, (30,))\n"
            "from ranktop.tui.detach import hold_terminal\n"
            "pid = os.getpid()\n"
            "print(hold_terminal() is None, os.getpid() == pid, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert (out.returncode, out.stdout) == (0, "True True\n"), out


def test_a_c10d_hosts_store_goes_on_serving_after_the_tui_detaches(tmp_path):
    """Under the TUI the c10d host's store is started after the fork, in the process that runs the
    engine: it was started before, its server thread stayed in the parent that only holds the
    terminal, and a detach ended it (a node that came to join then waited for ever)."""
    if importlib.util.find_spec("torch") is None:  # (the nodes import it; importing it here took 3-4 s)
        pytest.skip("the c10d store needs torch")
    from ranktop.core.spec import free_port

    code = ("import os, time\nprint('hello from', os.environ['RANK'], 'world', os.environ['WORLD_SIZE'], flush=True)\n"
            "while True:\n    time.sleep(0.1)\n")
    rdzv = ("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--rdzv-id", "detached-host", "--rdzv-conf", "last_call_timeout=1", "--monitor-interval", "0.2")
    term, _ = _one_rank_tui(tmp_path, code, *rdzv, "--shutdown-timeout", "3")
    second = None
    try:
        term.wait_screen("hello from 0 world 1")
        engine = next(e["pid"] for e in read_events(tmp_path / "logs" / "detached-host") if e["event"] == "run_started")
        holder = psutil.Process(engine).ppid()
        assert psutil.Process(holder).num_threads() == 1  # the store's thread is the engine's
        term.press("q")
        term.wait_screen("Detach")
        term.press("d")
        wait_for(lambda: not psutil.pid_exists(holder), what="the holder gone on the detach")
        out = tmp_path / "node1.out"
        with out.open("w") as sink:
            second = subprocess.Popen(ranktop_cmd("--headless", *rdzv, "--nproc-per-node", "1", "--run-id", "node1",
                                                  "--log-dir", str(tmp_path / "node1"), str(tmp_path / "rank.py")),
                                      cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        wait_for(lambda: "world 2" in out.read_text(), timeout=40, what="the second node's rank in a world of 2")
    finally:
        stopped = run_ranktop("stop", "detached-host")
        if second is not None:
            stop_process(second)
        term.close()
    assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: not marked_processes(), timeout=20, what="both nodes and their ranks gone")
