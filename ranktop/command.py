"""The `ranktop` command's entry point (`python -m ranktop` too). It imports the command line
itself, so that a Ctrl-C while ranktop loads is one line, not an import's traceback."""

import sys


def main() -> int:
    try:
        from ranktop.tui.cli import main as run_command_line
    except KeyboardInterrupt:
        return interrupted()
    return run_command_line()


def interrupted() -> int:
    """A Ctrl-C (SIGINT) that came before ranktop handles it: one line, exit 130 (it was a
    KeyboardInterrupt traceback). Whatever ranktop had started, its guard sweeps as ranktop exits."""
    try:
        print("\nranktop: interrupted (SIGINT)", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # (a console gone as well)
        pass
    return 130
