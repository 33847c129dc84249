"""ranktop runs on Python 3.10 and later (pyproject's requires-python), and CI runs 3.11: what
3.11 has and 3.10 lacks would pass CI and fail on 3.10. The suite was run on 3.10, 3.12 and 3.13
by hand (README.md); this catches the one such slip found there, before it ships again."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

# typing's names newer than 3.10 (3.11: Self, Never...; 3.12: override; 3.13: TypeIs...): imported
# where the module runs, each is an ImportError on 3.10. Under `if TYPE_CHECKING:` they never run.
NEWER_THAN_310 = {f"typing.{name}" for name in (
    "Self", "LiteralString", "Never", "assert_never", "assert_type", "reveal_type", "Required", "NotRequired",
    "TypeVarTuple", "Unpack", "dataclass_transform", "get_overloads", "clear_overloads", "override",
    "TypeAliasType", "get_protocol_members", "is_protocol", "ReadOnly", "TypeIs", "NoDefault")} | {
    "tomllib", "wsgiref.types"}


class RunTimeImports(ast.NodeVisitor):
    """Every name a module imports where it runs: `typing.X` for `from typing import X`."""

    def __init__(self) -> None:
        self.names: list[tuple[int, str]] = []

    def visit_If(self, node: ast.If) -> None:
        if ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for statement in node.orelse:
                self.visit(statement)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.names += [(node.lineno, alias.name) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.names += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        self.names.append((node.lineno, node.module or ""))


def product_modules() -> list[Path]:
    return [path for folder in ("ranktop", "core", "tui") for path in sorted((ROOT / folder).rglob("*.py"))]


def test_no_module_imports_at_run_time_what_python_3_10_lacks():
    """tui/logview.py imported typing.Self (3.11's): on 3.10 the TUI did not start at all."""
    newer = []
    for path in product_modules():
        imports = RunTimeImports()
        imports.visit(ast.parse(path.read_text(), str(path)))
        newer += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in imports.names if name in NEWER_THAN_310]
    assert not newer, newer
    assert len(product_modules()) > 50  # (the walk found the modules)


# 3.11's interpreter option -P and what goes with it: passed to 3.10's python, `-P` is a usage
# error (exit 2); the attributes are AttributeErrors there.
NEWER_THAN_310_OPTIONS = {"-P", "PYTHONSAFEPATH"}
NEWER_THAN_310_ATTRIBUTES = {"safe_path", "co_qualname"}
# and subprocess.Popen's 3.11 keyword (a TypeError on 3.10): 3.10 needs preexec_fn=os.setpgrp
NEWER_THAN_310_KEYWORDS = {"process_group"}


class UnguardedUses(ast.NodeVisitor):
    """Where a module uses 3.11's options or attributes outside a test of sys.version_info."""

    def __init__(self) -> None:
        self.uses: list[tuple[int, str]] = []

    def visit_If(self, node: ast.If | ast.IfExp) -> None:
        if "sys.version_info" not in ast.unparse(node.test):
            self.generic_visit(node)

    visit_IfExp = visit_If

    def visit_Constant(self, node: ast.Constant) -> None:
        if node.value in NEWER_THAN_310_OPTIONS:
            self.uses.append((node.lineno, repr(node.value)))

    def visit_keyword(self, node: ast.keyword) -> None:
        if node.arg in NEWER_THAN_310_KEYWORDS:
            self.uses.append((node.lineno, f"{node.arg}="))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in NEWER_THAN_310_ATTRIBUTES:
            self.uses.append((node.lineno, f".{node.attr}"))
        self.generic_visit(node)


def test_no_module_uses_python_3_11s_options_or_attributes_without_a_version_test():
    """core/process.py passed a function rank started under `python -I` on as `-s -P`: on 3.10
    each such rank exited 2 (`Unknown option: -P`); core/stacks/pyspy.py started py-spy with
    Popen(process_group=0), a TypeError there."""
    uses = []
    for path in product_modules():
        unguarded = UnguardedUses()
        unguarded.visit(ast.parse(path.read_text(), str(path)))
        uses += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in unguarded.uses]
    assert not uses, uses
