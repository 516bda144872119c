"""The signatures the PTX tests compile are the specialisations calls dispatch.

``tests/backends/test_cuda_ptx.py`` holds each kernel's PTX to no local memory and no spills,
compiled for ``KernelInfo.signature``; a call compiles (on a GPU) the specialisation of its
arguments' Numba types.  Here every launch of a call with C-contiguous arrays records those types
(a simulator array's are its numpy array's, which Numba types as it types a device array: C when
C-contiguous, else A), and each kernel the program lists must have been given exactly them.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba.core import sigutils

import attncomp as ac
from attncomp.backends.numba_cuda.host import launches as host_launches
from attncomp.backends.numba_cuda.host.arrays import Bf16Bits
from tests.conftest import load_example
from tests.cuda_sim.helpers import PIPELINE


def _numba_type(value):
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    if isinstance(value, FakeCUDAArray):
        value = value._ary
    return numba.typeof(value)


@pytest.fixture
def launches(monkeypatch):
    """Every launch's (Python function, argument types), in order."""
    found = []
    launch = host_launches.launch

    def recording(kernel, grid, block, *args):
        found.append((kernel.py_func, tuple(_numba_type(a) for a in args)))
        launch(kernel, grid, block, *args)

    monkeypatch.setattr(host_launches, "launch", recording)
    return found


def _check(launches, kernels) -> int:
    """Every launch of a listed kernel had its signature's types; the number of such launches."""
    declared = {}
    for info in kernels:
        args, _ = sigutils.normalize_signature(info.signature)
        declared[info.py_func] = (info.name, tuple(args))
    checked = 0
    for py_func, types in launches:
        if py_func not in declared:
            continue  # the runtime's own kernels (zero fills, conversions)
        name, args = declared[py_func]
        assert types == args, f"{name}: launched as {types}, its PTX is compiled for {args}"
        checked += 1
    return checked


def test_forward_and_backward_launch_their_signatures(launches):
    spec = load_example("alibi").causal_alibi
    fn = ac.compile(spec, backend="cuda", pipeline=PIPELINE)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 12, 8)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.5, 0.25], np.float32)
    out, pullback = fn.vjp(q, k, v, slopes)
    pullback(rng.standard_normal(np.shape(out)).astype(np.float32))
    forward = fn.compilation.program.kernels(8, 8)
    backward = fn.backward.compilation.program.kernels(8, 8)
    assert _check(launches, forward + backward) >= 2  # the attention forward, and the backward kernel
    names = {py_func.__name__ for py_func, _ in launches}
    assert {"attention_kernel_0", "attention_backward_kernel_0"} <= names


def test_a_decoding_step_launches_its_signatures(launches):
    spec = load_example("gqa").grouped_query_attention
    dec = ac.compile(spec, backend="cuda", pipeline=PIPELINE).decoder(max_len=16)
    rng = np.random.default_rng(1)

    def tokens(n):
        return (
            rng.standard_normal((1, 4, n, 8)).astype(np.float32),
            rng.standard_normal((1, 2, n, 8)).astype(np.float32),
            rng.standard_normal((1, 2, n, 8)).astype(np.float32),
        )

    dec(*tokens(5))
    del launches[:]
    dec(*tokens(1))  # one step: the cache's first 6 rows, a view of any layout
    program = dec.fn.program
    assert _check(launches, program.kernels(8, 8) + program.decode_kernels(8, rows=1)) >= 2


def test_bf16_given_as_int16_launches_the_uint16_signature(launches):
    """bf16 device memory given as int16 patterns (how a torch bf16 tensor arrives) runs the kernel
    specialised for uint16 patterns, the one the PTX tests compile, not an int16 twin."""
    import ml_dtypes
    from numba import cuda

    from tests.cuda_sim.helpers import retyped

    fn = ac.compile(retyped(load_example("causal").causal, "bf16"), backend="cuda", pipeline=PIPELINE)
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal((1, 1, 16, 16)).astype(ml_dtypes.bfloat16) for _ in range(3)]
    out = fn(*(Bf16Bits(cuda.to_device(a.view(np.int16))) for a in arrays))
    assert isinstance(out, Bf16Bits)
    assert _check(launches, fn.compilation.program.kernels(16, 16)) == 1


def test_bf16_patterns_go_in_and_come_out_through_the_program():
    """What the torch op does with bf16 CUDA tensors, through the ``Program`` alone: 16-bit device
    memory in (``bf16_patterns``), the result's patterns out (``bf16_patterns_of``), equal to a call
    on the same values from the host."""
    import ml_dtypes
    from numba import cuda

    from tests.cuda_sim.helpers import retyped

    fn = ac.compile(retyped(load_example("causal").causal, "bf16"), backend="cuda", pipeline=PIPELINE)
    program = fn.compilation.program
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((1, 1, 16, 16)).astype(ml_dtypes.bfloat16) for _ in range(3)]
    (out,) = fn.compilation.run([program.bf16_patterns(cuda.to_device(a.view(np.int16))) for a in arrays])
    patterns = program.bf16_patterns_of(out)
    assert patterns is not None and patterns.dtype.itemsize == 2
    got = np.asarray(patterns.copy_to_host()).view(np.uint16).view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got, fn(*arrays))
