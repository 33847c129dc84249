"""The cyclic garbage collector while ranktop starts.

Start-up allocates most of the objects a run ever keeps: the modules it imports (Textual alone
is ~90k tracked objects) and the app's widgets. Collecting while they pile up scans them again
and again, and afterwards every full collection scans them all once more: in the TUI that was
74 ms of its first second and then a 65-75 ms full collection every few seconds: 269 ms of its
first 12 s at 8 ranks x 1000 lines/s (a fifth of its CPU), 79 ms with this. So the command line holds collections off while it starts,
then freezes what start-up made (gc.freeze: never scanned again, never freed) and collects
normally from there on. Only the command line does this; `import ranktop.core` changes nothing.
"""

from __future__ import annotations

import gc


def hold() -> None:
    """No cyclic collections until `release` (reference counting still frees nearly everything)."""
    gc.disable()


def release() -> None:
    """Start-up is over: move what it made out of the collector's sight and collect again.
    Safe to call more than once; only the first call after `hold` acts."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
