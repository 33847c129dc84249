"""Multi-node through torch's rendezvous, for real, at its edges: waiting for nodes that do not
come, the exit barrier, nodes and stores lost, detached and served nodes, what peers write to
the store. (Rounds, restarts and the static form: test_rendezvous.py.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import freeze, read_line, run_ranktop, stop_process, wait_for
from ranktop.core.spec import free_port
from rdzv_job import CONF, LAPSE, RANK, TIMEOUT, Job, events, node_events, placements, wait_until_joining


def test_too_few_nodes_time_out_with_a_clear_message(tmp_path, torch_installed):
    job = Job(tmp_path, "alone")
    job.start("print", extra=("--rdzv-conf", "join_timeout=1,last_call_timeout=1,close_timeout=1"))
    ((status, out, err),) = job.finish()
    assert status == 1 and "PLACED" not in out
    assert "ranktop: error: the c10d rendezvous 'alone' timed out: not enough nodes joined" in err
    assert "Traceback" not in err
    assert [e["event"] for e in events(tmp_path / "node0")][-2:] == ["rendezvous_failed", "run_finished"]


def test_a_stop_signal_while_waiting_for_nodes_ends_at_once(tmp_path, torch_installed):
    """A node left waiting says what for, once the wait is not a short one (it used to print
    nothing until the round completed or timed out: 600 s of silence with c10d's defaults)."""
    job = Job(tmp_path, "waiting")
    node = job.start("print")
    wait_for(lambda: list(tmp_path.glob("node0/*/events.jsonl")) and any(
        e["event"] == "rendezvous_joining" for e in events(tmp_path / "node0")), timeout=30,
        what="the node waiting in the rendezvous")
    said = read_line(node.stderr, 30, "a line on stderr")
    assert said == "ranktop: waiting for nodes to join the c10d rendezvous 'waiting' (2 nodes; gives up after 40 s)\n"
    node.send_signal(signal.SIGTERM)
    ((status, out, err),) = job.finish()
    assert status == 128 + signal.SIGTERM and "PLACED" not in out
    assert "stopped by SIGTERM" in err and "Traceback" not in err


def test_a_node_whose_store_host_is_frozen_while_its_round_forms_gives_up_at_its_join_time_out(tmp_path,
                                                                                          torch_installed):
    """The node serving the store frozen (SIGSTOP, a paused VM) while a round forms: torch's
    handler on the other node waited in its store call for as long as it stayed so, silent and past
    its join time-out (a TCPStore call to a paused node ignores its time-out). It now says after 5 s
    that the store does not answer, and gives up once it has not for its join time-out, exit 1."""
    job = Job(tmp_path, "host-frozen", nnodes="3")
    conf = "last_call_timeout=1,close_timeout=5,join_timeout="
    host = job.start("print", extra=("--rdzv-conf", conf + "60,is_host=1"), local_addr="127.0.0.1")
    wait_until_joining(tmp_path, "node0")
    node = job.start("print", extra=("--rdzv-conf", conf + "6,is_host=0"), local_addr="127.0.0.2")
    store = f"the c10d rendezvous 'host-frozen''s store at {job.endpoint}"
    try:
        read_line(node.stderr, TIMEOUT, "the node's wait for a round", equal_to=(
            "ranktop: waiting for nodes to join the c10d rendezvous 'host-frozen' (3 nodes; gives up after 6 s)\n"))
        freeze(host.pid)
        read_line(node.stderr, TIMEOUT, "the line that the store does not answer", equal_to=(
            f"ranktop: {store} has not answered for 5 s (the node serving it paused, hung or cut off?): this node "
            "waits for it, and gives up after 6 s without an answer\n"))
        status = node.wait(TIMEOUT)
    finally:
        _thaw(host)
    (_, _, host_err), (_, out, err) = job.finish()
    assert status == 1 and "PLACED" not in out, err
    assert err.splitlines()[0] == (f"ranktop: error: the c10d rendezvous 'host-frozen' timed out: its store at "
                                   f"{job.endpoint} has not answered for 6 s, the join time-out (the node serving it "
                                   "paused, hung or cut off?)"), err
    said = [(e["event"], e.get("silent")) for e in events(tmp_path / "node1") if e["event"].startswith("rendezvous_")]
    assert said == [("rendezvous_joining", None), ("rendezvous_store_lost", True), ("rendezvous_failed", None)], said


def test_read_line_finds_the_second_of_two_lines_one_read_took_in(tmp_path):
    """The tests' read_line: a child writes two lines at once and waits. The pipe's readline()
    after select() took both in, returned the first, and a wait for the second timed out."""
    child = subprocess.Popen([sys.executable, "-c", "import sys\nsys.stderr.write('one\\ntwo\\n')\n"
                              "sys.stderr.flush()\nsys.stdin.read()"], stdin=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert read_line(child.stderr, 30, "the first line") == "one\n"
        assert read_line(child.stderr, 30, "the second line", equal_to="two\n") == "two\n"
    finally:
        child.stdin.close()  # it ends
        assert child.wait(30) == 0
        child.stderr.close()


def test_a_node_waiting_for_others_is_served_before_any_rank_starts(tmp_path, torch_installed):
    """A foreground run is served once it is under way: its ranks started or, here, its wait for
    a round begun (which may take minutes). ranktop ls lists it while it waits, and stop ends it."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    job = Job(tmp_path, "served-wait")
    job.env = {"XDG_RUNTIME_DIR": str(runtime)}
    env = {**os.environ, **job.env}
    node = job.start("print")
    (run,) = wait_for(lambda: json.loads(run_ranktop("ls", "--json", env=env).stdout), timeout=30,
                      what="the waiting node listed by ranktop ls")
    assert run["run_id"] == "served-wait" and run["pid"] == node.pid
    assert run["world"] is None and run["state"] == "rendezvous"  # no round yet: it said 2, a guess
    assert run_ranktop("ls", env=env).stdout.splitlines()[1].split()[1:4] == ["rdzv_rank.py", "?", "rendezvous"]
    assert [e["event"] for e in events(tmp_path / "node0") if e["event"].startswith("rendezvous")] == [
        "rendezvous_joining"]  # still waiting: no round has placed it
    # `stacks` of its log directory, which has no live rank, asks its engine, as for its id: it said
    # the run was not served and its engine had gone away (killed?)
    for target in ("served-wait", str(tmp_path / "node0")):
        said = run_ranktop("stacks", "--no-save", target, env=env, timeout=TIMEOUT)
        assert (said.returncode, said.stderr) == (1, "") and ": 0 of 0 ranks dumped" in said.stdout, (target, said)
    stopped = run_ranktop("stop", "served-wait", env=env, timeout=TIMEOUT)
    assert stopped.returncode == 0, stopped.stderr
    ((status, out, err),) = job.finish()
    assert status == 130 and "PLACED" not in out, err  # a stop the user asked for
    assert not any(e["event"] == "started" for e in events(tmp_path / "node0"))


def test_tui_shows_the_wait_for_nodes_and_why_the_run_ended(tmp_path, torch_installed):
    import asyncio

    from ranktop.core import LocalAgent, WorkerSpec
    from ranktop.core.engine import LocalEngine
    from ranktop.core.rendezvous import create_handler, parse_rdzv_conf
    from ranktop.tui.app import RanktopApp
    from ranktop.tui.panes import LiveText
    from textual.widgets import Static

    handler = create_handler("c10d", f"127.0.0.1:{free_port()}", "tui", 2, 2, local_addr="127.0.0.1",
                             conf=parse_rdzv_conf("join_timeout=4,last_call_timeout=1,close_timeout=1"))
    spec = WorkerSpec(role="default", local_world_size=2, entrypoint=sys.executable, args=(RANK, "print"),
                      rdzv_handler=handler)
    engine = LocalEngine(LocalAgent(spec, log_dir=str(tmp_path), console=False, shutdown_timeout=2))
    app = RanktopApp(engine)
    headers, notes, waiting = [], [], []
    app.notify = lambda message, **kw: notes.append(message)
    timed_out = "the c10d rendezvous 'tui' timed out: not enough nodes joined"

    def panel() -> str:
        return app.main.query_one("#root-cause-text").render().plain

    async def main():
        engine.start()  # returns at once: the round waits for a second node that never comes
        async with app.run_test(size=(160, 48)) as pilot:
            while not app.ended or timed_out not in panel():
                if app.main is not None and app.main.is_mounted:
                    headers.append(app.main.query_one("#header", LiveText).render().plain)
                    box = app.main.query_one("#waiting", Static)
                    waiting.append(str(box.render()) if box.display else None)
                await pilot.pause(0.1)
            await pilot.pause(0.3)
            waiting.append(str(box.render()) if box.display else None)
            headers.append(app.main.query_one("#header", LiveText).render().plain)

    asyncio.run(asyncio.wait_for(main(), 40))
    # (before the first round nothing is decided: it said `world 2  node 0/1`, the command line's
    # guesses, and so again once the round had timed out, in the end view; then `world ?  node ?`:
    # now the round it waits for, as far as it got, and in the end view the round that never formed)
    assert any(" rendezvous " in h and "  round 0 forming: 1 of 2 nodes  " in h for h in headers), headers
    assert " failed " in headers[-1] and "  round 0 not formed  " in headers[-1], headers[-1]
    assert not any("node 0/1" in h or "world" in h for h in headers), headers
    # What the node waits for, above the empty panes, until the round gave up
    assert ("waiting for nodes to join the c10d rendezvous 'tui' (2 nodes; gives up after 4 s)\n"
            "this node's 2 ranks start once the round is complete") in waiting, waiting
    assert waiting[-1] is None
    # Why it ended is the end panel's (a toast of the same words sat on the panel for 30 s)
    assert notes == [], notes
    assert app.exit_status == 1


def test_a_node_done_first_times_out_at_the_exit_barrier_and_still_succeeds(tmp_path, torch_installed):
    """torch's agent logs an exit-barrier time-out and returns its success; so does ranktop's (here
    through the API, torch's LocalElasticAgent shape: the CLI has no flag for it, as torchrun has
    none). This process hosts the c10d store and is the quick node; a ranktop node beside it keeps
    its rank running until the quick one has given up waiting, then ends well too."""
    from ranktop.core import DefaultLogsSpecs, LocalElasticAgent, WorkerSpec, WorkerState
    from ranktop.core.rendezvous import create_handler, parse_rdzv_conf

    endpoint, release = f"127.0.0.1:{free_port()}", tmp_path / "release"
    handler = create_handler("c10d", endpoint, "barrier", 2, 2, conf=parse_rdzv_conf(CONF), local_addr="127.0.0.1")
    job = Job(tmp_path, "barrier", endpoint=endpoint)  # made first above: this process serves the store
    slow = job.start("until-file", str(release))
    notices: list[str] = []
    spec = WorkerSpec(role="default", local_world_size=1, entrypoint=sys.executable, args=(RANK, "print"),
                      rdzv_handler=handler, monitor_interval=0.2)
    agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "quick")), exit_barrier_timeout=1.5,
                              console=False, on_notice=notices.append, shutdown_timeout=2)
    try:
        result = agent.run()
        assert slow.poll() is None  # the other node's rank was still running all along
    finally:
        release.touch()
    ((status, out, err),) = job.finish()
    assert result.state == WorkerState.SUCCEEDED and result.exit_status == 0
    assert "exit barrier: not every node of the c10d rendezvous 'barrier' finished within 1.5s" in notices
    quick = [e for e in events(tmp_path / "quick") if e["event"] in ("exit_barrier_timeout", "run_finished")]
    assert [(e["event"], e.get("timeout"), e.get("exit_status")) for e in quick] == [
        ("exit_barrier_timeout", 1.5, None), ("run_finished", None, 0)]
    assert status == 0, err
    assert "exit barrier:" not in err  # the slow node found the quick one at the barrier
    assert [p["WORLD_SIZE"] for p in placements(out)] == ["2"]
    assert not any(e["event"] == "exit_barrier_timeout" for e in events(tmp_path / "node0"))
    del handler  # the store it serves lives until the slow node is done


def test_a_node_at_the_exit_barrier_names_a_peer_that_gave_up_and_shows_no_torch_frames(tmp_path, torch_installed):
    """Node 1's rank is done and waits at the exit barrier; node 0, which serves the store, then
    fails for good and gives up. Node 1 said its barrier timed out after 300 s (it lost the store
    within seconds), under pages of torch's C++ TCPStore frames; it now names the peer, and ends
    with its own ranks' success, as torch's agent does."""
    job = Job(tmp_path, "barrier-gave-up")
    failing = tmp_path / "fail-now"
    job.start("fail-on-file", "0", str(failing), local_addr="127.0.0.1")  # first: it serves the store
    job.start("print", local_addr="127.0.0.2")
    wait_for(lambda: list(tmp_path.glob("node1/*/events.jsonl")) and any(
        e["event"] == "exited" and e["exitcode"] == 0 for e in events(tmp_path / "node1")), timeout=TIMEOUT,
        what="node 1's rank done (its node at the exit barrier)")
    failing.touch()
    (status0, _, err0), (status1, _, err1) = job.finish()
    assert status0 == 1 and "root cause: rank 0 (local rank 0" in err0, err0
    assert status1 == 0, err1
    assert ("ranktop: exit barrier: node " in err1 and "(group rank 0) gave up: rank 0 failed (exit 3), no restarts "
            "left (0 of 0 spent); the c10d rendezvous 'barrier-gave-up' is closed" in err1), err1
    assert "within 300s" not in err1
    for err in (err0, err1):
        assert "TCPStore" not in err and "frame #" not in err, err
    left = [e for e in events(tmp_path / "node1") if e["event"].startswith("exit_barrier")]
    assert [(e["event"], e["kind"]) for e in left] == [("exit_barrier_left", "peer_gave_up")], left


def fail_node_1_once_node_0_is_done(tmp_path, failing) -> None:
    """Once node 0's rank has exited 0 (its node at the exit barrier), make the file that fails
    node 1's `fail-on-file` rank."""
    wait_for(lambda: list(tmp_path.glob("node0/*/events.jsonl")) and any(
        e["event"] == "exited" and e["exitcode"] == 0 for e in events(tmp_path / "node0")), timeout=TIMEOUT,
        what="node 0's rank done (its node at the exit barrier)")
    failing.touch()


def test_a_node_at_the_exit_barrier_leaves_when_a_peer_waits_for_a_new_round(tmp_path, torch_installed):
    """Node 0's rank is done (exit barrier); node 1's rank then fails with a restart left, and node
    1 waits for a new round that node 0, its ranks finished, never joins. Node 0 waited out the
    barrier's 300 s for a node that had moved on; it now ends at once, with its ranks' success."""
    job = Job(tmp_path, "barrier-new-round")
    failing = tmp_path / "fail-now"
    conf = "join_timeout=60,last_call_timeout=1,close_timeout=5,is_host="
    job.start("fail-on-file", "1", str(failing), extra=("--max-restarts", "1", "--rdzv-conf", conf + "1"),
              local_addr="127.0.0.1")
    job.start("fail-on-file", "1", str(failing), extra=("--max-restarts", "1", "--rdzv-conf", conf + "0"),
              local_addr="127.0.0.2")
    fail_node_1_once_node_0_is_done(tmp_path, failing)
    (status0, _, err0), (status1, _, err1) = job.finish()
    assert status0 == 0, err0
    assert ("ranktop: exit barrier: 1 node(s) wait for a new round of the c10d rendezvous 'barrier-new-round' "
            "(a peer's ranks failed, or a node joined late); this node's ranks finished and it cannot join, "
            "so it ends without waiting for the others") in err0.splitlines(), err0
    # (a fixed-size round cannot form without node 0: it says so, and node 1 stops at once)
    assert status1 == 1 and err1.rstrip().endswith(
        "(group rank 0) gave up: its ranks had finished when another node's failed, and the next round cannot "
        "form without it); this node stops"), err1
    left = [e for e in events(tmp_path / "node0") if e["event"].startswith("exit_barrier")]
    assert [(e["event"], e["kind"]) for e in left] == [("exit_barrier_left", "new_round")], left
    # A TUI showed that line as a toast, gone in seconds: its end panel and the report it leaves
    # in the terminal said only `succeeded`. The final snapshot keeps it.
    from ranktop.core.client import FinalEngine
    from ranktop.core.report import report_after_tui
    from ranktop.tui.screens import root_cause_body

    (final,) = tmp_path.glob("node0/*/final.json")
    ended = FinalEngine(str(final)).snapshot()
    assert ended.end_note.startswith("exit barrier: 1 node(s) wait for a new round"), ended.end_note
    assert f"ranktop: note: {ended.end_note}" in report_after_tui(ended).splitlines()
    assert ended.end_note in root_cause_body(ended).plain


# An elastic job of 1 to 2 nodes whose first round must hold both: the store's host joins first and
# waits up to 30 s for the other (a round of 2 completes at once); the other, alone in its next round,
# completes it after 1 s.
HOST_CONF = "join_timeout=60,last_call_timeout=30,close_timeout=5,is_host=1"
PEER_CONF = "join_timeout=60,last_call_timeout=1,close_timeout=5,is_host=0"


def test_the_store_host_stays_at_the_exit_barrier_while_an_elastic_peer_forms_its_new_round(tmp_path,
                                                                                             torch_installed):
    """An elastic job (1 to 2 nodes): node 0 serves the c10d store and its rank is done; node 1's
    rank then fails with a restart left and waits for a new round. Node 0 left the rendezvous open
    "for the others to go on" and took the store with it: node 1's round failed (lost the store,
    exit 1). It now steps out of the round but serves the store until the job ends: node 1 runs its
    new round alone and succeeds, closing the rendezvous, and node 0 ends then."""
    job = Job(tmp_path, "barrier-host-stays", nnodes="1:2")
    failing = tmp_path / "fail-now"
    job.start("fail-on-file", "1", str(failing), extra=("--max-restarts", "1", "--rdzv-conf", HOST_CONF),
              local_addr="127.0.0.1")
    wait_until_joining(tmp_path, "node0")
    job.start("fail-on-file", "1", str(failing), extra=("--max-restarts", "1", "--rdzv-conf", PEER_CONF),
              local_addr="127.0.0.2")
    fail_node_1_once_node_0_is_done(tmp_path, failing)
    (status0, _, err0), (status1, out1, err1) = job.finish()
    assert status1 == 0, err1
    # its new round: node 1 alone, global rank 0 (which passes), its restart spent
    assert [(p["WORLD_SIZE"], p["RANK"], p["TORCHELASTIC_RESTART_COUNT"]) for p in placements(out1)] == [
        ("2", "1", "0"), ("1", "0", "1")], out1
    assert "lost the c10d rendezvous" not in err1 and "TCPStore" not in err1, err1
    assert status0 == 0, err0
    assert ("ranktop: exit barrier: 1 node(s) wait for a new round of the c10d rendezvous 'barrier-host-stays' "
            "(a peer's ranks failed, or a node joined late); this node's ranks finished and it cannot join, but it "
            "serves the rendezvous store their round needs: it stays until the job ends (at most 300 s)"
            ) in err0.splitlines(), err0
    left = [(e["event"], e.get("kind"), e.get("until")) for e in events(tmp_path / "node0")
            if e["event"].startswith(("exit_barrier", "store_served"))]
    assert left == [("exit_barrier_left", "new_round", None), ("store_served", None, "closed")], left


def test_the_store_host_serves_a_peers_new_round_no_longer_than_its_exit_barrier_would_wait(tmp_path,
                                                                                             torch_installed):
    """As above, but the peer's new round runs on: the host (this process, through the API, where
    the exit barrier's time-out can be short) stays for it only as long as its barrier would have
    waited, then says it stops serving a store the others may still use, and ends well."""
    from ranktop.core import DefaultLogsSpecs, LocalElasticAgent, WorkerSpec, WorkerState
    from ranktop.core.rendezvous import create_handler, parse_rdzv_conf

    endpoint, failing, release = f"127.0.0.1:{free_port()}", tmp_path / "fail-now", tmp_path / "release"
    handler = create_handler("c10d", endpoint, "host-timeout", 1, 2, conf=parse_rdzv_conf(HOST_CONF),
                             local_addr="127.0.0.1")
    job = Job(tmp_path, "host-timeout", nnodes="1:2", endpoint=endpoint)
    notices: list[str] = []
    spec = WorkerSpec(role="default", local_world_size=1, entrypoint=sys.executable, args=(RANK, "print"),
                      rdzv_handler=handler, monitor_interval=0.2)
    # The barrier's time must outlast the peer's new round starting (a look for newcomers every
    # NEWCOMERS_LOOK, 1 s, then the peer's 1 s last call: ~2.5 s), as the peer's placement needs
    # the store served here; the host waits all of it out, so no more than that with a margin.
    agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "host")), exit_barrier_timeout=6,
                              console=False, on_notice=notices.append, shutdown_timeout=2)

    def start_the_peer_then_fail_it_once_the_host_is_done() -> None:
        wait_until_joining(tmp_path, "host")
        job.start("fail-on-file-then-until", "1", str(failing), str(release),
                  extra=("--max-restarts", "1", "--rdzv-conf", PEER_CONF), local_addr="127.0.0.2")
        wait_for(lambda: list(tmp_path.glob("host/*/events.jsonl")) and any(
            e["event"] == "exited" for e in events(tmp_path / "host")), timeout=TIMEOUT, what="the host's rank done")
        failing.touch()

    toucher = threading.Thread(target=start_the_peer_then_fail_it_once_the_host_is_done, daemon=True)
    toucher.start()
    try:
        result = agent.run()
        toucher.join(timeout=TIMEOUT)
        assert job.nodes[0].poll() is None  # its new round's rank still runs, on the store served here till now
    finally:
        release.touch()
    ((status, out, err),) = job.finish()
    assert result.state == WorkerState.SUCCEEDED and result.exit_status == 0
    notices = [n for n in notices if n.startswith("exit barrier:")]
    assert notices[0].endswith("it stays until the job ends (at most 6 s)"), notices
    assert notices[1:] == ["exit barrier: stopped serving the c10d rendezvous 'host-timeout''s store after 6 s, "
                           "while the other nodes may still use it"], notices
    served = [e["until"] for e in events(tmp_path / "host") if e["event"] == "store_served"]
    assert served == ["timeout"]
    assert status == 0, err
    assert [p["WORLD_SIZE"] for p in placements(out)] == ["2", "1"]
    del handler  # the store it serves lived until the peer was done




def _thaw(host: subprocess.Popen, release: Path | None = None) -> None:
    """The frozen node serving the store, let go at a test's end whatever happened: resumed, its
    `until-file` rank released, and stopped."""
    os.kill(host.pid, signal.SIGCONT)
    if release is not None:
        release.touch()
    host.terminate()


def _freeze(node: subprocess.Popen, sig: int) -> None:
    """SIGSTOP or SIGCONT a node as a paused VM or a debugger would: its ranktop and every process
    under it (its ranks, in sessions of their own)."""
    import psutil

    for pid in [node.pid, *(child.pid for child in psutil.Process(node.pid).children(recursive=True))]:
        if sig == signal.SIGSTOP:
            freeze(pid)  # (frozen once every thread is: the store's server answered until then)
            continue
        with contextlib.suppress(ProcessLookupError):  # (one that ended since it was listed needs neither)
            os.kill(pid, sig)


def _placed(tmp_path: Path, node: str, attempt: str, says: bytes = b"PLACED") -> bool:
    """Whether the node's rank of that attempt has printed where it was placed (it has started up),
    or `says` (BUSY: in its collective)."""
    return any(says in log.read_bytes() for log in tmp_path.glob(f"{node}/*/{attempt}/0/stdout.log"))


# torch's last call: once a round has --nnodes MIN nodes (1 here), the node whose join made it so
# (the first: node 0, which serves the store) waits that long for more. Where every round of the job
# must hold both nodes, it waits up to 30 s: a round of 2 forms as the second joins, so that costs
# nothing. With 1 s, a round formed without node 1 where it came a second late: a busy box starts it
# late, its tries to reach node 0's store back off up to ~2 s, and a node that waits for a new round
# looks at the store once a second.
BOTH = "join_timeout=40,last_call_timeout=30,close_timeout=5"


def _wait_for_a_round_of_both(tmp_path: Path, says: bytes = b"PLACED") -> int:
    """Until node 0's and node 1's ranks are up (`says`) in node 1's first round; returns how many
    rounds node 0 formed alone before it: none, unless node 1 came past node 0's last call of 1 s,
    which a test keeps where node 0's next round is to form alone (see BOTH). Node 0's watch then
    took node 1 in, restarting its group (`nodes_joined`, no restart spent; logs in attempt_0.N)."""
    def both_up() -> tuple[int] | None:
        joined = node_events(tmp_path, "node1", "rendezvous_joined")
        if not joined or not _placed(tmp_path, "node1", "attempt_0", says):
            return None
        alone = joined[0]["round"]
        return (alone,) if _placed(tmp_path, "node0", "attempt_0" + (f".{alone}" if alone else ""), says) else None

    (alone,) = wait_for(both_up, timeout=TIMEOUT, what="node 0's and node 1's ranks up in one round")
    return alone


def test_a_frozen_node_rejoins_and_a_paused_store_host_is_said_and_waited_for(tmp_path, torch_installed):
    """Node 1 frozen (SIGSTOP) past the keep-alive limit: torch's handler drops it, and nobody
    noticed; node 0's idle rank ran on in a world of 2, and node 1, resumed, ran on in a round the
    job had left (torchrun does both). Node 0 now ends the round once node 1 is out of it (a
    restart spent, as for a failure); node 1, resumed, says it was dropped, stops its rank and joins
    the next round, spending none. Then node 0, which serves the store, is frozen: node 1's look at
    the store waited, silent, for as long as it stayed so (a TCPStore call to a paused node ignores
    its time-out); it now says so, and once it answers, that every node of the round was dropped
    meanwhile, and runs on. Both end well: the exit barrier takes no node for gone when every
    node's heartbeats lapsed at once."""
    job, release = Job(tmp_path, "frozen", nnodes="1:2"), tmp_path / "release"
    # Both rounds hold both nodes (BOTH): node 1, resumed once node 0 has restarted without it,
    # joins the round node 0 waits in. (With a 1 s last call, node 0's first round formed alone
    # where node 1 came late; and node 1, resumed once node 0's rank ran alone, joined a third
    # round, which held it only where its look at the store, once a second, came in time.)
    conf = BOTH + LAPSE + ",is_host="
    host = job.start("until-file", str(release), extra=("--max-restarts", "1", "--rdzv-conf", conf + "1"),
                     local_addr="127.0.0.1")
    peer = job.start("until-file", str(release), extra=("--max-restarts", "1", "--rdzv-conf", conf + "0"),
                     local_addr="127.0.0.2")
    try:
        wait_for(lambda: _placed(tmp_path, "node1", "attempt_0"), timeout=TIMEOUT, what="node 1's rank")
        _freeze(peer, signal.SIGSTOP)
        try:
            wait_for(lambda: node_events(tmp_path, "node0", "group_restart"), timeout=TIMEOUT,
                     what="node 0 restarting its group without node 1")
        finally:
            _freeze(peer, signal.SIGCONT)
        wait_for(lambda: _placed(tmp_path, "node0", "attempt_1") and _placed(tmp_path, "node1", "attempt_0.1"),
                 timeout=TIMEOUT, what="both nodes' ranks in a new round")
        _freeze(host, signal.SIGSTOP)
        try:
            wait_for(lambda: node_events(tmp_path, "node1", "rendezvous_store_lost"), timeout=TIMEOUT,
                     what="node 1 saying the store does not answer")
            time.sleep(1)  # (past the keep-alive limit, 4 s, in all)
        finally:
            _freeze(host, signal.SIGCONT)
        wait_for(lambda: node_events(tmp_path, "node1", "rendezvous_store_back"), timeout=TIMEOUT,
                 what="node 1 saying the store answers again")
    finally:
        release.touch()
    (status0, out0, err0), (status1, out1, err1) = job.finish()
    assert (status0, status1) == (0, 0), err0 + err1
    ours0 = [line for line in err0.splitlines() if line.startswith("ranktop:")]
    assert ("ranktop: node 127.0.0.2 (group rank 1) of the c10d rendezvous 'frozen' is gone: no keep-alive heartbeat "
            "of its for over 4 s (killed, frozen or cut off); restarting the group: attempt_1 (1 of 1 restarts "
            "spent)") in ours0, err0
    assert [p["WORLD_SIZE"] for p in placements(out0)] == ["2", "2"]
    assert ("ranktop: this node was dropped from round 0 of the c10d rendezvous 'frozen': no keep-alive heartbeat "
            "of its for over 4 s (it was frozen or cut off), and the job went on without it: stopping its ranks and "
            "joining the next round (no restart spent)") in err1.splitlines(), err1
    assert [(p["WORLD_SIZE"], p["TORCHELASTIC_RESTART_COUNT"]) for p in placements(out1)] == [("2", "0"), ("2", "0")]
    store = f"ranktop: the c10d rendezvous 'frozen''s store at {job.endpoint}"
    assert [line for line in err1.splitlines() if line.startswith(store)] == [
        f"{store} has not answered for 5 s (the node serving it paused, hung or cut off?): this node's ranks run "
        "on, and ranktop says when it answers again",
        f"{store} answers again, but every node of round 1 was dropped meanwhile (no keep-alive heartbeat reached "
        "it for over 4 s): the ranks run on, but torch's handler sends no more heartbeats, so a node lost from now "
        "on is noticed only when a collective of its ranks breaks"], err1
    ends = [(e["event"], e.get("kind"), e.get("reason")) for node in ("node0", "node1") for e in
            events(tmp_path / node) if e["event"] in ("round_end", "group_restart", "exit_barrier_left")]
    assert ends == [("round_end", "peer_failed", None), ("group_restart", None, "failure"),
                    ("round_end", "left_behind", None), ("group_restart", None, "left_behind")], ends
    assert [e["silent"] for e in events(tmp_path / "node1") if e["event"] == "rendezvous_store_lost"] == [True]
    # node 0, resumed, said nothing of it (its own store never stopped answering it): now it does
    assert ("ranktop: this node (or every node) was paused or cut off past the keep-alive limit: every node of "
            "round 1 was dropped meanwhile (no keep-alive heartbeat reached it for over 4 s): the ranks run on, but "
            "torch's handler sends no more heartbeats, so a node lost from now on is noticed only when a collective "
            "of its ranks breaks") in ours0, err0
    assert not [line for line in err1.splitlines() if "paused or cut off past" in line], err1


def test_a_frozen_node_whose_ranks_had_finished_does_not_wait_at_the_old_rounds_exit_barrier(tmp_path,
                                                                                              torch_installed):
    """Node 1 frozen past the keep-alive limit, node 0 going on without it; node 1's rank, resumed,
    finishes at once (its watch has not looked yet). Node 1 waited at the old round's exit barrier,
    for nodes that had gone on to a later round, for 300 s. It now ends at its first look there,
    saying why, and leaves the rendezvous open for the job that went on."""
    job, release0, release1 = Job(tmp_path, "frozen-done", nnodes="1:2"), tmp_path / "release0", tmp_path / "release1"
    conf = CONF + LAPSE + ",is_host="  # (a 1 s last call: node 0 goes on alone while node 1 is frozen)
    job.start("until-file", str(release0), extra=("--max-restarts", "1", "--rdzv-conf", conf + "1"),
              local_addr="127.0.0.1")
    peer = job.start("until-file", str(release1), extra=("--rdzv-conf", conf + "0", "--monitor-interval", "120"),
                     local_addr="127.0.0.2")
    try:
        alone = _wait_for_a_round_of_both(tmp_path)
        _freeze(peer, signal.SIGSTOP)
        try:
            wait_for(lambda: len(node_events(tmp_path, "node0", "started")) == alone + 2, timeout=TIMEOUT,
                     what="node 0's rank started again without node 1")
            release1.touch()
        finally:
            _freeze(peer, signal.SIGCONT)
        wait_for(lambda: peer.poll() is not None, timeout=30, what="node 1 ending, not waiting at the barrier")
    finally:
        release0.touch()
        release1.touch()
    (status0, out0, err0), (status1, _, err1) = job.finish()
    assert (status0, status1) == (0, 0), err0 + err1
    assert (f"ranktop: exit barrier: this node was dropped from round {alone} of the c10d rendezvous 'frozen-done': "
            "no keep-alive heartbeat of its for over 4 s (it was frozen or cut off), and the job went on without it; "
            "its ranks had finished, so it ends without waiting for the others, and leaves the rendezvous open for "
            "them") in err1.splitlines(), err1
    assert [p["WORLD_SIZE"] for p in placements(out0)] == ["1"] * alone + ["2", "1"], out0


def test_a_node_killed_while_the_others_ranks_sit_idle_ends_their_round(tmp_path, torch_installed):
    """Node 1, not the store's host, is killed outright while node 0's rank waits in no collective:
    node 0 ran on, its rank waiting for ever. It now learns once node 1's heartbeats have lapsed,
    and with no restart left gives up, naming the lost node (torchrun's node never notices)."""
    job, release = Job(tmp_path, "killed-idle"), tmp_path / "release"
    conf = CONF + LAPSE + ",is_host="
    job.start("until-file", str(release), extra=("--rdzv-conf", conf + "1"), local_addr="127.0.0.1")
    peer = job.start("until-file", str(release), extra=("--rdzv-conf", conf + "0"), local_addr="127.0.0.2")
    try:
        wait_for(lambda: node_events(tmp_path, "node0", "started") and node_events(tmp_path, "node1", "started"),
                 timeout=TIMEOUT, what="both ranks running")
        peer.kill()
        (status0, _, err0), (status1, _, _) = job.finish()
    finally:
        release.touch()
    assert status1 == -signal.SIGKILL
    assert status0 == 1, err0
    assert ("ranktop: error: node 127.0.0.2 (group rank 1) of the c10d rendezvous 'killed-idle' is gone: no "
            "keep-alive heartbeat of its for over 4 s (killed, frozen or cut off), and this node has no restarts "
            "left (0 of 0 spent)") in err0.splitlines(), err0
    assert [e["kind"] for e in events(tmp_path / "node0") if e["event"] == "round_end"] == ["peer_failed"]
    # nor did it wait (up to 5 s) for node 1 to read why it gave up: no node was left to read it
    closed = [e["others"] for e in events(tmp_path / "node0") if e["event"] == "rendezvous_closed"]
    assert closed == ["none_left"], closed


# How node 0 learns that node 1's user stopped it: its watch sees node 1 out of the round (its rank in
# no collective), or its rank's collective breaks first (its watch's first look is 10 s after its rank
# started: long after; not never, as a node 1 that joined late waits for that look, see
# _wait_for_a_round_of_both).
@pytest.mark.parametrize("seen_by", ["watch", "ranks"])
def test_a_node_its_user_stops_steps_out_so_an_elastic_peer_goes_on_at_once(tmp_path, torch_installed, seen_by):
    """Node 1 of an elastic job (1:2) is stopped by its user (SIGTERM to its ranktop): it was a lost
    node to node 0, which said `rank 0 failed (exit 1)` or, its rank idle, `no keep-alive heartbeat`,
    and whose next round formed only once node 1's heartbeats had lapsed (6-9 s here). Node 1 now
    tells the round it was stopped and steps out of it: node 0 names it so, and goes on alone at once."""
    job, release = Job(tmp_path, "stopped", nnodes="1:2"), tmp_path / "release"
    # (a 1 s last call: node 0's next round forms alone 1 s after it joins)
    conf = CONF + ",keep_alive_interval=3,keep_alive_max_attempt=3,is_host="
    mode, up = ("until-file", b"PLACED") if seen_by == "watch" else ("busy-until-file", b"BUSY")
    watch = ("--monitor-interval", "10") if seen_by == "ranks" else ()
    job.start(mode, str(release), extra=("--max-restarts", "1", "--rdzv-conf", conf + "1", *watch),
              local_addr="127.0.0.1")
    stopped = job.start(mode, str(release), extra=("--rdzv-conf", conf + "0"), local_addr="127.0.0.2")
    try:
        alone = _wait_for_a_round_of_both(tmp_path, up)
        stopped.send_signal(signal.SIGTERM)
        wait_for(lambda: _placed(tmp_path, "node0", "attempt_1"), timeout=TIMEOUT, what="node 0's rank again, alone")
    finally:
        release.touch()
    (status0, out0, err0), (status1, _, err1) = job.finish()
    assert (status0, status1) == (0, 128 + signal.SIGTERM), err0 + err1
    said = "node 127.0.0.2 (group rank 1) of the c10d rendezvous 'stopped' was stopped by its user (SIGTERM)"
    assert f"ranktop: {said}; restarting the group: attempt_1 (1 of 1 restarts spent)" in err0.splitlines(), err0
    assert [p["WORLD_SIZE"] for p in placements(out0)] == ["1"] * alone + ["2", "1"], out0
    ends = [(e["kind"], e["message"]) for e in node_events(tmp_path, "node0", "round_end")]
    assert ends == [("nodes_joined", "1 node(s) waiting to join the c10d rendezvous 'stopped'")] * alone + [
        ("peer_stopped", said)], ends
    (final,) = tmp_path.glob("node0/*/final.json")  # the header's `earlier:`
    assert json.loads(final.read_text())["earlier_attempts"] == ["attempt_0: restarted, nodes joined"] * alone + [
        f"attempt_0: {said}"]
    # its word was in the store before its rank got the signal (their collective broke then), and it stepped out
    assert [(e["how"], e["said_first"], e["stepped_out"]) for e in node_events(
        tmp_path, "node1", "rendezvous_stepped_out")] == [("SIGTERM", True, True)]
    # at once: torch's handler would have dropped node 1 only 6-9 s after its last heartbeat
    (stop,) = node_events(tmp_path, "node1", "signal_received")
    formed = node_events(tmp_path, "node0", "rendezvous_joined")[alone + 1]["ts"] - stop["ts"]
    assert formed < 5, formed


def _a_store_host_and_a_node_to_stop(tmp_path: Path, rdzv_id: str):
    """Node 0, which serves the store, and node 1 (its round watch looking only every 120 s), each
    with a rank up that waits for `release`: (job, release, node 0, node 1)."""
    job, release = Job(tmp_path, rdzv_id), tmp_path / "release"
    conf = CONF + ",is_host="
    host = job.start("until-file", str(release), extra=("--rdzv-conf", conf + "1"), local_addr="127.0.0.1")
    stopped = job.start("until-file", str(release), extra=("--rdzv-conf", conf + "0", "--monitor-interval", "120"),
                        local_addr="127.0.0.2")
    try:
        wait_for(lambda: all(_placed(tmp_path, f"node{i}", "attempt_0") for i in range(2)), timeout=TIMEOUT,
                 what="both nodes' ranks up")
    except BaseException:
        release.touch()
        job.finish()
        raise
    return job, release, host, stopped


def test_a_stopped_nodes_ranks_get_the_signal_before_its_step_out_and_a_second_ctrl_c_ends_the_step_out(
        tmp_path, torch_installed):
    """Node 0 serves the store and hangs (SIGSTOP); node 1 gets Ctrl-C. Before its ranks got the
    signal it told the round and stepped out of it, waiting up to 2 s for the store: they now wait
    for its word only, 0.5 s at most, and it steps out while they stop. A second Ctrl-C, which
    kills at once, waited those 2 s too: it now ends the wait for the step out at once. (Its
    round watch looks only every 120 s: a look on a store that does not answer holds the end of
    the watch a second.)"""
    job, release, host, stopped = _a_store_host_and_a_node_to_stop(tmp_path, "hung-ctrl-c")
    try:
        freeze(host.pid)  # (its store's server could answer the word until its every thread stopped)
        try:
            stopped.send_signal(signal.SIGINT)
            wait_for(lambda: node_events(tmp_path, "node1", "exited"), timeout=TIMEOUT, what="node 1's rank ended")
            stopped.send_signal(signal.SIGINT)
            wait_for(lambda: stopped.poll() is not None, timeout=TIMEOUT, what="node 1 ending")
        finally:
            host.send_signal(signal.SIGCONT)
        host.send_signal(signal.SIGTERM)
    finally:
        release.touch()
    (_, _, err0), (status1, _, err1) = job.finish()
    assert status1 == 130, err0 + err1
    first, second = node_events(tmp_path, "node1", "signal_received")
    assert (first["action"], second["action"]) == ("forward", "kill_now")
    (ended,) = node_events(tmp_path, "node1", "exited")
    assert ended["ts"] - first["ts"] < 1.5, ended["ts"] - first["ts"]  # (it waited out WORD_WAIT, 2 s)
    (step_out,) = node_events(tmp_path, "node1", "rendezvous_stepped_out")
    assert (step_out["said_first"], step_out["stepped_out"]) == (False, False)  # (the store never answered)
    # the wait for the step out ended with the second Ctrl-C, not 2 s after the first
    assert step_out["seconds"] - (second["ts"] - first["ts"]) < 0.5, (step_out, second["ts"] - first["ts"])


def test_a_word_the_store_refused_is_not_taken_for_said_before_the_ranks_signal(tmp_path, torch_installed):
    """Node 0 serves the store and is killed outright; node 1 then gets Ctrl-C. Its word to the
    round failed at once (the store's connection reset), and the event said it was in the store
    before the ranks got their signal (`said_first`), as it took the word's end for its saying. It
    says so now only where the word reached the store."""
    job, release, host, stopped = _a_store_host_and_a_node_to_stop(tmp_path, "store-killed")
    try:
        host.kill()
        host.wait()
        stopped.send_signal(signal.SIGINT)
        wait_for(lambda: stopped.poll() is not None, timeout=TIMEOUT, what="node 1 ending")
    finally:
        release.touch()
    (status0, _, _), (status1, _, err1) = job.finish()
    assert (status0, status1) == (-signal.SIGKILL, 130), err1
    (step_out,) = node_events(tmp_path, "node1", "rendezvous_stepped_out")
    assert (step_out["said_first"], step_out["stepped_out"]) == (False, False), step_out


def test_the_store_host_at_the_exit_barrier_leaves_once_every_other_node_is_gone(tmp_path, torch_installed):
    """Node 0 serves the store and its rank is done (exit barrier); node 1 is then killed outright
    (its guard ends its rank; nobody closes the rendezvous). Node 0 served a store nobody was left
    to use until the barrier's 300 s ran out; it now leaves once node 1's heartbeats have lapsed."""
    job, release = Job(tmp_path, "barrier-peers-gone"), tmp_path / "release"
    conf = CONF + LAPSE + ",is_host="
    job.start("print", extra=("--rdzv-conf", conf + "1"), local_addr="127.0.0.1")
    peer = job.start("until-file", str(release), extra=("--rdzv-conf", conf + "0"), local_addr="127.0.0.2")
    try:
        wait_for(lambda: any(e["exitcode"] == 0 for e in node_events(tmp_path, "node0", "exited")),
                 timeout=TIMEOUT, what="node 0's rank done (its node at the exit barrier)")
        peer.kill()
        (status0, _, err0), (status1, _, _) = job.finish()
    finally:
        release.touch()  # (only needed if node 1 outlived its kill)
    assert status1 == -signal.SIGKILL
    assert status0 == 0, err0
    assert ("ranktop: exit barrier: no other node of the c10d rendezvous 'barrier-peers-gone' is left (their "
            "keep-alive heartbeats stopped: they ended without closing it), so this node ends without waiting "
            "for them") in err0.splitlines(), err0
    left = [(e["event"], e.get("kind")) for e in events(tmp_path / "node0") if e["event"].startswith("exit_barrier")]
    assert left == [("exit_barrier_left", "peers_gone")], left


def test_the_store_host_serving_a_new_round_leaves_once_every_other_node_is_gone(tmp_path, torch_installed):
    """As the store host stays for an elastic peer's new round (below), but the peer is then killed
    outright: the host served the store until its barrier's 300 s ran out; it now ends once the
    peer's heartbeats have lapsed, saying why, with its ranks' success."""
    job = Job(tmp_path, "serving-peers-gone", nnodes="1:2")
    failing, release = tmp_path / "fail-now", tmp_path / "release"
    job.start("print", extra=("--max-restarts", "1", "--rdzv-conf", HOST_CONF + LAPSE), local_addr="127.0.0.1")
    wait_until_joining(tmp_path, "node0")
    peer = job.start("fail-on-file-then-until", "1", str(failing), str(release),
                     extra=("--max-restarts", "1", "--rdzv-conf", PEER_CONF + LAPSE), local_addr="127.0.0.2")
    try:
        fail_node_1_once_node_0_is_done(tmp_path, failing)
        wait_for(lambda: node_events(tmp_path, "node0", "exit_barrier_left") and len(
            node_events(tmp_path, "node1", "started")) == 2, timeout=TIMEOUT,
            what="node 1's new round running, node 0 serving its store")
        peer.kill()
        (status0, _, err0), (status1, _, _) = job.finish()
    finally:
        release.touch()
    assert status1 == -signal.SIGKILL
    assert status0 == 0, err0
    assert ("ranktop: exit barrier: stopped serving the c10d rendezvous 'serving-peers-gone''s store: no other "
            "node is left (their keep-alive heartbeats stopped: they ended without closing it)") in err0.splitlines()
    served = [e["until"] for e in events(tmp_path / "node0") if e["event"] == "store_served"]
    assert served == ["peers_gone"], served


def test_a_node_waiting_at_the_exit_barrier_says_so(tmp_path, torch_installed):
    """Node 0's rank is done, node 1's runs on: node 0 sat at the exit barrier, up to 300 s, as
    `rendezvous` and nothing more. It says what it waits for once the wait is not a short one.
    A third node joining the full, running round is torch's spare (its redundancy list): it waits
    with no time-out, and says so; its line named the join time-out (40 s here), as if it would
    give up then."""
    job = Job(tmp_path, "barrier-wait")
    release = tmp_path / "release"
    node = job.start("print", local_addr="127.0.0.1")
    job.start("until-file", str(release), local_addr="127.0.0.2")
    line = "ranktop: waiting at the exit barrier for the other nodes of the c10d rendezvous 'barrier-wait' " \
           "(gives up after 300 s)\n"
    spare_line = ("ranktop: the c10d rendezvous 'barrier-wait''s round is full and running: this node waits as a "
                  "spare, with no time-out, until a node of it leaves or the job ends\n")
    try:
        read_line(node.stderr, TIMEOUT, "the line about the exit barrier", equal_to=line)
        spare = job.start("print", local_addr="127.0.0.3")
        read_line(spare.stderr, TIMEOUT, "the spare's line", equal_to=spare_line)
    finally:
        release.touch()  # (the job ends either way)
    *nodes, (spare_status, _, spare_err) = job.finish()
    for status, _, err in nodes:
        assert status == 0 and "exit barrier:" not in err, err
    assert spare_status == 1 and "waiting for nodes to join" not in spare_err, spare_err  # the job ended without it
    assert [e["event"] for e in events(tmp_path / "node2")].count("rendezvous_spare") == 1


def test_a_stop_ends_the_exit_barrier_while_the_store_host_is_frozen(tmp_path, torch_installed):
    """Node 1's rank is done, and the node serving the store (node 0) is frozen (SIGSTOP, a paused
    VM): node 1's exit barrier waited in a store call for as long as node 0 stayed so, its stop
    signals, commands and 300 s time-out not looked at. A SIGTERM now ends it, 128+15."""
    job, release = Job(tmp_path, "barrier-frozen"), tmp_path / "release"
    host = job.start("until-file", str(release), extra=("--rdzv-conf", CONF + ",is_host=1"), local_addr="127.0.0.1")
    node = job.start("print", extra=("--rdzv-conf", CONF + ",is_host=0"), local_addr="127.0.0.2")
    try:
        read_line(node.stderr, TIMEOUT, "the line about the exit barrier", equal_to=(
            "ranktop: waiting at the exit barrier for the other nodes of the c10d rendezvous 'barrier-frozen' "
            "(gives up after 300 s)\n"))
        freeze(host.pid)
        node.send_signal(signal.SIGTERM)
        status = node.wait(TIMEOUT)  # (before node 0 is thawed)
    finally:
        _thaw(host, release)
    _, (_, _, err) = job.finish()
    assert status == 128 + signal.SIGTERM and "stopped by SIGTERM" in err and "Traceback" not in err, err
    left = [(e["event"], e.get("kind")) for e in events(tmp_path / "node1") if e["event"].startswith("exit_barrier")]
    assert left == [("exit_barrier_left", "stopped")], left


def test_a_node_whose_rank_fails_while_the_store_host_is_frozen_ends_and_says_why(tmp_path, torch_installed):
    """Node 1's rank fails, no restarts left, while the node serving the store (node 0) is frozen:
    node 1's look for the others' word on why the group ended, then its word that it gave up,
    waited as long as node 0 stayed so, the failure unsaid and its stop signals not taken. It now
    gives the word 2 s, and its giving up the close's time-out and the linger (1 + 5 s here), and
    ends with its rank's failure, exit 1."""
    job, release, fail = Job(tmp_path, "fail-frozen"), tmp_path / "release", tmp_path / "fail"
    host = job.start("until-file", str(release), extra=("--rdzv-conf", CONF + ",is_host=1"), local_addr="127.0.0.1")
    node = job.start("fail-on-file", "1", str(fail), extra=("--rdzv-conf", "join_timeout=40,last_call_timeout=1,close_timeout=1,is_host=0"),
                     local_addr="127.0.0.2")
    try:
        wait_for(lambda: _placed(tmp_path, "node1", "attempt_0"), timeout=TIMEOUT, what="node 1's rank")
        freeze(host.pid)
        fail.touch()
        status = node.wait(TIMEOUT)  # (before node 0 is thawed)
    finally:
        _thaw(host, release)
    _, (_, _, err) = job.finish()
    assert status == 1 and "root cause: rank 1 (local rank 0" in err and "Traceback" not in err, err
    closed = [e.get("others") for e in events(tmp_path / "node1") if e["event"] == "rendezvous_closed"]
    assert closed == ["store_silent"], closed


def test_a_spare_taken_off_the_spare_list_says_it_waits_with_the_join_time_out_again(tmp_path, torch_installed):
    """A spare of a full round (1:2 nodes) whose node 1 is frozen past the keep-alive limit: torch
    takes the spare off its spare list and times its join again, but the spare kept saying it
    waited `with no time-out`. It now says it waits for a round again, with the time-out."""
    job, release = Job(tmp_path, "spare-admitted", nnodes="1:2", conf=CONF + LAPSE), tmp_path / "release"
    # The first round must hold nodes 0 and 1, and node 0's watch looks only every 120 s: a round it
    # formed alone, its 1 s last call over before node 1 joined, never took node 1 in, and the wait
    # for node 1's rank timed out (1 full run; node 1 joins a second late when a busy box starts it
    # late, or starts node 0 late: node 1's tries to reach the store back off up to ~2 s). The first
    # node to join waits up to 30 s for the other; a round of 2 is complete as the second joins. Node 0
    # serves the store: had the frozen node won the race to serve it, the spare's look at the store
    # would wait as long as it stayed frozen, and never see it gone.
    conf = "join_timeout=40,last_call_timeout=30,close_timeout=5" + LAPSE + ",is_host="
    job.start("until-file", str(release), extra=("--monitor-interval", "120", "--rdzv-conf", conf + "1"),
              local_addr="127.0.0.1")
    frozen = job.start("until-file", str(release), extra=("--rdzv-conf", conf + "0"), local_addr="127.0.0.2")
    spare_line = ("ranktop: the c10d rendezvous 'spare-admitted''s round is full and running: this node waits as a "
                  "spare, with no time-out, until a node of it leaves or the job ends\n")
    admitted = ("ranktop: no longer a spare: waiting for nodes to join the c10d rendezvous 'spare-admitted' (1 to 2 "
                "nodes; gives up after 40 s)\n")
    try:
        wait_for(lambda: _placed(tmp_path, "node1", "attempt_0"), timeout=TIMEOUT, what="node 1's rank")
        spare = job.start("print", extra=("--rdzv-conf", conf + "0"), local_addr="127.0.0.3")
        read_line(spare.stderr, TIMEOUT, "the spare's line", equal_to=spare_line)
        _freeze(frozen, signal.SIGSTOP)
        try:
            read_line(spare.stderr, TIMEOUT, "the spare's line once taken off the spare list", equal_to=admitted)
        finally:
            _freeze(frozen, signal.SIGCONT)
    finally:
        release.touch()
        for node in job.nodes:
            stop_process(node)
    job.finish()
    said = [e["event"] for e in events(tmp_path / "node2") if e["event"].startswith("rendezvous_spare")]
    assert said == ["rendezvous_spare", "rendezvous_spare_admitted"], said


def test_the_node_serving_the_store_leaves_the_exit_barrier_only_after_the_others(tmp_path, torch_installed):
    """The node that serves the store is the last at the exit barrier: it used to leave at once,
    and a peer that looked for the last member a moment later could find the store gone and say its
    barrier had timed out (1 run in 12 under load). It now waits until every ranktop node has
    passed; both end well, and neither says a word about the barrier."""
    job = Job(tmp_path, "barrier-last")
    release = tmp_path / "release"
    job.start("until-file", str(release), local_addr="127.0.0.1")  # first: it serves the store
    job.start("print", local_addr="127.0.0.2")
    wait_for(lambda: list(tmp_path.glob("node1/*/events.jsonl")) and any(
        e["event"] == "exited" and e["exitcode"] == 0 for e in events(tmp_path / "node1")), timeout=TIMEOUT,
        what="node 1's rank done (its node at the exit barrier)")
    release.touch()
    for status, _, err in job.finish():
        assert status == 0 and "exit barrier:" not in err and "TCPStore" not in err, err
    for node in ("node0", "node1"):
        assert not any(e["event"].startswith("exit_barrier") for e in events(tmp_path / node))


def test_a_node_that_lost_the_store_ends_at_its_ranks_failure_with_no_restart_promised(tmp_path, torch_installed):
    """The node serving the store is killed (its guard ends its ranks): the other's ranks lose
    their collective. It said `restarting the group: attempt_1 (1 of 1 restarts spent)`, then its
    next round failed at once on the broken connection (a TCPStore client never connects again):
    now it ends at the failure, its restart unspent, saying why in one line, as torchrun ends
    there too (exit 1, its ranks not restarted). ~60 lines of torch's C++ warnings (TCPStore,
    `frame #0`...) came from ranktop's own process once."""
    job = Job(tmp_path, "store-gone")
    # (the last --rdzv-conf wins; is_host decides which node serves the store: both are local to
    # the endpoint, and the first to bind it used to win)
    conf = "join_timeout=15,last_call_timeout=1,close_timeout=5,is_host="
    host = job.start("wait-world", "3", extra=("--max-restarts", "1", "--rdzv-conf", conf + "1"), local_addr="127.0.0.1")
    job.start("wait-world", "3", extra=("--max-restarts", "1", "--rdzv-conf", conf + "0"), local_addr="127.0.0.2")
    wait_for(lambda: any(b"SUM" in p.read_bytes() for p in tmp_path.glob("node1/*/attempt_0/0/stdout.log")),
             timeout=TIMEOUT, what="the ranks' first all_reduce")
    host.kill()
    (status0, _, _), (status1, _, err1) = job.finish()
    assert status0 == -signal.SIGKILL
    # ranktop's own lines: a rank's are prefixed on the console and indented under the root cause
    ours = [line for line in err1.splitlines() if not line.startswith(("[default", " "))]
    assert status1 == 1 and ours[-2:] == [
        "ranktop: rdzv_rank.py failed in attempt_0 (1 of 2 attempts)",
        f"ranktop: error: not restarted, with 1 restart left: lost the c10d rendezvous 'store-gone''s store at "
        f"{job.endpoint} (the node serving it is gone?), and no new round can form without it"], err1
    assert not any("restarting" in line or "TCPStore" in line or "frame #" in line for line in ours), err1
    (final,) = tmp_path.glob("node1/*/final.json")
    ended = json.loads(final.read_text())
    assert (ended["state"], ended["attempt"], ended["exit_status"], ended["root_cause"]["attempt"]) == ("failed", 0, 1, 0)
    assert ended["store_lost"] == f"the c10d rendezvous 'store-gone''s store at {job.endpoint}"
    said = [e["event"] for e in events(tmp_path / "node1") if "store" in e["event"] or "restart" in e["event"]]
    assert said == ["rendezvous_store_lost", "group_not_restarted"], said
    assert not list(tmp_path.glob("node1/*/attempt_1"))


def test_closing_after_the_store_host_vanished_shows_ranktops_line_not_torchs_warning(tmp_path, torch_installed):
    """The node serving the store is killed while the other's rank runs on (it needs no
    collective); that rank then ends well, and its node finds the store gone at the exit barrier,
    says so in one line and closes the rendezvous, which fails: torch's dynamic handler logged a
    Python WARNING for that (`W... dynamic_rendezvous.py:...] The node '...' has failed to shutdown
    the rendezvous ...`) under ranktop's line. (Heartbeats every 60 s here: none is due meanwhile.)"""
    job, release = Job(tmp_path, "close-store-gone"), tmp_path / "release"
    conf = CONF + ",keep_alive_interval=60,is_host="
    host = job.start("until-file", str(release), extra=("--rdzv-conf", conf + "1"), local_addr="127.0.0.1")
    job.start("until-file", str(release), extra=("--rdzv-conf", conf + "0"), local_addr="127.0.0.2")
    wait_for(lambda: all(node_events(tmp_path, node, "started") for node in ("node0", "node1")), timeout=TIMEOUT,
             what="both nodes' ranks running")
    host.kill()
    host.wait(timeout=TIMEOUT)
    release.touch()
    (status0, _, _), (status1, _, err1) = job.finish()
    assert status0 == -signal.SIGKILL
    assert status1 == 0, err1
    assert ("ranktop: exit barrier: lost the c10d rendezvous 'close-store-gone''s store before every node finished "
            "(the node serving it may have ended): ") in err1, err1
    assert "WARNING" not in err1 and "dynamic_rendezvous" not in err1 and "failed to shutdown" not in err1, err1
    assert not any(re.match(r"[WE]\d{4} ", line) for line in err1.splitlines()), err1
