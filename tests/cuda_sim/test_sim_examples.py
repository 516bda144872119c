"""Every example spec on the CUDA backend, under the simulator, against the interpreter.

Tiled (blocks of 8, sizes that are not multiples of them: T = 13, S = 11)
and unfused (``pipeline=""``: every graph op as its own kernel).
"""

import numpy as np
import pytest

import attncomp as ac
from attncomp.ir.types import NUMPY_DTYPES
from attncomp.testing import TOLERANCE, random_inputs, worst_error
from tests.conftest import load_example
from tests.cuda_sim.helpers import as_list, run_cuda
from tests.passes.test_translation_validation import SIZES, _cases, _inputs

#: the simulator runs every thread of a block in turn: MLA's wide heads (192 features, and a latent
#: of 520) at one batch position, one or two heads and 13 query rows (unfused, 29 s with the inputs
#: the other examples' sizes give them, 4 s so)
FEWER_HEADS = {
    "mla_prefill": lambda module, rng: module.make_inputs(rng, H=1, T=13, S=11),
    "mla_absorbed_decode": lambda module, rng: random_inputs(
        module.mla_absorbed_decode.ir.main, {**SIZES, "B": 1, "H": 2, "KV": 1}, seed=7
    ),
}


@pytest.mark.parametrize("module,spec", _cases())
@pytest.mark.parametrize("pipeline", ["tiled", "unfused"])
def test_example_matches_the_interpreter(module, spec, pipeline):
    from tests.cuda_sim.helpers import PIPELINE

    rng = np.random.default_rng(5)
    smaller = FEWER_HEADS.get(spec.ir.main.name)
    inputs = smaller(module, rng) if smaller is not None else _inputs(module, spec, rng)
    got = run_cuda(spec, inputs, PIPELINE if pipeline == "tiled" else "")
    want = as_list(ac.interpret(spec, *inputs))
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, value in zip(got, spec.ir.main.results):
        assert g.dtype == np.dtype(NUMPY_DTYPES[value.type.dtype])
    assert worst_error(got, want) < 5 * TOLERANCE["f32"]


@pytest.mark.parametrize("lanes", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "example,name", [("alibi", "causal_alibi"), ("gqa", "grouped_query_attention"), ("lse", "causal_with_lse")]
)
def test_every_lane_layout(example, name, lanes):
    """Rows split over 1 to 8 threads; E = 6 leaves padded features in the last lane slices."""
    module = load_example(example)
    spec = getattr(module, name)
    rng = np.random.default_rng(11)
    shapes = {
        "q": (2, 4, 13, 8),
        "k": (2, 2 if "gqa" in example else 4, 11, 8),
        "v": (2, 2 if "gqa" in example else 4, 11, 6),
        "slopes": (4,),
    }
    inputs = [rng.standard_normal(shapes[a.name]).astype(np.float32) for a in spec.ir.main.args]
    got = run_cuda(spec, inputs, lanes=lanes)
    assert worst_error(got, as_list(ac.interpret(spec, *inputs))) < 5 * TOLERANCE["f32"]
