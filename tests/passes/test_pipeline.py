"""The pass manager: pipeline strings, stages, verification after each pass."""

import pytest

import attncomp as ac
from attncomp.passes import DEFAULT_PIPELINE, PASSES, default_pipeline, parse_pipeline
from attncomp.passes.manager import CPU_PIPELINE, CUDA_PIPELINE
from tests.passes.specs import causal, generic_alibi


def test_pass_names_are_the_documented_ones():
    assert {"softmax-fusion", "flash-tiling", "mask-elimination", "cse", "dce"} <= set(PASSES)


def test_options_are_parsed_and_typed():
    passes = parse_pipeline("softmax-fusion,flash-tiling{block_q=32,block_k=16},mask-elimination")
    assert [p.name for p in passes] == ["softmax-fusion", "flash-tiling", "mask-elimination"]
    assert (passes[1].block_q, passes[1].block_k) == (32, 16)


def test_unknown_pass_lists_the_valid_ones():
    with pytest.raises(ac.PipelineError, match=r"unknown pass 'fusion'; valid passes: .*softmax-fusion"):
        parse_pipeline("cse,fusion")


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ac.PipelineError, match=r"no option 'block'; valid options: block_q, block_k"):
        parse_pipeline("flash-tiling{block=3}")


def test_bad_option_value():
    with pytest.raises(ac.PipelineError, match="flash-tiling.block_q"):
        parse_pipeline("flash-tiling{block_q=big}")


def test_stages_and_dump():
    fn = ac.compile(causal, backend="interp")
    assert fn.stages == ["cse", "softmax-fusion", "flash-tiling", "mask-elimination", "canonicalize", "cse", "dce"]
    assert fn.ir("input") == str(causal.ir)
    assert "ac.attention" in fn.ir("softmax-fusion")
    assert "ac.tile_grid" in fn.ir("final")
    dump = fn.dump()
    assert dump.index("after input") < dump.index("after softmax-fusion") < dump.index("after mask-elimination")
    assert len(fn.timings) == len(fn.stages)
    with pytest.raises(KeyError, match="stages: input, cse"):
        fn.ir("nope")


def test_empty_pipeline_runs_the_graph_unfused():
    fn = ac.compile(causal, backend="interp", pipeline="")
    assert fn.stages == []
    assert fn.ir("final") == str(causal.ir)


def test_every_stage_parses_back_to_the_same_text():
    fn = ac.compile(causal, backend="interp")
    for stage in ["input", *fn.stages]:
        text = fn.ir(stage)
        assert str(ac.parse_ir(text)) == text


def test_a_pass_that_breaks_the_ir_is_named(monkeypatch):
    from attncomp.passes.dce import DeadCodeElimination

    def broken(self, module, remarks):
        body = module.main.body
        body.ops.insert(0, body.ops.pop(1))  # a use before its definition

    monkeypatch.setattr(DeadCodeElimination, "run", broken)
    with pytest.raises(ac.VerifyError, match=r"after pass dce: line \d+: .*used before it is defined"):
        ac.compile(causal, backend="interp", pipeline="dce")


def test_flash_tiling_precision_is_on_the_tile_grid():
    """``precision`` rides on ``ac.tile_grid`` (the default is not printed), parses back, and is checked."""
    default = ac.compile(causal, backend="interp").ir("final")
    assert "precision" not in default
    pipeline = "softmax-fusion,flash-tiling{block_q=32,precision=tf32},mask-elimination"
    fn = ac.compile(causal, backend="interp", pipeline=pipeline)
    text = fn.ir("final")
    assert 'ac.tile_grid {block_q = 32, precision = "tf32"}' in text
    assert str(ac.parse_ir(text)) == text
    assert fn.pipeline == pipeline
    with pytest.raises(ac.PipelineError, match="flash-tiling: precision must be one of exact, tf32, ieee"):
        ac.compile(causal, backend="interp", pipeline="softmax-fusion,flash-tiling{precision=fast}")
    with pytest.raises(ac.VerifyError, match="ac.tile_grid: precision must be one of"):
        ac.parse_ir(text.replace('"tf32"', '"fp8"'))


def test_cpu_computes_float32_whatever_the_precision():
    fn = ac.compile(causal, backend="cpu")
    pipeline = fn.pipeline.replace("block_k=128", "block_k=128,precision=tf32")
    assert ac.compile(causal, backend="cpu", pipeline=pipeline).source == fn.source


def test_default_pipelines():
    """cpu tiles 128 keys a block by default, and 128 query rows where its BLAS runs OpenBLAS's Haswell
    kernels, 64 elsewhere; cuda 128 query rows where query, key and value are 16-bit; interp the pass's
    defaults (64)."""
    from attncomp.backends.numba_cpu.intrinsics import blas_kernels

    cpu = ac.compile(causal, backend="cpu")
    assert cpu.pipeline == default_pipeline("cpu", blas_kernels()) and "block_k = 128" in cpu.ir()
    rows = 128 if blas_kernels() == "Haswell" else 64
    assert f"ac.tile_grid {{block_q = {rows}}}" in cpu.ir()
    assert default_pipeline("cpu") == CPU_PIPELINE == default_pipeline("cpu", "SkylakeX")
    assert "flash-tiling{block_q=64,block_k=128}" in CPU_PIPELINE
    assert "flash-tiling{block_q=128,block_k=128}" in default_pipeline("cpu", "Haswell")
    assert ac.compile(causal, backend="interp").pipeline == DEFAULT_PIPELINE
    assert "block_k = 64" in ac.compile(causal, backend="interp").ir()
    assert default_pipeline("cuda") == CUDA_PIPELINE
    generic = ac.compile(generic_alibi, backend="interp", pipeline=CUDA_PIPELINE)
    for dtype, rows in (("bf16", 128), ("f16", 128), ("f32", 64)):
        assert f"block_q = {rows}" in generic.for_dtype(dtype).ir(), dtype
    # the backward's tiles keep block_q
    assert "block_q = 64" in generic.for_dtype("bf16").backward.ir()
