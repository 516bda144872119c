"""bf16 kept in 16 bits on the device by the paged pool and by decoders whose keys are computed.

A paged decoder's pool takes its storage from the function that reads the pages: bf16 pages as their
patterns (half the bytes), written and copied on write as 16-bit words, read through the page table by
the attention (its own pages and a shared prefix in cascade alike).  A decoder whose keys and values
are computed in the spec appends them rounded to bf16 (to nearest even) into a 16-bit cache.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

import attncomp as ac
from attncomp.backends.numba_cuda.host.arrays import Bf16Bits, widen
from attncomp.backends.numba_cuda.warp import round_bf16
from attncomp.testing import TOLERANCE, worst_error
from tests.conftest import load_example
from tests.cuda_sim.helpers import projected_attention, retyped
from tests.e2e.test_paged_decoder import snapshot
from tests.passes.specs import generic_alibi as alibi

BF16 = ml_dtypes.bfloat16
SLOPES = np.array([0.5, 0.25]).astype(BF16)


def tokens(rng, n: int, heads: int = 2) -> tuple:
    """One sequence's new queries, keys and values (bf16) and the slopes."""
    return (*(rng.standard_normal((1, heads, n, 8)).astype(BF16) for _ in range(3)), SLOPES)


def serve(dtype: str, steps: list[dict]) -> tuple:
    """A prompt of 9 tokens for sequence 0, a fork of it, then ``steps`` (sequence -> token inputs):
    the server and each step's outputs.  Pages of 4: the fork shares two full pages (read in cascade)
    and a partial one (copied on write by the first holder to append)."""
    srv = ac.compile(alibi, backend="cuda").paged_decoder(page_size=4, num_pages=8, dtype=dtype)
    srv.cascade_min = 4
    outputs = []
    for batch in steps:
        if batch == "fork":
            srv.fork(0)
            continue
        if not srv.pool.sequences:
            srv.new()
        outputs.append(srv.step({seq: tuple(as_type(x, dtype) for x in args) for seq, args in batch.items()}))
    return srv, outputs


def as_type(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(np.float32) if dtype == "f32" else x


@pytest.fixture(scope="module")
def history():
    """Sequence 0: 9 tokens, then 3; its fork (sequence 1): 2 tokens, decoded together with 0's."""
    rng = np.random.default_rng(3)
    first, later, forked = tokens(rng, 9), tokens(rng, 3), tokens(rng, 2)
    steps = [{0: first}, "fork", {0: later, 1: forked}]
    return steps, first, later, forked


@pytest.fixture(scope="module")
def bf16_server(history):
    return serve("bf16", history[0])


def whole(parts: list[tuple]) -> list[np.ndarray]:
    """The token inputs of a sequence's history, concatenated, with the slopes."""
    return [*(np.concatenate([p[k] for p in parts], axis=2) for k in range(3)), SLOPES]


def test_the_pool_holds_bf16_patterns(bf16_server, history):
    """16-bit device arrays (half the bytes of the float32 pool), read back as the bf16 appended; the
    fork's partial page was copied on write, its shared pages read once in cascade."""
    srv, _ = bf16_server
    _, first, later, forked = history
    assert srv.paged.fn.program.attention[0].storage == "bits" and {1, 2} <= srv.paged.fn.program.bf16_bits
    assert srv.pool.storage.bits
    assert all(isinstance(a, Bf16Bits) and a.bits.dtype == np.uint16 for a in srv.pool.arrays)
    wide = ac.compile(alibi, backend="cuda").paged_decoder(page_size=4, num_pages=8, dtype="f32")
    wide.step({wide.new(): tuple(as_type(x, "f32") for x in first)})
    assert not wide.pool.storage.bits and all(a.dtype == np.float32 for a in wide.pool.arrays)
    assert 2 * srv.pool.bytes_per_position == wide.pool.bytes_per_position
    assert srv.cascades == 1 and srv.pages_free == 8 - 4  # three pages, and the partial one copied on write
    keys, values = srv.pool.read(0, 0, 12)
    np.testing.assert_array_equal(keys, whole([first, later])[1])
    np.testing.assert_array_equal(values, whole([first, later])[2])
    keys, values = srv.pool.read(1, 0, 11)
    np.testing.assert_array_equal(keys, whole([first, forked])[1])
    assert srv.pool.sequence(0).pages[:2] == srv.pool.sequence(1).pages[:2]  # the full pages still shared
    assert srv.pool.sequence(0).pages[2] != srv.pool.sequence(1).pages[2]  # the partial one copied


def test_a_bf16_pool_against_the_interpreter_and_the_float32_pool(bf16_server, history):
    """Each sequence's outputs against the float64 interpreter on its whole history (the same bf16
    inputs), and against the float32 pool given the same values."""
    srv, got = bf16_server
    steps, first, later, forked = history
    _, wide = serve("f32", steps)
    reference = ac.compile(alibi, backend="interp").for_dtype("bf16").compilation
    for seq, parts in ((0, [first, later]), (1, [first, forked])):
        ours = [step[seq] for step in got if seq in step]
        want = reference.run(whole(parts), exact=True)[0][:, :, -sum(o.shape[2] for o in ours) :]
        mine = np.concatenate(ours, axis=2)
        assert worst_error([mine], [want]) < TOLERANCE["bf16"]
        theirs = np.concatenate([step[seq] for step in wide if seq in step], axis=2)
        assert worst_error([mine], [theirs]) < TOLERANCE["bf16"]


def test_a_failed_step_leaves_the_bf16_pool_as_it_was(history):
    from attncomp.serving import PoolExhausted

    rng = np.random.default_rng(5)
    srv, _ = serve("bf16", history[0][:2])
    before = snapshot(srv)
    bad = [
        ({0: tokens(rng, 1), 1: tokens(rng, 20)}, PoolExhausted, r"needs 6 pages, 5 are free"),
        ({0: tokens(rng, 1), 1: tokens(rng, 1, heads=3)}, ac.ShapeError, "slopes: dimension H is 2"),
    ]
    for batch, error, message in bad:
        with pytest.raises(error, match=message):
            srv.step(batch)
        assert snapshot(srv) == before


def test_patterns_are_never_read_as_float32():
    """16-bit device memory given for an argument the kernels read widened (the slopes) is widened by a
    kernel, never reinterpreted: the same output as the host call's; a strided view is refused."""
    rng = np.random.default_rng(0)
    q, k, v, slopes = tokens(rng, 5)
    bf16 = ac.compile(alibi, backend="cuda").for_dtype("bf16").compilation
    assert 3 not in bf16.program.bf16_bits
    on_host = bf16.run([q, k, v, slopes])[0]
    on_device = [Bf16Bits(cuda.to_device(x.view(np.uint16))) for x in (q, k, v, slopes)]
    got = bf16.run(on_device)[0]
    assert isinstance(got, Bf16Bits)
    np.testing.assert_array_equal(got.copy_to_host().view(np.uint16), on_host.view(np.uint16))
    wide = widen(on_device[3])
    assert wide.dtype == np.float32
    np.testing.assert_array_equal(wide.copy_to_host(), slopes.astype(np.float32))
    strided = Bf16Bits(cuda.to_device(np.repeat(slopes.view(np.uint16), 2))[::2])
    with pytest.raises(TypeError, match="slopes: .* needs it C-contiguous"):
        bf16.run([*on_device[:3], strided])


def test_a_decoder_step_takes_bf16_patterns_on_the_device():
    """``fn.decoder`` steps given their bf16 inputs as device patterns (``Bf16Bits``, what a torch CUDA
    bf16 tensor passed to a call becomes) read their shapes as bf16 and give the host call's bits."""
    rng = np.random.default_rng(2)
    fn = ac.compile(alibi, backend="cuda")
    steps = [tokens(rng, 5), tokens(rng, 1)]
    on_host, on_device = fn.decoder(8, dtype="bf16"), fn.decoder(8, dtype="bf16")
    for step in steps:
        want = on_host(*step)
        got = on_device(*(Bf16Bits(cuda.to_device(x.view(np.uint16))) for x in step))
        assert isinstance(got, Bf16Bits)
        np.testing.assert_array_equal(got.copy_to_host().view(np.uint16), want.view(np.uint16))


# decoders whose keys and values are computed -------------------------------------------------
def test_computed_keys_are_cached_rounded_to_bf16():
    """Projected, rotated and normed keys (computed in float32) are appended rounded to bf16: the cache
    is 16-bit, equals the float32 decoder's cache rounded, and the outputs match the interpreter's;
    the query is rounded into 16 bits for the attention, a failed step changes nothing."""
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(shape).astype(BF16) for shape in [(1, 6, 16), (16, 16), (16, 8), (16, 8)]]
    spec = projected_attention()
    fn = ac.compile(spec, backend="cuda")
    dec, wide = fn.decoder(8, dtype="bf16"), fn.decoder(8, dtype="f32")
    steps = [(0, 4), (4, 5), (5, 6)]
    outs = [dec(args[0][:, a:b], *args[1:]) for a, b in steps]
    for a, b in steps:
        wide(*(x.astype(np.float32) for x in (args[0][:, a:b], *args[1:])))
    program = dec.fn.program
    assert program.bf16_bits == {4, 5} and program.attention[0].storage == "bits"  # the caches
    assert "round_bf16(new_0[" in program.driver_source and "bf16_patterns" in program.driver_source
    cache = dec.cache
    assert all(isinstance(c, Bf16Bits) and c.bits.dtype == np.uint16 for c in cache.values())
    for name, c in cache.items():
        float32 = wide.cache[name].copy_to_host()
        assert float32.dtype == np.float32 and not np.array_equal(float32, float32.astype(BF16))
        np.testing.assert_array_equal(c.copy_to_host(), float32.astype(BF16))
    got = np.concatenate(outs, axis=2)
    want = ac.compile(spec, backend="interp").for_dtype("bf16").compilation.run(args, exact=True)
    assert worst_error([got], want) < TOLERANCE["bf16"]
    before = dec.cache["k_cache"].copy_to_host()
    with pytest.raises(ac.ShapeError):
        dec(args[0][:, :1], args[1][:8], *args[2:])
    assert dec.length == 6
    np.testing.assert_array_equal(dec.cache["k_cache"].copy_to_host(), before)


def test_rounding_to_bf16_on_the_device():
    """``round_bf16``: to nearest even (ties both ways), NaN kept, overflow to infinity, subnormals,
    signed zeros: what ml_dtypes gives, bit for bit."""
    words = [0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F7FFF, 0x00008000, 0x00018000]
    words += [0x807FFFFF, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F808000]
    special = np.array(words, dtype=np.uint32).view(np.float32)
    x = np.concatenate([special, np.random.default_rng(0).standard_normal(64).astype(np.float32) * 1e3])
    out = cuda.to_device(np.zeros(x.size, np.uint16))
    rounded[1, 8](out, cuda.to_device(x))
    got = out.copy_to_host()
    with np.errstate(invalid="ignore"):  # numpy warns casting NaN
        want = x.astype(BF16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(BF16).astype(np.float32)).all()
    np.testing.assert_array_equal(got[nan] >> 15, want[nan] >> 15)  # the sign kept


@cuda.jit
def rounded(out, x):
    for n in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[n] = round_bf16(x[n])


def test_multi_query_attention_over_bf16_pages():
    """One key/value head (``examples/gqa.py``'s multi-query attention, whose head index is a constant
    of the IR's loop body) over bf16 pages: a prefill of 19 tokens then 2, each page's rows copied by
    the asynchronous-copy kernel through the page table, against the whole history at once."""
    spec = retyped(load_example("gqa").multi_query_attention, "bf16")
    srv = ac.compile(spec, backend="cuda").paged_decoder(page_size=16, num_pages=8, dtype="bf16")
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 21, 64)).astype(BF16)
    k, v = (rng.standard_normal((1, 1, 21, 64)).astype(BF16) for _ in range(2))
    seq = srv.new()
    first = srv.step({seq: (q[:, :, :19], k[:, :, :19], v[:, :, :19])})[seq]
    second = srv.step({seq: (q[:, :, 19:], k[:, :, 19:], v[:, :, 19:])})[seq]
    got = np.concatenate([np.asarray(first, np.float32), np.asarray(second, np.float32)], axis=2)
    assert "cp_async16(" in srv.paged.fn.source
    assert worst_error(got, ac.interpret(spec, q, k, v)) < TOLERANCE["bf16"]
