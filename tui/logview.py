"""A rank's output pane: a line-virtualised view over the engine's LineRing.

Only the rows on screen are ever parsed (ANSI colours kept) and turned into strips; parsed strips
are cached by absolute line number, so a repaint of an unchanged pane parses nothing. The app
calls `poll()` a few times a second for visible panes: it costs one integer compare when the ring
did not move, and otherwise copies just the new lines.
"""

from __future__ import annotations

import bisect
import itertools
import re
from typing import TYPE_CHECKING, Any

from ranktop.core.output import RING_BYTES, RanktopLine, line_length
from ranktop.core.sanitize import clean
from ranktop.tui.bounded_regex import BoundedPattern
from ranktop.tui.cells import (
    HINTS,
    agreed_widths,
    cells_before,
    crop_cells,
    drawable,
    index_at,
    may_be_wide,
    row_ends,
    split_segments,
)
from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.cache import LRUCache
from textual.color import Color
from textual.events import MouseDown, MouseMove, MouseUp
from textual.filter import ANSIToTruecolor, dim_color
from textual.geometry import Offset, Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.selection import Selection
from textual.strip import Strip

if TYPE_CHECKING:
    from typing import Self  # Python 3.11's: an import here, where 3.10 never runs it

    from ranktop.core.output import LineRing

MAX_CHARS = 10_000  # per line: past this a line is cut with a marker, so a 5 MB line costs no more than 10k
_MAX_BYTES = MAX_CHARS * 4  # UTF-8 needs at most 4 bytes a character
_TAB = 8
_BAR = 1  # columns of the scrollbar LogView draws itself: Textual's ScrollBar widgets re-render
# apart from the text, which made a second compositor pass over every pane on each tick
# (measured: more than half the TUI's CPU under a steady flood).
_CACHE_LINES = 512  # strips kept per pane: a few screens' worth, small even with 64 panes
_ROW_STYLES = 256  # plain rows' styles kept per pane (a few screens' worth)
_PLAIN_LINE = re.compile(rb"[\x20-\x7e]{0,%d}" % MAX_CHARS)  # printable ASCII: one cell a byte
_PLAIN_BYTES = bytes(range(0x20, 0x7F)) + b"\n"  # such lines joined by newlines: translate() deletes them all
_PLAIN = Style()  # Textual's colour filters want a style on every segment, even an empty one
# In UTF-8, a C1 control (8-bit CSI, OSC, ST...: the pane drops its sequence) or a presentation hint the pane
# drops (ZWJ, VS15 / VS16, a skin tone: cells.agreed_widths): the characters either side of it meet on screen.
_DROPPED = re.compile(b"|".join([rb"\xc2[\x80-\x9f]", *(re.escape(chr(code).encode()) for code in sorted(HINTS))]))
CUT_LEFT, CUT_RIGHT = "‹", "›"  # over a row's first / last cell without wrap: its text goes on past that edge


def _marker(raw: bytes) -> str:
    return f" … [line cut: {line_length(raw):,} bytes]"


def parse_line(raw: bytes, style: Style | None = None, color: bool = True) -> Text:
    """One ring line as Rich text: through the sanitiser (UTF-8 with replacement, SGR colours kept
    or dropped without colour, every other sequence dropped, controls shown as symbols) and at
    widths Rich and the terminal agree on (cells.drawable), tabs expanded, and cut at MAX_CHARS
    with a marker."""
    text = raw[:_MAX_BYTES].decode("utf-8", "replace")
    cut = len(raw) > _MAX_BYTES or len(text) > MAX_CHARS
    text = drawable(text[:MAX_CHARS], sgr=color)
    base = style if style is not None else ""
    if "\x1b" in text:  # only kept SGR sequences are left
        parsed = Text.from_ansi(text, no_wrap=True, end="")
        rich_text = Text(parsed.plain, style=base, spans=parsed.spans, no_wrap=True, end="")
    else:
        rich_text = Text(text, style=base, no_wrap=True, end="")
    if "\t" in rich_text.plain:
        rich_text.expand_tabs(_TAB)
    if cut:
        rich_text.append(_marker(raw), "dim italic")
    return rich_text


def _truecolor(style: Style | None) -> bool:
    """Does Textual's ANSI-to-truecolor filter leave `style` as it is?"""
    if style is None:
        return True
    return all(c is None or c.triplet is not None for c in (style.color, style.bgcolor)) and not style.dim


def line_width(raw: bytes) -> int:
    """The cells `parse_line(raw)` takes, cheaply for the common plain-ASCII case; 0 for a line of
    ranktop's own, which is drawn across the pane whatever its width (it does not scroll)."""
    if type(raw) is RanktopLine:
        return 0
    if len(raw) <= MAX_CHARS and raw.isascii():
        if _PLAIN_LINE.fullmatch(raw):
            return len(raw)
        plain = clean(raw.decode("ascii"))  # one cell a character once sequences are gone
        if "\t" not in plain:
            return len(plain)
    return parse_line(raw).cell_len  # bounded: parse_line reads at most _MAX_BYTES


def line_widths(lines: list[bytes]) -> list[int]:
    """line_width of each line, in one pass over them all when they are all plain (the usual batch)."""
    widths = list(map(len, lines))
    if widths and max(widths) <= MAX_CHARS and not b"\n".join(lines).translate(None, _PLAIN_BYTES):
        return widths
    return [line_width(line) for line in lines]


def line_rows(raw: bytes, cells: int, width: int) -> int:
    """The rows `parse_line(raw)` (`cells` wide) takes wrapped at `width` cells: a line that may
    hold a double-width character is cut as the pane cuts it, by whole characters. A line of
    ranktop's own is one row, cut at the pane's width."""
    if type(raw) is RanktopLine:
        return 1
    if raw.isascii() or not may_be_wide(raw[:_MAX_BYTES].decode("utf-8", "replace")):
        return max(1, -(-cells // width))
    return len(row_ends(parse_line(raw, color=False).plain, width))


def matches(raw: bytes, needle: str, needle_bytes: bytes | None) -> bool:
    """Whether one raw output line holds `needle` (lower case; `needle_bytes` its ASCII bytes, or
    None), in any case, as the pane shows it (escape sequences do not count). A line of ranktop's
    own never matches: search is of what the rank printed."""
    if type(raw) is RanktopLine:
        return False
    # An ASCII needle is in the bytes where the pane shows it when the line is whole there (at most
    # MAX_CHARS bytes) and holds nothing the pane drops, a sequence (7-bit or 8-bit) or a joiner: a
    # search counted what no pane showed, a needle in an 8-bit OSC or past a long line's cut, and
    # missed one the pane showed across a dropped joiner. (A character the pane draws as a
    # placeholder is non-ASCII either way.)
    if (needle_bytes is not None and len(raw) <= MAX_CHARS and b"\x1b" not in raw
            and (raw.isascii() or not _DROPPED.search(raw))):
        return needle_bytes in raw.lower()  # bytes.lower is enough and fast
    return needle in parse_line(raw[:_MAX_BYTES], color=False).plain.lower()


REGEX_PREFIX = "re:"  # a search query starting so is a regular expression (any case)


def plain_needle(query: str) -> str:
    """A plain query as `matches` takes it: in lower case, and drawn as the panes draw a line
    (cells.agreed_widths), so that a query typed or pasted with a skin tone or a joiner finds the
    emoji a pane shows without it."""
    return agreed_widths(query).lower()


def search_pattern(query: str) -> BoundedPattern | None:
    """The regular expression of a `re:` query (any case), None for a plain one; ValueError
    with a one-line reason when it does not compile. Each match of it is bounded in time (see
    tui/bounded_regex.py)."""
    if not query.startswith(REGEX_PREFIX):
        return None
    from ranktop.tui.usage import compiled_regex

    text = query[len(REGEX_PREFIX):]
    try:
        return compiled_regex(text, ignore_case=True)
    except ValueError as exc:
        raise ValueError(f"bad regular expression {text[:80]!r}: {exc}") from None


def regex_matches(raw: bytes, pattern: BoundedPattern) -> bool:
    """Whether one raw output line matches a `re:` search, as the pane shows the line (never a
    line of ranktop's own)."""
    return type(raw) is not RanktopLine and pattern.search(parse_line(raw[:_MAX_BYTES], color=False).plain) is not None


def column_showing(start: int, end: int, cells: int, width: int, x: int) -> int:
    """The column to scroll to (from `x`) so that cells [start, end) of a row `cells` wide show
    whole in `width` cells, clear of the cut marks (a `‹` over the first cell once scrolled right,
    a `›` over the last where the row goes on): 0 where they fit from there, else `x` where they
    show from it, else with about a quarter of the width before them (their start first, for a
    match wider than the pane)."""

    def clear(column: int) -> bool:
        return (column == 0 or column < start) and end <= column + width - (cells > column + width)

    if clear(0):
        return 0
    if clear(x):
        return x
    return max(1, min(start - 1, max(start - width // 4, end - width + 1)))


def cropped(strip: Strip, start: int, end: int, pad: Style | None = None) -> Strip:
    """Cells `start`..`end` of `strip`, `end - start` of them, cut between whole clusters
    (cells.crop_cells): rich's crop split 👨‍👩‍👧 after 👨. Where rich counts the cut's cells
    otherwise (a cluster across two segments, a row that begins zero-width), rich's own crop: the
    compositor lays a row out by rich's count."""
    if start == 0 and strip.cell_length <= end:  # nothing cut: the usual row, from its start, shorter than the pane
        return strip.extend_cell_length(end, pad)
    segments = list(strip)
    if all(segment.text.isascii() for segment in segments):  # one cell a character: rich's crop is exact
        return strip.crop_extend(start, end, pad)
    cut = crop_cells(segments, start, end, pad)
    if sum(cell_len(segment.text) for segment in cut) != end - start:
        return strip.crop_extend(start, end, pad)
    return Strip(cut, end - start)


def _kept_lines(source: Any) -> int:
    """How many complete lines the source (a LineRing, an engine's RankFeed) keeps."""
    return getattr(source, "maxlen", None) or 10_000


class LogView(ScrollView, can_focus=True):
    """Recent output of one rank, newest at the bottom; follows the tail until scrolled up."""

    COMPONENT_CLASSES = {"logview--match", "logview--match-current", "logview--bar", "logview--thumb",
                         "logview--ranktop", "logview--cut"}
    # The vertical scrollbar is drawn by render_line in the last column (see _BAR), so Textual's
    # own is sized to nothing; the horizontal one stays Textual's (it rarely changes).
    DEFAULT_CSS = """
    LogView { scrollbar-size-vertical: 0; }
    LogView > .logview--match { text-style: reverse; }
    LogView > .logview--match-current { background: $accent; color: $text; text-style: bold; }
    LogView > .logview--bar { background: $scrollbar-background; }
    LogView > .logview--thumb { background: $scrollbar; }
    LogView:focus > .logview--thumb { background: $scrollbar-active; }
    LogView > .logview--ranktop { background: $accent 30%; color: $text; text-style: bold; }
    LogView > .logview--cut { text-style: dim; }
    """
    BINDINGS = [
        Binding("end", "scroll_end", "Tail", show=False),
        Binding("home", "scroll_home", "Top", show=False),
        # Not in the footer: the pane's title says whether it follows, and the help lists them.
        Binding("f", "toggle_follow", "Follow", show=False),
        Binding("w", "toggle_wrap", "Wrap", show=False),
        Binding("n", "search_next", "Next match", show=False),
        Binding("N", "search_prev", "Previous match", show=False),
    ]

    follow: reactive[bool] = reactive(True)
    wrap: reactive[bool] = reactive(False)

    class SearchStopped(Message):
        """The `re:` search's pattern took too long on a line and was given up (it matches nothing
        from then on: the search, new lines, the highlighting); posted once for each search."""

        def __init__(self, log: LogView, query: str) -> None:
            super().__init__()
            self.log = log
            self.query = query

    def __init__(
        self,
        ring: LineRing | None = None,
        *,
        follow: bool = True,
        wrap: bool = False,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.set_reactive(LogView.follow, follow)
        self.set_reactive(LogView.wrap, wrap)
        self._strips: LRUCache[Any, Any] = LRUCache(_CACHE_LINES)
        self._by_me = False  # True while we move the view ourselves (not the user)
        self._base_style: Style | None = None
        self._base_background: Color | None = None
        self._bar: tuple[Segment, Segment] | None = None
        self._own_style: Style | None = None
        self._cut_style: Style | None = None
        self._row_styles: dict[tuple[int, int, bool], Style] = {}  # see _row_style
        self._frame: tuple[int, int, int, int, int, Selection | None] | None = None
        self._last_wrapped: tuple[tuple[bytes, int], str, list[int]] | None = None  # see _wrapped
        # The rows drawn for the frame in `_drawn_for`, by screen row: the compositor redraws every
        # widget under the union of the screen's changes (a title's clock makes that the whole
        # screen), so a pane that did not change is asked for its rows again.
        self._drawn: dict[int, Strip] = {}
        self._drawn_for: tuple | None = None
        self._dragging = False  # the mouse holds the scrollbar
        self._reset(ring)

    # ----- the data ------------------------------------------------------------------------------
    def _reset(self, ring: LineRing | None) -> None:
        self._ring = ring
        self._maxlen = _kept_lines(ring)
        # As many bytes as the ring keeps: a pane never holds more than its rank's ring.
        self._max_bytes = getattr(ring, "max_bytes", RING_BYTES)
        self._bytes = 0  # of self._lines
        self._version = -1
        self._lines: list[bytes] = []  # complete lines, oldest first; self._first is the number of the first
        self._widths: list[int] = []
        self._first = 0
        self._open: list[bytes] = []  # unfinished last line of each stream, shown after the complete ones
        self._open_widths: list[int] = []
        self._open_rows_each: list[int] = []  # rows of each open line (1 each unless wrapped)
        self._max_width = 0
        self._cum: list[int] = [0]  # wrap mode: absolute first row of each kept line, then the end
        self._wrap_width = 80  # set from the real width once mounted
        self._query, self._query_bytes = "", None
        self._regex: BoundedPattern | None = None
        self._hits: list[int] = []  # absolute numbers of matching complete lines, ascending
        self._current: int | None = None  # the match the view was moved to
        self._match_due: int | None = None  # a match to show once laid out (asked for before): on_resize
        self._strips.clear()

    def set_ring(self, ring: LineRing | None) -> None:
        """Show another ring (a new attempt of the rank): start over from it. A selection goes
        too: its rows were the old ring's."""
        query = self._query
        if self.is_mounted and self.text_selection is not None:
            self.screen.selections = {w: sel for w, sel in self.screen.selections.items() if w is not self}
        self._reset(ring)
        if self.is_mounted:
            self.poll()
            if query:
                self.search(query)

    @property
    def line_count(self) -> int:
        return len(self._lines) + len(self._open)

    def poll(self) -> bool:
        """Take what the ring got since the last call; repaint if the view changed. Cheap when
        nothing moved. Returns True when it repainted."""
        ring = self._ring
        if ring is None or ring.version == self._version:
            return False
        self._version, total, new, open_lines = ring.since(self._first + len(self._lines))
        changed_from, top_row = self._row_count() - self._open_rows(), self.scroll_offset.y
        dropped_rows = self._take(total, new, open_lines)
        self._update_virtual_size()
        if not self.size:
            return False  # not laid out yet: on_resize will place the view
        if self.follow:
            self._move_to(self.max_scroll_y)
        elif dropped_rows:
            self._move_to(max(0, top_row - dropped_rows))  # keep the same lines on screen
        elif changed_from >= top_row + self.scrollable_content_region.height:
            return False  # only rows below the screen changed: the scrollbar updates by itself
        self.refresh()
        return True

    def _take(self, total: int, new: list[bytes], open_lines: list[bytes]) -> int:
        """Add the new complete lines, replace the open ones; return the rows dropped at the top."""
        expected = self._first + len(self._lines)
        if total - len(new) != expected:  # lines went by unseen (a hidden pane): start from the ring's window
            dropped = self._row_count() - self._open_rows()
            self._lines, self._widths, self._first, self._max_width = [], [], total - len(new), 0
            self._bytes = 0
            self._cum = [0]
            self._strips.clear()
            self._hits = []
        else:
            dropped = 0
        widths = line_widths(new)
        self._lines.extend(new)
        self._bytes += sum(map(len, new))
        self._widths.extend(widths)
        self._max_width = max(self._max_width, *widths, 0)
        if self.wrap:
            self._extend_rows(new, widths)
        if self._query:
            self._hits.extend(n for n, line in enumerate(new, total - len(new)) if self._hit(line))
        over = max(len(self._lines) - self._maxlen, self._lines_over_bytes())
        if over > 0:
            dropped += self._drop_front(over)
        self._open = open_lines
        self._open_widths = line_widths(open_lines)
        self._count_open_rows()
        self._max_width = max(self._max_width, *self._open_widths, 0)
        return dropped

    def _lines_over_bytes(self) -> int:
        """How many of the oldest lines to drop to be within the byte cap again."""
        excess, count = self._bytes - self._max_bytes, 0
        while excess > 0:
            excess -= len(self._lines[count])
            count += 1
        return count

    def _drop_front(self, count: int) -> int:
        rows = (self._cum[count] - self._cum[0]) if self.wrap else count
        self._bytes -= sum(map(len, self._lines[:count]))
        del self._lines[:count], self._widths[:count]
        if self.wrap:
            del self._cum[:count]
        self._first += count
        if self._hits and self._hits[0] < self._first:
            del self._hits[: bisect.bisect_left(self._hits, self._first)]
        return rows

    # ----- rows (a line is one row, or several when wrapped) -------------------------------------
    def _rows_of(self, raw: bytes, width: int) -> int:
        return line_rows(raw, width, self._wrap_width) if self.wrap else 1

    def _extend_rows(self, lines: list[bytes], widths: list[int]) -> None:
        rows = itertools.accumulate(map(self._rows_of, lines, widths), initial=self._cum[-1])
        self._cum.extend(itertools.islice(rows, 1, None))  # accumulate starts with its initial value

    def _rebuild_rows(self) -> None:
        self._wrap_width = self.text_width
        self._cum = list(itertools.accumulate(map(self._rows_of, self._lines, self._widths), initial=0))
        self._count_open_rows()
        self._strips.clear()

    def _count_open_rows(self) -> None:
        self._open_rows_each = list(map(self._rows_of, self._open, self._open_widths))

    def _open_rows(self) -> int:
        return sum(self._open_rows_each)

    def _row_count(self) -> int:
        complete = (self._cum[-1] - self._cum[0]) if self.wrap else len(self._lines)
        return complete + self._open_rows()

    def _row_of_line(self, index: int, wrapped: bool | None = None) -> int:
        """The first row of the line at `index` (0 = oldest kept); `wrapped` as in _locate."""
        if not (self.wrap if wrapped is None else wrapped):
            return index
        if index < len(self._lines):
            return self._cum[index] - self._cum[0]
        return self._cum[-1] - self._cum[0] + sum(self._open_rows_each[: index - len(self._lines)])

    def _locate(self, row: int, wrapped: bool | None = None) -> tuple[int, int]:
        """(line index, row within that line) for a row of the whole view; `wrapped`: as the rows
        were with wrap on or off (the wrap's watcher asks as they were before it changed)."""
        if not (self.wrap if wrapped is None else wrapped):
            return row, 0
        complete = self._cum[-1] - self._cum[0]
        if row < complete:
            index = bisect.bisect_right(self._cum, row + self._cum[0]) - 1
            return index, row + self._cum[0] - self._cum[index]
        row -= complete
        for k, rows in enumerate(self._open_rows_each):
            if row < rows:
                return len(self._lines) + k, row
            row -= rows
        return self.line_count, 0

    def _update_virtual_size(self) -> None:
        size = Size((self._wrap_width if self.wrap else self._max_width) + _BAR, self._row_count())
        if size == self.virtual_size:
            return
        view = self.scrollable_content_region.size
        same_bars = (size.width > view.width) == (self.virtual_size.width > view.width) and (
            size.height > view.height) == (self.virtual_size.height > view.height)
        if same_bars and self.size:
            # Setting virtual_size re-lays out the whole screen; when no scrollbar comes or goes,
            # updating the scrollbars is all it needs (measured: most of the cost of a poll).
            self.set_reactive(ScrollView.virtual_size, size)
            self._scroll_update(size)
        else:
            self.virtual_size = size
            if self.follow:  # the new height counts once laid out: go to the tail then, not before
                self.call_after_refresh(self._follow_tail)

    # ----- rendering -----------------------------------------------------------------------------
    @property
    def _style(self) -> Style:
        # rich_style walks the CSS of every ancestor (most of a cached repaint's cost): keep it
        # until the styles change.
        if self._base_style is None:
            self._base_style = self.rich_style
        return self._base_style

    @property
    def _background(self) -> Color:
        # As _style: background_colors walks every ancestor, once a pane each frame.
        if self._base_background is None:
            self._base_background = self.background_colors[1]
        return self._base_background

    @property
    def text_width(self) -> int:
        """Columns for text: the content width less the scrollbar."""
        return max(1, self.scrollable_content_region.width - _BAR)

    def _thumb(self, scroll_y: int) -> tuple[int, int]:
        """Rows [start, end) of the scrollbar's thumb; (0, 0) when everything fits."""
        height, total = self.scrollable_content_region.height, self.virtual_size.height
        if total <= height or height <= 0:
            return 0, 0
        size = max(1, round(height * height / total))
        start = round(scroll_y / (total - height) * (height - size))
        return start, start + size

    def _frame_now(self) -> tuple[int, int, int, int, int, Selection | None]:
        scroll_x, scroll_y = self.scroll_offset
        # text_selection walks up to the screen on every call: once a repaint, not once a row
        return scroll_x, scroll_y, self.text_width, *self._thumb(scroll_y), self.text_selection

    @property
    def _bar_cells(self) -> tuple[Segment, Segment]:
        """The scrollbar's track cell and thumb cell, kept until the styles change."""
        if self._bar is None:
            self._bar = tuple(Segment(" " * _BAR, self.get_component_rich_style(name, partial=True))
                              for name in ("logview--bar", "logview--thumb"))
        return self._bar

    def render_lines(self, crop: Region) -> list[Strip]:
        # Read the scroll position, width and thumb once per repaint, not once per row.
        self._frame = self._frame_now()
        try:
            return self._rows(crop) if self._bare_box() else super().render_lines(crop)
        finally:
            self._frame = None

    def _bare_box(self) -> bool:
        """No border, padding, outline or opacity: then Textual's per-row styling (its StylesCache)
        would only wrap each of our finished rows in three more Strips, half a repaint's cost."""
        styles = self.styles
        return (styles.gutter.totals == (0, 0) and not any(edge for edge, _ in styles.outline)
                and styles.text_opacity == 1.0 and self.opacity == 1.0)

    def _rows(self, crop: Region) -> list[Strip]:
        """`crop` of the rows as render_line makes them, through the app's line filters."""
        background = self._background
        filters = self.get_line_filters()
        frame = (self._frame, background, tuple(filters))
        if frame != self._drawn_for:
            self._drawn.clear()
            self._drawn_for = frame
        # A plain row has only our CSS colours: when those are truecolor already, the usual filter
        # (ANSI colours to truecolor) would remake the row for nothing, style by style (the offset
        # meta makes every row's style new to its cache).
        plain_filters = [] if self._filters_keep_plain_rows(filters) else filters
        x1, x2 = crop.column_span
        rows = []
        for y in crop.line_range:
            row = self._drawn.get(y)
            if row is None:
                row, plain = self._row(y)
                for line_filter in plain_filters if plain else filters:
                    row = row.apply_filter(line_filter, background)
                self._drawn[y] = row
            rows.append(row if (x1, x2) == (0, row.cell_length) else cropped(row, x1, x2))
        return rows

    def refresh(self, *regions: Region, repaint: bool = True, layout: bool = False,
                recompose: bool = False) -> Self:
        if repaint:  # what the rows show changed (new lines, a search, the wrap): draw them again
            self._drawn.clear()
        return super().refresh(*regions, repaint=repaint, layout=layout, recompose=recompose)

    def _filters_keep_plain_rows(self, filters: list) -> bool:
        styles = (self._style, self._mark_style, *(cell.style for cell in self._bar_cells))
        return all(isinstance(f, ANSIToTruecolor) for f in filters) and all(map(_truecolor, styles))

    def render_line(self, y: int) -> Strip:
        return self._row(y)[0]

    def _row(self, y: int) -> tuple[Strip, bool]:
        """Row `y` of the view, and whether it is a plain row (printable ASCII in our own style)."""
        scroll_x, scroll_y, width, thumb_start, thumb_end, selection = self._frame or self._frame_now()
        bar = self._bar_cells[thumb_start <= y < thumb_end]
        row = scroll_y + y
        index, sub = self._locate(row)
        raw = self._raw(index)
        if type(raw) is RanktopLine:
            return self._own_row(raw, row, scroll_x, width), False
        if raw is not None and _PLAIN_LINE.fullmatch(raw) and not (self._query and self._hit(raw)):
            # Most log lines: printable ASCII, one cell a byte. Slicing the bytes is far cheaper than
            # parsing, rendering and cropping a Rich Text, and needs no cache.
            if self.wrap:
                raw = raw[sub * self._wrap_width : (sub + 1) * self._wrap_width]
            visible = raw[scroll_x : scroll_x + width].decode("ascii").ljust(width)
            left, right = self._cut_ends(len(raw), scroll_x, width)
            if selection is None:  # the usual row, in one Strip rather than three (each makes 7 caches)
                return Strip([*self._plain_cells(visible, left, right, scroll_x, row), bar], width + _BAR), True
            text = Strip([Segment(visible, self._style)], width)
            shown = ""  # (one cell a character: cells and indices are the same)
        else:
            strip = self._strip(index, sub)
            if strip is None:
                text, left, right, shown = Strip.blank(width, self._style), False, False, ""
            else:
                text = cropped(strip, scroll_x, scroll_x + width, self._style)
                left, right = self._cut_ends(strip.cell_length, scroll_x, width)
                # The row's text (row_text's, which a copy takes), joined only where it is needed:
                # a selection, or a pane scrolled sideways (every coloured row is drawn here)
                shown = strip.text if selection is not None or scroll_x else ""
        if left or right:
            text = self._marked(text, left, right, width)
        if selection is not None:
            text = self._selected(text, selection, row, shown, scroll_x, width)
        # Offsets tell Textual which row and column the mouse is over (what selection starts from),
        # as the index of the row's character there: scrolled sideways past a wide character, the
        # column is not the index (the plain row above carries the same meta).
        first = index_at(shown, scroll_x) if scroll_x else 0
        return Strip([*text.apply_offsets(first, row), bar], width + _BAR), False

    def _row_style(self, scroll_x: int, row: int, cut: bool = False) -> Style:
        """Our style (`cut`: a cut mark's) with the offset meta of this row (which Textual's mouse
        selection reads), kept: once a pane holds all the lines it keeps, a followed tail draws the
        same row numbers frame after frame (their lines change), and making this style was a fifth
        of a row's cost."""
        key = (scroll_x, row, cut)
        style = self._row_styles.get(key)
        if style is None:
            if len(self._row_styles) >= _ROW_STYLES:
                self._row_styles.clear()
            offset = Style.from_meta({"offset": (scroll_x, row)})
            base = self._mark_style if cut else self._style
            style = self._row_styles[key] = base + offset if base else offset
        return style

    # ----- cut marks: without wrap, a `‹` / `›` where a row goes on past the pane's edge -----------
    def _cut_ends(self, cells: int, scroll_x: int, width: int) -> tuple[bool, bool]:
        """Whether a row of a line `cells` wide, seen from column `scroll_x` in `width` cells, has
        text past the pane's left edge, and past its right: a number cut there read as another
        (`clipped to 5.` for `5.0`). Wrapped, a row ends where the pane does."""
        if self.wrap or width < 3:
            return False, False
        return scroll_x > 0 and cells > 0, cells > scroll_x + width

    @property
    def _mark_style(self) -> Style:
        """The cut marks' style: the pane's, dimmed, kept until the styles change. The dim is made
        the colour Textual's colour filter would make it (where the pane's colours are truecolor):
        a row with a mark then stays a plain row, which skips the filter (it doubled a frame's cost)."""
        if self._cut_style is None:
            style = self._style + self.get_component_rich_style("logview--cut", partial=True)
            color, background = style.color, style.bgcolor or self._background.rich_color
            if style.dim and color is not None and color.triplet is not None and background.triplet is not None:
                style += Style(color=dim_color(background, color), dim=False)
            self._cut_style = style
        return self._cut_style

    def _plain_cells(self, visible: str, left: bool, right: bool, scroll_x: int, row: int) -> list[Segment]:
        """A plain row's text with its offsets, its first / last cell a cut mark where it goes on."""
        if not (left or right):
            return [Segment(visible, self._row_style(scroll_x, row))]
        start, end = int(left), len(visible) - int(right)
        cells = [Segment(visible[start:end], self._row_style(scroll_x + start, row))]
        if left:
            cells.insert(0, Segment(CUT_LEFT, self._row_style(scroll_x, row, cut=True)))
        if right:
            cells.append(Segment(CUT_RIGHT, self._row_style(scroll_x + end, row, cut=True)))
        return cells

    def _marked(self, text: Strip, left: bool, right: bool, width: int) -> Strip:
        """`text` (`width` cells) with a cut mark over its first cell and / or its last (a wide
        character under a mark leaves a blank cell beside it)."""
        parts = [cropped(text, int(left), width - int(right))]
        if left:
            parts.insert(0, Strip([Segment(CUT_LEFT, self._mark_style)], 1))
        if right:
            parts.append(Strip([Segment(CUT_RIGHT, self._mark_style)], 1))
        return Strip.join(parts)

    def _own_row(self, raw: RanktopLine, row: int, scroll_x: int, width: int) -> Strip:
        """A line of ranktop's own (a restart's separator) as a band across the whole pane, the
        scrollbar's column included: no rank output reaches that column, so a rank that prints the
        same text in the same colours still cannot draw this. It does not scroll sideways, and a
        selection passes over it (a copy leaves it out)."""
        if self._own_style is None:
            self._own_style = self.get_component_rich_style("logview--ranktop")
        # Cleaned: a client takes which lines are ranktop's from the engine's answer ("own").
        words = drawable(raw[:_MAX_BYTES].decode("utf-8", "replace")[:MAX_CHARS])
        band = set_cell_size(words + " " + "─" * (width + _BAR), width + _BAR)
        text, bar = Segment(band, self._own_style).split_cells(width)  # (by cells: a wide character)
        return Strip([*Strip([text], width).apply_offsets(scroll_x, row), bar], width + _BAR)

    # ----- selection (mouse, or V in the screen), copied through OSC 52 ----------------------------
    def _selected(self, text: Strip, selection: Selection, row: int, shown: str, scroll_x: int,
                  width: int) -> Strip:
        """`text` (row `row` from column `scroll_x`, `width` cells; `shown`: the row's text) with the
        selected characters in the selection's colours: those a copy takes (the selection counts
        characters, the row is cut by cells: a wide character is two)."""
        span = selection.get_span(row)
        if span is None:
            return text
        first, last = span
        start = cells_before(shown, first)
        end = width + scroll_x if last == -1 else cells_before(shown, last)
        start, end = max(0, start - scroll_x), min(width, end - scroll_x)
        if start >= end:
            return text
        # By crops, not divide(): rich may count a row's text a cell shorter than its strip says (a
        # zero-width joiner before a wide character), and divide() then gave two pieces, not three:
        # a ValueError that ended the TUI.
        before, chosen, after = cropped(text, 0, start), cropped(text, start, end), cropped(text, end, width)
        # After each segment's own style, so the selection's colours win over the text's.
        selected = self.screen.get_component_rich_style("screen--selection", partial=True)
        marked = Segment.apply_style(chosen, post_style=selected)
        return Strip.join([before, Strip(marked, chosen.cell_length), after])

    def row_text(self, row: int) -> str:
        """A row as it reads on screen (sanitised; a wrapped line's piece), for copying; "" for a
        line of ranktop's own."""
        index, sub = self._locate(row)
        raw = self._raw(index)
        if raw is None or type(raw) is RanktopLine:
            return ""
        if not self.wrap:
            return parse_line(raw, color=False).plain
        plain, ends = self._wrapped(raw)
        return plain[ends[sub] : ends[sub + 1]] if sub + 1 < len(ends) else ""

    def _wrapped(self, raw: bytes) -> tuple[str, list[int]]:
        """A line's text and where its rows start and end, kept for the next row: a copy asks for
        each row of a line in turn (a line of 10,000 characters, 500 rows in a narrow pane, was
        parsed and cut 500 times: a copy of a few such lines took seconds, the TUI frozen)."""
        key = (raw, self._wrap_width)
        if self._last_wrapped is None or self._last_wrapped[0] != key:
            plain = parse_line(raw, color=False).plain
            self._last_wrapped = (key, plain, [0, *row_ends(plain, self._wrap_width)])
        return self._last_wrapped[1], self._last_wrapped[2]

    @property
    def row_count(self) -> int:
        return self._row_count()

    def get_selection(self, selection: Selection) -> tuple[str, str] | None:
        """The selected characters of each selected row, as the pane highlights them (get_span),
        the rows of a wrapped line as one line: a break only where the rank's output had one (a
        copy of a wrapped line had one at each row's end). Not Selection.extract: it splits its
        text with str.splitlines, which also breaks at U+2028, U+2029 (which a row may show), so
        the rows after one came out shifted and cut; and a drag let go below the last row cut that
        row at the column let go at, where it is highlighted whole."""
        start = selection.start or Offset(0, 0)
        last = self._row_count() - 1 if selection.end is None else min(selection.end.y, self._row_count() - 1)
        lines: list[str] = []
        for row in range(start.y, last + 1):
            span = selection.get_span(row)
            if span is None or self._is_own_row(row):  # ranktop's lines are not the rank's output: a copy,
                continue  # like the log files, has none
            text = self.row_text(row)
            first, end = span
            piece = text[first:] if end == -1 else text[first:end]
            if lines and self._locate(row)[1] > 0:  # a wrapped line's next row: the same line goes on
                lines[-1] += piece
            else:
                lines.append(piece)
        return "\n".join(lines), "\n"

    def _is_own_row(self, row: int) -> bool:
        return type(self._raw(self._locate(row)[0])) is RanktopLine

    def selection_updated(self, selection: Selection | None) -> None:
        self.refresh()

    def select_rows(self, first: int, last: int) -> Selection:
        """Select whole rows first..last (either order) and keep `last` in view."""
        top, bottom = sorted((max(0, first), max(0, min(last, self._row_count() - 1))))
        selection = Selection(Offset(0, top), Offset(len(self.row_text(bottom)), bottom))
        self.screen.selections = {self: selection}
        self.show_row(last)
        return selection

    def show_row(self, row: int) -> None:
        self.follow = False
        height = self.scrollable_content_region.height
        top = round(self.scroll_offset.y)
        if row < top:
            self._move_to(row)
        elif row >= top + height:
            self._move_to(row - height + 1)
        self.refresh()

    @property
    def bottom_row(self) -> int:
        """The last row shown (the newest when following)."""
        if self.follow:  # (the view may not have caught up with the newest rows yet)
            return max(0, self._row_count() - 1)
        height = self.scrollable_content_region.height
        return max(0, min(self._row_count(), round(self.scroll_offset.y) + height) - 1)

    def _raw(self, index: int) -> bytes | None:
        if index < len(self._lines):
            return self._lines[index]
        if index < self.line_count:
            return self._open[index - len(self._lines)]
        return None

    def _strip(self, index: int, sub: int) -> Strip | None:
        if index >= self.line_count:
            return None
        number = self._first + index
        if index < len(self._lines):
            raw, key = self._lines[index], number
        else:
            # An unfinished line by its text (a progress bar redrawn is new text) and its number:
            # another stream's line ending before it moves it down one, and the current-match
            # colour goes by number, as n / N do (by text alone it stayed on the line it had left).
            raw = self._open[index - len(self._lines)]
            key = ("open", number, raw)
        pieces = self._strips.get(key)
        if pieces is None:
            pieces = self._render_raw(raw, number)
            self._strips[key] = pieces
        return pieces[sub] if sub < len(pieces) else None

    def _render_raw(self, raw: bytes, number: int) -> list[Strip]:
        """The rows of the line numbered `number` (an unfinished one: as it will be once complete)."""
        text = parse_line(raw, self._style, color=not self.app.no_color)
        if self._query:
            current = number == self._current
            name = "logview--match-current" if current else "logview--match"
            style = self.get_component_rich_style(name)
            if self._regex is not None:
                text.highlight_regex(self._regex, style)
                self._say_if_stopped()
            else:
                text.highlight_words([self._query], style, case_sensitive=False)
        segments = [seg if seg.style else Segment(seg.text, _PLAIN) for seg in text.render(self.app.console)]
        if not self.wrap or text.cell_len <= self._wrap_width:
            return [Strip(segments, text.cell_len)]
        # By whole characters: a wide one that does not fit in a row's last cell starts the next row.
        rows = split_segments(segments, row_ends(text.plain, self._wrap_width))
        return [Strip(row) for row in rows]  # measured as Textual measures them

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._base_style = self._base_background = self._bar = self._own_style = self._cut_style = None
        self._row_styles.clear()
        self._strips.clear()
        self._drawn.clear()

    # ----- following and scrolling ---------------------------------------------------------------
    def _move_to(self, y: float) -> None:
        self._by_me = True
        try:
            self.scroll_to(y=y, animate=False, immediate=True)
        finally:
            self._by_me = False

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        # Not ScrollView's: it moves Textual's ScrollBar widget, which we hide (we draw our own),
        # and a refresh of a widget the compositor does not show makes it lay out the whole
        # screen again: every poll that scrolled cost a full layout.
        if round(old_value) != round(new_value):
            self.refresh()
        if not self._by_me:  # the user scrolled: up leaves the tail, reaching the bottom rejoins it
            at_bottom = round(new_value) >= self.max_scroll_y
            # Textual also moves the view up when the pane grows past the rows below it (a zoom, a
            # larger terminal, the sideways scrollbar going with `w`): that is no scroll down, and
            # a pane paused at the bottom (f, or a match shown there) followed the tail again.
            # Set without its watcher: the view is at the bottom already, and the watcher's move
            # there stopped an animated scroll (↓ zoomed, PgDn) from inside the animation's last
            # step, where Textual's animator raised KeyError: it ended the TUI.
            self.set_reactive(LogView.follow, at_bottom and (new_value > old_value or self.follow))

    def watch_follow(self, follow: bool) -> None:
        if follow:
            self._move_to(self.max_scroll_y)

    def watch_wrap(self, was_wrapped: bool, wrap: bool) -> None:
        self._count_rows_again(was_wrapped)
        if self.follow:
            self._move_to(self.max_scroll_y)

    def on_resize(self) -> None:
        if self.wrap and self.text_width != self._wrap_width:
            self._count_rows_again(True)
        if self._match_due is not None:  # once laid out: the sideways scrollbar may take a row
            self.call_after_refresh(self._keep_match_shown, self._match_due)
            self._match_due = None
        elif self.follow:
            self.call_after_refresh(self._follow_tail)

    def _count_rows_again(self, was_wrapped: bool) -> None:
        """Count the rows anew (the wrap turned on or off, a new width), a view scrolled back
        keeping its top line on top and the match it shows in view: the rows move (a zoom-out kept
        the row offset and showed lines about half as far back; `w` took a wrapped row's number
        for a line's, and the reverse)."""
        top = self._locate(round(self.scroll_offset.y), was_wrapped)[0]
        match = self._shown_match(was_wrapped)
        if self.wrap:
            self._rebuild_rows()
        else:
            self._count_open_rows()
            self._strips.clear()
        self._update_virtual_size()
        if not self.follow:
            self._move_to(self._row_of_line(top))
            if match is not None:  # once laid out: the sideways scrollbar comes or goes with the wrap
                self.call_after_refresh(self._keep_match_shown, self._first + match)
        self.refresh()

    def _keep_match_shown(self, number: int) -> None:
        if number == self._current and not self.follow:  # (unless n / N, or End, came first)
            self._show_match(number)

    def _shown_match(self, wrapped: bool) -> int | None:
        """The index of the current match's line where the view shows the match (a row of it,
        wrapped), else None."""
        if self._current is None or self._current < self._first:
            return None
        top, height = round(self.scroll_offset.y), self.scrollable_content_region.height
        index = self._current - self._first
        first, last = self._match_rows(index, wrapped)
        return index if first < top + height and last >= top else None

    # The scrollbar: a press on it jumps there, and dragging keeps moving the view.
    def on_mouse_down(self, event: MouseDown) -> None:
        offset = event.get_content_offset(self)
        if offset is not None and offset.x >= self.text_width and self.max_scroll_y:
            event.stop()
            self._dragging = True
            self.capture_mouse()
            self._scroll_to_bar(offset.y)

    def on_mouse_move(self, event: MouseMove) -> None:
        if self._dragging:
            self._scroll_to_bar(event.y - self.gutter.top)

    def on_mouse_up(self, event: MouseUp) -> None:
        if self._dragging:
            self._dragging = False
            self.release_mouse()

    def _scroll_to_bar(self, y: int) -> None:
        fraction = min(1.0, max(0.0, y / max(1, self.scrollable_content_region.height - 1)))
        self.scroll_to(y=round(fraction * self.max_scroll_y), animate=False, immediate=True)

    def _follow_tail(self) -> None:
        if self.follow:
            self._move_to(self.max_scroll_y)

    def on_mount(self) -> None:
        super().on_mount()
        self.poll()

    def action_scroll_end(self) -> None:
        self.follow = True
        self._move_to(self.max_scroll_y)

    def action_scroll_home(self) -> None:
        self.follow = False
        self._move_to(0)

    def action_toggle_follow(self) -> None:
        self.follow = not self.follow
        self.notify(f"{self.position_text}  (f: {'pause' if self.follow else 'follow the tail'})", timeout=2)

    def action_toggle_wrap(self) -> None:
        self.wrap = not self.wrap
        self.notify(f"long lines {'wrapped' if self.wrap else 'cut (scroll right to read)'}  (w: toggle)", timeout=2)

    @property
    def position_text(self) -> str:
        """'following' while the view follows the tail, else 'paused at line N' (the top line
        on screen, numbered as the rank printed it, from 1)."""
        if self.follow:
            return "following"
        top = self._locate(round(self.scroll_offset.y))[0]
        return f"paused at line {self._first + top + 1}"

    # ----- search --------------------------------------------------------------------------------
    def _hit(self, raw: bytes) -> bool:
        if self._regex is not None:
            hit = regex_matches(raw, self._regex)
            self._say_if_stopped()
            return hit
        return matches(raw, self._query, self._query_bytes)

    def _say_if_stopped(self) -> None:
        """Tell the screen, once, that the search's pattern was given up (a line took it past its
        time limit): from then on it matched nothing, without a word."""
        if self._regex is not None and self._regex.tell_once():
            self.post_message(self.SearchStopped(self, self._query))

    def search(self, query: str) -> int:
        """Highlight `query` (plain text, any case; `re:` then a regular expression) and go to its
        last match; the number of matching lines (0 clears the search when the query is empty).
        ValueError for a regular expression that does not compile (nothing changes then)."""
        regex = search_pattern(query)
        self._regex = regex
        self._query = query if regex is not None else plain_needle(query)
        self._query_bytes = self._query.encode() if self._query.isascii() else None
        self._strips.clear()
        if not self._query:
            self.clear_search()
            return 0
        self._hits = [self._first + i for i, line in enumerate(self._lines) if self._hit(line)]
        hits = self._matches()
        self._current = None
        if hits:
            self._go_to_hit(hits[-1])
        self.refresh()
        return len(hits)

    def _matches(self) -> list[int]:
        """The numbers of every matching line, oldest first: the complete lines', then those of
        the unfinished last lines (a prompt, a progress bar), numbered as they will be once
        complete. A match there was shown by the search, but n / N skipped it, and said nothing
        where it was the only one."""
        if not self._query:
            return []
        after = self._first + len(self._lines)
        return self._hits + [after + k for k, line in enumerate(self._open) if self._hit(line)]

    def search_next(self) -> bool:
        """The next match towards the tail (wrapping round to the oldest); whether it wrapped."""
        return self._step(+1)

    def search_prev(self) -> bool:
        """The previous match towards the oldest line (wrapping round to the newest); whether it wrapped."""
        return self._step(-1)

    def _step(self, direction: int) -> bool:
        hits = self._matches()
        if not hits:
            return False
        if self._current is None:
            at = len(hits)  # (on no match yet: n wraps round to the oldest, N goes to the newest)
        else:
            at, kept = self._current_hit(hits)
            if direction > 0 and not kept:
                at -= 1  # the current match has left the ring: the next is the oldest one kept
        to = at + direction
        if 0 <= to < len(hits):
            self._go_to_hit(hits[to])
            return False
        self._go_to_hit(hits[0] if direction > 0 else hits[-1])
        return True

    @property
    def match_position(self) -> tuple[int, int] | None:
        """(k, n): the view is on the k-th of the n matching lines, oldest first; None when it is
        on no match of them."""
        if self._current is None:
            return None
        hits = self._matches()
        at, kept = self._current_hit(hits)
        return (at + 1, len(hits)) if kept else None

    def _current_hit(self, hits: list[int]) -> tuple[int, bool]:
        """Where the current match stands among `hits`, and whether it is still one of them (the
        ring may have dropped its line, a progress bar redrawn its unfinished one)."""
        at = bisect.bisect_left(hits, self._current)
        return at, at < len(hits) and hits[at] == self._current

    def _go_to_hit(self, number: int) -> None:
        self._current = number
        self._strips.clear()  # the current-match colour moved
        self._show_match(number)

    def _show_match(self, number: int) -> None:
        """Bring the match in the line numbered `number` into view, if the ring still has it; in
        a view not in the screen's layout yet, once it is (on_resize: Textual sends one to a view
        it lays out for the first time, and to one shown again)."""
        if number < self._first:
            return
        if not self.size:
            # A pane made or shown again for a search's jump has no size till the next layout:
            # there is no height to centre the match in, and a pane made just now scrolled
            # nowhere (it showed line 1).
            self.follow = False
            self._match_due = number
            return
        self._show_rows(*self._match_rows(number - self._first))
        self._show_match_column(number)

    def _first_match(self, index: int) -> tuple[str, Any] | None:  # (a re.Match, or a regex one for `re:`)
        """The line at `index` as the pane shows it (tabs expanded) and the first match of the
        search in it (the one n / N go to), or None."""
        raw = self._raw(index)
        if raw is None or type(raw) is RanktopLine or not self._query:
            return None
        plain = parse_line(raw, color=False).plain
        found = (self._regex or re.compile(re.escape(self._query), re.IGNORECASE)).search(plain)
        return None if found is None else (plain, found)

    def _match_rows(self, index: int, wrapped: bool | None = None) -> tuple[int, int]:
        """The first and last rows of the view that show the first match in the line at `index`
        (`wrapped` as in _locate): its line's row unwrapped; wrapped, the rows its text falls on, as
        _render_raw cuts them (a long line takes dozens, and a match near its end is far below
        its first)."""
        row = self._row_of_line(index, wrapped)
        match = self._first_match(index) if (self.wrap if wrapped is None else wrapped) else None
        if match is None:
            return row, row
        plain, found = match
        ends = row_ends(plain, self._wrap_width)
        start, end = found.start(), max(found.start(), found.end() - 1)  # (its last character)
        first, last = (min(bisect.bisect_right(ends, at), len(ends) - 1) for at in (start, end))
        return row + first, row + last

    def _show_match_column(self, number: int) -> None:
        """Without wrap, scroll sideways to the first match in the line numbered `number`: a match
        past the pane's right edge showed nowhere."""
        match = None if self.wrap else self._first_match(number - self._first)
        if match is not None:
            plain, found = match
            start, end = cell_len(plain[: found.start()]), cell_len(plain[: found.end()])
            x = column_showing(start, end, cell_len(plain), self.text_width, round(self.scroll_offset.x))
            self.scroll_to(x=x, animate=False, immediate=True)

    def _show_rows(self, first: int, last: int) -> None:
        """Stop following and bring rows `first`..`last` into view: the view stays where they all
        show, else they go to its middle (`first` on top where they are more than it holds)."""
        self.follow = False
        height = self.scrollable_content_region.height
        top = round(self.scroll_offset.y)
        if not (top <= first and last < top + height):
            self._move_to(max(0, min(first, first - (height - (last - first)) // 2)))
        self.refresh()

    def at_edge_match(self, direction: int) -> bool:
        """Whether the view is on the last match (direction +1) or the first (-1), or has none:
        next/previous across ranks go on to another rank from there."""
        hits = self._matches()
        if not hits or self._current is None:
            return True
        return self._current == (hits[-1] if direction > 0 else hits[0])

    def go_to_edge_match(self, direction: int) -> None:
        """Go to the first match (direction +1: arriving from an earlier rank) or the last (-1)."""
        hits = self._matches()
        if hits:
            self._go_to_hit(hits[0] if direction > 0 else hits[-1])

    def clear_search(self) -> None:
        self._query, self._query_bytes, self._regex = "", None, None
        self._hits, self._current = [], None
        self._strips.clear()
        self.refresh()

    @property
    def search_query(self) -> str:
        return self._query

    def action_search_next(self) -> None:
        self.search_next()

    def action_search_prev(self) -> None:
        self.search_prev()
