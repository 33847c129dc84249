"""ranktop lives under `ranktop.*`: a user project with its own `core` and `tui` packages (common
names) first on sys.path shadows nothing, in the caller, in a callable rank or in the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def _user_project(tmp_path):
    for pkg in ("core", "tui"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(f"WHO = 'user {pkg}'\n")
    (tmp_path / "userjob.py").write_text(textwrap.dedent("""
        import core, tui

        def work(x):
            return (core.WHO, tui.WHO, x)
    """))
    return tmp_path


def test_api_and_callable_rank_see_the_users_core(tmp_path):
    project = _user_project(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(project)!r})
        import core
        from ranktop.core import Std, start_processes
        import userjob
        ctx = start_processes("t", userjob.work, {{0: (7,), 1: (8,)}}, {{0: {{}}, 1: {{}}}}, {str(logs)!r})
        result = ctx.wait()
        ctx.close()
        print(core.WHO, "|", sorted(result.return_values.items()), "|", result.failures)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "user core | [(0, ('user core', 'user tui', 7)), (1, ('user core', 'user tui', 8))] | {}"


def test_cli_from_a_project_with_its_own_core(tmp_path):
    project = _user_project(tmp_path)
    (project / "train.py").write_text("import core, tui, os\nprint(core.WHO, tui.WHO, os.environ['RANK'])\n")
    script = Path(sys.executable).with_name("ranktop")  # the installed command, beside our python
    assert script.exists()
    for cmd in ([sys.executable, "-m", "ranktop"], [str(script)]):
        out = subprocess.run([*cmd, "--headless", "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "2",
                              "train.py"], cwd=project, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(project)})
        assert out.returncode == 0, out.stderr
        assert sorted(out.stdout.splitlines()) == ["[default0]:user core user tui 0", "[default1]:user core user tui 1"]
