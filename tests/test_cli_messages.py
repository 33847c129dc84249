"""What the `ranktop` command line itself says: its usage errors (no run started)."""

from __future__ import annotations

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
