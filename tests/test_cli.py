"""`ranktop --headless`: flags, environment, files, exit statuses, stopping, restarts, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, ranktop_cmd, read_events, run_in_pty, run_ranktop, wait_for
from ranktop.core.errors import UsageError
from ranktop.core.sanitize import quoted
from ranktop.core.spec import free_port, parse_nnodes, parse_signal

RANKS = ROOT / "tests" / "ranks"


def _env_of(run_dir, rank, attempt=0):
    text = open(os.path.join(run_dir, f"attempt_{attempt}", str(rank), "stdout.log")).read()
    return json.loads(text.split("ENV ", 1)[1])


def test_per_rank_environment(tmp_path):
    res = run_ranktop("--headless", "--nproc_per_node", "2", "--log-dir", str(tmp_path), "--run-id", "envs",
                      "--role", "trainer", "--env", "EXTRA=1", "--debug", str(RANKS / "env_dump.py"))
    assert res.returncode == 0, res.stderr
    run_dir = tmp_path / "envs"
    envs = [_env_of(run_dir, r) for r in (0, 1)]
    port = envs[0]["MASTER_PORT"]
    for r, env in enumerate(envs):
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE",
                                    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME")} == {
            "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0", "ROLE_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
            "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "trainer"}
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == port and 0 < int(port) < 65536
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == "envs"
        assert env["TORCHELASTIC_ERROR_FILE"] == str(run_dir / "attempt_0" / str(r) / "error.json")
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["OMP_NUM_THREADS"] == "1"
        assert env["PYTHONUNBUFFERED"] == "1" and env["EXTRA"] == "1"
        assert env["RANKTOP_TEST_ID"] == os.environ["RANKTOP_TEST_ID"]  # the caller's environment is kept
        assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and env["CUDA_LAUNCH_BLOCKING"] == "1"
        assert env["NCCL_DESYNC_DEBUG"] == "1" and env["TORCH_SHOW_CPP_STACKTRACES"] == "1"
        assert env.get("FORCE_COLOR") == os.environ.get("FORCE_COLOR")  # a pipe: no colour hints of ours



@pytest.mark.parametrize("no_color", [False, True])
def test_colour_hints_reach_the_ranks_only_when_their_output_is_shown_in_colour(tmp_path, no_color):
    """SPEC 2.2: FORCE_COLOR/COLUMNS when the output is shown in colour: a terminal without
    NO_COLOR. The pipe of test_per_rank_environment gets neither; NO_COLOR on a terminal neither."""
    unset = ["/usr/bin/env", "-u", "COLUMNS", "-u", "NO_COLOR", "-u", "FORCE_COLOR", *(["NO_COLOR=1"] if no_color else [])]
    argv = unset + ranktop_cmd("--headless", "--log-dir", str(tmp_path), "--run-id", "tty", str(RANKS / "env_dump.py"))
    out, status = run_in_pty(argv, tmp_path, until=b"\x00never")
    assert status == 0, out.decode(errors="replace")
    env = _env_of(tmp_path / "tty", 0)
    if no_color:
        assert "FORCE_COLOR" not in env and "COLUMNS" not in env and env["NO_COLOR"] == "1"
    else:
        assert (env["FORCE_COLOR"], env["COLUMNS"]) == ("1", "120")

def test_a_dumb_terminal_gets_the_headless_console_without_colour_hints(tmp_path):
    """TERM=dumb (Emacs's M-x shell) acts on no escape sequence: the TUI was drawn there as a
    stream of them, and the ranks were told to print colours."""
    argv = ["/usr/bin/env", "-u", "NO_COLOR", "-u", "FORCE_COLOR",
            *ranktop_cmd("--log-dir", str(tmp_path), "--run-id", "dumb", str(RANKS / "env_dump.py"))]
    out, status = run_in_pty(argv, tmp_path, until=b"\x00never", env={"TERM": "dumb"})
    assert status == 0, out.decode(errors="replace")
    assert b"[default0]:" in out and b"\x1b[" not in out
    assert "FORCE_COLOR" not in _env_of(tmp_path / "dumb", 0)


def test_a_launch_from_inside_a_torchrun_worker_has_rank_0_host_the_store(tmp_path):
    """A torchrun worker's environment says TORCHELASTIC_USE_AGENT_STORE=True; a ranktop started
    from there passed it on, and torch's env:// then had no rank host the store: every rank waited
    for an agent's store that was not there (init_process_group hung). torchrun sets the variable
    in every rank, as ranktop now does."""
    res = run_ranktop("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path), "--run-id", "nested",
                      str(RANKS / "env_dump.py"), env={**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert res.returncode == 0, res.stderr
    assert [_env_of(tmp_path / "nested", r)["TORCHELASTIC_USE_AGENT_STORE"] for r in (0, 1)] == ["False", "False"]


def test_static_multi_node_without_torch_ranks_and_user_omp_threads(tmp_path):
    # ranktop's own static form: no agent meets the others first (with torch, torch's static
    # rendezvous would wait for a master at 10.0.0.5), the ranks get the same world
    res = run_ranktop("--headless", "-j", "3x2", "--node-rank", "2", "--master-addr", "10.0.0.5",
                      "--master-port", "29555", "--log-dir", str(tmp_path), "--run-id", "mn",
                      str(RANKS / "env_dump.py"), env={**os.environ, "OMP_NUM_THREADS": "4"}, without="torch")
    assert res.returncode == 0, res.stderr
    env = _env_of(tmp_path / "mn", 1)
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == (
        "5", "1", "2", "6", "3")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["OMP_NUM_THREADS"]) == ("10.0.0.5", "29555", "4")
    assert "[default5]:ENV" in res.stdout and "[default4]:ENV" in res.stdout


def test_static_backend_without_torch_gives_the_ranks_its_endpoint_as_the_master(tmp_path):
    """`--rdzv-backend static --rdzv-endpoint HOST:PORT` without torch is ranktop's own static form,
    as the API's static backend without torch is: the ranks meet at the endpoint. The endpoint went
    unused, and every node's ranks got 127.0.0.1:29500 (on two hosts, a wait for ever)."""
    res = run_ranktop("--headless", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--rdzv-backend",
                      "static", "--rdzv-endpoint", "10.0.0.5:29555", "--log-dir", str(tmp_path), "--run-id", "ep",
                      str(RANKS / "env_dump.py"), without="torch")
    assert res.returncode == 0, res.stderr
    env = _env_of(tmp_path / "ep", 1)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("3", "4", "10.0.0.5", "29555")
    no_port = run_ranktop("--headless", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static",
                          "--rdzv-endpoint", "10.0.0.5", "--log-dir", str(tmp_path), str(RANKS / "env_dump.py"),
                          without="torch")
    assert (no_port.returncode, no_port.stderr) == (2, "ranktop: error: bad --rdzv-endpoint '10.0.0.5': the static "
                                                       "backend needs HOST:PORT (the master's)\n")


def test_an_empty_master_addr_beside_a_static_endpoint_is_unused(tmp_path):
    """`--master-addr=$MASTER_ADDR` (unset) on a line whose static backend names its endpoint:
    the endpoint is where the ranks meet, under torchrun and ranktop's own static form alike, and
    torchrun runs the line; ranktop refused it as an empty address in use."""
    res = run_ranktop("--headless", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static",
                      "--rdzv-endpoint", "10.0.0.5:29555", "--master-addr=", "--log-dir", str(tmp_path), "--run-id",
                      "ep", str(RANKS / "env_dump.py"), without="torch")
    assert res.returncode == 0, res.stderr
    assert (_env_of(tmp_path / "ep", 0)["MASTER_ADDR"], _env_of(tmp_path / "ep", 0)["MASTER_PORT"]) == (
        "10.0.0.5", "29555")


def test_rdzv_id_without_torch_names_the_run_on_every_node(tmp_path):
    """README: --rdzv-id is the same on every node, TORCHELASTIC_RUN_ID and the run directory's
    name, numbered where nodes share a log directory. ranktop's own static form (no torch) gave
    each node an id of its own instead (a timestamp), so the nodes' ranks disagreed on it."""
    for node in ("0", "1"):
        res = run_ranktop("--headless", "--nnodes", "2", "--node-rank", node, "--master-addr", "10.0.0.5",
                          "--master-port", "29555", "--rdzv-id", "job42", "--log-dir", str(tmp_path),
                          str(RANKS / "env_dump.py"), without="torch")
        assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(tmp_path)) == ["job42", "job42.1"]
    assert _env_of(tmp_path / "job42", 0)["TORCHELASTIC_RUN_ID"] == "job42"
    assert _env_of(tmp_path / "job42.1", 0)["TORCHELASTIC_RUN_ID"] == "job42"
    bad = run_ranktop("--headless", "--nnodes", "2", "--node-rank", "1", "--rdzv-id", "a/b", "--log-dir",
                      str(tmp_path), str(RANKS / "env_dump.py"), without="torch")
    assert bad.returncode == 2 and bad.stderr.startswith("ranktop: error: bad --rdzv-id 'a/b': it contains '/'")


def test_rdzv_id_names_a_one_node_run_given_a_master_port_as_torchruns_static_round(tmp_path):
    """torchrun runs one node given a --master-port through its static rendezvous, and its ranks
    get a typed --rdzv-id as TORCHELASTIC_RUN_ID; ranktop dropped it for a timestamp of its own.
    Without a port torchrun runs on a store of its own and leaves the id unused (a random one)."""
    port = str(free_port())
    for _ in range(2):
        res = run_ranktop("--headless", "--master-port", port, "--rdzv_id=job7", "--log-dir", str(tmp_path),
                          str(RANKS / "env_dump.py"))
        assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(tmp_path)) == ["job7", "job7.1"]
    assert _env_of(tmp_path / "job7.1", 0)["TORCHELASTIC_RUN_ID"] == "job7"
    res = run_ranktop("--headless", "--rdzv-id", "job8", "--log-dir", str(tmp_path / "unused"),
                      str(RANKS / "env_dump.py"))
    assert res.returncode == 0 and os.listdir(tmp_path / "unused") != ["job8"]


def test_j_with_flags_that_agree_or_pet_defaults_runs_as_j_says(tmp_path):
    """A typed --nnodes/--nproc-per-node that says what -j says is fine; a PET_* default is not
    typed, and -j beats it as any flag beats its PET_* default."""
    res = run_ranktop("--headless", "-j", "1x2", "--nproc-per-node", "2", "--nnodes", "1", "--log-dir",
                      str(tmp_path), "--run-id", "agree", str(RANKS / "env_dump.py"))
    assert res.returncode == 0, res.stderr
    assert _env_of(tmp_path / "agree", 1)["WORLD_SIZE"] == "2"
    res = run_ranktop("--headless", "-j", "2", "--log-dir", str(tmp_path), "--run-id", "pet",
                      str(RANKS / "env_dump.py"), env={**os.environ, "PET_NNODES": "3", "PET_NPROC_PER_NODE": "5"})
    assert res.returncode == 0, res.stderr
    assert (_env_of(tmp_path / "pet", 1)["WORLD_SIZE"], _env_of(tmp_path / "pet", 1)["GROUP_WORLD_SIZE"]) == ("2", "1")


def test_a_flag_on_the_line_overrides_a_bad_pet_default_as_in_torchrun(tmp_path):
    """The command line wins over PET_*: a bad value the line overrides is never used, and torchrun
    runs the line (argparse reads a default only for a flag not given); ranktop refused it. Where
    the line leaves the flag out, the bad value is still one line naming the variable, and --help
    still helps."""
    env = {**os.environ, "PET_MAX_RESTARTS": "lots", "PET_NNODES": "", "PET_START_METHOD": "thread",
           "PET_MONITOR_INTERVAL": "0"}
    res = run_ranktop("--headless", "--max-restarts", "1", "--nnodes=1", "--start_method", "spawn",
                      "--monitor-interval", "0.5", "--log-dir", str(tmp_path), "--no-python", "true", env=env)
    assert res.returncode == 0, res.stderr
    assert run_ranktop("--help", env=env).returncode == 0
    res = run_ranktop("--headless", "--max-restarts", "1", "--nnodes=1", "--monitor-interval", "0.5",
                      "--log-dir", str(tmp_path / "no"), "--no-python", "true", env=env)
    assert (res.returncode, res.stderr) == (2, "ranktop: error: bad PET_START_METHOD='thread': expected one of "
                                               "spawn, fork, forkserver\n")
    assert not (tmp_path / "no").exists()


def test_standalone_picks_a_free_port(tmp_path):
    res = run_ranktop("--headless", "--standalone", "--log-dir", str(tmp_path), "--run-id", "s",
                      str(RANKS / "env_dump.py"))
    assert res.returncode == 0
    assert _env_of(tmp_path / "s", 0)["MASTER_PORT"] != "29500"


def test_a_master_addr_or_port_torchrun_leaves_unused_on_one_node_is_unused(tmp_path):
    """torchrun runs one node without a port or a rendezvous, and any --standalone line, on a store
    of its own at localhost:0: the line's --master-addr (and with --standalone its --master-port)
    go unused. ranktop gave them to the ranks: a host that is not this one (192.0.2.1 is reserved
    for documentation) was a wait for ever in init_process_group, a busy port a failed bind."""
    with socket.socket() as busy:  # held, so no free-port pick can be it
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        lines = {"one-node": ["--nproc-per-node", "2", "--master-addr", "192.0.2.1"],
                 "standalone": ["--standalone", "--master-addr", "192.0.2.1", "--master-port", port]}
        for run_id, flags in lines.items():
            res = run_ranktop("--headless", *flags, "--log-dir", str(tmp_path), "--run-id", run_id,
                              str(RANKS / "env_dump.py"))
            assert res.returncode == 0, res.stderr
            env = _env_of(tmp_path / run_id, 0)
            assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] != port, run_id
    # with a port (torchrun's static rendezvous on one node), both are the line's
    res = run_ranktop("--headless", "--master-addr", "127.0.0.2", "--master-port", port, "--log-dir", str(tmp_path),
                      "--run-id", "static", str(RANKS / "env_dump.py"))
    assert res.returncode == 0, res.stderr
    assert (_env_of(tmp_path / "static", 0)["MASTER_ADDR"], _env_of(tmp_path / "static", 0)["MASTER_PORT"]) == (
        "127.0.0.2", port)


def test_prefixed_console_filter_and_log_layout(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('out', os.environ['RANK'])\nprint('err', os.environ['RANK'], file=sys.stderr)\n")
    res = run_ranktop("--headless", "--nproc-per-node", "3", "--local-ranks-filter", "1", "--log-dir",
                      str(tmp_path / "logs"), "--run-id", "f", str(script))
    assert res.returncode == 0, res.stderr
    assert "[default1]:out 1" in res.stdout and "[default1]:err 1" in res.stderr
    assert "out 0" not in res.stdout and "out 2" not in res.stdout
    for r in range(3):
        rank_dir = tmp_path / "logs" / "f" / "attempt_0" / str(r)
        assert (rank_dir / "stdout.log").read_text() == f"out {r}\n"
        assert (rank_dir / "stderr.log").read_text() == f"err {r}\n"
    events = read_events(tmp_path / "logs" / "f")
    assert [e["event"] for e in events][0] == "run_started" and events[-1]["event"] == "run_finished"
    assert (events[0]["world_size"], events[0]["node_rank"], events[0]["run_id"]) == (3, 0, "f")
    assert sorted(e["rank"] for e in events if e["event"] == "started") == [0, 1, 2]
    assert sorted((e["rank"], e["exitcode"]) for e in events if e["event"] == "exited") == [(0, 0), (1, 0), (2, 0)]
    assert all(isinstance(e["ts"], float) for e in events)


def test_prefix_template_from_flag_and_environment(tmp_path):
    script = tmp_path / "p.py"
    script.write_text("print('hi')\n")
    res = run_ranktop("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path), "--role", "w",
                      "--log-line-prefix-template", "<${role_name}|${rank}|${local_rank}> ", str(script))
    assert sorted(res.stdout.splitlines()) == ["<w|0|0> hi", "<w|1|1> hi"]
    env = {**os.environ, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "${rank}: "}
    res = run_ranktop("--headless", "--log-dir", str(tmp_path), str(script), env=env)
    assert res.stdout == "0: hi\n"


def test_a_duplicate_filter_of_bytes_that_are_not_utf8_matches_those_bytes(tmp_path):
    """A command line's undecodable bytes reach Python as surrogates: encoding them strictly was a
    UnicodeEncodeError after the run directory was made."""
    res = run_ranktop("--headless", "--log-dir", str(tmp_path), "--run-id", "b", "--duplicate-stdout-filters",
                      "\udcff", "--no-python", "printf", "a\\377b\\nplain\\n",
                      errors="replace")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert (tmp_path / "b" / "attempt_0" / "filtered_stdout.log").read_bytes() == b"[default0]:a\xffb\n"


def test_a_headless_metric_is_said_to_be_ignored(tmp_path):
    res = run_ranktop("--headless", "--metric", r"loss (\d+)", "--log-dir", str(tmp_path), "--no-python", "echo", "hi")
    assert res.returncode == 0 and res.stdout == "[default0]:hi\n"
    assert res.stderr == ("ranktop: --metric ignored: a headless run has no TUI to show it in "
                          "(ranktop attach RUN --metric REGEX does)\n")


def test_redirects_keep_streams_off_the_console_but_in_files(tmp_path):
    script = tmp_path / "r.py"
    script.write_text("import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n")
    res = run_ranktop("--headless", "-r", "1", "--log-dir", str(tmp_path), "--run-id", "r", str(script))
    assert "to out" not in res.stdout and "[default0]:to err" in res.stderr
    assert (tmp_path / "r" / "attempt_0" / "0" / "stdout.log").read_text() == "to out\n"


def test_module_and_no_python_modes(tmp_path):
    res = run_ranktop("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path), "-m", "json.tool",
                      "--help")
    assert res.returncode == 0 and "[default1]:usage:" in res.stdout
    res = run_ranktop("--headless", "--no-python", "--log-dir", str(tmp_path), "echo", "a", "1")
    assert res.returncode == 0 and res.stdout == "[default0]:a 1\n"


def test_with_a_venv_and_a_conda_env_both_active_the_one_first_on_path_runs_the_ranks(tmp_path):
    """conda activates its base env in every shell, and a venv activated over it leaves both
    CONDA_PREFIX and VIRTUAL_ENV set: `python` is the venv's, the one first on PATH. With ranktop
    installed in that venv the ranks ran conda's base python, without the venv's packages."""
    from ranktop.tui.cli import python_for_ranks

    def env_at(name: str) -> str:
        (tmp_path / name / "bin").mkdir(parents=True)
        os.symlink(sys.executable, tmp_path / name / "bin" / "python")
        return str(tmp_path / name)

    conda, venv = env_at("conda"), env_at("venv")
    ours = os.path.join(sys.prefix, "bin")
    both = {"CONDA_PREFIX": conda, "VIRTUAL_ENV": sys.prefix, "PATH": f"{ours}:{conda}/bin:/usr/bin"}
    assert python_for_ranks(both) == sys.executable  # ranktop's own venv, over conda's base
    # Another venv over conda's base (ranktop from pipx): that venv's
    assert python_for_ranks({**both, "VIRTUAL_ENV": venv, "PATH": f"{venv}/bin:{conda}/bin"}) == f"{venv}/bin/python"
    # A conda env activated inside a venv: conda's, first on PATH
    assert python_for_ranks({**both, "VIRTUAL_ENV": venv, "PATH": f"{conda}/bin:{venv}/bin"}) == f"{conda}/bin/python"
    # Neither on PATH (sudo's secure_path): VIRTUAL_ENV first, as before
    assert python_for_ranks({**both, "VIRTUAL_ENV": venv, "PATH": "/usr/bin"}) == f"{venv}/bin/python"
    assert python_for_ranks({**both, "PATH": "/usr/bin"}) == sys.executable


def test_root_cause_tail_skips_a_chained_printed_traceback(tmp_path):
    script = tmp_path / "chain.py"
    script.write_text(
        "import sys\n"
        "sys.path.insert(0, %r)\n"
        "from ranktop.core import record\n"
        "@record\n"
        "def main():\n"
        "    for i in range(15):\n"
        "        print(f'step {i}', flush=True)\n"
        "    try:\n"
        "        {}['missing']\n"
        "    except KeyError:\n"
        "        raise RuntimeError('lost the batch')\n"
        "main()\n" % str(ROOT))
    res = run_ranktop("--headless", "--nproc-per-node", "1", "--log-dir", str(tmp_path), "--run-id", "x", str(script))
    assert res.returncode == 1 and "RuntimeError: lost the batch" in res.stderr
    tail = res.stderr.split("last output of rank 0:\n", 1)[1].split("  error file:", 1)[0]
    assert tail.splitlines() == [f"    step {i}" for i in range(5, 15)]


def test_failure_exit_status_and_root_cause(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "sys.path.insert(0, %r)\n"
        "from ranktop.core import record\n"
        "@record\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        print('about to fail', flush=True)\n"
        "        raise ValueError('bad batch')\n"
        "    time.sleep(30)\n"
        "main()\n" % str(ROOT))
    res = run_ranktop("--headless", "--nproc-per-node", "3", "--log-dir", str(tmp_path), "--run-id", "x", str(script))
    assert res.returncode == 1
    assert "root cause: rank 1 (local rank 1" in res.stderr and "exited with code 1" in res.stderr
    assert "ValueError: bad batch" in res.stderr and "Traceback" in res.stderr
    # The tail is what came before the traceback; the printed one (with its module-level frame,
    # which error.json does not have) is not repeated under it.
    assert "last output of rank 1:\n    about to fail\n  error file:" in res.stderr
    assert "last output of rank 0" not in res.stderr  # stopped by us: not a failure of its own
    exited = {e["rank"]: e for e in read_events(tmp_path / "x") if e["event"] == "exited"}
    assert exited[1]["exitcode"] == 1 and not exited[1]["by_us"]
    assert exited[0]["signal"] == "SIGTERM" and exited[0]["by_us"]


def test_signal_death_is_named_and_the_report_says_where_the_logs_are(tmp_path):
    res = run_ranktop("--headless", "--log-dir", str(tmp_path), "--run-id", "sg", "--no-python", sys.executable,
                      "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert res.returncode == 1
    assert "was killed by SIGSEGV" in res.stderr
    # No error file to point at: the report still ends with the run directory.
    assert "error file:" not in res.stderr and f"  logs: {tmp_path / 'sg'}\n" in res.stderr


def test_run_path_records_an_uncaught_exception_in_the_error_file_as_torchrun(tmp_path):
    """torchrun's --run-path runs the script in a recorded function, so an exception it lets out
    leaves error.json and the report quotes it; ranktop's left no file. A SystemExit leaves none,
    nor does a KeyboardInterrupt (torch's record takes an Exception only): a Ctrl-C passed on to
    the ranks left an error.json in each rank's directory."""
    script = tmp_path / "boom.py"
    script.write_text("import sys\nif sys.argv[1:] == ['exit']:\n    sys.exit(3)\nif sys.argv[1:] == ['interrupt']:\n"
                      "    raise KeyboardInterrupt\nraise ValueError('boom in the script')\n")
    res = run_ranktop("--headless", "--log-dir", str(tmp_path), "--run-id", "rp", "--run-path", str(script))
    assert res.returncode == 1
    error_file = tmp_path / "rp" / "attempt_0" / "0" / "error.json"
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "ValueError: boom in the script"
    assert "raise ValueError('boom in the script')" in message["extraInfo"]["py_callstack"]
    assert int(message["extraInfo"]["timestamp"]) > 0
    assert f"  error file: {error_file}\n" in res.stderr
    res = run_ranktop("--headless", "--log-dir", str(tmp_path), "--run-id", "rx", "--run-path", str(script), "exit")
    assert res.returncode == 1 and "exited with code 3" in res.stderr
    assert not (tmp_path / "rx" / "attempt_0" / "0" / "error.json").exists()
    res = run_ranktop("--headless", "--log-dir", str(tmp_path), "--run-id", "ri", "--run-path", str(script), "interrupt")
    assert res.returncode == 1 and "Signal 2 (SIGINT)" in res.stderr, res.stderr
    assert not (tmp_path / "ri" / "attempt_0" / "0" / "error.json").exists()


def test_a_file_timer_asked_for_says_in_one_line_that_no_watchdog_runs(tmp_path):
    """TORCHELASTIC_ENABLE_FILE_TIMER=1 has torch's agent run a file-timer watchdog and give its
    ranks TORCHELASTIC_TIMER_FILE; ranktop runs none, and said nothing of it (a rank's timers were
    never enforced, or it failed on the missing variable)."""
    res = run_ranktop("--headless", "--log-dir", str(tmp_path), "--no-python", "true",
                      env={**os.environ, "TORCHELASTIC_ENABLE_FILE_TIMER": "1"})
    assert res.returncode == 0, res.stderr
    assert res.stderr == ("ranktop: TORCHELASTIC_ENABLE_FILE_TIMER=1 ignored: ranktop runs no file-timer watchdog, "
                          "so the ranks get no TORCHELASTIC_TIMER_FILE and their torch.distributed.elastic.timer "
                          "timers are not enforced\n")


def test_restart_after_crash_picks_up_attempt_1(tmp_path):
    res = run_ranktop("--headless", "--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", str(tmp_path),
                      "--run-id", "re", "--shutdown-timeout", "5", str(RANKS / "crash_first_attempt.py"))
    assert res.returncode == 0, res.stderr
    run = tmp_path / "re"
    assert sorted(os.listdir(run)) == ["attempt_0", "attempt_1", "events.jsonl", "final.json"]
    assert (run / "attempt_1" / "1" / "stdout.log").read_text() == "rank 1 attempt 1\n"
    assert (run / "attempt_0" / "1" / "stdout.log").read_text() == "rank 1 attempt 0\n"
    events = read_events(run)
    restarts = [e for e in events if e["event"] == "group_restart"]
    assert [(e["attempt"], e["reason"]) for e in restarts] == [(1, "failure")]
    assert events[-1]["state"] == "SUCCEEDED"


def test_restarts_exhausted_gives_exit_1(tmp_path):
    res = run_ranktop("--headless", "--max-restarts", "1", "--log-dir", str(tmp_path), "--run-id", "ex",
                      "--no-python", "false")
    assert res.returncode == 1
    assert "in attempt_1 (2 of 2 attempts)" in res.stderr
    assert sorted(os.listdir(tmp_path / "ex")) == ["attempt_0", "attempt_1", "events.jsonl", "final.json"]


def _start_family(tmp_path, *flags, script_args=()):
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path),
                                        "--run-id", "fam", *flags, str(RANKS / "family.py"), *script_args),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    for _ in range(2):
        line = proc.stdout.readline()
        assert "PIDS" in line, line + proc.stderr.read()
        pids += [int(p) for p in line.split("PIDS", 1)[1].split()]
    return proc, pids


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_to_ranktop_is_forwarded_and_exit_is_128_plus_n(tmp_path, sig):
    proc, pids = _start_family(tmp_path)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + sig
    assert f"stopped by {signal.Signals(sig).name}" in err
    wait_for(lambda: not any(_alive(p) for p in pids), timeout=5, what="ranks and grandchildren gone")
    events = read_events(tmp_path / "fam")
    assert any(e["event"] == "signal_received" for e in events)
    # The ranks it stopped are not to blame: no root cause (it used to name rank 0).
    assert [e["root_cause_rank"] for e in events if e["event"] == "run_finished"] == [None]


def test_shutdown_timeout_escalates_to_sigkill(tmp_path):
    proc, pids = _start_family(tmp_path, "--shutdown-timeout", "0.5", script_args=["--ignore-term"])
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    exited = {e["pid"]: e for e in read_events(tmp_path / "fam") if e["event"] == "exited"}
    assert {exited[pids[0]]["signal"], exited[pids[3]]["signal"]} == {"SIGKILL"}
    wait_for(lambda: not any(_alive(p) for p in pids), timeout=5, what="everything gone")


def test_sigkill_of_ranktop_leaves_nothing_behind(tmp_path):
    proc, pids = _start_family(tmp_path, "--shutdown-timeout", "1")
    proc.kill()
    proc.communicate(timeout=10)
    # The guard stops groups and the setsid-escaped grandchildren (they carry the run's marker).
    wait_for(lambda: not any(_alive(p) for p in pids), timeout=10, what="ranks and grandchildren gone")


GUARDS_SEEN = ("import sys; from ranktop.core import guard; from ranktop.tui.cli import main\n"
               "launch, started = guard._launch, []\n"
               "guard._launch = lambda: started.append(launch()) or started[-1]\n"
               "rc = main(sys.argv[1:])\n"
               "print(rc, [p.returncode for p in started], guard._spare)")


@pytest.mark.parametrize(("args", "status", "guards"), [
    (["--no-python", "true"], "0", "[0]"),  # the guard started ahead is the run's: one in all
    (["--max-restarts", "1", "--no-python", "false"], "1", "[0, 0]"),  # the restart gets a new one
    (["--nnodes", "2:1", "--no-python", "true"], "2", "[0]"),  # a bad command line ends the spare
])
def test_the_headless_guard_starts_ahead_and_is_taken_or_ended(tmp_path, args, status, guards):
    # A headless run starts its guard before it imports the engine (its interpreter starts
    # beside ours, not beside the ranks'); every guard is reaped by the time main returns.
    res = subprocess.run([sys.executable, "-c", GUARDS_SEEN, "--headless", "--log-dir", str(tmp_path), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert res.stdout.strip().split(maxsplit=1) == [status, f"{guards} None"], res.stderr


def test_a_guard_killed_during_the_run_does_not_fail_it(tmp_path):
    import psutil

    proc = subprocess.Popen(ranktop_cmd("--headless", "--log-dir", str(tmp_path / "logs"), "--no-python", "sleep", "2"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def children(word: str) -> list[psutil.Process]:
            return [c for c in psutil.Process(proc.pid).children() if word in " ".join(c.cmdline())]

        wait_for(lambda: children("sleep"), what="the rank running")  # (the run has taken its guard by then)
        (guard,) = children("guard.main()")
        guard.kill()  # someone kills it: the run goes on, and ends as it would have
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_a_guard_py_where_ranktop_runs_is_never_run_as_the_guard(tmp_path):
    # The guard starts as `import guard` from ranktop's own directory, in isolated mode: a
    # guard.py in the working directory (a shared one, say) must not be what runs.
    planted = tmp_path / "planted"
    (tmp_path / "guard.py").write_text(f"open({str(planted)!r}, 'w').close()\nmain = lambda: None\n")
    done = run_ranktop("--headless", "--log-dir", str(tmp_path / "logs"), "--no-python", "true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not planted.exists()


def test_headless_does_not_import_textual(tmp_path):
    code = ("import sys; from ranktop.tui.cli import main; rc = main(['--headless', '--log-dir', %r, '--no-python', 'true']);"
            "print('textual' in sys.modules, rc)" % str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert res.stdout.strip() == "False 0", res.stderr


def test_the_collector_waits_out_start_up_and_collects_while_the_ranks_run(tmp_path):
    # Collections are held while ranktop starts (it would scan the imports' objects again and
    # again), and must be back, with start-up's objects frozen, before the run's long wait.
    code = ("import gc, sys, time; from ranktop.core import collector; from ranktop.tui.cli import main; seen = []\n"
            "release = collector.release\n"
            "collector.release = lambda: (seen.append((gc.isenabled(), time.monotonic())), release())\n"
            "rc = main(['--headless', '--log-dir', %r, '--no-python', 'sleep', '2'])\n"
            "print(seen[0][0], round(time.monotonic() - seen[0][1]), gc.isenabled(), gc.get_freeze_count() > 0, rc)"
            % str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    held, seconds_before_the_end, enabled, frozen, rc = res.stdout.split()
    assert (held, enabled, frozen, rc) == ("False", "True", "True", "0"), res.stderr
    assert int(seconds_before_the_end) >= 2  # released before the rank's 2 s, not at the exit


def test_version_and_help():
    assert run_ranktop("--version").stdout.startswith("ranktop ")
    help_text = run_ranktop("--help").stdout
    for flag in ("--nproc-per-node", "-j", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                 "--standalone", "--module", "--no-python", "--max-restarts", "--monitor-interval", "--log-dir",
                 "--redirects", "--tee", "--local-ranks-filter", "--role", "--log-line-prefix-template",
                 "--shutdown-timeout", "--env", "--debug", "--stall-timeout", "--headless", "--tui"):
        assert flag in help_text
    assert "subcommands:" in help_text and "ranktop stacks [TARGET]" in help_text


BAD_INPUT = [
    (["missing.py"], "bad script 'missing.py': no such file"),
    # A byte not in the file system's encoding is quoted as `\xff`, a backslash as typed (repr
    # wrote 'bad\udcff/x.py' and '2\\1'), an escape as its picture: still one line.
    (["bad\udcff/x.py"], "bad script 'bad\\xff/x.py': no such file"),
    (["--nnodes", "2\\1\x1b[2J", "{script}"], "bad --nnodes '2\\1␛[2J': expected N or MIN:MAX"),
    (["--no-python", "{nonexec}"], "not executable"),
    (["--no-python", "no-such-binary-xyz"], "bad binary 'no-such-binary-xyz': not found"),
    (["--nproc-per-node", "0", "{script}"], "bad --nproc-per-node '0'"),
    (["--nproc-per-node", "-3", "{script}"], "bad --nproc-per-node '-3'"),
    (["--nproc-per-node", "abc", "{script}"], "bad --nproc-per-node 'abc': expected a positive whole number"),
    (["-j", "2x", "{script}"], "bad -j '2x'"),
    (["-j", "x4", "{script}"], "bad -j 'x4'"),
    (["-j", "1:2:3x4", "{script}"], "bad -j '1:2:3x4': expected N, NxM or MIN:MAXxM"),
    (["--redirects", "0:5", "{script}"], "bad -r/-t: bad stream spec '0:5'"),
    # a rank of more digits than int() reads (4300): this was Python's 'Exceeds the limit' words
    (["-t", "1" * 5000 + ":3", "{script}"], "bad -r/-t: bad stream spec '11111"),
    (["--local-ranks-filter", "a", "{script}"], "bad --local-ranks-filter 'a'"),
    (["--local-ranks-filter", "0," + "1" * 5000, "{script}"], "bad --local-ranks-filter '0,111"),
    (["--log-dir", "{file}", "{script}"], "it is not a directory"),
    (["--log-dir", "/proc/ranktop-test", "{script}"], "cannot write there"),
    (["--master-port", "70000", "{script}"], "bad --master-port '70000': expected a whole number from 0 to 65535"),
    (["--env", "NOEQUALS", "{script}"], "bad --env 'NOEQUALS'"),
    (["--nnodes", "2", "--node-rank", "2", "{script}"], "bad --node-rank 2"),
    (["--max-restarts", "x", "{script}"], "bad --max-restarts 'x': expected a whole number, 0 or more"),
    (["--metric", "loss ([", "{script}"], "bad --metric 'loss ([': unterminated character set at position 6"),
]

# Every number flag: finite and in range, else one line naming the flag, the value as typed and
# what is accepted (nan seconds used to busy-loop forever; 1e8 ranks ate memory).
SECONDS = "expected a number of seconds from 0 to 604800"
NUMBER_INPUT = [
    (["--shutdown-timeout", "nan", "{script}"], f"bad --shutdown-timeout 'nan': {SECONDS}"),
    (["--shutdown-timeout", "-1", "{script}"], f"bad --shutdown-timeout '-1': {SECONDS}"),
    (["--shutdown-timeout=inf", "{script}"], f"bad --shutdown-timeout 'inf': {SECONDS}"),
    (["--shutdown_timeout", "1e400", "{script}"], f"bad --shutdown-timeout '1e400': {SECONDS}"),
    (["--shutdown-timeout", "soon", "{script}"], f"bad --shutdown-timeout 'soon': {SECONDS}"),
    (["--shutdown-timeout", "604801", "{script}"], f"bad --shutdown-timeout '604801': {SECONDS}"),
    (["--monitor-interval", "0", "{script}"],
     "bad --monitor-interval '0': expected a number of seconds from 0.001 to 604800"),
    (["--monitor-interval", "nan", "{script}"], "bad --monitor-interval 'nan': expected a number of seconds"),
    (["--monitor_interval", "-0.5", "{script}"], "bad --monitor-interval '-0.5': expected a number of seconds"),
    (["--stall-timeout", "0", "{script}"],
     "bad --stall-timeout '0': expected a number of seconds above 0, at most 604800"),
    (["--stall-timeout", "nan", "{script}"], "bad --stall-timeout 'nan': expected a number of seconds above 0"),
    (["--stall-timeout=-inf", "{script}"], "bad --stall-timeout '-inf': expected a number of seconds above 0"),
    (["--max-restarts", "-1", "{script}"], "bad --max-restarts '-1': expected a whole number, 0 or more"),
    (["--max-restarts", "1.5", "{script}"], "bad --max-restarts '1.5': expected a whole number, 0 or more"),
    # an empty value (--max-restarts=$N, N unset) is quoted: unquoted it left the line without a value
    (["--max-restarts=", "{script}"], "bad --max-restarts '': expected a whole number, 0 or more"),
    (["--linger=", "{script}"], "bad --linger '': expected a number of seconds from 0 to 604800"),
    (["--nproc-per-node", "100000000", "{script}"],
     "bad --nproc-per-node '100000000': expected a positive whole number (at most 4096), auto, cpu, gpu or xpu"),
    (["--nproc-per-node", "1e8", "{script}"], "bad --nproc-per-node '1e8': expected a positive whole number"),
    (["--nproc-per-node", "4097", "{script}"], "bad --nproc-per-node '4097': expected a positive whole number"),
    (["-j", "1x100000000", "{script}"], "bad -j '1x100000000': expected 1 <= MIN <= MAX <= 524287 nodes and 1 to 4096"),
    (["-j", "0x2", "{script}"], "bad -j '0x2': expected 1 <= MIN <= MAX"),
    (["-j", "3:2x2", "{script}"], "bad -j '3:2x2': expected 1 <= MIN <= MAX"),
    (["-j", "0", "{script}"], "bad -j '0': expected 1 <= MIN <= MAX"),
    # torch retried a malformed address until its time-out; the ranks got it as MASTER_ADDR
    (["--master-addr", "[::1", "{script}"],
     "bad --master-addr '[::1': expected a host name or an IP address (IPv6 bare or in brackets)"),
    (["--master-addr", "node 0", "{script}"], "bad --master-addr 'node 0': expected a host name"),
    # empty where it is used (one node given a port: torch's static rendezvous on ':PORT'); unused, it runs
    (["--master-addr", "", "--master-port", "29500", "{script}"], "bad --master-addr '': expected a host name"),
    (["--nnodes", "2", "--master_addr=", "{script}"], "bad --master-addr '': expected a host name"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "--local-addr", "[::1",
      "{script}"], "bad --local-addr '[::1': expected a host name or an IP address"),
    # -j names the nodes and ranks: a typed --nnodes or --nproc-per-node that says otherwise was dropped
    (["-j", "2x4", "--nnodes", "1", "{script}"], "-j 2x4 means --nnodes 2, and --nnodes 1 was given too: give one of them"),
    (["--nnodes=1", "-j", "1:2x2", "{script}"], "-j 1:2x2 means --nnodes 1:2, and --nnodes 1 was given too"),
    (["-j", "4", "--nproc_per_node", "2", "{script}"],
     "-j 4 means --nproc-per-node 4, and --nproc-per-node 2 was given too: give one of them"),
    (["--nnodes", "0", "{script}"], "bad --nnodes '0': expected N or MIN:MAX with 1 <= MIN <= MAX <= 524287"),
    (["--nnodes", "4:2", "{script}"], "bad --nnodes '4:2': expected N or MIN:MAX"),
    (["--nnodes", "99999999999", "{script}"], "bad --nnodes '99999999999': expected N or MIN:MAX"),
    (["--node-rank", "-1", "{script}"], "bad --node-rank '-1': expected a whole number, 0 or more"),
    (["--node_rank", "first", "{script}"], "bad --node-rank 'first': expected a whole number, 0 or more"),
    # 0 is a free port on one node (tests/test_torchrun_parity.py, [master-port-0]); several cannot find it
    (["--nnodes", "2", "--master_port=0", "{script}"], "bad --master-port 0: port 0 (a free one) only works on one "
                                                        "node: with 2 nodes the others could not find it"),
    (["--master-port", "nan", "{script}"], "bad --master-port 'nan': expected a whole number from 0 to 65535"),
    # read by no handler (one node, --standalone): it ran as if not given, where torchrun refuses it
    (["--rdzv-conf", "foo", "{script}"], "bad --rdzv-conf 'foo': expected KEY=VALUE[,KEY=VALUE...]"),
    (["--standalone", "--rdzv-conf", "join_timeout=abc", "{script}"],
     "bad --rdzv-conf join_timeout=abc: expected a positive whole number"),
    (["--rdzv_conf=ranks_store=mine", "{script}"], "bad --rdzv-conf ranks_store=mine: expected fresh or rendezvous"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUT + NUMBER_INPUT)
def test_bad_input_gives_one_line_and_starts_nothing(tmp_path, argv, message):
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    nonexec = tmp_path / "nonexec"
    nonexec.write_text("#!/bin/sh\n")
    (tmp_path / "afile").write_text("keep")
    subst = {"{script}": str(script), "{nonexec}": str(nonexec), "{file}": str(tmp_path / "afile")}
    args = [subst.get(a, a) for a in argv]
    if "--log-dir" not in args:
        args = ["--log-dir", str(tmp_path / "logs"), *args]
    res = run_ranktop("--headless", *args)
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "logs").exists() or not os.listdir(tmp_path / "logs")
    assert (tmp_path / "afile").read_text() == "keep"


ALLOWED = "(a run id names its run directory: printable characters other than '/', and not '.' or '..'; e.g. exp-1)"


@pytest.mark.parametrize(("run_id", "why"), [
    ("a/b", "it contains '/'"),
    ("..", "it is the name of the current or parent directory"),
    ("a\x1bb", "it contains a control character (U+001B)"),
    ("", "it is empty"),
])
@pytest.mark.parametrize("mode", ["--headless", "--detach"])
def test_a_bad_run_id_says_why_and_what_is_allowed(tmp_path, run_id, why, mode):
    """The line names the flag, the value, what is wrong with it and what a run id may be. It used
    to list '.' both among the characters refused and those to use."""
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    res = run_ranktop(mode, "--run-id", run_id, "--log-dir", str(tmp_path / "logs"), str(script),
                      env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert res.returncode == 2 and res.stdout == ""
    typed = run_id.replace("\x1b", "␛")  # (quoted as typed, an escape as its picture)
    assert res.stderr == f"ranktop: error: bad --run-id '{typed}': {why} {ALLOWED}\n"
    assert not (tmp_path / "ran").exists() and not (tmp_path / "logs").exists() and os.listdir(runtime) == []


@pytest.mark.parametrize(("run_id", "why"), [
    ("a\u00a0b", "it contains U+00A0 (NO-BREAK SPACE), which is not printable"),  # quoted, 'a b'
    ("a\u200bb", "it contains U+200B (ZERO WIDTH SPACE), which is not printable"),  # quoted, 'ab'
    ("a\udcffb", f"it contains the byte \\xff, which is not {sys.getfilesystemencoding()} text"),
])
def test_a_run_id_names_the_character_it_may_not_hold(run_id, why):
    """Each of these was 'it contains a control character': none is one, and the first two look,
    quoted, like a space and like nothing."""
    from ranktop.core.layout import check_run_id

    with pytest.raises(UsageError) as refused:
        check_run_id(run_id)
    assert str(refused.value).startswith(f"bad --run-id {quoted(run_id)}: {why} (a run id names")


def test_unknown_signal_name_is_refused():
    assert parse_signal("usr1") == signal.SIGUSR1 and parse_signal("SIGTERM") == signal.SIGTERM
    with pytest.raises(UsageError, match="unknown signal 'SIGFOO': use a name like TERM"):
        parse_signal("SIGFOO")


def test_parse_nnodes_forms():
    assert parse_nnodes("2:4x8") == (2, 4, 8, "2:4")
    assert parse_nnodes("2x8") == (2, 2, 8, "2")
    assert parse_nnodes("8") == (1, 1, 8, "1")
    for bad in ("2x", "x4", "1:2:3x4", "", "a"):
        with pytest.raises(ValueError, match="expected N, NxM or MIN:MAXxM"):
            parse_nnodes(bad)


def test_parse_nnodes_refuses_what_the_command_lines_j_refuses():
    """The Python API's parse_nnodes (TorchX's) took `0x8`, no nodes, which -j refused: one rule
    for both, torchrun's (0 < MIN <= MAX), in one line (a UsageError, so a ValueError as TorchX's)."""
    for bad in ("0x8", "0", "0:2x8", "3:2x2", "1x100000000", "600000x1"):
        expected = f"bad -j '{bad}': expected 1 <= MIN <= MAX <= 524287 nodes and 1 to 4096 ranks per node"
        with pytest.raises(UsageError) as raised:
            parse_nnodes(bad)
        assert str(raised.value) == expected
        assert run_ranktop("--headless", "-j", bad, "x.py").stderr.strip() == f"ranktop: error: {expected}"


def test_console_shows_the_last_state_of_a_progress_bar_but_files_keep_every_byte(tmp_path):
    script = tmp_path / "bar.py"
    script.write_text("import sys\nfor i in (10, 50, 100):\n    sys.stdout.write(f'\\rbar {i}%')\n    sys.stdout.flush()\nprint()\n")
    res = run_ranktop("--headless", "--log-dir", str(tmp_path), "--run-id", "bar", str(script))
    assert res.stdout == "[default0]:bar 100%\n"
    assert (tmp_path / "bar" / "attempt_0" / "0" / "stdout.log").read_bytes() == b"\rbar 10%\rbar 50%\rbar 100%\n"


PTY_RANK = """\
import hashlib, json, os, random, sys
rank = int(os.environ["RANK"])
size = os.get_terminal_size(1)
print(json.dumps({"tty": [sys.stdout.isatty(), sys.stderr.isatty()], "size": [size.columns, size.lines],
                  "term": os.environ.get("TERM")}), flush=True)
sys.stderr.write("from stderr\\n")
sys.stderr.flush()
rng = random.Random(rank)  # any bytes at all: controls, '\\r', '\\n', invalid UTF-8
blob = bytes(rng.randrange(256) for _ in range(3 << 20))
view = memoryview(blob)
while view:
    view = view[os.write(1, view[:65536]):]
with open(sys.argv[1] + f"/expect.{rank}", "w") as f:
    f.write(hashlib.sha256(blob).hexdigest())
"""


def test_pty_mode_gives_each_rank_a_terminal_and_keeps_every_byte(tmp_path):
    script = tmp_path / "tty.py"
    script.write_text(PTY_RANK)
    res = run_ranktop("--headless", "--pty", "-r", "3", "--nproc-per-node", "2", "--env", "COLUMNS=100",
                      "--env", "LINES=30", "--log-dir", str(tmp_path), "--run-id", "x", str(script), str(tmp_path))
    assert res.returncode == 0, res.stderr
    for rank in range(2):
        rank_dir = tmp_path / "x" / "attempt_0" / str(rank)
        data = (rank_dir / "stdout.log").read_bytes()
        first, rest = data.split(b"\n", 1)
        assert json.loads(first) == {"tty": [True, True], "size": [100, 30], "term": os.environ.get("TERM") or "xterm-256color"}
        # stderr shares the terminal, in order; then the blob exactly as written ('\n' not made '\r\n').
        assert rest.startswith(b"from stderr\n")
        blob = rest[len(b"from stderr\n"):]
        assert hashlib.sha256(blob).hexdigest() == (tmp_path / f"expect.{rank}").read_text()
        assert not (rank_dir / "stderr.log").exists()


def test_without_pty_ranks_write_to_pipes(tmp_path):
    script = tmp_path / "tty.py"
    script.write_text("import sys\nprint(sys.stdout.isatty(), sys.stderr.isatty())\n")
    res = run_ranktop("--headless", "--nproc-per-node", "1", "--log-dir", str(tmp_path), "--run-id", "x", str(script))
    assert res.returncode == 0 and res.stdout == "[default0]:False False\n"


def test_headless_says_one_line_per_restart_and_names_the_ranks_it_stopped(tmp_path):
    script = tmp_path / "fail1.py"
    script.write_text("import os, sys, time\nprint('up', flush=True)\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n")
    done = run_ranktop("--headless", "--nproc-per-node", "3", "--max-restarts", "2", "--shutdown-timeout", "5",
                       "--log-dir", str(tmp_path / "logs"), str(script))
    assert done.returncode == 1
    ours = [line for line in done.stderr.splitlines() if line.startswith("ranktop: rank")]
    assert ours == ["ranktop: rank 1 failed (exit 3); restarting the group: attempt_1 (1 of 2 restarts spent)",
                    "ranktop: rank 1 failed (exit 3); restarting the group: attempt_2 (2 of 2 restarts spent)"]
    assert ("  stopped by ranktop after it, not the cause: ranks 0 (killed by SIGTERM), 2 (killed by SIGTERM)"
            in done.stderr.splitlines())


def test_a_console_that_goes_away_is_reported_once_and_the_run_goes_on(tmp_path):
    # `ranktop ... | head -1`: the reader of ranktop's stdout leaves while the ranks still print.
    # The run goes on to its end (exit 0), the log files get every line, and the loss is said
    # once: on stderr and in events.jsonl (not once per write, nor once per rank).
    go = tmp_path / "go"
    script = tmp_path / "chatty.py"
    script.write_text(
        "import os, time\n"
        "print('ready', flush=True)\n"
        "deadline = time.monotonic() + 30\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "for i in range(300):\n"
        "    print(f'line {i}', flush=True)\n")
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--tee", "3", "--log-dir", str(tmp_path),
                                        "--run-id", "c", str(script)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline().endswith(b"]:ready\n")
    proc.stdout.close()  # the console is gone
    go.touch()  # only now do the ranks print the rest
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert err.count(b"the console's stdout is gone (Broken pipe)") == 1
    lost = [(e["stream"], e["error"]) for e in read_events(tmp_path / "c") if e["event"] == "console_lost"]
    assert lost == [("stdout", "Broken pipe")]
    for rank in (0, 1):
        log = (tmp_path / "c" / "attempt_0" / str(rank) / "stdout.log").read_text()
        assert log == "ready\n" + "".join(f"line {i}\n" for i in range(300))


# A rank that stays quiet until the file argv[1] exists (its loop's test is the one line a
# rank's own script adds: `while not done(): ...`).
UNTIL_TOLD = "import os, sys, time\ndef done():\n    return os.path.exists(sys.argv[1])\n"


def _stalled_until_said(tmp_path, script_text: str, *args: str, said) -> subprocess.CompletedProcess:
    """`ranktop --headless --nproc-per-node 2 --stall-timeout 1 ARGS script RELEASE` to its end,
    its ranks running `script_text` until RELEASE exists: made once `said(stderr so far)` holds,
    not after a fixed time; the run's stderr as the test reads it, in a file (no pipe to keep read)."""
    script, release, err_path = tmp_path / "quiet.py", tmp_path / "release", tmp_path / "stderr"
    script.write_text(script_text)
    with err_path.open("w") as err:
        proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "2", "--stall-timeout", "1", *args,
                                            str(script), str(release)),
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        wait_for(lambda: said(err_path.read_text()) or proc.poll() is not None, timeout=30, what="the stall lines")
    finally:
        release.touch()
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err_path.read_text())


def _stall_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " stalled: no output for " in line]


@pytest.fixture(scope="module")
def stalled(tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    """One headless run of two ranks quiet until told (rank 0 spinning, rank 1 asleep), both
    stalled (`--stall-timeout 1`, run id `quiet`), released once the stall lines and the hint were
    said: (the run, the hint it must say). The two tests below look at it, each for its own line;
    each stalled a run of its own."""
    tmp_path = tmp_path_factory.mktemp("stalled")
    hint = f"ranktop: where each rank is: ranktop stacks {tmp_path / 'quiet'} (in another terminal)"
    res = _stalled_until_said(tmp_path, UNTIL_TOLD + "if os.environ['RANK'] == '0':\n    while not done():\n"
                              "        pass\nelse:\n    while not done():\n        time.sleep(0.05)\n",
                              "--log-dir", str(tmp_path), "--run-id", "quiet",
                              said=lambda err: len(_stall_lines(err)) >= 2 and hint in err)
    return res, hint


def test_a_headless_stall_says_once_how_to_see_where_each_rank_is(stalled):
    """Headless has no `d` key: the stall lines said which ranks were quiet, and nothing of how
    to see where they wait (`ranktop stacks`, from another terminal)."""
    res, hint = stalled
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert sum(" stalled: no output for " in line for line in lines) == 2, res.stderr
    assert lines.count(hint) == 1, res.stderr
    # after the stall lines of the monitor pass that first found one (not between two of them)
    said = [line for line in lines if " stalled: no output for " in line or line == hint]
    assert said.index(hint) in (1, 2), res.stderr


def test_a_headless_stall_line_tells_a_busy_rank_from_a_blocked_one(stalled):
    """The stall line's cpu% is what tells a rank spinning from one blocked in a collective; with
    a stall time shorter than the sampler needs for two looks it used to say `cpu -`."""
    res, _ = stalled
    assert res.returncode == 0, res.stderr
    cpu = {}
    for line in _stall_lines(res.stderr):
        rank, percent = line.split("ranktop: rank ")[1].split(" ")[0], line.split("(cpu ")[1].split(",")[0]
        cpu[rank] = percent
    assert sorted(cpu) == ["0", "1"], res.stderr
    assert "-" not in cpu.values(), res.stderr
    # (the spinning rank's share depends on what else the machine runs: 38% under a loaded suite)
    busy, blocked = int(cpu["0"].rstrip("%")), int(cpu["1"].rstrip("%"))
    assert busy >= 20 and blocked <= 10, cpu
