"""A run's engine, served on a Unix socket: `ranktop ls`, `stop` and `logs` reach a run from any
terminal of the same user, also after the terminal that started it is gone.

One thread in the engine's process accepts clients and answers their requests, one at a time,
over core/protocol.py's frames. It only calls the Engine interface (snapshot, output_since,
submit), so it never changes engine state itself: a command it relays goes through the monitor
loop's queue like a key press. Requests (after each side's hello):

- {"type": "snapshot"} -> {"type": "snapshot", "snapshot": GroupSnapshot as JSON}
- {"type": "output", "rank": R, "generation": G, "line": N} -> {"type": "output", "rank": R,
  "generation": G', "line": N', "version": V, "lines": k, "open": m, "own": [i...]}, then two output
  frames: the k complete lines after line N joined with b"\\n", and the m unfinished ones (bytes,
  as written). "own" (left out when empty) numbers, from 0, the complete lines that ranktop itself
  added (a restart's separator): a rank can print the same bytes, so the mark is never in them.
  A client that does not know "own" shows those lines as output, as before it was added
- {"type": "command", "id": I, "command": NAME, "args": {...}} -> {"type": "ack", "id": I, "ok": B,
  "message": S}, for the commands in RELAYED, answered from a thread of their own (the engine takes
  seconds over some: a stop's word to a hung store): meanwhile the other clients are served, and
  what this one sent after the command waits for its ack. A stack dump's ack also carries "report"
  (the StackReport as JSON), and comes later, from a thread of its own, while the client's other
  requests are answered, so a client waits for it on a connection of its own; "stays": true where
  the TUI that started the run holds its engine (it stays after the end until that TUI is quit)

- {"type": "subscribe", "ranks": [R...] | null, "cursors": {"R": [G, N]}} -> {"type": "subscribed",
  "snapshot": ...}, then, pushed every PUSH_SECONDS: each subscribed rank's new output from its
  cursor (as the answer to an output request: the head, then two output frames), a
  {"type": "snapshot"} whenever a state changes, {"type": "event", "event": {...}} for each line
  the run adds to events.jsonl, and {"type": "ended", "exit_status": N} once the run is over.
  The cursors make the stream gapless and without overlap from where the client stood. A
  subscriber that reads slowly is never waited on: while it has not taken what was pushed,
  nothing more is made for it, and when it catches up it resumes from what the ranks' rings still
  hold (it skips ahead); one that owes more than MAX_PENDING is dropped.

Every byte to a client goes through its outbox: sent as far as the client takes it now, the rest
when its socket is writable, so a client that reads slowly (or asks and never reads) costs its own
connection, never the server thread; one that owes more than MAX_PENDING is dropped. Frames that
arrived before a client closed are read and applied, even where its answers can no longer be sent;
one that closed only its sending side (shutdown) is sent what it is owed, for FAREWELL_SECONDS at
most, before its connection is closed; where stack dumps it asked for still run, it stays for their
answers, DUMP_FAREWELL_SECONDS at most, then FAREWELL_SECONDS to take them.
One that takes nothing for UNREAD_SECONDS, or asks nothing for IDLE_SECONDS and follows nothing,
is dropped too; on the way out, one that takes nothing for STUCK_SECONDS is not waited for.
A dropped client is told why after the rest of the frame it was in the middle of (what it owed
past that is let go: sent behind it, the reason was lost), for FAREWELL_SECONDS at most.
A client is answered FRAMES_PER_ROUND requests per round of the loop: the rest wait, its socket
read no further, for the next round, after every other client's turn; and while requests wait,
the thread rests between rounds as long as the round took (PUSH_SECONDS at most: the
subscribers are pushed to on), so a client that asks without pause
holds up neither the other clients nor the engine's threads (which need the GIL it would hold).

A client that sends anything else (or anything before its hello, or no hello within
HELLO_SECONDS, or a frame it leaves unfinished for FRAME_SECONDS), or that is not ours
(SO_PEERCRED: another uid) is dropped; so is one whose request fails to be answered, whatever
the reason: it costs its own connection, never the server. At most MAX_CLIENTS are served at
once; past them SPARE_CLIENTS more are served on short connections (their hello says "short":
why), each for SHORT_SECONDS and refused a subscription, so that `ranktop ls` and `stop` get in
however many clients stay. A newcomer past those, or one that finds the engine out of
descriptors, is refused with an error that says why and a one-word "refused" ("full", "busy"):
the engine is there, only not for it. The engine and the ranks never wait on a client.
A client whose hello says "commands": true is an attached view's second connection, which carries
its commands: it is not counted in the "clients" a snapshot gives (`ranktop ls`: one per view).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import errno
import functools
import json
import math
import os
import selectors
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from ranktop.core import commands as cmd
from ranktop.core import protocol
from ranktop.core.engine import Engine, OutputCursor
from ranktop.core.layout import SET_TMPDIR, path_problem, temp_dir
from ranktop.core.output import RanktopLine

SEND_TIMEOUT = 2.0  # seconds the clients have, all together, to take what is left for them on the way out
LAST_ANSWERS_SECONDS = 2.0  # on the way out, how long the commands still being answered are waited for
PUSH_SECONDS = 0.05  # how often subscribers get what is new
MAX_PENDING = 16 << 20  # bytes a subscriber may owe before it is dropped
MAX_REPLY_BYTES = 2 << 20  # output lines per answer: a client asks again for the rest
MAX_CLIENTS = 64  # ls, attach, logs -f, browser tabs: far more than anyone opens; each is a descriptor
SPARE_CLIENTS = 4  # short connections past MAX_CLIENTS: room for a `ranktop stop` however many stay
SHORT_SECONDS = 10.0  # how long a short connection is served: ls and stop take well under a second
HELLO_SECONDS = 5.0  # a client that has not said hello by then is dropped (it holds a descriptor)
FRAME_SECONDS = 5.0  # a client that leaves a frame unfinished this long is dropped (it holds a slot)
# A client that asks nothing this long (and follows nothing) is dropped: it holds one of the
# MAX_CLIENTS slots. An attached view asks 4 times a second, and asks again on a new connection
# if it was dropped meanwhile (suspended overnight), so only a leaked connection meets this.
IDLE_SECONDS = 600.0
# A client that takes none of what it is owed this long is dropped: `logs -f | less` left unread,
# an attach behind a frozen SSH link. It costs one push of memory while it stays (it skips ahead).
UNREAD_SECONDS = 600.0
CHECK_SECONDS = 1.0  # how often the two above are looked at
STUCK_SECONDS = 1.0  # on the way out, a client that takes nothing this long is waited for no more
# A dropped client is told why after the rest of the frame it is in the middle of (what else it
# owed is not sent: it is what it was not taking); the connection is closed once that is sent, or
# after this long. Meanwhile it is no client any more, and nothing of it is read. One that sent its
# end of file is sent all it is owed, as long.
FAREWELL_SECONDS = 5.0
# One that sent its end of file while stack dumps it asked for still ran stays for their answers
# this long at most after that end of file (each dump has its own bound: py-spy's DUMP_TIMEOUT, or
# NATIVE_DUMP_TIMEOUT, for each rank), then has FAREWELL_SECONDS to take them. A ranktop client
# waits as long for a dump (client.STACKS_TIMEOUT).
DUMP_FAREWELL_SECONDS = 60.0
MAX_PUSH_BYTES = 4 << 20  # output in one push to a subscriber, all its ranks together (past it by one rank's part at most): well under MAX_PENDING
# Requests answered per client per round of the loop; the rest of what it sent waits (its socket is
# read no further meanwhile) for the next round, after every other client's turn. A client of
# ranktop's asks and waits for the answer: only one that sends without waiting meets this.
FRAMES_PER_ROUND = 8
ACCEPT_PAUSE = 0.5  # out of descriptors even for the spare: stop accepting for this long
# Connections the kernel holds for the server to take: a burst of as many as it serves. Past the
# queue a connect fails at once (EAGAIN), however long its time-out, and ranktop said the engine
# did not answer: with a queue of 16, taken one a round, 3 of 20 `ls` started at once were told so.
LISTEN_QUEUE = MAX_CLIENTS + SPARE_CLIENTS
# Connections taken from the queue a round: a few, so that those that closed at once are read (and
# let go) before more are taken. All that waited, taken at once, would fill every slot with closed
# ones under a client that connects and closes without pause, and live ones were refused as `full`.
ACCEPTS_PER_ROUND = 8
RELAYED = {c.__name__: c for c in (cmd.SignalRank, cmd.SignalGroup, cmd.KillRank, cmd.KillGroup, cmd.RestartRank,
                                   cmd.RestartGroup, cmd.Stop, cmd.SendInput, cmd.DumpStacks, cmd.SignalDump)}
# Answered (as every command) from a thread of their own, py-spy taking seconds, but without holding
# back their client's later requests meanwhile: a client waits for a dump on a connection of its own.
SLOW = (cmd.DumpStacks, cmd.SignalDump)
# Stack dumps under way at once, all clients together; past them a dump is refused at once. Each
# runs py-spy on every rank (or signals them all), and a client that asks without waiting had a
# thread and a dump started for each request: 400 from one connection's one read.
MAX_DUMPS = 4
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as the kernel
    recorded them (SO_PEERCRED: for a client, those of the process that listens)."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


class SocketDirError(Exception):
    """The socket directory is not safe to use; the message says why."""


class SocketInUse(SocketDirError):
    """A live engine serves a run of this id already."""


def socket_dir(create: bool = True) -> str:
    """$XDG_RUNTIME_DIR/ranktop, else $TMPDIR/ranktop-<uid>/sock: made 0700 (unless not `create`:
    a lister makes nothing), and refused when it is a symlink, someone else's, or open to others
    (a planted socket would receive commands). Each directory on the way that ranktop owns is
    checked before anything is made in it: `ranktop-<uid>` under the shared temp directory could
    have been planted as a symlink into someone else's directory (or /etc), and
    $XDG_RUNTIME_DIR is another user's after `sudo`, so it is used only when it is ours and private.
    A socket is reached by path only, so every directory on the way is held to a --log-dir's rule
    (core/layout.path_problem): one below another user's directory, private or not, is theirs to
    swap for one whose sockets they answer."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and _private(runtime) and path_problem(runtime) is None:
        parent = runtime
    else:
        tmp = temp_dir()
        parent = os.path.join(tmp, f"ranktop-{os.geteuid()}")
        if problem := path_problem(tmp):
            raise SocketDirError(f"{parent}: {problem}; {SET_TMPDIR}")
        if create:
            _make(parent)
        if not _private(parent):
            _checked(parent)  # says why
    path = os.path.join(parent, "ranktop" if parent == runtime else "sock")
    if create:
        _make(path)
    return _checked(path)


def _make(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # checked next, without following it


def _private(path: str) -> bool:
    """A directory of ours that no one else can write to (not a symlink to one)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _checked(path: str) -> str:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise SocketDirError(f"{path} is a symlink; ranktop will not make or serve sockets through it")
    if not stat.S_ISDIR(info.st_mode):
        raise SocketDirError(f"{path} is not a directory")
    if info.st_uid != os.geteuid():
        raise SocketDirError(f"{path} belongs to uid {info.st_uid}, not to you")
    if info.st_mode & 0o077:
        raise SocketDirError(f"{path} is open to others (mode {stat.S_IMODE(info.st_mode):o})")
    return path


SUN_PATH_MAX = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL)
_DEFAULT_ID_LENGTH = len("20261126-193431-9fac")  # a run id ranktop chooses: the time and 4 hex digits


def socket_path(run_id: str) -> str:
    """The socket of `run_id`, its directory made and checked; SocketDirError when the directory
    is not safe or the path is too long for a socket (a long run id under a deep $TMPDIR)."""
    directory = socket_dir()
    path = os.path.join(directory, f"{run_id}.sock")
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        # The directory may leave no room even for a run id of the default length (a deep
        # $XDG_RUNTIME_DIR or $TMPDIR): then it is the one to shorten.
        roomy = len(os.fsencode(os.path.join(directory, "x" * _DEFAULT_ID_LENGTH + ".sock"))) <= SUN_PATH_MAX
        long_id = len(os.fsencode(run_id)) > _DEFAULT_ID_LENGTH
        shorter = ("--run-id" if roomy else
                   f"{'--run-id and ' if long_id else ''}$XDG_RUNTIME_DIR (or $TMPDIR, where it is unset)")
        raise SocketDirError(f"the socket path {path} is over the {SUN_PATH_MAX} bytes a Unix socket allows: "
                             f"use a shorter {shorter}")
    return path


_SCALARS = frozenset({str, int, float, bool, type(None)})


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def to_json(value: Any) -> Any:
    """A snapshot (nested frozen dataclasses, enums, tuples) as plain JSON data. Every push to a
    client makes one, a field at a time: plain values are settled first, and each class's field
    names are looked up once."""
    if type(value) in _SCALARS:  # (exactly: a str enum is not plain)
        return value
    if dataclasses.is_dataclass(value):
        return {name: to_json(getattr(value, name)) for name in _field_names(type(value))}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value


@dataclasses.dataclass
class _Subscriber:
    """What one client subscribed to and has been sent so far."""

    ranks: list[int]
    cursors: dict[int, OutputCursor]
    seen: tuple = ()  # the states last pushed
    events: int = 0  # the run's events so far when last pushed
    ended: bool = False
    first: int = 0  # where in `ranks` the next push begins: after the last rank a full push reached


@dataclasses.dataclass(slots=True, eq=False)
class _Client:
    """All the server keeps of one connected client: dropping it forgets it in one place."""

    sock: socket.socket
    decoder: protocol.FrameDecoder
    # What it has yet to take. None once it can no longer be written to (it closed): what it
    # sent before its close is still read and applied.
    outbox: bytearray | None
    asked_at: float  # when it last sent a whole frame (inf: a dump runs for it)
    took_at: float  # when it last took bytes, or began to owe them
    hello_due: float | None  # by when it must say hello; None once it has
    frame_due: float | None = None  # in the middle of a frame: by when it must end
    short_due: float | None = None  # past MAX_CLIENTS: by when it must have left
    queued: collections.deque | None = None  # requests read and not yet answered
    subscriber: _Subscriber | None = None
    writing: bool = False  # its socket is watched for room to write
    # Bytes at the head of the outbox that end a frame partly sent (0: it begins with a whole frame).
    frame_end: int = 0
    farewell: bytearray | None = None  # dropped: the end of its frame and why, to send before the close
    farewell_by: float = 0.0  # by when that must be taken
    later: int = 0  # its commands and stack dumps being answered, each from a thread of its own
    # A command of its is being answered: what it sent after it waits, unread, for that answer
    # (a connection's answers come in the order it asked, its commands are applied in that order).
    busy: bool = False
    # It sent its end of file while its dumps ran: it stays, to be sent their answers (one whose
    # command is being answered is not read meanwhile: its end of file is read after the ack).
    awaits_later: bool = False
    parked: bool = False  # out of the selector: busy, owing nothing; or leaving, all sent, awaiting answers
    counted: bool = True  # in `clients`: not a view's second connection, which carries its commands


class EngineServer:
    """Serves `engine` at `path` until close(); see the module's docstring for the requests."""

    def __init__(self, engine: Engine, path: str, run_id: str):
        self.engine, self.path, self.run_id = engine, path, run_id
        self.clients = 0  # connected now, for `ranktop ls`
        in_use = SocketInUse(f"{path} is in use: another run has this run id")
        if remove_if_dead(path):
            raise in_use
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is ours alone (its directory is already 0700)
        try:
            self._listener.bind(path)
        except OSError as exc:
            self._listener.close()
            if exc.errno == errno.EADDRINUSE:  # another engine bound it since we looked
                raise in_use from None
            raise
        finally:
            os.umask(old_umask)
        self._listener.listen(LISTEN_QUEUE)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe wakes the thread already
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._clients: dict[socket.socket, _Client] = {}
        # Of those, the ones whose read requests wait for their turn, in the order they came, and
        # the subscribers: each a view of _clients, kept only so the loop need not walk them all.
        self._waiting: dict[socket.socket, _Client] = {}
        self._subscribers: dict[socket.socket, _Client] = {}
        self._deadlines = False  # some client has a hello, a frame or a short connection's time running
        self._leaving: dict[socket.socket, _Client] = {}  # dropped clients, told why as they take it
        self._next_check = 0.0  # when idle and unreading clients are looked for next
        self._spare_fd = _spare_fd()  # given up for a moment to refuse a client when out of descriptors
        self._accept_paused_until = 0.0
        self._later: list[tuple[_Client, bytes | str, bool]] = []  # answers made in threads (or why not), sent by the server thread
        self._later_lock = threading.Lock()  # also held by a wake-up's write and by the close of its pipe
        self._closed = False
        self._leave = threading.Event()  # set by a Stop once the run has ended: stop lingering
        self._relays: list[threading.Thread] = []  # the threads that answer commands (those still running among them)
        self._dumps = 0  # stack dumps under way (MAX_DUMPS at most)
        # A TUI on the terminal that started the run holds the engine: after the end it stays
        # until that person quits it (a Stop's ack says so: `ranktop stop` waits for the end only).
        self.shown = False
        self._thread = threading.Thread(target=self._serve, name="ranktop-server", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:  # a process limit (pids.max counts threads): not served, no socket left
            self._closed = True
            self._let_go()
            raise

    # ----- the loop -----------------------------------------------------------------------------
    def _serve(self) -> None:
        last_push = 0.0
        while not self._closed:
            if self._subscribers and time.monotonic() - last_push >= PUSH_SECONDS:
                last_push = time.monotonic()
                self._push()
            self._keep_time()
            for key, events in self._selector.select(self._select_timeout()):
                client = key.data
                if client is not None:
                    if client.farewell is not None:
                        self._say_farewell(client)
                        continue
                    if events & selectors.EVENT_WRITE:
                        self._flush(client)
                    # (one with requests still queued is read no further: it waits its turn)
                    if events & selectors.EVENT_READ and client.queued is None and client.sock in self._clients:
                        self._read(client)
                elif key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj == self._wake_r:
                    if b"x" in os.read(self._wake_r, 512):
                        return
                    self._send_later()
            began = time.monotonic()
            self._answer_queued()
            if self._waiting:  # asked faster than answered: the engine's threads get as long, the GIL theirs
                time.sleep(min(time.monotonic() - began, PUSH_SECONDS))

    def _select_timeout(self) -> float | None:
        if self._waiting:  # answers are due: look only for what else is ready
            return 0.0
        waits = [PUSH_SECONDS] if self._subscribers else []
        if self._clients:
            waits.append(CHECK_SECONDS)
        if self._deadlines or self._accept_paused_until or self._leaving:
            waits.append(ACCEPT_PAUSE)
        return min(waits, default=None)

    def _keep_time(self) -> None:
        """Drop clients that did not say hello, or finish a frame, in time, and short ones whose
        time is over; accept again after a pause."""
        now = time.monotonic()
        if self._deadlines:
            self._deadlines = False
            for client in list(self._clients.values()):
                if late := self._late(client, now):
                    self._drop(client.sock, late[0], refused=late[1])
                else:
                    self._deadlines |= client.hello_due is not None or client.frame_due is not None or client.short_due is not None
        for client in list(self._leaving.values()) if self._leaving else ():
            if now >= client.farewell_by:
                self._close(client)
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)
        if now >= self._next_check:
            self._next_check = now + CHECK_SECONDS
            for client in list(self._clients.values()):
                if why := self._overstayed(client, now):
                    self._drop(client.sock, why)

    @staticmethod
    def _late(client: _Client, now: float) -> tuple[str, str | None] | None:
        """(why, refusal word) where `client` is past one of its deadlines, else None."""
        if client.hello_due is not None and now >= client.hello_due:
            return f"no hello within {HELLO_SECONDS:g}s", None
        # (one whose turn is still to come, or whose command is being answered, is not read meanwhile)
        if client.frame_due is not None and now >= client.frame_due and client.queued is None and not client.busy:
            return f"a frame left unfinished for {FRAME_SECONDS:g}s", None
        if client.short_due is not None and now >= client.short_due:
            return _SHORT, "full"
        return None

    def _overstayed(self, client: _Client, now: float) -> str | None:
        """Why `client` is kept no longer (it takes nothing of what it is owed, or asks nothing and
        follows nothing), or None. A subscriber of a quiet run is owed nothing: it stays; one that
        can take nothing more (it shut its reading side) follows nothing."""
        owed = len(client.outbox or b"")
        if owed and now - client.took_at >= UNREAD_SECONDS:
            return f"it took none of the {owed} bytes it was sent for {UNREAD_SECONDS:g}s"
        follows = client.subscriber is not None and client.outbox is not None
        if not owed and not follows and now - client.asked_at >= IDLE_SECONDS:
            return f"it asked nothing for {IDLE_SECONDS:g}s"
        return None

    def _accept(self) -> None:
        """Take the connections waiting in the queue, ACCEPTS_PER_ROUND at most: each is served or
        told why not."""
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._refuse_one_for_lack_of_descriptors()
                return
            self._take(conn)

    def _take(self, conn: socket.socket) -> None:
        uid = peer_credentials(conn)[1]
        if uid not in (os.geteuid(), 0):
            self._refuse(conn, f"uid {uid} may not reach this run: it belongs to uid {os.geteuid()}")
            return
        if len(self._clients) >= MAX_CLIENTS + SPARE_CLIENTS:
            self._refuse(conn, f"this run has {MAX_CLIENTS} clients, and {SPARE_CLIENTS} short connections past "
                               "them: try again in a few seconds", "full")
            return
        conn.setblocking(False)
        now = time.monotonic()
        client = _Client(conn, protocol.FrameDecoder(), bytearray(), asked_at=now, took_at=now, hello_due=now + HELLO_SECONDS)
        self._clients[conn] = client
        self._deadlines = True
        self._selector.register(conn, selectors.EVENT_READ, client)
        self.clients += 1
        short = {}
        if len(self._clients) > MAX_CLIENTS:
            client.short_due = now + SHORT_SECONDS
            short = {"short": _SHORT}
        # (a client that has closed already is still read: the frames it sent before are applied)
        self._send(client, protocol.encode_control(protocol.hello("engine", run_id=self.run_id, pid=os.getpid(), **short)))

    def _refuse_one_for_lack_of_descriptors(self) -> None:
        """accept() failed for want of a descriptor, and the client still waits in the queue, so
        the listener stays readable: without this the loop would spin. Free the spare descriptor,
        take the client and tell it why; if even that fails, stop accepting for a moment."""
        if self._spare_fd >= 0:
            os.close(self._spare_fd)
            try:
                conn, _ = self._listener.accept()
            except OSError:
                conn = None
            if conn is not None:
                self._refuse(conn, "the run's engine is out of file descriptors: try again later", "busy")
            self._spare_fd = _spare_fd()
            if conn is not None:
                return
        self._selector.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE

    def _read(self, client: _Client) -> None:
        """Take what `client` sent: its whole requests are queued, answered from this round on."""
        try:
            data = client.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # its end of file: a client that closed only its sending side reads what it asked for
            self._drop(client.sock, owed=True)
            return
        try:
            messages = client.decoder.feed(data)
        except protocol.ProtocolError as exc:
            if not exc.before:
                self._drop(client.sock, _why_dropped(exc))
                return
            # The requests ahead of the bad frame are answered, then it drops the client, as when
            # they came in a read of their own: in the same read they were lost (a Stop not applied).
            messages = [*exc.before, exc]
        except Exception as exc:  # what a client sends costs its own connection, never the server
            self._drop(client.sock, _why_dropped(exc))
            return
        if messages:
            client.queued = collections.deque(messages)
            self._waiting[client.sock] = client
        if not client.decoder.pending:
            client.frame_due = None
        elif client.frame_due is None:
            client.frame_due = time.monotonic() + FRAME_SECONDS
            self._deadlines = True

    def _answer_queued(self) -> None:
        """Each client's next FRAMES_PER_ROUND queued requests, a client at a time."""
        for conn, client in list(self._waiting.items()):
            queue = client.queued
            for _ in range(min(FRAMES_PER_ROUND, len(queue))):
                if conn not in self._clients:  # dropped by an earlier one: the rest is not applied
                    break
                client.asked_at = max(client.asked_at, time.monotonic())  # (not while a dump runs for it)
                self._answer_safely(conn, queue.popleft())
                if client.busy:  # the rest waits for its command's answer (_send_later)
                    break
            if client.busy and queue and conn in self._clients:
                self._waiting.pop(conn, None)
            elif not queue or conn not in self._clients:
                self._waiting.pop(conn, None)
                client.queued = None
                if client.frame_due is not None:  # it was not read while it waited: its unfinished frame's time starts now
                    client.frame_due = time.monotonic() + FRAME_SECONDS

    def _answer_safely(self, conn: socket.socket, message: Any) -> None:
        try:
            self._answer(conn, message)
        except Exception as exc:  # a request we could not answer costs its client, never the server
            self._drop(conn, _why_dropped(exc))

    def _answer(self, conn: socket.socket, message: Any) -> None:
        if isinstance(message, protocol.ProtocolError):  # the bad frame after its requests (_read)
            raise message
        if not isinstance(message, dict):
            raise protocol.ProtocolError("clients send control messages only")
        client = self._clients[conn]
        kind = message["type"]
        if kind == "hello":
            protocol.check_hello(message, "client")
            client.hello_due = None
            # An attached view's second connection: the view is counted once. (Once: a hello said
            # again took one more off `clients` each time, and `ls` showed a run with -4 clients.)
            if message.get("commands") is True and client.counted:
                client.counted = False
                self.clients -= 1
            return
        if client.hello_due is not None:
            raise protocol.ProtocolError("say hello first")
        if kind == "snapshot":
            self._send(client, protocol.encode_control({"type": "snapshot", "snapshot": to_json(self.engine.snapshot()),
                                                        "clients": self.clients}))
        elif kind == "output":
            self._send(client, self._output(message))
        elif kind == "subscribe":
            self._subscribe(conn, message)
        elif kind == "command":
            answer = self._command(client, message)
            if answer is not None:
                self._send(client, protocol.encode_control({"type": "ack", "id": message.get("id"), **answer}))
        else:
            raise protocol.ProtocolError(f"unknown request {kind[:40]!r}")

    def _output(self, message: dict) -> bytes:
        rank, generation, line = message.get("rank"), message.get("generation", -1), message.get("line", 0)
        tail, local_world = message.get("tail"), len(self.engine.snapshot().ranks)
        if not (protocol.is_whole(rank) and 0 <= rank < local_world and protocol.is_whole(generation) and -1 <= generation < _BIG
                and protocol.is_whole(line) and 0 <= line < _BIG and (tail is None or protocol.is_whole(tail) and 0 <= tail < _BIG)):
            raise protocol.ProtocolError(f"output request needs a local rank in 0..{local_world - 1}, a generation "
                                         "(-1 or more), a line (0 or more) and, if any, a tail (0 or more)")
        return self._output_since(rank, OutputCursor(generation, line), tail)[1]

    def _output_since(self, rank: int, since: OutputCursor, tail: int | None = None,
                      most: int = MAX_REPLY_BYTES) -> tuple[OutputCursor, bytes, bool]:
        """(the cursor after what is sent, the answer's frames, whether it holds anything new):
        `most` bytes of lines, or the first line alone where it is longer."""
        cursor, lines, open_lines = self.engine.output_since(rank, since, tail)
        sent, size, own = [], 0, []
        for text in lines:
            size += len(text) + 1
            if sent and size > most:
                break
            if type(text) is RanktopLine:
                own.append(len(sent))
            sent.append(text)
        first = cursor.line - len(lines)  # the number of the first line returned
        head = {"type": "output", "rank": rank, "generation": cursor.generation, "line": first + len(sent),
                "version": cursor.version, "lines": len(sent), "open": len(open_lines),
                "more": len(sent) < len(lines)}
        if own:  # which of the lines are ranktop's (a restart's separator): out of band, not in the bytes
            head["own"] = own
        frames = (protocol.encode_control(head) + protocol.encode_output(rank, first + len(sent), b"\n".join(sent))
                  + protocol.encode_output(rank, 0, b"\n".join(open_lines)[: protocol.MAX_OUTPUT - 64]))
        return OutputCursor(cursor.generation, first + len(sent), cursor.version), frames, bool(sent)

    # ----- subscribers --------------------------------------------------------------------------
    def _subscribe(self, conn: socket.socket, message: dict) -> None:
        client = self._clients[conn]
        if client.short_due is not None:
            self._drop(conn, _SHORT, refused="full")
            return
        local_world = len(self.engine.snapshot().ranks)
        ranks, cursors = message.get("ranks"), message.get("cursors") or {}
        if ranks is None:
            ranks = list(range(local_world))
        # Each rank once: every push walks the list, and [0] * 150000 kept the server busy for good
        # (ls and logs found the engine not answering while that client stayed).
        if (not isinstance(ranks, list) or not all(protocol.is_whole(r) and 0 <= r < local_world for r in ranks)
                or len(set(ranks)) != len(ranks) or not isinstance(cursors, dict)):
            raise protocol.ProtocolError(f"subscribe needs distinct local ranks in 0..{local_world - 1} and cursors")
        start = {}
        for rank in ranks:
            at = cursors.get(str(rank), [-1, 0])
            if not (isinstance(at, list) and len(at) == 2 and all(protocol.is_whole(v) and -1 <= v < _BIG for v in at)):
                raise protocol.ProtocolError("a cursor is [generation, line]")
            start[rank] = OutputCursor(at[0], at[1])
        snap = self.engine.snapshot()
        events, _ = self.engine.events_since(sys.maxsize)  # what happened so far is in the snapshot; news follows
        client.subscriber = _Subscriber(ranks, start, seen=_states(snap), events=events)
        self._subscribers[conn] = client
        self._send(client, protocol.encode_control({"type": "subscribed", "snapshot": to_json(snap)}))

    def _push(self) -> None:
        snap = self._snapshot_for_pushes()
        for client in list(self._subscribers.values()):
            sub = client.subscriber
            # One that has not taken the last push (or can no longer take any) gets nothing more: it skips ahead.
            if not (sub.ended or client.outbox is None or client.outbox):
                self._push_to(client, snap)

    def _snapshot_for_pushes(self) -> Any:
        """The engine's snapshot for a round of pushes; where taking it fails, the subscribers are
        dropped, told why (as a push that fails: never the server thread, nor the engine's end)."""
        try:
            return self.engine.snapshot()
        except Exception as exc:
            for client in list(self._subscribers.values()):
                self._drop(client.sock, _push_failed(exc))
            return None

    def _push_to(self, client: _Client, snap: Any) -> None:
        """What is new for the subscriber `client`, sent; a push that fails costs it alone."""
        try:
            push = self._make_push(client.subscriber, snap)
        except Exception as exc:  # as for a request: it costs this subscriber only (on the way out too)
            self._drop(client.sock, _push_failed(exc))
            return
        self._send(client, push)

    def _make_push(self, sub: _Subscriber, snap: Any) -> bytes:
        """What is new for `sub` since its last push (its cursors and marks moved on)."""
        push = bytearray()
        share = max(MAX_PUSH_BYTES // max(1, len(sub.ranks)), 1)  # each rank's: the rest comes in the next push
        # A rank's share is one whole line at least (up to LINE_CAP): with many ranks the shares
        # alone could hold far more than the bound, so the push stops there, and the ranks it did
        # not reach come first in the next one.
        order = sub.ranks[sub.first:] + sub.ranks[:sub.first]
        for reached, rank in enumerate(order):
            if len(push) >= MAX_PUSH_BYTES:
                sub.first = (sub.first + reached) % len(sub.ranks)
                break
            sub.cursors[rank], frames, new = self._output_since(rank, sub.cursors[rank], most=share)
            if new:
                push += frames
        sub.events, events = self.engine.events_since(sub.events)
        for line in events:  # ours, written as JSON: sent as it was written
            push += protocol.encode_control({"type": "event", "event": json.loads(line)})
        states = _states(snap)
        if states != sub.seen:
            sub.seen = states
            push += protocol.encode_control({"type": "snapshot", "snapshot": to_json(snap)})
        if snap.ended and not push:  # all its output went first
            sub.ended = True
            push += protocol.encode_control({"type": "ended", "state": snap.state.value, "exit_status": snap.exit_status})
        return bytes(push)

    def _last_push(self) -> None:
        """On the way out: the subscribers get the rest of the output and the end, and every
        client what its outbox holds (a Stop's ack), as far as they take it within SEND_TIMEOUT,
        all of them together (the rest is bounded by what the rings hold: 64 pushes each at most).
        One that takes nothing for STUCK_SECONDS (a follower that stopped reading long before the
        end, an attach behind a frozen link) is waited for no more: the end is not held up by it."""
        snap = self._snapshot_for_pushes()
        deadline = time.monotonic() + SEND_TIMEOUT
        left = dict.fromkeys(self._subscribers.values(), 64)  # pushes each may still be made (none without a snapshot)
        while (now := time.monotonic()) < deadline:
            for client in list(left):
                sub, outbox = client.subscriber, client.outbox
                if (client.sock not in self._clients or outbox is None or not left[client] or (sub.ended and not outbox)
                        or _stuck(client, now)):
                    del left[client]
                elif not outbox:
                    left[client] -= 1
                    self._push_to(client, snap)
            owing = [client for client in self._clients.values() if client.outbox and not _stuck(client, now)]
            if not (left or owing):
                return
            self._wait_for_room(owing, min(deadline, now + STUCK_SECONDS))

    def _wait_for_room(self, clients: list[_Client], deadline: float) -> None:
        """Until one of `clients` can take more (sending it what it can), or `deadline`."""
        if not clients:
            return
        with selectors.DefaultSelector() as writable:
            for client in clients:
                writable.register(client.sock, selectors.EVENT_WRITE, client)
            for key, _ in writable.select(max(0.0, deadline - time.monotonic())):
                self._flush(key.data)

    def _send(self, client: _Client, data: bytes) -> None:
        """The one way bytes go to a client: behind what it has yet to take (never in the middle
        of a frame), as far as it takes them now; the rest when its socket has room."""
        outbox = client.outbox
        if outbox is None:  # dropped, or it closed: no one reads what would be sent
            return
        if not outbox:  # it owes nothing until now: its time to take this starts now
            client.took_at = time.monotonic()
        outbox += data
        self._flush(client)

    def _flush(self, client: _Client) -> None:
        outbox = client.outbox
        if outbox is None:
            return
        conn = client.sock
        try:
            while outbox:
                sent = conn.send(outbox)
                client.frame_end = 0 if sent == len(outbox) else _frame_end(outbox, client.frame_end, sent)
                del outbox[:sent]
                client.took_at = time.monotonic()
        except BlockingIOError:
            if len(outbox) > MAX_PENDING:
                self._drop(conn, f"too slow: {len(outbox)} bytes not taken")
                return
        except OSError:  # it closed (EPIPE): what it sent before is still read, until its end of file
            client.outbox = None
            outbox.clear()
        self._watch_writes(client, bool(outbox))

    def _watch_writes(self, client: _Client, on: bool) -> None:
        """Watch `client` for room to write while its outbox holds anything (only then: an idle
        socket is always writable, and the loop would spin)."""
        if on == client.writing or client.sock not in self._clients:
            return
        client.writing = on
        self._watch(client, (0 if client.busy else selectors.EVENT_READ) | (selectors.EVENT_WRITE if on else 0))

    def _watch(self, client: _Client, events: int) -> None:
        """Watch `client`'s socket for `events`; for none, take it out of the selector (parked)."""
        if not events:
            if not client.parked:
                client.parked = True
                self._selector.unregister(client.sock)
        elif client.parked:
            client.parked = False
            self._selector.register(client.sock, events, client)
        else:
            self._selector.modify(client.sock, events, client)

    def _command(self, client: _Client, message: dict) -> dict | None:
        kind, args = RELAYED.get(str(message.get("command"))), message.get("args") or {}
        if kind is None:
            return {"ok": False, "message": f"unknown command {str(message.get('command'))[:40]!r}: "
                                            f"expected one of {', '.join(RELAYED)}"}
        if not isinstance(args, dict):  # (it was called an unknown command)
            return {"ok": False, "message": f"bad {kind.__name__}: its args must be an object of named values"}
        try:
            command = kind(**args)
        except TypeError as exc:
            return {"ok": False, "message": f"bad {kind.__name__}: {exc}"}
        if isinstance(command, SLOW) and self._dumps >= MAX_DUMPS:
            return {"ok": False, "message": f"{MAX_DUMPS} stack dumps are under way already: ask again once they are done"}
        self._answer_later(client, message.get("id"), command)
        return None

    def _answer_later(self, client: _Client, request_id: Any, command: cmd.Command) -> None:
        """Answer `command` from a thread of its own. The engine takes seconds to answer some: a
        stack dump (py-spy), and a stop or a group restart in a multi-node run, whose word waits on
        the rendezvous's store (up to the monitor loop's 5 s where it hangs). Answered here, the
        other clients waited for them, and so did the view of the TUI that sent one, on its other
        connection: its snapshots and panes froze for the command's wait, and `ls` found the engine
        not answering. A command (not a dump) holds back what its client sent after it until it is
        answered: a connection's answers come in the order it asked."""
        slow = isinstance(command, SLOW)
        client.asked_at = math.inf  # waiting for its answer is not idling
        client.later += 1
        self._dumps += slow
        if not slow:
            client.busy = True
            self._watch(client, selectors.EVENT_WRITE if client.writing else 0)  # (not read meanwhile: not spun on)
        answer = self._dump if slow else self._relay
        thread = threading.Thread(target=answer, args=(client, request_id, command),
                                  name="ranktop-server-dump" if slow else "ranktop-server-command", daemon=True)
        if not slow:  # (close() sends their answers: a stop's ack, say, which ends a lingering engine)
            self._relays = [t for t in self._relays if t.is_alive()] + [thread]
        thread.start()

    def _relay(self, client: _Client, request_id: Any, command: cmd.Command) -> None:
        data: bytes | str  # the ack, or why the client is dropped instead (a request not answered costs its client)
        try:
            ack = self.engine.submit(command)
            data = protocol.encode_control({"type": "ack", "id": request_id, "ok": ack.ok, "message": ack.message,
                                            **({"stays": True} if self.shown else {})})
        except Exception as exc:
            data = _why_dropped(exc)
        self._answered(client, data, held=True)
        if isinstance(command, cmd.Stop):  # (an ended run's engine says the stop got what it asked for)
            self._leave.set()  # whoever stops a run wants it gone: no lingering after this end (its ack goes first)

    def _dump(self, client: _Client, request_id: Any, command: cmd.DumpStacks | cmd.SignalDump) -> None:
        data: bytes | str  # the answer, or why the client is dropped instead (no answer could be framed)
        try:
            data = self._dump_answer(request_id, command)
        except Exception as exc:  # answered all the same: a client waits for it, and is never idle meanwhile
            why = f"stack dump failed: {type(exc).__name__}: {exc}"[:200]
            try:
                data = protocol.encode_control({"type": "ack", "id": request_id, "ok": False, "message": why})
            except protocol.ProtocolError:  # an id that fills a frame: no ack of it fits one
                data = why
        self._answered(client, data, held=False)

    def _answered(self, client: _Client, data: bytes | str, held: bool) -> None:
        """Hand an answer made in a thread to the server's thread, which sends it (`held`: its
        client's later requests wait for it)."""
        with self._later_lock:
            self._later.append((client, data, held))
        self._wake(b"a")

    def _wake(self, why: bytes) -> None:
        """Wake the server's thread (b"x": to end). Under the lock that close() closes the pipe in:
        a dump's thread that ended after the close wrote into whatever file of the process had
        taken the pipe's descriptor number by then."""
        with self._later_lock:
            if self._wake_w < 0:  # closed: the server is gone, and so are its clients
                return
            try:
                os.write(self._wake_w, why)
            except BlockingIOError:  # full: the thread has wake-ups to read already
                pass

    def _dump_answer(self, request_id: Any, command: cmd.DumpStacks | cmd.SignalDump) -> bytes:
        ack = self.engine.submit(command)
        answer = {"type": "ack", "id": request_id, "ok": ack.ok, "message": ack.message}
        try:
            return protocol.encode_control({**answer, "report": to_json(ack.report)})
        except protocol.ProtocolError as exc:  # thousands of ranks' stacks: the files have them all
            saved = ack.report.saved_txt if ack.report is not None else None
            return protocol.encode_control({**answer, "ok": False, "message": f"{ack.message}; too large to "
                                            f"relay ({exc}); the dump is saved in {saved}"})

    def _send_later(self) -> None:
        with self._later_lock:
            later, self._later = self._later, []
        for client, data, held in later:
            client.later -= 1
            self._dumps -= not held  # (a dump's answer: the one kind not held)
            if client.sock in self._clients:
                if not client.later:
                    client.asked_at = time.monotonic()
                if isinstance(data, str):
                    self._drop(client.sock, data)
                    continue
                self._send(client, data)
                if held:
                    self._go_on(client)
            elif client.awaits_later and client.farewell is not None:  # it sent its end of file while the answer was made
                self._answer_leaving(client, data if isinstance(data, bytes) else _error(data, None))

    def _go_on(self, client: _Client) -> None:
        """Its command answered, `client` is read again and what it sent after it answered."""
        client.busy = False
        self._watch(client, selectors.EVENT_READ | (selectors.EVENT_WRITE if client.writing else 0))
        if client.queued:
            self._waiting[client.sock] = client
        elif client.frame_due is not None:  # it was not read meanwhile: its unfinished frame's time starts now
            client.frame_due = time.monotonic() + FRAME_SECONDS

    def _answer_leaving(self, client: _Client, data: bytes) -> None:
        """An answer made in a thread (a dump's, a command's) to a client that sent its end of file
        meanwhile: sent behind what it is still owed; once its last is made, it has FAREWELL_SECONDS
        to take them."""
        client.farewell += data
        if not client.later:
            client.farewell_by = time.monotonic() + FAREWELL_SECONDS
        self._watch(client, selectors.EVENT_WRITE)
        self._say_farewell(client)

    def _refuse(self, conn: socket.socket, reason: str, word: str | None = None) -> None:
        """Tell a client we do not serve why, in one send that cannot wait (a new connection's
        buffer is empty), and close it: refusing a crowd never holds up the others. `word`: the
        one word for a refusal of a live engine that may serve later ("full", "busy")."""
        try:
            conn.setblocking(False)
            conn.send(_error(reason, word))
        except OSError:
            pass
        conn.close()

    def _drop(self, conn: socket.socket, reason: str | None = None, *, refused: str | None = None,
              owed: bool = False) -> None:
        """Forget the client of `conn`, telling it `reason` (if any) after the frame it is in the
        middle of; `owed`: it sent its end of file, and still takes all it is owed."""
        client = self._clients.pop(conn, None)
        if client is None:  # dropped already (a failed push, then its request's answer)
            return
        self._waiting.pop(conn, None)
        self._subscribers.pop(conn, None)
        self.clients -= client.counted
        outbox, client.outbox = client.outbox, None
        client.awaits_later = owed and client.later > 0  # (a socket that only sent its end of file still reads)
        if not (reason or owed and (outbox or client.awaits_later)) or outbox is None or len(self._leaving) >= MAX_CLIENTS:
            self._close(client)
            return
        # Why, after the frame it is in the middle of: what it owed beyond it is what it did not
        # take (sent with all of it, the reason was lost behind it, and `logs -f` said only that
        # the engine had ended the connection).
        client.farewell = outbox if owed else outbox[:client.frame_end] + _error(reason, refused)
        client.farewell_by = time.monotonic() + (DUMP_FAREWELL_SECONDS if client.awaits_later else FAREWELL_SECONDS)
        self._leaving[conn] = client
        self._watch(client, selectors.EVENT_WRITE)
        self._say_farewell(client)

    def _say_farewell(self, client: _Client) -> None:
        """Send a dropped client what it is told last, as far as it takes it; closed once it has."""
        try:
            while client.farewell:
                del client.farewell[:client.sock.send(client.farewell)]
        except BlockingIOError:
            return
        except OSError:  # it closed: no answer reaches it
            client.awaits_later = False
        if client.awaits_later and client.later:  # all sent so far: it waits for its answers
            self._watch(client, 0)  # (its socket is writable all along: watched, the loop would spin)
            return
        self._close(client)

    def _close(self, client: _Client) -> None:
        client.farewell = None  # (an event of this round that is still to be handled finds it closed)
        self._leaving.pop(client.sock, None)
        if not client.parked:
            self._selector.unregister(client.sock)
        client.sock.close()

    def linger(self, seconds: float) -> None:
        """Keep serving the ended run for `seconds`, or until a client sends Stop. Not at all
        when a signal stopped the run, and no longer once SIGTERM, SIGINT or SIGQUIT comes:
        whoever stops a run, or kills its engine, wants it gone (it used to stay 10 minutes, as
        if it ignored them; a SIGQUIT killed it with its default action, its socket left behind)."""
        if self.engine.snapshot().stop_signal is not None:
            return
        before = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
                before[sig] = signal.signal(sig, lambda _signum, _frame: self._leave.set())
        try:
            deadline = time.monotonic() + seconds
            while not self._leave.wait(max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    return
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def _last_answers(self) -> None:
        """On the way out (the server's thread has ended): the answers to the commands still being
        answered, waited for LAST_ANSWERS_SECONDS at most (an engine that has ended answers at
        once), into their clients' outboxes, with those made meanwhile."""
        deadline = time.monotonic() + LAST_ANSWERS_SECONDS
        for thread in self._relays:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._send_later()

    def close(self) -> None:
        """Stop serving and remove the socket: `ranktop ls` no longer lists the run."""
        if self._closed:
            return
        self._closed = True
        self._wake(b"x")
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._last_answers()
            self._last_push()
        for conn in list(self._clients):
            self._drop(conn)
        for client in list(self._leaving.values()):
            self._close(client)
        self._let_go()

    def _let_go(self) -> None:
        """Close the socket, the selector and the wake-up pipe, and remove the socket's file."""
        self._selector.close()
        self._listener.close()
        os.close(self._wake_r)
        with self._later_lock:  # (a dump's thread may be about to write to it)
            os.close(self._wake_w)
            self._wake_w = -1
        if self._spare_fd >= 0:
            os.close(self._spare_fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


_SHORT = (f"this run has {MAX_CLIENTS} clients, the most it serves for long: a connection past them is "
          f"served for {SHORT_SECONDS:g}s, and not for a subscription (ranktop ls shows the clients; "
          "one that leaves makes room)")


def _frame_end(outbox: bytearray, end: int, sent: int) -> int:
    """Where the frame that the first `sent` bytes of `outbox` end in ends, counted after them;
    `end`: where the first frame in `outbox` begins (every frame is whole behind it)."""
    while end < sent:
        end += 5 + int.from_bytes(outbox[end + 1:end + 5], "big")  # the frame's type and length, then its payload
    return end - sent


def _stuck(client: _Client, now: float) -> bool:
    """Whether `client` has taken none of what it is owed for STUCK_SECONDS."""
    return bool(client.outbox) and now - client.took_at >= STUCK_SECONDS


def _why_dropped(exc: Exception) -> str:
    """What a client is told when what it sent could not be taken or answered: a bad frame or
    request says what is wrong with it; anything else is our failure, named."""
    if isinstance(exc, (protocol.ProtocolError, OSError)):
        return str(exc)
    return f"request failed: {type(exc).__name__}: {exc}"[:200]


def _push_failed(exc: Exception) -> str:
    return f"push failed: {type(exc).__name__}: {exc}"[:200]


def _error(reason: str, refused: str | None) -> bytes:
    """The frame that tells a client why it is dropped or refused; `refused`: the one word for
    an engine that is there but would not serve it now ("full", "busy")."""
    return protocol.encode_control({"type": "error", "message": reason, **({"refused": refused} if refused else {})})


_BIG = 1 << 62  # cursors and counts past this are not ours (and would not fit the frames' fields)


def _spare_fd() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _states(snap: Any) -> tuple:
    """What a subscriber is told again when it changes: the group's state and each rank's."""
    return (snap.state, snap.generation, snap.ended, tuple((r.state, r.paused, r.restarts) for r in snap.ranks))


def remove_if_dead(path: str) -> bool:
    """Remove a socket whose engine died (nobody answers on it); whether a live engine serves
    it. SocketDirError when something that is not a socket has its name: a file or a symlink is
    not ours to remove. A listener whose queue is full counts as live (the connect is bounded)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SocketDirError(f"{path} is there and is not a socket")
    except FileNotFoundError:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except FileNotFoundError:
        return False
    except (TimeoutError, BlockingIOError):
        return True  # someone listens there, too busy to take us now
    except ConnectionRefusedError:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return False
    except OSError as exc:
        if exc.errno == errno.ENOTSOCK:
            raise SocketDirError(f"{path} is there and is not a socket") from None
        raise
    finally:
        probe.close()
    return True


def serve(engine: Engine, names: Iterable[str]) -> tuple[EngineServer | None, str | None]:
    """Serve `engine` under the first of `names` (run ids) that no live engine has; (server,
    None), or (None, why not) - a run without its socket still runs, it only cannot be reached
    from another terminal. `names` holds the run's id, and more for a multi-node job's shared
    rendezvous id, where several of its nodes may run on this host."""
    problem: Exception | str | None = None
    for name in names:
        try:
            return EngineServer(engine, socket_path(name), name), None
        except SocketInUse as exc:
            problem = exc
        except (SocketDirError, OSError) as exc:
            problem = exc
            break
        except RuntimeError as exc:  # its thread: "can't start new thread"
            problem = f"{exc} (a process limit: ulimit -u, or the container's pids.max)"
            break
    return None, f"not serving this run for ranktop ls/stop/logs: {problem}"
