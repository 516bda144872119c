"""``ac.compile(..., batch_invariant=True)``: a sequence's output bits are those it gets alone, in a
plain call, a decoder step and a paged decoder step, in batches of 1, 3 and 17 ragged sequences,
over other page layouts (docs/api.md section 2, docs/serving.md)."""

import numpy as np
import pytest

import attncomp as ac
from attncomp.passes.flash_tiling import key_split_of
from tests.e2e.batch_invariance import (
    causal_gqa,
    decoder_steps,
    differing,
    gradient_calls,
    gradient_inputs,
    paged_steps,
    plain_calls,
    ragged_gqa,
)

#: keys of the sequence: three parts of the CPU's fixed key split (1024 keys, its key blocks of 128)
KEYS = 2 * key_split_of(128) + 200


def test_the_option_is_in_the_pipeline_and_the_ir():
    fn = ac.compile(causal_gqa, backend="cpu", batch_invariant=True)
    assert "block_k=128,batch_invariant=true}" in fn.pipeline
    assert "key_split = 1024, kv_repeat = 2}" in fn.ir()
    given = ac.compile(
        causal_gqa, backend="interp", pipeline="softmax-fusion,flash-tiling{block_k=32}", batch_invariant=True
    )
    assert given.pipeline == "softmax-fusion,flash-tiling{block_k=32,batch_invariant=true}"
    assert "key_split = 256" in given.ir()
    assert "key_split" not in ac.compile(causal_gqa, backend="cpu").ir()
    bad = fn.ir().replace("key_split = 1024", "key_split = 0")
    with pytest.raises(ac.VerifyError, match="key_split must be a positive integer"):
        ac.parse_ir(bad)


def test_the_decoders_keep_it():
    fn = ac.compile(causal_gqa, backend="cpu", batch_invariant=True)
    dec = fn.decoder(max_len=8)
    assert "kv-cache-reuse" in dec.fn.pipeline and "key_split = 1024" in dec.fn.ir()
    srv = fn.paged_decoder(page_size=16, num_pages=8)
    assert srv.batch_invariant
    # the ragged part's own blocks, the option kept
    assert "flash-tiling{block_q=16,block_k=128,batch_invariant=true}" in srv.paged.fn.pipeline
    assert "key_split = 1024" in srv.paged.fn.ir()


@pytest.mark.parametrize("rows", [1, 6], ids=["one-row", "six-rows"])
def test_plain_calls(rows):
    """One row (the decoding loops) and six (BLAS tiles), key counts ragged within the batch."""
    fn = ac.compile(ragged_gqa, backend="cpu", batch_invariant=True)
    seen = plain_calls(fn, np.asarray, rows, KEYS)
    assert differing(seen) == []
    want = ac.interpret(ragged_gqa, *_alone_inputs(rows))
    assert np.max(np.abs(seen[0][0] - want[0])) < 1e-5


def _alone_inputs(rows):
    from tests.e2e.batch_invariance import tokens

    rng = np.random.default_rng(0)
    mine = tokens(rng, KEYS)
    q = rng.standard_normal((1, 2, rows, 8)).astype(np.float32)
    return q, mine[1], mine[2], np.array([KEYS], np.int64)


def test_decoder_steps():
    fn = ac.compile(causal_gqa, backend="cpu", batch_invariant=True)
    assert differing(decoder_steps(fn, np.asarray, KEYS)) == []


def test_paged_decoder_steps():
    fn = ac.compile(causal_gqa, backend="cpu", batch_invariant=True, n_rep=4)
    seen = paged_steps(fn, np.asarray, KEYS)
    assert differing(seen) == []


@pytest.mark.parametrize("rows", [1, 6], ids=["one-row", "six-rows"])
def test_gradients(rows):
    """The backward of one sequence (its dq, dk, dv) has the same bits alone and in batches: its
    sums run over its own rows and keys in a fixed order, whatever shares the call (the default
    mode does not: its forward splits keys by the launch's size)."""
    fn = ac.compile(ragged_gqa, backend="cpu", batch_invariant=True)
    seen = gradient_calls(fn, np.asarray, rows, KEYS)
    assert differing(seen) == []
    q, k, v, d_out = gradient_inputs(np.random.default_rng(0), rows, KEYS)  # the sequence's own, as drawn there
    _, pullback = ac.compile(ragged_gqa, backend="interp").vjp(q, k, v, np.array([KEYS], np.int64))
    for got, want in zip(seen[0][1:], pullback(d_out)[:3]):
        assert np.max(np.abs(got - want[0])) < 1e-4 * max(1.0, np.max(np.abs(want)))


def test_paged_decoder_steps_over_8bit_pages():
    fn = ac.compile(causal_gqa, backend="cpu", batch_invariant=True, n_rep=4)
    seen = paged_steps(fn, np.asarray, KEYS, cache="f8e4m3")
    assert differing(seen) == []
