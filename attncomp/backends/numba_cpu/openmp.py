"""Keeping PyTorch's OpenMP runtime apart from the one Numba's thread pool starts.

The CPU kernels run on Numba's OpenMP thread pool, which loads the system's
``libgomp.so.1``.  PyTorch's Linux wheels carry their own ``torch/lib/libgomp.so.1``;
when torch is imported after Numba's pool has started, the dynamic linker hands torch
the runtime already loaded under that name, and torch's parallel ops then share it with
Numba's pool.  On the 2-core machine that made torch's SDPA (causal, T = 2048, H = 8,
D = 64, 2 threads) take 160 ms instead of 30.  Imported the other way round, each keeps
its own runtime.

:func:`load_torch_openmp` runs before attncomp starts Numba's pool: where torch is
installed but not yet imported, it loads torch's runtime first (no ``import torch``, which
would cost a second), so that a later ``import torch`` finds its own.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys


def torch_openmp_path() -> str | None:
    """The OpenMP runtime torch's wheel carries, if torch is installed with one (found
    without importing torch)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "lib", "libgomp.so.1")
    return path if os.path.exists(path) else None


def load_torch_openmp() -> bool:
    """Load torch's OpenMP runtime where torch is installed and not yet imported; whether it
    was loaded now."""
    if "torch" in sys.modules or not sys.platform.startswith("linux"):
        return False
    path = torch_openmp_path()
    if path is None:
        return False
    try:
        ctypes.CDLL(path)
    except OSError:  # a speed-up only: never fail for it
        return False
    return True
