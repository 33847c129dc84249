"""Which unfinished last lines are a program in a rank waiting for input.

Only prompts no other output looks like are known by their text, matched against the whole line
as a terminal shows it (escape sequences left out): a generic rule (a line ending in '> ', ': ' or
'? ') would take progress bars and status lines for prompts. Any other prompt (`input("Continue? ")`,
a bare `sys.stdin.readline()`) is known by what the rank's process does: the kernel says it waits
in a read of its stdin.
"""

from __future__ import annotations

import os
import re

from ranktop.core.sanitize import clean_bytes

# How long a rank must have been quiet after its prompt: a line that only looks like one for a
# moment, mid-write, is not one.
PROMPT_QUIET = 0.5
PROMPT_LOOK = 1.0  # seconds between looks at a rank reported stalled: has it come to a prompt since?

_PROMPT = re.compile(
    r"\(+Pdb\)+ "  # pdb (`((Pdb)) ` in a recursive `debug`)
    r"|\(Pdb\+\+\) "  # pdb++
    r"|ipdb> "  # ipdb
    r"|>>> "  # Python's interactive console (code.interact, python -i)
    r"|In \[\d+\]: "  # IPython.embed()
)


# The system calls that wait on stdin, per machine: read(2) of fd 0, and select(2)/pselect6(2)
# watching fd 0 alone (nfds 1: how readline waits for a key). /proc/PID/syscall numbers them.
_STDIN_WAITS = {"x86_64": (0, (23, 270)), "aarch64": (63, (72,)), "riscv64": (63, (72,))}.get(os.uname().machine)
NO_PROMPT = "stdin"  # what a rank reading stdin with no prompt of its own is shown waiting at
_SHOWN = 40  # characters of an unknown prompt shown in its place


def waits_on_stdin(pid: int) -> bool:
    """Whether process `pid` is blocked reading its stdin, as its /proc/PID/syscall says (False
    where that cannot be read: another user's process, a machine whose numbers we do not know)."""
    if _STDIN_WAITS is None:
        return False
    try:
        with open(f"/proc/{pid}/syscall", "rb") as f:
            fields = f.read(256).split()
        number, first = int(fields[0]), int(fields[1], 16)  # "running" or "-1 sp pc": not in a call
    except (OSError, ValueError, IndexError):
        return False
    read, selects = _STDIN_WAITS
    return (number == read and first == 0) or (number in selects and first == 1)


def rank_prompt(open_line: bytes | None, pid: int | None) -> str | None:
    """The prompt a quiet rank waits at: a known one (`input_prompt`); else, while process `pid`
    waits on its stdin, its unfinished line as shown (cut), or NO_PROMPT; None otherwise."""
    if (known := input_prompt(open_line)) is not None:
        return known
    if pid is None or not waits_on_stdin(pid):
        return None
    line = clean_bytes(open_line[-1024:]).strip() if open_line else ""
    return (line if len(line) <= _SHOWN else "\u2026" + line[-_SHOWN + 1:]) or NO_PROMPT


def input_prompt(open_line: bytes | None) -> str | None:
    """The prompt `open_line` (a rank's unfinished last line) is, e.g. '(Pdb)'; None if not one."""
    if not open_line or len(open_line) > 256:  # (a prompt is short; cleaning a long line costs)
        return None
    line = clean_bytes(open_line)
    return line.strip() if _PROMPT.fullmatch(line) else None
