"""``batch_invariant=True`` on the CUDA backend: a sequence's output bits are those it gets alone, in a
plain call, a decoder step and a paged decoder step, and its gradients, in batches of 1 and 6 ragged
sequences, over other page layouts; the key splits at fixed positions, whatever the launch's size."""

from __future__ import annotations

import ml_dtypes
import pytest

import attncomp as ac
from tests.cuda_sim.helpers import host, retyped
from tests.e2e.batch_invariance import (
    causal_gqa,
    decoder_steps,
    differing,
    gradient_calls,
    paged_steps,
    plain_calls,
    ragged_gqa,
)

#: key blocks of 8, so that parts of the fixed key split (8 blocks: 64 keys) come at small sizes
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=8,block_k=8},mask-elimination,canonicalize,cse,dce"
#: keys of the sequence: three parts
KEYS = 150
#: batch sizes on both sides of the simulator's 4 resident blocks (``launches.resident_blocks``), under
#: which a launch that may vary with the batch would split its keys: the CPU's 3 and 17 tell nothing
#: more here, where every block of a launch runs in turn
BATCHES = (1, 6)


def compiled(spec, **constants):
    return ac.compile(spec, backend="cuda", pipeline=PIPELINE, batch_invariant=True, **constants)


def test_the_split_is_at_fixed_positions_whatever_the_launch():
    fn = compiled(ragged_gqa)
    assert "key_split = 64" in fn.ir()
    kernels = fn.compilation.program.attention[0]
    for blocks in (1, 3, 17, 10_000):  # a launch that fills the GPU splits all the same
        assert kernels.split_for(blocks, KEYS, 64, 8) == 3
    assert kernels.split_for(1, 64, 64, 8) == 1


@pytest.mark.parametrize("rows", [1, 6], ids=["one-row", "six-rows"])
def test_plain_calls(rows):
    assert differing(plain_calls(compiled(ragged_gqa), host, rows, KEYS, batches=BATCHES)) == []


def test_decoder_steps():
    assert differing(decoder_steps(compiled(causal_gqa), host, KEYS, batches=BATCHES)) == []


def test_paged_decoder_steps():
    seen = paged_steps(compiled(causal_gqa, n_rep=4), host, KEYS, page_size=8, steps=2, batches=BATCHES)
    assert differing(seen) == []


def test_bf16_paged_steps_on_tensor_cores():
    """bf16 at D = 64, four query heads a key/value head (a constant ``n_rep``): prefills on the
    asynchronous-copy kernel, single-token steps on it with each group's heads packed into one tile."""
    pipeline = PIPELINE.replace("block_q=8,block_k=8", "block_q=16,block_k=32")
    fn = ac.compile(retyped(causal_gqa, "bf16"), backend="cuda", pipeline=pipeline, batch_invariant=True, n_rep=4)
    dims, bf16 = (64, 64, 64), ml_dtypes.bfloat16
    seen = paged_steps(fn, host, 70, page_size=16, dims=dims, steps=1, dtype=bf16, batches=(1, 6))
    kernels = fn.paged_decoder(page_size=16, num_pages=8).paged.fn.program.attention[0]  # the servers' own
    assert kernels.last_choice.packed_heads and kernels.last_choice.async_copies
    assert differing(seen) == []


def test_gradients():
    """A sequence's dq, dk and dv have the bits it gets alone: batch invariance sums the backward's
    gradients as ``deterministic=True`` does (no floating-point atomics, whose order varies)."""
    fn = compiled(ragged_gqa)
    assert "deterministic = true" in fn.backward.ir()
    assert differing(gradient_calls(fn, host, 6, KEYS, batches=BATCHES)) == []
