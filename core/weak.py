"""Callbacks that do not keep their object alive.

An agent holds each attempt's context, and a context its sinks, sweeps and stray tracker; each of
these calls back into its holder. Through a bound method that is a reference cycle, and what sits
in one is freed only by a full garbage collection: a run that restarted its group 300 times kept
~150 attempts' contexts (their rings, sinks, pumps) between two of them, and the allocator kept
the peak (RSS 20 to 50 MB). Through `weakly` an attempt is freed as soon as nothing holds it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weakly(method: Callable[..., Any], *first: Any) -> Callable[..., Any]:
    """`method` (a bound method), called with `first` before the call's own arguments, without a
    strong reference to its object: once that is gone a call does nothing and returns None."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*first, *args, **kwargs)

    return call
