"""Functions that tests run as ranks. Importable by name (no pytest import): a rank unpickles
them in a fresh interpreter."""

from __future__ import annotations

import atexit
import os
import sys
import time


def double(x):
    return x * 2


def big_value(n_bytes):
    return bytes([int(os.environ["LOCAL_RANK"])]) * n_bytes


def echo_env(*names):
    return {n: os.environ.get(n) for n in names}


def raise_value_error(text):
    raise ValueError(text)


def exit_with(code):
    sys.exit(code)


def print_streams(out_text, err_text):
    print(out_text)
    print(err_text, file=sys.stderr)
    return os.environ["LOCAL_RANK"]


def sleep_forever():
    while True:
        time.sleep(1)


def echo_env_of(names):
    """echo_env for launch(), which passes its one argument: a tuple of names."""
    return echo_env(*names)


def fail_only_rank(rank_to_fail):
    """fail_rank for launch(): that rank raises, the others sleep until stopped (none fails for a
    rank that does not exist)."""
    fail_rank(rank_to_fail, f"rank {rank_to_fail} failed")


def fail_rank(rank_to_fail, text):
    if int(os.environ["LOCAL_RANK"]) == rank_to_fail:
        raise RuntimeError(text)
    time.sleep(60)


def checkpoint_on_signal(path, delay=60.0):
    """Trap SIGHUP/SIGTERM/SIGINT like a trainer that checkpoints on the way out: say which signal
    came, spend `delay` seconds "saving", write `path`, and exit 128+N."""
    import signal

    got = []
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: got.append(signum))
    print(f"READY {os.getpid()}", flush=True)
    while not got:
        time.sleep(0.02)
    print(f"GOT {got[0]}", flush=True)
    time.sleep(delay)  # a repeat of the signal runs the handler again; the sleep goes on
    with open(path, "w") as f:
        f.write(f"checkpoint after signal {got[0]}\n")
    sys.exit(128 + got[0])


def env_changes(base):
    """The variables this rank sees that `base` (its launcher's environment) has not, or has otherwise."""
    return {k: v for k, v in os.environ.items() if base.get(k) != v}


def rank_and_arg(arg):
    return (int(os.environ["RANK"]), arg)


def raise_on_rank(rank, text):
    if int(os.environ["RANK"]) == rank:
        raise ValueError(text)
    return rank


def rank0_fails_until_restart(n):
    """Rank 0 raises in the group's first `n` starts; every rank returns the restart count after."""
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if os.environ["LOCAL_RANK"] == "0" and restarts < n:
        raise RuntimeError(f"failing at restart {restarts}")
    return restarts


class _Announced:
    """A return value that creates `path` as it is pickled: its rank is past its function's return."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        open(self.path, "w").close()
        return (str, ("returned",))


def _wait_for_file(path, within):
    deadline = time.monotonic() + within
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)
    return os.path.exists(path)


def exit0_once(go):
    """Local rank 0 returns at once; local rank 1 exits 0 without a value once `go` exists (a bare
    sys.exit(): status 0, but not a return, which sys.exit(0) is)."""
    if os.environ["LOCAL_RANK"] == "0":
        return "returned"
    assert _wait_for_file(go, 60), "never told to go"
    sys.exit()


def exit_order(rank, marks, patience=0.0, then="return"):
    """Rank 0 returns at once and notes, as its interpreter exits, whether rank 1 had returned by
    then. Rank 1 waits until rank 0 returned, gives rank 0 `patience` seconds to exit, then does
    `then`: "return", "exit0" (sys.exit(0): no return value) or "raise"."""
    if rank == 0:
        def note_exit():
            with open(os.path.join(marks, "r0-exit"), "w") as f:
                f.write(str(os.path.exists(os.path.join(marks, "r1-returned"))))

        atexit.register(note_exit)
        return _Announced(os.path.join(marks, "r0-returned"))
    assert _wait_for_file(os.path.join(marks, "r0-returned"), 60), "rank 0 never returned"
    _wait_for_file(os.path.join(marks, "r0-exit"), patience)
    if then == "exit0":
        sys.exit(0)
    if then == "raise":
        raise ValueError("after rank 0 returned")
    return _Announced(os.path.join(marks, "r1-returned"))


def killed_by_hand_once(pid_dir):
    """In the group's first start each rank leaves its pid in `pid_dir` (pid<rank>) for a caller to
    kill, and waits to be stopped; in a later start it returns its rank at once."""
    rank = os.environ["RANK"]
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        return int(rank)
    with open(os.path.join(pid_dir, f".pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(pid_dir, f".pid{rank}"), os.path.join(pid_dir, f"pid{rank}"))  # whole, when seen
    time.sleep(60)


def return_only_rank(rank_to_return):
    """That local rank returns its rank at once; the others sleep until stopped."""
    if int(os.environ["LOCAL_RANK"]) == rank_to_return:
        return rank_to_return
    time.sleep(60)


def process_identity(authkey_hex):
    """How multiprocessing sees this rank: its name and identity, its parent (name, whether it is
    this process's parent, whether alive), whether it has `authkey_hex` as its authkey, and the
    start method its own children would get."""
    import multiprocessing

    me, parent = multiprocessing.current_process(), multiprocessing.parent_process()
    return [me.name, list(me._identity), parent and [parent.name, parent.pid == os.getppid(), parent.is_alive()],
            me.authkey.hex() == authkey_hex, multiprocessing.get_start_method(allow_none=True)]


def read_stdin_line():
    return sys.stdin.readline()


def put_rank_in(queue):
    """Put this local rank in `queue` (a Manager's, shared with the caller)."""
    queue.put(int(os.environ["LOCAL_RANK"]))
    return "put"
