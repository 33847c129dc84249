"""Grouping ranks by their main thread's stack: the odd rank out, the merged call tree."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ranktop.core.stacks.model import Frame, RankStack, StackGroup, StackReport, StackStatus, TreeNode, rank_list


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
    tree = TreeNode(None)
    for s in stacks:
        if s.status == StackStatus.OK and s.main is not None:
            node = tree
            node.ranks.append(s.rank)
            for frame in s.main.frames:
                node = node.child(frame)
                node.ranks.append(s.rank)
    return StackReport(taken_at, elapsed_s, tuple(stacks), tuple(groups), tree)


def other_thread_groups(report: StackReport) -> list[tuple[str, tuple[Frame, ...], list[int]]]:
    """Non-main threads grouped across ranks by (thread name, stack): [(name, frames, ranks)]."""
    groups: dict[tuple, tuple[str, tuple[Frame, ...], list[int]]] = {}
    for s in report.ranks:
        for t in s.others:
            entry = groups.setdefault((t.name, t.key), (t.name, t.frames, []))
            entry[2].append(s.rank)
    return sorted(groups.values(), key=lambda g: (g[2][0], g[0]))


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
