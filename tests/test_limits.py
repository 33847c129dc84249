"""Limits: the open-files limit is raised at start (one line when even the hard limit is short),
and the Python API refuses nan, infinite, negative and absurd numbers as the command line does."""

from __future__ import annotations

import math
import os
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
import rank_fns
from conftest import ROOT, ranktop_cmd
from ranktop.core import LocalAgent, UsageError, WorkerSpec, start_processes

HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
NRANKS = 300  # about 1,500 descriptors: far over a soft limit of 256


def _ranktop_with_nofile(soft, hard, tmp_path, command):
    """ranktop with NRANKS ranks of `command`, under the given open-files limits (set by prlimit)."""
    argv = ["prlimit", f"--nofile={soft}:{hard}", *ranktop_cmd(
        "--headless", "--nproc-per-node", str(NRANKS), "--local-ranks-filter", "0", "--log-dir",
        str(tmp_path / "logs"), "--run-id", "fds", "--no-python", "sh", "-c", command)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(HARD != resource.RLIM_INFINITY and HARD < 2000, reason="needs a hard limit of 2000 open files")
def test_low_soft_limit_is_raised_and_many_ranks_run(tmp_path):
    res = _ranktop_with_nofile(256, HARD, tmp_path, "ulimit -n; sleep 1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    # The ranks run under the raised limit, as they would after `ulimit -n` in the shell.
    assert res.stdout.strip() == f"[default0]:{'unlimited' if HARD == resource.RLIM_INFINITY else HARD}"
    assert len(os.listdir(tmp_path / "logs" / "fds" / "attempt_0")) == NRANKS


def test_low_hard_limit_is_one_line_and_starts_nothing(tmp_path):
    marker = tmp_path / "ran"
    res = _ranktop_with_nofile(256, 256, tmp_path, f"touch {marker}; sleep 30")
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"ranktop: error: too few file descriptors for {NRANKS} ranks: about ")
    assert "the limit is 256 (hard limit 256); raise it (ulimit -Hn" in lines[0]
    assert not marker.exists()
    assert not (tmp_path / "logs").exists() or not os.listdir(tmp_path / "logs")


def test_api_refuses_too_many_ranks_for_the_hard_limit(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        import rank_fns
        from ranktop.core import UsageError, start_processes
        try:
            start_processes("t", rank_fns.sleep_forever, {{r: () for r in range(100)}},
                            {{r: {{}} for r in range(100)}}, {str(tmp_path)!r})
        except UsageError as exc:
            print(exc)
    """)
    res = subprocess.run(["prlimit", "--nofile=64:64", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60)
    assert res.stdout.startswith("too few file descriptors for 100 ranks"), res.stdout + res.stderr
    assert os.listdir(tmp_path) == []


def _spec(**kw):
    return WorkerSpec(**{"role": "r", "local_world_size": 1, "entrypoint": "true", **kw})


@pytest.mark.parametrize("field, value, message", [
    ("local_world_size", 0, "bad local_world_size 0: expected a whole number from 1 to 4096"),
    ("local_world_size", 10**8, "bad local_world_size 100000000: expected a whole number from 1 to 4096"),
    ("local_world_size", 2.0, "bad local_world_size 2.0: expected a whole number"),
    ("nnodes", 0, "bad nnodes 0: expected a whole number from 1 to 524287"),
    ("node_rank", -1, "bad node_rank -1: expected a whole number, 0 or more"),
    ("max_restarts", -1, "bad max_restarts -1: expected a whole number, 0 or more"),
    ("max_restarts", True, "bad max_restarts True: expected a whole number"),
    ("monitor_interval", math.nan, "bad monitor_interval nan: expected a number of seconds from 0.001"),
    ("monitor_interval", 0, "bad monitor_interval 0: expected a number of seconds from 0.001"),
    # text where a number belongs is shown as text: it read as the number it spells
    ("monitor_interval", "0.1", "bad monitor_interval '0.1': expected a number of seconds"),
    ("max_restarts", None, "bad max_restarts None: expected a whole number"),
    ("master_port", 0, "bad --master-port 0: expected a whole number from 1 to 65535"),
])
def test_worker_spec_refuses_bad_numbers(field, value, message):
    with pytest.raises(UsageError) as info:
        _spec(**{field: value})
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("kw, message", [
    ({"shutdown_timeout": math.nan}, "bad shutdown_timeout nan: expected a number of seconds from 0 to 604800"),
    ({"shutdown_timeout": -1}, "bad shutdown_timeout -1: expected a number of seconds from 0"),
    ({"shutdown_timeout": math.inf}, "bad shutdown_timeout inf: expected a number of seconds from 0"),
    ({"stall_timeout": 0}, "bad stall_timeout 0: expected a number of seconds above 0"),
    ({"stall_timeout": math.nan}, "bad stall_timeout nan: expected a number of seconds above 0"),
    ({"ring_lines": 0}, "bad ring_lines 0: expected a whole number, 1 or more"),
    # torch's agent takes any value here and, at the barrier, logs a traceback for what it
    # cannot use; ranktop's raised a bare TypeError once the ranks had succeeded
    ({"exit_barrier_timeout": "5"}, "bad exit_barrier_timeout '5': expected a number of seconds from 0"),
    ({"exit_barrier_timeout": -1}, "bad exit_barrier_timeout -1: expected a number of seconds from 0"),
])
def test_local_agent_refuses_bad_numbers_before_making_anything(tmp_path, kw, message):
    with pytest.raises(UsageError, match=f"^{message}"):
        LocalAgent(_spec(), log_dir=str(tmp_path / "logs"), **kw)
    assert not (tmp_path / "logs").exists()


def test_context_refuses_nan_and_negative_graces_and_keeps_running(tmp_path):
    ctx = start_processes("t", rank_fns.sleep_forever, {0: ()}, {0: {}}, str(tmp_path))
    try:
        for call, message in [
            (lambda: ctx.stop(signal.SIGTERM, math.nan), "bad grace nan"),
            (lambda: ctx.stop(signal.SIGTERM, -1), "bad grace -1"),
            (lambda: ctx.restart_rank(0, math.inf), "bad grace inf"),
            (lambda: ctx.close(timeout=math.nan), "bad timeout nan"),
            (lambda: ctx.wait(timeout=math.nan), "bad timeout nan"),
            (lambda: ctx.wait(timeout=1, period=-1), "bad period -1"),
        ]:
            with pytest.raises(UsageError, match=f"^{message}"):
                call()
        assert ctx.step() is None and ctx.slots[0].alive and not ctx.slots[0].stopped_by_us
    finally:
        ctx.close(timeout=5)
    assert ctx.step().failures[0].signal_name() == "SIGTERM"
