"""Decoding on the CUDA backend: flash-decoding key splits, small thread blocks, the device cache."""

from __future__ import annotations

import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import TOLERANCE, worst_error
from tests.conftest import load_example
from tests.cuda_sim.helpers import as_list, build_cuda, host
from tests.passes import specs as pass_specs


def _inputs(rng, shape_q, shape_k, value_dim=None):
    q = rng.standard_normal(shape_q).astype(np.float32)
    k = rng.standard_normal(shape_k).astype(np.float32)
    v = rng.standard_normal((*shape_k[:-1], value_dim or shape_k[-1])).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize(
    "spec,shape_q,shape_k",
    [
        (pass_specs.causal, (1, 2, 3, 8), (1, 2, 37, 8)),  # few rows: early splits have every key, late ones none
        (pass_specs.spelled_gqa_lse, (2, 4, 1, 8), (2, 2, 45, 8)),  # one token, GQA, LSE merged too
        (pass_specs.causal, (1, 1, 44, 8), (1, 1, 44, 8)),  # several query blocks, uneven splits
    ],
    ids=["causal-few-rows", "gqa-lse-one-token", "causal-blocks"],
)
def test_key_splits_merge_to_the_interpreter(spec, shape_q, shape_k, split):
    q, k, v = _inputs(np.random.default_rng(split), shape_q, shape_k)
    fn, impl = build_cuda(spec, split=split)
    got = as_list(impl.call(fn.func, [q, k, v], fn.constraints))
    assert impl.attention[0].last_split == split
    want = as_list(ac.interpret(spec, q, k, v))
    assert worst_error(got, want) < 5 * TOLERANCE["f32"]


def test_rows_without_visible_keys_stay_zero_across_splits():
    """A split whose keys are all masked, or that has no key block, leaves m = -inf, l = 0: the merge
    must give those rows 0 and LSE -inf only when every split saw nothing."""
    q, k, v = _inputs(np.random.default_rng(3), (1, 2, 24, 8), (1, 2, 24, 8))
    fn, impl = build_cuda(pass_specs.window, split=3, size=2)
    got = as_list(impl.call(fn.func, [q, k, v], fn.constraints))
    want = as_list(ac.interpret(pass_specs.window, q, k, v, size=2))
    assert worst_error(got, want) < 5 * TOLERANCE["f32"]


def test_a_decoding_step_is_split_by_default_with_one_row_per_thread_block():
    """One token for two heads: the launch is smaller than the (simulated) GPU, so its keys are split,
    and its thread blocks hold one query row with a warp of lanes."""
    module = load_example("gqa")
    q, k, v = module.make_inputs(np.random.default_rng(4), B=1, H=2, KV=1, T=1, S=200, D=8, E=8)
    fn = ac.compile(module.grouped_query_attention, backend="cuda")
    got = fn(q, k, v)
    kernels = fn.compilation.program.attention[0]
    assert kernels.last_split > 1
    assert (8, 8, 1) in kernels.specialisations and kernels.plan(8, 8, 1).threads == 32
    np.testing.assert_allclose(got, module.numpy_reference(q, k, v), rtol=1e-5, atol=1e-6)


def test_a_decoding_step_is_two_launches_with_its_splits_merged_in_the_attention_kernel():
    """The keys' and values' appends share one launch, and the unit's last split block merges the
    splits: a step is two kernel launches (it was four: two appends, attention, merge)."""
    from attncomp.backends.numba_cuda.host.launches import launch_count

    module = load_example("gqa")
    rng = np.random.default_rng(8)
    pipeline = "cse,softmax-fusion,flash-tiling{block_q=16,block_k=16},mask-elimination,canonicalize,cse,dce"
    fn = ac.compile(module.grouped_query_attention, backend="cuda", pipeline=pipeline)
    dec = fn.decoder(max_len=32)
    q, k, v = module.make_inputs(rng, B=1, H=2, KV=1, T=25, S=25, D=8, E=8)
    steps = [dec(q[:, :, :20], k[:, :, :20], v[:, :, :20])]  # two key blocks: the steps are split
    launches = []
    for t in range(20, 25):
        before = launch_count()
        steps.append(dec(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]))
        launches.append(launch_count() - before)
        assert dec.fn.program.attention[0].last_split > 1
    assert launches[1:] == [2] * 4  # the first split step also zeroes its split counters, once
    np.testing.assert_allclose(np.concatenate(steps, axis=2), module.numpy_reference(q, k, v), rtol=1e-5, atol=1e-6)


def test_a_steps_launches_are_recorded_with_their_times():
    """``launch_times`` records each launch of the calls inside (kernel, grid, block, host time; the
    simulator's span is its host time), and ``anatomy`` sums them a call; outside, nothing is kept."""
    from attncomp.backends.numba_cuda.host.launch_times import anatomy, launch_times, recording

    module = load_example("gqa")
    pipeline = "cse,softmax-fusion,flash-tiling{block_q=16,block_k=16},mask-elimination,canonicalize,cse,dce"
    dec = ac.compile(module.grouped_query_attention, backend="cuda", pipeline=pipeline).decoder(max_len=32)
    q, k, v = module.make_inputs(np.random.default_rng(9), B=1, H=2, KV=1, T=23, S=23, D=8, E=8)
    dec(q[:, :, :20], k[:, :, :20], v[:, :, :20])
    dec(q[:, :, 20:21], k[:, :, 20:21], v[:, :, 20:21])  # the first split step zeroes its counters
    with launch_times() as records:
        for t in (21, 22):
            dec(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert recording() is None
    names = [r.kernel for r in records]
    assert names == [names[0], "attention_kernel_0"] * 2 and "append" in names[0]
    splits = dec.fn.program.attention[0].last_split
    assert records[1].grid == (2, splits) and splits > 1  # two heads' rows, each split
    assert all(r.issue > 0 and r.span == r.issue and r.events is None for r in records)
    line = anatomy(records, calls=2)
    assert line.startswith("2 launches a call, issue ")
    assert f"{names[0]} x1: issue " in line and "attention_kernel_0 x1: issue " in line

    from benchmarks.host_profile import launch_lines

    def step():
        dec.length = 21
        dec(q[:, :, 21:22], k[:, :, 21:22], v[:, :, 21:22])

    assert launch_lines("step", step, lambda: None, calls=2)[0].startswith("step: 2 launches a call, issue ")


def test_nanochat_prefill_then_steps_equals_one_call():
    """The seed model: prefill 40 tokens, then 8 single-token steps, on the device cache (the CPU
    tests run the seed's 100 + 64; the simulator runs every CUDA thread as a Python thread)."""
    nanochat = load_example("nanochat_attention")
    rng = np.random.default_rng(0)
    x, *weights = nanochat.make_inputs(rng, B=1, T=48, C=24, n_head=6, n_kv_head=2)
    fn = ac.compile(nanochat.nanochat_attention, backend="cuda", n_head=6, n_kv_head=2)
    whole = fn(x, *weights)
    want = ac.compile(nanochat.nanochat_attention, backend="interp", n_head=6, n_kv_head=2)(x, *weights)
    assert worst_error([whole], [want]) < 5 * TOLERANCE["f32"]
    dec = fn.decoder(max_len=64)
    steps = [dec(x[:, :40], *weights)] + [dec(x[:, t : t + 1], *weights) for t in range(40, 48)]
    assert all(isinstance(step, np.ndarray) for step in steps)  # host inputs, host outputs
    decoded = np.concatenate(steps, axis=1)
    assert np.max(np.abs(decoded - whole)) / np.max(np.abs(whole)) < 1e-5
    assert dec.length == 48
    cache = {name: host(array) for name, array in dec.cache.items()}
    assert cache["k_cache"].shape == (1, 2, 48, 4) and cache["v_cache"].shape == (1, 2, 48, 4)
    # the keys the steps appended are the keys the interpreter's decoder computes
    reference = ac.compile(nanochat.nanochat_attention, backend="interp", n_head=6, n_kv_head=2).decoder(max_len=64)
    reference(x, *weights)
    np.testing.assert_allclose(cache["k_cache"], reference.cache["k_cache"], rtol=1e-5, atol=1e-5)
    dec.reset()  # a replay of the prefill and the first steps gives the same bits
    replay = [dec(x[:, :40], *weights)] + [dec(x[:, t : t + 1], *weights) for t in range(40, 44)]
    np.testing.assert_array_equal(np.concatenate(replay, axis=1), decoded[:, :44])


def test_the_device_cache_is_untouched_by_a_failing_step():
    from numba import cuda

    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    slopes = np.ones(2, np.float32)
    dec = ac.compile(pass_specs.causal_alibi, backend="cuda").decoder(max_len=8)
    dec(cuda.to_device(q), cuda.to_device(q), cuda.to_device(v), cuda.to_device(slopes))
    before = {name: host(array).copy() for name, array in dec.cache.items()}
    with pytest.raises(ValueError, match="exceeds max_len = 8"):
        dec(q, q, v, slopes)
    with pytest.raises(ac.ShapeError, match="dimension D"):
        dec(q[..., :1, :4], q[..., :1, :], v[..., :1, :], slopes)
    assert dec.length == 6
    for name, array in dec.cache.items():
        np.testing.assert_array_equal(host(array), before[name])


def test_split_workspace_is_reused_and_grown_across_calls():
    """Scratch buffers persist between calls: a bigger call grows them, a smaller one reuses a prefix."""
    fn, impl = build_cuda(pass_specs.spelled_gqa_lse, split=3)
    rng = np.random.default_rng(6)
    for batch, keys in ((1, 30), (3, 45), (1, 30)):
        q, k, v = _inputs(rng, (batch, 4, 1, 8), (batch, 2, keys, 8))
        got = as_list(impl.call(fn.func, [q, k, v], fn.constraints))
        assert worst_error(got, as_list(ac.interpret(pass_specs.spelled_gqa_lse, q, k, v))) < 5 * TOLERANCE["f32"]
    from attncomp.backends.numba_cuda.host.launches import stream_key

    scratch = impl.attention[0].scratch
    buffers = scratch.held(stream_key())
    assert buffers[0].size == 3 * 3 * 4 * 8  # splits x rows of the largest call x E
    assert not host(buffers[3]).any()  # each unit's last split left its count at zero
    q, k, v = _inputs(rng, (1, 4, 1, 8), (1, 2, 30, 8))
    before = {key: dict(views) for key, (_, views) in scratch.buffers.items()}
    impl.call(fn.func, [q, k, v], fn.constraints)  # a shape seen before: its views are reused
    after = {key: dict(views) for key, (_, views) in scratch.buffers.items()}
    assert before == after and all(len(views) == 2 for views in after.values())  # a view for each call's shape


def test_split_scratch_is_kept_per_stream():
    """A split launch's partial states and counters live in buffers kept from call to call; two
    streams may run at once, so each has its own."""
    from numba import cuda

    from attncomp.backends.numba_cuda.host.launches import on_stream, stream_key

    module = load_example("gqa")
    q, k, v = module.make_inputs(np.random.default_rng(6), B=1, H=2, KV=1, T=1, S=70, D=8, E=8)
    fn = ac.compile(module.grouped_query_attention, backend="cuda")
    kernels = fn.compilation.program.attention[0]
    want = module.numpy_reference(q, k, v)
    np.testing.assert_allclose(fn(q, k, v), want, rtol=1e-5, atol=1e-6)
    assert kernels.last_split > 1
    default = kernels.scratch.held(stream_key())
    side = cuda.stream()
    with on_stream(side):
        np.testing.assert_allclose(fn(q, k, v), want, rtol=1e-5, atol=1e-6)
        mine = kernels.scratch.held(stream_key())
    assert sorted(default) == sorted(mine) == [0, 1, 2, 3]
    assert all(mine[slot] is not default[slot] for slot in default)
    from attncomp.backends.numba_cuda.host.scratch import STREAMS

    others = [cuda.stream() for _ in range(STREAMS)]  # buffers of the 8 most recent streams are kept
    for other in others:
        with on_stream(other):
            fn(q, k, v)
    held = kernels.scratch.held_streams()
    assert len(held) == STREAMS and stream_key() not in held
    with on_stream(others[0]):
        held_first = kernels.scratch.held(stream_key())
        np.testing.assert_allclose(fn(q, k, v), want, rtol=1e-5, atol=1e-6)  # kept: used again as it is
        again = kernels.scratch.held(stream_key())
    assert all(again[slot] is held_first[slot] for slot in held_first)


def test_a_decoders_caches_start_zeroed_by_a_memset(monkeypatch):
    """``Program.zeros`` (a decoder's caches: float32, bf16 patterns, 8-bit codes) zeroes memory that
    comes uninitialised by a memset on the device, not by a copy of zeros made on the host."""
    import ml_dtypes
    from numba import cuda

    from attncomp.ir.types import NUMPY_DTYPES
    from tests.cuda_sim.helpers import projected_attention

    fn = ac.compile(load_example("gqa").grouped_query_attention, backend="cuda")
    bf16 = ac.compile(projected_attention(), backend="cuda").decoder(8, dtype="bf16").fn.program
    assert bf16.bf16_bits  # its caches kept as bf16 patterns
    original = cuda.device_array
    array_type = type(original(1))
    copy_in = array_type.copy_to_device

    def dirty(*args, **kwargs):  # memory as a device hands it out: anything
        array = original(*args, **kwargs)
        copy_in(array, np.full(array.shape, 7, array.dtype))
        return array

    copies = []
    monkeypatch.setattr(cuda, "device_array", dirty)
    monkeypatch.setattr(array_type, "copy_to_device", lambda self, *a, **k: copies.append(self))
    caches = [
        fn.compilation.program.zeros((2, 3, 5), np.float32),
        bf16.zeros((2, 3, 5), ml_dtypes.bfloat16, min(bf16.bf16_bits)),
        fn.compilation.program.zeros((2, 3, 5), NUMPY_DTYPES["f8e4m3"]),
    ]
    for cache in caches:
        bits = getattr(cache, "bits", cache)
        assert not bits.copy_to_host().any(), type(cache)
    assert copies == []
