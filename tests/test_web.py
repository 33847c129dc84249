"""`ranktop web`: the attach client served to browsers by textual-serve, seen in a real headless
chromium; read-only unless --control; bad flags are one line; other sites' pages, other names
for this host and requests without the launch's token are refused before any client starts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import CHROMIUM, page_open, screenshot
from conftest import ROOT, marked_processes, ranktop_cmd, run_ranktop, wait_for
from ranktop.core import commands as cmd
from ranktop.core.spec import free_port
from test_serve import ls, runtime, start_headless  # noqa: F401 (the runtime fixture)

FIRST_BYTE = "document.body.classList.contains('-first-byte')"  # textual-serve: the app has drawn


ADDRESS = re.compile(r"ranktop: serving run \S+ on http://\S+/\?token=([\w-]+) ")


def start_web(env, err: Path, *args: str) -> subprocess.Popen:
    """`ranktop web`, its stdout and stderr in the file `err` (read while it runs: the address it prints)."""
    with open(err, "w") as f:
        return subprocess.Popen(ranktop_cmd("web", *args), cwd=ROOT, env=env, stdout=f, stderr=f,
                                start_new_session=True)


def stop_web(web: subprocess.Popen, err: Path) -> str:
    web.send_signal(signal.SIGINT)  # textual-serve's own way out: it closes every tab's app
    web.wait(timeout=30)
    return err.read_text()


@contextlib.contextmanager
def serving(tmp_path, env, run_id: str, *web_args: str) -> Iterator[tuple[subprocess.Popen, int, str]]:
    """A headless 2-rank run and `ranktop web` on a free port, its page answering: the server,
    its port and the token in the address it printed (its stderr is tmp_path/web.err); both
    stopped on the way out, whatever the test did."""
    proc = start_headless(tmp_path, env, run_id)
    web = None
    try:
        wait_for(lambda: ls(env), what="the run listed")
        port = free_port("127.0.0.1")
        web = start_web(env, tmp_path / "web.err", "--port", str(port), *web_args)
        printed = wait_for(lambda: ADDRESS.search((tmp_path / "web.err").read_text()), what="the address", timeout=20)
        token = printed.group(1)
        wait_for(lambda: "textual" in page(port, token).lower(), what="the page served", timeout=20)
        yield web, port, token
    finally:
        if web is not None and web.poll() is None:
            web.kill()
            web.wait()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def page(port: int, token: str) -> str:
    """The web view's page ("" while nothing listens yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/?token={token}", timeout=5) as answer:
            return answer.read().decode()
    except OSError:
        return ""


def attach_clients() -> list[str]:
    """The attach clients textual-serve started (and the shells it starts them with)."""
    return [line for line in marked_processes().values() if "ranktop attach" in line]


@pytest.mark.parametrize(("args", "message"), [
    (("--port", "0"), "ranktop: error: bad --port '0': a TCP port number, 1..65535"),
    (("--port", "http"), "ranktop: error: bad --port 'http': a TCP port number, 1..65535"),
    (("--max-tabs", "65"), "ranktop: error: bad --max-tabs '65': a number of tabs, 1..64 (the clients a run serves)"),
    (("--host", "no such host.invalid"), "ranktop: error: bad --host 'no such host.invalid': "),
    (("nope",), "ranktop: error: 'nope' names no run: none is served on this host; "),  # then the runs that ended
])
def test_bad_web_arguments_are_one_line(runtime, args, message):  # noqa: F811
    done = run_ranktop("web", "--port", str(free_port("127.0.0.1")), *args, env=runtime)
    assert done.returncode == 2 and done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr


def test_without_textual_serve_it_is_one_line_and_nothing_is_looked_up(runtime):  # noqa: F811
    """It said `ranktop: error:`, as a usage error does, yet exited 1, after looking the run up."""
    done = run_ranktop("web", "nope", without="textual_serve", env=runtime)
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr == ("ranktop: error: ranktop web needs textual-serve, which is not installed: "
                           "pip install 'ranktop[web]'\n")


def test_a_tabs_client_output_is_kept_to_its_tail_and_its_last_line_shown_clean():
    """A tab's client's stderr: textual-serve kept all of it in memory (a client writing without end
    grew ranktop web without end); now its last bytes only, its last line the reason shown."""
    from ranktop.tui.web import StderrTail

    tail = StderrTail(64)
    for _ in range(1000):
        tail.add(b"x" * 1000 + b"\n")
    tail.add(b"ValueError: \x1b[2J\x1b[31mboom" + b"!" * 500 + b"\n\n")
    assert len(tail.data) == 64 and tail.reason() == "!" * 62
    tail.add(b"ValueError: \x1b[2J\x1b[31mboom\n")
    assert tail.reason() == "ValueError: boom" and StderrTail().reason() == ""


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
    with serving(tmp_path, runtime, "wide", "--host", "0.0.0.0") as (web, _port, _token):
        err = stop_web(web, tmp_path / "web.err")
    assert "ranktop: warning: serving on 0.0.0.0: anyone who can reach it can watch this run" in err
    assert "read-only" in err


def test_an_ended_runs_directory_is_served_as_its_final_view(tmp_path, runtime):  # noqa: F811
    """It raised AttributeError (a served run's facts read off the final view). A tab closed just
    before Ctrl-C: its client, still on its way out, left once the server's loop had closed, and
    ranktop web ended in a traceback (`Event loop is closed`); it is waited for now."""
    done = run_ranktop("--headless", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"), "--run-id", "over",
                       "--no-python", "true", env=runtime)
    assert done.returncode == 0, done.stderr
    port = free_port("127.0.0.1")
    web = start_web(runtime, tmp_path / "web.err", str(tmp_path / "logs" / "over"), "--port", str(port))
    try:
        printed = wait_for(lambda: ADDRESS.search((tmp_path / "web.err").read_text()), what="the address", timeout=20)
        wait_for(lambda: "textual" in page(port, printed.group(1)).lower(), what="the page served", timeout=20)
        tab = f"http://127.0.0.1:{port}/ws/{printed.group(1)}"
        # what a page may send besides keys: each was a traceback that ended the tab, or taken at any size;
        # empty keys broke the client's input: it took no more keys, nor the quit once the tab closed
        drawn = asyncio.run(_drawn_until_help(f"{tab}?width=100000&height=x", [
            "not json", "{}", "[]", "[5]", '["stdin", 5]', '["stdin", ""]', '["stdin", "\\ud800"]', "[" * 100_000 + "]" * 100_000,
            '["resize", {"width": "x", "height": 3}]', '["resize", {"width": -5, "height": 0}]',
            '["resize", [80, 24]]', '["resize", {"width": 100, "height": 30}]'], resize=(5000, 2000), rows=500))
        assert drawn[0] == 500 and drawn[1] <= 1000  # 1000x500 at most: 10000x10000 cost its client 840 MB and each frame 100 MB
        wait_for(lambda: not attach_clients(), what="the closed tab's client gone", timeout=10)
        # a moved run directory: the tab's client cannot start; its tab is ended (it stayed on the splash
        # for ever, its socket open) and the console says why once (textual-serve wrote it twice)
        (tmp_path / "logs" / "over").rename(tmp_path / "logs" / "moved")
        try:
            assert asyncio.run(_ended_undrawn(tab)) == "CLOSE"
        finally:
            (tmp_path / "logs" / "moved").rename(tmp_path / "logs" / "over")
        assert asyncio.run(_handshake(tab, {})) == 101  # then closed, just before the Ctrl-C
    finally:
        err = stop_web(web, tmp_path / "web.err")
    assert "ranktop: serving run over on http://127.0.0.1:" in err and "(its final view; Ctrl-C stops serving)" in err
    failed = [line for line in err.splitlines() if "names no run" in line]
    assert len(failed) == 1 and failed[0].startswith("ranktop web: a tab's client failed (exit 2), its tab closed: "
                                                     "ranktop: error: "), err
    assert "Application failed to start" not in err, err
    assert "Traceback" not in err and "asyncio" not in err and web.returncode == 0, err
    assert attach_clients() == []

    # Ctrl-C under a tab that answers nothing (a frozen browser, a laptop asleep), and Ctrl-C again as
    # it stops: aiohttp waited 10 s for the tab to answer its close, and the second was a traceback, exit 1
    web = start_web(runtime, tmp_path / "web.err", str(tmp_path / "logs" / "over"), "--port", str(port))
    try:
        took = asyncio.run(_stopped_under_a_silent_tab(_tab_address(tmp_path, port), web))
    finally:
        err = stop_web(web, tmp_path / "web.err")
    assert took < 4 and web.returncode == 0 and "Traceback" not in err, (took, err)

    # ranktop web SIGKILLed under an open tab: its client leaves too (it ran on, orphaned, for good)
    web = start_web(runtime, tmp_path / "web.err", str(tmp_path / "logs" / "over"), "--port", str(port))
    try:
        asyncio.run(_killed_under_a_tab(_tab_address(tmp_path, port), web))
    finally:
        web.kill()
        web.wait()
    wait_for(lambda: attach_clients() == [], what="the tab's client gone with its server", timeout=10)


def _tab_address(tmp_path: Path, port: int) -> str:
    """The websocket address of a `ranktop web` just started on `port`, once its page answers."""
    printed = wait_for(lambda: ADDRESS.search((tmp_path / "web.err").read_text()), what="the address", timeout=20)
    wait_for(lambda: "textual" in page(port, printed.group(1)).lower(), what="the page served", timeout=20)
    return f"http://127.0.0.1:{port}/ws/{printed.group(1)}"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_the_web_view_shows_the_ranks_in_a_real_browser(tmp_path, runtime):  # noqa: F811
    with serving(tmp_path, runtime, "demo") as (web, port, token):
        watchers = []
        png = tmp_path / "web.png"
        ready = screenshot(f"http://127.0.0.1:{port}/?token={token}", str(png), FIRST_BYTE,
                           while_open=lambda: watchers.append(ls(runtime)[0]["clients"]))
        assert ready, "the page never got the app's first frame"
        assert watchers and watchers[0] >= 1  # the tab's attach client was connected to the engine
        assert png.stat().st_size > 15_000  # drawn panes, not textual-serve's splash (about 13 kB)
        with page_open(f"http://127.0.0.1:{port}/?token={token}"):  # a tab left open does not hold up the stop
            wait_for(lambda: ls(runtime)[0]["clients"] >= 1, what="the open tab's client", timeout=20)
            web.send_signal(signal.SIGINT)
            web.wait(timeout=15)  # (aiohttp alone waits for open tabs: 20 s and more)
        err = (tmp_path / "web.err").read_text()
        assert f"serving run demo on http://127.0.0.1:{port}/?token={token} (read-only;" in err
        wait_for(lambda: ls(runtime)[0]["clients"] == 0, what="the tab's client gone with the server")
        assert ls(runtime)[0]["state"] == "running"  # watching changed nothing


async def _handshake(url: str, headers: dict[str, str]) -> int:
    """The status a websocket handshake to `url` got (101: upgraded, and the tab's first bytes came)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        try:
            async with session.ws_connect(url, headers=headers) as ws:
                deadline = time.monotonic() + 20
                while (await ws.receive(timeout=deadline - time.monotonic())).type != aiohttp.WSMsgType.BINARY:
                    pass  # textual-serve's own messages, until the app's output
                assert attach_clients(), "a tab drawn without an attach client"
                return 101
        except aiohttp.WSServerHandshakeError as refused:
            return refused.status


async def _ended_undrawn(url: str) -> str:
    """A tab whose client never draws: how its websocket ended, the name of its last message, or
    "open" if it had not ended after 20 s."""
    import aiohttp

    async def ended(ws: aiohttp.ClientWebSocketResponse) -> str:
        while (message := await ws.receive()).type == aiohttp.WSMsgType.TEXT:
            pass  # textual-serve's own messages
        return message.type.name

    async with aiohttp.ClientSession() as session:
        ws = await session.ws_connect(url)
        try:
            return await asyncio.wait_for(ended(ws), 20)
        except asyncio.TimeoutError:
            return "open"
        finally:
            ws._response.close()  # (dropped: a close waits for the other end's answer)


async def _drawn_until_help(url: str, said: list[str], resize: tuple[int, int], rows: int) -> tuple[int, int]:
    """A tab that sends `said` once its app has drawn, then `?`, and once the help shows, a resize
    to `resize`: the furthest row and column its frames draw at (their cursor moves) once they
    reach row `rows`; an assertion error if the tab is closed first. (A resize sent as the app
    starts may be lost in Textual: the page's address carries its first size. At 1x1 the help
    shows nothing of itself: `said` must leave a size it can be seen at.)"""
    import aiohttp

    furthest = (0, 0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.ws_connect(url, max_msg_size=0) as ws:
            while (await ws.receive(timeout=20)).type != aiohttp.WSMsgType.BINARY:
                pass
            for text in [*said, json.dumps(["stdin", "?"])]:
                await ws.send_str(text)
            helped, tail = False, b""
            deadline = time.monotonic() + 30
            while furthest[0] < rows:
                assert time.monotonic() < deadline, (helped, furthest)
                message = await asyncio.wait_for(ws.receive(), max(0.1, deadline - time.monotonic()))
                assert message.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT), message
                if message.type != aiohttp.WSMsgType.BINARY:
                    continue
                for y, x in re.findall(rb"\x1b\[(\d+);(\d+)H", message.data):
                    furthest = (max(furthest[0], int(y)), max(furthest[1], int(x)))
                if not helped and b"ranktop keys" in tail + message.data:  # (a frame may come in several messages)
                    helped = True
                    await ws.send_str(json.dumps(["resize", {"width": resize[0], "height": resize[1]}]))
                tail = message.data[-20:]
    return furthest


async def _past_the_tabs_held(url: str, held: int) -> tuple[int, int]:
    """`held` tabs opened and drawn, then one more: its handshake's status, and how many attach
    clients ran meanwhile."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        tabs = []
        deadline = time.monotonic() + 20
        while len(tabs) < held:
            try:
                tabs.append(await session.ws_connect(url))
            except aiohttp.WSServerHandshakeError:  # a closed tab's handler, not quite done
                assert time.monotonic() < deadline, "the tabs held were refused"
                await asyncio.sleep(0.1)
        for tab in tabs:
            while (await tab.receive(timeout=20)).type != aiohttp.WSMsgType.BINARY:
                pass
        try:
            async with session.ws_connect(url):
                status = 101
        except aiohttp.WSServerHandshakeError as refused:
            status = refused.status
        clients = len([line for line in attach_clients() if line.split()[0].endswith("python")])
        for tab in tabs:
            await tab.close()
        return status, clients


async def _stopped_under_a_silent_tab(url: str, server: subprocess.Popen) -> float:
    """A tab drawn that then takes nothing (nor answers a close); `server` sent SIGINT and, once the
    tab's client has gone, SIGINT again: the seconds until it has exited."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.ws_connect(url) as tab:
            while (await tab.receive(timeout=20)).type != aiohttp.WSMsgType.BINARY:
                pass
            start = time.monotonic()
            server.send_signal(signal.SIGINT)
            wait_for(lambda: not attach_clients(), what="the silent tab's client gone", timeout=10)
            server.send_signal(signal.SIGINT)  # (none once it has exited)
            server.wait(timeout=30)
            return time.monotonic() - start


async def _killed_under_a_tab(url: str, server: subprocess.Popen) -> None:
    """A tab drawn, then `server` SIGKILLed while it is open."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.ws_connect(url) as tab:
            while (await tab.receive(timeout=20)).type != aiohttp.WSMsgType.BINARY:
                pass
            assert attach_clients()
            server.kill()
            server.wait()


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(url, headers=headers or {}) as answer:
            return answer.status, await answer.text()


def test_other_sites_other_names_and_no_token_are_refused_before_a_client_starts(tmp_path, runtime):  # noqa: F811
    with serving(tmp_path, runtime, "guard", "--control", "--max-tabs", "2") as (web, port, token):
        here = f"127.0.0.1:{port}"
        tab, own = f"http://{here}/ws/{token}", {"Origin": f"http://{here}"}
        rebound = {"Host": f"attacker.example:{port}"}  # DNS rebinding: the attacker's name, this address
        refused = {
            "another site's page": (tab, {"Origin": "http://evil.example"}),
            "a page of this host's on another port": (tab, {"Origin": "http://127.0.0.1:1"}),
            "a sandboxed page": (tab, {"Origin": "null"}),
            "a rebound page": (tab, {**rebound, "Origin": f"http://attacker.example:{port}"}),
            "a rebound name, no Origin": (tab, rebound),
            "textual-serve's own /ws": (f"http://{here}/ws", own),
            "a wrong token": (f"http://{here}/ws/{token[::-1]}", own),
        }
        for why, (url, headers) in refused.items():
            assert asyncio.run(_handshake(url, headers)) == 403, why
        assert attach_clients() == [] and ls(runtime)[0]["clients"] == 0

        assert asyncio.run(_get(f"http://{here}/?token={token}", rebound))[0] == 403  # a rebound page never loads
        status, text = asyncio.run(_get(f"http://{here}/"))
        assert status == 403 and "open the address ranktop web printed" in text
        for name in (here, f"localhost:{port}"):  # the page's websocket goes where the page came from
            status, text = asyncio.run(_get(f"http://{here}/?token={token}", {"Host": name}))
            assert status == 200 and f'data-session-websocket-url="ws://{name}/ws/{token}"' in text
        assert attach_clients() == []

        # the page's own websocket draws the app; so does a program's (no Origin: not a browser)
        assert asyncio.run(_handshake(f"{tab}?width=100&height=30", own)) == 101
        assert asyncio.run(_handshake(f"{tab}?width=100&height=30", {"Origin": f"http://localhost:{port}",
                                                                     "Host": f"localhost:{port}"})) == 101
        assert asyncio.run(_handshake(tab, {})) == 101
        wait_for(lambda: not attach_clients(), what="the closed tabs' clients gone", timeout=20)
        # --max-tabs 2: a third tab open at once is refused before its client starts (each started one)
        assert asyncio.run(_past_the_tabs_held(tab, 2)) == (503, 2)
        wait_for(lambda: not attach_clients(), what="the held tabs' clients gone", timeout=20)
        err = stop_web(web, tmp_path / "web.err")
    # Only the address names the token: textual-serve logged each request, address and all.
    assert err.count(token) == 1 and "GET /" not in err, err
    # nor does a closed tab's client say anything there (textual-serve wrote its stderr, `ranktop: left guard;
    # it runs on...`, every crash's traceback, on ranktop web's stdout, and held all of it in memory)
    assert "ranktop: left" not in err and "Traceback" not in err, err
