"""The ring of recent lines stays bounded in bytes and linear in time, whatever a rank prints:
one endless line, a progress bar redrawn on it, or many huge lines."""

from __future__ import annotations

import fcntl
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
from ranktop.core.output import LINE_CAP, STDERR, STDOUT, ConsoleWriter, LineRing, RanktopLine, collapse_cr

MB = 1 << 20


def _open_bytes(ring: LineRing) -> int:
    return sum(len(p.current) + len(p.shown_before) for p in ring.partial.values())


def test_an_endless_line_keeps_its_head_and_its_length_in_bounded_memory():
    ring = LineRing()
    chunk = b"a" * MB
    for _ in range(64):
        ring.feed(STDOUT, chunk)
        assert _open_bytes(ring) <= LINE_CAP
    shown = ring.tail()[-1]
    assert shown.startswith(b"a" * LINE_CAP) and shown[LINE_CAP:].startswith(" \u2026".encode())
    assert f"{64 * MB:,} bytes".encode() in shown
    ring.feed(STDOUT, b"!\n")
    assert ring.total_lines == 1 and f"{64 * MB + 1:,} bytes".encode() in ring.tail()[0]
    assert ring.bytes == len(ring.tail()[0]) < LINE_CAP + 200


def test_a_progress_bar_redrawn_on_a_huge_open_line_shows_its_last_state():
    ring = LineRing()
    step = 0
    while step < 1_000_000:  # about 20 MB of redraws on one unfinished line
        ring.feed(STDERR, b"".join(b"\rtraining step %07d" % k for k in range(step, step + 20_000)))
        step += 20_000
        assert ring.tail() == [b"training step %07d" % (step - 1)]
        assert _open_bytes(ring) <= 64
    ring.feed(STDERR, b"\r" + b"p" * MB + b"\r")  # one huge state: its head, with its length
    assert ring.tail()[0].startswith(b"p" * LINE_CAP) and f"{MB:,} bytes".encode() in ring.tail()[0]
    ring.feed(STDERR, b"done\n")
    assert ring.tail() == [b"done"]


def test_the_ring_is_capped_in_bytes_as_well_as_lines():
    ring = LineRing(maxlen=10_000, max_bytes=4 * MB)
    for i in range(1000):
        ring.feed(STDOUT, b"z" * MB + b"\n")  # 1000 lines of 1 MB would be 1 GB
        if i % 7 == 0:
            ring.tail(1)  # watched now and then: lines made from what came so far
        assert ring.held_bytes <= 4 * MB
    assert ring.total_lines == 1000 and len(ring.tail()) > 1
    assert ring.bytes == sum(map(len, ring.lines)) <= 4 * MB
    small = LineRing(maxlen=10_000, max_bytes=1000)
    small.feed(STDOUT, b"".join(b"line %05d\n" % i for i in range(5000)))
    version, total, new, _ = small.since(4990)
    assert small.bytes <= 1000 and total == small.total_lines == 5000
    assert new == [b"line %05d" % i for i in range(4990, 5000)]


def test_nobody_watching_costs_no_lines_and_the_newest_output_survives():
    ring = LineRing(maxlen=10_000, max_bytes=300)
    many = [b"".join(b"x%03d\n" % i for i in range(start, start + 20)) for start in range(0, 500, 20)]
    feeds = [b"open line start ", b"and more ", *many, b"open at the end"]
    for chunk in feeds:
        ring.feed(STDOUT, chunk)
        assert not ring.lines and ring.held_bytes <= 300  # the reader made no line objects
    assert ring.total_lines == 500
    tail = ring.tail()
    assert tail[-1] == b"open at the end" and tail[-2] == b"x499"
    assert tail[:-1] == [b"x%03d" % i for i in range(500 - len(tail) + 1, 500)]


def test_lines_are_the_same_however_the_bytes_are_chunked():
    rng = random.Random(7)
    text = b"".join(rng.choice([b"ab", b"\r", b"\n", b"cde\r\n", b"x" * 50, b"\r\r"]) for _ in range(3000)) + b"\n"
    expected = [collapse_cr(line) for line in text.split(b"\n")[:-1]]
    ring = LineRing(maxlen=100_000)
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 40)
        ring.feed(STDOUT, text[pos : pos + step])
        pos += step
    assert ring.tail() == expected


def test_a_ring_of_short_lines_holds_about_maxlen_lines_not_its_whole_byte_budget():
    # 20 MB of short lines in chunks of 5000: the ring (8 MiB budget) keeps only the chunks that
    # still hold one of the newest 1000 lines, and shows the same lines as ever.
    ring, line = LineRing(maxlen=1000), b"step %07d loss 0.5\n"
    for start in range(0, 1_000_000, 5000):
        ring.feed(STDOUT, b"".join(line % i for i in range(start, start + 5000)))
        assert ring.held_bytes <= (1000 + 5000) * len(line % 0)
    ring.feed(STDOUT, b"open")
    assert ring.tail() == [
        (line % i)[:-1] for i in range(999_000, 1_000_000)] + [b"open"]
    assert ring.total_lines == 1_000_000


def test_a_first_look_makes_only_the_lines_kept_and_they_are_the_newest():
    # Chunks waiting to be made into lines, far more lines than the ring keeps, two streams
    # interleaved, lines spanning chunks and '\r' redraws: the newest `maxlen` lines come out as
    # a ring that made every line would give, and the old chunks are never split.
    rng = random.Random(11)
    full, windowed = LineRing(maxlen=1_000_000), LineRing(maxlen=50)
    for n in range(4000):
        stream = rng.choice((STDOUT, STDERR))
        chunk = rng.choice([b"o%d" % n, b"\n", b"step %d\r" % n, b"line %d\n" % n, b"a\nb%d\nc" % n])
        full.feed(stream, chunk)
        windowed.feed(stream, chunk)
    made = []
    windowed._make = lambda stream, chunk, make=windowed._make: made.append(chunk) or make(stream, chunk)
    _, total, lines, open_lines = windowed.since(0)
    _, full_total, full_lines, full_open_lines = full.since(0)
    assert (total, lines, open_lines) == (full_total, full_lines[-50:], full_open_lines)
    assert sum(chunk.count(b"\n") for chunk in made) < 50 + 5  # only chunks that hold kept lines were split


def test_a_look_at_the_newest_lines_makes_none_of_the_rings_own():
    """A pane's first look, and an attached view's look ahead at every rank, ask for the newest
    lines: they are made aside from the chunks that hold them, as a ring that made every line
    gives them, and the ring's own output waits on as it came. Making it all kept every line of
    a rank looked at once as a Python object: `ranktop attach` to 64 quiet ranks of 10k lines
    took their engine from 72 MB to 148. A look that finds nothing new makes nothing either
    (--metric reads every rank each second)."""
    rng = random.Random(5)
    ring, made = LineRing(maxlen=1000), LineRing(maxlen=1000)
    for n in range(6000):
        stream = rng.choice((STDOUT, STDOUT, STDERR))
        chunk = rng.choice([b"o%d" % n, b"\n", b"step %d\r" % n, b"line %d\n" % n, b"a\nb%d\nc" % n,
                            b"".join(b"block %d.%d\n" % (n, k) for k in range(rng.randint(1, 300)))])
        for r in (ring, made):
            r.feed(stream, chunk)
    ring.feed(STDERR, b"\r 5%|#  |")
    made.feed(STDERR, b"\r 5%|#  |")
    made.tail()  # the lines as a ring that made every one gives them
    waiting, total = ring.held_bytes, ring.total_lines
    for seen, tail in ((0, 300), (total - 20, 300), (total, 300), (0, 1), (0, 5000), (total, None)):
        assert ring.since(seen, tail) == made.since(seen, tail)
        assert not ring.lines and ring.held_bytes == waiting  # nothing made: the chunks wait as they came
    assert ring.since(0, 300)[3][-1] == b" 5%|#  |"  # the open lines too, stderr's last
    assert ring.tail() == made.tail()


def test_a_look_that_finds_only_more_of_the_open_line_takes_it_in():
    """A pane looks at its rank at every frame. Where only more of an open line came since (a
    progress bar redrawn without a newline), the look makes it, which makes no line: read aside,
    each look read the whole bar again from where its line began, up to the byte budget."""
    ring, made = LineRing(), LineRing()
    for r in (ring, made):
        r.feed(STDOUT, b"epoch 1\n")
    seen = ring.since(0)[1]
    for n in range(200):
        for r in (ring, made):
            r.feed(STDERR, b"\r%3d%%|" % n + b"#" * 500)
        made.tail()
        assert ring.since(seen) == made.since(seen)
        assert not ring.held_bytes - ring.bytes  # taken in: nothing waits to be read again
    assert ring.since(seen)[3] == [b"199%|" + b"#" * 500]


SEPARATOR = "──── 12:03:04 restart 1 of this rank (ranktop) ────"


def test_ranktops_own_line_is_marked_out_of_band_and_a_ranks_same_bytes_are_not():
    """A restart's separator went into the ring as STDOUT bytes: a rank printing the same bytes
    made the same line. Now it is a RanktopLine, in arrival order, and the lines the old process
    left open (on either stream: a stderr one ran on into the new process's) end before it."""
    ring = LineRing()
    ring.feed(STDOUT, SEPARATOR.encode() + b"\nold out open")
    ring.feed(STDERR, b"old err open")
    ring.add_own_line(SEPARATOR)
    ring.feed(STDERR, b"new err\n")
    ring.feed(STDOUT, b"new out\n")
    lines = ring.tail()
    assert lines == [SEPARATOR.encode(), b"old out open", b"old err open", SEPARATOR.encode(), b"new err", b"new out"]
    assert [type(line) is RanktopLine for line in lines] == [False, False, False, True, False, False]
    _, total, since, open_lines = ring.since(1)
    assert total == ring.total_lines == 6 and since == lines[1:] and open_lines == []
    assert type(since[2]) is RanktopLine  # the copy a UI takes keeps the mark


def _through_a_slow_console(writes: list[tuple[str, bytes]]) -> bytes:
    """What a ConsoleWriter with a 1000-byte budget per rank shows of `writes` (rank, data) on a
    terminal (a 4 KiB pipe) that reads nothing until every write was made."""
    r, w = os.pipe()
    fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    target = open(w, "wb")
    writer = ConsoleWriter(budget=1000)
    for key, data in writes:
        writer.write(target, data, key=key)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(r, 65536), b"")))
    reader.start()  # the terminal catches up only now
    writer.close()
    target.close()
    reader.join(10)
    os.close(r)
    return b"".join(chunks)


_FLOOD = [b"A%05d" % i + b"." * 93 + b"\n" for i in range(200)]  # 100 bytes each


def _notes(shown: bytes) -> list[int]:
    return [int(n) for n in re.findall(rb"\[ranktop: console fell behind, (\d+) bytes of this stream not shown here", shown)]


def test_a_console_that_falls_behind_drops_per_rank_and_says_how_much():
    shown = _through_a_slow_console([("flood", line) for line in _FLOOD] + [("quiet", b"quiet rank's line\n")])
    assert shown.count(b"quiet rank's line\n") == 1  # the flood used its own budget, not the quiet one's
    shown_flood = [line for line in _FLOOD if line in shown]
    assert _notes(shown) and sum(_notes(shown)) + 100 * len(shown_flood) == 100 * len(_FLOOD)


def test_the_drop_note_appears_even_when_nothing_follows():
    shown = _through_a_slow_console([("flood", line) for line in _FLOOD])
    assert shown.endswith(b"bytes of this stream not shown here; see its log file]\n")
    assert sum(_notes(shown)) + 100 * sum(line in shown for line in _FLOOD) == 100 * len(_FLOOD)


def test_a_pty_is_read_until_empty_in_one_round():
    import pty
    import select
    import tty

    from conftest import polls
    from ranktop.core.output import OutputPump

    master, slave = pty.openpty()
    tty.setraw(slave)  # bytes as written: no newline translation
    os.set_blocking(slave, False)
    os.set_blocking(master, False)
    pump = OutputPump()
    try:
        written = b""
        try:
            while True:  # fill the pty: several times what one read of it hands out (4 KiB)
                written += bytes(range(256))[: os.write(slave, bytes(range(256)))]
        except BlockingIOError:
            pass
        select.select([master], [], [], 10)
        got = pump._read(master)
        assert len(got) > 4096  # more than one read's worth in one call
        for _ in polls(10, "the rest of the pty's bytes"):
            if len(got) >= len(written):
                break
            got += pump._read(master)
        assert got == written
    finally:
        pump.close(timeout=1)
        os.close(slave)
        os.close(master)


def test_a_pty_whose_writer_outpaces_the_reader_is_watched_until_the_next_round():
    # A pty holds ~12 KiB: a writer that filled it would wait out the reader's whole pause, so a
    # pty that was full at a round is watched (select) until the next; a pipe never is (once
    # polled, a pipe wakes its poller on every write), nor a pty that was not full.
    import pty
    import tty

    from ranktop.core.output import STDOUT, LineRing, OutputPump, StreamSink

    master, slave = pty.openpty()
    tty.setraw(slave)
    os.set_blocking(slave, False)
    os.set_blocking(master, False)
    pipe_r, pipe_w = os.pipe()
    os.set_blocking(pipe_r, False)
    pump = OutputPump()
    pump.close(timeout=5)  # its thread is gone: the rounds below are ours, one at a time
    ring = LineRing()
    pump._pipes = {master: (StreamSink(STDOUT, ring), True, 16 << 10), pipe_r: (StreamSink(STDOUT, ring), False, 1 << 16)}
    try:
        filled = 0
        try:
            while True:
                filled += os.write(slave, b"x" * 1024)
        except BlockingIOError:
            pass
        os.write(pipe_w, b"y" * (64 << 10))
        pump._round()
        assert pump._pressing == [master], filled
        os.write(slave, b"z" * 100)  # a trickle: nobody waits on us
        pump._round()
        assert pump._pressing == []
    finally:
        for fd in (slave, master, pipe_r, pipe_w):
            os.close(fd)


def test_the_reader_sleeps_on_descriptors_past_1023():
    # A run of many ranks has more descriptors than select() takes: a pressing pty numbered past
    # 1023 must wake the reader like any other.
    import pty
    import resource

    from ranktop.core.output import OutputPump

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1600:
        pytest.skip("the open-files limit is below 1600")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1600), hard))
    master, slave = pty.openpty()
    high = os.dup2(master, 1500)
    pump = OutputPump()
    pump.close(timeout=5)  # its thread is gone, and its own pipe with it: the sleeps below are ours
    pump._wake_r, pump._wake_w = os.pipe()
    try:
        os.write(slave, b"ready\n")
        pump._pressing = [high]
        assert pump._sleep(10) == [high]  # woken by the pty within the pause, not by our own pipe
        pump._pressing = []
        pump.wake()
        assert pump._sleep(10) == [pump._wake_r]
    finally:
        for fd in (high, slave, master, pump._wake_r, pump._wake_w):
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_reader_makes_no_rounds_while_every_pipe_is_quiet_and_reads_what_comes_then():
    # 8 sleeping ranks cost the output thread a round of reads every 0.1 s; now, once no pipe
    # has had anything for a second, it waits in poll until one has something (or ends).
    import subprocess
    import sys

    from conftest import wait_for
    from ranktop.core.output import _IDLE_SECONDS, OutputPump, StreamSink

    read_end, write_end = os.pipe()
    rank = subprocess.Popen([sys.executable, "-c", "import sys\nfor _ in range(2):\n    sys.stdin.readline()\n"
                             "    print('late line', flush=True)\nsys.stdin.readline()"],
                            stdin=subprocess.PIPE, stdout=write_end)
    os.close(write_end)
    ring = LineRing()
    sink = StreamSink(STDOUT, ring)
    pump = OutputPump()
    pump.add(read_end, sink)
    try:
        for lines in (1, 2):
            wait_for(lambda: read_end in pump._pipes and pump.polling, what="the reader asleep on the quiet pipe")
            quiet = pump.rounds
            time.sleep(5 * _IDLE_SECONDS)  # a window of five rounds, were rounds still made while nothing comes
            assert pump.rounds == quiet
            rank.stdin.write(b"go\n")
            rank.stdin.flush()
            wait_for(lambda n=lines: ring.tail() == [b"late line"] * n, what="the line written after the quiet spell")
            wait_for(lambda q=quiet: pump.rounds >= q + 2, what="rounds again, while the rank may write more")
        rank.stdin.close()
        assert rank.wait(10) == 0
        assert sink.done.wait(10)  # its end of file woke the reader too
    finally:
        rank.kill()
        rank.wait()
        pump.close()


def test_pipes_are_widened_only_within_our_share_of_the_users_budget():
    from ranktop.core.output import exempt_from_pipe_limits, pipe_budget, release_pipe, widen_pipe

    f_getpipe_sz = getattr(fcntl, "F_GETPIPE_SZ", 1032)
    pipes = [os.pipe() for _ in range(3)]
    try:
        budget = 4 * MB  # half of it for us: two 1 MiB pipes
        granted = [widen_pipe(r, budget) for r, _ in pipes]
        assert granted == [True, True, False]
        assert [fcntl.fcntl(r, f_getpipe_sz) for r, _ in pipes] == [MB, MB, 64 << 10]
        release_pipe(pipes[0][0])  # a closed pipe gives its share back
        assert widen_pipe(pipes[2][0], budget) and fcntl.fcntl(pipes[2][0], f_getpipe_sz) == MB
    finally:
        for r, w in pipes:
            release_pipe(r)
            os.close(r)
            os.close(w)
    assert (pipe_budget() is None) == exempt_from_pipe_limits()
    from conftest import ROOT

    with open("/proc/sys/fs/pipe-user-pages-soft") as f:
        pages = int(f.read())
    limited = str(pages * os.sysconf("SC_PAGE_SIZE") if pages else None)
    ask = [sys.executable, "-c", "from ranktop.core.output import pipe_budget; print(pipe_budget())"]
    # Root of a user namespace of its own (rootless podman, apptainer --fakeroot) holds every
    # capability there, and CapEff says so, but the kernel asks for them in the initial one: taken
    # as exempt, its runs widened pipes without a budget, as Docker's root did.
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-Ur", "true"], capture_output=True, timeout=60).returncode == 0:
        asked = subprocess.run([unshare, "-Ur", *ask], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert asked.stdout.strip() == limited, asked.stderr
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return
    # Root without CAP_SYS_RESOURCE and CAP_SYS_ADMIN (Docker's, a pod's) has the user's limit too:
    # taken as exempt, a 40-rank run widened pipes until the kernel refused, and root's other
    # programs (and its own last ranks) got pipes of two pages.
    drop = "-sys_resource,-sys_admin"
    asked = subprocess.run(["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", *ask],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert asked.stdout.strip() == limited, asked.stderr


def test_a_console_that_is_a_local_file_is_written_at_once_even_while_a_terminal_is_stuck():
    """A batch job's output file on a local filesystem (or /dev/null) never waits on a reader, so
    its writes are not queued behind a terminal that stopped reading (ctrl-S, a stalled SSH
    session). A file on any other filesystem (here /proc; NFS or Lustre in life) may stall: it
    goes through the console thread like a terminal."""
    import tempfile

    from ranktop.core.output import _never_blocks, filesystem_type

    if not os.path.isdir("/dev/shm") or filesystem_type(os.stat("/dev/shm").st_dev) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm for a local file")
    r, w = os.pipe()
    fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    stuck = open(w, "wb")
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as out_file, open(os.devnull, "wb") as null, \
            open("/proc/self/status", "rb") as proc_file:
        assert filesystem_type(os.fstat(proc_file.fileno()).st_dev) == "proc"
        assert [_never_blocks(f) for f in (out_file, null, stuck, proc_file)] == [True, True, False, False]
        writer = ConsoleWriter()
        writer.write(stuck, b"t" * 65536, key="terminal")  # the console thread now waits on the pipe
        writer.write(out_file, (b"[r1]:", b"step 1\n"), key="file")
        writer.write(null, b"gone\n", key="file")
        with open(out_file.name, "rb") as shown_in_file:
            assert shown_in_file.read() == b"[r1]:step 1\n"  # already there: no wait
        shown: list[bytes] = []
        reader = threading.Thread(target=lambda: shown.extend(iter(lambda: os.read(r, 65536), b"")))
        reader.start()  # the terminal reads again: the thread finishes its write and ends
        writer.close()
        stuck.close()
        reader.join(10)
        os.close(r)
    assert b"".join(shown) == b"t" * 65536


def test_the_console_tee_of_an_endless_line_holds_little_and_loses_nothing():
    import io

    from ranktop.core.output import StreamSink

    console = io.BytesIO()
    writer = ConsoleWriter()
    sink = StreamSink(STDOUT, LineRing(), (writer, console, b"[r0]:"))
    piece = b"a" * (64 << 10)
    for _ in range(160):  # a 10 MB line, no newline yet
        sink.feed(piece)
        assert sink._console_open_bytes <= LINE_CAP + len(piece)
    sink.feed(b"b\nnext\nopen")
    sink.finish()
    writer.close()
    assert console.getvalue() == b"[r0]:" + piece * 160 + b"b\n[r0]:next\n[r0]:open\n"


def test_two_ranks_open_lines_that_cut_each_other_keep_their_prefixes():
    """Two ranks each leave a line open (two `(Pdb) ` prompts, two lines past 64 KiB shown as
    they come), in turns: the rest of the first one's line went on the second one's, without
    its prefix (`[r1]:r1 asks r0 goes on`), where it must start a line of its own."""
    import io

    from ranktop.core.output import StreamSink

    console = io.BytesIO()
    writer = ConsoleWriter()
    sinks = [StreamSink(STDOUT, LineRing(), (writer, console, b"[r%d]:" % rank)) for rank in (0, 1)]
    for rank, sink in enumerate(sinks):  # a prompt each, shown once left PROMPT_SECONDS
        sink.feed(b"r%d asks " % rank)
        sink.show_held_if_quiet(time.monotonic() + 1)
    long = b"x" * (LINE_CAP + 1)  # past what is held: shown as it comes
    for rank, sink in enumerate(sinks):
        sink.feed(b"r%d goes on " % rank + long)
    for rank, sink in enumerate(sinks):
        sink.feed(b" r%d ends\n" % rank)
    writer.close()
    assert console.getvalue() == (b"[r0]:r0 asks \n[r1]:r1 asks \n[r0]:r0 goes on " + long + b"\n[r1]:r1 goes on "
                                  + long + b"\n[r0]: r0 ends\n[r1]: r1 ends\n")


def _tee_model(text: bytes, prefix: bytes) -> bytes:
    """What the console should show of `text` (every line shorter than LINE_CAP): each line
    prefixed, '\\r' collapsed to its last state, the unfinished last line ended at the finish."""
    lines = text.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return b"".join(prefix + collapse_cr(line) + b"\n" for line in lines)


def test_the_console_tee_and_the_line_count_do_not_depend_on_how_the_bytes_are_chunked():
    import io

    from ranktop.core.output import StreamSink

    rng = random.Random(11)
    pieces = [b"step 12 loss 0.5\n", b"ab", b"\n", b"\r", b"x" * 300, b"\n\n", b"tail\r\n", b"\xff\x00"]
    for prefix in (b"[default3]:", b""):
        for trial in range(30):
            text = b"".join(rng.choice(pieces[:3] if trial % 3 == 0 else pieces) for _ in range(400))
            console, writer, ring = io.BytesIO(), ConsoleWriter(), LineRing(maxlen=100_000)
            sink = StreamSink(STDOUT, ring, (writer, console, prefix))
            pos = 0
            while pos < len(text):
                step = rng.choice([1, 7, 64, 2000, 1 << 14])
                sink.feed(text[pos : pos + step])
                pos += step
            sink.finish()
            writer.close()
            assert console.getvalue() == _tee_model(text, prefix), (prefix, trial)
            *complete, open_line = text.split(b"\n")
            assert ring.total_lines == len(complete)  # counted by the tee's replace or by the ring
            shown_open = [collapse_cr(open_line)] if collapse_cr(open_line) else []
            assert ring.tail() == [collapse_cr(line) for line in complete] + shown_open


def test_rounds_come_fast_only_while_a_pipe_fills_fast():
    from ranktop.core.output import _IDLE_SECONDS, _PRESSING, _ROUND_SECONDS, next_pause

    pause, pauses = 0.0, []
    for _ in range(6):  # a trickle: every round finds a little, far from filling a pipe
        pause = next_pause(pause, _PRESSING / 10, busy=0.0)
        pauses.append(pause)
    assert pauses[0] == _ROUND_SECONDS and pauses == sorted(pauses) and pauses[-1] == _IDLE_SECONDS
    # a pipe a quarter full (or an end of file): back to the fast pace at once, less the round's own time
    assert next_pause(_IDLE_SECONDS, _PRESSING, busy=0.001) == _ROUND_SECONDS - 0.001
    assert next_pause(_IDLE_SECONDS, 1.0, busy=1.0) == 0.0
    assert next_pause(_IDLE_SECONDS, 0.0, busy=0.0) == _IDLE_SECONDS  # idle stays at the longest pause


def test_a_chunk_that_cannot_be_handled_leaves_the_pipe_drained_and_the_log_whole(tmp_path):
    # Handling a chunk raised (here the ring runs out of memory on its second chunk): the sink
    # says so once and keeps only its log file; the reader thread lives on, so the rank, which
    # writes 4 MB through a 64 KiB pipe, is never left blocked, and its log has every byte.
    import subprocess
    import sys

    from ranktop.core.output import OutputPump, StreamSink

    class RingOutOfMemory(LineRing):
        chunks = 0

        def feed(self, stream, chunk, newlines=None):
            self.chunks += 1
            if self.chunks == 2:
                raise MemoryError("no room for the ring")
            super().feed(stream, chunk, newlines)

    log_path = tmp_path / "stdout.log"
    failures: list[tuple[str, bool, float]] = []
    sink = StreamSink(STDOUT, RingOutOfMemory(), log=(str(log_path), lambda: os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o600)),
                      on_failure=lambda s: failures.append((s.failure, s.saving, time.time())))
    read_end, write_end = os.pipe()
    rank = subprocess.Popen([sys.executable, "-c", "import os\nfor i in range(40000): os.write(1, b'%099d\\n' % i)"],
                            stdout=write_end)
    os.close(write_end)
    pump = OutputPump()
    pump.add(read_end, sink)
    try:
        assert rank.wait(timeout=10) == 0  # not blocked on its pipe
        assert sink.done.wait(10)
        assert pump._thread.is_alive()
    finally:
        rank.kill()
        rank.wait()
        pump.close()
    [(failure, saving, failed_at)] = failures
    assert (failure, saving) == ("MemoryError: no room for the ring", True)
    assert "in feed" in sink.failure_trace  # where it raised, for the events log
    assert log_path.read_bytes() == b"".join(b"%099d\n" % i for i in range(40000))
    # 4 MB through a pipe of at most 1 MiB took more reads after the failure: the rank still
    # counts as writing (no false stall), though the ring keeps nothing more
    assert sink.ring.last_output_at >= failed_at and sink.ring.chunks == 2


def test_newlines_are_counted_as_bytes_count_would():
    from ranktop.core.output import count_newlines

    rng = random.Random(5)
    samples = [b"", b"\n", b"no newline", b"\n\n\r\n", b"\xff\n\x00" * 1000]
    samples += [bytes(rng.choice(b"ab\n\r\x00") for _ in range(rng.randint(0, 3000))) for _ in range(200)]
    assert [count_newlines(s) for s in samples] == [s.count(b"\n") for s in samples]


def test_many_ranks_share_a_bounded_console_budget():
    # 64 ranks flooding a terminal that reads nothing: what waits for it stays within the total
    # (each rank gets its share, 2 MiB), every rank's overflow becomes its own note, and the
    # terminal, once it reads again, gets each rank's first 2 MiB (less what each write costs
    # besides its bytes) and then that note.
    from ranktop.core.output import _ITEM_COST, CONSOLE_TOTAL, console_budget

    assert [console_budget(n) for n in (1, 8, 64, 1000)] == [16 << 20, 16 << 20, 2 << 20, 1 << 20]
    r, w = os.pipe()
    stuck = open(w, "wb")
    writer = ConsoleWriter(budget=console_budget(64))
    piece = b"x" * (64 << 10)
    for rank in range(64):
        for _ in range(48):  # 3 MiB each
            writer.write(stuck, piece, key=rank)
    assert sum(writer._pending.values()) <= CONSOLE_TOTAL
    shown: list[bytes] = []
    reader = threading.Thread(target=lambda: shown.extend(iter(lambda: os.read(r, 1 << 20), b"")))
    reader.start()
    writer.close()
    stuck.close()
    reader.join(60)
    os.close(r)
    shown_bytes = b"".join(shown)
    fits = (2 << 20) // (len(piece) + _ITEM_COST)  # each queued write also costs a little besides its bytes
    assert _notes(shown_bytes) == [(48 - fits) * len(piece)] * 64
    assert shown_bytes.count(b"x") == 64 * fits * len(piece)


def test_tiny_writes_alternating_between_the_streams_hold_bounded_memory():
    """Alternating streams cannot be gathered into blocks: 1-byte chunks each cost ~100 bytes of
    objects that the byte budget does not count, so 8 MiB of them used to hold ~1 GB."""
    import tracemalloc

    ring = LineRing()
    tracemalloc.start()
    try:
        for _ in range(40_000):
            ring.feed(STDOUT, b"a", 0)
            ring.feed(STDERR, b"b", 0)
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 2 << 20  # 80k chunks kept would be ~7 MB
    ring.feed(STDOUT, b"!\n")
    assert ring.tail() == [b"a" * 40_000 + b"!", b"b" * 40_000]  # nothing else lost


def test_tiny_writes_to_a_stuck_console_are_bounded_in_number_as_well_as_bytes():
    """Each queued write costs a tuple and a queue slot besides its bytes: a stream of 1-byte
    writes to a stuck console used to queue 16 million of them (~2 GB) within its 16 MiB."""
    r, w = os.pipe()  # 64 KiB: ~64k 1-byte writes fill it, the rest wait
    stuck = open(w, "wb", buffering=0)  # noqa: SIM115 (closed below)
    writer = ConsoleWriter(budget=1 << 20)
    try:
        for _ in range(100_000):
            writer.write(stuck, b"y", key=0, line_open=True)
        assert 0 < writer.waiting() < (1 << 20) // 128  # not the ~35k writes beyond what the pipe took
    finally:
        os.close(r)  # the blocked write fails: the writer gives the console up
        writer.close(stall=1.0)
        stuck.close()
