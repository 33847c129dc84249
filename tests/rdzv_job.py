"""What the multi-node tests share: ranktop nodes meeting through torch's rendezvous on loopback
(`Job`), what they print and record, and a real etcd server. Small --rdzv-conf timeouts keep
every round quick; deadlines are generous for a busy machine."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, ranktop_cmd, read_events, stop_process, wait_for
from ranktop.core.spec import free_port

RANK = str(ROOT / "tests" / "ranks" / "rdzv_rank.py")
CONF = "join_timeout=40,last_call_timeout=1,close_timeout=5"
TIMEOUT = 90

# A node killed outright (SIGKILL) never says it left: the others learn it once its keep-alive
# heartbeats lapse, here after 4 s (torch's default: 3 x 5 s). Not 2 x 1 s: torch's handler sends a
# heartbeat only once its last is an interval old, so a healthy node's ages up to two intervals
# between sends (three as a round starts), and torch dropped healthy nodes from their round.
LAPSE = ",keep_alive_interval=1,keep_alive_max_attempt=4"


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



def start_etcd(tmp_path: Path, client: str, peer: str, *flags: str) -> subprocess.Popen:
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
        wait_for(lambda: etcd_answers(client, server, tmp_path / "etcd.log"), timeout=30, what="etcd to serve")
    except BaseException:
        stop_process(server)
        raise
    return server


def etcd_answers(client: str, server: subprocess.Popen, log: Path) -> bool:
    if server.poll() is not None:
        pytest.fail(f"etcd exited with {server.returncode}: {log.read_text()[-2000:]}")
    try:
        with urllib.request.urlopen(f"{client}/version", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def node_events(tmp_path: Path, node: str, name: str) -> list[dict]:
    return [e for e in events(tmp_path / node) if e["event"] == name] if list(
        tmp_path.glob(f"{node}/*/events.jsonl")) else []


def wait_until_joining(tmp_path: Path, node: str) -> None:
    """Until `node` begins its first round (its rendezvous_joining event, written as it makes the
    one store call that joins): a node started after this joins later, its own start taking
    seconds (torch's import). Its `waiting for nodes` line would come only after 2 s more."""
    wait_for(lambda: node_events(tmp_path, node, "rendezvous_joining"), timeout=TIMEOUT,
             what=f"{node} joining the rendezvous")
