"""ranktop started with its own stdin, stdout or stderr closed: a closed stream counts as
/dev/null, the run completes with every byte in the log files, and a TUI with no usable terminal
falls back to headless with one line saying so."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from conftest import ROOT, ranktop_cmd, run_in_pty

pytestmark = pytest.mark.timeout(90)

SCRIPT = "import os, sys\nprint('hello from', os.environ['RANK'], flush=True)\nprint('err', os.environ['RANK'], file=sys.stderr)\n"
TRACEBACK = "Traceback (most recent call last)"
FALLBACK = "ranktop: no terminal for the TUI (stdin is not a terminal): running headless"


def run_closed(tmp_path, closing: str, *extra: str) -> subprocess.CompletedProcess:
    """ranktop under bash with `closing` (e.g. '>&-') applied, stdout and stderr captured where
    they stay open."""
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)
    argv = ranktop_cmd("--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), *extra, str(script))
    command = f"exec {shlex.join(argv)} {closing}"
    return subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=60)


def logged(tmp_path) -> str:
    """Everything the ranks' log files hold."""
    return "".join(path.read_text() for path in sorted((tmp_path / "logs").rglob("*.log")))


@pytest.mark.parametrize("closing", [">&-", "2>&-", "<&-", "<&- >&- 2>&-"])
def test_headless_with_closed_streams_completes_and_keeps_every_byte(tmp_path, closing):
    done = run_closed(tmp_path, closing, "--headless", "--tee", "3")
    assert done.returncode == 0, done.stderr
    assert TRACEBACK not in done.stderr
    logs = logged(tmp_path)
    for rank in (0, 1):
        assert f"hello from {rank}" in logs and f"err {rank}" in logs
    if ">&-" not in closing.replace("2>&-", ""):
        assert "hello from 0" in done.stdout and "hello from 1" in done.stdout
    if "2>&-" not in closing:
        assert "err 0" in done.stderr


def test_failure_with_closed_stdout_still_reports_on_stderr(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    argv = ranktop_cmd("--headless", "--log-dir", str(tmp_path / "logs"), str(script))
    done = subprocess.run(["bash", "-c", f"exec {shlex.join(argv)} >&-"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert TRACEBACK not in done.stderr and "exited with code 3" in done.stderr


def test_usage_error_with_closed_stdout_is_one_line(tmp_path):
    argv = ranktop_cmd("--headless", "--nproc-per-node", "0", "x.py")
    done = subprocess.run(["bash", "-c", f"exec {shlex.join(argv)} >&-"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("ranktop: error: ") and done.stderr.count("\n") == 1


def test_tui_without_a_usable_stdin_falls_back_to_headless(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "ranktop", "--tui", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
            str(script)]
    out, status = run_in_pty(argv, tmp_path, until=b"\x00never", stdin_closed=True)
    text = out.decode("utf-8", "replace")
    assert status == 0, text
    assert text.count("ranktop: ") == 1 and FALLBACK in text
    assert TRACEBACK not in text and "\x1b[?1049h" not in text  # no TUI was started
    assert "[default0]:hello from 0" in text and "[default1]:hello from 1" in text


def test_tui_with_stdin_not_a_terminal_falls_back_to_headless(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)
    argv = ranktop_cmd("--tui", "--log-dir", str(tmp_path / "logs"), str(script))
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0
    assert done.stderr.splitlines()[0] == FALLBACK
    assert "hello from 0" in done.stdout and TRACEBACK not in done.stderr
