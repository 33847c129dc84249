"""Writes awkward bytes to stdout: binary junk, invalid UTF-8, a 5 MB line with no newline in the
middle of the stream, '\r' progress bars and a partial last line. The same bytes come from
`payload()`, so a test can compare byte for byte."""
import os
import sys


def payload() -> bytes:
    parts = [
        b"plain line\n",
        bytes(range(256)) + b"\n",
        b"bad utf8 \xff\xfe\xc3\x28 end\n",
        b"progress 10%\rprogress 50%\rprogress 100%\n",
        b"x" * (5 * 1024 * 1024),
        b"\nafter the long line\n",
        b"\r\n".join([b"crlf line"] * 3) + b"\r\n",
        b"partial last line without newline",
    ]
    return b"".join(parts)


if __name__ == "__main__":
    data = payload()
    out = sys.stdout.buffer
    for i in range(0, len(data), 7919):  # odd-sized writes, so chunk borders land anywhere
        out.write(data[i : i + 7919])
        out.flush()
    os.write(2, b"stderr too\n")
