"""mask-elimination: tile classes from interval reasoning on the mask."""

import numpy as np

import attncomp as ac
from tests.passes import specs

SKIPPED, MASKED, FULL = 0, 1, 2


def counts(block_map):
    return [int((block_map == c).sum()) for c in (SKIPPED, MASKED, FULL)]


def test_causal_256_with_64_blocks():
    x = np.random.default_rng(0).standard_normal((1, 2, 256, 8)).astype(np.float32)
    fn = ac.compile(specs.causal, backend="interp")
    block_map = fn.block_map(x, x, x)
    assert block_map.shape == (1, 2, 4, 4) and block_map.dtype == np.int8
    assert counts(block_map[0, 0]) == [6, 4, 6]
    np.testing.assert_array_equal(block_map[0, 1], np.tril(np.full((4, 4), FULL)) - np.eye(4, dtype=int))


def test_window_of_64_at_1024_computes_under_a_quarter_of_the_tiles():
    x = np.random.default_rng(0).standard_normal((1, 1, 1024, 8)).astype(np.float32)
    fn = ac.compile(specs.window, backend="interp", size=64)
    block_map = fn.block_map(x, x, x)
    computed = int((block_map != SKIPPED).sum())
    assert computed < block_map.size / 4
    assert computed == 16 + 15  # the diagonal and the block below it


def test_loop_bounds_are_tightened_for_affine_masks():
    text = ac.compile(specs.window, backend="interp").ir("final")
    assert "%kb_first = " in text and "%kb_end = " in text


def test_without_mask_every_tile_is_full_and_no_switch_is_left():
    fn = ac.compile(specs.unmasked, backend="interp")
    assert "ac.switch" not in fn.ir("final")
    x = np.zeros((100, 4), np.float32)
    assert counts(fn.block_map(x, x, x)) == [0, 0, 4]


def test_document_ids_are_summarised_per_block():
    rng = np.random.default_rng(1)
    T = 256
    doc = np.repeat(np.arange(4), 64)[None].astype(np.int32)  # four documents of one block each
    x = rng.standard_normal((1, 1, T, 8)).astype(np.float32)
    fn = ac.compile(specs.document, backend="interp")
    assert fn.ir("final").count("ac.block_reduce") == 2
    block_map = fn.block_map(x, x, x, doc)[0, 0]
    np.testing.assert_array_equal(block_map, np.diag([MASKED] * 4))
    np.testing.assert_allclose(fn(x, x, x, doc), ac.interpret(specs.document, x, x, x, doc), rtol=1e-5, atol=1e-6)


def test_sizes_that_are_not_block_multiples():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 1, 70, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, 70, 8)).astype(np.float32)
    fn = ac.compile(specs.causal, backend="interp")
    assert fn.block_map(q, k, k).shape == (1, 1, 2, 2)
    np.testing.assert_allclose(fn(q, k, k), ac.interpret(specs.causal, q, k, k), rtol=1e-5, atol=1e-6)


def test_a_row_with_no_visible_key_gives_zeros_and_minus_infinite_lse():
    @ac.spec
    def shifted(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "D"]):
        s = q @ k.mT
        i, j = ac.index(s)
        s = ac.where(j < i, s, -ac.inf)  # row 0 sees nothing
        return ac.softmax(s) @ v, ac.logsumexp(s)

    x = np.random.default_rng(3).standard_normal((9, 4)).astype(np.float32)
    out, lse = ac.compile(
        shifted,
        backend="interp",
        pipeline="softmax-fusion,flash-tiling{block_q=4,block_k=4},mask-elimination",
    )(x, x, x)
    assert np.all(out[0] == 0) and lse[0] == -np.inf
    ref_out, ref_lse = ac.interpret(shifted, x, x, x)
    np.testing.assert_allclose(out[1:], ref_out[1:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[1:], ref_lse[1:], rtol=1e-5)


def test_a_mask_given_as_data_is_summarised_over_both_positions():
    """m[b, i, j] read at a tile's rows and keys: bounded by its minimum and maximum over the tile."""
    rng = np.random.default_rng(3)
    T = 256
    x = rng.standard_normal((2, 1, T, 8)).astype(np.float32)
    causal = np.tril(np.ones((T, T), bool))
    m = np.stack([causal, causal])
    m[1, 130:, :64] = False  # batch 1: rows of the last two blocks see nothing of the first
    m[1, 200, 10] = True  # but one
    fn = ac.compile(specs.dense, backend="interp")
    assert fn.ir("final").count("ac.block_reduce") == 4  # min and max along T, then along S
    tiles = fn.block_map(x, x, x, m)
    np.testing.assert_array_equal(tiles[0, 0], ac.compile(specs.causal, backend="interp").block_map(x, x, x)[0, 0])
    assert tiles[1, 0, 2, 0] == MASKED and tiles[1, 0, 3, 0] == MASKED  # row 130 sees key 0; row 200 key 10
    m[1, 200, 10] = False
    tiles = fn.block_map(x, x, x, m)
    assert tiles[1, 0, 3, 0] == SKIPPED and tiles[1, 0, 3, 1] == FULL
    np.testing.assert_allclose(fn(x, x, x, m), ac.interpret(specs.dense, x, x, x, m), rtol=1e-6, atol=1e-7)


def test_an_additive_mask_per_head_skips_tiles_of_minus_infinity():
    rng = np.random.default_rng(4)
    T = 128
    q, k, v = (rng.standard_normal((1, 2, T, 8)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((1, 2, T, T)).astype(np.float32)
    bias[0, 0, :64, 64:] = -np.inf  # head 0: the first rows see only the first keys
    bias[0, 1, 64:, :64] = -np.inf  # head 1: the last rows see only the last keys
    fn = ac.compile(specs.dense_bias, backend="interp")
    tiles = fn.block_map(q, k, v, bias)[0]
    np.testing.assert_array_equal(tiles, [[[FULL, SKIPPED], [FULL, FULL]], [[FULL, FULL], [SKIPPED, FULL]]])
    want = ac.interpret(specs.dense_bias, q, k, v, bias)
    for backend in ("interp", "cpu"):
        got = ac.compile(specs.dense_bias, backend=backend)(q, k, v, bias)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_tiles_classified_from_a_mask_given_as_data_agree_with_the_mask():
    """Random rectangles of visible pairs at sizes that are not block multiples: a skipped tile
    holds no visible pair, a full one nothing else, and the result is the unfused graph's."""
    pipeline = "cse,softmax-fusion,flash-tiling{block_q=8,block_k=8},mask-elimination"
    fn = ac.compile(specs.dense, backend="interp", pipeline=pipeline)
    rng = np.random.default_rng(7)
    seen = set()
    for _ in range(12):
        t, s = (int(n) for n in rng.integers(1, 40, 2))
        mask = np.zeros((2, t, s), bool)
        for b in range(2):
            for _ in range(3):
                i0, j0 = rng.integers(0, t), rng.integers(0, s)
                mask[b, i0 : i0 + rng.integers(1, 20), j0 : j0 + rng.integers(1, 20)] = True
        q, k, v = (rng.standard_normal((2, 1, n, 4)).astype(np.float32) for n in (t, s, s))
        tiles = fn.block_map(q, k, v, mask)
        for b, _, qb, kb in np.ndindex(*tiles.shape):
            pairs = mask[b, qb * 8 : qb * 8 + 8, kb * 8 : kb * 8 + 8]
            tile_class = tiles[b, 0, qb, kb]
            seen.add(int(tile_class))
            assert tile_class != SKIPPED or not pairs.any()
            assert tile_class != FULL or pairs.all()
        np.testing.assert_allclose(fn(q, k, v, mask), ac.interpret(specs.dense, q, k, v, mask), atol=1e-12)
    assert seen == {SKIPPED, MASKED, FULL}


def test_a_table_of_blocks_classifies_the_tiles_it_covers():
    """A mask read from a table of blocks (``table[h, i // rows, j // cols]``, FlexAttention's block
    lists): a tile reaches the entries of its positions' blocks (one or two where blocks are as
    large as tiles or larger, a summary of whole entries where tiles hold several), so tiles are
    skipped or run whole from the table, at sizes that are not multiples of either; the results are
    the unfused graph's, forward and gradients."""
    pipeline = "cse,softmax-fusion,flash-tiling{block_q=8,block_k=8},mask-elimination,canonicalize,cse,dce"
    rng = np.random.default_rng(11)
    seen = set()
    for rows, cols in ((8, 8), (4, 8), (12, 16), (16, 2), (3, 8)):
        fn = ac.compile(specs.block_table, backend="interp", pipeline=pipeline, rows=rows, cols=cols)
        t, s = (int(n) for n in rng.integers(9, 40, 2))
        table = rng.integers(0, 3, (2, -(-t // rows), -(-s // cols))).astype(np.int32)
        q, k, v = (rng.standard_normal((1, 2, n, 4)).astype(np.float32) for n in (t, s, s))
        code = table[:, np.arange(t)[:, None] // rows, np.arange(s)[None, :] // cols]
        shown = (code == 2) | ((code == 1) & (np.arange(s)[None, :] <= np.arange(t)[:, None]))
        tiles = fn.block_map(q, k, v, table)[0]
        for h, qb, kb in np.ndindex(*tiles.shape):
            pairs = shown[h, qb * 8 : qb * 8 + 8, kb * 8 : kb * 8 + 8]
            seen.add((rows >= 8 or 8 % rows == 0, int(tiles[h, qb, kb])))  # blocks tiles cut evenly
            assert tiles[h, qb, kb] != SKIPPED or not pairs.any()
            assert tiles[h, qb, kb] != FULL or pairs.all()
        unfused = ac.compile(specs.block_table, backend="interp", pipeline="", rows=rows, cols=cols)
        want, pullback = unfused.vjp(q, k, v, table)
        got, got_pullback = fn.vjp(q, k, v, table)
        np.testing.assert_allclose(got, want, atol=1e-12)
        cotangent = rng.standard_normal(want.shape)
        for a, b in zip(got_pullback(cotangent)[:3], pullback(cotangent)[:3]):
            np.testing.assert_allclose(a, b, atol=1e-10)
    assert {(True, SKIPPED), (True, FULL), (True, MASKED)} <= seen
    assert seen & {(False, SKIPPED), (False, FULL)} == set()  # blocks of 3: tiles cut them unevenly
