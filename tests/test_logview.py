"""The rank output pane (tui/logview.py): a tiny host app with one LogView over a real LineRing,
driven by Pilot; and one run of real ranks through the engine."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import sys
import threading
from collections.abc import AsyncIterator

import pytest
from conftest import ROOT, polls, until, wait_for
from ranktop.core import LocalAgent, WorkerSpec
from ranktop.core.output import STDERR, STDOUT, LineRing, RanktopLine
from ranktop.tui.logview import MAX_CHARS, LogView
from rich.cells import cell_len, chop_cells
from textual.app import App, ComposeResult
from textual.pilot import Pilot

SIZE = (60, 12)


def sync(test):
    """Run an async Pilot test without an asyncio pytest plugin."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


class Host(App):
    def __init__(self, ring: LineRing | None, **kw) -> None:
        super().__init__()
        self.ring, self.kw = ring, kw

    def compose(self) -> ComposeResult:
        yield LogView(self.ring, **self.kw)

    @property
    def view(self) -> LogView:
        return self.query_one(LogView)


@contextlib.asynccontextmanager
async def shown(ring: LineRing | None, size: tuple[int, int] = SIZE, **kw) -> AsyncIterator[tuple[LogView, Pilot]]:
    """A LogView over `ring` in a small app, laid out: (the view, the app's pilot)."""
    app = Host(ring, **kw)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        yield app.view, pilot


def feed_lines(ring: LineRing, start: int, stop: int, text: str = "line") -> None:
    ring.feed(STDOUT, "".join(f"{text} {i}\n" for i in range(start, stop)).encode())


def screen_rows(view: LogView) -> list[str]:
    return [view.render_line(y).text.rstrip() for y in range(view.scrollable_content_region.height)]


def styles_of(view: LogView, y: int, word: str) -> list:
    return [seg.style for seg in view.render_line(y) if word in seg.text]


@sync
async def test_follows_the_tail_then_scrolling_up_holds_the_view_and_end_resumes():
    ring = LineRing()
    feed_lines(ring, 0, 100)
    async with shown(ring) as (view, pilot):
        assert view.follow and screen_rows(view)[-1] == "line 99"
        feed_lines(ring, 100, 150)
        assert view.poll()
        assert screen_rows(view)[-1] == "line 149"

        view.focus()
        await pilot.press("pageup", "up")
        assert not view.follow
        held = screen_rows(view)
        feed_lines(ring, 150, 400)
        view.poll()
        await pilot.pause()
        assert screen_rows(view) == held, "new lines moved a view scrolled away from the tail"

        await pilot.press("end")
        assert view.follow and screen_rows(view)[-1] == "line 399"
        view.scroll_to(y=10, animate=False)  # what the mouse wheel and the scrollbar do
        await pilot.pause()
        assert not view.follow
        view.scroll_to(y=view.max_scroll_y, animate=False)
        await pilot.pause()
        assert view.follow, "scrolling back to the bottom rejoins the tail"
        await pilot.press("f")
        assert not view.follow
        await pilot.press("f")
        assert view.follow and screen_rows(view)[-1] == "line 399"


@sync
async def test_an_animated_scroll_that_reaches_the_bottom_rejoins_the_tail():
    """↓ and PgDn scroll with Textual's animation. Where its last frame was the first at the bottom
    (frames late on a busy box), the view began to follow the tail, and the follow's own move
    there stopped the animation from inside that frame: Textual's animator raised KeyError, which
    ended the TUI (↑ then ↓ in a zoomed pane)."""
    ring = LineRing()
    feed_lines(ring, 0, 100)
    async with shown(ring) as (view, pilot):
        view.focus()
        await pilot.press("pageup")
        await pilot.wait_for_animation()
        assert not view.follow
        # As ↓ or PgDn on a box too slow for the frames between: the view moves on the last one only.
        view.scroll_to(y=view.max_scroll_y, duration=0.05, easing=lambda done: float(done >= 1.0))
        await pilot.wait_for_animation()
        assert view.follow and screen_rows(view)[-1] == "line 99"
        feed_lines(ring, 100, 110)
        view.poll()
        assert screen_rows(view)[-1] == "line 109"


def thumb_rows(view: LogView) -> list[int]:
    """Rows whose last cell (the scrollbar the view draws itself) has the thumb's colour."""
    thumb = view.get_component_rich_style("logview--thumb", partial=True)
    return [y for y in range(view.scrollable_content_region.height)
            if list(view.render_line(y))[-1].style == thumb]


@sync
async def test_the_scrollbar_is_drawn_in_the_last_column_and_the_mouse_drags_it():
    ring = LineRing()
    feed_lines(ring, 0, 100)
    async with shown(ring) as (view, pilot):
        height, bar_x = view.scrollable_content_region.height, view.text_width
        assert bar_x == SIZE[0] - 1 and all(view.render_line(y).cell_length == SIZE[0] for y in range(height))
        # following the tail: a one-row thumb at the bottom, once the view has moved there
        await until(pilot, lambda: thumb_rows(view) == [height - 1], what="the thumb at the bottom")

        await pilot.mouse_down(view, offset=(bar_x, 0))  # press at the top of the bar: jump to the top
        assert view.scroll_offset.y == 0 and not view.follow
        assert screen_rows(view)[0] == "line 0" and thumb_rows(view) == [0]
        await pilot.hover(view, offset=(bar_x, height // 2))  # drag to the middle
        assert 0 < view.scroll_offset.y < view.max_scroll_y and 0 < thumb_rows(view)[0] < height - 1
        await pilot.hover(view, offset=(bar_x, height - 1))  # to the bottom: the tail again
        await pilot.mouse_up(view, offset=(bar_x, height - 1))
        assert view.follow and screen_rows(view)[-1] == "line 99"

        await pilot.click(view, offset=(3, 0))  # a click on the text is not a scroll
        assert view.follow and screen_rows(view)[-1] == "line 99"


@sync
async def test_no_thumb_when_everything_fits():
    ring = LineRing()
    feed_lines(ring, 0, 3)
    async with shown(ring) as (view, pilot):
        assert thumb_rows(view) == [] and screen_rows(view)[:3] == ["line 0", "line 1", "line 2"]
        await pilot.mouse_down(view, offset=(view.text_width, 0))
        assert view.follow


@sync
async def test_poll_is_false_when_nothing_changed_and_shows_the_open_line():
    ring = LineRing()
    feed_lines(ring, 0, 3)
    async with shown(ring) as (view, pilot):
        assert not view.poll()
        ring.feed(STDOUT, b"epoch 1 50%\repoch 1 80%")  # unfinished progress bar: its latest state shows
        assert view.poll() and not view.poll()
        assert screen_rows(view)[3] == "epoch 1 80%" and view.line_count == 4
        ring.feed(STDERR, b"warn\n")
        ring.feed(STDOUT, b"\repoch 1 100%\n")
        assert view.poll()
        assert screen_rows(view)[:5] == ["line 0", "line 1", "line 2", "warn", "epoch 1 100%"]


@sync
async def test_a_full_ring_drops_old_lines_without_moving_a_held_view():
    ring = LineRing(maxlen=50)
    feed_lines(ring, 0, 50)
    async with shown(ring) as (view, pilot):
        view.focus()
        await pilot.press("pageup")
        held = screen_rows(view)
        feed_lines(ring, 50, 55)  # five lines leave the top of the ring
        view.poll()
        assert view.line_count == 50 and screen_rows(view) == held
        feed_lines(ring, 55, 500)  # far more than the ring keeps: start from its window
        view.poll()
        assert view.line_count == 50 and screen_rows(view)[0] == "line 450"


@sync
async def test_a_pane_caches_no_more_bytes_than_its_ring_keeps():
    ring = LineRing(maxlen=10_000, max_bytes=64 << 10)
    async with shown(ring) as (view, pilot):
        for start in range(0, 400, 20):  # polled as it comes: the pane keeps its own copy
            ring.feed(STDOUT, b"".join(b"%04d " % i + b"w" * 4000 + b"\n" for i in range(start, start + 20)))
            view.poll()
            assert view._bytes == sum(map(len, view._lines)) <= 64 << 10
        assert view._lines == list(ring.lines) and view._lines[-1].startswith(b"0399 ")


@sync
async def test_search_counts_highlights_and_moves_between_matches():
    ring = LineRing()
    for i in range(200):
        ring.feed(STDOUT, f"step {i} {'NaN loss' if i % 50 == 7 else 'ok'}\n".encode())
    async with shown(ring) as (view, pilot):
        assert view.search("nan") == 4
        assert not view.follow
        assert "step 157 NaN loss" in screen_rows(view), "search goes to the match nearest the tail"
        current = screen_rows(view).index("step 157 NaN loss")
        assert styles_of(view, current, "NaN")[0] != styles_of(view, current, "loss")[0], "match highlighted"

        view.focus()
        await pilot.press("N")
        assert "step 107 NaN loss" in screen_rows(view)
        await pilot.press("N", "N")
        assert "step 7 NaN loss" in screen_rows(view)
        await pilot.press("N")  # wraps round to the newest
        assert "step 157 NaN loss" in screen_rows(view)
        await pilot.press("n")  # and forward past the newest to the oldest
        assert "step 7 NaN loss" in screen_rows(view)

        ring.feed(STDOUT, b"step 200 NaN loss\n")
        view.poll()
        await pilot.press("N")
        assert "step 200 NaN loss" in screen_rows(view), "new matching lines join the search"
        assert view.search("no such words") == 0
        view.clear_search()
        assert view.search_query == ""


def test_a_search_counts_only_what_the_pane_shows():
    """A needle inside an 8-bit sequence (UTF-8 C1: an OSC the pane drops) or past a long line's
    cut at MAX_CHARS was counted, in a pane's search and in ctrl+f's, from the raw bytes: a rank
    could make a match no pane showed, and n went to a line without it. One across a joiner the
    pane drops (cells.agreed_widths) is counted where it shows."""
    from fake_engine import FakeEngine
    from ranktop.tui.logview import matches, parse_line
    from ranktop.tui.search_all import RankSearch

    hidden = ["step 1 \u009d0;NaN\u009c ok", "step 2 \u009b31m ok", "a" * MAX_CHARS + " NaN"]
    # (the pane drops a joiner and a skin tone: `NaN` and `Na👍N` on screen; `N\u3164aN` is `N�aN`)
    shown = ["loss ± NaN", "b" * (MAX_CHARS - 4) + " NaN", "Na\u200dN", "Na👍🏽N"]
    for line in [*hidden, *shown, "N\u3164aN"]:
        raw = line.encode()
        assert matches(raw, "nan", b"nan") == ("nan" in parse_line(raw, color=False).plain.lower()), line
    assert not matches(hidden[1].encode(), "31m", b"31m")
    engine = FakeEngine(2)
    engine.print(0, *hidden)
    engine.print(1, *hidden, *shown)
    assert RankSearch.run(engine, range(2), "nan").counts == {1: 3}
    # A query pasted with what the pane drops finds the line as the pane shows it.
    assert RankSearch.run(engine, range(2), "a👍🏽N").counts == {1: 1}


@sync
async def test_the_current_match_colour_stays_on_the_line_n_and_n_are_on_as_the_other_stream_prints():
    """The unfinished last line's rows were cached by its text: the current-match colour stayed
    on the prompt after a line of the other stream took its number (n / N had moved on with the
    number), so two lines were drawn current. The colour goes by the line's number, as n / N do."""
    ring = LineRing()
    ring.feed(STDOUT, b"loss 0.5\nstep\nloss? ")  # a complete match, then a prompt that matches
    async with shown(ring) as (view, pilot):
        current = view.get_component_rich_style("logview--match-current")
        other = view.get_component_rich_style("logview--match")

        def looks(y: int) -> list:  # the style of each "loss" on row y, less its offset meta
            return [style.clear_meta_and_links() for style in styles_of(view, y, "loss")]

        assert view.search("loss") == 2 and view.match_position == (2, 2)
        view.focus()
        await pilot.press("N", "n")  # back on the prompt
        assert screen_rows(view)[2] == "loss?" and looks(2) == [current]
        ring.feed(STDERR, b"loss spike\n")  # the other stream's line takes the prompt's number
        view.poll()
        assert screen_rows(view)[2:4] == ["loss spike", "loss?"]
        assert view.match_position == (2, 3), "n / N are on the line numbered as the prompt was"
        assert looks(2) == [current] and looks(3) == [other]
        await pilot.press("n")
        assert view.match_position == (3, 3)
        assert looks(2) == [other] and looks(3) == [current]


SEPARATOR = "──── 12:03:04 restart 1 of this rank (ranktop) ────"


def cells(strip) -> list[tuple[str, tuple]]:
    """(character, (colour, background, bold)) of each cell of a row (single-width text)."""
    return [(ch, (seg.style.color, seg.style.bgcolor, seg.style.bold)) for seg in strip for ch in seg.text]


def sgr(style) -> str:
    """The escape sequence a rank prints to get `style`'s colours and weight."""
    (r, g, b), (br, bg, bb) = style.color.triplet, style.bgcolor.triplet
    return f"\x1b[{'1;' if style.bold else ''}38;2;{r};{g};{b};48;2;{br};{bg};{bb}m"


@sync
async def test_ranktops_own_line_is_drawn_where_no_rank_line_reaches():
    """A restart's separator was a line like any other: a rank printing the same text in the same
    colours drew the same row. Ranktop's own line is a band through the scrollbar's column too,
    which a rank's text never reaches; search finds only the rank's lines, and a copy leaves
    ranktop's out, as the log files do."""
    ring = LineRing()
    feed_lines(ring, 0, 3)
    async with shown(ring) as (view, pilot):
        own = view.get_component_rich_style("logview--ranktop")
        width = view.text_width
        band = SEPARATOR + " " + "─" * (width - len(SEPARATOR) - 1)  # as wide as a rank's text may be
        ring.feed(STDOUT, f"{sgr(own)}{band}\x1b[0m\n".encode())
        ring.add_own_line(SEPARATOR)
        feed_lines(ring, 3, 5)
        view.poll()
        rows = screen_rows(view)
        forged, real = rows.index(band), rows.index(band + "─")
        assert rows[forged + 1:forged + 4] == [band + "─", "line 3", "line 4"]
        forged_cells, real_cells = cells(view.render_line(forged)), cells(view.render_line(real))
        assert forged_cells[:width] == real_cells[:width]  # the text: the same characters and colours
        bar = cells([view._bar_cells[0]])[0]
        assert forged_cells[width] == bar and real_cells[width] == ("─", real_cells[0][1]) != bar
        assert type(view._lines[real]) is RanktopLine

        assert view.search("restart 1 of this rank") == 1 and view._hits == [3]  # the rank's line only
        view.clear_search()
        selection = view.select_rows(0, view.row_count - 1)
        copied = view.get_selection(selection)[0].splitlines()
        assert copied == ["line 0", "line 1", "line 2", band, "line 3", "line 4"]
        view.wrap = True
        await pilot.pause()
        assert view.row_count == 7 and screen_rows(view)[real] == band + "─"  # one row, wrapped or not


@sync
async def test_a_line_marked_ranktops_own_is_drawn_cleaned_and_as_wide_as_the_pane():
    """The band drew a line marked ranktop's own as its bytes were: an engine's answer marks its
    lines by number (`"own"`), so its escape sequences reached the terminal, and a wide character
    made the band's text part wider than the pane."""
    ring = LineRing()
    async with shown(ring) as (view, pilot):
        ring.add_own_line("──── 界界 \x1b]52;c;Zm9v\x07\x1b[2J restart ────")
        view.poll()
        strip = view.render_line(0)
        text = "".join(seg.text for seg in strip)
        assert "\x1b" not in text and "\x07" not in text
        assert strip.cell_length == view.size.width and cell_len(text) == view.size.width
        assert text.startswith("──── 界界 ")


@sync
async def test_ansi_colours_are_kept_and_invalid_utf8_is_replaced():
    ring = LineRing()
    ring.feed(STDOUT, b"\x1b[31mred\x1b[0m plain \x1b[1;32mgreen\x1b[0m\n")
    ring.feed(STDOUT, b"bad \xff\xfe\xc3\x28 end\n")
    ring.feed(STDOUT, b"tab\tbell\x07 esc\x1b alone\n")
    ring.feed(STDOUT, bytes(range(256)) + b"\n")
    async with shown(ring) as (view, pilot):
        (red,) = styles_of(view, 0, "red")
        (green,) = styles_of(view, 0, "green")
        assert red.color.name == "color(1)" and green.color.name == "color(2)" and green.bold
        assert "\ufffd" in screen_rows(view)[1] and screen_rows(view)[1].endswith("end")
        # BEL is shown as a symbol; "ESC SP a" is an escape sequence (nF) and goes whole.
        assert screen_rows(view)[2] == "tab     bell␇ esclone"
        assert all(ord(c) >= 32 for row in screen_rows(view) for c in row), "no control bytes reach the terminal"


@sync
async def test_no_color_drops_colours(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    ring = LineRing()
    ring.feed(STDOUT, b"\x1b[31mred\x1b[0m plain\n")
    async with shown(ring) as (view, pilot):
        (red,) = styles_of(view, 0, "red")
        assert red.color is None or red.color.name != "color(1)"


@sync
async def test_a_5mb_line_is_cut_with_a_marker():
    ring = LineRing()
    ring.feed(STDOUT, b"x" * (5 << 20) + b"\nafter\n")
    ring.feed(STDOUT, "é".encode() * (3 << 20))  # still arriving, no newline yet
    async with shown(ring) as (view, pilot):
        assert view.virtual_size.width < 2 * MAX_CHARS
        view.scroll_to(x=view.max_scroll_x, animate=False)
        await pilot.pause()
        rows = screen_rows(view)
        assert rows[0].endswith("[line cut: 5,242,880 bytes]") and rows[2].endswith("[line cut: 6,291,456 bytes]")
        view.wrap = True
        await pilot.pause()
        assert view.virtual_size.height > 3


@sync
async def test_wrap_toggle_changes_the_virtual_height():
    ring = LineRing()
    for i in range(20):
        ring.feed(STDOUT, f"{i:03d} ".encode() + b"w" * 150 + b"\n")
    async with shown(ring) as (view, pilot):
        # Scrolled all the way right, the last of the 154 columns sits just left of the scrollbar.
        assert view.virtual_size.height == 20 and view.max_scroll_x == 154 - view.text_width
        view.focus()
        await pilot.press("w")
        assert view.wrap
        assert view.virtual_size.height == 20 * -(-154 // view.text_width) and view.max_scroll_x == 0
        assert screen_rows(view)[-1].startswith("w") and view.follow
        ring.feed(STDOUT, b"short\n")
        view.poll()
        assert screen_rows(view)[-1] == "short"
        await pilot.press("w")
        assert not view.wrap and view.virtual_size.height == 21


@sync
async def test_set_ring_starts_over():
    first, second = LineRing(), LineRing()
    feed_lines(first, 0, 30, "old")
    feed_lines(second, 0, 2, "new")
    async with shown(first) as (view, pilot):
        view.set_ring(second)
        await pilot.pause()
        assert view.line_count == 2 and screen_rows(view)[:3] == ["new 0", "new 1", ""]


@pytest.mark.timeout(60)
@sync
async def test_real_ranks_through_the_engine(tmp_path):
    """Awkward bytes from real processes (binary, invalid UTF-8, '\\r' bars, a 5 MB line, a
    partial last line) reach the pane through the engine's pipes and ring."""
    script = str(ROOT / "tests" / "ranks" / "output_fidelity.py")
    spec = WorkerSpec(role="r", local_world_size=2, entrypoint=sys.executable, args=("-u", script))
    agent = LocalAgent(spec, log_dir=str(tmp_path), console=False, shutdown_timeout=5)
    runner = threading.Thread(target=agent.run)
    runner.start()
    try:
        assert agent.wait_started(10)
        app = Host(agent.ring(1))
        async with app.run_test(size=(80, 24)) as pilot:
            view = app.view
            # stdout and stderr are two pipes: wait for the last line of each, not only stdout's
            wait_for(lambda: b"partial last line" in (out := b"".join(agent.ring(1).tail())) and b"stderr too" in out,
                     20, what="rank output")
            view.poll()
            await pilot.pause()
            rows = [row for row in screen_rows(view) if row]
            assert rows[-1] == "partial last line without newline" and view.follow
            assert {"crlf line", "after the long line", "stderr too"} <= set(rows)
            assert view.search("PROGRESS") == 1
            assert "progress 100%" in screen_rows(view)
            assert view.search("bad utf8") == 1 and any("bad utf8 \ufffd" in r for r in screen_rows(view))
    finally:
        runner.join(30)
    assert not runner.is_alive()


class RestyledHost(Host):
    CSS = "LogView.hot { background: #0000ff; color: red; }"


def same_as_textuals_own(view: LogView) -> bool:
    """Whether the pane's rows are, cell for cell and meta for meta, what Textual's own styling makes."""
    from textual.widget import Widget

    crop = view.scrollable_content_region.reset_offset
    ours = view.render_lines(crop)
    view._styles_cache.clear()
    view._frame = view._frame_now()
    theirs = Widget.render_lines(view, crop)
    view._frame = None
    return [list(row) for row in ours] == [list(row) for row in theirs]


@sync
async def test_our_rows_are_what_textuals_own_restyling_would_make(monkeypatch):
    """The bare-box shortcut (no StylesCache pass, no filter on plain rows) changes no cell."""
    ring = LineRing()
    feed_lines(ring, 0, 20)
    ring.feed(STDOUT, b"\x1b[31mred\x1b[0m plain\n")
    async with shown(ring) as (view, pilot):
        assert same_as_textuals_own(view)
        assert view._bare_box() and view._filters_keep_plain_rows(view.get_line_filters())
        view.styles.padding = (0, 1)  # a box Textual must draw: its own pass again
        await pilot.pause()
        assert not view._bare_box()


@sync
async def test_plain_rows_carry_their_own_offsets_and_the_panes_colours_as_they_change():
    """A plain row's style (the pane's colours and the row's offset, which mouse selection reads)
    is kept from frame to frame: the rows still say where they are after the view moves, and take
    the pane's new colours when they change."""
    ring = LineRing(maxlen=30)
    wide = "w" * 70  # wider than the pane: it scrolls sideways too
    feed_lines(ring, 0, 40, wide)
    app = RestyledHost(ring)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        view = app.view
        height = view.scrollable_content_region.height
        for x, y in ((0, view.max_scroll_y), (3, 2), (0, view.max_scroll_y)):
            view.scroll_to(x=x, y=y, animate=False, immediate=True)
            assert view.scroll_offset == (x, y)
            assert [list(view.render_line(row))[0].style.meta["offset"] for row in range(height)] == [
                (x, y + row) for row in range(height)]
        assert same_as_textuals_own(view)
        bottom = view.max_scroll_y + height - 1
        feed_lines(ring, 40, 45, wide)  # a full ring: the same row numbers show newer lines
        assert view.poll() and view.max_scroll_y + height - 1 == bottom and view.row_text(bottom).endswith(" 44")
        assert same_as_textuals_own(view)
        view.add_class("hot")  # new colours from the stylesheet, as focus and themes bring them
        await pilot.pause()
        assert same_as_textuals_own(view)
        assert list(view.render_line(0))[0].style.bgcolor.triplet == (0, 0, 255)


@sync
async def test_rows_are_drawn_again_only_when_the_view_changed():
    ring = LineRing()
    ring.feed(STDOUT, b"0123456789" * 10 + b"\n")  # wider than the view: it can scroll sideways
    feed_lines(ring, 1, 3)
    async with shown(ring) as (view, pilot):
        crop = view.scrollable_content_region.reset_offset
        first = view.render_lines(crop)
        assert all(a is b for a, b in zip(first, view.render_lines(crop), strict=True))  # nothing changed: kept
        ring.feed(STDOUT, b"epoch 1 50%")  # an open line on the next row
        assert view.poll()
        again = view.render_lines(crop)
        assert again[3].text.startswith("epoch 1 50%") and again[0] is not first[0]
        view.scroll_to(x=2, animate=False, immediate=True)  # a new frame: no row of the old one
        assert view.render_lines(crop)[0].text.startswith("‹3456789")  # (the mark over column 2)


# Double-width characters (fullwidth digits, CJK, emoji), a combining accent, zero-width-joined
# emoji and characters Rich and the terminal count apart, each line placed so that a wide character
# or a cluster falls across the wrap column.
WIDE_LINES = [
    "W:" + "".join(chr(0xFF10 + i % 10) for i in range(200)),  # the reviewer's line: ８ was lost at 80x24
    "\x1b[31m" + "红色" * 30 + "\x1b[0mx\x1b[32m" + "绿" * 40 + "\x1b[0m",  # colours across the wrap
    "a" + "漢字🙂" * 40,
    "x" * 78 + "e\u0301y" * 3,  # the accent stays on its e
    "x" * 78 + "👩\u200d💻z" + "👩\u200d💻" * 40,  # a joined emoji: its parts, each moved whole
    # 0 cells to Rich and 2 or 1 to tmux (U+3164 drew this text over the next rank's pane), 2 to Rich
    # and 1 to glibc 2.36 (☺️, ☰), 0 against 1 (ा, U+2028), unassigned (U+0378)
    "\u3164" * 30 + "SPOOF\uffa0" + "ना👍🏽☺️\u2630\u2028\u0378" * 12,
]


def plain_of(line: str) -> str:
    return "".join(part.split("m", 1)[-1] for part in line.split("\x1b["))


def shown_of(line: str) -> str:
    """`line` as a pane shows it: without its colours, at widths Rich and the terminal agree on."""
    from ranktop.tui.cells import agreed_widths

    return agreed_widths(plain_of(line))


@functools.cache
def _wcswidth():
    wcswidth = ctypes.CDLL(None).wcswidth
    wcswidth.argtypes, wcswidth.restype = [ctypes.c_wchar_p, ctypes.c_size_t], ctypes.c_int
    return wcswidth if wcswidth("a一", 2) == 3 else None


def terminal_cells(text: str) -> int | None:
    """The cells the C library's wcswidth gives `text`, as tmux places its characters (-1: one it
    cannot print); None where it does not count as a UTF-8 locale does."""
    wcswidth = _wcswidth()
    return None if wcswidth is None else wcswidth(text, len(text))


def check_as_wide_to_both(cells: str, width: int) -> None:
    """A row's text is `width` cells to Rich, which pads and crops it, and to the terminal."""
    assert cell_len(cells) == width and terminal_cells(cells) in (None, width), cells


def shown_cells(view: LogView, y: int) -> str:
    """Screen row `y` as its cells read: the text, without the scrollbar's last cell."""
    strip = view.render_line(y)
    assert strip.cell_length == view.size.width, "every row is exactly as wide as the pane"
    return "".join(seg.text for seg in list(strip)[:-1])


def check_wrapped(view: LogView, lines: list[str]) -> None:
    """Every row on screen is each line cut by whole cells, as rich's chop_cells cuts it: nothing lost
    or doubled, a wide character or cluster never split, each row padded to the pane's width."""
    width = view.text_width
    expected = [row for line in lines for row in chop_cells(shown_of(line), width)]
    assert view.row_count == len(expected) == view.virtual_size.height <= view.scrollable_content_region.height
    for y, want in enumerate(expected):
        cells = shown_cells(view, y)
        assert view.row_text(y) == want and cells == want + " " * (width - cell_len(want)), f"row {y}"
        check_as_wide_to_both(cells, width)
    for line in lines:
        rows = chop_cells(shown_of(line), width)
        assert "".join(rows) == shown_of(line)
        for row, after in itertools.pairwise(rows):  # a row ends short only for a wide character
            assert cell_len(row) == width or (cell_len(row) == width - 1 and cell_len(after[0]) == 2), row


async def settle(pilot: Pilot, condition, what: str, timeout: float = 5.0) -> None:
    for _ in polls(timeout, what):
        if condition():
            return
        await pilot.pause(0.01)


@sync
async def test_wrap_moves_wide_characters_whole_and_keeps_clusters_and_colours():
    """Every row is as wide as the pane to Rich and to the terminal, wrapped or not. Found by an
    audit: a character they count apart (U+3164: 0 cells to Rich, 2 to tmux) made a row wider on
    screen than Textual laid it out, and the rest of it was drawn over the next pane."""
    ring = LineRing()
    ring.feed(STDOUT, "".join(line + "\n" for line in WIDE_LINES[:-1]).encode())
    ring.feed(STDOUT, WIDE_LINES[-1].encode())  # the open last line wraps the same way
    async with shown(ring, size=(80, 24)) as (view, pilot):
        assert view.row_count == len(WIDE_LINES)
        for y in range(len(WIDE_LINES)):  # unwrapped: each line's row cut at the pane's edge
            check_as_wide_to_both(shown_cells(view, y), view.text_width)
        view.focus()
        await pilot.press("w")
        assert view.wrap and view.text_width == 79
        check_wrapped(view, WIDE_LINES)
        assert shown_cells(view, 1).startswith("８９０"), "the character across the wrap column moves whole"
        for y in range(6, 9):  # the coloured line's rows: each character keeps its colour
            assert {s.color.name for s in styles_of(view, y, "红")} <= {"color(1)"}
            assert {s.color.name for s in styles_of(view, y, "绿")} <= {"color(2)"}
        assert any(styles_of(view, y, "绿") for y in (7, 8)), "the green part reaches a later row"

        await pilot.resize_terminal(71, 24)  # rows are cut again for the new width
        await settle(pilot, lambda: view.text_width == 70 and view.row_count == sum(
            len(chop_cells(shown_of(line), 70)) for line in WIDE_LINES), "rows for the new width")
        check_wrapped(view, WIDE_LINES)


@sync
async def test_without_wrap_a_wide_character_cut_by_the_edge_is_a_blank_cell():
    ring = LineRing()
    ring.feed(STDOUT, (WIDE_LINES[0] + "\n").encode())
    line = plain_of(WIDE_LINES[0])
    async with shown(ring, size=(80, 24)) as (view, pilot):
        for scroll_x in (0, 1, 2, 3):  # the right edge, then the left, cut a ０..９ in half
            view.scroll_to(x=scroll_x, animate=False, immediate=True)
            cells = shown_cells(view, 0)
            assert cell_len(cells) == view.text_width and "\ufffd" not in cells
            # (the row goes on past the right edge, and past the left once scrolled: a cut mark on each)
            assert cells.endswith("›") and cells.startswith("‹") == (scroll_x > 0)
            inside = cells.removeprefix("‹").removesuffix("›")
            assert inside.strip(" ") in line, "whole characters, in order, none lost inside the row"
            assert cell_len(inside.strip(" ")) >= view.text_width - 4


def test_row_ends_cut_by_whole_clusters_as_richs_chop_cells_does():
    from ranktop.tui.cells import row_ends

    for text in ["", "abc", "汉字" * 5, "a" + "汉" * 5, "e\u0301" * 9, "x👩\u200d💻" * 4, "☺\ufe0f" * 5, "\u0301x"]:
        for width in (2, 3, 4, 7):
            ends = [0, *row_ends(text, width)]
            rows = [text[a:b] for a, b in itertools.pairwise(ends)]
            assert "".join(rows) == text and rows == (chop_cells(text, width) or [""]), (text, width)


def test_characters_rich_and_the_terminal_count_apart_are_drawn_at_widths_both_give_them():
    """Found by an audit: Rich, which pads and crops every row, and the terminal (tmux, glibc's
    wcwidth) count some characters' cells apart, so a row was drawn wider or narrower than its pane.
    Each such character is drawn as `�`, or dropped where it only asks for a presentation; every
    other one, and an ASCII line (the same object, untouched), is kept."""
    from ranktop.tui.cells import PLACEHOLDER, agreed_widths, drawable

    table = {
        "\u3164\uffa0\u115f\u1160": PLACEHOLDER * 4,  # the Hangul fillers: 0 cells to Rich, 2 or 1 to tmux
        "नाम": "न" + PLACEHOLDER + "म",  # a spacing combining mark (Mc): 0 to Rich, 1 to wcwidth
        "\u0378x\U000e0080": PLACEHOLDER + "x" + PLACEHOLDER,  # unassigned (Cn): either way
        "👍🏽 👍🏿": "👍 👍",  # the skin tones (0 to Rich, 2 to wcwidth) are dropped
        "☺️ ✌︎": "☺ ✌",  # VS16 (☺️ is 2 to Rich, 1 to wcwidth) and VS15 are dropped
        "👨\u200d👩\u200d👧": "👨👩👧",  # ZWJ: 2 cells to Rich, 6 to wcwidth; each part is 2 to both
        "日本語 é e\u0301 🙂 ␛ ⟨U+202E⟩ \ufffd": "日本語 é e\u0301 🙂 ␛ ⟨U+202E⟩ \ufffd",
    }
    for text, drawn in table.items():
        assert agreed_widths(text) == drawn, text
    line = "step 12 loss 0.5 \x1b[31mred\x1b[0m\t"
    assert agreed_widths(line) is line
    assert drawable("\x1b[31m\u3164x\x1b]0;t\x07\x1b[0m", sgr=True) == "\x1b[31m" + PLACEHOLDER + "x\x1b[0m"
    if terminal_cells("x") is None:
        return  # no C library to ask: the table above is all there is
    # Where it is asked: what Rich 15 and glibc 2.36 count apart (☰: 2 against 1; U+2028: 0 against
    # none), and every character of the BMP and of the emoji planes drawn as wide to both.
    assert agreed_widths("\u2630\u2028") == "".join(
        PLACEHOLDER if cell_len(c) != terminal_cells(c) else c for c in "\u2630\u2028")
    for code in (*range(0x80, 0xD800), *range(0xE000, 0x10000), *range(0x1F000, 0x1FB00)):
        drawn = agreed_widths(chr(code))
        assert cell_len(drawn) == terminal_cells(drawn), hex(code)


def top_line(view: LogView) -> int:
    """The number in the `step N` line at the top of the pane."""
    return int(screen_rows(view)[0].split()[1])


@sync
async def test_the_wrap_toggle_keeps_a_paused_panes_top_line_and_its_match_in_view():
    """`w` read the top row in the new mode's rows (a wrapped row number taken for a line, a line
    for a wrapped row): paused at line 160 it went to 207, and back to 217; a match `/` had shown
    went off screen. The top line stays on top, as through a zoom or a resize, and a match on
    screen stays there."""
    ring = LineRing()
    for i in range(300):  # every other line wraps, onto five rows
        ring.feed(STDOUT, f"step {i} loss 2.{i:03d}{' lr 3.0e-4 grad 1.5' * 8 * (i % 2)}\n".encode())
    async with shown(ring, size=(40, 12)) as (view, pilot):
        view.focus()
        view.scroll_to(y=view.max_scroll_y - 50, animate=False, immediate=True)  # as PgUp x5 (the wheel)
        paused, top = view.position_text, top_line(view)
        assert paused == f"paused at line {top + 1}" and top == 300 - 11 - 50
        for wrap in (True, False, True, False):
            await pilot.press("w")
            await pilot.pause()
            assert view.wrap == wrap and (view.position_text, top_line(view)) == (paused, top), f"wrap {wrap}"

        def match_shown() -> bool:
            return any(row.startswith("step 123 loss 2.123") for row in screen_rows(view))

        assert view.search("loss 2.123") == 1 and match_shown()
        paused = view.position_text
        await pilot.press("w")  # the lines above it take more rows: it stays in view
        await pilot.pause()
        assert view.wrap and match_shown() and view.position_text != paused
        await pilot.press("w")
        await pilot.pause()
        assert not view.wrap and match_shown()


@sync
async def test_a_search_step_scrolls_sideways_to_a_match_past_the_right_edge():
    """Without wrap, `/` and n / N went to the match's line only: a match past the pane's right
    edge showed nowhere. A step scrolls sideways to the match, and back to column 0 for a match
    that shows from there."""
    ring = LineRing()
    far = "." * 70 + " grad 9.9 then the line goes on " + "-" * 40  # the match at column ~80
    ring.feed(STDOUT, b"".join(f"step {i} {far if i % 2 else 'grad 0.1 near'}\n".encode() for i in range(40)))
    async with shown(ring) as (view, pilot):
        current = view.get_component_rich_style("logview--match-current")

        def current_match() -> str:
            """The row drawing a match in the current-match colour, as it reads on screen."""
            rows = [y for y in range(view.scrollable_content_region.height)
                    if any(style.clear_meta_and_links() == current for style in styles_of(view, y, "grad"))]
            assert len(rows) == 1, "one current match, in view"
            return shown_cells(view, rows[0])

        assert view.search("GRAD") == 40 and not view.follow
        assert view.scroll_offset.x > 0 and "grad 9.9" in current_match()
        view.focus()
        await pilot.press("N")
        assert view.scroll_offset.x == 0 and current_match().startswith("step 38 grad 0.1 near")
        await pilot.press("n")
        assert view.scroll_offset.x > 0 and "grad 9.9" in current_match()
        view.wrap = True  # wrapped, every column shows: a step scrolls only up and down
        await pilot.press("N", "n")
        assert view.scroll_offset.x == 0 and view.match_position == (40, 40)
        await pilot.press("w")  # unwrapped again, the match it showed stays in view
        await pilot.pause()
        assert not view.wrap and view.scroll_offset.x > 0 and "grad 9.9" in current_match()


@sync
async def test_without_wrap_a_row_that_goes_on_past_an_edge_is_marked_there():
    """A row cut by the pane's right edge showed no sign of it: `clipped to 5.` where the log had
    `5.0`. Its last cell is a dim `›`, and its first a `‹` once scrolled right past text; a row
    that fits exactly has none, nor has any row wrapped."""
    width = SIZE[0] - 1  # the text's columns, left of the scrollbar
    lines = ["a" * width, "b" * (width + 1), "\x1b[31m" + "c" * 70 + "\x1b[0m", "." * 45 + " clipped to 5.0",
             "short", "", "漢" * 40]
    ring = LineRing()
    ring.feed(STDOUT, "".join(line + "\n" for line in lines).encode())
    async with shown(ring) as (view, pilot):
        assert view.text_width == width
        rows = [shown_cells(view, y) for y in range(len(lines))]
        assert rows[0] == "a" * width and rows[4].rstrip() == "short" and rows[5].strip() == ""
        assert rows[1] == "b" * (width - 1) + "›" and rows[2] == "c" * (width - 1) + "›"
        assert rows[3].endswith(" clipped to 5›"), "the cut number does not read as a value"
        assert rows[6].endswith("›") and cell_len(rows[6]) == width and rows[6][0] == "漢"

        def distance(a, b) -> int:
            return sum(abs(x - y) for x, y in zip(a.triplet, b.triplet, strict=True))

        # The mark is the pane's colours dimmed: its colour nearer the background than the text's,
        # in the plain row (the usual one, drawn without the colour filter) and in a parsed one.
        drawn = view.render_lines(view.scrollable_content_region.reset_offset)
        (text,) = [seg.style for seg in drawn[1] if seg.text.startswith("b")]
        for y in (1, 2):
            (mark,) = [seg.style.clear_meta_and_links() for seg in drawn[y] if seg.text == "›"]
            assert mark.bgcolor == text.bgcolor and not mark.dim
            assert distance(mark.color, text.bgcolor) < 0.8 * distance(text.color, text.bgcolor), "dimmer"

        view.scroll_to(x=2, animate=False, immediate=True)
        rows = [shown_cells(view, y) for y in range(len(lines))]
        assert rows[0] == "‹" + "a" * (width - 3) + "  " and rows[1] == "‹" + "b" * (width - 2) + " "
        assert rows[2] == "‹" + "c" * (width - 2) + "›" and rows[4] == "‹" + "rt".ljust(width - 1)
        assert rows[5].strip() == "" and rows[6].startswith("‹") and rows[6].endswith("›")
        assert all(cell_len(row) == width for row in rows)

        view.wrap = True
        await pilot.pause()
        assert not any("‹" in row or "›" in row for row in screen_rows(view)), "wrapped: no row is cut"


@sync
async def test_a_pane_paused_at_the_bottom_stays_paused_when_it_grows():
    """Textual moves a view up when it grows past the rows below it (a zoom, a larger terminal, a
    sideways scrollbar going with `w`): that was taken for the user scrolling to the bottom, and
    a pane paused there with `f` followed the tail again."""
    ring = LineRing()
    feed_lines(ring, 0, 100)
    async with shown(ring) as (view, pilot):
        view.focus()
        await pilot.press("f")
        assert not view.follow and screen_rows(view)[-1] == "line 99"
        await pilot.resize_terminal(SIZE[0], SIZE[1] + 6)
        await settle(pilot, lambda: view.scrollable_content_region.height == SIZE[1] + 6, "the pane grown")
        feed_lines(ring, 100, 110)
        view.poll()
        await pilot.pause()
        assert not view.follow and "line 99" in screen_rows(view) and "line 109" not in screen_rows(view)


def test_rows_cut_between_clusters_keep_little_whatever_the_rows():
    """A row is cut between whole clusters (rich's crop split 👨‍👩‍👧 after 👨), and the clusters of
    the rows cut are kept for the next frame: bounded, however many rows, however long, a rank
    prints (a list's ints kept 18 MB for 256 rows of 1024 wide characters)."""
    import tracemalloc

    from ranktop.tui import cells
    from ranktop.tui.logview import cropped
    from rich.segment import Segment
    from textual.strip import Strip

    family = Strip([Segment("👨\u200d👩\u200d👧loss 0.123")])
    assert [cropped(family, k, k + 6).text for k in range(4)] == \
        ["👨\u200d👩\u200d👧loss", " loss ", "loss 0", "oss 0."]  # (from cell 1: the family's right half)
    cells._kept_edges.cache_clear()
    tracemalloc.start()
    try:
        for i in range(600):  # distinct rows of wide characters, each cut from its 4th cell
            wide = Strip([Segment("日" * 1023 + chr(0x4E00 + i))])
            assert cropped(wide, 3, 83).text == " " + "日" * 39 + " "  # (cut through 日 at either end)
        for i in range(20):  # and longer ones, which are not kept
            cropped(Strip([Segment("日" * 20_000 + str(i))]), 3, 83)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 8 * 2**20, kept
