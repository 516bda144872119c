"""``ir/signs.py``: which scalar values are never negative, and the tensor-core forward's main loop
folding a score scale into its softmax only where the scale is one of them."""

import pytest

import attncomp as ac
from attncomp.backends.tiles import read_tiled_attention
from attncomp.ir.signs import nonnegative


@ac.spec
def scaled(q: ac.floating["T", "D"], k: ac.floating["S", "D"], v: ac.floating["S", "D"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b = ac.index(s)
    return ac.softmax(ac.where(b[1] <= b[0], s, -ac.inf), axis=-1) @ v


@ac.spec
def negated(q: ac.floating["T", "D"], k: ac.floating["S", "D"], v: ac.floating["S", "D"]):
    return ac.softmax((q @ k.mT) * -0.125, axis=-1) @ v


@ac.spec
def temperature(q: ac.floating["T", "D"], k: ac.floating["S", "D"], v: ac.floating["S", "D"], t: ac.f32[1]):
    return ac.softmax((q @ k.mT) * t[0], axis=-1) @ v


@ac.spec
def softcapped(q: ac.floating["T", "D"], k: ac.floating["S", "D"], v: ac.floating["S", "D"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    return ac.softmax(30.0 * ac.tanh(s / 30.0), axis=-1) @ v


def _factor(spec):
    """The factor of the score region's one multiply, and the region's op names."""
    fn = ac.compile(spec, backend="interp").for_dtype("bf16")
    (grid,) = [op for op in fn.module.main.body.ops if op.name == "ac.tile_grid"]
    region = read_tiled_attention(grid).masked.score.regions[0]
    names = [op.name for op in region.ops]
    s = region.args[-1]
    factor = [x for x in region.ops[0].operands if x is not s][0] if names == ["ac.mul", "ac.yield"] else None
    return factor, names


def test_a_size_to_a_power_is_never_negative():
    factor, names = _factor(scaled)
    assert names == ["ac.mul", "ac.yield"] and nonnegative(factor)


def test_a_negative_constant_or_an_argument_may_be_negative():
    for spec in (negated, temperature):
        factor, names = _factor(spec)
        assert factor is not None and not nonnegative(factor), spec


def _flash_source(spec) -> str:
    from attncomp.backends import numba_cuda

    fn = ac.compile(spec, backend="interp").for_dtype("bf16")
    impl = numba_cuda.build(fn.module)
    (kernels,) = impl.attention
    assert kernels.choice_for(64, 64).async_copies
    return kernels.source(64, 64)


def test_the_main_loop_folds_only_a_scale_never_negative():
    pytest.importorskip("numba_cuda", reason="the cuda extra")
    assert "scale_log2" in _flash_source(scaled)
    for spec in (negated, temperature, softcapped):
        source = _flash_source(spec)
        assert "while True:  # the main loop" in source and "scale_log2" not in source, spec.__name__
