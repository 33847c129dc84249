"""torch 2.13's elastic API names in ranktop.core, checked against behaviour, with real ranks."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import rank_fns
from conftest import ROOT, has_torch_elastic, run_ranktop, stop_process, wait_for
from ranktop.core import (
    ChildFailedError,
    DefaultLogsSpecs,
    LocalAgent,
    LocalElasticAgent,
    MultiprocessContext,
    ProcessFailure,
    Std,
    SubprocessContext,
    WorkerSpec,
    get_error_handler,
    set_start_method,
    start_processes,
    to_map,
)
from ranktop.core.errors import BadErrorFile, write_error_file
from test_start_processes import _pid_alive

PY = sys.executable


def square(x: int) -> int:
    return x * x


def _ended(ctx):
    """The context's result once its ranks have ended; closed either way."""
    try:
        return ctx.wait(timeout=60)
    finally:
        ctx.close()


def test_start_processes_with_default_logs_specs_uses_torchs_layout(tmp_path):
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.OUT, tee=Std.ERR, local_ranks_filter={0})
    envs = {r: {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "0"} for r in range(2)}
    result = _ended(start_processes("sq", square, {0: (3,), 1: (4,)}, envs, specs))
    assert result.return_values == {0: 9, 1: 16} and not result.failures
    (run_dir,) = (tmp_path / "logs").iterdir()
    assert run_dir.name.startswith("job7_") and specs.attempt_dir == str(run_dir / "attempt_0")
    assert sorted(os.listdir(run_dir / "attempt_0")) == ["0", "1"]
    assert result.stdouts[0] == str(run_dir / "attempt_0" / "0" / "stdout.log")
    dest = specs.reify(envs | {0: {**envs[0], "TORCHELASTIC_RESTART_COUNT": "1"}})  # the next attempt
    assert dest.stdouts[1] == str(run_dir / "attempt_1" / "1" / "stdout.log")
    assert dest.tee_stderrs == {0: str(run_dir / "attempt_1" / "0" / "stderr.log")}  # filtered to rank 0
    assert dest.filtered_stdout == str(run_dir / "attempt_1" / "filtered_stdout.log")


def test_binary_ranks_return_none_and_a_failed_group_returns_nothing(tmp_path):
    for name, code, expected in (("ok", "pass", {0: None, 1: None}), ("bad", "import sys; sys.exit(2)", {})):
        (tmp_path / name).mkdir()
        ctx = start_processes("b", PY, {0: ("-c", "pass"), 1: ("-c", code)}, {0: {}, 1: {}}, str(tmp_path / name))
        try:
            result = ctx.wait(timeout=60)
        finally:
            ctx.close()
        assert result.return_values == expected
        assert bool(result.failures) == (name == "bad")


def test_errors_are_torchs(tmp_path):
    with pytest.raises(RuntimeError, match="exactly the local ranks 0..1"):
        start_processes("t", PY, {0: (), 1: ()}, {0: {}}, str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        DefaultLogsSpecs(log_dir=str(tmp_path / "file"))
    with pytest.raises(NotADirectoryError):
        start_processes("t", PY, {0: ()}, {0: {}}, str(tmp_path / "file"))
    assert to_map(Std.OUT, 2) == {0: Std.OUT, 1: Std.OUT}
    assert to_map({1: Std.ERR}, 2) == {0: Std.NONE, 1: Std.ERR}


def test_local_agent_names_its_log_dir_argument_not_the_command_lines_flag(tmp_path):
    """It said `bad --log-dir ...`, a flag an API caller never used (the command line keeps it:
    tests/test_rundirs.py)."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=f"^bad log_dir {re.escape(str(tmp_path / 'file'))}: it is not a directory$"):
        LocalAgent(WorkerSpec("r", 1, "/bin/true"), log_dir=str(tmp_path / "file"))


def test_an_error_file_that_is_no_regular_file_is_none_as_torchs(tmp_path):
    """A directory or FIFO at the error file's path raised BadErrorFile; torch's ProcessFailure
    reads only what os.path.isfile accepts and takes the rest for no file at all."""
    os.mkfifo(tmp_path / "fifo")
    for path, kind in ((str(tmp_path), "a directory"), (str(tmp_path / "fifo"), "a FIFO")):
        failure = ProcessFailure(0, 1, -9, path)
        assert failure.message == "Signal 9 (SIGKILL) received by PID 1"
        assert (failure.error_file, failure.error_file_data) == ("<N/A>", {"message": "<NONE>"})
        named = ProcessFailure(0, 1, -9, path, raise_bad_file=False)  # the engine's way still says why
        assert named.message.endswith(f"error file {path} is not a regular file ({kind}); ignored")


def test_child_failed_error_error_file_data_and_the_error_handler(tmp_path, monkeypatch):
    rank_file = tmp_path / "rank_error.json"
    try:
        raise ValueError("boom")
    except ValueError as exc:
        write_error_file(rank_file, exc)
    first = ProcessFailure(1, 4242, 1, str(rank_file), rank=1, exited_at=100.0)
    later = ProcessFailure(0, 4241, -15, str(tmp_path / "none.json"), rank=0, exited_at=101.0)
    err = ChildFailedError("train.py", {0: later, 1: first})
    assert err.get_first_failure() == (1, first)
    table = err.format_msg().splitlines()  # torch's table: the root cause last, under its heading
    assert table[table.index("Root Cause (first observed failure):") + 4] == "  rank      : 1 (local_rank: 1)"
    assert first.error_file_data["message"]["message"] == "ValueError: boom"
    assert later.error_file_data == {"message": "<NONE>"} and later.error_file == "<N/A>"  # torch's, for none
    assert first.timestamp == int(json.loads(rank_file.read_text())["message"]["extraInfo"]["timestamp"])
    assert isinstance(first.timestamp, int) and isinstance(later.timestamp, int) and later.timestamp == 101
    assert first.error_file_data == json.loads(rank_file.read_text())  # as loaded
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"message": "out of memory", "timestamp": 1700000000}))
    simple = ProcessFailure(2, 4243, 1, str(plain))
    assert (simple.message, simple.timestamp, simple.error_file_data["message"]) == ("out of memory", 1700000000,
                                                                                    "out of memory")
    plain.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON") as raised:  # as torch's: json's JSONDecodeError
        ProcessFailure(3, 4244, 1, str(plain))
    assert isinstance(raised.value, BadErrorFile)
    plain.write_text(json.dumps({"timestamp": 1}))
    with pytest.raises(ValueError, match='has no "message"'):  # torch: KeyError
        ProcessFailure(3, 4244, 1, str(plain))
    # the engine reads files its ranks control: there the problem is named, not raised
    bad = ProcessFailure(3, 4244, 1, str(plain), raise_bad_file=False)
    assert 'has no "message" object at the top; ignored' in bad.message and bad.error_file == str(plain)
    ours = tmp_path / "launcher_error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(ours))
    get_error_handler().dump_error_file(str(rank_file), error_code=1)
    copied = json.loads(ours.read_text())
    assert copied["message"]["message"] == "ValueError: boom" and copied["message"]["errorCode"] == 1


def test_local_elastic_agent_shape_and_entrypoint_name(tmp_path):
    spec = WorkerSpec(role="trainer", local_world_size=2, entrypoint=square, args=(5,))
    assert spec.get_entrypoint_name() == "square"
    assert WorkerSpec(role="r", local_world_size=1, entrypoint="/usr/bin/python3").get_entrypoint_name() == "python3"
    agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path)), start_method="spawn",
                              exit_barrier_timeout=30, console=False)
    result = agent.run()
    assert result.return_values == {0: 25, 1: 25}
    assert os.path.dirname(agent.run_dir) == str(tmp_path)
    # once: a second run() was an OSError '[Errno 9] <run dir> is closed' (torch's runs the group again)
    with pytest.raises(RuntimeError, match=f"^this agent has run already \\(its run: {agent.run_dir}\\); make a new agent"):
        agent.run()
    assert agent.result is result


def test_record_exits_zero_normally_and_the_root_cause_error_file_is_passed_up(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys\nfrom ranktop.core import record\n@record\ndef main():\n"
                      "    if os.environ.get('FAIL'):\n        raise KeyError('lost')\n    sys.exit(0)\n"
                      "print('returned', main(), flush=True)\n")
    fine = run_ranktop("--headless", "--log-dir", str(tmp_path / "a"), str(script))
    assert fine.returncode == 0 and "[default0]:returned None" in fine.stdout  # sys.exit(0) in @record returns
    ours = tmp_path / "scheduler_error.json"
    done = run_ranktop("--headless", "--log-dir", str(tmp_path / "b"), "--env", "FAIL=1", str(script),
                       env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(ours)})
    assert done.returncode == 1
    assert json.loads(ours.read_text())["message"]["message"] == "KeyError: 'lost'"


def test_worker_state_is_the_group_state_under_torchs_names():
    from ranktop.core import GroupState, WorkerState

    torch_api = pytest.importorskip("torch.distributed.elastic.agent.server.api")
    assert WorkerState is GroupState
    assert {m for m in torch_api.WorkerState.__members__} <= set(WorkerState.__members__)
    assert WorkerState.HEALTHY is GroupState.RUNNING and WorkerState.UNHEALTHY is GroupState.RESTARTING
    assert WorkerState.is_running(WorkerState.HEALTHY) and not WorkerState.is_running(WorkerState.SUCCEEDED)
    assert [s.name for s in GroupState if s.finished] == ["SUCCEEDED", "FAILED", "STOPPED"]


def test_a_failed_group_reports_the_rank_that_failed_not_the_ones_stopped_for_it(tmp_path):
    from rank_fns import fail_rank

    ctx = start_processes("f", fail_rank, {0: (1, "rank one broke"), 1: (1, "rank one broke"), 2: (1, "x")},
                          {r: {"LOCAL_RANK": str(r)} for r in range(3)}, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    try:
        result = ctx.wait(timeout=60)
    finally:
        ctx.close()
    assert list(result.failures) == [1] and result.return_values == {}
    failure = result.failures[1]
    assert "rank one broke" in failure.message_text and isinstance(failure.timestamp, int)
    assert failure.error_file != "<N/A>" and failure.error_file_data["message"]["message"].endswith("rank one broke")


# A rank that prints its local rank, then the variables its arguments name that it has (none here:
# torch's agent sets no OMP_NUM_THREADS, only torchrun's command line does).
PRINT_TWO = ("-u", "-c", "import os, sys\nprint('out', os.environ['LOCAL_RANK'])\n"
             "print('keep me', *[v for v in sys.argv[1:] if v in os.environ], flush=True)\n")


def test_local_elastic_agent_takes_torchs_whole_constructor_and_honours_its_logs_specs(tmp_path, capfd, monkeypatch):
    from ranktop.core.agent import LocalAgent

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the ranks' is whatever the agent adds

    torch_agent = pytest.importorskip("torch.distributed.elastic.agent.server.local_elastic_agent")
    import inspect

    theirs = list(inspect.signature(torch_agent.LocalElasticAgent.__init__).parameters)
    ours = [p for p in inspect.signature(LocalElasticAgent.__init__).parameters if p != "kwargs"]
    assert ours == theirs  # every parameter, in torch's order

    class Mine(LocalElasticAgent):  # a class, as torch's is: code that subclasses it keeps working
        pass

    spec = WorkerSpec(role="trainer", local_world_size=2, entrypoint=PY, args=PRINT_TWO + ("OMP_NUM_THREADS",))
    # torch's positional form, to its last parameter; redirects=ALL: files only, a silent console
    agent = Mine(spec, DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL), "spawn", 300, None, 5, None, 10.0)
    assert isinstance(agent, LocalAgent) and agent.shutdown_timeout == 5
    assert agent.uninterruptible_state_timeout == 10.0 and agent.health_check_server is None
    capfd.readouterr()
    assert agent.run().is_failed() is False
    shown = capfd.readouterr()
    assert "out" not in shown.out + shown.err
    for rank in (0, 1):
        assert (tmp_path / os.path.basename(agent.run_dir) / "attempt_0" / str(rank) / "stdout.log").read_text() \
            == f"out {rank}\nkeep me\n"
    # tee ALL with a filter: only rank 1 reaches the console
    filtered = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "f"), tee=Std.ALL,
                                                        local_ranks_filter={1}))
    assert filtered.shutdown_timeout == 30  # torch's default grace
    filtered.run()
    shown = capfd.readouterr().out
    assert "out 1" in shown and "out 0" not in shown


def test_worker_spec_takes_torchs_fields_by_keyword(tmp_path, capfd):
    api = pytest.importorskip("torch.distributed.elastic.agent.server.api")
    import dataclasses

    from ranktop.core import LocalAgent, UsageError

    assert {f.name for f in dataclasses.fields(api.WorkerSpec)} <= {f.name for f in dataclasses.fields(WorkerSpec)}
    old = WorkerSpec(role="r", local_world_size=1, rdzv_handler=None, fn=square, args=(3,))  # torch's older `fn`
    assert old.entrypoint is square

    def nested() -> None: ...

    assert WorkerSpec(role="r", local_world_size=1, entrypoint=nested).get_entrypoint_name() == \
        "test_worker_spec_takes_torchs_fields_by_keyword.<locals>.nested"  # torch's: the qualified name
    with pytest.raises(UsageError, match=r"^WorkerSpec needs an entrypoint: a binary's path or a function$"):
        WorkerSpec(role="r", local_world_size=1)
    with pytest.raises(UsageError, match=r"^bad event_log_handler 'loud': expected one of null, console, "
                                         r"dynamic_rendezvous$"):
        WorkerSpec(role="r", local_world_size=1, entrypoint=PY, event_log_handler="loud")
    spec = WorkerSpec(role="r", local_world_size=2, entrypoint=PY, args=PRINT_TWO, event_log_handler="console",
                      duplicate_stdout_filters=["keep"], local_addr="127.0.0.1", run_id="tf")
    capfd.readouterr()
    agent = LocalAgent(spec, log_dir=str(tmp_path))
    agent.run()
    shown = "".join(capfd.readouterr())
    assert "ranktop: event " in shown and '"event": "run_finished"' in shown  # event_log_handler="console"
    assert sorted((tmp_path / "tf" / "attempt_0" / "filtered_stdout.log").read_text().splitlines()) == [
        "[r0]:keep me", "[r1]:keep me"]


def test_worker_spec_numa_options_bind_as_the_flag_does_or_say_why_not(tmp_path, monkeypatch):
    binding = pytest.importorskip("torch.numa.binding")
    from ranktop.core import LocalAgent, UsageError
    from ranktop.core.gpu import numa_binding
    from ranktop.core.gpu_fake import FakeNvml

    spec = WorkerSpec(role="r", local_world_size=2, entrypoint=PY, args=("-c", "pass"),
                      numa_options=binding.NumaOptions(affinity_mode=binding.AffinityMode.NODE))
    monkeypatch.delenv("RANKTOP_FAKE_GPUS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU to follow, whatever this host has
    with pytest.raises(UsageError, match=r"^numa_options: --numa-binding node: it binds each rank to its GPU's NUMA node"):
        LocalAgent(spec, log_dir=str(tmp_path / "a"))
    assert os.listdir(tmp_path) == []  # refused before any run directory
    lenient = dataclasses_replace(spec, numa_options=binding.NumaOptions(
        affinity_mode=binding.AffinityMode.NODE, should_fall_back_if_binding_fails=True))
    assert LocalAgent(lenient, log_dir=str(tmp_path / "b")).spec.cpu_affinity is None  # runs unbound, as torch falls back
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("RANKTOP_FAKE_GPUS", "2")
    agent = LocalAgent(spec, log_dir=str(tmp_path / "c"))
    assert agent.spec.cpu_affinity == numa_binding("node", 2, None, nvml=FakeNvml(2))


def dataclasses_replace(spec: WorkerSpec, **changes) -> WorkerSpec:
    import dataclasses

    return dataclasses.replace(spec, **changes)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_local_elastic_agent_run_raises_signal_exception_when_the_caller_is_signalled(tmp_path, sig):
    """torch's agent.run() stops the ranks and raises SignalException when its process gets a stop
    signal; ranktop's returned a STOPPED result that is not is_failed(), so ported code went on as
    if the job had succeeded (and its process exited 0)."""
    parent = textwrap.dedent(f"""
        import signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from ranktop.core import DefaultLogsSpecs, LocalElasticAgent, SignalException, Std, WorkerSpec
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal
        rank = "import os, time; print('up', os.getpid(), flush=True); time.sleep(60)"
        spec = WorkerSpec(role="t", local_world_size=2, entrypoint=sys.executable, args=("-c", rank),
                          run_id="job")
        agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir={str(tmp_path)!r}, redirects=Std.ALL))
        try:
            agent.run()
        except SignalException as e:
            print("raised", e.sigval.name, e, agent.result.state.name, flush=True)
    """)
    proc = subprocess.Popen([PY, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        logs = [tmp_path / "job" / "attempt_0" / str(r) / "stdout.log" for r in (0, 1)]
        ups = [wait_for(lambda log=log: log.is_file() and log.read_text().startswith("up "), timeout=30,
                        what=f"{log} up") for log in logs]
        pids = [int(log.read_text().split()[1]) for log in logs]
        assert all(ups)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        stop_process(proc)
    assert (proc.returncode, out) == (0, f"raised {sig.name} Process {proc.pid} got signal: {int(sig)} STOPPED\n")
    wait_for(lambda: not any(_pid_alive(p) for p in pids), timeout=5, what="the ranks to be gone")


def test_a_rank_that_cannot_start_raises_the_oserror_torch_raises(tmp_path):
    """torch raises FileNotFoundError/PermissionError naming the binary, from start_processes and
    from agent.run(); ranktop raised a bare OSError subclass that named no file (an `except
    FileNotFoundError` missed it), and its LocalElasticAgent returned FAILED with no failure."""
    missing = str(tmp_path / "no-such-binary")
    (tmp_path / "logs").mkdir()
    with pytest.raises(FileNotFoundError, match=r"^\[Errno 2\] cannot start local rank 0: No such file or "
                                                r"directory: '.*no-such-binary'$") as caught:
        start_processes("b", missing, {0: ()}, {0: {}}, str(tmp_path / "logs"))
    assert caught.value.filename == missing and caught.value.errno == 2
    plain = tmp_path / "plain.py"
    plain.write_text("print('not executable')\n")
    spec = WorkerSpec(role="t", local_world_size=1, entrypoint=str(plain))
    agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "agent")))
    with pytest.raises(PermissionError, match=r"cannot start local rank 0: Permission denied: '.*plain.py'$"):
        agent.run()
    assert agent.result.is_failed()


def test_a_function_context_keeps_its_start_method_as_torchs(tmp_path):
    ctx = start_processes("sq", square, {0: (2,)}, {0: {}}, str(tmp_path), start_method="forkserver")
    try:
        assert ctx.start_method == "forkserver" and ctx.wait(timeout=60).return_values == {0: 4}
    finally:
        ctx.close()


def test_a_context_built_with_torchs_constructor_is_a_type_error_naming_start_processes(tmp_path):
    """README: built directly with torch's constructor, the contexts raise TypeError. Positionally,
    torch's (name, entrypoint, args, envs, start_method, logs_specs) filled ranktop's (..., log_dir,
    streams) and failed deep inside with AttributeError ('str' object has no attribute 'path')."""
    specs = DefaultLogsSpecs(log_dir=str(tmp_path))
    why = r"^MultiprocessContext is made by start_processes\(\), which checks and opens its run directory first: call it instead$"
    with pytest.raises(TypeError, match=why):
        MultiprocessContext("sq", square, {0: (2,)}, {0: {}}, "spawn", specs)
    with pytest.raises(TypeError, match=why.replace("Multiprocess", "Subprocess")):
        SubprocessContext("t", "/bin/true", {0: ()}, {0: {}}, specs, None)
    with pytest.raises(TypeError):  # torch's keywords: not ranktop's
        MultiprocessContext(name="sq", entrypoint=square, args={0: (2,)}, envs={0: {}}, start_method="spawn",
                            logs_specs=specs)
    assert list(tmp_path.iterdir()) == []  # nothing made


def test_local_agent_takes_a_start_method_as_the_spec_gives_it(tmp_path):
    """SPEC 2.1: LocalAgent(spec, log_dir=..., start_method="spawn", log_line_prefix_template=None);
    it took no start_method (TypeError). Checked as set_start_method checks it, then spawn as ever."""
    spec = WorkerSpec(role="trainer", local_world_size=2, entrypoint=square, args=(3,))
    agent = LocalAgent(spec, str(tmp_path / "a"), "forkserver", "[${rank}]:", console=False)
    assert (agent.start_method, agent.prefix_template) == ("forkserver", "[${rank}]:")
    assert agent.run().return_values == {0: 9, 1: 9}
    with pytest.raises(ValueError, match=r"^unknown start method 'thread': expected one of spawn, fork, forkserver$"):
        LocalAgent(spec, log_dir=str(tmp_path / "b"), start_method="thread")
    assert not (tmp_path / "b").exists()  # refused before a run directory was made


def test_set_start_method_takes_the_three_methods_and_refuses_others_in_one_line():
    for method in ("spawn", "fork", "forkserver"):
        set_start_method(method)
    with pytest.raises(ValueError, match=r"^unknown start method 'thread': expected one of spawn, fork, forkserver$"):
        set_start_method("thread")


def test_torchs_own_default_logs_specs_and_worker_spec_are_taken(tmp_path, capfd):
    """Code that swaps only start_processes or the agent for ranktop's but still builds torch's
    DefaultLogsSpecs and WorkerSpec failed with TypeError (open: path should be string...) or
    AttributeError ('DefaultLogsSpecs' object has no attribute 'redirects')."""
    tmp = pytest.importorskip("torch.distributed.elastic.multiprocessing")
    torch_api = pytest.importorskip("torch.distributed.elastic.agent.server.api")
    specs = tmp.DefaultLogsSpecs(log_dir=str(tmp_path / "sp"), redirects=tmp.Std.OUT, tee={1: tmp.Std.ERR})
    envs = {r: {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0"} for r in range(2)}
    result = _ended(start_processes("sq", square, {0: (3,), 1: (4,)}, envs, specs))
    assert result.return_values == {0: 9, 1: 16}
    (run_dir,) = (tmp_path / "sp").iterdir()
    assert run_dir.name.startswith("job_")
    assert result.stdouts == {r: str(run_dir / "attempt_0" / str(r) / "stdout.log") for r in (0, 1)}
    assert result.stderrs == {0: "", 1: str(run_dir / "attempt_0" / "1" / "stderr.log")}
    restarted = {r: {**env, "TORCHELASTIC_RESTART_COUNT": "1"} for r, env in envs.items()}
    result = _ended(start_processes("sq", square, {0: (1,)}, {0: restarted[0]}, specs))  # the run's next attempt
    assert result.stdouts[0] == str(run_dir / "attempt_1" / "0" / "stdout.log")  # as torch's

    spec = torch_api.WorkerSpec(role="t", local_world_size=2, rdzv_handler=None, entrypoint=PY,
                                args=PRINT_TWO, max_restarts=0)
    capfd.readouterr()
    agent = LocalElasticAgent(spec, tmp.DefaultLogsSpecs(log_dir=str(tmp_path / "agent"), redirects=tmp.Std.ALL))
    assert agent.run().is_failed() is False
    shown = capfd.readouterr()
    assert "out" not in shown.out + shown.err  # redirects=ALL: nothing on the console
    run_dir = tmp_path / "agent" / os.path.basename(agent.run_dir)
    assert [(run_dir / "attempt_0" / str(r) / "stdout.log").read_text() for r in (0, 1)] == \
        ["out 0\nkeep me\n", "out 1\nkeep me\n"]

    class OwnLayout(tmp.DefaultLogsSpecs):
        def reify(self, envs):
            return super().reify(envs)

    (tmp_path / "own").mkdir()
    with pytest.raises(TypeError, match=r"^logs_specs: torch's OwnLayout has a reify of its own, which ranktop "
                                        r"cannot honour \(it lays out the files itself\); use DefaultLogsSpecs$"):
        start_processes("sq", square, {0: (1,)}, {0: {}}, OwnLayout(log_dir=str(tmp_path / "own")))
    assert os.listdir(tmp_path / "own") == []


def test_get_worker_group_answers_as_torchs(tmp_path):
    """torch's ElasticAgent has get_worker_group(): the group's state (FAILED after its ranks
    failed, as torch's own tests check it), node and ranks, and each rank's pid while it runs."""
    import threading

    from rank_fns import raise_on_rank, sleep_forever
    from ranktop.core import WorkerState

    spec = WorkerSpec(role="trainer", local_world_size=2, entrypoint=raise_on_rank, args=(1, "boom"))
    agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "failed")), console=False)
    assert agent.get_worker_group().state == WorkerState.INIT
    assert agent.run().is_failed()
    group = agent.get_worker_group()
    assert (group.state, group.group_rank, group.group_world_size, group.spec.role) == \
        (WorkerState.FAILED, 0, 1, "trainer")
    assert [(w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size, w.id)
            for w in group.workers] == [(0, 0, 0, 2, 2, None), (1, 1, 1, 2, 2, None)]

    running = LocalElasticAgent(WorkerSpec(role="t", local_world_size=2, entrypoint=sleep_forever),
                                DefaultLogsSpecs(log_dir=str(tmp_path / "running")), console=False, shutdown_timeout=2)
    thread = threading.Thread(target=running.run)
    thread.start()
    try:
        assert running.wait_started(30)
        group = running.get_worker_group()
        assert group.state == WorkerState.RUNNING
        assert [w.id for w in group.workers] == [running.pcontext.pids()[r] for r in (0, 1)]
    finally:
        running.stop()
        thread.join(30)


_ARGV_SCRIPT = """
import argparse, sys, tempfile

def train(rank):
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float)
    lr = parser.parse_known_args()[0].lr  # the options a user would parse
    return [rank, sys.argv[1:], lr, sys.flags.optimize, sys.warnoptions, sorted(sys._xoptions)]

if __name__ == "__main__":
    if sys.argv[1] == "torch":
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    else:
        from ranktop.core import DefaultLogsSpecs, start_processes
    for method in ("spawn", "fork"):
        ctx = start_processes("t", train, {0: (0,), 1: (1,)}, {0: {}, 1: {}},
                              DefaultLogsSpecs(log_dir=tempfile.mkdtemp(dir=sys.argv[-1])), start_method=method)
        print(method, ctx.wait(60, 0.05).return_values, flush=True)
        ctx.close()
"""


def _each_impl(tmp_path, *python_flags: str) -> dict[str, list]:
    """What _ARGV_SCRIPT printed under ranktop's start_processes, and under torch's where it is
    installed, run as `python FLAGS train.py IMPL --lr 0.5 TMP`: (start method, return values) for
    each start, the implementation's name as IMPL."""
    script = tmp_path / "train.py"
    script.write_text(_ARGV_SCRIPT)
    impls = ["ranktop"] + (["torch"] if has_torch_elastic() else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shown = {}
    for impl in impls:
        done = subprocess.run([PY, *python_flags, str(script), impl, "--lr", "0.5", str(tmp_path)], capture_output=True,
                              text=True, timeout=180, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        # torch's return values come in the order the ranks returned: compare them as maps
        lines = done.stdout.replace(f"'{impl}'", "'IMPL'").splitlines()
        shown[impl] = [(line.split(" ", 1)[0], ast.literal_eval(line.split(" ", 1)[1])) for line in lines]
    return shown


def test_a_function_rank_sees_the_callers_command_line_and_interpreter_options_as_torchs(tmp_path):
    """`python -O -W ... -X ... train.py --lr 0.5`: a rank that parses its options (argparse in the
    function) reads the caller's sys.argv, as multiprocessing gives it (it read ranktop's own
    bootstrap's and failed), and runs under the caller's interpreter options, as multiprocessing
    passes them on (it ran under none: asserts on, no warning filters)."""
    shown = _each_impl(tmp_path, "-O", "-W", "ignore::UserWarning", "-X", "faulthandler")
    expected = {r: [r, ["IMPL", "--lr", "0.5", str(tmp_path)], 0.5, 1, ["ignore::UserWarning"], ["faulthandler"]]
                for r in (0, 1)}
    assert shown["ranktop"] == [("spawn", expected), ("fork", expected)]
    assert shown.get("torch", shown["ranktop"]) == shown["ranktop"]


_ENVIRONMENT_SCRIPT = """
import os, sys
from ranktop.core.launcher import LaunchConfig, elastic_launch


def flags():
    return [sys.flags.ignore_environment, getattr(sys.flags, "safe_path", None), sys.flags.no_user_site,
            sys.stdout.write_through, "sitecustomize" in sys.modules, os.environ.get("RANKTOP_FAULTHANDLER")]


if __name__ == "__main__":
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, max_restarts=0)  # one node: no torch
    print(elastic_launch(config, flags)()[0])
"""


@pytest.mark.parametrize("flag", ["-E", "-I"])
def test_a_function_rank_keeps_the_environment_ranktop_gives_it_whatever_the_callers_flags(tmp_path, flag):
    """`python -E` or `-I` was passed on to the ranks with the rest: they ignored PYTHONUNBUFFERED
    (output came in blocks, late) and the stack-dump handler's PYTHONPATH entry (SIGUSR1 killed them)."""
    script = tmp_path / "train.py"
    script.write_text(_ENVIRONMENT_SCRIPT)
    done = subprocess.run([PY, flag, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT if flag == "-E" else tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    ignores_env, safe_path, no_user_site, write_through, boot, faulthandler = ast.literal_eval(
        done.stdout.splitlines()[-1])
    assert (ignores_env, write_through, boot, faulthandler) == (0, True, True, "1")
    assert no_user_site == (flag == "-I")  # the rest of -I still holds
    assert safe_path == (None if sys.version_info < (3, 11) else flag == "-I")  # (3.10 has no -P, no safe_path)


def test_local_rank_in_the_args_is_substituted_as_torchs_agent_does(tmp_path):
    """torch's agent (and so torchrun and elastic_launch) puts each rank's local rank in for
    `${local_rank}` in its text arguments; ranktop's passed them through as written."""
    args = ("-c", "import sys; print(sys.argv[1:])", "--local_rank=${local_rank}", "$local_rank", "a$$b", "$HOME",
            "${rank}")
    spec = WorkerSpec(role="r", local_world_size=2, entrypoint=PY, args=args)
    agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL))
    assert not agent.run().is_failed()
    shown = [(tmp_path / os.path.basename(agent.run_dir) / "attempt_0" / str(r) / "stdout.log").read_text()
             for r in (0, 1)]
    expected = [["--local_rank=0", "0", "a$b", "$HOME", "${rank}"], ["--local_rank=1", "1", "a$b", "$HOME", "${rank}"]]
    assert [ast.literal_eval(text) for text in shown] == expected
    try:
        from torch.distributed.elastic.utils.api import macros
    except ImportError:
        return
    assert [macros.substitute(list(args[2:]), str(r)) for r in (0, 1)] == expected  # torch's own, on the same


_IDENTITY_SCRIPT = """
import multiprocessing, sys, tempfile
sys.path.insert(0, sys.argv[2])
import rank_fns

if __name__ == "__main__":
    if sys.argv[1] == "torch":
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    else:
        from ranktop.core import DefaultLogsSpecs, start_processes
    key = multiprocessing.current_process().authkey.hex()
    for method, n in (("spawn", 2), ("fork", 1)):
        ctx = start_processes("t", rank_fns.process_identity, {r: (key,) for r in range(n)},
                              {r: {"LOCAL_RANK": str(r)} for r in range(n)},
                              DefaultLogsSpecs(log_dir=tempfile.mkdtemp(dir=sys.argv[3])), start_method=method)
        print(method, ctx.wait(60, 0.05).return_values, flush=True)
        ctx.close()
    print("next", [multiprocessing.current_process().name, multiprocessing.Process().name])
"""


def test_a_function_rank_is_named_and_parented_as_torchs_multiprocessing_child(tmp_path):
    """torch's function ranks are multiprocessing children: `current_process().name` is
    SpawnProcess-N (ForkProcess-N for fork), numbered on from the caller's own counter, their
    parent_process() is the caller, and they share its authkey. ranktop's said MainProcess with no
    parent: `current_process().name == "MainProcess"` (or `parent_process() is None`), the usual
    "am I the parent" test, was true in every rank."""
    script = tmp_path / "who.py"
    script.write_text(_IDENTITY_SCRIPT)
    impls = ["ranktop"] + (["torch"] if has_torch_elastic() else [])
    shown = {}
    for impl in impls:
        done = subprocess.run([PY, str(script), impl, os.path.dirname(__file__), str(tmp_path)], capture_output=True,
                              text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        shown[impl] = [(line.split(" ", 1)[0], ast.literal_eval(line.split(" ", 1)[1]))
                       for line in done.stdout.splitlines()]
    parent = ["MainProcess", True, True]
    assert shown["ranktop"] == [
        ("spawn", {0: ["SpawnProcess-1", [1], parent, True, "spawn"], 1: ["SpawnProcess-2", [2], parent, True, "spawn"]}),
        ("fork", {0: ["ForkProcess-3", [3], parent, True, "fork"]}),
        ("next", ["MainProcess", "Process-4"]),  # the caller's next child is numbered after the ranks
    ]
    assert shown.get("torch", shown["ranktop"]) == shown["ranktop"]


def test_elastic_launch_names_its_function_ranks_by_its_start_method(tmp_path):
    """torch's agent starts its ranks with start_processes: the same names, by the config's method."""
    import multiprocessing

    from ranktop.core.launcher import LaunchConfig, elastic_launch

    key = multiprocessing.current_process().authkey.hex()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=0, start_method="forkserver",
                          logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    shown = elastic_launch(config, rank_fns.process_identity)(key)
    (first, second) = (shown[r][1][-1] for r in (0, 1))
    assert second == first + 1 and multiprocessing.Process().name == f"Process-{first + 2}"
    assert shown[0] == [f"ForkServerProcess-{first}", [first], ["MainProcess", True, True], True, "forkserver"]


def test_a_managers_queue_reaches_function_ranks_and_a_plain_queue_is_one_line(tmp_path):
    """A Manager's proxy (manager.Queue(), .dict()) passed to function ranks connects back with the
    caller's authkey, which torch's ranks share as multiprocessing children: ranktop's had their
    own, and failed with `AuthenticationError: digest received was wrong`. A plain
    multiprocessing.Queue only a multiprocessing start can send (torch's spawn does): a one-line
    RuntimeError that says what to pass instead."""
    import multiprocessing

    for name in ("m", "q"):
        (tmp_path / name).mkdir()
    with multiprocessing.Manager() as manager:
        queue = manager.Queue()
        result = _ended(start_processes("q", rank_fns.put_rank_in, {0: (queue,), 1: (queue,)},
                                        {r: {"LOCAL_RANK": str(r)} for r in range(2)}, str(tmp_path / "m")))
        assert result.return_values == {0: "put", 1: "put"} and sorted([queue.get(), queue.get()]) == [0, 1]
    with pytest.raises(RuntimeError, match=r"^cannot send the arguments of 'put_rank_in' to a new process: "
                                           r"Queue objects .* pass a Manager's instead, manager.Queue\(\)\)$"):
        start_processes("q", rank_fns.put_rank_in, {0: (multiprocessing.Queue(),)}, {0: {}}, str(tmp_path / "q"))
