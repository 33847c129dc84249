"""How soon an elastic job goes on without a node its user stopped. Run by hand:

    python bench/bench_node_stop.py [--how sigterm|stop|kill] [--launchers ranktop,ranktop,ranktop]
                                    [--rdzv-conf KEY=VALUE,...] [--rounds N]

Three nodes on loopback (127.0.0.1-3, one rank each, all-reducing over gloo until stopped) form one
c10d round (`--nnodes 2:3 --max-restarts 3`; node 0 serves the store). Once every rank has
all-reduced in the world of three, node 2 is stopped: SIGTERM to its launcher, `ranktop stop` of
its run, or SIGKILL. Printed: the seconds from the stop to each other node's next round (ranktop:
its `rendezvous_joined` event; torchrun: its agent's second `Rendezvous complete` log line), and, for a
ranktop node 2 stopped by SIGTERM or `ranktop stop`, the seconds from its taking the stop
(`signal_received`, `user_stop`) to its rank's end (`exited`): what it does before its ranks get
the signal (its word to the round) counts there. With
torch's default keep-alive (5 s x 3), a node that stays a member of its round until its heartbeats
lapse is dropped 10-15 s after its last one. `--launchers` picks each node's launcher (ranktop or
torchrun; node 2 must be ranktop's for `--how stop`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compiled import ROOT, compile_ranktop  # noqa: E402

RANK = str(ROOT / "tests" / "ranks" / "rdzv_rank.py")
WAIT = 120.0  # seconds for the round of three, and for the others' next round


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(i: int, launcher: str, endpoint: str, conf: str, work: Path) -> subprocess.Popen:
    flags = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
             "--rdzv-id", "bench-stop", "--rdzv-conf", f"{conf},is_host={int(i == 0)}", "--local-addr",
             f"127.0.0.{i + 1}", "--max-restarts", "3", "--monitor-interval", "0.2"]
    env = dict(os.environ)
    if launcher == "ranktop":
        cmd = [sys.executable, "-m", "ranktop", "--headless", "--log-dir", str(work / f"node{i}"),
               "--shutdown-timeout", "2", *flags]
    else:  # (its INFO lines say when each round is complete)
        cmd = [sys.executable, "-m", "torch.distributed.run", *flags]
        env.update(LOGLEVEL="INFO", PYTHONWARNINGS="ignore")
    with open(work / f"node{i}.out", "w") as out:
        return subprocess.Popen([*cmd, RANK, "wait-world", "4"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=env)


def new_round_at(i: int, launcher: str, work: Path, after: float) -> float | None:
    """When node i's next round after `after` formed, None while it has not."""
    if launcher == "torchrun":
        return time.time() if (work / f"node{i}.out").read_text(errors="replace").count("Rendezvous complete") >= 2 \
            else None
    for events in (work / f"node{i}").glob("*/events.jsonl"):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "rendezvous_joined" and event["ts"] > after:
                return event["ts"]
    return None


def own_rank_end(work: Path) -> float | None:
    """Seconds from node 2's taking the stop to its rank's end, from its events; None where it has none."""
    taken = ended = None
    for events in (work / "node2").glob("*/events.jsonl"):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event["event"] in ("signal_received", "user_stop") and taken is None:
                taken = event["ts"]
            elif event["event"] == "exited" and taken is not None and ended is None:
                ended = event["ts"]
    return None if taken is None or ended is None else ended - taken


def stop_node(node: subprocess.Popen, how: str, work: Path) -> None:
    if how == "stop":
        (run_dir,) = (work / "node2").glob("*/")
        subprocess.Popen([sys.executable, "-m", "ranktop", "stop", str(run_dir)], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        node.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)


def wait_until(what: str, done) -> None:
    deadline = time.monotonic() + WAIT
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} within {WAIT:g} s")
        time.sleep(0.05)


def one_round(args: argparse.Namespace, launchers: list[str], work: Path) -> tuple[list[float | None], float | None]:
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    try:
        for i, launcher in enumerate(launchers):
            nodes.append(start_node(i, launcher, endpoint, args.rdzv_conf, work))
            time.sleep(0.5)  # (node 0 first: it serves the store)
        wait_until("round of three", lambda: all(
            "SUM 3 world 3" in (work / f"node{i}.out").read_text(errors="replace") for i in range(3)))
        time.sleep(1.0)
        stopped_at = time.time()
        stop_node(nodes[2], args.how, work)
        seen: dict[int, float] = {}
        deadline = time.monotonic() + WAIT
        while len(seen) < 2 and time.monotonic() < deadline:
            for i in (0, 1):
                if i not in seen and (at := new_round_at(i, launchers[i], work, stopped_at)) is not None:
                    seen[i] = at
            time.sleep(0.05)
        nodes[2].wait(WAIT)
        return [seen[i] - stopped_at if i in seen else None for i in (0, 1)], own_rank_end(work)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--how", choices=("sigterm", "stop", "kill"), default="sigterm")
    parser.add_argument("--launchers", default="ranktop,ranktop,ranktop")
    parser.add_argument("--rdzv-conf", default="join_timeout=60,last_call_timeout=1,close_timeout=5")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    launchers = args.launchers.split(",")
    if len(launchers) != 3 or set(launchers) - {"ranktop", "torchrun"}:
        parser.error("--launchers: three of ranktop or torchrun")
    if args.how == "stop" and launchers[2] != "ranktop":
        parser.error("--how stop needs node 2 to be ranktop's")
    compile_ranktop()
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="ranktop-bench-stop-") as tmp:
            times, own = one_round(args, launchers, Path(tmp))
        shown = ", ".join(f"node {i} {t:.1f} s" if t is not None else f"node {i} none" for i, t in enumerate(times))
        ranks = f"; node 2's rank ended {own:.2f} s after it took the stop" if own is not None else ""
        print(f"{args.how} of node 2 ({launchers[2]}) -> next round: {shown}{ranks}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
