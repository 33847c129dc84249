"""Which unfinished last lines are a program in a rank waiting for input.

Only prompts no other output looks like are known, matched against the whole line as a terminal
shows it (escape sequences left out): a generic rule (a line ending in '> ', ': ' or '? ') would
take progress bars and status lines for prompts. An `input("Continue? ")` is not recognised.
"""

from __future__ import annotations

import re

from ranktop.core.sanitize import clean_bytes

# How long a rank must have been quiet after its prompt: a line that only looks like one for a
# moment, mid-write, is not one.
PROMPT_QUIET = 0.5

_PROMPT = re.compile(
    r"\(+Pdb\)+ "  # pdb (`((Pdb)) ` in a recursive `debug`)
    r"|\(Pdb\+\+\) "  # pdb++
    r"|ipdb> "  # ipdb
    r"|>>> "  # Python's interactive console (code.interact, python -i)
    r"|In \[\d+\]: "  # IPython.embed()
)


def input_prompt(open_line: bytes | None) -> str | None:
    """The prompt `open_line` (a rank's unfinished last line) is, e.g. '(Pdb)'; None if not one."""
    if not open_line or len(open_line) > 256:  # (a prompt is short; cleaning a long line costs)
        return None
    line = clean_bytes(open_line)
    return line.strip() if _PROMPT.fullmatch(line) else None
