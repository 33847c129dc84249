"""Runs torchrun (torch.distributed.run), or torch.distributed.launch where a case says "launch",
on each command line of a JSON list and prints the exit status of each; its ranks record what
they were given (dump_rank.py). torch is imported once, and each line runs in a fork of this
process, so nothing one line changes leaks into the next; two lines run at a time (every line has
ports of its own), which halves the wait on a 2-core box.

    python torchrun_reference.py LINES.json   # [{"argv": [...], "env": {...}, "dump": DIR, "launch": false}, ...]
"""

import json
import os
import sys

from torch.distributed.launch import main as launch
from torch.distributed.run import main as torchrun

AT_ONCE = 2


def start_line(case: dict) -> int:
    """The line's torchrun in a fork; its pid."""
    pid = os.fork()
    if pid == 0:
        os.environ.update(case["env"])
        os.environ["DUMP_TO"] = case["dump"]
        try:
            (launch if case.get("launch") else torchrun)(case["argv"])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # a failed group: torchrun raises ChildFailedError
            code = 1
        os._exit(code)
    return pid


def run_lines(cases: list[dict]) -> list[int]:
    """Every line's exit status, in order, AT_ONCE lines running at a time."""
    statuses: list[int | None] = [None] * len(cases)
    running: dict[int, int] = {}  # pid -> the line's index
    waiting = list(enumerate(cases))
    while waiting or running:
        while waiting and len(running) < AT_ONCE:
            index, case = waiting.pop(0)
            running[start_line(case)] = index
        pid, status = os.wait()
        if pid in running:  # (a stray grandchild reparented to us is not a line)
            statuses[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    return statuses


if __name__ == "__main__":  # --run-path ranks are spawned and import this module again
    print(json.dumps(run_lines(json.load(open(sys.argv[1])))))
