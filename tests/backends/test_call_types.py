"""``backends/call_types.py``: the calls Numba types while attncomp compiles, remembered.

A kernel compiled inside the window gets the same types and so the same code as compiled
outside it: its variables' types and its calls' signatures are compared, and for a CUDA kernel
its PTX.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re

import numpy as np
import pytest
from numba import njit

import attncomp as ac
from attncomp.backends import call_types
from tests.passes import specs as pass_specs


def _typed(dispatcher, signature, remember: bool):
    """The types of a fresh compile of ``dispatcher``'s function (not Numba's cache, which keeps none)."""
    options = {k: v for k, v in dispatcher.targetoptions.items() if k not in ("cache", "nopython")}
    again = njit(**options)(dispatcher.py_func)
    if remember:
        with call_types.remembered():
            again.compile(signature)
    else:
        again.compile(signature)
    annotation = again.overloads[signature].type_annotation
    # an inlined function's variables are named with a count of the process's inlinings
    variables = {re.sub(r"_v\d+_", "_v_", name): str(t) for name, t in annotation.typemap.items()}
    calls = sorted(str(s) for s in annotation.calltypes.values() if s is not None)
    return variables, calls


def test_a_cpu_task_has_the_same_types_inside_the_window_and_outside():
    fn = ac.compile(pass_specs.causal, backend="cpu")
    x = np.ones((1, 2, 5, 8), np.float32)
    fn(x, x, x)
    (task,) = [k for k in fn.compilation.program.kernels if k.py_func.__name__.endswith("_task")]
    (signature,) = task.signatures
    inside = _typed(task, signature, remember=True)
    outside = _typed(task, signature, remember=False)
    assert len(inside[1]) > 200  # a kernel's worth of calls
    assert inside == outside


def test_only_calls_typed_inside_the_window_are_remembered():
    @njit
    def outside(a, b):
        return min(a, b) + max(b, a)

    @njit
    def inside(a, b):
        return min(a, b) - max(b, a)

    before = call_types.remembered_signatures()
    assert outside(1.5, 2) == 3.5
    assert call_types.remembered_signatures() == before
    with call_types.remembered():
        assert inside(1.5, 2) == -0.5
    assert call_types.remembered_signatures() > before


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs the cuda extra")
def test_a_cuda_kernel_has_the_same_ptx_inside_the_window_and_outside(monkeypatch):
    from attncomp.backends import numba_cuda
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for

    impl = numba_cuda.build(ac.compile(pass_specs.causal, backend="interp").module)
    kernel = next(k for k in impl.kernels(64, 64) if k.name.startswith("attention_kernel_0["))
    inside = compile_ptx_for(kernel.py_func, kernel.signature, [(8, 0)], kernel.launch_bounds)[(8, 0)]
    monkeypatch.setattr(call_types, "remembered", contextlib.nullcontext)
    outside = compile_ptx_for(kernel.py_func, kernel.signature, [(8, 0)], kernel.launch_bounds)[(8, 0)]

    def plain(ptx: str) -> str:  # Numba numbers functions and shared arrays by the process's compiles
        return re.sub(r"_cudapy_smem_\d+", "_cudapy_smem_", re.sub(r"B\d+v\d+", "B_v_", ptx))

    assert ".entry" in inside and plain(inside) == plain(outside)
