"""The parity rank as a directory Python runs (`python dump_app`): its __main__.py."""

import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dump_rank.py"),
               run_name="__main__")
