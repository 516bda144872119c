"""The asynchronous-copy tensor-core forward (``mma/flash_kernel.py``) against the float64 interpreter.

Keys and values reach shared memory by ``cp.async`` and the B fragments by ``ldmatrix``, in the
simulator through ``mma/warp_sim.py``'s emulation: a copy lands only at its wait, warps run apart, and
every shared access is counted by bank.  A call with dense key and value rows runs this kernel;
one with strided rows runs the staged kernel (``mma/forward_kernel.py``) of the same plan sizes.
"""

import os

import numpy as np
import pytest

from attncomp.backends.numba_cuda.mma.atoms import CP_ASYNC_16, LDMATRIX_X4, LDMATRIX_X4_TRANS
from attncomp.testing import TOLERANCE, random_inputs, worst_error
from tests.cuda_sim.helpers import as_list, build_cuda, host, retyped
from tests.cuda_sim.test_sim_tensor_cores import attention_cases

#: one warp of 32 query rows (two 16-row tiles, the query read from its shared tile); key tiles of 32,
#: one chunk each
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=32,block_k=32},mask-elimination,canonicalize,cse,dce"
#: key tiles of 128: two chunks of 64 a tile
LONG_TILES = "cse,softmax-fusion,flash-tiling{block_q=16,block_k=128},mask-elimination,canonicalize,cse,dce"
SIZES = {"B": 1, "H": 2, "KV": 1, "T": 33, "S": 45, "D": 64, "E": 64, "R": 33}
CASES = dict(attention_cases())


def run(
    name: str,
    dtype: str,
    pipeline: str = PIPELINE,
    sizes: dict | None = None,
    strided: bool = False,
    split: int | None = None,
):
    """(attention kernels, got, want) of an example in ``dtype``; ``strided``: keys and values given
    as views whose rows are not one after another; ``split``: key splits (default: as many as fill
    the GPU, one under the simulator for these sizes)."""
    typed = retyped(CASES[name], dtype)
    fn, impl = build_cuda(typed, pipeline, split=split)
    sizes = {**SIZES, **(sizes or {})}
    inputs = random_inputs(typed.ir.main, sizes, seed=7)
    rng = np.random.default_rng(7)
    inputs = [rng.integers(1, sizes["S"], x.shape).astype(x.dtype) if x.dtype.kind == "i" else x for x in inputs]
    given = inputs
    if strided:  # every other feature of an array twice as wide
        given = [_strided(x) if x.ndim == 4 and x.shape[-2] == sizes["S"] else x for x in inputs]
    got = [host(g) for g in as_list(impl.call(fn.func, given, fn.constraints))]
    return impl.attention[0], got, fn.compilation.run(inputs, exact=True)


def _strided(x: np.ndarray):
    """``x`` as a device view of every other feature of an array twice as wide (a host array would
    go over C-contiguous)."""
    from numba import cuda

    wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), x.dtype)
    wide[..., ::2] = x
    from attncomp.backends.numba_cuda.host.arrays import Bf16Bits

    if x.dtype == np.float16:
        return cuda.to_device(wide)[..., ::2]
    return Bf16Bits(cuda.to_device(wide.view(np.uint16))[..., ::2])


#: bank counts are the emulation's; on a GPU (``ATTNCOMP_TEST_GPU=1``) the kernels' results are checked
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def no_conflicts(banks, *atoms) -> None:
    """Every one of ``atoms`` ran and met no bank conflict (in the simulator)."""
    if SIMULATED:
        counts = banks()
        for atom in atoms or (CP_ASYNC_16, LDMATRIX_X4, LDMATRIX_X4_TRANS):
            instructions, conflicts = counts[atom.name]
            assert instructions > 0 and conflicts == 0, (atom.name, counts[atom.name])


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("lse.causal_with_lse", "bf16"),
        ("alibi.causal_alibi", "f16"),
        ("gqa.grouped_query_attention", "bf16"),
        ("gqa.multi_query_attention", "bf16"),  # one key/value head: its index a constant of the loop's body
        ("document_mask.causal_document_mask", "bf16"),
        ("sinks_window.sinks_window", "bf16"),
        ("softcap.causal_softcap", "f16"),
        ("relative_bias.relative_bias", "bf16"),
    ],
)
def test_example_with_async_copies(name, dtype, banks):
    kernels, got, want = run(name, dtype)
    source = kernels.source(64, 64)
    assert "cp_async16(" in source and "ldmatrix_x4_trans(" in source
    assert kernels.choice_for(64, 64).async_copies and kernels.last_choice.async_copies
    assert worst_error(got, want) < TOLERANCE[dtype]
    no_conflicts(banks)


@pytest.mark.parametrize("n_keys", [150, 100])
def test_two_chunks_a_tile_and_one_warp(n_keys, banks):
    """Key tiles of 128 computed 64 keys at a time, 16 query rows a block (one warp); the keys end in
    the first chunk of the second tile (150) or in the second chunk of the first (100: its copies
    read no key past the last, the simulator's copies checking their source's bounds)."""
    kernels, got, want = run("lse.causal_with_lse", "bf16", LONG_TILES, {"T": 20, "S": n_keys})
    assert kernels.mma_plan(64, 64, rows=16).chunk == 64
    assert worst_error(got, want) < TOLERANCE["bf16"]
    no_conflicts(banks)


#: key tiles of 32 computed whole, 16 query rows a block: runs of several full tiles
SHORT_TILES = LONG_TILES.replace("block_k=128", "block_k=32")


@pytest.mark.parametrize(
    "name,split",
    [
        ("pass_specs.unmasked", 1),
        ("sliding_window.two_sided_window", 1),
        ("prefix_lm.prefix_lm", 1),
        ("sliding_window.two_sided_window", 3),
    ],
)
def test_runs_of_full_tiles(name, split, banks):
    """Full tiles run in the main loop of their own, a run ended by a masked tile or by the keys'
    end (150 keys: four whole tiles, then 22 keys in the general body); by the kernel without key
    splits, or by three splits' blocks and their merge."""
    kernels, got, want = run(name, "bf16", SHORT_TILES, {"T": 40, "S": 150, "R": 40}, split=split)
    assert kernels.last_split == split
    assert kernels.last_choice.key_splits == (split > 1)
    assert "while True:  # the main loop" in kernels.source(64, 64, rows=16)
    assert worst_error(got, want) < TOLERANCE["bf16"]
    no_conflicts(banks)


def test_strided_keys_and_values_run_the_staged_kernel(banks):
    kernels, got, want = run("lse.causal_with_lse", "bf16", strided=True)
    assert worst_error(got, want) < TOLERANCE["bf16"]
    assert not SIMULATED or banks()[CP_ASYNC_16.name][0] == 0  # no copies: the staged kernel ran
    assert not kernels.choice_for(64, 64, dense=False).async_copies
    assert kernels.last_choice.mma and not kernels.last_choice.async_copies
    assert "cp_async16(" not in kernels.source(64, 64, dense=False)


def test_128_query_rows_a_block(banks):
    """flash-tiling{block_q=128}: at D = 64 four warps of two 16-row tiles share each key and value
    tile (the query's copies and ldmatrix reads without bank conflicts too).  At D = 128 both kernels
    have eight warps of one tile, its query kept in registers, and 64 keys a chunk
    (``forward_plan.FLASH_SHAPES``)."""
    pipeline = PIPELINE.replace("block_q=32,block_k=32", "block_q=128,block_k=64")
    kernels, got, want = run("lse.causal_with_lse", "f16", pipeline, {"T": 130, "S": 40})
    plan = kernels.mma_plan(64, 64)
    assert (plan.warps, plan.m_tiles, plan.warp_rows) == (4, 2, 32)
    assert "q_sh = cuda.shared.array(" in kernels.source(64, 64)
    assert worst_error(got, want) < TOLERANCE["f16"]
    no_conflicts(banks)
    for plan in (kernels.mma_plan(128, 128, splits=False), kernels.mma_plan(128, 128)):
        assert (plan.warps, plan.m_tiles, plan.chunk, plan.q_words) == (8, 1, 64, 0)
    assert "q_sh" not in kernels.source(128, 128)


@pytest.mark.parametrize("split", [1, 2])
def test_one_tile_a_warp_64_keys_a_chunk_at_d128(split, banks):
    """D = 128, one 16-row tile a warp, keys 64 at a time (two whole chunks and a tail of two keys,
    its rows past the end copied from nowhere): by the kernel without key splits and by two splits'
    blocks and their merge."""
    pipeline = PIPELINE.replace("block_q=32,block_k=32", "block_q=128,block_k=64")
    sizes = {"D": 128, "E": 128, "H": 1, "T": 130, "S": 130}
    kernels, got, want = run("lse.causal_with_lse", "bf16", pipeline, sizes=sizes, split=split)
    plan = kernels.mma_plan(128, 128, splits=split > 1)
    assert (plan.warps, plan.m_tiles, plan.chunk) == (8, 1, 64) and kernels.last_choice.async_copies
    assert kernels.last_split == split
    assert worst_error(got, want) < TOLERANCE["bf16"]
    no_conflicts(banks)


def test_a_launch_has_the_block_its_kernel_is_written_for(monkeypatch):
    """128-row blocks: a launch of one split has the block of the kernel without key splits, read from
    that kernel's plan (where the two differ, a GPU refuses a block larger than its registers allow)."""
    from attncomp.backends.numba_cuda.host import launches

    launched, launch = [], launches.launch
    monkeypatch.setattr(
        launches, "launch", lambda k, grid, block, *a: (launched.append((k, block)), launch(k, grid, block, *a))
    )
    pipeline = PIPELINE.replace("block_q=32,block_k=32", "block_q=128,block_k=64")
    sizes = {"D": 128, "E": 128, "H": 1, "T": 130, "S": 130}
    kernels, got, want = run("lse.causal_with_lse", "bf16", pipeline, sizes=sizes, split=1)
    one_split = kernels.mma_plan(128, 128, splits=False)
    assert kernels.last_split == 1 and one_split.warps == 8 and not one_split.choice.key_splits
    assert [block for k, block in launched if k is kernels.kernel(128, 128, 128, True, False)] == [one_split.threads]
    assert worst_error(got, want) < TOLERANCE["bf16"]


@pytest.mark.parametrize(
    "name,work",
    [
        ("alibi.causal_alibi", "positional"),
        ("softcap.causal_softcap", "elementwise"),
        ("document_mask.causal_document_mask", "elementwise"),
    ],
)
def test_scores_with_work_per_element_have_one_tile_a_warp_at_d128(name, work, banks):
    """ALiBi's scores read each element's key and query position, soft-capping's take a tanh, a
    document mask gathers two ids (``forward_plan.MASK_OPS``): one 16-row tile a warp at D = 128 (two
    would spill); the last two keep two at D = 64."""
    kernels, got, want = run(name, "bf16", sizes={"D": 128, "E": 128})
    assert kernels.score_work == work and kernels.mma_plan(128, 128).m_tiles == 1
    assert kernels.mma_plan(64, 64).m_tiles == (2 if work == "elementwise" else 1)
    assert "q_sh" not in kernels.source(128, 128)
    assert worst_error(got, want) < TOLERANCE["bf16"]
    no_conflicts(banks)


def test_which_rows_are_dense():
    """Dense rows: the last two axes one row after another and every start 16-byte aligned (a
    C-contiguous array, or a decoder cache's first rows); not a view of every other feature, nor
    one whose rows start off 16 bytes."""
    from numba import cuda

    from attncomp.backends.numba_cuda.host.arrays import dense_rows

    cache = cuda.to_device(np.zeros((2, 3, 40, 64), np.float16))
    assert dense_rows(cache) and dense_rows(cache[:, :, :17]) and dense_rows(cache[1:, 1:])
    assert not dense_rows(cache[..., ::2])
    assert not dense_rows(cuda.to_device(np.zeros(2 * 40 * 64 + 1, np.float16))[1:].reshape(2, 40, 64))
    assert not dense_rows(cuda.to_device(np.zeros((40, 12), np.float16)))  # rows of 24 bytes
