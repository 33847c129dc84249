"""Multi-node through torch's rendezvous, for real, at its edges, continued: stores lost while
the ranks run, detached and served nodes, what peers write to the store, in-process nodes and their
heartbeats. (Waiting for nodes, the exit barrier and frozen nodes: test_rendezvous_ends.py; rounds,
restarts and the static form: test_rendezvous.py.)
"""

from __future__ import annotations

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
from conftest import ROOT, read_events, run_ranktop, stop_process, wait_for
from ranktop.core.spec import free_port
from rdzv_job import CONF, LAPSE, RANK, TIMEOUT, Job, events, node_events, start_etcd

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
