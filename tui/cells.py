"""Cutting a line into rows by whole terminal cells, for the wrap mode of the output pane.

A row may end only between clusters: a character with the zero-width ones after it (combining
marks, variation selectors) and, through a zero-width joiner, the character after that too. A
double-width cluster that does not fit in the last cell of a row starts the next one, and that row
ends a cell short. Cells are counted with rich's `cell_len`, as Textual's Strip counts them, so a
row is as wide here as on screen.
"""

from __future__ import annotations

import array
import bisect
import functools
import itertools

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style

_ZWJ = "\u200d"
_FIRST_WIDE = "\u1100"  # no character below this takes two cells


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
