"""What a stack dump is: per-thread frames, per-rank results, groups of ranks, the merged tree."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class StackStatus(str, enum.Enum):
    OK = "ok"
    NATIVE = "native"  # a binary rank with no Python in it
    NOT_PYTHON = "not-python"  # py-spy found no interpreter in the process
    GONE = "gone"  # exited before or during the dump
    NO_PERMISSION = "no-permission"
    NO_PY_SPY = "no-py-spy"
    FAILED = "failed"  # anything else py-spy reported, or it timed out


@dataclass(frozen=True)
class Frame:
    name: str
    filename: str
    short_filename: str
    line: int

    @property
    def where(self) -> str:
        """'train.py:12'; a C frame (py-spy --native) has no line: 'libc.so.6'."""
        return f"{self.short_filename}:{self.line}" if self.line else self.short_filename

    @property
    def label(self) -> str:
        return f"{self.name} ({self.where})" if self.where else self.name


# Frames of one thread: its outermost and innermost 50, where a deep recursion starts and where it
# is now (faulthandler, the SIGUSR1 fallback, shows 100 too). The tree has a level per frame, and
# its readers recurse a few calls a level (a saved dump read back: about 3.5).
MAX_FRAMES = 100


def within_frame_limit(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """`frames` (outermost first), or, past MAX_FRAMES, the outermost and innermost MAX_FRAMES / 2
    with one frame between them saying how many were left out (1000 frames ended every reader of
    the tree in a RecursionError). Frames it cut already are left as they are."""
    half = MAX_FRAMES // 2
    if len(frames) <= MAX_FRAMES or (len(frames) == MAX_FRAMES + 1 and _is_gap(frames[half])):
        return frames
    gap = Frame(f"... {len(frames) - 2 * half} frames left out ...", "", "", 0)
    return (*frames[:half], gap, *frames[-half:])


def _is_gap(frame: Frame) -> bool:
    return not frame.filename and not frame.line and frame.name.endswith(" frames left out ...")


@dataclass(frozen=True)
class ThreadStack:
    """One thread's frames, outermost call first (the order of a Python traceback)."""

    name: str
    thread_id: int
    os_thread_id: int | None
    active: bool | None  # py-spy: on CPU now (spinning) or idle (blocked); None: not known (faulthandler)
    owns_gil: bool
    is_main: bool
    frames: tuple[Frame, ...]

    def __post_init__(self) -> None:
        # Whatever the source (py-spy, faulthandler's text read back after SIGUSR1, which the rank
        # writes itself and may make as deep as it likes): the tree's readers recurse per frame.
        object.__setattr__(self, "frames", within_frame_limit(tuple(self.frames)))

    @property
    def key(self) -> tuple:
        return tuple((f.name, f.filename, f.line) for f in self.frames)


def snapshot_facts(rank: Any) -> dict:
    """The facts of a rank's dump that come from the agent's snapshot (a RankSnapshot), not from
    the dump: its cpu%, how long it has been silent, the prompt it waits at. Both ways of dumping
    show them; the SIGUSR1 fallback, which has no py-spy to say on CPU or idle, needs cpu% most."""
    return {"cpu_percent": rank.cpu_percent, "stall_seconds": rank.stall_seconds, "input_prompt": rank.input_prompt}


@dataclass(frozen=True)
class RankStack:
    rank: int
    local_rank: int | None
    pid: int
    status: StackStatus
    threads: tuple[ThreadStack, ...] = ()
    reason: str | None = None
    hint: str | None = None
    dumped_pid: int | None = None  # the Python process dumped, when not the rank itself (native rank)
    cpu_percent: float | None = None  # from the stats sampler, when the agent has one
    stall_seconds: float | None = None
    children: tuple[str, ...] = ()  # "PID NAME" of the dumped process's children: what a wait waits on
    input_prompt: str | None = None  # the prompt it waits at for input, as the agent's snapshot says
    paused: bool = False  # stopped by a signal when dumped: neither on CPU nor blocked in its own code

    @property
    def main(self) -> ThreadStack | None:
        return next((t for t in self.threads if t.is_main), None)

    @property
    def others(self) -> tuple[ThreadStack, ...]:
        return tuple(t for t in self.threads if not t.is_main)


@dataclass(frozen=True)
class StackGroup:
    """Ranks whose main threads have the identical stack."""

    ranks: tuple[int, ...]
    frames: tuple[Frame, ...]
    odd: bool  # a minority group: look here first
    active: tuple[int, ...] = ()  # ranks whose main thread was on CPU


@dataclass(frozen=True)
class ThreadGroup:
    """Threads other than the main one with the same name and the identical stack, across ranks."""

    name: str
    frames: tuple[Frame, ...]
    ranks: tuple[int, ...]
    minority: bool  # the threads of this name are elsewhere in most ranks: this stack stands out
    missing: tuple[int, ...] = ()  # ranks dumped that have no thread of this name at all

    @property
    def odd(self) -> bool:
        """Look here first: a thread some ranks lack, or one stopped where the rest are not."""
        return self.minority or bool(self.missing)

    @property
    def odd_words(self) -> str:
        """What makes it odd, for a title: 'not in rank 3' (the ranks that lack it say most),
        else 'ODD ONE OUT' as for the main threads; '' when it is not."""
        if self.missing:
            return f"not in {rank_list(self.missing)}"
        return "ODD ONE OUT" if self.minority else ""


@dataclass
class TreeNode:
    """The merged call tree: each frame with the ranks whose main thread passes through it."""

    frame: Frame | None  # None for the root
    ranks: list[int] = field(default_factory=list)
    children: list[TreeNode] = field(default_factory=list)

    def child(self, frame: Frame) -> TreeNode:
        key = (frame.name, frame.filename, frame.line)
        for node in self.children:
            if (node.frame.name, node.frame.filename, node.frame.line) == key:
                return node
        node = TreeNode(frame)
        self.children.append(node)
        return node


@dataclass(frozen=True)
class StackReport:
    taken_at: float
    elapsed_s: float
    ranks: tuple[RankStack, ...]
    groups: tuple[StackGroup, ...]
    tree: TreeNode
    saved_txt: str | None = None
    saved_json: str | None = None
    save_error: str | None = None  # why the dump was not saved where it should have been
    native_frames: bool = False  # C/C++ frames included (py-spy --native)

    @property
    def groups_odd_first(self) -> tuple[StackGroup, ...]:
        """The groups as the TUI and `ranktop stacks` list them: the odd one out first (at 80x24
        it was below the fold), then the rest largest first."""
        return tuple(sorted(self.groups, key=lambda g: not g.odd))

    @property
    def odd_ranks(self) -> list[int]:
        return sorted(r for g in self.groups if g.odd for r in g.ranks)

    @property
    def problems(self) -> list[RankStack]:
        return [r for r in self.ranks if r.status != StackStatus.OK]

    def summary(self) -> str:
        ok = len(self.ranks) - len(self.problems)
        text = f"{ok} of {len(self.ranks)} ranks dumped, {len(self.groups)} distinct stack(s)"
        if self.odd_ranks:
            text += f"; odd one out: {rank_list(self.odd_ranks)}"
        elif len(self.groups) > 1:
            text += "; no majority stack"
        return text


def rank_list(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2,5'; [3] -> 'rank 3'."""
    rs = sorted(set(ranks))
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    if not parts:
        return "no ranks"
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(parts)
