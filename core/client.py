"""The client side of core/server.py: find the runs served on this host and talk to one."""

from __future__ import annotations

import dataclasses
import enum
import errno
import functools
import json
import math
import os
import socket
import stat
import threading
import time
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ranktop.core import commands as cmd
from ranktop.core import protocol
from ranktop.core.engine import FIRST_LOOK_LINES, OutputCursor
from ranktop.core.errors import file_kind, read_at_most
from ranktop.core.events import recorded_seal, run_started
from ranktop.core.layout import FINAL_FILE, FINAL_KEY, STACKS, final_seal_of, open_dir_below, tail_lines_below
from ranktop.core.limits import MAX_NPROC_PER_NODE
from ranktop.core.output import RanktopLine, as_shown
from ranktop.core.sanitize import clean, quoted
from ranktop.core.server import SocketDirError, peer_credentials, remove_if_dead, socket_dir, to_json
from ranktop.core.state import GroupSnapshot, RankSnapshot, RankState
from ranktop.core.value import Value

CONNECT_TIMEOUT = 3.0
READ_ONLY = "read-only view: nothing was done (ranktop web --control, or ranktop attach, can act on ranks)"
STACKS_TIMEOUT = 60.0  # py-spy on many ranks takes seconds; a dump that never answers is given up


REQUEST_SECONDS = 5.0  # a whole answer, however slowly its bytes come
# A command's whole answer: the engine's monitor loop answers within 5 s, or says it did not
# (agent_commands.ACK_TIMEOUT), and a stop or a group restart in a multi-node run takes up to 2 s of
# that when the rendezvous's store hangs; its answer may be silent all that while.
COMMAND_SECONDS = 8.0


class RunGone(Exception):
    """The run's engine is not there (any more); the message says why. Its two kinds say the
    engine is there, only of no use to this connection: EngineSilent and EngineRefused."""


class EngineRefused(RunGone):
    """The engine is there and said why it will not serve us now (every client slot taken, out of
    descriptors): the run goes on, and a later try may get in. `word`: its one word for it
    ("full", "busy"; "refused" where it gave none). `listener`: as EngineSilent's."""

    def __init__(self, message: str, word: str, listener: int | None = None) -> None:
        super().__init__(message)
        self.word, self.listener = word, listener


class EngineSilent(RunGone):
    """The engine is there but gave no whole answer in time (stopped, or swamped): this
    connection is of no more use, though the run may well go on. `listener`: the pid of the
    process that listens on the socket, where the kernel said (a silent engine cannot)."""

    def __init__(self, message: str, listener: int | None = None) -> None:
        super().__init__(message)
        self.listener = listener


def listener_pid(sock: socket.socket) -> int | None:
    """The pid of the process listening at the other end of a connected Unix socket (the
    kernel's SO_PEERCRED: it answers while that process is stopped), None where unknown."""
    try:
        pid = peer_credentials(sock)[0]
    except OSError:
        return None
    return pid or None


class Connection:
    """One connection to a run's engine: request() sends a control message and returns the answer
    (a dict, plus the output frames that came with it)."""

    def __init__(self, path: str, timeout: float = CONNECT_TIMEOUT, *, answer_within: float | None = None,
                 commands: bool = False):
        """`timeout`: for the connection and the engine's hello, and for each silence within an
        answer. `answer_within`: the time a whole answer may take, however slowly its bytes come
        (REQUEST_SECONDS unless given: a stack dump's takes longer, and may be silent for seconds
        before it comes: given, only it bounds an answer's silences). `commands`: the connection
        carries the commands of a view that has one of its own (the engine counts the view once)."""
        self.path = path
        self.answer_within = REQUEST_SECONDS if answer_within is None else answer_within
        self._timeout: float | None = timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._decoder = protocol.FrameDecoder()
        self._frames: list[Any] = []
        listener = None
        try:
            self._sock.connect(path)
            listener = listener_pid(self._sock)
            try:
                self._sock.sendall(protocol.encode_control(protocol.hello("client", **({"commands": True} if commands else {}))))
            except (BrokenPipeError, ConnectionResetError):  # refused at once: why is read next
                pass
            first = self._next(time.monotonic() + max(timeout, REQUEST_SECONDS))
            if not isinstance(first, dict):
                raise protocol.ProtocolError("the first frame is rank output, not a hello")
        except protocol.ProtocolError as exc:  # not ranktop's engine (of this version): one line, as one gone
            self._sock.close()
            raise RunGone(f"{path} does not speak as a ranktop engine: {exc}") from None
        except (TimeoutError, BlockingIOError):  # BlockingIOError: its queue of connections is full
            self._sock.close()
            raise EngineSilent(f"the engine at {path} does not answer", listener) from None
        except OSError as exc:
            self._sock.close()
            raise RunGone(f"no engine answers at {path} ({exc.strerror or exc})") from None
        if first.get("type") == "error":
            self._sock.close()
            raise _refusal(first, listener)
        try:
            protocol.check_hello(first, "engine")
        except protocol.ProtocolError as exc:
            self._sock.close()
            raise RunGone(f"{path} does not speak as a ranktop engine: {exc}") from None
        self.hello = first
        if answer_within is not None:
            self._timeout = None

    def _next(self, deadline: float | None = None) -> Any:
        """The next message or frame; by `deadline` (TimeoutError), if given, however the bytes trickle."""
        while not self._frames:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(errno.ETIMEDOUT, "no whole answer in time")
                self._sock.settimeout(left if self._timeout is None else min(left, self._timeout))
            data = self._sock.recv(1 << 16)
            if not data:
                raise ConnectionResetError(0, "the engine closed the connection")
            self._frames += self._decoder.feed(data)
        return self._frames.pop(0)

    def request(self, message: dict, frames: int = 0) -> tuple[dict, list[protocol.Output]]:
        deadline = time.monotonic() + self.answer_within
        try:
            self._sock.sendall(protocol.encode_control(message))
            answer = self._next(deadline)
            if not isinstance(answer, dict):
                raise protocol.ProtocolError("rank output came where an answer was due")
            # (dropped within the answer: the engine ends the frame it was in, then says why)
            outputs = [_unless_error(self._next(deadline)) for _ in range(frames if answer.get("type") == message["type"] else 0)]
        except TimeoutError:
            raise EngineSilent("the run's engine gave no whole answer in time") from None
        except OSError as exc:  # (the engine may have said why it closed this connection before it did)
            raise self._told_why() or RunGone(f"the run's engine went away ({exc.strerror or exc})") from None
        except protocol.ProtocolError as exc:
            raise RunGone(f"the run's engine sent what is not ranktop's protocol: {exc}") from None
        if answer.get("type") == "error":
            raise _refusal(answer) if "refused" in answer else _dropped(answer)
        return answer, outputs

    def _told_why(self) -> Dropped | None:
        """Why the engine dropped this connection, where it said so before it closed it (it
        dropped an idle one, and the next request failed to be sent): what came is read."""
        try:
            self._sock.setblocking(False)
            while data := self._sock.recv(1 << 16):
                self._frames += self._decoder.feed(data)
        except (OSError, protocol.ProtocolError):
            pass
        errors = [f for f in self._frames if isinstance(f, dict) and f.get("type") == "error"]
        return _dropped(errors[-1]) if errors else None

    def snapshot(self) -> dict:
        answer, _ = self.request({"type": "snapshot"})
        if not isinstance(answer.get("snapshot"), dict):
            raise RunGone("the run's engine sent a bad snapshot: not a JSON object")
        return {**answer["snapshot"], "clients": answer.get("clients", 0)}

    def command(self, name: str, **args: Any) -> dict:
        answer, _ = self.request({"type": "command", "id": 1, "command": name, "args": args})
        return answer

    def output(self, rank: int, generation: int, line: int,
               tail: int | None = None) -> tuple[dict, list[bytes], list[bytes]]:
        """(answer, complete lines after `line` (at most the last `tail`), unfinished lines) of one rank."""
        request = {"type": "output", "rank": rank, "generation": generation, "line": line}
        answer, frames = self.request(request if tail is None else {**request, "tail": tail}, frames=2)
        if not (len(frames) == 2 and all(isinstance(f, protocol.Output) for f in frames)
                and all(protocol.is_whole(answer.get(k)) and answer[k] >= -1 for k in ("generation", "line", "lines", "open"))
                and protocol.is_whole(answer.get("version"))):
            raise RunGone("the run's engine sent a bad answer to an output request")
        done, open_ = frames
        try:
            lines = _marked(done.data.split(b"\n"), answer) if answer["lines"] else []
        except protocol.ProtocolError:
            raise RunGone("the run's engine sent a bad answer to an output request") from None
        return answer, lines, open_.data.split(b"\n") if answer["open"] else []

    def subscribe(self, ranks: list[int] | None = None,
                  cursors: dict[int, tuple[int, int]] | None = None) -> GroupSnapshot:
        """Ask the engine to push these local ranks' output from `cursors` (default: all it
        holds), state changes and the end; read them with pushed(). Returns the snapshot taken
        with the subscription. Nothing but pushes comes on this connection afterwards."""
        answer, _ = self.request({"type": "subscribe", "ranks": ranks,
                                  "cursors": {str(r): list(c) for r, c in (cursors or {}).items()}})
        self._timeout = None
        self._sock.settimeout(None)  # a quiet run pushes nothing for as long as it likes
        return served_snapshot(answer["snapshot"])

    def pushed(self) -> Iterator[tuple[dict, list[bytes]]]:
        """(message, complete lines) for each push after subscribe(): "output" messages carry
        their rank's new lines; "snapshot" and "ended" none. RunGone when the engine leaves."""
        while True:
            try:
                message = self._next()
                if not isinstance(message, dict):
                    raise protocol.ProtocolError("rank output came where a message was due")
                if message.get("type") == "error":  # dropped by the engine: why
                    raise _dropped(message)
                if message.get("type") != "output":
                    yield message, []
                    continue
                # Dropped within a push: the engine ends the frame it was in, then says why.
                done = _unless_error(self._next())
                _open = _unless_error(self._next())
                if not isinstance(done, protocol.Output) or not isinstance(_open, protocol.Output):
                    raise protocol.ProtocolError("an output message came without its two output frames")
                lines = _marked(done.data.split(b"\n"), message) if message.get("lines") else []
            except OSError as exc:
                raise RunGone(f"the run's engine went away ({exc.strerror or exc})") from None
            except protocol.ProtocolError as exc:
                raise RunGone(f"the run's engine sent what is not ranktop's protocol: {exc}") from None
            yield message, lines

    @property
    def short(self) -> str | None:
        """Why the engine serves this connection for a few seconds only (it has all the clients
        it serves for long), or None: enough for ls and stop, not for attach or logs -f."""
        why = self.hello.get("short")
        return clean(str(why)) if why else None

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refusal(error: dict, listener: int | None = None) -> RunGone:
    """What an engine's error frame means: a refusal of a live engine where it gives the one word
    for it, else the connection's end."""
    word = error.get("refused")
    if word is None:
        return RunGone(str(error.get("message")))
    return EngineRefused(str(error.get("message")), word if word in ("full", "busy") else "refused", listener)


class Dropped(RunGone):
    """The engine ended this connection and said why (it was sent more than it took, say): the
    engine itself, and the run, may well go on."""


def _dropped(error: dict) -> Dropped:
    return Dropped(str(error.get("message"))[:300])


def _unless_error(frame: Any) -> Any:
    """`frame`; Dropped where it is the engine's error frame (it ended the connection, and says why)."""
    if isinstance(frame, dict) and frame.get("type") == "error":
        raise _dropped(frame)
    return frame


def engine_answers(path: str) -> bool:
    """Whether an engine still answers at `path`, however busy or full (it may have ended one of
    our connections and be there still)."""
    try:
        with Connection(path, timeout=1.0):
            return True
    except (EngineSilent, EngineRefused):
        return True
    except RunGone:
        return False


NOT_ANSWERING = "not answering"  # the state `ls` gives a run whose engine took no request in time


@dataclass
class ServedRun:
    run_id: str
    path: str
    # {"state": NOT_ANSWERING} alone when its engine did not answer; {"state": "full"} (EngineRefused's
    # word) when it refused us; either way `seen` is False
    snapshot: dict
    clients: int
    pid: int | None  # the engine's process: of a silent one, the socket's listener as the kernel names it
    full: bool = False  # it serves all the clients it serves for long: attach and logs -f cannot get in
    seen: bool = True  # its engine gave its snapshot


def _marked(lines: list[bytes], head: dict) -> list[bytes]:
    """`lines` of an output answer with those its head's "own" numbers made RanktopLines (an
    engine from before "own" sends none: its separators read as output, as they did)."""
    own = head.get("own", [])
    if not (isinstance(own, list) and all(protocol.is_whole(i) and 0 <= i < len(lines) for i in own)):
        raise protocol.ProtocolError("an output message's \"own\" is not a list of its line numbers")
    for i in own:
        lines[i] = RanktopLine(lines[i])
    return lines


def served_runs() -> list[ServedRun]:
    """Every run served on this host for this user, newest first; sockets nobody answers on
    (their engine died) are removed on the way."""
    try:
        directory = socket_dir(create=False)
    except (SocketDirError, OSError):  # (none yet: FileNotFoundError)
        return []
    found = []
    for name in os.listdir(directory):
        if not name.endswith(".sock"):
            continue
        path = os.path.join(directory, name)
        try:
            with Connection(path, timeout=1.0) as conn:
                snap, pid, full = conn.snapshot(), conn.hello.get("pid"), bool(conn.short)
        except EngineSilent as silent:  # there, but stopped or swamped: listed, so that it is not taken for gone
            found.append(ServedRun(name[: -len(".sock")], path, {"state": NOT_ANSWERING}, 0, silent.listener, seen=False))
            continue
        except EngineRefused as refused:  # there, and said why not now: listed, with its word for it
            found.append(ServedRun(name[: -len(".sock")], path, {"state": refused.word}, 0, refused.listener,
                                   full=refused.word == "full", seen=False))
            continue
        except RunGone:
            try:
                remove_if_dead(path)  # its engine died: ls cleans up after it
            except (SocketDirError, OSError):
                pass
            continue
        except (protocol.ProtocolError, KeyError):
            continue
        checked = _listed_snapshot(snap)
        if checked is None:  # not a run's snapshot: no engine of ours, like one that sends garbage
            continue
        found.append(ServedRun(name[: -len(".sock")], path, checked, checked["clients"] - 1, pid, full))
    return sorted(found, key=_started_at, reverse=True)


def unlisted_why() -> str | None:
    """Why no run served on this host can be looked for, where served_runs() finds none for it:
    the socket directory is not safe (a symlink, someone else's, open to others, below another
    user's directory), and served_runs() will not connect to a socket there, as no run serves
    one there; None where it is safe, or none was made yet."""
    try:
        socket_dir(create=False)
    except SocketDirError as exc:
        return str(exc)
    except FileNotFoundError:  # no run served yet
        return None
    except OSError as exc:
        return f"its socket directory cannot be read ({exc.strerror})"
    return None


def _started_at(run: ServedRun) -> float:
    started = run.snapshot.get("started_at")
    return started if isinstance(started, (int, float)) and math.isfinite(started) else 0.0  # (NaN: unknown)


def _listed_snapshot(raw: dict) -> dict | None:
    """An engine's snapshot as `ls`, `logs`, `stop` and `stacks` read it: checked and cleaned as
    the views check theirs (decode_snapshot), back in the engine's JSON shape, with a count of
    clients; None where no view could be made of it (a `clients` of "x", ranks that are text:
    `ls` and `logs` stopped with a traceback on such an engine)."""
    clients = raw.get("clients", 1)
    try:
        snap = decode_snapshot(raw)
    except BadValue:
        return None
    if not protocol.is_whole(clients) or not 0 <= clients <= _MAX_CLIENTS_SHOWN:
        return None
    return {**to_json(snap), "clients": clients}


_MAX_CLIENTS_SHOWN = 1 << 20  # an engine serves at most 64 (core/server.py); more is not an engine of ours


def find_run(target: str | None, runs: list[ServedRun]) -> ServedRun:
    """The run `target` names (a run id, a unique prefix of one, or its run directory); the newest
    running one when None. ValueError with one line listing the candidates otherwise (SeveralRuns
    where it names more than one)."""
    if target is None:
        live = [r for r in runs if not r.snapshot.get("ended")] or runs
        if not live:
            raise ValueError("no runs are served on this host")
        return live[0]
    by_dir = [r for r in runs if os.path.realpath(target) == os.path.realpath(r.snapshot.get("log_dir") or "/")]
    by_dir = by_dir or _silent_run_of(target, runs)
    exact = [r for r in runs if r.run_id == target]
    if not (by_dir or exact) and run_dir_of(target) is not None:
        # the id (or directory) of an ended run, typed in full, is that run, not a prefix of another
        raise ValueError(f"{quoted(target)} names an ended run, not one served on this host")
    matches = by_dir or exact or [r for r in runs if r.run_id.startswith(target)]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(r.run_id for r in (matches or runs))
    if matches:
        raise SeveralRuns(f"{quoted(target)} matches several runs: runs are {names}")
    if not runs:
        raise ValueError(f"{quoted(target)} names no run: none is served on this host")
    raise ValueError(f"{quoted(target)} names no run served on this host: runs are {names}")


def _silent_run_of(target: str, runs: list[ServedRun]) -> list[ServedRun]:
    """The run whose engine does not answer (so nothing says its log_dir) that wrote the run
    directory `target`: the one served under the directory's run id (or its name) by the very
    process its run_started event names."""
    silent = [r for r in runs if not r.seen]
    run_dir = run_dir_of(target) if silent else None
    started = run_started(run_dir) if run_dir is not None else None
    if started is None:
        return []
    run_id, pid = started.get("run_id"), started.get("pid")
    names = (run_id, os.path.basename(os.path.normpath(run_dir)))
    # (a pid that one side cannot name matches nothing: None == None is no process)
    return [r for r in silent if r.pid is not None and r.pid == pid
            and (r.run_id in names or r.run_id.startswith(f"{run_id}."))]


class SeveralRuns(ValueError):
    """A prefix of several served runs: none is picked (nor an ended run it also prefixes)."""


def wait_gone(path: str, timeout: float) -> bool:
    """Until nobody serves `path` any more (the run ended and its engine left), or `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(path):
            return True
        try:
            Connection(path, timeout=1.0).close()
        except EngineRefused:  # there still, with a crowd of clients
            pass
        except RunGone:
            return True
        time.sleep(0.1)
    return False


def wait_ended(path: str, timeout: float) -> bool:
    """Until the run served at `path` has ended (its engine may stay: a TUI showing the end), or `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with Connection(path, timeout=1.0) as conn:
                if conn.snapshot().get("ended"):
                    return True
        except (EngineSilent, EngineRefused):  # busy: ask again
            pass
        except RunGone:
            return True
        time.sleep(0.1)
    return False


# ----- the Engine interface over the socket (ranktop attach) -------------------------------------
def from_json(kind: Any, data: Any) -> Any:
    """`data` (plain JSON, as core/server.py's to_json makes it) as an instance of the type `kind`:
    nested frozen dataclasses, enums, tuples and optionals, as the snapshot types use them."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if data is None:
        return None
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return from_json(options[0], data) if len(options) == 1 else data
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json(args[0], item) for item in data)
        return tuple(from_json(a, item) for a, item in zip(args, data, strict=False))
    if origin is list:
        return [from_json(args[0], item) for item in data] if args else list(data)
    if origin is dict:
        return {k: from_json(args[1], v) for k, v in data.items()} if args else dict(data)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(data)
    if dataclasses.is_dataclass(kind):
        fields = _init_fields(kind)
        return kind(**{name: from_json(fields[name], value) for name, value in data.items() if name in fields})
    return data


@functools.cache
def _init_fields(kind: type) -> dict[str, Any]:
    """A dataclass's constructor fields and their types (resolving the hints takes milliseconds:
    an attached TUI decodes a snapshot four times a second)."""
    hints = typing.get_type_hints(kind)
    return {f.name: hints[f.name] for f in dataclasses.fields(kind) if f.init}


@dataclass(eq=False)
class _Channel:
    """One of a RemoteEngine's connections to its engine, asked one request at a time (`lock`),
    made again by `connect` when lost."""

    connect: Callable[[], Connection]
    conn: Connection | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    dropped: str | None = None  # why the engine last ended this connection, until told (take_dropped)


class RemoteEngine:
    """The Engine interface of a run served elsewhere on this host: what `ranktop attach` hands
    the TUI. close() only disconnects: the run goes on.

    The view's requests (snapshots, the panes' output) and the commands go on two connections:
    the engine may take seconds to answer a command (a stop's word to a hung store), and the view
    waited behind it, frozen. An engine that does not answer in time (stopped, swamped) is asked
    again, on either, on a new connection a second later; the view keeps what it last saw
    meanwhile. An engine that has gone leaves the last snapshot as the end, or better, the run's
    final.json when it wrote one."""

    def __init__(self, path: str, *, read_only: bool = False, look_ahead: bool = False):
        """`look_ahead`: also fetch every rank's newest FIRST_LOOK_LINES now, which answer each
        pane's first request (`ranktop attach` builds this engine while Textual loads)."""
        self.path = path
        self.read_only = read_only  # watch only (ranktop web without --control): acting commands are refused
        # The view's connection (the UI's timer and its workers, one request at a time)...
        self._view = _Channel(lambda: _long(Connection(path, timeout=1.0)), _long(Connection(path)))
        # ... and the commands', made at the first: its answers may be silent for seconds.
        self._commands = _Channel(lambda: Connection(path, timeout=1.0, answer_within=COMMAND_SECONDS, commands=True))
        self._retry_at = 0.0  # till when the engine counts as silent: nothing is sent to it
        self.gone = False  # the engine left (its run ended, or it was stopped)
        try:
            self.last = served_snapshot(self._view.conn.snapshot())
        except RunGone:
            self._view.conn.close()
            raise
        self._early: dict[int, tuple[OutputCursor, list[bytes], list[bytes]]] = {}
        if look_ahead:
            for rank in self.last.ranks:
                self._early[rank.local_rank] = self.output_since(rank.local_rank, None, FIRST_LOOK_LINES)

    def _ask(self, ask: Callable[[Connection], Any], channel: _Channel | None = None) -> Any:
        """ask(the view's connection, or `channel`'s)'s answer; EngineSilent while the engine does
        not answer (the connection is dropped, a new one tried a second later, and until then
        nothing is sent on either); RunGone once it has gone. A connection the engine closed is
        not the engine's end: it drops one that asked nothing for long (a view suspended
        overnight, commands not sent for 10 minutes) or took nothing (behind a frozen link), so a
        new connection is tried at once, and only where none is made has the engine gone."""
        channel = channel or self._view
        with channel.lock:
            if time.monotonic() < self._retry_at:
                raise EngineSilent("the run's engine does not answer")
            if channel.conn is None:
                self._connect(channel)
            try:
                return self._ask_on(ask, channel)
            except EngineSilent:
                raise
            except RunGone as exc:
                if isinstance(exc, Dropped):  # (kept where no new connection is made now: said once one is)
                    channel.dropped = str(exc)
                self._connect(channel)
            return self._ask_on(ask, channel)  # (as above, on the new connection: gone now is gone)

    def _ask_on(self, ask: Callable[[Connection], Any], channel: _Channel) -> Any:
        """ask(the channel's connection)'s answer; a connection that fails it is closed: one whose
        answer did not come in time would give that answer, late, to the next request (rank 0's
        lines as rank 1's), so a new one is tried a second later."""
        try:
            return ask(channel.conn)
        except RunGone as exc:
            channel.conn.close()
            channel.conn = None
            if isinstance(exc, EngineSilent):
                self._retry_at = time.monotonic() + 1.0
            raise

    def take_dropped(self) -> str | None:
        """Why the engine ended this view's connection, once a new one has taken its place; said
        once. None meanwhile, and while a request is under way (the caller asks again on its next
        tick rather than wait for it). (The commands' connection, dropped when no command came for
        10 minutes, is made again at the next one without a word.)"""
        view = self._view
        if not view.lock.acquire(blocking=False):
            return None
        try:
            if view.conn is None:
                return None
            why, view.dropped = view.dropped, None
            return why
        finally:
            view.lock.release()

    def _connect(self, channel: _Channel) -> None:
        try:
            channel.conn = channel.connect()
        except (EngineSilent, EngineRefused) as exc:  # there, not for us now: asked again later
            self._retry_at = time.monotonic() + 1.0
            raise EngineSilent(str(exc)) from None

    def snapshot(self) -> GroupSnapshot:
        if self.gone:
            return self.last
        try:
            self.last = decode_snapshot(self._ask(lambda conn: conn.snapshot()))
        except EngineSilent:
            pass  # what we saw last, until it answers again
        except (RunGone, BadValue) as exc:
            self._lose(str(exc))
        return self.last

    def _lose(self, why: str) -> None:
        """The engine went away: the run's end is its final.json, if it left one; else what we
        saw last, marked as ended with the end unknown."""
        self.gone = True
        if self.last.ended:
            return
        try:
            view = final_view_of(self.last.log_dir, self.last.final_seal)
        except NotEnginesFinal as planted:  # said with how the engine was lost; the end stays unknown
            self.last = self.last.engine_lost(f"{why}; {planted}")
            return
        if view is None:
            self.last = self.last.engine_lost(why)
            return
        self.last = view.snapshot()
        view.close()

    def output_since(self, local_rank: int, cursor: OutputCursor | None,
                     tail: int | None = None) -> tuple[OutputCursor, list[bytes], list[bytes]]:
        cursor = cursor or OutputCursor()
        early = self._early.pop(local_rank, None) if self._early and tail == FIRST_LOOK_LINES else None
        if early is not None and cursor.line == 0 and early[0].generation == cursor.generation:
            return early  # what look_ahead fetched: the next request goes on from its cursor, no gap
        if self.gone:
            return cursor, [], []
        try:
            answer, lines, open_lines = self._ask(
                lambda conn: conn.output(local_rank, cursor.generation, cursor.line, tail))
        except RunGone:  # silent for now, or gone: the next snapshot says which
            return cursor, [], []
        # More lines wait on the engine: a version no one has makes the pane ask again at once.
        version = -2 if answer.get("more") else answer["version"]
        return OutputCursor(answer["generation"], answer["line"], version), lines, open_lines

    def submit(self, command: cmd.Command) -> cmd.Ack:
        args = command.as_dict() if isinstance(command, Value) else {}
        name = type(command).__name__
        if self.read_only and not isinstance(command, cmd.DumpStacks):  # a py-spy dump only reads the ranks
            return cmd.Ack(False, READ_ONLY)
        if self.gone and isinstance(command, cmd.DumpStacks):  # no engine to dump the ranks: the last dump saved
            return self._last_dump()
        try:
            if isinstance(command, (cmd.DumpStacks, cmd.SignalDump)):
                return self._stacks(name, args)
            channel = self._channel_for(command)
            try:
                answer = self._ask(lambda conn: conn.command(name, **args), channel)
            finally:
                if channel is not self._commands and channel.conn is not None:  # (the kill's own)
                    channel.conn.close()
        except RunGone as exc:
            return cmd.Ack(False, str(exc))
        return cmd.Ack(bool(answer.get("ok")), str(answer.get("message")))

    def _channel_for(self, command: cmd.Command) -> _Channel:
        """The commands' connection; for a kill now (a second q or Ctrl-C) that finds a command
        still being answered there (a stop waiting on a hung store), one of its own, for the kill
        alone: it reaches the engine at once, and ends the stop's wait, where behind the stop it
        waited for it."""
        if isinstance(command, cmd.KillGroup) and self._commands.lock.locked():
            return _Channel(self._commands.connect)
        return self._commands

    def _stacks(self, name: str, args: dict) -> cmd.Ack:
        return dump_stacks(self.path, name, args)

    @property
    def redumps(self) -> bool:
        """Whether a stack view may ask for a new dump: not once the engine has gone, nor once the
        run has ended (its engine lingering: no rank is left to dump)."""
        return not self.gone and not self.last.ended

    def _last_dump(self) -> cmd.Ack:
        """The last dump saved in the run directory (the engine's end, if final.json told it, or
        as last seen)."""
        return last_dump_in(self.last.log_dir, "the run's engine has gone")

    def close(self) -> None:
        for channel in (self._view, self._commands):
            with channel.lock:
                if channel.conn is not None:
                    channel.conn.close()
                    channel.conn = None


def _long(conn: Connection) -> Connection:
    """`conn`, if the engine serves it for long (as a view needs); else closed, EngineRefused."""
    if conn.short:
        conn.close()
        raise EngineRefused(conn.short, "full")
    return conn


def dump_stacks(path: str, name: str = "DumpStacks", args: dict | None = None) -> cmd.Ack:
    """A stack dump (DumpStacks or SignalDump) by the engine served at `path`: the Ack carries
    its report. It takes seconds, so it has a connection of its own (a UI's snapshots do not
    wait behind it). RunGone if the engine cannot be reached."""
    from ranktop.core.stacks import StackReport  # with psutil, 20 ms that attach need not wait for

    # (an engine says hello at once, dumping or not: one that does not is silent, said in seconds)
    with Connection(path, answer_within=STACKS_TIMEOUT) as conn:
        answer = conn.command(name, **(args or {}))
    report = answer.get("report")
    try:
        report = from_json(StackReport, report) if report is not None else None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        return cmd.Ack(False, f"the engine's stack report cannot be read: {exc}")
    return cmd.Ack(bool(answer.get("ok")), str(answer.get("message")), report=report)


def final_view_of(run_dir: str | None, seal: Any = None) -> FinalEngine | None:
    """The final view of a served run whose engine has gone, from the final.json in `run_dir` (its
    run directory, as its engine's snapshot gave it) that holds the key to `seal` (the snapshot's
    final_seal); None where there is none that can be shown (the engine was killed before the
    run's end) or `run_dir` is not an absolute path (a relative one, or none, would be read from
    whatever directory the client runs in). NotEnginesFinal if the one there is not the engine's."""
    if not run_dir or not os.path.isabs(run_dir):
        return None
    try:
        return FinalEngine(os.path.join(run_dir, FINAL_FILE), seal if isinstance(seal, str) else None)
    except NotEnginesFinal:
        raise
    except BadFinalFile:
        return None


class BadFinalFile(Exception):
    """final.json cannot be shown (not ours, truncated, another shape); one line says why."""


class NotEnginesFinal(BadFinalFile):
    """A final.json the run's engine did not write (a rank planted it where a killed engine left
    none, or another user did): ignored, and one line says so and why."""


class AmbiguousRun(BadFinalFile):
    """A prefix that names several ended runs: none of them is shown; the line lists them."""


class FinalEngine:
    """An ended run whose engine has gone, seen through its final.json and its log files:
    read-only (every command is refused with why).

    Whoever could write the run directory could have written all of it, and ranktop may read it
    as root: final.json is checked field by field (`checked_from_json`), and the view reads only
    log files below the directory final.json lies in, opened from a descriptor of it, never
    through a symlink, wherever final.json says they are."""

    TAIL_BYTES = 1 << 20  # of each rank's stdout.log shown in its pane

    read_only = True  # a view offers no key that acts on ranks: there are none left to act on

    MAX_FINAL = 16 << 20  # a snapshot of thousands of ranks fits

    def __init__(self, final_path: str, seal: str | None = None):
        """`seal`: the run's final_seal as its live engine served it; without one, the seal its
        events.jsonl recorded at the start, if any (an older ranktop's run has none)."""
        run_dir = os.path.dirname(os.path.abspath(final_path))
        try:
            self._run_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise BadFinalFile(f"bad final view {final_path}: its directory cannot be opened "
                               f"({exc.strerror})") from None
        try:
            snap = self._read(final_path, seal or recorded_seal(self._run_fd))
        except BadFinalFile:
            os.close(self._run_fd)
            raise
        # local rank -> names from the run directory to its stdout.log, its stderr.log
        self._stdout_logs: dict[int, list[str]] = {}
        self._stderr_logs: dict[int, list[str]] = {}
        # (local rank, file name, why) of log files found but not read: not a plain file below the run
        self.left_out: list[tuple[int, str, str]] = []
        ranks = tuple(self._logs_below(rank, snap.log_dir, run_dir) for rank in snap.ranks)
        # The directory it was found in: the one it recorded may have moved, or be anyone's.
        self.last = dataclasses.replace(snap, log_dir=run_dir, ranks=ranks)
        self.gone = True

    def _read(self, final_path: str, seal: str | None) -> GroupSnapshot:
        name = os.path.basename(final_path)
        try:
            data = json.loads(read_regular(self._run_fd, name, self.MAX_FINAL, owner=os.fstat(self._run_fd).st_uid))
            if (why := _unsealed(data, seal)) is not None:
                raise NotEnginesFinal(f"{final_path} was not written by the run's engine ({why}): ignored")
            return decode_snapshot(data)
        except NotOwned as exc:
            raise NotEnginesFinal(f"{final_path} was not written by the run's engine ({exc}): ignored") from None
        except (NotRegular, BadValue) as exc:
            raise BadFinalFile(f"bad final view {final_path}: {exc}") from None
        except (OSError, ValueError, RecursionError) as exc:
            raise BadFinalFile(f"bad final view {final_path}: {type(exc).__name__}: {str(exc)[:200]}") from None

    def _logs_below(self, rank: RankSnapshot, recorded_dir: str | None, run_dir: str) -> RankSnapshot:
        """`rank` with only those of its log paths that name a regular file below the run
        directory (rebased there); the others unknown (None), so no view opens them either."""
        found = {}
        for field in ("stdout_log", "stderr_log"):
            names = names_below(getattr(rank, field), recorded_dir)
            why = ("its path in final.json is not below the run directory" if names is None
                   else _not_regular_below(self._run_fd, names))
            if why is not None:
                found[field] = None
                if why and getattr(rank, field):  # (a log never made, or gone, is nothing to say)
                    self.left_out.append((rank.local_rank, os.path.basename(getattr(rank, field)), why))
                continue
            found[field] = os.path.join(run_dir, *names)
            (self._stdout_logs if field == "stdout_log" else self._stderr_logs)[rank.local_rank] = names
        return dataclasses.replace(rank, **found)

    def snapshot(self) -> GroupSnapshot:
        return self.last

    def output_since(self, local_rank: int, cursor: OutputCursor | None,
                     tail: int | None = None) -> tuple[OutputCursor, list[bytes], list[bytes]]:
        generation = self.last.generation
        if cursor is not None and cursor.generation == generation and cursor.line > 0:
            return cursor, [], []
        names = self._stdout_logs.get(local_rank)
        lines = self._tail(names) if names else []
        return OutputCursor(generation, len(lines), 1), lines if tail is None else lines[max(0, len(lines) - tail):], []

    def stderr_tail(self, local_rank: int) -> list[bytes]:
        """The last lines of the rank's stderr.log (its last TAIL_BYTES), read as its stdout.log is."""
        names = self._stderr_logs.get(local_rank)
        return self._tail(names) if names else []

    def _tail(self, names: list[str]) -> list[bytes]:
        # As a served run's ring holds them: a progress bar redrawn with '\r' is its last state, a
        # line is cut where the ring cuts it (the file keeps every byte).
        return [as_shown(line) for line in tail_lines_below(self._run_fd, names, self.TAIL_BYTES)]

    def submit(self, command: cmd.Command) -> cmd.Ack:
        if isinstance(command, cmd.DumpStacks):  # no rank is left to dump: the last dump taken, if any
            return self._last_dump()
        return cmd.Ack(False, "the run has ended: this is its final view, read-only")

    redumps = False  # a stack view shows the last dump saved during the run; there is none to take

    def _last_dump(self) -> cmd.Ack:
        return last_saved_dump(self._run_fd, self.last.log_dir)

    def close(self) -> None:
        if self._run_fd >= 0:
            os.close(self._run_fd)
            self._run_fd = -1


def _unsealed(data: Any, seal: str | None) -> str | None:
    """Why a final.json's `data` is not the one the engine that served `seal` wrote; None if it is
    (or there is no seal to hold it to)."""
    if seal is None:
        return None
    key = data.get(FINAL_KEY) if isinstance(data, dict) else None
    if not isinstance(key, str):
        return "it holds no key to the run's seal"
    return None if final_seal_of(key) == seal else "its key does not match the run's seal"


class NotRegular(ValueError):
    """A file a view reads that is not a plain file of a bounded size; the message says which."""


class NotOwned(NotRegular):
    """A file a view reads that belongs to another user than its directory's owner."""


def read_regular(dir_fd: int, name: str, limit: int, owner: int | None = None) -> bytes:
    """The file `name` in the directory `dir_fd`, never through a symlink nor from a FIFO (which
    would block the view), at most `limit` bytes: NotRegular otherwise, OSError if unreadable.
    `owner`: the uid it must belong to (NotOwned if not)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegular("not a regular file")
        if owner is not None and info.st_uid != owner:
            raise NotOwned(f"it belongs to uid {info.st_uid}, its run directory to uid {owner}")
        data = read_at_most(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise NotRegular(f"larger than {limit >> 20} MiB")
    return data


MAX_DUMP = 16 << 20  # a saved stack report of thousands of ranks fits


def last_dump_in(run_dir: str | None, why: str) -> cmd.Ack:
    """last_saved_dump of the run directory `run_dir`, opened here; `why` no rank is dumped now
    ("the run has ended"), for the line that says the directory cannot be opened."""
    try:
        run_fd = os.open(run_dir or "", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return cmd.Ack(False, f"no stacks: {why}, and its run directory cannot be opened ({exc.strerror})")
    try:
        return last_saved_dump(run_fd, run_dir or "")
    finally:
        os.close(run_fd)


def last_saved_dump(run_fd: int, run_dir: str) -> cmd.Ack:
    """The newest stack dump saved during a run whose engine has gone (<run dir>/stacks/<time>.json,
    `run_fd` a descriptor of that directory), checked as final.json is; the Ack says why there is none."""
    from ranktop.core.stacks import StackReport  # (psutil: not for a view that never dumps)

    none = cmd.Ack(False, "no stacks: the run has ended, and no stack dump was saved during it")
    try:
        folder = open_dir_below(run_fd, [STACKS])
    except OSError:
        return none
    try:
        for name in sorted((n for n in os.listdir(folder) if n.endswith(".json")), reverse=True):
            try:
                report = checked_from_json(StackReport, json.loads(read_regular(folder, name, MAX_DUMP)))
            except (OSError, ValueError, RecursionError):
                continue  # half-written, not ours: the one before it
            txt = os.path.join(run_dir, STACKS, name.removesuffix(".json") + ".txt")
            return cmd.Ack(True, "the last stack dump saved during the run",
                           report=dataclasses.replace(report, saved_txt=txt, save_error=None))
        return none
    finally:
        os.close(folder)


def names_below(path: str | None, recorded_dir: str | None) -> list[str] | None:
    """The names that lead from the run directory to `path` (a log path final.json gives:
    absolute below the run directory it recorded, or relative to it), or None where it would
    leave the directory: another absolute path, '..', '.', an empty name, a NUL."""
    if not path:
        return None
    if os.path.isabs(path):
        prefix = (recorded_dir or "").rstrip("/") + "/"
        if not recorded_dir or not os.path.isabs(recorded_dir) or not path.startswith(prefix):
            return None
        path = path[len(prefix):]
    names = path.split("/")
    return names if all(name not in ("", ".", "..") and "\0" not in name for name in names) else None


def _not_regular_below(dir_fd: int, names: list[str]) -> str | None:
    """Why the file `names` lead to from `dir_fd` is not read as a log (`it is a FIFO, not a plain
    file`); "" where it is not there; None for a plain file."""
    try:
        parent = open_dir_below(dir_fd, names[:-1])
    except FileNotFoundError:
        return ""
    except OSError:  # (ELOOP, ENOTDIR: a directory on the way swapped for a symlink or a file)
        return "a directory on its way is not a plain directory"
    try:
        mode = os.stat(names[-1], dir_fd=parent, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"it cannot be looked at ({exc.strerror})"
    finally:
        os.close(parent)
    if stat.S_ISREG(mode):
        return None
    return f"it is {'a symlink' if stat.S_ISLNK(mode) else file_kind(mode)}, not a plain file"


# ----- final.json, checked (anyone who could write the run directory could have written it) -------
# Every float in a snapshot is a time of day (epoch seconds), a duration or a percentage: none is
# negative or past 1e11 (the year 5138), which every clock the views use can still show.
MAX_FLOAT = 1e11
MAX_INT = 2**63  # pids, exit codes, byte counts: C longs


class BadValue(ValueError):
    """A value of a snapshot (final.json, a live engine's) that its field cannot hold; the
    message names the field."""

    def __init__(self, where: str | None, message: str):
        """`where`: the field ("" for the whole); None: `message` says it all."""
        super().__init__(message if where is None else f"{where or 'the top'} {message}")
        self.where = where or ""


def _not(where: str, value: Any, expected: str) -> BadValue:
    shown = json.dumps(value)  # escaped: quoted to a terminal as it is
    return BadValue(where, f"is {shown[:40]}{'…' if len(shown) > 40 else ''}, expected {expected}")


def checked_from_json(kind: Any, data: Any, where: str = "") -> Any:
    """`data` as an instance of `kind`, as from_json makes it, but every value checked against
    its type, for what another process supplies (final.json, which anyone who could write the
    run directory could have written; a live engine's snapshot). Text comes cleaned of anything
    a terminal would act on (the views put these fields on the screen as they are). A bad value
    in a field that may be unknown becomes unknown (`_unknown`); any other raises BadValue naming
    it (`ranks[1].state is "zombie", expected one of ...`)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):  # every union in a snapshot is `X | None`
        (option,) = [a for a in args if a is not type(None)]
        return None if data is None else checked_from_json(option, data, where)
    if origin is tuple:
        if not isinstance(data, list):
            raise _not(where, data, "a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(checked_from_json(args[0], item, f"{where}[{i}]") for i, item in enumerate(data))
        if len(data) != len(args):
            raise _not(where, data, f"a list of {len(args)}")
        return tuple(checked_from_json(a, item, f"{where}[{i}]")
                     for i, (a, item) in enumerate(zip(args, data, strict=True)))
    if origin is list:  # (a saved stack report's tree)
        if not isinstance(data, list):
            raise _not(where, data, "a list")
        return [checked_from_json(args[0], item, f"{where}[{i}]") for i, item in enumerate(data)]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        values = [m.value for m in kind if m not in _VIEWS_OWN]
        if not isinstance(data, str) or data not in values:
            raise _not(where, data, "one of " + ", ".join(values))
        return kind(data)
    if dataclasses.is_dataclass(kind):
        return _final_dataclass(kind, data, where)
    if _holds(kind, data):
        return float(data) if kind is float else clean(data, newlines=True) if kind is str else data
    raise _not(where, data, _EXPECTED.get(kind, str(kind)))


# States only a client's view says (of a run whose engine it lost): no engine or final.json can.
_VIEWS_OWN = frozenset({RankState.UNKNOWN})
_EXPECTED = {bool: "true or false", str: "text", int: "a whole number",
             float: f"a number from 0 to {MAX_FLOAT:g}"}


def _holds(kind: Any, value: Any) -> bool:
    """Whether a field of the plain type `kind` can hold `value` (bool is no number here)."""
    if kind is bool or kind is str:
        return isinstance(value, kind)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind is int:
        return isinstance(value, int) and -MAX_INT < value < MAX_INT
    # (compared as it is: a whole number too large for a float, 10**400, is out of range, not an OverflowError)
    return kind is float and 0 <= value <= MAX_FLOAT


def _final_dataclass(kind: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise _not(where, data, "an object")
    values = {}
    for field in dataclasses.fields(kind):
        if not field.init:
            continue
        hint, path = _init_fields(kind)[field.name], f"{where}.{field.name}" if where else field.name
        if field.name not in data:
            if field.default is dataclasses.MISSING:
                raise BadValue(path, "is missing")
            continue
        try:
            values[field.name] = checked_from_json(hint, data[field.name], path)
        except BadValue as bad:
            unknown = _unknown(field, hint)
            # Inside an object of its own (a rank's field): that object's field it is, judged there.
            if unknown is _NONE or (bad.where != path and _holds_objects(hint)):
                raise
            values[field.name] = unknown
    return kind(**values)


_NONE = object()  # a field that cannot be unknown


def _unknown(field: dataclasses.Field, hint: Any) -> Any:
    """What a field shows when final.json's value for it is bad: its default, None where it may
    be None, NaN for a time it must have (shown as an unknown time); _NONE where nothing fits."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if type(None) in typing.get_args(hint):
        return None
    return math.nan if hint is float else _NONE


def _holds_objects(hint: Any) -> bool:
    return dataclasses.is_dataclass(hint) or any(_holds_objects(a) for a in typing.get_args(hint))


def decode_snapshot(data: Any) -> GroupSnapshot:
    """A snapshot another process sent or left, checked (checked_from_json, snapshot_problem);
    BadValue says what is wrong with it, in one line."""
    snap = checked_from_json(GroupSnapshot, data)
    problem = snapshot_problem(snap)
    if problem:
        raise BadValue(None, problem)
    return snap


def served_snapshot(data: Any) -> GroupSnapshot:
    """The first snapshot an engine serves, checked: RunGone (one line) if no view can be made of it."""
    try:
        return decode_snapshot(data)
    except BadValue as exc:
        raise RunGone(f"the run's engine sent a bad snapshot: {exc}") from None


def snapshot_problem(snap: GroupSnapshot) -> str | None:
    """What in a well-typed snapshot no run could have made (one line), or None: sizes the views
    allocate by, and ranks out of their places."""
    if not 0 < snap.local_world_size <= MAX_NPROC_PER_NODE:
        return f"local_world_size is {snap.local_world_size}, expected 1 to {MAX_NPROC_PER_NODE}"
    if snap.ranks and len(snap.ranks) != snap.local_world_size:
        return f"ranks has {len(snap.ranks)} ranks, local_world_size says {snap.local_world_size}"
    misplaced = next((i for i, rank in enumerate(snap.ranks) if rank.local_rank != i), None)
    if misplaced is not None:
        return f"ranks[{misplaced}].local_rank is {snap.ranks[misplaced].local_rank}, expected {misplaced}"
    if snap.output_lines_kept < 1:
        return f"output_lines_kept is {snap.output_lines_kept}, expected 1 or more"
    return None


def final_run(target: str | None) -> str | None:
    """final.json of the ended run `target` names (its run directory, or its id under the default
    log root), or None."""
    if not target:
        return None
    if (found := _run_files(target)) is not None:  # named exactly: no prefix of another
        run_dir, files = found
        return os.path.join(run_dir, FINAL_FILE) if FINAL_FILE in files else None
    return None if os.sep in target else _final_by_prefix(target)


def run_dir_of(target: str) -> str | None:
    """The run directory `target` names exactly (itself, or its id under the default log root):
    one that holds the run's final.json or its events.jsonl; None if it names none so."""
    found = _run_files(target)
    return None if found is None else found[0]


def _run_files(target: str) -> tuple[str, frozenset[str]] | None:
    """The run directory `target` names exactly and which of final.json and events.jsonl it
    holds, or None. A bare name is a run id first, looked for under the default log root as its
    ended runs are named (core/layout.default_run_files), and only then a directory here: root's
    `ranktop logs exp-1` typed in /tmp showed another user's /tmp/exp-1 (`./exp-1` names that)."""
    from ranktop.core.layout import EVENTS, default_log_root, default_run_files

    if os.sep not in target and (files := default_run_files(target)):
        return os.path.join(default_log_root(), target), files
    files = frozenset(name for name in (FINAL_FILE, EVENTS) if os.path.isfile(os.path.join(target, name)))
    return (target, files) if files else None


def _final_by_prefix(prefix: str) -> str | None:
    """final.json of the one ended run under the default log root whose id starts with `prefix`,
    as for served runs; AmbiguousRun naming them when several do."""
    from ranktop.core.layout import default_log_root, ended_runs_starting

    ended = ended_runs_starting(prefix)
    if len(ended) > 1:
        raise AmbiguousRun(f"{quoted(prefix)} matches several ended runs: {', '.join(ended[:10])}"
                           f"{', ...' if len(ended) > 10 else ''}")
    return os.path.join(default_log_root(), ended[0], FINAL_FILE) if ended else None
