"""examples/train_tiny_lm.py: a tiny language model trains through fn.to_torch() as through torch ops."""

import pytest
from conftest import load_example

pytest.importorskip("torch", reason="the torch extra is not installed")


def test_twenty_steps_match_the_same_model_with_torch_attention():
    example = load_example("train_tiny_lm")
    ours, _ = example.train("attncomp", 20)
    theirs, _ = example.train("torch", 20)
    assert len(ours) == len(theirs) == 20
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 1e-3 * abs(b), f"step {step + 1}: {a} against {b}"
    assert ours[-1] < ours[0]


def test_bf16_causal_follows_sdpa_in_bf16():
    """--dtype bf16 --attention causal: the generic spec runs in bf16 through the op, and its losses
    follow the same bf16 model with SDPA within bf16 rounding."""
    example = load_example("train_tiny_lm")
    ours, _ = example.train("attncomp", 8, dtype="bf16", attention="causal")
    theirs, _ = example.train("torch", 8, dtype="bf16", attention="causal")
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step + 1}: {a} against {b}"
