"""What a hostile peer writes to the rendezvous store, read by ranktop: the store takes no
password, so anyone who reaches its port writes any bytes under any key. One TCPStore serves
the whole file, each test under keys of its own; a round's state is torch's pickle under
`torch.rendezvous.<rendezvous id>`. (The gave-up words and the ranks' placement:
test_rendezvous_ends.py's test_what_a_peer_wrote_*.)
"""

from __future__ import annotations

import base64
import datetime
import os
import pickle
from pathlib import Path

import pytest
from conftest import read_line
from rdzv_job import CONF, TIMEOUT, Job, events

STATE_KEY = "torch.rendezvous."


@pytest.fixture(scope="module")
def store():
    pytest.importorskip("torch")
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def _rendezvous(store, run_id: str):
    """A c10d handler of this node on the file's store (a client of it), in ranktop's Rendezvous."""
    from ranktop.core.rendezvous import Rendezvous, create_handler, parse_rdzv_conf

    handler = create_handler("c10d", f"127.0.0.1:{store.port}", run_id, 1, 1,
                             conf=parse_rdzv_conf(CONF + ",is_host=0"), local_addr="127.0.0.1")
    return Rendezvous(handler, "default", 1)


def _state(**fields):
    """torch's own round state with `fields` set, pickled as its handler pickles it."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    state.__dict__.update(fields)
    return pickle.dumps(state)


class _Runs:
    """A pickle that runs a call as it loads: os.mkdir(path)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _node(addr: str, pid: int):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    return _NodeDesc(addr, pid, 0)


@pytest.mark.parametrize("what", ["code", "deep", "huge round", "no node", "negative rank", "too big"])
def test_a_round_state_a_peer_wrote_runs_no_code_and_fails_the_round_in_one_line(tmp_path, store, what):
    """torch's handler unpickled the state whatever it held: a pickle's call (os.mkdir here, any
    code as root in general) ran in ranktop's process at the first sync; a tuple nested 300,000
    deep crashed it (SIGSEGV in the hash); a round of 2**70 formed and went to the ranks. Each is
    now refused before torch loads it, and the round fails in one line."""
    marker = tmp_path / "made-by-the-store"
    bits = {
        "code": lambda: pickle.dumps(_Runs(str(marker))),
        "deep": lambda: b"\x80\x04\x8f(" + b")" + b"\x85" * 300_000 + b"\x90.",
        "huge round": lambda: _state(round=2**70),
        "no node": lambda: _state(participants={"10.0.0.9": 0}),
        "negative rank": lambda: _state(participants={_node("10.0.0.9", 7): -1}),
        "too big": lambda: _state(last_heartbeats=dict.fromkeys(
            (_node(f"node-{i:05d}.a-long-cluster-name.example.com", i) for i in range(20_000)),
            datetime.datetime.now(datetime.timezone.utc))),
    }[what]()
    run_id = f"state-{what.replace(' ', '-')}"
    rdzv = _rendezvous(store, run_id)
    store.set(STATE_KEY + run_id, base64.b64encode(bits))
    from ranktop.core.rendezvous import RendezvousFailed

    with pytest.raises(RendezvousFailed) as failed:
        rdzv.next_round()
    said = str(failed.value)
    assert f"the c10d rendezvous '{run_id}' failed: RendezvousStateError: the round state in the store is " \
           "not one torch wrote: " in said, said
    assert "\n" not in said and len(said) < 400, said
    assert not marker.exists()


def test_a_round_state_torch_wrote_is_read_as_before():
    """A state of 11,000 nodes (under 1 MiB), as torch's handler writes it, passes (so does every
    round of the multi-node tests, and the real node's below)."""
    from ranktop.core.rendezvous_state import vetted_state

    now = datetime.datetime.now(datetime.timezone.utc)
    nodes = {_node(f"node-{i:05d}.cluster.example.com", 100_000 + i): i for i in range(11_000)}
    bits = _state(round=3, complete=True, deadline=now, participants=nodes, wait_list={_node("w", 1)},
                  redundancy_list=set(), last_heartbeats=dict.fromkeys(nodes, now))
    assert vetted_state(bits) is bits


def test_a_round_state_a_peer_writes_while_the_ranks_run_runs_no_code(tmp_path, store):
    """A real node: the state turns hostile while its rank runs. torch's keep-alive thread (and
    ranktop's looks at the round) loaded it at once, running its call as root; now it is refused,
    said once in one line (torch logged a warning naming only the error's type at each keep-alive
    heartbeat, every second here), the rank runs on and the run ends as it does: exit 0, nothing
    run, no traceback."""
    marker, done = tmp_path / "made-by-the-store", tmp_path / "done"
    job = Job(tmp_path, "state-mid-run", nnodes="1", endpoint=f"127.0.0.1:{store.port}",
              conf=CONF + ",keep_alive_interval=1")
    node = job.start("until-file", str(done))
    read_line(node.stdout, TIMEOUT, "the rank placed")
    store.set(STATE_KEY + "state-mid-run", base64.b64encode(pickle.dumps(_Runs(str(marker)))))
    said = [read_line(node.stderr, TIMEOUT, "the round's line")]
    while "round state" not in said[-1]:
        said.append(read_line(node.stderr, TIMEOUT, "the refused state said"))
    assert said[-1] == ("ranktop: c10d rendezvous 'state-mid-run': the round state in the store is not one torch "
                        "wrote: it names posix.mkdir, which no state holds; anyone who reaches the store can write "
                        "it; it is not read, so this node's keep-alive heartbeats and its next round fail while it "
                        "is there (the ranks run on)\n"), said
    Path(done).touch()
    ((status, _, err),) = job.finish()
    assert status == 0 and not marker.exists(), err
    assert "Traceback" not in err and "keep-alive" not in err and "round state" not in err, err
    assert [e["message"] for e in events(tmp_path / "node0") if e["event"] == "rendezvous_state_refused"] == [
        said[-1].split(": ", 2)[2].split("; it is not read")[0]]
