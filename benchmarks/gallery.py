"""The gallery (docs/gallery.md; the README quotes its first rows): each example variant, its line of
DSL, and the tiles it computes at T = 8192.

    python -m benchmarks.gallery            # prints the markdown table
    python -m benchmarks.gallery --t 2048   # another sequence length

For each variant the spec is compiled with the default pipeline (64 x 64
tiles) and ``fn.block_map`` classifies every tile for realistic inputs:
"computed" is the fraction of tiles run at all, "unmasked" the fraction run
without evaluating the mask.  Only the classification runs, so this takes
seconds, not the minutes the attention itself would.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import attncomp as ac

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

Inputs = Callable[[np.random.Generator, int], list[np.ndarray]]


def load_example(name: str):
    """Import ``examples/NAME.py`` (its ``__main__`` block does not run)."""
    module_name = f"attncomp_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


@dataclass
class Variant:
    example: str
    spec: str
    #: the spec's line(s) that make the variant, verbatim: checked against its source
    lines: tuple[str, ...]
    #: the inputs at sequence length t; the default is the example's make_inputs at T = S = t
    inputs: Inputs | None = None
    constants: dict[str, Any] = field(default_factory=dict)
    setting: str = ""


def heads(example: str, **sizes: Any) -> Inputs:
    """make_inputs with one head (the masks here do not depend on it) and tiny head dims."""
    return lambda rng, t: load_example(example).make_inputs(rng, **(dict(B=1, H=1, T=t, S=t, D=8, E=8) | sizes))


def with_lengths(example: str, fraction: float) -> Inputs:
    def make(rng: np.random.Generator, t: int) -> list[np.ndarray]:
        q, k, v, *_ = load_example(example).make_inputs(rng, B=1, H=1, T=t, S=t, D=8, E=8)
        return [q, k, v, np.array([round(fraction * t)], dtype=np.int32)]

    return make


def documents(rng: np.random.Generator, t: int) -> list[np.ndarray]:
    return load_example("document_mask").make_inputs(rng, B=1, H=1, T=t, D=8, E=8, n_docs=4)


def prefix(rng: np.random.Generator, t: int) -> list[np.ndarray]:
    q, k, v, _ = load_example("prefix_lm").make_inputs(rng, B=1, H=1, T=t, S=t, D=8, E=8)
    return [q, k, v, np.array([t // 4], dtype=np.int32)]


def tokens(example: str, **sizes: Any) -> Inputs:
    """make_inputs of a spec that starts from hidden states [B, T, C]."""
    return lambda rng, t: load_example(example).make_inputs(rng, B=1, T=t, **sizes)


CAUSAL = "masked = ac.where(j <= i, scores, -ac.inf)"
CAUSAL_SCORES = "scores = ac.where(j <= i, scores, -ac.inf)"
CAUSAL_S = "s = ac.where(j <= i, s, -ac.inf)"
LENGTHS = "lengths = 0.7 T"

VARIANTS = [
    Variant("sdpa", "sdpa", ("weights = ac.softmax(scores, axis=-1)",)),
    Variant("causal", "causal", (CAUSAL,)),
    Variant("padding", "key_padding", ("is_real_key = j < lengths[b]",), with_lengths("padding", 0.7), {}, LENGTHS),
    Variant(
        "padding",
        "causal_key_padding",
        ("visible = (j <= i) & (j < lengths[b])",),
        with_lengths("padding", 0.7),
        {},
        LENGTHS,
    ),
    Variant(
        "sliding_window", "causal_sliding_window", ("in_window = (j <= i) & (i - j < window)",), setting="window=256"
    ),
    Variant("sliding_window", "two_sided_window", ("in_window = ac.abs(i - j) < window",), setting="window=256"),
    Variant(
        "sinks_window",
        "sinks_window",
        ("visible = (j <= i) & ((i - j < window) | (j < sinks))",),
        setting="window=256, sinks=4",
    ),
    Variant("prefix_lm", "prefix_lm", ("visible = (j <= i) | (j < prefix[b])",), prefix, {}, "prefix = T/4"),
    Variant(
        "document_mask",
        "causal_document_mask",
        ("same_document = doc[b, i] == doc[b, j]", "scores = ac.where(same_document & (j <= i), scores, -ac.inf)"),
        documents,
        {},
        "4 documents, random lengths",
    ),
    Variant(
        "alibi",
        "causal_alibi",
        ("s = s + slopes[h] * (j - i)", "s = ac.where((j <= i) & (i - j < window), s, -ac.inf)"),
        setting="window=256",
    ),
    Variant("softcap", "causal_softcap", ("scores = cap * ac.tanh(scores / cap)", CAUSAL_SCORES), setting="cap=50"),
    Variant("sigmoid_attention", "causal_sigmoid", ("return ac.where(j <= i, ac.sigmoid(scores), 0.0) @ v",)),
    Variant(
        "relative_bias",
        "relative_bias",
        ("scores = scores + table[h, distance + max_distance]",),
        heads("relative_bias", max_distance=128),
        {"max_distance": 128},
        "max_distance=128",
    ),
    Variant(
        "gqa",
        "grouped_query_attention",
        ("k = ac.repeat_kv(k, n_rep)", CAUSAL_SCORES),
        heads("gqa", H=4, KV=2),
        {},
        "H=4, KV=2",
    ),
    Variant(
        "gqa",
        "multi_query_attention",
        ('k: ac.f32["B", 1, "S", "D"],', CAUSAL_SCORES),
        heads("gqa", H=4, KV=1),
        {},
        "H=4",
    ),
    Variant("rope_qknorm", "rope_qknorm", ("q = rms_norm(apply_rotary_emb(q, base), eps)", CAUSAL_SCORES)),
    Variant("lse", "causal_with_lse", ("lse = ac.logsumexp(scores, axis=-1)", CAUSAL_SCORES)),
    Variant(
        "lse",
        "key_padding_with_lse",
        ("lse = ac.logsumexp(scores, axis=-1)", "scores = ac.where(j < lengths[b], scores, -ac.inf)"),
        with_lengths("lse", 0.7),
        {},
        LENGTHS,
    ),
    Variant("softmax_spelled_out", "causal_softmax_spelled_out", ("p = e / ac.sum(e, -1, keepdims=True)", CAUSAL_S)),
    Variant("softmax_spelled_out", "causal_softmax_builtin", ("p = ac.softmax(s, axis=-1)", CAUSAL_S)),
    Variant(
        "cross_attention",
        "cross_attention",
        ("k = (memory @ w_k).reshape(B, S, n_head, head_dim).transpose(1, 2)",),
        lambda rng, t: load_example("cross_attention").make_inputs(rng, B=1, T=t, S=t, C=16),
        {},
        "C=16",
    ),
    Variant(
        "mha_projections",
        "gpt2_attention",
        ("q = qkv[..., :C].reshape(B, T, n_head, head_dim).transpose(1, 2)", CAUSAL_SCORES),
        tokens("mha_projections", C=24),
        {},
        "C=24",
    ),
    Variant(
        "nanochat_attention",
        "nanochat_attention",
        ("q, k = apply_rotary_emb(q, base), apply_rotary_emb(k, base)", CAUSAL_SCORES),
        tokens("nanochat_attention", C=24),
        {},
        "C=24",
    ),
]


@dataclass
class Row:
    variant: Variant
    computed: float
    unmasked: float
    seconds: float


def measure(variant: Variant, t: int, seed: int = 0) -> Row:
    module = load_example(variant.example)
    spec = getattr(module, variant.spec)
    source = inspect.getsource(spec.fn)
    for line in variant.lines:
        if line not in source:
            raise AssertionError(f"{variant.example}.{variant.spec} no longer has the line {line!r}")
    rng = np.random.default_rng(seed)
    inputs = variant.inputs(rng, t) if variant.inputs else heads(variant.example)(rng, t)
    start = time.perf_counter()
    fn = ac.compile(spec, backend="interp", **variant.constants)
    tiles = fn.block_map(*inputs)
    seconds = time.perf_counter() - start
    computed = float(np.count_nonzero(tiles)) / tiles.size
    unmasked = float(np.count_nonzero(tiles == 2)) / tiles.size
    return Row(variant, computed, unmasked, seconds)


def markdown(rows: list[Row], t: int) -> str:
    lines = [
        f"| variant | the line of DSL that makes it | at T = S = {t} | tiles computed | of all, unmasked |",
        "|---|---|---|---:|---:|",
    ]
    for row in rows:
        v = row.variant
        # a pipe inside a table cell ends the cell, even in a code span, unless escaped
        dsl = "<br>".join(f"`{line}`".replace("|", "\\|") for line in v.lines)
        lines.append(f"| `{v.example}.py` `{v.spec}` | {dsl} | {v.setting} | {row.computed:.1%} | {row.unmasked:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, default=8192, help="sequence length T = S (default: 8192)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (document lengths)")
    parser.add_argument("--timing", action="store_true", help="also print how long each block map took")
    args = parser.parse_args(argv)
    rows = [measure(variant, args.t, args.seed) for variant in VARIANTS]
    print(markdown(rows, args.t))
    if args.timing:
        for row in rows:
            print(f"{row.variant.example}.{row.variant.spec}: {row.seconds:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
