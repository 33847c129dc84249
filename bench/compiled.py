"""Every bench starts ranktop as an installed copy starts: from compiled bytecode.

pip compiles a package when it installs it. An editable checkout run with
PYTHONDONTWRITEBYTECODE=1 (as on our dev boxes) never writes a .pyc, so every start compiled
ranktop's ~60 modules again: about 0.3 s of CPU before the first rank, which the benches used to
count as ranktop's own start-up."""

from __future__ import annotations

import compileall
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compile_ranktop() -> None:
    for package in ("ranktop", "core", "tui"):
        compileall.compile_dir(ROOT / package, quiet=1)
