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
from conftest import ROOT, freeze, read_events, read_line, run_ranktop, stop_process, wait_for
from ranktop.core.spec import free_port
from rdzv_job import CONF, RANK, TIMEOUT, Job, events, node_events, placements, start_etcd, wait_until_joining


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


# A node killed outright (SIGKILL) never says it left: the others learn it once its keep-alive
# heartbeats lapse, here after 4 s (torch's default: 3 x 5 s). Not 2 x 1 s: torch's handler sends a
# heartbeat only once its last is an interval old, so a healthy node's ages up to two intervals
# between sends (three as a round starts), and torch dropped healthy nodes from their round.
LAPSE = ",keep_alive_interval=1,keep_alive_max_attempt=4"


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


# torch's dynamic handler's WARNING for each failed keep-alive heartbeat (every keep_alive_interval)
FAILED_HEARTBEAT = "has failed to send a keep-alive heartbeat"


def lost_line(rdzv: str, store: str, who: str = "the node serving it") -> str:
    return (f"ranktop: lost the {rdzv}'s store{store} ({who} is gone?): this node's ranks run on, but no new "
            "round can form, so a failure of theirs ends the run")


def test_a_store_lost_while_the_ranks_run_is_said_once_not_at_every_heartbeat(tmp_path, torch_installed):
    """The node serving the store is killed while the other's rank runs on (2 s more): torch's
    keep-alive thread logged a WARNING at each heartbeat (every 5 s by default, 1 s here) for as long
    as the ranks ran, and nothing said what it meant. ranktop says it once, in its own words, and
    the run ends as before (exit 0, the exit barrier's line about the lost store). A rank printing
    torch's very words still reaches the console: only torch's records in ranktop's process go."""
    job, release = Job(tmp_path, "store-lost-running"), tmp_path / "release"
    conf = CONF + ",keep_alive_interval=1,is_host="
    host = job.start("until-file", str(release), extra=("--rdzv-conf", conf + "1"), local_addr="127.0.0.1")
    job.start("say-until-file", str(release), f"rank: {FAILED_HEARTBEAT} (its own line)",
              extra=("--rdzv-conf", conf + "0"), local_addr="127.0.0.2")
    try:
        wait_for(lambda: all(node_events(tmp_path, node, "started") for node in ("node0", "node1")),
                 timeout=TIMEOUT, what="both nodes' ranks running")
        host.kill()
        host.wait(timeout=TIMEOUT)
        wait_for(lambda: node_events(tmp_path, "node1", "rendezvous_store_lost"), timeout=TIMEOUT,
                 what="node 1 finding the store lost")
        # the rank runs on: two more heartbeats fail meanwhile, either of which would say it again
        # (an absence leaves nothing to wait on)
        time.sleep(2)
    finally:
        release.touch()
    (status0, _, _), (status1, _, err1) = job.finish()
    assert status0 == -signal.SIGKILL
    assert status1 == 0, err1
    lines = err1.splitlines()
    said = lost_line("c10d rendezvous 'store-lost-running'", f" at {job.endpoint}")
    assert lines.count(said) == 1, err1
    assert ("ranktop: exit barrier: lost the c10d rendezvous 'store-lost-running''s store before every node "
            "finished (the node serving it may have ended): ") in err1, err1  # the end, as before
    ours = [line for line in lines if not line.startswith("[default")]
    assert not any(FAILED_HEARTBEAT in line or "dynamic_rendezvous" in line for line in ours), err1
    assert not any(re.match(r"[WE]\d{4} ", line) for line in ours), err1
    assert f"[default1]:rank: {FAILED_HEARTBEAT} (its own line)" in lines, err1
    store = [e["store"] for e in events(tmp_path / "node1") if e["event"].startswith("rendezvous_store")]
    assert store == [f"the c10d rendezvous 'store-lost-running''s store at {job.endpoint}"], store
    left = [e["kind"] for e in events(tmp_path / "node1") if e["event"] == "exit_barrier_left"]
    assert left == ["store_lost"], left


def test_a_store_that_answers_again_is_said_to_once(tmp_path, torch_installed):
    """etcd-v2: the etcd server is killed while the rank runs, then started again (its keys and
    port kept): ranktop says the store is lost, once, then that it answers again, once."""
    client, peer = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    server = start_etcd(tmp_path, client, peer, "--enable-v2")
    release = tmp_path / "release"
    job = Job(tmp_path, "store-back", nnodes="1", backend="etcd-v2", endpoint=client.removeprefix("http://"),
              conf=CONF + ",keep_alive_interval=1")
    try:
        job.start("until-file", str(release))
        wait_for(lambda: node_events(tmp_path, "node0", "started"), timeout=TIMEOUT, what="the rank running")
        server.kill()
        server.wait()
        wait_for(lambda: node_events(tmp_path, "node0", "rendezvous_store_lost"), timeout=TIMEOUT,
                 what="the store found lost")
        server = start_etcd(tmp_path, client, peer, "--enable-v2")
        wait_for(lambda: node_events(tmp_path, "node0", "rendezvous_store_back"), timeout=TIMEOUT,
                 what="the store found again")
        release.touch()
        ((status, _, err),) = job.finish()
    finally:
        release.touch()
        stop_process(server)
    assert status == 0, err
    ours = [line for line in err.splitlines() if "'store-back''s store" in line]
    assert ours == [lost_line("etcd-v2 rendezvous 'store-back'", "", "its server"),
                    "ranktop: the etcd-v2 rendezvous 'store-back''s store answers again: keep-alive heartbeats "
                    "and new rounds can reach it"], err
    said = [e["event"] for e in events(tmp_path / "node0") if e["event"].startswith("rendezvous_store")]
    assert said == ["rendezvous_store_lost", "rendezvous_store_back"], said


def test_tui_marks_a_lost_store_in_its_header_and_says_it_in_a_toast(tmp_path, torch_installed):
    """The TUI's node (not the store's host) loses the store while its rank runs: a toast says so
    once and the header marks it (nothing in the TUI said the store was gone)."""
    import asyncio

    from ranktop.core import LocalAgent, WorkerSpec
    from ranktop.core.engine import LocalEngine
    from ranktop.core.rendezvous import create_handler, parse_rdzv_conf
    from ranktop.tui.app import RanktopApp
    from ranktop.tui.panes import LiveText

    job, release = Job(tmp_path, "tui-store"), tmp_path / "release"
    conf = CONF + ",keep_alive_interval=1,is_host="
    host = job.start("until-file", str(release), extra=("--rdzv-conf", conf + "1"), local_addr="127.0.0.1")
    handler = create_handler("c10d", job.endpoint, "tui-store", 2, 2, local_addr="127.0.0.2",
                             conf=parse_rdzv_conf(conf + "0"))
    spec = WorkerSpec(role="default", local_world_size=1, entrypoint=sys.executable,
                      args=(RANK, "until-file", str(release)), rdzv_handler=handler)
    engine = LocalEngine(LocalAgent(spec, log_dir=str(tmp_path / "node1"), console=False, shutdown_timeout=2))
    app = RanktopApp(engine)
    headers, notes = [], []
    app.notify = lambda message, **kw: notes.append(message)

    async def main():
        engine.start()
        async with app.run_test(size=(200, 48)) as pilot:
            while not app.ended:
                if host.poll() is None and node_events(tmp_path, "node1", "started"):
                    host.kill()
                if app.main is not None and app.main.is_mounted:
                    headers.append(app.main.query_one("#header", LiveText).render().plain)
                if notes and any("  store lost" in h for h in headers):
                    release.touch()
                await pilot.pause(0.1)

    try:
        asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    finally:
        release.touch()
        job.finish()
    lost = f"lost the c10d rendezvous 'tui-store''s store at {job.endpoint}: this node's ranks run on, but no new round can form"
    assert notes[0] == lost and notes.count(lost) == 1, notes
    assert any(" round 0  store lost  " in h for h in headers), headers
    assert app.exit_status == 0


def test_only_failed_heartbeats_of_this_rendezvous_are_dropped_and_only_while_its_store_is_said_lost(torch_installed):
    """The filter on torch's dynamic-rendezvous logger, with real records: a failed heartbeat of
    this rendezvous is dropped only while ranktop says its store is lost; another rendezvous's, or
    any other record of that logger, goes through, and nothing is dropped outside the run."""
    import logging

    from ranktop.core.rendezvous import Rendezvous, create_handler

    handler = create_handler("c10d", f"127.0.0.1:{free_port()}", "quiet", 1, 1, conf={"is_host": "1"})
    rdzv = Rendezvous(handler, "default", 1)
    logger = logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    seen: list[str] = []
    keep = logging.Handler()
    keep.emit = lambda record: seen.append(record.getMessage())
    failed = "The node 'n' " + FAILED_HEARTBEAT + " to the rendezvous '{}' due to an error of type RendezvousConnectionError."
    others = [failed.format("other"), failed.format("quiet-2"), "The node 'n' has failed to shutdown the rendezvous "
              "'quiet' due to an error of type RendezvousConnectionError.", "The node 'n' has joined round 3"]
    logger.addHandler(keep)
    try:
        with rdzv.quiet_lost_heartbeats():
            logger.warning(failed.format("quiet"))  # not said lost (and no ranks run: nothing looked at)
            rdzv.store_lost = "the c10d rendezvous 'quiet''s store"
            for message in [failed.format("quiet"), *others]:
                logger.warning(message)
        logger.warning(failed.format("quiet"))
    finally:
        logger.removeHandler(keep)
        handler.shutdown()
    assert seen == [failed.format("quiet"), *others, failed.format("quiet")], seen


STORE_LOST = """
import os, subprocess, sys
from ranktop.core.rendezvous import _torch_rendezvous
_torch_rendezvous("c10d")
assert "TORCH_CPP_LOG_LEVEL" not in os.environ  # the ranks get the environment as it was
import torch.distributed as dist
server = subprocess.Popen([sys.executable, "-c", "import sys, torch.distributed as d; "
                           "s = d.TCPStore('127.0.0.1', 0, 2, True, wait_for_workers=False); "
                           "print(s.port, flush=True); sys.stdin.read()"],  # (until told to go)
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
client = dist.TCPStore("127.0.0.1", int(server.stdout.readline()), 2, False)
client.set("k", "v")
server.stdin.close()
server.wait()
try:
    client.check(["k"])
    client.add("n", 1)
except Exception as exc:
    print("lost:", type(exc).__name__)
"""


def test_torch_loaded_by_ranktop_keeps_its_cpp_store_warnings_to_itself(torch_installed):
    """A store whose server went away: each call printed a page of C++ frames from ranktop's own
    process (the node serving the store had ended; ranktop then says so in one line)."""
    done = subprocess.run([sys.executable, "-c", STORE_LOST], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "lost:" in done.stdout, done.stderr
    assert "TCPStore" not in done.stderr and "frame #" not in done.stderr, done.stderr


def test_a_detached_node_keeps_the_rendezvous_id_as_its_run_id(tmp_path, torch_installed):
    """--detach fixes the background run's id up front; a multi-node run's must stay the
    rendezvous id, the same on every node, as in the foreground."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    script = tmp_path / "ticker.py"
    script.write_text("import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(0.1)\n")
    done = run_ranktop("--detach", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "job-7", "--rdzv-conf", CONF,
                       "--local-addr", "127.0.0.1", "--log-dir", str(tmp_path / "logs"), str(script), env=env,
                       timeout=TIMEOUT)
    assert done.returncode == 0 and done.stdout.startswith("ranktop: started job-7 in the background"), done.stderr
    run_dir = tmp_path / "logs" / "job-7"
    try:
        (run,) = json.loads(run_ranktop("ls", "--json", env=env).stdout)
        assert run["run_id"] == "job-7"
        assert [p.name for p in (tmp_path / "logs").iterdir()] == ["job-7"]  # the run directory too
        # The store is the background run's: the command that started it used to host one too, and
        # its exit took the rendezvous of the run it had just started down with it half the time.
        wait_for(lambda: any(e["event"] in ("started", "rendezvous_failed")
                             for e in read_events(run_dir, while_written=True)), timeout=TIMEOUT, what="a round")
    finally:
        stopped = run_ranktop("stop", "job-7", env=env, timeout=TIMEOUT)
    events = read_events(run_dir)
    assert stopped.returncode == 0, (stopped.stderr, events)
    assert [e["event"] for e in events if e["event"] in ("rendezvous_joined", "rendezvous_failed", "user_stop")] == [
        "rendezvous_joined", "user_stop"], events


def test_nodes_of_one_job_on_one_host_are_each_served(tmp_path, torch_installed):
    """A job tried on loopback: a second node's run used to go unserved (its socket name, the
    rendezvous id, was the first node's), so ranktop ls/stop could not reach it. Sharing a log
    root, the names follow the directories (job-8, job-8.1); a node with a log root of its own
    (its directory: job-8) takes the next free number."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    script = tmp_path / "ticker.py"
    script.write_text("import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(0.1)\n")
    endpoint = f"127.0.0.1:{free_port()}"
    started = []
    for logs in ("logs", "logs", "other"):
        done = run_ranktop("--detach", "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", endpoint, "--rdzv-id", "job-8", "--rdzv-conf", CONF,
                           "--local-addr", "127.0.0.1", "--log-dir", str(tmp_path / logs), str(script), env=env,
                           timeout=TIMEOUT)
        started.append(done.stdout)
        assert done.returncode == 0, done.stderr
    expected = {"job-8": tmp_path / "logs" / "job-8", "job-8.1": tmp_path / "logs" / "job-8.1",
                "job-8.2": tmp_path / "other" / "job-8"}
    try:
        assert [line.split(" in the background")[0] for line in started] == [
            f"ranktop: started {name}" for name in expected], started
        runs = {r["run_id"]: Path(r["log_dir"]) for r in json.loads(run_ranktop("ls", "--json", env=env).stdout)}
        assert runs == expected
        for run_dir in expected.values():  # one job: every node in the same round
            wait_for(lambda d=run_dir: any(e["event"] == "rendezvous_joined" for e in read_events(d, while_written=True)),
                     timeout=TIMEOUT, what="the round joined")
    finally:
        stops = [run_ranktop("stop", name, env=env, timeout=TIMEOUT) for name in ("job-8.2", "job-8.1", "job-8")]
    assert [s.returncode for s in stops] == [0, 0, 0], [s.stderr for s in stops]
    assert run_ranktop("ls", env=env).stdout.startswith("no runs")


def test_a_detached_run_that_cannot_join_says_why_in_one_line(tmp_path, torch_installed):
    """What stops the background run before it serves (a bad backend, a store out of reach) is
    its own one line on the terminal that asked, as without --detach; nothing is left running."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    script = tmp_path / "ok.py"
    script.write_text("print('never')\n")
    common = ("--detach", "--nnodes", "1", "--rdzv-id", "j9", "--log-dir", str(tmp_path / "logs"))
    bad = run_ranktop(*common, "--rdzv-backend", "nosuch", "--rdzv-endpoint", "127.0.0.1:29123", str(script),
                      env=env, timeout=TIMEOUT)
    assert bad.returncode == 2 and bad.stdout == ""
    assert re.fullmatch(r"ranktop: error: bad rendezvous \(--rdzv-backend nosuch.*'nosuch' is not registered.*\n",
                        bad.stderr), bad.stderr
    gone = run_ranktop(*common, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                       "--rdzv-conf", "read_timeout=1,is_host=0", str(script), env=env, timeout=TIMEOUT)
    assert gone.returncode == 1
    assert gone.stderr.startswith("ranktop: error: cannot reach the c10d rendezvous at 127.0.0.1:"), gone.stderr
    assert gone.stderr.count("\n") == 1, gone.stderr
    # In the foreground too: torch's C++ errors at each connect try (a page of frames) were printed.
    here = run_ranktop(*common[1:], "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                       "--rdzv-conf", "read_timeout=1,is_host=0", str(script), env=env, timeout=TIMEOUT)
    assert here.returncode == 1 and here.stdout == ""
    assert re.fullmatch(r"ranktop: error: cannot reach the c10d rendezvous at 127.0.0.1:\d+: .*\n", here.stderr), \
        here.stderr
    assert run_ranktop("ls", env=env).stdout.startswith("no runs")


def test_an_endpoint_where_no_c10d_store_answers_is_one_line_not_a_hang(tmp_path, torch_installed):
    """Something else listens at the endpoint (a mistyped port, etcd's): torch's store client waits
    for its answer whatever its read_timeout, and ranktop printed nothing, for ever, deaf to Ctrl-C.
    It gives up after twice that time-out and 5 s (torch's own connect tries overrun it)."""
    import socket

    with socket.socket() as silent:  # takes connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        res = run_ranktop("--headless", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                          "--rdzv-conf", "read_timeout=1,is_host=0", "--log-dir", str(tmp_path / "logs"), RANK,
                          "print", timeout=TIMEOUT)
    assert (res.returncode, res.stdout) == (1, "")
    assert res.stderr == (f"ranktop: error: cannot reach the c10d rendezvous at {endpoint}: no c10d store answered "
                          "there within 7 s (none serves it, or another service listens on that port)\n")
    assert not (tmp_path / "logs").exists()


def test_the_static_and_etcd_backends_wait_torchruns_900_s_unless_the_conf_says_otherwise():
    """torchrun's launcher hands every backend timeout=900; the static backend's own default is 600."""
    pytest.importorskip("torch")
    import datetime

    from ranktop.core.rendezvous import create_handler

    endpoint = f"127.0.0.1:{free_port()}"  # nothing is reached until the first round
    assert create_handler("static", endpoint, "st", 2, 2, conf={"rank": "1"}).timeout == datetime.timedelta(seconds=900)
    told = create_handler("static", endpoint, "st", 2, 2, conf={"rank": "1", "timeout": "30"})
    assert told.timeout == datetime.timedelta(seconds=30)


@pytest.mark.parametrize("written, said", [
    (b'{"host": "h\\u001b]52;c;aGk=\\u0007", "group_rank": 0, "reason": "x\\n[default0]:ok\\u001b[2J"}',
     "node h (group rank 0) gave up: x\u240a[default0]:ok"),
    (b'{"group_rank": 1}', "node ? (group rank 1) gave up: ?"),  # a KeyError that stopped the watch
    (b'[1]', "node ? (group rank ?) gave up: ?"),
    (b'\xff{', "node ? (group rank ?) gave up: ?"),
    (json.dumps({"host": "h", "group_rank": "0", "reason": "r" * 100_000}).encode(),
     "node h (group rank ?) gave up: " + "r" * 300),
    (b'{"host": "h", "group_rank": 1%s, "reason": "r"}' % (b"0" * 4000), "node h (group rank ?) gave up: r"),
    # over 1 MiB is not parsed (torch's append grows a value past 100 MB; parsing `[0,0,...` took 5 times that)
    (json.dumps({"host": "h", "group_rank": 1, "reason": "r", "pad": [0] * 400_000}).encode(),
     "node ? (group rank ?) gave up: ?"),
])
def test_what_a_peer_wrote_to_the_store_when_giving_up_is_shown_as_one_safe_line(torch_installed, written, said):
    """Anyone who reaches the c10d store can write there (it takes no password): the words a node
    gave up with went raw to the other nodes' consoles (an OSC 52 clipboard write, a cleared
    screen, a forged rank line), and a value without "host" raised in the watch thread."""
    from datetime import timedelta

    from ranktop.core.rendezvous import _GAVE_UP, Rendezvous
    from ranktop.core.spec import Placement
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=10))
    rdzv = Rendezvous(None, "default", 1)
    rdzv.store, rdzv.placement = store, Placement(1, 2, 1, 2, 1, 2, "127.0.0.1", 1, "r", 1, False)
    store.set(_GAVE_UP, written)
    assert rdzv.peer_gave_up() == said


@pytest.mark.parametrize("written, read", [
    (b'{"group_rank": 2, "how": "SIGTERM", "host": "node2"}', (2, "SIGTERM", "node2")),
    (b'{"group_rank": 0, "how": "command"}', (0, "K, q or ranktop stop", "?")),
    (b'{"group_rank": 1, "how": "SIGTERM\\u001b[2J", "host": "h\\u001b]52;c;aGk=\\u0007"}', (1, "", "h")),
    (b'{"group_rank": 1, "how": "' + b"SIGX" * 1000 + b'", "host": "' + b"h" * 1000 + b'"}', (1, "", "h" * 300)),
    (b'{"group_rank": 1, "how": "SIGT\\u0395RM"}', (1, "", "?")),  # a Greek capital E: no signal's name
    (b'{"group_rank": "1", "how": "SIGTERM"}', (None, "", "?")),  # not read: no node of the round
    (b'{"group_rank": 1%s, "how": "SIGTERM"}' % (b"0" * 4000), (None, "", "?")),
    (b'[1]', (None, "", "?")),
    (b'\xff{', (None, "", "?")),
])
def test_how_a_peer_said_its_user_stopped_it_is_read_as_a_signal_or_the_stop_commands(written, read):
    """What a node stopped by its user writes to the round's store, as the others read it: anyone
    can write there, so a group rank is a whole number in range or not read, how is a signal's name
    or the stop commands, or nothing, and the host one line's worth of safe text."""
    from ranktop.core.rendezvous import _how_stopped

    assert tuple(_how_stopped(written)) == read


@pytest.mark.parametrize("fixed", [{"master_addr": "10.9.8.7", "master_port": 4242}, {"master_port": 4242}, {}])
def test_a_worker_specs_master_overrides_the_rounds_as_torchs(tmp_path, torch_installed, fixed):
    """torch's agent gives the ranks WorkerSpec.master_addr/master_port where they are set, the
    round's master where not (None, torch's default: ranktop's used to be 127.0.0.1, and the round's
    master always won)."""
    from rank_fns import echo_env
    from ranktop.core import LocalAgent, WorkerSpec
    from ranktop.core.rendezvous import create_handler, parse_rdzv_conf

    handler = create_handler("c10d", f"127.0.0.1:{free_port()}", "fixed", 1, 1, conf=parse_rdzv_conf(CONF),
                             local_addr="127.0.0.1")
    spec = WorkerSpec(role="default", local_world_size=1, entrypoint=echo_env, args=("MASTER_ADDR", "MASTER_PORT"),
                      rdzv_handler=handler, **{"master_addr": None, "master_port": None, **fixed})
    agent = LocalAgent(spec, log_dir=str(tmp_path), console=False, shutdown_timeout=2)
    seen = agent.run().return_values[0]
    handler.shutdown()
    assert seen["MASTER_ADDR"] == fixed.get("master_addr", "127.0.0.1")
    if "master_port" in fixed:
        assert seen["MASTER_PORT"] == "4242"
    else:  # the store this node's ranks meet at, served for them
        assert seen["MASTER_PORT"] != "4242"
    joined = [e for e in read_events(agent.run_dir) if e["event"] == "rendezvous_joined"]
    assert joined[0]["master"] == f"{seen['MASTER_ADDR']}:{seen['MASTER_PORT']}"


def _listening_ports() -> set[int]:
    """The TCP ports this process listens on (its sockets, as /proc/net lists them)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[3] == "0A":  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_finished_agent_dropped_frees_its_stores_without_a_garbage_collection(tmp_path, torch_installed):
    """As torch's: once the caller drops the agent, its spec and the handler, the stores they held
    (the rendezvous's, served here, and the one served for the ranks) stop listening at once. The
    agent's own callbacks made a cycle, so both stayed open, each with its thread, until the next
    garbage collection (a fork before it, an mp.Process say, could abort in the collection)."""
    import gc

    from rank_fns import double
    from ranktop.core import DefaultLogsSpecs, LocalElasticAgent, WorkerSpec
    from ranktop.core.rendezvous import create_handler, parse_rdzv_conf

    before = _listening_ports()
    gc.disable()  # what the cycle collector would free is not freed here
    try:
        handler = create_handler("c10d", f"127.0.0.1:{free_port()}", "drop", 1, 1, conf=parse_rdzv_conf(CONF),
                                 local_addr="127.0.0.1")
        spec = WorkerSpec(role="default", local_world_size=1, entrypoint=double, args=(2,), rdzv_handler=handler)
        agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path)), console=False, shutdown_timeout=2)
        assert agent.run().return_values == {0: 4}
        handler.shutdown()
        assert len(_listening_ports() - before) >= 2  # the rendezvous's store and the ranks'
        del agent, spec, handler
        assert _listening_ports() - before == set()
    finally:
        gc.enable()


def _in_process_node(tmp_path: Path, rdzv_id: str, endpoint: str, nnodes: int, conf: str, done_at_once: bool = False,
                     **agent_args):
    """An agent of this process as a node (its rank sleeps, in no collective, or with
    `done_at_once` returns at once), and its handler."""
    from rank_fns import double, sleep_forever
    from ranktop.core import DefaultLogsSpecs, LocalElasticAgent, WorkerSpec
    from ranktop.core.rendezvous import create_handler, parse_rdzv_conf

    handler = create_handler("c10d", endpoint, rdzv_id, nnodes, nnodes, conf=parse_rdzv_conf(conf),
                             local_addr="127.0.0.1")
    spec = WorkerSpec(role="default", local_world_size=1, entrypoint=double if done_at_once else sleep_forever,
                      args=(1,) if done_at_once else (), rdzv_handler=handler, max_restarts=1)
    return LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path)), console=False, shutdown_timeout=2,
                             **agent_args), handler


def test_nodes_at_the_exit_barrier_do_not_wait_for_a_node_its_user_stopped(tmp_path, torch_installed):
    """Three nodes: this agent's rank and node B's are done (the exit barrier), node C's user stops
    it while its ranks run. C never comes, but B is alive, so neither found itself alone: both
    waited out the barrier's time-out (300 s by default). C said it was stopped (its step out): the
    nodes at the barrier, every other node of the round, now end at their next look."""
    from ranktop.core.rendezvous import Rendezvous, create_handler, parse_rdzv_conf

    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", "barrier-stopped"
    agent, handler = _in_process_node(tmp_path, rdzv_id, endpoint, 3, CONF, done_at_once=True, exit_barrier_timeout=15)
    peers = [Rendezvous(create_handler("c10d", endpoint, rdzv_id, 3, 3, conf=parse_rdzv_conf(CONF),
                                       local_addr="127.0.0.1"), "default", 1) for _ in range(2)]
    barrier_b = []

    def node_b() -> None:  # done at once, as this agent's rank
        peers[0].next_round()
        barrier_b.append(peers[0].exit_barrier(15, lambda: False))

    def node_c() -> None:  # its user stops it once both others are at the barrier
        peers[1].next_round()
        wait_for(lambda: peers[1].store.add("torchelastic/agent/terminal_state/num_members", 0) == 2,
                 timeout=TIMEOUT, what="two nodes at the exit barrier")
        peers[1].step_out_stopped("SIGTERM")

    threads = [threading.Thread(target=node, daemon=True) for node in (node_b, node_c)]
    for thread in threads:
        thread.start()
    try:
        result = agent.run()
        for thread in threads:
            thread.join(TIMEOUT)
    finally:
        for peer in peers:
            peer.handler.shutdown()
        handler.shutdown()
    said = (f"node 127.0.0.1 (group rank {peers[1].placement.group_rank}) of the c10d rendezvous '{rdzv_id}' was "
            "stopped by its user (SIGTERM), so this node ends without waiting for it")
    assert (result.state.name, result.end_note) == ("SUCCEEDED", f"exit barrier: {said}")
    assert [(end.kind, end.message) for end in barrier_b] == [("peer_stopped", said)]


def test_a_node_whose_run_ended_sends_no_more_heartbeats_while_it_lives_on(tmp_path, torch_installed):
    """A node's run stopped (K, a signal) while its process lives on (its TUI on the end screen, an
    API caller holding the agent, a detached engine lingering): torch's handler went on sending
    keep-alive heartbeats for as long as it lived, so the other nodes never found the node gone (a
    peer's ranks in no collective ran on; a peer at the exit barrier waited its 300 s), and with the
    store lost, torch's warning for each failed heartbeat was written over the TUI every 5 s. Its
    heartbeats now end with the run: it drops out of the rendezvous once they lapse, as if it had exited."""
    agent, handler = _in_process_node(tmp_path, "ended-lives-on", f"127.0.0.1:{free_port()}", 1, CONF + LAPSE)
    threading.Thread(target=lambda: agent.wait_started(TIMEOUT) and agent.stop(), daemon=True).start()
    assert agent.run().state.name == "STOPPED"

    def in_the_rendezvous() -> bool:
        with handler._heartbeat_lock:
            handler._state_holder.sync()
            return handler._this_node in handler._state_holder.state.last_heartbeats

    assert in_the_rendezvous()  # (its last heartbeats are recent)
    wait_for(lambda: not in_the_rendezvous(), timeout=15, what="the ended node's heartbeats to lapse")  # 4 s
    handler.shutdown()


def test_a_lost_nodes_next_round_timing_out_blames_none_of_this_nodes_ranks(tmp_path, torch_installed):
    """Node 1 goes silent (its heartbeats stop: killed, frozen) while node 0's rank sits in no
    collective: node 0 stops its rank for it, spends a restart, and its next round times out. Its
    end named that rank the root cause, `killed by SIGTERM` (ranktop's own stop, `failed in
    attempt_0`): the agent forgot why the group had ended as it joined the next round. Now no rank
    is blamed: the round's time-out ends the run, and attempt_0 ended with the lost node."""
    from ranktop.core.rendezvous import Rendezvous, create_handler, parse_rdzv_conf

    endpoint, conf = f"127.0.0.1:{free_port()}", CONF.replace("join_timeout=40", "join_timeout=2") + LAPSE
    agent, handler = _in_process_node(tmp_path, "lost-then-timed-out", endpoint, 2, conf)
    lost = create_handler("c10d", endpoint, "lost-then-timed-out", 2, 2, conf=parse_rdzv_conf(conf),
                          local_addr="127.0.0.1")

    def join_then_go_silent() -> None:
        Rendezvous(lost, "default", 1).next_round()
        agent.wait_started(TIMEOUT)
        lost._stop_heartbeats()  # as its process ended

    threading.Thread(target=join_then_go_silent, daemon=True).start()
    try:
        result = agent.run()
    finally:
        lost.shutdown()
        handler.shutdown()
    assert result.rendezvous_error == "the c10d rendezvous 'lost-then-timed-out' timed out: not enough nodes joined"
    assert result.root_cause is None, result.root_cause
    (earlier,) = agent.snapshot().earlier_attempts
    assert re.fullmatch(r"attempt_0: node 127\.0\.0\.1 \(group rank [01]\) of the c10d rendezvous "
                        r"'lost-then-timed-out' is gone: no keep-alive heartbeat of its for over 4 s .*", earlier), earlier


@pytest.mark.parametrize("bad, error", [
    # node 1's role and size, as group rank 0 reads them to plan every node's ranks
    ({"torchelastic/role_info/1": '{"role": "default", "local_world_size": -5}'}, "node 1's role and size"),
    ({"torchelastic/role_info/1": '["x"]'}, "node 1's role and size"),
    ({"torchelastic/role_info/1": "[" + "0," * 600_000 + "0]"}, "node 1's role and size in the store is 1200003 bytes, over 1048576"),
    # this node's ranks, as group rank 0 wrote them (group rank 1 reads its own)
    ({"torchelastic/assigned_ranks/1": "[-3, 4, 0, 4]"}, "the ranks assigned to this node"),
    ({"torchelastic/assigned_ranks/1": "[2, 1000000000000, 2, 4]"}, "the ranks assigned to this node"),
    ({"torchelastic/assigned_ranks/1": '"\\u001b]0;x\\u0007"'}, "the ranks assigned to this node"),
    # where the ranks meet
    ({"ranktop/ranks_store/0": '["evil host\\u001b[2J", 80]'}, "the ranks' master in the store"),
    ({"ranktop/ranks_store/0": '["10.0.0.1", 70000]'}, "the ranks' master in the store"),
])
def test_what_a_peer_wrote_for_the_ranks_is_checked_before_the_ranks_get_it(torch_installed, bad, error):
    """Anyone who reaches the store can write it: a negative rank, a world of 10**12 or a master
    host with an escape sequence went to the ranks' environment (or ended the round in an unpacking
    error). Each is a one-line ValueError, which the round's failure says, cleaned."""
    import torch.distributed as dist
    from ranktop.core.rendezvous import assign_ranks, published_master

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    good = {"torchelastic/role_info/1": '{"role": "default", "rank": 1, "local_world_size": 2}',
            "torchelastic/assigned_ranks/1": "[2, 4, 2, 4]", "ranktop/ranks_store/0": '["127.0.0.1", 29400]'}
    for key, value in {**good, **bad}.items():
        store.set(key, value)

    def place(group_rank: int) -> tuple:
        return (*assign_ranks(store, group_rank, 2, "default", 2), *published_master(store, 0, ("127.0.0.1", 1))[:2])

    if "role_info" in next(iter(bad)):  # read by group rank 0, which plans
        with pytest.raises(ValueError, match=re.escape(error)) as failed:
            place(0)
    else:
        with pytest.raises(ValueError, match=re.escape(error)) as failed:
            place(1)
    assert "\x1b" not in str(failed.value) and "\n" not in str(failed.value)
    for key, value in good.items():  # (good values place the node)
        store.set(key, value)
    assert place(1) == (2, 4, 2, 4, "127.0.0.1", 29400)
