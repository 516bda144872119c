"""attncomp's compile window: what holds while Numba compiles attncomp's kernels.

Inside :func:`window` the target's front end has attncomp's changes (``front_end.py``), the calls
Numba types are remembered (``call_types.py``), and Python's cyclic garbage collector is paused
(:func:`collection_paused`).

Numba's compile of a kernel allocates millions of objects that live until it ends (its IR,
types, the LLVM IR builder's values), so the collector's young generations fill again and again
and each full collection walks the whole heap, which in a process that has imported torch holds
millions more.  Paused for the window, three specs' cpu kernel modules compiled in 6.2-6.6 s
instead of 7.1-7.2 s, and the PTX of three specs' kernels for two targets in 10.5-10.7 s instead
of 13.0-14.1 s; the garbage of one compile (tens of megabytes) waits until the window closes,
when the collector runs again as before.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

from attncomp.backends import front_end
from attncomp.backends.call_types import remembered

_LOCK = threading.Lock()
#: windows open in this process (any thread), and whether the collector ran when the first opened
_OPEN = {"count": 0, "was_enabled": False}


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector until the block ends (nested and concurrent blocks share
    one pause: the collector runs again, if it ran before, when the last one ends)."""
    with _LOCK:
        if _OPEN["count"] == 0:
            _OPEN["was_enabled"] = gc.isenabled()
            gc.disable()
        _OPEN["count"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _OPEN["count"] -= 1
            if _OPEN["count"] == 0 and _OPEN["was_enabled"]:
                gc.enable()


@contextlib.contextmanager
def window(target: str) -> Iterator[None]:
    """The compile window for ``target`` (a key of :data:`front_end.PACKAGES`): Numba compiles
    attncomp's kernels inside it."""
    front_end.install(target)
    with remembered(), collection_paused():
        yield
