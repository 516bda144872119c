"""``attncomp.flash_attn``'s specs on the cuda backend against the float64 interpreter: tensors laid out
as FlashAttention lays them out (``[B, T, H, D]``, read through transposes), bf16 on the tensor-core
kernels (the asynchronous copies, reading the arguments in place, a head's rows a pitch apart); a causal
window with soft-capping and ALiBi over whole sequences (forward and gradients, the backward reading
them in place too, and the deterministic backward's bits), packed sequences with a causal mask, and a
cache kept in FlashAttention's pages (``[num_pages, page_size, KV, D]``) read in place through a table."""

import ml_dtypes
import numpy as np

import attncomp as ac
from attncomp.flash_attn.specs import flash_attention, flash_attention_paged, flash_attention_varlen
from attncomp.testing import TOLERANCE, relative_error
from tests.cuda_sim.helpers import host

PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=32,block_k=32},mask-elimination,canonicalize,cse,dce"
BF16 = ml_dtypes.bfloat16


def _pair(spec, **constants):
    return (ac.compile(spec, backend=backend, pipeline=PIPELINE, **constants) for backend in ("cuda", "interp"))


def test_whole_sequences_with_a_window_softcap_and_alibi_forward_and_gradients():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 40, 2, 64)).astype(BF16)
    k, v = (rng.standard_normal((1, 48, 1, 64)).astype(BF16) for _ in range(2))
    args = [q, k, v, np.array([[0.5, 0.125]], np.float32), np.int64(0)]
    fn, reference = _pair(flash_attention, causal=True, left=20, softcap=4.0, alibi=True)
    want, want_pullback = reference.vjp(*args)
    out = host(fn(*args))
    assert out.shape == (1, 40, 2, 64)
    assert relative_error(np.asarray(out, np.float64), np.asarray(want, np.float64)) < TOLERANCE["bf16"]
    # the arguments read in place through transposed views (``host/views.py``), as 16-bit
    # patterns, a head's rows H * D apart (``arrays.pitched_rows``): the asynchronous copies, stepping by the pitch
    program = fn.for_dtype("bf16").compilation.program
    assert program.attention[0].last_choice.async_copies
    # the output written as bf16 patterns through a transposed view of the result: no pass after the kernel
    assert program.attention[0].out_view and program.attention[0].out_bits
    assert not program.graph_kernels  # no transpose of the inputs or of the output, no narrowing
    _, pullback = fn.vjp(*args)
    cotangent = rng.standard_normal(want.shape).astype(BF16)
    for got, expected in list(zip(pullback(cotangent), want_pullback(cotangent)))[:3]:
        assert (
            relative_error(np.asarray(host(got), np.float64), np.asarray(expected, np.float64)) < 2 * TOLERANCE["bf16"]
        )
    # the backward reads the four (the output gradient too, beside its fused delta reduction) in place,
    # 16-bit, by the asynchronous copies stepping by the pitch
    backward_program = fn.for_dtype("bf16").backward.compilation.program
    backward = backward_program.backward[0]
    assert len(backward.views) == 4 and backward.last_choice.async_copies
    # the gradients transposed back into [B, T, H, D] and rounded to bf16 patterns in one pass each
    transposes = [k for k in backward_program.graph_kernels if k.name.endswith("_transpose")]
    assert len(transposes) == 3 and all(k.signature.startswith("void(uint16[") for k in transposes)


def test_packed_sequences_attend_within_their_own():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 70, 2, 64)).astype(BF16) for _ in range(3))
    seq = np.repeat(np.arange(3, dtype=np.int32), [20, 35, 15])
    args = [q, k, v, np.zeros((1, 2), np.float32), seq, seq, np.zeros(70, np.int32), np.int64(0)]
    fn, reference = _pair(flash_attention_varlen, causal=True)
    out = host(fn(*args))
    want = reference(*args)
    assert relative_error(np.asarray(out, np.float64), np.asarray(want, np.float64)) < TOLERANCE["bf16"]


def test_deterministic_gradients_read_in_place_are_the_same_bits_twice():
    """Two query heads per key/value head, ``deterministic=true``: the key-major and dQ kernels read the
    four through their views, and two runs give the same bits."""
    rng = np.random.default_rng(2)
    q, d_out = (rng.standard_normal((1, 36, 4, 64)).astype(BF16) for _ in range(2))
    k, v = (rng.standard_normal((1, 40, 2, 64)).astype(BF16) for _ in range(2))
    args = [q, k, v, np.zeros((1, 4), np.float32), np.int64(0)]
    pipeline = PIPELINE.replace("block_k=32", "block_k=32,deterministic=true")
    fn, reference = (ac.compile(flash_attention, backend=b, pipeline=pipeline, causal=True) for b in ("cuda", "interp"))
    runs = [[host(g) for g in fn.vjp(*args)[1](d_out)[:3]] for _ in range(2)]
    want = reference.vjp(*args)[1](d_out)[:3]
    for got, expected in zip(runs[0], want):
        assert relative_error(np.asarray(got, np.float64), np.asarray(expected, np.float64)) < 2 * TOLERANCE["bf16"]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*runs))
    backward = fn.for_dtype("bf16").backward.compilation.program.backward[0]
    assert backward.deterministic and len(backward.views) == 4 and backward.last_choice.async_copies


def test_a_paged_cache_in_flashattentions_layout_read_through_its_table():
    """Pages ``[num_pages, page_size, KV, D]`` (a row's heads together) in a shuffled table, rows of
    different lengths, a causal window: a decoding step's few queries a row (the key-split decoder,
    rows staged through the table) in bf16 and float32, and a prefill chunk in bf16 on the tensor
    cores' asynchronous copies (each row's chunks from its page, a slot a row of heads apart);
    nothing gathered before the kernel."""
    rng = np.random.default_rng(3)
    pages, size, kv, d = 9, 16, 2, 64
    table = rng.permutation(pages)[:8].reshape(2, 4).astype(np.int32)
    k_len, k_start = np.array([50, 43], np.int32), np.array([0, 3], np.int32)
    for dtype, queries in ((BF16, 3), (np.float32, 3), (BF16, 40)):
        q = rng.standard_normal((2, queries, 4, d)).astype(dtype)
        k_pages, v_pages = (rng.standard_normal((pages, size, kv, d)).astype(dtype) for _ in range(2))
        args = [q, k_pages, v_pages, table, np.zeros((1, 4), np.float32), k_len, k_start, np.int64(0)]
        fn, reference = _pair(flash_attention_paged, causal=True, left=30)
        out = np.asarray(host(fn(*args)), np.float64)
        bound = TOLERANCE["bf16" if dtype is BF16 else "f32"]
        assert relative_error(out, np.asarray(reference(*args), np.float64)) < bound
        program = fn.for_dtype("bf16" if dtype is BF16 else "f32").compilation.program
        assert not program.graph_kernels  # the pages are read where they lie: no copy, no transpose
        assert program.attention[0].last_choice.async_copies == (queries == 40)
