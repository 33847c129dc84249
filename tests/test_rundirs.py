"""Run directories under a shared /tmp, as root: a log root someone else controls is refused, run
ids cannot leave the root, nothing is written through a planted symlink or a swapped directory,
everything is private, and error.json is read as hostile input (core/layout.py, core/errors.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil
import pytest
from conftest import NOBODY, ROOT, mode_of, ranktop_cmd, read_events, run_ranktop, stop_process, wait_for
from ranktop.core import Std, start_processes
from ranktop.core.agent import LocalAgent
from ranktop.core.errors import UsageError
from ranktop.core.spec import WorkerSpec

PY = sys.executable



def _one_error_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res
    assert lines[0].startswith("ranktop: error: ")
    return lines[0]


def _with_tmpdir(tmp_path) -> dict:
    return {**os.environ, "TMPDIR": str(tmp_path)}


# ----- the log root -----------------------------------------------------------------------------
def _shared_root(tmp_path, how: str):
    """The default root $TMPDIR/ranktop-<uid>, made the way another user (or a mistake) left it."""
    root = tmp_path / f"ranktop-{os.geteuid()}"
    if how == "symlink":
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        root.symlink_to(target)
        return root, target
    root.mkdir()
    if how == "other user":
        os.chmod(root, 0o700)
        os.chown(root, NOBODY, NOBODY)
    else:
        os.chmod(root, {"group-writable": 0o770, "world-writable": 0o777, "sticky world-writable": 0o1777}[how])
    return root, root


@pytest.mark.parametrize("how, why", [
    ("other user", f"belongs to uid {NOBODY}, not to you"),
    ("group-writable", "is writable by group (mode 770)"),
    ("world-writable", "is writable by group and others (mode 777)"),
    ("sticky world-writable", "is writable by group and others (mode 1777)"),
    ("symlink", "is a symlink"),
])
def test_default_log_root_that_others_control_is_refused(tmp_path, how, why):
    root, target = _shared_root(tmp_path, how)
    marker = tmp_path / "rank-ran"
    res = run_ranktop("--headless", "--no-python", "touch", str(marker), env=_with_tmpdir(tmp_path))
    line = _one_error_line(res)
    assert f"log root {root} {why}" in line and "--log-dir" in line
    assert not marker.exists() and os.listdir(target) == []


def test_default_log_root_is_made_private_and_everything_in_a_run_is_private(tmp_path):
    res = run_ranktop("--headless", "--nproc-per-node", "2", "--run-id", "r", "--no-python", PY, "-c",
                      "import sys; print('out'); print('err', file=sys.stderr)", env=_with_tmpdir(tmp_path))
    assert res.returncode == 0, res.stderr
    root = tmp_path / f"ranktop-{os.geteuid()}"
    run = root / "r"
    dirs = [root, run, run / "attempt_0", run / "attempt_0" / "0", run / "attempt_0" / "1"]
    files = [run / "events.jsonl", *(run / "attempt_0" / r / f for r in "01" for f in ("stdout.log", "stderr.log"))]
    assert {str(d): mode_of(d) for d in dirs} == {str(d): 0o700 for d in dirs}
    assert {str(f): mode_of(f) for f in files} == {str(f): 0o600 for f in files}
    assert (run / "attempt_0" / "1" / "stdout.log").read_text() == "out\n"


def test_an_empty_log_dir_is_the_default_root_not_the_current_directory(tmp_path):
    """`--log_dir=$LOG_DIR` with LOG_DIR unset is no --log-dir, as torchrun reads it (a temporary
    directory): it was the current directory, and the run directory landed wherever the job was
    started (a checkout, /)."""
    work = tmp_path / "work"
    work.mkdir()
    res = run_ranktop("--headless", "--log_dir=", "--run-id", "no-dir", "--no-python", "true",
                      env=_with_tmpdir(tmp_path), cwd=work)
    assert res.returncode == 0, res.stderr
    assert os.listdir(work) == []
    assert (tmp_path / f"ranktop-{os.geteuid()}" / "no-dir" / "final.json").is_file()


def _theirs(tmp_path):
    """A directory of another user's, where root's $TMPDIR or $XDG_RUNTIME_DIR may point (kept
    over `sudo -E`, or set by whoever wrote the job script)."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    return theirs


@pytest.mark.skipif(os.geteuid() != 0, reason="makes another user's directory: needs root")
def test_a_default_log_root_below_another_users_tmpdir_is_refused(tmp_path):
    """The default root is $TMPDIR/ranktop-<uid>: with $TMPDIR another user's, they could swap the
    root (ours, private) for a tree of theirs once it was made, and the ranks, which open
    $TORCHELASTIC_ERROR_FILE by path, wrote their error file wherever a link of theirs pointed."""
    theirs = _theirs(tmp_path)
    env = {**_with_tmpdir(theirs), "XDG_RUNTIME_DIR": ""}
    res = run_ranktop("--headless", "--no-python", "touch", str(tmp_path / "rank-ran"), env=env)
    assert _one_error_line(res) == (f"ranktop: error: log root {theirs}/ranktop-0: it goes through {theirs}, "
                                    f"which belongs to uid {NOBODY}, not to you (uid 0): whoever controls it "
                                    "decides where the path leads; set TMPDIR to a directory of your own, "
                                    "or pass --log-dir DIR")
    assert os.listdir(theirs) == [] and not (tmp_path / "rank-ran").exists()


def test_a_tmpdir_of_dot_is_the_current_directory_walked_as_any(tmp_path):
    """Python keeps TMPDIR=. as '.' (tempfile's one relative answer), and the walk to it began at
    / and found no name to take: the default log root was made in /, as /ranktop-<uid>, while the
    run said ./ranktop-<uid>, and the current directory (another user's, maybe) was never looked
    at. It is the current directory, walked to as any $TMPDIR."""
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    stray = f"/ranktop-{os.geteuid()}"
    made_stray = not os.path.lexists(stray)
    try:
        res = run_ranktop("--headless", "--run-id", "h21-dot-tmpdir", "--no-python", "true",
                          env=_with_tmpdir("."), cwd=work)
        assert res.returncode == 0, res.stderr
        assert not os.path.lexists(f"{stray}/h21-dot-tmpdir")
        assert (work / f"ranktop-{os.geteuid()}" / "h21-dot-tmpdir" / "events.jsonl").is_file()
        if os.geteuid() == 0:  # the current directory another user's: refused as their $TMPDIR is
            theirs = _theirs(tmp_path)
            res = run_ranktop("--headless", "--no-python", "true", env=_with_tmpdir("."), cwd=theirs)
            assert _one_error_line(res).startswith(f"ranktop: error: log root {theirs}/ranktop-0: it goes "
                                                   f"through {theirs}, which belongs to uid {NOBODY}")
            assert os.listdir(theirs) == []
    finally:  # (what the walk from / made, before it took '.' for the current directory)
        shutil.rmtree(f"{stray}/h21-dot-tmpdir", ignore_errors=True)
        if made_stray and os.path.isdir(stray) and not os.listdir(stray):
            os.rmdir(stray)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes another user's directory: needs root")
@pytest.mark.parametrize("where", ["TMPDIR", "XDG_RUNTIME_DIR"])
def test_no_socket_is_served_below_another_users_directory(tmp_path, where):
    """The socket directory is $XDG_RUNTIME_DIR/ranktop, else $TMPDIR/ranktop-<uid>/sock; only
    its last step was checked, so a private directory of root's inside another user's (made
    there earlier) was served from, and they could swap it for one whose socket they answer."""
    theirs = _theirs(tmp_path)
    runtime = theirs / "rt"
    runtime.mkdir(mode=0o700)  # root's own, private: it passed
    env = {**os.environ, "TMPDIR": str(theirs if where == "TMPDIR" else tmp_path),
           "XDG_RUNTIME_DIR": str(runtime if where == "XDG_RUNTIME_DIR" else "")}
    logs = tmp_path / "logs"
    res = run_ranktop("--headless", "--log-dir", str(logs), "--run-id", "r", "--no-python", "true", env=env)
    assert res.returncode == 0, res.stderr
    assert os.listdir(theirs) == ["rt"] and os.listdir(runtime) == [], res.stderr
    if where == "TMPDIR":  # nowhere to serve it: the run goes on, and says why in one line
        assert (f"ranktop: not serving this run for ranktop ls/stop/logs: {theirs}/ranktop-0: it goes through "
                f"{theirs}, which belongs to uid {NOBODY}, not to you (uid 0): whoever controls it decides "
                "where the path leads; set TMPDIR to a directory of your own\n") in res.stderr
    else:  # $XDG_RUNTIME_DIR is passed over, as one of another user's is: $TMPDIR's is used
        assert "not serving" not in res.stderr and os.listdir(tmp_path / "ranktop-0") == ["sock"]


@pytest.mark.parametrize("mode, chown, ok", [
    (0o1777, None, True),  # like /tmp: no one can rename our run directory there
    (0o777, None, False),
    (0o770, None, False),
    (0o755, NOBODY, False),
])
def test_explicit_log_dir_may_be_shared_like_tmp_but_no_more(tmp_path, mode, chown, ok):
    logs = tmp_path / "logs"
    logs.mkdir()
    os.chmod(logs, mode)
    if chown is not None:
        os.chown(logs, chown, chown)
    res = run_ranktop("--headless", "--log-dir", str(logs), "--run-id", "r", "--no-python", "echo", "hi")
    if ok:
        assert res.returncode == 0, res.stderr
        assert mode_of(logs / "r") == 0o700 and (logs / "r" / "attempt_0" / "0" / "stdout.log").read_text() == "hi\n"
    else:
        assert f"bad --log-dir {logs}: it " in _one_error_line(res)
        assert os.listdir(logs) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="plants another user's symlink: needs root")
@pytest.mark.parametrize("shared_mode", [0o1777, 0o1770], ids=["like /tmp", "a sticky team directory"])
def test_a_log_dir_through_another_users_symlink_in_a_shared_directory_is_refused(tmp_path, shared_mode):
    """In /tmp-like directories the kernel follows another user's symlink only where
    protected_symlinks is on: with it off, root wrote its run into whatever the link named. A
    group-writable sticky directory is as shared (a member's link there was followed)."""
    shared, target = tmp_path / "shared", tmp_path / "etc"
    shared.mkdir()
    target.mkdir()
    os.chmod(shared, shared_mode)
    link = shared / "myrun"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    res = run_ranktop("--headless", "--log-dir", str(link), "--run-id", "r", "--no-python", "echo", "hi")
    assert _one_error_line(res) == (f"ranktop: error: bad --log-dir {link}: it goes through {link}, a symlink of "
                                    f"uid {NOBODY}'s in a directory others may write: ranktop will not follow it; "
                                    "pick a directory of your own")
    assert os.listdir(target) == []
    os.lchown(link, 0, 0)  # one's own link there is followed, as the kernel would
    assert run_ranktop("--headless", "--log-dir", str(link), "--run-id", "r", "--no-python", "true").returncode == 0
    assert os.listdir(target) == ["r"]


@pytest.mark.skipif(os.geteuid() != 0, reason="makes another user's directory: needs root")
@pytest.mark.parametrize("below", ["a link", "a new directory"])
def test_a_log_dir_below_another_users_directory_is_refused(tmp_path, below):
    """Whoever may rename entries of a directory on the way picks where the rest leads, at any
    moment: a link of theirs (in no shared directory, so no protected_symlinks) sent root's run
    into whatever it named, and a directory root made there could be swapped after the check."""
    theirs, target = tmp_path / "theirs", tmp_path / "etc"
    theirs.mkdir(mode=0o755)
    target.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    logs = theirs / "logs"
    if below == "a link":
        logs.symlink_to(target)
        os.lchown(logs, NOBODY, NOBODY)
    res = run_ranktop("--headless", "--log-dir", str(logs / "deeper"), "--run-id", "r", "--no-python", "echo", "hi")
    assert _one_error_line(res) == (f"ranktop: error: bad --log-dir {logs / 'deeper'}: it goes through {theirs}, "
                                    f"which belongs to uid {NOBODY}, not to you (uid 0): whoever controls it "
                                    "decides where the path leads; pick a directory of your own")
    assert os.listdir(target) == [] and os.listdir(theirs) == (["logs"] if below == "a link" else [])


@pytest.mark.parametrize("links", [{"a": "b", "b": "a"}, {"a": "a/x/y"}], ids=["a cycle", "a link into itself"])
def test_a_log_dir_through_a_symlink_loop_is_one_line(tmp_path, links):
    """ranktop walks a chosen directory's path itself, one name at a time (core/layout._walk):
    links that lead back into themselves end as the kernel's lookup does, not in an endless walk."""
    from ranktop.core.layout import open_chosen_dir

    for name, target in links.items():
        (tmp_path / name).symlink_to(target)
    path = tmp_path / "a" / "logs"
    with pytest.raises(UsageError) as refused:
        open_chosen_dir(str(path), "--log-dir", make=True)
    assert str(refused.value) == f"bad --log-dir {path}: cannot write there (Too many levels of symbolic links)"


def test_a_log_dir_too_long_for_its_runs_paths_is_one_line_and_nothing_is_made(tmp_path):
    """A --log-dir near PATH_MAX (4096 bytes) gave its ranks a TORCHELASTIC_ERROR_FILE no process
    could open (@record failed with a traceback in its place) and a run directory `ranktop logs`
    could not find: it is refused before anything is made, the Python API's log_dir too."""
    from ranktop.core.logs_specs import DefaultLogsSpecs

    script = tmp_path / "rank.py"
    script.write_text("print('hello')\n")
    long_dir = os.path.join(tmp_path, *["d" * 200] * 20)
    size = len(os.fsencode(long_dir))
    assert size < 4095  # the directory itself could still be made
    res = run_ranktop("--headless", "--nproc-per-node", "1", "--log-dir", long_dir, "--run-id", "r", str(script))
    assert _one_error_line(res) == (f"ranktop: error: bad --log-dir {long_dir[:80]}...: its path is {size} bytes "
                                    "long, and at most 3583 leave room for a run's files below it within the 4095 "
                                    "bytes of a path; pick a shorter one")
    assert sorted(os.listdir(tmp_path)) == ["rank.py"]
    with pytest.raises(ValueError, match=f"bad log_dir .*: its path is {size} bytes long"):
        DefaultLogsSpecs(log_dir=long_dir)
    fits = os.path.join(tmp_path, *["d" * 200] * 16)
    res = run_ranktop("--headless", "--nproc-per-node", "1", "--log-dir", fits, "--run-id", "r", str(script))
    assert res.returncode == 0 and "hello" in res.stdout, res


def test_a_run_directory_under_the_longest_log_dir_taken_still_gets_its_stack_dump_saved(tmp_path):
    """The log dir's room check (PATH_MAX less 512 bytes for a run's paths) was also put on a run
    directory named to `ranktop stacks`, which needs room for stacks/<time>.json only: a run made
    under a log dir that passed, with a long run id, got its dump shown but not saved, with
    `pick a shorter one`, a directory ranktop itself had just made."""
    log_dir = os.path.join(tmp_path, *["d" * 200] * 17)
    run_id = "r" * 150
    run_dir = os.path.join(log_dir, run_id)
    assert len(os.fsencode(log_dir)) <= 3583 < len(os.fsencode(run_dir))
    script = tmp_path / "rank.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(3600)\n")
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(rt)}
    proc = subprocess.Popen(ranktop_cmd("--headless", "--nproc-per-node", "1", "--shutdown-timeout", "3", "--run-id",
                                        run_id, "--log-dir", log_dir, str(script)),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "up" in proc.stdout.readline()
        files = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}  # not served there: found from the files
        out = run_ranktop("stacks", "--signal", run_dir, env=files, timeout=30)
        assert (out.returncode, out.stderr) == (0, ""), out
        assert [n for n in os.listdir(os.path.join(run_dir, "stacks")) if n.endswith(".json")]
    finally:
        stop_process(proc)


def test_the_schedulers_error_file_in_a_long_directory_is_copied(tmp_path):
    """The same check refused the directory of $TORCHELASTIC_ERROR_FILE, where ranktop writes one
    file (reached through held directories: PATH_MAX does not bound it), with `leave room for a
    run's files below it`: the scheduler's copy was not made."""
    script = tmp_path / "rank.py"
    script.write_text("from ranktop.core.errors import record\n"
                      "record(lambda: 1 / 0)()\n")
    theirs = os.path.join(tmp_path, *["s" * 200] * 18)
    os.makedirs(theirs, mode=0o700)
    assert len(os.fsencode(theirs)) > 3583
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": os.path.join(theirs, "e.json")}
    res = run_ranktop("--headless", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"), "--run-id", "r",
                      str(script), env=env)
    assert res.returncode == 1 and "not copied" not in res.stderr, res.stderr
    with open(os.path.join(theirs, "e.json")) as copy:
        assert "ZeroDivisionError" in copy.read()


def test_a_log_dir_through_a_group_writable_directory_is_refused_and_own_links_are_followed(tmp_path):
    mine, open_to_group = tmp_path / "mine", tmp_path / "team"
    mine.mkdir()
    open_to_group.mkdir()
    os.chmod(open_to_group, 0o775)
    (tmp_path / "link").symlink_to("mine/../mine")
    res = run_ranktop("--headless", "--log-dir", str(open_to_group / "logs"), "--run-id", "r", "--no-python", "true")
    assert f"it goes through {open_to_group}, which is writable by group (mode 775)" in _one_error_line(res)
    assert os.listdir(open_to_group) == []
    res = run_ranktop("--headless", "--log-dir", str(tmp_path / "link" / "logs"), "--run-id", "r", "--no-python", "true")
    assert res.returncode == 0, res.stderr
    assert os.listdir(mine / "logs") == ["r"]


def _as_nobody(call) -> str:
    """What `call()` raised in a child process run as uid/gid nobody ('' if nothing)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, call, report, and leave without pytest's cleanup
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            call()
            said = b""
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which asserts on it
            said = f"{type(exc).__name__}: {exc}".encode()
        os.write(write_end, said)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    return said


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a walk as nobody: needs root to become nobody")
def test_a_log_dir_below_a_directory_others_may_only_search_is_reached(tmp_path):
    """A root-owned 0711 directory (a /home or /scratch that hides its entries) lets anyone pass
    through, as the kernel's lookup does; the walk opened it for reading, so a user's own
    --log-dir below it was refused with Permission denied."""
    from ranktop.core.layout import open_chosen_dir

    top = tempfile.mkdtemp(dir="/tmp", prefix="ranktop-search-only-")  # tmp_path's parents are 0700
    try:
        os.chmod(top, 0o711)
        os.mkdir(os.path.join(top, "mine"), 0o700)
        os.chown(os.path.join(top, "mine"), NOBODY, NOBODY)
        logs = os.path.join(top, "mine", "a", "logs")
        assert _as_nobody(lambda: open_chosen_dir(logs, "--log-dir", make=True).close()) == ""
        assert os.stat(logs).st_uid == NOBODY and mode_of(logs) == 0o700
        assert _as_nobody(lambda: open_chosen_dir(logs, "log_dir", make=False).close()) == ""
        os.chmod(logs, 0o300)  # the chosen directory itself must still be readable: it is listed
        assert _as_nobody(lambda: open_chosen_dir(logs, "log_dir", make=False).close()) == (
            f"UsageError: bad log_dir {logs}: cannot open there (Permission denied)")
    finally:
        shutil.rmtree(top)


def test_a_log_dir_made_by_ranktop_is_private_all_the_way_down(tmp_path):
    logs = tmp_path / "a" / "b" / "logs"
    assert run_ranktop("--headless", "--log-dir", str(logs), "--run-id", "r", "--no-python", "true").returncode == 0
    assert [mode_of(d) for d in (tmp_path / "a", tmp_path / "a" / "b", logs)] == [0o700] * 3


def test_an_existing_run_directory_is_never_reused(tmp_path):
    (tmp_path / "taken").mkdir()
    res = run_ranktop("--headless", "--log-dir", str(tmp_path), "--run-id", "taken", "--no-python", "echo", "hi")
    assert "run directory" in _one_error_line(res) and "already exists" in res.stderr
    assert os.listdir(tmp_path / "taken") == []


@pytest.mark.parametrize("run_id", ["a/b", "../escape", "..", ".", "", "two\nlines", "tab\there"])
def test_bad_run_id_is_one_line(tmp_path, run_id):
    logs = tmp_path / "logs"
    logs.mkdir()
    res = run_ranktop("--headless", "--log-dir", str(logs), "--run-id", run_id, "--no-python", "echo", "hi")
    assert "bad --run-id" in _one_error_line(res)
    assert os.listdir(logs) == [] and sorted(os.listdir(tmp_path)) == ["logs"]


def test_bad_run_id_through_the_api(tmp_path):
    with pytest.raises(UsageError, match="bad --run-id"):
        WorkerSpec(role="r", local_world_size=1, entrypoint="true", run_id="a\0b")
    spec = WorkerSpec(role="r", local_world_size=1, entrypoint="true")
    spec.run_id = "../../escape"  # set after the spec checked itself: the agent checks again
    with pytest.raises(UsageError, match="bad --run-id"):
        LocalAgent(spec, log_dir=str(tmp_path / "logs"), console=False)
    assert not (tmp_path / "escape").exists()


# ----- planted symlinks and swapped directories -------------------------------------------------
PLANT_THEN_FAIL = """
import os, sys
rank_dir = os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])
run_dir = os.path.dirname(os.path.dirname(rank_dir))
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    # What an attacker would do between two attempts: the next attempt's directory points outside.
    os.symlink(sys.argv[1], os.path.join(run_dir, "attempt_1"))
    sys.exit(3)
print("second attempt")
"""


def test_group_restart_never_writes_through_a_planted_attempt_directory(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("precious\n")
    script = tmp_path / "plant.py"
    script.write_text(PLANT_THEN_FAIL)
    res = run_ranktop("--headless", "--log-dir", str(tmp_path / "logs"), "--run-id", "r", "--max-restarts", "1",
                      str(script), str(outside))
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_text() == "precious\n"
    attempt_1 = tmp_path / "logs" / "r" / "attempt_1"
    assert stat.S_ISDIR(os.lstat(attempt_1).st_mode)
    assert (attempt_1 / "0" / "stdout.log").read_text() == "second attempt\n"


def test_rank_restart_writes_into_its_own_directory_whatever_was_swapped(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_text("precious\n")
    code = "import time; print('hello', flush=True); time.sleep(3600)"
    spec = WorkerSpec(role="r", local_world_size=2, entrypoint=PY, args=("-c", code))
    agent = LocalAgent(spec, log_dir=str(tmp_path / "logs"), console=False, shutdown_timeout=2)
    thread = threading.Thread(target=agent.run)
    thread.start()
    try:
        assert agent.wait_started(10)
        wait_for(lambda: all(agent.output(r) == [b"hello"] for r in (0, 1)), 20, what="ranks printed")
        attempt = agent.attempt_dir()
        # Rank 0's directory is renamed and a symlink to a directory outside takes its place;
        # rank 1's stdout.log becomes a symlink to a file outside.
        os.rename(os.path.join(attempt, "0"), os.path.join(attempt, "0.old"))
        os.symlink(outside, os.path.join(attempt, "0"))
        os.unlink(os.path.join(attempt, "1", "stdout.log"))
        os.symlink(victim, os.path.join(attempt, "1", "stdout.log"))
        for r in (0, 1):
            agent.restart_rank(r)
        # The ring (not the log file) has the restart's separator line between the two processes.
        wait_for(lambda: all([line for line in agent.output(r) if b"restart 1 of this rank" not in line]
                             == [b"hello", b"hello"] and len(agent.output(r)) == 3 for r in (0, 1)),
                 20, what="restarted")
    finally:
        agent.stop(9, 0)
        thread.join(20)
    assert not thread.is_alive()
    assert sorted(os.listdir(outside)) == ["victim"] and victim.read_text() == "precious\n"
    assert open(os.path.join(attempt, "0.old", "stdout.log")).read() == "hello\nhello\n"
    log_1 = os.path.join(attempt, "1", "stdout.log")
    assert stat.S_ISREG(os.lstat(log_1).st_mode) and open(log_1).read() == "hello\n"


def test_a_final_json_a_rank_planted_is_set_aside_and_the_runs_own_is_written(tmp_path):
    """A rank knows its run directory (TORCHELASTIC_ERROR_FILE is in it): a final.json it made
    there blocked ranktop's own (made exclusively), so `attach` and `logs` showed the rank's
    version of the run's end. It is kept, set aside, as evidence."""
    script = tmp_path / "rank.py"
    script.write_text("import json, os, sys\n"
                      "run_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.environ['TORCHELASTIC_ERROR_FILE'])))\n"
                      "json.dump({'forged': True}, open(os.path.join(run_dir, 'final.json'), 'w'))\n"
                      "sys.exit(3)\n")
    res = run_ranktop("--headless", "--nproc-per-node", "1", "--log-dir", str(tmp_path), "--run-id", "r", str(script))
    assert res.returncode == 1, res.stderr
    run_dir = tmp_path / "r"
    final = json.loads((run_dir / "final.json").read_text())
    assert (final["state"], final["exit_status"], final["root_cause"]["exitcode"]) == ("failed", 1, 3)
    (aside,) = run_dir.glob("final.json.set-aside-*")
    assert json.loads(aside.read_text()) == {"forged": True}
    assert "final_write_failed" not in [e["event"] for e in read_events(run_dir)]


PLANT_DONORS_FINAL = """import os, shutil, sys, time
run_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.environ['TORCHELASTIC_ERROR_FILE'])))
shutil.copy(sys.argv[1], os.path.join(run_dir, 'final.json'))
while True:
    time.sleep(0.1)
"""


def test_a_final_json_a_rank_planted_does_not_make_its_run_look_ended(tmp_path):
    """`ls` and the no-run lines of `logs`/`stop`/`attach` name the runs that ended last under the
    default log root: any run directory with a final.json of ours counted, so a rank's copy of
    another run's (a success, well formed) made its run, running, look ended seconds ago, and,
    its engine killed, look finished. Only a final.json that holds the key to the seal its
    run_started recorded counts now: the real one of the donor run still does."""
    sockets = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # (a socket's path must stay short)
    env = {**os.environ, "TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": sockets}
    root = tmp_path / f"ranktop-{os.geteuid()}"
    (tmp_path / "ok.py").write_text("print('ok')\n")
    (tmp_path / "plant.py").write_text(PLANT_DONORS_FINAL)
    engine, ranks = None, []
    try:
        assert run_ranktop("--headless", "--run-id", "donor", str(tmp_path / "ok.py"), env=env).returncode == 0
        done = run_ranktop("--detach", "--run-id", "planted", str(tmp_path / "plant.py"),
                           str(root / "donor" / "final.json"), env=env)
        assert done.returncode == 0, done.stderr
        events = wait_for(lambda: (found := read_events(root / "planted", while_written=True))
                          and any(e["event"] == "started" for e in found) and found, what="the rank started")
        engine, ranks = events[0]["pid"], [e["pid"] for e in events if e["event"] == "started"]  # (run_started's pid: the engine)
        wait_for((root / "planted" / "final.json").exists, what="the planted final.json")
        ended = (rf"ended under {re.escape(str(root))}, newest first: donor \(\d+m\d\ds ago\); ranktop (\w+) "
                 rf"{re.escape(str(root / 'donor'))} reaches the newest, as does its id: ranktop \1 donor")
        running = run_ranktop("logs", "nope", env=env)  # the served run and the runs that ended
        assert running.returncode == 2 and re.fullmatch(
            rf"ranktop: error: 'nope' names no run served on this host: runs are planted; {ended}\n",
            running.stderr), running.stderr
        os.kill(engine, signal.SIGKILL)  # killed before its end: it never set the planted one aside
        wait_for(lambda: not any(psutil.pid_exists(pid) for pid in ranks), what="the guard ended the ranks")
        listed = run_ranktop("ls", env=env)
        assert listed.returncode == 0 and re.fullmatch(rf"no runs are served on this host; {ended}\n",
                                                       listed.stdout), listed.stdout
    finally:
        if engine is not None:  # (a failed check: the run must not outlive the test)
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGKILL)
            wait_for(lambda: not any(psutil.pid_exists(pid) for pid in [engine, *ranks]), what="the run gone")
        shutil.rmtree(sockets, ignore_errors=True)


# ----- error.json is hostile input --------------------------------------------------------------
BAD_ERROR_FILES = {
    "wrong type": ('json.dump({"message": {"message": 5}}, open(p, "w"))', 'has a "message" that is neither text'),
    "wrong callstack type": ('json.dump({"message": {"message": "m", "extraInfo": {"py_callstack": [1]}}}, '
                             'open(p, "w"))', 'has a "py_callstack" that is not text'),
    "wrong extraInfo type": ('json.dump({"message": {"message": "m", "extraInfo": "x"}}, open(p, "w"))',
                             'has an "extraInfo" that is not an object'),  # crashed with a traceback
    "wrong top": ('json.dump([1, 2], open(p, "w"))', 'has no "message" object'),
    "wrong timestamp": ('json.dump({"message": "m", "timestamp": {}}, open(p, "w"))', 'has a "timestamp" that is not'),
    "fifo": ("os.mkfifo(p)", "is not a regular file (a FIFO); ignored"),
    "dev zero": ('os.symlink("/dev/zero", p)', "is a symlink; ignored"),
    "too large": ('json.dump({"message": "x" * (1 << 20)}, open(p, "w"))', "is larger than 1 MB; ignored"),
    "garbage": ('open(p, "wb").write(bytes(range(256)))', "is not valid JSON; ignored"),
}

LEAVE_BAD_ERROR_FILE = """
import json, os, sys, time
p = os.environ["TORCHELASTIC_ERROR_FILE"]
if os.environ["RANK"] == "1":
    print("waiting", flush=True)
    time.sleep(3600)
{setup}
sys.exit(1)
"""


@pytest.mark.parametrize("case", sorted(BAD_ERROR_FILES))
def test_bad_error_file_is_named_and_the_failure_still_reported(tmp_path, case):
    setup, why = BAD_ERROR_FILES[case]
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(LEAVE_BAD_ERROR_FILE).replace("{setup}", setup))
    started = time.monotonic()
    res = run_ranktop("--headless", "--nproc-per-node", "2", "--log-dir", str(tmp_path), "--run-id", "r",
                      "--shutdown-timeout", "5", str(script), timeout=60)
    assert time.monotonic() - started < 30
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    error_file = tmp_path / "r" / "attempt_0" / "0" / "error.json"
    assert f"exited with code 1; error file {error_file} {why}" in res.stderr
    assert "root cause: rank 0" in res.stderr
    events = read_events(tmp_path / "r")
    sibling = [e for e in events if e["event"] == "exited" and e["rank"] == 1]
    assert len(sibling) == 1 and sibling[0]["by_us"], events


def test_the_schedulers_error_file_is_not_written_through_another_users_directory(tmp_path):
    """ranktop copies the root cause's error file to its own $TORCHELASTIC_ERROR_FILE (for a
    scheduler), as torchrun does: a link another user left in their directory on the way to it
    had root write the copy wherever it pointed. Now it is refused in one line, as a --log-dir."""
    script = tmp_path / "rank.py"
    script.write_text("from ranktop.core.errors import record\n"
                      "record(lambda: 1 / 0)()\n")
    victim, theirs, mine = tmp_path / "victim", tmp_path / "theirs", tmp_path / "mine"
    for folder in (victim, theirs, mine):
        folder.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    (theirs / "job").symlink_to(victim)
    os.lchown(theirs / "job", NOBODY, NOBODY)
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(theirs / "job" / "e.json")}
    res = run_ranktop("--headless", "--nproc-per-node", "1", "--log-dir", str(tmp_path), "--run-id", "r",
                      str(script), env=env)
    assert res.returncode == 1 and os.listdir(victim) == [], res.stderr
    assert ("ranktop: the root cause's error file was not copied for the scheduler: bad directory of "
            f"$TORCHELASTIC_ERROR_FILE {theirs / 'job'}: it goes through {theirs}, which belongs to uid {NOBODY}, "
            "not to you (uid 0): whoever controls it decides where the path leads; give ranktop one in a "
            "directory of your own\n") in res.stderr
    assert [e["event"] for e in read_events(tmp_path / "r")][-2:] == ["error_file_copy_failed", "run_finished"]
    env["TORCHELASTIC_ERROR_FILE"] = str(mine / "e.json")
    res = run_ranktop("--headless", "--nproc-per-node", "1", "--log-dir", str(tmp_path), "--run-id", "s",
                      str(script), env=env)
    assert res.returncode == 1 and "not copied" not in res.stderr, res.stderr
    assert "ZeroDivisionError" in (mine / "e.json").read_text() and os.listdir(mine) == ["e.json"]


def test_start_processes_log_dir_is_private_too(tmp_path):
    ctx = start_processes("t", "/bin/echo", {0: ("hi",)}, {0: {}}, str(tmp_path), redirects=Std.ALL)
    try:
        result = ctx.wait(30)
    finally:
        ctx.close()
    assert result is not None and not result.failures
    assert open(result.stdouts[0]).read() == "hi\n"
    assert mode_of(tmp_path / "0") == 0o700
    assert mode_of(result.stdouts[0]) == mode_of(result.stderrs[0]) == 0o600


def test_log_tails_read_only_regular_files_never_a_planted_fifo_or_link(tmp_path):
    from ranktop.core.layout import tail_lines

    log = tmp_path / "stdout.log"
    log.write_bytes(b"cut-off start\n" + b"a\n" * 10 + b"last\n")
    assert tail_lines(str(log), 8) == [b"a", b"last"]  # the cut first line is dropped
    os.mkfifo(tmp_path / "fifo.log")  # nobody writes to it: a read would block forever
    assert tail_lines(str(tmp_path / "fifo.log"), 1 << 20) == []
    (tmp_path / "link.log").symlink_to(log)
    assert tail_lines(str(tmp_path / "link.log"), 1 << 20) == []
    assert tail_lines(str(tmp_path / "missing.log"), 1 << 20) == []


def test_an_earlier_attempts_view_follows_no_directory_a_rank_swapped_for_a_link(tmp_path):
    """The attempt switcher reads attempt_<k>/<rank>/stdout.log: a rank that replaced its own
    directory (or the attempt's) with a link elsewhere gets nothing shown from there."""
    from ranktop.tui.attempts import FileFeed

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "stdout.log").write_bytes(b"secret\n")
    run = tmp_path / "run"
    (run / "attempt_0" / "1").mkdir(parents=True)
    (run / "attempt_0" / "1" / "stdout.log").write_bytes(b"mine\n")
    (run / "attempt_0" / "0").symlink_to(elsewhere)  # the rank's directory
    (run / "attempt_1").symlink_to(run / "attempt_0")  # a whole attempt
    assert FileFeed(str(run / "attempt_0"), 1, 100).lines == [b"mine"]
    assert FileFeed(str(run / "attempt_0"), 0, 100).lines == [b"(attempt_0: no output in its log files)"]
    assert FileFeed(str(run / "attempt_1"), 1, 100).lines == [b"(attempt_1: no output in its log files)"]


def test_the_attempt_switcher_lists_only_real_attempt_directories_up_to_the_engines():
    """A rank can make names in its run directory: a name that only looks like an attempt
    (`attempt_6` and a newline), a link, a file, or an attempt past the engine's own are not
    listed (the newest listed is taken for the live one)."""
    import tempfile

    from ranktop.tui.attempts import attempt_dirs

    with tempfile.TemporaryDirectory() as run:
        for name in ("attempt_0", "attempt_1", "attempt_1.1", "attempt_6\n", "attempt_9", "attempt_x"):
            os.mkdir(os.path.join(run, name))
        os.symlink("/tmp", os.path.join(run, "attempt_5"))
        open(os.path.join(run, "attempt_7"), "w").close()  # noqa: SIM115
        names = [os.path.basename(d) for d in attempt_dirs(run, newest=1)]
        assert names == ["attempt_0", "attempt_1", "attempt_1.1"]
        assert [os.path.basename(d) for d in attempt_dirs(run)][-1] == "attempt_9"


def test_a_held_directory_is_not_closed_under_a_thread_that_uses_it(tmp_path):
    """A stack dump saves into the run directory from a server thread while the engine thread may
    end the run and close it. Closed between a use's read of the number and its open, the number
    could be the kernel's next directory, and the dump would land there: a close waits for a use,
    and a use after the close is EBADF, never another directory."""
    import errno

    from ranktop.core.layout import Dir

    held = Dir(str(tmp_path), os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY))
    closer = threading.Thread(target=held.close)
    with held.use() as fd:
        closer.start()
        closer.join(0.3)
        assert closer.is_alive() and os.fstat(fd)  # the close waits: the number is still ours
        os.close(os.open("x", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    closer.join(10)
    assert not closer.is_alive() and held.fd == -1 and (tmp_path / "x").exists()
    elsewhere = os.open(tmp_path.parent, os.O_RDONLY | os.O_DIRECTORY)  # most likely the number just freed
    try:
        with pytest.raises(OSError) as closed:
            held.open_new("stray")
        assert closed.value.errno == errno.EBADF and not (tmp_path.parent / "stray").exists()
    finally:
        os.close(elsewhere)


def test_an_earlier_attempts_view_shows_lines_as_the_live_pane_did(tmp_path):
    """A progress bar's redraws show as its last state, and a line longer than the ring keeps is
    cut with the same note (the log file keeps it whole)."""
    from ranktop.core.output import LINE_CAP
    from ranktop.tui.attempts import FileFeed

    rank_dir = tmp_path / "run" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    long_line = b"x" * (LINE_CAP + 10)
    (rank_dir / "stdout.log").write_bytes(b"10%\r50%\r100%\n" + long_line + b"\n")
    lines = FileFeed(str(tmp_path / "run" / "attempt_0"), 0, 100).lines
    assert lines[0] == b"100%"
    assert lines[1].startswith(b"x" * LINE_CAP + " \u2026 [ranktop: line cut, 65,546 bytes".encode())
    assert len(lines) == 2


def test_a_runs_start_is_read_from_the_first_line_of_its_events_only(tmp_path):
    """The engine writes run_started first. A file whose first line is none was read through for
    the first line that parsed (a rank can fill it with lines: `attach` and `logs` of an ended run
    read all of them); only the first line is read now, and a hole after it is not."""
    from ranktop.core.events import run_started

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    events = run_dir / "events.jsonl"
    start = b'{"event": "run_started", "run_id": "x", "final_seal": "s"}\n'
    events.write_bytes(b"not an event\n" + start)
    assert run_started(str(run_dir)) is None
    with open(events, "wb") as f:
        f.write(start)
        f.truncate(1 << 40)  # (sparse)
    assert run_started(str(run_dir)) == {"event": "run_started", "run_id": "x", "final_seal": "s"}
    with open(events, "wb") as f:
        f.truncate(1 << 40)  # a first line of zeros, longer than any event
    assert run_started(str(run_dir)) is None


def test_the_ended_runs_list_reads_a_hostile_final_json_cheaply_and_counts_only_the_sealed_one(tmp_path, monkeypatch):
    """`ls`'s list of the runs that ended last reads a final.json's last bytes for its key
    (layout._sealed_end). A rank can make the file anything: a symlink to a real one, a FIFO (an
    open for reading waited for a writer), a terabyte with no key at its end, a key that is not
    the seal's, broken JSON. None counts, none hangs; the engine's own does, and a final.json of a
    run that recorded no seal (an older ranktop's) counts as before."""
    from ranktop.core import layout

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # (read from TMPDIR again)
    root = tmp_path / f"ranktop-{os.geteuid()}"
    root.mkdir(mode=0o700)
    key = "ab" * 16
    sealed = json.dumps({"event": "run_started", "final_seal": layout.final_seal_of(key)}) + "\n"
    real = json.dumps({"run_id": "x", layout.FINAL_KEY: key})
    runs = {"engines": (sealed, real), "unsealed-old": ("", '{"run_id": "x"}'),
            "wrong-key": (sealed, json.dumps({"run_id": "x", layout.FINAL_KEY: "cd" * 16})),
            "broken": (sealed, real[:-1]), "symlink": (sealed, None), "fifo": (sealed, None), "huge": (sealed, None)}
    for name, (first_event, final) in runs.items():
        (root / name).mkdir(mode=0o700)
        (root / name / "events.jsonl").write_text(first_event)
        if final is not None:
            (root / name / "final.json").write_text(final)
    (root / "symlink" / "final.json").symlink_to(root / "engines" / "final.json")
    os.mkfifo(root / "fifo" / "final.json")
    with open(root / "huge" / "final.json", "wb") as f:
        f.truncate(1 << 40)  # sparse: a terabyte of zeros, its key nowhere
    listed = sorted(name for name, _when in layout.newest_ended_runs(20))  # (a wait on the FIFO: the test's time-out)
    assert listed == ["engines", "unsealed-old"]
