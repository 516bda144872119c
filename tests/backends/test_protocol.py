"""Every backend builds a ``Program``; compiled functions and their features use only its interface."""

import numpy as np
import pytest

import attncomp as ac
from attncomp.backends import BACKENDS, build
from attncomp.backends.base import Program
from attncomp.backends.host_pages import HostPages
from tests.passes import specs


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_a_build_is_a_program_with_host_storage(backend):
    fn = ac.compile(specs.causal, backend=backend)
    program = fn.compilation.program
    assert isinstance(program, Program) and program.backend == backend
    assert program.source == fn.source and program.cache_on_device is False
    assert isinstance(program.page_storage(), HostPages)
    assert program.zeros((2, 3), np.float32).dtype == np.float32
    with pytest.raises(ValueError, match="ptx needs the cuda backend"):
        _ = fn.ptx


def test_the_cuda_build_is_a_program_with_device_storage():
    pytest.importorskip("numba_cuda")
    program = build("cuda", ac.compile(specs.causal, backend="interp").module)
    assert isinstance(program, Program) and program.backend == "cuda" and program.cache_on_device
    assert program.device_type == "cuda"  # where the torch op's tensors must be: read in place
    assert program.bf16_patterns_of(np.zeros(2, np.float32)) is None


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_host_programs_take_memory_handed_over_as_host_arrays(backend):
    """What the torch op asks a program: host memory, no stream to order with, bf16 as 16-bit views."""
    import ml_dtypes

    program = ac.compile(specs.causal, backend=backend).compilation.program
    assert program.device_type == "cpu"
    with program.on_stream(0):
        pass
    values = np.array([1.5, -2.0, 0.0], dtype=ml_dtypes.bfloat16)
    bits = values.view(np.int16)
    viewed = program.bf16_patterns(bits)
    assert viewed.dtype == ml_dtypes.bfloat16 and np.shares_memory(viewed, bits)
    np.testing.assert_array_equal(viewed, values)
    patterns = program.bf16_patterns_of(values)
    assert patterns.itemsize == 2 and np.shares_memory(patterns, values)
    assert program.bf16_patterns_of(np.zeros(2, np.float32)) is None


def test_unknown_backends_are_refused_by_name():
    assert BACKENDS == ("interp", "cpu", "cuda")
    with pytest.raises(ValueError, match="unknown backend 'tpu'; available backends: interp, cpu, cuda"):
        ac.compile(specs.causal, backend="tpu")


def test_derived_compilations_are_built_once():
    fn = ac.compile(specs.causal, backend="interp")
    assert fn.backward.compilation is fn.backward.compilation
    assert fn.forward_saving.compilation is fn.forward_saving.compilation
    assert fn.decoder(8).fn is fn.decoder(16).fn
    assert "kv-cache-reuse" in fn.decoder(8).fn.pipeline and "kv-cache-reuse" not in fn.pipeline


def test_the_interpreter_runs_exact_or_rounded():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 5, 4)).astype(np.float32) for _ in range(3))
    c = ac.compile(specs.causal, backend="interp").compilation
    (rounded,) = c.run([q, k, v])
    (exact,) = c.run([q, k, v], exact=True)
    assert rounded.dtype == np.float32 and exact.dtype == np.float64
    np.testing.assert_allclose(rounded, exact, rtol=1e-6)
