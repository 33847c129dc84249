"""Put first on a Python rank's PYTHONPATH by ranktop (core.spec.faulthandler_env).

With RANKTOP_FAULTHANDLER=1, SIGUSR1 makes the rank print every thread's stack to stderr (its
log and pane): a stack dump that needs no ptrace. A handler the program installs later for
SIGUSR1 replaces this one, so programs that use the signal keep working. Then the
sitecustomize this file shadows, if any, runs as if it had been found first.
"""

import os
import sys


def _register() -> None:
    if os.environ.get("RANKTOP_FAULTHANDLER") != "1" or not hasattr(sys.stderr, "fileno"):
        return
    import faulthandler
    import signal

    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError):
        pass  # no SIGUSR1 (not POSIX) or no usable stderr: nothing to fall back to


def _chain() -> None:
    """Run the next sitecustomize on sys.path under its own name, as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.path[:] = rest  # leave sys.path as the program expects it, without this folder
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_register()
_chain()
