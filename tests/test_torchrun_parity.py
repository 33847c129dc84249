"""torchrun command lines, run by torchrun and by ranktop: the ranks must get the same world.

The reference is the installed torch's own launcher (torch.distributed.run), run on the same lines
in one process (tests/parity/torchrun_reference.py); each rank records its environment, argv and
`__name__` (tests/parity/dump_rank.py). Also: PET_* defaults, abbreviations, and the flags torchrun
has that are checked one by one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, make_agent, ranktop_cmd, run_ranktop
from ranktop.core.spec import free_port

pytest.importorskip("torch")

PARITY = ROOT / "tests" / "parity"
S, M, B = str(PARITY / "dump_rank.py"), "dump_rank", str(PARITY / "dump_bin")

def _loopback_v6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


# (id, argv, extra environment): the kinds of lines found in docs, READMEs and Slurm/Kubeflow scripts.
LINES = [
    ("standalone", ["--standalone", "--nproc-per-node", "2", S], {}),
    ("equals-underscore", ["--nproc_per_node=2", S], {}),
    ("module", ["--nproc-per-node", "2", "-m", M, "--lr", "0.1"], {}),
    ("no-python", ["--nproc-per-node", "2", "--no-python", B, "x"], {}),
    ("args-after-dashes", ["--nproc-per-node", "2", S, "--", "--epochs", "3"], {}),
    ("script-is-a-directory", ["--nproc-per-node", "2", str(PARITY / "dump_app"), "a"], {}),  # it was refused
    ("module-args-after-dashes", ["--nproc-per-node", "2", "-m", M, "--", "--epochs", "3"], {}),
    ("dashes-before-script", ["--nproc-per-node", "2", "--", S, "--epochs", "3"], {}),
    ("pet-kubeflow-one-node", [S], {"PET_NNODES": "1", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1",
                                    "PET_MASTER_PORT": str(free_port()), "PET_NPROC_PER_NODE": "2"}),
    ("abbreviations", ["--stand", "--nproc-per", "2", "--max-r", "1", S], {}),
    ("nnodes-range-1", ["--nnodes=1:1", "--nproc-per-node=2", S], {}),
    ("max-restarts", ["--max-restarts", "3", "--nproc-per-node", "2", S], {}),
    ("role", ["--role", "trainer", "--nproc-per-node", "2", S], {}),
    ("static-one-node", ["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
                         "--master-port", "29561", "--nproc-per-node", "2", S], {}),
    ("master-port-underscore", ["--master_port=29562", "--nproc_per_node=2", S], {}),
    ("pet-only", [S], {"PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "1"}),
    ("pet-standalone", [S, "a"], {"PET_STANDALONE": "1", "PET_NPROC_PER_NODE": "3"}),
    ("flag-beats-pet", ["--nproc-per-node", "1", S], {"PET_NPROC_PER_NODE": "3"}),
    ("run-path", ["--run-path", "--nproc-per-node", "2", S, "a", "b"], {}),
    ("virtual-local-rank", ["--virtual-local-rank", "--nproc-per-node", "2", S], {}),
    ("virtual-local-rank-visible", ["--virtual-local-rank", "--nproc-per-node", "2", S],
     {"CUDA_VISIBLE_DEVICES": "3,5"}),
    ("one-rank-no-omp", ["--nproc-per-node", "1", S], {}),
    ("omp-kept", ["--nproc-per-node", "2", S], {"OMP_NUM_THREADS": "4"}),
    ("redirect-maps", ["-r", "3", "-t", "0:3,7:1", "--nproc-per-node", "2", S], {}),
    ("ranks-filter-beyond", ["--local_ranks_filter=0,5", "--nproc_per_node=2", S], {}),
    ("nproc-cpu", ["--nproc-per-node", "cpu", S], {}),
    ("start-method", ["--start-method", "fork", "--nproc-per-node", "2", S], {}),
    ("monitor-interval", ["--monitor-interval", "0.5", "--nproc-per-node", "2", S], {}),
    ("run-path-beats-no-python", ["--no-python", "--run-path", "--nproc-per-node", "2", S, "a"], {}),
    ("run-path-beats-module", ["-m", "--run-path", S], {}),
    ("nproc-plus", ["--nproc-per-node", "+2", S], {}),
    ("prefix-t-is-tee", ["--t", "3", "--nproc-per-node", "2", S], {}),  # not --tui, a flag torchrun lacks
    ("signals-to-handle", ["--signals-to-handle", "SIGTERM,SIGUSR1", S], {}),
    # torch.distributed.launch's macro, which torchrun's agent still substitutes (and `$$` is `$`)
    ("local-rank-macro", ["--nproc-per-node", "2", S, "--local_rank=${local_rank}", "$local_rank", "a$$b", "$HOME",
                          "${rank}"], {}),
    *([("master-addr-ipv6", ["--nnodes", "1", "--master-addr", "[::1]", "--master-port", str(free_port()),
                             "--nproc-per-node", "2", S], {})] if socket.has_ipv6 and _loopback_v6() else []),
    # Rendezvous lines (one node, so that a line is one command): the ids and the store come from the round.
    ("c10d", ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29573", "--rdzv-id", "job",
              "--nnodes", "1", "--nproc-per-node", "2", S], {}),
    # torchtitan's run_train.sh: port 0, the store's on a free port (it was refused as a bad endpoint)
    ("c10d-port-0-torchtitan", ["--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
                                "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", S], {}),
    ("c10d-underscores-conf", ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:29574", "--rdzv_id=job2",
                               "--rdzv-conf=join_timeout=60,read_timeout=60", "--nnodes=1:1", "--nproc_per_node=2",
                               S], {}),
    ("pet-c10d", [S], {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "127.0.0.1:29575", "PET_RDZV_ID": "kf",
                       "PET_NNODES": "1", "PET_NPROC_PER_NODE": "2"}),
    ("static-backend", ["--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:29576", "--rdzv-id", "st",
                        "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "2", S], {}),
    # torchrun's default backend is static: an endpoint alone on one node is its rendezvous (it went unused)
    ("endpoint-without-backend", ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc-per-node", "2", S], {}),
    # Found in public job scripts and READMEs:
    # fms_ehrs's `--rdzv-id "$SLURM_ARRAY_TASK_ID"` outside an array job: torchrun draws a random id
    # (it was refused as an empty run id)
    ("rdzv-id-empty", ["--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv-id", "", "--rdzv-endpoint=localhost:0",
                       S], {}),
    # apex's `torchrun --no_python --nproc_per_node=8 pytest -q -s tests/...`: a binary found on PATH
    ("no-python-on-path", ["--no_python", "--nproc_per_node=2", "dump_bin", "-q", "-s", "tests/t.py"],
     {"PATH": f"{PARITY}{os.pathsep}{os.environ['PATH']}"}),
    # `--master_addr=$MASTER_ADDR` with the variable unset, on one node: unused, as torchrun leaves it (it was refused)
    ("master-addr-empty-unused", ["--nproc_per_node=2", "--master_addr=", S], {}),
    ("master-addr-empty-standalone", ["--standalone", "--nproc_per_node=2", "--master_addr=", S], {}),
    # ... and where the static backend's endpoint names the master (it was refused)
    ("master-addr-empty-static-endpoint", ["--rdzv-backend", "static", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                                           "--rdzv-id", "st2", "--nnodes", "1", "--master_addr=", "--nproc_per_node=2",
                                           S], {}),
    # torchtitan's run_train.sh with fault tolerance, `--local_addr=${LOCAL_ADDR}` unset: torch takes
    # an empty address for none (this host's name); it was refused as a bad --local-addr
    ("local-addr-empty-torchtitan-ft", ["--nproc_per_node=2", "--nnodes=1", "--rdzv_id", "101", "--rdzv_backend",
                                        "c10d", "--rdzv_endpoint=localhost:0", "--local_addr=", "--rdzv-conf",
                                        "is_host=true", "--role", "rank", "--tee", "3", "-m", M, "--module", "x"], {}),
    # a `-m` among the module's own arguments is theirs
    ("module-dash-m-in-its-args", ["--nnodes=1", "--nproc_per_node=2", "-m", M, "-m", "src.task", "-dc", "x.yaml"], {}),
    # torch.distributed.launch lines with ranktop in its place (the reference is launch itself, LAUNCH):
    # accelerate's examples README, and HumanOmniV2's (--use_env first, a dashed --master-port)
    ("launch-use-env", ["--nproc_per_node", "2", "--use_env", S, "--data_dir", "path_to_data"], {}),
    ("launch-use-env-master-port", ["--use_env", "--nproc_per_node", "2", "--master-port", str(free_port()),
                                    "--nnodes", "1", S, "--model-path", "out"], {}),
    # `torchrun --master_port=0` (advice against port clashes): torchrun takes it and its ranks get
    # MASTER_PORT=0, which init_process_group waits on; ranktop refused it (1 to 65535). Now a free
    # port on one node (each rank's MASTER_PORT is a real one: test_same_world_as_torchrun checks)
    ("master-port-0", ["--master_port=0", "--nproc_per_node=2", S], {}),
]
# Lines whose reference is `python -m torch.distributed.launch` (with --use_env, it gives torchrun's world).
LAUNCH = {"launch-use-env", "launch-use-env-master-port"}
# What torchrun derives from its own rendezvous rather than from the line: compared only where the
# line fixes it.
FIXED_PORT = {"static-one-node", "master-port-underscore", "pet-kubeflow-one-node", "master-addr-ipv6",
              "launch-use-env-master-port"}
# Lines that name a rendezvous: the run id and whether the agent hosts the ranks' store are the round's.
RENDEZVOUS = {"c10d", "c10d-underscores-conf", "pet-c10d", "static-backend", "endpoint-without-backend",
              "master-addr-empty-static-endpoint", "local-addr-empty-torchtitan-ft"}


def _records(dump_dir) -> dict[str, dict]:
    return {name[:-5]: json.loads((dump_dir / name).read_text()) for name in sorted(os.listdir(dump_dir))}


def _comparable(records: dict[str, dict], line_id: str) -> dict[str, dict]:
    out = {}
    for rank, rec in records.items():
        rec = dict(rec)
        if line_id not in FIXED_PORT:
            rec.pop("MASTER_PORT")
            rec.pop("MASTER_ADDR")
        if line_id not in RENDEZVOUS:
            rec.pop("TORCHELASTIC_RUN_ID", None)  # (dump_bin, a shell rank, records fewer keys)
            rec.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        out[rank] = rec
    return out


# The static multi-node line (no --rdzv-backend) of test_a_static_two_node_line_gives_torchruns_world,
# as job scripts give it (flags) and as Kubeflow's PyTorchJob does (PET_* only): a master port each.
STATIC_PORTS = {"flags": str(free_port()), "pet-only": str(free_port())}


def _static_node(form: str, node_rank: int, port: str) -> tuple[list[str], dict[str, str]]:
    """Node `node_rank`'s (flags, extra environment) of the static two-node line in `form`."""
    line = {"nnodes": "2", "nproc_per_node": "2", "master_addr": "127.0.0.1", "master_port": port,
            "node_rank": str(node_rank)}
    if form == "pet-only":
        return [S, "x"], {f"PET_{k.upper()}": v for k, v in line.items()}
    return [*(f"--{k.replace('_', '-')}={v}" for k, v in line.items()), S, "x"], {}


@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory):
    """Every line through torchrun at once (one torch import for all of them): a line's id -> (its
    exit status, its ranks' dump directory). Also each node of the static two-node lines, first (two
    lines run at a time: both nodes of a form start together), as ("static", form, node rank), the
    nodes of a form dumping to one directory."""
    base = tmp_path_factory.mktemp("torchrun")
    runs = []  # (key, argv, env, dump directory, whether torch.distributed.launch is the reference)
    for form, port in STATIC_PORTS.items():
        (base / f"static-{form}").mkdir()
        for node_rank in (1, 0):
            runs.append((("static", form, node_rank), *_static_node(form, node_rank, port), base / f"static-{form}",
                         False))
    for line_id, argv, env in LINES:
        (base / line_id).mkdir()
        runs.append((line_id, argv, env, base / line_id, line_id in LAUNCH))
    cases = [{"argv": argv, "env": env, "dump": str(dump), "launch": launch} for _, argv, env, dump, launch in runs]
    (base / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "LOGLEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run([sys.executable, str(PARITY / "torchrun_reference.py"), str(base / "cases.json")],
                         cwd=PARITY, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    statuses = json.loads(res.stdout.strip().splitlines()[-1])
    return {key: (status, dump) for (key, _, _, dump, _), status in zip(runs, statuses, strict=True)}


@pytest.mark.parametrize("line_id,argv,env", LINES, ids=[line[0] for line in LINES])
def test_same_world_as_torchrun(line_id, argv, env, torchrun_results, tmp_path):
    status, torch_dump = torchrun_results[line_id]
    assert status == 0, f"torchrun failed on this line: {status}"
    dump = tmp_path / "dump"
    dump.mkdir()
    res = run_ranktop("--headless", "--log-dir", str(tmp_path / "logs"), *argv, cwd=PARITY,
                      env={**os.environ, **env, "DUMP_TO": str(dump)})
    assert res.returncode == 0, res.stderr
    # where the ranks meet is a port they can reach (torchrun's is 0 on the master-port-0 line)
    assert all(1 <= int(rec["MASTER_PORT"]) <= 65535 for rec in _records(dump).values())
    theirs, ours = _comparable(_records(torch_dump), line_id), _comparable(_records(dump), line_id)
    assert ours == theirs, json.dumps({"ranktop": ours, "torchrun": theirs}, indent=1)


# ----- one line for each bad value; nothing started ------------------------------------------------
BAD = [
    ([S], {"PET_MAX_RESTARTS": "lots"}, "ranktop: error: bad PET_MAX_RESTARTS='lots'"),
    ([S], {"PET_STANDALONE": "yes"}, "ranktop: error: bad PET_STANDALONE='yes': expected 0 or 1"),
    ([S], {"PET_START_METHOD": "thread"}, "ranktop: error: bad PET_START_METHOD='thread': expected one of spawn"),
    ([S], {"PET_NPROC_PER_NODE": "x"}, "ranktop: error: bad PET_NPROC_PER_NODE='x': bad --nproc-per-node 'x': "),
    # flags read once the line is parsed: these were named as the flag, which the line does not hold
    ([S], {"PET_NNODES": ""}, "ranktop: error: bad PET_NNODES='': bad --nnodes '': expected N or MIN:MAX"),
    ([S], {"PET_TEE": "9"}, "ranktop: error: bad PET_TEE='9': bad stream spec '9': expected 0-3"),
    # a rank or a count of more digits than int() reads (4300): the map's was Python's 'Exceeds the limit'
    ([S], {"PET_TEE": f"{'1' * 5000}:3"},
     f"ranktop: error: bad PET_TEE='{'1' * 5000}:3': bad stream spec '{'1' * 5000}:3': expected 0-3"),
    ([S], {"PET_NNODES": "1" * 5000},
     f"ranktop: error: bad PET_NNODES='{'1' * 5000}': bad --nnodes '{'1' * 5000}': expected N or MIN:MAX"),
    ([S], {"PET_LOCAL_RANKS_FILTER": "0,"}, "ranktop: error: bad PET_LOCAL_RANKS_FILTER='0,': bad --local-ranks"),
    ([S], {"PET_ROLE": "w\x1b[2J"}, "ranktop: error: bad PET_ROLE='w␛[2J': bad role 'w␛[2J': control characters"),
    (["--nproc", "2", S], {}, "ranktop: error: ambiguous option: --nproc could match"),
    (["--nproc-per-node", "xpu", S], {}, "ranktop: error: bad --nproc-per-node xpu: no XPU found"),
    (["--numa-binding", "node", S], {}, "ranktop: error: --numa-binding node: it binds each rank to its GPU's "
                                         "NUMA node, and NVML says: no GPU"),
    (["--numa-binding", "exclusive", S], {"RANKTOP_FAKE_GPUS": str(len(os.sched_getaffinity(0)) + 1)},
     "ranktop: error: --numa-binding exclusive: GPU cuda:0: its NUMA node has "),
    (["--numa-binding", "node", "--nproc-per-node", "3", S], {"RANKTOP_FAKE_GPUS": "2"},
     "ranktop: error: --numa-binding node: local rank 2 has no GPU to follow"),
    (["--virtual-local-rank", "--nproc-per-node", "2", S], {"CUDA_VISIBLE_DEVICES": "3"},
     "ranktop: error: bad --virtual-local-rank with 2 ranks: CUDA_VISIBLE_DEVICES='3' lists 1 device(s)"),
    ([S], {"PYTHON_EXEC": "/nonexistent/python"}, "ranktop: error: bad PYTHON_EXEC='/nonexistent/python'"),
    (["--no-python", "-m", B], {}, "ranktop: error: --no-python and --module exclude each other"),
    (["--local-ranks-filter", ",", S], {}, "ranktop: error: bad --local-ranks-filter ','"),
    (["--local-ranks-filter", "0,-1", S], {}, "ranktop: error: bad --local-ranks-filter '0,-1'"),  # -1 names no rank
    # torchrun waits for ever: no other node can find its store on a random local port
    (["--standalone", "--nnodes", "2", S], {}, "ranktop: error: --standalone runs this one node, and --nnodes 2"),
    # torchrun reads it as host ":", port 1, and hangs
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "::1", S], {}, "ranktop: error: bad --rdzv-endpoint '::1': "),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "../x", S], {},
     "ranktop: error: bad --rdzv-id '../x': it contains '/' (a run id names its run directory"),
    (["--nproc-per-node", "gpu", S], {"RANKTOP_FAKE_GPUS": "2", "CUDA_VISIBLE_DEVICES": ""},
     "ranktop: error: bad --nproc-per-node gpu: no GPU found"),
    ([S], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, "ranktop: error: bad TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon'"),
    # Found by a sweep of bad values: each was a traceback, a raw escape, two lines or a run.
    (["--nnodes", "1:²", S], {}, "ranktop: error: bad --nnodes '1:²': expected N or MIN:MAX"),  # isdigit, not int
    ([S], {"PET_STANDALONE": "²"}, "ranktop: error: bad PET_STANDALONE='²': expected 0 or 1"),
    (["--metric", "a{99999999999}", S], {}, "ranktop: error: bad --metric 'a{99999999999}': too large or too "),
    (["--metric", "(" * 5000, S], {}, "ranktop: error: bad --metric '((((("),  # RecursionError
    (["--nproc-per-node", "gpu", S], {"RANKTOP_FAKE_GPUS": "2", "CUDA_VISIBLE_DEVICES": "²"},
     "ranktop: error: bad --nproc-per-node gpu: no GPU found"),
    (["--node-rank", "\x1b[31m1\nX", S], {}, "ranktop: error: bad --node-rank '␛[31m1␊X': expected a whole number"),
    (["--role", "\x1b]0;title\x07", S], {}, "ranktop: error: bad role '␛]0;title␇': control characters"),
    (["--role", "a\udcff", S], {}, "ranktop: error: bad role 'a\\xff': control characters (escape sequences, "
                                   "newlines) or bytes that are not UTF-8"),
    ([S], {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${rank}]\x1b[2J"},
     "ranktop: error: bad log line prefix template '[${rank}]␛[2J': control characters"),
    (["--signals-to-handle", "SIGTERM,SIGCHLD", S], {},
     "ranktop: error: bad --signals-to-handle 'SIGTERM,SIGCHLD': SIGCHLD comes each time a rank ends"),
    ([str(PARITY)], {}, "ranktop: error: bad script '" + str(PARITY) + "': a directory without a __main__.py"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--nnodes", "2", S], {},  # pages of C++ frames
     "ranktop: error: bad --rdzv-endpoint '127.0.0.1:0': port 0 (a free one) only works on one node: with "
     "up to 2 nodes the others could not find it; name a port they all reach"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-conf", "keep_alive_interval=-1", S],
     {}, "ranktop: error: bad --rdzv-conf keep_alive_interval=-1: expected a positive whole number"),  # it waited
    # a traceback (torch's timedelta overflowed), or a round failed on a date past year 9999 or before year 1
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-conf", "last_call_timeout=99999999999999",
      S], {}, "ranktop: error: bad --rdzv-conf last_call_timeout=99999999999999: expected a positive whole number, "
              "at most 604800"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-conf",
      "keep_alive_interval=600000,keep_alive_max_attempt=600000", S], {},
     "ranktop: error: bad --rdzv-conf keep_alive_interval=600000,keep_alive_max_attempt=600000: keep_alive_interval x "
     "keep_alive_max_attempt, the keep-alive limit (600000 x 600000 s), must be at most 604800 s"),
    # etcd's own URL form: it was said to be an IPv6 address without brackets
    (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "http://127.0.0.1:2379", "--nnodes", "2", S], {},
     "ranktop: error: bad --rdzv-endpoint 'http://127.0.0.1:2379': expected HOST:PORT, without a scheme such as "
     "http://\n"),
    # python-etcd puts it into the key's URL as it is: 'exp?1' and 'exp?2' met in one rendezvous ('exp')
    (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:2379", "--nnodes", "2", "--rdzv-id", "exp?1", S], {},
     "ranktop: error: bad --rdzv-id 'exp?1': the etcd-v2 backend puts it into a URL unescaped, where '?' ends the "
     "key: 'a?1' and 'a?2' met in one rendezvous, 'a'; use an id without '?', '#' or '%'"),
    (["--run-id", "x" * 300, S], {},  # it blamed --log-dir
     f"ranktop: error: bad --run-id '{'x' * 80}': it is longer than 200 bytes"),
]


@pytest.mark.parametrize("argv,env,message", BAD, ids=[b[2][16:50] for b in BAD])
def test_bad_value_is_one_line(argv, env, message, tmp_path):
    res = run_ranktop("--headless", "--log-dir", str(tmp_path), *argv, cwd=PARITY,
                      env={**os.environ, **env, "DUMP_TO": str(tmp_path)})
    assert res.returncode == 2
    assert res.stderr.startswith(message) and res.stderr.count("\n") == 1, res.stderr
    assert os.listdir(tmp_path) == []  # no run directory, no rank


def test_our_own_options_are_the_ones_torchrun_lacks():
    """RANKTOP_ONLY yields to torchrun's options in abbreviations: it must name exactly ours."""
    from ranktop.tui.cli import RANKTOP_ONLY, build_parser
    from torch.distributed.run import get_args_parser

    theirs = {o for a in get_args_parser()._actions for o in a.option_strings}
    ours = {o for a in build_parser()._actions for o in a.option_strings}
    assert ours - theirs == RANKTOP_ONLY


def test_nproc_cpu_an_empty_filter_and_standalone_give_torchruns_world(tmp_path):
    """As torch: `cpu` is the CPUs of our affinity (taskset, Slurm, cgroups), not the machine's;
    an empty --local-ranks-filter is no filter (it used to hide every rank)."""
    script = tmp_path / "hi.py"
    script.write_text("import os\nprint('hi from', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    one_cpu = subprocess.run(["taskset", "-c", "0", *ranktop_cmd("--headless", "--nproc-per-node", "cpu",
                                                                 "--log-dir", str(tmp_path / "a"), str(script))],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert one_cpu.returncode == 0 and one_cpu.stdout == "[default0]:hi from 0 of 1\n", one_cpu.stderr
    every = run_ranktop("--headless", "--nproc-per-node", "2", "--local-ranks-filter=", "--log-dir",
                        str(tmp_path / "b"), str(script))
    assert sorted(every.stdout.splitlines()) == ["[default0]:hi from 0 of 2", "[default1]:hi from 1 of 2"]
    # --standalone with room for more nodes: the one node alone, as torchrun ends up once its wait
    # for others (30 s) is over; it used to tell the rank WORLD_SIZE 2.
    alone = run_ranktop("--headless", "--standalone", "--nnodes", "1:2", "--log-dir", str(tmp_path / "c"), str(script))
    assert alone.stdout == "[default0]:hi from 0 of 1\n", alone.stderr


def test_a_stream_both_redirected_and_teed_is_shown_as_torchrun_shows_it(tmp_path):
    script = tmp_path / "hi.py"
    script.write_text("import os\nprint('hi from', os.environ['RANK'])\n")
    done = run_ranktop("--headless", "--nproc-per-node", "2", "-r", "1", "-t", "3", "--log-dir", str(tmp_path),
                       str(script))
    assert sorted(done.stdout.splitlines()) == ["[default0]:hi from 0", "[default1]:hi from 1"]  # tee wins


def test_gpu_count_follows_cuda_visible_devices(tmp_path):
    env = {**os.environ, "RANKTOP_FAKE_GPUS": "4", "CUDA_VISIBLE_DEVICES": "2,0", "DUMP_TO": str(tmp_path)}
    res = run_ranktop("--headless", "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "gpu", S, env=env)
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(tmp_path)) == ["0.json", "1.json", "logs"]


@pytest.mark.parametrize("visible,count", [("2,0", 2), ("", 0), ("1,9,2", 1), ("0,0", 1), ("GPU-abc,3", 2),
                                           ("-1", 0), ("3,x,1", 1)])
def test_count_visible_reads_the_list_as_cuda_does(visible, count):
    from ranktop.core.gpu import count_visible

    assert count_visible(visible, 4) == count


def test_python_exec_picks_the_ranks_interpreter(tmp_path):
    python = tmp_path / "py"
    python.symlink_to(sys.executable)
    (tmp_path / "dump").mkdir()
    (tmp_path / "which.py").write_text("import sys; print('EXE', sys.executable)\n")
    res = run_ranktop("--headless", "--log-dir", str(tmp_path / "logs"), str(tmp_path / "which.py"),
                      env={**os.environ, "PYTHON_EXEC": str(python)})
    assert res.returncode == 0, res.stderr
    assert f"EXE {python}" in res.stdout
    assert f"ranktop: ranks run {python}" in res.stderr  # the run says which interpreter it used


@pytest.mark.parametrize("variable", ["VIRTUAL_ENV", "CONDA_PREFIX"])
def test_an_active_env_other_than_ranktops_own_runs_the_ranks_and_the_report_says_so(tmp_path, variable):
    """ranktop installed on its own (pipx), a virtualenv or conda env active: the ranks run that
    env's python, and the start line and the end report name it."""
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60)
    script = tmp_path / "which.py"
    script.write_text("import sys\nprint('EXE', sys.executable)\nsys.exit(3)\n")
    res = run_ranktop("--headless", "--log-dir", str(tmp_path / "logs"), str(script),
                      env={**os.environ, variable: str(env_dir)})
    python = str(env_dir / "bin" / "python")
    assert res.returncode == 1, res.stderr
    assert f"EXE {python}" in res.stdout
    assert res.stderr.startswith(f"ranktop: ranks run {python}\n")
    assert res.stderr.rstrip().endswith(f"the ranks ran {python}")  # the end report, after the root cause
    # ranktop's own env active (the usual install): its own interpreter, nothing said
    same = run_ranktop("--headless", "--log-dir", str(tmp_path / "logs"), str(script),
                       env={**os.environ, variable: sys.prefix})
    assert f"EXE {sys.executable}" in same.stdout and "ranks ran" not in same.stderr and "ranks run" not in same.stderr


def test_duplicate_filters_copy_matching_lines_of_every_rank(tmp_path):
    script = tmp_path / "dup.py"
    script.write_text("import os, sys\nr = os.environ['RANK']\nprint('loss 1.0 rank', r)\nprint('noise', r)\n"
                      "print('apple, pie', r, file=sys.stderr)\nprint('grad NaN', r, end='')\n")
    done = run_ranktop("--headless", "--nproc-per-node", "2", "--duplicate-stdout-filters", "loss,NaN",
                       "--duplicate_stderr_filters", "apple,, pie", "--run-id", "dup", "--log-dir", str(tmp_path),
                       str(script))
    assert done.returncode == 0, done.stderr
    attempt = tmp_path / "dup" / "attempt_0"
    out = (attempt / "filtered_stdout.log").read_text().splitlines()
    assert sorted(out) == ["[default0]:grad NaN 0", "[default0]:loss 1.0 rank 0",
                           "[default1]:grad NaN 1", "[default1]:loss 1.0 rank 1"]
    assert sorted((attempt / "filtered_stderr.log").read_text().splitlines()) == [
        "[default0]:apple, pie 0", "[default1]:apple, pie 1"]  # ',,' is a comma inside the needle
    assert "noise" in (attempt / "0" / "stdout.log").read_text()  # the logs themselves are untouched


def test_event_log_handler_console_echoes_events_and_logs_specs_is_refused(tmp_path):
    done = run_ranktop("--headless", "--event-log-handler", "console", "--log-dir", str(tmp_path),
                       "--no-python", "true")
    assert done.returncode == 0
    echoed = [json.loads(line.split(" ", 2)[2])["event"] for line in done.stderr.splitlines()
              if line.startswith("ranktop: event ")]
    assert echoed[0] == "run_started" and echoed[-1] == "run_finished" and "exited" in echoed
    refused = run_ranktop("--headless", "--logs-specs", "mine", "--log-dir", str(tmp_path / "x"), "--no-python", "true")
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        "ranktop: error: bad --logs-specs 'mine': ranktop writes its own log files (see --log-dir); "
        "torchrun.logs_specs plugins are not loaded"]
    assert not (tmp_path / "x").exists()


def test_logs_specs_default_is_torchs_own_entry_point_and_runs(tmp_path):
    done = run_ranktop("--headless", "--logs-specs=default", "--log-dir", str(tmp_path), "--no-python", "true")
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr


def test_numa_binding_starts_each_rank_on_the_cpus_near_its_gpu(tmp_path):
    """Fake NVML (its devices sit at this machine's real PCI addresses), real sysfs, real affinity:
    each rank starts on the CPUs near its GPU, within what ranktop itself may use, and so do the
    threads it starts. (This box has one NUMA node: the binding is then every CPU ranktop has.)"""
    from ranktop.core.gpu import numa_binding
    from ranktop.core.gpu_fake import FakeNvml

    script = tmp_path / "where.py"
    script.write_text(WHERE)
    plan = numa_binding("node", 2, None, nvml=FakeNvml(2))
    assert plan[0] and plan[0] <= os.sched_getaffinity(0)
    res = run_ranktop("--headless", "--numa-binding", "node", "--nproc-per-node", "2", "--log-dir",
                      str(tmp_path / "logs"), str(script), env={**os.environ, "RANKTOP_FAKE_GPUS": "2"})
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert f"[default{rank}]:cpus {sorted(plan[rank])} thread {sorted(plan[rank])}" in res.stdout, res.stdout


WHERE = ("import os, threading\nseen = []\nt = threading.Thread(target=lambda: seen.append("
         "sorted(os.sched_getaffinity(0))))\nt.start(); t.join()\n"
         "print('cpus', sorted(os.sched_getaffinity(0)), 'thread', seen[0], flush=True)\n")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind one rank to one of them")
def test_a_rank_starts_on_the_cpus_it_is_given_and_the_others_keep_ours(tmp_path):
    ours, one = sorted(os.sched_getaffinity(0)), min(os.sched_getaffinity(0))
    agent = make_agent(tmp_path, WHERE, n=2, cpu_affinity={0: frozenset({one})})
    assert agent.run().exit_status == 0  # in this thread: it spawns the ranks
    lines = {r: b"".join(agent.output(r)).decode() for r in (0, 1)}
    assert f"cpus [{one}] thread [{one}]" in lines[0] and f"cpus {ours} thread {ours}" in lines[1]
    assert sorted(os.sched_getaffinity(0)) == ours  # the spawning thread got its own CPUs back


def test_numa_text_forms():
    from ranktop.core.numa import NumaError, cpu_list, pci_address

    assert pci_address("00000000:DC:00.0") == "0000:dc:00.0" and pci_address(b"00000001:1A:00.0") == "0001:1a:00.0"
    assert cpu_list("0-3,8-9,12") == {0, 1, 2, 3, 8, 9, 12} and cpu_list("") == set()
    with pytest.raises(NumaError, match="unexpected PCI bus id 'nonsense'"):
        pci_address("nonsense")


def test_the_grace_is_torch_elastic_shutdown_timeout_then_pet_then_the_flag(tmp_path):
    """As torchrun: TORCH_ELASTIC_SHUTDOWN_TIMEOUT when nothing else says; PET_SHUTDOWN_TIMEOUT and
    the flag win over it. (Neither: ranktop's 10 s.) The grace a run used is in its final.json."""
    cases = [({}, [], 10.0), ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"}, [], 3.0),
             ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3", "PET_SHUTDOWN_TIMEOUT": "4"}, [], 4.0),
             ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3", "PET_SHUTDOWN_TIMEOUT": "4"}, ["--shutdown-timeout", "5"], 5.0)]
    for i, (env, flags, grace) in enumerate(cases):
        done = run_ranktop("--headless", "--run-id", f"g{i}", "--log-dir", str(tmp_path), *flags, "--no-python", "true",
                           env={**os.environ, **env})
        assert done.returncode == 0, done.stderr
        assert json.loads((tmp_path / f"g{i}" / "final.json").read_text())["shutdown_timeout"] == grace, env


@pytest.mark.parametrize("form", list(STATIC_PORTS))
def test_a_static_two_node_line_gives_torchruns_world(tmp_path, form, torchrun_results):
    """The static multi-node line (no --rdzv-backend), as job scripts give it (flags) and as
    Kubeflow's PyTorchJob does (PET_* only): both nodes run by torchrun (in torchrun_results), then
    both by ranktop; every rank gets the same world. MASTER_PORT is left out: torchrun's static
    round picks a free one too."""
    statuses = [torchrun_results["static", form, node_rank][0] for node_rank in (1, 0)]
    assert statuses == [0, 0], f"torchrun failed on this line's nodes: {statuses}"
    dump, port = tmp_path / "ranktop", str(free_port())
    dump.mkdir()
    nodes = []
    for node_rank in (1, 0):
        argv, env = _static_node(form, node_rank, port)
        env = {**os.environ, "DUMP_TO": str(dump), "LOGLEVEL": "ERROR", "PYTHONWARNINGS": "ignore", **env}
        nodes.append(subprocess.Popen(ranktop_cmd("--headless", "--log-dir", str(tmp_path / f"logs{node_rank}"), *argv),
                                      cwd=PARITY, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        for node in nodes:
            assert node.wait(timeout=120) == 0, node.stderr.read()[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
            node.stderr.close()
    records = {launcher: {rank: {k: v for k, v in rec.items() if k != "MASTER_PORT"} for rank, rec in _records(at).items()}
               for launcher, at in (("torchrun", torchrun_results["static", form, 0][1]), ("ranktop", dump))}
    assert sorted(records["torchrun"]) == ["0", "1", "2", "3"]
    assert records["ranktop"] == records["torchrun"], json.dumps(records, indent=1)
