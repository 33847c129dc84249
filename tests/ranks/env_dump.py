"""Prints the rank's environment as one JSON line (for the environment tests)."""
import json
import os

print("ENV " + json.dumps(dict(os.environ)), flush=True)
