"""A rank that starts helpers which escape the orphan guard's marker: both clear their environment
(`env -i`), one calls setsid (a child of the rank, in a session of its own), one is double-forked
into a process group of its own (orphaned at once, still in the rank's session).

    helpers.py DIR EXIT_RANKS [STUBBORN]

Each helper writes its pid to DIR/<rank>-<kind>.pid and, on SIGTERM, appends TERM to
DIR/<rank>-<kind>.term and exits (STUBBORN=stubborn: it records TERM and keeps running, so only
SIGKILL ends it). Ranks listed in EXIT_RANKS (e.g. "0" or "0,1") exit 0 once their helpers run;
the others wait until stopped.
"""
import os
import subprocess
import sys
import time

folder, exit_ranks = sys.argv[1], sys.argv[2].split(",")
stubborn = len(sys.argv) > 3 and sys.argv[3] == "stubborn"
rank = os.environ["LOCAL_RANK"]
on_term = 'echo TERM >> "$1"' + ("" if stubborn else "; exit 0")
script = f"trap '{on_term}' TERM; echo $$ > \"$2.tmp\"; mv \"$2.tmp\" \"$2\"; while :; do /bin/sleep 0.05; done"


def helper_argv(kind):
    base = os.path.join(folder, f"{rank}-{kind}")
    return ["/bin/sh", "-c", script, "helper", base + ".term", base + ".pid"]


# The helpers write nothing to the rank's pipes: once ranktop is SIGKILLed nobody reads them, and
# the shell's "Terminated" note for its sleep would kill it with SIGPIPE before its trap ran.
subprocess.Popen(["env", "-i", "setsid", *helper_argv("setsid")], stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
middle = os.fork()
if middle == 0:
    os.setpgid(0, 0)
    if os.fork() == 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.execvp("env", ["env", "-i", *helper_argv("setpgid")])
    os._exit(0)
os.waitpid(middle, 0)
while not all(os.path.exists(os.path.join(folder, f"{rank}-{k}.pid")) for k in ("setsid", "setpgid")):
    time.sleep(0.01)
print("HELPERS STARTED", flush=True)
if rank in exit_ranks:
    sys.exit(0)
while True:
    time.sleep(1)
