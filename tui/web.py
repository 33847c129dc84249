"""`ranktop web [RUN]`: a run's TUI in browsers, for demos. textual-serve runs one `ranktop attach`
per browser tab, each a client of the same engine; without `--control` those clients are
read-only (keys that act on ranks say so and do nothing).

textual-serve checks nobody: any page a browser shows could open its websocket (cross-site
websocket hijacking) or reach the server under its own name (DNS rebinding), and watch the run,
or act on it with --control. So every request is refused (403) before it is handled unless its
Host names this server, a websocket's Origin (where sent) is the page's own, and the page and the
websocket carry this launch's token (see Gate)."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ranktop.core.client import FinalEngine, ServedRun
from ranktop.core.sanitize import clean, quoted
from ranktop.core.server import MAX_CLIENTS
from ranktop.core.signals import deaf_to
from ranktop.core.stdio import print_err
from ranktop.core.strays import children_of_self
from ranktop.tui.detach import WEB_SERVER
from ranktop.tui.runs_cli import pick_run, run_parser
from ranktop.tui.usage import BadValue, UsageParser, usage_error

if TYPE_CHECKING:  # (aiohttp comes with textual-serve, which ranktop web imports only when it serves)
    from aiohttp import web

LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise BadValue(f"bad --port {quoted(text)}: a TCP port number, 1..65535")
    return port


def tab_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_CLIENTS:
        raise BadValue(f"bad --max-tabs {quoted(text)}: a number of tabs, 1..{MAX_CLIENTS} (the clients a run serves)")
    return count


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str]) -> int:
    """`ranktop web [RUN]`: serve the run's TUI to browsers until Ctrl-C; the exit status."""
    ns = _web_parser().parse_args(argv)
    if not _has_textual_serve():  # (as a missing etcd client is: one line, exit 2, before any run is looked up)
        return usage_error("ranktop web needs textual-serve, which is not installed: pip install 'ranktop[web]'")
    problem = _cannot_listen(ns.host, ns.port)
    if problem is not None:
        return usage_error(problem)
    run = pick_run(ns.run, "web")
    if isinstance(run, int):
        return run
    run_id, target, how = _what_to_serve(run, ns.control)
    if not is_loopback(ns.host):
        print(f"ranktop: warning: serving on {ns.host}: anyone who can reach it can watch this run"
              + (" and act on its ranks (--control)" if ns.control else ""), file=sys.stderr, flush=True)
    # textual-serve runs each tab's command through `sh -c`: exec'd, the attach client is the very
    # process it started, whose exit and hang-up it sees (sh took the hang-up and left the client,
    # which went only once ranktop web had gone and its stdin closed)
    attach = [sys.executable, "-m", "ranktop", "attach", target, *([] if ns.control else ["--read-only"])]
    return _serve(f"exec {shlex.join(attach)}", ns.host, ns.port, run_id, how, ns.max_tabs)


def _has_textual_serve() -> bool:
    try:
        import textual_serve.server  # noqa: F401
    except ImportError:
        return False
    return True


def _web_parser() -> UsageParser:
    p = run_parser("ranktop web", "A run's TUI in browsers (textual-serve): one attach client per tab.")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=port_number, default=8000, help="the TCP port (default 8000)")
    p.add_argument("--control", action="store_true",
                   help="let the browsers act on ranks (signal, kill, restart, stop); read-only without it")
    p.add_argument("--max-tabs", type=tab_count, default=MAX_TABS, metavar="N",
                   help=f"the most tabs open at once, each an attach client of the run (default {MAX_TABS})")
    return p


def _what_to_serve(run: ServedRun | FinalEngine, control: bool) -> tuple[str, str, str]:
    """(the run's id, fit to show; what each tab attaches to; how it is served, in words)."""
    if isinstance(run, FinalEngine):  # ended, its engine gone: every tab shows its final view
        ended = run.snapshot()
        run.close()
        run_id, target, how = ended.run_id, ended.log_dir, "its final view; Ctrl-C stops serving"
    else:  # the run directory, not the id: a tab opened after the engine has gone shows the final view
        run_id, target = run.run_id, run.snapshot.get("log_dir") or run.run_id
        how = f"{'control' if control else 'read-only'}; Ctrl-C stops serving, the run goes on"
    # A socket's or a final.json's name: shown on the console and as the page's title
    return clean(run_id), target, how


def _serve(command: str, host: str, port: int, run_id: str, how: str, max_tabs: int) -> int:
    """Serve `command`, one per browser tab, until Ctrl-C; then end the attach clients left."""
    from textual_serve.server import Server

    gate = Gate(host, secrets.token_urlsafe(18))
    os.environ[WEB_SERVER] = str(os.getpid())  # each tab's client leaves when this process dies (SIGKILL)
    if not print_err(f"ranktop: serving run {run_id} on http://{_url_host(host)}:{port}/?token={gate.token} ({how})"):
        return 1  # (said on stdout at the end) nobody learns the address and its token: nothing is served
    try:
        _with_gated_tabs(Server)(command, host=host, port=port, title=f"ranktop {run_id}", gate=gate,
                                 max_tabs=max_tabs).serve()
    finally:
        end_children(CHILD_GRACE)
        for sig in (signal.SIGINT, signal.SIGTERM):  # no child is started from here on: none inherits SIG_IGN
            signal.signal(sig, signal.SIG_IGN)  # (Python's exit puts back the default action of a handler of its own)
    return 0


CHILD_GRACE = 5.0  # seconds an attach client has to leave after its hang-up, before SIGKILL
MAX_TABS = 16  # tabs open at once: each is a process (40-60 MB) and one of the 64 clients the run serves


LOOPBACK_HOSTS = frozenset({*LOOPBACK_NAMES, "127.0.0.1", "::1"})
WILDCARDS = ("", "0.0.0.0", "::")  # bound to every address


class Gate:
    """Which requests `ranktop web` handles at all; the rest get a 403 before anything runs.

    - Host (every route): a name this server answers for, port aside: the host it was bound to,
      the address the request came in on, the loopback names when that is a loopback address,
      and this machine's names when bound to every address. A page reached under some other name
      (DNS rebinding: an attacker's name that resolves to this host) does not even load. The
      port is not compared, as Django and Jupyter do not: no rebinding picks it, and a tunnel
      (ssh -L 9000:localhost:8000) may present another.
    - Origin (where sent): http:// and the request's own Host, exactly: the page builds its
      websocket's address from the Host it was loaded under. Browsers send an Origin with every
      websocket handshake, so one from another site's page is refused. A request without one is
      let in: it comes from a program, not a browser, and a program can reach the port and send
      any Origin it likes anyway; the token is what keeps it out.
    - Token: a secret drawn per launch and printed in the address to open. The page (?token=)
      and the websocket (/ws/TOKEN) need it; textual-serve's bare /ws is always refused. Other
      users of this host can reach a loopback port too, and would pass the checks above.
    """

    def __init__(self, bound: str, token: str) -> None:
        self.token = token
        self.names = {_host_name(bound)}
        if is_loopback(bound):
            self.names |= LOOPBACK_HOSTS
        if bound in WILDCARDS:
            self.names |= {_host_name(socket.gethostname()), _host_name(socket.getfqdn())}

    def refusal(self, request) -> str | None:  # noqa: ANN001 (aiohttp's)
        """Why `request` is refused, in words; None when it may go on."""
        host = request.headers.get("Host", "")
        where = _netloc(host)
        if where is None or where[0] not in self._names_for(request):
            return f"Host {host!r} is not a name this server answers for"
        origin = request.headers.get("Origin")
        if origin is not None and _origin(origin) != where:
            return f"Origin {origin!r} is not this page's own (http://{host})"
        route = request.match_info.route.name
        if route == "index":
            given = request.query.get("token", "")
        elif route in ("websocket", "tab"):
            given = request.match_info.get("token", "")
        else:
            return None  # textual-serve's own scripts and styles; downloads go by a random key
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return "no token, or not this launch's: open the address ranktop web printed"
        return None

    def _names_for(self, request) -> set[str]:  # noqa: ANN001
        names = set(self.names)
        sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
        if sockname:
            local = _host_name(sockname[0])
            names.add(local)
            if is_loopback(local):
                names |= LOOPBACK_HOSTS
        return names


def _host_name(host: str) -> str:
    """`host` as Gate compares it: an address in its one spelling (IPv4-mapped IPv6 unwrapped), a
    name in lower case without a trailing dot."""
    host = host.strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host.lower().rstrip(".")
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def _netloc(text: str) -> tuple[str, int] | None:
    """A Host header's (host, port), the port 80 when left out; None if it is not host[:port]."""
    if not text or not text.isprintable() or any(c in text for c in " @/\\?#"):
        return None
    try:
        parts = urllib.parse.urlsplit(f"//{text}")
        port = parts.port
    except ValueError:  # a bad port, an unclosed [
        return None
    if not parts.hostname:
        return None
    return _host_name(parts.hostname), 80 if port is None else port


def _origin(text: str) -> tuple[str, int] | None:
    """An Origin header's (host, port) when it is http://host[:port]; None otherwise ("null", https)."""
    scheme, sep, rest = text.partition("://")
    return _netloc(rest) if sep and scheme.lower() == "http" else None


def _with_gated_tabs(server: type) -> type:
    """textual-serve's Server (`server`), made a _GatedTabs one."""

    class WebServer(_GatedTabs, server):
        pass

    return WebServer


class _GatedTabs:
    """What ranktop web changes in textual-serve's Server (this mixin goes before it): it lets in
    only what its Gate lets through, builds the page's addresses from the Host it was loaded under
    (not the bound host, which a remote browser cannot use for 0.0.0.0), checks what each page
    sends (tab_message), and also lets go of open tabs when it stops: aiohttp waits for every running handler on shutdown (up to 60 s), and a
    tab's websocket handler runs until the browser leaves."""

    def __init__(self, *args, gate: Gate, max_tabs: int = MAX_TABS, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.max_tabs = max_tabs
        self.tabs: dict[asyncio.Task, asyncio.BaseTransport | None] = {}  # each tab's handler, and its connection
        self.stopping = False  # (a client that leaves as ranktop web stops has not failed)

    async def _make_app(self) -> web.Application:
        app = await super()._make_app()
        app.router.add_get("/ws/{token}", self.handle_websocket, name="tab")
        app.middlewares.append(_guarded_by(self.gate))
        return app

    def initialize_logging(self) -> None:
        # textual-serve logs every request (the page's and the websocket's address, the token
        # in both) and its tracebacks with their locals: a screenful a tab, on a console that
        # may be shared or recorded. Warnings and errors only, a plain line each.
        logging.basicConfig(level=logging.WARNING, format="ranktop web: %(name)s: %(message)s", force=True)
        # (a client that did not start: its TabClient says why, once)
        logging.getLogger("textual-serve").addFilter(lambda record: record.msg != "Application failed to start")

    async def on_startup(self, app) -> None:  # noqa: ANN001
        pass  # textual-serve's banner names the address without the token; ranktop printed its own

    async def handle_index(self, request):  # noqa: ANN001, ANN201 (aiohttp's)
        import aiohttp_jinja2

        context = _page_context(request, self.title, self.gate.token)
        response = aiohttp_jinja2.render_template("app_index.html", request, context)
        response.headers["Referrer-Policy"] = "no-referrer"  # the token stays in this address bar
        response.headers["Cache-Control"] = "no-store"
        return response

    async def handle_websocket(self, request):  # noqa: ANN001, ANN201 (aiohttp's)
        from aiohttp import web

        if len(self.tabs) >= self.max_tabs:  # (textual-serve started a client for every tab, without end)
            return web.Response(status=503, text=f"ranktop web: refused: {self.max_tabs} tabs are open, the most "
                                                 "it serves at once (--max-tabs): close one\n")
        tab = asyncio.current_task()
        self.tabs[tab] = request.transport
        try:
            return await self._tab(request)
        finally:
            del self.tabs[tab]

    async def _tab(self, request):  # noqa: ANN001, ANN202 (aiohttp's)
        """A tab's websocket, driven by its own attach client (a TabClient) until either leaves.
        (textual-serve's own handler, with the client's output kept bounded and quiet.)"""
        from aiohttp import web

        websocket = web.WebSocketResponse(heartbeat=15)
        await websocket.prepare(request)
        client = _tab_client()(self.command, write_bytes=websocket.send_bytes, write_str=websocket.send_str,
                               close=websocket.close, download_manager=self.download_manager, debug=self.debug)
        client.stopping = lambda: self.stopping
        try:  # (textual-serve took the size the address asked for, whatever it was)
            await client.start(*_size_asked(request.rel_url))
            await self._process_messages(websocket, client)
        except asyncio.CancelledError:  # ranktop web stops: on_shutdown dropped the connection
            pass
        except Exception as error:  # (a client that could not be started: out of processes, of files)
            print_err(f"ranktop web: a tab failed: {type(error).__name__}: {clean(str(error))}")
            await websocket.close()
        finally:
            await client.stop()
        return websocket

    async def _process_messages(self, websocket, app_service) -> None:  # noqa: ANN001 (textual-serve's)
        """What the tab's page sends, checked (tab_message) and passed on; the rest dropped."""
        from aiohttp import WSMsgType

        async for message in websocket:
            said = tab_message(message.data) if message.type == WSMsgType.TEXT else None
            if said is None:
                continue
            kind, value = said
            if kind == "stdin":
                await app_service.send_bytes(value)
            elif kind == "resize":
                await app_service.set_terminal_size(*value)
            elif kind == "ping":
                await websocket.send_json(["pong", value])
            else:
                await (app_service.focus() if kind == "focus" else app_service.blur())

    def request_exit(self) -> None:
        # The first Ctrl-C or SIGTERM stops; the next ones, while the tabs are let go, change nothing:
        # each raised aiohttp's GracefulExit again inside its clean-up, a traceback and exit 1. (Taken
        # from the loop, which would give SIGINT back to KeyboardInterrupt as it closes.)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        deaf_to((signal.SIGINT, signal.SIGTERM))
        super().request_exit()

    async def on_shutdown(self, app) -> None:  # noqa: ANN001
        self.stopping = True
        _hang_up(children_of_self())  # the clients leave first, so each tab's handler ends at once
        for tab, connection in self.tabs.items():
            if connection is not None:  # dropped, not closed: a tab that did not answer the close held the stop 10 s
                connection.abort()
            tab.cancel()
        await _clients_gone(CHILD_GRACE)


TAIL_BYTES = 4096  # of a tab's client's stderr, kept: enough for the last line, which says why it failed
REASON_CHARS = 300  # of that line, shown on the console


class StderrTail:
    """The last `size` bytes a tab's client wrote on its stderr; the rest is dropped as it comes.
    textual-serve kept all of it, in memory, and wrote it on ranktop web's stdout: every closed
    tab's `ranktop: left RUN; it runs on...`, every crash's traceback with its locals."""

    def __init__(self, size: int = TAIL_BYTES) -> None:
        self.size = size
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        del self.data[:-self.size]

    async def drain(self, stream: asyncio.StreamReader) -> None:
        """Keep the tail of `stream` until its end (or the task's cancel)."""
        while chunk := await stream.read(65536):
            self.add(chunk)

    def reason(self) -> str:
        """The last line written, fit to show (the client's output is not to be trusted); "" if none."""
        lines = [line for line in bytes(self.data).decode("utf-8", "replace").splitlines() if line.strip()]
        return clean(lines[-1].strip())[:REASON_CHARS] if lines else ""


def _tab_client() -> type:
    """textual-serve's AppService made a tab's client whose stderr is kept in a StderrTail, not
    written out, and whose tab is ended once it has gone (imported only when ranktop web serves)."""
    from textual_serve.app_service import AppService

    class TabClient(AppService):
        stopping: Callable[[], bool] = staticmethod(lambda: False)  # ranktop web stops: no failure to say

        async def _open_app_process(self, width: int = 80, height: int = 24):  # noqa: ANN202 (asyncio's Process)
            process = await super()._open_app_process(width, height)
            self.stderr_tail = StderrTail()
            self.stderr_drain = asyncio.create_task(self.stderr_tail.drain(process.stderr))
            process.stderr = _ended_stream()  # what textual-serve reads: nothing
            return process

        async def run(self) -> None:
            await super().run()  # until the client's output ends
            status = await self._process.wait()
            try:
                await asyncio.wait_for(self.stderr_drain, 1.0)  # (a grandchild could hold it open)
            except asyncio.TimeoutError:
                pass
            if status != 0 and not self.stopping():
                why = self.stderr_tail.reason() or "it said nothing"
                print_err(f"ranktop web: a tab's client failed (exit {status}), its tab closed: {why}")
            await self.remote_close()  # (the tab stayed on textual-serve's splash for ever, its socket open)

    return TabClient


def _ended_stream() -> asyncio.StreamReader:
    stream = asyncio.StreamReader()
    stream.feed_eof()
    return stream


MAX_COLUMNS, MAX_ROWS = 1000, 500  # a tab's terminal: 10000x10000 cost its client 840 MB and each frame 100 MB


def tab_size(width: object, height: object) -> tuple[int, int] | None:
    """(columns, rows) a tab's page asked for, each brought within 1..MAX_COLUMNS, 1..MAX_ROWS; None
    unless both are whole numbers (a negative, a zero or text crashed its client)."""
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (width, height)):
        return None
    return min(max(1, width), MAX_COLUMNS), min(max(1, height), MAX_ROWS)


def tab_message(text: str) -> tuple[str, Any] | None:
    """A tab's message, checked: ("stdin", its bytes), ("resize", (columns, rows)) within bounds,
    ("ping", what to answer), ("focus" or "blur", None); None for anything else, which is dropped.
    textual-serve took any JSON as it came: each malformed message was a traceback on the
    console and ended the tab, and a resize to any size was passed on."""
    try:
        envelope = json.loads(text)
    except (ValueError, RecursionError):  # (RecursionError: [[[[...]]]] nested deeper than Python recurses)
        return None
    if not isinstance(envelope, list) or not envelope or not isinstance(envelope[0], str):
        return None
    kind, value = envelope[0], envelope[1] if len(envelope) > 1 else None
    if kind == "stdin" and isinstance(value, str):
        keys = value.encode("utf-8", "ignore")  # (a lone surrogate, "\ud800", is no key: dropped, not a "?")
        # Textual's web driver takes no keys for the end of its input: every key after it broke its
        # input thread, and with it the quit a closed tab sends, so the client stayed for good
        return (kind, keys) if keys else None
    if kind == "resize" and isinstance(value, dict):
        size = tab_size(value.get("width"), value.get("height"))
        return None if size is None else (kind, size)
    if kind == "ping":
        return kind, value
    if kind in ("focus", "blur"):
        return kind, None
    return None


def _size_asked(url) -> tuple[int, int]:  # noqa: ANN001 (yarl's URL)
    """(columns, rows) a tab's address asks for (?width=&height=, 80x24 where either is left out
    or not a number), brought within bounds as tab_size does."""
    asked = [_whole(url.query.get(name), default) for name, default in (("width", 80), ("height", 24))]
    size = tab_size(*asked)
    assert size is not None  # (both whole numbers)
    return size


def _whole(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


async def _clients_gone(grace: float) -> None:
    """Wait, the loop still running, until the attach clients have left (SIGKILL after `grace`):
    asyncio started each, and learns of its exit and of its pipes' end in this loop. One that left
    after the loop had closed (a tab closed just before Ctrl-C: its client was still on its way
    out) ended ranktop web in a traceback, `Event loop is closed`, from its transport's finalizer."""
    deadline = time.monotonic() + grace
    while (left := children_of_self()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for pid in left:
        _signal(pid, signal.SIGKILL)
    while children_of_self() and time.monotonic() < deadline + grace:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.05)  # (their exits and their pipes' ends, reported to this loop, handled)


def _guarded_by(gate: Gate):  # noqa: ANN202 (aiohttp's middleware)
    """aiohttp middleware that answers what `gate` refuses with a 403 saying why, before its
    handler runs: no websocket upgrade, no attach client started."""
    from aiohttp import web

    @web.middleware
    async def guard(request, handler):  # noqa: ANN001, ANN202
        refusal = gate.refusal(request)
        if refusal is not None:
            return web.Response(status=403, text=f"ranktop web: refused: {refusal}\n")
        return await handler(request)

    return guard


def _page_context(request, title: str, token: str) -> dict:  # noqa: ANN001 (aiohttp's)
    """textual-serve's page template's values, its addresses built from the Host the page was
    loaded under (the Gate has checked it) and the websocket's carrying the token."""
    from textual_serve.server import to_int

    host = request.headers["Host"]
    router = request.app.router
    return {
        "font_size": to_int(request.query.get("fontsize", "16"), 16),
        "app_websocket_url": f"ws://{host}{router['tab'].url_for(token=token)}",
        "config": {"static": {"url": f"http://{host}{router['static'].url_for(filename='/')}".rstrip("/") + "/"}},
        "application": {"name": title},
    }


def end_children(grace: float) -> None:
    """Attach clients textual-serve left running: a hang-up, SIGKILL after `grace`, reaped."""
    pids = sorted(children_of_self())
    _hang_up(pids)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if not _reaped(pid)]
        time.sleep(0.05)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
        _reaped(pid, wait=True)


def _hang_up(pids: Iterable[int]) -> None:
    for pid in pids:
        _signal(pid, signal.SIGHUP)


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
        return f"bad --host {quoted(host)}: {getattr(exc, 'strerror', None) or exc}"
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
