"""--metric: a number from each rank's output in the titles and the rank list, outliers marked,
and the sparklines of the zoomed title (tui/metric.py)."""

from __future__ import annotations

import re
import time

import pytest
from conftest import until
from fake_engine import FakeEngine
from ranktop.tui.metric import BadMetric, RankTrack, Tracker, compile_metric, metric_name, sparkline
from test_tui_app import notes
from test_tui_fake import drive

pytestmark = pytest.mark.timeout(60)


def test_metric_names_and_bad_expressions():
    assert metric_name(re.compile(r"loss ([0-9.]+)")) == "loss"
    assert metric_name(re.compile(r"train loss=([0-9.]+)")) == "train loss"
    assert metric_name(re.compile(r"(?P<acc>[0-9.]+)%")) == "acc"
    assert metric_name(re.compile(r"([0-9.]+) it/s")) == "metric"
    with pytest.raises(BadMetric, match=r"bad --metric 'loss \(\[': unterminated character set"):
        compile_metric("loss ([")
    # The regex package writes a repeat out as often as its least count: 275 MB and 0.4 s for this
    # one, and `a{4294967294}` (re takes it) ran the box out of memory.
    with pytest.raises(BadMetric, match=r"too large to compile: over 100,000 items with its repeats written out"):
        compile_metric("(?:a{1000}){1000}")


def test_sparkline_scales_between_its_own_extremes():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([5, 5, 5]) == "▁▁▁"
    assert sparkline(list(range(100)), width=4) == sparkline([96, 97, 98, 99]) == "▁▃▆█"  # the last 4
    assert sparkline([]) == ""
    # Values far apart (`loss 1e308`, then `loss -1e308`): their span is past the largest float,
    # and a NaN bar's ValueError ended the TUI, zoomed or in m's details.
    assert sparkline([1e308, -1e308, 0.0, -1.7976931348623157e308, 1.7976931348623157e308]) == "▇▂▅▁█"


def test_last_match_per_rank_and_the_outlier():
    engine = FakeEngine(4)
    for r in range(4):
        engine.print(r, f"step 1 loss {0.9 + r * 0.01:.2f}", f"step 2 loss {0.5 + r * 0.01:.2f}", "eval done")
    engine.print(2, "step 2 loss 7.25")  # rank 2 diverges
    tracker = Tracker(engine, compile_metric(r"loss ([0-9.]+)"))
    assert tracker.update(engine.snapshot(), now=100.0)
    assert [tracker.ranks[r].value for r in range(4)] == ["0.50", "0.51", "7.25", "0.53"]
    assert tracker.outliers() == {2}
    assert tracker.title_part(2).startswith("loss 7.25 ")
    assert not tracker.update(engine.snapshot(), now=100.5)  # at most once a second
    engine.print(0, "step 3 loss 0.40", "step 4 loss 0.30")
    assert tracker.update(engine.snapshot(), now=101.0)
    assert tracker.ranks[0].value == "0.30" and tracker.ranks[0].rate == 2.0  # two lines in that second


def test_the_value_is_read_from_the_line_as_the_pane_shows_it():
    """The ranks get FORCE_COLOR, and Rich's log handler colours numbers: such a value gave none.
    A value inside an escape sequence the pane drops (a title) was read where the pane shows none."""
    engine = FakeEngine(3)
    engine.print(0, "step 1 loss \x1b[1;36m0.50\x1b[0m")
    engine.print(1, "\x1b]0;loss 9.99\x07step 1 loss 0.40")
    engine.print(2, "step 1 loss \x1b]0;9.99\x07\x1b[2K0.30")
    tracker = Tracker(engine, compile_metric(r"loss ([0-9.]+)"))
    assert tracker.update(engine.snapshot(), now=100.0)
    assert [tracker.ranks[r].value for r in range(3)] == ["0.50", "0.40", "0.30"]


def test_ranktops_own_lines_are_no_metric_and_no_search_match():
    """A restart's separator is ranktop's line, not output: `--metric 'restart ([0-9]+)'` read it as
    the rank's value, and ctrl+f counted it as the rank's match."""
    from ranktop.core.output import RanktopLine
    from ranktop.tui.search_all import RankSearch

    engine = FakeEngine(2)
    engine.print(0, "restart 7 of the data loader")
    engine.lines[0].append(RanktopLine("──── 12:03:04 restart 1 of this rank (ranktop) ────".encode()))
    engine.lines[1].append(RanktopLine("──── 12:03:04 restart 1 of this rank (ranktop) ────".encode()))
    tracker = Tracker(engine, compile_metric(r"restart ([0-9]+)"))
    assert tracker.update(engine.snapshot(), now=100.0)
    assert [tracker.ranks[r].value for r in range(2)] == ["7", None]
    assert RankSearch.run(engine, range(2), "restart").counts == {0: 1}
    assert RankSearch.run(engine, range(2), "re:restart [0-9]").counts == {0: 1}


def test_the_rank_list_drops_its_last_columns_so_the_metric_and_hits_show_in_a_narrow_list():
    """At 80 columns with --metric and a search of every rank the list's rows were cut at their
    end: the metric's value and its outlier `!` were what went. Now the output's age, then cpu,
    give way first."""
    from conftest import screen_rows
    from ranktop.tui.panes import list_columns

    assert list_columns(0, hits=True, metric=True) == {"metric", "hits", "cpu", "age"}  # not laid out: all
    assert list_columns(13, hits=False, metric=False) == {"cpu", "age"}
    assert list_columns(22, hits=True, metric=True) == {"metric", "hits", "cpu"}
    assert list_columns(11, hits=True, metric=True) == {"metric"}
    engine = FakeEngine(32)
    for r in range(32):
        engine.print(r, f"loss {1.0 + (r == 5) * 9:.3f}")

    async def body(app, pilot):
        listing = app.main.query_one("#rank-list")
        await until(pilot, lambda: "10.000!" in listing.plain, what="the outlier in the list")
        await pilot.press("ctrl+f", *"loss", "enter")
        await until(pilot, lambda: app.main.everywhere is not None, what="the search of every rank")
        row = re.compile(r"^ +5 running +1 +10\.000!")  # rank 5: its hit and its marked value, whole
        await until(pilot, lambda: any(row.search(line) for line in screen_rows(app)), what="rank 5's row whole")

    drive(engine, body, size=(80, 40), metric=compile_metric(r"loss ([0-9.]+)"))

def test_metric_in_titles_list_and_zoomed_sparklines():
    engine = FakeEngine(32)
    for r in range(32):
        engine.print(r, f"loss {1.0 + (r == 5) * 9:.3f}")

    async def body(app, pilot):
        main = app.main
        await until(pilot, lambda: "10.000!" in main.query_one("#rank-list").plain, what="outlier in the list")
        await pilot.press("5")
        await until(pilot, lambda: "loss 10.000" in main.pane(5).title and " !" in main.pane(5).title,
                    what="the outlier's title")
        history = main.tracker.ranks[5].history["metric"]
        engine.print(5, "loss 2.000")  # taken at the next read, once a second
        await until(pilot, lambda: len(history) >= 2 and history[-1] == 2.0, what="a second sample")
        await pilot.press("z")
        await until(pilot, lambda: "loss ▇" in main.pane(5).title or "loss █" in main.pane(5).title,
                    what="the metric's sparkline when zoomed")

    drive(engine, body, metric=compile_metric(r"loss ([0-9.]+)"))


def test_a_value_that_is_no_finite_number_or_a_group_left_out_of_a_match_ends_nothing():
    """A rank's `loss 1e999` (infinity) or `loss nan` went into the metric's history: the
    sparkline it scaled, zoomed or in the details view, raised a ValueError that ended the TUI,
    and the run with it. A --metric whose group took no part in a match (`acc` for `loss
    (\\S+)|acc`) made the value None: a TypeError at the next read, the same end."""
    from ranktop.tui.details import RankDetails

    engine = FakeEngine(3)
    engine.print(0, "loss 1.5")
    engine.print(1, "loss 2.0", "acc")  # the group is not in the newest match: the line before counts
    engine.print(2, "loss 1.0")

    async def body(app, pilot):
        main = app.main
        history = lambda: main.tracker.ranks[0].history["metric"]  # noqa: E731
        await until(pilot, lambda: 0 in main.tracker.ranks and len(history()) >= 1, what="a first sample")
        assert "loss 2.0 " in main.pane(1).title
        engine.print(0, "loss 1e999")
        await until(pilot, lambda: "loss 1e999 " in main.pane(0).title, what="the infinite value in the title")
        await pilot.press("0", "z")  # the zoomed title draws the histories' sparklines
        engine.print(0, "loss nan")
        await until(pilot, lambda: "loss nan " in main.pane(0).title, what="NaN in the title")
        await until(pilot, lambda: " !" in main.pane(0).title, what="NaN marked as the odd one out")
        await pilot.press("m")
        await until(pilot, lambda: isinstance(app.screen, RankDetails), what="the details view")
        await until(pilot, lambda: "loss" in str(app.screen.query_one("#details-text").render()), what="its histories")
        out = main.tracker.ranks[0].history["out"]  # (one sample a second, whatever the metric reads)
        taken = len(out)
        await until(pilot, lambda: len(out) > taken, what="a sample taken with NaN read")
        assert app.is_running and set(history()) == {1.5}  # what is no finite number is not a sample

    drive(engine, body, metric=compile_metric(r"loss (\S+)|acc"))


@pytest.mark.parametrize("size", [(160, 48), (120, 30), (80, 24)])
def test_the_zoomed_title_keeps_the_log_files_name_in_view(size):
    """Zoomed, the sparklines took the whole title: below about 200 columns its `log …/stdout.log`
    was cut off entirely. They shorten, then the labels go, so the log file's name stays."""
    from conftest import screen_rows

    engine = FakeEngine(2)
    log = "/home/someone/experiments/logs/job-2026-11-26/attempt_0/0/stdout.log"
    engine.set_rank(0, cpu_percent=12.0, rss=300 << 20, stdout_log=log)
    width = size[0]

    async def body(app, pilot):
        main = app.main
        await pilot.press("z")
        for step in range(1, 3):  # a sample a second: the sparklines need two
            engine.print(0, f"loss {2.0 - step / 4:.3f}")
            await until(pilot, lambda n=step: len(main.tracker.ranks[0].history["metric"]) >= n, what="a sample")
        await until(pilot, lambda: screen_rows(app)[1].rstrip().endswith("/0/stdout.log"), what="the log's name")
        title = screen_rows(app)[1].rstrip()
        assert "loss 1.500" in title and "running" in title, title
        if width >= 120:  # room for the metric's sparkline too
            assert re.search("loss [▁▂▃▄▅▆▇█]{2}", title), title
        if width >= 160:
            assert re.search("cpu [▁▂▃▄▅▆▇█]{2}", title) and "/attempt_0/0/stdout.log" in title, title

    drive(engine, body, size=size, metric=compile_metric(r"loss ([0-9.]+)"))


def test_the_details_view_names_the_ranks_gpu_its_own_memory_and_the_devices():
    """SPEC 2.6 shows per rank the GPU's index, utilisation, memory used/total and the rank's own
    memory; the pane's title has room for the rank's own over the total only, and the details view
    said nothing of the device's use."""
    from ranktop.core.state import GpuSample
    from ranktop.tui.details import details_text

    engine = FakeEngine(2)
    engine.set_rank(0, gpu=GpuSample(index=3, util_percent=55.0, mem_used=30 << 30, mem_total=80 << 30,
                                     proc_mem=3 << 29))
    snap = engine.snapshot()
    text = details_text(snap.ranks[0], snap, None, time.time(), width=80).plain
    assert "\ngpu3  util 55%  this rank 1.5G  device 30.0G of 80.0G used\n" in text, text
    engine.set_rank(0, gpu=GpuSample(index=3))  # known device, no sample read yet
    snap = engine.snapshot()
    assert "\ngpu3  util -  this rank -  device - of - used\n" in details_text(snap.ranks[0], snap, None, time.time()).plain
    assert "gpu1 " not in details_text(snap.ranks[1], snap, None, time.time()).plain  # no GPU known: no line


def test_the_details_view_shows_who_the_rank_is_and_its_histories():
    from ranktop.tui.details import RankDetails, details_text

    engine = FakeEngine(2)
    engine.set_rank(1, cpu_percent=50.0, rss=200 << 20, stdout_log="/logs/r/attempt_0/1/stdout.log")

    async def body(app, pilot):
        await pilot.press("1", "m")
        await until(pilot, lambda: isinstance(app.screen, RankDetails), what="the details view")
        shown = lambda: str(app.screen.query_one("#details-text").render())  # noqa: E731
        await until(pilot, lambda: "memory" in shown() and "now" in shown(), what="the histories")
        text = shown()
        assert "rank 1" in text and "pid 1001" in text and "running" in text
        assert "/logs/r/attempt_0/1/stdout.log" in text and "now      50%" in text and "now     200M" in text
        for _ in range(3):  # output while the view is open: its rate is measured for this rank
            engine.print(1, "a", "b", "c", "d")
            await pilot.pause(1.1)
        await until(pilot, lambda: "/s" in shown().split("\noutput ", 1)[1].split("\n")[0], what="an output rate")
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main, what="closed")

    drive(engine, body, size=(80, 24))
    # The text itself, without a screen: one line per series, the metric named by its expression.
    track = RankTrack()
    for v in (1.0, 0.5, 0.25):
        track.history["metric"].append(v)
    text = details_text(engine.snapshot().ranks[0], engine.snapshot(), track, time.time(), width=80,
                        metric_name="loss").plain
    assert "loss" in text and "now     0.25  min     0.25  max        1" in text and "cpu         no samples" in text


@pytest.mark.timeout(20)  # (without the time limit the first read never came back)
def test_a_metric_that_backtracks_without_end_is_given_up_and_the_tui_goes_on():
    """`--metric 'loss ((\\d)+)+x'` on a rank's `loss 111…` (5,000 digits) backtracked without end in
    re, which held the GIL: the TUI froze, and the engine's output thread with it. The match is
    given up after 250 ms: the screen says so once, the values shown stay the last ones read, and
    the output rates and the keys go on."""
    engine = FakeEngine(3)
    engine.print(0, "loss 12x")
    engine.print(1, "loss " + "1" * 5000)
    stopped = ("the --metric pattern 'loss ((\\d)+)+x' took over 250 ms on one line of rank 1: stopped "
               "(no more values read)")

    async def body(app, pilot):
        main = app.main
        await until(pilot, lambda: stopped in notes(app), timeout=5, what="the note on the pattern given up")
        assert "loss 12 " in main.pane(0).title
        read = main.tracker.ranks[0].cursor.line
        engine.print(0, "loss 34x")
        await pilot.press("2")
        await until(pilot, lambda: main.current == 2, timeout=5, what="the key after it")
        await until(pilot, lambda: main.tracker.ranks[0].cursor.line > read, what="the next read")
        assert main.tracker.ranks[0].value == "12" and main.tracker.ranks[0].rate > 0
        assert notes(app).count("--metric pattern") == 1

    drive(engine, body, metric=compile_metric(r"loss ((\d)+)+x"))
