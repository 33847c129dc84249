"""A client that floods a run's engine with requests, for bench_ab.py --flood: it asks for
snapshots as fast as its socket takes them, never waiting for an answer, and reads the answers
as they come, only to count them (so the engine never drops it as too slow). With `waits` (the
--flood-waits of bench_ab.py) it asks one at a time instead, the next as soon as the last is
answered, as a client of ranktop's does, only without pause: it never meets the engine's bound of
requests per round.

    python bench/flood.py SOCKET [SECONDS] [--waits]   # by hand, beside a run: answers per second
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ranktop.core import protocol  # noqa: E402

sys.path.pop(0)

BATCH = 64  # requests per send
ANSWER = b'"type":"snapshot"'  # in every answer's head, and in nothing else the engine sends it


class Flood:
    """Floods the engine at `path` once it is served, until stop() or the engine leaves."""

    def __init__(self, path: str, waits: bool = False) -> None:
        self.path, self.waits, self.answers, self.seconds = path, waits, 0, 0.0
        self._stop = threading.Event()
        self._conn = socket.socket(socket.AF_UNIX)
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def start(self) -> Flood:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self._conn.shutdown(socket.SHUT_RDWR)  # its reads and sends end now
        except OSError:  # not connected (the run ended before it was served)
            pass
        self._thread.join(30)
        self._conn.close()

    def _run(self) -> None:
        while not os.path.exists(self.path):
            if self._stop.wait(0.005):
                return
        try:
            self._conn.connect(self.path)
        except OSError:  # the run ended first
            return
        began = time.monotonic()
        if self.waits:
            self._ask_and_wait()
            self.seconds = time.monotonic() - began
            return
        asking = threading.Thread(target=self._ask, name="flood-ask", daemon=True)
        asking.start()
        tail = b""
        try:
            while data := self._conn.recv(1 << 16):
                self.answers += (tail + data).count(ANSWER)
                tail = data[-len(ANSWER) + 1:]  # (an answer's mark split across two reads)
        except OSError:
            pass
        self.seconds = time.monotonic() - began
        self._stop.set()
        asking.join(30)

    def _ask(self) -> None:
        batch = protocol.encode_control({"type": "snapshot"}) * BATCH
        try:
            self._conn.sendall(protocol.encode_control(protocol.hello("client")))
            while not self._stop.is_set():
                self._conn.sendall(batch)
        except OSError:  # the engine left, or dropped us, or stop()
            pass


    def _ask_and_wait(self) -> None:
        """One request at a time, the next as soon as the last is answered (read whole)."""
        ask, decoder = protocol.encode_control({"type": "snapshot"}), protocol.FrameDecoder()
        try:
            self._conn.sendall(protocol.encode_control(protocol.hello("client")) + ask)
            while not self._stop.is_set() and (data := self._conn.recv(1 << 16)):
                for frame in decoder.feed(data):
                    if isinstance(frame, dict) and frame.get("type") == "snapshot":
                        self.answers += 1
                        self._conn.sendall(ask)
        except OSError:  # the engine left, or dropped us, or stop()
            pass


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--waits"]
    if not args or args[0] in ("-h", "--help"):  # (it flooded a socket named --help for 10 s)
        print(__doc__)
        return 0 if args else 2
    path, seconds = args[0], float(args[1]) if len(args) > 1 else 10.0
    flood = Flood(path, waits="--waits" in sys.argv).start()
    time.sleep(seconds)
    flood.stop()
    print(f"{flood.answers} answers in {flood.seconds or seconds:.1f} s: {flood.answers / (flood.seconds or seconds):.0f}/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
