"""`ranktop web [RUN]`: a run's TUI in browsers, for demos. textual-serve runs one `ranktop attach`
per browser tab, each a client of the same engine; without `--control` those clients are
read-only (keys that act on ranks say so and do nothing)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shlex
import signal
import socket
import sys
import time

from ranktop.core.strays import children_of_self
from ranktop.tui.runs_cli import pick_run, run_parser
from ranktop.tui.usage import BadValue, usage_error

LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise BadValue(f"bad --port {text!r}: a TCP port number, 1..65535")
    return port


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str]) -> int:
    p = run_parser("ranktop web", "A run's TUI in browsers (textual-serve): one attach client per tab.")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=port_number, default=8000, help="the TCP port (default 8000)")
    p.add_argument("--control", action="store_true",
                   help="let the browsers act on ranks (signal, kill, restart, stop); read-only without it")
    ns = p.parse_args(argv)
    problem = _cannot_listen(ns.host, ns.port)
    if problem is not None:
        return usage_error(problem)
    run = pick_run(ns.run)
    if isinstance(run, int):
        return run
    if not is_loopback(ns.host):
        print(f"ranktop: warning: serving on {ns.host}: anyone who can reach it can watch this run"
              + (" and act on its ranks (--control)" if ns.control else ""), file=sys.stderr, flush=True)
    # The run directory, not the id: a tab opened after the engine has gone shows the final view.
    target = run.snapshot.get("log_dir") or run.run_id
    command = shlex.join([sys.executable, "-m", "ranktop", "attach", target, *([] if ns.control else ["--read-only"])])
    try:
        from textual_serve.server import Server
    except ImportError:
        print("ranktop: error: ranktop web needs textual-serve: pip install 'ranktop[web]'", file=sys.stderr)
        return 1
    print(f"ranktop: serving run {run.run_id} on http://{_url_host(ns.host)}:{ns.port} "
          f"({'control' if ns.control else 'read-only'}; Ctrl-C stops serving, the run goes on)",
          file=sys.stderr, flush=True)
    try:
        _tab_aware(Server)(command, host=ns.host, port=ns.port, title=f"ranktop {run.run_id}").serve()
    finally:
        end_children(CHILD_GRACE)
    return 0


CHILD_GRACE = 5.0  # seconds an attach client has to leave after its hang-up, before SIGKILL


def _tab_aware(server: type) -> type:
    """textual-serve's Server, which also lets go of open tabs when it stops: aiohttp waits for
    every running handler on shutdown (up to 60 s), and a tab's websocket handler runs until the
    browser leaves."""

    class WebServer(server):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 (Server's own)
            super().__init__(*args, **kwargs)
            self.tabs: set[asyncio.Task] = set()

        async def handle_websocket(self, request):  # noqa: ANN001, ANN201 (aiohttp's)
            tab = asyncio.current_task()
            self.tabs.add(tab)
            try:
                return await super().handle_websocket(request)
            finally:
                self.tabs.discard(tab)

        async def on_shutdown(self, app) -> None:  # noqa: ANN001
            for pid in children_of_self():  # the clients leave first, so each tab's handler ends at once
                _signal(pid, signal.SIGHUP)
            for tab in self.tabs:
                tab.cancel()

    return WebServer


def end_children(grace: float) -> None:
    """Attach clients textual-serve left running: a hang-up, SIGKILL after `grace`, reaped."""
    pids = sorted(children_of_self())
    for pid in pids:
        _signal(pid, signal.SIGHUP)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if not _reaped(pid)]
        time.sleep(0.05)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
        _reaped(pid, wait=True)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reaped(pid: int, wait: bool = False) -> bool:
    try:
        return os.waitpid(pid, 0 if wait else os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def _cannot_listen(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on, in one line, before anything is served."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        return f"bad --host {host!r}: {getattr(exc, 'strerror', None) or exc}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
