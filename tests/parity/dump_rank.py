"""A rank that records what its launcher gave it: its environment, argv and how it was run."""

import json
import os
import sys

KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "CUDA_VISIBLE_DEVICES",
        "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")
record = {k: os.environ.get(k) for k in KEYS}
record["argv"] = sys.argv[1:]
record["name"] = __name__
with open(os.path.join(os.environ["DUMP_TO"], f"{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)
