"""--metric: a number from each rank's output in the titles and the rank list, outliers marked,
and the sparklines of the zoomed title (tui/metric.py)."""

from __future__ import annotations

import re

import pytest
from conftest import until
from fake_engine import FakeEngine
from ranktop.tui.metric import BadMetric, Tracker, compile_metric, metric_name, sparkline
from test_tui_fake import drive

pytestmark = pytest.mark.timeout(60)


def test_metric_names_and_bad_expressions():
    assert metric_name(re.compile(r"loss ([0-9.]+)")) == "loss"
    assert metric_name(re.compile(r"train loss=([0-9.]+)")) == "train loss"
    assert metric_name(re.compile(r"(?P<acc>[0-9.]+)%")) == "acc"
    assert metric_name(re.compile(r"([0-9.]+) it/s")) == "metric"
    with pytest.raises(BadMetric, match=r"bad --metric 'loss \(\[': unterminated character set"):
        compile_metric("loss ([")


def test_sparkline_scales_between_its_own_extremes():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([5, 5, 5]) == "▁▁▁"
    assert sparkline(list(range(100)), width=4) == sparkline([96, 97, 98, 99]) == "▁▃▆█"  # the last 4
    assert sparkline([]) == ""


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
