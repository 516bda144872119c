"""8-bit pages in a paged decoder (``fn.paged_decoder(page_size, num_pages, cache="f8e4m3")``): the
pool holds codes and a float32 scale per (token, head) beside the pages, quantised on append and
dequantised as tiles are read.  Steps over several ragged sequences, forks and pages out of order
agree with the float64 interpreter run on the dequantised pool at float32's tolerance, and their
error against the unquantised result stays within what the type's rounding allows."""

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.ir.quantized import dequantize, quantize
from attncomp.ir.types import NUMPY_DTYPES
from attncomp.serving import PoolExhausted
from tests.e2e.test_8bit_cache import ROUNDING, causal_gqa, relative

CACHES = ["f8e4m3", "f8e5m2"]


@pytest.fixture(scope="module")
def compiled():
    return {backend: ac.compile(causal_gqa, backend=backend) for backend in ("interp", "cpu")}


class Served:
    """A paged decoder and every sequence's tokens so far, to check each step against whole calls."""

    def __init__(self, fn, cache, group, d, page_size=8, num_pages=64, dtype="f32", seed=0):
        self.srv = fn.paged_decoder(page_size=page_size, num_pages=num_pages, dtype=dtype, cache=cache)
        self.rng = np.random.default_rng(seed)
        self.kv, self.group, self.d, self.dtype = 2, group, d, dtype
        self.tokens: dict[int, list[np.ndarray]] = {}  # q, k, v of every position so far
        self.outputs: dict[int, list[np.ndarray]] = {}

    def draw(self, n):
        shapes = [(1, self.kv * self.group, n, self.d), (1, self.kv, n, self.d), (1, self.kv, n, self.d)]
        x = [self.rng.standard_normal(s).astype(np.float32) * scale for s, scale in zip(shapes, (1, 3, 3))]
        return [a.astype(ml_dtypes.bfloat16) for a in x] if self.dtype == "bf16" else x

    def new(self):
        seq = self.srv.new()
        self.tokens[seq], self.outputs[seq] = [], []
        return seq

    def fork(self, seq):
        child = self.srv.fork(seq)
        self.tokens[child], self.outputs[child] = list(self.tokens[seq]), []
        return child

    def step(self, counts: dict[int, int]) -> dict[int, np.ndarray]:
        new = {seq: self.draw(n) for seq, n in counts.items()}
        ys = self.srv.step({seq: tuple(x) for seq, x in new.items()})
        for seq, x in new.items():
            self.tokens[seq].append(x)
            self.outputs[seq].append(ys[seq])
        return ys

    def whole(self, seq, last: int) -> tuple[np.ndarray, ...]:
        """The sequence's queries, and its keys and values as the pool holds them (dequantised), and
        its last ``last`` outputs."""
        q = np.concatenate([t[0] for t in self.tokens[seq]], axis=2)
        keys, values = self.srv.pool.read(seq, 0, self.srv.length(seq))
        got = np.concatenate(self.outputs[seq], axis=2)[:, :, -last:]
        return q, keys, values, got.astype(np.float64)


def contiguous(pages: list[int]) -> bool:
    return pages == list(range(pages[0], pages[0] + len(pages))) if pages else True


@pytest.mark.parametrize("backend", ["interp", "cpu"])
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("group", "d"), [(4, 32), (3, 24)])
def test_paged_steps_agree_with_the_interpreter_on_the_dequantised_pool(compiled, backend, cache, group, d):
    """Three ragged sequences and a fork of one (cascade over its shared prompt), in pages handed out
    out of order; steps of one token (the few-row loops over codes, page by page), of six (a tile of
    many rows, dequantised for BLAS) and of three, prefills and decodes mixed."""
    s = Served(compiled[backend], cache, group, d, seed=group * d)
    a, b, c = s.new(), s.new(), s.new()
    s.step({a: 70, b: 5})
    s.step({c: 19, b: 9})  # b's pages follow a's and c's: not contiguous
    s.srv.free(c)
    c = s.new()
    s.step({c: 12})  # c takes the pages its predecessor freed, then new ones
    f = s.fork(a)  # shares a's 70 positions; its partial last page copied when it appends
    s.step({a: 1, b: 1, c: 1, f: 1})  # a and f attend their 64 shared positions once (cascade)
    s.step({a: 6, b: 1, c: 3, f: 1})
    s.step({a: 1, b: 6, c: 1, f: 3})
    assert s.srv.cascades >= 2
    assert not all(contiguous(s.srv.pool.sequence(seq).pages) for seq in (a, b, c, f))
    pool = s.srv.pool
    kv_codes, kv_scales = pool.arrays[0], pool.arrays[1]
    assert kv_codes.dtype == np.dtype(NUMPY_DTYPES[cache])
    assert kv_codes.shape == (64, 2, 8, d) and kv_scales.shape == (64, 2, 8) and kv_scales.dtype == np.float32
    for seq, last in ((a, 8), (b, 8), (c, 4), (f, 5)):
        q, keys, values, got = s.whole(seq, last)
        want = ac.interpret(causal_gqa, q, keys, values)[:, :, -last:]
        assert relative(got, want) < 2e-5, f"sequence {seq}"
    # the first steps too: a's prefill and its first decode
    q, keys, values, _ = s.whole(a, 1)
    got = np.concatenate(s.outputs[a], axis=2).astype(np.float64)
    assert relative(got, ac.interpret(causal_gqa, q, keys, values)) < 2e-5
    exact = ac.interpret(causal_gqa, q, *(np.concatenate([t[i] for t in s.tokens[a]], axis=2) for i in (1, 2)))
    assert 1e-4 < relative(got, exact)  # the pool was quantised


@pytest.mark.parametrize("cache", CACHES)
def test_the_error_against_the_unquantised_result_is_bounded_by_the_type(compiled, cache):
    """As for ``fn.decoder``'s 8-bit cache (tests/e2e/test_8bit_cache.py): per query row, values
    within ``u`` of their size, scores moved by at most ``u |q| max|k_j| / sqrt(D)``, so the output
    moves by at most ``max|v| (u + 2 max_j |ds_j|)``, to first order.  And the steps give what the
    interpreter gives on the tokens quantised by ``ir.quantized`` directly, not read from the pool."""
    s = Served(compiled["cpu"], cache, 4, 32, seed=7)
    a, b = s.new(), s.new()
    s.step({a: 60, b: 33})
    for n in (1, 1, 5, 1, 2):
        s.step({a: n, b: 1})
    u = ROUNDING[cache]
    for seq in (a, b):
        q, k, v = (np.concatenate([t[i] for t in s.tokens[seq]], axis=2) for i in range(3))
        got = np.concatenate(s.outputs[seq], axis=2).astype(np.float64)
        rounded = [dequantize(*quantize(x, cache)) for x in (k, v)]  # float32, as the steps read them
        assert relative(got, ac.interpret(causal_gqa, q, *rounded)) < 2e-5
        exact = ac.interpret(causal_gqa, q, k, v).astype(np.float64)
        q_norm = np.linalg.norm(q[0], axis=-1)
        k_norm = np.repeat(np.linalg.norm(k[0], axis=-1), 4, axis=0)
        causal_max = np.maximum.accumulate(k_norm, axis=-1)
        bound = np.max(np.abs(v)) * (u + 2 * u * q_norm * causal_max / np.sqrt(32)) * 1.1
        assert np.all(np.max(np.abs(got - exact)[0], axis=-1) <= bound)
        print(f"{cache}, sequence {seq}: largest error {relative(got, exact):.2e} of the largest output")


@pytest.mark.parametrize(("cache", "d"), [("f8e4m3", 32), ("f8e5m2", 128)])
def test_bf16_inputs_with_8bit_pages_on_the_cpu(compiled, cache, d):
    """A page's run of rows at a time; on a CPU with AVX-512 BF16 and VBMI on bf16 dot products."""
    s = Served(compiled["cpu"], cache, 4, d, dtype="bf16", seed=3)
    a, b = s.new(), s.new()
    s.step({a: 20, b: 3})
    ys = s.step({a: 1, b: 6})
    assert ys[a].dtype == ml_dtypes.bfloat16
    for seq in (a, b):
        q, keys, values, got = s.whole(seq, 21 if seq == a else 9)
        want = ac.interpret(causal_gqa, q, *(x.astype(ml_dtypes.bfloat16) for x in (keys, values)))
        assert relative(got, want.astype(np.float64)) < 1e-2  # bf16: the results' rounding


def test_the_pool_takes_about_half_of_a_bf16_pools_memory(compiled):
    """Codes and scales: ``(d + 4) / 2d`` of bf16's bytes a position, 0.516 for D = 128."""
    sizes = {}
    for cache in (None, "f8e4m3"):
        s = Served(compiled["interp"], cache, 4, 128, dtype="bf16")
        s.step({s.new(): 3})
        sizes[cache] = s.srv.pool.bytes_per_position
    assert sizes["f8e4m3"] / sizes[None] == (128 + 4) / 256


def test_the_cache_type_is_in_the_ir_and_the_pipeline(compiled):
    srv = compiled["cpu"].paged_decoder(page_size=8, num_pages=4, cache=ac.f8e5m2)
    assert srv.cache == "f8e5m2" and srv.pool.cache == "f8e5m2"
    text = srv.paged.fn.ir("chunk-pairs")
    assert 'cache_type = "f8e5m2"' in text
    assert (
        "%k_pages: tensor<num_pages x KV x page_size x D x f8e5m2>, %k_scales: tensor<num_pages x KV x page_size x f32>"
        in text
    )
    view = "ac.page_view %k_pages, %page_table, %k_scales {rows = k_rows} : tensor<B_chunk x KV x k_rows x D x f32>"
    assert view in text
    assert "chunk-pairs{ragged=true,paged=true,cache=f8e5m2}" in srv.paged.fn.pipeline
    assert str(ac.parse_ir(text)) == text
    source = srv.paged.fn.source
    assert "dequantize_rows(" in source and "scale_keys(sg, " in source


def test_a_failed_step_changes_nothing(compiled):
    s = Served(compiled["cpu"], "f8e4m3", 2, 16, num_pages=4)
    a = s.new()
    s.step({a: 21})  # 3 pages of 8
    pool = s.srv.pool
    before = [x.tobytes() for x in pool.host_arrays()], pool.pages_free, s.srv.length(a)
    with pytest.raises(PoolExhausted, match="needs 2 pages, 1 are free"):
        s.step({a: 12})
    with pytest.raises(ac.ShapeError):
        s.srv.step({a: tuple(x[:, :, :1] if i else x for i, x in enumerate(s.draw(2)))})
    assert ([x.tobytes() for x in pool.host_arrays()], pool.pages_free, s.srv.length(a)) == before


def test_bad_cache_types_are_refused_naming_the_argument(compiled):
    fn = compiled["cpu"]
    for bad in ("f8", "bf16", ac.f32, 8):
        with pytest.raises(ValueError, match=r"^cache: an 8-bit cache type is one of f8e4m3, f8e5m2"):
            fn.paged_decoder(page_size=8, num_pages=4, cache=bad)
    cut = "softmax-fusion,chunk-pairs{part=attention,ragged=true,paged=true,cache=i8}"
    with pytest.raises(ac.PipelineError, match="chunk-pairs: cache must be one of f8e4m3, f8e5m2"):
        ac.compile(causal_gqa, backend="interp", pipeline=cut)
    with pytest.raises(ac.PipelineError, match=r"chunk-pairs: cache= is the element type of a paged attention"):
        ac.compile(causal_gqa, backend="interp", pipeline="softmax-fusion,chunk-pairs{cache=f8e4m3}")
