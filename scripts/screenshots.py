"""Make the README's screenshots from the app's own SVG export, then PNGs with cairosvg.

    python scripts/screenshots.py [--out screenshots]

Runs examples/demo_train.py under the real app (real ranks, fake NVML via RANKTOP_FAKE_GPUS=4 so
the GPU columns show) and writes <name>.svg and <name>.png for: 4 ranks training, a failed rank
with its root cause, a zoomed pane with a search, 16 ranks, 8 ranks with a --metric column and a
straggler, a zoomed rank with sparklines, a restarted rank's separator, an 80x24 terminal, a rank's
details view, and lines selected with V. `--png-of SVG` renders one SVG made elsewhere (the
real-GPU picture comes from scripts/gpu_check.py on a GPU machine). PNGs need the Fira Code font
(Debian: apt-get install fonts-firacode) for cairosvg to render the SVG's font-family.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from ranktop.core.agent import LocalAgent
from ranktop.core.engine import LocalEngine
from ranktop.core.spec import WorkerSpec
from ranktop.core.stats import StatsSampler
from ranktop.tui.app import RanktopApp
from ranktop.tui.metric import compile_metric

ROOT = Path(__file__).resolve().parent.parent

DEMO = str(ROOT / "examples" / "demo_train.py")
SIZE = (160, 48)
LOSS = compile_metric(r"loss ([0-9.]+)")

Scene = Callable[[RanktopApp, object], Awaitable[None]]


async def until(pilot, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("scene did not reach its state")
        await pilot.pause(0.05)


def lines_of(app: RanktopApp, local_rank: int) -> int:
    return len(app.engine.agent.output(local_rank))


async def training(app, pilot) -> None:
    await until(pilot, lambda: all(lines_of(app, r) > 30 for r in range(4)))
    await pilot.pause(1.2)  # one more stats sample so cpu% is a steady figure


async def failed(app, pilot) -> None:
    await until(pilot, lambda: app.main is not None and app.main.ended)
    await pilot.pause(0.3)


async def zoom_search(app, pilot) -> None:
    await until(pilot, lambda: any(b"warning" in line for line in app.engine.agent.output(1)) and lines_of(app, 1) > 60)
    await pilot.press("1", "z", "slash", *"warning", "enter")
    await pilot.pause(0.5)


async def sixteen(app, pilot) -> None:
    await until(pilot, lambda: all(lines_of(app, r) > 15 for r in range(16)), timeout=60)
    await pilot.pause(1.2)


async def metric_lens(app, pilot) -> None:
    await until(pilot, lambda: all(lines_of(app, r) > 25 for r in range(8)), timeout=60)
    await pilot.pause(2.5)  # a few output-rate samples, so the straggler stands out


async def sparklines(app, pilot) -> None:
    await until(pilot, lambda: lines_of(app, 0) > 40, timeout=60)
    await pilot.press("0", "z")
    await pilot.pause(6.0)  # the sparklines fill from the samples taken while zoomed


async def restart_separator(app, pilot) -> None:
    await until(pilot, lambda: lines_of(app, 1) > 20)
    await pilot.press("1", "r", "r")  # the second press confirms
    await until(pilot, lambda: any(b"restart 1 of this rank" in line for line in app.engine.agent.output(1)))
    await until(pilot, lambda: lines_of(app, 1) > 8)
    await pilot.press("z")
    await pilot.pause(1.0)


async def details(app, pilot) -> None:
    await until(pilot, lambda: lines_of(app, 2) > 40, timeout=60)
    await pilot.press("2", "m")
    await pilot.pause(8.0)  # the histories fill, a sample a second


async def selection(app, pilot) -> None:
    await until(pilot, lambda: lines_of(app, 1) > 40, timeout=60)
    await pilot.press("1", "z", "V", *["up"] * 4)
    await pilot.pause(0.3)


SCENES: list[tuple[str, int, tuple[str, ...], Scene, dict]] = [
    ("training-4-ranks", 4, ("--rate", "12"), training, {}),
    ("failed-rank-root-cause", 4, ("--rate", "25", "--fail-rank", "2", "--fail-step", "40"), failed, {}),
    ("zoomed-pane-search", 4, ("--rate", "25"), zoom_search, {}),
    ("sixteen-ranks", 16, ("--rate", "8"), sixteen, {}),
    ("metric-straggler", 8, ("--rate", "10", "--slow-rank", "5"), metric_lens, {"metric": LOSS}),
    ("zoomed-sparklines", 4, ("--rate", "10"), sparklines, {"metric": LOSS}),
    ("restart-separator", 2, ("--rate", "12"), restart_separator, {}),
    ("small-80x24", 4, ("--rate", "12"), training, {"size": (80, 24)}),
    ("rank-details", 4, ("--rate", "10", "--slow-rank", "2"), details, {"metric": LOSS}),
    ("line-selection", 4, ("--rate", "2"), selection, {}),
]


def shoot(name: str, nproc: int, args: tuple[str, ...], scene: Scene, out: Path, log_root: str,
          metric=None, size: tuple[int, int] = SIZE, script: str = DEMO) -> Path:
    """Run `script` (the demo) under the real app in a terminal of `size`, play `scene`, save the
    SVG. The GPU columns are NVML's, or the fake's where RANKTOP_FAKE_GPUS is set."""
    spec = WorkerSpec(role="default", local_world_size=nproc, entrypoint=sys.executable,
                      args=("-u", script, *args), name=os.path.basename(script), max_restarts=0)
    sampler = StatsSampler(interval=0.5)
    agent = LocalAgent(spec, log_dir=log_root, console=False, color=True, shutdown_timeout=3.0,
                       stall_timeout=60.0, sampler=sampler)
    engine = LocalEngine(agent)
    sampler.attach(engine)
    app = RanktopApp(engine, metric=metric)
    svg = out / f"{name}.svg"

    async def run() -> None:
        engine.start()
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.main is not None and app.main.is_mounted)
            await scene(app, pilot)
            svg.write_text(app.export_screenshot(title=f"ranktop · {name}"))

    try:
        asyncio.run(run())
    finally:
        engine.close()
        sampler.close()
    return svg


def to_png(svg: Path) -> Path:
    import cairosvg

    png = svg.with_suffix(".png")
    cairosvg.svg2png(url=str(svg), write_to=str(png), output_width=1600)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "screenshots"))
    # a name no scene has is refused: it retook nothing, said nothing and exited 0
    parser.add_argument("--only", default=None, choices=[scene[0] for scene in SCENES], metavar="NAME",
                        help="retake this scene only: %(choices)s")
    parser.add_argument("--png-of", metavar="SVG", help="only copy this SVG (one made elsewhere, such as "
                        "scripts/gpu_check.py's real-gpu.svg) into --out and render its PNG")
    ns = parser.parse_args(argv)
    os.environ.setdefault("RANKTOP_FAKE_GPUS", "4")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    if ns.png_of:
        svg = out / Path(ns.png_of).name
        if svg.resolve() != Path(ns.png_of).resolve():
            shutil.copyfile(ns.png_of, svg)
        print(f"wrote {to_png(svg)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="ranktop-shots-") as logs:
        for name, nproc, args, scene, options in SCENES:
            if ns.only and ns.only != name:
                continue
            png = to_png(shoot(name, nproc, args, scene, out, logs, **options))
            print(f"wrote {png.relative_to(ROOT) if png.is_relative_to(ROOT) else png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
