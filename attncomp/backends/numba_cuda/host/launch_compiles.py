"""Compiles at launch: on a GPU, numba-cuda compiles a kernel when a launch first brings its argument
types, and that compile runs inside attncomp's compile window, one process at a time.

A kernel of a generated module is a ``cuda.jit`` dispatcher without a signature: its first launch
with new argument types misses the dispatcher's table, and numba-cuda's C dispatcher calls the
dispatcher's ``_compile_for_args``, which loads the kernel from Numba's disk cache or compiles it
(the front end, NVVM, the link to a cubin).  :func:`prepare` gives each dispatcher, at its first
launch, a ``_compile_for_args`` that calls numba-cuda's own inside

- the compile window (``backends/compile_window.py``): the front end's changes that act only there,
  and the cyclic collector paused.  A decoding kernel's first-launch compile, in a process that has
  imported torch (as the GPU check's are), took 1.52-1.55 s inside it against 2.02-2.11 s outside;
- the cache entry's lock (``cache.one_compiler``), named by the kernel and its argument types:
  processes sharing the kernel cache (a test run's workers, the GPU check's compile phase, the ranks
  of a job) that first launch the same kernel at once compile it once, and the others load what the
  first wrote.

A launch that finds its types in the table (every launch after the first, as a rule) never reaches
it: the hot path is untouched.  Under Numba's simulator, whose kernels compile nothing, nothing is
prepared.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

from attncomp.backends import compile_window
from attncomp.backends.cache import one_compiler

#: the dispatcher method numba-cuda's C dispatcher calls when a launch's argument types miss its table
MISS = "_compile_for_args"


def prepare(kernel: Any) -> None:
    """Make ``kernel``'s compiles at launch run in the compile window, one process at a time (once a
    dispatcher; a simulator kernel, which has no such method, is left as it is)."""
    own = getattr(type(kernel), MISS, None)
    if own is None or MISS in vars(kernel):
        return
    setattr(kernel, MISS, functools.partial(compile_in_window, kernel, own))


def compile_in_window(kernel: Any, own: Any, *args: Any, **kws: Any) -> Any:
    """numba-cuda's ``own`` compile of ``kernel`` for ``args``, inside the compile window and the
    lock of its cache entry."""
    try:
        name = lock_name(kernel, args)
    except Exception:  # an argument Numba cannot type: its own compile says so
        return own(kernel, *args, **kws)
    with compile_window.window("cuda"), one_compiler(name):
        return own(kernel, *args, **kws)


def lock_name(kernel: Any, args: tuple[Any, ...]) -> str:
    """The cache entry of ``kernel`` launched with ``args``: its module (named by its source's text),
    its name, and a digest of the argument types Numba sees."""
    func = kernel.py_func
    types = ", ".join(str(kernel.typeof_pyval(a)) for a in args)
    digest = hashlib.sha256(types.encode()).hexdigest()[:16]
    return f"{func.__module__}.{func.__qualname__}.{digest}"
