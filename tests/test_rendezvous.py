"""Multi-node through torch's rendezvous, for real: several ranktop processes on loopback, each
one node (`--headless`), meeting through a c10d store that the first of them serves, or a real
etcd: rounds, restarts, torchrun nodes beside ranktop's, the static form, bad input.
(Waiting for nodes, the exit barrier and lost stores: test_rendezvous_ends.py.)

Skipped where torch is not importable (the without-torch tests fake that themselves).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT, freeze, ranktop_cmd, read_line, run_ranktop, stop_process, wait_for
from ranktop.core.spec import free_port
from rdzv_job import CONF, RANK, TIMEOUT, Job, events, node_events, placements, start_etcd, wait_until_joining


def test_two_nodes_allreduce_over_c10d(tmp_path, torch_installed):
    job = Job(tmp_path, "two-nodes")
    for _ in range(2):
        job.start("allreduce", nproc=2)
    results = job.finish()
    for status, out, err in results:
        assert status == 0, err
        assert out.count("SUM 6 world 4") == 2, out
    placed = [p for _, out, _ in results for p in placements(out)]
    assert sorted(int(p["RANK"]) for p in placed) == [0, 1, 2, 3]
    assert {p["TORCHELASTIC_RUN_ID"] for p in placed} == {"two-nodes"}
    assert {p["GROUP_WORLD_SIZE"] for p in placed} == {"2"}
    # one run id for every node: the run directory is named after the rendezvous id
    for node in ("node0", "node1"):
        assert (tmp_path / node / "two-nodes" / "attempt_0").is_dir()
        assert any(e["event"] == "rendezvous_joined" and e["round"] == 0 for e in events(tmp_path / node))


def test_nodes_with_different_nproc_and_roles_get_torchruns_ranks(tmp_path, torch_installed):
    job = Job(tmp_path, "mixed")
    job.start("print", nproc=2, extra=("--role", "trainer"))
    job.start("print", nproc=1, extra=("--role", "reader"))
    results = job.finish()
    by_group = {}
    for status, out, err in results:
        assert status == 0, err
        for p in placements(out):
            by_group.setdefault(int(p["GROUP_RANK"]), []).append(p)
    # global ranks run through the nodes in group-rank order, whichever node that is
    sizes = [len(by_group[g]) for g in (0, 1)]
    expected = list(range(3))
    got = sorted(int(p["RANK"]) for g in (0, 1) for p in by_group[g])
    assert got == expected and sorted(sizes) == [1, 2]
    first = sorted(int(p["RANK"]) for p in by_group[0])
    assert first == list(range(sizes[0]))
    # role ranks count within one role: the trainer's two ranks, the reader's one
    roles = {p["ROLE_WORLD_SIZE"]: sorted(q["ROLE_RANK"] for q in by_group[g]) for g in (0, 1) for p in by_group[g]}
    assert roles == {"2": ["0", "1"], "1": ["0"]}
    assert {p["WORLD_SIZE"] for g in (0, 1) for p in by_group[g]} == {"3"}


@pytest.mark.parametrize(("group_rank_0", "identical"), [("ranktop", False), ("torchrun", False), ("ranktop", True)],
                         ids=["ranktop-first", "torchrun-first", "worker-identical"])
def test_a_ranktop_node_and_a_torchrun_node_make_one_job(tmp_path, torch_installed, group_rank_0, identical):
    """The same c10d line on two nodes, one launched by ranktop and one by torchrun: one world of
    four ranks whose gloo all-reduce meets, whichever launcher is group rank 0. With torch's
    TORCH_ELASTIC_WORKER_IDENTICAL=1 neither node writes its role to the store (a ranktop node that
    waited for the torchrun node's would wait for ever). torchrun-first: the ranktop node's ranks
    run on once the torchrun node's are done, and the torchrun agent at its exit barrier, whose
    keep-alive heartbeats stop there, is not taken for a lost node (the ranktop node stopped its
    ranks and ended the job, exit 1)."""
    job = Job(tmp_path, f"with-torchrun-{group_rank_0}")
    if identical:
        job.env["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"
    ours_last = group_rank_0 == "torchrun"
    if ours_last:  # a heartbeat lapses after 3 s
        job.conf = f"{CONF},keep_alive_interval=1,keep_alive_max_attempt=3"
    release = tmp_path / "release"
    modes = {"ranktop": ("allreduce-until-file", str(release)) if ours_last else ("allreduce",),
             "torchrun": ("allreduce",)}
    starts = {"ranktop": job.start, "torchrun": job.start_torchrun}
    other = "torchrun" if group_rank_0 == "ranktop" else "ranktop"
    starts[group_rank_0](*modes[group_rank_0], nproc=2, local_addr="127.0.0.1")
    starts[other](*modes[other], nproc=2, local_addr="127.0.0.2")
    if ours_last:
        line = (f"ranktop: node 127.0.0.1 (group rank 0) of the c10d rendezvous '{job.rdzv_id}' waits at the exit "
                "barrier, its ranks done: torchrun's agent sends no keep-alive heartbeats there, so it is not "
                "taken for gone\n")
        read_line(job.nodes[1].stderr, TIMEOUT, "the line about the torchrun node at its exit barrier", equal_to=line)
        release.touch()
    results = dict(zip((group_rank_0, other), job.finish(), strict=True))
    for launcher, (status, out, err) in results.items():
        assert status == 0, (launcher, err[-3000:])
        assert out.count("SUM 6 world 4") == 2, (launcher, out)
    ours = placements(results["ranktop"][1])
    assert {p["GROUP_RANK"] for p in ours} == {"0" if group_rank_0 == "ranktop" else "1"}
    placed = ours + placements(results["torchrun"][1])
    assert sorted(int(p["RANK"]) for p in placed) == [0, 1, 2, 3]
    # the ranks meet on the store torch's handler shares, as a torchrun node's ranks must
    assert {(p["MASTER_ADDR"], p["TORCHELASTIC_USE_AGENT_STORE"]) for p in placed} == {("127.0.0.1", "True")}
    ranktop_node = "node0" if group_rank_0 == "ranktop" else "node1"
    assert (tmp_path / ranktop_node / job.rdzv_id / "attempt_0").is_dir()  # the rendezvous id names the run


def test_the_static_line_without_a_backend_makes_one_job_with_a_torchrun_node(tmp_path, torch_installed):
    """torchrun's most common multi-node line (--nnodes 2 --node-rank R --master-addr/-port, no
    --rdzv-backend) is torch's static rendezvous: a ranktop node and a torchrun node make one job."""
    port = str(free_port())
    flags = ("--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port)
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *flags, "--node-rank", "0",
                                 RANK, "allreduce"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "LOGLEVEL": "ERROR", "PYTHONWARNINGS": "ignore"})
    try:
        ours = run_ranktop("--headless", *flags, "--node-rank", "1", "--log-dir", str(tmp_path), RANK, "allreduce",
                           timeout=TIMEOUT)
        theirs = torchrun.communicate(timeout=TIMEOUT)
    finally:
        stop_process(torchrun)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert torchrun.returncode == 0, theirs[1][-3000:]
    assert ours.stdout.count("SUM 6 world 4") == 2 and theirs[0].count("SUM 6 world 4") == 2
    assert sorted(p["RANK"] for p in placements(ours.stdout)) == ["2", "3"]
    assert "static rendezvous" in ours.stdout + ours.stderr


def test_two_nodes_through_torchs_static_rendezvous(tmp_path, torch_installed):
    job = Job(tmp_path, "static", backend="static")
    for node_rank in (1, 0):  # the group rank is the --node-rank, whoever starts first
        job.start("print", extra=("--node-rank", str(node_rank)))
    results = job.finish()
    for status, _out, err in results:
        assert status == 0, err
    placed = [placements(out)[0] for _, out, _ in results]
    assert [(p["GROUP_RANK"], p["RANK"], p["WORLD_SIZE"]) for p in placed] == [("1", "1", "2"), ("0", "0", "2")]


STATIC_LINE = ("--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--max-restarts", "1")


def _static_nodes(tmp_path: Path, launchers: list[list[str]], *rank_args: str) -> list[subprocess.Popen]:
    """Two nodes on torchrun's static line (no --rdzv-backend), node ranks 0 and 1, one launcher each."""
    port = str(free_port())
    env = {**os.environ, "LOGLEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
    return [subprocess.Popen([*launcher, *STATIC_LINE, "--master-port", port, "--node-rank", str(r), RANK, *rank_args],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for r, launcher in enumerate(launchers)]


def _ranktop_node(tmp_path: Path, name: str) -> list[str]:
    return ranktop_cmd("--headless", "--log-dir", str(tmp_path / name), "--shutdown-timeout", "2",
                       "--monitor-interval", "0.2")


@pytest.mark.parametrize("mode", ["allreduce-fail-first", "allreduce-busy-fail-first"], ids=["idle", "in-collective"])
def test_a_static_job_restarts_on_every_node_when_one_nodes_rank_fails(tmp_path, torch_installed, mode):
    """torch's static rendezvous has no rounds: node 1 restarting alone read the first start's ranks
    and master again and its ranks waited for ever, while node 0's idle ranks never noticed. Each
    later start now meets first, and a node whose peer waits there restarts its group too."""
    nodes = _static_nodes(tmp_path, [_ranktop_node(tmp_path, "node0"), _ranktop_node(tmp_path, "node1")], mode, "1")
    results = []
    try:
        results = [(node.wait(TIMEOUT), *node.communicate()) for node in nodes]
    finally:
        for node in nodes:
            stop_process(node)
    for status, out, err in results:
        assert status == 0, err[-3000:]
        assert out.count("SUM 1 world 2") == 2, out  # both starts' all_reduce, over both nodes
        assert [p["TORCHELASTIC_RESTART_COUNT"] for p in placements(out)] == ["0", "1"], out
    for node in ("node0", "node1"):
        restarts = [(e["reason"], e["attempt"]) for e in events(tmp_path / node) if e["event"] == "group_restart"]
        assert restarts == [("failure", 1)]
        masters = [e["master"] for e in events(tmp_path / node) if e["event"] == "rendezvous_joined"]
        assert len(set(masters)) == 2  # a fresh store for each start, not the static port
    # node 0: its idle rank stopped for node 1's failure; in a collective, the rank may fail first
    said = [ln for ln in results[0][2].splitlines() if "restarting the group" in ln]
    assert len(said) == 1 and said[0].endswith("; restarting the group: attempt_1 (1 of 1 restarts spent)"), said
    if mode == "allreduce-fail-first":
        assert said[0].startswith("ranktop: another node of the static rendezvous 'none' failed;"), said
    assert "ranktop: rank 1 failed (exit 3); restarting the group: attempt_1 (1 of 1 restarts spent)" in results[1][2]


def test_a_static_job_with_a_torchrun_node_ends_a_restart_in_one_line(tmp_path, torch_installed):
    """torchrun's static rendezvous has no rounds for a later start to meet in: the ranktop node
    says so and ends, exit 1, rather than waiting for ranks that are not coming."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "0.2"]
    nodes = _static_nodes(tmp_path, [torchrun, _ranktop_node(tmp_path, "node1")], "allreduce-fail-first", "1")
    try:
        status, _out, err = nodes[1].wait(TIMEOUT), *nodes[1].communicate()
    finally:
        for node in nodes:  # the torchrun node's rank waits for ever, as without ranktop
            stop_process(node)
    assert status == 1, err[-3000:]
    assert ("ranktop: error: the static rendezvous 'none' cannot start the group again: a node of it is "
            "torchrun's, whose static rendezvous has no rounds to meet in") in err, err[-3000:]


def _placed(tmp_path: Path, node: str) -> bool:
    """Whether `node`'s first rank has started and printed where the round placed it."""
    return any(b"PLACED" in p.read_bytes() for p in tmp_path.glob(f"{node}/*/attempt_0/0/stdout.log"))


@pytest.mark.parametrize("line", ["static", "rendezvous-store"])
def test_ranks_that_lose_their_store_with_its_node_are_stopped_at_once(tmp_path, torch_installed, line):
    """The node serving the store is killed while the other's rank is idle (in no collective, as
    one starting up or loading data). Under the static line group rank 0 serves the job's store and
    the ranks'; with ranks_store=rendezvous the ranks use the rendezvous's: their store is gone, and
    they waited for ever (in init_process_group: for their own time-out) with nothing said. The
    other node now stops them within seconds, exit 1, one line, no rank blamed, no restart."""
    if line == "static":
        host, other = _static_nodes(tmp_path, [_ranktop_node(tmp_path, "node0"), _ranktop_node(tmp_path, "node1")],
                                    "fail-first", "5")  # (no rank 5: every rank waits until stopped)
        lost = "ranktop: error: lost the static rendezvous 'none''s store at "
    else:
        job = Job(tmp_path, "store-lost", conf=ONE_STORE)
        host, other = (job.start("fail-first", "5", local_addr=f"127.0.0.{n + 1}",
                                 extra=("--max-restarts", "1", "--rdzv-conf", f"{ONE_STORE},is_host={int(n == 0)}"))
                       for n in (0, 1))
        lost = "ranktop: error: lost the c10d rendezvous 'store-lost''s store at "
    try:
        wait_for(lambda: _placed(tmp_path, "node1"), timeout=TIMEOUT, what="node 1's rank placed")
        host.kill()
        status, err = other.wait(TIMEOUT), other.communicate()[1]
    finally:
        for node in (host, other):
            stop_process(node)
    assert status == 1, err[-3000:]
    (run_dir,) = tmp_path.glob("node1/*/events.jsonl")
    last, logs = err.rstrip().splitlines()[-2:]  # (the run's directory under the error, as under a root cause)
    assert last.startswith(lost) and last.endswith("(the node serving it is gone?), and this node's ranks' "
                                                   "store with it; this node stops"), err[-3000:]
    assert logs == f"  logs: {run_dir.parent}", err[-3000:]
    assert "this node's ranks run on" not in err, err[-3000:]  # (they are stopped: not said where they are not)
    assert sum("this node's ranks meet on it too, and are stopped if it is found gone" in line
               for line in err.splitlines()) == 1, err[-3000:]
    assert "root cause" not in err and "restarting" not in err and "Traceback" not in err, err[-3000:]
    assert [e["kind"] for e in events(tmp_path / "node1") if e["event"] == "round_end"] == ["store_lost"]


def _two_nodes_all_reduced(job: Job) -> list[str]:
    """Two nodes waiting for a world of three, started; their stdout up to the line that says their
    two-node group all-reduced (kept: a newcomer joining earlier would restart the group before it
    ever ran)."""
    first = [job.start("wait-world", "3") for _ in range(2)]
    seen = ["", ""]
    for i, node in enumerate(first):
        while "SUM 1 world 2" not in seen[i]:
            line = node.stdout.readline()
            assert line, node.stderr.read()
            seen[i] += line
    return seen


def test_third_node_joining_restarts_the_group_without_spending_a_restart(tmp_path, torch_installed):
    job = Job(tmp_path, "scale-up", nnodes="2:3")
    seen = _two_nodes_all_reduced(job)
    job.start("wait-world", "3")
    results = [(status, (seen[i] if i < 2 else "") + out, err) for i, (status, out, err) in enumerate(job.finish())]
    for status, _out, err in results:
        assert status == 0, err
    for node in ("node0", "node1"):  # the first two restarted their group once, for the newcomer
        restarts = [(e["reason"], e["attempt"]) for e in events(tmp_path / node) if e["event"] == "group_restart"]
        assert restarts == [("nodes_joined", 0)]
        assert (tmp_path / node / "scale-up" / "attempt_0.1").is_dir()
    assert not [e for e in events(tmp_path / "node2") if e["event"] == "group_restart"]
    third = placements(results[2][1])
    assert [p["WORLD_SIZE"] for p in third] == ["3"]
    assert third[0]["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert [out.count("SUM 3 world 3") for _, out, _ in results] == [1, 1, 1]
    assert [out.count("SUM 1 world 2") for _, out, _ in results] == [1, 1, 0]
    for _status, out, _err in results[:2]:
        assert [p["WORLD_SIZE"] for p in placements(out)][-1] == "3"
        assert [p["TORCHELASTIC_RESTART_COUNT"] for p in placements(out)][-1] == "0"


def test_failure_with_restarts_left_re_rendezvous_on_both_nodes(tmp_path, torch_installed):
    job = Job(tmp_path, "retry")
    for _ in range(2):
        job.start("fail-first", "1", extra=("--max-restarts", "1"))
    results = job.finish()
    for status, out, err in results:
        assert status == 0, err
        restarts = [p["TORCHELASTIC_RESTART_COUNT"] for p in placements(out)]
        assert restarts == ["0", "1"], out
    # One console line for the restart on each node; the node whose rank ranktop stopped for the
    # other node's failure says so, and blames none of its own (it used to print two lines, the
    # second "rank 0 failed (signal SIGTERM)").
    lines = sorted([ln for ln in err.splitlines() if "restarting the group" in ln] for _, _, err in results)
    assert lines == [["ranktop: another node of the c10d rendezvous 'retry' failed; restarting the group: "
                      "attempt_1 (1 of 1 restarts spent)"],
                     ["ranktop: rank 1 failed (exit 3); restarting the group: attempt_1 (1 of 1 restarts spent)"]], lines
    for node in ("node0", "node1"):
        started = events(tmp_path / node)[0]  # before any round: what a round decides is not there yet
        assert started["event"] == "run_started" and started["run_id"] == "retry"
        assert (started["world_size"], started["node_rank"], started["master_port"]) == (None, None, None)
        rounds = [e["round"] for e in events(tmp_path / node) if e["event"] == "rendezvous_joined"]
        assert len(rounds) == 2 and rounds[1] > rounds[0]
        assert (tmp_path / node / "retry" / "attempt_1").is_dir()


ONE_STORE = CONF + ",ranks_store=rendezvous"


def test_on_the_rendezvous_store_a_restarted_group_meets_again_with_no_other_port(tmp_path, torch_installed):
    """--rdzv-conf ranks_store=rendezvous: the ranks meet on the c10d store itself (MASTER_PORT is
    the endpoint's), and a group restarted after a rank failed initialises gloo afresh: the first
    group's keys, unprefixed in that store, are gone (left there, the second group dialled the
    first one's ranks and failed)."""
    job = Job(tmp_path, "one-store-retry", conf=ONE_STORE)
    for _ in range(2):
        job.start("allreduce-fail-first", "1", extra=("--max-restarts", "1"))
    results = job.finish()
    port = job.endpoint.rpartition(":")[2]
    for status, out, err in results:
        assert status == 0, err
        placed = placements(out)
        assert [p["TORCHELASTIC_RESTART_COUNT"] for p in placed] == ["0", "1"], out
        assert {(p["MASTER_ADDR"], p["MASTER_PORT"], p["TORCHELASTIC_USE_AGENT_STORE"]) for p in placed} == \
            {("127.0.0.1", port, "True")}
        assert out.count("SUM 1 world 2") == 2, out  # one all-reduce in each start of the group
    for node in ("node0", "node1"):
        masters = {e["master"] for e in events(tmp_path / node) if e["event"] == "rendezvous_joined"}
        assert masters == {job.endpoint}


def test_on_the_rendezvous_store_a_node_joining_later_forms_a_working_group(tmp_path, torch_installed):
    """Elastic --nnodes 2:3 with ranks_store=rendezvous: two nodes all-reduce, a third joins, and
    the three-node group (a new round on the same store) all-reduces too, on the endpoint's port."""
    job = Job(tmp_path, "one-store-scale-up", nnodes="2:3", conf=ONE_STORE)
    seen = _two_nodes_all_reduced(job)
    job.start("wait-world", "3")
    results = [(status, (seen[i] if i < 2 else "") + out, err) for i, (status, out, err) in enumerate(job.finish())]
    port = job.endpoint.rpartition(":")[2]
    for status, out, err in results:
        assert status == 0, err
        assert out.count("SUM 3 world 3") == 1, out
        assert {p["MASTER_PORT"] for p in placements(out)} == {port}
        assert placements(out)[-1]["WORLD_SIZE"] == "3"


def test_a_lost_node_ends_the_other_after_one_round_naming_the_attempt_that_failed(tmp_path, torch_installed):
    """Node loss: node 1's ranktop is SIGKILLed mid-run (its guard ends its ranks). Node 0's ranks
    lose their collective, it spends a restart and waits for a round that never completes: one
    line when join_timeout runs out, exit 1. The root cause is the failure of attempt_0: the headline
    named the second attempt (attempt_1), whose ranks never started."""
    job = Job(tmp_path, "node-lost")
    conf = "join_timeout=4,last_call_timeout=1,close_timeout=5,is_host="  # (which node serves the store)
    job.start("wait-world", "3", extra=("--max-restarts", "1", "--rdzv-conf", conf + "1"), local_addr="127.0.0.1")
    lost = job.start("wait-world", "3", extra=("--max-restarts", "1", "--rdzv-conf", conf + "0"), local_addr="127.0.0.2")
    wait_for(lambda: any(b"SUM" in p.read_bytes() for p in tmp_path.glob("node0/*/attempt_0/0/stdout.log")),
             timeout=TIMEOUT, what="the ranks' first all_reduce")
    lost.kill()
    (status0, _, err0), (status1, _, _) = job.finish()
    assert (status0, status1) == (1, -signal.SIGKILL), err0
    assert "ranktop: rank 0 failed (exit 1); restarting the group: attempt_1 (1 of 1 restarts spent)" in err0
    assert "ranktop: rdzv_rank.py failed in attempt_0 (1 of 2 attempts)\n  root cause: rank 0 " in err0, err0
    assert err0.rstrip().endswith("ranktop: error: the c10d rendezvous 'node-lost' timed out: not enough nodes joined"), err0
    assert not list(tmp_path.glob("node0/*/attempt_1")), "no rank of the second attempt started"
    (final,) = tmp_path.glob("node0/*/final.json")
    ended = json.loads(final.read_text())
    assert ended["root_cause"]["attempt"] == 0 and ended["attempt"] == 1
    # the round it waited for, never formed; the world, node and round of the last one that did
    assert ended["forming"] == {"number": 1, "joined": None, "nodes": "2"}, ended["forming"]
    assert (ended["round"], ended["world_size"], ended["node_rank"]) == (0, 2, 0)
    # (the ranks shown are attempt 0's: restarted none; they said ⟳1, the restart that never started)
    assert [r["restarts"] for r in ended["ranks"]] == [0], ended["ranks"]
    # What its TUI (or `ranktop attach` of it) leaves in the terminal named the failure twice, the
    # headline's attempt_0 again as `earlier attempts: attempt_0: rank 0 failed (exit 1)`.
    from ranktop.core.client import FinalEngine
    from ranktop.core.report import report_after_tui
    from ranktop.tui.screens import root_cause_text

    snap = FinalEngine(str(final)).snapshot()
    assert snap.earlier_attempts == ("attempt_0: rank 0 failed (exit 1)",), snap.earlier_attempts
    after_tui = report_after_tui(snap)
    assert after_tui.startswith("ranktop: rdzv_rank.py failed in attempt_0 (1 of 2 attempts)\n"), after_tui
    assert "earlier attempts" not in after_tui and "attempt_0: " not in after_tui, after_tui
    panel = root_cause_text(snap).plain  # the TUI's end panel: the attempt in its heading, no earlier line
    assert ", attempt_0 (pid " in panel and "earlier" not in panel and panel.count("attempt_0 ") == 1, panel


def test_a_node_out_of_restarts_for_a_peers_failure_blames_none_of_its_ranks(tmp_path, torch_installed):
    """Node 1 (a restart left) restarts for its rank's failure; node 0 has none left (its own
    --max-restarts, or a node that joined an elastic job later and has spent fewer): ranktop
    stopped node 0's rank for the peer's failure, and it gives up. It named that rank the root
    cause, `killed by SIGTERM`, and told the peer `rank 0 failed (exit -15)`."""
    job = Job(tmp_path, "peer-failed")
    job.start("fail-first", "1", extra=("--max-restarts", "0"), local_addr="127.0.0.1")
    job.start("fail-first", "1", extra=("--max-restarts", "1"), local_addr="127.0.0.2")
    (status0, _, err0), (status1, _, err1) = job.finish()
    assert (status0, status1) == (1, 1), (err0, err1)
    assert "root cause" not in err0, err0
    (run_dir,) = tmp_path.glob("node0/*/events.jsonl")
    assert err0.rstrip().endswith("ranktop: error: another node of the c10d rendezvous 'peer-failed' failed, "
                                  f"and this node has no restarts left (0 of 0 spent)\n  logs: {run_dir.parent}"), err0
    assert "root cause: rank 1 (local rank 0" in err1 and "exited with code 3" in err1, err1
    assert err1.rstrip().endswith("gave up: its ranks were stopped for another node's failure, no restarts left "
                                  "(0 of 0 spent)); this node stops"), err1
    finished = [e for e in events(tmp_path / "node0") if e["event"] == "run_finished"]
    assert finished[0]["root_cause_rank"] is None and finished[0]["exit_status"] == 1
    # node 1, out of its round for the next one, is alive: node 0 waited until it had read why
    closed = [e["others"] for e in events(tmp_path / "node0") if e["event"] == "rendezvous_closed"]
    assert closed == ["read"], closed


def test_a_node_placed_in_a_round_its_nnodes_did_not_ask_for_says_so(tmp_path, torch_installed):
    """--nnodes 3 on one node, 2 on the other: one round serves both, and the --nnodes of the node
    that joins last decides it (torch's: had the 3-node one joined last, neither would have
    completed it, and both time out). The other ran in a world it did not ask for without a word."""
    job = Job(tmp_path, "nnodes-differ")
    job.nnodes = "3"
    job.start("print", local_addr="127.0.0.2")
    wait_until_joining(tmp_path, "node0")
    job.nnodes = "2"
    job.start("print", local_addr="127.0.0.1")
    (status1, out1, err1), (status0, _, err0) = job.finish()
    assert (status0, status1) == (0, 0), (err0, err1)
    assert placements(out1)[0]["WORLD_SIZE"] == "2"
    assert "warning" not in err0, err0
    assert ("ranktop: warning: the round has 2 nodes, not this node's --nnodes 3: another node's --nnodes "
            "decided it (give every node the same)") in err1.splitlines(), err1
    # (the first node started logs under node0/)
    assert any(e["event"] == "rendezvous_size_not_asked" and e["nodes"] == 2 for e in events(tmp_path / "node0"))


@pytest.mark.parametrize(("mode", "how"), [("fail", "exit 3"), ("kill", "signal SIGKILL")])
def test_giving_up_closes_the_rendezvous_and_stops_the_other_node(tmp_path, torch_installed, mode, how):
    """The node whose rank failed says why to the others, in the words of its restart line (a rank
    killed by a signal was `exit -9`)."""
    job = Job(tmp_path, "give-up")
    for _ in range(2):
        job.start(mode, "1")
    results = job.finish()
    assert all(status == 1 for status, _, _ in results), results
    gave_up = [err for _, _, err in results if "gave up:" in err]
    assert len(gave_up) == 1, results
    line = [ln for ln in gave_up[0].splitlines() if "gave up:" in ln][0]
    assert line.startswith("ranktop: error: node ") and f"rank 1 failed ({how}), no restarts left" in line
    assert "rendezvous 'give-up' is closed, this node stops" in line


def test_without_torch_a_rendezvous_backend_is_a_one_line_error(tmp_path):
    res = run_ranktop("--headless", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
                      "--log-dir", str(tmp_path), RANK, "print", without="torch")
    assert res.returncode == 2
    assert res.stderr.startswith("ranktop: error: --rdzv-backend c10d needs torch, and torch is not installed "
                                 "(pip install torch)")
    assert len(res.stderr.splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing started, no run directory
    # the static backend without torch is ranktop's own static form, exactly as without the flag
    res = run_ranktop("--headless", "--rdzv-backend", "static", "--log-dir", str(tmp_path), "--run-id", "plain",
                      RANK, "print", without="torch")
    assert res.returncode == 0, res.stderr
    assert placements(res.stdout)[0]["WORLD_SIZE"] == "1"


@pytest.mark.parametrize(("conf", "message"), [
    ("join_timeout", "bad --rdzv-conf 'join_timeout': expected KEY=VALUE"),
    ("ranks_store=rendezvous", "--rdzv-conf ranks_store=rendezvous needs --rdzv-backend c10d, not static"),
])
def test_without_torch_the_static_forms_bad_rdzv_conf_is_a_one_line_error(tmp_path, conf, message):
    """ranktop's own static form checks --rdzv-conf as torch's does (it went unread: the run started)."""
    res = run_ranktop("--headless", "--rdzv-backend", "static", "--rdzv-conf", conf, "--log-dir", str(tmp_path),
                      RANK, "print", without="torch")
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"ranktop: error: {message}") and len(res.stderr.splitlines()) == 1, res.stderr
    assert not list(tmp_path.iterdir())  # nothing started


@pytest.mark.parametrize("flags", [
    ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1"),
    ("--nnodes", "2", "--node-rank", "1"),  # torch's static rendezvous, as torchrun's default
    ("--nproc-per-node", "xpu"),
])
def test_a_torch_that_fails_to_import_is_named_not_pip_installed(tmp_path, flags):
    """torch installed but broken (here: a torch package whose import raises): the one line names
    the import's error; `pip install torch` would not mend it."""
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise ImportError('boom')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(broken), str(ROOT)])}
    res = run_ranktop("--headless", "--log-dir", str(tmp_path / "logs"), *flags, RANK, "print", env=env)
    assert res.returncode == 2, res.stderr
    assert "needs torch, and torch failed to import: boom" in res.stderr and "pip install" not in res.stderr
    assert res.stderr.startswith("ranktop: error: ") and len(res.stderr.splitlines()) == 1, res.stderr
    assert not (tmp_path / "logs").exists()  # nothing started, no run directory


@pytest.mark.parametrize(("flags", "message"), [
    (("--rdzv-conf", "join_timeout"), "bad --rdzv-conf 'join_timeout': expected KEY=VALUE"),
    (("--nnodes", "3:2"), "bad --nnodes '3:2': expected N or MIN:MAX with 1 <= MIN <= MAX"),
    (("--nnodes", "0:2"), "bad --nnodes '0:2'"),
    (("--rdzv-conf", "ranks_store=shared"), "bad --rdzv-conf ranks_store=shared: expected fresh or rendezvous"),
    (("--rdzv-backend", "static", "--rdzv-conf", "ranks_store=rendezvous"),
     "--rdzv-conf ranks_store=rendezvous needs --rdzv-backend c10d, not static"),
])
def test_bad_rendezvous_flags_are_one_line_errors(tmp_path, flags, message):
    res = run_ranktop("--headless", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
                      "--log-dir", str(tmp_path), *flags, RANK, "print")
    assert res.returncode == 2
    assert res.stderr.startswith(f"ranktop: error: {message}") and len(res.stderr.splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_restarting_one_rank_restarts_the_group_and_the_snapshot_shows_the_round(tmp_path, torch_installed):
    from ranktop.core import GroupState, LocalAgent, WorkerSpec, WorkerState
    from ranktop.core.rendezvous import create_handler, parse_rdzv_conf

    handler = create_handler("c10d", f"127.0.0.1:{free_port()}", "solo", 1, 1, conf=parse_rdzv_conf(CONF),
                             local_addr="127.0.0.1")
    spec = WorkerSpec(role="default", local_world_size=2, entrypoint=sys.executable, args=(RANK, "wait-world", "9"),
                      rdzv_handler=handler)
    agent = LocalAgent(spec, log_dir=str(tmp_path), console=False, shutdown_timeout=2)
    results = []
    thread = threading.Thread(target=lambda: results.append(agent.run()))
    thread.start()
    try:
        assert agent.wait_started(30)
        first = agent.snapshot()
        assert (first.round, first.node_rank, first.nnodes, first.attempt) == (0, 0, 1, 0)
        agent.restart_rank(1)  # one new rank could not rejoin the others' collectives: all restart
        again = wait_for(lambda: (s := agent.snapshot()).attempt == 1 and s.state == GroupState.RUNNING and s,
                         timeout=30, what="the group's second start")
        assert again.round == 1
    finally:
        agent.stop()
        thread.join(30)
    assert results[0].state == WorkerState.STOPPED
    log = events(tmp_path)
    assert [e["reason"] for e in log if e["event"] == "group_restart"] == ["user"]
    assert not any(e["event"] == "user_restart_rank" for e in log)


def test_a_backend_torch_does_not_have_is_a_one_line_error(tmp_path, torch_installed):
    res = run_ranktop("--headless", "--rdzv-backend", "nope", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                      "--log-dir", str(tmp_path), RANK, "print")
    assert res.returncode == 2
    assert res.stderr.startswith("ranktop: error: bad rendezvous (--rdzv-backend nope")
    assert len(res.stderr.splitlines()) == 1
    assert not list(tmp_path.iterdir())


# ----- etcd: a real etcd server (Debian's etcd-server, v2 API on) and python-etcd -------------------
# CI installs both (.ci/run, the `test` extra): missing, these tests fail rather than skip.

@pytest.fixture
def etcd_server(tmp_path, torch_installed):
    """A throwaway etcd on loopback ports, v2 API on (torch's etcd backends speak v2); its
    endpoint. Stopped and reaped after the test."""
    yield from _etcd(tmp_path, "--enable-v2")


@pytest.fixture
def etcd_v3_only(tmp_path, torch_installed):
    """The same etcd without its v2 API (etcd 3.4's default)."""
    yield from _etcd(tmp_path)


def _etcd(tmp_path: Path, *flags: str):
    client, peer = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    server = start_etcd(tmp_path, client, peer, *flags)
    try:
        yield client.removeprefix("http://")
    finally:
        stop_process(server)


@pytest.mark.parametrize(("backend", "rank"), [("etcd", ("allreduce",)), ("etcd-v2", ("fail-first", "1"))],
                         ids=["etcd", "etcd-v2"])
def test_two_nodes_through_a_real_etcd_server(tmp_path, etcd_server, backend, rank):
    """torch's etcd handler (its own rendezvous protocol over etcd keys) and etcd-v2 (torch's
    dynamic rendezvous kept in etcd): two ranktop nodes form one world of two. Over etcd-v2 rank 1
    fails once: both nodes spend a restart, as over c10d. The peer took the failing node's new
    round for a node joining (torch's etcd store has no compare_set, where the nodes agree why the
    group ended) and spent none: its ranks started again as attempt 0."""
    restarts = rank[0] == "fail-first"
    job = Job(tmp_path, f"over-{backend}", backend=backend, endpoint=etcd_server)
    for _ in range(2):
        job.start(*rank, extra=("--max-restarts", "1") if restarts else ())
    results = job.finish()
    for status, out, err in results:
        assert status == 0, err
        assert f"ranktop: {backend} rendezvous 'over-{backend}' round 0: this node is group rank" in out + err
        if rank == ("allreduce",):
            assert "SUM 1 world 2" in out, out
    placed = [p for _, out, _ in results for p in placements(out)]
    first = [p for p in placed if p["TORCHELASTIC_RESTART_COUNT"] == "0"]
    assert sorted((p["RANK"], p["WORLD_SIZE"], p["GROUP_RANK"]) for p in first) == [("0", "2", "0"), ("1", "2", "1")]
    assert {p["TORCHELASTIC_RUN_ID"] for p in placed} == {f"over-{backend}"}
    if restarts:
        assert sorted(p["TORCHELASTIC_RESTART_COUNT"] for p in placed) == ["0", "0", "1", "1"], placed
        lines = sorted(ln for _, _, err in results for ln in err.splitlines() if "restarting the group" in ln)
        assert lines == [f"ranktop: another node of the {backend} rendezvous 'over-{backend}' failed; restarting "
                         "the group: attempt_1 (1 of 1 restarts spent)",
                         "ranktop: rank 1 failed (exit 3); restarting the group: attempt_1 (1 of 1 restarts spent)"], lines


def test_the_waiting_line_over_etcd_v1_names_its_nodes_and_time_out(etcd_server):
    """torch's legacy etcd handler has no settings to read: the waiting line named neither the nodes
    a round needs nor when it gives up. Its rendezvous keeps both, and the line says them."""
    from ranktop.core.rendezvous import Rendezvous, create_handler

    handler = create_handler("etcd", etcd_server, "etcd-v1-words", 2, 3, conf={"timeout": "45"})
    rdzv = Rendezvous(handler, "default", 1)
    assert rdzv.waiting_words() == ("waiting for nodes to join the etcd rendezvous 'etcd-v1-words' (2 to 3 nodes; "
                                    "gives up after 45 s)")
    assert rdzv.nodes_needed() == "2 to 3"


def test_etcd_without_its_client_is_a_one_line_error(tmp_path, torch_installed):
    res = run_ranktop("--headless", "--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                      "--log-dir", str(tmp_path), RANK, "print", without="etcd")
    assert res.returncode == 2
    assert res.stderr == "ranktop: error: --rdzv-backend etcd needs the etcd client: pip install python-etcd\n"
    assert not list(tmp_path.iterdir())


def test_no_etcd_server_at_the_endpoint_is_a_one_line_error(tmp_path, torch_installed):
    if importlib.util.find_spec("etcd") is None:
        pytest.fail("python-etcd is not installed (pip install python-etcd, part of the `test` extra)")
    _cannot_reach(tmp_path / "logs", "etcd-v2", f"127.0.0.1:{free_port()}")


def test_an_etcd_without_its_v2_api_is_a_one_line_error_saying_so(tmp_path, etcd_v3_only):
    said = _cannot_reach(tmp_path / "logs", "etcd", etcd_v3_only)
    assert said.endswith("(torch's etcd backends need etcd's v2 API: etcd 3.4/3.5 with --enable-v2)\n")


def _cannot_reach(log_dir: Path, backend: str, endpoint: str) -> str:
    res = run_ranktop("--headless", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
                      "--log-dir", str(log_dir), RANK, "print")
    assert res.returncode == 1
    assert res.stderr.startswith(f"ranktop: error: cannot reach the {backend} rendezvous at {endpoint}: ")
    assert len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr
    assert not log_dir.exists()
    return res.stderr


def _plugin_handler_class() -> type:
    """A torchrun plugin's handler, as torch asks it for these only: backend `mine`, run `job7`;
    its next_rendezvous calls the function it was made with (none: NotImplementedError)."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    class Plugin(RendezvousHandler):
        def __init__(self, next_round=None):
            self.next_round = next_round

        def get_backend(self) -> str:
            return "mine"

        def get_run_id(self) -> str:
            return "job7"

        def next_rendezvous(self):
            if self.next_round is None:
                raise NotImplementedError
            return self.next_round()

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def shutdown(self) -> bool:
            return True

    return Plugin


def test_a_plugin_handler_that_says_nothing_or_raises_still_gets_the_waiting_line(torch_installed):
    from ranktop.core.rendezvous import Rendezvous

    Plugin = _plugin_handler_class()  # noqa: N806 - a class

    class Raising(Plugin):
        @property
        def settings(self):
            raise RuntimeError("not configured yet")

    line = "waiting for nodes to join the mine rendezvous 'job7'"  # no counts or time-out: none said
    assert Rendezvous(Plugin(), "default", 1).waiting_words() == line
    assert Rendezvous(Raising(), "default", 1).waiting_words() == line
    # the header's forming round: the number its rounds give it, no count, no nodes
    for handler in (Plugin(), Raising()):
        assert (Rendezvous(handler, "default", 1).forming(), Rendezvous(handler, "default", 1).nodes_needed()) == \
            ((0, None), None)


def test_a_handler_error_that_says_nothing_is_named_by_where_it_was_raised(torch_installed):
    """torch 2.11's c10d handler fails a bare `assert` when a node becomes group rank 0 in a later
    round (pytorch/pytorch#182221): the round failed with `AssertionError: unknown error`, nothing
    to look up. It names the file, line and function now, and torch's version where it is torch's."""
    import torch
    from ranktop.core.rendezvous import Rendezvous, RendezvousFailed

    torch_file = "/venv/lib/python3.12/site-packages/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py"
    torch_check = compile("\n" * 1169 + "def next_rendezvous():\n    assert False\n", torch_file, "exec")
    as_torch: dict = {}
    exec(torch_check, as_torch)  # code whose frames say they are torch's, as an installed torch's do

    def bare() -> None:
        raise AssertionError

    failures = []
    for raises in (bare, as_torch["next_rendezvous"]):
        with pytest.raises(RendezvousFailed) as failed:
            Rendezvous(_plugin_handler_class()(raises), "default", 1).next_round()
        failures.append(str(failed.value))
    line = bare.__code__.co_firstlineno + 1
    assert failures == [
        f"the mine rendezvous 'job7' failed: AssertionError: no message, raised at {__file__}:{line} in bare",
        "the mine rendezvous 'job7' failed: AssertionError: no message, raised at "
        f"torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1171 in next_rendezvous (torch {torch.__version__})",
    ]


def _printed(node: Path, word: bytes, local_rank: int = 0) -> bool:
    """Whether the node's local rank printed `word` in attempt 0."""
    return any(word in log.read_bytes() for log in node.glob(f"*/attempt_0/{local_rank}/stdout.log"))


def test_a_node_that_gives_up_after_its_users_kill_says_so_to_the_others(tmp_path, torch_installed):
    """The user kills a rank on node0, its peer there fails of it and node0, out of restarts, gives
    up: node1 read only `gave up: rank 0 failed (exit 1)`, nothing of the kill that came first."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs

    job = Job(tmp_path, "kill-gives-up")
    job.start("local-pair", str(free_port()), nproc=2)
    job.start("until-file", str(tmp_path / "never"))
    try:
        wait_for(lambda: all(_printed(tmp_path / "node0", b"\nUP\n", r) for r in range(2)), timeout=TIMEOUT,
                 what="node0's ranks up")
        (node0,) = [run for run in served_runs() if run.pid == job.nodes[0].pid]
        assert RemoteEngine(node0.path).submit(cmd.KillRank(1)).ok
    finally:
        results = job.finish()
    (status0, _, err0), (status1, _, err1) = results
    assert (status0, status1) == (1, 1), results
    assert "ranktop: rdzv_rank.py failed after you killed rank 1 in attempt_0 (1 of 1 attempts)" in err0.splitlines(), err0
    (line,) = [ln for ln in err1.splitlines() if "gave up:" in ln]
    assert "gave up: rank 0 failed (exit 1) after its user killed rank 1, no restarts left (0 of 0 spent)" in line, line


# How node1 learns of node0's `R`: its watch sees node0 waiting for the next round (ranks in no
# collective), or its ranks break in their collective first (its watch looks only every 120 s: at
# 5 s, a look that fell just after the `R` came first now and then under CI's load).
@pytest.mark.parametrize("seen_by", ["watch", "ranks"])
def test_a_group_restart_on_one_node_is_the_next_attempt_on_every_node(tmp_path, torch_installed, seen_by):
    """The user's `R` on node0 of a two-node job (no --max-restarts). Node1's ranks broke in their
    collective when node0 stopped its own, and node1 took it for a failure with no restart left: it
    gave up and ended the job, for a restart the user asked for (or, where it saw node0 waiting
    first, it started again as the same attempt: TORCHELASTIC_RESTART_COUNT 1 on node0, 0 on
    node1). Now every node starts the next attempt, spending no restart, as `R` does on one node."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs

    done = tmp_path / "done"
    job = Job(tmp_path, "user-restart")
    mode = "until-file" if seen_by == "watch" else "busy-until-file"
    job.start(mode, str(done))
    job.start(mode, str(done), extra=("--monitor-interval", "120") if seen_by == "ranks" else ())
    try:
        up = b"PLACED" if mode == "until-file" else b"BUSY"
        wait_for(lambda: all(_printed(tmp_path / f"node{i}", up) for i in range(2)), timeout=TIMEOUT,
                 what="both nodes' ranks up (in their collective)")
        (node0,) = [run for run in served_runs() if run.pid == job.nodes[0].pid]
        assert RemoteEngine(node0.path).submit(cmd.RestartGroup()).ok
        wait_for(lambda: all(len(node_events(tmp_path, f"node{i}", "started")) == 2 or job.nodes[i].poll() is not None
                             for i in range(2)), timeout=TIMEOUT, what="both nodes' second start")
    finally:
        done.touch()
    results = job.finish()
    assert _restarted_once(tmp_path, results) == [[("user", 1)], [("peer_user", 1)]]
    for node in range(2):
        assert list((tmp_path / f"node{node}").glob("*/attempt_1"))
    ends = [e["kind"] for e in events(tmp_path / "node1") if e["event"] == "round_end"]
    assert ends == (["peer_restart"] if seen_by == "watch" else []), ends
    lines = [[ln for ln in err.splitlines() if "restarting" in ln] for _, _, err in results]
    assert lines[1] == ["ranktop: another node's user restarted the group (R): restarting the group as "
                        "attempt_1 (no restart spent)"], lines


def _restarted_once(tmp_path, results: list[tuple[int, str, str]]) -> list[list[tuple[str, int]]]:
    """Each node's group restarts, (reason, attempt), once every node ended 0 having placed its
    ranks twice, TORCHELASTIC_RESTART_COUNT 0 then 1."""
    restarts = []
    for node, (status, out, err) in enumerate(results):
        assert status == 0, err
        assert [p["TORCHELASTIC_RESTART_COUNT"] for p in placements(out)] == ["0", "1"], out
        restarts.append([(e["reason"], e["attempt"]) for e in events(tmp_path / f"node{node}")
                         if e["event"] == "group_restart"])
    return restarts


def test_a_group_restart_just_after_another_nodes_failure_spends_a_restart_as_every_node_does(tmp_path,
                                                                                              torch_installed):
    """node1's rank fails and node1 says so in the store; the user's `R` on node0 comes before
    node0 has heard (its watch looks only every 120 s: the race made certain, no sleep). node0
    started the next attempt spending no restart while node1 spent one: the same attempt, but
    node0 had a restart more than the others. Every node now takes the first word: node0 too."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs

    job, fail, done = Job(tmp_path, "restart-overtaken"), tmp_path / "fail", tmp_path / "done"
    flags = ("--max-restarts", "2")
    job.start("until-file", str(done), extra=(*flags, "--monitor-interval", "120"), local_addr="127.0.0.1")
    job.start("fail-on-file-then-until", "1", str(fail), str(done), extra=flags, local_addr="127.0.0.2")
    try:
        wait_for(lambda: all(_printed(tmp_path / f"node{i}", b"PLACED") for i in range(2)), timeout=TIMEOUT,
                 what="both nodes' ranks up")
        fail.touch()
        wait_for(lambda: node_events(tmp_path, "node1", "group_restart"), timeout=TIMEOUT,
                 what="node1 restarting for its rank's failure (its word in the store)")
        (node0,) = [run for run in served_runs() if run.pid == job.nodes[0].pid]
        ack = RemoteEngine(node0.path).submit(cmd.RestartGroup())
        assert ack.ok and ack.message == ("another node of the c10d rendezvous 'restart-overtaken' failed just before "
                                          "your R: the group restarts for that, a restart spent, as on every node"), ack
        wait_for(lambda: all(len(node_events(tmp_path, f"node{i}", "started")) == 2 for i in range(2)),
                 timeout=TIMEOUT, what="both nodes' second start")
    finally:
        done.touch()
    results = job.finish()
    assert _restarted_once(tmp_path, results) == [[("failure", 1)], [("failure", 1)]]
    assert ("ranktop: another node of the c10d rendezvous 'restart-overtaken' failed; restarting the group: attempt_1 "
            "(1 of 2 restarts spent)") in results[0][2].splitlines(), results[0][2]


def test_a_group_restart_while_the_store_does_not_answer_is_answered_at_once(tmp_path, torch_installed):
    """node0 serves the c10d store and hangs (SIGSTOP: a wedged host, a cut network); the user's `R`
    on node1 tells the other nodes first, through that store, and that call held node1's monitor
    loop for the store's time-out (60 s): `R` got `no answer from the monitor loop within 5s`, and
    no other key, nor a stop, was taken meanwhile. The word now waits a moment at most: `R` is
    answered and node1's ranks stop, as on one node."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine, served_runs

    job, release = Job(tmp_path, "restart-store-hangs"), tmp_path / "release"
    conf = CONF + ",is_host="
    host = job.start("until-file", str(release), extra=("--rdzv-conf", conf + "1"), local_addr="127.0.0.1")
    job.start("until-file", str(release), extra=("--rdzv-conf", conf + "0"), local_addr="127.0.0.2")
    try:
        wait_for(lambda: all(node_events(tmp_path, node, "started") for node in ("node0", "node1")),
                 timeout=TIMEOUT, what="both nodes' ranks running")
        (node1,) = [run for run in served_runs() if run.pid == job.nodes[1].pid]
        freeze(host.pid)
        ack = RemoteEngine(node1.path).submit(cmd.RestartGroup())
        assert ack.ok, ack.message
        wait_for(lambda: node_events(tmp_path, "node1", "exited"),
                 timeout=TIMEOUT, what="node1's rank stopped for the restart")
        # Its next round cannot form while the store's host hangs (join_timeout is 40 s): what a
        # person reads meanwhile is that round, and the last one's world marked as the last
        wait_for(lambda: len(node_events(tmp_path, "node1", "rendezvous_joining")) == 2, timeout=TIMEOUT,
                 what="node1 joining its next round")
        _shows_the_round_forming(RemoteEngine(node1.path).snapshot())
        (listed,) = [run for run in json.loads(run_ranktop("ls", "--json").stdout) if run["pid"] == job.nodes[1].pid]
        assert (listed["state"], listed["world"], listed["last_world"]) == ("rendezvous", None, 2), listed
    finally:
        host.send_signal(signal.SIGCONT)
        release.touch()
        for node in job.nodes:
            stop_process(node)
    job.finish()


def _shows_the_round_forming(snap) -> None:
    """The header of a node joining round 1 of a two-node job while the store does not answer (it
    has not got into the round yet), having run as group rank 1 in round 0: it said `world 2  node
    1/2 round 0` beside `rendezvous`, as if that still held. Narrower, the last round gives way
    first, the forming one last (at 80 columns the earlier attempt's end leaves room for neither)."""
    from ranktop.tui.panes import header_text

    assert snap.forming is not None and (snap.forming.number, snap.forming.nodes) == (1, "2"), snap.forming
    wide = header_text(snap, snap.taken_at, width=200).plain
    assert "  round 1 forming: 0 of 2 nodes  last round 0: world 2 node 1/2  " in wide, wide
    narrow = header_text(snap, snap.taken_at, width=120).plain
    assert "  round 1 forming: 0 of 2 nodes  " in narrow and "world" not in narrow, narrow
    assert "world" not in header_text(snap, snap.taken_at, width=80).plain
