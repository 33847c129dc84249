"""Clients of a run's socket that misbehave: silent, half-spoken, never reading, many at once, or
arriving as the run ends. None of them may cost the run its output, its end or its exit status;
each is kept only as long as it is of use; and the clients ranktop ships go on when the engine
ends one of their connections."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pty
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT, make_agent, ranktop_cmd, run_ranktop, screen_rows, stop_process, until, wait_for
from ranktop.core import protocol
from ranktop.core.state import GroupState

LINES = 30_000
# The ranks wait for the test's clients, then print LINES lines each; rank 1 fails.
FLOOD = f"""import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
for i in range({LINES}):
    sys.stdout.write(f'line {{i}} ' + 'x' * 60 + '\\n')
sys.exit(3 if os.environ['RANK'] == '1' else 0)
"""


@pytest.fixture
def runtime(monkeypatch):
    """A socket directory of this test's own, for the test's ranktop and for this process."""
    path = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", path)
    try:
        yield {**os.environ, "XDG_RUNTIME_DIR": path}
    finally:
        subprocess.run(["rm", "-rf", path], check=False)


def hello(path: str, *requests: dict, rcvbuf: int | None = None) -> socket.socket:
    """A raw client that said hello (and sent `requests`) and read the engine's hello."""
    conn = socket.socket(socket.AF_UNIX)
    if rcvbuf:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    conn.settimeout(10)
    conn.connect(path)
    conn.sendall(b"".join(protocol.encode_control(m) for m in (protocol.hello("client"), *requests)))
    head = conn.recv(5, socket.MSG_WAITALL)  # the hello's frame alone: a subscriber's pushes stay unread
    assert head[:1] == protocol.CONTROL and b'"type":"hello"' in conn.recv(int.from_bytes(head[1:], "big"), socket.MSG_WAITALL)
    return conn


def frames_until_closed(conn: socket.socket, timeout: float = 10) -> list:
    """Every frame the engine sends on `conn` until it closes it; fails after `timeout`."""
    conn.settimeout(timeout)
    decoder, frames = protocol.FrameDecoder(), []
    with contextlib.suppress(ConnectionResetError):
        while data := conn.recv(1 << 16):
            frames += decoder.feed(data)
    return frames


class Racer(threading.Thread):
    """Connects, says hello and asks for a snapshot again and again until stopped: some of its
    tries meet the run's end. Each must end in an answer or a closed connection, nothing else."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.path, self.stop, self.answered, self.problems = path, threading.Event(), 0, []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.socket(socket.AF_UNIX) as conn:
                    conn.settimeout(10)
                    conn.connect(self.path)
                    conn.sendall(protocol.encode_control(protocol.hello("client"))
                                 + protocol.encode_control({"type": "snapshot"}))
                    types = [f.get("type") for f in frames_until_hello_and(conn)]
                    self.answered += types == ["hello", "snapshot"]
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
                pass  # the engine had gone, or went while we spoke
            except Exception as exc:  # noqa: BLE001 - a hang (TimeoutError) or garbage: the test says which
                self.problems.append(repr(exc))


def frames_until_hello_and(conn: socket.socket) -> list:
    """The engine's hello and its answer, or what came before it closed the connection."""
    decoder, frames = protocol.FrameDecoder(), []
    while len(frames) < 2 and (data := conn.recv(1 << 16)):
        frames += decoder.feed(data)
    return frames


def test_clients_that_misbehave_cost_the_run_nothing(tmp_path, runtime):
    """A client that connects and says nothing, one that subscribes and never reads while the ranks
    flood, one that sends half a request, one that asks and never reads, thirty idle ones, and one
    that keeps connecting as the run ends: the run prints every line, ends with its own status,
    and its engine leaves, closing every connection."""
    script, go, out = tmp_path / "flood.py", tmp_path / "go", tmp_path / "out"
    script.write_text(FLOOD)
    with open(out, "wb") as out_file:
        proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--run-id", "rude", "--log-dir",
                                            str(tmp_path / "logs"), str(script), str(go)),
                                cwd=ROOT, env=runtime, stdout=out_file, stderr=subprocess.PIPE)
    path = os.path.join(runtime["XDG_RUNTIME_DIR"], "ranktop", "rude.sock")
    clients: list[socket.socket] = []
    racer = Racer(path)
    try:
        wait_for(lambda: os.path.exists(path), timeout=30, what="the run served")
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(path)
        lazy = hello(path, {"type": "subscribe"}, rcvbuf=4096)
        half = hello(path)
        half.sendall(protocol.encode_control({"type": "snapshot"})[:7])
        asker = hello(path, *[{"type": "snapshot"}] * 500, rcvbuf=4096)
        clients += [silent, lazy, half, asker] + [hello(path) for _ in range(30)]
        racer.start()
        go.touch()
        assert proc.wait(60) == 1  # rank 1's failure, as if nobody watched
        stderr = proc.stderr.read().decode()
    finally:
        racer.stop.set()
        stop_process(proc)
        proc.stderr.close()
        racer.join(30)
    assert not racer.is_alive() and racer.problems == []
    assert "rank 1 (local rank 1, pid " in stderr and "exited with code 3" in stderr and "Traceback" not in stderr, stderr
    printed = out.read_bytes().splitlines()
    for rank in (0, 1):  # every line on the console and in the log files
        assert sum(line.startswith(f"[default{rank}]:line ".encode()) for line in printed) == LINES
        log = tmp_path / "logs" / "rude" / "attempt_0" / str(rank) / "stdout.log"
        assert log.read_bytes().count(b"\n") == LINES
    for conn in clients:  # the engine closed every connection on its way out
        frames_until_closed(conn)
        conn.close()
    assert not os.path.exists(path)


# ----- the bounds, on a fake engine served by the real server (constants made short) -------------
@pytest.fixture
def served(runtime):
    """A FakeEngine served on a real socket: (engine, server)."""
    from fake_engine import FakeEngine
    from ranktop.core.server import serve

    engine = FakeEngine(2)
    server, problem = serve(engine, ["fake"])
    assert problem is None
    try:
        yield engine, server
    finally:
        server.close()


@pytest.fixture
def short_bounds(monkeypatch):
    from ranktop.core import server

    monkeypatch.setattr(server, "CHECK_SECONDS", 0.05)
    return server


def test_an_idle_client_is_dropped_and_a_follower_of_a_quiet_run_is_kept(served, short_bounds, monkeypatch):
    """A connection that says hello and then nothing held one of the 64 slots for good. It is
    dropped after IDLE_SECONDS, and told why; a `logs -f` of a run that prints nothing asks
    nothing either, and stays."""
    monkeypatch.setattr(short_bounds, "IDLE_SECONDS", 0.5)
    fake, server = served
    follower = hello(server.path, {"type": "subscribe"})
    idle = hello(server.path)
    (dropped,) = frames_until_closed(idle)
    assert dropped == {"type": "error", "message": "it asked nothing for 0.5s"}
    wait_for(lambda: server.clients == 1, what="the idle client counted out")  # the follower, as quiet, stays
    fake.print(0, "still here")
    decoder, frames = protocol.FrameDecoder(), []
    while not any(isinstance(f, protocol.Output) and b"still here" in f.data for f in frames):
        frames += decoder.feed(follower.recv(1 << 16))
    follower.close()


def test_a_commands_connection_saying_hello_again_is_counted_out_once(served):
    """An attached view's commands connection is not counted in `clients` (`ls`: one per view).
    Each hello that said so took one more off the count: a client saying it five times left a
    run listed with -4 clients, for good."""
    _, server = served
    view = hello(server.path)
    commands = hello(server.path, *[protocol.hello("client", commands=True)] * 5, {"type": "snapshot"})
    decoder, frames = protocol.FrameDecoder(), []
    while not any(isinstance(f, dict) and f.get("type") == "snapshot" for f in frames):
        frames += decoder.feed(commands.recv(1 << 16))
    assert [f["clients"] for f in frames if isinstance(f, dict) and f.get("type") == "snapshot"] == [1]
    commands.close()
    view.close()
    wait_for(lambda: server.clients == 0, what="both connections counted out")


def test_a_client_that_takes_nothing_of_what_it_is_sent_is_dropped(served, short_bounds, monkeypatch):
    """`logs -f | less` nobody reads: kept while it takes nothing, it held its slot and a push's
    worth of memory for as long as the run lasted."""
    monkeypatch.setattr(short_bounds, "UNREAD_SECONDS", 0.5)
    fake, server = served
    lazy = hello(server.path, {"type": "subscribe"}, rcvbuf=4096)
    fake.print(0, *(f"line {i} " + "x" * 100 for i in range(20_000)))  # more than its socket holds
    wait_for(lambda: server.clients == 0, what="the unreading client dropped")
    frames_until_closed(lazy)  # what its socket held, then the end: no hang
    lazy.close()


def test_an_attached_view_goes_on_after_the_engine_ends_its_connection(served, short_bounds, monkeypatch):
    """An attach suspended overnight (Ctrl-Z) has its connection dropped as idle: on its return it
    took the closed connection for the engine's end and showed the run as lost. It connects again."""
    from ranktop.core import commands as cmd
    from ranktop.core.client import RemoteEngine

    monkeypatch.setattr(short_bounds, "IDLE_SECONDS", 0.3)
    fake, server = served
    engine = RemoteEngine(server.path)
    try:
        wait_for(lambda: server.clients == 0, what="the idle view dropped")
        fake.group = dataclasses.replace(fake.group, attempt=1)
        snap = engine.snapshot()
        assert (snap.attempt, snap.ended, engine.gone) == (1, False, False)
        wait_for(lambda: server.clients == 0, what="the idle view dropped again")
        assert engine.submit(cmd.KillRank(0)).ok and fake.commands == [cmd.KillRank(0)]
    finally:
        engine.close()


def test_an_attached_view_whose_new_connection_is_slow_to_answer_never_takes_a_late_answer(served, short_bounds,
                                                                                           monkeypatch):
    """Asked again on a new connection after its old one was dropped, a view whose answer came late
    (the engine busy) kept that connection: the next request read the late answer, rank 0's lines
    shown as rank 1's, and every answer after it one behind. The connection is given up, as a slow
    answer on the first try gives it up."""
    from ranktop.core.client import RemoteEngine

    monkeypatch.setattr(short_bounds, "IDLE_SECONDS", 0.3)
    fake, server = served
    fake.print(0, "zero")
    fake.print(1, "one")
    engine = RemoteEngine(server.path)
    released, answer_of = threading.Event(), fake.output_since

    def slow_for_rank_0(local_rank, *args, **kwargs):
        if local_rank == 0:
            released.wait(10)  # past the client's second of silence: it gives this answer up
        return answer_of(local_rank, *args, **kwargs)

    try:
        wait_for(lambda: server.clients == 0, what="the idle view dropped")
        monkeypatch.setattr(fake, "output_since", slow_for_rank_0)
        assert engine.output_since(0, None)[1] == []  # not answered in time: nothing, for now
        released.set()
        assert wait_for(lambda: engine.output_since(1, None)[1], what="rank 1's lines") == [b"one"]
        assert engine.output_since(0, None)[1] == [b"zero"]
    finally:
        released.set()
        engine.close()


def test_the_end_waits_for_a_reading_follower_not_for_one_that_takes_nothing(served, short_bounds, monkeypatch):
    """On the way out the engine gave every client up to 2 s to take what it was owed: a follower
    that had stopped reading long before held the run's end for all of it. One that takes nothing
    for STUCK_SECONDS is given up; one that reads gets the rest and the end."""
    from ranktop.core.client import Connection

    monkeypatch.setattr(short_bounds, "SEND_TIMEOUT", 60.0)  # what a stuck client would hold the end for
    monkeypatch.setattr(short_bounds, "STUCK_SECONDS", 0.3)
    fake, server = served
    lazy = hello(server.path, {"type": "subscribe"}, rcvbuf=4096)
    reader = Connection(server.path)
    reader.subscribe([0])
    fake.print(0, *(f"line {i} " + "x" * 100 for i in range(20_000)))
    fake.end(GroupState.SUCCEEDED, 0)
    began = time.monotonic()
    closing = threading.Thread(target=server.close)
    closing.start()
    got = []
    for message, _lines in reader.pushed():
        got += [message] if message["type"] in ("output", "ended") else []
        if message["type"] == "ended":
            break
    closing.join(30)
    assert not closing.is_alive() and time.monotonic() - began < 30  # not the 60 s the lazy one could have had
    assert got[-1]["type"] == "ended" and got[-2]["line"] == 20_000
    reader.close()
    frames_until_closed(lazy)
    lazy.close()


def test_a_push_holds_a_bounded_share_of_each_ranks_output_and_loses_none(served, short_bounds, monkeypatch):
    """A push held up to 2 MiB of every subscribed rank's lines: with a few ranks flooding, one push
    was past the 16 MiB a client may owe, and a follower that was reading was dropped as too slow."""
    from ranktop.core.client import Connection

    monkeypatch.setattr(short_bounds, "MAX_PUSH_BYTES", 64 << 10)
    fake, server = served
    lines = [f"line {i} ".encode() + b"x" * 100 for i in range(3000)]
    for rank in (0, 1):
        fake.print(rank, *(line.decode() for line in lines))
    follower = Connection(server.path)
    follower.subscribe([0, 1])
    seen: dict[int, list[bytes]] = {0: [], 1: []}
    for message, got in follower.pushed():
        if message["type"] == "output":
            assert sum(len(line) + 1 for line in got) <= 32 << 10  # its rank's share
            seen[message["rank"]] += got
        if seen == {0: lines, 1: lines}:
            break
    follower.close()


def test_a_push_of_many_ranks_with_long_lines_stays_within_its_bound(runtime, short_bounds, monkeypatch):
    """Each rank's share of a push is at least one whole line: with many ranks each given a long
    line at once (a line is up to 64 KiB), one push held each rank's, far past the bound, and past
    what a client may owe, so a follower that was reading was dropped as too slow. A push stops
    at the bound; the ranks it did not reach come first in the next one."""
    from fake_engine import FakeEngine
    from ranktop.core.client import Connection
    from ranktop.core.server import serve

    monkeypatch.setattr(short_bounds, "MAX_PUSH_BYTES", 64 << 10)
    monkeypatch.setattr(short_bounds, "MAX_PENDING", 256 << 10)
    fake = FakeEngine(32)
    lines = {rank: [f"rank {rank} ".encode() + b"x" * (60 << 10)] for rank in range(32)}
    for rank, (line,) in lines.items():
        fake.print(rank, line.decode())
    server, problem = serve(fake, ["fake"])
    assert problem is None
    follower = Connection(server.path)
    try:
        follower.subscribe(list(range(32)))
        seen: dict[int, list[bytes]] = {rank: [] for rank in range(32)}
        for message, got in follower.pushed():
            if message["type"] == "output":
                seen[message["rank"]] += got
            if seen == lines:
                break
    finally:
        follower.close()
        server.close()


def test_logs_follow_whose_connection_the_engine_ends_says_the_run_goes_on(served, short_bounds, monkeypatch, runtime):
    """`logs -f` into a pipe nobody read: dropped by the engine, it said the run's engine was lost
    before its end, exit 1, of a run that went on."""
    monkeypatch.setattr(short_bounds, "UNREAD_SECONDS", 0.5)
    fake, server = served
    # More than its pipe and its socket hold (the kernel takes megabytes of a Unix socket's sends).
    fake.print(0, *(f"line {i} " + "x" * 100 for i in range(100_000)))
    follow = subprocess.Popen(ranktop_cmd("logs", "fake", "-f"), cwd=ROOT, env=runtime, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        assert follow.stdout.readline() == b"[0]:line 0 " + b"x" * 100 + b"\n"  # following; then read no more
        wait_for(lambda: server.clients == 0, what="logs -f dropped")
        out, err = follow.communicate(timeout=30)
    finally:
        stop_process(follow)
    assert follow.returncode == 1 and b"Traceback" not in err and err.count(b"\n") == 1, err
    assert err.decode().endswith("the run goes on, and ranktop logs fake -f follows it again\n"), err
    assert err.decode().startswith("ranktop: fake: the run's engine ended this connection"), err


# ----- logs -f ended by a signal ------------------------------------------------------------------
TWO_BURSTS = """import os, pathlib, sys, time
print('up', flush=True)
for burst in (1, 2):
    while not pathlib.Path(os.environ['GO'] + str(burst)).exists():
        time.sleep(0.02)
    sys.stdout.write(''.join(f'burst {i}\\n' for i in range(100000)))  # far more than a rank's ring keeps
    print('done', burst, flush=True)
while True:
    time.sleep(0.1)
"""


def _read_until(stream, line: bytes) -> None:
    while (got := stream.readline()) != line:
        assert got, f"logs -f ended before {line!r}"


def _at_default(sig: int) -> Callable[[], None]:
    """A child's preexec_fn: `sig` at its default, whatever this process got. Tests started in the
    background of a script (SIGINT ignored, as POSIX has it) or under nohup (SIGHUP) pass the
    ignored signal on, and `logs -f` rightly keeps it ignored: the signal sent did nothing and the
    test waited out its 30 s."""
    return lambda: signal.signal(sig, signal.SIG_DFL)


def _send_until_gone(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to `proc` again and again, as fast as it goes, until it has exited (send_signal
    reaps it first, and sends nothing once it has)."""
    while proc.poll() is None:
        proc.send_signal(sig)


@pytest.mark.parametrize("sig, flood", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGHUP, False),
                                        (signal.SIGINT, True), (signal.SIGTERM, True), (signal.SIGHUP, True)])
def test_logs_follow_ended_by_a_signal_says_the_total_of_lines_not_shown(tmp_path, runtime, sig, flood):
    """`logs -f` says how many lines of a rank it could not show at the first hole, and the total
    at its end: Ctrl-C said it, SIGTERM (kill, timeout) and SIGHUP (the SSH link dropped, with
    stderr kept in a file) ended it without a word. A flood of them (`flood`: Ctrl-C held down,
    `kill` again and again) ends it the same way: the next one, while logs put its handlers back
    or ended on the first, killed it (no total, no 143) or escaped as a Terminated traceback (a
    KeyboardInterrupt one, out of the code saying the total)."""
    script = tmp_path / "bursts.py"
    script.write_text(TWO_BURSTS)
    go = tmp_path / "go"
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "1", "--run-id", "bursts", "--log-dir",
                                        str(tmp_path / "logs"), str(script)),
                            cwd=ROOT, env={**runtime, "GO": str(go)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    path = os.path.join(runtime["XDG_RUNTIME_DIR"], "ranktop", "bursts.sock")
    try:
        wait_for(lambda: os.path.exists(path), timeout=30, what="the run served")
        follow = subprocess.Popen(ranktop_cmd("logs", "bursts", "-f"), cwd=ROOT, env=runtime,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_at_default(sig))
        try:
            _read_until(follow.stdout, b"[0]:up\n")
            log = tmp_path / "logs" / "bursts" / "attempt_0" / "0" / "stdout.log"
            for burst in (1, 2):  # each while logs -f waits on its full pipe: the ring moves past it
                Path(f"{go}{burst}").touch()
                wait_for(lambda b=burst: f"done {b}\n".encode() in log.read_bytes(), timeout=30,
                         what=f"burst {burst} written")
                _read_until(follow.stdout, f"[0]:done {burst}\n".encode())
            if flood:
                _send_until_gone(follow, sig)
            else:
                follow.send_signal(sig)
            _out, err = follow.communicate(timeout=30)
        finally:
            stop_process(follow)
    finally:
        stop_process(proc)
    said = [line for line in err.decode().splitlines() if " lines of rank 0 " in line]
    assert follow.returncode == 128 + sig and b"Traceback" not in err, err
    assert len(said) == 2 and " in all were not shown" in said[1], err  # the first hole, then the total
    first, total = (int(line.split(": ")[2].split()[0]) for line in said)
    assert 0 < first < total <= 200_000, err


def test_logs_read_slowly_asks_again_on_a_new_connection(served, short_bounds, monkeypatch, runtime):
    """`ranktop logs RUN | less`, read for longer than a client may stay idle: its next request met
    the closed connection and it ended, exit 0, as if it had printed everything."""
    monkeypatch.setattr(short_bounds, "IDLE_SECONDS", 0.3)
    fake, server = served
    lines = [f"line {i} " + "x" * 100 for i in range(30_000)]  # more than one answer holds
    fake.print(0, *lines)
    reader = subprocess.Popen(ranktop_cmd("logs", "fake"), cwd=ROOT, env=runtime, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, bufsize=0)  # (unbuffered: communicate() reads past a buffer)
    try:
        assert reader.stdout.readline() == f"[0]:{lines[0]}\n".encode()  # then read no more for a while
        wait_for(lambda: server.clients == 0, what="logs dropped as idle")
        out, err = reader.communicate(timeout=30)
    finally:
        stop_process(reader)
    assert (reader.returncode, err) == (0, b"")
    assert out.decode().splitlines() == [f"[0]:{line}" for line in lines[1:]]


@pytest.mark.parametrize("nohup", [False, True])
def test_logs_follow_whose_terminal_hangs_up_ends_without_a_traceback(served, runtime, tmp_path, nohup):
    """The terminal `logs -f` writes to hangs up under it: the kernel sends SIGHUP, and every write
    to it fails (EIO) from then on. It ends as on SIGTERM, exit 129 (SIGHUP killed it). Started
    with SIGHUP ignored (nohup, stderr kept in a file), it stays ignored, and the first write
    that fails ends logs with one line, exit 1: it was a traceback."""
    fake, _server = served
    fake.print(0, *(f"line {i} " + "x" * 100 for i in range(100_000)))  # far more than a terminal holds
    err = tmp_path / "err"
    pid, master = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal, its stdin, stdout and stderr
        try:
            os.chdir(ROOT)
            if nohup:
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT, 0o600), 2)
            os.execve(sys.executable, ranktop_cmd("logs", "fake", "-f"), {**runtime, "PYTHONPATH": str(ROOT)})
        finally:
            os._exit(127)
    status = None
    try:
        shown = b""
        while b"[0]:line 0 " not in shown:  # following; then nobody reads: its writes wait on the terminal
            shown += os.read(master, 1 << 16)
        os.close(master)  # the hang-up
        master = -1
        (status,) = wait_for(lambda: _reaped(pid), what="logs -f ended by the hang-up")
    finally:
        if master >= 0:
            os.close(master)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if not nohup:
        assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP
        return
    assert os.waitstatus_to_exitcode(status) == 1
    assert err.read_text() == "ranktop: fake: logs cannot write its output (Input/output error)\n"


def _reaped(pid: int) -> tuple[int] | None:
    """(its wait status) once the child `pid` has ended, reaped; None while it runs."""
    done, status = os.waitpid(pid, os.WNOHANG)
    return (status,) if done else None


# ----- logs after its engine left -----------------------------------------------------------------
def _ended_in(fake, run_dir: Path, lines: list[str]) -> None:
    """End the fake run, with its final.json and rank 0's stdout.log in `run_dir`, as an engine leaves them."""
    from ranktop.core.server import to_json

    log = run_dir / "attempt_0" / "0" / "stdout.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"{line}\n" for line in lines))
    fake.set_rank(0, stdout_log=str(log))
    fake.group = dataclasses.replace(fake.group, log_dir=str(run_dir))
    fake.end(GroupState.FAILED, 1)
    (run_dir / "final.json").write_text(json.dumps(to_json(fake.snapshot())))


def test_logs_follow_not_waited_for_at_the_end_says_how_the_run_ended(served, short_bounds, monkeypatch, runtime,
                                                                      tmp_path):
    """`logs -f` that had taken nothing for a second when the run ended (its reader paused) is not
    waited for: it missed the "ended" push and said `lost the run's engine before its end`, exit 1,
    though final.json said how the run ended. It says that, and where the rest is, exit 0."""
    monkeypatch.setattr(short_bounds, "STUCK_SECONDS", 0.3)
    fake, server = served
    fake.group = dataclasses.replace(fake.group, log_dir=str(tmp_path / "run"))
    lines = [f"line {i} " + "x" * 100 for i in range(100_000)]  # more than its pipe and its socket hold
    fake.print(0, *lines)
    follow = subprocess.Popen(ranktop_cmd("logs", "fake", "-f"), cwd=ROOT, env=runtime, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        assert follow.stdout.readline() == f"[0]:{lines[0]}\n".encode()  # following; then read no more for now
        _ended_in(fake, tmp_path / "run", lines)
        server.close()  # given up on logs -f after 0.3 s
        out, err = follow.communicate(timeout=30)
    finally:
        stop_process(follow)
    assert follow.returncode == 0 and len(out.splitlines()) < len(lines), err
    assert err.decode() == (f"ranktop: fake has ended (failed, exit status 1); its engine left before logs took all "
                            f"of its output: the rest is in its log files under {tmp_path / 'run'}\n")


def test_logs_follow_that_comes_as_the_run_ends_prints_its_logs(served, runtime, tmp_path, monkeypatch):
    """`logs -f` that connects as the run ends, its subscription never answered (the engine was on
    its way out): it exited 0 having printed nothing. It prints what `logs` of the ended run
    prints, the end of each rank's log files, and how the run ended."""
    fake, server = served
    lines = [f"line {i}" for i in range(3)]
    fake.group = dataclasses.replace(fake.group, log_dir=str(tmp_path / "run"))  # (as ls tells logs)

    def leave(conn, _message) -> None:  # the engine goes as the subscription comes: its socket first
        _ended_in(fake, tmp_path / "run", lines)
        os.unlink(server.path)
        server._drop(conn)

    monkeypatch.setattr(server, "_subscribe", leave)
    follow = run_ranktop("logs", "fake", "-f", env=runtime, timeout=30)
    assert (follow.returncode, follow.stdout) == (0, "".join(f"[0]:{line}\n" for line in lines)), follow.stderr
    assert follow.stderr == (f"ranktop: fake has ended (failed); its engine has left: that was the last MiB of each "
                             f"rank's stdout.log and stderr.log; all its log files are under {tmp_path / 'run'}\n")


# ----- a client that asks without pause -----------------------------------------------------------
def _unread(conn: socket.socket) -> int:
    """Bytes `conn` sent that its peer has not read yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def _acks(conn: socket.socket, count: int) -> list[dict]:
    decoder, acks = protocol.FrameDecoder(), []
    while len(acks) < count:
        acks += [f for f in decoder.feed(conn.recv(1 << 16)) if isinstance(f, dict) and f.get("type") == "ack"]
    return acks


def test_a_client_that_asks_without_pause_is_answered_in_turns_with_the_others(served):
    """A client that sends requests without waiting for answers had all that one read of its
    socket held (64 KiB: hundreds) answered before any other client was looked at, and kept the
    server thread from the engine's threads meanwhile. Each client is answered a few a round: a
    request from another client is answered in the next round, and the flood's all are, in order."""
    from ranktop.core import commands as cmd

    fake, server = served
    flooder, other = hello(server.path), hello(server.path)
    flood = [protocol.encode_control({"type": "command", "id": i, "command": "SendInput",
                                      "args": {"local_rank": 0, "text": str(i)}}) for i in range(300)]
    assert len(b"".join(flood)) < 1 << 16  # one read of the server's takes them all
    wait_for(lambda: _unread(flooder) == _unread(other) == 0, what="the hellos read")
    with fake._lock:  # the engine held: the flood's first command waits in it, and holds the rest back
        flooder.sendall(b"".join(flood))
        wait_for(lambda: _unread(flooder) == 0, what="the flood read")
        other.sendall(protocol.encode_control({"type": "command", "id": "other", "command": "KillRank",
                                               "args": {"local_rank": 1}}))
        # The other client is served while the flood's first still waits (not after all 300, as it
        # was). Which of their threads the engine then takes first is up to the lock and the
        # scheduler, not the server: checked on what applied them, it was 26th, then 41st, of a
        # flood on a loaded box.
        wait_for(lambda: len(fake.asked) == 2, what="the other client's command at the engine")
        assert fake.asked == [cmd.SendInput(0, "0"), cmd.KillRank(1)]
    assert _acks(other, 1)[0]["id"] == "other"
    assert [ack["id"] for ack in _acks(flooder, len(flood))] == list(range(len(flood)))
    assert [c.text for c in fake.commands if isinstance(c, cmd.SendInput)] == [str(i) for i in range(len(flood))]
    flooder.close()
    other.close()



def test_a_burst_of_clients_while_the_server_is_busy_waits_in_the_queue_and_is_served(served):
    """Connections wait in the listen queue while the server thread answers a request. It held 16,
    and the server took one a round, so past them a connect failed at once (EAGAIN), whatever its
    time-out: of 20 `ranktop ls` started at once on an idle run, 3 said the engine did not answer.
    A burst of as many clients as it serves waits, and each is answered once the server is back."""
    fake, server = served
    asker = hello(server.path)
    wait_for(lambda: _unread(asker) == 0, what="the hello read")
    burst = []
    with fake._lock:  # the engine held: the server thread waits in the snapshot asked for
        asker.sendall(protocol.encode_control({"type": "snapshot"}))
        wait_for(lambda: _unread(asker) == 0, what="the snapshot asked")
        for _ in range(40):
            conn = socket.socket(socket.AF_UNIX)
            burst.append(conn)
            conn.setblocking(False)
            conn.connect(server.path)  # (BlockingIOError: the queue was full)
            conn.setblocking(True)
            conn.settimeout(10)
            conn.sendall(protocol.encode_control(protocol.hello("client")) + protocol.encode_control({"type": "snapshot"}))
    for conn in [asker, *burst]:
        decoder, frames = protocol.FrameDecoder(), []
        while not any(isinstance(f, dict) and f.get("type") == "snapshot" for f in frames):
            frames += decoder.feed(conn.recv(1 << 16))
        conn.close()
    wait_for(lambda: server.clients == 0, what="every client counted out")



def test_the_requests_ahead_of_a_bad_frame_are_answered_however_they_were_read(served):
    """A command and a bad frame behind it, in one read of the server's: the frames decoded ahead
    of the bad one were lost with it, so the command was not applied, though sent in two parts it
    was, and answered. Same bytes, either way: the command is applied and answered, then the
    client is dropped with why."""
    from ranktop.core import commands as cmd

    fake, server = served
    conn = socket.socket(socket.AF_UNIX)
    conn.settimeout(10)
    conn.connect(server.path)
    conn.sendall(protocol.encode_control(protocol.hello("client"))
                 + protocol.encode_control({"type": "command", "id": 7, "command": "KillRank", "args": {"local_rank": 1}})
                 + b"X\0\0\0\0")
    frames = frames_until_closed(conn)
    conn.close()
    assert [(f["type"], f.get("id"), f.get("message")) for f in frames] == [
        ("hello", None, None), ("ack", 7, "fake: KillRank"),
        ("error", None, "unknown frame type b'X': not a ranktop connection")]
    assert fake.commands == [cmd.KillRank(1)]


# ----- a dropped client is told why -----------------------------------------------------------------
def test_a_subscriber_dropped_as_unread_is_told_why_after_the_frame_it_was_in(served, short_bounds, monkeypatch):
    """The reason went out behind all the client had not taken, in one send that could not wait,
    so it was lost and the client saw only the end. It comes after the frame the client was in
    the middle of (what it owed past that is let go): once it reads again it gets whole frames,
    then why."""
    monkeypatch.setattr(short_bounds, "UNREAD_SECONDS", 0.5)
    fake, server = served
    lazy = hello(server.path, {"type": "subscribe"}, rcvbuf=4096)
    fake.print(0, *(f"line {i} " + "x" * 100 for i in range(20_000)))  # more than its socket holds
    wait_for(lambda: server.clients == 0, what="the unreading client dropped")
    frames = frames_until_closed(lazy)  # (a frame cut in two would fail to decode)
    assert frames[-1]["type"] == "error" and frames[-1]["message"].startswith("it took none of the "), frames[-1]
    lazy.close()


def test_a_client_dropped_as_too_slow_is_told_why(served, short_bounds, monkeypatch):
    """A client that asks and reads too slowly owes more than MAX_PENDING: once it reads it gets
    the answers already in its socket, then why it was dropped."""
    monkeypatch.setattr(short_bounds, "MAX_PENDING", 64 << 10)
    fake, server = served
    greedy = hello(server.path, rcvbuf=4096)
    ask = protocol.encode_control({"type": "snapshot"})
    with contextlib.suppress(OSError):  # (dropped while it still sends)
        greedy.sendall(ask * 2000)
    wait_for(lambda: server.clients == 0, what="the greedy client dropped")
    frames = frames_until_closed(greedy)
    assert {f["type"] for f in frames[:-1]} == {"snapshot"} and frames[-1]["type"] == "error", frames[-1]
    assert frames[-1]["message"].startswith("too slow: "), frames[-1]
    greedy.close()


def test_logs_follow_dropped_within_a_push_says_why(served, short_bounds, monkeypatch, runtime):
    """`logs -f` dropped in the middle of a push (it took less than the push held) said only that
    the engine had ended the connection: the reason was lost behind the push, and the push's
    last frame never came. It says why, and that the run goes on. (It is stopped while the push
    is made: left to read, a quick one took the whole push, was never dropped, and followed on
    until the test's 30 s ran out, one run in three on a 2-core box.)"""
    monkeypatch.setattr(short_bounds, "MAX_PENDING", 64 << 10)  # one push is past it: dropped on the first
    fake, server = served
    fake.print(0, "ready")
    follow = subprocess.Popen(ranktop_cmd("logs", "fake", "-f"), cwd=ROOT, env=runtime, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert "ready" in follow.stdout.readline()  # it follows
        follow.send_signal(signal.SIGSTOP)  # it takes nothing while the push is made
        fake.print(0, *(f"line {i} " + "x" * 100 for i in range(20_000)))
        wait_for(lambda: server.clients == 0, what="the follower dropped")
        follow.send_signal(signal.SIGCONT)
        _, err = follow.communicate(timeout=30)
    finally:
        if follow.poll() is None:
            follow.send_signal(signal.SIGCONT)
            stop_process(follow)
    assert follow.returncode == 1 and err.count("\n") == 1, err
    assert err.startswith("ranktop: fake: the run's engine ended this connection (too slow: "), err
    assert err.endswith("; the run goes on, and ranktop logs fake -f follows it again\n"), err


def test_an_attached_view_whose_connection_is_dropped_says_why(served, short_bounds, monkeypatch):
    """An attached view dropped as idle (suspended overnight) found the engine's reason unread
    behind its failed request, and connected again without a word. It can say why."""
    from ranktop.core.client import RemoteEngine

    monkeypatch.setattr(short_bounds, "IDLE_SECONDS", 0.3)
    fake, server = served
    engine = RemoteEngine(server.path)
    try:
        assert engine.take_dropped() is None
        wait_for(lambda: server.clients == 0, what="the idle view dropped")
        assert not engine.snapshot().ended
        assert engine.take_dropped() == "it asked nothing for 0.3s"
        assert engine.take_dropped() is None  # said once
    finally:
        engine.close()


def test_an_attached_view_dropped_then_refused_says_why_once_it_connects_again(served, short_bounds, monkeypatch):
    """Dropped as idle, an attached view found every slot taken when it connected again: why it
    had been dropped was lost, and when a later try got in it said nothing. It says why once a
    new connection has taken the old one's place (not before: it is not connected meanwhile)."""
    from ranktop.core.client import RemoteEngine

    monkeypatch.setattr(short_bounds, "IDLE_SECONDS", 0.3)
    monkeypatch.setattr(short_bounds, "MAX_CLIENTS", 1)
    monkeypatch.setattr(short_bounds, "SPARE_CLIENTS", 0)
    fake, server = served
    engine = RemoteEngine(server.path)
    blocker = None
    try:
        wait_for(lambda: server.clients == 0, what="the idle view dropped")
        blocker = hello(server.path, {"type": "subscribe"})  # a follower, never idle: it holds the one slot
        assert not engine.snapshot().ended  # asked: dropped, and refused a new connection
        assert engine.take_dropped() is None
        blocker.close()
        wait_for(lambda: server.clients == 0, what="the slot free again")
        wait_for(lambda: not engine.snapshot().ended and server.clients == 1, what="the view connected again")
        assert engine.take_dropped() == "it asked nothing for 0.3s"
    finally:
        if blocker is not None:
            blocker.close()
        engine.close()


def test_an_attached_tui_whose_connection_is_dropped_says_why_and_goes_on(served, short_bounds, monkeypatch):
    """The TUI's line was documented with the test above, which reads the engine's reason only:
    nothing showed that the screen says it. Dropped between two of its ticks, it says why, once a
    new connection took the old one's place, and shows what comes on it."""
    from ranktop.core.client import RemoteEngine
    from test_tui_app import notes
    from test_tui_fake import drive

    monkeypatch.setattr(short_bounds, "IDLE_SECONDS", 0.05)  # shorter than a tick: dropped between two
    fake, server = served
    said = "the run's engine ended this view's connection (it asked nothing for 0.05s); the view connected again"

    async def body(app, pilot):
        await until(pilot, lambda: said in notes(app), what="why it was dropped")
        fake.print(0, "still here")
        await until(pilot, lambda: any("still here" in row for row in screen_rows(app)), what="the view going on")

    drive(RemoteEngine(server.path), body)


def subscribed(path: str) -> socket.socket:
    """A raw client that subscribed to all ranks, once the engine said so."""
    follower = hello(path, {"type": "subscribe"})
    decoder, frames = protocol.FrameDecoder(), []
    while not any(isinstance(f, dict) and f.get("type") == "subscribed" for f in frames):
        frames += decoder.feed(follower.recv(1 << 16))
    return follower


def test_a_push_that_fails_on_the_way_out_costs_its_subscriber_not_the_end(served):
    """A push that raised while the server ran cost its subscriber only; the same push made on
    the way out (the rest of the output and the end) raised out of close(): the socket stayed,
    and a headless run ended in a traceback instead of its end report and exit status."""
    closed_with_a_subscriber_while_failing(*served, "output_since")


def closed_with_a_subscriber_while_failing(fake, server, method: str) -> None:
    """Close `server` with a subscriber while the engine's `method` raises on the closing thread
    (the server's own thread pushes on unharmed): the socket goes, and the subscriber is told why."""
    follower = subscribed(server.path)
    answer_of, closing = getattr(fake, method), threading.current_thread()

    def failing_on_the_way_out(*args, **kwargs):
        if threading.current_thread() is closing:
            raise RuntimeError("a bug")
        return answer_of(*args, **kwargs)

    setattr(fake, method, failing_on_the_way_out)
    server.close()
    assert not os.path.exists(server.path)
    assert frames_until_closed(follower)[-1] == {"type": "error", "message": "push failed: RuntimeError: a bug"}
    follower.close()


# Prints 1.5 MB (more than a socket holds) and waits to be dumped.
PRINTS_AND_WAITS = """import time
for i in range(1500):
    print(f'{i:04} ' + 'x' * 1000)
time.sleep(60)
"""


def test_a_client_that_sends_its_end_of_file_after_asking_gets_its_whole_answer(tmp_path, runtime):
    """A client that sends its requests and then its end of file (shutdown(SHUT_WR), as a script
    through `socat` does) had its connection closed at that end of file: an answer larger than
    its socket took at once was cut off, without a word, and a stack dump's answer, which comes
    later from a thread of its own, never came. What it is owed goes before the close, the dump's
    answer too. A real engine and rank: the dump is py-spy's."""
    from ranktop.core.engine import LocalEngine
    from ranktop.core.server import serve

    engine = LocalEngine(make_agent(tmp_path, PRINTS_AND_WAITS, n=1, name="w.py")).start()
    server = None
    try:
        wait_for(lambda: len(engine.output_since(0, None)[1]) == 1500, what="the rank's lines in its ring")
        server, problem = serve(engine, ["eof"])
        assert problem is None
        submit, end_read = engine.submit, threading.Event()

        def after_the_end_of_file(command):  # the dump still runs when the end of file is read
            end_read.wait(10)
            return submit(command)

        engine.submit = after_the_end_of_file
        conn = hello(server.path, {"type": "output", "rank": 0, "generation": -1, "line": 0},
                     {"type": "command", "id": 1, "command": "DumpStacks", "args": {"save": False}})
        conn.shutdown(socket.SHUT_WR)
        wait_for(lambda: server.clients == 0, what="its end of file read")  # (before it reads any of the answer)
        end_read.set()
        head, done, unfinished, ack = frames_until_closed(conn, timeout=30)
        conn.close()
    finally:
        if server is not None:
            server.close()
        engine.close()
    assert (head["type"], head["lines"], head["more"]) == ("output", 1500, False), head
    assert done.data.split(b"\n")[-1].startswith(b"1499 ") and unfinished.data == b""
    assert (ack["type"], ack["id"], ack["ok"]) == ("ack", 1, True), ack
    (dumped,) = ack["report"]["ranks"]
    assert dumped["status"] == "ok" and dumped["threads"][0]["frames"], dumped


def test_a_stack_dump_that_outlasts_its_client_and_the_server_writes_into_no_file(served, short_bounds, monkeypatch,
                                                                                   tmp_path):
    """A client that sent its end of file waits for its dump's answer DUMP_FAREWELL_SECONDS at most:
    its connection is closed then, the dump still running. A dump's thread wakes the server's
    thread with a byte in its pipe: one that ended after close() wrote it by the pipe's descriptor
    number, closed by then, and perhaps taken by another file of the process since: a byte written
    into someone else's file. It writes nothing."""
    monkeypatch.setattr(short_bounds, "DUMP_FAREWELL_SECONDS", 0.2)
    fake, server = served
    submit, started, release = fake.submit, threading.Event(), threading.Event()

    def held(command):
        started.set()
        release.wait(10)
        return submit(command)

    fake.submit = held
    before = set(threading.enumerate())
    asker = hello(server.path, {"type": "command", "id": 1, "command": "DumpStacks", "args": {}})
    wait_for(started.is_set, what="the dump running")
    (dumper,) = [t for t in threading.enumerate() if t not in before and t.name == "ranktop-server-dump"]
    asker.shutdown(socket.SHUT_WR)
    assert frames_until_closed(asker, timeout=5) == [] and dumper.is_alive()  # not waited for past the bound
    asker.close()
    wake = server._wake_w
    server.close()
    other = tmp_path / "other"
    fd = os.open(other, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if fd != wake:  # the pipe's number, free since the close, given to this file
            with pytest.raises(OSError):
                os.fstat(wake)
            os.dup2(fd, wake)
        release.set()
        dumper.join(10)
        assert not dumper.is_alive()
    finally:
        os.close(fd)
        if fd != wake:
            os.close(wake)
    assert other.read_bytes() == b""


def test_a_snapshot_that_fails_for_a_push_costs_the_subscribers_not_the_server(served):
    """A push's snapshot was taken outside the guard that makes a failed push cost its subscriber
    only: an engine's snapshot that raised there ended the server's thread, and every client
    after it (`ls`, `stop`) found the engine not answering. The subscribers are told why."""
    fake, server = served
    follower = subscribed(server.path)
    snapshot_of, failed = fake.snapshot, threading.Event()

    def failing_once():
        if threading.current_thread().name == "ranktop-server" and not failed.is_set():
            failed.set()  # (the server's next snapshot is the next push's: nothing else asks)
            raise RuntimeError("a bug")
        return snapshot_of()

    fake.snapshot = failing_once
    assert frames_until_closed(follower)[-1] == {"type": "error", "message": "push failed: RuntimeError: a bug"}
    follower.close()
    asker = hello(server.path, {"type": "snapshot"})
    (answer,) = protocol.FrameDecoder().feed(asker.recv(1 << 20))
    assert answer["type"] == "snapshot"  # the server goes on
    asker.close()


def test_a_follower_that_can_take_nothing_more_is_dropped_as_idle(served, short_bounds, monkeypatch):
    """A subscriber that shut its reading side (its pushes fail: EPIPE) follows nothing it can
    take, yet counted as a follower, never idle: it held one of the slots for as long as the
    run lasted. It is dropped as one that asks nothing."""
    monkeypatch.setattr(short_bounds, "IDLE_SECONDS", 0.3)
    fake, server = served
    follower = subscribed(server.path)
    follower.shutdown(socket.SHUT_RD)
    fake.print(0, "a line it cannot take")
    wait_for(lambda: server.clients == 0, what="the follower that takes nothing dropped")
    follower.close()


def test_a_stack_dump_that_fails_is_answered_and_its_client_not_left_waiting(served):
    """A dump is answered from a thread of its own; one whose engine raised ended that thread with
    no answer: the client waited out its 60 s, and, counted as waiting for a dump, was never
    dropped as idle. It is answered at once, saying why it failed."""
    fake, server = served

    def failing(command):
        raise RuntimeError("a bug")

    fake.submit = failing
    asker = hello(server.path, {"type": "command", "id": 7, "command": "DumpStacks", "args": {}})
    asker.settimeout(5)
    (ack,) = protocol.FrameDecoder().feed(asker.recv(1 << 16))
    assert ack == {"type": "ack", "id": 7, "ok": False, "message": "stack dump failed: RuntimeError: a bug"}
    asker.close()


def test_stack_dumps_asked_without_waiting_run_a_few_at_a_time_and_the_rest_are_refused(served):
    """Each stack dump asked for started a thread (and py-spy on every rank) at once: one client
    that sent 400 without waiting had 400 running. MAX_DUMPS run at once; one asked past them is
    refused at once, saying why, and one asked once they are done runs."""
    from ranktop.core.server import MAX_DUMPS

    fake, server = served
    dump = [{"type": "command", "id": i, "command": "DumpStacks", "args": {}} for i in range(MAX_DUMPS + 2)]
    with fake._lock:  # the engine slow to answer: the dumps are all under way
        asker = hello(server.path, *dump)
        refused = _acks(asker, 2)
    assert [(a["id"], a["ok"]) for a in refused] == [(MAX_DUMPS, False), (MAX_DUMPS + 1, False)], refused
    assert refused[0]["message"] == f"{MAX_DUMPS} stack dumps are under way already: ask again once they are done"
    assert sorted((a["id"], a["ok"]) for a in _acks(asker, MAX_DUMPS)) == [(i, True) for i in range(MAX_DUMPS)]
    asker.sendall(protocol.encode_control({**dump[0], "id": "again"}))
    assert _acks(asker, 1)[0] | {"message": ""} == {"type": "ack", "id": "again", "ok": True, "message": "",
                                                    "report": None}
    asker.close()


def test_a_snapshot_that_fails_on_the_way_out_costs_the_subscribers_not_the_end(served):
    """The last pushes' snapshot was taken outside the guard a push has while the server runs:
    one that raised on the way out went out of close() (the socket stayed, and a headless run
    ended in a traceback). The subscribers are told why, the socket goes."""
    closed_with_a_subscriber_while_failing(*served, "snapshot")


def test_a_stack_dump_whose_answer_cannot_be_framed_drops_its_client(served):
    """A dump's ack repeats the request's id: an id that filled most of a frame made every answer
    too large to frame, the failure's too, and the dump's thread ended in a traceback with no
    answer (the client, counted as waiting for a dump, was never dropped as idle). It is dropped,
    told why."""
    fake, server = served
    request = {"type": "command", "id": "", "command": "DumpStacks", "args": {}}
    request["id"] = "x" * (protocol.MAX_CONTROL - len(protocol.encode_control(request)) + 5)  # the frame full
    asker = hello(server.path, request)
    (error,) = frames_until_closed(asker)
    assert error["type"] == "error" and error["message"].startswith("stack dump failed: ProtocolError: control "
                                                                    "message of "), error
    asker.close()
    wait_for(lambda: server.clients == 0, what="the client dropped")
