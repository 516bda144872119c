"""The structure of generated CUDA attention kernels (source text; no GPU, no simulator).

Skipped tiles load nothing, the mask runs only in class-1 tiles, grouped-query
attention reads key/value heads by index arithmetic, and the thread layout
follows the head dims.  float32 runs on tensor cores by default (3xTF32): the
scalar kernels are examined with ``precision=ieee``, which keeps float32 FMAs.
"""

import importlib.util

import pytest

import attncomp as ac
from tests.conftest import load_example

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda") is None, reason="the cuda extra (numba-cuda) is not installed"
)


FMA = "cse,softmax-fusion,flash-tiling{precision=ieee},mask-elimination,canonicalize,cse,dce"


def _kernel_source(
    example: str, name: str, head_dim: int = 64, value_dim: int = 64, rows: int | None = None, pipeline: str = FMA
) -> str:
    from attncomp.backends import numba_cuda

    fn = ac.compile(getattr(load_example(example), name), backend="interp", pipeline=pipeline)
    impl = numba_cuda.build(fn.module)
    (kernels,) = impl.attention
    return kernels.source(head_dim, value_dim, rows)


def _body_after(source: str, marker: str) -> str:
    return source[source.index(marker) :]


def test_tiles_are_classified_before_any_load_and_the_mask_runs_only_in_class_1():
    source = _kernel_source("alibi", "causal_alibi")
    loop = _body_after(source, "for kb in range(")
    classify = loop.index("if tile_class")
    assert loop.index("k_tile[cc, dd] =") > classify  # staging only inside the non-skipped branch
    assert "!= 0:" in loop[classify : classify + 40]
    mask_guard = loop.index("== 1:")
    assert loop.index("<= i_") > mask_guard  # the causal comparison j <= i sits under the class-1 guard
    prologue = source[: source.index("for kb in range(")]
    assert "arg_" in prologue and "[bi_1]" in prologue  # slopes[h] hoisted out of the key loop


def test_tensor_core_tiles_are_classified_before_any_load_too():
    source = _kernel_source("alibi", "causal_alibi", pipeline=None)
    assert "mma_tf32(" in source
    loop = _body_after(source, "for kb in range(")
    classify = loop.index("if tile_class")
    assert loop.index("k_sh[at] =") > classify and loop.index("v_sh[at] =") > classify
    assert loop.index("<= i_") > loop.index("== 1:")


def test_a_spec_without_mask_has_no_mask_code():
    source = _kernel_source("sdpa", "sdpa")
    assert "tile_class" not in source and "if not " not in source


def test_grouped_query_attention_reads_key_heads_by_index():
    source = _kernel_source("gqa", "grouped_query_attention")
    assert "//" in source.split("k_tile = cuda.shared")[0]  # h // (H // KV) in the prologue
    assert "repeat" not in source


@pytest.mark.parametrize("head_dim,lanes", [(32, 1), (64, 2), (128, 4), (256, 8)])
def test_lanes_per_row_follow_the_head_dim(head_dim, lanes):
    from attncomp.backends.numba_cuda.simt.forward_plan import plan_attention

    plan = plan_attention(64, 64, head_dim, head_dim)
    assert plan.lanes == lanes and plan.threads == 64 * lanes
    assert plan.head_slice <= 32 and plan.shared_bytes <= 48 * 1024
    source = _kernel_source("causal", "causal", head_dim, head_dim)
    assert f"({lanes} per query row)" in source
    assert f"q_{plan.head_slice - 1} = " in source and f"q_{plan.head_slice} = " not in source


@pytest.mark.parametrize("rows,lanes", [(1, 32), (2, 16), (8, 4), (64, 2)])
def test_few_query_rows_get_small_thread_blocks_with_a_warp(rows, lanes):
    from attncomp.backends.numba_cuda.simt.forward_plan import plan_attention, rows_for

    assert rows_for(64, rows) == rows and rows_for(64, 1000) == 64 and rows_for(64, 3) == 4
    plan = plan_attention(64, 64, 64, 64, rows=rows)
    assert plan.lanes == lanes and plan.threads == max(32, 2 * rows)
    source = _kernel_source("causal", "causal", rows=rows)
    assert f"scores = cuda.shared.array((16, {rows})" in source and f"({lanes} per query row)" in source


@pytest.mark.parametrize("rows,head_dim", [(1, 128), (1, 64), (2, 32), (8, 64), (64, 64), (64, 128), (32, 256)])
def test_the_lanes_of_a_warp_meet_their_partials_in_different_banks(rows, head_dim):
    """The generated kernel's ``partials`` buffer, read as it reads it: lane ``g`` of row ``r`` sums
    ``partials[g + m lanes, r lanes + u]`` over ``u``, and thread ``t`` writes ``partials[c, t]``.  Each
    warp's access of one instruction touches 32 different banks (shared memory's 32 banks of 4 bytes;
    ``mma/atoms.py``), for the decoding blocks of one row too."""
    import re
    from collections import Counter

    from attncomp.backends.numba_cuda.mma.atoms import BANKS
    from attncomp.backends.numba_cuda.simt.forward_plan import plan_attention

    plan = plan_attention(64, 64, head_dim, head_dim, rows=rows)
    assert plan.lanes > 1
    source = _kernel_source("causal", "causal", head_dim, head_dim, rows=rows)
    width = int(re.search(r"partials = cuda\.shared\.array\(\(\d+, (\d+)\), ", source).group(1))
    assert "partials[c, tid] = " in source and "partials[c, row_base + 0]" in source
    lanes, threads = plan.lanes, plan.threads
    for first in range(0, threads, 32):
        warp = range(first, min(first + 32, threads))
        for m in range(plan.chunk // lanes or 1):  # each pass of ``for c in range(g, nkc, lanes)``
            for u in range(lanes):
                words = {((t % lanes) + m * lanes) * width + (t // lanes) * lanes + u for t in warp}
                assert max(Counter(word % BANKS for word in words).values()) == 1, (first, m, u)
        for c in range(plan.chunk):
            assert max(Counter((c * width + t) % BANKS for t in warp).values()) == 1


def test_key_splits_take_contiguous_parts_of_the_key_loop_and_the_last_part_merges_them():
    source = _kernel_source("lse", "causal_with_lse")
    loop = source[: source.index("for kb in range(kb_lo, kb_hi):")]
    assert "sp = cuda.blockIdx.y" in loop and "kb_lo = kb_lo + sp * per_split" in loop
    assert "part_m[sp, flat] = m" in source and "part_o[sp, flat, " in source
    assert "_merge(" not in source  # no second kernel: the unit's last split block merges
    tail = source[source.index("cuda.threadfence()") :]
    assert "cuda.atomic.add(done, task, 1) == n_split - 1" in tail and "done[task] = 0" in tail
    assert "math.exp(part_m[sp, flat] - top_safe)" in tail and "out_1[" in tail


@pytest.mark.parametrize("pipeline", [FMA, None], ids=["scalar", "tensor-cores"])
def test_the_split_merge_reads_the_partial_states_after_a_fence(pipeline):
    """Flash-decoding's in-kernel merge: each split fences before it counts itself done, and the block
    that counts last fences after its atomic, before it reads the other splits' partial states."""
    source = _kernel_source("causal", "causal", pipeline=pipeline)
    merge = _body_after(source, "if n_split > 1:  # the last of this unit's splits")
    atomic = merge.index("cuda.atomic.add(done, task, 1)")
    assert merge.index("cuda.threadfence()") < atomic  # release: this block's state, before its count
    after = merge.index("cuda.threadfence()", atomic)  # acquire: the others' states, after the count
    assert after < merge.index("cuda.syncthreads()", atomic) < merge.index("part_m[", atomic)


def test_every_rt_call_a_driver_writes_is_in_the_runtime_a_driver_imports():
    """Generated drivers import ``numba_cuda/runtime.py`` as ``rt`` by its path; the helpers live in
    ``host/``.  Each ``rt.NAME`` the driver writers spell is one that module hands on."""
    import re
    from pathlib import Path

    from attncomp.backends.numba_cuda import runtime

    backends = Path(runtime.__file__).resolve().parents[1]
    writers = [backends / "host_ops.py", *sorted((backends / "numba_cuda" / "host").glob("*.py"))]
    called = {name for path in writers for name in re.findall(r"\brt\.(\w+)\(", path.read_text())}
    assert "launch_map" in called and "kernel_scalar" in called
    assert sorted(called - set(runtime.__all__)) == []
    assert all(hasattr(runtime, name) for name in runtime.__all__)


#: casts of a computed value: choosing between such values needs no branch
CASTS = {"ACC", "U", "np.int32", "np.uint32", "np.int64", "np.float32"}
#: the per-row choices of a merge or finish (``lse_merge.py``, shared with the CPU kernels): two a row
MERGE_NAMES = {"denominator", "top_safe"}


def _computed(node) -> bool:
    """Whether evaluating ``node`` reads no memory and calls nothing but casts."""
    import ast

    if isinstance(node, ast.Name | ast.Constant):
        return True
    if isinstance(node, ast.Attribute):
        return _computed(node.value)
    if isinstance(node, ast.BinOp | ast.UnaryOp | ast.Compare | ast.BoolOp):
        return all(_computed(child) for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr))
    if isinstance(node, ast.Call):
        return ast.unparse(node.func) in CASTS and all(_computed(a) for a in node.args)
    return False


def _branches_between_values(source: str) -> list[str]:
    """The lines that choose between computed values by a branch: a conditional expression, an
    ``and``/``or`` of comparisons, or an ``if`` that only reassigns one value."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id in MERGE_NAMES for t in node.targets):
            continue
        if isinstance(node, ast.Assign | ast.Expr):
            for inner in ast.walk(node.value):
                if isinstance(inner, ast.IfExp | ast.BoolOp) and _computed(inner):
                    found.append(ast.unparse(node))
        elif isinstance(node, ast.If) and not node.orelse and len(node.body) == 1:
            (only,) = node.body
            assigns = isinstance(only, ast.Assign) and all(isinstance(t, ast.Name) for t in only.targets)
            if assigns and _computed(only.value) and _computed(node.test):
                found.append(ast.unparse(node).replace("\n", " "))
    return found


@pytest.mark.parametrize(
    "example,name,dtype,head_dim,gradients",
    [
        ("alibi", "causal_alibi", "bf16", 128, False),
        ("sliding_window", "causal_sliding_window", "f16", 64, False),
        ("alibi", "causal_alibi", "bf16", 64, True),
        ("document_mask", "causal_document_mask", "f32", 64, True),
    ],
)
def test_kernels_choose_between_values_without_branches(example, name, dtype, head_dim, gradients):
    """A mask, a bound, a copy's size: choices between computed values are ``select`` calls, never a
    conditional expression or an ``if`` around one assignment.  Each of those is a branch and a join
    in Numba's IR, whose front end takes time per block and per variable assigned more than once:
    written as branches, they took most of a tensor-core kernel's compile."""
    from attncomp.backends import numba_cuda
    from tests.cuda_sim.helpers import retyped

    spec = getattr(load_example(example), name)
    fn = ac.compile(retyped(spec, dtype) if dtype != "f32" else spec, backend="interp")
    impl = numba_cuda.build(fn.backward.module if gradients else fn.module)
    kernel = "attention_backward_kernel_0" if gradients else "attention_kernel_0"
    sources = {k.name: k.source for k in impl.kernels(head_dim, head_dim) if k.name.startswith(kernel)}
    assert sources
    for kernel, source in sources.items():
        assert "select(" in source, kernel
        assert _branches_between_values(source) == [], kernel


def test_score_functions_take_the_special_function_units_exp_log_and_division():
    """Sigmoid attention's ``log sigmoid`` (an exp and a log a score) and its gradient (a division) run
    ``ex2.approx``, ``lg2.approx`` and ``rcp.approx`` in the tile kernels (``device_math.TILE_FUNCTIONS``),
    forward and backward; graph kernels keep libdevice's accurate ones."""
    from attncomp.backends import numba_cuda

    spec = load_example("sigmoid_attention").causal_sigmoid
    source = _kernel_source("sigmoid_attention", "causal_sigmoid", pipeline=None)
    assert "fast_exp(" in source and "fast_log(" in source and "ac_exp(" not in source
    backward = numba_cuda.build(ac.compile(spec, backend="interp").backward.module)
    (kernels,) = backward.backward
    assert "fast_div(" in kernels.source(64, 64) and "fast_log(" in kernels.source(64, 64)
    unfused = numba_cuda.build(ac.compile(spec, backend="interp", pipeline="").module)
    graph = "\n".join(k.source for k in unfused.graph_kernels)
    assert "ac_exp(" in graph and "fast_exp(" not in graph


def test_a_bound_on_the_scores_is_every_rows_max_from_the_start():
    """Sigmoid attention's scores (``log sigmoid``) are at most 0 (``score_bound``): the tensor-core
    forward keeps 0 as every row's max, with no quad maximum and no rescale; softmax's tracks it."""
    sigmoid = _kernel_source("sigmoid_attention", "causal_sigmoid", pipeline=None)
    assert "m_a = ACC(0.0)" in sigmoid and "quad_max(" not in sigmoid.split("def ", 1)[1]
    softmax = _kernel_source("causal", "causal", pipeline=None)
    assert "m_a = NEG_INF" in softmax and "quad_max(" in softmax.split("def ", 1)[1]
