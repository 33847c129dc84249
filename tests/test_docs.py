"""The docs cite tests by name as the evidence for what they say: a test renamed or removed left a
citation that pointed at nothing (the performance log named a footer test by its old name)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"(?:tests/)?(test_\w+\.py)::(test_\w+)")
CITED_IN_THE_SAME_FILE = re.compile(r"(?<![\w.])::(test_\w+)")  # `::name`, its file named just before


def _tests_by_file() -> dict[str, set[str]]:
    return {path.name: set(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M))
            for path in (ROOT / "tests").glob("test_*.py")}


def test_every_test_the_docs_cite_exists():
    tests = _tests_by_file()
    every_name = set().union(*tests.values())
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        missing += [f"{doc.name}: {f}::{name}" for f, name in CITED.findall(text) if name not in tests.get(f, ())]
        missing += [f"{doc.name}: ::{name}" for name in CITED_IN_THE_SAME_FILE.findall(text) if name not in every_name]
    assert not missing, "cited tests that do not exist:\n" + "\n".join(missing)
