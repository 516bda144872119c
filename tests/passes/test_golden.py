"""Exact IR text after each pass for small specs (tests/passes/golden/*.txt).

To accept a deliberate change of output, run with ATTNCOMP_UPDATE_GOLDEN=1
and review the diff of the golden files.
"""

import os
from pathlib import Path

import pytest

import attncomp as ac
from tests.passes import specs

GOLDEN = Path(__file__).parent / "golden"
#: the checkout's root: ac.check_index names the spec's file, which is written relative to it
ROOT = str(Path(__file__).resolve().parents[2]) + os.sep

CASES = [
    ("softmax_fusion_unmasked", specs.unmasked, "softmax-fusion", "softmax-fusion"),
    ("softmax_fusion_alibi", specs.causal_alibi, "cse,softmax-fusion", "softmax-fusion"),
    ("softmax_fusion_spelled_gqa_lse", specs.spelled_gqa_lse, "cse,softmax-fusion", "softmax-fusion"),
    (
        "flash_tiling_unmasked",
        specs.unmasked,
        "softmax-fusion,flash-tiling{block_q=16,block_k=32}",
        "flash-tiling",
    ),
    (
        "flash_tiling_document_gather_checks",
        specs.document,
        "cse,softmax-fusion,flash-tiling{block_q=16,block_k=16}",
        "flash-tiling",
    ),
    (
        "mask_elimination_causal_2d",
        specs.causal_2d,
        "softmax-fusion,flash-tiling{block_q=16,block_k=16},mask-elimination,canonicalize,cse,dce",
        "final",
    ),
]


#: backwards (fn.backward): the autodiff output, and the tiled and classified backward
BACKWARD_CASES = [
    ("autodiff_alibi", specs.causal_alibi, "cse,softmax-fusion", "autodiff"),
    ("autodiff_learned_temperature", specs.learned_temperature, "softmax-fusion", "autodiff"),
    (
        "backward_mask_elimination_causal_2d",
        specs.causal_2d,
        "softmax-fusion,flash-tiling{block_q=16,block_k=16},mask-elimination,canonicalize,cse,dce",
        "final",
    ),
]


@pytest.mark.parametrize(
    "name,spec,pipeline,stage,backward",
    [(*c, False) for c in CASES] + [(*c, True) for c in BACKWARD_CASES],
    ids=[c[0] for c in CASES + BACKWARD_CASES],
)
def test_golden_ir(name, spec, pipeline, stage, backward):
    fn = ac.compile(spec, backend="interp", pipeline=pipeline)
    text = (fn.backward if backward else fn).ir(stage).replace(ROOT, "")
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("ATTNCOMP_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()
