"""Multi-node through torch's own rendezvous (torchrun's --rdzv-* flags), round by round.

torch is imported here only, and only when a rendezvous backend is asked for: ranktop's static
form (--nnodes/--node-rank/--master-addr) needs no torch, and `--headless` starts fast.

In each round this node
  1. joins the round (`next_rendezvous()`): its group rank, the number of nodes, a shared store;
  2. learns where its ranks sit in the job, through the same store, with the keys and JSON that
     torch's agent uses: nodes with different --nproc-per-node or roles get torchrun's ranks;
  3. learns MASTER_ADDR/MASTER_PORT, which group rank 0 publishes before it assigns the ranks.
While the ranks run, a `RoundWatch` looks for nodes waiting to join, for a node that gave up, and,
under torch's dynamic handler (c10d, etcd-v2), for nodes dropped from the round once their
keep-alive heartbeats lapsed (killed, frozen): another of the round's nodes, or this one, which the
job then went on without. torch's handler drops them and tells nobody. A node its user stops says
so (`say_stopped`) before its ranks get the signal, and steps out of the round itself (`leave_round`)
once they have it, so that the others go on at once.
When the group ends early, the nodes of the round agree on why (nodes joined: no restart spent;
a failure, or a node stopped by its user: one restart spent on every node). At the end the node
waits at the exit barrier (success), or says it gave up and closes the rendezvous so that no new
round starts.

Two things torchrun 2.13 gets wrong with torch's default store sharing, and ranktop avoids:
  - group rank 0 writes the master's address into the first round's store only, so a node joining
    a later round waits for it forever while the others wait for that node (the scale-up hang);
  - the ranks' store (served by group rank 0's agent) is the same for every start of the group and
    the ranks use it without a prefix, so a restarted group reads the previous group's keys and
    gloo dials ranks that are gone. ranktop's group rank 0 serves a fresh store for each start.
With `--rdzv-conf ranks_store=rendezvous` (c10d only) the ranks use the rendezvous's own store
instead, so that nodes need reach only its port: torch 2.13's ranks put their keys there without a
prefix, so group rank 0 deletes every key outside the rendezvous's own before it says where the
ranks meet. That is safe because a round forms only once each of its nodes has ended its ranks.
torch's static backend has no rounds (one store for the job): ranktop's later starts of the group
meet first, each under a prefix of that store of its own (see `Rendezvous._static_start`).
torchrun nodes can join a ranktop job and the other way round: group rank 0 writes torch's own
MASTER_* keys every round, and uses torch's shared store, as torchrun does, in a round where a
node did not mark itself as ranktop (a torchrun node's ranks can only reach that store).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from ranktop.core.errors import UsageError
from ranktop.core.limits import MAX_NNODES, MAX_NPROC_PER_NODE, MAX_SECONDS, PORT
from ranktop.core.protocol import is_whole
from ranktop.core.sanitize import clean, quoted
from ranktop.core.spec import Placement
from ranktop.core.value import Value
from ranktop.core.weak import weakly

if TYPE_CHECKING:  # (logging loads only where torch's records are filtered: a one-node start skips it)
    from logging import LogRecord

# Keys torch's agent reads and writes: the same ones let ranktop and torchrun nodes work together.
_ROLE_INFO = "torchelastic/role_info/"
_ASSIGNED_RANKS = "torchelastic/assigned_ranks/"
_EXIT_BARRIER = "torchelastic/agent/terminal_state"
_MASTER_ADDR, _MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
# ranktop's own, in each round's store: where the ranks' store is; why the group ended (the first
# node to know writes it, the others take its answer); a node that gave up, and who has read that.
_RANKS_STORE = "ranktop/ranks_store/"
_RANKTOP_NODE = "ranktop/node/"  # written by each ranktop node before its role info
_GROUP_END = "ranktop/group_end"
# The word a node whose user restarted the group (`R`) leaves under _GROUP_END, and what the
# other nodes say of it.
USER_RESTART = "user_restart"
PEER_RESTART_WORDS = "another node's user restarted the group (R)"
# The word a node stopped by its user (K, q, `ranktop stop`, a stop signal) leaves under _GROUP_END
# as it steps out of its round. Before it, the node counts itself under _STOPPED and says, under
# _STOPPED/<its count>, its group rank and how: a signal's name, or STOP_COMMAND.
USER_STOP = "user_stop"
_STOPPED = "ranktop/stopped"
STOP_COMMAND = "command"
_GAVE_UP = "ranktop/gave_up"
_GAVE_UP_HEARD = "ranktop/gave_up_heard"
_BARRIER_LEFT = "ranktop/exit_barrier_left"  # ranktop nodes past the exit barrier (or done waiting at it)
_BARRIER_CAME = "ranktop/exit_barrier_came"  # ranktop nodes that came to it (torch's count has torchrun's too)
# The static backend has no rounds: one store for the whole job. ranktop's k-th start of the group
# (k > 0) meets there, at `ranktop/start/<k>/`, and keeps that start's keys under that prefix.
_START = "ranktop/start/"
# ranktop's own --rdzv-conf key (torch never sees it): where the ranks meet. "fresh": a new store on
# group rank 0 for each start of the group; "rendezvous": the rendezvous's own (c10d), no other port.
RANKS_STORE_CONF = "ranks_store"
_RANKS_STORE_CHOICES = ("fresh", "rendezvous")
_ON_RENDEZVOUS_STORE = "rendezvous"  # published instead of a host and port: each node's own endpoint
_ONE_STORE_ATTR = "_ranktop_ranks_on_rendezvous_store"  # set on torch's handler: it travels in WorkerSpec
_RENDEZVOUS_KEYS = "torch.rendezvous."  # c10d's own keys (its state, its rounds' stores): kept when clearing

BUILTIN_BACKENDS = ("c10d", "etcd", "etcd-v2", "static")
_POLL = 0.1  # seconds between looks at the store while waiting on it
GAVE_UP_LINGER = 5.0  # at most this long a node that gave up waits for the others to hear it
NEWCOMERS_LOOK = 1.0  # seconds between looks for nodes waiting for a new round, at the exit barrier
STORE_LOST_LOOKS = 3  # looks in a row, while the ranks run, that find the store's connection gone
# seconds a look at the store may wait for its answer before the store is said not to answer: a
# TCPStore call to a paused node (SIGSTOP, a paused VM) waits as long as it stays paused, whatever
# the store's time-out
STORE_SILENT = 5.0


class RendezvousFailed(RuntimeError):
    """The rendezvous cannot go on (closed, timed out, unreachable); str() is one line for the user."""


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """torchrun's --rdzv-conf: 'join_timeout=60,is_host=1' -> {'join_timeout': '60', 'is_host': '1'}."""
    conf: dict[str, str] = {}
    if not text.strip():
        return conf
    for item in text.split(","):
        key, _, value = item.partition("=")
        if not key.strip() or not value.strip():
            raise UsageError(f"bad --rdzv-conf {quoted(text)}: expected KEY=VALUE[,KEY=VALUE...], "
                             "e.g. join_timeout=60,last_call_timeout=5")
        conf[key.strip()] = value.strip()
    for key in _COUNTS.intersection(conf):
        try:
            number = int(conf[key])
        except ValueError:  # not a number at all: torch's own words, when it reads it
            continue
        # torch takes 0 or less, then waits out the round (600 s by default). Past a week it is a typo,
        # as ranktop's own waits; far past it, torch's timedelta or the store's C int overflowed (a
        # traceback), or a deadline past year 9999 failed the round as it formed
        if not 0 < number <= MAX_SECONDS:
            raise _not_a_count(key, conf[key])
    _check_keep_alive_limit(conf)
    return conf


def _not_a_count(key: str, value: str) -> UsageError:
    return UsageError(f"bad --rdzv-conf {key}={value}: expected a positive whole number, at most {MAX_SECONDS}")


def _check_keep_alive_limit(conf: dict[str, str]) -> None:
    """torch drops a node whose heartbeats are older than keep_alive_interval x keep_alive_max_attempt,
    reckoned back from now: at most a week, as each of them (a limit of thousands of years failed the
    round as it formed, on a date before year 1)."""
    try:
        interval = int(conf.get("keep_alive_interval", _KEEP_ALIVE_DEFAULTS[0]))
        attempts = int(conf.get("keep_alive_max_attempt", _KEEP_ALIVE_DEFAULTS[1]))
    except ValueError:  # torch's own words, when it reads it
        return
    if interval * attempts > MAX_SECONDS:
        typed = ",".join(f"{key}={conf[key]}" for key in ("keep_alive_interval", "keep_alive_max_attempt") if key in conf)
        raise UsageError(f"bad --rdzv-conf {typed}: keep_alive_interval x keep_alive_max_attempt, the keep-alive "
                         f"limit ({interval} x {attempts} s), must be at most {MAX_SECONDS} s")


# --rdzv-conf keys torch reads as whole numbers that must be positive: seconds, or attempts.
_COUNTS = frozenset({"join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval",
                     "keep_alive_max_attempt", "read_timeout", "timeout"})
_KEEP_ALIVE_DEFAULTS = (5, 3)  # torch's keep_alive_interval (seconds) and keep_alive_max_attempt


def _torch_rendezvous(backend: str) -> Any:
    """torch's rendezvous package (importing it registers c10d, etcd, static and plugins)."""
    try:
        with warnings.catch_warnings(), _quiet_cpp_logs():
            warnings.simplefilter("ignore")  # torch warns at import time when numpy is missing
            from torch.distributed.elastic import rendezvous
            from torch.distributed.elastic.rendezvous import registry
    except ImportError as exc:
        raise UsageError(f"--rdzv-backend {backend} needs torch, and {torch_import_problem(exc)}; without it, "
                         "run the static form: --nnodes N --node-rank R --master-addr HOST --master-port PORT") from None
    return rendezvous, registry


@contextlib.contextmanager
def _quiet_cpp_logs() -> Iterator[None]:
    """torch's C++ warnings and errors in ranktop's own process (a store whose server went away, or
    out of reach at the first join: a page of stack frames per call) are not for ranktop's user, who
    gets one line that says what happened.
    torch reads TORCH_CPP_LOG_LEVEL once, as it loads; the ranks get the environment as it was.
    A level the user set is theirs."""
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        yield
    finally:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def torch_import_problem(exc: ImportError) -> str:
    """Why importing torch (or a part of it) failed, in words for the user: not installed, or
    installed and broken (a CUDA library missing, a bad build): then pip install would not help."""
    if not torch_installed():
        return "torch is not installed (pip install torch)"
    return f"torch failed to import: {_one_line(exc)}"


def torch_installed() -> bool:
    """Whether there is a torch to import (it may still fail to import), without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except ValueError:  # torch in sys.modules as None: it cannot be imported
        return False


def check_endpoint(endpoint: str, max_nodes: int, flag: str = "--rdzv-endpoint") -> None:
    """UsageError (one line, naming `flag`) for an endpoint torch would take and then wait on."""
    if len(endpoint) > 300:  # a name no resolver takes: torch printed pages of C++ frames
        raise UsageError(f"bad {flag} {quoted(endpoint[:80])}: expected HOST:PORT with a host name of at most "
                         "255 characters")
    if "://" in endpoint:  # etcd's own URLs, http://HOST:PORT: it was taken for an IPv6 address without brackets
        raise UsageError(f"bad {flag} {quoted(endpoint[:80])}: expected HOST:PORT, without a scheme such as http://")
    if endpoint.count(":") > 1 and not endpoint.startswith("["):  # torch reads "::1" as host ":", port 1, and waits
        raise UsageError(f"bad {flag} {quoted(endpoint)}: write an IPv6 address in brackets, [::1]:29400")
    port = endpoint.rpartition(":")[2].strip() if ":" in endpoint else ""
    if max_nodes > 1 and port.isascii() and port.isdigit() and len(port) <= 5 and int(port) == 0:
        # One node binds a free port for its store (torchtitan's `localhost:0`); more cannot find it
        raise UsageError(f"bad {flag} {quoted(endpoint[:80])}: port 0 (a free one) only works on one node: "
                         f"with up to {max_nodes} nodes the others could not find it; name a port they all reach")


# What python-etcd, under torch's etcd backends, does not escape as it puts the run id into the key's
# URL: the server reads the key cut at '?' or '#', and '%XX' as the character it stands for.
_ETCD_URL_CUTS = {"?": "ends the key: 'a?1' and 'a?2' met in one rendezvous, 'a'",
                  "#": "ends the key: 'a#1' and 'a#2' met in one rendezvous, 'a'",
                  "%": "starts an escape: 'a%20b' met 'a b', and 'a%2Fb' was the key 'a/b'"}


def check_rdzv_id(run_id: str, backend: str, flag: str = "--rdzv-id") -> None:
    """UsageError (one line, naming `flag`) for a run id that torch's etcd backends would store under
    another job's key: two jobs met in one rendezvous, or a job found another's closed."""
    if backend not in ("etcd", "etcd-v2"):
        return
    for char, what in _ETCD_URL_CUTS.items():
        if char in run_id:
            raise UsageError(f"bad {flag} {quoted(run_id)}: the {backend} backend puts it into a URL unescaped, "
                             f"where {char!r} {what}; use an id without '?', '#' or '%'")


def static_master(endpoint: str, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """The static backend's HOST:PORT (IPv6 in brackets), where the ranks meet when ranktop's own
    static form (no torch) runs it; torch's static backend asks for both too."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port:
        raise UsageError(f"bad {flag} {quoted(endpoint)}: the static backend needs HOST:PORT (the master's)")
    return host.strip("[]"), PORT.parse(f"{flag}'s port", port)


# torchrun's launcher gives every backend this `timeout` unless --rdzv-conf names one (the static
# and etcd backends wait that long for the other nodes; their own default is 600 s).
RDZV_TIMEOUT = 900
_C10D_READ_TIMEOUT = 60  # torch's c10d backend's read_timeout unless --rdzv-conf names one
# The name of a thread that runs a store call ranktop may walk away from, blocked in torch's C++
STORE_CALL_THREAD = "ranktop-rdzv-join"
_CUT_SHORT_LOOK = 0.05  # seconds between looks at whether a wait for a store call is to end early


class Done(threading.Event):
    """An event waited for by the monitor loop, for a while at most."""

    def wait_within(self, seconds: float, cut_short: Callable[[], bool] | None = None) -> bool:
        """Whether it is set within `seconds`, and before `cut_short()` says to stop waiting
        (looked at every _CUT_SHORT_LOOK seconds)."""
        deadline = time.monotonic() + seconds
        while not self.is_set() and (left := deadline - time.monotonic()) > 0:
            if cut_short is not None and cut_short():
                break
            self.wait(left if cut_short is None else min(left, _CUT_SHORT_LOOK))
        return self.is_set()


class StoreCall:
    """`call()` run in a daemon thread named STORE_CALL_THREAD: a store call may block for its
    whole time-out, or for ever in torch's C++, and whoever waits for it must be free to walk
    away (the thread is left blocked: agent_rendezvous.store_call_left_blocked). `done` is set
    once it has returned or raised; an exception among `caught` is kept as its outcome, any
    other ends the thread."""

    def __init__(self, call: Callable[[], Any], caught: type[Exception] | tuple[type[Exception], ...] = ()) -> None:
        self.done = Done()
        self._outcome: list[Any] = []
        threading.Thread(target=self._run, args=(call, caught), name=STORE_CALL_THREAD, daemon=True).start()

    def _run(self, call: Callable[[], Any], caught: Any) -> None:
        try:
            self._outcome.append(call())
        except caught as exc:
            self._outcome.append(exc)
        finally:
            self.done.set()

    def outcome(self, default: Any = None) -> Any:
        """What the call returned, or the caught exception it raised; `default` while it runs, or
        where it raised another."""
        return self._outcome[0] if self._outcome else default


def create_handler(
    backend: str,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    *,
    conf: dict[str, str] | None = None,
    local_addr: str | None = None,
    check_only: bool = False,
) -> Any:
    """torch's RendezvousHandler for torchrun's flags, from torch's handler registry (plugins too).

    As with torchrun, the c10d node that hosts the store starts it here and the others connect to
    it. UsageError for bad values or a missing package (naming what to install); RendezvousFailed
    when the endpoint cannot be reached. `check_only`: the values checked, nothing started or
    reached, None returned (`--detach`: the store must be the background run's, not ours).
    """
    conf = dict(conf or {})
    one_store = _ranks_on_rendezvous_store(conf.pop(RANKS_STORE_CONF, "fresh"), backend)
    rdzv, registry = _torch_rendezvous(backend)
    try:
        params = rdzv.RendezvousParameters(backend=backend, endpoint=endpoint, run_id=run_id,
                                           min_nodes=min_nodes, max_nodes=max_nodes, local_addr=local_addr,
                                           **{"timeout": RDZV_TIMEOUT, **conf})
        handler = None if check_only else _handler_in_time(registry.get_rendezvous_handler, params, conf)
    except Exception as exc:
        raise _handler_error(exc, rdzv, backend, endpoint) from None
    if handler is not None and one_store:
        setattr(handler, _ONE_STORE_ATTR, True)
    return handler


def _handler_in_time(make: Callable[[Any], Any], params: Any, conf: dict[str, str]) -> Any:
    """`make(params)`, torch's handler, made in a thread of its own: a c10d node that connects to an
    endpoint where something else listens (a mistyped port, etcd's) waits in torch's C++ for an
    answer that never comes, whatever its read_timeout, and took no Ctrl-C there. Past twice that
    time-out and 5 s, RendezvousFailed; the thread is left blocked, as a stop leaves a round's call
    (agent_rendezvous.store_call_left_blocked). With nothing listening, torch's own tries to connect
    overrun the time-out too (9.5 s for 5, 142 s for 60) before they fail: the line covers both."""
    if params.backend != "c10d":
        return make(params)
    try:
        limit = 2 * int(conf.get("read_timeout", _C10D_READ_TIMEOUT)) + 5
    except ValueError:  # torch's own words, at once
        return make(params)
    call = StoreCall(lambda: make(params), Exception)
    if not call.done.wait(limit):  # (a Ctrl-C ends the wait: KeyboardInterrupt)
        raise RendezvousFailed(f"cannot reach the c10d rendezvous at {params.endpoint}: no c10d store answered "
                               f"there within {limit} s (none serves it, or another service listens on that port)")
    if isinstance(handler := call.outcome(), Exception):
        raise handler
    return handler


def check_rdzv_conf(text: str, backend: str) -> None:
    """--rdzv-conf checked as create_handler checks it (UsageError), where no handler is made: one
    node without a backend, --standalone, ranktop's own static form. torchrun refuses a bad one
    there too; no torch handler reads its counts, so one that is no number is said here."""
    conf = parse_rdzv_conf(text)
    for key in sorted(_COUNTS.intersection(conf)):
        try:
            int(conf[key])
        except ValueError:
            raise _not_a_count(key, conf[key]) from None
    _ranks_on_rendezvous_store(conf.get(RANKS_STORE_CONF, "fresh"), backend)


def _ranks_on_rendezvous_store(choice: str, backend: str) -> bool:
    """--rdzv-conf ranks_store=fresh|rendezvous: True for the rendezvous's own store. Only c10d's
    store is a TCPStore that every node reaches and whose rounds wait for every node's ranks to end
    (the static backend has no rounds: a restarted node would clear keys under its peers' new ranks)."""
    if choice not in _RANKS_STORE_CHOICES:
        raise UsageError(f"bad --rdzv-conf {RANKS_STORE_CONF}={choice}: expected fresh or rendezvous")
    if choice == "rendezvous" and backend != "c10d":
        raise UsageError(f"--rdzv-conf {RANKS_STORE_CONF}=rendezvous needs --rdzv-backend c10d, not {backend}")
    return choice == "rendezvous"


def _handler_error(exc: Exception, rdzv: Any, backend: str, endpoint: str) -> Exception:
    """What to tell about a handler that could not be made: one line, or `exc` itself if unforeseen."""
    if isinstance(exc, ImportError):
        if backend.startswith("etcd"):
            return UsageError(f"--rdzv-backend {backend} needs the etcd client: pip install python-etcd")
        return UsageError(f"--rdzv-backend {backend}: {_one_line(exc)}")
    # python-etcd's client asks the server for its peers as it is made: its errors mean no server there.
    if isinstance(exc, rdzv.RendezvousError) or type(exc).__module__.partition(".")[0] == "etcd":
        why = _one_line(exc)
        if backend.startswith("etcd") and "404" in why:  # an etcd 3.x serving only its v3 API
            why += " (torch's etcd backends need etcd's v2 API: etcd 3.4/3.5 with --enable-v2)"
        return RendezvousFailed(f"cannot reach the {backend} rendezvous at {endpoint or '(no endpoint)'}: {why}")
    if isinstance(exc, (ValueError, TypeError, KeyError, OverflowError)):  # (a number too large for torch)
        known = ", ".join(BUILTIN_BACKENDS)
        return UsageError(f"bad rendezvous (--rdzv-backend {backend}, --rdzv-endpoint {quoted(endpoint)}, "
                          f"--rdzv-conf): {_one_line(exc)} (backends: {known} or a torchrun plugin)")
    return exc


def _one_line(exc: BaseException) -> str:
    """The exception's message and its cause's, on one line."""
    parts, last = [], exc
    while exc is not None and len(parts) < 3:
        last = exc
        text = " ".join(str(exc).split())
        inner = exc.__cause__ or exc.__context__
        if inner is not None:  # torch's pointer to the cause, which follows here anyway
            text = text.replace(" See inner exception for details.", "").removesuffix(".")
        if text and text not in parts:
            parts.append(text)
        exc = inner
    return "; ".join(parts) or _raised_where(last)


def _raised_where(exc: BaseException) -> str:
    """Where an exception that says nothing was raised: something a user can look up (torch 2.11's
    c10d handler fails a bare `assert` when a node becomes group rank 0 in a later round)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "no message"
    code, path = tb.tb_frame.f_code, tb.tb_frame.f_code.co_filename
    for packages in ("/site-packages/", "/dist-packages/"):  # torch/... rather than the venv's path
        path = path.rpartition(packages)[2]
    where = f"no message, raised at {path}:{tb.tb_lineno} in {code.co_name}"
    torch = sys.modules.get("torch")
    if path.startswith("torch/") and torch is not None:
        where += f" (torch {getattr(torch, '__version__', 'of no version')})"
    return where


def plan_ranks(nodes: list[tuple[str, int]]) -> list[tuple[int, int, int, int]]:
    """Ranks for every node, as torch's agent assigns them.

    `nodes[g]` is (role, local_world_size) of the node with group rank g. Returns, per node,
    (base global rank, world size, base role rank, role world size): global ranks run through the
    nodes in group-rank order; role ranks do the same among the nodes of one role.
    """
    world = sum(size for _, size in nodes)
    role_sizes: dict[str, int] = {}
    for role, size in nodes:
        role_sizes[role] = role_sizes.get(role, 0) + size
    plan, next_rank, next_role_rank = [], 0, dict.fromkeys(role_sizes, 0)
    for role, size in nodes:
        plan.append((next_rank, world, next_role_rank[role], role_sizes[role]))
        next_rank += size
        next_role_rank[role] += size
    return plan


def identical_nodes() -> bool:
    """torch's fast path (TORCH_ELASTIC_WORKER_IDENTICAL=1): every node has the same role and size,
    so ranks follow from the group rank and nothing goes through the store."""
    return os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1"


def assign_ranks(store: Any, group_rank: int, nodes: int, role: str, local_world_size: int,
                 before_answers: Callable[[], None] | None = None) -> tuple[int, int, int, int]:
    """This node's (base rank, world size, base role rank, role world size) through the round's
    store: each node writes its role and size, group rank 0 plans and writes every node's answer
    (after `before_answers()`, which sees every node's role written)."""
    if identical_nodes():
        world = nodes * local_world_size
        return group_rank * local_world_size, world, group_rank * local_world_size, world
    store.set(f"{_ROLE_INFO}{group_rank}",
              json.dumps({"role": role, "rank": group_rank, "local_world_size": local_world_size}))
    if group_rank == 0:
        infos = [_role_info(store.get(f"{_ROLE_INFO}{g}"), g) for g in range(nodes)]
        if before_answers is not None:
            before_answers()
        plan = plan_ranks(infos)
        store.multi_set([f"{_ASSIGNED_RANKS}{g}" for g in range(nodes)], [json.dumps(p) for p in plan])
    return _assigned(store.get(f"{_ASSIGNED_RANKS}{group_rank}"), nodes, local_world_size)


# What other nodes write to the store is input: anyone who reaches it can write it (it takes no
# password). A value of another shape, or ranks that cannot be this node's, is a one-line failure
# of the round, not a world of absurd ranks for the ranks to fail in.
_JSON_MAX = 1 << 20  # bytes of a JSON value from the store parsed at most (ranktop's own are under 1 KiB)


def _store_json(raw: bytes, what: str) -> Any:
    """The JSON value another node wrote for `what`; ValueError if it is no JSON, or over _JSON_MAX
    bytes: torch's client reads a value whole (one grown by `append` past 100 MB too), and parsing
    100 MB of `[0,0,...` took 400 MB more and 2 s."""
    if len(raw) > _JSON_MAX:
        raise ValueError(f"{what} in the store is {len(raw)} bytes, over {_JSON_MAX}")
    return json.loads(raw)


def _role_info(raw: bytes, group_rank: int) -> tuple[str, int]:
    """(role, local world size) that node `group_rank` wrote; ValueError if it is not one."""
    info = _store_json(raw, f"node {group_rank}'s role and size")
    role, size = (info.get("role"), info.get("local_world_size")) if isinstance(info, dict) else (None, None)
    if not isinstance(role, str) or not 0 < len(role) <= 256 or not is_whole(size) or not 0 < size <= MAX_NPROC_PER_NODE:
        raise ValueError(f"node {group_rank}'s role and size in the store are not a role and 1 to "
                         f"{MAX_NPROC_PER_NODE} ranks: {clean(str(info))[:120]}")
    return role, size


def _assigned(raw: bytes, nodes: int, local_world_size: int) -> tuple[int, int, int, int]:
    """(base rank, world size, base role rank, role world size) as group rank 0 wrote them for
    this node; ValueError unless they place its `local_world_size` ranks within the world."""
    ranks = _store_json(raw, "the ranks assigned to this node")
    if isinstance(ranks, list) and len(ranks) == 4 and all(map(is_whole, ranks)):
        base, world, role_base, role_world = ranks
        if (0 <= base and base + local_world_size <= world <= nodes * MAX_NPROC_PER_NODE
                and 0 <= role_base and role_base + local_world_size <= role_world <= world):
            return base, world, role_base, role_world
    raise ValueError(f"the ranks assigned to this node in the store cannot be its {local_world_size}: "
                     f"{clean(str(ranks))[:120]}")


def published_master(store: Any, number: int, bootstrap: tuple[str, int]) -> tuple[str, int, bool]:
    """MASTER_ADDR/PORT for this node's ranks, and whether that is the rendezvous's own store: what
    a ranktop group rank 0 published (it does so before it assigns the ranks, so it is there by
    now), else torch's, as on a torchrun node (group rank 0 is one, or TORCH_ELASTIC_WORKER_IDENTICAL
    skipped the assignment). The rendezvous's store is reached as this node reaches it. Either is
    what some node wrote to the store: ValueError unless it is a host and a port."""
    key = f"{_RANKS_STORE}{number}"
    if not store.check([key]):
        return (*_master(*bootstrap), False)  # group rank 0 is a torchrun node
    published = _store_json(store.get(key), "the ranks' master")
    if published == _ON_RENDEZVOUS_STORE:
        endpoint = _tcp_endpoint(store)
        if endpoint is None:
            raise ValueError("the ranks are to use the rendezvous's store, and this node's is no TCPStore")
        return (*endpoint, True)
    if isinstance(published, list) and len(published) == 2:
        return (*_master(*published), False)
    raise ValueError(f"the ranks' master in the store is no host and port: {clean(str(published))[:120]}")


def _master(addr: Any, port: Any) -> tuple[str, int]:
    """(addr, port) if they are a host name or address and a port, as the ranks' MASTER_ADDR and
    MASTER_PORT must be; ValueError otherwise. torch's own MASTER_ADDR/MASTER_PORT keys, which its
    handler reads for every node, are no more to be trusted than ranktop's."""
    if isinstance(addr, str) and 0 < len(addr) <= 255 and addr.isprintable() and " " not in addr \
            and is_whole(port) and 0 < port < 65536:
        return addr, port
    raise ValueError(f"the ranks' master in the store is no host and port: {clean(str(addr))[:120]}:"
                     f"{clean(str(port))[:20]}")


def _clear_ranks_keys(store: Any) -> None:
    """Delete what earlier starts of the group left in the rendezvous's TCPStore: every key but
    c10d's own (torch 2.13's ranks write theirs unprefixed, and a restarted group's gloo read the
    old ranks' addresses and dialled them). Every node of the round has ended its ranks by now."""
    tcp = _tcp_store(store)
    for key in tcp.list_keys():
        if not key.startswith(_RENDEZVOUS_KEYS):
            tcp.delete_key(key)


def _serve_ranks_store(host: str) -> Any:
    """A new TCPStore server in this process, on a free port, for one start of the group's ranks."""
    import torch.distributed as dist

    return dist.TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)


_FIRST_WORD_WAIT = 10.0  # seconds: the first caller writes its word right after counting


def _first_word(store: Any, key: str, word: str) -> str:
    """The first word written to `key` by the callers of this, `word` if this call is the first.
    c10d's stores have compare_set; torch's etcd store (etcd and etcd-v2 rounds) has none, only an
    atomic add: the callers are counted, the first writes its word, the others read it."""
    try:
        return store.compare_set(key, "", word).decode()
    except RuntimeError as exc:
        if "Not implemented" not in str(exc):
            raise
    if store.add(f"{key}/callers", 1) == 1:
        store.set(key, word)
        return word
    from datetime import timedelta  # (here: datetime is not imported at every start for this)

    store.wait([key], timedelta(seconds=_FIRST_WORD_WAIT))
    return store.get(key).decode()


_END_WORDS = ("nodes_joined", "failure", USER_RESTART, USER_STOP)


def _end_word(word: str, seen: str) -> str:
    """The word found under _GROUP_END if it is one a node writes, else this node's own `seen`:
    anyone can write there, and the round watch took any other word for nodes joining (a node
    found dropped, a failure, then cost no restart)."""
    return word if word in _END_WORDS else seen


class RoundEnd(Value):
    """Why the running round must end although the ranks are fine."""

    __slots__ = ("kind", "message", "serves_store")

    # `kind`: "nodes_joined": restart the group, no restart spent; "peer_failed": another node's ranks
    # failed, restart the group as a failure; "peer_restart": another node's user restarted the
    # group (`R`), the next attempt, no restart spent; "peer_gave_up": stop, the rendezvous is closed;
    # "store_lost": stop, the node serving the store the ranks use too has ended; "left_behind":
    # this node was dropped from the round (frozen, cut off) and the job went on, join the next one
    # with no restart spent ("peer_failed" too for another node dropped, its heartbeats lapsed);
    # "peer_stopped": another node's user stopped it, restart the group as a failure (a restart
    # spent, as torchrun's agents spend one), none of this node's ranks to blame.
    # `serves_store`: "new_round" and "left_behind" only: this node serves the store the others'
    # round needs, so it stays
    def __init__(self, kind: str, message: str, serves_store: bool = False) -> None:
        self.kind, self.message, self.serves_store = kind, message, serves_store


def _named(nodes: list[tuple[str, int]]) -> str:
    """"HOST (group rank 1), HOST2 (group rank 2)": the first _NODES_NAMED, the rest counted (one
    line, however many: a round of thousands, a state padded with nodes)."""
    named = ", ".join(f"{addr} (group rank {rank})" for addr, rank in nodes[:_NODES_NAMED])
    return named + (f" and {len(nodes) - _NODES_NAMED} more" if len(nodes) > _NODES_NAMED else "")


class _Stopped(NamedTuple):
    """What a node stopped by its user said of itself (_STOPPED), as words safe for a terminal."""

    group_rank: int | None  # None: not read (no whole number in range)
    how: str  # a signal's name, or the stop commands; "" where it is neither
    host: str  # its host name ("?" where none): for a handler that keeps no node addresses


def _how_stopped(raw: bytes) -> _Stopped:
    """What a node stopped by its user wrote (_STOPPED). Anyone can write there: a group rank that
    is no whole number in range is not read, a how that is no signal's name nor the stop commands
    is "" (the node is still said to be stopped), a host is cleaned and cut to one line's worth."""
    try:
        said = _store_json(raw, "how a node was stopped")
    except (ValueError, RecursionError):
        said = None
    if not isinstance(said, dict):
        return _Stopped(None, "", "?")
    rank, how, host = said.get("group_rank"), said.get("how"), said.get("host")
    host = (clean(host)[:_WORDS_SHOWN] or "?") if isinstance(host, str) else "?"
    if not is_whole(rank) or not 0 <= rank <= MAX_NNODES:
        return _Stopped(None, "", host)
    if how == STOP_COMMAND:
        return _Stopped(rank, "K, q or ranktop stop", host)
    signal_name = (isinstance(how, str) and len(how) <= 12 and how.isascii() and how.startswith("SIG")
                   and how[3:].isalpha() and how.isupper())  # (ASCII: a Greek capital passed as a letter of a name)
    return _Stopped(rank, how if signal_name else "", host)


class _RoundView(NamedTuple):
    """The running round as torch's dynamic handler sees it (Rendezvous._round_view)."""

    here: bool  # this node is still in it
    alive: bool  # another node still sends keep-alive heartbeats
    moved: bool  # the rendezvous is at a later round
    gone: list[tuple[str, int]]  # the round's nodes dropped from it: (address, group rank)


class _GaveUp(Value):
    __slots__ = ("host", "group_rank", "reason")

    def __init__(self, host: str, group_rank: int | str, reason: str) -> None:
        self.host, self.group_rank, self.reason = host, group_rank, reason


_WORDS_SHOWN = 300  # characters of a peer's host or reason: one line, whatever the store holds
_NODES_NAMED = 8  # nodes named in a line about nodes gone; the rest are counted


def _gave_up_words(raw: bytes) -> _GaveUp:
    """What a node that gave up wrote to the store, as words safe for a terminal. Anyone who
    reaches the store (it takes no password) can write there: a value of another shape, or with
    escape sequences or line breaks, must neither stop the watch nor reach the console raw."""
    try:
        said = _store_json(raw, "why a node gave up")
    except (ValueError, RecursionError):
        said = None
    if not isinstance(said, dict):
        said = {}

    def text(key: str) -> str:
        value = said.get(key)
        return clean(value if isinstance(value, str) else "?")[:_WORDS_SHOWN]

    rank = said.get("group_rank")  # (a whole number of 4,000 digits is JSON too)
    return _GaveUp(text("host"), rank if is_whole(rank) and 0 <= rank <= MAX_NNODES else "?", text("reason"))


class Rendezvous:
    """This node's side of torch's rendezvous: the only view of it the agent has."""

    def __init__(self, handler: Any, role: str, local_world_size: int):
        self.handler = handler
        # torch's handler unpickles what the store holds, anyone's bytes (imported here: a run with
        # no rendezvous loads no pickle machinery)
        from ranktop.core.rendezvous_state import vet_state_reads

        vet_state_reads(handler, weakly(self._state_refused))  # (weakly: the handler must not hold this alive)
        # told why, once for each round state refused (a state a peer wrote that torch would unpickle)
        self.on_state_refused: Callable[[str], None] | None = None
        self._a_state_refused = False  # (torch's warnings of it are dropped from then on)
        self.role = role
        self.local_world_size = local_world_size
        self.store: Any = None  # the current round's store
        self.placement: Placement | None = None
        self._rounds = 0
        self._job_store: Any = None  # static backend: the one store of the job
        self._every_node_ranktop = False  # static backend: seen in a later start's store check
        self._ranks_store: Any = None  # served here while this node is group rank 0
        self._ranks_on_rendezvous = False  # the running ranks meet on the rendezvous's own store
        # --rdzv-conf ranks_store=rendezvous: as group rank 0, send the ranks to the rendezvous's store
        self.on_rendezvous_store = bool(getattr(handler, _ONE_STORE_ATTR, False))
        self._told_gave_up = False
        self._next_look = 0.0  # at the exit barrier: when to look at the round's nodes again
        self._alone_since: float | None = None  # when no other node was first seen alive, of late
        # What ranktop said of the round's store, from its own looks while the ranks run: the
        # store's words while it is lost; `on_store_change` is told each change, once.
        self.store_lost: str | None = None
        self.on_store_change: Callable[[str | None], None] | None = None
        self._store_said = threading.Lock()
        self._ranks_run = False  # a RoundWatch looks (the store's loss is said while the ranks run)
        self._lost_looks = 0  # looks in a row that found the store's connection broken
        self.store_silent = False  # store_lost holds because a look waits for an answer, not because it failed
        self._asked_at: float | None = None  # when the look at the store under way asked it
        # torch's dynamic handler (c10d, etcd-v2): the nodes of the running round, as it formed, by
        # group rank; and those found out of it (heartbeats lapsed) at the last look
        self._round_nodes: dict[Any, int] = {}
        self._gone_seen: list[tuple[str, int]] = []
        self._done_said: list[tuple[str, int]] = []  # torchrun nodes said to be at the exit barrier, not gone
        self.on_peers_done: Callable[[str], None] | None = None
        self._stepped_out = False  # out of its round by its own leave_round, not by lapsed heartbeats
        self._dropped_said = -1  # the round (self._rounds) whose every node dropped was said
        self._join_began: float | None = None  # while torch's handler joins a round: since when
        self.on_every_node_dropped: Callable[[str], None] | None = None

    @property
    def run_id(self) -> str:
        return self.handler.get_run_id()

    def describe(self) -> str:
        return f"{self.handler.get_backend()} rendezvous '{self.run_id}'"

    def waiting_words(self) -> str:
        """What this node waits for while a round forms, in words: the nodes the round needs and
        when it gives up, where the handler says (torch's dynamic handlers, c10d and etcd-v2,
        through their settings; the static one its world size and timeout; the legacy etcd
        handler and a plugin perhaps neither)."""
        try:
            parts = self._round_needs()
        except Exception:  # noqa: BLE001 - a plugin's property that raises costs the detail, not the run
            parts = []
        return f"waiting for nodes to join the {self.describe()}" + (f" ({'; '.join(parts)})" if parts else "")

    def spare_words(self) -> str | None:
        """Words for a node that torch's dynamic handler (c10d, etcd-v2) put on its redundancy list,
        else None: the round is full and running, so the node waits with no time-out until a node
        of it leaves or the job ends, as a torchrun node does (its waiting line named the join
        time-out). Read from the state the handler last synced, without a store call."""
        try:
            if self.handler._this_node not in self.handler._state_holder.state.redundancy_list:
                return None
        except Exception:  # noqa: BLE001 - another handler, or torch's private parts moved
            return None
        return (f"the {self.describe()}'s round is full and running: this node waits as a spare, with no "
                "time-out, until a node of it leaves or the job ends")

    def _nodes_asked(self) -> tuple[int, int] | None:
        """(fewest, most) nodes this node's handler asks a round for, where it says."""
        settings = getattr(self.handler, "settings", None)
        low, high = getattr(settings, "min_nodes", None), getattr(settings, "max_nodes", None)
        if low is None:
            low = high = getattr(self.handler, "world_size", None)
        if low is None:  # torch's legacy etcd handler keeps them on the rendezvous it wraps
            impl = getattr(self.handler, "_rdzv_impl", None)
            low, high = getattr(impl, "_num_min_workers", None), getattr(impl, "_num_max_workers", None)
        return (low, high) if type(low) is int and type(high) is int else None

    def elastic(self) -> bool:
        """Whether a round may have fewer nodes than the most it takes (--nnodes MIN:MAX)."""
        try:
            asked = self._nodes_asked()
        except Exception:  # noqa: BLE001 - a plugin's property that raises: taken as elastic, the safe side
            return True
        return asked is None or asked[0] < asked[1]

    def size_not_asked(self, nodes: int) -> str | None:
        """Words for a round of `nodes` that this node's own --nnodes would not have formed (one
        round serves every node, and another node's --nnodes completed it); None where it fits."""
        try:
            asked = self._nodes_asked()
        except Exception:  # noqa: BLE001 - a plugin's property that raises costs the warning, not the run
            return None
        if asked is None or asked[0] <= nodes <= asked[1]:
            return None
        mine = str(asked[0]) if asked[0] == asked[1] else f"{asked[0]}:{asked[1]}"
        return (f"warning: the round has {nodes} node{'s' * (nodes != 1)}, not this node's --nnodes {mine}: "
                "another node's --nnodes decided it (give every node the same)")

    def forming(self) -> tuple[int | None, int | None]:
        """(number, nodes joined so far) of the round this node is joining, as torch's dynamic handler
        (c10d, etcd-v2) last synced its state: no store call, as a snapshot reads it several times a
        second. While a round is complete, the nodes on its wait list wait for the next one; the round
        this node last ran in is complete until it has stepped out of it. Other handlers: the number
        this node's rounds give it, and no count."""
        try:
            state = self.handler._state_holder.state
            number, complete, this = state.round, state.complete, self.handler._this_node
            placed = self.placement.round if self.placement is not None else None
            if complete and this in state.participants and number != placed:  # formed: its ranks being placed
                return number, len(state.participants)
            return (number + 1, len(state.wait_list)) if complete else (number, len(state.participants))
        except Exception:  # noqa: BLE001 - another handler, or torch's private parts moved
            return self._rounds, None

    def nodes_needed(self) -> str | None:
        """The nodes a round needs as this node's handler says: "2", "2 to 4"; None where it does not."""
        try:
            asked = self._nodes_asked()
        except Exception:  # noqa: BLE001 - a plugin's property that raises
            return None
        if asked is None:
            return None
        return str(asked[0]) if asked[0] == asked[1] else f"{asked[0]} to {asked[1]}"

    def _round_needs(self) -> list[str]:
        settings = getattr(self.handler, "settings", None)
        needed = self.nodes_needed()
        join = (getattr(getattr(settings, "timeout", None), "join", None) or getattr(self.handler, "timeout", None)
                or getattr(getattr(self.handler, "_rdzv_impl", None), "_timeout", None))  # (legacy etcd: seconds)
        parts = []
        if needed is not None:
            parts.append(f"{needed} node{'s' * (needed != '1')}")
        seconds = join.total_seconds() if hasattr(join, "total_seconds") else join
        if type(seconds) in (int, float) and seconds > 0:
            parts.append(f"gives up after {seconds:.0f} s")
        return parts

    def next_round(self) -> Placement:
        """Join the next round (blocks until it completes) and place this node's ranks in it.
        RendezvousFailed when the rendezvous is closed, times out or cannot be reached."""
        try:
            self._join_began = time.monotonic()
            try:
                info = self.handler.next_rendezvous()
            finally:
                self._join_began = None
            self._rounds += 1
            store, group_rank, nodes, number = info.store, info.rank, info.world_size, self._round_number()
            if self.handler.get_backend() == "static":
                store = self._static_start(store, number, nodes)
            use_agent_store = bool(self.handler.use_agent_store)
            bootstrap = (info.bootstrap_store_info.master_addr, int(info.bootstrap_store_info.master_port))
            self._ranks_store = None  # the previous group's store goes before the new one comes
            if group_rank == 0:  # torch's handler on a node new to the job waits for these in every round
                store.set(_MASTER_ADDR, bootstrap[0])
                store.set(_MASTER_PORT, str(bootstrap[1]))
            store.set(f"{_RANKTOP_NODE}{group_rank}", "1")

            def publish_master() -> None:
                self._publish_master(store, nodes, number, bootstrap, use_agent_store)

            ranks = assign_ranks(store, group_rank, nodes, self.role, self.local_world_size,
                                 before_answers=publish_master)
            master_addr, master_port, on_rendezvous_store = published_master(store, number, bootstrap)
            use_agent_store = use_agent_store or on_rendezvous_store  # the ranks are its clients
        except Exception as exc:
            raise RendezvousFailed(self._failure_message(exc)) from None
        self.store, self._told_gave_up, self._ranks_on_rendezvous = store, False, on_rendezvous_store
        self._lost_looks = 0  # (a look before this round is none of this store's)
        self._round_nodes, self._gone_seen, self._stepped_out = self._participants(), [], False
        self._done_said = []
        self._store_answers(True)  # a round formed in it (etcd's server may come back)
        self.placement = Placement(group_rank, nodes, *ranks, master_addr=master_addr, master_port=master_port,
                                   run_id=self.run_id, round=number, use_agent_store=use_agent_store)
        return self.placement

    def join_silent_for(self) -> float:
        """Seconds the store has not answered torch's dynamic handler (c10d, etcd-v2) while it joins
        a round: it reads the round's state about once a second as it waits, and a TCPStore call to
        a paused node (SIGSTOP, a paused VM) waits as long as the node stays paused, the join
        time-out and the store's own notwithstanding. 0 while no round is joined, or under another handler."""
        began = self._join_began
        holder = getattr(self._dynamic(), "_state_holder", None)
        last = getattr(holder, "_last_sync_time", None)
        if began is None or type(last) not in (int, float):
            return 0.0
        return time.monotonic() - max(began, last)

    def join_timeout(self) -> float | None:
        """torch's dynamic handler's join time-out in seconds, None where it has none to read."""
        return self._dynamic_timeout("join")

    def close_timeout(self) -> float:
        """How long torch's dynamic handler tries to close the rendezvous while its store answers
        (its close time-out, 30 s unless --rdzv-conf says), in seconds; 30 where it does not say."""
        close = self._dynamic_timeout("close")
        return 30.0 if close is None else close

    def _dynamic_timeout(self, name: str) -> float | None:
        timeout = getattr(getattr(getattr(self._dynamic(), "settings", None), "timeout", None), name, None)
        return timeout.total_seconds() if hasattr(timeout, "total_seconds") else None

    def endpoint_words(self) -> str:
        """" at HOST:PORT": where the rendezvous's own store is (c10d: its TCPStore), also before any
        round formed; "" where it is no TCPStore."""
        store = self.store
        if store is None:
            backend = getattr(getattr(self._dynamic(), "_state_holder", None), "_backend", None)
            store = getattr(getattr(backend, "_inner", backend), "_store", None)  # (rendezvous_state's wrapper)
        where = _tcp_endpoint(store) if store is not None else None
        return f" at {where[0]}:{where[1]}" if where else ""

    def _round_number(self) -> int:
        # torch's dynamic handler (c10d, etcd-v2) numbers its rounds the same on every node, but
        # keeps the number in its private state; other handlers: the rounds this node joined.
        state = getattr(getattr(self.handler, "_state_holder", None), "state", None)
        number = getattr(state, "round", None)
        return number if isinstance(number, int) else self._rounds - 1

    def _publish_master(self, store: Any, nodes: int, number: int, bootstrap: tuple[str, int],
                        use_agent_store: bool) -> None:
        """Group rank 0: say where this start of the group's ranks meet, before any node learns its
        ranks. When every node is ranktop: a fresh store, or the rendezvous's own, cleared, where
        asked (see the module's docstring for why); torch's own store when a torchrun node is in
        the round, since its ranks can only go there."""
        addr, port = _master(*bootstrap)  # (torch's handler read them back from the store)
        published: Any = [addr, port]
        if store.check([f"{_RANKTOP_NODE}{g}" for g in range(nodes)]):
            if self.on_rendezvous_store:
                _clear_ranks_keys(store)
                published = _ON_RENDEZVOUS_STORE
            elif use_agent_store:
                self._ranks_store = _serve_ranks_store(addr)
                published = [addr, self._ranks_store.port]
        store.set(f"{_RANKS_STORE}{number}", json.dumps(published))

    def _static_start(self, job_store: Any, start: int, nodes: int) -> Any:
        """The static backend's store for this node's `start`-th start of the group. It has no
        rounds: a node restarting alone read the first start's ranks and master again, and its
        ranks waited for peers that were not coming. So each later start meets first: every node's
        k-th start waits for every node's k-th (a node whose ranks run sees one waiting, in
        `nodes_waiting`, and restarts too), and keeps its keys under a prefix of its own. The first
        start stays on torch's keys, which a torchrun node in the job reads and writes."""
        self._job_store = job_store
        if start == 0:
            return job_store
        if not self._marked_ranktop(job_store, nodes):
            raise RendezvousFailed(f"the {self.describe()} cannot start the group again: a node of it is "
                                   "torchrun's, whose static rendezvous has no rounds to meet in (its "
                                   "restarted ranks would read the first start's keys); this node stops")
        arrived = f"{_START}{start}/arrived"
        job_store.add(arrived, 1)
        deadline = time.monotonic() + self.handler.timeout.total_seconds()
        while job_store.add(arrived, 0) < nodes:
            said = self.peer_gave_up()  # in the start this node left: a node out of restarts says so there
            if said:
                raise RendezvousFailed(f"the {self.describe()} is closed ({said}); this node stops")
            if time.monotonic() > deadline:
                raise RendezvousFailed(f"the {self.describe()} timed out: not every node came to start "
                                       f"{start} of the group within {self.handler.timeout.total_seconds():g} s")
            time.sleep(_POLL)
        import torch.distributed as dist

        return dist.PrefixStore(f"{_START}{start}/", job_store)

    def _marked_ranktop(self, job_store: Any, nodes: int) -> bool:
        """Whether every node marked itself ranktop in the first start (each does so as it joins,
        before its ranks start; a moment's grace for one whose peer failed at once)."""
        marks = [f"{_RANKTOP_NODE}{g}" for g in range(nodes)]
        deadline = time.monotonic() + GAVE_UP_LINGER
        while not self._every_node_ranktop:
            self._every_node_ranktop = bool(job_store.check(marks))
            if time.monotonic() > deadline:
                break
            if not self._every_node_ranktop:
                time.sleep(_POLL)
        return self._every_node_ranktop

    def _failure_message(self, exc: Exception) -> str:
        if isinstance(exc, RendezvousFailed):
            return str(exc)
        name = type(exc).__name__
        if name == "RendezvousClosedError":
            peer = self.peer_gave_up()
            why = peer or "another node gave up or the job ended"
            return f"the {self.describe()} is closed ({why}); this node stops"
        if name == "RendezvousTimeoutError":
            detail = " ".join(str(exc).split())
            return f"the {self.describe()} timed out: not enough nodes joined" + (f" ({detail})" if detail else "")
        if name in ("RendezvousConnectionError", "DistNetworkError", "DistStoreError"):
            return (f"lost the {self.describe()}: {_one_line(exc)} "
                    "(the node serving its store may have ended)")
        return f"the {self.describe()} failed: {name}: {_one_line(exc)}"

    def store_words(self) -> str:
        """"the c10d rendezvous 'job42''s store at HOST:PORT" (the address where it is a TCPStore)."""
        where = _tcp_endpoint(self.store) if self.store is not None else None
        return f"the {self.describe()}'s store" + (f" at {where[0]}:{where[1]}" if where else "")

    def store_lost_words(self) -> str:
        """"lost the c10d rendezvous 'job42''s store at HOST:PORT (the node serving it is gone?)"."""
        who = "the node serving it" if _tcp_endpoint(self.store) is not None else "its server"
        return f"lost {self.store_lost or self.store_words()} ({who} is gone?)"

    def look_at_store(self) -> bool:
        """Whether the round's store answers a call of ranktop's own (not one through torch's
        handler: a failing heartbeat holds its lock). What changed since the last look goes to
        `on_store_change`, once: the store's words when it stopped answering, None when it answers
        again. A call can block for the store's timeout where the network, not the node, is gone."""
        store = self.store
        if store is None:
            return True
        self._asked_at = time.monotonic()
        try:
            store.check([_GAVE_UP])
        except Exception as exc:  # noqa: BLE001 - whatever the error, the store did not answer
            self._lost_looks = self._lost_looks + 1 if _connection_lost(exc) else 0
            self._store_answers(False)
            return False
        finally:
            self._asked_at = None
        self._lost_looks = 0
        self._store_answers(True)
        return True

    def connection_broken(self) -> bool:
        """Look at the round's store now: is its connection broken (not a slow answer)? A TCPStore
        client (c10d's, the static backend's) never connects again, even to a new server at the
        same address: no round of this handler can form through it. Blocks like any store call."""
        return not self.look_at_store() and self._lost_looks > 0

    def store_gone(self) -> bool:
        """Whether the last STORE_LOST_LOOKS looks found the store's connection broken (not a
        slow answer, nor one passing fault): the node serving it has ended."""
        return self._lost_looks >= STORE_LOST_LOOKS

    def look_waited(self) -> float:
        """Seconds the look at the store under way (look_at_store) has waited for its answer, 0 if none."""
        asked_at = self._asked_at
        return 0.0 if asked_at is None else time.monotonic() - asked_at

    def store_not_answering(self) -> None:
        """A look at the store has waited STORE_SILENT seconds for its answer: said once, as a lost
        store is; the answer, when it comes, says the store is back."""
        with self._store_said:
            if self.store_lost is not None:
                return
            self.store_silent = True
        self._store_answers(False)

    def _store_answers(self, answers: bool) -> None:
        with self._store_said:  # the watch and a heartbeat's thread may look at once: one says it
            if answers == (self.store_lost is None):
                return
            self.store_lost = lost = None if answers else self.store_words()
        # (told outside the lock: what is said of a store back looks at the round through torch's
        # handler, whose heartbeat lock a failing heartbeat holds while it looks at the store here)
        if self.on_store_change is not None:
            self.on_store_change(lost)
        if answers:
            self.store_silent = False

    def quiet_lost_heartbeats(self) -> contextlib.AbstractContextManager[None]:
        """While in it, torch's WARNING for each failed keep-alive heartbeat of this rendezvous is
        dropped while ranktop says the store is lost (it said so once, in its own words)."""
        return _quiet_torch(self._drops_heartbeat_warning)

    def _state_refused(self, why: str) -> None:
        self._a_state_refused = True
        if self.on_state_refused is not None:
            self.on_state_refused(why)

    def _drops_heartbeat_warning(self, _record: LogRecord, text: str) -> bool:
        if f"{_FAILED_HEARTBEAT} '{self.run_id}' " not in text:
            return False
        if text.endswith(f"{_REFUSED_STATE}.") and self._a_state_refused:  # said once, in ranktop's words
            return True
        # The first failed heartbeat may come before the watch's next look: ranktop looks now (in
        # torch's keep-alive thread, which waits for it), and only its own look decides.
        if self.store_lost is None and self._ranks_run:
            self.look_at_store()
        return self.store_lost is not None

    def ranks_lose_the_store(self) -> bool:
        """Whether losing the rendezvous's store leaves the running ranks without theirs: torch's
        static rendezvous (group rank 0 serves the job's store and the ranks'), or ranks that meet on
        the rendezvous's own store (--rdzv-conf ranks_store=rendezvous). c10d's ranks otherwise meet
        on a store of group rank 0's, which need not be the endpoint's host: they run on."""
        return self._job_store is not None or self._ranks_on_rendezvous

    def nodes_waiting(self) -> int:
        """Nodes waiting for the next round; under the static backend, at this node's next start."""
        if self._job_store is not None:
            return int(self._job_store.add(f"{_START}{self._rounds}/arrived", 0))
        return self.handler.num_nodes_waiting()

    def agree_on_end(self, seen: str) -> str:
        """Why the running group ended, the same on every ranktop node of the round: `seen`
        ("nodes_joined", "failure" or USER_RESTART) if this node is the first to say, else the
        first one's word. A node whose ranks broke because another stopped its own for newcomers
        spends no restart; after a real failure every node spends one; after a user's `R` on one
        node every node starts the next attempt, spending none."""
        try:
            return _end_word(_first_word(self.store, _GROUP_END, seen), seen)
        except Exception:
            return seen  # out of reach: this node's own view

    def peer_gave_up(self) -> str | None:
        """What a node that gave up in this round said, once it did (and count this node as told)."""
        try:
            if self.store is None or not self.store.check([_GAVE_UP]):
                return None
            said = _gave_up_words(self.store.get(_GAVE_UP))
            if not self._told_gave_up and said.group_rank != self.placement.group_rank:
                self._told_gave_up = True
                self.store.add(_GAVE_UP_HEARD, 1)
        except Exception:
            return None  # the store is out of reach: the ranks or the next round will tell
        return f"node {said.host} (group rank {said.group_rank}) gave up: {said.reason}"

    def give_up(self, reason: str, stopped: Callable[[], bool] | None = None) -> str | None:
        """Tell this round's other nodes that this node gave up, then close the rendezvous.
        Returns how the wait for them to read it ended (`_linger_until_heard`, which `stopped()`
        ends: "stopped"), None where nothing was told: another node had given up first (then this
        one says nothing), the round is this node alone, or the store is out of reach."""
        placement, store = self.placement, self.store
        first = self.peer_gave_up()
        told = False
        if first is None and store is not None and placement is not None and placement.group_world_size > 1:
            try:
                store.set(_GAVE_UP, json.dumps({"host": socket.gethostname(), "reason": reason,
                                                "group_rank": placement.group_rank}))
                told = True
            except Exception:
                pass  # out of reach: the others learn it when they next join a round
        # Closed before the wait: a node already waiting for its next round hears only that (then
        # reads why), and a node at its exit barrier or with ranks running reads the key.
        self.close()
        return self._linger_until_heard(store, placement.group_world_size - 1, stopped) if told else None

    def _linger_until_heard(self, store: Any, others: int, stopped: Callable[[], bool] | None = None) -> str:
        """The store may live in this process: give the others a moment to read why first.
        "read" once every other node read it; "linger_over" after GAVE_UP_LINGER; "store_lost"
        where the store went; "stopped" once `stopped()` says so. "none_left" once no other node sends keep-alive heartbeats
        (killed, or dropped as gone): nobody is left to read it, so waiting helps none. While
        another node lives, or where the handler cannot say (no heartbeats: the static and etcd
        backends, a plugin; this node's own lapsed), it waits, as that node may still read it."""
        deadline = time.monotonic() + GAVE_UP_LINGER
        self._alone_since = None
        try:
            while store.add(_GAVE_UP_HEARD, 0) < others:
                # (alone for NEWCOMERS_LOOK: a peer moving to its next round is out of the
                # handler's state for an instant, and would find the store gone)
                if self._no_peer_left():
                    return "none_left"
                if time.monotonic() >= deadline:
                    return "linger_over"
                if stopped is not None and stopped():  # (its user's stop: answered, and out now)
                    return "stopped"
                time.sleep(_POLL)
        except Exception:
            return "store_lost"  # the store went: nobody is left to read it
        return "read"

    def close(self) -> bool:
        """Close the rendezvous: no node can start a new round of it. False if that failed (the
        store is gone: whoever tells of that, the exit barrier or the next round, says so)."""
        try:
            with _quiet_failed_close():
                return self.handler.shutdown() is not False
        except Exception:
            return False

    def exit_barrier(self, timeout: float, stopped: Callable[[], bool]) -> RoundEnd | None:
        """Wait until every node of the round got here (None), else why not: "timeout",
        "stopped", "peer_gave_up" (a node's ranks failed for good meanwhile), "new_round" (nodes
        wait for a round this node cannot join: the round's other nodes will not come; with
        `serves_store` where their round needs the store this process serves), "peer_stopped"
        (every node that has not come said its user stopped it), "peers_gone" (every other node
        ended without a word: their heartbeats lapsed) or "store_lost"."""
        placement, store = self.placement, self.store
        if store is None or placement is None:
            return None
        last = f"{_EXIT_BARRIER}/last_member"
        deadline = time.monotonic() + timeout
        self._next_look, self._alone_since = time.monotonic() + NEWCOMERS_LOOK, None
        try:
            if store.add(f"{_EXIT_BARRIER}/num_members", 1) >= placement.group_world_size:
                store.set(last, "<val_ignored>")
            store.add(_BARRIER_CAME, 1)  # (after torch's count: a reader of both counts none too few)
            while not store.check([last]):
                end = self._done_waiting(deadline, timeout, stopped)
                if end is not None:
                    store.add(_BARRIER_LEFT, 1)  # the nodes that pass are not to wait for this one
                    return end
                time.sleep(_POLL)
        except Exception as exc:
            return RoundEnd("store_lost", f"lost the {self.describe()}'s store before every node finished "
                                          f"(the node serving it may have ended): {_one_line(exc)}")
        self._linger_at_barrier(store, placement.group_world_size)
        return None

    def _done_waiting(self, deadline: float, timeout: float, stopped: Callable[[], bool]) -> RoundEnd | None:
        """Why a node at the exit barrier stops waiting now, if it does."""
        said = self.peer_gave_up()
        if said:
            return RoundEnd("peer_gave_up", said)
        if stopped():
            return RoundEnd("stopped", "stopped while waiting")
        if time.monotonic() < self._next_look:  # a look is a round trip through the handler's state
            return self._timed_out(deadline, timeout)
        self._next_look = time.monotonic() + NEWCOMERS_LOOK
        left = self.left_behind()
        if left:  # the round's other nodes are in a later one: none of them comes to this barrier
            return RoundEnd("left_behind", f"{left}; its ranks had finished, so it ends without waiting for the "
                                           "others, and leaves the rendezvous open for them", serves_store=self.serves_store())
        waiting = self._newcomers()
        if waiting:
            # A peer whose ranks failed re-joined (or a node came late): the round's other nodes
            # form the next one and never reach this barrier; waiting out the time-out helps none,
            # but in an elastic job their round lives in the store, which may be served from here.
            serves = self.elastic() and self.serves_store()
            then = (f"but it serves the rendezvous store their round needs: it stays until the job ends "
                    f"(at most {timeout:g} s)" if serves else "so it ends without waiting for the others")
            return RoundEnd("new_round", f"{waiting} node(s) wait for a new round of the {self.describe()} "
                                         "(a peer's ranks failed, or a node joined late); this node's ranks "
                                         f"finished and it cannot join, {then}", serves_store=serves)
        stopped = self._stopped_not_come()
        if stopped:
            return RoundEnd("peer_stopped", stopped)
        if self._no_peer_left():
            return RoundEnd("peers_gone", f"no other node of the {self.describe()} is left (their keep-alive "
                                          "heartbeats stopped: they ended without closing it), so this node ends "
                                          "without waiting for them")
        return self._timed_out(deadline, timeout)

    def _stopped_not_come(self) -> str | None:
        """Words for the round's nodes that said their user stopped them, where every node that has
        not come to the exit barrier is one of them, else None: a node stopped while its ranks ran
        never comes (its run ended with them), and the nodes here waited out the barrier's time-out
        (300 s) where another node was still alive to keep them from finding themselves alone."""
        stopped = self._other_nodes_stopped()
        if not stopped or self.store.add(f"{_EXIT_BARRIER}/num_members", 0) + len(stopped) < self.placement.group_world_size:
            return None
        one = len(stopped) == 1
        return f"{self._stopped_words(stopped)}, so this node ends without waiting for {'it' if one else 'them'}"

    def _timed_out(self, deadline: float, timeout: float) -> RoundEnd | None:
        return self.barrier_timed_out(timeout) if time.monotonic() > deadline else None

    def barrier_timed_out(self, timeout: float) -> RoundEnd:
        """The exit barrier's end once its `timeout` has run out."""
        return RoundEnd("timeout", f"not every node of the {self.describe()} finished within {timeout:g}s")

    def _newcomers(self) -> int:
        """Nodes waiting for the next round; 0 where the handler cannot say."""
        try:
            return self.nodes_waiting()
        except Exception:  # noqa: BLE001 - the store's loss is the barrier's own store calls' to tell
            return 0

    def others_alive(self) -> bool | None:
        """Whether another node still sends the rendezvous its keep-alive heartbeats. torch's dynamic
        handler (c10d, etcd-v2) drops a node whose heartbeats lapsed (keep_alive_interval times
        keep_alive_max_attempt: 15 s by default) from the state it reads; a node killed outright
        never says it left. None where that cannot be read: another handler, torch's private parts
        moved, the store out of reach (the barrier's own store calls tell of that)."""
        handler = self._dynamic()
        if handler is None:
            return None
        try:
            with handler._heartbeat_lock:
                handler._state_holder.sync()
                beating = list(handler._state_holder.state.last_heartbeats)
        except Exception:  # noqa: BLE001 - torch's private parts moved, or the store is out of reach
            return None
        if handler._this_node not in beating and not self._stepped_out:
            return None  # its own heartbeats lapsed too (the store's node paused): no word on the others
        return any(node != handler._this_node for node in beating)

    def _dynamic(self) -> Any:
        """torch's dynamic handler (c10d, etcd-v2), whose private state ranktop reads; None for another."""
        try:
            from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic
        except ImportError:
            return None
        return self.handler if isinstance(self.handler, dynamic.DynamicRendezvousHandler) else None

    def _participants(self) -> dict[Any, int]:
        """The round just joined: its nodes and their group ranks, as the dynamic handler holds them."""
        try:
            return dict(self._dynamic()._state_holder.state.participants)
        except Exception:  # noqa: BLE001 - another handler, or torch's private parts moved
            return {}

    def _lapse_words(self) -> str:
        """"2 s": how long torch's handler waits for a node's heartbeat before it drops the node."""
        try:
            settings = self.handler.settings
            return f"{(settings.keep_alive_interval * settings.keep_alive_max_attempt).total_seconds():g} s"
        except Exception:  # noqa: BLE001 - torch's settings moved
            return "the keep-alive limit"

    def _round_view(self, fresh: bool = False) -> _RoundView | None:
        """The running round as torch's dynamic handler sees it now, None where it cannot be read.
        The handler drops a node whose keep-alive heartbeats lapsed, and tells nobody. `fresh`: read
        the store, not the state the handler read less than its cache time ago (1 s): that state is
        judged by the clock at its reading, and a node frozen while a read was under way judges the
        old bytes it then gets by the time it resumed (every heartbeat lapsed, the round moved on)."""
        handler = self._dynamic()
        placement = self.placement
        if handler is None or placement is None or not self._round_nodes:
            return None
        try:
            with handler._heartbeat_lock:
                if fresh:
                    handler._state_holder._last_sync_time = -1  # as torch starts it: never read
                handler._state_holder.sync()
                state, this = handler._state_holder.state, handler._this_node
                gone = sorted((clean(str(node.addr))[:_WORDS_SHOWN], rank if type(rank) is int else -1)
                              for node, rank in self._round_nodes.items()
                              if node not in state.participants and node not in state.last_heartbeats)
                return _RoundView(here=state.round == placement.round and this in state.participants,
                                  alive=any(node != this for node in state.last_heartbeats),
                                  moved=state.round != placement.round, gone=gone)
        except Exception:  # noqa: BLE001 - torch's private parts moved, or the store is out of reach
            return None

    def left_behind(self) -> str | None:
        """Words for this node dropped from its running round while the job went on to a later one,
        else None. A node frozen (SIGSTOP, a paused VM, a debugger) or cut off for longer than the
        keep-alive limit is dropped by the others, who form a new round without it; resumed, torch's
        handler sends no more heartbeats and counts no node waiting, so its ranks ran on in the old
        round. (A node that finds every heartbeat stale, its own too, is at the next round in its
        own view: the job went on only if another node is alive there.)"""
        view = self._round_view()
        if view is None or view.here or not (view.moved and view.alive):
            return None
        return (f"this node was dropped from round {self.placement.round} of the {self.describe()}: no keep-alive "
                f"heartbeat of its for over {self._lapse_words()} (it was frozen or cut off), and the job went "
                "on without it")

    def every_node_dropped_unsaid(self) -> str | None:
        """every_node_dropped's words the first time they hold for the running round (whoever
        looks: the watch, or the line on a store that answers again), else None."""
        if self._dropped_said == self._rounds:
            return None
        words = self.every_node_dropped()
        if words:
            self._dropped_said = self._rounds
        return words

    def every_node_dropped(self) -> str | None:
        """Words for a round whose every node torch's handler dropped at once (the store's node paused
        for longer than the keep-alive limit, or every node): none sends a heartbeat from then on,
        and none is to blame, so the ranks run on. None otherwise."""
        def dropped(view: _RoundView | None) -> bool:
            return view is not None and not (view.here or view.alive or self._stepped_out)

        # the cached state may be an old read judged late: a fresh read has the last word
        if not (dropped(self._round_view()) and dropped(self._round_view(fresh=True))):
            return None
        return (f"every node of round {self.placement.round} was dropped meanwhile (no keep-alive heartbeat reached "
                f"it for over {self._lapse_words()}): the ranks run on, but torch's handler sends no more heartbeats, "
                "so a node lost from now on is noticed only when a collective of its ranks breaks")

    def nodes_gone(self) -> str | None:
        """Words for nodes out of the running round, else None: those that said their user stopped
        them (they stepped out: step_out_stopped), at the first look; those that torch's handler
        dropped (their heartbeats lapsed: killed, frozen or cut off), at two looks in a row. Their
        ranks are gone from the job, or will be, though ranks in no collective would never learn
        it. (A node that steps out of the round to join the next is out of every list for a moment.)"""
        view = self._round_view()
        gone = view.gone if view is not None and view.here else []
        done = self._at_torchruns_exit_barrier(gone)
        gone = [node for node in gone if node not in done]
        seen, self._gone_seen = self._gone_seen, gone
        if not gone:
            return None
        stopped = self._stopped_among(gone)
        if gone != seen and len(stopped) < len(gone):
            return None
        lost = [node for node in gone if node not in stopped]
        words = [self._stopped_words(stopped)] if stopped else []
        if lost:
            one = len(lost) == 1
            words.append(f"node{'s' * (not one)} {_named(lost)} of the {self.describe()} {'is' if one else 'are'} "
                         f"gone: no keep-alive heartbeat of {'its' if one else 'theirs'} for over {self._lapse_words()} "
                         "(killed, frozen or cut off)")
        return "; ".join(words)

    def _at_torchruns_exit_barrier(self, gone: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Those of the `gone` nodes that are torchrun's and waiting at the exit barrier, their ranks
        done: torch's agent waits there in one store call (TCPStore.wait), which holds its store
        client, so its keep-alive heartbeats stop and torch's handler drops it. Taken for lost, it
        had a ranktop node whose ranks still ran stop them and restart, or end the job. Nodes that
        never marked themselves ranktop, where as many torchrun nodes came to the barrier (torch's
        count less ranktop's); said once (`on_peers_done`). [] where none, or the store is out of reach."""
        try:
            torchrun = [node for node in gone if not self.store.check([f"{_RANKTOP_NODE}{node[1]}"])]
            if not torchrun:
                return []
            ranktop_came = int(self.store.add(_BARRIER_CAME, 0))  # (read first: see exit_barrier)
            came = int(self.store.add(f"{_EXIT_BARRIER}/num_members", 0)) - ranktop_came
        except Exception:  # noqa: BLE001 - out of reach: the watch's own look at the store says so
            return []
        if came < len(torchrun):  # not all of them: which ones is not for ranktop to guess
            return []
        new = [node for node in torchrun if node not in self._done_said]
        if new and self.on_peers_done is not None:
            one = len(new) == 1
            self.on_peers_done(f"node{'s' * (not one)} {_named(new)} of the {self.describe()} "
                               f"{'waits' if one else 'wait'} at the exit barrier, {'its' if one else 'their'} "
                               "ranks done: torchrun's agent sends no keep-alive heartbeats there, so "
                               f"{'it is' if one else 'they are'} not taken for gone")
        self._done_said += new
        return torchrun

    def stopped_words(self) -> str:
        """Words for the nodes of the running round that said their user stopped them, named as the
        round formed (the state torch's handler last read may not show them out of it yet: it may
        be a second old); for another node where none can be read (the store out of reach)."""
        stopped = self._other_nodes_stopped()
        return self._stopped_words(stopped) if stopped else f"another node of the {self.describe()} was stopped by its user"

    def _other_nodes_stopped(self) -> dict[tuple[str, int], str]:
        """The round's other nodes that said their user stopped them, by (address as the round
        formed, group rank), with how in words; {} where none did or the store is out of reach."""
        placement, said = self.placement, self._stopped_said()
        if placement is None:
            return {}
        addrs = {rank: clean(str(getattr(node, "addr", "?")))[:_WORDS_SHOWN] for node, rank in self._round_nodes.items()}
        # (the host it said where the handler keeps no addresses: the static and etcd backends)
        return {(addrs.get(rank, node.host), rank): node.how for rank, node in sorted(said.items())
                if rank < placement.group_world_size and rank != placement.group_rank}

    def _stopped_words(self, stopped: dict[tuple[str, int], str]) -> str:
        one, hows = len(stopped) == 1, sorted(set(stopped.values()))
        how = f" ({', '.join(how for how in hows if how)})" if any(hows) else ""
        return (f"node{'s' * (not one)} {_named(list(stopped))} of the {self.describe()} {'was' if one else 'were'} "
                f"stopped by {'its user' if one else 'their users'}{how}")

    def _stopped_among(self, gone: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
        """Those of the `gone` nodes (address, group rank) that said their user stopped them, with
        how in words."""
        said = self._stopped_said()
        return {node: said[node[1]].how for node in gone if node[1] in said}

    def _stopped_said(self) -> dict[int, _Stopped]:
        """By group rank, the first _NODES_NAMED nodes that said in the running round's store that
        their user stopped them (a count anyone can raise costs no more store calls). {} where the
        store is out of reach: the nodes are then said lost, as they are to torch's handler."""
        said: dict[int, _Stopped] = {}
        try:
            count = int(self.store.add(_STOPPED, 0))
            for n in range(1, min(count, _NODES_NAMED) + 1):
                key = f"{_STOPPED}/{n}"
                if self.store.check([key]):  # (counted, not yet said)
                    node = _how_stopped(self.store.get(key))
                    if node.group_rank is not None:
                        said.setdefault(node.group_rank, node)
        except Exception:  # noqa: BLE001 - out of reach, or no store (no round)
            pass
        return said

    def step_out_stopped(self, how: str) -> bool:
        """say_stopped, then leave_round where it was said. Returns whether it stepped out."""
        return self.say_stopped(how) and self.leave_round()

    def say_stopped(self, how: str) -> bool:
        """This node's user stopped it while its ranks run: before they stop (their peers' break
        once they do, and those nodes then agree on why), tell the round's other nodes how
        (_STOPPED), and take the group's end for it where no other node's word came first
        (USER_STOP: they restart as for a failure, blaming none of their ranks). A few store calls,
        none of them contended; the step out of the round (leave_round), which is, follows once
        the ranks have their signal. `how`: a signal's name, or STOP_COMMAND. In a round of this
        node alone there is nobody to tell. Returns whether it was said."""
        placement, store = self.placement, self.store
        if placement is None or store is None or placement.group_world_size < 2:
            return False
        try:  # (said before the word, which sends its readers here)
            store.set(f"{_STOPPED}/{store.add(_STOPPED, 1)}",
                      json.dumps({"group_rank": placement.group_rank, "how": how, "host": socket.gethostname()}))
            _first_word(store, _GROUP_END, USER_STOP)
        except Exception:  # noqa: BLE001 - out of reach: the others learn it as they would of a lost node
            return False
        return True

    def _no_peer_left(self) -> bool:
        """No other node alive in the rendezvous at two looks in a row: a node that goes on to its
        next round is out of it for a moment, between leaving the last round and joining the next."""
        if self.others_alive() is not False:
            self._alone_since = None
            return False
        now = time.monotonic()
        if self._alone_since is None:
            self._alone_since = now
        return now - self._alone_since >= NEWCOMERS_LOOK

    def serves_store(self) -> bool:
        """Whether this process serves the round's store (the c10d endpoint's host: a TCPStore
        server on a thread of ranktop's own), read from the sockets it listens on. A store that is
        no TCPStore (etcd, a plugin's) is nobody's process: False. Where the sockets cannot be read
        (no /proc): True, as staying is the safe side."""
        port = _tcp_port(self.store)
        if port is None:
            return False
        try:
            return port in _ports_listened_on_here()
        except OSError:
            return True

    def leave_round(self) -> bool:
        """Step out of the round without closing the rendezvous: the others' next round then forms
        at once, not once this node's heartbeats lapse (15 s by default). torch's dynamic handler
        (c10d, etcd-v2) has no public call for it; with any other handler nothing is done. Under
        the heartbeat lock, as the keep-alive thread and the round watch use the same state. It
        changes the round's state, which every node shares, by compare-and-set: where many nodes
        step out at once (a whole job stopped) each retries while the others change it (31 nodes
        of one process: the last 0.4 s after the stop, 1.5 s in an earlier measure). Returns
        whether it stepped out."""
        handler = self._dynamic()
        if handler is None:
            return False
        self._stepped_out = True
        try:
            from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic

            handler._stop_heartbeats()
            with handler._heartbeat_lock:
                handler._op_executor.run(dynamic._RendezvousExitOp(), handler._get_deadline(handler.settings.timeout.close))
        except Exception:  # noqa: BLE001 - torch's private parts moved, or the store is out of reach
            return False  # the heartbeats lapse instead, and the others go on then
        return True

    def stop_heartbeats(self) -> None:
        """This node's run has ended: it sends the rendezvous no more keep-alive heartbeats, so the
        other nodes find it gone once they lapse, as they would had its process ended. torch's
        dynamic handler (c10d, etcd-v2) sends them from a thread of its own for as long as the
        handler lives (a TUI showing the end, a detached engine lingering, an API caller holding
        the agent) unless the rendezvous is closed, which a stop, or a store lost, leaves undone."""
        handler = self._dynamic()
        if handler is None:
            return
        try:
            handler._stop_heartbeats()
        except Exception:  # noqa: BLE001 - torch's private parts moved
            pass

    def serve_store(self, deadline: float, stopped: Callable[[], bool]) -> str:
        """Keep serving the store (this process lives on) until the job ends, the rendezvous closed
        by the node that finished it or gave up ("closed"), or every other node is gone without
        closing it ("peers_gone"), or until `deadline` ("timeout"), or a stop ("stopped").
        "unreadable" if the rendezvous state cannot be read."""
        next_look, self._alone_since = 0.0, None
        while not stopped():
            if time.monotonic() >= next_look:  # a look is a round trip through the handler's state
                next_look = time.monotonic() + NEWCOMERS_LOOK
                try:
                    if self.handler.is_closed():
                        return "closed"
                except Exception:  # noqa: BLE001 - a plugin's handler, or a state it cannot read
                    return "unreadable"
                if self._no_peer_left():
                    return "peers_gone"
            if time.monotonic() > deadline:
                return "timeout"
            time.sleep(_POLL)
        return "stopped"

    def _linger_at_barrier(self, store: Any, nodes: int) -> None:
        """Past the barrier. The store may live in this process, and a peer still polling for the
        last member would find it gone: leave once every ranktop node has passed (or given up
        waiting), at most GAVE_UP_LINGER. Only ranktop nodes count: a torchrun node says nothing."""
        deadline = time.monotonic() + GAVE_UP_LINGER
        try:
            ours = sum(store.check([f"{_RANKTOP_NODE}{r}"]) for r in range(nodes))
            done = store.add(_BARRIER_LEFT, 1)
            while done < ours and time.monotonic() < deadline:
                time.sleep(_POLL)
                done = store.add(_BARRIER_LEFT, 0)
        except Exception:
            pass  # the store is gone: whoever served it has left, and every node had passed


# torch's dynamic handler (c10d, etcd-v2) logs Python WARNINGs that ranktop says in its own words:
# that it could not close the rendezvous (the node serving its store is gone: ranktop's line about
# the lost store says so), and that a keep-alive heartbeat failed (every keep_alive_interval, 5 s by
# default, for as long as the ranks run: ranktop says once that the store is lost). Only the records
# a `drops` test names are dropped; any other record of that logger, or of any other, goes through.
_DYNAMIC_LOGGER = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_FAILED_CLOSE = "has failed to shutdown the rendezvous"
_FAILED_HEARTBEAT = "has failed to send a keep-alive heartbeat to the rendezvous"
_REFUSED_STATE = "due to an error of type RendezvousStateError"  # (the state is not read: rendezvous_state)


@contextlib.contextmanager
def _quiet_torch(drops: Callable[[LogRecord, str], bool]) -> Iterator[None]:
    import logging

    def shown(record: LogRecord) -> bool:  # (a logging filter may be a plain callable)
        try:
            return not drops(record, record.getMessage())
        except Exception:  # noqa: BLE001 - a record ranktop cannot read (or a slip of ours) is shown, not lost
            return True

    logger = logging.getLogger(_DYNAMIC_LOGGER)
    logger.addFilter(shown)
    try:
        yield
    finally:
        logger.removeFilter(shown)


def _quiet_failed_close() -> contextlib.AbstractContextManager[None]:
    """Drop the failed-close WARNING logged by this thread (ranktop's own close) only."""
    thread = threading.get_ident()
    return _quiet_torch(lambda record, text: record.thread == thread and _FAILED_CLOSE in text)


def _connection_lost(exc: BaseException) -> bool:
    """Whether torch's store call failed because its connection is gone (DistNetworkError: a broken
    pipe, a refused connection), directly or under c10d's RendezvousConnectionError, which also
    wraps a slow answer (DistStoreError, a time-out: the node may only be busy)."""
    for _ in range(4):
        if type(exc).__name__ == "DistNetworkError":
            return True
        inner = exc.__cause__ or exc.__context__
        if inner is None:
            return False
        exc = inner
    return False


def _tcp_store(store: Any) -> Any:
    """The store under a (prefixed) store: a PrefixStore over a PrefixStore... over the TCPStore."""
    for _ in range(8):
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    return store


def _tcp_port(store: Any) -> int | None:
    """The port of the TCPStore under a (prefixed) store, None if there is none."""
    port = getattr(_tcp_store(store), "port", None)
    return port if type(port) is int else None


def _tcp_endpoint(store: Any) -> tuple[str, int] | None:
    """(host, port) of the TCPStore under a (prefixed) store, as this node reached it; None if none."""
    host, port = getattr(_tcp_store(store), "host", None), _tcp_port(store)
    return (host, port) if isinstance(host, str) and host and port is not None else None


def _ports_listened_on_here() -> set[int]:
    """The TCP ports this process listens on (Linux: its socket descriptors, matched in
    /proc/self/net). OSError where /proc cannot say."""
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since it was listed
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                sockets.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as rows:  # (no IPv6: no tcp6)
            next(rows, None)  # the heading
            for row in rows:
                fields = row.split()
                if len(fields) > 9 and fields[3] == "0A" and fields[9] in sockets:  # 0A: LISTEN
                    ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


class RoundWatch:
    """While the ranks run: looks for nodes waiting to join, a node that gave up, and nodes dropped
    from the round, without holding up the monitor loop (a store call can block for as long as the
    store's timeout, or its paused node)."""

    def __init__(self, rdzv: Rendezvous, interval: float, wake: Callable[[], None]):
        self.rdzv = rdzv
        self.interval = interval
        self.wake = wake
        self.end: RoundEnd | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ranktop-rdzv-watch", daemon=True)
        rdzv._ranks_run = True
        self._thread.start()

    def stop(self) -> None:
        self.rdzv._ranks_run = False
        self._stop.set()
        self._thread.join(timeout=1.0)  # a store call may hang; the thread is a daemon

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and self.end is None:
            self.end = self._look()
            if self.end is not None:
                self.wake()

    def _look(self) -> RoundEnd | None:
        if not self.rdzv.look_at_store():  # its loss is said once (Rendezvous.on_store_change)
            if self.rdzv.store_gone() and self.rdzv.ranks_lose_the_store():
                # Their store went with its node: ranks starting up, or in no collective, would wait
                # for their own time-out, or for ever.
                return RoundEnd("store_lost", f"{self.rdzv.store_lost_words()}, and this node's ranks' store with it")
            return None  # the ranks run on, and tell if they fail
        said = self.rdzv.peer_gave_up()
        if said:
            return RoundEnd("peer_gave_up", said)
        left = self.rdzv.left_behind()
        if left:  # the old round's word is no longer this node's to read or write
            return RoundEnd("left_behind", left)
        self._say_every_node_dropped()
        try:
            waiting = self.rdzv.nodes_waiting()
        except Exception:
            return None  # out of reach for now: the ranks or the next round will tell
        if waiting > 0:
            return self._agreed("nodes_joined", f"{waiting} node(s) waiting to join the {self.rdzv.describe()}")
        gone = self.rdzv.nodes_gone()
        return self._agreed("failure", gone) if gone else None

    def _say_every_node_dropped(self) -> None:
        """Every node of the round dropped at once, seen on a store that never stopped answering
        here: this node serves it, and was paused itself (or every node was cut off). The nodes
        that lost the store say it as it answers again."""
        told = self.rdzv.on_every_node_dropped
        if told is not None and self.rdzv.store_lost is None:
            words = self.rdzv.every_node_dropped_unsaid()
            if words:
                told(words)

    def _agreed(self, seen: str, words: str) -> RoundEnd:
        """The round's end as its nodes agree on it, `seen` being this node's view, in `words`."""
        agreed = self.rdzv.agree_on_end(seen)
        if agreed == USER_RESTART:
            return RoundEnd("peer_restart", PEER_RESTART_WORDS)
        if agreed == USER_STOP:
            return RoundEnd("peer_stopped", words if seen == "failure" else self.rdzv.stopped_words())
        if agreed == "failure":
            return RoundEnd("peer_failed", words if seen == agreed else f"another node of the {self.rdzv.describe()} failed")
        return RoundEnd("nodes_joined", words if seen == agreed else f"nodes joined the {self.rdzv.describe()}")
