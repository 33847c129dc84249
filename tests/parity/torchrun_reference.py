"""Runs torchrun (torch.distributed.run) on each command line of a JSON list and prints the exit
status of each; its ranks record what they were given (dump_rank.py). torch is imported once, and
each line runs in a fork of this process, so nothing one line changes leaks into the next.

    python torchrun_reference.py LINES.json   # [{"argv": [...], "env": {...}, "dump": DIR}, ...]
"""

import json
import os
import sys

from torch.distributed.run import main as torchrun


def run_line(case: dict) -> int:
    pid = os.fork()
    if pid == 0:
        os.environ.update(case["env"])
        os.environ["DUMP_TO"] = case["dump"]
        try:
            torchrun(case["argv"])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # a failed group: torchrun raises ChildFailedError
            code = 1
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


if __name__ == "__main__":  # --run-path ranks are spawned and import this module again
    print(json.dumps([run_line(case) for case in json.load(open(sys.argv[1]))]))
