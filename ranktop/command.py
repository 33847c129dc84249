"""The `ranktop` command's entry point (`python -m ranktop` too). It imports the command line
itself, so that a Ctrl-C while ranktop loads is one line, not an import's traceback."""

import sys


def main() -> int:
    try:
        from ranktop.tui.cli import main as run_command_line
    except BaseException as exc:
        if not is_interrupt(exc):
            raise
        status = interrupted()
    else:
        status = run_command_line()
    _forget_caught_interrupts()
    return status


def is_interrupt(exc: BaseException) -> bool:
    """Whether `exc` is a Ctrl-C: a KeyboardInterrupt, or one Python 3.11 wrapped on its way out of
    a class's `__set_name__` (a RuntimeError, 'Error calling __set_name__', whose cause it is), as
    an import that defines such a class meets it."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__cause__
    return False


def interrupted() -> int:
    """A Ctrl-C (SIGINT) that came before ranktop handles it: one line, exit 130 (it was a
    KeyboardInterrupt traceback). Whatever ranktop had started, its guard sweeps as ranktop exits."""
    try:
        print("\nranktop: interrupted (SIGINT)", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # (a console gone as well)
        pass
    return 130


def _forget_caught_interrupts() -> None:
    """A KeyboardInterrupt raised in code made from a string (a dataclass's generated `__init__`, run
    by `exec` as its module is imported) marks the interpreter as interrupted even once it was
    caught, and `python -m ranktop` then ends by SIGINT itself, not with the status returned (-2
    where 130 was said). Every status here is one ranktop chose: a string run that ends normally
    clears that mark."""
    exec("")
