"""Grouping ranks by their main thread's stack: the odd rank out, the merged call tree."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ranktop.core.stacks.model import (
    RankStack,
    StackGroup,
    StackReport,
    StackStatus,
    ThreadGroup,
    ThreadStack,
    TreeNode,
    rank_list,
)


def build_report(stacks: list[RankStack], taken_at: float, elapsed_s: float) -> StackReport:
    """Group by identical main-thread stack; smaller groups than the largest one are odd."""
    by_key: dict[tuple, list[RankStack]] = {}
    for s in stacks:
        if s.status == StackStatus.OK and s.main is not None:
            by_key.setdefault(s.main.key, []).append(s)
    sizes = sorted((len(v) for v in by_key.values()), reverse=True)
    # Odd only against a clear majority: with a tie for the largest group no one stands out.
    clear = len(sizes) > 1 and sizes[0] > sizes[1]
    groups = [
        StackGroup(tuple(s.rank for s in members), members[0].main.frames, clear and len(members) < sizes[0],
                   tuple(s.rank for s in members if s.main.active))
        for members in by_key.values()
    ]
    groups.sort(key=lambda g: (-len(g.ranks), g.ranks))
    tree = merge_tree((s.rank, s.main) for s in stacks if s.status == StackStatus.OK and s.main is not None)
    return StackReport(taken_at, elapsed_s, tuple(stacks), tuple(groups), tree)


def merge_tree(threads: Iterable[tuple[int, ThreadStack]]) -> TreeNode:
    """The call tree of these (rank, thread)s, a rank's threads one after another: each frame
    with the ranks whose thread passes through it, once each (a rank may have two threads of
    one name)."""
    tree = TreeNode(None)
    for rank, thread in threads:
        node = tree
        _count(node, rank)
        for frame in thread.frames:
            node = node.child(frame)
            _count(node, rank)
    return tree


def _count(node: TreeNode, rank: int) -> None:
    if not node.ranks or node.ranks[-1] != rank:  # (its threads come together: a look at the last will do)
        node.ranks.append(rank)


def other_thread_groups(report: StackReport) -> list[ThreadGroup]:
    """Non-main threads grouped across ranks by (thread name, its `thread_kind`; stack), the odd ones first: a stack
    the threads of its name have in fewer ranks than another (against a clear majority, as the
    main threads' groups), or a thread some dumped ranks lack."""
    by_key: dict[tuple, tuple[tuple, list[int]]] = {}  # (name, stack): (frames, ranks)
    for s in _dumped(report):
        for t in s.others:
            ranks = by_key.setdefault((thread_kind(t.name), t.key), (t.frames, []))[1]
            if not ranks or ranks[-1] != s.rank:  # (two threads of one name and stack in a rank)
                ranks.append(s.rank)
    dumped = {s.rank for s in _dumped(report)}
    by_name: dict[str, list[tuple[tuple, list[int]]]] = {}
    for (name, _), entry in by_key.items():
        by_name.setdefault(name, []).append(entry)
    groups = [g for name, entries in by_name.items() for g in _of_one_name(name, entries, dumped)]
    # A thread stopped elsewhere first, then one some ranks lack (rank 0's own logger threads
    # are common), then the rest; by rank within each.
    return sorted(groups, key=lambda g: (not g.minority, not g.odd, g.ranks[0], g.name))


def _of_one_name(name: str, entries: list[tuple[tuple, list[int]]], dumped: set[int]) -> list[ThreadGroup]:
    """The groups of the threads named `name`, (frames, ranks) each: odd as the main threads'
    groups are, and each saying which dumped ranks have no thread of that name."""
    sizes = sorted((len(ranks) for _, ranks in entries), reverse=True)
    clear = len(sizes) > 1 and sizes[0] > sizes[1]
    missing = tuple(sorted(dumped - {r for _, ranks in entries for r in ranks}))
    return [ThreadGroup(name, frames, tuple(ranks), clear and len(ranks) < sizes[0], missing)
            for frames, ranks in entries]


# Python numbers the threads it names itself in the order a process starts them ('Thread-7
# (worker)', 'ThreadPoolExecutor-1_0', 'Dummy-3'): one thread more in rank 0, started first,
# gives the same thread another name there than in every other rank.
_NUMBERED = re.compile(r"^(Thread|ThreadPoolExecutor|Dummy)-\d+")


def thread_kind(name: str) -> str:
    """A thread's name as the other threads are grouped by: Python's own start number left out
    ('Thread-N (worker)')."""
    return _NUMBERED.sub(r"\1-N", name)


def thread_tree(report: StackReport, name: str) -> TreeNode:
    """The call tree of the threads named `name` (a `thread_kind`) in every rank: where the odd
    one forks off."""
    return merge_tree((s.rank, t) for s in _dumped(report) for t in s.others if thread_kind(t.name) == name)


def _dumped(report: StackReport) -> list[RankStack]:
    return [s for s in report.ranks if s.status == StackStatus.OK]


@dataclass(frozen=True)
class ProblemGroup:
    """Ranks not dumped for the same reason: one line and one hint for them all (eight ranks
    without ptrace were eight copies of a three-line hint, the last ones below the fold)."""

    ranks: tuple[RankStack, ...]
    status: StackStatus
    reason: str | None
    hint: str | None

    @property
    def who(self) -> str:
        """'rank 3 (pid 12)', 'ranks 0-3 (pids 12, 13, 14, 15)'."""
        pids = ", ".join(str(s.pid) for s in self.ranks)
        return f"{rank_list(s.rank for s in self.ranks)} (pid{'s' if len(self.ranks) > 1 else ''} {pids})"


def problem_groups(report: StackReport) -> list[ProblemGroup]:
    """The ranks not dumped, grouped by why; a hint naming each rank's own pid (gdb -p PID) is
    shared as `<pid>` by a group of several."""
    keyed: dict[tuple, list[RankStack]] = {}
    for s in report.problems:
        keyed.setdefault((s.status, _pid_free(s.reason, s), _pid_free(s.hint, s)), []).append(s)
    groups = []
    for (status, reason, hint), members in keyed.items():
        one = members[0] if len(members) == 1 else None
        groups.append(ProblemGroup(tuple(members), status, one.reason if one else reason, one.hint if one else hint))
    return groups


def _pid_free(text: str | None, s: RankStack) -> str | None:
    for pid in {s.pid, s.dumped_pid} - {None, 0}:
        text = re.sub(rf"\b{pid}\b", "<pid>", text) if text else text
    return text
