"""Text a rank supplies, drawn at widths Rich and the terminal agree on; and cut into rows by whole
terminal cells, for the wrap mode of the output pane.

Textual crops and pads every row by Rich's count of each character's cells, and the terminal
places the characters by its own (tmux, like most emulators, by the C library's wcwidth). Where
they count a character apart, a row is drawn wider or narrower than its pane, and what follows it
lands in the neighbouring pane (a rank printing U+3164, 0 cells to Rich and 2 to tmux, wrote its
text over the next rank's pane). So every piece of rank text goes through `drawable` (`clean`,
then `agreed_widths`) before it reaches a widget:

- a presentation hint is dropped: the zero-width joiner U+200D, the variation selectors VS15 and
  VS16 (U+FE0E, U+FE0F), the emoji skin tones U+1F3FB-1F3FF. Rich counts `☺` + VS16 as 2 cells and
  a ZWJ sequence as one emoji of 2, where tmux and wcwidth count each character by itself; without
  them an emoji sequence shows as its parts (👨‍👩‍👧 as 👨👩👧), each as wide to both;
- a character whose width is disputed is drawn as PLACEHOLDER (U+FFFD, `�`, one cell to both, as
  invalid UTF-8 already shows): an unassigned code point (category Cn: the Unicode versions of Rich,
  of Python and of the terminal differ), a spacing combining mark (Mc, Devanagari's `ा`: 0 cells to
  Rich, 1 to wcwidth), a Hangul filler (U+115F, U+1160, U+3164, U+FFA0), and, where the C library's
  wcwidth works in this process's locale, any character it counts otherwise than Rich (U+2630's
  trigrams: 2 to Rich, 1 to glibc 2.36).

Only characters are looked at, never their neighbours, so the widths also agree across any cut of
the text. The terminal is taken to count as this process's C library does: one elsewhere (ssh from
another system) may still count a character otherwise.

A row of the wrap mode may end only between clusters: a character with the zero-width ones after
it (combining marks) and, through a zero-width joiner, the character after that too. A
double-width cluster that does not fit in the last cell of a row starts the next one, and that row
ends a cell short. Cells are counted with rich's `cell_len`, as Textual's Strip counts them, so a
row is as wide here as on screen.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import functools
import itertools
import unicodedata
from collections.abc import Callable

from ranktop.core.sanitize import clean
from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style

_ZWJ = "\u200d"
_FIRST_WIDE = "\u1100"  # no character below this takes two cells

PLACEHOLDER = "\ufffd"  # what a character of disputed width is drawn as
HINTS = frozenset({0x200D, 0xFE0E, 0xFE0F, *range(0x1F3FB, 0x1F400)})  # dropped
_FILLERS = frozenset({0x115F, 0x1160, 0x3164, 0xFFA0})
_DISPUTED_CATEGORIES = frozenset({"Cn", "Mc"})
_KEPT_CODES = 1 << 16  # code points whose drawing is kept (~6 MB): past that the table starts over


@functools.cache
def c_wcwidth() -> Callable[[int], int] | None:
    """The C library's wcwidth, where it counts as a UTF-8 locale does (1 for `a`, 2 for `一`);
    else None. Python sets LC_CTYPE from the environment at start-up, which is the locale the
    terminal's user chose; setlocale is never called here (it is process-wide)."""
    try:
        wcwidth = ctypes.CDLL(None).wcwidth
    except (OSError, AttributeError):
        return None
    wcwidth.argtypes, wcwidth.restype = [ctypes.c_int32], ctypes.c_int  # (wchar_t: 32 bits on Linux and macOS)
    return wcwidth if wcwidth(ord("a")) == 1 and wcwidth(0x4E00) == 2 else None


def _drawn_as(code: int) -> int | str | None:
    """How code point `code` is drawn: as itself (its code), as PLACEHOLDER, or not at all (None)."""
    if code < 0x80:
        return code
    if code in HINTS:
        return None
    char = chr(code)
    if code in _FILLERS or unicodedata.category(char) in _DISPUTED_CATEGORIES:
        return PLACEHOLDER
    wcwidth = c_wcwidth()
    if wcwidth is not None and wcwidth(code) != cell_len(char):
        return PLACEHOLDER
    return code


class _Drawn(dict):
    """str.translate's table for agreed_widths: each code point's drawing, worked out the first
    time it is met (a dict lookup after that, in C)."""

    def __missing__(self, code: int) -> int | str | None:
        if len(self) >= _KEPT_CODES:  # a rank printing every code point keeps no 100 MB table
            self.clear()
        drawn = self[code] = _drawn_as(code)
        return drawn


_DRAWN = _Drawn()


def agreed_widths(text: str) -> str:
    """`text` with every character drawn at a width Rich and the terminal agree on: see the module
    docstring. ASCII text is returned as it is, at once."""
    return text if text.isascii() else text.translate(_DRAWN)


def drawable(text: str, *, sgr: bool = False, newlines: bool = False) -> str:
    """Rank-supplied `text` fit for a widget: `clean` (sgr, newlines: as there), then agreed_widths."""
    return agreed_widths(clean(text, sgr=sgr, newlines=newlines))


def may_be_wide(text: str) -> bool:
    """Whether `text` may hold a character of two cells (when not, it wraps every `width` cells)."""
    return bool(text) and max(text) >= _FIRST_WIDE


def clusters(text: str) -> tuple[list[int], list[int]]:
    """The index of the first character of each cluster of `text`, and the cells of each."""
    sizes = list(map(cell_len, text))
    if 0 not in sizes:  # the usual line: every character is a cluster of its own
        return list(range(len(text))), sizes
    starts: list[int] = []
    joined = False
    for index, size in enumerate(sizes):
        if joined:  # the character after a joiner, whatever it is, is part of the joiner's cluster
            joined = False
        elif size or not starts:
            starts.append(index)
        else:  # zero width: part of the cluster before it
            joined = text[index] == _ZWJ
    ends = [*starts[1:], len(text)]
    return starts, [cell_len(text[start:end]) for start, end in zip(starts, ends, strict=True)]


def cells_before(text: str, index: int) -> int:
    """The cells `text[:index]` takes on screen; past the end of `text`, one more for each index
    beyond it (a row is padded with spaces to the pane's width)."""
    if index <= len(text):
        return cell_len(text[:index]) if not text.isascii() else index
    return cell_len(text) + index - len(text)


def index_at(text: str, cell: int) -> int:
    """The index of the character `text` draws over cell `cell` (of a wide one, either of its
    cells; of a cluster, its first character); past the end, as cells_before counts."""
    if text.isascii():
        return cell
    starts, sizes = clusters(text)
    edges = list(itertools.accumulate(sizes, initial=0))
    if cell >= edges[-1]:
        return len(text) + cell - edges[-1]
    return starts[bisect.bisect_right(edges, cell) - 1]


def row_ends(text: str, width: int) -> list[int]:
    """Where each row of `text` wrapped at `width` cells ends (character indices, the last its
    length): always one row at least, and a cluster wider than `width` gets a row of its own."""
    starts, sizes = clusters(text)
    edges = list(itertools.accumulate(sizes, initial=0))  # cells before each cluster
    ends: list[int] = []
    first = 0  # the cluster the row starts with
    while True:
        after = max(first + 1, bisect.bisect_right(edges, edges[first] + width) - 1)  # the next row's first
        if after >= len(sizes):
            return [*ends, len(text)]
        ends.append(starts[after])
        first = after


def split_segments(segments: list[Segment], ends: list[int]) -> list[list[Segment]]:
    """`segments` cut into rows at character offsets `ends` (ascending, the last the length of
    their whole text), each piece keeping its segment's style."""
    rows: list[list[Segment]] = [[]]
    limits = iter(ends)
    end, pos = next(limits), 0
    for segment in segments:
        text, style = segment.text, segment.style
        while pos + len(text) > end:  # this row ends inside the segment
            head, text = text[: end - pos], text[end - pos :]
            if head:
                rows[-1].append(Segment(head, style))
            rows.append([])
            pos, end = end, next(limits)
        if text:
            rows[-1].append(Segment(text, style))
        pos += len(text)
    return rows


def crop_cells(segments: list[Segment], start: int, end: int, pad: Style | None = None) -> list[Segment]:
    """Cells `start`..`end` of a row's segments, `end - start` cells exactly: cut between the
    clusters of the row's whole text, as its cells are counted everywhere else (Strip.crop splits
    a segment character by character: it cut 👨‍👩‍👧 after 👨, and a row scrolled sideways then
    showed its text a cell off, its highlight too). A cluster the cut goes through is spaces in
    its segment's style; past the text, spaces in `pad`."""
    text = "".join(segment.text for segment in segments)
    starts, edges = (_kept_edges if len(text) <= _KEPT_TEXT else _cluster_edges)(text)
    left, right = min(start, edges[-1]), min(end, edges[-1])  # the cells the text covers
    first = bisect.bisect_left(edges, left)  # the first cluster whole in the cut
    after = bisect.bisect_right(edges, right) - 1  # the cluster that ends past it (or the text's end)
    cut: list[Segment] = []
    if lead := min(edges[first], right) - left:  # a cluster cut by `start` (or holding the whole cut)
        cut.append(Segment(" " * lead, _style_at(segments, starts[first] - 1)))
    if after >= first:
        cut.extend(_characters(segments, starts[first], starts[after]))
        if tail := right - edges[after]:  # a cluster cut by `end`
            cut.append(Segment(" " * tail, _style_at(segments, starts[after])))
    if end - start > right - left:
        cut.append(Segment(" " * (end - start - (right - left)), pad))
    return cut


def _cluster_edges(text: str) -> tuple[array.array, array.array]:
    """Where each cluster of `text` starts (its length last) and the cells before each (all of
    them last), as arrays (a list's int objects took 36 bytes a character)."""
    starts, sizes = clusters(text)
    return array.array("l", [*starts, len(text)]), array.array("l", itertools.accumulate(sizes, initial=0))


# A pane's rows are cut again at every frame: the edges of a few screens of rows are kept, those of
# rows up to _KEPT_TEXT characters only (~5 MB at most, whatever the ranks print).
_KEPT_TEXT = 1024
_kept_edges = functools.lru_cache(maxsize=256)(_cluster_edges)


def _characters(segments: list[Segment], begin: int, end: int) -> list[Segment]:
    """The segments' characters `begin`..`end`, each piece in its segment's style."""
    pieces, pos = [], 0
    for segment in segments:
        size = len(segment.text)
        if pos + size > begin and pos < end and begin < end:
            pieces.append(Segment(segment.text[max(0, begin - pos) : end - pos], segment.style))
        pos += size
    return pieces


def _style_at(segments: list[Segment], index: int) -> Style | None:
    """The style of the segment that holds character `index`."""
    pos = 0
    for segment in segments:
        pos += len(segment.text)
        if index < pos:
            return segment.style
    return None
