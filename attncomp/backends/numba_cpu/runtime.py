"""Helpers the generated CPU driver calls for graph-level ops (numpy, float64-safe)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from numba.core.typing.templates import Signature

from attncomp.backends.fp8_bits import FORMATS
from attncomp.backends.numba_cpu.quantize import append_rows
from attncomp.backends.scalars import array_dtype, kernel_scalar  # noqa: F401 (drivers call rt.kernel_scalar)
from attncomp.errors import with_location
from attncomp.ir.ops.compute import safe_max
from attncomp.ir.ops.random import uniform  # noqa: F401 (drivers call rt.uniform)
from attncomp.ir.ops.shape import check_pages as _check_pages
from attncomp.ir.ops.structural import check_index_range, check_indices
from attncomp.ir.ops.tile import block_reduce  # noqa: F401 (drivers call rt.block_reduce)
from attncomp.ir.quantized import CACHE_MAX, quantize
from attncomp.ir.types import CACHE_DTYPES, NUMPY_DTYPES, dtype_of_numpy

__all__ = ["check_index_range", "check_pages"]

NUMPY = NUMPY_DTYPES


def cast(x, dtype: str) -> np.ndarray:
    return np.asarray(x, dtype=NUMPY[dtype])


def kernel_array(x: np.ndarray, dtype: str | None = None) -> np.ndarray:
    """C-contiguous; in ``dtype`` when given (the tiles a kernel multiplies), else with
    16-bit floats widened to their accumulation type, float32 (``accumulation_dtype``)."""
    x = np.asarray(x)
    if dtype == "bf16":  # a tile source read as bits and widened tile by tile (signatures.stored_bf16)
        return np.ascontiguousarray(x, dtype=NUMPY[dtype]).view(np.uint16)
    if dtype in CACHE_DTYPES:  # an 8-bit cache's codes (signatures.stored_f8, ELEMENT)
        return np.ascontiguousarray(x, dtype=NUMPY[dtype]).view(np.uint8 if dtype == "f8e4m3" else np.int8)
    if dtype is not None:
        return np.ascontiguousarray(x, dtype=NUMPY[dtype])
    stored = dtype_of_numpy(x.dtype)
    if stored is not None and array_dtype(stored) != stored:
        return np.ascontiguousarray(x, dtype=NUMPY[array_dtype(stored)])
    return np.ascontiguousarray(x)


def iota(shape: tuple[int, ...], axis: int) -> np.ndarray:
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return np.arange(shape[axis], dtype=np.int64).reshape(view)


def gather(src: np.ndarray, *indices: np.ndarray, at: str = "") -> np.ndarray:
    """``src[indices]``; an index out of range is the interpreter's ``IndexError`` (``at``: the spec's line)."""
    indices = tuple(np.asarray(i) for i in indices)
    try:
        check_indices(src.shape, list(indices), "ac.gather")
    except IndexError as error:
        raise IndexError(with_location(str(error), at)) from None
    return src[indices]


def scatter_add(shape: tuple[int, ...], updates: np.ndarray, *indices: np.ndarray) -> np.ndarray:
    """Zeros of ``shape`` with ``updates`` added at ``indices`` (the gradient of a gather)."""
    from attncomp.ir.ops.gradient import scatter_into

    out = np.zeros(shape, dtype=np.result_type(updates, np.float32))
    scatter_into(out, np.asarray(updates), [np.asarray(i) for i in indices], "ac.gather")
    return out


def reduce(kind: str, x: np.ndarray, axes: list[int], keepdims: bool) -> np.ndarray:
    fn = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean}[kind]
    if kind in ("max", "min") and x.size == 0:
        return fn(x, axis=tuple(axes), keepdims=keepdims, initial=-np.inf if kind == "max" else np.inf)
    return fn(x, axis=tuple(axes), keepdims=keepdims)


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - safe_max(x, axis))
    total = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(total == 0, 1, total)


def logsumexp(x: np.ndarray, axis: int, keepdims: bool) -> np.ndarray:
    m = safe_max(x, axis)
    out = m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))
    return out if keepdims else np.squeeze(out, axis=axis)


def cache_append(cache: np.ndarray, new: np.ndarray, axis: int, length: int) -> np.ndarray:
    """Write ``new`` after the ``length`` cached entries (in place); view what is now cached."""
    index = [slice(None)] * cache.ndim
    index[axis] = slice(length, length + new.shape[axis])
    cache[tuple(index)] = new
    index[axis] = slice(0, length + new.shape[axis])
    return cache[tuple(index)]


def cache_append_quantized(cache: np.ndarray, scales: np.ndarray, new: np.ndarray, axis: int, length: int) -> None:
    """Quantise ``new`` into an 8-bit ``cache`` and its ``scales`` after the ``length`` cached entries
    (in place, ``ir.quantized``); the kernels read the codes and scales where they are.  Rows along
    the second-to-last axis of a C-contiguous cache (a decoder's) that they fit in compiled code
    (``quantize.append_rows``, which checks no bounds), else with NumPy."""
    dtype = dtype_of_numpy(cache.dtype)
    rank = cache.ndim
    fits = new.ndim == rank and new.shape[:-2] == cache.shape[:-2] and new.shape[-1] == cache.shape[-1]
    fits = fits and 0 <= length and length + new.shape[-2] <= cache.shape[-2]
    if fits and axis % rank == rank - 2 and cache.flags.c_contiguous and scales.flags.c_contiguous:
        prefix = math.prod(cache.shape[:-2])
        rows = np.ascontiguousarray(new, dtype=np.float32).reshape(prefix, new.shape[-2], new.shape[-1])
        codes = cache.view(np.uint8).reshape(prefix, cache.shape[-2], cache.shape[-1])
        top = np.float32(CACHE_MAX[dtype])
        append_rows(codes, scales.reshape(prefix, scales.shape[-1]), rows, length, top, *FORMATS[dtype])
        return
    codes, new_scales = quantize(new, dtype)
    index = [slice(None)] * cache.ndim
    index[axis] = slice(length, length + new.shape[axis])
    cache[tuple(index)] = codes
    scales[tuple(index[:-1])] = new_scales


def _thread_count() -> Callable[[], int]:
    """``numba.get_num_threads`` as the drivers call it on every kernel call: once Numba's thread
    pool is started, its C function reads the calling thread's count in a fifth of the time."""
    from numba import get_num_threads
    from numba.np.ufunc import parallel

    from attncomp.backends.numba_cpu.openmp import load_torch_openmp

    load_torch_openmp()  # before the pool's runtime loads (openmp.py)
    get_num_threads()  # starts the pool
    fast = getattr(parallel, "_get_num_threads", None)
    return fast if callable(fast) else get_num_threads


num_threads = _thread_count()


def check_pages(table: np.ndarray, num_pages: int, size: int, rows: int) -> None:
    """Before a kernel reads ``rows`` rows through a page table: enough entries, each naming a page."""
    _check_pages(np.asarray(table, dtype=np.int64), num_pages, size, rows)


def task_addresses(signature: Signature, *dispatchers) -> tuple[int, ...]:
    """Each task's entry point (Numba's calling convention) for ``signature``: what a parallel
    driver calls them at (``intrinsics.task_caller``).  The dispatchers keep the code alive."""
    addresses = []
    for dispatcher in dispatchers:
        compiled = dispatcher.overloads[signature.args]
        addresses.append(compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name))
    return tuple(addresses)
