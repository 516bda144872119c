"""Every spec of every example, on ``interp`` and ``cpu``, against its direct numpy formula.

The numpy references (``numpy_reference`` in each example) are written
without the DSL, so these tests check the whole compiler, not only that a
backend agrees with the interpreter.  Sizes span several 64 x 64 tiles with a
ragged last one, and constants are chosen so that mask-elimination has tiles
to skip and tiles to compute unmasked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from conftest import example_names, load_example

import attncomp as ac
from attncomp.testing import TOLERANCE, worst_error

#: a compiled function returns float32; the cpu backend also computes in it
BOUNDS = {"interp": 1e-5, "cpu": 1e-4}

Inputs = Callable[[np.random.Generator], list[np.ndarray]]


@dataclass
class Case:
    """One run of an example's spec: how to make its inputs, and which reference to call."""

    example: str
    spec: str
    inputs: Inputs | None = None  # default: the module's make_inputs
    reference: Callable[..., Any] | None = None  # default: the module's numpy_reference
    constants: dict[str, Any] = field(default_factory=dict)
    label: str = ""  # tells apart cases of one spec with the same constants

    @property
    def id(self) -> str:
        settings = ",".join([*(f"{k}={v}" for k, v in self.constants.items()), *filter(None, [self.label])])
        return f"{self.example}:{self.spec}" + (f"[{settings}]" if settings else "")

    def build(self, rng: np.random.Generator) -> tuple[ac.Spec, list[np.ndarray], Any]:
        module = load_example(self.example)
        inputs = (self.inputs or module.make_inputs)(rng)
        reference = self.reference or module.numpy_reference
        expected = reference(*inputs, **self.constants)
        return getattr(module, self.spec), inputs, expected


def make(example: str, **sizes: Any) -> Inputs:
    """The example's own ``make_inputs`` at these sizes."""
    return lambda rng: load_example(example).make_inputs(rng, **sizes)


def reference(example: str, **flags: Any) -> Callable[..., Any]:
    """The example's ``numpy_reference`` with the keyword flags that select one of its specs."""
    return lambda *args, **constants: load_example(example).numpy_reference(*args, **flags, **constants)


def lse_with_lengths(rng: np.random.Generator) -> list[np.ndarray]:
    """``lse.make_inputs`` plus per-batch key lengths, one of them 0 (an all-masked batch entry)."""
    inputs = load_example("lse").make_inputs(rng, B=3, T=100, S=150)
    return [*inputs, np.array([150, 70, 0], dtype=np.int32)]


def worked_example(*rows_lists: list[list[float]]) -> Inputs:
    return lambda rng: load_example("seed_walkthrough").as_f32(*rows_lists)


def seed_walkthrough_cases() -> list[Case]:
    walk = load_example("seed_walkthrough")
    cat_sat = worked_example(walk.CAT_SAT_Q, walk.CAT_SAT_K, walk.CAT_SAT_V)
    one_query = worked_example(walk.ONE_QUERY_Q, walk.ONE_QUERY_K, walk.ONE_QUERY_V)
    causal, unscaled = reference("seed_walkthrough", causal=True), reference("seed_walkthrough", scaled=False)
    return [
        Case("seed_walkthrough", "cat_sat", cat_sat, label="worked"),
        Case("seed_walkthrough", "cat_sat", make("seed_walkthrough", T=70, S=90), label="random"),
        Case("seed_walkthrough", "cat_sat_causal", cat_sat, causal, label="worked"),
        Case("seed_walkthrough", "cat_sat_causal", make("seed_walkthrough", T=130, S=130), causal, label="random"),
        Case("seed_walkthrough", "one_query_unscaled", one_query, unscaled, label="worked"),
    ]


#: causal-style examples whose make_inputs takes B, H, T, S: three query blocks, the last ragged
SQUARE = dict(B=1, H=2, T=150, S=150)

#: the cases of each example, by example name; an example not listed has one spec and runs as is
CASES: dict[str, list[Case]] = {
    "alibi": [
        Case("alibi", "causal_alibi", make("alibi", **SQUARE), constants={"window": 40}),
    ],
    "causal": [Case("causal", "causal", make("causal", B=2, H=2, T=150, S=150))],
    "cross_attention": [
        Case("cross_attention", "cross_attention", make("cross_attention", B=2, T=70, S=130, C=16)),
    ],
    "document_mask": [
        Case("document_mask", "causal_document_mask", make("document_mask", B=2, H=2, T=200, n_docs=4)),
    ],
    "gqa": [
        Case("gqa", "grouped_query_attention", make("gqa", B=1, H=4, KV=2, T=100, S=100), label="KV=2"),
        Case("gqa", "grouped_query_attention", make("gqa", B=1, H=4, KV=1, T=100, S=100), label="KV=1"),
        Case("gqa", "multi_query_attention", make("gqa", B=1, H=4, KV=1, T=100, S=100)),
    ],
    "lse": [
        Case("lse", "causal_with_lse", make("lse", B=1, H=2, T=150, S=150)),
        Case("lse", "key_padding_with_lse", lse_with_lengths),
    ],
    "mha_projections": [
        Case(
            "mha_projections",
            "gpt2_attention",
            make("mha_projections", B=2, T=100, C=24),
            constants={"n_head": 3},
        ),
    ],
    "nanochat_attention": [
        Case(
            "nanochat_attention",
            "nanochat_attention",
            make("nanochat_attention", B=1, T=100, C=24, n_head=6, n_kv_head=2),
            constants={"n_kv_head": 2},
        ),
    ],
    "padding": [
        Case("padding", "key_padding", make("padding", B=3, H=2, T=100, S=150)),
        Case(
            "padding",
            "causal_key_padding",
            make("padding", B=3, H=2, T=150, S=150),
            reference("padding", causal=True),
        ),
    ],
    "prefix_lm": [Case("prefix_lm", "prefix_lm", make("prefix_lm", B=3, H=2, T=150, S=150))],
    "relative_bias": [
        Case(
            "relative_bias",
            "relative_bias",
            make("relative_bias", **SQUARE, max_distance=8),
            constants={"max_distance": 8},
        )
    ],
    "context_parallel": [
        Case(
            "context_parallel",
            "alibi_softcap",
            make("train_tiny_lm", **SQUARE),
            reference("train_tiny_lm"),
        )
    ],
    "mla": [
        Case("mla", "mla_prefill", make("mla", T=80, S=80)),
        Case("mla", "mla_absorbed_decode", make("mla", T=3, S=70, decode=True), label="3 new tokens"),
    ],
    "rope_qknorm": [Case("rope_qknorm", "rope_qknorm", make("rope_qknorm", **SQUARE))],
    "sdpa": [Case("sdpa", "sdpa", make("sdpa", B=1, H=2, T=70, S=150))],
    "seed_walkthrough": seed_walkthrough_cases(),
    "sinks_window": [
        Case(
            "sinks_window",
            "sinks_window",
            make("sinks_window", T=200, S=200),
            constants={"window": 40, "sinks": 3},
        ),
    ],
    "sliding_window": [
        Case(
            "sliding_window",
            "causal_sliding_window",
            make("sliding_window", T=200, S=200),
            constants={"window": 40},
        ),
        Case(
            "sliding_window",
            "two_sided_window",
            make("sliding_window", T=200, S=200),
            reference("sliding_window", causal=False),
            constants={"window": 40},
        ),
    ],
    "softcap": [
        Case("softcap", "causal_softcap", make("softcap", **SQUARE), constants={"cap": 1.0}),
    ],
    "softmax_spelled_out": [
        Case("softmax_spelled_out", "causal_softmax_spelled_out", make("softmax_spelled_out", **SQUARE)),
        Case("softmax_spelled_out", "causal_softmax_builtin", make("softmax_spelled_out", **SQUARE)),
    ],
}


def spec_names(example: str) -> list[str]:
    return [name for name, value in vars(load_example(example)).items() if isinstance(value, ac.Spec)]


def all_cases() -> list[Case]:
    cases = []
    for example in example_names():
        cases.extend(CASES.get(example) or [Case(example, name) for name in spec_names(example)])
    return cases


def test_every_spec_of_every_example_has_a_case():
    covered = {(case.example, case.spec) for case in all_cases()}
    missing = [(e, s) for e in example_names() for s in spec_names(e) if (e, s) not in covered]
    assert not missing, f"add these to CASES in {__file__}: {missing}"


@pytest.mark.parametrize("case", all_cases(), ids=lambda case: case.id)
def test_reference_interpreter_matches_numpy(case: Case):
    """The unoptimised graph in float64: only rounding may differ."""
    spec, inputs, expected = case.build(np.random.default_rng(0))
    got = ac.interpret(spec, *inputs, **case.constants)
    as_tuple = lambda r: r if isinstance(r, tuple) else (r,)  # noqa: E731
    assert worst_error(as_tuple(got), as_tuple(expected)) <= TOLERANCE["f64"]


@pytest.mark.parametrize("backend", ["interp", "cpu"])
@pytest.mark.parametrize("case", all_cases(), ids=lambda case: case.id)
def test_compiled_matches_numpy(case: Case, backend: str):
    spec, inputs, expected = case.build(np.random.default_rng(0))
    fn = ac.compile(spec, backend=backend, **case.constants)
    got = fn(*inputs)
    as_tuple = lambda r: r if isinstance(r, tuple) else (r,)  # noqa: E731
    got, expected = as_tuple(got), as_tuple(expected)
    assert len(got) == len(expected)
    for result, want in zip(got, expected):
        assert result.dtype == np.float32
        assert result.shape == np.shape(want)
    error = worst_error(got, expected)
    assert error <= BOUNDS[backend], f"{case.id} on {backend}: relative error {error:.2e}"
