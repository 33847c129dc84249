"""torch's round state, read as what it is: bytes anyone who reaches the store may have written.

torch's dynamic handler (c10d, etcd-v2) keeps each round's state in the store as a pickle and
loads it with `pickle.loads` at every sync: joining a round, each keep-alive heartbeat (5 s), and
each of ranktop's own looks at the round. The store takes no password, so whoever reaches its
port ran any code they liked in every node's ranktop process, as root; a 300 KB pickle of a
tuple nested 300,000 deep crashed it (a C recursion, SIGSEGV); a round of 2**70 went to the
ranks, and one of 10**5000 made every line that names it raise. So the handler's backend is wrapped (`vet_state_reads`): a state it
returns reaches torch only once it is shown to be one torch writes (`vetted_state`), else torch's
sync raises RendezvousStateError and the call that synced fails in one line.

Nothing here is imported unless a rendezvous runs; torch's classes are looked up when needed.
"""

from __future__ import annotations

import functools
import io
import pickle
import pickletools
from collections.abc import Callable
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

from ranktop.core.sanitize import clean

# A round of 1,000 nodes is ~90 KB, so 1 MiB holds some 12,000. Reading one costs up to ~0.6 s
# here, as each opcode is looked at in Python (torch's own pickle then loads it in C).
MAX_STATE_BYTES = 1 << 20
_MAX_DEPTH = 32  # a state nests 11 deep (as followed here); a hash of something nested thousands deep overflows C's stack
_DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
# The only classes a state holds: what `find_class` may give the unpickler.
_CLASSES = frozenset({(_DYNAMIC, "_RendezvousState"), (_DYNAMIC, "_NodeDesc"), ("datetime", "datetime"),
                      ("datetime", "timezone"), ("datetime", "timedelta")})
# The opcodes pickle writes for a state (protocol 4, Python's default since 3.8, or 5): constants,
# the memo, containers, classes.
_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINGET", "LONG_BINGET",
    "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS",
    "EMPTY_DICT", "SETITEM", "SETITEMS", "EMPTY_SET", "ADDITEMS",
    "STACK_GLOBAL", "NEWOBJ", "REDUCE", "BUILD",
})
_INTO_FIRST = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})  # fill the item below
_COUNT_LIMIT = 2**63  # a round, a rank, a pid: a count that fits the store's own integers


def vet_state_reads(handler: Any, refused: Callable[[str], None] | None = None) -> None:
    """Have every state torch's dynamic handler reads from its backend vetted first; `refused` is
    told why, once for each state refused. Other handlers (static, etcd v1, a plugin's) keep no
    pickled state: nothing to do."""
    holder = getattr(handler, "_state_holder", None)
    backend = getattr(holder, "_backend", None)
    if backend is not None and not isinstance(backend, _VettedBackend):
        holder._backend = _VettedBackend(backend, refused)


class _VettedBackend:
    """torch's RendezvousBackend (c10d's, etcd-v2's) whose states are vetted as they are read."""

    def __init__(self, inner: Any, refused: Callable[[str], None] | None):
        self._inner = inner
        self._refused = refused
        # The last state vetted, and the last refused with its error: the same bytes again (at each
        # sync, as long as they stay in the store) need no second look, nor a second word.
        self._passed: bytes | None = None
        self._failed: tuple[bytes, str] | None = None

    def _vetted(self, got: Any) -> Any:
        if got is None or got[0] == self._passed:
            return got
        if self._failed is not None and got[0] == self._failed[0]:
            raise _state_error(self._failed[1])  # (a new one: a raised one's traceback grows at each raise)
        try:
            vetted_state(got[0])
        except Exception as exc:
            self._failed = (got[0], str(exc))
            if self._refused is not None:
                self._refused(str(exc))
            raise
        self._passed = got[0]
        return got

    @property
    def name(self) -> str:
        return self._inner.name

    def get_state(self) -> Any:
        return self._vetted(self._inner.get_state())

    def set_state(self, state: bytes, token: Any = None) -> Any:
        return self._vetted(self._inner.set_state(state, token))  # (the store's state: ours, or another's)


def vetted_state(bits: bytes) -> bytes:
    """`bits` if they are a round state as torch writes one; else torch's RendezvousStateError,
    in one line saying what is wrong."""
    try:
        why = _why_no_state(bits)
    except _NotAState as exc:
        why = str(exc)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes make the scan or the load do
        why = f"it does not load ({type(exc).__name__})"
    if why is None:
        return bits
    raise _state_error(f"the round state in the store is not one torch wrote: {why}; anyone who reaches the "
                       "store can write it")


def _state_error(words: str) -> Exception:
    """torch's RendezvousStateError: what its handler raises for a state it cannot read."""
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    return RendezvousStateError(words)


def _why_no_state(bits: bytes) -> str | None:
    if not isinstance(bits, bytes):
        return "it is not bytes"
    if len(bits) > MAX_STATE_BYTES:
        return f"it is {len(bits)} bytes, over {MAX_STATE_BYTES}"
    why = _scan(bits)
    if why is None:
        why = _state_problem(_StateUnpickler(io.BytesIO(bits)).load())
    return why


def _scan(bits: bytes) -> str | None:
    """Why the pickle is no state, read opcode by opcode without making an object: an opcode a
    state never uses, or items nested over _MAX_DEPTH deep. The depth of each item on pickle's
    stack is followed, and the memo keeps the depth an item had when it was memoized: a list or
    a node filled after that is deeper than its memo says, but neither is hashed as deep (a list
    not at all, a node through its own __hash__, which Python's recursion limit bounds), and what
    stays in a state is checked field by field (_state_problem). A tuple, the one that hashes
    what it holds in C (300,000 deep: SIGSEGV), cannot be filled after it is made."""
    stack: list[int] = []
    marks: list[int] = []
    memo: list[int] = []
    for op, arg, _ in pickletools.genops(bits):
        effect = _EFFECTS.get(op.name)
        if effect is None:
            return f"it holds the pickle opcode {op.name}, which no state does"
        below_mark, taken, made, into_first = effect
        if below_mark == _PUSH:  # a constant, an empty container: nests nothing
            stack.append(1)
            continue
        if below_mark == _MARK:
            marks.append(len(stack))
            continue
        if below_mark == _PUT:
            memo.append(stack[-1])
            continue
        if below_mark == _GET:
            stack.append(memo[arg])
            continue
        start = len(stack) - taken if below_mark < 0 else marks.pop() - below_mark
        if start < 0:
            raise ValueError("the pickle takes more than its stack holds")
        depths = stack[start:]
        del stack[start:]
        if into_first:  # the container below gets the rest: as deep as it was, or deeper
            depth = max(depths[0], 1 + max(depths[1:], default=0))
        else:
            depth = 1 + max(depths, default=0)
        if depth > _MAX_DEPTH:
            return f"it nests over {_MAX_DEPTH} deep"
        stack.extend([depth] * made)
    return "it leaves items over" if stack or marks else None


_MARK, _PUT, _GET, _PUSH = -2, -3, -4, -5


def _effect(op: Any) -> tuple[int, int, int, bool]:
    """(how many items under its mark `op` takes, or -1 where it takes no mark: then how many it
    takes; how many it makes; whether it fills the first it takes), or the memo's and marks' own."""
    if op.name == "MARK":
        return _MARK, 0, 0, False
    if op.name == "MEMOIZE":
        return _PUT, 0, 0, False
    if op.name in ("BINGET", "LONG_BINGET"):
        return _GET, 0, 0, False
    before = op.stack_before
    if not before and len(op.stack_after) == 1:
        return _PUSH, 0, 1, False
    below_mark = before.index(pickletools.markobject) if pickletools.markobject in before else -1
    return below_mark, len(before), len(op.stack_after), op.name in _INTO_FIRST


_EFFECTS = {op.name: _effect(op) for op in pickletools.opcodes if op.name in _OPCODES}


class _NotAState(pickle.UnpicklingError):
    """A pickle does as it loads what no state torch wrote does (its words say what)."""


class _StandIn:
    """An object of one of torch's classes, made as torch's pickle makes it and in no other way:
    NEWOBJ (no call), then one BUILD with a dict of its fields. In each other way torch's own
    class may fail the load past torch's `except PickleError` (in its keep-alive thread, which
    then ends for good, a traceback on the terminal), or be changed by it: its node is a frozen
    dataclass (a slot state's setattr raises FrozenInstanceError); neither class takes the
    arguments a call could give; a node built again after it was hashed as a key sits under its
    first fields' hash (torch's `del last_heartbeats[node]` then raises KeyError); and a BUILD on
    a class itself sets the class's attributes for the whole process, __qualname__ too (its next
    pickle of a node then fails, at every sync). A BUILD on a stand-in class fails: its
    __setstate__ is called without an instance."""

    of = ""  # the name of torch's class

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        raise _NotAState(f"it calls the class {type(self).of}, which torch's pickle of a state does not")

    def __setstate__(self, fields: Any) -> None:
        if type(fields) is not dict or not fields or vars(self):
            raise _NotAState(f"it builds a {type(self).of} as torch's pickle does not")
        vars(self).update(fields)


class _StateStandIn(_StandIn):
    of = "_RendezvousState"


class _NodeStandIn(_StandIn):
    """Hashed and compared by its fields in the load, as torch's node (a frozen dataclass) is: a
    node used as a key before it is built fails the load here too (AttributeError), and so does
    one whose fields hold itself through a tuple (RecursionError)."""

    of = "_NodeDesc"

    def __hash__(self) -> int:
        return hash(_node_fields(self))

    def __eq__(self, other: object) -> bool:
        return _node_fields(self) == _node_fields(other) if type(other) is _NodeStandIn else NotImplemented


def _node_fields(node: Any) -> tuple[Any, Any, Any]:
    return node.addr, node.pid, node.local_id


_STAND_INS = {cls.of: cls for cls in (_StateStandIn, _NodeStandIn)}


class _StateUnpickler(pickle.Unpickler):
    """Loads the classes a state holds, and no other: a pickle's other globals are code. torch's
    two classes are loaded as stand-ins (_StandIn): a pickle must change nothing of torch's as it
    is read, nor pass as a state whose load by torch would. datetime's classes are built in: the
    load does with them what torch's does (setting their attributes fails)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _CLASSES:
            raise _NotAState(f"it names {clean(f'{module}.{name}')[:120]}, which no state holds")
        return _STAND_INS[name] if module == _DYNAMIC else super().find_class(module, name)


def _state_problem(state: Any) -> str | None:
    """What in a loaded state is not as torch's handler makes it (None: nothing). A field an
    older or newer torch's state lacks is not asked for; one it has must be of its type, and one
    no torch's state has is refused: it could hold anything the load makes (a list nested
    60,000 deep, which torch's next pickle of the state, at the next keep-alive heartbeat, fails
    on with RecursionError)."""
    if type(state) is not _StateStandIn:
        return "it is no round state"
    fields = vars(state)
    if "round" not in fields:
        return "it has no round"
    for field, value in fields.items():
        fits = _STATE_FIELDS.get(field) if type(field) is str else None
        if fits is None and field in _torch_fields("_RendezvousState"):  # (a later torch's: of no known kind)
            fits = _is_plain
        if fits is None:
            return f"it has a field no state has, {clean(repr(field))[:60]}"
        if not fits(value):
            return f"its {field} is not of its kind"
    return None


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < _COUNT_LIMIT


def _is_flag(value: Any) -> bool:
    return type(value) is bool


def _is_node(node: Any) -> bool:
    """A node with torch's fields, and only those: its address (a host name or IP, which ranktop
    shows), pid and id."""
    if type(node) is not _NodeStandIn or not vars(node).keys() <= _torch_fields("_NodeDesc") | _NODE_FIELDS:
        return False
    addr, pid, local_id = _node_fields(node)
    others = (value for field, value in vars(node).items() if field not in _NODE_FIELDS)
    return type(addr) is str and 0 < len(addr) <= 1024 and _is_count(pid) and _is_count(local_id) \
        and all(map(_is_plain, others))


_NODE_FIELDS = frozenset({"addr", "pid", "local_id"})


@functools.cache
def _torch_fields(name: str) -> frozenset[str]:
    """The fields the installed torch's class `name` gives its objects: a later torch's state or
    node may have one this module does not know, and its nodes must not be refused for it (its
    value is taken if plain, _is_plain); a field no torch here has is refused."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    cls = getattr(dynamic_rendezvous, name)
    try:
        return frozenset(vars(cls() if name == "_RendezvousState" else cls("", 0, 0)))
    except Exception:  # noqa: BLE001 - a torch whose classes are made otherwise: only the known fields
        return frozenset()


def _is_plain(value: Any) -> bool:
    """A value that nests nothing: a number, a flag, a short string, a time, None, a node."""
    return value is None or type(value) in (bool, int, float) or (type(value) is str and len(value) <= 1024) \
        or _is_time(value) or _is_node(value)


def _is_time(value: Any) -> bool:
    """A datetime of the kind torch's handler compares it with: one of the other kind (naive
    where torch's are aware, or the other way) makes that comparison raise TypeError, past
    torch's `except RendezvousError`, in its keep-alive thread too."""
    aware = _torch_times_aware()
    return type(value) is datetime and (aware is None or (value.tzinfo is not None) == aware)


@functools.cache
def _torch_times_aware() -> bool | None:
    """Whether torch's handler keeps its times aware (`datetime.now(timezone.utc)`, later torch)
    or naive (`datetime.utcnow()`, earlier), as torch itself answers: its _should_keep_alive
    compares a node's last heartbeat with its now, here a naive one. None where it cannot be
    asked (then either kind passes)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    compares = getattr(dynamic_rendezvous, "_should_keep_alive", None)
    if compares is None:
        return None
    node = object()
    asked = SimpleNamespace(node=node, state=SimpleNamespace(last_heartbeats={node: datetime(2000, 1, 1)}),
                            settings=SimpleNamespace(keep_alive_interval=timedelta(0)))
    try:
        compares(asked)
    except TypeError:  # (can't compare offset-naive and offset-aware datetimes)
        return True
    except Exception:  # noqa: BLE001 - a torch whose function asks for more than it did
        return None
    return False


def _are_nodes(value: Any) -> bool:
    return all(map(_is_node, value))


_STATE_FIELDS: dict[str, Callable[[Any], bool]] = {
    "round": _is_count, "complete": _is_flag, "closed": _is_flag,
    "deadline": lambda v: v is None or _is_time(v),
    "participants": lambda v: type(v) is dict and _are_nodes(v) and all(map(_is_count, v.values())),
    "wait_list": lambda v: type(v) is set and _are_nodes(v),
    "redundancy_list": lambda v: type(v) is set and _are_nodes(v),
    "last_heartbeats": lambda v: type(v) is dict and _are_nodes(v) and all(map(_is_time, v.values())),
}
