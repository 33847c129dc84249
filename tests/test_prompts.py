"""Which unfinished last lines are input prompts (core/prompts.py): the known debugger and REPL
prompts, never a progress bar or a line that only ends like one."""

from __future__ import annotations

import pytest
from ranktop.core.output import LINE_CAP, STDERR, STDOUT, LineRing
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


MADE = None  # in a list of chunks: both rings make what came so far into lines (a view looked)
BLOCK = b"step\n" * 20_000  # a chunk of its own: what comes after it is not gathered into it


@pytest.mark.parametrize("chunks", [
    [(STDOUT, b"step 1\nstep 2\n")],
    [(STDOUT, b"step 1\nstep 2\n(Pdb) ")],
    [(STDOUT, b"step 1\n\r10%|#  |\r50%|### |")],
    [(STDOUT, b"step 1\n\r50%|### |\r")],  # a redraw begun: the bar before it is what shows
    [(STDOUT, b"(Pd"), (STDERR, b"warning\n"), (STDOUT, b"step\nstep\nb) ")],
    [(STDOUT, b"step\n(Pd"), (STDOUT, b"b) ")],  # the prompt's start in a chunk gathered before
    [(STDOUT, b"no newline at all yet")],
    [(STDOUT, b"step\n" + b"x" * (LINE_CAP + 10))],  # an open line past the cap: cut, with its note
    [(STDERR, b"Traceback\n"), (STDOUT, b"a\n" * 50_000 + b">>> ")],  # more than one block
    # The newest chunk holds no newline: a progress bar on the other stream, a line left open
    # after a block of lines, a prompt whose start came chunks before it.
    [(STDOUT, BLOCK), (STDERR, b"\reval:   0%|   | 0/10\reval:  10%|#  | 1/10")],
    [(STDOUT, BLOCK), (STDOUT, b"evaluating... ")],
    [(STDOUT, BLOCK + b"(Pd"), (STDERR, b"w" * 70_000 + b"\n"), (STDOUT, b"b"), (STDERR, b"x\n"), (STDOUT, b") ")],
    [(STDOUT, BLOCK), (STDERR, b"\r 1%|" * 20_000 + b"\r 2%|"), (STDERR, b"\r\r")],  # redrawn for long
    [(STDOUT, BLOCK), (STDOUT, b"x" * (LINE_CAP - 5)), (STDOUT, b"x" * 10)],  # past the cap across chunks
    # The open line began in output made into lines already, and goes on in what waits.
    [(STDOUT, b"step\nepoch 3 \r 5%|"), MADE, (STDERR, b"warning\n"), (STDOUT, b"\r 9%|")],
    [(STDOUT, b"step\n\r 5%|"), MADE, (STDOUT, b"\r")],
    [(STDOUT, b"step\n" + b"x" * LINE_CAP), MADE, (STDOUT, b"y" * 20)],
])
def test_the_open_line_read_from_the_waiting_chunks_is_the_one_made_lines_leave(chunks):
    """A quiet rank's open line is read from the chunks that wait, and none of its lines is made
    for it: making them all (as before) turned every line of 64 quiet ranks nobody watched into a
    Python object, 160 MB of TUI against 97. Until then only a newest chunk with a newline was
    read so: one that held none (a progress bar, a prompt in a write of its own) had them made."""
    ring, made = LineRing(), LineRing()
    for item in chunks:
        for r in (ring, made):
            if item is MADE:
                r.tail()
            else:
                r.feed(*item)
    kept = len(ring.lines)
    made.tail()  # every chunk made into lines: the open line as the ring always gave it
    assert ring.open_line() == made.open_line() == ring.open_line()  # (the second: as worked out before)
    assert len(ring.lines) == kept  # nothing made: the lines still wait as the chunks that came
    assert ring.tail() == made.tail()


def test_a_process_reading_its_stdin_waits_at_its_line_cleaned_and_cut(tmp_path):
    """Any unfinished line is the prompt of a process blocked reading its stdin: shown as a
    terminal would show it, escape sequences dropped, its last 40 characters at most."""
    import subprocess
    import sys

    from conftest import wait_for
    from ranktop.core.prompts import NO_PROMPT, rank_prompt

    line = b"\x1b]52;c;aGk=\x07\x1b[1m" + b"x" * 100 + b" Continue? [y/N] "
    reader = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE)
    try:
        shown = wait_for(lambda: rank_prompt(line, reader.pid), what="the reader blocked in its read")
        assert shown == "\u2026" + "x" * 23 + " Continue? [y/N]" and len(shown) == 40
        assert rank_prompt(None, reader.pid) == NO_PROMPT
        assert rank_prompt(b"(Pdb) ", None) == "(Pdb)"  # a known prompt needs no look at the process
        assert rank_prompt(line, sleeper.pid) is None and rank_prompt(line, None) is None
    finally:
        for proc in (reader, sleeper):
            proc.kill()
            proc.wait()
            proc.stdin.close()
