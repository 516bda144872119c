"""One compile for every length on the cuda backend: kernels are generated per head dims and, for
calls with fewer query rows than a block, per power of two of their rows; no other length
generates one."""

from __future__ import annotations

import numpy as np

from examples.causal import causal, numpy_reference
from tests.cuda_sim.helpers import as_list, build_cuda, host

#: the scalar kernels (the simulator runs them fastest); 64 query rows a block
PIPELINE = "cse,softmax-fusion,flash-tiling{precision=ieee},mask-elimination,canonicalize,cse,dce"


def test_lengths_generate_a_kernel_per_power_of_two_of_few_rows_and_none_else():
    fn, impl = build_cuda(causal, PIPELINE)
    (attention,) = impl.attention
    rng = np.random.default_rng(0)

    def call(t: int, s: int) -> None:
        q = rng.standard_normal((1, 1, t, 16)).astype(np.float32)
        k, v = (rng.standard_normal((1, 1, s, 16)).astype(np.float32) for _ in range(2))
        (out,) = as_list(impl.call(fn.func, [q, k, v], fn.constraints))
        np.testing.assert_allclose(host(out), numpy_reference(q, k, v), rtol=2e-5, atol=2e-6)

    for t, s in [(1, 3), (2, 5), (3, 7), (5, 13), (13, 29), (31, 37), (61, 67), (97, 101)]:
        call(t, s)
    made = sorted(attention.specialisations)
    assert made == [(16, 16, rows) for rows in (1, 2, 4, 8, 16, 32, 64)]
    for t, s in [(7, 200), (11, 11), (17, 3), (50, 53), (64, 64), (100, 130)]:
        call(t, s)
    assert sorted(attention.specialisations) == made
