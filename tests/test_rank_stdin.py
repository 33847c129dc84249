"""Typing into a rank: the TUI's `i` reaches a breakpoint() in a rank (pdb over a pipe), and
headless ranks read ranktop's own stdin, as under torchrun."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from conftest import drive, make_agent, read_events, run_ranktop, screen_rows, until, wait_for
from ranktop.core import commands as cmd
from ranktop.core.engine import FIRST_LOOK_LINES, LocalEngine
from ranktop.tui.app import RanktopApp

PDB_RANK = (
    "import os\n"
    "x = 41 + int(os.environ['LOCAL_RANK'])\n"
    "print('before', flush=True)\n"
    "breakpoint()\n"
    "print('after', x, flush=True)\n"
)


def pane_text(app, local_rank: int) -> str:
    return "\n".join(line.decode(errors="replace") for line in app.engine.agent.output(local_rank))


def test_i_types_into_a_breakpoint_and_the_rank_goes_on(tmp_path):
    app = RanktopApp(LocalEngine(make_agent(tmp_path, PDB_RANK, n=2, name="pdb.py")))

    async def body(app, pilot):
        await until(pilot, lambda: all(b"before" in b"".join(app.engine.agent.output(r)) for r in range(2)),
                    what="both ranks at their breakpoint")
        await pilot.press("1", "i")
        await until(pilot, lambda: app.main.query_one("#stdin").display, what="the stdin box")
        await pilot.press(*"p x", "enter")
        await until(pilot, lambda: "42" in pane_text(app, 1), what="pdb printed x of rank 1")
        await pilot.press(*"c", "enter")
        await until(pilot, lambda: "after 42" in pane_text(app, 1), what="rank 1 went on")
        assert "p x" in pane_text(app, 1)  # the typed line shows in the pane, as a terminal echoes it
        assert "after" not in pane_text(app, 0)  # rank 0 still waits in its own pdb
        await pilot.press("escape")
        ack = app.engine.submit(cmd.SendInput(0, "c\n"))
        assert ack.ok and ack.message == "typed 2 bytes into rank 0"
        await until(pilot, lambda: app.main.ended, what="both ranks done")
        typed = [e for e in read_events(app.engine.agent.run_dir) if e["event"] == "user_input"]
        assert [(e["rank"], e["bytes"]) for e in typed] == [(1, 4), (1, 2), (0, 2)]
        await pilot.press("q")

    drive(app, body)
    assert app.exit_status == 0


def test_i_types_into_pdb_on_a_pty_and_the_pane_shows_the_command(tmp_path):
    """--pty: the rank's terminal echoes what `i` types, as a keyboard's would. It did not echo,
    and pdb's readline echoes only where its terminal does: the pane read `(Pdb) 41`, never
    `p x`, in the pane and in stdout.log alike."""
    app = RanktopApp(LocalEngine(make_agent(tmp_path, PDB_RANK, n=1, name="pdb.py", pty=True)))

    async def body(app, pilot):
        await until(pilot, lambda: "(Pdb) " in pane_text(app, 0), what="the pdb prompt")
        await pilot.press("i", *"p x", "enter")
        await until(pilot, lambda: "(Pdb) p x\n41\n(Pdb) " in pane_text(app, 0), what="the command, its answer")
        await pilot.press("c", "enter")
        await until(pilot, lambda: app.main.ended, what="the rank done")
        await pilot.press("q")

    drive(app, body)
    assert app.exit_status == 0
    log = (Path(app.engine.agent.run_dir) / "attempt_0" / "0" / "stdout.log").read_text()
    assert "(Pdb) p x\n41\n(Pdb) c\nafter 41\n" in log


PROMPTS = "import os\nline = input(f\"rank {os.environ['RANK']}? \")\nprint('got', line, flush=True)\n"


def test_the_stdin_box_types_into_the_rank_it_names_and_closes_at_the_end(tmp_path):
    """The box typed into whichever pane had the focus when enter came: a click on rank 1's pane
    while `rank 0 stdin` was open sent rank 0's answer to rank 1. And it stayed open, focused,
    after the run ended, so the end panel's `q quits` typed a `q` into it."""
    app = RanktopApp(LocalEngine(make_agent(tmp_path, PROMPTS, n=2, name="prompts.py")))

    async def body(app, pilot):
        await until(pilot, lambda: all(f"rank {r}? " in pane_text(app, r) for r in range(2)), what="both prompts")
        await pilot.press("0", "i")
        await pilot.click("#pane-1", offset=(5, 3))
        assert app.main.current == 1
        # A click back into the box: it still says rank 0. (A focus() here raced the click on
        # pane 1: its Picked, still queued, focused that pane's log after the box, and "zero"
        # went to the screen's keys. The click's pauses let the Picked land first.)
        box = app.main.query_one("#stdin")
        await pilot.click("#stdin")
        await until(pilot, lambda: app.focused is box, what="the box focused")
        await pilot.press(*"zero", "enter")
        await until(pilot, lambda: "got zero" in pane_text(app, 0), what="rank 0's answer")
        assert "got" not in pane_text(app, 1)
        await pilot.press("escape", "1", "i", *"one", "enter")
        await until(pilot, lambda: app.main.ended, what="both ranks done")
        assert not app.main.query_one("#stdin").display
        await pilot.press("q")  # leaves at once: nothing left to type into

    drive(app, body)
    assert app.exit_status == 0 and "got one" in pane_text(app, 1)


def test_the_footer_offers_no_search_while_the_stdin_box_is_typed_into(tmp_path):
    """With the box open the footer showed `/ Search` alone, and `/` typed a slash into the box."""
    from test_tui_fake import shown_footer_keys

    app = RanktopApp(LocalEngine(make_agent(tmp_path, "import sys\nfor line in sys.stdin:\n    print('got', line, end='', flush=True)\n",
                                            n=1, name="echo.py")))

    def offered() -> set[str]:
        return {key.description for key in shown_footer_keys(app)}

    async def body(app, pilot):
        await until(pilot, lambda: "Search" in offered(), what="the grid's footer")
        await pilot.press("i")
        await until(pilot, lambda: app.focused is app.main.query_one("#stdin"), what="the stdin box")
        await until(pilot, lambda: "Search" not in offered(), what="a footer without / Search")
        await pilot.press(*"a/b", "enter")
        await until(pilot, lambda: "got a/b" in pane_text(app, 0), what="the line with its slash")
        await pilot.press("escape")
        await until(pilot, lambda: "Search" in offered(), what="/ Search back with the box closed")

    drive(app, body)


def _pasted(text: str) -> list:
    """What the driver posts for `text` pasted in a terminal: its bracketed paste read through
    the decoder Textual's input thread uses and Textual's parser, in four reads."""
    import ranktop.tui.driver  # noqa: F401 (it sets the driver's decoder)
    from textual._xterm_parser import XTermParser
    from textual.drivers import linux_driver

    decode, parser = linux_driver.getincrementaldecoder("utf-8")().decode, XTermParser()
    data = f"\x1b[200~{text}\x1b[201~".encode()
    reads = (data[:3], data[3:len(data) // 2], data[len(data) // 2 : -3], data[-3:])
    return [event for piece in reads if (shown := decode(piece)) for event in parser.feed(shown)]


def test_a_paste_is_shown_and_sent_without_its_escape_sequences():
    """Found by fuzzing `i` into an attached run: a paste went into the box as it came, and
    Textual drew it raw, so a pasted `ESC ] 52 ; c ; ... ESC \\` wrote the terminal's clipboard
    and `ESC [ 2 J` cleared the screen; sent, a pasted Ctrl-C or Ctrl-S reached a --pty rank's
    terminal, whose line discipline acted on it. A paste's sequences are dropped and its controls
    shown as symbols, in every box, as the panes show a rank's output (its characters at widths
    Rich and the terminal agree on too): the line sent is the one shown.
    And a paste is one: Textual's parser ended it at its first ESC, and the rest came as keys
    (`^]52;c;...`, Ctrl-C, an enter that sent a line of it to the rank)."""
    from fake_engine import FakeEngine
    from test_tui_fake import drive as drive_fake

    engine = FakeEngine(2)

    async def body(app, pilot):
        await pilot.press("i")
        box = app.main.query_one("#stdin")
        for event in _pasted("p x\x1b]52;c;ZXZpbA==\x1b\\ \x1b[2J\x03\x13y\u202e\r\nq"):
            app.post_message(event)
        await until(pilot, lambda: box.value, what="the paste in the box")
        await pilot.pause()
        assert box.value == "p x ␃␓y⟨U+202E⟩"  # its first line
        assert not [row for row in screen_rows(app) if "\x1b" in row]
        await pilot.press("enter")
        await until(pilot, lambda: engine.commands, what="the line sent")
        assert engine.commands == [cmd.SendInput(0, "p x ␃␓y⟨U+202E⟩\n")]
        await pilot.press("escape", "slash")
        # (and at widths Rich and the terminal agree on, as a pane draws them: U+3164 is 0 cells
        # to Rich and 2 to tmux, the skin tone 0 and 2; cells.agreed_widths)
        for event in _pasted("loss\x1b[31m 0.5\x1b[0m\u3164👍🏽"):
            app.post_message(event)
        await until(pilot, lambda: app.main.query_one("#search").value == "loss 0.5\ufffd👍", what="the search's paste")

    drive_fake(engine, body)


def test_the_stdin_box_holds_at_most_the_line_a_rank_may_be_typed_and_says_so_of_a_paste():
    """Found by fuzzing `i`: the box had no bound, and its keys slowed as a paste of 250,000
    characters grew it, for a line the engine refuses once sent (cmd.MAX_INPUT, its line break
    included). A paste past the bound is refused whole, in one line; a key, with the bell."""
    from fake_engine import FakeEngine
    from test_tui_app import notes
    from test_tui_fake import drive as drive_fake
    from textual import events

    engine = FakeEngine(1)
    longest = cmd.MAX_INPUT - 1

    async def body(app, pilot):
        await pilot.press("i")
        box = app.main.query_one("#stdin")
        app.post_message(events.Paste("x" * (longest - 5)))
        await until(pilot, lambda: box.value, what="the paste in the box")
        app.post_message(events.Paste("y" * 250_000))
        await until(pilot, lambda: "nothing pasted" in notes(app), what="the paste refused")
        assert notes(app) == (f"nothing pasted: the line would be {longest + 250_000 - 5:,} characters, and one "
                              f"typed into a rank is at most {longest:,}")
        app.post_message(events.Paste("y" * 5))  # what still fits goes in
        await until(pilot, lambda: len(box.value) == longest, what="the line at its longest")
        await pilot.press("z")  # a key past the bound: the bell
        await pilot.press("enter")
        await until(pilot, lambda: engine.commands, what="the line sent")
        assert engine.commands == [cmd.SendInput(0, "x" * (longest - 5) + "yyyyy\n")]
        assert cmd.problem(engine.commands[0], 1) is None  # the longest line the engine takes

    drive_fake(engine, body)


def test_input_to_a_rank_that_ended_or_a_bad_one_is_refused(tmp_path):
    app = RanktopApp(LocalEngine(make_agent(tmp_path, "print('done')", n=1)))

    async def body(app, pilot):
        await until(pilot, lambda: app.main.ended, what="rank done")
        assert app.engine.submit(cmd.SendInput(3, "x\n")).message == "bad local rank 3: local ranks are 0..0"
        too_long = app.engine.submit(cmd.SendInput(0, "x" * (cmd.MAX_INPUT + 1)))
        assert not too_long.ok and too_long.message == f"bad input: expected text of at most {cmd.MAX_INPUT} characters"
        await pilot.press("q")

    drive(app, body)


def test_a_line_the_ranks_pipe_has_no_room_for_is_typed_whole_or_not_at_all(tmp_path):
    """Found by fuzzing `i` into an attached run: a pasted line of 150 KB (60,000 `é`, under the
    64k characters a line may have) went into the rank's pipe as far as it had room, 64 KiB, and
    the refusal said so; the part left in the pipe had no line break, so the rank read it with
    the next line typed, `c`, as one. A line goes whole or not at all."""
    engine = LocalEngine(make_agent(tmp_path, "import sys\nfor line in sys.stdin:\n    print('got', len(line), flush=True)\n",
                                    n=1, name="reader.py"))
    engine.start()
    try:
        wait_for(lambda: engine.snapshot().ranks[0].pid, what="the rank started")
        ack = engine.submit(cmd.SendInput(0, "é" * 60_000 + "\n"))
        assert engine.submit(cmd.SendInput(0, "c\n")).ok
        wait_for(lambda: b"got" in b"".join(engine.agent.output(0)), what="the rank's answer")
        assert [line for line in engine.agent.output(0) if line.startswith(b"got")] == [b"got 2"]  # was `got 65538`
        assert not ack.ok and ack.message == ("rank 0's stdin has no room for the line (120001 bytes): it is not "
                                              "reading, or the line is more than its pipe holds; nothing was typed")
    finally:
        engine.close()


def test_headless_ranks_read_ranktops_stdin(tmp_path):
    code = "import sys; line = sys.stdin.readline(); print('got', line.strip(), flush=True)"
    done = run_ranktop("--headless", "--no-python", "--log-dir", str(tmp_path), sys.executable, "-c", code,
                       input="hello\n")
    assert done.returncode == 0, done.stderr
    assert "got hello" in done.stdout


def test_breakpoint_driven_through_i_in_a_real_terminal(tmp_path):
    from conftest import ROOT
    from test_tui_tmux import Terminal

    script = tmp_path / "pdb_rank.py"
    script.write_text(PDB_RANK)
    term = Terminal(f"cd {ROOT} && {sys.executable} -m ranktop --tui --nproc-per-node 1 --log-dir {tmp_path / 'logs'} "
                    f"{script}; echo EXIT $?; sleep 30", width=100, height=30)
    try:
        term.wait_screen("(Pdb)")
        term.press("i")
        term.wait_screen("stdin of rank 0")
        term.press("p x", "Enter")
        term.wait_screen("41")
        term.press("c", "Enter")
        term.wait_screen("after 41")
        wait_for(lambda: "stdin of rank 0" not in term.screen(), what="the stdin box closed at the end")
        term.press("q")
        term.wait_screen("EXIT 0")
    finally:
        term.close()


# ----- the cue: a rank waiting at a prompt -------------------------------------------------------
# Rank 0 stops in pdb; rank 1 waits for it, silent, as a rank in a collective would.
PDB_AND_WAITER = (
    "import os, time\n"
    "if os.environ['LOCAL_RANK'] == '0':\n"
    "    print('before', flush=True)\n"
    "    breakpoint()\n"
    "    print('after', flush=True)\n"
    "else:\n"
    "    print('in the collective', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_rank_at_a_pdb_prompt_is_titled_input_not_stalled_and_listed_as_a_problem(tmp_path):
    """Rank 0 at its `(Pdb) ` prompt looked like the rank waiting for it: `running`, then
    `stalled` after --stall-timeout. Its title says `input (i)`, the compact list's problems
    filter shows it, and it is `running` again as soon as it prints."""
    from ranktop.tui.panes import list_order
    from test_tui_app import title

    app = RanktopApp(LocalEngine(make_agent(tmp_path, PDB_AND_WAITER, n=2, name="pdb.py", stall_timeout=1.0)))

    async def body(app, pilot):
        await until(pilot, lambda: " input (i) " in title(app, 0) and " stalled " in title(app, 1),
                    what="rank 0 waiting for input, rank 1 stalled")
        snap = app.engine.snapshot()
        assert snap.ranks[0].input_prompt == "(Pdb)" and snap.ranks[1].input_prompt is None
        assert [r.rank for r in list_order(snap.ranks, "state", "problems", snap.taken_at)] == [0, 1]
        await pilot.press("0", "i", "c", "enter")
        await until(pilot, lambda: "after" in pane_text(app, 0), what="rank 0 went on")
        assert app.engine.snapshot().ranks[0].input_prompt is None  # it printed: no prompt any more
        await until(pilot, lambda: " running " in title(app, 0), what="rank 0's title running again")

    drive(app, body)


def test_the_input_prompt_goes_through_local_agent_and_a_progress_bar_is_no_prompt(tmp_path):
    """Rank 0 ends in an unfinished progress bar, rank 1 in a `(Pdb) ` it wrote itself and
    reads stdin after: only rank 1 waits for input, and stops as soon as it prints again."""
    from conftest import Running

    code = (
        "import os, sys, time\n"
        "if os.environ['LOCAL_RANK'] == '0':\n"
        "    sys.stdout.write('epoch 1\\n\\r10%|#    |\\r50%|####   |'); sys.stdout.flush()\n"
        "else:\n"
        "    sys.stdout.write('> /x.py(3)<module>()\\n(Pdb) '); sys.stdout.flush()\n"
        "    sys.stdin.readline()\n"
        "    print('went on', flush=True)\n"
        "time.sleep(60)\n"
    )
    agent = make_agent(tmp_path, code, n=2)
    with Running(agent) as agent:
        ranks = wait_for(lambda: quiet_ranks(agent, lambda now: now[1].input_prompt),
                         what="both ranks quiet, rank 1 at its prompt")
        assert (ranks[0].input_prompt, ranks[1].input_prompt) == (None, "(Pdb)")
        assert ranks[1].state.value == "running"
        assert agent.submit(cmd.SendInput(1, "c\n")).ok
        wait_for(lambda: b"went on" in b"\n".join(agent.output(1)), what="rank 1 printed again")
        assert agent.snapshot().ranks[1].input_prompt is None


def test_the_snapshots_of_quiet_ranks_leave_their_output_as_it_came(tmp_path):
    """A live rank gone quiet after a burst of lines is looked at for a prompt in every snapshot.
    That look made all its waiting output into lines, one Python object each: 64 such ranks of
    10k lines held a TUI of 160 MB where 97 MB holds them as read (`bench/bench_tui.py --cases
    memory`), and so did 64 whose last write held no newline (a progress bar on stderr) until
    that was read from the waiting chunks too. Its lines are all still there when a view asks,
    and a prompt is still seen. A look at its newest lines (a pane's first) makes none of the
    ring's own either: `ranktop attach` looks ahead at every rank, and an engine of 72 MB held 148;
    nor do --metric's looks at every rank (a TUI of 156 MB against 96)."""
    from conftest import Running
    from ranktop.tui.metric import Tracker, compile_metric

    code = (
        "import os, sys, time\n"
        "sys.stdout.write(''.join(f'step {i} loss 0.5\\n' for i in range(20000))); sys.stdout.flush()\n"
        "if os.environ['LOCAL_RANK'] == '1':\n"
        "    sys.stdout.write('(Pdb) '); sys.stdout.flush(); sys.stdin.readline()\n"
        "time.sleep(0.2); sys.stderr.write('\\reval:  10%|#  | 1/10'); sys.stderr.flush()\n"
        "time.sleep(60)\n"
    )
    agent = make_agent(tmp_path, code, n=2)
    with Running(agent) as agent:
        for _ in range(3):  # quiet past PROMPT_QUIET, then a few more snapshots look again
            ranks = wait_for(lambda: quiet_ranks(agent, lambda now: now[1].input_prompt), what="both ranks quiet")
        assert (ranks[0].input_prompt, ranks[1].input_prompt) == (None, "(Pdb)")
        ring = agent.pcontext.slots[0].ring
        assert not ring.lines and ring.held_bytes >= sum(len(f"step {i} loss 0.5\n") for i in range(10_000, 20_000))
        # A pane's first look (an attached view's look ahead at every rank): its lines made aside
        _cursor, first_look, open_lines = LocalEngine(agent).output_since(0, None, FIRST_LOOK_LINES)
        assert first_look == [f"step {i} loss 0.5".encode() for i in range(20_000 - FIRST_LOOK_LINES, 20_000)]
        assert open_lines == [b"eval:  10%|#  | 1/10"] and not ring.lines
        # --metric reads every rank once a second, shown or not: the first look, then nothing new
        tracker = Tracker(LocalEngine(agent), compile_metric(r"step (\d+)"))
        for now in (1.0, 2.0, 3.0):
            assert tracker.update(agent.snapshot(), now=now)
        assert tracker.ranks[0].value == "19999" and tracker.ranks[0].rate == 0.0 and not ring.lines
        lines = agent.output(0)  # the ring's newest 10k, made now, and the bar
        assert len(lines) == 10_001 and lines[-2:] == [b"step 19999 loss 0.5", b"eval:  10%|#  | 1/10"]


READS_STDIN = (
    "import os, sys, time\n"
    "r = os.environ['LOCAL_RANK']\n"
    "if r == '0':\n"
    "    print('went on', input('Continue? [y/N] '), flush=True)\n"
    "elif r == '1':\n"
    "    print('ready', flush=True)\n"
    "    sys.stdin.readline()\n"
    "    print('went on', flush=True)\n"
    "else:\n"
    "    sys.stdout.write('Continue? '); sys.stdout.flush()\n"
    "time.sleep(60)\n"
)


def quiet_ranks(agent, ready) -> list | None:
    """The ranks once all have been quiet past PROMPT_QUIET and `ready(ranks)` holds."""
    snap = agent.snapshot()
    quiet = all(r.last_output_at and r.last_output_at + 0.6 < snap.taken_at for r in snap.ranks)
    return snap.ranks if quiet and ready(snap.ranks) else None


def test_a_rank_reading_its_stdin_waits_at_whatever_prompt_it_wrote(tmp_path):
    """`input("Continue? [y/N] ")` and a bare `sys.stdin.readline()` were `running`, then
    `stalled`: only known debugger prompts counted. A rank blocked reading its stdin (the kernel's
    /proc/PID/syscall) waits at its unfinished line, or at `stdin` with none; a rank that wrote
    the same words and sleeps does not."""
    from conftest import Running

    agent = make_agent(tmp_path, READS_STDIN, n=3)
    with Running(agent) as agent:
        ranks = wait_for(lambda: quiet_ranks(agent, lambda rs: rs[0].input_prompt and rs[1].input_prompt),
                         what="ranks 0 and 1 at their prompts")
        assert [r.input_prompt for r in ranks] == ["Continue? [y/N]", "stdin", None]
        assert agent.submit(cmd.SendInput(0, "y\n")).ok and agent.submit(cmd.SendInput(1, "\n")).ok
        for r in (0, 1):
            wait_for(lambda r=r: b"went on" in b"\n".join(agent.output(r)), what=f"rank {r} went on")
        assert [r.input_prompt for r in agent.snapshot().ranks] == [None, None, None]


def test_a_rank_reading_its_terminal_through_readline_waits_at_its_prompt(tmp_path):
    """On --pty, readline waits for a key in pselect6 on fd 0, not in read."""
    from conftest import Running

    code = "import readline\nprint('went on', input('go? '), flush=True)\nimport time; time.sleep(60)\n"
    agent = make_agent(tmp_path, code, n=1, pty=True)
    with Running(agent) as agent:
        (rank,) = wait_for(lambda: quiet_ranks(agent, lambda rs: rs[0].input_prompt), what="the prompt")
        assert rank.input_prompt == "go?"
        assert agent.submit(cmd.SendInput(0, "y\n")).ok
        wait_for(lambda: b"went on y" in b"\n".join(agent.output(0)), what="the rank went on")


def headless_lines_of_rank_0(tmp_path, script_text: str, answer: bytes, stalled: Path | None = None) -> list[str]:
    """Run `script_text` headless (--stall-timeout 1) until it says a rank waits for input (having
    made the file `stalled` once it said the rank stalled, if given), type `answer` into its stdin,
    and return rank 0's lines on stderr once it exited 0."""
    import subprocess

    from conftest import ranktop_cmd, stop_process

    script = tmp_path / "rank.py"
    script.write_text(script_text)
    err = tmp_path / "stderr.txt"
    with open(err, "wb") as sink:
        proc = subprocess.Popen(ranktop_cmd("--headless", "--stall-timeout", "1", "--nproc-per-node", "1",
                                            "--run-id", "hl", "--log-dir", str(tmp_path / "logs"), str(script)),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=sink)
    try:
        if stalled is not None:
            wait_for(lambda: "stalled" in err.read_text(), timeout=20, what="the stall reported")
            stalled.touch()
        wait_for(lambda: "waits for input" in err.read_text(), timeout=20, what="the headless line")
        proc.stdin.write(answer)
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        stop_process(proc)
    return [line for line in err.read_text().splitlines() if "rank 0" in line]


def test_headless_says_a_rank_without_a_prompt_waits_on_its_stdin(tmp_path):
    lines = headless_lines_of_rank_0(tmp_path, "import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n", b"\n")
    assert len(lines) == 1 and re.fullmatch(r"ranktop: rank 0 waits for input on its stdin: no output for \ds "
                                            r"\(pid \d+\)", lines[0]), lines


def test_a_rank_that_printed_nothing_waits_on_its_stdin(tmp_path):
    """A rank whose first act is to read its stdin: `starting` in the TUI, then `stalled` headless,
    never waiting for input (the prompt was looked for only after its first output)."""
    from conftest import Running

    agent = make_agent(tmp_path, "import sys, time\nsys.stdin.readline()\ntime.sleep(60)\n", n=1)
    with Running(agent) as agent:
        wait_for(lambda: agent.snapshot().ranks[0].input_prompt == "stdin", what="rank 0 at its stdin")
    (tmp_path / "headless").mkdir()
    lines = headless_lines_of_rank_0(tmp_path / "headless", "import sys\nsys.stdin.readline()\n", b"\n")
    assert len(lines) == 1 and lines[0].startswith("ranktop: rank 0 waits for input on its stdin: "), lines


def test_a_rank_reported_stalled_that_comes_to_read_its_stdin_is_said_to_wait_for_input(tmp_path):
    """A silent step longer than --stall-timeout, then a read of stdin with no prompt of its own:
    headless said `stalled` and nothing more, though the rank waited for someone to type."""
    reported = tmp_path / "reported"
    code = (f"import os, sys, time\nprint('ready', flush=True)\nwhile not os.path.exists({str(reported)!r}):\n"
            "    time.sleep(0.05)\nsys.stdin.readline()\n")
    lines = headless_lines_of_rank_0(tmp_path, code, b"\n", stalled=reported)
    assert len(lines) == 2 and lines[0].startswith("ranktop: rank 0 stalled: no output for "), lines
    assert re.fullmatch(r"ranktop: rank 0 waits for input on its stdin: no output for \ds \(pid \d+\)", lines[1]), lines
    said = [(e["event"], e["input_prompt"]) for e in read_events(tmp_path / "logs" / "hl")
            if e["event"] in ("stall_detected", "waits_for_input")]
    assert said == [("stall_detected", None), ("waits_for_input", "stdin")], said


def test_headless_says_once_that_a_rank_waits_for_input_where_it_said_stalled(tmp_path):
    lines = headless_lines_of_rank_0(tmp_path, PDB_RANK, b"c\n")
    assert len(lines) == 1 and re.fullmatch(r"ranktop: rank 0 waits for input at its \(Pdb\) prompt: no output "
                                            r"for \ds \(pid \d+\)", lines[0]), lines
    (stall,) = [e for e in read_events(tmp_path / "logs" / "hl") if e["event"] == "stall_detected"]
    assert stall["input_prompt"] == "(Pdb)"
