"""A ring's older output waits compressed (core/packing.py), and every look at it gives what a
ring that never packed gives: lines, open lines, the newest lines made aside, the line count."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
from ranktop.core import output, packing
from ranktop.core.output import LINE_CAP, MADE, STDERR, STDOUT, LineRing, RanktopLine
from ranktop.core.packing import PackedChunk, RingPacker, pack


def log_lines(first: int, count: int) -> bytes:
    return b"".join(b"[rank 3] step %7d loss %.5f lr 3.0e-04 tok/s %d\n" % (i, 2.5 / (1 + i * 1e-3), 41000 + i % 900)
                    for i in range(first, first + count))


def packed_chunks(ring: LineRing) -> int:
    return sum(isinstance(chunk, PackedChunk) for _, chunk, _ in ring._chunks)


def random_chunk(rng: random.Random, n: int) -> bytes:
    return rng.choice([
        b"o%d" % n, b"\n", b"step %d\r" % n, b"a\nb%d\nc" % n,
        log_lines(n, rng.randint(1, 400)),
        b"".join(b"\r%3d%%|" % k + b"#" * 40 for k in range(rng.randint(1, 200))),
        b"x" * rng.randint(LINE_CAP - 100, LINE_CAP + 5000),  # a line past the cap, across chunks
        os.urandom(rng.randint(100, 20_000)),  # (incompressible: waits as it came)
    ])


@pytest.mark.parametrize("maxlen, max_bytes, max_chunks",
                         [(1_000_000, 64 << 20, None), (300, 8 << 20, None), (5000, 256 << 10, None), (2000, 1 << 20, 40)])
def test_every_look_at_a_packed_ring_gives_what_an_unpacked_one_gives(maxlen, max_bytes, max_chunks, monkeypatch):
    """Two rings fed the same chunks, both streams, '\\r' redraws, lines past the cap, random
    bytes, with the byte budget, the line count and the chunk count dropping old chunks, ranktop's
    own lines and a new attempt's clear() among them, one packing at random moments (its looks
    made aside, as a pane's first look and `--metric` make them, or all of it made, as a pane's)."""
    if max_chunks is not None:
        monkeypatch.setattr(output, "_MAX_CHUNKS", max_chunks)
    rng = random.Random(maxlen)
    ring, plain = LineRing(maxlen, max_bytes), LineRing(maxlen, max_bytes)
    packed_at_some_point, made_packed_at_some_point = 0, False
    pane, pane_first, pane_shown = [], 0, True  # a TUI's pane of the ring: it keeps the lines it is given
    for n in range(1500):
        stream, chunk = rng.choice((STDOUT, STDOUT, STDERR)), random_chunk(rng, n)
        for r in (ring, plain):
            r.feed(stream, chunk)
        if rng.random() < 0.2:
            made = {id(line) for line in ring.lines if len(line) > 1}  # (b"" and one byte are shared objects)
            ring.pack()
            packed = made - {id(line) for line in ring.lines}
            assert not any(id(line) in packed for line in pane)  # (a pane's lines are never kept twice)
            packed_at_some_point = max(packed_at_some_point, packed_chunks(ring))
            made_packed_at_some_point = made_packed_at_some_point or any(s == MADE for s, _, _ in ring._chunks)
        if rng.random() < 0.03:  # hidden (it keeps its lines and asks for none), shown again, or let go of
            pane_shown = not pane_shown
            if rng.random() < 0.3:
                pane, pane_first = [], ring.total_lines
        if pane_shown and rng.random() < 0.1:  # its poll, as a LogView's
            answer = ring.since(pane_first + len(pane))
            assert answer == plain.since(pane_first + len(pane))
            _, total, new, _ = answer
            if total - len(new) != pane_first + len(pane):  # lines went by unseen: it starts from the ring's window
                pane, pane_first = [], total - len(new)
            pane += new
            pane_first += max(0, len(pane) - maxlen)
            del pane[:-maxlen]
            del answer, new
        if rng.random() < 0.01:
            restarted = rng.random() < 0.8  # (else the attempt is replaced: its output goes)
            for r in (ring, plain):
                r.add_own_line(f"ranktop: restart {n}") if restarted else r.clear()
        if rng.random() < 0.05:
            assert ring.open_line() == plain.open_line()
            seen = rng.randint(0, ring.total_lines)
            for tail in (1, 300, None):
                assert ring.since(seen, tail) == plain.since(seen, tail)
    assert packed_at_some_point and made_packed_at_some_point
    # (Made lines packed again go whole once newer chunks hold maxlen lines; made, they stayed until
    # the next look made more. Every look gives the same lines either way.)
    assert ring.total_lines == plain.total_lines and ring.held_bytes <= plain.held_bytes
    assert ring.stored_bytes <= ring.held_bytes  # (a chunk is packed only where that saves)
    assert ring.open_line() == plain.open_line()
    assert ring.tail() == plain.tail()


def test_a_quiet_ranks_output_is_packed_on_the_second_look_and_reads_the_same():
    ring, plain = LineRing(), LineRing()
    for start in range(0, 10_000, 250):  # 10k training-log lines, read in rounds, then quiet
        for r in (ring, plain):
            r.feed(STDOUT, log_lines(start, 250))
    held = ring.held_bytes
    assert ring.pack() == (True, 0)  # the first look only marks what is there, and says more is coming
    assert not packed_chunks(ring)
    more, saved = ring.pack()  # the second packs all of it, the newest chunk too: nothing left
    assert not more and packed_chunks(ring) == len(ring._chunks)
    assert ring.stored_bytes < held / 4 and saved == held - ring.stored_bytes
    assert ring.held_bytes == held  # (the byte budget counts output as it came)
    assert ring.since(0, 300) == plain.since(0, 300)
    assert ring.tail() == plain.tail()


def test_output_that_keeps_coming_is_packed_once_it_stayed_a_look():
    ring = LineRing()
    for start in range(0, 8000, 1000):  # eight chunks (a block holds up to 64 KiB)
        ring.feed(STDOUT, log_lines(start, 1000))
    ring.pack()
    ring.feed(STDOUT, log_lines(8000, 1000))  # a new chunk: the one before it will not change
    assert ring.pack()[0]
    assert packed_chunks(ring) == 8 and not isinstance(ring._chunks[-1][1], PackedChunk)
    ring.feed(STDOUT, b"more of the newest")  # (gathered onto it: it changed since the look)
    assert ring.pack() == (True, 0) and packed_chunks(ring) == 8
    assert not ring.pack()[0] and packed_chunks(ring) == 9  # quiet a whole look: packed too
    ring.feed(STDOUT, b" and after it\n")  # a packed chunk is never added to
    assert isinstance(ring._chunks[-2][1], PackedChunk) and ring._chunks[-1][1] == b" and after it\n"
    assert ring.tail()[-1].endswith(b"more of the newest and after it")


def test_output_that_turns_over_within_a_few_looks_is_not_packed_until_it_stays():
    """A rank writing its whole scrollback again between two looks (MBs a second of long lines,
    say) would have every byte packed and then dropped: its ring is packed once it slows."""
    ring, plain = LineRing(maxlen=2000), LineRing(maxlen=2000)
    for start in range(0, 12_000, 1000):
        for r in (ring, plain):
            r.feed(STDOUT, log_lines(start, 1000))
        assert ring.pack() == (True, 0) and not packed_chunks(ring)
    assert not ring.pack()[0] and packed_chunks(ring) == len(ring._chunks)
    assert ring.tail() == plain.tail()


def test_a_newest_chunk_too_small_to_pack_is_looked_at_again_once_it_grew():
    ring = LineRing()
    ring.feed(STDOUT, b"epoch 1\n")
    ring.pack()
    assert ring.pack() == (False, 0) and not packed_chunks(ring)  # quiet a look, but too small to be worth it
    ring.feed(STDOUT, log_lines(0, 500))  # gathered onto it
    ring.pack()
    more, saved = ring.pack()
    assert not more and saved > 0 and packed_chunks(ring) == 1 == len(ring._chunks)
    assert ring.tail() == [b"epoch 1", *log_lines(0, 500).split(b"\n")[:-1]]


def test_a_ring_whose_chunks_a_view_made_into_lines_has_nothing_left_to_pack():
    """A shown pane makes its rank's lines at each repaint: the packer, finding nothing waiting,
    must not keep coming back for that ring."""
    ring = LineRing()
    ring.feed(STDOUT, log_lines(0, 1000))
    ring.pack()
    ring.feed(STDOUT, log_lines(1000, 10))
    shown = ring.tail()  # (a pane keeps the lines it was given)
    assert ring.pack() == (True, 0)  # the lines made: left a look to see whether they stay as they are
    assert ring.pack() == (False, 0) and not ring._pack_due  # held by the pane: not packed twice
    assert len(ring.lines) == len(shown) == 1010 and not ring._chunks


def test_lines_made_for_a_look_that_is_gone_wait_packed_again():
    """A client's look at a served run (`ranktop attach`, a pane's whole scrollback) makes its
    rank's lines; once they stayed a look as they are, and nothing but the ring holds them, they
    are packed again, and every later look gives what a ring that kept them made gives. (Walking
    64 quiet ranks from an attached TUI took their engine from 31 to 99 MB for good.)"""
    ring, plain = LineRing(), LineRing()
    for start in range(0, 10_000, 500):
        for r in (ring, plain):
            r.feed(STDOUT, log_lines(start, 500))
    for r in (ring, plain):
        r.feed(STDERR, b"Epoch 3:  40%|####      | 2/5")
        assert len(r.since(0)[2]) == 10_000  # the look: every line made (and let go of: sent away)
    held = ring.held_bytes
    assert ring.pack() == (True, 0)
    more, saved = ring.pack()
    assert not more and not ring.lines and [s for s, _, _ in ring._chunks] == [MADE]
    assert ring.stored_bytes < held / 4 and saved == held - ring.stored_bytes and ring.held_bytes == held
    assert ring.open_line() == plain.open_line() == b"Epoch 3:  40%|####      | 2/5"
    for seen, tail in ((0, 300), (9_990, None), (10_000, None)):
        assert ring.since(seen, tail) == plain.since(seen, tail)
    for r in (ring, plain):  # (its stream that wrote last is the rank's, never the packed lines')
        r.add_own_line("──── 12:03:04 restart 1 of this rank (ranktop) ────")
    assert ring.open_line() is plain.open_line() is None
    for r in (ring, plain):
        r.feed(STDOUT, log_lines(10_000, 100))
    assert ring.since(9_000) == plain.since(9_000)
    assert ring.tail() == plain.tail()


def test_made_lines_up_to_ranktops_own_or_with_a_view_that_holds_them_stay_made():
    own, plain = LineRing(), LineRing()
    for r in (own, plain):
        r.feed(STDOUT, log_lines(0, 2000))
        r.add_own_line("──── 12:03:04 restart 1 of this rank (ranktop) ────")  # (a RanktopLine: its type is its mark)
    own.pack()
    assert own.pack() == (False, 0) and len(own.lines) == 2001 and not own._chunks
    for r in (own, plain):
        r.feed(STDOUT, log_lines(2000, 2000))
        r.since(2001)
    own.pack()
    assert own.pack()[1] > 0 and len(own.lines) == 2001 and [s for s, _, _ in own._chunks] == [MADE]  # the lines after it
    assert own.tail() == plain.tail() and type(own.tail()[2000]) is RanktopLine
    shown = LineRing()
    shown.feed(STDOUT, log_lines(0, 2000))
    pane = shown.since(0)[2]  # a TUI's pane keeps the lines it is given: packed, they would be kept twice
    shown.pack()
    assert shown.pack() == (False, 0) and len(shown.lines) == len(pane) == 2000
    del pane
    shown.feed(STDOUT, log_lines(2000, 10))
    shown.since(2000)  # (the pane gone; more made)
    shown.pack()
    assert shown.pack()[1] > 0 and not shown.lines



def test_lines_a_hidden_pane_holds_stay_made_where_a_look_made_newer_ones():
    """A hidden pane keeps the lines it was given and asks for no more (the compact view's panes
    of the ranks walked past); another view's look (a failed rank's root cause, a search of every
    rank) made the lines that came since, which nothing keeps. Packed, the pane's would be kept
    twice, and made again, apart from the pane's, once it is shown: twice as objects, for good."""
    ring = LineRing()
    ring.feed(STDOUT, log_lines(0, 2000))
    pane = ring.since(0)[2]  # then hidden
    ring.feed(STDOUT, log_lines(2000, 10))
    ring.tail(60)
    ring.pack()
    assert ring.pack() == (False, 0) and len(ring.lines) == 2010 and not ring._chunks
    pane += ring.since(2000)[2]  # shown again
    assert len(pane) == 2010 and all(mine is kept for mine, kept in zip(pane, ring.lines, strict=True))


def test_lines_a_look_takes_while_they_are_packed_again_stay_made(monkeypatch):
    """zlib packs the made lines outside the ring's lock: a pane opened on the rank meanwhile (a
    search's jump to it, say) takes those very lines, which must then stay as they are."""
    ring = LineRing()
    ring.feed(STDOUT, log_lines(0, 2000))
    ring.tail()  # (a look that is gone)
    pane = []

    def pack_while_a_pane_opens(raw, size=None):
        pane.extend(ring.since(0)[2])
        return pack(raw, size)

    assert ring.pack() == (True, 0)
    monkeypatch.setattr(output, "pack", pack_while_a_pane_opens)
    assert ring.pack() == (True, 0)  # (taken meanwhile: they are looked at again)
    monkeypatch.setattr(output, "pack", pack)
    ring.pack()
    assert ring.pack() == (False, 0) and not ring._chunks
    assert len(pane) == 2000 and all(mine is kept for mine, kept in zip(pane, ring.lines, strict=True))


def test_a_progress_bar_after_lines_packed_again_is_made_at_each_look_and_they_stay_packed():
    """A client follows a quiet rank whose lines were packed again, while a progress bar is redrawn
    on stderr: each look made the bar aside from where its line began (every redraw of an epoch, up
    to the byte budget: 5 ms a look after 30k redraws, against 0.013), as nothing new was made."""
    ring, plain = LineRing(), LineRing()
    for r in (ring, plain):
        r.feed(STDOUT, log_lines(0, 2000))
        r.since(0)
    ring.pack(), ring.pack()
    made = ring._chunks[0]
    assert [s for s, _, _ in ring._chunks] == [MADE]
    for k in range(50):
        for r in (ring, plain):
            r.feed(STDERR, b"\rEpoch 3: %3d%%|" % k + b"#" * (k // 3) + b"| %d/5000 [00:12<03:00]" % k)
        assert ring.since(2000) == plain.since(2000)
        assert list(ring._chunks) == [made]  # the bar made onto its open line; the lines left packed
    assert ring.open_line() == plain.open_line() and ring.tail() == plain.tail()


def test_lines_a_follower_makes_again_at_each_new_line_are_not_packed_again_each_time(monkeypatch):
    """A served run's rank that prints a line every few seconds, followed by a client (`ranktop
    attach`'s pane, `ranktop follow`): each new line's look made all of its lines again, and the
    packer packed them again before the next (6 ms a line for 10k lines, against 0.01). Lines a
    look made again wait twice as long each time before they are packed again."""
    packed_made = []

    def counting_pack(raw, size=None):
        if size is not None:
            packed_made.append(size)
        return pack(raw, size)

    monkeypatch.setattr(output, "pack", counting_pack)
    ring, plain = LineRing(), LineRing()
    for r in (ring, plain):
        r.feed(STDOUT, log_lines(0, 2000))
    seen = ring.since(0)[1]
    for k in range(30):
        ring.pack(), ring.pack()  # a quiet look
        for r in (ring, plain):
            r.feed(STDOUT, log_lines(2000 + k, 1))
        answer = ring.since(seen)
        assert answer == plain.since(seen)
        seen = answer[1]
        del answer
    again = len(packed_made)
    assert 1 <= again <= 2
    for _ in range(2 * output._MADE_AGAIN_WAIT):  # the client gone: packed again all the same, a minute on
        ring.pack()
    assert len(packed_made) == again + 1 and not ring.lines and ring.tail() == plain.tail()


def test_lines_made_again_for_a_chunk_past_the_byte_budget_are_not_packed_again_each_time(monkeypatch):
    """Lines a look made, packed again once it left, wait first, as one entry: in a ring at its
    byte budget (long lines), each chunk that came made them all again to let the oldest go, and
    the packer packed them all again two looks later (a rank of 1 KB lines, one every 3 s: 8 MB
    packed and unpacked every 7 s, for good). Made again so, they wait twice as long each time,
    as a follower's do."""
    packed_made = []

    def counting_pack(raw, size=None):
        if size is not None:
            packed_made.append(size)
        return pack(raw, size)

    def wide_line(i: int) -> bytes:  # (a metrics dict a step)
        return b"step %5d {" % i + b'"grad_norm": 1.0, ' * 55 + b"}\n"

    monkeypatch.setattr(output, "pack", counting_pack)
    ring, plain = LineRing(1000, 256 << 10), LineRing(1000, 256 << 10)  # (~250 of its lines)
    for r in (ring, plain):
        for i in range(0, 400, 50):
            r.feed(STDOUT, b"".join(map(wide_line, range(i, i + 50))))
        r.tail()  # a look that is gone
    ring.pack(), ring.pack()
    assert [s for s, _, _ in ring._chunks] == [MADE] and len(packed_made) == 1
    for k in range(40):  # a line, then quiet for two looks
        for r in (ring, plain):
            r.feed(STDOUT, wide_line(400 + k))
        ring.pack(), ring.pack()
    assert len(packed_made) <= 2
    assert ring.since(0, 10) == plain.since(0, 10) and ring.tail() == plain.tail()


def test_output_that_does_not_compress_waits_as_it_came():
    ring = LineRing()
    noise = os.urandom(210_000).replace(b"\n", b"").replace(b"\r", b"")[:200_000]  # one line
    ring.feed(STDOUT, noise)
    ring.feed(STDOUT, b"\n")
    ring.pack()
    assert ring.pack() == (False, 0)
    assert not packed_chunks(ring) and ring.stored_bytes == ring.held_bytes
    assert ring.tail() == [noise[:LINE_CAP] + b" \xe2\x80\xa6 [ranktop: line cut, 200,000 bytes; the log file has it all]"]


def test_feeding_while_another_thread_packs_loses_and_reorders_nothing():
    """The reader thread feeds (gathering small reads onto the newest chunk) while the packer's
    thread packs: zlib reads a chunk outside the ring's lock, so nothing may add to it then."""
    ring, plain = LineRing(maxlen=100_000, max_bytes=64 << 20), LineRing(maxlen=100_000, max_bytes=64 << 20)
    done = threading.Event()

    def keep_packing() -> None:
        while not done.is_set():
            ring.pack()

    packing = threading.Thread(target=keep_packing)
    packing.start()
    try:
        rng = random.Random(3)
        for n in range(20_000):
            chunk = log_lines(n, rng.randint(1, 3)) if rng.random() < 0.9 else b"partial %d " % n
            ring.feed(STDOUT, chunk)
            plain.feed(STDOUT, chunk)
    finally:
        done.set()
        packing.join(10)
    assert not packing.is_alive()
    ring.pack(), ring.pack()
    assert packed_chunks(ring) > 10
    assert ring.tail() == plain.tail()


def test_the_packer_thread_packs_what_stayed_and_then_sleeps():
    ring = LineRing()
    ring.feed(STDOUT, log_lines(0, 5000))
    own = RingPacker(every=0.02)
    own.wake(ring)
    deadline = time.monotonic() + 10
    while (packed_chunks(ring) < len(ring._chunks) or ring._pack_due) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert packed_chunks(ring) == len(ring._chunks) and not ring._pack_due
    assert not own._due.is_set() and not own._rings  # nothing more coming: it waits to be woken


def test_a_rings_output_is_packed_by_the_process_packer_after_it_stayed_a_while(monkeypatch):
    monkeypatch.setattr(packing, "_packer", RingPacker(every=0.05))  # (the process's, as feed() finds it)
    ring = LineRing()
    ring.feed(STDOUT, log_lines(0, 5000))  # wakes the packer: no call to pack() here
    deadline = time.monotonic() + 15
    while packed_chunks(ring) < len(ring._chunks) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert packed_chunks(ring) == len(ring._chunks)
    assert ring.tail()[-1] == log_lines(4999, 1)[:-1]


def test_a_chunk_mostly_after_its_last_newline_waits_as_it_came_and_a_kept_tail_counts():
    """A packed chunk keeps its text after the last newline beside it (up to 4 KiB): where that
    is most of the chunk (a progress bar left drawn), packed it would take more than it came in;
    where packing pays even so, the tail is part of the memory it takes."""
    bar = b"".join(b"\r%3d%%|" % k + b"#" * (k // 4) + b" " * (25 - k // 4) for k in range(101))
    ring = LineRing()
    ring.feed(STDOUT, b"epoch 1\n" + bar)  # 3.1 KB, all but 8 bytes after the newline
    ring.pack()
    assert ring.pack() == (False, 0) and not packed_chunks(ring)
    assert ring.stored_bytes == ring.held_bytes
    other = LineRing()
    other.feed(STDOUT, log_lines(0, 100) + bar)  # 5.8 KB of lines, the bar after them
    other.pack()
    more, saved = other.pack()
    assert not more and packed_chunks(other) == 1 and other.stored_bytes > len(bar)
    assert saved == other.held_bytes - other.stored_bytes
    assert other.open_line() == bar.rsplit(b"\r", 1)[1] and other.tail()[-1] == bar.rsplit(b"\r", 1)[1]


def test_a_look_that_failed_leaves_the_ring_to_the_packer(monkeypatch):
    """A look whose packing raised (no memory for zlib's work) while output kept coming: what it
    chose waits as it came, and the packer still packs the ring's later output. (The ring had
    said more was coming, so its feed does not wake the packer again: dropped, it never was.)"""
    monkeypatch.setattr(packing, "_packer", RingPacker(every=0.05))  # (the process's may be asleep for 2 s)
    failed = []

    def pack_once_failing(raw):
        if not failed:
            failed.append(len(raw))
            raise MemoryError
        return pack(raw)

    monkeypatch.setattr(output, "pack", pack_once_failing)
    ring = LineRing()
    looks = []

    def look() -> tuple[bool, int]:
        looks.append(LineRing.pack(ring))
        if len(looks) == 1:  # more comes between the first look and the second, which fails
            ring.feed(STDERR, log_lines(0, 300))
        return looks[-1]

    ring.pack = look
    ring.feed(STDOUT, log_lines(0, 3000))  # wakes the process packer
    deadline = time.monotonic() + 10
    while not failed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failed
    ring.feed(STDOUT, log_lines(3000, 300))
    while packed_chunks(ring) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert packed_chunks(ring) == 2 and not isinstance(ring._chunks[0][1], PackedChunk)  # (the one that failed)


def test_a_packer_thread_that_cannot_start_fails_no_feed(monkeypatch):
    """Starting the packer's thread can fail (a container's pids limit): the reader's feed must
    not raise, which would fail the rank's sink (its console and ring would get no more), and a
    later wake starts the thread, which packs the rings listed before too."""
    own = RingPacker(every=0.02)
    monkeypatch.setattr(packing, "_packer", own)
    start = threading.Thread.start

    def refused(thread: threading.Thread) -> None:
        if thread.name == "ranktop-packer":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refused)
    ring = LineRing()
    ring.feed(STDOUT, log_lines(0, 5000))
    monkeypatch.setattr(threading.Thread, "start", start)
    other = LineRing()
    other.feed(STDOUT, log_lines(0, 5000))
    deadline = time.monotonic() + 10
    while (packed_chunks(ring) < len(ring._chunks) or packed_chunks(other) < len(other._chunks)) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert packed_chunks(ring) == len(ring._chunks) and packed_chunks(other) == len(other._chunks)
