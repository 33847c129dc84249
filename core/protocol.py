"""The wire format between a run's engine and the clients that attach to it.

A connection carries frames both ways. A frame is one type byte, a 4-byte big-endian length,
then the payload:

- `J`: a control message, a UTF-8 JSON object with a "type" (hello, subscribe, command, ack,
  snapshot, event, ended, error...). Small and rare, so JSON keeps it readable and versionable.
- `O`: rank output: local rank (u32), the stream's cursor after these bytes (u64), then the bytes
  exactly as the rank wrote them. Never decoded on the way: a rank's output may be any bytes.

Both sides are hostile to each other's mistakes: the decoder checks the type and the length
before it buffers anything, so garbage, a truncated frame or a 4 GB length prefix costs the
reader at most one frame's bounded buffer and ends as a `ProtocolError` naming what was wrong.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from ranktop.core.value import Value

VERSION = 1

CONTROL = b"J"
OUTPUT = b"O"
_HEAD = struct.Struct(">cI")  # type, payload length
_OUTPUT_HEAD = struct.Struct(">IQ")  # local rank, cursor after the bytes

MAX_CONTROL = 1 << 20  # a snapshot of thousands of ranks fits; anything bigger is not ours
MAX_OUTPUT = 4 << 20  # the engine sends output in slices of at most this much


class ProtocolError(Exception):
    """The peer sent something that is not this protocol; the connection is dropped with this.
    `before`: the whole frames that came ahead of the bad one in what was fed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.before: list[dict[str, Any] | Output] = []



def is_whole(value: Any) -> bool:
    """A JSON whole number another process sent: an int, not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)

class Output(Value):
    """One rank's output in one binary frame, with the position it ends at."""

    __slots__ = ("local_rank", "cursor", "data")

    def __init__(self, local_rank: int, cursor: int, data: bytes) -> None:
        self.local_rank = local_rank
        self.cursor = cursor  # the rank's output position after `data`: a client resumes from here
        self.data = data


def encode_control(message: dict[str, Any]) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    if len(payload) > MAX_CONTROL:
        raise ProtocolError(f"control message of {len(payload)} bytes is over the {MAX_CONTROL} byte limit")
    return _HEAD.pack(CONTROL, len(payload)) + payload


def encode_output(local_rank: int, cursor: int, data: bytes) -> bytes:
    if len(data) + _OUTPUT_HEAD.size > MAX_OUTPUT:
        raise ProtocolError(f"output slice of {len(data)} bytes is over the {MAX_OUTPUT} byte limit")
    return _HEAD.pack(OUTPUT, _OUTPUT_HEAD.size + len(data)) + _OUTPUT_HEAD.pack(local_rank, cursor) + data


def hello(role: str, **facts: Any) -> dict[str, Any]:
    """The first message each side sends: who it is and which protocol version it speaks."""
    return {"type": "hello", "version": VERSION, "role": role, **facts}


def check_hello(message: dict[str, Any], expect_role: str) -> None:
    if message.get("type") != "hello":
        raise ProtocolError(f"expected hello first, got {str(message.get('type'))[:40]!r}")
    if message.get("version") != VERSION:
        raise ProtocolError(f"protocol version {str(message.get('version'))[:20]!r} is not supported "
                            f"(this ranktop speaks version {VERSION}); use the same ranktop on both sides")
    if message.get("role") != expect_role:
        raise ProtocolError(f"expected a {expect_role}, got {str(message.get('role'))[:40]!r}")


class FrameDecoder:
    """Turns a byte stream into frames: dicts for control messages, `Output` for rank output."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any] | Output]:
        """The whole frames in what came so far; ProtocolError at the first bad one, with those
        before it (the same bytes read in two parts gave the first part's frames)."""
        self._buffer += data
        frames: list[dict[str, Any] | Output] = []
        try:
            while len(self._buffer) >= _HEAD.size:
                kind, length = _HEAD.unpack_from(self._buffer)
                _check_head(kind, length)
                end = _HEAD.size + length
                if len(self._buffer) < end:
                    break
                payload = bytes(self._buffer[_HEAD.size:end])
                del self._buffer[:end]
                frames.append(_decode_control(payload) if kind == CONTROL else _decode_output(payload))
        except ProtocolError as exc:
            exc.before = frames
            raise
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an unfinished frame held: at most one frame's limit."""
        return len(self._buffer)


def _check_head(kind: bytes, length: int) -> None:
    if kind == CONTROL:
        if length > MAX_CONTROL:
            raise ProtocolError(f"control frame of {length} bytes is over the {MAX_CONTROL} byte limit")
    elif kind == OUTPUT:
        if not _OUTPUT_HEAD.size <= length <= MAX_OUTPUT:
            raise ProtocolError(f"output frame of {length} bytes is outside {_OUTPUT_HEAD.size}..{MAX_OUTPUT}")
    else:
        raise ProtocolError(f"unknown frame type {kind!r}: not a ranktop connection")


def _decode_control(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." a million deep
        raise ProtocolError("control frame is not JSON") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("control frame is not a JSON object with a \"type\"")
    return message


def _decode_output(payload: bytes) -> Output:
    local_rank, cursor = _OUTPUT_HEAD.unpack_from(payload)
    return Output(local_rank, cursor, payload[_OUTPUT_HEAD.size:])
