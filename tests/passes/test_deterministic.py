"""``deterministic``: flash-tiling's option, carried to the backward's ``ac.key_grid``, and compile's keyword."""

import pytest

import attncomp as ac
from attncomp.passes.pipeline import tiling_pipeline
from tests.conftest import load_example
from tests.passes.specs import causal, generic_alibi

DETERMINISTIC = "cse,softmax-fusion,flash-tiling{deterministic=true},mask-elimination,canonicalize,cse,dce"


def test_compile_keyword_puts_the_option_on_the_key_grid():
    default = ac.compile(causal, backend="interp")
    fn = ac.compile(causal, backend="interp", deterministic=True)
    assert fn.pipeline == DETERMINISTIC
    assert "deterministic" not in default.backward.ir()
    text = fn.backward.ir()
    assert "ac.key_grid {block_k = 64, deterministic = true, kv_repeat = 1}" in text
    assert str(ac.parse_ir(text)) == text
    # nothing else changes: the forward, and the backward but for the attribute
    assert fn.ir() == default.ir()
    assert text.replace("deterministic = true, ", "") == default.backward.ir()


def test_the_pipeline_option_and_its_errors():
    pipeline = "softmax-fusion,flash-tiling{block_q=32,deterministic=true},mask-elimination"
    fn = ac.compile(load_example("gqa").grouped_query_attention, backend="interp", pipeline=pipeline)
    assert "ac.key_grid {block_k = 64, deterministic = true, kv_repeat = (H//KV)}" in fn.backward.dump()
    assert "deterministic" not in fn.ir()  # the forward's ac.tile_grid has no such attribute
    assert ac.compile(causal, backend="interp", pipeline=pipeline, deterministic=True).pipeline == pipeline
    with pytest.raises(ac.PipelineError, match="flash-tiling.deterministic"):
        ac.compile(causal, backend="interp", pipeline="softmax-fusion,flash-tiling{deterministic=maybe}")
    with pytest.raises(ac.VerifyError, match="ac.key_grid: deterministic must be true or false"):
        ac.parse_ir(fn.backward.ir().replace("deterministic = true", "deterministic = 1"))


def test_a_pipeline_without_flash_tiling():
    """The interpreter runs it as given; a compiled backend, which tiles what is left untiled, gets
    ``flash-tiling{deterministic=true}`` last."""
    assert tiling_pipeline("", tiled=False, deterministic=True) == ""
    assert tiling_pipeline("cse,softmax-fusion", tiled=False, deterministic=True) == "cse,softmax-fusion"
    tiled = "cse,softmax-fusion,flash-tiling{deterministic=true}"
    assert tiling_pipeline("cse,softmax-fusion", deterministic=True) == tiled
    assert tiling_pipeline(None, deterministic=True) == DETERMINISTIC
    assert ac.compile(causal, backend="interp", pipeline="", deterministic=True).pipeline == ""


def test_every_float_type_of_a_generic_spec():
    fn = ac.compile(generic_alibi, backend="interp", deterministic=True)
    for dtype in ("f32", "bf16"):
        assert "deterministic = true" in fn.for_dtype(dtype).backward.ir()
