"""A rank that leaves a helper which never keeps its pid: in a session of its own, its environment
cleared (no marker), SIGTERM ignored, it forks its successor and exits, again and again, so that
each generation lives PERIOD seconds. It writes its session's id (the first one's pid, which every
generation keeps) to FILE and ends on its own after 30 s, should a test leave it running.

    runaway.py FILE PERIOD
"""
import os
import signal
import sys
import time

if sys.argv[1] == "--generations":  # the helper itself, started with an empty environment
    path, period, end = sys.argv[2], float(sys.argv[3]), time.monotonic() + 30
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getsid(0)))
    os.rename(path + ".tmp", path)
    while time.monotonic() < end:
        time.sleep(period)
        if os.fork() != 0:
            os._exit(0)
    os._exit(0)

path, period = sys.argv[1], sys.argv[2]
if os.fork() == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (kept through exec: ignored from its first moment)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.execve(sys.executable, [sys.executable, __file__, "--generations", path, period], {})
while not os.path.exists(path):
    time.sleep(0.01)
print("RUNAWAY STARTED", flush=True)
