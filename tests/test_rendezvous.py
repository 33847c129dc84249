"""Multi-node through torch's rendezvous, for real: several ranktop processes on loopback, each
one node (`--headless`), meeting through a c10d store that the first of them serves.

Skipped as a whole when torch is not importable (the without-torch test fakes that itself).
Small --rdzv-conf timeouts keep every round quick; deadlines are generous for a busy machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, ranktop_cmd, read_events, run_ranktop, stop_process, wait_for
from ranktop.core.spec import free_port

RANK = str(ROOT / "tests" / "ranks" / "rdzv_rank.py")
CONF = "join_timeout=40,last_call_timeout=1,close_timeout=5"
TIMEOUT = 90


class Job:
    """ranktop processes that meet at one c10d endpoint, one per node."""

    def __init__(self, tmp_path: Path, rdzv_id: str, nnodes: str = "2", backend: str = "c10d",
                 endpoint: str | None = None, conf: str = CONF):
        self.tmp_path, self.rdzv_id, self.nnodes, self.backend = tmp_path, rdzv_id, nnodes, backend
        self.conf = conf
        self.endpoint = endpoint or f"127.0.0.1:{free_port()}"
        self.nodes: list[subprocess.Popen] = []
        self.env: dict[str, str] = {}  # more environment for every node

    def start(self, *rank_args: str, nproc: int = 1, extra: tuple[str, ...] = (),
              local_addr: str = "127.0.0.1") -> subprocess.Popen:
        """A ranktop node. torch sorts a round's nodes by address, then pid: `local_addr` can fix
        the group ranks (127.0.0.1 before 127.0.0.2, both loopback)."""
        name = f"node{len(self.nodes)}"
        cmd = ranktop_cmd("--headless", *self._rendezvous_flags(nproc, local_addr),
                          "--log-dir", str(self.tmp_path / name), "--shutdown-timeout", "2", *extra,
                          RANK, *rank_args)
        return self._popen(cmd, {**os.environ, **self.env})

    def start_torchrun(self, *rank_args: str, nproc: int = 1, local_addr: str = "127.0.0.1") -> subprocess.Popen:
        """A node run by torch's own launcher on the same flags."""
        cmd = [sys.executable, "-m", "torch.distributed.run", *self._rendezvous_flags(nproc, local_addr),
               RANK, *rank_args]
        return self._popen(cmd, {**os.environ, **self.env, "LOGLEVEL": "ERROR", "PYTHONWARNINGS": "ignore"})

    def _rendezvous_flags(self, nproc: int, local_addr: str) -> tuple[str, ...]:
        return ("--nnodes", self.nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", self.backend,
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id, "--rdzv-conf", self.conf,
                "--local-addr", local_addr, "--monitor-interval", "0.2")

    def _popen(self, cmd: list[str], env) -> subprocess.Popen:
        node = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.nodes.append(node)
        return node

    def finish(self) -> list[tuple[int, str, str]]:
        """(exit status, stdout, stderr) of every node, once all have ended."""
        try:
            outputs = [node.communicate(timeout=TIMEOUT) for node in self.nodes]
        finally:
            for node in self.nodes:  # only reached with a node still running after a timeout
                if node.poll() is None:
                    node.kill()
                    node.communicate()
        return [(node.returncode, out, err) for node, (out, err) in zip(self.nodes, outputs, strict=True)]


def placements(stdout: str) -> list[dict]:
    # found anywhere: a torchrun node's ranks share its stdout, and their lines can run together
    return [json.loads(found) for found in re.findall(r"PLACED (\{[^{}]*\})", stdout)]


def events(log_dir: Path) -> list[dict]:
    """The events of the one run under `log_dir` (its run id is the rendezvous id)."""
    (events_file,) = log_dir.glob("*/events.jsonl")
    return read_events(events_file.parent)


@pytest.fixture
def torch_installed():
    pytest.importorskip("torch")


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
    waited for the torchrun node's would wait for ever)."""
    job = Job(tmp_path, f"with-torchrun-{group_rank_0}")
    if identical:
        job.env["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"
    starts = {"ranktop": job.start, "torchrun": job.start_torchrun}
    other = "torchrun" if group_rank_0 == "ranktop" else "ranktop"
    starts[group_rank_0]("allreduce", nproc=2, local_addr="127.0.0.1")
    starts[other]("allreduce", nproc=2, local_addr="127.0.0.2")
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
    last = err.rstrip().splitlines()[-1]
    assert last.startswith(lost) and last.endswith("(the node serving it is gone?), and this node's ranks' "
                                                   "store with it; this node stops"), err[-3000:]
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
    line when join_timeout runs out, exit 1. The root cause is the failure of attempt 1 (attempt_0):
    the headline said `attempt 2 of 2`, an attempt whose ranks never started."""
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
    assert "ranktop: rdzv_rank.py failed (attempt 1 of 2)\n  root cause: rank 0 " in err0, err0
    assert err0.rstrip().endswith("ranktop: error: the c10d rendezvous 'node-lost' timed out: not enough nodes joined"), err0
    assert not list(tmp_path.glob("node0/*/attempt_1")), "no rank of the second attempt started"
    (final,) = tmp_path.glob("node0/*/final.json")
    ended = json.loads(final.read_text())
    assert ended["root_cause"]["attempt"] == 0 and ended["attempt"] == 1
    # (the ranks shown are attempt 0's: restarted none; they said ⟳1, the restart that never started)
    assert [r["restarts"] for r in ended["ranks"]] == [0], ended["ranks"]


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
    assert err0.rstrip().endswith("ranktop: error: another node of the c10d rendezvous 'peer-failed' failed, "
                                  "and this node has no restarts left (0 of 0 spent)"), err0
    assert "root cause: rank 1 (local rank 0" in err1 and "exited with code 3" in err1, err1
    assert err1.rstrip().endswith("gave up: its ranks were stopped for another node's failure, no restarts left "
                                  "(0 of 0 spent)); this node stops"), err1
    finished = [e for e in events(tmp_path / "node0") if e["event"] == "run_finished"]
    assert finished[0]["root_cause_rank"] is None and finished[0]["exit_status"] == 1


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
    server = _start_etcd(tmp_path, client, peer, *flags)
    try:
        yield client.removeprefix("http://")
    finally:
        stop_process(server)


def _start_etcd(tmp_path: Path, client: str, peer: str, *flags: str) -> subprocess.Popen:
    """An etcd serving at `client` (its data in tmp_path: started again, it has the same keys)."""
    etcd = shutil.which("etcd")
    if etcd is None:
        pytest.fail("etcd is not installed (Debian/Ubuntu: apt-get install etcd-server; .ci/run installs it)")
    if importlib.util.find_spec("etcd") is None:
        pytest.fail("python-etcd is not installed (pip install python-etcd, part of the `test` extra)")
    with open(tmp_path / "etcd.log", "a") as log:  # (the server has its own descriptor)
        server = subprocess.Popen(
            [etcd, "--name", "ranktop-test", "--data-dir", str(tmp_path / "etcd-data"), *flags,
             "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"ranktop-test={peer}"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _etcd_answers(client, server, tmp_path / "etcd.log"), timeout=30, what="etcd to serve")
    except BaseException:
        stop_process(server)
        raise
    return server


def _etcd_answers(client: str, server: subprocess.Popen, log: Path) -> bool:
    if server.poll() is not None:
        pytest.fail(f"etcd exited with {server.returncode}: {log.read_text()[-2000:]}")
    try:
        with urllib.request.urlopen(f"{client}/version", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.mark.parametrize(("backend", "rank"), [("etcd", "allreduce"), ("etcd-v2", "print")])
def test_two_nodes_through_a_real_etcd_server(tmp_path, etcd_server, backend, rank):
    """torch's etcd handler (its own rendezvous protocol over etcd keys) and etcd-v2 (torch's
    dynamic rendezvous kept in etcd): two ranktop nodes form one world of two."""
    job = Job(tmp_path, f"over-{backend}", backend=backend, endpoint=etcd_server)
    for _ in range(2):
        job.start(rank)
    results = job.finish()
    for status, out, err in results:
        assert status == 0, err
        assert f"ranktop: {backend} rendezvous 'over-{backend}' round 0: this node is group rank" in out + err
        if rank == "allreduce":
            assert "SUM 1 world 2" in out, out
    placed = [p for _, out, _ in results for p in placements(out)]
    assert sorted((p["RANK"], p["WORLD_SIZE"], p["GROUP_RANK"]) for p in placed) == [("0", "2", "0"), ("1", "2", "1")]
    assert {p["TORCHELASTIC_RUN_ID"] for p in placed} == {f"over-{backend}"}


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


def test_a_plugin_handler_that_says_nothing_or_raises_still_gets_the_waiting_line(torch_installed):
    from ranktop.core.rendezvous import Rendezvous
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    class Plugin(RendezvousHandler):  # a torchrun plugin's handler: torch asks it for these only
        def get_backend(self) -> str:
            return "mine"

        def get_run_id(self) -> str:
            return "job7"

        def next_rendezvous(self):
            raise NotImplementedError

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def shutdown(self) -> bool:
            return True

    class Raising(Plugin):
        @property
        def settings(self):
            raise RuntimeError("not configured yet")

    line = "waiting for nodes to join the mine rendezvous 'job7'"  # no counts or time-out: none said
    assert Rendezvous(Plugin(), "default", 1).waiting_words() == line
    assert Rendezvous(Raising(), "default", 1).waiting_words() == line


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
    said = wait_for(lambda: select.select([node.stderr], [], [], 0.1)[0] and node.stderr.readline(), timeout=30,
                    what="a line on stderr")
    assert said == "ranktop: waiting for nodes to join the c10d rendezvous 'waiting' (2 nodes; gives up after 40 s)\n"
    node.send_signal(signal.SIGTERM)
    ((status, out, err),) = job.finish()
    assert status == 128 + signal.SIGTERM and "PLACED" not in out
    assert "stopped by SIGTERM" in err and "Traceback" not in err


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

    async def main():
        engine.start()  # returns at once: the round waits for a second node that never comes
        async with app.run_test(size=(160, 48)) as pilot:
            while not app.ended or not notes:
                if app.main is not None and app.main.is_mounted:
                    headers.append(app.main.query_one("#header", LiveText).render().plain)
                    box = app.main.query_one("#waiting", Static)
                    waiting.append(str(box.render()) if box.display else None)
                await pilot.pause(0.1)
            await pilot.pause(0.3)
            waiting.append(str(box.render()) if box.display else None)

    asyncio.run(asyncio.wait_for(main(), 40))
    # (before the first round nothing is decided: it said `world 2  node 0/1`, the command line's guesses)
    assert any(" rendezvous " in h and "  world ?  node ?  " in h for h in headers), headers
    assert not any("node 0/1" in h for h in headers), headers
    # What the node waits for, above the empty panes, until the round gave up
    assert ("waiting for nodes to join the c10d rendezvous 'tui' (2 nodes; gives up after 4 s)\n"
            "this node's 2 ranks start once the round is complete") in waiting, waiting
    assert waiting[-1] is None
    assert notes == ["the c10d rendezvous 'tui' timed out: not enough nodes joined"]
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
# heartbeats lapse, here after 2 s (torch's default: 3 x 5 s).
LAPSE = ",keep_alive_interval=1,keep_alive_max_attempt=2"


def node_events(tmp_path: Path, node: str, name: str) -> list[dict]:
    return [e for e in events(tmp_path / node) if e["event"] == name] if list(
        tmp_path.glob(f"{node}/*/events.jsonl")) else []


def wait_until_joining(tmp_path: Path, node: str) -> None:
    """Until `node` begins its first round (its rendezvous_joining event, written as it makes the
    one store call that joins): a node started after this joins later, its own start taking
    seconds (torch's import). Its `waiting for nodes` line would come only after 2 s more."""
    wait_for(lambda: node_events(tmp_path, node, "rendezvous_joining"), timeout=TIMEOUT,
             what=f"{node} joining the rendezvous")


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
    `rendezvous` and nothing more. It says what it waits for once the wait is not a short one."""
    job = Job(tmp_path, "barrier-wait")
    release = tmp_path / "release"
    node = job.start("print", local_addr="127.0.0.1")
    job.start("until-file", str(release), local_addr="127.0.0.2")
    line = "ranktop: waiting at the exit barrier for the other nodes of the c10d rendezvous 'barrier-wait' " \
           "(gives up after 300 s)\n"
    try:
        wait_for(lambda: select.select([node.stderr], [], [], 0.1)[0] and node.stderr.readline() == line,
                 timeout=TIMEOUT, what="the line about the exit barrier")
    finally:
        release.touch()  # (the job ends either way)
    for status, _, err in job.finish():
        assert status == 0 and "exit barrier:" not in err, err


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


def test_a_node_that_lost_the_store_says_so_in_one_line_without_torch_frames(tmp_path, torch_installed):
    """The node serving the store is killed (its guard ends its ranks): the other's ranks lose
    their collective, it spends a restart, and its next round finds no store: one line that says
    so. ~60 lines of torch's C++ warnings (TCPStore, `frame #0`...) came first, from ranktop's own
    process."""
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
    assert status1 == 1 and "ranktop: error: lost the c10d rendezvous 'store-gone': The connection to the " \
                            "C10d store has failed; " in err1, err1
    # (torch's "See inner exception for details." pointed at nothing the user sees: the inner one follows)
    assert "inner exception" not in err1, err1
    # ranktop's own lines: a rank's are prefixed on the console and indented under the root cause
    ours = [line for line in err1.splitlines() if not line.startswith(("[default", " "))]
    assert not any("TCPStore" in line or "frame #" in line for line in ours), err1


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
    server = _start_etcd(tmp_path, client, peer, "--enable-v2")
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
        server = _start_etcd(tmp_path, client, peer, "--enable-v2")
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
server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                           "s = d.TCPStore('127.0.0.1', 0, 2, True, wait_for_workers=False); "
                           "print(s.port, flush=True); time.sleep(1)"], stdout=subprocess.PIPE, text=True)
client = dist.TCPStore("127.0.0.1", int(server.stdout.readline()), 2, False)
client.set("k", "v")
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
    assert run_ranktop("ls", env=env).stdout.startswith("no runs")


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


@pytest.mark.parametrize("bad, error", [
    # node 1's role and size, as group rank 0 reads them to plan every node's ranks
    ({"torchelastic/role_info/1": '{"role": "default", "local_world_size": -5}'}, "node 1's role and size"),
    ({"torchelastic/role_info/1": '["x"]'}, "node 1's role and size"),
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
