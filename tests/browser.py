"""A real browser for the web view's tests and its screenshot: Debian's headless `chromium`,
driven over the DevTools protocol (a websocket, through aiohttp, which textual-serve brings).
`chromium --screenshot` alone shoots at the load event, before the page's websocket has
brought the app's first frame; here we wait for a condition the page itself reports."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator

from conftest import stop_process
from ranktop.core.spec import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _page_socket(port: int, deadline: float) -> str:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=2) as answer:
                pages = [t for t in json.load(answer) if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("chromium's DevTools never answered")
        time.sleep(0.1)


async def _shoot(ws_url: str, ready_js: str, settle: float, deadline: float,
                 while_open: Callable[[], object] | None) -> tuple[bytes, bool]:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=64 << 20) as ws:
        ids = iter(range(1, 1 << 30))

        async def call(method: str, **params):
            my_id = next(ids)
            await ws.send_json({"id": my_id, "method": method, "params": params})
            async for message in ws:
                data = json.loads(message.data)
                if data.get("id") == my_id:
                    return data.get("result", {})
            raise ConnectionError("chromium closed the DevTools connection")

        # A headless page never has the window's focus, and Textual shows its footer's keys only
        # while the app has focus: let the page have it, as a tab someone looks at does.
        await call("Emulation.setFocusEmulationEnabled", enabled=True)
        ready = False
        while time.monotonic() < deadline:
            answer = await call("Runtime.evaluate", expression=ready_js, returnByValue=True)
            if answer.get("result", {}).get("value") is True:
                ready = True
                break
            await asyncio.sleep(0.2)
        if ready:  # the terminal's own input takes the focus, as a click on it would give it
            await call("Runtime.evaluate", expression="document.querySelector('.xterm-helper-textarea')?.focus()")
        await asyncio.sleep(settle if ready else 0)  # the app's first frames, drawn after its first byte
        if ready and while_open is not None:
            while_open()
        shot = await call("Page.captureScreenshot", format="png")
        return base64.b64decode(shot["data"]), ready


@contextlib.contextmanager
def page_open(url: str, timeout: float = 30.0) -> Iterator[None]:
    """Headless chromium showing `url` until the block ends (a tab someone left open)."""
    profile = tempfile.mkdtemp(prefix="ranktop-chromium-")
    browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                                f"--remote-debugging-port={free_port('127.0.0.1')}", url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield
    finally:
        _close(browser, profile)


def _close(browser: subprocess.Popen, profile: str) -> None:
    stop_process(browser)
    shutil.rmtree(profile, ignore_errors=True)


def screenshot(url: str, png_path: str, ready_js: str, *, timeout: float = 30.0, settle: float = 2.0,
               size: tuple[int, int] = (1280, 800), while_open: Callable[[], object] | None = None) -> bool:
    """Open `url` in headless chromium, wait until `ready_js` evaluates to true in the page (at
    most `timeout` s), let it settle, call `while_open` (the page is still up), and save a PNG.
    Returns whether the page got ready."""
    port, profile = free_port("127.0.0.1"), tempfile.mkdtemp(prefix="ranktop-chromium-")
    browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                                f"--remote-debugging-port={port}", f"--window-size={size[0]},{size[1]}", url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        png, ready = asyncio.run(_shoot(_page_socket(port, deadline), ready_js, settle, deadline, while_open))
        with open(png_path, "wb") as f:
            f.write(png)
        return ready
    finally:
        _close(browser, profile)
