"""The one sanitiser between rank-supplied text and the terminal (core.sanitize), and the
LogView's line conversion that uses it."""

from __future__ import annotations

import re

import pytest
from ranktop.core.sanitize import clean, clean_bytes, clean_console
from ranktop.tui.logview import MAX_CHARS, line_width, line_widths, parse_line

ESC, BEL, ST = "\x1b", "\x07", "\x1b\\"
CLIPBOARD = "cHduZWQ="  # base64 of "pwned"
OSC52 = f"{ESC}]52;c;{CLIPBOARD}{BEL}"
TITLE = f"{ESC}]0;EVIL-TITLE{ST}{ESC}]2;EVIL-TITLE2{BEL}"
# A link whose URL carries a clipboard write: what Rich's ANSI decoder turned into a live link.
LINK = f"{ESC}]8;;http://x/{BEL}{OSC52}{ST}click{ESC}]8;;{ST}"
DCS = f"{ESC}Pq#0;2;0;0;0#1!14~{ST}"

# Anything a terminal acts on: ESC, or any C0/C1 control other than tab and newline.
_LIVE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def live(text: str, sgr: bool = False) -> list[str]:
    """The control characters left in `text` (kept SGR sequences excepted when `sgr`)."""
    if sgr:
        text = re.sub(r"\x1b\[[0-9;:]*m", "", text)
    return _LIVE.findall(text)


@pytest.mark.parametrize("sgr", [False, True])
@pytest.mark.parametrize(("raw", "visible", "payload"), [
    (f"a{OSC52}b", "ab", CLIPBOARD),
    (f"{TITLE}after", "after", "EVIL-TITLE"),
    (f"{ESC}[2J{ESC}[H{ESC}[?1049hcleared", "cleared", "?1049"),
    (f"see {LINK} here", "see click <http://x/> here", CLIPBOARD),
    (f"x{DCS}y", "xy", "14~"),
    (f"{ESC}_apc payload{ST}{ESC}^pm payload{ST}{ESC}Xsos payload{ST}z", "z", "payload"),
    (f"{ESC}c{ESC}7{ESC}(B{ESC}#8ok", "ok", ""),
])
def test_sequences_are_dropped_and_the_text_stays(raw, visible, payload, sgr):
    out = clean(raw, sgr=sgr)
    assert out == visible
    assert not live(out)
    if payload:
        assert payload not in out


def test_eight_bit_c1_introducers_are_sequences_too():
    raw = "\x9b2J\x9d52;c;" + CLIPBOARD + "\x9cok\x90dcs\x9c\x9f" + "apc\x9c!"
    out = clean(raw, sgr=True)
    assert out == "ok!"
    assert not live(out)


def test_other_c1_and_c0_controls_become_visible_symbols():
    assert clean("a\x85b\x8dc") == "a␛Eb␛Mc"  # NEL, RI: shown as their 7-bit ESC letter
    assert clean("bell\x07 bs\x08 cr\r nul\x00 del\x7f") == "bell␇ bs␈ cr␍ nul␀ del␡"
    assert clean("lone escape\x1b") == "lone escape␛"
    assert clean("tab\tkept") == "tab\tkept"


def test_bidi_overrides_and_isolates_are_shown_as_code_points_and_marks_are_kept():
    # "Trojan Source": an override makes a terminal that implements bidi show `exe.txt`.
    assert clean("saved to \u202etxt.exe") == "saved to ⟨U+202E⟩txt.exe"
    raw = "".join(chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A)))
    out = clean(f"[{raw}]", sgr=True)
    assert out == "[" + "".join(f"⟨U+{c:04X}⟩" for c in map(ord, raw)) + "]"
    assert clean_console("[0]:a\u2067b\n".encode()) == "[0]:a⟨U+2067⟩b\n".encode()
    assert parse_line("x\u202ey".encode()).plain == "x⟨U+202E⟩y"
    rtl = "שלום\u200f! \u061cمرحبا\u200e"  # the marks only place punctuation: kept as they are
    assert clean(rtl) is rtl


def test_a_link_keeps_its_text_and_shows_its_target_as_plain_text():
    def link(target: str, text: str, st: str = ST) -> str:
        return f"{ESC}]8;id=7;{target}{st}{text}{ESC}]8;;{st}"

    assert clean(f"docs: {link('https://x.org/a', 'here')}.") == "docs: here <https://x.org/a>."
    # Rich's links say their own target: it is not written twice.
    assert clean(link("https://wandb.ai/r/1", "https://wandb.ai/r/1", BEL)) == "https://wandb.ai/r/1"
    # A new link ends the one before; a link still open at the end of the line ends there.
    two = f"{ESC}]8;;http://a{BEL}A{ESC}]8;;http://b{BEL}B"
    assert clean(two, sgr=True) == "A <http://a>B <http://b>"
    assert clean("\x9d8;;http://c\x9cC\x9d8;;\x9c!") == "C <http://c>!"
    # The target is text like any other: its controls are shown, and it is never a live link.
    out = clean(link("http://a/\x01\u202e", f"{ESC}[1mt{ESC}[0m"), sgr=True)
    assert out == f"{ESC}[1mt{ESC}[0m <http://a/␁⟨U+202E⟩>"
    assert "]8;" not in out and not live(out, sgr=True)


@pytest.mark.parametrize("sgr", [False, True])
@pytest.mark.parametrize("raw", [f"a{ESC}{ESC}]0;x{BEL}[2J", f"{ESC}{ESC}c[2J", f"{ESC}{ESC}{DCS}[?1049h",
                                 f"{ESC}{ESC}[6n", f"{ESC}{OSC52}[1mbold"])
def test_a_lone_escape_cannot_meet_the_text_after_a_dropped_sequence(raw, sgr):
    """A sequence dropped from between a lone ESC and `[2J` used to leave them side by side: a live
    clear-screen where colours are kept (the panes, the end report, --sanitize-console)."""
    out = clean(raw, sgr=sgr)
    assert not live(out, sgr=sgr) and "␛" in out


def test_newlines_are_kept_only_when_asked():
    assert clean("one\ntwo") == "one␊two"
    assert clean("one\ntwo", newlines=True) == "one\ntwo"


def test_sgr_colours_are_kept_only_when_asked():
    raw = f"{ESC}[1;31mred{ESC}[0m {ESC}[38;2;1;2;3mrgb{ESC}[m"
    assert clean(raw, sgr=True) == raw
    assert clean(raw) == "red rgb"
    assert clean(f"{ESC}[31$mno", sgr=True) == "no"  # an intermediate byte: not an SGR
    assert clean("\x9b31mc1", sgr=True) == f"{ESC}[31mc1"  # 8-bit CSI rewritten to the 7-bit form
    assert clean(f"{ESC}[38;5;00000196mx", sgr=True) == f"{ESC}[38;5;00000196mx"  # (8 digits)
    # A parameter no terminal reads: Rich's int() of its 5000 digits raised, and the TUI ended.
    assert clean(f"{ESC}[{'9' * 5000}mx{ESC}[1;{'2' * 9}my", sgr=True) == "xy"
    assert parse_line(f"{ESC}[{'9' * 5000}mbig{ESC}[31m red".encode()).plain == "big red"


def test_an_unterminated_sequence_is_dropped_to_the_end_of_its_line():
    assert clean(f"start{ESC}]52;c;{CLIPBOARD}") == "start"
    assert clean(f"start{ESC}[12") == "start"
    # Split over two lines (two ring lines, two console chunks): neither half is live.
    first, second = clean(f"a{ESC}]52;c;AAAA"), clean(f"BBBB{BEL}z")
    assert first == "a" and second == "BBBB␇z"
    assert clean(f"a{ESC}]0;title\nnext{BEL}", newlines=True) == "a\nnext␇"


def test_invalid_utf8_is_replaced_and_stray_c1_bytes_cannot_act():
    out = clean_bytes(b"ok \xff\xfe \x9b2J \xc2\x9b2J end")
    assert out == "ok \ufffd\ufffd \ufffd2J  end"
    assert not live(out)


def test_plain_text_is_returned_unchanged():
    text = "epoch 3 loss 0.25 ✓ [bold]not markup[/bold]"
    assert clean(text) is text


def test_console_filter_keeps_colours_and_lines():
    raw = f"[0]:{ESC}[32mok{ESC}[0m{OSC52}\n[1]:{TITLE}done\n".encode()
    assert clean_console(raw) == f"[0]:{ESC}[32mok{ESC}[0m\n[1]:done\n".encode()


# ----- the LogView's one conversion function -------------------------------------------------
def test_parse_line_keeps_colours_and_drops_everything_else():
    raw = f"{ESC}[31mred{ESC}[0m {LINK} {OSC52}{TITLE}{ESC}[2J\x07end".encode()
    text = parse_line(raw)
    assert text.plain == "red click <http://x/> ␇end"
    assert not live(text.plain)
    assert [(span.start, span.end, span.style.color.number) for span in text.spans] == [(0, 3, 1)]
    assert not any(span.style.link for span in text.spans)
    assert line_width(raw) == text.cell_len


def test_line_widths_of_a_batch_are_each_lines_width():
    plain = [b"step 1 loss 0.5", b"", b"~" * MAX_CHARS]
    for batch in (plain, [*plain, f"{ESC}[31mred{ESC}[0m".encode()], [*plain, b"a\tb"],
                  [*plain, b"x" * (MAX_CHARS + 5)], [*plain, "漢字".encode()], [b"a\x7f"], []):
        assert line_widths(batch) == [line_width(line) for line in batch]
    assert line_widths(plain) == [15, 0, MAX_CHARS]


def test_parse_line_does_not_read_markup():
    text = parse_line(b"[link=http://evil]x[/link] [bold]b[/bold]")
    assert text.plain == "[link=http://evil]x[/link] [bold]b[/bold]"
    assert not text.spans
