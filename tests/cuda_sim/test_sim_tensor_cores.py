"""The tensor-core kernels: warp instructions against the fragment layouts of ``mma/atoms.py``'s
table, and the f16/bf16 attention kernels against the float64 interpreter.

Under the simulator the warp instructions run ``mma/warp_sim.py``'s emulation; on a GPU
(``ATTNCOMP_TEST_GPU=1``) the same tests run the PTX, so the two are held to one layout
(``attncomp/backends/numba_cuda/mma/atoms.py``).  The simulator runs a few example specs (every
CUDA thread is a Python thread); a GPU runs every example in f16 and in bf16.
"""

import os

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from attncomp.backends.numba_cuda.mma import warp_sim
from attncomp.backends.numba_cuda.mma.atoms import ACCUMULATOR, ATOMS, HALF_SHIFTS, LANES, M16N8K16, MmaAtom
from attncomp.backends.numba_cuda.warp import mma_bf16, mma_f16, pack_bf16x2, pack_f16x2, quad_max, quad_sum
from attncomp.testing import TOLERANCE, random_inputs, worst_error
from tests.conftest import load_example
from tests.cuda_sim.helpers import as_list, build_cuda, host, retyped
from tests.passes.test_translation_validation import _cases

ON_GPU = os.environ.get("NUMBA_ENABLE_CUDASIM") != "1"
#: two warps of query rows, one key tile = one P V product
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=32,block_k=16},mask-elimination,canonicalize,cse,dce"
SIZES = {"B": 1, "H": 2, "KV": 1, "T": 33, "S": 35, "D": 16, "E": 16, "R": 33}
ELEMENT = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}
#: where a register's high half starts
HIGH = HALF_SHIFTS[1]


def bits_of(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(ELEMENT[dtype]).view(np.uint16)


def places(fragment) -> np.ndarray:
    """A fragment's (row, column) places by lane, register and element of the register (``mma_atoms``)."""
    return np.array(fragment.places(), np.int32)


# -- the table against numpy, through the emulation -------------------------------------------------


def element_values(x: np.ndarray, element: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as the element type's values (float64) and their register bits (uint32: 16-bit patterns,
    or tf32 as float32 bits with the low 13 zero)."""
    if element == "tf32":
        bits = x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
        return bits.view(np.float32).astype(np.float64), bits
    bits = bits_of(x, element)
    return bits.view(ELEMENT[element]).astype(np.float64), bits.astype(np.uint32)


def registers(fragment, bits: np.ndarray) -> np.ndarray:
    """Every lane's registers of an operand (32 x registers, uint32) packed from its bits by the table."""
    at = places(fragment)
    halves = bits[at[..., 0], at[..., 1]].astype(np.uint32)
    return np.bitwise_or.reduce(halves << np.array(HALF_SHIFTS[: fragment.per_register], np.uint32), axis=-1)


def emulated(atom: MmaAtom, element: str, a_regs: np.ndarray, b_regs: np.ndarray, c: np.ndarray) -> np.ndarray:
    """D (m x n) of the emulated product of the warp's registers, its places read by the table."""
    at = places(atom.c)[..., 0, :]
    rows = [(*a_regs[lane], *b_regs[lane], *c[at[lane, :, 0], at[lane, :, 1]]) for lane in range(LANES)]
    d = getattr(warp_sim, f"_mma_{element}")(rows)
    out = np.zeros((atom.m, atom.n))
    out[at[..., 0], at[..., 1]] = d
    return out


@pytest.mark.parametrize("element", ["f16", "bf16", "tf32"])
def test_fragments_built_from_the_atom_table_multiply(element):
    """Fragments placed by the table for random A, B and C: the emulated ``mma`` is ``A @ B + C``."""
    atom, rng = ATOMS[element], np.random.default_rng(2)
    a, a_bits = element_values(rng.standard_normal((atom.m, atom.k)), element)
    b, b_bits = element_values(rng.standard_normal((atom.k, atom.n)), element)
    c = rng.standard_normal((atom.m, atom.n)).astype(np.float32)
    got = emulated(atom, element, registers(atom.a, a_bits), registers(atom.b, b_bits), c)
    np.testing.assert_allclose(got, a @ b + c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("element", ["f16", "tf32"])
def test_accumulators_feed_the_next_product(element):
    """The accumulators of ``tiles`` products (S, m x k) fed as the A fragment of the next by the
    atom's ``feed``, and B's rows read in its ``fed_b_rows``: the product is ``S @ V``."""
    atom, rng = ATOMS[element], np.random.default_rng(3)
    s, _ = element_values(rng.standard_normal((atom.m, atom.k)), element)
    v, v_bits = element_values(rng.standard_normal((atom.k, atom.n)), element)
    c_at = places(atom.c)[..., 0, :]
    tiles = [s[:, tile * atom.n : (tile + 1) * atom.n] for tile in range(atom.tiles)]
    a_regs = np.zeros((LANES, atom.a.registers), np.uint32)
    b_regs = np.zeros((LANES, atom.b.registers), np.uint32)
    for lane in range(LANES):
        for r, halves in enumerate(atom.feed()):
            for h, (tile, e) in enumerate(halves):
                value = tiles[tile][c_at[lane, e, 0], c_at[lane, e, 1]]
                a_regs[lane, r] |= element_values(np.array([[value]]), element)[1][0, 0] << np.uint32(HALF_SHIFTS[h])
        first = atom.c.first_col(lane)
        for r, rows in enumerate(atom.fed_b_rows()):
            for h, row in enumerate(rows):
                b_regs[lane, r] |= v_bits[first + row, atom.b.place(lane, r, h)[1]] << np.uint32(HALF_SHIFTS[h])
    got = emulated(atom, element, a_regs, b_regs, np.zeros((atom.m, atom.n), np.float32))
    np.testing.assert_allclose(got, s @ v, rtol=1e-5, atol=1e-5)
    assert sorted(atom.k_order()) == list(range(atom.k))


def test_derived_facts_of_the_atoms():
    """What the writers read: the 16-bit accumulators feed in place, tf32's in the order (0, 2, 1, 3)."""
    assert M16N8K16.k_order() == tuple(range(16)) and M16N8K16.tiles == 2
    assert (M16N8K16.k_half, ATOMS["tf32"].k_half) == (8, 4)
    assert ATOMS["tf32"].feed_order() == (0, 2, 1, 3)
    assert ATOMS["tf32"].k_order() == (0, 2, 4, 6, 1, 3, 5, 7)
    for atom in (M16N8K16, ATOMS["tf32"]):
        assert atom.a_words == ((0, 0), (8, 0), (0, 4), (8, 4)) and atom.b_words == (0, 4) and atom.step_words == 8
    assert ACCUMULATOR.by_row() == ((0, (0, 1)), (8, (2, 3))) and ACCUMULATOR.columns() == (0, 1)
    assert ACCUMULATOR.row_lane_masks() == (1, 2) and ACCUMULATOR.next_row_mask() == 4


# -- the table against the instructions (the emulation in the simulator, the PTX on a GPU) ------------


@cuda.jit(device=True)
def word(lo, hi):
    return np.uint32(lo) | (np.uint32(hi) << np.uint32(HIGH))


@cuda.jit(device=True)
def packed(m, at, lane, r):
    """Register ``r`` of a lane: the two 16-bit patterns at its places (``at``: the table)."""
    return word(m[at[lane, r, 0, 0], at[lane, r, 0, 1]], m[at[lane, r, 1, 0], at[lane, r, 1, 1]])


@cuda.jit(device=True)
def accumulators(c, at, lane):
    """A lane's four accumulator registers, from their places in ``c`` (``at``: the table)."""
    return (
        c[at[lane, 0, 0, 0], at[lane, 0, 0, 1]],
        c[at[lane, 1, 0, 0], at[lane, 1, 0, 1]],
        c[at[lane, 2, 0, 0], at[lane, 2, 0, 1]],
        c[at[lane, 3, 0, 0], at[lane, 3, 0, 1]],
    )


@cuda.jit(device=True)
def store_accumulators(out, at, lane, d0, d1, d2, d3):
    """A lane's four accumulator registers, back to their places in ``out``."""
    out[at[lane, 0, 0, 0], at[lane, 0, 0, 1]] = d0
    out[at[lane, 1, 0, 0], at[lane, 1, 0, 1]] = d1
    out[at[lane, 2, 0, 0], at[lane, 2, 0, 1]] = d2
    out[at[lane, 3, 0, 0], at[lane, 3, 0, 1]] = d3


def fragment_kernel(mma):
    """A kernel of one warp: A (16 x 16), B (16 x 8) bits and C (16 x 8) -> fragments placed by the
    atom table, one product, the D fragments back to their places."""

    @cuda.jit
    def product(a, b, c, a_at, b_at, c_at, out):
        lane = cuda.threadIdx.x
        a0, a1, a2, a3 = (
            packed(a, a_at, lane, 0),
            packed(a, a_at, lane, 1),
            packed(a, a_at, lane, 2),
            packed(a, a_at, lane, 3),
        )
        b0, b1 = packed(b, b_at, lane, 0), packed(b, b_at, lane, 1)
        c0, c1, c2, c3 = accumulators(c, c_at, lane)
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        store_accumulators(out, c_at, lane, d0, d1, d2, d3)

    return product


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_mma_fragments_follow_the_documented_layout(dtype):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 16)), rng.standard_normal((16, 8))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    a_bits, b_bits = bits_of(a, dtype), bits_of(b, dtype)
    out = np.zeros((16, 8), np.float32)
    tables = places(M16N8K16.a), places(M16N8K16.b), places(M16N8K16.c)
    fragment_kernel(mma_f16 if dtype == "f16" else mma_bf16)[1, 32](a_bits, b_bits, c, *tables, out)
    exact = a_bits.view(ELEMENT[dtype]).astype(np.float64) @ b_bits.view(ELEMENT[dtype]).astype(np.float64) + c
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-5)


@cuda.jit
def quad_kernel(x, y, sums, maxima, f16_words, bf16_words):
    lane = cuda.threadIdx.x
    sums[lane] = quad_sum(x[lane])
    maxima[lane] = quad_max(x[lane])
    f16_words[lane] = pack_f16x2(x[lane], y[lane])
    bf16_words[lane] = pack_bf16x2(x[lane], y[lane])


def test_quad_reductions_and_packing():
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal(32).astype(np.float32) for _ in range(2))
    sums, maxima = np.zeros(32, np.float32), np.zeros(32, np.float32)
    f16_words, bf16_words = np.zeros(32, np.uint32), np.zeros(32, np.uint32)
    quad_kernel[1, 32](x, y, sums, maxima, f16_words, bf16_words)
    # the lanes that share an accumulator row (the table's): every combination of its masks
    masks = ACCUMULATOR.row_lane_masks()
    sharing = [
        sorted({lane ^ (m1 * masks[0]) ^ (m2 * masks[1]) for m1 in (0, 1) for m2 in (0, 1)}) for lane in range(32)
    ]
    assert all(len({ACCUMULATOR.place(other, 0)[0] for other in group}) == 1 for group in sharing)
    np.testing.assert_allclose(sums, [x[group].astype(np.float64).sum() for group in sharing], rtol=1e-6)
    np.testing.assert_array_equal(maxima, [x[group].max() for group in sharing])
    low, high = HALF_SHIFTS
    for words, dtype in ((f16_words, "f16"), (bf16_words, "bf16")):
        np.testing.assert_array_equal((words >> low) & 0xFFFF, bits_of(x, dtype))  # the first value: half 0
        np.testing.assert_array_equal(words >> high, bits_of(y, dtype))  # rounded to nearest even


def attention_cases():
    """(id, spec) of the example specs a tensor-core kernel can take, with sizes from ``SIZES``."""
    found = []
    for case in _cases():
        spec = case.values[1]
        names = {d.symbol for a in spec.ir.main.args for d in a.type.shape if d.is_symbol}
        if not spec.generic and names <= set(SIZES) and "D" in names:
            found.append((case.id, spec))
    return found


#: what the simulator runs: captured tensors, GQA, LSE, key padding, documents, sinks, soft-capping,
#: and a spec with nothing fused (its probabilities returned: graph kernels only)
IN_SIMULATOR = {
    ("alibi.causal_alibi", "bf16"),
    ("alibi.causal_alibi", "f16"),
    ("gqa.grouped_query_attention", "bf16"),
    ("lse.key_padding_with_lse", "f16"),
    ("document_mask.causal_document_mask", "bf16"),
    ("sinks_window.sinks_window", "bf16"),
    ("softcap.causal_softcap", "f16"),
    ("relative_bias.relative_bias", "bf16"),
    ("pass_specs.returns_probabilities", "f16"),
}


#: specs with no fused attention: one that returns its probabilities keeps them, so softmax-fusion
#: leaves the softmax and both products to the graph kernels (float32 arithmetic, no tensor cores)
UNFUSED = {"pass_specs.returns_probabilities"}


def run_16_bit(spec, dtype: str, split: int | None = None, sizes: dict | None = None, seed: int = 3):
    typed = retyped(spec, dtype)
    fn, impl = build_cuda(typed, PIPELINE, split=split)
    sizes = {**SIZES, **(sizes or {})}
    inputs = random_inputs(typed.ir.main, sizes, seed=seed)
    rng = np.random.default_rng(seed)
    # lengths, prefixes, document ids: inside the keys, so that tiles are partly masked
    inputs = [rng.integers(1, sizes["S"], x.shape).astype(x.dtype) if x.dtype.kind == "i" else x for x in inputs]
    got = [host(g) for g in as_list(impl.call(fn.func, inputs, fn.constraints))]
    want = fn.compilation.run(inputs, exact=True)
    return impl, got, want


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("name,spec", attention_cases(), ids=[c[0] for c in attention_cases()])
def test_example_on_tensor_cores(name, spec, dtype):
    if not ON_GPU and (name, dtype) not in IN_SIMULATOR:
        pytest.skip("the simulator runs a few of the examples; a GPU runs them all")
    impl, got, want = run_16_bit(spec, dtype)
    # on tensor cores: every fused attention (RoPE and QK-norm too: a Python float is weak, so they
    # compute in the input's type and the query and key stay 16-bit); none where nothing is fused
    on_tensor_cores = [a.element is not None for a in impl.attention]
    assert all(on_tensor_cores) and bool(on_tensor_cores) != (name in UNFUSED)
    assert [a.mma_plan(16, 16) is not None for a in impl.attention] == on_tensor_cores
    assert [f"mma_{dtype}(" in a.source(16, 16) for a in impl.attention] == on_tensor_cores
    assert got[0].dtype == np.dtype(ELEMENT[dtype])
    assert worst_error(got, want) < TOLERANCE[dtype]


def test_split_keys_and_one_warp_on_tensor_cores():
    """12 query rows: one warp per thread block; keys split in three parts, merged by their LSE."""
    spec = dict(attention_cases())["lse.causal_with_lse"]
    impl, got, want = run_16_bit(spec, "bf16", split=3, sizes={"T": 12, "S": 40})
    assert impl.attention[0].last_split == 3
    assert impl.attention[0].mma_plan(16, 16, rows=16).warps == 1
    assert worst_error(got, want) < TOLERANCE["bf16"]


def test_bf16_query_key_value_stay_16_bit_on_the_device():
    """Query, key and value read only by tensor-core tile loads are kept as bf16 patterns: host arrays
    go over as their uint16 view, device memory as ``Bf16Bits``; kernels that cannot take them on
    tensor cores (fewer than 16 rows, D = 8) read the same patterns."""
    from attncomp.backends.numba_cuda.host.arrays import Bf16Bits

    spec = retyped(dict(attention_cases())["alibi.causal_alibi"], "bf16")
    fn, impl = build_cuda(spec, PIPELINE)
    assert impl.bf16_bits == {0, 1, 2}  # q, k, v; the slopes are widened
    assert impl.attention[0].storage == "bits"
    for sizes in ({"T": 5}, {"D": 8}):  # the scalar kernels, on the same patterns
        inputs = random_inputs(spec.ir.main, {**SIZES, **sizes}, seed=4)
        got = impl.call(fn.func, inputs, fn.constraints)
        assert impl.attention[0].mma_plan(inputs[0].shape[-1], 16, rows=8 if "T" in sizes else 32) is None
        assert worst_error([host(got)], fn.compilation.run(inputs, exact=True)) < TOLERANCE["bf16"]
    inputs = random_inputs(spec.ir.main, SIZES, seed=5)
    on_device = [Bf16Bits(cuda.to_device(x.view(np.uint16))) for x in inputs[:3]]
    got = host(impl.call(fn.func, [*on_device, inputs[3]], fn.constraints))
    assert worst_error([got], fn.compilation.run(inputs, exact=True)) < TOLERANCE["bf16"]
    with pytest.raises(TypeError, match="k: expected bf16"):
        impl.call(fn.func, [inputs[0], cuda.to_device(inputs[1].astype(np.float32)), *inputs[2:]], fn.constraints)
    with pytest.raises(TypeError, match="v: expected bf16"):
        impl.call(fn.func, [*inputs[:2], inputs[2].astype(np.float16), inputs[3]], fn.constraints)


def test_bf16_attention_outputs_are_written_16_bit():
    """An attention output the function returns as bf16 is written by the kernel as bf16 patterns,
    rounded to nearest even in the kernel (the split merge too): host calls get bf16, device calls
    ``Bf16Bits`` of the same bits.  An output other ops read stays float32."""
    from attncomp.backends.numba_cuda.host.arrays import Bf16Bits

    spec = retyped(dict(attention_cases())["alibi.causal_alibi"], "bf16")
    fn, impl = build_cuda(spec, PIPELINE)
    kernels = impl.attention[0]
    assert kernels.out_bits and kernels.signature().startswith("void(uint16[:, :, :, ::1]")
    assert "round_bf16(o_0_0 / denominator)" in kernels.source(16, 16)
    inputs = random_inputs(spec.ir.main, SIZES, seed=6)
    got = impl.call(fn.func, inputs, fn.constraints)
    assert got.dtype == ml_dtypes.bfloat16
    assert worst_error([got], fn.compilation.run(inputs, exact=True)) < TOLERANCE["bf16"]
    on_device = [Bf16Bits(cuda.to_device(x.view(np.uint16))) for x in inputs[:3]]
    there = impl.call(fn.func, [*on_device, inputs[3]], fn.constraints)
    assert isinstance(there, Bf16Bits)
    np.testing.assert_array_equal(there.copy_to_host().view(np.uint16), got.view(np.uint16))
    _, split = build_cuda(spec, PIPELINE, split=3)  # the merging block rounds what it merges
    merged = split.call(fn.func, inputs, fn.constraints)
    assert split.attention[0].last_split == 3 and merged.dtype == ml_dtypes.bfloat16
    assert worst_error([merged], fn.compilation.run(inputs, exact=True)) < TOLERANCE["bf16"]
    projected = retyped(load_example("mha_projections").gpt2_attention, "bf16")
    assert not build_cuda(projected, PIPELINE)[1].attention[0].out_bits  # the output projection reads it


def test_bf16_arguments_other_ops_read_are_widened():
    spec = retyped(dict(attention_cases())["rope_qknorm.rope_qknorm"], "bf16")
    _, impl = build_cuda(spec, PIPELINE)
    assert impl.bf16_bits == frozenset() and impl.attention[0].storage == "f32"
