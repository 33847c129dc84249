"""The one filter between text a rank supplies and the user's terminal.

Rank output, error.json messages and tracebacks, script and file names, stack dumps: any of it may
hold escape sequences that a terminal obeys (OSC 52 writes the clipboard, OSC 0/2 sets the window
title, CSI 2J clears the screen, OSC 8 opens a hyperlink whose URL can smuggle the rest). Every such
string goes through `clean` before it reaches a widget (or, with --sanitize-console, the console):

- OSC, DCS, SOS, PM and APC strings are dropped whole, OSC 8 hyperlinks included: their link text,
  which sits outside the sequence, stays, followed by the target as plain text (`docs <https://x>`)
  unless the text already is the target, so a link still says where it goes but cannot be clicked;
- CSI sequences are dropped, except SGR (colours, bold) when the caller keeps colours and each of
  its parameters has at most 8 digits;
- other escape sequences (ESC 7, ESC c, ESC ( B ...) are dropped;
- remaining C0 and C1 control characters are shown as visible symbols (U+2400 block: ␛ for a lone
  ESC, ␇ for BEL; a C1 character as ␛ and its 7-bit letter), so nothing invisible is lost;
- the bidirectional embeddings, overrides and isolates (U+202A-202E, U+2066-2069) are shown as
  their code point (`⟨U+202E⟩`): a terminal that implements bidi would let one reorder the rest of
  a line, so that a message reads other than its bytes ("Trojan Source"). The marks LRM, RLM and
  ALM, which only place neighbouring punctuation, are left to right-to-left text that needs them;
- a byte of a file name that is not in the file system's encoding (Python holds it as a lone
  surrogate, U+DC80-DCFF) is shown as its escape, `\\xff`: it was `?` on the way out, or `\\udcff`.

Work is per string: an unterminated string sequence at the end is dropped to the end, so a
sequence split over two lines never becomes a live one on either.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from ranktop.core.errors import UsageError

# 7-bit (ESC x) or 8-bit (one C1 character) introducers of the string sequences: DCS P, SOS X,
# OSC ], PM ^, APC _. They end at ST (ESC \ or U+009C) or, for OSC as xterm allows, BEL; here
# also at a line break (left in place), so an unterminated one hides no more than its own line.
_STRING = r"(?:\x1b[P\]X^_]|[\x90\x98\x9d\x9e\x9f])(?:[^\x07\x1b\x9c\n]|\x1b(?!\\))*(?:\x07|\x1b\\|\x9c|(?=\n)|\Z)"
_CSI = r"(?:\x1b\[|\x9b)([\x30-\x3f]*)([\x20-\x2f]*)([\x40-\x7e]|\Z)"
_OTHER_ESC = r"\x1b[\x20-\x2f]*[\x30-\x7e]"  # nF (ESC ( B), Fp/Fe/Fs (ESC 7, ESC M, ESC c)
_SEQUENCE = re.compile(f"{_STRING}|{_CSI}|{_OTHER_ESC}")
# Parameters of at most 8 digits each: no terminal reads one longer (xterm stops at 65535), and
# Rich, which reads the kept ones for the panes, raised on one of over 4300 digits (int()'s limit),
# so that a rank's `ESC [ 9999...9 m` ended the TUI.
_SGR_PARAMS = re.compile(r"(?:[0-9]{0,8}[;:])*[0-9]{0,8}")

_TAB, _NEWLINE = 0x09, 0x0A


def _symbol(code: int) -> str:
    if code == 0x7F:
        return "␡"
    if code < 0x20:
        return chr(0x2400 + code)  # ␀ … ␟ (␛ for ESC)
    return "␛" + chr(code - 0x40)  # a C1 control is ESC plus this letter in 7-bit form


_BIDI_CONTROLS = [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_UNDECODED_BYTES = range(0xDC80, 0xDD00)  # os.fsdecode's stand-ins for the bytes 0x80-0xff


def _symbols(newlines: bool) -> dict[int, str]:
    keep = {_TAB, _NEWLINE} if newlines else {_TAB}
    codes = [*range(0x20), 0x7F, *range(0x80, 0xA0)]
    symbols = {code: _symbol(code) for code in codes if code not in keep}
    return (symbols | {code: f"⟨U+{code:04X}⟩" for code in _BIDI_CONTROLS}
            | {code: f"\\x{code - 0xDC00:02x}" for code in _UNDECODED_BYTES})


_VISIBLE = _symbols(newlines=False)
_VISIBLE_WITH_NEWLINES = _symbols(newlines=True)
_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\udc80-\udcff]")


def _keep_sgr(match: re.Match[str]) -> str:
    params, intermediates, final = match.group(1, 2, 3)
    if final == "m" and not intermediates and params is not None and _SGR_PARAMS.fullmatch(params):
        return "\x1b[" + params + "m"  # the 8-bit CSI form is rewritten to the 7-bit one
    return ""


def _drop(match: re.Match[str]) -> str:
    return ""


_LINK_INTRODUCERS = ("\x1b]8;", "\x9d8;")


class _LinkTargets:
    """Replaces the sequences of one string as `keep` does, and writes each OSC 8 link's target
    after its text. A link ends at the next OSC 8 (`ESC ] 8 ; ; ST` closes it, another target
    replaces it) or at the end of the string."""

    def __init__(self, text: str, keep: Callable[[re.Match[str]], str]):
        self._text, self._keep = text, keep
        self._open: tuple[str, int] | None = None  # the open link's target, and where its text starts

    def __call__(self, match: re.Match[str]) -> str:
        if not match[0].startswith(_LINK_INTRODUCERS):
            return self._keep(match)
        shown = self.close(match.start())
        target = _link_target(match[0])
        self._open = (target, match.end()) if target else None
        return shown

    def close(self, end: int) -> str:
        """What follows the open link's text, which ends at `end`: ` <target>`, or nothing."""
        if self._open is None:
            return ""
        target, start = self._open
        self._open = None
        label = _SEQUENCE.sub("", self._text[start:end]).strip()
        return "" if label == target else f" <{target}>"


def _link_target(sequence: str) -> str:
    """The URI of an OSC 8 sequence: `8;params;URI` between the introducer and the terminator."""
    body = sequence[2:] if sequence.startswith("\x1b") else sequence[1:]
    for terminator in ("\x07", "\x1b\\", "\x9c"):
        body = body.removesuffix(terminator)
    fields = body.split(";", 2)
    return fields[2].strip() if len(fields) == 3 else ""


def clean(text: str, *, sgr: bool = False, newlines: bool = False) -> str:
    """`text` with nothing a terminal would act on: see the module docstring. `sgr` keeps colour
    sequences (rank output panes); `newlines` keeps line breaks (multi-line text like a
    traceback); tabs are always kept."""
    if not _UNSAFE.search(text):
        return text  # the common case: printable text, nothing to do
    table = _VISIBLE_WITH_NEWLINES if newlines else _VISIBLE
    keep = _keep_sgr if sgr else _drop
    links = _LinkTargets(text, keep) if "]8;" in text or "\x9d8;" in text else None
    replace = links or keep
    # One pass: the text between two sequences has its controls shown before it is joined to
    # anything, so a lone ESC left in front of a dropped sequence cannot meet the text after it
    # and become a live one (ESC ESC ] 0 ; x BEL [ 2 J must not end as ESC [ 2 J).
    out, at = [], 0
    for match in _SEQUENCE.finditer(text):
        out.append(text[at:match.start()].translate(table))
        shown = replace(match)
        out.append(shown if shown.startswith("\x1b[") else shown.translate(table))  # a kept SGR is whole
        at = match.end()
    out.append(text[at:].translate(table))
    if links is not None:
        out.append(links.close(len(text)).translate(table))
    return "".join(out)


def shown(text: str) -> str:
    """`text` with every control character shown as its picture (ESC as ␛, a newline as ␊) and
    nothing dropped: for a message quoting what someone typed, where the sequence itself is the
    news (`clean` drops whole sequences, as rank output's colours are noise)."""
    return text.translate(_VISIBLE) if _UNSAFE.search(text) else text


def quoted(value: object) -> str:
    """`value` as a one-line message quotes what someone typed (a path, a run id, a flag's value):
    in single quotes, as typed, a byte not in the file system's encoding as `\\xff` and a control
    character as its picture. (repr wrote `\\udcff`, doubled each backslash and switched quotes.)
    What is not text (an API caller's None, a number) is quoted as repr does."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        return repr(value)
    return f"'{shown(value)}'"


def check_console_prefix(what: str, text: str | None) -> None:
    """UsageError for a role or prefix template that a terminal would act on (an escape sequence,
    a newline) or that holds bytes that are not UTF-8: it heads every console line ranktop prints."""
    if text and (clean(text) != text or _not_utf8(text)):
        raise UsageError(f"bad {what} {quoted(text[:80])}: control characters (escape sequences, newlines) "
                         "or bytes that are not UTF-8 cannot head console lines")


def _not_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a command line's or the environment's undecodable bytes
        return True
    return False


def clean_bytes(raw: bytes, *, sgr: bool = False, newlines: bool = False) -> str:
    """Raw rank bytes as safe text: UTF-8 with invalid bytes replaced (a stray 8-bit C1 byte is
    invalid UTF-8, so it becomes U+FFFD), then `clean`."""
    return clean(raw.decode("utf-8", "replace"), sgr=sgr, newlines=newlines)


_UNFINISHED_ESCAPE = re.compile(rb"\x1b(?:\[[\x30-\x3f]*[\x20-\x2f]*|[\x20-\x2f]*)\Z")


def unfinished_tail(data: bytes) -> int:
    """How many bytes at the end of `data` start what only a next piece can finish: a UTF-8
    character cut short, or an escape or CSI sequence still without its final byte. A piece of a
    long line is cleaned on its own: held back, such a tail is cleaned whole with the next piece
    rather than shown as U+FFFD or stray parameters. (String sequences are not held: one may run
    on without end, and `clean` drops an unterminated one to the end of its piece.)"""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        if byte >= 0xC0 and back < (2 if byte < 0xE0 else 3 if byte < 0xF0 else 4):
            return back
        break
    escape = _UNFINISHED_ESCAPE.search(data, max(0, len(data) - 64))
    return len(escape[0]) if escape else 0


def clean_console(data: bytes) -> bytes:
    """The console filter of --sanitize-console: lines as `clean` makes them, colours kept."""
    return clean_bytes(data, sgr=True, newlines=True).encode("utf-8")
