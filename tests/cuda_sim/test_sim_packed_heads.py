"""Tensor-core decoding (``mma/packed_heads.py``): a decode step's grouped query heads share a tile.

A call with fewer query rows than a tile, whose ``G`` query heads share a key/value head, runs the
asynchronous-copy kernel with a block per (batch position, key/value head) and the group's rows
packed head by head, against the float64 interpreter; a grid whose scores read the head keeps a
block a head.
"""

# Dimension names such as ac.bf16["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import TOLERANCE, random_inputs, worst_error
from tests.conftest import load_example
from tests.cuda_sim.helpers import as_list, build_cuda, host, retyped
from tests.cuda_sim.test_sim_flash import PIPELINE, no_conflicts, run

#: GQA 8/2: four query heads a key/value head
GROUPED = {"H": 8, "KV": 2}


@ac.spec
def gqa_last_rows_lse(
    q: ac.bf16["B", "H", "T", "D"],
    k: ac.bf16["B", "KV", "S", "D"],
    v: ac.bf16["B", "KV", "S", "E"],
):
    """Causal with the query rows the last of the keys' (a decode step's), and the log-sum-exp."""
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i + (k.shape[2] - q.shape[2]), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ ac.repeat_kv(v, n_rep), ac.logsumexp(s, axis=-1)


@ac.spec
def gqa_head_bias(
    q: ac.bf16["B", "H", "T", "D"],
    k: ac.bf16["B", "KV", "S", "D"],
    v: ac.bf16["B", "KV", "S", "E"],
    bias: ac.f32["H"],
):
    """A score that reads the query head: its rows cannot share a tile with the group's."""
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(s + bias[h], axis=-1) @ ac.repeat_kv(v, n_rep)


@pytest.mark.parametrize("rows,dtype", [(1, "bf16"), (3, "bf16"), (5, "f16")])
def test_grouped_rows_share_a_tile(rows, dtype, banks):
    """Causal GQA with 1, 3 and 5 rows a head: 4, 12 and 20 packed rows (one warp, then two); row
    ``r`` of a block is row ``r % T`` of its head, so the mask sees each row's own position."""
    kernels, got, want = run("gqa.grouped_query_attention", dtype, sizes={**GROUPED, "T": rows})
    assert kernels.packable is not None
    assert kernels.last_choice.packed_heads and kernels.last_choice.async_copies
    assert worst_error(got, want) < TOLERANCE[dtype]
    no_conflicts(banks)


@pytest.mark.parametrize("split", [1, 2])
def test_packed_rows_merge_their_key_splits_and_lse(split):
    """The key splits' partial states are indexed by packed row; the merge writes each to its head and
    row, output and log-sum-exp (causal from the last rows, which read the keys' length)."""
    fn, impl = build_cuda(gqa_last_rows_lse, PIPELINE, split=split)
    sizes = {"B": 2, **GROUPED, "T": 3, "S": 45, "D": 64, "E": 64}
    inputs = random_inputs(gqa_last_rows_lse.ir.main, sizes, seed=3)
    got = [host(x) for x in as_list(impl.call(fn.func, inputs, fn.constraints))]
    kernels = impl.attention[0]
    assert kernels.last_choice.packed_heads and kernels.last_split == split
    want = fn.compilation.run(inputs, exact=True)
    assert len(got) == len(want) == 2 and worst_error(got, want) < TOLERANCE["bf16"]


def test_a_score_that_reads_the_head_keeps_a_block_a_head():
    fn, impl = build_cuda(gqa_head_bias, PIPELINE)
    kernels = impl.attention[0]
    assert kernels.packable is None and kernels.packed_rows(1, 4, 64, 64) is None
    sizes = {"B": 1, **GROUPED, "T": 1, "S": 20, "D": 64, "E": 64}
    inputs = random_inputs(gqa_head_bias.ir.main, sizes, seed=5)
    got = [host(x) for x in as_list(impl.call(fn.func, inputs, fn.constraints))]
    assert not kernels.last_choice.packed_heads
    assert worst_error(got, fn.compilation.run(inputs, exact=True)) < TOLERANCE["bf16"]


def test_a_bf16_gqa_decoder_steps_on_tensor_cores():
    """A decoder's single-token steps (absolute positions, the cache's rows) run the packed kernel and
    agree with one call over the whole sequence."""
    module = load_example("gqa")
    spec = retyped(module.grouped_query_attention, "bf16")
    rng = np.random.default_rng(11)
    q, k, v = module.make_inputs(rng, B=1, H=8, KV=2, T=22, S=22, D=64, E=64)
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    dec = ac.compile(spec, backend="cuda").decoder(max_len=32)
    steps = [dec(q[:, :, :19], k[:, :, :19], v[:, :, :19])]
    for t in range(19, 22):
        steps.append(dec(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]))
        assert dec.fn.program.attention[0].last_choice.packed_heads
    want = ac.compile(spec, backend="interp")(q, k, v)
    assert worst_error([np.concatenate(steps, axis=2)], [want]) < TOLERANCE["bf16"]


def test_a_bf16_gqa_server_reads_its_pages_by_asynchronous_copies(banks):
    """A paged decoder's pool (pages of 16 rows, a chunk of 64 keys spanning four) copied a page's
    rows at a time through the page table (``mma/page_copies.py``), its steps' heads packed: two
    sequences of different lengths against the interpreter on their whole histories."""
    module = load_example("gqa")
    spec = retyped(module.grouped_query_attention, "bf16")
    rng = np.random.default_rng(2)

    def tokens(n: int) -> tuple:
        shapes = ((1, 8, n, 64), (1, 2, n, 64), (1, 2, n, 64))
        return tuple(rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for shape in shapes)

    srv = ac.compile(spec, backend="cuda").paged_decoder(page_size=16, num_pages=16, dtype="bf16")
    first, second = srv.new(), srv.new()
    history = {first: [tokens(40)], second: [tokens(7)]}
    outputs = {seq: [out] for seq, out in srv.step({seq: parts[0] for seq, parts in history.items()}).items()}
    for _ in range(2):
        step = {first: tokens(1), second: tokens(1)}
        for seq, out in srv.step(step).items():
            history[seq].append(step[seq])
            outputs[seq].append(out)
        choice = srv.paged.fn.program.attention[0].last_choice
        assert choice.async_copies and choice.packed_heads
    reference = ac.compile(spec, backend="interp")
    for seq, parts in history.items():
        want = reference(*(np.concatenate([p[k] for p in parts], axis=2) for k in range(3)))
        assert worst_error([np.concatenate(outputs[seq], axis=2)], [want]) < TOLERANCE["bf16"]
    no_conflicts(banks)
