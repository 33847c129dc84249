"""The real TUI under a pseudo-terminal: everything ranktop writes to the terminal is read and
checked. A rank's escape sequences (in its output, its error.json, its script's name) must never
reach the terminal, while the text around them does."""

from __future__ import annotations

import re
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
