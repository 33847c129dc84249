"""Headless: the console gets a rank's bytes exactly, like torchrun, unless --sanitize-console asks
for the TUI's filter there; the log files always keep the raw bytes.
`ranktop stacks` prints what py-spy read from a rank through the same filter."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from conftest import ROOT, ranktop_cmd
from ranktop.core.stacks import find_py_spy

pytestmark = pytest.mark.timeout(60)

PAYLOAD = b"cHduZWQ="
# The last piece: a lone ESC before a sequence that is dropped, then the text of another one.
HOSTILE = (b"\x1b[32mgreen\x1b[0m \x1b]52;c;" + PAYLOAD + b"\x07\x1b]0;EVIL-TITLE\x07\x1b[2J"
           b"\x1bP+q" + PAYLOAD + b"\x1b\\bad \xff\x9b utf8 bell\x07 end \x1b\x1b]0;x\x07[2J")
RANK = f"import sys\nsys.stdout.buffer.write(bytes.fromhex('{HOSTILE.hex()}') + b'\\n')\n"


def run(tmp_path, *flags: str) -> tuple[bytes, bytes]:
    """(ranktop's stdout, the rank's stdout.log) of one headless run."""
    script = tmp_path / "hostile.py"
    script.write_text(RANK)
    logs = tmp_path / "logs"
    done = subprocess.run(ranktop_cmd("--headless", "--log-dir", str(logs), *flags, str(script)), cwd=ROOT,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (log,) = logs.rglob("stdout.log")
    return done.stdout, log.read_bytes()


def test_headless_console_is_byte_exact_by_default(tmp_path):
    console, log = run(tmp_path)
    assert console == b"[default0]:" + HOSTILE + b"\n"  # the rank's bytes after ranktop's prefix
    assert log == HOSTILE + b"\n"


def test_sanitize_console_filters_the_console_and_keeps_the_file_raw(tmp_path):
    console, log = run(tmp_path, "--sanitize-console")
    assert log == HOSTILE + b"\n"
    line = console.decode("utf-8")
    assert line == "[default0]:\x1b[32mgreen\x1b[0m bad \ufffd\ufffd utf8 bell␇ end ␛[2J\n"
    assert PAYLOAD not in console and b"EVIL-TITLE" not in console


FAILER = ("from ranktop.core.errors import record\n"
          f"HOSTILE = bytes.fromhex('{HOSTILE.hex()}').decode('utf-8', 'replace')\n"
          "@record\ndef main():\n    raise ValueError('boom:' + HOSTILE)\nmain()\n")


@pytest.mark.parametrize("sanitize", [False, True])
def test_the_end_report_quotes_error_json_filtered_only_with_sanitize_console(tmp_path, sanitize):
    script = tmp_path / "fail.py"
    script.write_text(FAILER)
    flags = ["--sanitize-console"] if sanitize else []
    done = subprocess.run(ranktop_cmd("--headless", "--log-dir", str(tmp_path / "logs"), *flags, str(script)),
                          cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 1
    report = done.stderr[done.stderr.index(b"ranktop: fail.py failed"):]
    assert b"ValueError: boom:" in report
    if sanitize:
        assert b"\x1b]" not in report and PAYLOAD not in report and b"\x07" not in report
        assert b"\x1b[2J" not in report and "␛[2J".encode() in report
    else:
        assert b"\x1b]52;c;" + PAYLOAD in report  # like torchrun: the error text as the rank wrote it


@pytest.mark.skipif(find_py_spy() is None, reason="needs py-spy")
def test_stacks_cli_prints_hostile_file_names_safely(tmp_path):
    script = tmp_path / "w\x1b]0;EVIL-TITLE\x07\x1b]52;c;cHduZWQ=\x07.py"
    script.write_text("import time\ndef wait_here():\n    time.sleep(3600)\nprint('ready', flush=True)\nwait_here()\n")
    ranktop = subprocess.Popen(ranktop_cmd("--headless", "--log-dir", str(tmp_path / "logs"), str(script)),
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert b"ready" in ranktop.stdout.readline()
        out = subprocess.run(ranktop_cmd("stacks", "--no-save", str(ranktop.pid)), cwd=ROOT, capture_output=True,
                             timeout=30)
        assert out.returncode == 0 and b"wait_here (w.py:" in out.stdout, out
        assert b"\x1b" not in out.stdout and PAYLOAD not in out.stdout and b"EVIL-TITLE" not in out.stdout
    finally:
        ranktop.send_signal(signal.SIGTERM)
        ranktop.communicate(timeout=30)


def test_a_long_line_cut_into_pieces_keeps_its_characters_with_sanitize_console(tmp_path):
    """A line longer than ranktop holds is shown piece by piece as it is read, and each piece is
    cleaned on its own: a character cut between two reads used to show as two U+FFFD."""
    script = tmp_path / "long.py"
    # 3-byte characters, so that most read boundaries (at 64 KiB or 1 MiB) fall inside one.
    script.write_text("import sys\nsys.stdout.write('\\u20ac' * 1_000_000 + '\\x1b[31m!\\n')\n")
    logs = tmp_path / "logs"
    done = subprocess.run(ranktop_cmd("--headless", "--log-dir", str(logs), "--sanitize-console", str(script)),
                          cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ("[default0]:" + "\u20ac" * 1_000_000 + "\x1b[31m!\n").encode()


def test_the_console_filter_cleans_a_character_or_sequence_cut_between_two_pieces_whole(tmp_path):
    from ranktop.core.output import ConsoleWriter
    from ranktop.core.sanitize import clean_console, unfinished_tail

    assert [unfinished_tail(b) for b in (b"ab", b"a\xe2", b"a\xe2\x82", b"\xe2\x82\xac", b"x\x1b", b"x\x1b[3",
                                         b"x\x1b[31m", b"\xf0\x9f\x98")] == [0, 1, 2, 0, 1, 3, 0, 3]
    with open(tmp_path / "console", "wb") as console:
        writer = ConsoleWriter(clean=clean_console)
        for piece in (b"a\xe2\x82", b"\xac b \x1b[3", b"1mred"):
            writer.write(console, piece, "rank", line_open=True)
        writer.write(console, b"!\n", "rank")
        writer.close()
    assert (tmp_path / "console").read_bytes() == "a\u20ac b \x1b[31mred!\n".encode()


def test_the_end_report_shows_paths_with_escapes_and_newlines_cleaned(tmp_path):
    """The run directory and error file paths are ranktop's words too: a --log-dir named with an
    OSC sequence and a newline (a name taken from a shared directory) retitled the terminal and
    split the `logs:` line in two."""
    script = tmp_path / "rank.py"
    script.write_text("from ranktop.core.errors import record\nrecord(lambda: 1 / 0)()\n")
    log_dir = tmp_path / "lo\x1b]0;PWN\x07gs\nx"
    done = subprocess.run(ranktop_cmd("--headless", "--log-dir", str(log_dir), "--run-id", "r", str(script)),
                          cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 1, done.stderr
    report = done.stderr[done.stderr.index(b"ranktop: rank.py failed"):].decode()
    assert "\x1b" not in report and "\x07" not in report
    shown = f"{tmp_path}/logs\u240ax/r"
    assert f"  error file: {shown}/attempt_0/0/error.json\n" in report
    assert report.endswith(f"  logs: {shown}\n"), report


@pytest.mark.parametrize("env", [{}, {"PYTHONIOENCODING": "ascii"}], ids=["utf-8", "ascii"])
def test_the_end_report_shows_a_paths_bytes_that_are_not_text_as_escapes(tmp_path, env):
    """A --log-dir with a byte that is no UTF-8 (0xff) and an é: the `logs:` line showed the byte
    as `?`, and under an ASCII console the é too, so the path could not be found again from it."""
    script = tmp_path / "rank.py"
    script.write_text("raise SystemExit(3)\n")
    log_dir = os.path.join(os.fsencode(tmp_path), b"l\xff-\xc3\xa9")
    done = subprocess.run([*ranktop_cmd("--headless", "--run-id", "r"), b"--log-dir", log_dir, str(script)],
                          cwd=ROOT, capture_output=True, timeout=60, env={**os.environ, **env})
    assert done.returncode == 1, done.stderr
    e_acute = b"\\xe9" if env else b"\xc3\xa9"
    assert done.stderr.endswith(b"  logs: " + os.fsencode(tmp_path) + b"/l\\xff-" + e_acute + b"/r\n"), done.stderr


def test_the_end_report_names_a_hostile_script_safely(tmp_path):
    """The script's name is ranktop's to print: one named with an OSC sequence retitled the terminal."""
    script = tmp_path / "ev\x1b]0;PWN\x07il.py"
    script.write_text("raise SystemExit(3)\n")
    done = subprocess.run(ranktop_cmd("--headless", "--log-dir", str(tmp_path / "logs"), str(script)), cwd=ROOT,
                          capture_output=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith(b"ranktop: evil.py failed in attempt_0 (1 of 1 attempts)\n") and b"\x1b" not in done.stderr
