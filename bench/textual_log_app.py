"""The comparison apps for bench_tui.py: N panes in a grid, fed by N generator processes.

    python textual_log_app.py --widget log     ...  # Textual's own Log widget, fed from pipes
    python textual_log_app.py --widget logview ...  # ranktop's LogView over a real LocalAgent's rings

`log` is what a straightforward Textual app would do: a reader thread per rank writes every chunk
to the rank's log file, then hands it to the Log widget on the UI thread. `logview` is the same
grid with ranktop's engine and widget, minus ranktop's own chrome (header, titles, stats).
Press q to quit (the ranks are stopped).
"""

from __future__ import annotations

import argparse
import codecs
import os
import subprocess
import sys
import threading
from pathlib import Path

from textual.app import App, ComposeResult
from textual.containers import Grid
from textual.widgets import Log

GEN = str(Path(__file__).with_name("gen_lines.py"))
POLL_SECONDS = 0.2  # ranktop's panes repaint at a few Hz; the harness does the same


def gen_args(ns: argparse.Namespace) -> list[str]:
    return ["--lines", str(ns.lines), "--rate", str(ns.rate), "--linger", str(ns.linger)]


class GridApp(App):
    CSS = """
    Grid { grid-size: 4; grid-gutter: 0; }
    Grid > * { border: round $primary; height: 1fr; }
    """
    BINDINGS = [("q", "quit_all", "Quit")]

    def __init__(self, ns: argparse.Namespace) -> None:
        super().__init__()
        self.ns = ns

    def compose(self) -> ComposeResult:
        with Grid():
            yield from self.panes()

    def panes(self) -> list:
        raise NotImplementedError

    def action_quit_all(self) -> None:
        self.stop_ranks()
        self.exit()

    def stop_ranks(self) -> None:
        pass


class LogGridApp(GridApp):
    """Textual's Log widget, one per rank, fed by reader threads through call_from_thread."""

    def panes(self) -> list:
        return [Log(max_lines=10_000, id=f"r{r}") for r in range(self.ns.ranks)]

    def on_mount(self) -> None:
        self.procs = []
        for r in range(self.ns.ranks):
            folder = Path(self.ns.log_dir) / str(r)
            folder.mkdir(parents=True, exist_ok=True)
            proc = subprocess.Popen([sys.executable, "-u", GEN, "--rank", str(r), *gen_args(self.ns)],
                                    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
            self.procs.append(proc)
            log = self.query_one(f"#r{r}", Log)
            threading.Thread(target=self.pump, args=(proc, folder / "stdout.log", log), daemon=True).start()

    def pump(self, proc: subprocess.Popen, path: Path, log: Log) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        fd = proc.stdout.fileno()
        with open(path, "wb") as f:
            while chunk := os.read(fd, 1 << 16):
                f.write(chunk)
                f.flush()
                self.call_from_thread(log.write, decoder.decode(chunk))
        proc.stdout.close()

    def stop_ranks(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


class LogViewGridApp(GridApp):
    """ranktop's engine (LocalAgent, console off) and LogView, polled a few times a second."""

    def panes(self) -> list:
        from ranktop.tui.logview import LogView

        return [LogView(None, id=f"r{r}") for r in range(self.ns.ranks)]

    def on_mount(self) -> None:
        from ranktop.core import LocalAgent, WorkerSpec

        spec = WorkerSpec(role="bench", local_world_size=self.ns.ranks, entrypoint=sys.executable,
                          args=("-u", GEN, *gen_args(self.ns)), run_id="logview")
        self.agent = LocalAgent(spec, log_dir=self.ns.log_dir, console=False, shutdown_timeout=2)
        self.runner = threading.Thread(target=self.agent.run, daemon=True)
        self.runner.start()
        self.agent.wait_started(30)
        self.views = list(self.query("LogView"))
        for r, view in enumerate(self.views):
            view.set_ring(self.agent.ring(r))
        self.set_interval(POLL_SECONDS, self.tick)

    def tick(self) -> None:
        for view in self.views:
            view.poll()

    def stop_ranks(self) -> None:
        self.agent.kill_group()
        self.runner.join(10)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--widget", choices=("log", "logview"), required=True)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--rate", type=float, default=1000)
    p.add_argument("--linger", type=float, default=0)
    p.add_argument("--log-dir", required=True)
    ns = p.parse_args()
    (LogGridApp if ns.widget == "log" else LogViewGridApp)(ns).run()


if __name__ == "__main__":
    main()
