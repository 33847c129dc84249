"""What a hostile peer writes to the rendezvous store, read by ranktop: the store takes no
password, so anyone who reaches its port writes any bytes under any key. One TCPStore serves
the whole file, each test under keys of its own; a round's state is torch's pickle under
`torch.rendezvous.<rendezvous id>`. (The gave-up words and the ranks' placement:
test_rendezvous_ends.py's test_what_a_peer_wrote_*.)
"""

from __future__ import annotations

import base64
import datetime
import io
import os
import pickle
import struct
import time
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


def _unframed(bits: bytes) -> bytes:
    """`bits` without their FRAME: framing is optional, and an edit would make its length wrong."""
    assert bits[2] == pickle.FRAME[0]
    return bits[:2] + bits[11:]


def _sets_class_attribute() -> bytes:
    """A state that sets an attribute of torch's _NodeDesc itself as it loads (BUILD on the class,
    kept in a field of its own): whatever loads it changes the class for the whole process."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    bits = _unframed(_state(kept=_NodeDesc))
    at = bits.index(b"_NodeDesc\x94\x93") + len(b"_NodeDesc\x94\x93")
    plant = b"N}\x8c\x07plantedK\x05s\x86b"  # (None, {'planted': 5}), BUILD: setattr on the class
    return bits[:at] + plant + bits[at:]


@pytest.mark.parametrize("what", ["code", "deep", "huge round", "no node", "negative rank", "too big",
                                  "class attribute"])
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
        "class attribute": _sets_class_attribute,
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
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    assert not hasattr(_NodeDesc, "planted")  # (the refused load set it on torch's class, all the same)


_DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"


def _text(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()  # SHORT_BINUNICODE


def _hand_state(fields: bytes) -> bytes:
    """A round state written opcode by opcode, as a peer may write one: the items of its dict of
    fields. Memo 0 is the module's name (NODE makes torch's _NodeDesc class from it), so that the
    first MEMOIZE in `fields` is memo 1."""
    return b"\x80\x04" + _text(_DYNAMIC) + b"\x94" + _text("_RendezvousState") + b"\x93)\x81}(" + fields + b"ub."


NODE = b"h\x00" + _text("_NodeDesc") + b"\x93"  # BINGET 0, STACK_GLOBAL: the class
NEW_NODE = NODE + b")\x81"  # NEWOBJ: a node with no fields yet, as torch's pickle makes one


def _node_fields(addr: str) -> bytes:
    """A node's fields, as the dict its BUILD takes."""
    return b"}(" + _text("addr") + _text(addr) + _text("pid") + b"K\x07" + _text("local_id") + b"K\x00u"


def _nested_list(depth: int) -> bytes:
    """A list nested `depth` deep, each list made empty and memoized first, then filled from the
    memo: followed by the depth its memo says, it nests 3 deep."""
    made = b"](" + b"]\x94" * depth  # (memo 1 to depth, on the stack until the outer list takes them)
    filled = b"".join(b"j" + struct.pack("<I", at) + b"j" + struct.pack("<I", at + 1) + b"a" for at in range(1, depth))
    return made + filled + b"e"


def _a_time(of_torchs_kind: bool) -> datetime.datetime:
    """A time aware where torch's handler compares aware ones, else naive (or the other way)."""
    from ranktop.core.rendezvous_state import _torch_times_aware

    aware = _torch_times_aware() == of_torchs_kind
    return datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc if aware else None)


def _memo_free(value) -> bytes:
    """`value`'s opcodes, as pickle writes them with no memo (so as not to take memo numbers)."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, 4)
    pickler.fast = True
    pickler.dump(value)
    return _unframed(out.getvalue())[2:-1]  # (no PROTO, no STOP)


@pytest.mark.parametrize("what, why", [
    ("class renamed", "it does not load (TypeError)"),
    ("frozen node set", "it builds a _NodeDesc as torch's pickle does not"),
    ("node built twice", "it builds a _NodeDesc as torch's pickle does not"),
    ("node hashed unbuilt", "it does not load (AttributeError)"),
    ("field of no state", "it has a field no state has, 'kept'"),
    ("times of the other kind", "its last_heartbeats is not of its kind"),
])
def test_a_round_state_torchs_own_load_or_sync_fails_on_is_refused(what, why):
    """States that passed, and that torch then failed on past its `except PickleError` and
    `except RendezvousError`, in its keep-alive thread too (the thread ended with a traceback on
    the terminal, and this node's heartbeats with it), or whose load changed torch's own class:
    __qualname__ set on _NodeDesc (kept out of its __dict__, where the load's check looked; every
    later pickle of a node failed); a node's field set as a slot (FrozenInstanceError); a node
    built again after it was a key (KeyError at torch's `del last_heartbeats[node]`); a node
    hashed before it was built (AttributeError); a list nested 2,000 deep through the memo, in
    a field of its own (RecursionError as torch pickled the state at the next heartbeat); and
    naive heartbeats where torch compares aware ones (TypeError)."""
    from ranktop.core.rendezvous_state import vetted_state
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    bits = {
        "class renamed": lambda: _hand_state(_text("round") + b"K\x00" + _text("kept") + NODE + b"N}"
                                             + _text("__qualname__") + _text("Evil") + b"s\x86b"),
        "frozen node set": lambda: _hand_state(_text("round") + b"K\x00" + _text("participants") + b"}" + NEW_NODE
                                               + b"N" + _node_fields("a") + b"\x86bK\x00s"),
        "node built twice": lambda: _hand_state(
            _text("round") + b"K\x00" + _text("last_heartbeats") + b"}" + NEW_NODE + b"\x94" + _node_fields("a")
            + b"b" + _memo_free(_a_time(True)) + b"s" + _text("wait_list") + b"\x8f(h\x01" + _node_fields("b")
            + b"b\x90"),
        "node hashed unbuilt": lambda: _hand_state(
            _text("round") + b"K\x00" + _text("participants") + b"}" + NEW_NODE + b"\x94K\x00s" + _text("wait_list")
            + b"\x8f(h\x01" + _node_fields("a") + b"b\x90"),
        "field of no state": lambda: _hand_state(_text("round") + b"K\x00" + _text("kept") + _nested_list(2000)),
        "times of the other kind": lambda: _state(last_heartbeats={_node("10.0.0.9", 7): _a_time(False)}),
    }[what]()
    with pytest.raises(RendezvousStateError) as refused:
        vetted_state(bits)
    assert f"not one torch wrote: {why}; anyone" in str(refused.value), refused.value


def test_a_round_state_torch_wrote_is_read_as_before():
    """A state of 11,000 nodes (under 1 MiB), as torch's handler writes it, passes (so does every
    round of the multi-node tests, and the real node's below)."""
    from ranktop.core.rendezvous_state import vetted_state

    now = datetime.datetime.now(datetime.timezone.utc)
    nodes = {_node(f"node-{i:05d}.cluster.example.com", 100_000 + i): i for i in range(11_000)}
    bits = _state(round=3, complete=True, deadline=now, participants=nodes, wait_list={_node("w", 1)},
                  redundancy_list=set(), last_heartbeats=dict.fromkeys(nodes, now))
    assert vetted_state(bits) is bits


def test_a_later_torchs_state_with_a_field_of_its_own_is_read(monkeypatch):
    """A field the installed torch's state has and this vetting does not know (a later torch's)
    is taken where its value nests nothing: refused, every c10d round of that torch would fail.
    A field no torch here has is still refused."""
    from ranktop.core import rendezvous_state
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    made = dynamic_rendezvous._RendezvousState.__init__

    def later_torchs(self):
        made(self)
        self.generation = 0

    monkeypatch.setattr(dynamic_rendezvous._RendezvousState, "__init__", later_torchs)
    rendezvous_state._torch_fields.cache_clear()
    try:
        assert rendezvous_state.vetted_state(_state(generation=7))
        with pytest.raises(Exception, match="it has a field no state has, 'planted'"):
            rendezvous_state.vetted_state(_state(planted=7))
        with pytest.raises(Exception, match="its generation is not of its kind"):
            rendezvous_state.vetted_state(_state(generation=[[7]]))
    finally:
        rendezvous_state._torch_fields.cache_clear()


def test_nodes_gone_are_said_in_one_bounded_line(store):
    """Every node of the round dropped was named: a round of thousands (or a state a peer padded
    with nodes) made a line of megabytes for the console, a toast and events.jsonl."""
    from ranktop.core.spec import Placement

    rdzv = _rendezvous(store, "state-gone")
    this = rdzv.handler._this_node
    now = datetime.datetime.now(datetime.timezone.utc)
    store.set(STATE_KEY + "state-gone", base64.b64encode(
        _state(round=0, complete=True, participants={this: 0}, last_heartbeats={this: now})))
    rdzv.placement = Placement(0, 21, 0, 21, 0, 21, "127.0.0.1", 1, "state-gone", 0, False)
    rdzv._round_nodes = {this: 0, **{_node(f"gone\x1b]0;x\x07-{g}", g): g for g in range(1, 21)}}
    assert rdzv.nodes_gone() is None  # (said at the second look in a row)
    said = rdzv.nodes_gone()
    assert said.startswith("nodes gone-1 (group rank 1), gone-10 (group rank 10), "), said
    assert "gone-16 (group rank 16) and 12 more of the c10d rendezvous 'state-gone' are gone" in said, said
    assert "\x1b" not in said and "gone-17" not in said


def test_a_read_judged_after_a_freeze_is_not_taken_for_every_node_dropped(store):
    """A node frozen (SIGSTOP) while its keep-alive heartbeat read the round state got the bytes of
    before the freeze on resuming, and torch's handler judged them by the clock after it: every
    heartbeat lapsed, the round moved on with nobody in it, a state it then served from its cache
    for a second. The watch read that and said every node of the round was dropped (the ranks run
    on) a look before it found this node dropped while the job went on (seen once in CI). Only a
    fresh read says every node was dropped."""
    from ranktop.core.spec import Placement

    rdzv, key = _rendezvous(store, "stale-read"), STATE_KEY + "stale-read"
    this, other = rdzv.handler._this_node, _node("127.0.0.9", 1)
    now = datetime.datetime.now(datetime.timezone.utc)
    long_ago = now - datetime.timedelta(minutes=5)
    store.set(key, base64.b64encode(_state(round=0, complete=True, participants={other: 0, this: 1},
                                           last_heartbeats={other: long_ago, this: long_ago})))
    rdzv.placement = Placement(1, 2, 1, 2, 1, 2, "127.0.0.1", 1, "stale-read", 0, False)
    rdzv._round_nodes = {other: 0, this: 1}
    rdzv.handler._state_holder.sync()  # the read the freeze held up, judged after it
    assert rdzv.handler._state_holder.state.round == 1 and not rdzv.handler._state_holder.state.last_heartbeats
    store.set(key, base64.b64encode(_state(round=1, complete=True, participants={other: 0},
                                           last_heartbeats={other: now})))  # where the job is
    assert rdzv.every_node_dropped() is None
    assert rdzv.left_behind().startswith("this node was dropped from round 0 of the c10d rendezvous 'stale-read'")
    store.set(key, base64.b64encode(_state(round=1, participants={}, last_heartbeats={})))  # every node dropped
    rdzv.handler._state_holder._last_sync_time = -1  # (its cache's second has passed)
    assert rdzv.every_node_dropped().startswith("every node of round 0 was dropped meanwhile")


def test_a_node_that_gave_up_stops_waiting_for_the_others_to_read_why_at_a_stop(store):
    """A node whose group ended with no restarts left tells the others why and waits up to 5 s for
    them to read it; a stop meanwhile (`ranktop stop`, Ctrl-C) waited those 5 s too, and `ranktop
    stop` took the engine for silent (seen once in a full run). The wait ends at a stop."""
    from ranktop.core.rendezvous import GAVE_UP_LINGER
    from ranktop.core.spec import Placement

    rdzv = _rendezvous(store, "gave-up-stopped")
    import torch.distributed as dist

    rdzv.store = dist.PrefixStore("gave-up-stopped/", store)  # the round's store (its keys its own)
    rdzv.placement = Placement(0, 2, 0, 2, 0, 2, "127.0.0.1", 1, "gave-up-stopped", 0, False)
    looks = []
    began = time.monotonic()
    assert rdzv.give_up("its ranks failed", stopped=lambda: looks.append(1) or len(looks) > 2) == "stopped"
    assert time.monotonic() - began < GAVE_UP_LINGER and len(looks) == 3


@pytest.mark.parametrize("written, agreed", [
    (b"user_restart", "user_restart"),  # another node's word comes first
    (b"x", "failure"),
    (b"\x1b]52;c;aGk=\x07", "failure"),
    (b"\xff\xfe", "failure"),
])
def test_only_a_word_a_node_writes_decides_why_the_group_ended(store, written, agreed):
    """The first word under ranktop/group_end decides, on every node, whether a restart is spent:
    anything else was taken by the round watch for nodes joining, so a node found dropped (a
    failure) cost no restart, and the words were compared whole whatever their size."""
    import torch.distributed as dist
    from ranktop.core.rendezvous import Rendezvous

    rdzv = Rendezvous(None, "default", 1)
    rdzv.store = dist.PrefixStore(f"end-{written.hex()}/", store)
    rdzv.store.set("ranktop/group_end", written)
    assert rdzv.agree_on_end("failure") == agreed


@pytest.mark.parametrize("bootstrap", [("evil\x1b]0;x\x07", 29500), ("a\x00b", 29500), ("h" * 256, 29500),
                                       ("node a", 29500), ("10.0.0.1", 0), ("10.0.0.1", 10**9)])
def test_torchs_master_address_is_checked_as_ranktops(store, bootstrap):
    """Where group rank 0 is a torchrun node, the ranks meet at torch's MASTER_ADDR/MASTER_PORT,
    which its handler reads back from the store for every node: a host with an escape or a NUL,
    or a port out of range, went to the ranks' environment and the round's line unchecked."""
    from ranktop.core.rendezvous import published_master

    with pytest.raises(ValueError, match="the ranks' master in the store is no host and port") as failed:
        published_master(store, 7, bootstrap)
    assert "\x1b" not in str(failed.value) and "\x00" not in str(failed.value)
    assert published_master(store, 7, ("10.0.0.1", 29500)) == ("10.0.0.1", 29500, False)


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
