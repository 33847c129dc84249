"""Real PyTorch under ranktop: gloo collectives on one node and on two "nodes" over loopback.

Skipped as a whole when torch is not installed. Torch's import is slow (seconds per rank on a
small machine), so the number of launches here is kept to three.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, ranktop_cmd, run_ranktop
from ranktop.core.spec import free_port

pytest.importorskip("torch")

TIMEOUT = 90


def rank_log(log_dir: Path, run_id: str, local_rank: int) -> str:
    return (log_dir / run_id / "attempt_0" / str(local_rank) / "stdout.log").read_text()


def test_allreduce_four_ranks(tmp_path, examples):
    res = run_ranktop("--headless", "--nproc-per-node", "4", "--log-dir", str(tmp_path), "--run-id", "ar",
                      str(examples / "allreduce.py"), timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr
    for r in range(4):
        assert f"rank {r}: sum=6.0" in rank_log(tmp_path, "ar", r)
        assert any(line.startswith(f"[default{r}]:rank {r}: sum=6.0") for line in res.stdout.splitlines()), res.stdout


def test_two_nodes_on_loopback(tmp_path, examples):
    port = free_port()
    procs = []
    for node in (0, 1):
        args = ranktop_cmd("--headless", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(port),
                           "--log-dir", str(tmp_path / f"node{node}"), "--run-id", "mn",
                           "--shutdown-timeout", "2", str(examples / "allreduce.py"))
        procs.append(subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:  # only reached with something still running after a timeout
            if p.poll() is None:
                p.terminate()
                p.communicate()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
    for node in (0, 1):
        for local in (0, 1):
            global_rank = node * 2 + local
            log = rank_log(tmp_path / f"node{node}", "mn", local)
            assert f"rank {global_rank}: sum=6.0 (local_rank {local}, world 4)" in log


def test_train_ddp_runs_to_completion(tmp_path, examples):
    res = run_ranktop("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path), "--run-id", "ddp",
                      str(examples / "train_ddp.py"), "--steps", "5", timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr
    for r in range(2):
        log = rank_log(tmp_path, "ddp", r)
        assert f"rank {r} step   4 loss" in log
        assert f"rank {r} done: w=" in log
    # DDP keeps the replicas identical: both ranks end with the same weights.
    finals = [rank_log(tmp_path, "ddp", r).rsplit("done: ", 1)[1].strip() for r in range(2)]
    assert finals[0] == finals[1]
