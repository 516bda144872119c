"""Arguments and results of the CUDA backend under the simulator: device arrays in and
out, float16 storage, float64 specs, rows with no visible key, gather bounds, checks."""

import numpy as np
import pytest

import attncomp as ac
from attncomp.backends.numba_cuda.host.arrays import is_device
from attncomp.testing import TOLERANCE, worst_error
from tests.conftest import load_example
from tests.cuda_sim.helpers import PIPELINE, as_list, build_cuda, host, run_cuda
from tests.passes import specs as pass_specs


def _causal_inputs(rng, t=13, s=11, d=8):
    q = rng.standard_normal((1, 3, t, d)).astype(np.float32)
    k = rng.standard_normal((1, 3, s, d)).astype(np.float32)
    v = rng.standard_normal((1, 3, s, d)).astype(np.float32)
    return q, k, v


def test_device_arrays_stay_on_the_device():
    from numba import cuda

    q, k, v = _causal_inputs(np.random.default_rng(0))
    fn, impl = build_cuda(pass_specs.causal)
    on_host = impl.call(fn.func, [q, k, v], fn.constraints)
    on_device = impl.call(fn.func, [cuda.to_device(x) for x in (q, k, v)], fn.constraints)
    assert isinstance(on_host, np.ndarray)
    assert is_device(on_device) and not isinstance(on_device, np.ndarray)
    np.testing.assert_array_equal(host(on_device), on_host)
    assert worst_error([on_host], [ac.interpret(pass_specs.causal, q, k, v)]) < 5 * TOLERANCE["f32"]


def test_device_arguments_are_checked_without_copies():
    from numba import cuda

    q, k, v = _causal_inputs(np.random.default_rng(0))
    fn, impl = build_cuda(pass_specs.causal)
    with pytest.raises(ac.ShapeError, match="dimension D is 4"):
        impl.call(
            fn.func,
            [cuda.to_device(q), cuda.to_device(np.ascontiguousarray(k[..., :4])), cuda.to_device(v)],
            fn.constraints,
        )
    with pytest.raises(TypeError, match="f32"):
        impl.call(fn.func, [cuda.to_device(q.astype(np.float64)), k, v], fn.constraints)


def test_device_arguments_seen_before_bind_by_their_key_alone():
    """A call whose device arguments have the kinds, element types and shapes of an earlier call's
    takes the sizes that call bound (no stand-ins, no checks: they read nothing else); new shapes, and
    wrong ones, go through the checks again."""
    from numba import cuda

    rng = np.random.default_rng(1)
    fn, impl = build_cuda(pass_specs.causal)
    seen = impl._bound
    first = [cuda.to_device(x) for x in _causal_inputs(rng)]
    want = host(impl.call(fn.func, first, fn.constraints))
    (keys,) = seen.values()
    assert len(keys) == 1
    again = [cuda.to_device(x) for x in _causal_inputs(rng)]
    got = host(impl.call(fn.func, again, fn.constraints))
    assert len(keys) == 1
    assert worst_error([got], [ac.interpret(pass_specs.causal, *map(host, again))]) < 5 * TOLERANCE["f32"]
    assert not np.array_equal(got, want)
    impl.call(fn.func, [cuda.to_device(x) for x in _causal_inputs(rng, t=9, s=7)], fn.constraints)
    assert len(keys) == 2
    q, k, v = _causal_inputs(rng)
    with pytest.raises(ac.ShapeError, match="dimension D is 4"):
        impl.call(
            fn.func,
            [cuda.to_device(q), cuda.to_device(np.ascontiguousarray(k[..., :4])), cuda.to_device(v)],
            fn.constraints,
        )
    assert len(keys) == 2


def test_float16_storage_with_float32_accumulation():
    @ac.spec
    def half(q: ac.f16["T", "D"], k: ac.f16["S", "D"], v: ac.f16["S", "E"]):
        return ac.softmax(q @ k.mT * 0.5, axis=-1) @ v

    rng = np.random.default_rng(2)
    q, k = (rng.standard_normal((n, 8)).astype(np.float16) for n in (19, 17))
    v = rng.standard_normal((17, 6)).astype(np.float16)
    for pipeline in (PIPELINE, ""):
        (out,) = run_cuda(half, [q, k, v], pipeline)
        assert out.dtype == np.float16
        assert worst_error([out], [ac.interpret(half, q, k, v)]) < TOLERANCE["f16"]


def test_float64_specs_accumulate_in_float64():
    @ac.spec
    def double(q: ac.f64["T", "D"], k: ac.f64["S", "D"], v: ac.f64["S", "D"]):
        return ac.softmax(q @ k.mT, axis=-1) @ v

    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((19, 8)), rng.standard_normal((17, 8))
    (out,) = run_cuda(double, [q, k, k])
    assert out.dtype == np.float64
    assert worst_error([out], [ac.interpret(double, q, k, k)]) < 1e-10


@pytest.mark.parametrize("pipeline", [PIPELINE, ""], ids=["tiled", "unfused"])
def test_rows_with_no_visible_key_give_zeros_and_minus_inf(pipeline):
    spec = load_example("lse").key_padding_with_lse
    rng = np.random.default_rng(4)
    q, k, v = _causal_inputs(rng, t=13, s=19)
    lengths = np.array([0], dtype=np.int32)  # batch 0 sees no key at all
    inputs = [q, k, v, lengths] if len(spec.ir.main.args) == 4 else None
    assert inputs is not None, "lse.key_padding_with_lse takes (q, k, v, lengths)"
    out, lse = run_cuda(spec, inputs, pipeline)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    lengths[0] = 12  # keys 0..11 visible: two key blocks of 8, the second partly
    got = run_cuda(spec, inputs, pipeline)
    assert worst_error(got, as_list(ac.interpret(spec, *inputs))) < 5 * TOLERANCE["f32"]


def test_gather_out_of_range_is_an_index_error():
    @ac.spec
    def pick(table: ac.f32["N"], idx: ac.i32["T"]):
        return table[idx] * 2.0

    table = np.arange(4, dtype=np.float32)
    (ok,) = run_cuda(pick, [table, np.array([3, 0, 2], np.int32)], "")
    np.testing.assert_array_equal(ok, table[[3, 0, 2]] * 2)
    with pytest.raises(IndexError, match="index 4 is out of range for axis 0 of size 4"):
        run_cuda(pick, [table, np.array([1, 4], np.int32)], "")


def test_new_sizes_reuse_kernels_and_new_head_dims_specialise():
    fn, impl = build_cuda(pass_specs.causal)
    rng = np.random.default_rng(6)
    for t, s in [(1, 1), (9, 17), (24, 5)]:
        q, k, v = _causal_inputs(rng, t, s)
        got = impl.call(fn.func, [q, k, v], fn.constraints)
        assert worst_error([got], [ac.interpret(pass_specs.causal, q, k, v)]) < 5 * TOLERANCE["f32"]
    assert impl.attention[0].specialised == [(8, 8)]
    q, k, v = _causal_inputs(rng, 5, 6, d=4)
    impl.call(fn.func, [q, k, v], fn.constraints)
    assert impl.attention[0].specialised == [(8, 8), (4, 4)]
    assert "D = 4, E = 4" in impl.source


def test_compile_with_backend_cuda():
    from attncomp.backends import BACKENDS

    if "cuda" not in BACKENDS:
        pytest.skip("attncomp/api.py does not register the cuda backend yet")
    q, k, v = _causal_inputs(np.random.default_rng(7))
    fn = ac.compile(pass_specs.causal, backend="cuda", pipeline=PIPELINE)
    got = fn(q, k, v)
    assert worst_error([got], [ac.interpret(pass_specs.causal, q, k, v)]) < 5 * TOLERANCE["f32"]
    assert "cuda.jit" in fn.source


def test_decoding_with_a_kv_cache_matches_the_whole_sequence():
    """The kv-cache-reuse graph (cache appends, absolute positions), step by step, as a decoder runs it."""
    module = load_example("nanochat_attention")
    spec = module.nanochat_attention
    pipeline = "cse,softmax-fusion,kv-cache-reuse," + PIPELINE.split("softmax-fusion,")[1]
    fn, impl = build_cuda(spec, pipeline)
    x, *weights = module.make_inputs(np.random.default_rng(0))
    cache_shape = tuple(
        d.value if d.is_const else {"B": 1, "N_max": 32}.get(str(d), 4) for d in fn.func.args[-1].type.shape
    )
    k_cache, v_cache = np.zeros(cache_shape, np.float32), np.zeros(cache_shape, np.float32)
    outputs, length = [], 0
    for step in (10, 3, 3):
        out, new_k, new_v = impl.run(
            fn.func, [x[:, length : length + step], *weights, k_cache, v_cache], fn.constraints, {"N_cached": length}
        )
        k_cache[:, :, length : length + step], v_cache[:, :, length : length + step] = new_k, new_v
        outputs.append(out)
        length += step
    want = ac.interpret(spec, x, *weights)
    assert worst_error([np.concatenate(outputs, axis=1)], [want]) < 5 * TOLERANCE["f32"]
