"""Every kernel of every example compiles to PTX for sm_80 and sm_90, without local memory.

Needs the ``cuda`` extra (numba-cuda and NVVM from wheels), no GPU.  ``.local``
in PTX is an array the compiler kept in local memory; with nvJitLink
installed (``cuda-toolkit[nvjitlink]``, also in the extra) the PTX is also
assembled for each target and ptxas must report no spill stores or loads.  NVVM writes a
kernel's PTX once, for sm_80: its PTX for sm_90 is the same but for the ``.target`` line, which
``test_nvvm_writes_the_same_ptx_for_sm_80_and_sm_90`` holds on a kernel of every kind.
Attention kernels are checked at the default block sizes (64 x 64) with
head dims 64 (every example) and 128 (a few).  Each kernel is compiled as a call
launches it: for the specialisation a call with C-contiguous arrays dispatches
(``KernelInfo.signature``, held to the launches by ``tests/cuda_sim/test_sim_launch_signatures.py``)
and with its ``cuda.jit``'s launch bounds (``.maxntid`` in the PTX).
"""

from __future__ import annotations

import importlib.util
import re

import pytest

import attncomp as ac
from tests.conftest import example_names, load_example

TARGETS = [(8, 0), (9, 0)]
TRIGONOMETRY = ("ac_sin", "ac_cos")


def _toolchain_missing() -> str | None:
    if importlib.util.find_spec("numba_cuda") is None:
        return "the cuda extra (numba-cuda) is not installed: pip install -e '.[cuda]'"
    try:
        from numba import cuda

        def probe(out):
            out[0] = 1.0

        cuda.compile_ptx(probe, "void(float32[::1])", cc=(8, 0))
    except Exception as error:  # NVVM missing or unusable
        return f"numba.cuda.compile_ptx does not work here (NVVM from the cuda extra?): {error}"
    return None


MISSING = _toolchain_missing()
pytestmark = [
    pytest.mark.skipif(MISSING is not None, reason=MISSING or ""),
    # one worker runs them all, so that a kernel several tests check (``_COMPILED``) compiles once a run
    pytest.mark.xdist_group("ptx"),
]


def _nvjitlink() -> bool:
    from attncomp.backends.numba_cuda.ptx import nvjitlink_available

    return MISSING is None and nvjitlink_available()


def _example_specs():
    cases = []
    for name in example_names():
        module = load_example(name)
        for attr, value in sorted(vars(module).items()):
            if isinstance(value, ac.Spec):
                cases.append(pytest.param(value, id=f"{name}.{attr}"))
    return cases


#: PTX by (kernel source with its own name blanked, signature, targets): many examples share kernels
#: (a matmul, a transpose, the same attention), and the same source compiles to the same PTX, so each
#: is compiled once per test process (one for the whole file: its ``xdist_group``)
_COMPILED: dict[tuple, dict] = {}
_REPORTS: dict[tuple, object] = {}  # ptxas' report by (PTX, target)


def _key(kernel, targets) -> tuple:
    source = kernel.source.replace(kernel.py_func.__name__, "KERNEL")
    return (source, kernel.signature, tuple(targets), kernel.launch_bounds)


def _compiled(kernel, targets) -> dict:
    """The kernel's PTX for each target: NVVM's for the first, and for the others the same text with
    their ``.target`` line.  NVVM writes the same PTX for sm_90 as for sm_80 but for that line
    (``test_nvvm_writes_the_same_ptx_for_sm_80_and_sm_90`` holds it on a kernel of every kind this
    file checks), so each kernel goes through NVVM once and through ptxas once per target."""
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for

    key = _key(kernel, targets)
    if key not in _COMPILED:
        first = targets[0]
        ptx = compile_ptx_for(kernel.py_func, kernel.signature, [first], kernel.launch_bounds)[first]
        _COMPILED[key] = {cc: _retargeted(ptx, first, cc) for cc in targets}
    return _COMPILED[key]


def _retargeted(ptx: str, source: tuple[int, int], target: tuple[int, int]) -> str:
    old, new = (f"\n.target sm_{a}{b}\n" for a, b in (source, target))
    assert ptx.count(old) == 1, "one .target line"
    return ptx.replace(old, new)


def _check(impl, head_dim: int, kernels=None, texts: dict | None = None, targets=TARGETS) -> dict[str, dict]:
    from attncomp.backends.numba_cuda.ptx import local_memory_lines, nvjitlink_available, ptxas_report

    reports = {}
    for kernel in impl.kernels(head_dim, head_dim) if kernels is None else kernels:
        name = kernel.name
        for cc, ptx in _compiled(kernel, targets).items():
            if texts is not None:
                texts[name, cc] = ptx
            assert f".target sm_{cc[0]}{cc[1]}" in ptx and ".entry" in ptx, name
            if kernel.launch_bounds is not None:
                assert f".maxntid {kernel.launch_bounds}, 1, 1" in ptx, name
            local = local_memory_lines(ptx)
            if any(f"{f}(" in kernel.source for f in TRIGONOMETRY):
                # libdevice's accurate sinf/cosf reduce huge arguments (|x| > 105615) through a small
                # local array (Payne-Hanek); rotary angles need the accuracy, so this depot is expected.
                depots = [int(m) for line in local for m in re.findall(r"__local_depot\d+\[(\d+)\]", line)]
                assert len(depots) <= 1 and sum(depots) <= 64, f"{name}: {local[:3]}"
            else:
                assert local == [], f"{name} uses local memory on sm_{cc[0]}{cc[1]}: {local[:3]}"
            if nvjitlink_available():
                if (ptx, cc) not in _REPORTS:
                    _REPORTS[ptx, cc] = ptxas_report(ptx, cc)
                report = _REPORTS[ptx, cc]
                assert not report.spills, f"{name} spills on sm_{cc[0]}{cc[1]}:\n{report.log}"
                reports[f"{name}@sm_{cc[0]}{cc[1]}"] = report
    return reports


def _build(spec, pipeline=None):
    from attncomp.backends import numba_cuda

    return numba_cuda.build(ac.compile(spec, backend="interp", pipeline=pipeline).module)


@pytest.mark.parametrize("spec", _example_specs())
def test_example_kernels_compile_without_local_memory(spec):
    impl = _build(spec)
    assert impl.attention or any(k.name.endswith("matmul") for k in impl.graph_kernels)
    _check(impl, 64)


def _kernels_of_every_kind() -> list:
    """A kernel of each kind this file checks: f16/bf16 attention on tensor cores with asynchronous
    copies and ldmatrix, float32 on tf32 tensor cores (3xTF32), float32 on scalar FMAs, libdevice's
    cosine (rotary embeddings) and the graph kernels beside it, the tensor-core backward,
    a bf16 decoding step with packed heads, an 8-bit cache's decoding step and its append."""
    from attncomp.backends import numba_cuda
    from tests.cuda_sim.helpers import retyped

    alibi, gqa = load_example("alibi").causal_alibi, load_example("gqa").grouped_query_attention
    kernels = [k for k in _build(retyped(alibi, "bf16")).kernels(128, 128) if k.name.startswith("attention_")]
    kernels += [k for k in _build(alibi).kernels(64, 64) if k.name.startswith("attention_")]
    kernels += [k for k in _build(alibi).kernels(128, 128) if k.name.startswith("attention_")]
    rope = list(_build(load_example("rope_qknorm").rope_qknorm).kernels(64, 64))
    kernels += [next(k for k in rope if k.name.endswith(kind)) for kind in ("_cos", "_reduce", "_concat")]
    kernels += [k for k in rope if k.name.startswith("attention_")]
    backward = numba_cuda.build(ac.compile(retyped(alibi, "f16"), backend="interp").backward.module)
    kernels += [k for k in backward.kernels(64, 64) if k.name.startswith("attention_backward_")]
    kernels += _build(retyped(gqa, "bf16"), DECODER).decode_kernels(64, rows=1, group=4)
    eight_bit = _build(gqa, DECODER.replace("kv-cache-reuse", "kv-cache-reuse{cache=f8e4m3}"))
    kernels += eight_bit.decode_kernels(64, rows=1)
    kernels += [k for k in eight_bit.kernels(64) if k.name.endswith("cache_append")]
    return kernels


def test_nvvm_writes_the_same_ptx_for_sm_80_and_sm_90():
    """What lets ``_compiled`` run NVVM once a kernel: for a kernel of every kind this file checks,
    NVVM's PTX for sm_90 is its PTX for sm_80 with the other ``.target`` line.  A later NVVM that
    writes sm_90 code of its own fails here, and ``_compiled`` would then compile for each target."""
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for

    first, *others = TARGETS
    kernels = _kernels_of_every_kind()
    assert len(kernels) == 11
    for kernel in kernels:
        found = compile_ptx_for(kernel.py_func, kernel.signature, TARGETS, kernel.launch_bounds)
        for cc in others:
            assert found[cc] == _retargeted(found[first], first, cc), f"{kernel.name} on sm_{cc[0]}{cc[1]}"
        _COMPILED.setdefault(_key(kernel, TARGETS), found)  # the checks below find it compiled


@pytest.mark.parametrize("example,name", [("causal", "causal"), ("alibi", "causal_alibi")])
def test_attention_kernels_for_head_dim_128(example, name):
    impl = _build(getattr(load_example(example), name))
    reports = _check(impl, 128)
    assert all(k for k in impl.attention)
    for label, report in reports.items():
        if "attention" in label:
            assert report.registers <= 255, label


@pytest.mark.parametrize("dtype,head_dim", [("bf16", 128), ("f16", 64)])
def test_tensor_core_attention_kernels(dtype, head_dim):
    """f16/bf16 attention at the default blocks (64 x 64): four warps, S = Q K^T and O += P V on
    mma.sync in the PTX, no local memory, no spills on sm_80 and sm_90 (bf16: its output stored as
    16-bit patterns, rounded in the kernel)."""
    from tests.cuda_sim.helpers import retyped

    impl = _build(retyped(load_example("alibi").causal_alibi, dtype))
    assert impl.attention[0].out_bits == (dtype == "bf16")
    plan = impl.attention[0].mma_plan(head_dim, head_dim)
    assert plan.warps == 4
    attention = [k for k in impl.kernels(head_dim, head_dim) if k.name.startswith("attention_kernel_0[")]
    texts: dict = {}
    _check(impl, head_dim, attention, texts)
    # per chunk of keys: (D / 16) (chunk / 8) products for S, (E / 8) (chunk / 16) for O; twice,
    # in the main loop over runs of full tiles and in the body of every other chunk
    products = head_dim // 16 * plan.chunk // 8 + head_dim // 8 * plan.chunk // 16
    assert plan.async_copies  # a call with C-contiguous arrays: 16-byte copies and ldmatrix
    for ptx in texts.values():
        assert ptx.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32") == 2 * products
        assert "cp.async.cg.shared.global" in ptx and "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx


@pytest.mark.parametrize(
    "example,name", [("document_mask", "causal_document_mask"), ("sliding_window", "causal_sliding_window")]
)
def test_masks_with_more_work_have_one_tile_a_warp_at_d128(example, name):
    """A mask that gathers (documents) or computes four ops (a causal sliding window): at D = 128 the
    bf16 forward keeps one 16-row tile a warp (``forward_plan.MASK_OPS``: two would spill), and its
    one-split kernel has no spills on sm_80 and sm_90."""
    from attncomp.backends.numba_cuda.program import group_kernel
    from attncomp.passes import default_pipeline
    from tests.cuda_sim.helpers import retyped

    impl = _build(retyped(getattr(load_example(example), name), "bf16"), default_pipeline("cuda"))
    kernels = impl.attention[0]
    assert kernels.score_work == "elementwise" and kernels.mma_plan(128, 128, splits=False).m_tiles == 1
    assert kernels.mma_plan(64, 64, splits=False).m_tiles == 2
    _check(None, 128, [group_kernel(kernels, "one split", 128, 128, splits=False)])


def test_mla_prefill_head_dims_run_on_tensor_cores_without_spills():
    """MLA's prefill (query/key 192, value 128, examples/mla.py) in bf16: the staged tensor-core kernel,
    16 keys a chunk, no local memory and no spills on sm_80 and sm_90."""
    from attncomp.backends import numba_cuda

    member = ac.compile(load_example("mla").mla_prefill, backend="interp").for_dtype("bf16")
    impl = numba_cuda.build(member.compilation.module)
    plan = impl.attention[0].mma_plan(192, 128)
    assert plan is not None and plan.chunk == 16 and not impl.attention[0].choice_for(192, 128).async_copies
    kernels = [k for k in impl.kernels(192, 128) if k.name.startswith("attention_kernel_0[")]
    texts: dict = {}
    _check(None, 192, kernels, texts)
    for ptx in texts.values():
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx


@pytest.mark.parametrize("dtype,head_dim", [("bf16", 128), ("f16", 64)])
def test_strided_calls_run_the_staged_tensor_core_kernels(dtype, head_dim):
    """A call whose key or value rows are not dense runs the kernel that stages 32-bit words by loads
    and stores (no cp.async, no ldmatrix): on tensor cores too, without spills."""
    from attncomp.backends.numba_cuda.program import KernelInfo, bounds
    from tests.cuda_sim.helpers import retyped

    group = _build(retyped(load_example("alibi").causal_alibi, dtype)).attention[0]
    staged = group.choice_for(head_dim, head_dim, dense=False)
    assert staged.mma and not staged.async_copies and group.choice_for(head_dim, head_dim).async_copies
    dispatcher = group.kernel(head_dim, head_dim, dense=False)
    source = group.source(head_dim, head_dim, dense=False)
    info = KernelInfo("staged", dispatcher.py_func, group.signature(), source, bounds(dispatcher), staged)
    texts: dict = {}
    _check(None, head_dim, [info], texts)
    for ptx in texts.values():
        assert "mma.sync.aligned.m16n8k16" in ptx and "cp.async" not in ptx and "ldmatrix" not in ptx


@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashattention_layout_is_read_in_place_by_the_asynchronous_copies(head_dim):
    """``attncomp.flash_attn``'s spec on ``[B, T, H, D]``: its arguments read through transposed views,
    kept as bf16 patterns (typed of any layout: the specialisation such a call dispatches), and the
    asynchronous copies stepping by the rows' pitch: cp.async and ldmatrix, without spills."""
    pytest.importorskip("torch")  # attncomp.flash_attn's package imports it
    from attncomp.backends import numba_cuda
    from attncomp.backends.numba_cuda.program import KernelInfo, bounds
    from attncomp.flash_attn.specs import flash_attention

    module = ac.compile(flash_attention, backend="interp", causal=True, left=255).for_dtype("bf16").module
    group = numba_cuda.build(module).attention[0]
    assert len(group.views) == 3 and group.views <= group.bits  # q, k and v: transposed views, 16-bit
    choice = group.choice_for(head_dim, head_dim)
    assert choice.async_copies and choice.storage == "bits"
    dispatcher = group.kernel(head_dim, head_dim, pitched=True)
    source = group.source(head_dim, head_dim, pitched=True)
    assert "k_pitch" in source and "uint16[:, :, :, :]" in group.signature()
    info = KernelInfo("pitched", dispatcher.py_func, group.signature(), source, bounds(dispatcher), choice)
    texts: dict = {}
    _check(None, head_dim, [info], texts)
    for ptx in texts.values():
        assert "mma.sync.aligned.m16n8k16" in ptx and "cp.async" in ptx and "ldmatrix" in ptx


@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashattention_layout_gradients_are_read_in_place_by_the_asynchronous_copies(head_dim):
    """The backward of ``attncomp.flash_attn``'s spec: query, key, value and output gradient read
    through transposed views as bf16 patterns (the output gradient's also by the fused ``delta``
    reduction, typed of any layout), the backward's asynchronous copies stepping by the rows' pitch:
    cp.async and ldmatrix, without spills; nothing of the four is copied."""
    pytest.importorskip("torch")  # attncomp.flash_attn's package imports it
    from attncomp.backends import numba_cuda
    from attncomp.flash_attn.specs import flash_attention

    module = ac.compile(flash_attention, backend="interp", causal=True).for_dtype("bf16").backward.module
    impl = numba_cuda.build(module)
    group = impl.backward[0]
    assert len(group.views) == 4 and group.views <= group.bits
    kernels = impl.kernels(head_dim, head_dim)
    [reduction] = [k for k in kernels if k.name.endswith("_reduce")]
    assert "uint16[:, :, :, :]" in reduction.signature  # d_out's view, as patterns, of any layout
    [backward] = [k for k in kernels if k.name.startswith("attention_backward_")]
    assert backward.choice.async_copies and "o_rows_pitch" in backward.source
    texts: dict = {}
    _check(None, head_dim, [backward, reduction], texts)
    assert all("cp.async" in ptx and "ldmatrix" in ptx for (name, _), ptx in texts.items() if name == backward.name)
    # the driver copies none of them: the transposes left are the gradients' own
    copies = [line for line in impl.driver_source.splitlines() if "launch_map(k" in line and "transpose" in line]
    assert len(copies) == 3


@pytest.mark.parametrize("precision,head_dim", [("exact", 64), ("tf32", 128)])
def test_float32_tensor_core_attention_kernels(precision, head_dim):
    """float32 attention on tf32 mma.sync (m16n8k8): 3xTF32 by default (three products each), one
    product with precision = "tf32"; no local memory, no spills on sm_80 and sm_90."""
    option = "" if precision == "exact" else "{precision=tf32}"
    pipeline = f"cse,softmax-fusion,flash-tiling{option},mask-elimination,canonicalize,cse,dce"
    impl = _build(load_example("alibi").causal_alibi, pipeline)
    plan = impl.attention[0].mma_plan(head_dim, head_dim)
    assert plan.tf32 and plan.split == (precision == "exact") and plan.warps == 4
    attention = [k for k in impl.kernels(head_dim, head_dim) if k.name.startswith("attention_kernel_0[")]
    texts: dict = {}
    _check(impl, head_dim, attention, texts)
    products = (3 if plan.split else 1) * 2 * (head_dim // 8) * (plan.chunk // 8)
    for ptx in texts.values():
        assert ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == products


def test_exact_float32_past_head_dim_64_runs_the_fma_kernels():
    impl = _build(load_example("alibi").causal_alibi)
    assert impl.attention[0].mma_plan(64, 64).split
    assert impl.attention[0].mma_plan(128, 128) is None
    assert "mma_" not in impl.attention[0].source(128, 128)


@pytest.mark.parametrize("head_dim,rows", [(64, 1), (128, 1), (128, 4)])
def test_decode_step_kernels(head_dim, rows):
    """A decoding step's kernel: thread blocks of a few query rows with a warp of lanes, and key splits."""
    impl = _build(load_example("gqa").grouped_query_attention, DECODER)
    kernels = impl.decode_kernels(head_dim, rows=rows)
    plan = impl.attention[0].plan(head_dim, head_dim, rows)
    assert plan.rows == rows and plan.threads >= 32
    assert f"cuda.shared.array((16, {rows})" in kernels[0].source  # scores of this many rows only
    reports = _check(impl, head_dim, kernels)
    assert all(report.registers <= 255 for report in reports.values())


@pytest.mark.parametrize("head_dim,rows", [(64, 1), (128, 1), (128, 3)])
def test_packed_gqa_decode_step_kernels(head_dim, rows):
    """A bf16 GQA 32/8 decoding step: the four query heads of a key/value head packed into one warp's
    tile, keys and values by 16-byte asynchronous copies, products on tensor cores; no local memory,
    no spills on sm_80 and sm_90."""
    from tests.cuda_sim.helpers import retyped

    impl = _build(retyped(load_example("gqa").grouped_query_attention, "bf16"), DECODER)
    (kernel,) = impl.decode_kernels(head_dim, rows=rows, group=4)
    assert kernel.choice.packed_heads and kernel.choice.async_copies and kernel.launch_bounds == 32
    texts: dict = {}
    _check(impl, head_dim, [kernel], texts)
    for ptx in texts.values():
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx and "cp.async.cg.shared.global" in ptx


def test_unfused_and_decoder_kernels_cover_every_graph_op():
    """Unfused graphs and a decoder's graph: together they use every op kind outside attention."""
    cases = [
        ("mha_projections", "gpt2_attention", ""),
        ("rope_qknorm", "rope_qknorm", ""),
        ("lse", "causal_with_lse", ""),
        ("gqa", "grouped_query_attention", ""),
        ("relative_bias", "relative_bias", ""),
        ("softcap", "causal_softcap", ""),
        ("document_mask", "causal_document_mask", None),
        ("nanochat_attention", "nanochat_attention", ""),
        ("nanochat_attention", "nanochat_attention", DECODER),
    ]
    seen = set()
    for example, name, pipeline in cases:
        fn = ac.compile(getattr(load_example(example), name), backend="interp", pipeline=pipeline)
        seen |= {op.name for op in fn.module.main.body.ops if any(r.type.rank for r in op.results)}
        from attncomp.backends import numba_cuda

        _check(numba_cuda.build(fn.module), 64)
    wanted = {
        "ac.matmul",
        "ac.softmax",
        "ac.logsumexp",
        "ac.reduce",
        "ac.gather",
        "ac.transpose",
        "ac.slice",
        "ac.concat",
        "ac.repeat_kv",
        "ac.reshape",
        "ac.block_reduce",
        "ac.cache_append",
        "ac.where",
        "ac.cmp",
        "ac.iota",
        "ac.cos",
        "ac.sin",
        "ac.rsqrt",
        "ac.tanh",
    }
    assert wanted <= seen, sorted(wanted - seen)


DECODER = "cse,softmax-fusion,kv-cache-reuse,flash-tiling,mask-elimination,canonicalize,cse,dce"


@pytest.mark.parametrize(
    "example,name",
    [
        ("causal", "causal"),
        ("alibi", "causal_alibi"),
        ("gqa", "grouped_query_attention"),
        ("lse", "key_padding_with_lse"),
        ("relative_bias", "relative_bias"),
    ],
)
def test_backward_kernels_compile_without_local_memory(example, name):
    """The scalar backward kernel (ac.key_grid; float32 with precision=ieee, as the tensor-core
    kernels of the default precision have their own tests below) at the default 64 x 64 blocks,
    head dim 64: no local memory, no spills; the graph kernels of the backward (delta =
    rowsum(d_out * out), ...) too."""
    from attncomp.backends import numba_cuda

    pipeline = "cse,softmax-fusion,flash-tiling{precision=ieee},mask-elimination,canonicalize,cse,dce"
    fn = ac.compile(getattr(load_example(example), name), backend="interp", pipeline=pipeline)
    impl = numba_cuda.build(fn.backward.module)
    (kernels,) = impl.backward
    plan = kernels.plan(64, 64)
    assert (plan.block_q, plan.block_k, plan.keys) == (64, 64, 64)
    reports = _check(impl, 64)
    for label, report in reports.items():
        if "backward" in label:
            assert report.registers <= 255, label


@pytest.mark.parametrize(
    "example,name,dtype,head_dim",
    [
        ("causal", "causal", "bf16", 64),
        ("softcap", "causal_softcap", "f16", 128),
        ("alibi", "causal_alibi", "bf16", 128),
    ],
)
def test_tensor_core_backward_kernels(example, name, dtype, head_dim):
    """The f16/bf16 backward at the default 64 x 64 blocks: the five products per chunk on mma.sync,
    no local memory, no spills on sm_80 and sm_90 (soft-capping's derivative and ALiBi's slope sums
    in registers beside the fragments).  Where the rows are dense, the asynchronous-copy kernel
    (``mma/flash_backward.py``): every product once, each operand by ldmatrix; else the staged one,
    whose blocks share the keys by column halves past D = 64."""
    from attncomp.backends import numba_cuda
    from attncomp.backends.numba_cuda.mma.flash_backward_plan import FlashBackwardPlan
    from tests.cuda_sim.helpers import retyped

    fn = ac.compile(retyped(getattr(load_example(example), name), dtype), backend="interp")
    impl = numba_cuda.build(fn.backward.module)
    (kernels,) = impl.backward
    d = head_dim
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32"
    plan = kernels.mma_plan(d, d)
    if isinstance(plan, FlashBackwardPlan):
        # up to D = 64 a warp per 16 keys; past it two, each half the rows' scores and the columns
        assert (plan.keys, plan.rows, plan.split) == ((64, 32, 1) if d == 64 else (32, 32, 2))
        # S^T and dP^T ((D / 16) (rows / 8) each), dV and dK ((D / 8) (rows / 16) each), and the
        # warp's dQ fragments over the block's keys
        dq = plan.dq_row_tiles * (plan.keys // 16) * (plan.dq_columns // 8)
        products = 2 * (d // 16) * (plan.warp_rows // 8) + 2 * (plan.d_share // 8) * (plan.rows // 16) + dq
    else:
        assert (plan.keys, plan.rows) == ((64, 32) if d == 64 else (32, 16))
        # dV and dK over the block's share of the columns ((E / halves / 8) (rows / 16) each), and a
        # loop over the warp's dQ fragments (keys / 16 each)
        assert plan.halves == (1 if d == 64 else 2)
        products = 2 * (d // 16) * (plan.rows // 8) + 2 * (d // plan.halves // 8) * (plan.rows // 16) + plan.keys // 16
    backward = [k for k in impl.kernels(d, d) if k.name.startswith("attention_backward_kernel_0[")]
    texts: dict = {}
    reports = _check(impl, d, backward, texts)
    for ptx in texts.values():
        assert ptx.count(mma) == products
    assert all(report.registers <= 255 for report in reports.values())


#: a floating-point atomic add in PTX (``atom.global.add.f32``, ``red.global.add.f64``, ...)
FLOAT_ATOMIC = re.compile(r"\b(?:atom|red)(?:\.\w+)*\.add\.f(?:16|32|64)\b")


@pytest.mark.parametrize(
    "example,name,dtype",
    [
        ("causal", "causal", "f32"),
        ("gqa", "grouped_query_attention", "f32"),
        ("relative_bias", "relative_bias", "f32"),
        ("alibi", "causal_alibi", "bf16"),
    ],
)
def test_deterministic_backward_kernels(example, name, dtype):
    """deterministic=True at the default 64 x 64 blocks, head dim 64: the key-major kernel, the dQ kernel
    (on tensor cores where every site is uniform) and the two ordered sums (of a key/value head's query
    positions, of the sites' per-block slices) compile for sm_80 and sm_90 with no local memory, no spills and no
    floating-point atomics, where the default backward has them."""
    from attncomp.backends import numba_cuda
    from attncomp.backends.numba_cuda.ptx import compile_ptx
    from tests.cuda_sim.helpers import retyped

    spec = getattr(load_example(example), name)
    spec = spec if dtype == "f32" else retyped(spec, dtype)
    # the default backward with atomics: float32's scalar one (its 3xTF32 one is slow to compile and
    # has its own test)
    ieee = "cse,softmax-fusion,flash-tiling{precision=ieee},mask-elimination,canonicalize,cse,dce"
    default = numba_cuda.build(
        ac.compile(spec, backend="interp", pipeline=ieee if dtype == "f32" else None).backward.module
    )
    # float32 on one tf32 product (the staged design; 3xTF32's kernels are slow to compile and the
    # default backward's have their own test), bf16 on the asynchronous-copy one (``mma/deterministic.py``)
    tf32 = "cse,softmax-fusion,flash-tiling{precision=tf32},mask-elimination,canonicalize,cse,dce"
    fn = ac.compile(spec, backend="interp", pipeline=tf32 if dtype == "f32" else None, deterministic=True)
    impl = numba_cuda.build(fn.backward.module)
    (kernels,) = impl.backward
    # the table indexed per element on the scalar kernels
    assert kernels.deterministic and (kernels.mma_plan(64, 64) is None) == (name == "relative_bias")
    backward = [k for k in impl.kernels(64, 64) if k.name.startswith("attention_backward_kernel_0")]
    names = [k.name for k in backward]
    assert names == [f"attention_backward_kernel_0{s}[D=64,E=64]" for s in ("", "_dq", "_heads", "_sites")]
    texts: dict = {}
    reports = _check(impl, 64, backward, texts)
    assert not any(FLOAT_ATOMIC.search(ptx) for ptx in texts.values())
    assert all(report.registers <= 255 for report in reports.values())
    (before,) = [k for k in default.kernels(64, 64) if k.name.startswith("attention_backward_kernel_0")]
    assert FLOAT_ATOMIC.search(compile_ptx(before.py_func, before.signature))  # the default adds dq so


@pytest.mark.parametrize(
    "example,name,precision",
    [("causal", "causal", "exact"), ("causal", "causal", "tf32"), ("alibi", "causal_alibi", "tf32")],
)
def test_tf32_backward_kernels(example, name, precision):
    """float32 gradients at D = 64: the five products per chunk on mma.sync.m16n8k8, three each of
    split operands (3xTF32, the default precision=exact) or one (precision=tf32); no local memory,
    no spills on sm_80 and sm_90."""
    from attncomp.backends import numba_cuda

    pipeline = f"cse,softmax-fusion,flash-tiling{{precision={precision}}},mask-elimination,canonicalize,cse,dce"
    fn = ac.compile(getattr(load_example(example), name), backend="interp", pipeline=pipeline)
    impl = numba_cuda.build(fn.backward.module)
    (kernels,) = impl.backward
    plan = kernels.mma_plan(64, 64)
    assert (plan.element, plan.keys, plan.rows) == ({"exact": "3xtf32"}.get(precision, "tf32"), 64, 16)
    backward = [k for k in impl.kernels(64, 64) if k.name.startswith("attention_backward_kernel_0[")]
    texts: dict = {}
    reports = _check(impl, 64, backward, texts)
    # per chunk: S^T and dP^T ((D / 8) (rows / 8) each), dV and dK ((E / 8) (rows / 8) each), and the
    # loop over the warp's dQ fragments (keys / 8 each); three of each for 3xTF32
    products = (4 * (64 // 8) * (plan.rows // 8) + plan.keys // 8) * (3 if precision == "exact" else 1)
    for ptx in texts.values():
        assert ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == products
    assert all(report.registers <= 255 for report in reports.values())


@pytest.mark.parametrize("example,name", [("alibi", "causal_alibi"), ("relative_bias", "relative_bias")])
def test_unfused_backward_kernels_compile(example, name):
    """pipeline="": the backward's ac.scatter_add (into slopes [H], into a table [H, R]) as a graph kernel."""
    from attncomp.backends import numba_cuda

    fn = ac.compile(getattr(load_example(example), name), backend="interp", pipeline="")
    impl = numba_cuda.build(fn.backward.module)
    assert any(k.name.endswith("scatter_add") for k in impl.graph_kernels)
    _check(impl, 64)


@pytest.mark.parametrize("rows", [1, 4])
def test_paged_attention_kernels(rows):
    """A paged decoder's attention reads keys and values through the page table in the kernel."""
    fn = ac.compile(load_example("gqa").grouped_query_attention, backend="cuda")
    impl = fn.paged_decoder(page_size=16, num_pages=8).paged.fn.program
    kernels = impl.decode_kernels(64, rows=rows)
    assert "page = arg_" in kernels[0].source and "_table[" in kernels[0].source
    _check(impl, 64, kernels)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashattention_pages_are_read_in_place_through_the_table(head_dim):
    """``flash_attn_with_kvcache``'s paged spec: pages ``[num_pages, page_size, KV, D]`` read where they
    lie, bf16 patterns; a prefill chunk's tensor-core kernel copies each row's 16 bytes from its page
    by ``cp.async`` (the pool's row ``(page * size + slot) * heads + head``), and a decoding step's
    kernel reads the rows through the table: no local memory; no spills at D = 128 (at D = 64 ptxas
    spills a few bytes of the prefill kernel at 255 registers, as of the ragged paged kernels)."""
    pytest.importorskip("torch")  # attncomp.flash_attn's package imports it
    from attncomp.backends import numba_cuda
    from attncomp.backends.numba_cuda.ptx import local_memory_lines
    from attncomp.flash_attn.specs import flash_attention_paged

    module = ac.compile(flash_attention_paged, backend="interp", causal=True).for_dtype("bf16").module
    impl = numba_cuda.build(module)
    assert impl.attention[0].choice_for(head_dim, head_dim).async_copies and not impl.graph_kernels
    (prefill,) = [k for k in impl.kernels(head_dim, head_dim) if k.name.startswith("attention_kernel_0")]
    assert "k_heads + k_head" in prefill.source and "k_table[pq]" in prefill.source
    decode = impl.decode_kernels(head_dim, rows=4)
    if head_dim == 128:
        _check(impl, head_dim, [prefill, *decode])
    for kernel in (prefill, *decode):
        for ptx in _compiled(kernel, TARGETS).values():
            assert local_memory_lines(ptx) == []
            assert ("cp.async" in ptx) == (kernel is prefill)


@pytest.mark.parametrize("element", ["float32", "uint16", "uint8"])
def test_page_writing_kernels(element):
    """The kernels a device pool is written with: new rows into their slots, a page copied on write;
    a bf16 pool's (uint16 patterns) move 16-bit words, an 8-bit pool's bytes.  No local memory."""
    from attncomp.backends.numba_cuda.host import pages
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for, local_memory_lines

    for kernel, signature in pages.SIGNATURES[element].items():
        for cc, ptx in compile_ptx_for(kernel.py_func, signature, TARGETS).items():
            assert f".target sm_{cc[0]}{cc[1]}" in ptx and ".entry" in ptx
            assert local_memory_lines(ptx) == []
            assert ("st.global.u16" in ptx) == (element == "uint16")


@pytest.mark.parametrize("rows", [1, 16])
def test_bf16_paged_attention_kernels(rows):
    """A bf16 pool's reader: the pages are uint16 patterns, widened as they are read through the page
    table (scalar kernels), or (tensor cores, 16 rows) copied a row's 16 bytes at a time from its page
    by ``cp.async`` (``mma/page_copies.py``)."""
    from tests.passes.specs import generic_alibi

    fn = ac.compile(generic_alibi, backend="cuda")
    impl = fn.paged_decoder(page_size=16, num_pages=8, dtype="bf16").paged.fn.program
    (kernel,) = impl.decode_kernels(64, rows=rows)
    # the output (rounded in the kernel), the query, and the key and value pages: C-contiguous, as a step passes them
    assert kernel.signature.count("uint16[:, :, :, ::1]") == 4
    assert ("k_table[pq]" if rows == 16 else "widen_bf16(") in kernel.source
    _check(impl, 64, [kernel])


@pytest.mark.parametrize("head_dim", [128])  # GQA 32/8's; D = 64 runs in the simulator's server test
def test_bf16_paged_gqa_decode_kernels(head_dim):
    """A bf16 GQA 32/8 server's step: the group's heads packed into one tile, its pages copied by
    ``cp.async`` through the table; no local memory, no spills on sm_80 and sm_90."""
    from tests.cuda_sim.helpers import retyped

    fn = ac.compile(retyped(load_example("gqa").grouped_query_attention, "bf16"), backend="cuda")
    impl = fn.paged_decoder(page_size=16, num_pages=8, dtype="bf16").paged.fn.program
    (kernel,) = impl.decode_kernels(head_dim, rows=1, group=4)
    assert kernel.choice.packed_heads and "cp_async16(k_sh" in kernel.source and "v_table[pq]" in kernel.source
    # ptxas spills a few bytes of these ragged kernels (32 to 84 bytes at 255 registers: their tile
    # classification gathers each sequence's start and positions, and each copy row looks its page
    # up); the non-paged ragged kernel and a decoder's have none.  The PTX is held to no local memory.
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for, local_memory_lines

    for ptx in compile_ptx_for(kernel.py_func, kernel.signature, TARGETS, kernel.launch_bounds).values():
        assert local_memory_lines(ptx) == [] and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx


@pytest.mark.parametrize("cache", ["f8e4m3", "f8e5m2"])
def test_8bit_paged_attention_kernels(cache):
    """A pool of 8-bit pages: the scalar attention kernel reads each row's codes (bytes) through the
    page table, decodes them and multiplies them by the scale at the same page and slot; no local
    memory."""
    fn = ac.compile(load_example("gqa").grouped_query_attention, backend="cuda")
    impl = fn.paged_decoder(page_size=16, num_pages=8, cache=cache).paged.fn.program
    (kernel,) = impl.decode_kernels(64, rows=1)
    assert kernel.choice.cache == cache and not kernel.choice.mma
    assert f"decode_{cache}(" in kernel.source and "_scale[page, " in kernel.source
    assert kernel.signature.count("uint8[") == 2  # the key and the value pages
    _check(impl, 64, [kernel])


@pytest.mark.parametrize("cache", ["f8e4m3", "f8e5m2"])
@pytest.mark.parametrize("head_dim,rows", [(64, 1), (128, 4)])
def test_8bit_cache_decode_kernels(cache, head_dim, rows):
    """A decoder over an 8-bit cache: the scalar attention kernel decodes codes (bytes) as it stages
    keys and values, and the append quantises rows (integer arithmetic on the bits, no local memory)."""
    pipeline = DECODER.replace("kv-cache-reuse", f"kv-cache-reuse{{cache={cache}}}")
    impl = _build(load_example("gqa").grouped_query_attention, pipeline)
    (attention,) = impl.decode_kernels(head_dim, rows=rows)
    assert attention.choice.cache == cache and not attention.choice.mma
    assert f"decode_{cache}(" in attention.source and "uint8[" in attention.signature
    appends = [k for k in impl.kernels(head_dim) if k.name.endswith("cache_append")]
    assert len(appends) == 1 and f"encode_{cache}(" in appends[0].source  # keys and values: one launch
    _check(impl, head_dim, [attention, *appends])


def test_decoder_rounding_append_and_query_kernels():
    """A bf16 decoder whose keys and values are computed: the append (keys and values in one kernel)
    rounds float32 to bf16 patterns, and so does the copy of the query the attention reads (integer
    arithmetic, no local memory)."""
    from tests.cuda_sim.helpers import projected_attention

    impl = ac.compile(projected_attention(), backend="cuda").decoder(8, dtype="bf16").fn.program
    kernels = [k for k in impl.kernels(8) if k.name.endswith(("cache_append", "bf16_patterns"))]
    assert len(kernels) == 2 and all("round_bf16(" in k.source for k in kernels)  # keys and values: one append
    assert all(k.signature.startswith("void(uint16[") for k in kernels)
    _check(impl, 8, kernels)


@pytest.mark.parametrize("bits", ["uint16", "int16"])
def test_bf16_conversion_kernels(bits):
    """The kernels that widen bf16 device memory given as patterns (``arrays.widen``; torch's bf16 is
    viewed as int16) and round float32 device results to bf16 patterns (``arrays.rounded``): integer
    moves and shifts, no local memory."""
    from attncomp.backends.numba_cuda.host import arrays
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for, local_memory_lines

    for kernel, signature in [
        (arrays._widen_kernel, f"void(float32[::1], {bits}[::1])"),
        (arrays._round_kernel, "void(uint16[::1], float32[::1])"),
    ]:
        for cc, ptx in compile_ptx_for(kernel.py_func, signature, TARGETS).items():
            assert f".target sm_{cc[0]}{cc[1]}" in ptx and ".entry" in ptx
            assert local_memory_lines(ptx) == []


def library_bf16_kernels() -> list:
    """(kernel, signature) of the same two conversions written with numba-cuda's own bf16: widening a
    ``bfloat16`` array (what a torch bf16 tensor is typed as through DLPack), and rounding into one
    with the library's round-to-nearest-even conversion."""
    from numba import cuda, float32
    from numba.cuda.bf16 import float32_to_bfloat16_rn

    def widen(out, x):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = float32(x[i])

    def rounded(out, x):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = float32_to_bfloat16_rn(x[i])

    return [(widen, "void(float32[::1], bfloat16[::1])"), (rounded, "void(bfloat16[::1], float32[::1])")]


def test_the_library_bf16_conversions_go_through_local_memory():
    """Why the kernels keep bf16 as 16-bit words (``Bf16Bits``) and convert with ``warp.widen_bf16`` and
    ``warp.round_bf16`` (docs/architecture.md, "bf16 on the device"): numba-cuda 0.30's bf16 arrays
    compile, but each conversion is a call whose argument and result pass through a local-memory frame
    (``__local_depot``), where ``test_bf16_conversion_kernels`` finds none.  When this fails, the
    library's conversions can replace the hand-written ones."""
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for, local_memory_lines

    for kernel, signature in library_bf16_kernels():
        for ptx in compile_ptx_for(kernel, signature, TARGETS).values():
            assert local_memory_lines(ptx) and "call" in ptx


def test_torch_bf16_array_interface_is_no_numba_type():
    """torch describes a bf16 CUDA tensor's ``__cuda_array_interface__`` with typestr ``"<V2"`` (the
    interface has no bfloat16), which numba-cuda cannot type; it types ``ml_dtypes.bfloat16`` (and a
    DLPack bf16 tensor passed straight to a launch), but offers no public DLPack import to a device
    array that can be viewed, sliced and reshaped.  So a torch bf16 tensor crosses as its 16-bit
    patterns, viewed as int16 (``Program.bf16_patterns``)."""
    import ml_dtypes
    import numpy as np
    from numba.cuda import types
    from numba.cuda.core.errors import NumbaNotImplementedError
    from numba.cuda.np import numpy_support

    with pytest.raises(NumbaNotImplementedError):
        numpy_support.from_dtype(np.dtype("<V2"))
    assert numpy_support.from_dtype(np.dtype(ml_dtypes.bfloat16)) == types.bfloat16


def test_attention_kernels_carry_their_block_size_as_launch_bounds():
    """The forward and backward kernels are compiled with launch bounds of the threads they are
    launched with (``.maxntid``): ptxas keeps registers x threads within the register file."""
    from attncomp.backends import numba_cuda
    from tests.cuda_sim.helpers import retyped

    fn = ac.compile(retyped(load_example("causal").causal, "bf16"), backend="interp")
    impl, backward = numba_cuda.build(fn.module), numba_cuda.build(fn.backward.module)
    (forward,) = [k for k in impl.kernels(64, 64) if k.name.startswith("attention_kernel_0[")]
    (grads,) = [k for k in backward.kernels(64, 64) if k.name.startswith("attention_backward_kernel_0[")]
    assert forward.launch_bounds == impl.attention[0].threads(64, 64) == 64  # two warps of 32 rows
    assert grads.launch_bounds == backward.backward[0].launch_plan(64, 64).threads
    assert f"@cuda.jit(cache=True, launch_bounds={forward.launch_bounds})" in forward.source


@pytest.mark.skipif(not _nvjitlink(), reason="ptxas (nvJitLink) is not installed")
def test_a_block_of_256_query_rows_fits_the_register_file():
    """flash-tiling{block_q=256} (float32 at D = 64: 512 threads a block): without launch bounds ptxas
    gives each thread more registers than 512 threads may have, and the launch would fail; with them
    it keeps to 128, and the check before a launch agrees."""
    from attncomp.backends.numba_cuda.host import launches
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for, ptxas_report

    pipeline = "cse,softmax-fusion,flash-tiling{block_q=256},mask-elimination,canonicalize,cse,dce"
    impl = _build(load_example("causal").causal, pipeline)
    (kernel,) = [k for k in impl.kernels(64, 64) if k.name.startswith("attention_kernel_0[")]
    threads = impl.attention[0].threads(64, 64)
    assert threads == kernel.launch_bounds == 512
    bounded = ptxas_report(compile_ptx_for(kernel.py_func, kernel.signature, [(8, 0)], threads)[8, 0], (8, 0))
    assert bounded.registers <= 128
    launches.check_block(kernel.name, threads, bounded.registers)
    free = ptxas_report(compile_ptx_for(kernel.py_func, kernel.signature, [(8, 0)])[8, 0], (8, 0))
    assert free.registers > 128
    with pytest.raises(launches.LaunchResourceError, match="512 threads"):
        launches.check_block(kernel.name, threads, free.registers)


def test_warp_instructions_are_convergent_calls():
    """The inline PTX of the tensor-core kernels: mma.sync, shfl.sync and ldmatrix.sync are
    ``convergent`` calls (LLVM may not move them into code some lanes skip); the copies and ldmatrix
    touch shared memory, so they have side effects (never dropped, merged or moved across a
    barrier), and the arithmetic has none."""
    from numba.cuda.compiler import _compile_pyfunc_with_fixup

    from tests.cuda_sim.helpers import retyped

    impl = _build(retyped(load_example("causal").causal, "bf16"))
    (kernel,) = [k for k in impl.kernels(64, 64) if k.name.startswith("attention_kernel_0[")]
    library, _ = _compile_pyfunc_with_fixup(
        kernel.py_func,
        kernel.signature,
        debug=False,
        lineinfo=False,
        device=False,
        fastmath=False,
        cc=(8, 0),
        opt=True,
        abi="numba",
        abi_info=None,
        forceinline=False,
        launch_bounds=kernel.launch_bounds,
        lto=False,
    )
    calls = [line for line in library.get_llvm_str().splitlines() if " asm " in line and "call " in line]
    warp = [line for line in calls if "mma.sync" in line or "shfl.sync" in line or "ldmatrix.sync" in line]
    assert len(warp) > 16 and all(line.rstrip().endswith("convergent") for line in warp)
    memory = ("cp.async", "ldmatrix")
    assert any("cp.async.cg" in line for line in calls) and any("ldmatrix" in line for line in calls)
    assert all(("asm sideeffect" in line) == any(m in line for m in memory) for line in calls)
    assert all(" convergent" not in line for line in calls if "cvt.rn" in line or "ex2.approx" in line)


@pytest.mark.parametrize("example,name,dtype", [("causal", "causal", "bf16"), ("lse", "key_padding_with_lse", "f16")])
def test_the_backward_delta_kernel(example, name, dtype):
    """``delta = rowsum(d_out * out) - d_lse`` is one graph kernel (a reduction with its casts, product
    and difference inline, ``host/fused_reductions.py``): it compiles for sm_80 and sm_90 with no local
    memory and no spills, and reads the 16-bit arrays as stored (16-bit loads: float16, or bf16's
    patterns, widened as they are read)."""
    from attncomp.backends import numba_cuda
    from tests.cuda_sim.helpers import retyped

    fn = ac.compile(retyped(getattr(load_example(example), name), dtype), backend="interp")
    impl = numba_cuda.build(fn.backward.module)
    delta = [k for k in impl.graph_kernels if not k.name.endswith("_reshape")]
    assert [k.name for k in delta] == ["k0_reduce"]
    texts: dict = {}
    _check(impl, 64, [k for k in impl.kernels(64, 64) if k.name == "k0_reduce"], texts)
    for ptx in texts.values():
        assert "ld.global.u16" in ptx or "ld.global.b16" in ptx


def test_the_one_pass_search_finds_numba_cudas_singly_assigned_variables(monkeypatch):
    """``lowering_fix``: while a tensor-core kernel lowers (bf16, D = 32), the one-pass search finds,
    for every function, the set numba-cuda's own method finds."""
    from numba.cuda import lowering

    from attncomp.backends.numba_cuda import lowering_fix
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for
    from tests.cuda_sim.helpers import retyped

    assert lowering_fix.install()
    replaced = lowering_fix.original()
    assert replaced is not None  # numba-cuda's own, kept
    compared = []

    def both(self):
        replaced(self)
        theirs = self._singly_assigned_vars
        ours = lowering_fix.singly_assigned(self)
        compared.append((len(ours), ours == theirs))

    monkeypatch.setattr(lowering.Lower, "_find_singly_assigned_variable", both)
    impl = _build(retyped(load_example("causal").causal, "bf16"))
    kernel = next(k for k in impl.kernels(32, 32) if k.name.startswith("attention_kernel_0["))
    compile_ptx_for(kernel.py_func, kernel.signature, [(8, 0)], kernel.launch_bounds)
    assert compared and all(same for _, same in compared), compared
    assert sum(n for n, _ in compared) > 500  # a kernel with many register-held variables


def test_a_mask_given_as_data_compiles_without_spills():
    """m[b, i, j], a boolean tensor: its two-axis block summaries (graph kernels) and the bf16
    forward that reads it per element in masked tiles, at D = 128, no local memory, no spills."""
    from attncomp.passes import default_pipeline
    from tests.cuda_sim.helpers import retyped
    from tests.passes.specs import dense

    impl = _build(retyped(dense, "bf16"), default_pipeline("cuda"))
    assert sum(k.name.endswith("_block_reduce") for k in impl.graph_kernels) == 4
    _check(impl, 128)


def test_dropout_kernels_compile_without_spills():
    """Attention dropout's hash (``ac.random``: 64-bit and 32-bit multiplies and shifts, per element) in
    the bf16 forward and backward on tensor cores at D = 64 (the backward near the register file's
    limit): no local memory, no spills.  (The scalar kernels' weight is checked in the simulator.)"""
    from attncomp.backends import numba_cuda
    from attncomp.passes import default_pipeline
    from tests.cuda_sim.helpers import retyped
    from tests.e2e.test_dropout import dropout_gqa

    bf16 = ac.compile(retyped(dropout_gqa, "bf16"), backend="interp", pipeline=default_pipeline("cuda"))
    impl = _build(retyped(dropout_gqa, "bf16"), default_pipeline("cuda"))
    texts: dict = {}
    _check(impl, 64, texts=texts)
    _check(numba_cuda.build(bf16.backward.module), 64, texts=texts)
    assert all("mul.lo.s64" in ptx or "mul.lo.u64" in ptx for ptx in texts.values() if "mma.sync" in ptx)
