"""The Python API with torch's start_processes semantics, on real processes."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass

import pytest
import rank_fns
from conftest import NOBODY, ROOT, has_torch_elastic, mode_of, run_side_by_side, stop_process, wait_for
from ranktop.core import DefaultLogsSpecs, ProcessFailure, RunProcsResult, Std, record, start_processes
from ranktop.core.errors import read_error_file, write_error_file
from ranktop.core.output import line_length

PY = sys.executable
RANKS = os.path.join(os.path.dirname(__file__), "ranks")


def _envs(n):
    return {r: {"LOCAL_RANK": str(r)} for r in range(n)}


def _run(fn, args, tmp_path, **kw) -> RunProcsResult:
    ctx = start_processes("trainer", fn, args, _envs(len(args)), str(tmp_path), **kw)
    try:
        result = ctx.wait(timeout=60)
        assert result is not None, "ranks still running after 60 s"
        return result
    finally:
        ctx.close()


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_return_values_by_rank(tmp_path):
    result = _run(rank_fns.double, {0: (1,), 1: (21,), 2: ("ab",)}, tmp_path)
    assert not result.is_failed()
    assert result.return_values == {0: 2, 1: 42, 2: "abab"}


def test_large_return_values_do_not_deadlock(tmp_path):
    size = 10 * 1024 * 1024
    result = _run(rank_fns.big_value, {0: (size,), 1: (size,)}, tmp_path)
    assert {r: (len(v), v[:1]) for r, v in result.return_values.items()} == {0: (size, b"\0"), 1: (size, b"\1")}


@pytest.mark.parametrize(
    "redirects, tee, files, console",
    [
        (Std.NONE, Std.NONE, (False, False), (True, True)),  # straight through, no files
        (Std.OUT, Std.NONE, (True, False), (False, True)),
        (Std.ALL, Std.NONE, (True, True), (False, False)),
        (Std.NONE, Std.ERR, (False, True), (True, True)),
        (Std.NONE, Std.ALL, (True, True), (True, True)),
    ],
)
def test_redirect_and_tee_land_in_the_right_files(tmp_path, capfd, redirects, tee, files, console):
    result = _run(rank_fns.print_streams, {0: ("out-0", "err-0"), 1: ("out-1", "err-1")}, tmp_path,
                  redirects=redirects, tee=tee)
    out, err = capfd.readouterr()
    for r in (0, 1):
        for (paths, text, expect) in ((result.stdouts, f"out-{r}", files[0]), (result.stderrs, f"err-{r}", files[1])):
            if expect:
                assert paths[r] == str(tmp_path / str(r) / os.path.basename(paths[r]))
                with open(paths[r]) as f:
                    assert f.read() == text + "\n"
            else:
                assert paths[r] == ""
        assert (f"out-{r}" in out) == console[0]
        assert (f"err-{r}" in err) == console[1]
    if tee & Std.ERR:
        assert "[trainer0]:err-0" in err and "[trainer1]:err-1" in err


def test_per_rank_redirect_map(tmp_path):
    result = _run(rank_fns.print_streams, {0: ("a", "b"), 1: ("c", "d")}, tmp_path,
                  redirects=Std.from_str("0:3,1:1"))
    assert result.stdouts[0] and result.stderrs[0] and result.stdouts[1] and not result.stderrs[1]


def test_raising_function_gives_one_failure_with_error_file(tmp_path):
    result = _run(rank_fns.raise_value_error, {0: ("boom",)}, tmp_path)
    assert list(result.failures) == [0]
    failure = result.failures[0]
    assert failure.exitcode == 1
    assert failure.message_text == "ValueError: boom" and failure.message["message"] == "ValueError: boom"
    assert "raise_value_error" in failure.traceback
    with open(failure.error_file) as f:
        data = json.load(f)
    assert data["message"]["message"] == "ValueError: boom"
    assert data["message"]["extraInfo"]["timestamp"].isdigit()


def test_a_function_rank_that_returned_lives_until_every_rank_returned(tmp_path):
    """As torch's function workers: a rank that returned stays alive until its peers returned
    too, so none tears down a process group (gloo without destroy_process_group) that the others
    still use; that made peers abort at exit with "terminate called without an active exception".
    Rank 1 gives rank 0 a moment to exit after its return before returning itself: rank 0 must
    still be there, and exits after."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "logs").mkdir()
    result = _run(rank_fns.exit_order, {0: (0, str(marks)), 1: (1, str(marks), 1.5)}, str(tmp_path / "logs"))
    assert result.return_values == {0: "returned", 1: "returned"}
    assert (marks / "r0-exit").read_text() == "True"


@pytest.mark.parametrize("then, failures, values", [("exit0", {}, {0: "returned", 1: None}),
                                                    ("raise", {1: 1}, {})])
def test_a_returned_rank_is_let_go_when_a_peer_ends_without_a_value_or_fails(tmp_path, then, failures, values):
    """A peer that exits 0 without returning (sys.exit(0)) lets the waiting rank go; one that fails
    stops it with the group, and only the failed rank is reported, as torch's."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "logs").mkdir()
    result = _run(rank_fns.exit_order, {0: (0, str(marks)), 1: (1, str(marks), 0, then)}, str(tmp_path / "logs"))
    assert ({r: f.exitcode for r, f in result.failures.items()}, result.return_values) == (failures, values)


def test_sys_exit_gives_its_code_and_no_error_file(tmp_path):
    result = _run(rank_fns.exit_with, {0: (138,)}, tmp_path)
    failure = result.failures[0]
    assert failure.exitcode == 138
    assert not os.path.exists(failure.error_file)
    assert failure.signal_name() == "<N/A>"


def test_binary_failure_stops_its_sibling_with_sigterm(tmp_path):
    args = {0: ("-c", "import sys; sys.exit(138)"), 1: ("-c", "import time; time.sleep(60)")}
    ctx = start_processes("trainer", PY, args, _envs(2), str(tmp_path))
    try:
        result = ctx.wait(timeout=60)
        sibling = ctx.slots[1].failure
    finally:
        ctx.close()
    # as torch 2.13 for binaries: the sibling it stopped is in `failures` too (function ranks: the cause only)
    assert sorted(result.failures) == [0, 1] and result.failures[0].exitcode == 138
    assert sibling is result.failures[1]
    assert sibling.exitcode == -signal.SIGTERM and sibling.signal_name() == "SIGTERM"  # stopped, with the grace
    assert result.failures[0].exited_at <= sibling.exited_at


def test_a_failed_binary_group_lists_the_ranks_torch_lists(tmp_path):
    """One binary rank fails, its sibling is stopped for it: the same ranks and exit codes in
    `failures` as torch's own start_processes gives for the same call, run beside it. (Function
    ranks: test_api_parity.py::test_a_failed_group_reports_the_rank_that_failed_not_the_ones_stopped_for_it;
    torch's spawn there leaves its resource tracker running, so it is not run beside ours.)"""
    multiprocessing = pytest.importorskip("torch.distributed.elastic.multiprocessing")
    import ranktop.core as ranktop_core

    args = {0: ("-c", "import sys; sys.exit(7)"), 1: ("-c", "import time; time.sleep(60)")}
    found = {}
    for who, module in (("torch", multiprocessing), ("ranktop", ranktop_core)):
        ctx = module.start_processes(f"{who}-f", PY, args, _envs(2),
                                     logs_specs=module.DefaultLogsSpecs(log_dir=str(tmp_path / who)))
        try:
            result = ctx.wait(timeout=60)
        finally:
            ctx.close()
        found[who] = ({r: f.exitcode for r, f in result.failures.items()}, result.return_values)
    assert found["ranktop"] == found["torch"] == ({0: 7, 1: -signal.SIGTERM}, {}), found


def test_segfaulting_binary_reports_sigsegv(tmp_path):
    result = _run(PY, {0: ("-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")}, tmp_path)
    failure = result.failures[0]
    assert failure.exitcode == -11 and failure.signal_name() == "SIGSEGV"
    assert failure.message == f"Signal 11 (SIGSEGV) received by PID {failure.pid}"


def test_binaries_get_str_cast_args(tmp_path):
    result = _run("/bin/echo", {0: (1, 2.5, None)}, tmp_path, redirects=Std.OUT)
    with open(result.stdouts[0]) as f:
        assert f.read() == "1 2.5 None\n"


def test_a_binary_given_as_bytes_runs_and_an_entrypoint_of_no_kind_is_one_line(tmp_path):
    """A bytes path was cast to str as the arguments are, and failed as `No such file or
    directory: "b'/bin/echo'"` (torch's takes it for a function and fails in the rank)."""
    (tmp_path / "run").mkdir()
    with pytest.raises(TypeError, match=r"^entrypoint must be a function or a binary's path \(str, bytes or "
                                        r"os.PathLike\), not int 5$"):
        start_processes("t", 5, {0: ()}, _envs(1), str(tmp_path / "run"))
    assert os.listdir(tmp_path / "run") == []
    result = _run(os.fsencode("/bin/echo"), {0: ("hi",)}, tmp_path / "run", redirects=Std.OUT)
    with open(result.stdouts[0]) as f:
        assert f.read() == "hi\n"


def test_wait_returns_none_while_running_and_close_leaves_nothing(tmp_path):
    ctx = start_processes("t", PY, {0: (os.path.join(RANKS, "family.py"),)}, _envs(1), str(tmp_path),
                          redirects=Std.OUT)
    try:
        assert ctx.wait(timeout=0.1) is None
        line = wait_for(lambda: _pids_line(tmp_path / "0" / "stdout.log"), what="family pids")
        pids = [int(p) for p in line.split()[1:]]
        assert all(_pid_alive(p) for p in pids)
    finally:
        ctx.close(timeout=2)
    wait_for(lambda: not any(_pid_alive(p) for p in pids), timeout=5, what="every process of the rank to exit")


def _pids_line(path):
    try:
        return next((line for line in path.read_text().splitlines() if line.startswith("PIDS")), None)
    except OSError:
        return None


def test_wait_with_a_period_of_0_waits_to_the_end_as_torchs(tmp_path):
    """torch's wait(period=0) polls without a pause; it was refused here (`bad period 0`)."""
    ctx = start_processes("t", rank_fns.double, {0: (4,)}, {0: {}}, str(tmp_path))
    try:
        assert ctx.wait(timeout=-1, period=0).return_values == {0: 8}
    finally:
        ctx.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_nothing_left_after_the_parent_is_signalled(tmp_path, sig):
    parent = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from ranktop.core import start_processes, Std
        ctx = start_processes("p", sys.executable, {{0: ({os.path.join(RANKS, 'family.py')!r},), 1: ({os.path.join(RANKS, 'family.py')!r},)}},
                              {{0: {{}}, 1: {{}}}}, {str(tmp_path)!r}, redirects=Std.OUT)
        print("started", flush=True)
        ctx.wait()
    """)
    proc = subprocess.Popen([PY, "-c", parent], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    lines = [wait_for(lambda r=r: _pids_line(tmp_path / str(r) / "stdout.log"), what=f"rank {r} pids") for r in (0, 1)]
    pids = [int(p) for line in lines for p in line.split()[1:]]
    proc.send_signal(sig)
    proc.wait(timeout=10)
    proc.stdout.close()
    wait_for(lambda: not any(_pid_alive(p) for p in pids), timeout=10, what="ranks and grandchildren to be gone")


def test_a_killed_callers_function_ranks_leave_no_pickles_in_tmpdir(tmp_path):
    """Function ranks take their arguments (and give their results) as pickles in a directory of
    the context's under $TMPDIR, which close() removes. A caller killed before it (SIGKILL, or an
    exception it never caught) had its ranks swept by the guard, and that directory left for good:
    torch's spawn leaves nothing outside its log_dir."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    parent = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import rank_fns
        from ranktop.core import start_processes
        ctx = start_processes("p", rank_fns.sleep_forever, {{0: ()}}, {{0: {{}}}}, {str(tmp_path / "logs")!r})
        print(*ctx.pids().values(), flush=True)
        ctx.wait()
    """)
    (tmp_path / "logs").mkdir()
    proc = subprocess.Popen([PY, "-c", parent], stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)})
    rank = int(proc.stdout.readline())
    assert [p.name.startswith("ranktop-") for p in tmp.iterdir()] == [True]  # its pickles' directory
    proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()
    wait_for(lambda: not _pid_alive(rank), timeout=10, what="the rank to be swept")
    wait_for(lambda: not list(tmp.iterdir()), timeout=10, what="the pickles' directory to be removed")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT])
def test_a_stop_signal_raises_signal_exception_in_the_caller_as_torch(tmp_path, sig):
    """torch's start_processes makes SIGTERM/SIGINT/SIGHUP/SIGQUIT raise SignalException in the
    caller, which closes the ranks with e.sigval; ranktop's let the signal kill the caller, and an
    `except SignalException` never ran. A handler the caller set (here SIG_IGN for SIGHUP, as nohup
    does) is left alone; close() puts back what was replaced."""
    parent = textwrap.dedent(f"""
        import signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from ranktop.core import SignalException, start_processes
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as started from a terminal (a
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)  # background job inherits both ignored)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        ctx = start_processes("p", {PY!r}, {{0: ("-c", "import time; time.sleep(60)")}}, {{0: {{}}}}, {str(tmp_path)!r})
        try:  # (the signal may come while "started" is still being printed)
            print("started", ctx.pids()[0], flush=True)
            while ctx.wait(0.2) is None:
                pass
        except SignalException as e:
            print("caught", e.sigval.name, e, flush=True)
            ctx.close(e.sigval)
            print("restored", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
                  signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, flush=True)
    """)
    proc = subprocess.Popen([PY, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        started = proc.stdout.readline().split()
        assert started[0] == "started", started
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        stop_process(proc)
    assert proc.returncode == 0
    assert out.splitlines() == [f"caught {sig.name} Process {proc.pid} got signal: {int(sig)}", "restored True True True"]
    wait_for(lambda: not _pid_alive(int(started[1])), timeout=5, what="the rank to be gone")


def test_closing_one_of_two_contexts_keeps_the_signal_exception_for_the_other(tmp_path):
    """Two contexts open: closing the first put back SIG_DFL, so a SIGTERM then killed the caller
    outright instead of raising SignalException for the second. The handlers go back only when
    the last context that counts on them is closed."""
    parent = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from ranktop.core import SignalException, start_processes
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sleeper = {{0: ("-c", "import time; time.sleep(60)")}}
        first = start_processes("a", {PY!r}, sleeper, {{0: {{}}}}, {str(tmp_path / "a")!r})
        second = start_processes("b", {PY!r}, sleeper, {{0: {{}}}}, {str(tmp_path / "b")!r})
        first.close()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            second.wait(5)
        except SignalException as e:
            print("caught", e.sigval.name, flush=True)
        second.close()
        print("restored", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    """)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    done = subprocess.run([PY, "-c", parent], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.splitlines()) == (0, ["caught SIGTERM", "restored True"]), done.stderr


def test_a_close_cut_short_while_it_signals_the_ranks_is_finished_by_the_next_close(tmp_path):
    """The second SIGTERM can come while close() still signals the ranks (a loaded machine: the
    rank had its SIGTERM, the caller's came before close() went on): the close was then marked
    done, the next close() returned at once and left the rank running and the handlers installed.
    The signal is sent here right after the ranks', from inside close(), where it came by chance."""
    parent = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from ranktop.core import SignalException, start_processes
        ctx = start_processes("p", {PY!r}, {{0: ("-c", "import time; time.sleep(60)")}}, {{0: {{}}}}, {str(tmp_path)!r})
        stop_all = ctx._stop_all
        def stop_all_then_signalled(sig, grace):
            ctx._stop_all = stop_all  # once
            stop_all(sig, grace)
            os.kill(os.getpid(), signal.SIGTERM)
        ctx._stop_all = stop_all_then_signalled
        pid = ctx.pids()[0]
        try:
            ctx.close(timeout=2)
        except SignalException as e:
            print("cut short", e.sigval.name, flush=True)
            ctx.close(timeout=2)
        print("closed", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, pid, flush=True)
    """)
    done = subprocess.run([PY, "-c", parent], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "cut short SIGTERM" and lines[1].startswith("closed True "), done.stdout
    assert not _pid_alive(int(lines[1].split()[2]))


def test_a_close_cut_short_by_a_second_signal_is_finished_by_the_next_close(tmp_path):
    """A second SIGTERM while close() waits for the ranks raises SignalException out of it (as
    torch's); calling close() again must finish the job. It returned at once, leaving the rank
    running, the run directory and the guard held, and the SignalException handler installed."""
    ready, termed = tmp_path / "ready", tmp_path / "termed"
    rank = (f"import signal, time; signal.signal(signal.SIGTERM, lambda *a: open({str(termed)!r}, 'w').close()); "
            f"open({str(ready)!r}, 'w').close(); time.sleep(60)")
    logs = tmp_path / "logs"
    logs.mkdir()
    parent = textwrap.dedent(f"""
        import signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from ranktop.core import SignalException, start_processes
        ctx = start_processes("p", {PY!r}, {{0: ("-c", {rank!r})}}, {{0: {{}}}}, {str(logs)!r})
        try:
            print("started", ctx.pids()[0], flush=True)
            while ctx.wait(0.2) is None:
                pass
        except SignalException as e:
            try:
                ctx.close(e.sigval, timeout=2)
            except SignalException as again:
                print("cut short", again.sigval.name, flush=True)
                ctx.close(timeout=2)
        print("closed", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    """)
    proc = subprocess.Popen([PY, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        started = proc.stdout.readline().split()
        assert started[0] == "started", started
        wait_for(ready.exists, timeout=10, what="the rank to ignore SIGTERM")
        proc.send_signal(signal.SIGTERM)
        wait_for(termed.exists, timeout=10, what="the rank to get close()'s SIGTERM")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert out.splitlines() == ["cut short SIGTERM", "closed True"]
        assert not _pid_alive(int(started[1]))  # the second close() waited it out, then SIGKILL
    finally:
        stop_process(proc)


def test_a_stop_signal_during_a_pass_that_raised_is_raised_then_not_later(tmp_path):
    """A SIGTERM held during a monitor pass that then raised came out of a later wait() or close(),
    long after it was sent. It is raised there and then, with the pass's error as its __context__,
    and nothing is left pending: close() finishes without raising it again."""
    logs = tmp_path / "logs"
    logs.mkdir()
    parent = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from ranktop.core import SignalException, start_processes
        ctx = start_processes("p", {PY!r}, {{0: ("-c", "import time; time.sleep(60)")}}, {{0: {{}}}}, {str(logs)!r})
        look = ctx._strays.look
        def look_then_fail():  # in the pass, with stop signals held: SIGTERM comes, then an error
            ctx._strays.look = look
            os.kill(os.getpid(), signal.SIGTERM)
            raise OSError("the pass failed")
        ctx._strays.look = look_then_fail
        try:
            ctx.wait(1)
        except SignalException as e:
            print("caught", e.sigval.name, "after", repr(e.__context__), flush=True)
            ctx.close(e.sigval)
        except OSError as e:
            print("the pass's own error", e, flush=True)
            ctx.close()
        print("closed", ctx.pids()[0], flush=True)
    """)
    done = subprocess.run([PY, "-c", parent], capture_output=True, text=True, timeout=60)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert lines[0] == "caught SIGTERM after OSError('the pass failed')", lines
    assert lines[1].startswith("closed "), lines  # close() raised nothing left over
    wait_for(lambda: not _pid_alive(int(lines[1].split()[1])), timeout=10, what="the rank to be gone")


def test_output_bytes_reach_the_log_file_unchanged(tmp_path):
    sys.path.insert(0, RANKS)
    try:
        from output_fidelity import payload
    finally:
        sys.path.remove(RANKS)
    ctx = start_processes("t", PY, {0: (os.path.join(RANKS, "output_fidelity.py"),)}, _envs(1), str(tmp_path),
                          redirects=Std.ALL)
    try:
        result = ctx.wait(timeout=60)
        with open(result.stdouts[0], "rb") as f:
            assert f.read() == payload()
        lines = ctx.slots[0].ring.tail()
        assert b"progress 100%" in lines and not any(b"progress 10%" in line for line in lines)
        assert lines[-1] == b"partial last line without newline"
        assert b"bad utf8 \xff\xfe\xc3\x28 end" in lines
        assert any(line_length(line) == 5 * 1024 * 1024 for line in lines)  # its head, and its length
    finally:
        ctx.close()


@pytest.mark.parametrize(
    "args, envs, message",
    [
        ({0: (), 1: ()}, {0: {}}, "args and envs must both have exactly the local ranks 0..1"),
        ({0: (), 2: ()}, {0: {}, 2: {}}, "exactly the local ranks 0..1"),
    ],
)
def test_mismatched_ranks_are_refused(tmp_path, args, envs, message):
    with pytest.raises(ValueError, match=message):
        start_processes("t", PY, args, envs, str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("env, named", [({"A": 5}, "envs[0]['A']: an environment variable's value must be text, not int"),
                                        ({"A": None}, "envs[0]['A']: an environment variable's value must be text, not NoneType"),
                                        ({7: "x"}, "envs[0][7]: an environment variable's name must be text, not int")])
def test_envs_that_are_not_text_are_one_line_before_anything_is_made(tmp_path, env, named):
    """torch's binary ranks raise Popen's TypeError (naming neither rank nor variable) with their
    directories made; its function ranks fail at their start. Both are refused here, first."""
    for entrypoint, args in ((PY, ("-c", "pass")), (rank_fns.double, (1,))):
        with pytest.raises(TypeError) as info:
            start_processes("t", entrypoint, {0: args}, {0: env}, str(tmp_path))
        assert str(info.value) == named
        assert os.listdir(tmp_path) == []
    torch_mp = pytest.importorskip("torch.distributed.elastic.multiprocessing")
    with pytest.raises(TypeError):  # the same type as torch's, for code that catches it
        torch_mp.start_processes("t", PY, {0: ("-c", "pass")}, {0: env},
                                 torch_mp.DefaultLogsSpecs(log_dir=str(tmp_path / "torch"))).close()


def test_args_that_are_not_arguments_are_one_line_before_anything_is_made(tmp_path):
    """torch's binary ranks raise iteration's bare TypeError; its function ranks fail at their start."""
    for entrypoint in (PY, rank_fns.double):
        with pytest.raises(TypeError, match=r"^args\[1\] must be the rank's arguments \(a tuple\), not NoneType$"):
            start_processes("t", entrypoint, {0: (1,), 1: None}, {0: {}, 1: {}}, str(tmp_path))
        assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("entrypoint, args, envs, error, message", [
    (PY, {0: ("-c", "pass")}, {0: {"A": "x\0y"}}, ValueError,
     r"envs\[0\]\['A'\]: an environment variable's value cannot hold a NUL byte"),
    (rank_fns.double, {0: (1,)}, {0: {"A=B": "1"}}, ValueError,
     r"envs\[0\]\['A=B'\]: an environment variable's name cannot hold '='"),
    (PY, {0: ("-c", "pass")}, {0: {"A": "\ud800"}}, ValueError,
     r"envs\[0\]\['A'\]: an environment variable's value cannot be encoded for the ranks"),
    (PY, {0: ("-c", "pass")}, {0: None}, TypeError, r"envs\[0\] must map variable names to values, not NoneType"),
    (PY, {0: ("-c", "pass"), 1: ("-c", "pa\0ss")}, {0: {}, 1: {}}, ValueError,
     r"args\[1\]\[1\]: an argument cannot hold a NUL byte"),
    (rank_fns.double, {0: (1,), 1: (threading.Lock(),)}, {0: {}, 1: {}}, ValueError,
     r"cannot send the arguments of 'double' to a new process"),
], ids=["nul-in-value", "equals-in-name", "unencodable-value", "envs-not-a-mapping", "nul-in-argument", "unpicklable-argument"])
def test_what_the_ranks_start_would_refuse_is_one_line_before_anything_is_made(tmp_path, entrypoint, args, envs,
                                                                              error, message):
    """Popen's refusals ('embedded null byte', 'illegal environment variable name', naming neither
    rank nor variable) and pickle's came at the rank's start, its directory made: the older form's
    log_dir was then no longer empty, so the corrected call was refused too."""
    with pytest.raises(error, match=f"^{message}"):
        start_processes("t", entrypoint, args, envs, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_restart_count_that_names_no_attempt_is_one_line_naming_it(tmp_path):
    specs = DefaultLogsSpecs(log_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"^envs\[0\]\['TORCHELASTIC_RESTART_COUNT'\] 'x': expected the restart "):
        start_processes("t", PY, {0: ("-c", "pass")}, {0: {"TORCHELASTIC_RESTART_COUNT": "x"}}, specs)
    assert os.listdir(tmp_path) == []


def test_bytes_in_envs_reach_the_rank_as_popen_takes_them(tmp_path):
    ctx = start_processes("t", PY, {0: ("-c", "import os; print(os.environ['A'])")}, {0: {b"A": b"bytes"}},
                          str(tmp_path), redirects=Std.OUT)
    try:
        result = ctx.wait(timeout=60)
    finally:
        ctx.close()
    assert result is not None and not result.is_failed()
    assert open(result.stdouts[0]).read() == "bytes\n"


def test_log_dir_must_exist_be_a_directory_and_be_empty(tmp_path):
    args, envs = {0: ("-c", "pass")}, {0: {}}
    with pytest.raises(ValueError, match="does not exist"):
        start_processes("t", PY, args, envs, str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        start_processes("t", PY, args, envs, str(tmp_path / "file"))
    with pytest.raises(ValueError, match="is not empty"):
        start_processes("t", PY, args, envs, str(tmp_path))
    assert (tmp_path / "file").read_text() == "x"


def test_redirect_map_naming_a_missing_rank_is_ignored_as_in_torch(tmp_path):
    # One map serves nodes with different numbers of ranks: a rank this node lacks is ignored.
    ctx = start_processes("t", PY, {0: ("-c", "print('hello')")}, {0: {}}, str(tmp_path),
                          redirects={0: Std.OUT, 5: Std.OUT})
    try:
        result = ctx.wait()
    finally:
        ctx.close()
    assert result is not None and not result.is_failed()
    assert open(result.stdouts[0]).read() == "hello\n"


def test_unpicklable_callable_is_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="must be importable by name"):
        ctx = start_processes("t", lambda: 1, {0: ()}, {0: {}}, str(tmp_path))
        ctx.close()


UNPICKLABLE = lambda: 1  # noqa: E731  (module level: pickle's PicklingError, as torch's spawn gives)


def test_what_cannot_be_pickled_is_a_pickling_error_as_torchs_and_named(tmp_path):
    import pickle

    (tmp_path / "fn").mkdir()
    with pytest.raises(pickle.PicklingError, match="must be importable by name") as info:
        start_processes("t", UNPICKLABLE, {0: ()}, {0: {}}, str(tmp_path / "fn"))
    assert isinstance(info.value, ValueError)  # what ranktop raised before, for code that catches it
    (tmp_path / "args").mkdir()
    with pytest.raises(pickle.PicklingError, match=r"^cannot send the arguments of 'double' to a new process: "):
        start_processes("t", rank_fns.double, {0: (threading.Lock(),)}, {0: {}}, str(tmp_path / "args"))
    pytest.importorskip("torch.distributed.elastic.multiprocessing")
    # torch's, in a process of its own: its start leaves multiprocessing's resource tracker running
    code = textwrap.dedent(f"""
        import pickle, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_start_processes import UNPICKLABLE
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
        try:
            start_processes("t", UNPICKLABLE, {{0: ()}}, {{0: {{}}}}, DefaultLogsSpecs(log_dir={str(tmp_path / "torch")!r}))
        except pickle.PicklingError:
            print("PicklingError")
    """)
    assert subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120).stdout == "PicklingError\n"


def test_record_writes_torch_format_and_reads_torch_files(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with pytest.raises(KeyError):
        record(lambda: {}["missing"])()
    content = read_error_file(path)
    assert content.message == "KeyError: 'missing'" and "Traceback" in content.traceback
    # What torch's own @record writes (same keys; an old-style plain message too).
    path.write_text(json.dumps({"message": {"message": "RuntimeError: from torch",
                                            "extraInfo": {"py_callstack": "tb", "timestamp": "1700000000"}}}))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert (failure.message_text, failure.traceback, failure.timestamp) == ("RuntimeError: from torch", "tb", 1700000000.0)
    path.write_text(json.dumps({"message": "plain text"}))
    assert read_error_file(path).message == "plain text"
    write_error_file(path, OSError("disk"))
    assert read_error_file(path).message == "OSError: disk"


def test_error_file_from_torch_record_is_read(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "torch_rank.py"
    script.write_text(textwrap.dedent("""
        from torch.distributed.elastic.multiprocessing.errors import record
        @record
        def main():
            raise ZeroDivisionError("torch side")
        main()
    """))
    logs = tmp_path / "logs"
    logs.mkdir()
    result = _run(PY, {0: (str(script),)}, logs, redirects=Std.ALL)
    failure = result.failures[0]
    assert failure.exitcode == 1
    assert "ZeroDivisionError: torch side" in failure.message_text
    assert "torch side" in (failure.traceback or "")


# ----- torch 2.13's context attributes, call forms, LogsSpecs console filter ------------------

# Runs every redirects x tee x local_ranks_filter combination with one implementation and prints
# what each left: where the context says each stream went, and each file's text (paths relative
# to the attempt directory). The console is what the caller captures from this process.
_TABLE_SCRIPT = """
import itertools, json, os, sys, tempfile
if sys.argv[1] == "torch":
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
else:
    from ranktop.core import DefaultLogsSpecs, Std, start_processes
STD = {"N": Std.NONE, "O": Std.OUT, "E": Std.ERR, "A": Std.ALL}
FILTERS = {"all": None, "r1": {1}, "empty": set()}
CODE = "import sys; print('out-' + sys.argv[1], flush=True); print('err-' + sys.argv[1], file=sys.stderr, flush=True)"
report = {}
for red, tee, flt in itertools.product("NOA", "NEA", FILTERS):
    key = red + tee + flt
    root = tempfile.mkdtemp(dir=sys.argv[2])
    specs = DefaultLogsSpecs(log_dir=root, redirects=STD[red], tee=STD[tee], local_ranks_filter=FILTERS[flt])
    args = {r: ("-c", CODE, f"{key}-r{r}") for r in range(2)}
    ctx = start_processes("p", sys.executable, args, {0: {}, 1: {}}, specs, duplicate_stdout_filters=["out"])
    result = ctx.wait(60, period=0.05)
    ctx.close()
    rel = lambda p: p if p in ("", os.devnull) else os.path.relpath(p, root).split(os.sep, 1)[1]
    files = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n)) as f:
                files[rel(os.path.join(d, n))] = sorted(f.read().splitlines())
    report[key] = {"ctx": [{r: rel(p) for r, p in ctx.stdouts.items()}, {r: rel(p) for r, p in ctx.stderrs.items()}],
                   "result": [{r: rel(p) for r, p in result.stdouts.items()},
                              {r: rel(p) for r, p in result.stderrs.items()}],
                   "files": files}
print("REPORT " + json.dumps(report), flush=True)
"""


def _tables(tmp_path) -> dict[str, tuple[dict, str, str]]:
    """torch's and ranktop's (report, console stdout, console stderr), the two run side by side."""
    runs = {}
    for impl in ("torch", "ranktop"):
        (tmp_path / impl).mkdir()
        runs[impl] = {"args": [PY, "-c", _TABLE_SCRIPT, impl, str(tmp_path / impl)]}
    tables = {}
    for impl, proc in run_side_by_side(runs, timeout=240).items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout
        tables[impl] = json.loads(out[out.index("REPORT ") + 7:]), out[:out.index("REPORT ")], proc.stderr
    return tables


def _shown(console: str, token: str, rank: int) -> str:
    """How a rank's line reached the console: prefixed (a tee), plain (passed through), or not.
    Ranks writing to a shared console may interleave their lines, so no line anchors."""
    prefixed = console.count(f"[p{rank}]:{token}")
    plain = console.count(token) - prefixed
    return "+".join(kind for kind, n in (("prefixed", prefixed), ("plain", plain)) if n) or "absent"


def test_console_and_files_match_torch_for_every_redirect_tee_and_filter(tmp_path):
    pytest.importorskip("torch.distributed.elastic.multiprocessing")
    tables = _tables(tmp_path)
    (torch_report, torch_out, torch_err), (ours, our_out, our_err) = tables["torch"], tables["ranktop"]
    assert set(ours) == set(torch_report) and len(ours) == 27
    for key in torch_report:
        assert ours[key] == torch_report[key], key  # same paths ("" / os.devnull / file) and file texts
        for r in (0, 1):
            for stream, theirs, mine in (("out", torch_out, our_out), ("err", torch_err, our_err)):
                token = f"{stream}-{key}-r{r}"
                assert _shown(mine, token, r) == _shown(theirs, token, r), token
    # The case of the report: a filter leaving rank 0 out hides its untouched console output.
    assert _shown(our_out, "out-NNr1-r0", 0) == "absent" and _shown(our_out, "out-NNr1-r1", 1) == "plain"
    assert ours["NNr1"]["ctx"][0] == {"0": os.devnull, "1": ""}


def _specs_run(tmp_path, *more, envs=None, code="print('hi')", nprocs=2, **kw):
    envs = envs if envs is not None else {r: {} for r in range(nprocs)}
    ctx = start_processes("b", PY, {r: ("-c", code) for r in range(nprocs)}, envs, *more, **kw)
    try:
        result = ctx.wait(timeout=60)
        assert result is not None
    finally:
        ctx.close()
    return ctx, result


def test_context_has_torchs_stdouts_stderrs_error_files_and_filtered_files(tmp_path):
    from ranktop.core import DefaultLogsSpecs

    specs = DefaultLogsSpecs(log_dir=str(tmp_path), redirects={1: Std.OUT}, tee={0: Std.ALL})
    ctx = start_processes("b", PY, {r: ("-c", "print('keep me'); print('drop me')") for r in (0, 1)}, {0: {}, 1: {}},
                          specs, duplicate_stdout_filters=["keep"])
    attempt = specs.attempt_dir
    try:
        assert ctx.stdouts == {0: os.path.join(attempt, "0", "stdout.log"), 1: os.path.join(attempt, "1", "stdout.log")}
        assert ctx.stderrs == {0: os.path.join(attempt, "0", "stderr.log"), 1: ""}  # "": not redirected
        assert ctx.error_files == {r: os.path.join(attempt, str(r), "error.json") for r in (0, 1)}
        assert ctx.filtered_stdout.name == os.path.join(attempt, "filtered_stdout.log")
        assert not ctx.filtered_stdout.closed and ctx.filtered_stderr is None  # no stderr filters
        result = ctx.wait(timeout=60)
    finally:
        ctx.close()
    assert ctx.filtered_stdout.closed
    assert (result.stdouts, result.stderrs) == (ctx.stdouts, ctx.stderrs)
    with open(os.path.join(attempt, "filtered_stdout.log")) as f:
        assert f.read() == "[b0]:keep me\n"  # as torch: only teed streams feed the copy
    with open(ctx.stdouts[1]) as f:
        assert f.read() == "keep me\ndrop me\n"


def test_older_form_context_paths(tmp_path):
    ctx = start_processes("b", PY, {0: ("-c", "pass")}, {0: {}}, str(tmp_path), "spawn", Std.ERR)
    try:
        assert (ctx.stdouts, ctx.stderrs) == ({0: ""}, {0: str(tmp_path / "0" / "stderr.log")})
        assert ctx.error_files == {0: str(tmp_path / "0" / "error.json")}
        assert ctx.filtered_stdout is None and ctx.filtered_stderr is None
    finally:
        ctx.close()


def test_reify_sets_the_error_file_in_envs_in_place_and_ranks_get_it(tmp_path):
    from ranktop.core import DefaultLogsSpecs

    envs = {0: {"TORCHELASTIC_RUN_ID": "r"}, 1: {}}
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "a"))
    dest = specs.reify(envs)
    assert dest.error_files == {r: os.path.join(specs.attempt_dir, str(r), "error.json") for r in (0, 1)}
    assert {r: envs[r]["TORCHELASTIC_ERROR_FILE"] for r in (0, 1)} == dest.error_files
    envs = {0: {}}
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "b"), redirects=Std.OUT)
    ctx, _ = _specs_run(tmp_path, specs, envs=envs, nprocs=1,
                        code="import os; print(os.environ['TORCHELASTIC_ERROR_FILE'])")
    with open(ctx.stdouts[0]) as f:
        assert f.read().strip() == envs[0]["TORCHELASTIC_ERROR_FILE"] == ctx.error_files[0]


def test_positions_after_a_logs_specs_follow_torchs_order(tmp_path, capfd):
    from ranktop.core import DefaultLogsSpecs

    specs = DefaultLogsSpecs(log_dir=str(tmp_path), tee=Std.OUT)
    # (name, entrypoint, args, envs, logs_specs, log_line_prefixes, start_method, numa_options,
    #  duplicate_stdout_filters, duplicate_stderr_filters): torch runs this; ranktop used to refuse it.
    ctx, result = _specs_run(tmp_path, specs, {0: "[a]", 1: "[b]"}, "spawn", None, ["hi"], None)
    assert not result.is_failed()
    out = capfd.readouterr().out
    assert "[a]hi" in out and "[b]hi" in out
    with open(os.path.join(specs.attempt_dir, "filtered_stdout.log")) as f:
        assert sorted(f.read().splitlines()) == ["[a]hi", "[b]hi"]


def test_the_older_positional_form_still_works(tmp_path, capfd):
    ctx, result = _specs_run(tmp_path, str(tmp_path), "spawn", Std.NONE, Std.OUT, {0: "<0>", 1: "<1>"})
    assert not result.is_failed() and result.stdouts[0] == str(tmp_path / "0" / "stdout.log")
    out = capfd.readouterr().out
    assert "<0>hi" in out and "<1>hi" in out


@pytest.mark.parametrize(
    "more, kw, error, message",
    [
        (("specs", None, "spawn", None, None, None, "extra"), {}, TypeError,
         r"takes at most 10 positional arguments when the fifth is a LogsSpecs \(11 given\)"),
        (("dir", "spawn", Std.NONE, Std.NONE, None, "extra"), {}, TypeError,
         r"takes at most 9 positional arguments when the fifth is a log_dir \(10 given\)"),
        (("specs", None, "spawn"), {"start_method": "fork"}, TypeError, "multiple values for argument 'start_method'"),
        (("dir", "spawn", Std.OUT), {"redirects": Std.ERR}, TypeError, "multiple values for argument 'redirects'"),
        (("dir",), {"log_dir": "dir"}, TypeError, "multiple values for argument 'log_dir'"),
        (("specs",), {"redirects": Std.OUT, "tee": Std.ERR}, TypeError,
         r"got redirects, tee with a LogsSpecs: they belong in the LogsSpecs"),
        (("specs", None, "thread"), {}, ValueError, "unknown start method 'thread'"),
        (("specs", None, "spawn", "node"), {}, TypeError,
         "numa_options must be a torch NumaOptions \\(with an affinity_mode\\), got 'node'"),
        (("specs", "[a]"), {}, TypeError, "log_line_prefixes must map local ranks to text, not str"),
        (("specs", {0: 7}), {}, TypeError, "log_line_prefixes\\[0\\] must be text, not int"),
        (("specs", None, "spawn", None, [1]), {}, TypeError,
         "duplicate_stdout_filters must be a list of text, not one holding int"),
        (("dir",), {"duplicate_stderr_filters": [b"x"]}, TypeError,
         "duplicate_stderr_filters must be a list of text, not one holding bytes"),
    ],
)
def test_bad_call_forms_are_refused_with_one_line(tmp_path, more, kw, error, message):
    from ranktop.core import DefaultLogsSpecs

    (tmp_path / "logs").mkdir()
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"))
    more = tuple(specs if m == "specs" else str(tmp_path / "logs") if m == "dir" else m for m in more)
    kw = {k: str(tmp_path / "logs") if v == "dir" else v for k, v in kw.items()}
    with pytest.raises(error, match=message):
        start_processes("b", PY, {0: ("-c", "pass")}, {0: {}}, *more, **kw)
    assert os.listdir(tmp_path / "logs") == []  # refused before anything was made or started


def test_devnull_log_dir_is_refused_with_one_line():
    from ranktop.core import DefaultLogsSpecs

    with pytest.raises(NotADirectoryError, match=r"log_dir: /dev/null \(no log files\) is not supported by ranktop"):
        DefaultLogsSpecs(log_dir=os.devnull)


@dataclass
class _Numa:  # the shape of torch's NumaOptions, without needing torch
    affinity_mode: str
    should_fall_back_if_binding_fails: bool = False


def test_numa_options_bind_each_rank_as_numa_binding_does(tmp_path, monkeypatch):
    from ranktop.core.gpu import numa_binding
    from ranktop.core.logs_specs import DefaultLogsSpecs

    monkeypatch.setenv("RANKTOP_FAKE_GPUS", "2")  # fake GPUs on this machine's real PCI devices and sysfs
    expected = numa_binding("node", 2, None)
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.OUT)
    ctx, result = _specs_run(tmp_path, specs, None, "spawn", _Numa("node"),
                             code="import os; print(sorted(os.sched_getaffinity(0)))")
    for r in (0, 1):
        with open(ctx.stdouts[r]) as f:
            assert f.read().strip() == str(sorted(expected[r]))


def test_numa_options_that_cannot_be_honoured_fail_in_one_line_or_fall_back(tmp_path, monkeypatch):
    from ranktop.core.logs_specs import DefaultLogsSpecs
    from ranktop.core.numa import NumaError

    monkeypatch.setenv("RANKTOP_FAKE_GPUS", "2")
    with pytest.raises(NumaError, match=r"^numa_options: bad --numa-binding 'sideways': expected one of node, "):
        start_processes("b", PY, {0: ("-c", "pass")}, {0: {}}, DefaultLogsSpecs(log_dir=str(tmp_path / "a")),
                        numa_options=_Numa("sideways"))
    # torch's should_fall_back_if_binding_fails: the ranks run on ranktop's own CPUs instead.
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "b"), redirects=Std.OUT)
    ctx, result = _specs_run(tmp_path, specs, numa_options=_Numa("sideways", True), nprocs=1,
                             code="import os; print(sorted(os.sched_getaffinity(0)))")
    with open(ctx.stdouts[0]) as f:
        assert f.read().strip() == str(sorted(os.sched_getaffinity(0)))


def test_torchs_own_numa_options_are_accepted(tmp_path, monkeypatch):
    binding = pytest.importorskip("torch.numa.binding")
    from ranktop.core.logs_specs import DefaultLogsSpecs

    monkeypatch.setenv("RANKTOP_FAKE_GPUS", "1")
    options = binding.NumaOptions(affinity_mode=binding.AffinityMode.SOCKET)
    ctx, result = _specs_run(tmp_path, DefaultLogsSpecs(log_dir=str(tmp_path)), numa_options=options, nprocs=1)
    assert not result.is_failed()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_refused_call_closes_every_descriptor_it_opened(tmp_path):
    from ranktop.core import DefaultLogsSpecs

    gc.collect()  # a context's wake-up pipe is closed when the context is collected (see Waker)
    before = _open_fds()
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"))
    # refused before anything is made; then a rank that cannot start, after the attempt
    # directory was made and opened, with a filtered copy open in it
    with pytest.raises(TypeError):
        start_processes("b", PY, {0: ("-c", "pass")}, {0: {}}, specs, None, duplicate_stdout_filters=[1])
    with pytest.raises(OSError, match="cannot start local rank 0"):
        start_processes("b", str(tmp_path / "no-such-binary"), {0: ()}, {0: {}}, specs,
                        duplicate_stdout_filters=["x"])
    assert os.path.isdir(specs.attempt_dir)
    (tmp_path / "old").mkdir()
    with pytest.raises(OSError, match="cannot start local rank 0"):  # the older form: log_dir held, then refused
        start_processes("b", str(tmp_path / "no-such-binary"), {0: ()}, {0: {}}, str(tmp_path / "old"))
    gc.collect()
    assert _open_fds() == before


def test_one_logs_specs_serves_two_calls_each_in_a_fresh_directory(tmp_path):
    from ranktop.core import DefaultLogsSpecs

    specs = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.OUT)
    stdouts = []
    for text in ("first", "second"):
        ctx, result = _specs_run(tmp_path, specs, nprocs=1, code=f"print({text!r})")
        assert not result.is_failed()
        stdouts.append(ctx.stdouts[0])
    # both kept, each <log_dir>/<run id>_<random>/attempt_0/0/stdout.log, in different run dirs
    assert [open(path).read() for path in stdouts] == ["first\n", "second\n"]
    runs = [os.path.dirname(os.path.dirname(os.path.dirname(path))) for path in stdouts]
    assert runs[0] != runs[1] and all(os.path.dirname(run) == str(tmp_path) for run in runs)
    assert all(path.endswith(os.path.join("attempt_0", "0", "stdout.log")) for path in stdouts)
    assert specs.attempt_dir == os.path.join(runs[1], "attempt_0")




@pytest.mark.skipif(os.geteuid() != 0, reason="makes another user's directory: needs root")
def test_a_logs_specs_log_dir_below_another_users_directory_is_refused_at_each_call(tmp_path):
    """Whoever may rename entries of a directory on log_dir's way picks where the run directories
    go: a log_dir made with os.makedirs below their directory, or one they came to control after
    the spec was made (its run directory swapped for a link between two calls), sent root's
    ranks' logs wherever they pointed."""
    from ranktop.core import DefaultLogsSpecs

    theirs, target = tmp_path / "theirs", tmp_path / "etc"
    theirs.mkdir(mode=0o755)
    target.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ValueError) as refused:
        DefaultLogsSpecs(log_dir=str(theirs / "logs"))
    assert str(refused.value) == (f"bad log_dir {theirs / 'logs'}: it goes through {theirs}, which belongs to uid "
                                  f"{NOBODY}, not to you (uid 0): whoever controls it decides where the path leads; "
                                  "pick a directory of your own")
    assert os.listdir(theirs) == []
    mine = tmp_path / "mine"
    specs = DefaultLogsSpecs(log_dir=str(mine / "logs"), redirects=Std.OUT)
    assert mode_of(mine) == mode_of(mine / "logs") == 0o700  # made private all the way, as --log-dir
    ctx, result = _specs_run(tmp_path, specs, nprocs=1, code="print('first')")
    assert not result.is_failed()
    os.chown(mine, NOBODY, NOBODY)  # now theirs: they put a link where the log dir was
    os.rename(mine / "logs", mine / "old")
    (mine / "logs").symlink_to(target)
    os.lchown(mine / "logs", NOBODY, NOBODY)
    with pytest.raises(ValueError, match=f"^bad log_dir {mine / 'logs'}: it goes through {mine}, which belongs to uid "):
        start_processes("b", PY, {0: ("-c", "print('second')")}, {0: {}}, specs)
    assert os.listdir(target) == [] and len(os.listdir(mine / "old")) == 1



@pytest.mark.skipif(os.geteuid() != 0, reason="makes another user's directory: needs root")
def test_function_ranks_pass_nothing_through_another_users_tmpdir(tmp_path, monkeypatch):
    """A function's arguments and its return value travel as pickles in a directory made under
    $TMPDIR, which the rank and the caller open by path: with $TMPDIR another user's, they could
    swap that directory for theirs, and root unpickled what they put there (code of theirs run,
    in the rank and in the caller). The log_dir being one's own is not enough."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    (tmp_path / "logs").mkdir(mode=0o700)
    monkeypatch.setattr("tempfile.tempdir", str(theirs))  # what $TMPDIR=theirs makes it
    with pytest.raises(ValueError) as refused:
        start_processes("t", rank_fns.double, {0: (1,)}, _envs(1), str(tmp_path / "logs"))
    assert str(refused.value) == (f"bad $TMPDIR {theirs}: it goes through {theirs}, which belongs to uid {NOBODY}, "
                                  "not to you (uid 0): whoever controls it decides where the path leads; "
                                  "set TMPDIR to a directory of your own")
    assert os.listdir(theirs) == []
    assert os.listdir(tmp_path / "logs") == []


def test_a_run_id_too_long_for_a_file_name_or_a_nul_in_log_dir_is_one_line(tmp_path):
    """Each raised the OS's bare error (File name too long; embedded null byte), naming nothing."""
    from ranktop.core import DefaultLogsSpecs

    specs = DefaultLogsSpecs(log_dir=str(tmp_path))
    with pytest.raises(ValueError) as too_long:
        specs.reify({0: {"TORCHELASTIC_RUN_ID": "x" * 300}})
    assert str(too_long.value) == (f"bad log_dir {tmp_path}: cannot make a run directory there for run id "
                                   f"{'x' * 60!r} (File name too long)")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=r"^bad log_dir '/tmp/a␀b': embedded null byte$"):  # the NUL as its picture
        DefaultLogsSpecs(log_dir="/tmp/a\0b")


@pytest.mark.parametrize("stamp", ["\u0661\u0662\u0663", "\u00b2", "9" * 13, 10**30, 1e308, float("inf"), -1])
def test_a_hostile_timestamp_in_a_rank_error_file_is_named_not_raised(tmp_path, stamp):
    from ranktop.core import ChildFailedError

    text = json.dumps({"message": {"message": "ValueError: x", "extraInfo": {"timestamp": stamp}}})
    code = f"import os; open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w').write({text!r}); raise SystemExit(1)"
    result = _run(PY, {0: ("-c", code)}, tmp_path)
    failure = result.failures[0]
    assert failure.exitcode == 1 and not failure.error_file_read
    assert failure.message == (f"exited with code 1; error file {failure.error_file} has a \"timestamp\" "
                               "that is not a number of seconds up to the year 9999; ignored")
    assert abs(failure.timestamp - time.time()) < 60  # when the exit was seen
    assert "Root Cause" in str(ChildFailedError("trainer", result.failures))  # the table's time formats


def test_a_rank_killed_by_a_signal_without_a_name_has_torchs_signal_name(tmp_path):
    sig = signal.SIGRTMIN + 6  # real-time: no name in signal.Signals
    result = _run(PY, {0: ("-c", f"import os; os.kill(os.getpid(), {int(sig)})")}, tmp_path)
    failure = result.failures[0]
    assert failure.exitcode == -sig and failure.signal_name() == "<N/A>"
    assert failure.message == f"Signal {int(sig)} (<N/A>) received by PID {failure.pid}"


@pytest.mark.parametrize("death_sig", [None, signal.SIGINT])
def test_close_sends_sigterm_without_a_death_sig_as_torch(tmp_path, death_sig):
    got = tmp_path / "got"
    code = textwrap.dedent(f"""
        import os, signal, sys
        def note(sig, frame):
            with open({str(got)!r}, "w") as f:
                f.write(str(sig))
            sys.exit(0)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(s, note)
        open({str(tmp_path / "ready")!r}, "w").close()
        signal.pause()
    """)
    (tmp_path / "run").mkdir()
    ctx = start_processes("t", PY, {0: ("-c", code)}, _envs(1), str(tmp_path / "run"))
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), what="the rank's handlers")
    finally:
        ctx.close(death_sig, timeout=10)
    assert got.read_text() == str(int(death_sig or signal.SIGTERM))


def test_close_checks_death_sig_before_signalling_and_a_negative_timeout_kills_at_once(tmp_path):
    """close(death_sig=99) was os.killpg's bare `OSError: [Errno 22] Invalid argument`, and
    close(timeout=-1) was refused while the ranks ran on; torch's closes SIGKILL at once there."""
    ready = tmp_path / "ready"
    (tmp_path / "run").mkdir()
    ctx = start_processes("t", "/bin/sh", {0: ("-c", f'trap "" TERM; : > {ready}; exec sleep 30')}, _envs(1),
                          str(tmp_path / "run"))
    try:
        wait_for(ready.exists, what="the rank ignoring SIGTERM")
        for bad, error, message in ((99, ValueError, "bad death_sig 99: expected a signal of this system, 1 to "),
                                    (-1, ValueError, "bad death_sig -1: "),
                                    ("SIGTERM", TypeError, "death_sig must be a signal .*, not str 'SIGTERM'$")):
            with pytest.raises(error, match=f"^{message}"):
                ctx.close(death_sig=bad)
        assert _pid_alive(ctx.pids()[0])  # refused before anything was signalled
        started = time.monotonic()
    finally:
        ctx.close(timeout=-1)
    assert time.monotonic() - started < 10  # no grace (the default is 30 s) for a rank that ignores SIGTERM
    assert ctx.wait().failures[0].exitcode == -signal.SIGKILL


_UNGUARDED_SCRIPT = """
import os, sys
if sys.argv[1] == "torch":
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
else:
    from ranktop.core import DefaultLogsSpecs, start_processes

def train():
    return 1

with open(os.path.join(sys.argv[2], "runs"), "a") as f:
    f.write(__name__ + "\\n")
logs = os.path.join(sys.argv[2], "logs-" + __name__)
os.mkdir(logs)
# no `if __name__ == "__main__":` around the launch
ctx = start_processes("t", train, {0: ()}, {0: {}}, DefaultLogsSpecs(log_dir=logs), start_method="spawn")
result = ctx.wait(60, 0.05)
ctx.close()
print(__name__, {r: f.exitcode for r, f in result.failures.items()})
"""


def test_a_script_that_launches_without_a_main_guard_fails_its_rank_as_torchs_spawn(tmp_path):
    """The rank loads the caller's script to find its function; a launch there is refused, as
    multiprocessing's spawn refuses it. It ran the launch inside the rank (which failed) and then
    the function, so the script's top level ran once more per rank, launch and all. (torch 2.13's
    start_processes, run through this script in place of ranktop's, ends the same way, its rank's
    RuntimeError from multiprocessing: checked by hand, `python unguarded.py torch DIR`; a torch
    import per rank made it the suite's dearest parity check.)"""
    impl = "ranktop"
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_SCRIPT)
    done = subprocess.run([PY, str(script), impl, str(tmp_path)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "runs").read_text() == "__main__\n__mp_main__\n"  # the rank went no further
    assert done.stdout == "__main__ {0: 1}\n"  # the caller's line alone: rank 0 failed, exit 1
    assert "RuntimeError: " in done.stderr  # the rank's, on the console
    assert 'start ranks only under `if __name__ == "__main__":`' in done.stderr


_PACKAGE_MAIN = """
import sys
from . import helper  # resolves only in a module run with its package: python -m pkg.train

def train(x):
    return helper.BASE + x

if __name__ == "__main__":
    from ranktop.core import start_processes
    ctx = start_processes("t", train, {0: (1,)}, {0: {}}, sys.argv[1])
    result = ctx.wait(60)
    ctx.close()
    print(result.return_values, {r: f.exitcode for r, f in result.failures.items()})
"""


def test_a_function_of_a_script_run_as_python_m_finds_its_package_as_torchs_spawn(tmp_path):
    """A rank loads the caller's script by its module name where it was run as `python -m
    pkg.train`, as multiprocessing's spawn (torch's ranks) loads it: loaded by path, its relative
    import had no package, and the rank failed (ImportError) where torch's returned."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "helper.py").write_text("BASE = 41\n")
    (tmp_path / "pkg" / "train.py").write_text(_PACKAGE_MAIN)
    (tmp_path / "logs").mkdir()
    done = subprocess.run([PY, "-m", "pkg.train", str(tmp_path / "logs")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "{0: 42} {}\n", done.stderr[-2000:]


def _closed_then_waited(log_dir, fn, args, ready) -> list[tuple[dict, dict]]:
    """Start `fn` on len(args) function ranks, wait until `ready(ctx)`, close, then wait() twice:
    each wait's ({local rank: exit code} of its failures, its return values)."""
    ctx = start_processes("t", fn, args, _envs(len(args)), DefaultLogsSpecs(log_dir=str(log_dir)))
    try:
        wait_for(lambda: ready(ctx), timeout=30, what="the ranks to be where the test closes them")
    finally:
        ctx.close(timeout=5)
    return [({r: f.exitcode for r, f in result.failures.items()}, result.return_values)
            for result in (ctx.wait(5), ctx.wait(5))]


def _has_exited(pid: int) -> bool:
    """Whether our child `pid` has ended, without reaping it (the context reaps its own ranks)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


_TORCH_CLOSE_SCRIPT = """
import sys, tempfile
sys.path.insert(0, sys.argv[1])
import rank_fns
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

if __name__ == "__main__":
    ctx = start_processes("t", rank_fns.return_only_rank, {r: (0,) for r in range(3)},
                          {r: {"LOCAL_RANK": str(r)} for r in range(3)},
                          DefaultLogsSpecs(log_dir=tempfile.mkdtemp(dir=sys.argv[2])), start_method="fork")
    # A SIGTERM that reaches a rank inside its fork's logging hook is swallowed there ("Exception
    # ignored"), and the rank sleeps on until the close's SIGKILL: 30 s by default, in 1 run of 14.
    ctx.close(timeout=2)
    print([sorted(ctx.wait(5).failures) for _ in range(2)])
"""


def test_wait_after_close_lists_the_ranks_close_cut_short(tmp_path):
    """wait() after close(): every rank close() ended, with its signal (torch's lists one, a
    different one on each wait); a rank that had returned is not one of them (torch's, waiting for
    its launcher, is listed), and a rank that failed on its own before the close is the only one
    (it was listed beside the ranks the close then stopped: not reaped yet, it counted as stopped)."""
    returned = _closed_then_waited(tmp_path / "returned", rank_fns.return_only_rank, {r: (0,) for r in range(3)},
                                   lambda ctx: os.path.exists(ctx._result_path(0)))
    assert returned == [({1: -signal.SIGTERM, 2: -signal.SIGTERM}, {})] * 2
    failed = _closed_then_waited(tmp_path / "failed", rank_fns.fail_rank, {r: (1, "boom") for r in range(3)},
                                 lambda ctx: _has_exited(ctx.pids()[1]))
    assert failed == [({1: 1}, {})] * 2
    finished = _closed_then_waited(tmp_path / "finished", rank_fns.double, {r: (r,) for r in range(2)},
                                   lambda ctx: all(_has_exited(pid) for pid in ctx.pids().values()))
    assert finished == [({}, {0: 0, 1: 2})] * 2
    if has_torch_elastic():  # torch's: one rank of the three, whichever its join looked at first
        # TMPDIR: torch's spawn leaves a pytorch-errorfile-*.pickle per rank it stopped (never removed)
        done = subprocess.run([PY, "-c", _TORCH_CLOSE_SCRIPT, os.path.dirname(__file__), str(tmp_path)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
        assert done.returncode == 0, done.stderr[-2000:]
        assert [len(listed) for listed in json.loads(done.stdout.splitlines()[-1])] == [1, 1], done.stdout


def test_a_close_from_another_thread_while_wait_collects_leaves_wait_its_values(tmp_path):
    """A watchdog thread's close() while wait() collects the result (it reads the ranks' last
    output and their return values without the context's lock): close() let go of the output
    pump and removed the return values' directory under it, and wait() raised OSError EBADF (or
    gave None for a value). torch's wait() then returns its result. Here wait()'s collection is
    held until the close() is over, or for 1 s: the close must wait for it."""
    ctx = start_processes("trainer", rank_fns.double, {0: (1,), 1: (2,)}, _envs(2), str(tmp_path))
    collecting, closed = threading.Event(), threading.Event()
    collect = ctx._collect

    def held_collect():
        if threading.current_thread() is threading.main_thread():
            collecting.set()
            closed.wait(1.0)
        return collect()

    ctx._collect = held_collect
    watchdog = threading.Thread(target=lambda: (collecting.wait(30), ctx.close(), closed.set()))
    watchdog.start()
    try:
        result = ctx.wait(timeout=60)
    finally:
        watchdog.join(30)
        ctx.close()
    assert collecting.is_set() and closed.is_set()
    assert result.return_values == {0: 2, 1: 4} and not result.failures


_STDIN_SCRIPT = """
import os, sys, tempfile
sys.path.insert(0, sys.argv[2])
import rank_fns

if __name__ == "__main__":
    if sys.argv[1] == "torch":
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    else:
        from ranktop.core import DefaultLogsSpecs, start_processes
    read = "import sys; print(repr(sys.stdin.readline()))"
    ctx = start_processes("b", sys.executable, {0: ("-c", read)}, {0: {}}, DefaultLogsSpecs(log_dir=tempfile.mkdtemp()))
    ctx.wait(60, 0.05)
    ctx.close()
    ctx = start_processes("f", rank_fns.read_stdin_line, {0: ()}, {0: {}}, DefaultLogsSpecs(log_dir=tempfile.mkdtemp()),
                          start_method="fork")
    print(repr(ctx.wait(60, 0.05).return_values[0]), flush=True)
    ctx.close()
"""


def test_a_binary_rank_reads_the_callers_stdin_and_a_function_rank_dev_null_as_torchs(tmp_path):
    """torch's binary ranks inherit the caller's stdin (a `breakpoint()` there reads its terminal);
    its function ranks read /dev/null, as multiprocessing's children. ranktop's binary ranks read
    /dev/null. A caller whose stdin is closed gives them /dev/null: its descriptor 0 may be
    another of its files by then."""
    script = tmp_path / "stdin.py"
    script.write_text(_STDIN_SCRIPT)
    (tmp_path / "typed").write_text("typed line\n")
    impls = ["ranktop"] + (["torch"] if has_torch_elastic() else [])
    shown = {}
    for impl, stdin in [(impl, "typed") for impl in impls] + [("ranktop", None)]:
        with open(tmp_path / "typed") if stdin else open(os.devnull) as given:
            done = subprocess.run([PY, str(script), impl, os.path.dirname(__file__)], stdin=given if stdin else None,
                                  capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
                                  cwd=tmp_path, **({} if stdin else {"preexec_fn": lambda: os.close(0)}))
        assert done.returncode == 0, done.stderr[-2000:]
        shown[impl, stdin] = done.stdout.splitlines()[-2:]
    assert shown["ranktop", "typed"] == ["'typed line\\n'", "''"]
    assert shown.get(("torch", "typed"), shown["ranktop", "typed"]) == shown["ranktop", "typed"]
    assert shown["ranktop", None] == ["''", "''"]
