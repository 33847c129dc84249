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


MODULE_ROW = re.compile(r"^\| `(?:core|tui)/.*$", re.M)
MODULE_PATH = re.compile(r"`((?:core|tui)/[\w/]*?)(\w+\.py)?`")


def _modules_the_table_names() -> set[str]:
    """Each `core/x.py` or `tui/x.py` a row of README's module table names, and for a folder's row
    (`core/stacks/`: its modules by name in lower case, `model`, `pyspy`...) each module of the folder it names."""
    named = set()
    for row in MODULE_ROW.findall((ROOT / "README.md").read_text()):
        for folder, module in MODULE_PATH.findall(row):
            if module:
                named.add(folder + module)
            elif folder.count("/") == 2:  # a folder's row: its modules are the other names in backticks
                named |= {f"{folder}{word}.py" for word in re.findall(r"`([a-z_][a-z0-9_]*)`", row)}
    return named


def test_the_module_table_names_every_module_and_no_other():
    """README's module table missed six modules (core/launch.py, core/prompts.py, ...), and nothing
    said so as modules were added."""
    modules = {path.relative_to(ROOT).as_posix() for folder in ("core", "tui")
               for path in (ROOT / folder).rglob("*.py") if path.name != "__init__.py"}
    named = _modules_the_table_names()
    assert len(named) > 50  # (the table was found)
    assert sorted(modules - named) == [], "modules README's table does not name"
    assert sorted(named - modules) == [], "names in README's table that are no module"
