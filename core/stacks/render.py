"""The grouped text view of a report (`ranktop stacks`, the saved .txt)."""

from __future__ import annotations

import datetime

from ranktop.core.prompts import NO_PROMPT
from ranktop.core.sanitize import clean
from ranktop.core.stacks.grouping import other_thread_groups, problem_groups
from ranktop.core.stacks.model import RankStack, StackReport, TreeNode, rank_list


def rank_facts(s: RankStack) -> str:
    """' (pid 12, cpu 98%, stalled 31s, idle)' — what tells spinning from blocked."""
    facts = [f"pid {s.pid}"]
    if s.dumped_pid:
        facts.append(f"Python child {s.dumped_pid}")
    if s.cpu_percent is not None:
        facts.append(f"cpu {s.cpu_percent:.0f}%")
    if s.stall_seconds is not None:
        facts.append(f"silent {s.stall_seconds:.0f}s")
    if s.paused:  # (py-spy's "idle" would hide why it is quiet)
        facts.append("paused (stopped by a signal)")
    elif s.main is not None and s.main.active is not None:
        facts.append("on CPU" if s.main.active else "idle")
    if s.input_prompt:  # idle, and why: someone is to type (the grid's `input (i)`)
        facts.append("waits for input" + ("" if s.input_prompt == NO_PROMPT else f" at {s.input_prompt}"))
    if gil := _gil_holder(s):
        facts.append(gil)
    if s.children:
        more = f" +{len(s.children) - SHOWN_CHILDREN} more" if len(s.children) > SHOWN_CHILDREN else ""
        facts.append(f"child{'ren' if len(s.children) > 1 else ''} {', '.join(s.children[:SHOWN_CHILDREN])}{more}")
    return ", ".join(facts)


SHOWN_CHILDREN = 3  # a rank's child processes named in its facts; the JSON has them all


def _gil_holder(s: RankStack) -> str | None:
    """Who holds the GIL, as py-spy saw it: a thread idle with it held sits in a C call that did
    not release it, and every other thread of the rank waits for it."""
    holder = next((t for t in s.threads if t.owns_gil), None)
    if holder is None:
        return None
    return "holds the GIL" if holder.is_main else f"GIL held by thread {holder.name!r}"


def format_report(report: StackReport, *, threads: bool = False) -> str:
    """The grouped view: groups (odd ones marked and first, as the TUI lists them), the merged
    tree, per-rank problems; with `threads`, the other threads (odd ones marked and first)."""
    when = datetime.datetime.fromtimestamp(report.taken_at).strftime("%H:%M:%S")
    with_c = ", with C frames" if report.native_frames else ""
    out = [f"stacks at {when} ({report.elapsed_s:.2f}s{with_c}): {report.summary()}"]
    if report.saved_txt:
        out.append(f"saved: {report.saved_txt}")
    elif report.save_error:
        out.append(report.save_error)
    by_rank = {s.rank: s for s in report.ranks}
    for g in report.groups_odd_first:
        mark = "  <-- ODD ONE OUT" if g.odd else ""
        out += ["", f"== {rank_list(g.ranks)} ({len(g.ranks)}){mark}"]
        out += [f"   {rank_list([r])}: {rank_facts(by_rank[r])}" for r in g.ranks if len(g.ranks) <= 8]
        out += [f"     {f.label}" for f in g.frames] or ["     (no Python frames)"]
    if report.tree.children:
        out += ["", "call tree (main threads; ranks under each frame):"]
        out += _tree_lines(report.tree, set(report.odd_ranks), 1)
    if report.problems:
        out += ["", "not dumped:"]
        for p in problem_groups(report):
            out.append(f"   {p.who}: {p.status.value}: {p.reason}")
            if p.hint:
                out.append(f"      hint: {p.hint}")
    if threads:
        out += _thread_lines(report)
    # Each line on its own: a name with a line break in it (a rank chooses its function, file
    # and thread names) shows the break as ␊ rather than start a line of its own, which could
    # read as a group, a rank or an ODD ONE OUT; and the saved .txt is as safe to cat.
    return "\n".join(clean(line) for line in out)


def _tree_lines(node: TreeNode, odd: set[int], depth: int) -> list[str]:
    lines = []
    for child in node.children:
        flag = "  <-- odd" if odd and set(child.ranks) <= odd and len(child.ranks) < len(node.ranks) else ""
        lines.append(f"{'  ' * depth}{child.frame.label}  [{rank_list(child.ranks)}]{flag}")
        lines += _tree_lines(child, odd, depth + 1)
    return lines


def _thread_lines(report: StackReport) -> list[str]:
    groups = other_thread_groups(report)
    if not groups:
        return ["", "other threads: none"]
    out = ["", "other threads:"]
    for g in groups:
        mark = f"  <-- {g.odd_words}" if g.odd else ""
        out.append(f"-- thread {g.name!r} in {rank_list(g.ranks)}{mark}")
        out += [f"     {f.label}" for f in g.frames] or ["     (no Python frames)"]
    return out
