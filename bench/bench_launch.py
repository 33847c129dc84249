"""Launch benchmark: ranktop --headless vs torchrun vs a bare parallel spawn, side by side.

    python bench/bench_launch.py                       # every scenario, 5 repeats each
    python bench/bench_launch.py -s trivial -s stop -n 3 --no-torchrun

Scenarios (the project's targets in brackets):
  trivial  8 ranks of an empty script, launch to reap          [within 0.15 s of bare]
  many     128 ranks of an empty script, launch to reap        [within 0.3 s of bare]
  lines    8 ranks x 200k lines, --tee 3 and log files         [within 1.5x of bare to /dev/null]
           (every log file is checked to hold exactly the bytes its rank wrote)
  stop     8 ranks, each with a grandchild, all exit on SIGINT;
           SIGINT to the launcher until every rank and grandchild is dead   [0.3 s]
  writes   8 ranks x 400k short lines that only write (one write(2) each), --tee 3 + logs,
           beside the C floor (each rank piped into `cat` writing its log file) and /dev/null
           [16 cores: within 1.3x of /dev/null; 2 cores: at or below the floor]
           and ranktop's own CPU seconds for the job                [>= 1 GB of lines per CPU s]
  bigline  one rank writes a 200 MB line without a newline      [ranktop CPU <= 3 s, RSS <= 100 MB]
  mblines  one rank writes 1000 lines of 1 MB                    [peak RSS <= 150 MB]
  pty      one rank writes 20 MB through --pty and through pipes [pty within 3x of pipes]

For writes, bigline and mblines "ranktop CPU" is the launcher's user+system time (wait4: the
launcher and every process it reaped) less what the ranks reported for themselves just before
they exit (getrusage, to the microsecond as wait4 counts it: os.times counts in 10 ms ticks, and
its truncation put ~5 ms a rank on ranktop's side), and peak RSS is the launcher's (ru_maxrss over it and its reaped children;
the ranks are far smaller), as a small Python that starts it reports them (see _MEASURE).

Run by hand, not by the tests. The launchers' own console output goes to /dev/null. Each
figure is the median of the repeats after one unmeasured warm-up run; the contenders take
turns, so a change in background load hits them alike.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from compiled import add_installed_option, compile_ranktop, ranktop_python
from ranktop.core.process import wait_exit as exited

ROOT = Path(__file__).resolve().parent.parent
NPROC = 8
MANY = 128  # ranks of the 'many' scenario
DEADLINE = 120.0  # seconds any one launch may take before the bench gives up on it
STOP_WAIT = 10.0  # seconds to wait for ranks to die after SIGINT before calling it a miss

TRIVIAL = "pass\n"

# One write(2) per line (like print() with PYTHONUNBUFFERED=1, which both launchers set or
# recommend): the worst case for whoever reads the pipes. The rank leaves the size and sha256 of
# what it wrote next to the logs, so the bench can check that nothing was lost.
SPEW = """\
import hashlib, os, sys
n, out = int(sys.argv[1]), sys.argv[2]
rank = os.environ.get("RANK", sys.argv[3] if len(sys.argv) > 3 else "0")
h, size, fd = hashlib.sha256(), 0, sys.stdout.fileno()
for i in range(n):
    line = f"[rank {rank}] step {i:7d} loss {1.0 / (i + 1):.8f} lr 3.0e-04 tokens/s 123456 ok\\n".encode()
    os.write(fd, line)
    h.update(line)
    size += len(line)
with open(f"{out}/expect.{rank}", "w") as f:
    f.write(f"{size} {h.hexdigest()}")
"""

# A rank with a grandchild; both die of SIGINT's default action (Python's KeyboardInterrupt
# re-raises it as a death by signal). The pid file says both are up.
STOPPER = """\
import os, subprocess, sys, time
out = sys.argv[1]
rank = os.environ.get("RANK", sys.argv[2] if len(sys.argv) > 2 else "0")
child = subprocess.Popen(["sleep", "600"])
tmp = f"{out}/pids.{rank}.tmp"
with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(tmp, f"{out}/pids.{rank}")
time.sleep(600)
"""


# Only writes: no hashing, so the ranks are as fast as they can be and the launcher's tax shows.
# The bench rebuilds the expected bytes itself (`writes_payload`) to check the logs.
# argv = lines, where to leave its own CPU seconds (cpu.<rank>), [rank when no $RANK].
WRITER = """\
import os, resource, sys
n, out = int(sys.argv[1]), sys.argv[2]
rank = os.environ.get("RANK", sys.argv[3] if len(sys.argv) > 3 else "0")
w, r = os.write, rank.encode()
for i in range(n):
    w(1, b"[rank %s] step %7d loss 0.12345678 lr 3.0e-04 ok\\n" % (r, i))
t = resource.getrusage(resource.RUSAGE_SELF)
with open(f"{out}/cpu.{rank}", "w") as f:
    f.write(str(t.ru_utime + t.ru_stime))
os._exit(0)
"""

# One rank, big writes: argv = total MB, MB per line (0: no newline at all), where to report
# its own CPU seconds.
BIG = """\
import os, resource, sys
total_mb, line_mb, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
block = b"x" * (1 << 20)
for i in range(total_mb):
    os.write(1, block[:-1] + b"\\n" if line_mb and (i + 1) % line_mb == 0 else block)
if not line_mb:
    os.write(1, b"\\n")
t = resource.getrusage(resource.RUSAGE_SELF)
with open(out, "w") as f:
    f.write(str(t.ru_utime + t.ru_stime))
"""


def writes_payload(rank: int, n: int) -> bytes:
    r = str(rank).encode()
    return b"".join(b"[rank %s] step %7d loss 0.12345678 lr 3.0e-04 ok\n" % (r, i) for i in range(n))


@dataclass
class Result:
    times: list[float] = field(default_factory=list)
    note: str = ""
    cpu: list[float] = field(default_factory=list)  # the launcher's own CPU seconds per run (writes)

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None


# ----- the three ways to launch ----------------------------------------------------------------

# With --installed, compiled.ranktop_python: an installed copy's Python, and -P.
RANKTOP_PYTHON = [sys.executable]


def ranktop_cmd(script: str, args: list[str], log_dir: str, tee: bool, nproc: int = NPROC) -> list[str]:
    cmd = [*RANKTOP_PYTHON, "-m", "ranktop", "--headless", "--nproc-per-node", str(nproc),
           "--log-dir", log_dir, "--run-id", "bench"]
    if tee:
        cmd += ["--tee", "3"]
    return cmd + [script, *args]


def torchrun_cmd(script: str, args: list[str], log_dir: str, tee: bool) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC)]
    if tee:
        cmd += ["--tee", "3", "--log-dir", log_dir]
    return cmd + [script, *args]


def launcher_env() -> dict[str, str]:
    # Same for every contender: torchrun would otherwise warn about OMP_NUM_THREADS per run.
    # PYTHON_EXEC: ranktop's ranks run the interpreter the bare ranks run, whichever runs ranktop.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHON_EXEC": sys.executable}
    # Installed packages (torch) come with .pyc files; a source checkout gets them on first
    # import unless this is set, in which case ranktop alone would recompile itself every run.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def rank_env(rank: int, nproc: int = NPROC) -> dict[str, str]:
    return {**launcher_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc)}


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    """proc's exit status, taken as soon as it exits (ranktop's own pidfd wait: Popen.wait(timeout)
    polls with sleeps up to 50 ms, which put every figure 0-50 ms late, in 50 ms steps)."""
    if not exited(proc, timeout):
        raise subprocess.TimeoutExpired(proc.args, timeout)
    return proc.returncode


def run_launcher(cmd: list[str]) -> float:
    """Wall time of one launcher run to its exit; its console output is thrown away. A run past
    DEADLINE is killed, and a run that fails is an error."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launcher_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        code = wait_exit(proc, DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"gave up after {DEADLINE}s: {' '.join(cmd)}") from None
    elapsed = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"exit status {code}: {' '.join(cmd)}")
    return elapsed


def run_bare(script: str, args: list[str], stdout=subprocess.DEVNULL, nproc: int = NPROC) -> float:
    """The reference: Popen every rank at once, wait for all of them."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-u", script, *args, str(r)], env=rank_env(r, nproc), stdout=stdout,
                              stderr=stdout, cwd=ROOT) for r in range(nproc)]
    codes = [wait_exit(p, DEADLINE) for p in procs]
    elapsed = time.perf_counter() - start
    if any(codes):
        raise RuntimeError(f"bare ranks exited with {codes}")
    return elapsed


# ----- scenarios ---------------------------------------------------------------------------------

def interleaved(n: int, contenders: dict[str, Callable[[], float]]) -> dict[str, Result]:
    """One warm-up each (page cache, .pyc files), then n rounds of one run per contender, so a
    change in background load hits every contender alike."""
    results = {name: Result() for name in contenders}
    live = dict(contenders)
    for round_no in range(n + 1):
        for name, once in list(live.items()):
            try:
                elapsed = once()
            except RuntimeError as exc:
                results[name].note = str(exc)[:200]
                del live[name]
                continue
            if round_no:
                results[name].times.append(elapsed)
    return results


def fresh_dir(base: str, name: str) -> str:
    path = os.path.join(base, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def bench_trivial(base: str, n: int, torchrun: bool, nproc: int = NPROC) -> dict[str, Result]:
    script = os.path.join(base, "trivial.py")
    Path(script).write_text(TRIVIAL)
    contenders = {
        "ranktop": lambda: run_launcher(ranktop_cmd(script, [], fresh_dir(base, "rt"), tee=False, nproc=nproc)),
        "bare": lambda: run_bare(script, [], nproc=nproc),
    }
    if torchrun and nproc == NPROC:  # 128 ranks: torchrun takes seconds; the target compares with a bare spawn
        contenders["torchrun"] = lambda: run_launcher(torchrun_cmd(script, [], fresh_dir(base, "tr"), tee=False))
    return interleaved(n, contenders)


def check_logs(log_root: str, expect_dir: str) -> str | None:
    """None when every rank's stdout.log holds exactly what the rank wrote, else what is wrong."""
    for r in range(NPROC):
        size, digest = Path(expect_dir, f"expect.{r}").read_text().split()
        logs = sorted(Path(log_root).glob(f"**/attempt_0/{r}/stdout.log"))
        if len(logs) != 1:
            return f"rank {r}: expected one stdout.log, found {len(logs)}"
        data = logs[0].read_bytes()
        if len(data) != int(size) or hashlib.sha256(data).hexdigest() != digest:
            return f"rank {r}: log has {len(data)} bytes, rank wrote {size} (or content differs)"
    return None


def bench_lines(base: str, n: int, torchrun: bool, lines: int) -> dict[str, Result]:
    script = os.path.join(base, "spew.py")
    Path(script).write_text(SPEW)
    problems: dict[str, str] = {}

    def launched(name: str, make_cmd) -> Callable[[], float]:
        def once() -> float:
            logs, expect = fresh_dir(base, f"{name}-logs"), fresh_dir(base, f"{name}-expect")
            elapsed = run_launcher(make_cmd(script, [str(lines), expect], logs, tee=True))
            problem = check_logs(logs, expect)
            if problem:
                problems[name] = problem
            return elapsed
        return once

    def bare() -> float:
        return run_bare(script, [str(lines), fresh_dir(base, "bare-expect")])

    contenders = {"ranktop": launched("ranktop", ranktop_cmd), "bare": bare}
    if torchrun:
        contenders["torchrun"] = launched("torchrun", torchrun_cmd)
    out = interleaved(n, contenders)
    for name, problem in problems.items():
        out[name].note = f"BYTES LOST: {problem}"
    for name in ("ranktop", "torchrun"):
        if name in out and name not in problems and out[name].times:
            out[name].note = "logs byte-identical"
    return out


def read_pids(pid_dir: str, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [p for p in Path(pid_dir).glob("pids.*") if not p.name.endswith(".tmp")]
        if len(files) == NPROC:
            return [int(x) for p in files for x in p.read_text().split()]
        time.sleep(0.005)
    raise RuntimeError(f"ranks did not all start within {timeout}s")


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie (dead, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def time_until_dead(pids: list[int]) -> float | None:
    """Seconds until none of `pids` runs, from now; None if some still run after STOP_WAIT."""
    start = time.perf_counter()
    while any(alive(p) for p in pids):
        if time.perf_counter() - start > STOP_WAIT:
            return None
        time.sleep(0.001)
    return time.perf_counter() - start


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def stop_launcher(base: str, make_cmd, script: str) -> float:
    pid_dir = fresh_dir(base, "pids")
    cmd = make_cmd(script, [pid_dir], fresh_dir(base, "stop-logs"), tee=False)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launcher_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        pids = read_pids(pid_dir)
        proc.send_signal(signal.SIGINT)
        took = time_until_dead(pids)
        if took is None:
            left = sum(alive(p) for p in pids)
            raise RuntimeError(f"{left} of {len(pids)} rank/grandchild processes still alive {STOP_WAIT}s after SIGINT")
        return took
    finally:
        kill_all(pids)
        try:
            wait_exit(proc, STOP_WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_bare(base: str, script: str) -> float:
    pid_dir = fresh_dir(base, "pids")
    procs = [subprocess.Popen([sys.executable, "-u", script, pid_dir, str(r)], env=rank_env(r), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for r in range(NPROC)]
    pids: list[int] = []
    try:
        pids = read_pids(pid_dir)
        for p in procs:
            os.killpg(p.pid, signal.SIGINT)  # the whole session: rank and grandchild
        took = time_until_dead(pids)
        if took is None:
            raise RuntimeError("bare ranks outlived SIGINT")
        return took
    finally:
        kill_all(pids)
        for p in procs:
            p.wait()


def run_cat_floor(script: str, args: list[str], log_dir: str, cpu: list[float] | None = None) -> float:
    """The C floor: every rank's output piped into its own `cat`, which writes the log file.
    The cats' CPU seconds together go to `cpu`."""
    start = time.perf_counter()
    ranks, cats = [], []
    for r in range(NPROC):
        log = open(os.path.join(log_dir, f"{r}.log"), "wb")
        cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=log)
        log.close()
        ranks.append(subprocess.Popen([sys.executable, "-u", script, *args, str(r)], env=rank_env(r), cwd=ROOT,
                                      stdout=cat.stdin, stderr=cat.stdin))
        cat.stdin.close()
        cats.append(cat)
    codes = [wait_exit(p, DEADLINE) for p in ranks]
    cats_cpu = 0.0
    for cat in cats:
        _, status, usage = os.wait4(cat.pid, 0)
        cat.returncode = os.waitstatus_to_exitcode(status)
        codes.append(cat.returncode)
        cats_cpu += usage.ru_utime + usage.ru_stime
    elapsed = time.perf_counter() - start
    if any(codes):
        raise RuntimeError(f"floor processes exited with {codes}")
    if cpu is not None:
        cpu.append(cats_cpu)
    return elapsed


def check_writes(log_root: str, lines: int, pattern: str) -> str | None:
    for r in range(NPROC):
        logs = sorted(Path(log_root).glob(pattern.format(r=r)))
        if len(logs) != 1:
            return f"rank {r}: expected one log, found {len(logs)}"
        if logs[0].read_bytes() != writes_payload(r, lines):
            return f"rank {r}: log differs from what the rank wrote"
    return None


def bench_writes(base: str, n: int, torchrun: bool, lines: int) -> dict[str, Result]:
    script = os.path.join(base, "writer.py")
    Path(script).write_text(WRITER)
    problems: dict[str, str] = {}
    cpu: dict[str, list[float]] = {"ranktop": [], "torchrun": [], "floor": [], "ranktop-idle": []}
    logs = {"ranktop": "**/attempt_0/{r}/stdout.log", "floor": "{r}.log", "torchrun": "**/attempt_0/{r}/stdout.log",
            "ranktop-idle": "**/attempt_0/{r}/stdout.log"}

    def checked(name: str, run: Callable[[str, list[str]], float], count: int = lines) -> Callable[[], float]:
        def once() -> float:
            log_dir, cpu_dir = fresh_dir(base, f"{name}-logs"), fresh_dir(base, f"{name}-cpu")
            elapsed = run(log_dir, [str(count), cpu_dir])
            problem = check_writes(log_dir, count, logs[name]) if name in logs else None
            if problem:
                problems[name] = problem
            return elapsed
        return once

    def launched(name: str, make_cmd) -> Callable[[str, list[str]], float]:
        def run(log_dir: str, args: list[str]) -> float:
            elapsed, own = launcher_cpu(make_cmd(script, args, log_dir, tee=True), args[1])
            cpu[name].append(own)
            return elapsed
        return run

    contenders = {
        "ranktop": checked("ranktop", launched("ranktop", ranktop_cmd)),
        "floor": checked("floor", lambda d, args: run_cat_floor(script, args, d, cpu["floor"])),
        "bare": checked("bare", lambda d, args: run_bare(script, args)),
        # the same job with one line per rank: ranktop's start-up and teardown, to take apart
        "ranktop-idle": checked("ranktop-idle", launched("ranktop-idle", ranktop_cmd), count=1),
    }
    if torchrun:
        contenders["torchrun"] = checked("torchrun", launched("torchrun", torchrun_cmd))
    out = interleaved(n, contenders)
    for name, seconds in cpu.items():
        if name in out:
            out[name].cpu = seconds[1:]  # the warm-up run is not counted
    for name, problem in problems.items():
        out[name].note = f"BYTES LOST: {problem}"
    return out


def launcher_cpu(cmd: list[str], cpu_dir: str) -> tuple[float, float]:
    """(wall seconds, the launcher's own CPU seconds) of one run: what it and every process it
    reaped used (RUSAGE_CHILDREN across the run, as wait4 counts), less what its ranks reported
    for themselves in `cpu_dir`. A run past DEADLINE is killed and reported."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    elapsed = run_launcher(cmd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    ranks = sum(float(p.read_text()) for p in Path(cpu_dir).glob("cpu.*"))
    return elapsed, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime - ranks


# The launcher is started by a small Python that reports its wall time, CPU and peak RSS: Linux
# keeps a process's high-water mark across exec, and a vfork child's image before exec is its
# parent's, so a launcher started straight from this bench read as at least the bench's own peak
# (~130 MB once the writes scenario had built its expected bytes).
_MEASURE = """\
import resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True).returncode
elapsed = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(code, elapsed, usage.ru_utime + usage.ru_stime, usage.ru_maxrss)
"""


def launcher_cost(cmd: list[str], rank_cpu_file: str) -> tuple[float, float, float]:
    """(wall seconds, launcher CPU seconds less the rank's own, peak RSS in MB) of one run."""
    done = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], cwd=ROOT, env=launcher_env(),
                          capture_output=True, text=True, check=True)
    code, elapsed, cpu, maxrss = done.stdout.split()
    if int(code) != 0:
        raise RuntimeError(f"exit status {code}: {' '.join(cmd)}")
    rank_cpu = float(Path(rank_cpu_file).read_text())
    return float(elapsed), float(cpu) - rank_cpu, int(maxrss) / 1024


def bench_big(base: str, name: str) -> dict[str, str]:
    """One run of bigline, mblines or pty; figures as text."""
    script = os.path.join(base, "big.py")
    Path(script).write_text(BIG)
    cpu_file = os.path.join(base, "rank-cpu")

    def cmd(total_mb: int, line_mb: int, *flags: str) -> list[str]:
        return [*RANKTOP_PYTHON, "-m", "ranktop", "--headless", "--nproc-per-node", "1", "--log-dir",
                fresh_dir(base, "big-logs"), "--run-id", "bench", *flags, script, str(total_mb),
                str(line_mb), cpu_file]

    if name == "bigline":
        wall, cpu, rss = launcher_cost(cmd(200, 0, "--tee", "3"), cpu_file)
        return {"figure": f"wall {wall:.2f} s, ranktop CPU {cpu:.2f} s, peak RSS {rss:.0f} MB",
                "target": "CPU <= 3 s, RSS <= 100 MB", "met": _yes(cpu <= 3 and rss <= 100)}
    if name == "mblines":
        wall, cpu, rss = launcher_cost(cmd(1000, 1, "--tee", "3"), cpu_file)
        return {"figure": f"wall {wall:.2f} s, ranktop CPU {cpu:.2f} s, peak RSS {rss:.0f} MB",
                "target": "RSS <= 150 MB", "met": _yes(rss <= 150)}
    pipes, _, _ = launcher_cost(cmd(20, 1), cpu_file)
    pty, _, _ = launcher_cost(cmd(20, 1, "--pty"), cpu_file)
    return {"figure": f"pty {pty:.2f} s, pipes {pipes:.2f} s ({pty / pipes:.1f}x)",
            "target": "pty within 3x of pipes", "met": _yes(pty <= 3 * pipes)}


def bench_stop(base: str, n: int, torchrun: bool) -> dict[str, Result]:
    script = os.path.join(base, "stopper.py")
    Path(script).write_text(STOPPER)
    contenders = {"ranktop": lambda: stop_launcher(base, ranktop_cmd, script),
                  "bare": lambda: stop_bare(base, script)}
    if torchrun:
        contenders["torchrun"] = lambda: stop_launcher(base, torchrun_cmd, script)
    return interleaved(n, contenders)


# ----- the table ---------------------------------------------------------------------------------

def fmt(res: Result | None) -> str:
    if res is None:
        return "-"
    return "failed" if res.median is None else f"{res.median:.3f} s"


def verdict(name: str, rt: float | None, bare: float | None, lines: int) -> tuple[str, str, str]:
    """(ranktop vs bare, the target, met?)"""
    if rt is None or bare is None:
        return "-", "-", "-"
    if name == "trivial":
        return f"+{rt - bare:.3f} s ({rt / bare:.2f}x)", "within 0.15 s of bare", _yes(rt - bare <= 0.15)
    if name == "many":
        return f"+{rt - bare:.3f} s ({rt / bare:.2f}x)", "within 0.3 s of bare", _yes(rt - bare <= 0.3)
    if name == "lines":
        return f"{rt / bare:.2f}x", "within 1.5x of bare", _yes(rt / bare <= 1.5)
    if name == "writes":
        return f"{rt / bare:.2f}x", "within 1.3x of bare (16 cores)", _yes(rt / bare <= 1.3)
    return f"{rt / bare:.2f}x", "all dead within 0.3 s", _yes(rt <= 0.3)


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def print_table(rows: dict[str, dict[str, Result]], lines: int, repeats: int, writes: int) -> None:
    labels = {"trivial": f"{NPROC} trivial ranks, launch+reap",
              "many": f"{MANY} trivial ranks, launch+reap",
              "lines": f"{NPROC} x {lines // 1000}k lines, tee 3 + logs (bare: /dev/null)",
              "stop": f"SIGINT -> {NPROC} ranks + grandchildren dead",
              "writes": f"{NPROC} x {writes // 1000}k write-only lines, tee 3 + logs"}
    header = ["scenario", "ranktop", "torchrun", "C floor", "bare", "ranktop vs bare", "target", "met"]
    body = []
    for name, res in rows.items():
        rt, bare = res["ranktop"].median, res["bare"].median
        body.append([labels[name], fmt(res["ranktop"]), fmt(res.get("torchrun")), fmt(res.get("floor")),
                     fmt(res["bare"]), *verdict(name, rt, bare, lines)])
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    print(f"\nmedians of {repeats} runs, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print(_row(header, widths))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in body:
        print(_row(row, widths))
    for name, res in rows.items():
        for who, r in res.items():
            if r.note:
                print(f"  {name}/{who}: {r.note}")
            if len(r.times) > 1:
                print(f"  {name}/{who}: runs {' '.join(f'{t:.3f}' for t in r.times)}")
            if r.cpu and who != "ranktop-idle":
                idle = res.get("ranktop-idle")
                print(f"  {name}/{who}: {own_cpu_line(r.cpu, len(writes_payload(0, writes)), idle.cpu if idle and who == 'ranktop' else None)}")


def own_cpu_line(seconds: list[float], rank_bytes: float, idle: list[float] | None) -> str:
    """The CPU a reader spent on the job and what it comes to per GB of output; with `idle` (the
    same launcher's CPU for a job of one line per rank), also without its start-up."""
    total = NPROC * rank_bytes
    cpu = statistics.median(seconds)
    line = (f"CPU {cpu:.3f} s (runs {' '.join(f'{c:.3f}' for c in seconds)}) for {total / 1e6:.0f} MB: "
            f"{total / 1e9 / cpu:.2f} GB of lines per CPU second [target >= 1 GB/s: {_yes(total / 1e9 / cpu >= 1)}]")
    if idle:
        start = statistics.median(idle)
        line += (f"; start-up and teardown alone {start:.3f} s (runs {' '.join(f'{c:.3f}' for c in idle)}), "
                 f"the output itself {cpu - start:.3f} s = {total / 1e9 / max(cpu - start, 1e-9):.2f} GB/s")
    return line


def _row(cells: list[str], widths: list[int]) -> str:
    return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"


_BIG = ("bigline", "mblines", "pty")


def have_torch() -> bool:
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-s", "--scenario", action="append", choices=("trivial", "many", "lines", "stop", "writes", *_BIG),
                   help="run only these (repeatable; default all)")
    p.add_argument("-n", "--repeats", type=int, default=5, help="measured runs per contender (default 5)")
    p.add_argument("--lines", type=int, default=200_000, help="lines per rank in 'lines' (default 200000)")
    p.add_argument("--writes", type=int, default=400_000, help="lines per rank in 'writes' (default 400000)")
    p.add_argument("--no-torchrun", action="store_true", help="skip torchrun even when torch is installed")
    add_installed_option(p)
    ns = p.parse_args(argv)
    compile_ranktop()

    torchrun = not ns.no_torchrun and have_torch()
    if not torchrun:
        print("torchrun: skipped" + ("" if ns.no_torchrun else " (torch is not importable)"))
    scenarios = ns.scenario or ["trivial", "many", "lines", "stop", "writes", *_BIG]
    rows: dict[str, dict[str, Result]] = {}
    big: dict[str, dict[str, str]] = {}
    base = tempfile.mkdtemp(prefix="ranktop-bench-")
    try:
        global RANKTOP_PYTHON
        if ns.installed:
            RANKTOP_PYTHON = ranktop_python(os.path.join(base, "installed"), ns.installed)
            print(f"ranktop: an installed copy, run by {RANKTOP_PYTHON[0]}")
        for name in scenarios:
            print(f"running {name} ...", flush=True)
            if name in _BIG:
                big[name] = bench_big(base, name)  # once: each run is long and the figure is coarse
            elif name == "writes":
                rows[name] = bench_writes(base, ns.repeats, torchrun, ns.writes)
            elif name == "trivial":
                rows[name] = bench_trivial(base, ns.repeats, torchrun)
            elif name == "many":
                rows[name] = bench_trivial(base, ns.repeats, torchrun, nproc=MANY)
            elif name == "lines":
                rows[name] = bench_lines(base, ns.repeats, torchrun, ns.lines)
            else:
                rows[name] = bench_stop(base, ns.repeats, torchrun)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(rows, ns.lines, ns.repeats, ns.writes)
    for name, figures in big.items():
        print(f"{name}: {figures['figure']}  [target: {figures['target']}: {figures['met']}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
