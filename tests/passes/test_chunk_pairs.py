"""chunk-pairs: each part, run in the interpreter chunk by chunk, agrees with the whole function."""

import numpy as np
import pytest

import attncomp as ac
from attncomp.chunked.tasks import merge
from tests.conftest import load_example
from tests.passes import specs

FUSED = "cse,softmax-fusion"


def part(spec, name: str, **constants):
    pipeline = f"{FUSED},chunk-pairs{{part={name}}}"
    return ac.compile(spec, backend="interp", pipeline=pipeline, **constants)


def test_attention_part_of_each_chunk_pair_merges_into_the_whole():
    rng = np.random.default_rng(0)
    B, H, T, D, E = 2, 3, 37, 8, 4
    q, k = (rng.standard_normal((B, H, T, D), dtype=np.float32) for _ in range(2))
    v = rng.standard_normal((B, H, T, E), dtype=np.float32)
    slopes = np.linspace(0.5, 0.1, H, dtype=np.float32)
    whole = ac.interpret(specs.causal_alibi, q, k, v, slopes, window=9)
    fn = part(specs.causal_alibi, "attention", window=9)
    assert [a.name for a in fn.func.args] == ["q_chunk", "k_chunk", "v_chunk", "slopes"]
    assert fn.func.attrs["chunk_offsets"] == ["B_start", "H_start", "q_start", "k_start"]
    text = fn.ir("chunk-pairs")
    assert str(ac.parse_ir(text)) == text
    sizes = {"B": B, "H": H, "T": T, "S": T, "D": D, "E": E}
    cuts_q, cuts_k = [0, 10, 20, 30, 37], [0, 16, 32, 37]
    got = np.zeros_like(whole)
    for b0 in range(B):
        for h0, h1 in ((0, 2), (2, 3)):
            for i0, i1 in zip(cuts_q, cuts_q[1:]):
                partials = []
                for j0, j1 in zip(cuts_k, cuts_k[1:]):
                    offsets = {"B_start": b0, "H_start": h0, "q_start": i0, "k_start": j0}
                    chunk = (slice(b0, b0 + 1), slice(h0, h1))
                    partials.append(
                        ac.interpret(
                            ac.parse_ir(text),
                            q[(*chunk, slice(i0, i1))],
                            k[(*chunk, slice(j0, j1))],
                            v[(*chunk, slice(j0, j1))],
                            slopes,
                            sizes=dict(sizes, **offsets),
                        )
                    )
                got[b0 : b0 + 1, h0:h1, i0:i1] = merge(*partials)[0]
    np.testing.assert_allclose(got, whole, rtol=1e-12, atol=1e-12)


def test_unmasked_attention_part_drops_the_mask_and_what_only_it_reads():
    fn = ac.compile(specs.document, backend="interp", pipeline=f"{FUSED},chunk-pairs{{part=attention,masked=false}}")
    assert [a.name for a in fn.func.args] == ["q_chunk", "k_chunk", "v_chunk"]
    assert "%doc" not in fn.ir("final") and "ac.gather" not in fn.ir("final")


def test_inputs_part_computes_rows_at_their_absolute_positions():
    nanochat = load_example("nanochat_attention")
    rng = np.random.default_rng(1)
    x, *weights = nanochat.make_inputs(rng, B=1, T=20, C=24, n_head=6, n_kv_head=2)
    fn = part(nanochat.nanochat_attention, "inputs", n_head=6, n_kv_head=2)
    assert fn.func.attrs["position_offsets"] == ["T=T_start"]
    assert [a.name for a in fn.func.args] == ["x", "w_q", "w_k", "w_v"]  # w_o is for the outputs part
    whole = ac.interpret(fn.module, x, *weights[:3], sizes={"T_start": 0})
    chunk = ac.interpret(fn.module, x[:, 12:20], *weights[:3], sizes={"T_start": 12})
    for w, c in zip(whole, chunk):  # rotary embeddings see positions 12..19
        np.testing.assert_allclose(c, w[:, :, 12:20], rtol=1e-12, atol=1e-12)


def test_outputs_part_is_what_follows_the_attention():
    nanochat = load_example("nanochat_attention")
    fn = part(nanochat.nanochat_attention, "outputs", n_head=6, n_kv_head=2)
    assert [a.name for a in fn.func.args] == ["attention_out", "attention_lse", "w_o"]
    assert [op.name for op in fn.func.body.ops] == ["ac.transpose", "ac.reshape", "ac.matmul", "ac.return"]


@ac.spec
def values_scaled_by_length(q: ac.f32["T", "D"], k: ac.f32["T", "D"], v: ac.f32["T", "D"]):
    v = v * v.shape[0]
    return ac.softmax(q @ k.mT) @ v


@ac.spec
def keys_centred(q: ac.f32["T", "D"], k: ac.f32["T", "D"], v: ac.f32["T", "D"]):
    k = k - ac.sum(k, 0, keepdims=True)
    return ac.softmax(q @ k.mT) @ v


@pytest.mark.parametrize(
    "spec, message",
    [
        (keys_centred, r"= ac\.reduce is outside the attention \(computing k and v\) and it reduces over the axis T"),
        (values_scaled_by_length, r"= ac\.dim \{value = T\} is outside the attention .* reads the size of an axis"),
    ],
)
def test_ops_that_need_the_whole_sequence_are_refused_by_name(spec, message):
    with pytest.raises(ac.PipelineError, match=message):
        part(spec, "inputs")


def test_queries_and_keys_along_different_axes_are_cut_apart():
    with pytest.raises(ac.PipelineError, match="part=queries and part=keys"):
        part(specs.causal, "inputs")
    assert [a.name for a in part(specs.causal, "queries").func.args] == ["q"]
    assert [a.name for a in part(specs.causal, "keys").func.args] == ["k", "v"]


def test_paged_ragged_attention_part_reads_each_sequence_through_its_page_table():
    rng = np.random.default_rng(3)
    H, D, size = 2, 8, 4
    k_pages, v_pages = (rng.standard_normal((12, H, size, D), dtype=np.float32) for _ in range(2))
    table = np.array([[7, 2, 11, 0, 5], [3, 9, 0, 0, 0]], np.int64)  # a second sequence of 6 keys, padded
    lengths, starts = np.array([18, 6]), np.array([0, 0])
    q = rng.standard_normal((2, H, 3, D), dtype=np.float32)
    positions = np.array([[18, 19, 20], [6, 7, 8]], np.int64)
    slopes = np.array([0.5, 0.25], np.float32)
    sizes = {"B_start": 0, "H_start": 0, "q_start": 0, "k_start": 0, "H": H, "D": D, "E": D, "T": 3, "S": 21}
    paged = part(specs.causal_alibi, "attention,ragged=true,paged=true", window=9)
    names = [a.name for a in paged.func.args]
    assert names == ["q_chunk", "k_pages", "v_pages", "page_table", "q_positions", "k_starts", "k_lengths", "slopes"]
    text = paged.ir("chunk-pairs")
    assert "ac.page_view" in text and str(ac.parse_ir(text)) == text
    ragged = [positions, starts, lengths]
    got = ac.interpret(paged.module, q, k_pages, v_pages, table, *ragged, slopes, sizes=dict(sizes, k_rows=18))
    contiguous = part(specs.causal_alibi, "attention,ragged=true", window=9)
    for b in range(2):  # each sequence alone, its keys materialised
        n = int(lengths[b])
        k, v = (np.moveaxis(p[table[b]], 0, 1).reshape(H, -1, D)[None, :, :n] for p in (k_pages, v_pages))
        alone = [positions[b : b + 1], starts[b : b + 1], lengths[b : b + 1]]
        want = ac.interpret(contiguous.module, q[b : b + 1], k, v, *alone, slopes, sizes=sizes)
        np.testing.assert_allclose(got[0][b], want[0][0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[1][b], want[1][0], rtol=1e-12, atol=1e-12)
    with pytest.raises(IndexError, match="page 16 is out of range for a pool of 12 pages"):
        ac.interpret(paged.module, q, k_pages, v_pages, table + 5, *ragged, slopes, sizes=dict(sizes, k_rows=18))
    with pytest.raises(IndexError, match="18 rows need 5 pages of 4, the table has 4"):
        ac.interpret(paged.module, q, k_pages, v_pages, table[:, :4], *ragged, slopes, sizes=dict(sizes, k_rows=18))


def test_tiles_of_a_chunk_pair_are_classified_at_their_absolute_positions():
    """doc[b, i + q_start] is bounded by the hull of the two summary blocks the tile's rows reach."""
    from attncomp.blockmap import block_map

    pipeline = f"{FUSED},chunk-pairs{{part=attention}},flash-tiling{{block_q=8,block_k=8}},mask-elimination"
    fn = ac.compile(specs.document, backend="interp", pipeline=pipeline)
    rng = np.random.default_rng(4)
    doc = np.repeat(np.array([[0, 1, 2, 3]], np.int32), 16, axis=1)  # documents of 16 positions
    q, k, v = (rng.standard_normal((1, 1, 32, 8), dtype=np.float32) for _ in range(3))
    for q_start, k_start, want in [
        (32, 16, [[0, 0, 1, 0], [0, 0, 2, 1], [0, 0, 0, 0], [0, 0, 0, 0]]),  # rows 32..63, keys 16..47
        (28, 12, [[1, 1, 1, 0], [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]]),  # off the blocks of the summary
    ]:
        sizes = {"B": 1, "H": 1, "T": 64, "D": 8, "B_start": 0, "H_start": 0, "q_start": q_start, "k_start": k_start}
        tiles = block_map(fn.func, fn.constraints, (q, k, v, doc), sizes)[0, 0]
        np.testing.assert_array_equal(tiles, want)
        got = ac.interpret(fn.module, q, k, v, doc, sizes=sizes)
        unfused = ac.interpret(part(specs.document, "attention").module, q, k, v, doc, sizes=sizes)
        np.testing.assert_allclose(got[0], unfused[0], rtol=1e-12, atol=1e-12)


def test_a_mask_given_as_data_is_classified_at_a_chunk_pairs_absolute_positions():
    """m[b, i + q_start, j + k_start]: bounded by the hull of the (up to) 2 x 2 summary blocks the tile reaches."""
    from attncomp.blockmap import block_map

    pipeline = f"{FUSED},chunk-pairs{{part=attention}},flash-tiling{{block_q=8,block_k=8}},mask-elimination"
    fn = ac.compile(specs.dense, backend="interp", pipeline=pipeline)
    rng = np.random.default_rng(5)
    position = np.arange(64)
    mask = (position[:, None] // 16 == position[None, :] // 16)[None]  # blocks of 16 seeing each other
    q, k, v = (rng.standard_normal((1, 1, 32, 8), dtype=np.float32) for _ in range(3))
    for q_start, k_start, want in [
        (32, 16, [[0, 0, 2, 2], [0, 0, 2, 2], [0, 0, 0, 0], [0, 0, 0, 0]]),  # rows 32..63, keys 16..47
        (28, 12, [[1, 1, 1, 1], [0, 0, 1, 2], [0, 0, 1, 1], [0, 0, 0, 0]]),  # off the blocks of the summary
    ]:
        sizes = {"B": 1, "H": 1, "T": 64, "S": 64, "D": 8, "B_start": 0, "H_start": 0}
        sizes.update(q_start=q_start, k_start=k_start)
        tiles = block_map(fn.func, fn.constraints, (q, k, v, mask), sizes)[0, 0]
        np.testing.assert_array_equal(tiles, want)
        got = ac.interpret(fn.module, q, k, v, mask, sizes=sizes)
        unfused = ac.interpret(part(specs.dense, "attention").module, q, k, v, mask, sizes=sizes)
        np.testing.assert_allclose(got[0], unfused[0], rtol=1e-12, atol=1e-12)
