"""Every bench starts ranktop as an installed copy starts: from compiled bytecode.

pip compiles a package when it installs it. An editable checkout run with
PYTHONDONTWRITEBYTECODE=1 (as on our dev boxes) never writes a .pyc, so every start compiled
ranktop's ~60 modules again: about 0.3 s of CPU before the first rank, which the benches used to
count as ranktop's own start-up."""

from __future__ import annotations

import argparse
import compileall
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compile_ranktop() -> None:
    for package in ("ranktop", "core", "tui"):
        compileall.compile_dir(ROOT / package, quiet=1)


def installed_python(into: str, source: str | Path = ROOT) -> str:
    """A Python that runs ranktop as `pip install ranktop` leaves it, made under `into`: a venv
    holding a built copy of ranktop from `source` (a checkout; this one by default), compiled,
    with this interpreter's site-packages on its path for the dependencies. The .pth files there
    are not run in it, so an editable checkout's finder (which imports pathlib, urllib and
    ipaddress at every start, ~25 ms) is not paid for."""
    venv.create(into, with_pip=False)
    python = os.path.join(into, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", site, str(Path(source).resolve())], check=True, cwd=into)
    compileall.compile_dir(os.path.join(site, "ranktop"), quiet=1)
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def add_installed_option(parser: argparse.ArgumentParser) -> None:
    """`--installed [SOURCE]`: ranktop from a copy installed in a venv of its own (installed_python),
    built from this checkout, or from SOURCE: another checkout, or a wheel for a host that cannot
    build one (no network, an old setuptools), as `pip wheel --no-deps .` makes it."""
    parser.add_argument("--installed", nargs="?", const=str(ROOT), default=None, metavar="SOURCE",
                        help="run ranktop as `pip install` leaves it (a venv of its own), built from this "
                             "checkout or from SOURCE (a checkout or a built wheel), not the editable checkout")


def ranktop_python(into: str, source: str | None) -> list[str]:
    """How a bench starts ranktop: `PYTHON -m ranktop` with what this returns as PYTHON. With a
    source, an installed copy's Python and -P, so that the checkout's ranktop/ in the working
    directory does not shadow that copy; else this interpreter (an editable checkout)."""
    return [installed_python(into, source), "-P"] if source else [sys.executable]
