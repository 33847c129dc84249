"""Rank 1 crashes on attempt 0 only; everyone reports the restart count."""
import os
import sys
import time

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
print(f"rank {rank} attempt {attempt}", flush=True)
if attempt == 0 and rank == 1:
    sys.exit(7)
if attempt == 0:
    time.sleep(30)
