"""Numba's typing of a function call, remembered while attncomp compiles its kernels.

Numba types every call in a function by trying the callee's templates in order until one takes
the arguments; each template that refuses them builds an error message (in colour) that is
thrown away.  A generated kernel calls a few functions (operators, casts, ``min``, the tile and
warp helpers) with the same argument types over and over: of the calls Numba typed in seven CPU
kernel modules, 85% repeated one it had typed already (2,545 distinct of 17,408), and 81% in five
CUDA kernels.  Inside :func:`remembered`, a call already typed with the same argument types gets
the signature its templates gave the first time, without trying them again: 7% of compiling a
CPU kernel module, 14% of a CUDA kernel's PTX.

Only a signature is remembered (a call that fails is typed again, and reports its error as
Numba does), per typing context, and only inside the window, where only attncomp's generated
code compiles: a Numba function of the user's own, compiled elsewhere, is typed as before.
Numba's templates for a function give the same signature for the same argument types (an
``@overload`` or ``@intrinsic`` keeps its own cache of them, to the same effect), so a kernel's
types, and so its code, are the same with the window or without; the tests compile every
kernel inside it, and ``tests/backends/test_call_types.py`` compares the types of a kernel
compiled both ways.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_LOCAL = threading.local()
_SIGNATURES: dict[tuple, Any] = {}
_INSTALLED: list[Any] = []


def install() -> None:
    """Give Numba's function types the remembering ``get_call_type`` (idempotent; outside
    :func:`remembered` it is Numba's own)."""
    from numba.core.types import functions

    if _INSTALLED:
        return
    original = functions.BaseFunction.get_call_type

    def get_call_type(self: Any, context: Any, args: Any, kws: Any) -> Any:
        if not getattr(_LOCAL, "depth", 0):
            return original(self, context, args, kws)
        try:
            key = (self, context, tuple(args), tuple(sorted(kws.items())))
            found = _SIGNATURES.get(key)
        except TypeError:  # an unhashable argument type: typed as Numba types it
            return original(self, context, args, kws)
        if found is None:
            found = original(self, context, args, kws)
            if found is not None:
                _SIGNATURES[key] = found
        return found

    functions.BaseFunction.get_call_type = get_call_type
    _INSTALLED.append(original)


def remembered_signatures() -> int:
    """How many call signatures are remembered in this process."""
    return len(_SIGNATURES)


def compiling() -> bool:
    """Whether this thread is inside :func:`remembered`: attncomp compiling its own kernels."""
    return bool(getattr(_LOCAL, "depth", 0))


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """Remember the calls Numba types in this thread until the block ends (nested blocks share it)."""
    install()
    depth = getattr(_LOCAL, "depth", 0)
    _LOCAL.depth = depth + 1
    try:
        yield
    finally:
        _LOCAL.depth = depth
