"""Tests that run the CUDA backend under Numba's CUDA simulator.

They need ``NUMBA_ENABLE_CUDASIM=1`` set before Numba is imported, so they
run in their own process: ``tests/backends/test_cuda_simulator.py`` starts
``python -m pytest tests/cuda_sim`` with it set.  In any other pytest process
this directory is not collected (importing its modules would start Numba's
CUDA target without the simulator).
"""

from __future__ import annotations

import os

import numpy as np

import attncomp as ac

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    collect_ignore_glob = ["test_*.py"]

#: small blocks, so that the test sizes make skipped, masked, full and partial tiles
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=8,block_k=8},mask-elimination,canonicalize,cse,dce"


def build_cuda(spec, pipeline: str = PIPELINE, lanes: int | None = None, **constants):
    """(compiled function, CUDA build) for ``spec``: the pipeline runs as for ``ac.compile``."""
    from attncomp.backends import numba_cuda

    fn = ac.compile(spec, backend="interp", pipeline=pipeline, **constants)
    return fn, numba_cuda.build(fn.module, lanes=lanes)


def run_cuda(spec, inputs, pipeline: str = PIPELINE, lanes: int | None = None) -> list:
    fn, impl = build_cuda(spec, pipeline, lanes)
    result = impl.call(fn.func, inputs, fn.constraints)
    return list(result) if isinstance(result, tuple) else [result]


def as_list(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def host(x) -> np.ndarray:
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)
