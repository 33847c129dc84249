"""Stack dumps of hung ranks: py-spy on every rank at once, grouped by main-thread stack.

The odd rank out is usually the culprit: when ranks 0-2 wait in `all_reduce` and rank 3 sits in
`load_batch`, the group of one is what to look at. Everything here is engine code shared by the
TUI (StacksScreen) and `ranktop stacks`; a failure to dump one rank is a per-rank status with a
reason and a hint, never an exception.

The fallback that needs no ptrace is SIGUSR1: Python ranks started by ranktop register
faulthandler for it (see `core.spec.faulthandler_env` and core/faulthandler_boot/sitecustomize.py), so the
rank prints its own stacks to stderr, which lands in its log and its pane.
"""

from ranktop.core.stacks.discovery import ForeignRanks, RanksNotHeld, find_run_dir, live_ranks_in_run_dir, ranks_of_pid
from ranktop.core.stacks.grouping import (
    ProblemGroup,
    build_report,
    merge_tree,
    other_thread_groups,
    problem_groups,
    thread_tree,
)
from ranktop.core.stacks.model import (
    Frame,
    RankStack,
    StackGroup,
    StackReport,
    StackStatus,
    ThreadGroup,
    ThreadStack,
    TreeNode,
    rank_list,
)
from ranktop.core.stacks.procs import HeldProcess, close_all
from ranktop.core.stacks.pyspy import (
    DUMP_TIMEOUT,
    NO_PY_SPY_HINT,
    PTRACE_HINT,
    classify_py_spy_error,
    dump_agent_stacks,
    dump_pid,
    dump_pids,
    find_py_spy,
    parse_py_spy_json,
    python_descendant,
)
from ranktop.core.stacks.render import format_report, rank_facts
from ranktop.core.stacks.saving import report_to_dict, save_report
from ranktop.core.stacks.sigusr1 import (
    catches_signal,
    parse_faulthandler,
    signal_agent_report,
    signal_dump,
    signal_pids,
    signal_report,
)

__all__ = [
    "DUMP_TIMEOUT", "HeldProcess", "NO_PY_SPY_HINT", "PTRACE_HINT", "Frame", "RankStack", "StackGroup", "StackReport",
    "StackStatus", "ThreadGroup", "ThreadStack", "TreeNode", "build_report", "catches_signal", "classify_py_spy_error",
    "close_all",
    "dump_agent_stacks", "dump_pid", "dump_pids", "find_py_spy", "find_run_dir", "format_report",
    "ForeignRanks", "RanksNotHeld", "live_ranks_in_run_dir", "merge_tree", "other_thread_groups", "ProblemGroup", "problem_groups", "parse_faulthandler", "parse_py_spy_json",
    "python_descendant", "rank_facts", "rank_list", "ranks_of_pid", "report_to_dict", "save_report",
    "signal_agent_report", "signal_dump", "signal_pids", "signal_report", "thread_tree",
]
