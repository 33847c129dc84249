"""A function rank's multiprocessing identity: what multiprocessing gives a child it starts, so
that a rank answers `current_process()` and `parent_process()` as torch's do.

torch's function ranks are multiprocessing children: `current_process().name` is
`SpawnProcess-N` (`ForkProcess-N`, `ForkServerProcess-N`: the start method's), `parent_process()`
is the caller, and they share its authkey. Code that logs the name, or takes
`current_process().name == "MainProcess"` (or `parent_process() is None`) to mean "I am the
parent", saw every ranktop rank as a parent: each is a fresh interpreter, started by Popen.
The caller's side numbers each rank from its own multiprocessing counter, as a Process it made
would be (a later Process of the caller's is numbered after them, as after torch's); the rank's
side takes that identity on before anything of the user's runs.
"""

from __future__ import annotations

import os
from typing import Any

_PROCESS_CLASS = {"spawn": "SpawnProcess", "fork": "ForkProcess", "forkserver": "ForkServerProcess"}


def next_identity(start_method: str) -> dict[str, Any]:
    """The identity the caller's next multiprocessing child would have (its counter moves on)."""
    import multiprocessing.process as mp_process

    me = mp_process.current_process()
    identity = (*me._identity, next(mp_process._process_counter))
    return {"name": f"{_PROCESS_CLASS[start_method]}-{':'.join(map(str, identity))}", "identity": identity,
            "start_method": start_method, "authkey": bytes(me.authkey), "parent_name": me.name,
            "parent_pid": os.getpid()}


def assume(given: dict[str, Any]) -> None:
    """In the rank: become the multiprocessing child `given` describes (next_identity's)."""
    import itertools
    import multiprocessing
    import multiprocessing.process as mp_process

    process = multiprocessing.get_context(given["start_method"]).Process(name=given["name"])
    process._identity = tuple(given["identity"])
    process._parent_pid, process._parent_name = given["parent_pid"], given["parent_name"]
    process.authkey = given["authkey"]
    mp_process._current_process = process
    mp_process._process_counter = itertools.count(1)  # (making the Process above counted one)
    sentinel = _parent_sentinel(given["parent_pid"])
    if sentinel is not None:
        mp_process._parent_process = mp_process._ParentProcess(given["parent_name"], given["parent_pid"], sentinel)
    # The rank's own children default to its method, as a multiprocessing child's do.
    multiprocessing.set_start_method(given["start_method"], force=True)


def _parent_sentinel(pid: int) -> int | None:
    """A descriptor that becomes readable when the caller ends (parent_process().is_alive() and
    join() wait on it): its pidfd; None where the kernel has none. A caller already gone gets a
    pipe at its end: its pid may be another process's by now."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    except (AttributeError, OSError):  # no pidfds here (Linux before 5.3)
        return None
    if fd is not None and os.getppid() == pid:  # still our parent: the pidfd is the caller's
        return fd
    if fd is not None:
        os.close(fd)
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end
