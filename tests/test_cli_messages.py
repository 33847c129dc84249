"""What the `ranktop` command line itself says: its usage errors and its --detach line (no run started)."""

from __future__ import annotations

import subprocess

import pytest
from conftest import run_ranktop


@pytest.mark.parametrize("args", [(), ("--nproc-per-node", "2")], ids=["bare", "options-only"])
def test_a_line_without_a_script_names_only_the_script_as_missing(args):
    """The script's own arguments are optional (the usage line ends `training_script ...`); a line
    without a script was told `the following arguments are required: training_script,
    training_script_args` (argparse counts its REMAINDER positional as required)."""
    done = run_ranktop(*args)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "ranktop: error: the following arguments are required: training_script\n")


@pytest.mark.parametrize(("run_id", "attach", "follow", "stop"), [
    ("bg", "ranktop attach bg", "ranktop logs bg -f", "ranktop stop bg"),
    ("-my run", "ranktop attach -- '-my run'", "ranktop logs -f -- '-my run'", "ranktop stop -- '-my run'"),
], ids=["plain", "dash-and-space"])
def test_the_detached_runs_commands_are_each_on_a_line_of_their_own(tmp_path, monkeypatch, capsys, run_id, attach,
                                                                     follow, stop):
    """--detach printed `...: ranktop attach RUN | ranktop logs RUN -f | ranktop stop RUN`, which a
    shell reads as one pipeline (pasted, it ran one). Each command now has a line and a label."""
    from ranktop.tui import cli

    monkeypatch.setattr(cli, "_served_name", lambda child, name, path: name)  # served at once
    child = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        assert cli._wait_served(child, run_id, str(tmp_path / "run.sock")) == 0
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    assert capsys.readouterr().out == (f"ranktop: started {run_id} in the background (pid {child.pid})\n"
                                       f"  attach: {attach}\n  follow: {follow}\n  stop:   {stop}\n")
