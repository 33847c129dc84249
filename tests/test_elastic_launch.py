"""`elastic_launch`/`LaunchConfig`/`launch_agent` side by side with torch 2.13's own
(`torch.distributed.launcher.api`), each launcher in a subprocess of its own, with real ranks. The
bodies compared side by side run in one batch per launcher (the `launched` fixture), a fork each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT
from ranktop.core.spec import free_port

PY = sys.executable
TESTS = str(ROOT / "tests")
# The first test to ask for the `launched` batch pays for all of it (16 launches, ~25 s alone):
# on a box loaded past its cores it ran past pytest-timeout's 120 s.
pytestmark = pytest.mark.timeout(360)

# One implementation's names imported, and what a body reports with; a body prints one `RESULT <json>` line.
_NAMES = textwrap.dedent("""
    import json, os, sys
    impl = sys.argv[1]
    if impl == "torch":
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch, launch_agent
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    else:
        from ranktop.core import LaunchConfig, elastic_launch, launch_agent, DefaultLogsSpecs, Std, ChildFailedError
    import rank_fns

    def report(value):
        print("RESULT", json.dumps(value), flush=True)

    def failure(exc):
        first_rank, first = exc.get_first_failure()
        message = first.message["message"] if isinstance(first.message, dict) else first.message
        return {"type": type(exc).__name__, "is_child_failed": isinstance(exc, ChildFailedError), "name": exc.name,
                "ranks": sorted(exc.failures), "first": [first_rank, first.local_rank, first.exitcode, message],
                "text": str(exc)}
""")
# Runs the body argv[2].
_DRIVER = _NAMES + "exec(sys.argv[2])\n"
# Runs each body of the JSON list argv[2] ({"body", "dir", "out", "err"}) one after the other, each in
# a fork of this process in a directory of its own (its TMPDIR too), its stdout and stderr to files,
# and prints their exit statuses: torch is imported once here, not once a body (1.6 s of CPU each;
# ranktop's c10d rendezvous imports it too). Nothing a body changes leaks into the next.
_BATCH = _NAMES + textwrap.dedent("""
    import tempfile
    import torch
    statuses = []
    for case in json.load(open(sys.argv[2])):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.chdir(case["dir"])
            os.environ["TMPDIR"] = case["dir"]
            tempfile.tempdir = None  # (read from TMPDIR again)
            for fd, path in ((1, case["out"]), (2, case["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            status = 0
            try:
                exec(case["body"], dict(globals()))  # (names of its own: a body's `code` is not this loop's)
            except BaseException:
                import traceback
                traceback.print_exc()
                status = 1
            sys.exit(status)  # (the interpreter's own exit, atexit handlers and all, as a process of its own)
        statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    print(json.dumps(statuses))
""")


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), TESTS]), "TMPDIR": str(tmp_path)}


def _result(impl: str, returncode: int, stdout: str, stderr: str) -> tuple[object, str]:
    """(what a body reported, its stdout); the test fails with its output where it reported nothing."""
    found = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert returncode == 0 and found, f"{impl}: exit {returncode}\n{stdout}\n{stderr}"
    return json.loads(found[-1]), stdout


def _run(impl: str, body: str, tmp_path, timeout: float = 120) -> tuple[object, str]:
    """(what the body reported, its stdout) under `impl`, "torch" or "ranktop", in a process of its own."""
    done = subprocess.run([PY, "-c", _DRIVER, impl, textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=timeout, env=_env(tmp_path), cwd=tmp_path)
    return _result(impl, done.returncode, done.stdout, done.stderr)


# One node through the c10d rendezvous on a free port: torch's default backend (etcd) needs a server.
C10D = ("LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend='c10d', rdzv_endpoint='localhost:0', "
        "monitor_interval=0.05, logs_specs=DefaultLogsSpecs(log_dir='logs')")
# The same, with ranks forked: a spawned function rank of torch's imports torch afresh (4x the time of
# the tests below on the 2-core box). What those tests compare (values, failures, restarts) does not
# depend on the start method; the environment test keeps spawn, the default.
C10D_FORK = C10D + ", start_method='fork'"
# The bodies run under both launchers (name -> body), each pair compared by a test below.
BOTH: dict[str, str] = {}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, dict]:
    """Every body of BOTH run under torch and then under ranktop, a batch each (_BATCH): a body's
    name -> each launcher's (exit status, stdout, stderr), and "dir", where the body ran under
    <dir>/<launcher>."""
    pytest.importorskip("torch.distributed.launcher.api")
    base = tmp_path_factory.mktemp("both")
    found: dict[str, dict] = {name: {"dir": base / f"body{i}"} for i, name in enumerate(BOTH)}
    for impl in ("torch", "ranktop"):
        cases = []
        for name, body in BOTH.items():
            at = found[name]["dir"]
            (at / impl).mkdir(parents=True)
            cases.append({"body": textwrap.dedent(body), "dir": str(at / impl), "out": str(at / f"{impl}.out"),
                          "err": str(at / f"{impl}.err")})
        (base / f"{impl}.json").write_text(json.dumps(cases))
        done = subprocess.run([PY, "-c", _BATCH, impl, str(base / f"{impl}.json")], capture_output=True, text=True,
                              timeout=120 * len(cases), env=_env(base), cwd=base)
        assert done.returncode == 0, done.stderr[-3000:]
        statuses = json.loads(done.stdout.splitlines()[-1])
        for name, case, status in zip(BOTH, cases, statuses, strict=True):
            found[name][impl] = (status, Path(case["out"]).read_text(), Path(case["err"]).read_text())
    return found


def _both(launched: dict[str, dict], name: str) -> tuple[tuple[object, str], tuple[object, str]]:
    """(what body `name` reported, its stdout) under torch, and under ranktop."""
    theirs, ours = (_result(impl, *launched[name][impl]) for impl in ("torch", "ranktop"))
    return theirs, ours


BOTH["values"] = f"""
    config = {C10D_FORK}, max_restarts=0)
    values = elastic_launch(config, rank_fns.rank_and_arg)("x")
    direct = launch_agent(config, rank_fns.rank_and_arg, ["y"])
    report([sorted(values.items()), sorted(direct.items()), bool(config.run_id)])
"""


def test_returns_the_same_values_by_global_rank_as_torchs(launched):
    (theirs, _), (ours, _) = _both(launched, "values")
    assert ours == theirs == [[[0, [0, "x"]], [1, [1, "x"]]], [[0, [0, "y"]], [1, [1, "y"]]], True]


def _shape(table: str) -> list[str]:
    """ChildFailedError's table without what differs from run to run (time, host, pid, paths) and
    without the traceback's frames (torch's wrapper and ranktop's are different files)."""
    lines = [line for line in table.splitlines() if not line.startswith("    ")]
    subs = [(r"(time|host|error_file)(\s*): .*", r"\1\2: X"), (r"\(pid: \d+\)", "(pid: P)"),
            (r"traceback : Traceback.*", "traceback : Traceback"), (r"^=+$", "="), (r"^-+$", "-")]
    for pattern, repl in subs:
        lines = [re.sub(pattern, repl, line) for line in lines]
    return lines


BOTH["failing rank"] = f"""
    try:
        elastic_launch({C10D_FORK}, max_restarts=0), rank_fns.raise_on_rank)(1, "boom")
    except Exception as exc:
        report(failure(exc))
"""


def test_a_failing_rank_raises_child_failed_error_as_torchs(launched):
    (theirs, _), (ours, _) = _both(launched, "failing rank")
    assert ours["type"] == theirs["type"] == "ChildFailedError" and ours["is_child_failed"]
    assert ours["name"] == theirs["name"] == "raise_on_rank"  # torch's: the function's __name__
    assert ours["ranks"] == theirs["ranks"] == [1]
    assert ours["first"] == theirs["first"] == [1, 1, 1, "ValueError: boom"]
    assert _shape(ours["text"]) == _shape(theirs["text"])


BOTH["restarts"] = f"""
    spent = elastic_launch({C10D_FORK}, max_restarts=1), rank_fns.rank0_fails_until_restart)(1)
    try:
        elastic_launch({C10D_FORK}, max_restarts=1), rank_fns.rank0_fails_until_restart)(2)
    except Exception as exc:
        report([sorted(spent.items()), failure(exc)["first"]])
"""


def test_restarts_are_honoured_as_torchs(launched):
    """The boundary with one restart allowed: one failed start is restarted (the whole group, the
    rank that did not fail too), two are not, and the error is the last start's."""
    (theirs, _), (ours, _) = _both(launched, "restarts")
    assert ours == theirs == [[[0, 1], [1, 1]], [0, 0, 1, "RuntimeError: failing at restart 1"]]


BOTH["binary"] = """
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend='c10d',
                          rdzv_endpoint='localhost:0', max_restarts=0, logs_specs=DefaultLogsSpecs(log_dir='logs'))
    values = elastic_launch(config, sys.executable)("-c", "print('hi from', __import__('os').environ['RANK'])")
    code = "import os, sys, time; time.sleep(int(os.environ['RANK']) * 30); sys.exit(3)"
    try:
        elastic_launch(config, sys.executable)("-u", "-c", code)
    except Exception as exc:
        report([sorted(values.items()), failure(exc)])
"""


def test_a_binary_entrypoint_returns_none_by_rank_and_fails_as_torchs(launched):
    """Also two documented differences: ranktop's console prefixes each rank's line where torch's
    passes it through (no tee), and a rank that exits without an error file says so in other words."""
    (theirs, their_out), (ours, our_out) = _both(launched, "binary")
    assert ours[0] == theirs[0] == [[0, None], [1, None]]
    assert ours[1]["name"] == theirs[1]["name"] == "import os, sys, time; time.sleep(int(os.environ['RANK']) * 30); sys.exit(3)"
    assert ours[1]["ranks"] == theirs[1]["ranks"] == [0, 1]  # the rank stopped for it too, as torch keeps it
    assert ours[1]["first"][:3] == theirs[1]["first"][:3] == [0, 0, 3]
    assert theirs[1]["first"][3] == "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    assert ours[1]["first"][3] == ("exited with code 3. To see the traceback, wrap the rank's main function in "
                                   "@ranktop.core.record (or torch's @record).")
    # torch's ranks write to its stdout unprefixed (on a loaded box their lines were missing from
    # the captured output now and then: torch's side, so only the prefix is checked there)
    assert not re.findall(r"^\[default_role\d\]:", their_out, re.M)
    assert sorted(re.findall(r"^\[default_role\d\]:hi from \d$", our_out, re.M)) == [
        "[default_role0]:hi from 0", "[default_role1]:hi from 1"]


BOTH["cannot start"] = """
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # outlives the launch
    endpoint = f"127.0.0.1:{store.port}"
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, rdzv_backend="c10d", rdzv_endpoint=endpoint,
                          run_id="closing", rdzv_configs={"is_host": False}, max_restarts=0,
                          logs_specs=DefaultLogsSpecs(log_dir="logs"))
    try:
        elastic_launch(config, "/nonexistent/binary")()
        raised = None
    except Exception as exc:
        raised = isinstance(exc, FileNotFoundError)
    look = get_rendezvous_handler(RendezvousParameters("c10d", endpoint, "closing", 1, 1, is_host=False))
    report([raised, look.is_closed()])
"""


def test_a_rank_that_cannot_start_closes_the_rendezvous_as_torchs(launched):
    """torch's launch_agent shuts the rendezvous down on any error but a stop signal, so the other
    nodes learn at once; ranktop's left it open after a rank's start OSError."""
    (theirs, _), (ours, _) = _both(launched, "cannot start")
    assert ours == theirs == [True, True]


BOTH["environment"] = f"""
    base = dict(os.environ)
    report(elastic_launch({C10D}, max_restarts=1, run_id="envjob"), rank_fns.env_changes)(base))
"""


def test_each_rank_sees_torchs_environment(launched):
    (theirs, _), (ours, _) = _both(launched, "environment")
    ran_in = launched["environment"]["dir"]
    ranktop_own = {"RANKTOP_FAULTHANDLER", "RANKTOP_GUARD_TOKEN", "RANKTOP_RANK_TOKEN", "PYTHONPATH", "PYTHONUNBUFFERED"}
    for rank in ("0", "1"):
        assert set(theirs[rank]) <= set(ours[rank]) and set(ours[rank]) - set(theirs[rank]) <= ranktop_own
        differ = {k for k in theirs[rank] if theirs[rank][k] != ours[rank][k]}
        assert differ == {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}  # a free port each; the run directory
        assert ours[rank]["TORCHELASTIC_RUN_ID"] == "envjob" and ours[rank]["TORCHELASTIC_RESTART_COUNT"] == "0"
        # torch: <log_dir>/<run_id>_<random>/...; ranktop: <log_dir>/<run_id>/...
        assert re.fullmatch(rf"logs/envjob_\w+/attempt_0/{rank}/error.json", theirs[rank]["TORCHELASTIC_ERROR_FILE"])
        assert ours[rank]["TORCHELASTIC_ERROR_FILE"] == str(ran_in / "ranktop" / "logs" / "envjob" / "attempt_0"
                                                            / rank / "error.json")


BOTH["prefix template"] = """
    specs = DefaultLogsSpecs(log_dir="logs", tee=Std.ALL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d", run_id="pre",
                          rdzv_endpoint="localhost:0", role="trainer", logs_specs=specs,
                          log_line_prefix_template="${role_name}-${rank}> ")
    report(elastic_launch(config, sys.executable)("-c", "print('hi')"))
"""


def test_role_and_log_line_prefix_template_head_teed_lines_as_torchs(launched):
    (_, their_out), (_, our_out) = _both(launched, "prefix template")
    for out in (their_out, our_out):
        assert sorted(re.findall(r"^trainer-\d> hi$", out, re.M)) == ["trainer-0> hi", "trainer-1> hi"]
    ran_in = launched["prefix template"]["dir"]
    assert (ran_in / "ranktop" / "logs" / "pre" / "attempt_0" / "1" / "stdout.log").read_text() == "hi\n"


def test_one_node_with_torchs_defaults_runs_without_torch(tmp_path):
    """torch's defaults (etcd backend, no endpoint) look for an etcd server; one node without an
    endpoint runs here alone, on a free port, with no torch imported. The config's run id is
    filled in, and serves again: the next call's run directory is <run_id>.1."""
    body = """
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, local_addr="localhost",
                              logs_specs=DefaultLogsSpecs(log_dir="logs"))
        first = elastic_launch(config, rank_fns.echo_env)("MASTER_ADDR", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
        again = elastic_launch(config, rank_fns.double)(21)
        report([first, again, config.run_id, config.max_restarts, config.role, "torch" in sys.modules,
                sorted(os.listdir("logs"))])
    """
    (first, again, run_id, restarts, role, torch_loaded, dirs), _ = _run("ranktop", body, tmp_path)
    assert first == {r: {"MASTER_ADDR": "localhost", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": run_id} for r in "01"}
    assert again == {"0": 42, "1": 42} and (restarts, role) == (3, "default_role")  # torch's defaults
    assert not torch_loaded and dirs == [run_id, f"{run_id}.1"]


@pytest.mark.parametrize(("changes", "message"), [
    ({"min_nodes": 0}, "bad min_nodes 0: expected a whole number from 1 to"),
    ({"min_nodes": 3, "max_nodes": 2}, "bad min_nodes 3: more than max_nodes 2"),
    ({"nproc_per_node": 0}, "bad nproc_per_node 0: expected a whole number from 1 to 4096"),
    ({"max_restarts": -1}, "bad max_restarts -1: expected a whole number, 0 or more"),
    ({"monitor_interval": float("nan")}, "bad monitor_interval nan: expected a number of seconds from 0.001"),
    ({"run_id": "a/b"}, "bad run_id 'a/b': it contains '/'"),
    ({"run_id": "a%2Fb", "rdzv_backend": "etcd", "rdzv_endpoint": "127.0.0.1:2379", "max_nodes": 2},
     "bad run_id 'a%2Fb': the etcd backend puts it into a URL unescaped, where '%' starts an escape"),
    ({"role": 7}, "bad role 7: expected a str"),
    ({"rdzv_backend": ""}, "bad rdzv_backend '': expected c10d, etcd, etcd-v2, static or a torchrun plugin's name"),
    ({"signals_to_handle": "SIGTERM,SIGFOO"}, "bad signals_to_handle 'SIGTERM,SIGFOO': 'SIGFOO' is not a signal"),
    ({"signals_to_handle": "SIGFOO" * 5000}, f"bad signals_to_handle {('SIGFOO' * 14)[:80]!r}: {('SIGFOO' * 7)[:40]!r} is"),
    ({"rdzv_endpoint": "::1:29400", "rdzv_backend": "c10d"}, "bad rdzv_endpoint '::1:29400': write an IPv6 address"),
    # a long one is cut whatever else is wrong with it (colons took the IPv6 check first, in full)
    ({"rdzv_endpoint": "h:" * 5000, "rdzv_backend": "c10d"}, f"bad rdzv_endpoint {('h:' * 40)!r}: expected HOST:PORT"),
    ({"rdzv_endpoint": "localhost:0", "max_nodes": 2, "rdzv_backend": "c10d"},
     "bad rdzv_endpoint 'localhost:0': port 0 (a free one) only works on one node"),
    ({"start_method": "thread"}, "unknown start method 'thread': expected one of spawn, fork, forkserver"),
    ({"entrypoint": None}, "WorkerSpec needs an entrypoint"),
])
def test_bad_config_values_are_one_line_errors(tmp_path, changes, message):
    from ranktop.core import DefaultLogsSpecs, LaunchConfig, elastic_launch

    changes = dict(changes)
    entrypoint = changes.pop("entrypoint", PY)
    fields = {"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 1, **changes}
    with pytest.raises(ValueError) as raised:
        elastic_launch(LaunchConfig(**fields, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path))), entrypoint)("-c", "")
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert os.listdir(tmp_path) == []  # refused before any run directory


@pytest.mark.parametrize(("env", "message"), [
    ({"shutdown_timeout": -1}, "bad shutdown_timeout -1: expected a number of seconds from 0"),
    ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, "bad TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon': expected a number"),
    ({"rdzv_configs": "timeout=5"}, "bad rdzv_configs 'timeout=5': expected a dict"),
])
def test_bad_values_are_refused_as_the_config_is_made(tmp_path, monkeypatch, env, message):
    from ranktop.core import DefaultLogsSpecs, LaunchConfig

    fields = {k: v for k, v in env.items() if not k.isupper()}
    for name, value in env.items():
        if name.isupper():
            monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        LaunchConfig(1, 1, 1, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)), **fields)
    assert "\n" not in str(raised.value)


def test_config_fields_and_defaults_are_torchs(monkeypatch):
    import dataclasses

    api = pytest.importorskip("torch.distributed.launcher.api")
    from ranktop.core import LaunchConfig

    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")
    theirs, ours = api.LaunchConfig(1, 2, 4), LaunchConfig(1, 2, 4)
    names = [f.name for f in dataclasses.fields(api.LaunchConfig)]
    assert [f.name for f in dataclasses.fields(LaunchConfig)] == names
    same = [n for n in names if n != "logs_specs"]
    assert {n: getattr(ours, n) for n in same} == {n: getattr(theirs, n) for n in same}
    assert ours.shutdown_timeout == 12 and ours.rdzv_configs == {"timeout": 900}
    assert LaunchConfig(1, 1, 1, rdzv_timeout=5).rdzv_configs == {"timeout": 5}
    for config in (theirs, ours):
        os.rmdir(config.logs_specs.root_log_dir)  # each made a fresh temporary log root


def test_the_static_backend_without_torch_places_the_ranks_itself(tmp_path):
    """As on the command line: with torch not installed, the static backend is ranktop's own static
    form, the node rank from rdzv_configs["rank"] and the master from the endpoint."""
    port = free_port()
    body = f"""
        sys.modules["torch"] = None  # as if not installed
        config = LaunchConfig(min_nodes=2, max_nodes=2, nproc_per_node=2, rdzv_backend="static",
                              rdzv_endpoint="127.0.0.1:{port}", rdzv_configs={{"rank": 1}},
                              logs_specs=DefaultLogsSpecs(log_dir="logs"))
        report(elastic_launch(config, rank_fns.echo_env)("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"))
    """
    values, _ = _run("ranktop", body, tmp_path)
    assert values == {str(r): {"RANK": str(r), "WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(port)} for r in (2, 3)}


BOTH["killed by hand"] = f"""
    import pathlib, signal, threading, time

    def kill_rank_1(pid_dir):
        pid_file = pathlib.Path(pid_dir, "pid1")
        while not pid_file.exists():
            time.sleep(0.01)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    seen = []
    for restarts in (0, 1):
        pid_dir = os.path.abspath(f"pids{{restarts}}")
        os.mkdir(pid_dir)
        threading.Thread(target=kill_rank_1, args=(pid_dir,), daemon=True).start()
        try:
            values = elastic_launch({C10D_FORK}, max_restarts=restarts), rank_fns.killed_by_hand_once)(pid_dir)
            seen.append(sorted(values.items()))
        except Exception as exc:
            f = failure(exc)
            seen.append([f["type"], f["ranks"], f["first"][:3], f["first"][3].split(" received by PID")[0]])
    report(seen)
"""


def test_a_rank_killed_by_hand_from_outside_is_a_failure_as_under_torch(launched):
    """A person's `kill -9` of a rank (an elastic_launch run is not served: ranktop's own `k` cannot
    reach it): a failure, as torch's agent has it, since no launcher can tell it from the kernel's
    OOM kill. With a restart left the group starts again and the call returns every rank's value;
    without, ChildFailedError names the killed rank and its signal."""
    (theirs, _), (ours, _) = _both(launched, "killed by hand")
    assert ours == theirs == [["ChildFailedError", [1], [1, 1, -9], "Signal 9 (SIGKILL)"], [[0, 0], [1, 1]]]
