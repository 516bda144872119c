"""widen-bf16: the cuda backend's own pass, bf16 values computed as float32 (docs/ir.md)."""

import re

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.dsl import Spec
from attncomp.passes import DEFAULT_PIPELINE
from attncomp.passes.manager import backend_pipeline
from tests.e2e.test_float_types import retyped
from tests.passes import specs

SPECS = [name for name, value in vars(specs).items() if isinstance(value, Spec) and name != "generic_alibi"]
WIDEN = DEFAULT_PIPELINE + ",widen-bf16"


def test_the_cuda_backend_runs_it_after_any_pipeline():
    assert backend_pipeline("cuda") == "widen-bf16"
    assert backend_pipeline("cpu") == backend_pipeline("interp") == ""


@pytest.mark.parametrize("name", SPECS)
def test_every_bf16_type_becomes_f32_and_nothing_else_changes(name):
    fn = ac.compile(retyped(getattr(specs, name), "bf16"), backend="interp", pipeline=WIDEN)
    before, after = fn.ir("dce"), fn.ir("widen-bf16")
    assert "bf16" in before and "bf16" not in after
    assert after == re.sub(r"(?<=[ <])bf16>", "f32>", before)  # only the types, as text would say


def test_a_module_without_bf16_is_left_as_it_is():
    fn = ac.compile(specs.causal, backend="interp", pipeline=WIDEN)
    assert fn.ir("widen-bf16") == fn.ir("dce")


def test_the_widened_stage_computes_what_the_spec_says():
    module = retyped(specs.causal, "bf16")
    fn = ac.compile(module, backend="interp", pipeline=WIDEN)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 9, 8)).astype(ml_dtypes.bfloat16) for _ in range(3))
    want = np.asarray(ac.interpret(module, q, k, v), dtype=np.float64)
    got = ac.interpret(ac.parse_ir(fn.ir("widen-bf16")), *(x.astype(np.float32) for x in (q, k, v)))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)  # bf16's final rounding apart
