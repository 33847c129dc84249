"""The hang the stack view exists for: a real 4-rank gloo job where ranks 0-2 wait in all_reduce
and rank 3 is stuck in load_batch (examples/hang_allreduce.py).

One job, started by the real TUI app, serves every check (torch's import costs seconds per rank):
stall detection, the engine's grouped dump, `ranktop stacks <run dir>` from another process, and
the `D` key in the TUI. Skipped when torch is not installed or py-spy cannot attach here.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
from conftest import ROOT, polls, read_events, run_ranktop
from ranktop.core import stacks
from ranktop.core.agent import LocalAgent
from ranktop.core.engine import LocalEngine
from ranktop.core.spec import WorkerSpec, faulthandler_env
from ranktop.core.stacks import StackStatus
from test_stacks import py_spy_can_attach  # noqa: F401  (module fixture: skip where py-spy cannot attach)

pytest.importorskip("torch")

TIMEOUT = 60


def _hung(agent: LocalAgent) -> bool:
    """Every rank printed its last good step and has been silent past the stall timeout since.
    The output is read before the snapshot, and the silence is measured from the snapshot's own
    last-output time: a rank still marked stalled from its slow start-up does not count."""
    printed = all(any(b"step 1 " in line for line in agent.output(r)) for r in range(agent.spec.local_world_size))
    snap, now = agent.snapshot(), time.time()
    return printed and all(r.state.value == "stalled" and r.last_output_at is not None
                           and now - r.last_output_at >= 1.0 for r in snap.ranks)


async def _until(condition, what: str, timeout: float = TIMEOUT) -> None:
    for _ in polls(timeout, what):
        if condition():
            return
        await asyncio.sleep(0.05)


def test_hung_allreduce_names_rank_3_everywhere(tmp_path):
    from ranktop.tui.app import RanktopApp
    from ranktop.tui.stacks_view import StacksScreen

    env = {**faulthandler_env(True, os.environ), "HANG_STEP": "2"}
    spec = WorkerSpec(role="default", local_world_size=4, entrypoint=sys.executable,
                      args=("-u", str(ROOT / "examples" / "hang_allreduce.py")), env=env)
    agent = LocalAgent(spec, log_dir=str(tmp_path), console=False, stall_timeout=1.0, shutdown_timeout=2)
    app = RanktopApp(LocalEngine(agent))

    async def scenario() -> None:
        app.engine.start()  # the app is handed a running engine
        async with app.run_test(size=(180, 50)) as pilot:
            await _until(lambda: _hung(agent), "ranks 0-2 in all_reduce and rank 3 stuck, all stalled")

            # The engine API.
            report = await asyncio.to_thread(stacks.dump_agent_stacks, agent)
            assert [s.status for s in report.ranks] == [StackStatus.OK] * 4, stacks.format_report(report)
            assert report.odd_ranks == [3], stacks.format_report(report)
            majority, odd = report.groups
            assert majority.ranks == (0, 1, 2) and "all_reduce" in [f.name for f in majority.frames]
            assert odd.ranks == (3,) and "load_batch" in [f.name for f in odd.frames]
            assert all(s.stall_seconds and s.stall_seconds >= 1.0 for s in report.ranks)

            # Another terminal: `ranktop stacks <run dir>` while the job hangs.
            cli = await asyncio.to_thread(run_ranktop, "stacks", agent.run_dir, timeout=TIMEOUT)
            assert cli.returncode == 0, cli.stderr
            assert "odd one out: rank 3" in cli.stdout and "== rank 3 (1)  <-- ODD ONE OUT" in cli.stdout
            # listed first, as the TUI lists it (it came after the majority)
            assert cli.stdout.index("== rank 3 (1)") < cli.stdout.index("== ranks 0-2 (3)")
            assert "all_reduce (torch/distributed/distributed_c10d.py" in cli.stdout

            # The TUI: D dumps every rank; the odd group is highlighted, the tree has the frames.
            await pilot.press("D")
            await _until(lambda: isinstance(app.screen, StacksScreen) and app.screen.report is not None,
                         "the stacks screen with a report")
            screen = app.screen
            odd_widgets = list(screen.query(".stack-group.odd"))
            assert len(odd_widgets) == 1 and odd_widgets[0].border_title == "rank 3 — ODD ONE OUT"
            # first, above the majority: at 80x24 it was below the fold
            assert [w.border_title for w in screen.query(".stack-group")] == ["rank 3 — ODD ONE OUT", "ranks 0-2"]
            labels = [str(node.label) for node in _nodes(screen.query_one("#stacks-tree"))]
            assert any("all_reduce" in label and "[ranks 0-2]" in label for label in labels)
            assert any("load_batch" in label and "[rank 3]" in label for label in labels)
            await pilot.press("t")  # other threads: the prefetch thread, stuck in rank 3's storage read
            await _until(lambda: screen.query(".stack-group.thread"), "the thread view")
            titles = [str(w.border_title) for w in screen.query(".stack-group.thread")]
            assert titles == ["thread 'prefetch' — rank 3 — ODD ONE OUT", "thread 'prefetch' — ranks 0-2"]
            tree = screen.query_one("#stacks-tree")  # the selected thread's, forking at rank 3's storage read
            assert str(tree.root.label) == "thread 'prefetch': ranks 0-3"
            assert any(str(node.label).startswith("[rank 3] fetch_from_storage") for node in _nodes(tree))
            # The fallback without ptrace: u sends SIGUSR1; faulthandler's dumps give the same verdict.
            py_spy_report = screen.report
            await pilot.press("u")
            await _until(lambda: screen.report is not py_spy_report, "the SIGUSR1 report")
            fallback = screen.report
            assert fallback.odd_ranks == [3], stacks.format_report(fallback)
            assert "all_reduce" in [f.name for f in fallback.groups[0].frames]
            assert all(s.main.active is None for s in fallback.ranks)  # faulthandler cannot tell
            await pilot.press("enter")  # the odd group's rank, zoomed
            await _until(lambda: not isinstance(app.screen, StacksScreen), "the stacks screen to close")
            assert app.main.zoomed and app.main.current == 3
            # Leaving the context unmounts the app, which stops the ranks.

    asyncio.run(scenario())

    events = read_events(agent.run_dir)
    stalled = {e["rank"] for e in events if e["event"] == "stall_detected"}
    assert stalled == {0, 1, 2, 3}
    dumps = [e for e in events if e["event"] == "stacks_dumped"]
    assert len(dumps) >= 3 and all(d["odd_ranks"] == [3] for d in dumps)
    assert {d["source"] for d in dumps} == {"agent", "cli", "signal"}
    assert len(os.listdir(os.path.join(agent.run_dir, "stacks"))) == 2 * len(dumps)


def _nodes(tree) -> list:
    """Every node of a Textual Tree, its root first."""
    out, stack = [], [tree.root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    return out
