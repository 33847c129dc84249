"""A rank with a grandchild in its group and one that escaped with setsid; prints all pids, then waits.
`--ignore-term` makes the rank ignore SIGTERM (so only SIGKILL ends it)."""
import os
import signal
import subprocess
import sys
import time

if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(f"PIDS {os.getpid()} {child.pid} {escaped.pid}", flush=True)
while True:
    time.sleep(1)
