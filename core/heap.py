"""The process's heap: handing free pages back to the system where freeing left them in the middle.

free() gives back only the top of the heap; chunks freed anywhere else stay counted in the
process's RSS until malloc reuses them. Two moments free much at once: a packing of the rings'
output (core/packing.py) and NVML's initialisation (core/gpu.py).
"""

from __future__ import annotations

import functools


def give_back_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc (musl has none)
        return None
