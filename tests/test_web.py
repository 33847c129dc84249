"""`ranktop web`: the attach client served to browsers by textual-serve, seen in a real headless
chromium; read-only unless --control; bad flags are one line."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest
from browser import CHROMIUM, page_open, screenshot
from conftest import ROOT, ranktop_cmd, run_ranktop, wait_for
from ranktop.core import commands as cmd
from ranktop.core.spec import free_port
from test_serve import ls, runtime, start_headless  # noqa: F401 (the runtime fixture)

FIRST_BYTE = "document.body.classList.contains('-first-byte')"  # textual-serve: the app has drawn


def start_web(env, *args: str) -> subprocess.Popen:
    return subprocess.Popen(ranktop_cmd("web", *args), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def stop_web(web: subprocess.Popen) -> str:
    web.send_signal(signal.SIGINT)  # textual-serve's own way out: it closes every tab's app
    _, err = web.communicate(timeout=30)
    return err


@contextlib.contextmanager
def serving(tmp_path, env, run_id: str, *web_args: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """A headless 2-rank run and `ranktop web` on a free port, its page answering; both stopped
    on the way out, whatever the test did."""
    proc = start_headless(tmp_path, env, run_id)
    web = None
    try:
        wait_for(lambda: ls(env), what="the run listed")
        port = free_port("127.0.0.1")
        web = start_web(env, "--port", str(port), *web_args)
        wait_for(lambda: "textual" in page(port).lower(), what="the page served", timeout=20)
        yield web, port
    finally:
        if web is not None and web.poll() is None:
            web.kill()
            web.wait()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def page(port: int) -> str:
    """The web view's page ("" while nothing listens yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as answer:
            return answer.read().decode()
    except OSError:
        return ""


@pytest.mark.parametrize(("args", "message"), [
    (("--port", "0"), "ranktop: error: bad --port '0': a TCP port number, 1..65535"),
    (("--port", "http"), "ranktop: error: bad --port 'http': a TCP port number, 1..65535"),
    (("--host", "no such host.invalid"), "ranktop: error: bad --host 'no such host.invalid': "),
    (("nope",), "ranktop: error: 'nope' names no run served on this host: runs are none"),
])
def test_bad_web_arguments_are_one_line(runtime, args, message):  # noqa: F811
    done = run_ranktop("web", "--port", str(free_port("127.0.0.1")), *args, env=runtime)
    assert done.returncode == 2 and done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr


def test_a_port_in_use_is_one_line(runtime):  # noqa: F811
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = run_ranktop("web", "--port", str(taken.getsockname()[1]), env=runtime)
    assert done.returncode == 2 and "cannot listen on 127.0.0.1:" in done.stderr and "in use" in done.stderr


def test_read_only_clients_refuse_what_acts_and_still_dump_stacks(tmp_path, runtime, monkeypatch):  # noqa: F811
    from ranktop.core.client import RemoteEngine, served_runs

    proc = start_headless(tmp_path, runtime, "ro")
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime["XDG_RUNTIME_DIR"])
    try:
        wait_for(lambda: [r for r in ls(runtime) if r["state"] == "running"], what="the run listed")
        (run,) = served_runs()
        viewer = RemoteEngine(run.path, read_only=True)
        try:
            for command in (cmd.KillRank(0), cmd.Stop(), cmd.SendInput(0, "c\n"), cmd.SignalDump()):
                ack = viewer.submit(command)
                assert not ack.ok and ack.message.startswith("read-only view: nothing was done")
            assert viewer.submit(cmd.DumpStacks()).report is not None  # py-spy only reads
            # untouched: both ranks go on (a rank counts as starting until it has printed)
            wait_for(lambda: [r.state.value for r in viewer.snapshot().ranks] == ["running", "running"],
                     what="both ranks running")
            assert all(r.restarts == 0 for r in viewer.snapshot().ranks)
        finally:
            viewer.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_non_loopback_host_warns_that_anyone_can_watch(runtime, tmp_path):  # noqa: F811
    with serving(tmp_path, runtime, "wide", "--host", "0.0.0.0") as (web, _port):
        err = stop_web(web)
    assert "ranktop: warning: serving on 0.0.0.0: anyone who can reach it can watch this run" in err
    assert "read-only" in err


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_the_web_view_shows_the_ranks_in_a_real_browser(tmp_path, runtime):  # noqa: F811
    with serving(tmp_path, runtime, "demo") as (web, port):
        watchers = []
        png = tmp_path / "web.png"
        ready = screenshot(f"http://127.0.0.1:{port}/", str(png), FIRST_BYTE,
                           while_open=lambda: watchers.append(ls(runtime)[0]["clients"]))
        assert ready, "the page never got the app's first frame"
        assert watchers and watchers[0] >= 1  # the tab's attach client was connected to the engine
        assert png.stat().st_size > 15_000  # drawn panes, not textual-serve's splash (about 13 kB)
        with page_open(f"http://127.0.0.1:{port}/"):  # a tab left open does not hold up the stop
            wait_for(lambda: ls(runtime)[0]["clients"] >= 1, what="the open tab's client", timeout=20)
            web.send_signal(signal.SIGINT)
            _, err = web.communicate(timeout=15)  # (aiohttp alone waits for open tabs: 20 s and more)
        assert "serving run demo on http://127.0.0.1:" in err
        wait_for(lambda: ls(runtime)[0]["clients"] == 0, what="the tab's client gone with the server")
        assert ls(runtime)[0]["state"] == "running"  # watching changed nothing
