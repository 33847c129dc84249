"""The README's picture of `ranktop web`: a real 4-rank demo run (fake NVML), served to a real
headless chromium, shot once the page has drawn the app.

    python scripts/web_screenshot.py [--out screenshots/web-view.png]

Needs chromium (Debian: apt-get install chromium) and textual-serve (pip install 'ranktop[web]').
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import screenshot  # noqa: E402

FIRST_BYTE = "document.body.classList.contains('-first-byte')"


def served_address(web: subprocess.Popen, timeout: float = 20.0) -> str:
    """The address `ranktop web` printed (it carries the launch's token), once its page answers."""
    said = []  # what it printed instead, where it failed: why (a port in use, a run not found)
    for line in web.stderr:  # the address is its first line; EOF if it failed
        if found := re.search(r" on (http://\S+/\?token=\S+) ", line):
            url = found.group(1)
            break
        said.append(line.rstrip("\n"))
    else:
        raise SystemExit("ranktop web printed no address" + "".join(f"\n  {line}" for line in said))
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return url
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} never answered") from None
            time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "screenshots" / "web-view.png"))
    ap.add_argument("--port", type=int, default=8731)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ranktop-web-shot-") as work:  # the run's logs, its socket
        shoot(Path(work), ns.out, ns.port)


def shoot(work: Path, out: str, port: int) -> None:
    """The demo run and `ranktop web` of it, their files under `work`; the page's picture to `out`."""
    (work / "runtime").mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(work / "runtime"), "RANKTOP_FAKE_GPUS": "4"}
    ranktop = [sys.executable, "-m", "ranktop"]
    run = subprocess.Popen([*ranktop, "--headless", "--nproc-per-node", "4", "--run-id", "demo", "--log-dir",
                            str(work / "logs"), str(ROOT / "examples" / "demo_train.py")],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    web = None
    try:
        time.sleep(3)  # a few steps of training in every pane
        web = subprocess.Popen([*ranktop, "web", "demo", "--port", str(port)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url = served_address(web)
        if not screenshot(url, out, FIRST_BYTE, settle=3.0, size=(1400, 820)):
            raise SystemExit("the page never drew the app")
        print(f"wrote {out}")
    finally:
        if web is not None:
            web.send_signal(signal.SIGINT)
            web.wait(30)
        run.send_signal(signal.SIGTERM)
        run.wait(30)


if __name__ == "__main__":
    main()
