"""Fuzz three corners of the TUI the earlier fuzzers left out. By hand, minutes each, never in the
test suite (its findings are: each has a test of its own):

    nice -n 10 python scripts/fuzz_tui.py copy  [--actions 3000] [--sessions 30] [--seed 1]
    nice -n 10 python scripts/fuzz_tui.py pager [--actions 300]  [--sessions 10] [--seed 1]  (tmux)
    nice -n 10 python scripts/fuzz_tui.py stdin [--actions 1500] [--sessions 10] [--seed 1]

copy   Pilot over a FakeEngine whose ranks print hostile lines (escape sequences, OSC 52, bidi
       controls, NULs, invalid UTF-8, wide, combining and joined characters, U+2028, lines of up
       to 50,000 characters); mouse drags, double and triple clicks, V selections, copies (y,
       ctrl+c, enter), wrap, zoom, sideways and page scrolls, resizes, group restarts. After each
       drag: the pane highlights the characters the selection holds. After each copy: the
       clipboard holds no control character but the line break, the OSC 52 sequence Textual
       writes is base64 of exactly that text, and each copied line is its selected part (the
       rows of a wrapped line are one line).
pager  `ranktop --tui` in tmux, one rank printing hostile lines; `o` with a $PAGER script whose
       mode changes each time: it exits at once, fails, dies of SIGKILL, signals its own process
       group (as the terminal's Ctrl-C, Ctrl-\\ and Ctrl-Z do), writes 3 MB of the log or of
       escape sequences to the terminal, leaves the terminal raw, waits for a key (given Enter,
       Ctrl-C or Ctrl-\\), leaves a child behind, execs what does not exist, or is `less` given its
       keys (q, F then Ctrl-C, G, a search, Ctrl-Z); the rank's log missing, both missing, 20 GiB
       sparse, a FIFO, a link to /; resizes meanwhile; bytes typed that are not UTF-8. A third of
       the sessions have a $PAGER of their own: not on PATH, a directory, not executable, empty,
       blank, unbalanced quotes, a 120,000-character path, /bin/false, `less`. After each action:
       no pager left, the TUI on screen without a traceback, ranktop and the rank running and not
       stopped (state T), no signal, stop or exit in events.jsonl.
stdin  a --detach run of three ranks that read their stdin (rank 0 records each line it reads,
       rank 1 reads slowly, rank 2 exits on `exit`), --pty in a third of the runs, attached from
       Pilot as `ranktop attach` does; `i`, pastes (controls, escape sequences, several lines,
       50,000 characters, more than a line may carry), typed words, enter, esc, clicks on other
       panes, ranks killed from outside, the run stopped with the box open. After each action:
       the app is up, no raw control character is on screen, the box closes within 3 s of the
       run's end; at the end of a run (without --pty, whose line discipline edits what is typed)
       rank 0 read each line the engine said it typed, whole and in order.

Each area prints a line for each thing found (the seed and action it was first found at) and the
count of actions by kind; the exit status is 1 where anything was found. FUZZ_VERBOSE=1 prints
each action and the keys sent (pager), and more about a finding; FUZZ_KEEP=1 leaves the pager's
tmux server and the scratch files for a look by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import itertools
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the FakeEngine and the tests' waits

SCRATCH = Path(os.environ.get("FUZZ_SCRATCH") or tempfile.gettempdir()) / f"ranktop-fuzz-{os.getpid()}"

# Whatever a terminal could act on, or that reads as something else: C0 but tab and newline, DEL,
# C1, the bidi embeddings, overrides and isolates, and lone surrogates.
UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
UNSAFE_ON_SCREEN = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


# ----- hostile text ---------------------------------------------------------------------------------
PIECES = [
    "\x1b]52;c;ZXZpbA==\x07", "\x1b]52;c;ZXZpbA==\x1b\\", "\x1b]0;pwned\x07", "\x1b[2J", "\x1b[H", "\x1b[31m", "\x1b[0m",
    "\x1b[1;44m", "\x1bP+q\x1b\\", "\x1b]8;;https://evil.example/\x07link\x1b]8;;\x07", "\x1bc", "\x1b7", "\x1b",
    "\x9b2J", "\x9d0;t\x9c", "\u202e", "\u2066", "\u2069", "\u200f", "\u200d", "\x00", "\x07", "\x08", "\r", "\t",
    "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029", "日本語", "テキスト", "한국어", "👍", "👨‍👩‍👧", "🇫🇷",
    "e\u0301", "\u0338", "ﷺ", "\ufeff", "\ufffd", "Ａ", "word", "loss 0.123", " ", "  ", "x" * 80,
]
RAW_PIECES = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80\x81", b"\xe6\x97"]


def hostile_text(rng: random.Random, longest: int = 200) -> str:
    parts = [rng.choice(PIECES) for _ in range(rng.randint(1, 12))]
    if rng.random() < 0.05:
        parts.append(rng.choice(["x", "日", "\x1b[31m", "é"]) * rng.randint(min(1000, longest), longest))
    return "".join(parts)


def hostile_line(rng: random.Random, longest: int = 50_000) -> bytes:
    line = hostile_text(rng, longest).encode("utf-8", "surrogatepass")
    if rng.random() < 0.2:
        at = rng.randint(0, len(line))
        line = line[:at] + rng.choice(RAW_PIECES) + line[at:]
    return line.replace(b"\n", b" ")


@dataclasses.dataclass
class Tally:
    area: str
    actions: int = 0
    copies: int = 0
    counts: dict = dataclasses.field(default_factory=dict)  # what the actions were, by kind

    def count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
    found: list[str] = dataclasses.field(default_factory=list)

    def find(self, seed: int, action: int, what: str) -> None:
        """One line for each thing found (the first seed and action it was found at)."""
        if any(line.split(": ", 1)[1][:50] == what[:50] for line in self.found):
            return
        line = f"{self.area} seed {seed} action {action}: {what}"
        self.found.append(line)
        print("FOUND", line, flush=True)


# ----- copy: selections and what reaches the clipboard ------------------------------------------------
class Clipboard:
    """What the app writes to its terminal driver, kept: the OSC 52 sequences among it."""

    def __init__(self, app) -> None:
        self.osc52: list[str] = []
        self._write = app._driver.write
        app._driver.write = self.write

    def write(self, data: str) -> None:
        if "\x1b]52;" in data:
            self.osc52.append(data)
        self._write(data)


def _marked(app) -> object:
    return app.main.get_component_rich_style("screen--selection", partial=True).bgcolor


def highlighted(log, y: int, marked) -> str:
    """The characters pane row `y` (on screen) draws in the selection's colours."""
    return "".join(seg.text for seg in log.render_line(y) if seg.style and seg.style.bgcolor == marked)


def check_copy(app, clip: Clipboard, expected: list[str] | None) -> list[str]:
    """What is wrong with the last copy (its text, its OSC 52 sequence, its lines against `expected`)."""
    wrong = []
    text = app.clipboard
    if m := UNSAFE.search(text):
        wrong.append(f"the copy holds {m.group()!r}")
    if clip.osc52:
        last = clip.osc52[-1]
        m = re.fullmatch(r"\x1b\]52;c;([A-Za-z0-9+/=]*)\x07", last)
        if m is None:
            wrong.append(f"an OSC 52 sequence not of base64 alone: {last[:60]!r}")
        elif base64.b64decode(m.group(1)).decode("utf-8", "surrogatepass") != text:
            wrong.append("the OSC 52 sequence carries other text than the clipboard")
    if expected is not None and text != "\n".join(expected).rstrip("\n"):
        wrong.append(f"copied {text[:80]!r}, the selected lines are {chr(10).join(expected)[:80]!r}")
    return wrong


def selected_lines(log, selection) -> list[str]:
    """Each selected line's selected characters, from the rows' text (what a copy should be): the
    rows a wrapped line fills are one line, as the rank wrote it."""
    from textual.geometry import Offset

    start = selection.start or Offset(0, 0)
    last = log.row_count - 1 if selection.end is None else min(selection.end.y, log.row_count - 1)
    rows = []
    for row in range(start.y, last + 1):
        if log._is_own_row(row):
            continue
        span = selection.get_span(row)
        text = log.row_text(row)
        if span is None:
            continue
        first, end = span
        piece = text[first:] if end == -1 else text[first:end]
        if rows and log._locate(row)[1] > 0:  # the next row of a wrapped line
            rows[-1] += piece
        else:
            rows.append(piece)
    return rows


def highlight_problems(log, selection, marked) -> list[str]:
    """Rows on screen whose highlighted characters are not the row's selected ones (as far as the
    pane shows the row: from its scroll column, its width)."""
    from ranktop.tui.cells import clusters

    wrong = []
    top = round(log.scroll_offset.y)
    scroll_x = round(log.scroll_offset.x)
    width = log.text_width
    for y in range(log.scrollable_content_region.height):
        row = top + y
        if row >= log.row_count or log._is_own_row(row):
            continue
        span = selection.get_span(row)
        shown = highlighted(log, y, marked).replace("‹", "").replace("›", "").strip()
        if span is None:
            if shown:
                wrong.append(f"row {row} is highlighted ({shown[:40]!r}) but not selected")
            continue
        text = log.row_text(row)
        first, end = span
        # The chosen characters inside the view's columns, whole characters only (cells counted as
        # rich counts them: a cluster, joined by U+200D, is as wide as its first character).
        stop = len(text) if end == -1 else min(end, len(text))
        starts, sizes = clusters(text)
        edges = list(itertools.accumulate(sizes, initial=0))
        visible = []
        for c, begin in enumerate(starts):
            after = starts[c + 1] if c + 1 < len(starts) else len(text)
            if edges[c] >= scroll_x and edges[c + 1] <= scroll_x + width:
                visible.extend(text[i] for i in range(max(begin, first), min(after, stop)))
        want = "".join(visible).strip()
        if shown and want and not (want in shown or shown in want):
            wrong.append(f"row {row}: highlighted {shown[:40]!r}, selected {want[:40]!r}"
                         + (f" (row {text[:120]!r}, span {span}, scrolled {scroll_x})"
                            if os.environ.get("FUZZ_VERBOSE") else ""))
    return wrong


async def copy_session(seed: int, actions: int, tally: Tally) -> None:
    from conftest import until
    from fake_engine import FakeEngine
    from ranktop.tui.app import RanktopApp
    from ranktop.tui.screens import ConfirmQuit
    from textual.pilot import OutOfBounds

    rng = random.Random(seed)
    n = rng.randint(1, 4)
    engine = FakeEngine(n)
    for r in range(n):
        engine.lines[r].extend(hostile_line(rng) for _ in range(rng.randint(0, 40)))
    app = RanktopApp(engine)
    size = (rng.randint(40, 200), rng.randint(12, 60))
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: app.main is not None and app.main.is_mounted, what="main screen")
        clip = Clipboard(app)
        main = app.main
        for k in range(actions):
            tally.actions += 1
            if not app.is_running:
                tally.find(seed, k, f"the app ended: {getattr(app, '_exception', None)!r}")
                return
            if isinstance(app.screen, ConfirmQuit):
                await pilot.press("escape")
                continue
            if app.screen is not main:
                await pilot.press("escape")
                continue
            started = time.monotonic()
            log = main.pane(main.current).log
            choice = rng.random()
            copied = False
            pressed = 1  # keys: Pilot waits for the app to be idle after each (tens of ms)
            kind = "output" if choice < 0.15 else "drag" if choice < 0.40 else "V" if choice < 0.50 else (
                "copy" if choice < 0.65 and main.selections else "key" if choice < 0.75 else "sideways"
                if choice < 0.82 else "resize" if choice < 0.90 else "restart" if choice < 0.93 else "escape")
            try:
                if choice < 0.15:  # more hostile output
                    r = rng.randrange(n)
                    with engine._lock:
                        engine.lines[r].extend(hostile_line(rng) for _ in range(rng.randint(1, 30)))
                        engine._set_rank(r, output_version=engine.group.ranks[r].output_version + 1)
                    await pilot.pause(0.05)
                elif choice < 0.40:  # a mouse drag (clicks of a chain: select all in the pane or its container)
                    height = max(1, log.scrollable_content_region.height)
                    x1, y1 = rng.randint(0, log.size.width), rng.randint(0, height - 1)
                    x2, y2 = rng.randint(-2, log.size.width + 2), rng.randint(-2, height + 1)
                    if rng.random() < 0.1:
                        await pilot.click(log, offset=(x1, y1), times=rng.choice([2, 3]))
                    else:
                        await pilot.mouse_down(log, offset=(x1, y1))
                        await pilot.hover(log, offset=(x2, y2))
                        await pilot.mouse_up(log, offset=(x2, y2))
                        await pilot.pause(0.02)
                    if main.selections and log in main.selections:
                        problems = highlight_problems(log, main.selections[log], _marked(app))
                        for p in problems[:1]:
                            tally.find(seed, k, f"highlight: {p}")
                elif choice < 0.50:  # V, a few rows
                    steps = rng.randint(0, 40)
                    await pilot.press("V", *([rng.choice(["up", "down"])] * steps))
                    pressed = 1 + steps
                elif choice < 0.65 and main.selections:  # copy
                    expected = None
                    sel = main.selections.get(log) if len(main.selections) == 1 else None
                    if sel is not None:
                        expected = selected_lines(log, sel)
                        before = (sel, log.row_count, log.line_count, log.wrap, log._first)
                    sequences = len(clip.osc52)
                    await pilot.press(rng.choice(["y", "y", "ctrl+c", "enter"]))
                    await pilot.pause(0.02)
                    copied = True
                    tally.copies += 1
                    # (enter copies only V's, the mouse's stays; and a restart as the key came drops
                    # the selection, no copy made: the clipboard still held the last one's text)
                    if main.selections or len(clip.osc52) == sequences:
                        continue
                    for p in check_copy(app, clip, expected):
                        if os.environ.get("FUZZ_VERBOSE") and expected is not None:
                            p += f" (selection, rows, lines, wrap, first before: {before}; rows, lines after: " \
                                 f"{log.row_count}, {log.line_count}, {log._first})"
                        tally.find(seed, k, f"copy: {p}")
                elif choice < 0.75:
                    await pilot.press(rng.choice(["w", "z", "f", "escape", "tab", "pageup", "pagedown", "home",
                                                  "end", "left", "right", "up", "down", str(rng.randrange(n))]))
                elif choice < 0.82:  # sideways: scrolled right, a row's first character is another
                    log.scroll_to(x=rng.randint(0, 80), animate=False)
                    await pilot.pause(0.02)
                elif choice < 0.90:
                    await pilot.resize_terminal(rng.randint(30, 200), rng.randint(8, 60))
                elif choice < 0.93:  # a group restart: new rings
                    with engine._lock:
                        engine.group = dataclasses.replace(engine.group, generation=engine.group.generation + 1)
                        for r in range(n):
                            engine.lines[r] = [hostile_line(rng) for _ in range(rng.randint(0, 10))]
                    await pilot.pause(0.1)
                else:
                    await pilot.press("escape")
            except OutOfBounds:
                pass
            spent = time.monotonic() - started
            if spent > (5.0 if copied else 3.0) + 0.15 * pressed:
                tally.find(seed, k, f"an action ({kind}) took {spent:.1f} s")


def fuzz_copy(seeds: range, actions: int) -> Tally:
    tally = Tally("copy")
    per = max(1, actions // len(seeds))
    for seed in seeds:
        try:
            asyncio.run(copy_session(seed, per, tally))
        except Exception:  # noqa: BLE001 - what ended the app is the finding
            tally.find(seed, -1, "the app raised: " + traceback.format_exc().strip().splitlines()[-1])
    return tally


# ----- pager: `o` in a real terminal ------------------------------------------------------------------------
RANK_PRINTS = """
import sys, time
lines = open(sys.argv[1], 'rb').read().split(b'\\n')
i = 0
while True:
    sys.stdout.buffer.write(lines[i % len(lines)] + b'\\n')
    sys.stdout.flush()
    if i % 7 == 0:
        sys.stderr.buffer.write(b'err ' + lines[(i * 3) % len(lines)][:200] + b'\\n')
        sys.stderr.flush()
    i += 1
    time.sleep(0.05)
"""

# $PAGER: what it does is read from a file each time (the mode), so one run tries them all.
PAGER_SH = """#!/bin/sh
mode=$(cat "$(dirname "$0")/mode")
echo "$$" > "$(dirname "$0")/pager.pid"
case "$mode" in
  exit0) exit 0 ;;
  exit1) exit 1 ;;
  kill9) kill -9 $$ ;;
  int_group) kill -INT 0; sleep 0.3 ;;
  quit_group) kill -QUIT 0; sleep 0.3 ;;
  tstp_group) kill -TSTP 0; sleep 0.3 ;;
  cat) head -c 3000000 "$@" ;;
  raw) stty raw -echo ;;
  sleep) sleep 1 ;;
  wait_key) read line < /dev/tty ;;
  bg_child) (sleep 3 > /dev/null 2>&1 &) ;;
  big_output) yes 'x \033]0;t\007 \033[2J y' | head -c 3000000 ;;
  missing_exec) exec /nonexistent/pager "$@" ;;
  less) exec less "$@" ;;
esac
"""
PAGER_MODES = ["exit0", "exit1", "kill9", "int_group", "quit_group", "tstp_group", "cat", "raw", "sleep",
               "wait_key", "bg_child", "big_output", "missing_exec", "less", "less", "less"]
# $PAGER values of whole sessions (besides the script above, in most of them)
ODD_PAGERS = ["no-such-pager-fuzz", "/tmp", "{noexec}", "", "   ", 'less "-R', "/x" * 60_000, "/bin/false",
              "sh -c 'exit 3'", "less"]


class Tmux:
    """One tmux server of our own, running `command` in a window of its own size."""

    def __init__(self, name: str, command: str, env: dict[str, str], size: tuple[int, int]) -> None:
        self.socket = name
        self.env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | env
        self.run("new-session", "-d", "-s", "t", "-x", str(size[0]), "-y", str(size[1]), command)
        self.path = self.run("display-message", "-p", "#{socket_path}").strip()

    def run(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, env=self.env,
                              timeout=20).stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "t")

    def keys(self, *keys: str) -> None:
        if os.environ.get("FUZZ_VERBOSE"):
            print("    send", keys, time.time(), flush=True)
        self.run("send-keys", "-t", "t", *keys)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, env=self.env)
        with contextlib.suppress(OSError):  # (a killed server leaves its socket behind)
            os.unlink(self.path)


def poll(condition, timeout: float, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


def events_of(run_dir: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def pager_procs(ranktop_pid: int) -> list:
    import psutil

    try:
        children = psutil.Process(ranktop_pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            line = " ".join(child.cmdline())
            if "pager.sh" in line or line.startswith(("less", "head", "yes", "cat", "sleep")):
                found.append(child)
    return found


def pager_session(seed: int, actions: int, tally: Tally) -> None:
    import psutil

    rng = random.Random(seed)
    home = SCRATCH / f"pager-{seed}"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    lines_file = home / "lines.txt"
    lines_file.write_bytes(b"\n".join(hostile_line(rng, 20_000) for _ in range(200)))
    (home / "rank.py").write_text(RANK_PRINTS)
    pager_sh = home / "pager.sh"
    pager_sh.write_text(PAGER_SH)
    pager_sh.chmod(0o755)
    (home / "mode").write_text("exit0")
    noexec = home / "noexec"
    noexec.write_text("#!/bin/sh\n")
    odd = rng.random() < 0.3
    pager = rng.choice(ODD_PAGERS).replace("{noexec}", str(noexec)) if odd else str(pager_sh)
    status = home / "status"
    command = (f"cd {shlex.quote(str(ROOT))} && {shlex.quote(sys.executable)} -m ranktop --tui --nproc-per-node 1 "
               f"--log-dir {home / 'logs'} {home / 'rank.py'} {lines_file}; echo $? > {status}; sleep 600")
    term = Tmux(f"fuzz-pager-{os.getpid()}-{seed}", command, {"PAGER": pager, "PYTHONPATH": str(ROOT)},
                (rng.randint(60, 200), rng.randint(15, 50)))
    try:
        run_dir = poll(lambda: next((p for p in (home / "logs").glob("*") if p.is_dir()), None), 30)
        if run_dir is None or not poll(lambda: "running" in term.screen(), 30):
            tally.find(seed, -1, f"the TUI did not come up: {term.screen()[-300:]!r}")
            return
        started = {e["event"]: e for e in events_of(run_dir)}
        ranktop_pid = started["run_started"]["pid"]
        rank_pid = started["started"]["pid"]
        log = run_dir / "attempt_0" / "0" / "stdout.log"
        for k in range(actions):
            tally.actions += 1
            what = pager_action(rng, term, home, log, ranktop_pid, odd)
            if os.environ.get("FUZZ_VERBOSE"):
                print(k, what, flush=True)
            problem = run_problem(term, run_dir, ranktop_pid, rank_pid, status)
            if problem:
                tally.find(seed, k, f"after {what} (PAGER={pager[:40]!r}): {problem}")
                return
    finally:
        if os.environ.get("FUZZ_KEEP"):  # (to look at by hand: tmux -L SOCKET attach)
            print("kept", term.socket, home, flush=True)
        else:
            term.close()
            for proc in pager_procs_left(home):
                with contextlib.suppress(psutil.Error):
                    proc.kill()


def pager_procs_left(home: Path) -> list:
    import psutil

    left = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if str(home) in " ".join(proc.info["cmdline"] or ()):
                left.append(proc)
    return left


def pager_action(rng: random.Random, term: Tmux, home: Path, log: Path, ranktop_pid: int, odd: bool) -> str:
    """One action; returns what it was."""
    choice = rng.random()
    if choice < 0.15:
        key = rng.choice(["z", "f", "w", "escape", "0", "V", "y", "Escape", "e", "m", "Escape"])
        term.keys(key)
        time.sleep(0.1)
        return f"key {key}"
    if choice < 0.22:  # bytes typed that are not always UTF-8 (a Latin-1 paste, an 8-bit meta key)
        data = bytes(rng.choice([0xFF, 0xE9, 0xC3, 0x80, 0x41, 0x61]) for _ in range(rng.randint(1, 4)))
        term.run("send-keys", "-t", "t", "-H", *(f"{b:02x}" for b in data))
        time.sleep(0.2)
        return f"bytes {data!r}"
    if choice < 0.27:
        term.run("resize-window", "-t", "t", "-x", str(rng.randint(40, 200)), "-y", str(rng.randint(10, 50)))
        time.sleep(0.2)
        return "resize"
    mode = rng.choice(PAGER_MODES)
    (home / "mode").write_text(mode)
    mutation = rng.choice([None, None, None, "missing", "both_missing", "huge", "fifo", "symlink_dir"])
    moved = mutate_log(log, mutation)
    try:
        pid_file = home / "pager.pid"  # (written by the pager script as it starts)
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()
        term.keys("o")
        # The pager starts once `o` is handled, which may be a while (the TUI steps aside first):
        # the next key must not come before it, or it is taken by the TUI, and `o` by the next pager.
        if odd:
            started = poll(lambda: pager_procs(ranktop_pid), 2)
        else:
            started = poll(pid_file.exists, 1 if mutation == "both_missing" else 8)
        if started:
            follow_up(rng, term, mode, odd, lambda: bool(pager_procs(ranktop_pid)))
        if not poll(lambda: not pager_procs(ranktop_pid), 6):
            # A pager still busy (a FIFO nobody writes; less reading 20 GiB for its first line):
            # Ctrl-C, as a person would, then q if it is still there (once it has gone, q is the TUI's).
            term.keys("C-c")
            if not poll(lambda: not pager_procs(ranktop_pid), 1):
                term.keys("q")
            poll(lambda: not pager_procs(ranktop_pid), 5)
        return f"o, PAGER mode {mode}, log {mutation or 'as is'}"
    finally:
        restore_log(log, moved)


def follow_up(rng: random.Random, term: Tmux, mode: str, odd: bool, running) -> None:
    """Keys for a pager that waits for them, as a person would press them (while it runs: once it
    has gone they are the TUI's, `x` then enter a SIGINT to the rank)."""
    if mode == "wait_key" and not odd:
        time.sleep(0.2)
        key = rng.choice(["Enter", "C-c", "C-\\"])
        if os.environ.get("FUZZ_VERBOSE"):
            print("  key", key, flush=True)
        term.keys(key)
    elif mode == "less" or odd:
        time.sleep(0.3)
        keys = rng.choice([["q"], ["F", "SLEEP", "C-c", "q"], ["G", "q"], ["/", "x", "Enter", "q"],
                           ["C-z", "SLEEP", "q"], ["C-c", "q"], ["C-\\"], ["SLEEP", "q"]])
        if os.environ.get("FUZZ_VERBOSE"):
            print("  keys", keys, flush=True)
        for key in keys:
            if key == "SLEEP":
                time.sleep(0.5)
            elif not running():
                break
            else:
                term.keys(key)
                time.sleep(0.15)
        if rng.random() < 0.3:
            term.run("resize-window", "-t", "t", "-x", str(rng.randint(40, 200)), "-y", str(rng.randint(10, 50)))


def mutate_log(log: Path, how: str | None) -> list[tuple[Path, Path]]:
    """Change the rank's log files as a hostile rank could; returns (moved, kept) pairs to put back."""
    if how is None:
        return []
    err = log.with_name("stderr.log")
    moved = []
    for path in ([log] if how != "both_missing" else [log, err]):
        kept = path.with_name(path.name + ".kept")
        with contextlib.suppress(OSError):
            os.rename(path, kept)
            moved.append((path, kept))
    if how == "huge":
        with open(log, "wb") as f:
            f.truncate(20 << 30)  # sparse: 20 GiB of nothing
    elif how == "fifo":
        os.mkfifo(log)
    elif how == "symlink_dir":
        os.symlink("/", log)
    return moved


def restore_log(log: Path, moved: list[tuple[Path, Path]]) -> None:
    for path, kept in moved:
        with contextlib.suppress(OSError):
            if path.is_symlink() or path.exists():
                path.unlink()
        with contextlib.suppress(OSError):
            os.rename(kept, path)


def run_problem(term: Tmux, run_dir: Path, ranktop_pid: int, rank_pid: int, status: Path) -> str | None:
    """What is wrong once an action is done: the TUI not back, or the run stopped."""
    import psutil

    # Back: no pager left, and the screen is the TUI's (a dialog of its own may be open: `m`, `e`).
    back = poll(lambda: not pager_procs(ranktop_pid) and "Traceback" not in (s := term.screen())
                and ("ranktop" in s or "rank 0" in s), 10)
    events = [e["event"] for e in events_of(run_dir)[2:]]
    bad = [e for e in events if e in ("signal_received", "user_stop", "exited", "run_finished", "signalled")]
    if bad:
        return f"the run was acted on: {bad}"
    if status.exists():
        return f"ranktop exited ({status.read_text().strip()}): {term.screen()[-400:]!r}"
    for pid, who in ((ranktop_pid, "ranktop"), (rank_pid, "the rank")):
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_STOPPED:
                return f"{who} is stopped (SIGTSTP/SIGSTOP): the run stalls"
        except psutil.NoSuchProcess:
            return f"{who} is gone"
    if not back:
        tty = term.run("display-message", "-p", "-t", "t", "#{pane_tty}").strip()
        procs = subprocess.run(["ps", "-o", "pid,stat,pgid,tpgid,args", "-t", tty], capture_output=True,
                               text=True).stdout
        return f"the TUI is not back: {term.screen()[:200]!r}; on its terminal:\n{procs}"
    return None


def fuzz_pager(seeds: range, actions: int) -> Tally:
    tally = Tally("pager")
    if shutil.which("tmux") is None:
        tally.find(0, -1, "needs tmux")
        return tally
    per = max(1, actions // len(seeds))
    for seed in seeds:
        pager_session(seed, per, tally)
    return tally


# ----- stdin: `i` into the ranks of an attached run ----------------------------------------------------------
READER = """
import json, os, sys, time
rank = int(os.environ["RANK"])
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
record = open(os.path.join(os.environ["FUZZ_RECORD"], f"{attempt}.{rank}"), "a")
while True:
    if rank == 1:
        time.sleep(0.7)  # reads slowly: its pipe may fill
    print("(Pdb) ", end="", flush=True)
    line = sys.stdin.buffer.readline()
    if not line:
        print("end of file", flush=True)
        time.sleep(3600)
    record.write(json.dumps(line.decode("utf-8", "surrogateescape")) + "\\n")
    record.flush()
    print("got", len(line), "bytes", flush=True)
    if rank == 2 and b"exit" in line:
        sys.exit(3)
"""


def paste_text(rng: random.Random) -> str:
    """What a paste may bring: controls, escape sequences, bidi, wide characters, a long line."""
    choice = rng.random()
    if choice < 0.1:
        return rng.choice(["x", "日本", "\x1b[31m", "\x00"]) * rng.randint(1000, 50_000)
    if choice < 0.15:
        return "y" * 70_000  # over what one SendInput may carry
    if choice < 0.2:
        return "p 1\np 2\r\nc"  # several lines: the box takes the first
    return hostile_text(rng)


async def stdin_session(seed: int, actions: int, tally: Tally) -> None:
    import psutil
    from conftest import screen_rows, until
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs
    from ranktop.tui.app import RanktopApp
    from ranktop.tui.screens import ConfirmQuit
    from textual import events
    from textual.pilot import OutOfBounds

    rng = random.Random(seed)
    home = SCRATCH / f"stdin-{seed}"
    shutil.rmtree(home, ignore_errors=True)
    (home / "record").mkdir(parents=True)
    runtime = home / "rt"
    runtime.mkdir(mode=0o700)
    (home / "reader.py").write_text(READER)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "FUZZ_RECORD": str(home / "record"), "PYTHONPATH": str(ROOT)}
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    pty = ["--pty"] if rng.random() < 0.3 else []
    done = subprocess.run([sys.executable, "-m", "ranktop", "--detach", "--linger", "5", "--nproc-per-node", "3",
                           "--max-restarts", str(rng.randint(1, 4)), "--shutdown-timeout", "1", *pty,
                           "--run-id", f"fz{seed}", "--log-dir", str(home / "logs"), str(home / "reader.py")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        tally.find(seed, -1, f"the run did not start: {done.stderr.strip()}")
        return
    engine = RemoteEngine(served_runs()[0].path, look_ahead=True)
    sent: list[tuple[int, int, str, bool]] = []  # (attempt, local rank, text, ok)
    submit = engine.submit

    def recording_submit(command):
        ack = submit(command)
        if isinstance(command, cmd.SendInput):
            sent.append((engine.last.attempt, command.local_rank, command.text, ack.ok))
        return ack

    engine.submit = recording_submit  # (the app calls it from its thread, and from Pilot's)
    app = RanktopApp(engine)
    app.attached = True
    ended_at = None
    try:
        async with app.run_test(size=(rng.randint(60, 180), rng.randint(15, 50))) as pilot:
            await until(pilot, lambda: app.main is not None and app.main.is_mounted, what="main screen")
            main = app.main
            box = main.query_one("#stdin")
            for k in range(actions):
                tally.actions += 1
                if not app.is_running:
                    tally.find(seed, k, f"the app ended: {getattr(app, '_exception', None)!r}")
                    return
                if isinstance(app.screen, ConfirmQuit) or app.screen is not main:
                    await pilot.press("escape")
                    continue
                started = time.monotonic()
                # With the box open, mostly what goes into it; else mostly `i`.
                choice = rng.random() * 0.65 if box.display and rng.random() < 0.8 else rng.random()
                if not box.display and rng.random() < 0.3:
                    choice = 0.0
                pressed = 1
                kind = ("i" if choice < 0.15 else "paste" if choice < 0.35 else "typed" if choice < 0.5 else "enter"
                        if choice < 0.65 else "escape" if choice < 0.72 else "click" if choice < 0.8 else "digit"
                        if choice < 0.85 else "kill or stop" if choice < 0.88 else "wait")
                try:
                    if choice < 0.15:
                        tally.count("i")
                        await pilot.press("i")
                    elif choice < 0.35 and box.display:
                        tally.count("paste")
                        app.post_message(events.Paste(paste_text(rng)))  # (as the driver posts it)
                        await pilot.pause(0.05)
                    elif choice < 0.50 and box.display:
                        tally.count("typed")
                        word = rng.choice(["p x", "c", "n", "exit", "where", "日本", "ab cd"])
                        pressed = len(word)
                        await pilot.press(*[{" ": "space"}.get(ch, ch) for ch in word])
                    elif choice < 0.65:
                        await pilot.press("enter")
                    elif choice < 0.72:
                        await pilot.press("escape")
                    elif choice < 0.80:
                        target = main.pane(rng.randrange(main.n)).log
                        await pilot.click(target, offset=(2, 1))
                    elif choice < 0.85:
                        await pilot.press(str(rng.randrange(3)))
                    elif choice < 0.87 and rng.random() < 0.3:  # a rank killed from outside
                        pids = [r.pid for r in engine.last.ranks if r.pid and r.state.alive]
                        if pids:
                            with contextlib.suppress(OSError):
                                os.kill(rng.choice(pids), signal.SIGKILL)
                        await pilot.pause(0.2)
                    elif choice < 0.88 and k > actions // 2:  # the run stopped under the open box
                        subprocess.run([sys.executable, "-m", "ranktop", "stop", f"fz{seed}"], env=env, cwd=ROOT,
                                       capture_output=True, timeout=60)
                        await pilot.pause(0.2)
                    else:
                        await pilot.pause(0.3)
                except OutOfBounds:
                    pass
                spent = time.monotonic() - started
                if spent > 4.0 + 0.15 * pressed:
                    tally.find(seed, k, f"an action ({kind}) took {spent:.1f} s")
                for row in screen_rows(app):
                    if m := UNSAFE_ON_SCREEN.search(row):
                        tally.find(seed, k, f"the screen shows a raw {m.group()!r}: {row.strip()[:60]!r}")
                        break
                if main.ended and ended_at is None:
                    ended_at = time.monotonic()
                if ended_at is not None and time.monotonic() - ended_at > 3:
                    if box.display:
                        tally.find(seed, k, "the stdin box is still open 3 s after the run ended")
                    break  # the next session starts a new run
            await pilot.pause(1.0)
    finally:
        engine.close()
        subprocess.run([sys.executable, "-m", "ranktop", "stop", f"fz{seed}"], env=env, cwd=ROOT, capture_output=True,
                       timeout=60)
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error, TypeError):
                if str(home) in " ".join(proc.info["cmdline"] or ()):
                    poll(lambda p=proc: not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, 10)
    for *_, ok in sent:
        tally.count("line sent" if ok else "line refused")
    if not pty:  # (a terminal's line discipline edits what is typed: a pasted ^U, ^C, DEL)
        check_records(home / "record", sent, seed, tally)


def check_records(record: Path, sent: list[tuple[int, int, str, bool]], seed: int, tally: Tally) -> None:
    """Rank 0 (which reads at once) got each line the engine said it typed, whole and in order."""
    attempts = {a for a, r, _, _ in sent if r == 0}
    for attempt in sorted(attempts):
        typed = [text for a, r, text, ok in sent if a == attempt and r == 0 and ok]
        try:
            got = [json.loads(line) for line in (record / f"{attempt}.0").read_text().splitlines()]
        except OSError:
            got = []
        expected = [t.encode("utf-8", "surrogatepass").decode("utf-8", "surrogateescape") for t in typed]
        if got != expected[: len(got)] or len(got) < len(expected) - 1:
            at = next((i for i, (g, t) in enumerate(zip(got, expected, strict=False)) if g != t), min(len(got), len(expected)))
            tally.find(seed, -1, f"attempt {attempt}: rank 0's line {at} of {len(got)} is "
                                 f"{got[at][:60] if at < len(got) else None!r}, of {len(expected)} typed "
                                 f"{expected[at][:60] if at < len(expected) else None!r}")


def fuzz_stdin(seeds: range, actions: int) -> Tally:
    """Sessions of `actions / len(seeds)` actions at most (a run that ends sooner ends its session),
    on new seeds until `actions` were run."""
    tally = Tally("stdin")
    per = max(1, actions // len(seeds))
    seed = seeds.start - 1
    while tally.actions < actions:
        seed += 1
        before = tally.actions
        try:
            asyncio.run(stdin_session(seed, min(per, actions - tally.actions), tally))
        except Exception:  # noqa: BLE001 - what ended the app is the finding
            tally.find(seed, -1, "raised: " + traceback.format_exc().strip().splitlines()[-1])
        if tally.actions == before:
            break
    return tally


# ----- main -------------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("area", choices=["copy", "pager", "stdin"])
    parser.add_argument("--actions", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1, help="the first seed")
    parser.add_argument("--sessions", type=int, default=None, help="apps (or runs) the actions are spread over")
    ns = parser.parse_args()
    defaults = {"copy": (3000, 30), "pager": (300, 10), "stdin": (1500, 10)}
    actions = ns.actions or defaults[ns.area][0]
    seeds = range(ns.seed, ns.seed + (ns.sessions or defaults[ns.area][1]))
    started = time.monotonic()
    # A kill ends it through its cleanups (its tmux servers, its runs), as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    SCRATCH.mkdir(parents=True, exist_ok=True)
    try:
        tally = {"copy": fuzz_copy, "pager": fuzz_pager, "stdin": fuzz_stdin}[ns.area](seeds, actions)
    finally:
        if not os.environ.get("FUZZ_KEEP"):
            shutil.rmtree(SCRATCH, ignore_errors=True)
    extra = f", {tally.copies} copies" if tally.copies else ""
    extra += "".join(f", {n} {kind}" for kind, n in sorted(tally.counts.items()))
    print(f"{tally.area}: {tally.actions} actions{extra} in {time.monotonic() - started:.0f} s, "
          f"{len(tally.found)} found")
    for line in tally.found:
        print("  " + line)
    return 1 if tally.found else 0


if __name__ == "__main__":
    sys.exit(main())
