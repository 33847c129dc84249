"""The examples README's Examples section runs, where no other test runs them: those that need no
torch (the torch ones are in tests/test_torch_e2e.py and tests/test_stacks_torch.py); and the
developer scripts README's Development section gives, where they can go wrong before they start."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import ROOT, ranktop_cmd, run_ranktop


def test_crash_with_a_rank_the_group_does_not_have_runs_clean(tmp_path, examples):
    """crash.py's docstring says the ranks finish when nothing crashes: with a --rank the group does
    not have (`--rank 3` on 2 ranks, or the default rank 1 on one) they waited out their sleep,
    300 s of nothing (found by a README audit)."""
    done = run_ranktop("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path),
                       str(examples / "crash.py"), "--rank", "3", "--sleep", "20", timeout=60)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[default{rank}]:rank {rank}: attempt 0 runs clean (no rank 3: the ranks are 0..1), done" \
            in done.stdout.splitlines(), done.stdout


def test_screenshots_only_refuses_a_scene_it_does_not_have(tmp_path):
    """`--only NAME` retakes one scene: a mistyped name retook none, said nothing and exited 0."""
    out = tmp_path / "shots"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "screenshots.py"), "--only", "training",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert "argument --only: invalid choice: 'training' (choose from 'training-4-ranks', " in done.stderr, done.stderr
    assert not out.exists()


def test_web_screenshot_says_why_ranktop_web_gave_no_address(tmp_path):
    """Where `ranktop web` failed (its port in use, say), web_screenshot.py said only `ranktop web
    printed no address`, and threw away the line that said why."""
    spec = importlib.util.spec_from_file_location("web_screenshot", ROOT / "scripts" / "web_screenshot.py")
    web_screenshot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(web_screenshot)
    (tmp_path / "runtime").mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "runtime")}
    web = subprocess.Popen(ranktop_cmd("web", "nosuch"), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    with pytest.raises(SystemExit) as failed:
        web_screenshot.served_address(web)
    assert web.wait(30) == 2
    assert str(failed.value).startswith("ranktop web printed no address\n  ranktop: error: 'nosuch' names no run: "), \
        failed.value
