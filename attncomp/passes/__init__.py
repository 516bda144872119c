"""Passes: one file per pass, the pass manager and the pipeline parser."""

from attncomp.passes import (
    autodiff,
    canonicalize,
    chunk_pairs,
    cse,
    dce,
    flash_tiling,
    kv_cache_reuse,
    mask_elimination,
    save_residuals,
    softmax_fusion,
    widen_bf16,
)
from attncomp.passes.base import PASSES, Pass, register_pass
from attncomp.passes.manager import DEFAULT_PIPELINE, Stage, default_pipeline, parse_pipeline, run_pipeline

__all__ = [
    "DEFAULT_PIPELINE",
    "PASSES",
    "Pass",
    "Stage",
    "autodiff",
    "canonicalize",
    "chunk_pairs",
    "cse",
    "dce",
    "default_pipeline",
    "flash_tiling",
    "kv_cache_reuse",
    "mask_elimination",
    "save_residuals",
    "softmax_fusion",
    "widen_bf16",
    "parse_pipeline",
    "register_pass",
    "run_pipeline",
]
