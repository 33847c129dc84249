"""Which unfinished last lines are input prompts (core/prompts.py): the known debugger and REPL
prompts, never a progress bar or a line that only ends like one."""

from __future__ import annotations

import pytest
from ranktop.core.output import STDERR, STDOUT, LineRing
from ranktop.core.prompts import input_prompt


@pytest.mark.parametrize("line, prompt", [
    (b"(Pdb) ", "(Pdb)"),
    (b"((Pdb)) ", "((Pdb))"),  # a recursive `debug`
    (b"(Pdb++) ", "(Pdb++)"),
    (b"ipdb> ", "ipdb>"),
    (b">>> ", ">>>"),
    (b"In [12]: ", "In [12]:"),
    (b"\x1b[?2004h(Pdb) ", "(Pdb)"),  # readline's bracketed paste on a terminal
    (b"\x1b[1;35m>>> \x1b[0m", ">>>"),  # a coloured REPL
])
def test_known_prompts_are_prompts(line, prompt):
    assert input_prompt(line) == prompt


@pytest.mark.parametrize("line", [
    None, b"", b"50%|####   |", b" 50%|#####     | 5/10 [00:01<00:01,  4.99it/s]", b"Continue? [y/N] ",
    b"Password: ", b"epoch 3> ", b"loading... ", b"... ", b"x (Pdb) ", b"(Pdb)", b"(Pdb) " + b"x" * 300,
])
def test_other_lines_are_not(line):
    assert input_prompt(line) is None


def test_the_rings_open_line_is_the_last_streams_as_shown():
    ring = LineRing()
    assert ring.open_line() is None
    ring.feed(STDOUT, b"> /x.py(3)<module>()\n(Pd")
    ring.feed(STDERR, b"warning\n")
    ring.feed(STDOUT, b"b) ")
    assert ring.open_line() == b"(Pdb) "
    ring.feed(STDERR, b"a line of its own\n")  # the last stream ended its line
    assert ring.open_line() is None
    ring.feed(STDOUT, b"\r10%|#  |\r50%|### |")
    assert ring.open_line() == b"50%|### |"
    ring.clear()
    assert ring.open_line() is None
