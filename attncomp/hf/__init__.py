"""attncomp in Hugging Face transformers models (docs/api.md section 10; needs the ``hf`` extra).

    import attncomp.hf

    attncomp.hf.register()  # attn_implementation="attncomp": the default specs, cpu backend
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attncomp")

``register`` adds an attention function to ``transformers.AttentionInterface``
(:class:`attncomp.hf.attention.AttncompAttention`) and a mask function to
``transformers.AttentionMaskInterface`` (:func:`attncomp.hf.masks.attncomp_mask`) under one
name, so ``attn_implementation=name`` works in ``from_pretrained``, ``from_config`` and
``model.set_attn_implementation``. The mask function hands the attention compact facts (a
query-to-key shift, segment ids for padding and packed sequences, the sliding window), not a
``[B, 1, T, S]`` tensor; only a custom overlay's mask function, which nothing but evaluating it
pair by pair can read, becomes one, as it does for ``sdpa``. ``import attncomp`` never imports
this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from transformers import AttentionInterface, AttentionMaskInterface
except ImportError as error:
    raise ImportError(
        'attncomp.hf needs Hugging Face transformers, the hf extra of attncomp: pip install "attncomp[hf]"'
    ) from error

import attncomp as ac
from attncomp.hf.attention import AttncompAttention
from attncomp.hf.masks import MaskFacts, attncomp_mask
from attncomp.hf.specs import (
    DEFAULT_SPECS,
    MASK_SPECS,
    hf_attention,
    hf_attention_bias,
    hf_attention_bias_heads,
    hf_attention_blocks,
    hf_attention_mask,
    hf_attention_mask_heads,
    hf_attention_position_bias,
    hf_attention_position_bias_rows,
    hf_attention_segments,
    hf_attention_segments_sinks,
    hf_attention_sinks,
    with_dropout,
)

__all__ = [
    "DEFAULT_SPECS",
    "MASK_SPECS",
    "AttncompAttention",
    "MaskFacts",
    "attncomp_mask",
    "hf_attention",
    "hf_attention_bias",
    "hf_attention_bias_heads",
    "hf_attention_blocks",
    "hf_attention_mask",
    "hf_attention_mask_heads",
    "hf_attention_position_bias",
    "hf_attention_position_bias_rows",
    "hf_attention_segments",
    "hf_attention_segments_sinks",
    "hf_attention_sinks",
    "register",
    "with_dropout",
]

BACKENDS = ("cpu", "cuda", "interp")


def register(
    name: str = "attncomp",
    spec: ac.Spec | None = None,
    backend: str = "cpu",
    inputs: dict[str, Callable[[Any], Any]] | None = None,
) -> AttncompAttention:
    """Make ``attn_implementation=name`` run attention as ``spec`` (None: the default specs) on ``backend``.

    ``inputs`` maps a spec argument that is not a fact of the mask to a function of the attention
    module giving its tensor (without it, the module's attribute of that name is read). Registering
    a name again replaces it. Returns the registered attention function.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attncomp.hf: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if spec is not None and not isinstance(spec, ac.Spec):
        raise TypeError(f"attncomp.hf: spec must be an @ac.spec, got {type(spec).__name__}")
    attention = AttncompAttention(name, spec, backend, inputs)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, attncomp_mask)
    return attention
