"""MLA's shapes (examples/mla.py) in bf16 on the CUDA backend, against the float64 interpreter.

The prefill (query/key 192, value 128) runs the staged tensor-core forward (``mma/forward_kernel.py``).  The absorbed
decode (a latent of 576 shared by every head, values its first 512) runs the scalar kernels, on 16 new
rows as on a decoder's one-token steps: a warp's 16 query rows would hold 144 registers of query
fragments and 256 of output accumulators, past a thread's 255.
"""

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import TOLERANCE, worst_error
from tests.conftest import load_example
from tests.cuda_sim.helpers import as_list, host

BF16 = ml_dtypes.bfloat16
mla = load_example("mla")
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=16,block_k=64},mask-elimination,canonicalize,cse,dce"


def build(spec):
    """(the bf16 member compiled for the interpreter, its CUDA build)."""
    from attncomp.backends import numba_cuda

    member = ac.compile(spec, backend="interp", pipeline=PIPELINE).for_dtype("bf16")
    return member, numba_cuda.build(member.compilation.module)


@pytest.mark.parametrize(
    "name, sizes, family",
    [
        ("mla_prefill", {"H": 2, "T": 20, "S": 20}, "mma m16n8k16"),
        ("mla_absorbed_decode", {"H": 4, "T": 16, "S": 40, "decode": True}, "fma"),
    ],
)
def test_mla_shapes(name, sizes, family):
    member, impl = build(getattr(mla, name))
    inputs = [x.astype(BF16) for x in mla.make_inputs(np.random.default_rng(3), B=1, **sizes)]
    got = [host(g) for g in as_list(impl.call(member.compilation.func, inputs, member.compilation.constraints))]
    want = mla.numpy_reference(*[x.astype(np.float64) for x in inputs])
    assert worst_error([got[0].astype(np.float64)], [want]) < TOLERANCE["bf16"]
    described = impl.attention[0].last_choice.describe()
    assert family in described and "async copies" not in described  # a row of 192 is 24 copies: no block divides it


def test_mla_decoder_steps_over_the_latent():
    fn = ac.compile(mla.mla_absorbed_decode, backend="cuda")
    dec = fn.decoder(32, dtype="bf16")
    rng = np.random.default_rng(5)
    q_all, latent = (x.astype(BF16) for x in mla.make_inputs(rng, B=1, H=4, T=12, S=12, decode=True))
    dec(q_all[:, :, :8], latent[:, :, :8])  # a prefill of 8, then one token at a time
    for t in range(8, 12):
        out = host(dec(q_all[:, :, t : t + 1], latent[:, :, t : t + 1]))
    want = mla.numpy_reference(q_all[:, :, 11:].astype(np.float64), latent.astype(np.float64))
    assert worst_error([out.astype(np.float64)], [want]) < TOLERANCE["bf16"]
    assert set(dec.cache) == {"k_cache"}  # one cache: the latent, whose first 512 features are the values
