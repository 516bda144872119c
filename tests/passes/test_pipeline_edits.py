"""Pipeline edits: pass lists in, pass lists out, printed as text that parses back to them."""

import pytest

from attncomp.passes import DEFAULT_PIPELINE, parse_pipeline
from attncomp.passes.pipeline import edit_pipeline, make_pass, pass_names, pipeline_text


def default():
    return parse_pipeline(DEFAULT_PIPELINE)


def test_text_round_trips_and_names_only_changed_options():
    passes = parse_pipeline("cse,chunk-pairs{part=outputs,masked=false},flash-tiling{block_q=16}")
    assert pipeline_text(passes) == "cse,chunk-pairs{part=outputs,masked=false},flash-tiling{block_q=16}"
    assert pipeline_text(parse_pipeline(pipeline_text(passes))) == pipeline_text(passes)
    assert pipeline_text(default()) == DEFAULT_PIPELINE


def test_insert_before_and_after_a_pass_or_at_the_ends():
    autodiff = make_pass("autodiff")
    assert pass_names(edit_pipeline(default(), insert=autodiff, before="flash-tiling"))[:4] == [
        "cse",
        "softmax-fusion",
        "autodiff",
        "flash-tiling",
    ]
    assert pass_names(edit_pipeline(parse_pipeline("cse"), insert=autodiff, before="flash-tiling")) == [
        "cse",
        "autodiff",
    ]
    reuse = make_pass("kv-cache-reuse")
    assert pass_names(edit_pipeline(default(), insert=reuse, after="softmax-fusion"))[2] == "kv-cache-reuse"
    assert pass_names(edit_pipeline(parse_pipeline("cse"), insert=reuse, after="softmax-fusion"))[0] == "kv-cache-reuse"


def test_replace_until_and_the_input_list_is_left_alone():
    passes = default()
    tiled = edit_pipeline(passes, replace=make_pass("flash-tiling", block_q=16, block_k=32))
    assert "flash-tiling{block_q=16,block_k=32}" in pipeline_text(tiled)
    assert pipeline_text(passes) == DEFAULT_PIPELINE
    assert pass_names(edit_pipeline(passes, until="softmax-fusion")) == ["cse", "softmax-fusion"]
    assert edit_pipeline(parse_pipeline("cse,dce"), until="softmax-fusion") == []
    appended = edit_pipeline(parse_pipeline("cse"), replace=make_pass("flash-tiling", block_q=8))
    assert pipeline_text(appended) == "cse,flash-tiling{block_q=8}"


def test_an_insert_names_one_place():
    with pytest.raises(ValueError, match="exactly one of before= and after="):
        edit_pipeline(default(), insert=make_pass("dce"))
