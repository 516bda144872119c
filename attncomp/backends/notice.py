"""Saying, once, that a first call is busy compiling.

A new spec's first call on a compiled backend spends seconds in Numba (its
kernels are then cached on disk, and later processes load them).  So that
the wait is not a silent one, a call that has kernels still to compile
starts a timer: if the call is still running after :data:`DELAY` seconds, one
line on stderr says what is compiling.  ``ATTNCOMP_QUIET=1`` silences it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: seconds a call runs before the notice is printed
DELAY = 1.0


def quiet() -> bool:
    return os.environ.get("ATTNCOMP_QUIET", "") not in ("", "0")


@contextmanager
def compile_notice(name: str, backend: str, pending: bool) -> Iterator[None]:
    """Within the block, print the notice for ``@name`` on ``backend`` if it runs past :data:`DELAY`
    (only when ``pending``: some kernel of the call is not compiled yet)."""
    if not pending or quiet():
        yield
        return
    message = (
        f"attncomp: compiling @{name} for the {backend} backend with Numba "
        "(once: the kernels are cached on disk for later calls and processes; ATTNCOMP_QUIET=1 silences this)"
    )
    timer = threading.Timer(DELAY, lambda: print(message, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
