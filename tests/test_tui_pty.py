"""The real TUI under a pseudo-terminal: everything ranktop writes to the terminal is read and
checked. A rank's escape sequences (in its output, its error.json, its script's name) must never
reach the terminal, while the text around them does."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from conftest import run_in_pty

pytestmark = pytest.mark.timeout(90)

PAYLOAD = "cHduZWQ="  # base64 "pwned": the clipboard text an OSC 52 would set
TITLE = "EVIL-TITLE"
# Every kind of sequence a terminal obeys.
HOSTILE = (
    f"\x1b]52;c;{PAYLOAD}\x07"  # clipboard write
    f"\x1b]0;{TITLE}\x07\x1b]2;{TITLE}\x1b\\"  # window title
    f"\x1b]8;;http://x/\x07\x1b]52;c;{PAYLOAD}\x07\x1b\\link\x1b]8;;\x1b\\"  # payload in a link's URL
    f"\x1bP+q{PAYLOAD}\x1b\\"  # DCS
    "\x1b[2J\x1b[?1049l\x1b[H"  # clear the screen, leave the alternate screen
)
# The rank builds the text from hex, so its traceback's source lines do not quote it.
RANK = (
    "from ranktop.core.errors import record\n"
    f"HOSTILE = bytes.fromhex('{HOSTILE.encode().hex()}').decode()\n"
    "@record\ndef main():\n"
    "    print('rank-out:' + HOSTILE + ':end', flush=True)\n"
    "    raise ValueError('boom:' + HOSTILE + ':end')\n"
    "main()\n"
)
SCRIPT_NAME = f"train\x1b]0;{TITLE}\x07\x1b]52;c;{PAYLOAD}\x07.py"
OSC = re.compile(rb"\x1b\](\d*)[;\x07\x1b]")


def test_no_rank_escape_reaches_the_terminal(tmp_path):
    script = tmp_path / SCRIPT_NAME
    script.write_text(RANK)
    argv = [sys.executable, "-m", "ranktop", "--tui", "--nproc-per-node", "1", "--shutdown-timeout", "3",
            "--log-dir", str(tmp_path / "logs"), str(script)]
    out, status = run_in_pty(argv, tmp_path, until=b"ROOT CAUSE", keys=b"q")
    assert b"ROOT CAUSE" in out, out[-2000:]
    assert status == 1
    # The visible text around the sequences reaches the screen: the script name, output, error.
    for text in (b"train", b"rank-out:", b"ValueError: boom:", b":end"):
        assert text in out, text
    # Nothing the rank sent does: no payload, no title, no clipboard/title/link OSC at all.
    assert PAYLOAD.encode() not in out
    assert TITLE.encode() not in out
    kinds = {m.group(1) for m in OSC.finditer(out)}
    assert not kinds & {b"0", b"1", b"2", b"8", b"52"}, kinds
    assert b"\x1bP" not in out  # no DCS string
    # Textual leaves the alternate screen once, when ranktop quits; a rank's \x1b[?1049l did not.
    assert out.count(b"\x1b[?1049l") <= 1
    assert b"\x1b[2J" not in out.split(b"\x1b[?1049l")[0][out.find(b"rank-out"):]


# A rank that writes UTF-8 (and a byte that is none) whatever its own locale, then ends.
WORDS = "café 漢字 🚀"
UTF8_RANK = f"import sys\nsys.stdout.buffer.write('{WORDS} '.encode() + b'\\xff end\\n')\n"


def _tui_of_one_ending_rank(tmp_path, env: dict) -> bytes:
    script = tmp_path / "words.py"
    script.write_text(UTF8_RANK, encoding="utf-8")
    argv = [sys.executable, "-m", "ranktop", "--tui", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"),
            str(script)]
    out, status = run_in_pty(argv, tmp_path, until=b"DONE", keys=b"q", env=env)
    assert b"DONE" in out, out[-2000:]
    assert status == 0
    return out


def _latin1_locale(tmp_path) -> dict:
    """A real ISO-8859-1 locale (Python's streams then encode Latin-1), made for the test."""
    if shutil.which("localedef") is None:
        pytest.skip("needs localedef")
    (tmp_path / "locales").mkdir()
    subprocess.run(["localedef", "-i", "en_US", "-f", "ISO-8859-1", str(tmp_path / "locales" / "en_US.ISO-8859-1")],
                   check=False, capture_output=True)  # (it warns, exit 1, and still makes it)
    if not (tmp_path / "locales" / "en_US.ISO-8859-1").is_dir():
        pytest.skip("localedef made no en_US.ISO-8859-1 (no locale sources)")
    return {"LOCPATH": str(tmp_path / "locales"), "LC_ALL": "en_US.ISO-8859-1", "LANG": None}


@pytest.mark.parametrize("env", [{"LC_ALL": "C", "LANG": None, "PYTHONUTF8": "0"}, {"PYTHONIOENCODING": "ascii"},
                                 "latin-1"], ids=["C-without-utf8-mode", "ascii-io", "latin-1"])
def test_the_tui_draws_in_utf8_whatever_the_locale(tmp_path, env):
    out = _tui_of_one_ending_rank(tmp_path, _latin1_locale(tmp_path) if env == "latin-1" else env)
    # The frame and the rank's words arrive as UTF-8; they came as \u2588, \xe9 ... escapes, each
    # counted as one cell, which broke every line of the layout.
    assert WORDS.encode() in out
    assert "━".encode() in out  # the end panel's rule
    assert b"\\u" not in out and b"\\x" not in out and b"\\U" not in out


def test_the_tui_takes_its_size_from_the_terminal_not_columns_and_lines(tmp_path):
    # The pty is 160x48; an exported COLUMNS=20 LINES=5 drew the TUI in a 20x5 corner.
    out = _tui_of_one_ending_rank(tmp_path, {"COLUMNS": "20", "LINES": "5"})
    assert b"\x1b[48;1H" in out or b"\x1b[47;1H" in out, "nothing drawn below the fifth line"
    assert b"no GPU" in out  # the header's end: cut at 20 columns
