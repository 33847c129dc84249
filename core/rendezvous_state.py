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

import io
import pickle
import pickletools
from collections.abc import Callable
from datetime import datetime
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
    except _NoStateClass as exc:
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
        unpickler = _StateUnpickler(io.BytesIO(bits))
        state = unpickler.load()
        why = unpickler.changed_class() or _state_problem(state, unpickler)
    return why


def _scan(bits: bytes) -> str | None:
    """Why the pickle is no state, read opcode by opcode without making an object: an opcode a
    state never uses, or items nested over _MAX_DEPTH deep (the depth of each item on pickle's
    stack and in its memo is followed, so a memo reference cannot hide one)."""
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


class _NoStateClass(pickle.UnpicklingError):
    """A pickle names a global (a class, a function) that no state holds."""


class _StateUnpickler(pickle.Unpickler):
    """Loads the classes a state holds, and no other: a pickle's other globals are code. torch's
    two classes are loaded as stand-ins of this load's own: a pickle can set a class's attributes
    (BUILD on the class itself), and it must not change torch's (the state is refused only after
    the load), nor pass as a state that would change them when torch loads it (changed_class).
    datetime's classes are built in: setting theirs fails the load."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.stand_ins = {name: type(name, (), {}) for module, name in _CLASSES if module == _DYNAMIC}
        self._own = {name: set(vars(cls)) for name, cls in self.stand_ins.items()}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _CLASSES:
            raise _NoStateClass(f"it names {clean(f'{module}.{name}')[:120]}, which no state holds")
        return self.stand_ins[name] if module == _DYNAMIC else super().find_class(module, name)

    def changed_class(self) -> str | None:
        """Why the load is no state's, where it set an attribute of a class (None: it set none)."""
        for name, cls in self.stand_ins.items():
            if set(vars(cls)) != self._own[name]:
                return f"it sets attributes of the class {name}"
        return None


def _state_problem(state: Any, unpickler: _StateUnpickler) -> str | None:
    """What in a loaded state is not as torch's handler makes it (None: nothing). A field an
    older or newer torch's state lacks is not asked for; one it has must be of its type."""
    if type(state) is not unpickler.stand_ins["_RendezvousState"]:
        return "it is no round state"
    node_class = unpickler.stand_ins["_NodeDesc"]

    def nodes(value: Any) -> bool:
        return all(type(node) is node_class and _is_node(node) for node in value)

    checks = {"round": _is_count, "complete": _is_flag, "closed": _is_flag,
              "deadline": lambda v: v is None or type(v) is datetime,
              "participants": lambda v: type(v) is dict and nodes(v) and all(map(_is_count, v.values())),
              "wait_list": lambda v: type(v) is set and nodes(v),
              "redundancy_list": lambda v: type(v) is set and nodes(v),
              "last_heartbeats": lambda v: type(v) is dict and nodes(v) and all(type(t) is datetime for t in v.values())}
    if not hasattr(state, "round"):
        return "it has no round"
    for field, fits in checks.items():
        if hasattr(state, field) and not fits(getattr(state, field)):
            return f"its {field} is not of its kind"
    return None


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < _COUNT_LIMIT


def _is_flag(value: Any) -> bool:
    return type(value) is bool


def _is_node(node: Any) -> bool:
    """A node's fields as torch's: its address (a host name or IP, which ranktop shows), pid and id."""
    addr = getattr(node, "addr", None)
    return (type(addr) is str and 0 < len(addr) <= 1024 and _is_count(getattr(node, "pid", None))
            and _is_count(getattr(node, "local_id", None)))
