"""Tiles read through a transpose (FlashAttention's ``[B, T, H, D]`` read as ``[B, H, T, D]``): the CPU
forward kernels read the array as it is passed, its axes permuted in their indices (no transposed
copy in the driver), by BLAS with the rows' stride as leading dimension and through a work buffer
in the few-row loops; the backward's kernels multiply its rows where they lie, and the driver's numpy
reads a view of it."""

import numpy as np
import pytest

import attncomp as ac
from attncomp.flash_attn.specs import flash_attention_cache
from attncomp.testing import relative_error

pytest.importorskip("torch")  # attncomp.flash_attn imports torch


@ac.spec
def heads_after_positions(
    q: ac.f32["B", "T", "H", "D"], k: ac.f32["B", "S", "KV", "D"], v: ac.f32["B", "S", "KV", "D"]
):
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    s = (qh @ ac.repeat_kv(kh, qh.shape[1] // kh.shape[1]).mT) * qh.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    out = ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ ac.repeat_kv(vh, qh.shape[1] // kh.shape[1])
    return out.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("rows", [70, 3], ids=["blas", "few-rows"])
def test_tiles_are_read_through_the_transpose_in_place(rows):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, rows, 4, 16), dtype=np.float32)
    k, v = (rng.standard_normal((2, 90, 2, 16), dtype=np.float32) for _ in range(2))
    fn = ac.compile(heads_after_positions, backend="cpu")
    want = ac.compile(heads_after_positions, backend="interp")(q, k, v)
    assert relative_error(fn(q, k, v), want) < 1e-5
    driver = fn.source.split("def heads_after_positions")[-1]
    assert driver.count("np.transpose(") == 1  # the output's, a view: none of q, k or v is copied


@pytest.mark.parametrize("rows", [70, 3], ids=["blas", "few-rows"])
def test_bf16_tiles_read_through_the_transpose_are_widened_as_their_rows_are_copied(rows):
    import ml_dtypes

    rng = np.random.default_rng(3)
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((2, rows, 4, 16)).astype(bf16)
    k, v = (rng.standard_normal((2, 90, 2, 16)).astype(bf16) for _ in range(2))
    fn = ac.compile(flash_attention_cache, backend="cpu", causal=True)
    args = [q, k, v, np.zeros((1, 4), np.float32), np.array([90, 41], np.int32), np.zeros(2, np.int32), np.int64(0)]
    got = np.asarray(fn(*args), np.float64)
    want = ac.compile(flash_attention_cache, backend="interp", causal=True)(*args)
    assert relative_error(got, np.asarray(want, np.float64)) < 2e-2
    driver = fn.for_dtype("bf16").source.split("def flash_attention_cache")[-1]
    assert driver.count("np.transpose(") == 1  # the output's: q, k and v read as they are, as bf16 bits


def test_a_cache_of_flash_attention_read_in_place_decodes_each_rows_keys():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 1, 8, 32), dtype=np.float32)
    k, v = (rng.standard_normal((3, 200, 2, 32), dtype=np.float32) for _ in range(2))
    args = [q, k, v, np.zeros((1, 8), np.float32), np.array([200, 57, 130], np.int32), np.array([0, 3, 0], np.int32)]
    args.append(np.int64(0))
    fn = ac.compile(flash_attention_cache, backend="cpu", causal=True)
    assert relative_error(fn(*args), ac.compile(flash_attention_cache, backend="interp", causal=True)(*args)) < 1e-5
    assert fn.source.split("def flash_attention_cache")[-1].count("np.transpose(") == 1


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_backward_reads_the_transposes_in_place_too(dtype):
    """The backward's kernel multiplies query, key, value and output-gradient rows where they lie (its
    arrays in the accumulation type: bf16 widened in their own layout), and ``delta = sum(d_out *
    out)`` reads a view of the output gradient: of q, k, v and d_out nothing is transposed into a
    copy; the gradients' own transposes back are all the driver makes."""
    import ml_dtypes

    from attncomp.flash_attn.specs import flash_attention

    rng = np.random.default_rng(2)
    cast = np.float32 if dtype == "f32" else ml_dtypes.bfloat16
    q, cotangent = (rng.standard_normal((2, 45, 4, 16)).astype(cast) for _ in range(2))
    k, v = (rng.standard_normal((2, 37, 2, 16)).astype(cast) for _ in range(2))
    args = [q, k, v, np.zeros((1, 4), np.float32), np.int64(0)]
    fn = ac.compile(flash_attention, backend="cpu", causal=True)
    reference = ac.compile(flash_attention, backend="interp", causal=True)
    got = fn.vjp(*args)[1](cotangent)[:3]
    want = reference.vjp(*args)[1](cotangent)[:3]
    for a, b in zip(got, want):
        assert relative_error(np.asarray(a, np.float64), np.asarray(b, np.float64)) < (1e-4 if dtype == "f32" else 2e-2)
    driver = fn.for_dtype(dtype).backward.source.split("def flash_attention_backward")[-1]
    views = [line for line in driver.splitlines() if "np.transpose(" in line]
    assert len(views) == 4 and sum("rt.cast" not in line for line in views) == 1  # d_out's view; dq, dk, dv
