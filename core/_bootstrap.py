"""The first code a callable rank runs in its fresh interpreter (see process.python_call_argv)."""

from __future__ import annotations

import os
import pickle
import runpy
import sys
import time

from ranktop.core.mp_identity import assume

# True while the caller's script runs to define the rank's function: a launch from it then is a
# script without `if __name__ == "__main__":`, and is refused (process.refuse_while_loading_main).
loading_main = False


def _load_main(path: str | None, name: str | None) -> None:
    # What multiprocessing's spawn does: the caller's script becomes __mp_main__ and stands in for
    # __main__ so that pickled references like __main__.train resolve. A script the caller ran as
    # `python -m pkg.mod` is run by that name, so that its relative imports find its package.
    global loading_main
    module = type(sys)("__mp_main__")
    sys.modules["__mp_main__"] = module
    loading_main = True
    try:
        if name:
            found = runpy.run_module(name, run_name="__mp_main__", alter_sys=True)
        else:
            found = runpy.run_path(path, run_name="__mp_main__")
        module.__dict__.update(found)
    finally:
        loading_main = False
    sys.modules["__main__"] = module


def wait_for_peers(peers: list[tuple[str, str]]) -> None:
    """Stay alive until every other rank of the group returned (its result file is there) or
    ended without one (the launcher marks each exit it reaps), as torch's function workers wait
    for their launcher before exiting: a rank that ends while its peers still use a process group
    with it (gloo without destroy_process_group) can make one of them abort at exit ("terminate
    called without an active exception"). A group that fails or is stopped is signalled, which
    ends this wait; a launcher that dies leaves it to the guard."""
    delay = 0.001
    for result, exited in peers:  # one look per pause: the first peer not yet done
        while not (os.path.exists(result) or os.path.exists(exited)):
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def main() -> None:
    payload_path, result_path = sys.argv[1], sys.argv[2]
    with open(payload_path, "rb") as f:
        prep = pickle.load(f)
        sys.path[:] = prep["sys_path"]
        # the caller's command line, as multiprocessing's spawn gives it (before its script loads)
        sys.argv[:] = prep["sys_argv"]
        os.chdir(prep["cwd"])
        # named as torch's multiprocessing child would be, before the caller's script runs (as spawn's)
        assume(prep["process"])
        if prep["main_path"] or prep.get("main_name"):
            _load_main(prep["main_path"], prep.get("main_name"))
        fn, args = pickle.load(f)
    peers = prep.get("peers", [])

    from ranktop.core.errors import record

    result = record(fn)(*args)
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, result_path)
    wait_for_peers(peers)


if __name__ == "__main__":
    main()
