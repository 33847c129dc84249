"""The attach protocol's frames: exact round trips over a real socket, and hostile input that
ends as one ProtocolError naming the problem, with bounded buffering."""

from __future__ import annotations

import random
import socket
import struct
import threading

import pytest
from ranktop.core.protocol import (
    MAX_CONTROL,
    VERSION,
    FrameDecoder,
    Output,
    ProtocolError,
    check_hello,
    encode_control,
    encode_output,
    hello,
)

ALL_BYTES = bytes(range(256)) * 3  # output is never decoded: every byte value must survive


def _stream() -> tuple[bytes, list]:
    frames = [hello("client", pid=1), {"type": "subscribe", "ranks": [0, 1]},
              Output(0, 768, ALL_BYTES), Output(7, 2**40, b""), {"type": "ack", "id": 3, "result": "ok"},
              Output(1, 5, b"\x1b]52;c;aGk=\x07\r\n")]
    wire = b"".join(encode_output(f.local_rank, f.cursor, f.data) if isinstance(f, Output) else encode_control(f)
                    for f in frames)
    return wire, frames


def test_frames_cross_a_real_socket_in_any_slicing():
    wire, frames = _stream()
    rng = random.Random(7)
    a, b = socket.socketpair()
    with a, b:
        def send() -> None:
            at = 0
            while at < len(wire):
                n = rng.randint(1, 9)
                a.sendall(wire[at:at + n])
                at += n
            a.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        decoder, got = FrameDecoder(), []
        while chunk := b.recv(5):
            got += decoder.feed(chunk)
        sender.join()
    assert got == frames and decoder.pending == 0


@pytest.mark.parametrize("wire,message", [
    (b"X\x00\x00\x00\x01a", "unknown frame type b'X': not a ranktop connection"),
    (b"GET / HTTP/1.1\r\n\r\n", "unknown frame type b'G'"),
    (struct.pack(">cI", b"J", 2**32 - 1), f"control frame of 4294967295 bytes is over the {MAX_CONTROL} byte limit"),
    (struct.pack(">cI", b"O", 2**31), "output frame of 2147483648 bytes is outside 12.."),
    (struct.pack(">cI", b"O", 3) + b"abc", "output frame of 3 bytes is outside 12.."),
    (struct.pack(">cI", b"J", 4) + b"\xff\xfe{}", "control frame is not JSON"),
    (struct.pack(">cI", b"J", 2) + b"[]", 'control frame is not a JSON object with a "type"'),
    (struct.pack(">cI", b"J", 12) + b'{"type": 5 }', 'control frame is not a JSON object with a "type"'),
    (struct.pack(">cI", b"J", 200_000) + b"[" * 200_000, "control frame is not JSON"),
])
def test_bad_input_is_one_protocol_error(wire, message):
    with pytest.raises(ProtocolError) as err:
        FrameDecoder().feed(wire)
    assert str(err.value).startswith(message)



def test_a_bad_frame_carries_the_whole_frames_ahead_of_it():
    """Fed in one part with the bad frame behind them, the good frames were lost with the error;
    fed apart, they were returned: the server applies them either way."""
    good = encode_control({"type": "snapshot"}) + encode_output(1, 5, b"out")
    with pytest.raises(ProtocolError) as err:
        FrameDecoder().feed(good + b"X\0\0\0\0")
    assert err.value.before == FrameDecoder().feed(good) == [{"type": "snapshot"}, Output(1, 5, b"out")]

def test_a_huge_length_prefix_is_refused_before_anything_is_buffered():
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError):
        decoder.feed(struct.pack(">cI", b"J", MAX_CONTROL + 1))
    assert decoder.pending <= 5


def test_truncated_frame_waits_without_error():
    wire = encode_control({"type": "snapshot", "ranks": list(range(100))})
    decoder = FrameDecoder()
    assert decoder.feed(wire[:-1]) == [] and decoder.pending == len(wire) - 1
    assert decoder.feed(wire[-1:]) == [{"type": "snapshot", "ranks": list(range(100))}]


def test_random_garbage_only_ever_raises_protocol_error():
    rng = random.Random(2026)
    wire, _ = _stream()
    for _ in range(3000):
        data = bytearray(wire)
        for _ in range(rng.randint(1, 6)):  # flip, cut and splice bytes of a valid stream
            at = rng.randrange(len(data))
            choice = rng.random()
            if choice < 0.5:
                data[at] = rng.randrange(256)
            elif choice < 0.8:
                del data[at:at + rng.randint(1, 40)]
            else:
                data[at:at] = rng.randbytes(rng.randint(1, 40))
        decoder = FrameDecoder()
        try:
            decoder.feed(bytes(data))
        except ProtocolError:
            continue
        assert decoder.pending <= MAX_CONTROL + 5


@pytest.mark.parametrize("message,error", [
    ({"type": "subscribe"}, "expected hello first, got 'subscribe'"),
    ({"type": "hello", "version": 99, "role": "client"},
     f"protocol version '99' is not supported (this ranktop speaks version {VERSION})"),
    ({"type": "hello", "version": VERSION, "role": "engine"}, "expected a client, got 'engine'"),
])
def test_hello_is_checked(message, error):
    with pytest.raises(ProtocolError, match=error.replace("(", r"\(").replace(")", r"\)")):
        check_hello(message, "client")
    check_hello(hello("client"), "client")
