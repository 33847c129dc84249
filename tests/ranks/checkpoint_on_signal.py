"""A rank that checkpoints when signalled: `checkpoint_on_signal.py PATH DELAY` (see rank_fns)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rank_fns  # noqa: E402

rank_fns.checkpoint_on_signal(sys.argv[1], float(sys.argv[2]))
