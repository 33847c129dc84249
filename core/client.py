"""The client side of core/server.py: find the runs served on this host and talk to one."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from ranktop.core import protocol
from ranktop.core.server import SocketDirError, socket_dir

CONNECT_TIMEOUT = 3.0


class RunGone(Exception):
    """The run's engine is not there (any more), or it refused us; the message says which."""


class Connection:
    """One connection to a run's engine: request() sends a control message and returns the answer
    (a dict, plus the output frames that came with it)."""

    def __init__(self, path: str, timeout: float = CONNECT_TIMEOUT):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._decoder = protocol.FrameDecoder()
        self._frames: list[Any] = []
        try:
            self._sock.connect(path)
            self._sock.sendall(protocol.encode_control(protocol.hello("client")))
            first = self._next()
        except OSError as exc:
            self._sock.close()
            raise RunGone(f"no engine answers at {path} ({exc.strerror or exc})") from None
        if first.get("type") == "error":
            self._sock.close()
            raise RunGone(str(first.get("message")))
        protocol.check_hello(first, "engine")
        self.hello = first

    def _next(self) -> Any:
        while not self._frames:
            data = self._sock.recv(1 << 16)
            if not data:
                raise ConnectionResetError(0, "the engine closed the connection")
            self._frames += self._decoder.feed(data)
        return self._frames.pop(0)

    def request(self, message: dict, frames: int = 0) -> tuple[dict, list[protocol.Output]]:
        try:
            self._sock.sendall(protocol.encode_control(message))
            answer = self._next()
            outputs = [self._next() for _ in range(frames if answer.get("type") == message["type"] else 0)]
        except OSError as exc:
            raise RunGone(f"the run's engine went away ({exc.strerror or exc})") from None
        if answer.get("type") == "error":
            raise RunGone(str(answer.get("message")))
        return answer, outputs

    def snapshot(self) -> dict:
        answer, _ = self.request({"type": "snapshot"})
        return {**answer["snapshot"], "clients": answer.get("clients", 0)}

    def command(self, name: str, **args: Any) -> dict:
        answer, _ = self.request({"type": "command", "id": 1, "command": name, "args": args})
        return answer

    def output(self, rank: int, generation: int, line: int) -> tuple[dict, list[bytes], list[bytes]]:
        """(answer, complete lines after `line`, unfinished lines) of one rank."""
        answer, (done, open_) = self.request({"type": "output", "rank": rank, "generation": generation,
                                              "line": line}, frames=2)
        lines = done.data.split(b"\n") if answer["lines"] else []
        return answer, lines, open_.data.split(b"\n") if answer["open"] else []

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ServedRun:
    run_id: str
    path: str
    snapshot: dict
    clients: int
    pid: int  # the engine's process


def served_runs() -> list[ServedRun]:
    """Every run served on this host for this user, newest first; sockets nobody answers on
    (their engine died) are removed on the way."""
    try:
        directory = socket_dir()
    except (SocketDirError, OSError):
        return []
    found = []
    for name in os.listdir(directory):
        if not name.endswith(".sock"):
            continue
        path = os.path.join(directory, name)
        try:
            with Connection(path, timeout=1.0) as conn:
                snap, pid = conn.snapshot(), conn.hello.get("pid")
        except RunGone:
            _remove_if_dead(path)
            continue
        except (protocol.ProtocolError, KeyError):
            continue
        found.append(ServedRun(name[: -len(".sock")], path, snap, snap.get("clients", 1) - 1, pid))
    return sorted(found, key=lambda run: run.snapshot.get("started_at") or 0, reverse=True)


def _remove_if_dead(path: str) -> None:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    except OSError:
        pass
    finally:
        probe.close()


def find_run(target: str | None, runs: list[ServedRun]) -> ServedRun:
    """The run `target` names (a run id, a unique prefix of one, or its run directory); the newest
    running one when None. ValueError with one line listing the candidates otherwise."""
    if target is None:
        live = [r for r in runs if not r.snapshot.get("ended")] or runs
        if not live:
            raise ValueError("no runs are served on this host (ranktop ls lists them)")
        return live[0]
    by_dir = [r for r in runs if os.path.abspath(target) == r.snapshot.get("log_dir")]
    exact = [r for r in runs if r.run_id == target]
    matches = by_dir or exact or [r for r in runs if r.run_id.startswith(target)]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(r.run_id for r in (matches or runs)) or "none"
    what = "matches several runs" if matches else "names no run served on this host"
    raise ValueError(f"{target!r} {what}: runs are {names}")


def wait_gone(path: str, timeout: float) -> bool:
    """Until nobody serves `path` any more (the run ended and its engine left), or `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(path):
            return True
        try:
            Connection(path, timeout=1.0).close()
        except RunGone:
            return True
        time.sleep(0.1)
    return False
