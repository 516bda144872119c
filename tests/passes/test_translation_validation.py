"""Every pass preserves meaning: the interpreter gives the same result on the
IR before and after it, for every example spec and the pass tests' specs.

Blocks of 5 query rows and 7 keys make every tile shape appear at the test
sizes: full blocks, short last blocks, and skipped, masked and full tiles.
"""

import numpy as np
import pytest

import attncomp as ac
from attncomp.ir.binding import bind_arguments
from attncomp.ir.verifier import verify_module
from attncomp.testing import random_inputs, worst_error
from tests.conftest import example_names, load_example
from tests.passes import specs as pass_specs

PIPELINE = "cse,softmax-fusion,dce,flash-tiling{block_q=5,block_k=7},mask-elimination,canonicalize,cse,dce"
SIZES = {"B": 2, "H": 4, "KV": 2, "T": 13, "S": 11, "D": 8, "E": 6, "C": 24, "R": 9, "L": 520, "QB": 1, "KB": 1}


def _cases():
    cases = []
    for name in example_names():
        module = load_example(name)
        for attr, value in sorted(vars(module).items()):
            if isinstance(value, ac.Spec):
                cases.append(pytest.param(module, value, id=f"{name}.{attr}"))
    for attr, value in sorted(vars(pass_specs).items()):
        if isinstance(value, ac.Spec):
            cases.append(pytest.param(pass_specs, value, id=f"pass_specs.{attr}"))
    return cases


def _inputs(module, spec, rng):
    """The example's own inputs where they fit the spec, else random ones."""
    make = getattr(module, "make_inputs", None)
    if make is not None:
        inputs = make(rng)
        try:
            bind_arguments(spec.ir.main, inputs, verify_module(spec.ir))
            return inputs
        except (TypeError, ac.ShapeError):
            pass
    return random_inputs(spec.ir.main, SIZES, seed=7)


def _as_list(result):
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("module,spec", _cases())
def test_every_stage_means_the_same(module, spec):
    rng = np.random.default_rng(3)
    inputs = _inputs(module, spec, rng)
    fn = ac.compile(spec, backend="interp", pipeline=PIPELINE)
    reference = _as_list(ac.interpret(spec, *inputs))
    for stage in fn.stages:
        got = _as_list(ac.interpret(ac.parse_ir(fn.ir(stage)), *inputs))
        error = worst_error(got, reference)
        assert error < 1e-10, f"after {stage}: relative error {error:.3e}"
