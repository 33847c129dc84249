"""A rank for the rendezvous tests: prints where the round placed it, then does what argv says.

    print           nothing more
    allreduce       a gloo all_reduce of the rank numbers over the whole job; prints the sum
    wait-world N    while WORLD_SIZE < N, all_reduces over and over until stopped (or until a peer
                    stopped breaks the collective); with N ranks, one all_reduce
    fail-first R    global rank R exits 3 in attempt 0; the others wait until stopped in attempt 0
    allreduce-fail-first R  allreduce, then as fail-first (every attempt all-reduces, in a group of its own)
    allreduce-until-file P  allreduce, then as until-file
    allreduce-busy-fail-first R  as allreduce-fail-first, but in attempt 0 the others all_reduce over and
                    over (in a collective when R fails) until the collective breaks or they are stopped
    fail R          global rank R exits 3; the others wait until stopped
    kill R          global rank R dies by SIGKILL; the others wait until stopped
    until-file P    waits until file P exists, then exits 0
    local-pair PORT local rank 1 holds a connection to local rank 0 on PORT (both print UP); once it is
                    gone, local rank 0 exits 1, as a collective's peer of a lost rank fails; in a later
                    attempt every rank exits 0 at once
    busy-until-file P  all_reduces over and over (prints BUSY after the first) until rank 0 sees file P:
                    then every rank exits 0 at the same step
    say-until-file P TEXT  prints TEXT to stderr, then as until-file
    fail-on-file R P  global rank R waits until file P exists, then exits 3; the others exit 0
    fail-on-file-then-until R P Q  as fail-on-file in attempt 0; in later attempts every rank waits
                    until file Q exists, then exits 0
"""
import json
import os
import sys
import time

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT")
print("PLACED " + json.dumps({k: os.environ.get(k) for k in NAMES}), flush=True)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
mode, rest = sys.argv[1], sys.argv[2:]
arg = int(rest[0]) if rest and mode not in ("until-file", "say-until-file", "busy-until-file", "allreduce-until-file") else 0


def wait_until_stopped() -> None:
    while True:
        time.sleep(60)


def allreduce(until_stopped: bool = False, fails: bool = False) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print(f"SUM {t.item():g} world {dist.get_world_size()}", flush=True)
    if fails:  # at once: sys.exit ran gloo's teardown with its threads still busy (SIGABRT, 1 run in 4)
        sys.stdout.flush()
        os._exit(3)
    while until_stopped:
        dist.all_reduce(torch.tensor([1.0]))
        time.sleep(0.05)
    dist.destroy_process_group()


def busy_until_file(path: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print("BUSY", flush=True)
    while True:  # rank 0's look at the file is every rank's: they leave the collective together
        seen = torch.tensor([float(rank == 0 and os.path.exists(path))])
        dist.all_reduce(seen)
        if seen.item():
            break
        time.sleep(0.05)
    dist.destroy_process_group()


def local_pair(port: int) -> None:
    import socket

    if attempt > 0:
        return
    # Its pair's word (both are children of the same ranktop): the port is only a free one, and a
    # rank of another test that picked it too (or a connection to itself, an ephemeral source port
    # equal to it) is no peer, whose end would never come.
    word = f"{os.getppid():>12}".encode()
    if os.environ["LOCAL_RANK"] == "0":
        server = socket.create_server(("127.0.0.1", port))
        while True:
            conn, _ = server.accept()
            conn.settimeout(10)
            try:
                if conn.recv(len(word), socket.MSG_WAITALL) == word:
                    break
            except OSError:
                pass
            conn.close()
        conn.settimeout(None)
        print("UP", flush=True)
        if not conn.recv(1):
            print("RuntimeError: Connection closed by peer", flush=True)
            sys.exit(1)
        return
    for _ in range(500):
        try:
            peer = socket.create_connection(("127.0.0.1", port))  # held until killed
            if peer.getsockname() != peer.getpeername():
                peer.sendall(word)
                break
            peer.close()
        except OSError:
            pass
        time.sleep(0.02)
    print("UP", flush=True)
    wait_until_stopped()


if mode == "allreduce":
    allreduce()
elif mode == "local-pair":
    local_pair(arg)
elif mode == "busy-until-file":
    busy_until_file(rest[0])
elif mode == "wait-world":
    allreduce(until_stopped=world < arg)
elif mode == "allreduce-busy-fail-first":
    allreduce(until_stopped=attempt == 0, fails=rank == arg and attempt == 0)
elif mode == "allreduce-fail-first":
    allreduce()
    if rank == arg and attempt == 0:
        sys.exit(3)
    if attempt == 0:
        wait_until_stopped()
elif mode == "kill":
    if rank == arg:
        os.kill(os.getpid(), 9)
    wait_until_stopped()
elif mode in ("fail-first", "fail"):
    if rank == arg and (mode == "fail" or attempt == 0):
        sys.exit(3)
    if mode == "fail" or attempt == 0:
        wait_until_stopped()
elif mode == "fail-on-file-then-until" and attempt > 0:
    while not os.path.exists(rest[2]):
        time.sleep(0.05)
elif mode in ("fail-on-file", "fail-on-file-then-until"):
    while rank == arg and not os.path.exists(rest[1]):
        time.sleep(0.05)
    sys.exit(3 if rank == arg else 0)
elif mode in ("until-file", "say-until-file", "allreduce-until-file"):
    if mode == "allreduce-until-file":
        allreduce()
    if mode == "say-until-file":
        print(rest[1], file=sys.stderr, flush=True)
    while not os.path.exists(rest[0]):
        time.sleep(0.05)
