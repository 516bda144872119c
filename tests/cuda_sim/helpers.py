"""Building and running the CUDA backend in the simulator tests."""

from __future__ import annotations

import numpy as np

import attncomp as ac

#: small blocks, so that the test sizes make skipped, masked, full and partial tiles
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=8,block_k=8},mask-elimination,canonicalize,cse,dce"


def build_cuda(spec, pipeline: str = PIPELINE, lanes: int | None = None, split: int | None = None, **constants):
    """(compiled function, CUDA build) for ``spec``: the pipeline runs as for ``ac.compile``."""
    from attncomp.backends import numba_cuda

    fn = ac.compile(spec, backend="interp", pipeline=pipeline, **constants)
    return fn, numba_cuda.build(fn.module, lanes=lanes, split=split)


def run_cuda(spec, inputs, pipeline: str = PIPELINE, lanes: int | None = None) -> list:
    fn, impl = build_cuda(spec, pipeline, lanes)
    result = impl.call(fn.func, inputs, fn.constraints)
    return list(result) if isinstance(result, tuple) else [result]


def as_list(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def host(x) -> np.ndarray:
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


def retyped(spec, dtype: str):
    """``spec`` with its float32 arguments declared ``dtype`` (f16, bf16): the same function, traced
    again from its source in its module."""
    import inspect
    import sys
    import textwrap

    source = textwrap.dedent(inspect.getsource(spec.fn)).replace("ac.f32[", f"ac.{dtype}[")
    namespace = dict(vars(sys.modules[spec.fn.__module__]))
    exec(compile(source, f"<{spec.name} in {dtype}>", "exec"), namespace)
    return namespace[spec.fn.__name__]
