"""Parsing pipeline strings and running passes, verifying after each one.

"softmax-fusion,flash-tiling{block_q=64,block_k=64},mask-elimination"
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from attncomp.errors import PipelineError, VerifyError
from attncomp.ir.copying import copy_locations, forget_numbers
from attncomp.ir.core import Module
from attncomp.ir.parser import parse_ir
from attncomp.ir.printer import print_module
from attncomp.ir.verifier import verify_module
from attncomp.passes.base import PASSES, Pass

DEFAULT_PIPELINE = "cse,softmax-fusion,flash-tiling,mask-elimination,canonicalize,cse,dce"

#: The cpu backend's tiles (query rows, keys), by the BLAS kernels that multiply them: OpenBLAS's
#: name for the kernels it runs (``numba_cpu.intrinsics.blas_kernels``), which ``ac.compile`` passes
#: :func:`default_pipeline`.  BLAS's products over 128 keys cost less per key than over 64: causal
#: attention (H = 8, D = 64) ran 5 to 9% faster forward with 64 x 128 tiles than 64 x 64, forward and
#: backward 7% faster at T = 2048.  Which row count is faster depends on the kernels: on the 2-core AMD
#: EPYC (AVX-512), with OpenBLAS's 256-bit Haswell kernels 128 x 128 tiles ran 7 to 11% faster than
#: 64 x 128 (causal, dense, windowed and document-masked forwards and backwards, T = 256 to 2048),
#: while with its SkylakeX kernels they ran 24 to 38% slower (64 x 128 x 64 products take its
#: small-matrix path, which packs nothing, near the cores' peak; 128 x 128 x 64 products do not).
CPU_TILES = {"Haswell": (128, 128)}
#: the tiles for other kernels, or where the BLAS is not OpenBLAS
CPU_TILES_ELSE = (64, 128)


def cpu_pipeline(blas: str | None = None) -> str:
    """The cpu backend's default pipeline where its BLAS runs the kernels named ``blas``."""
    block_q, block_k = CPU_TILES.get(blas or "", CPU_TILES_ELSE)
    return DEFAULT_PIPELINE.replace("flash-tiling", f"flash-tiling{{block_q={block_q},block_k={block_k}}}")


CPU_PIPELINE = cpu_pipeline()


#: The cuda backend's default: forward tiles of 128 query rows where query, key and value are
#: 16-bit (f16, bf16), so that a block's warps (``forward_plan.FLASH_SHAPES``) share each key and value
#: chunk the tensor-core forward copies in (half the copies a query row, as FlashAttention-2's
#: 128-row blocks); float32 tiles keep 64 rows, whose 3xTF32 kernel would not fit its shared memory.
CUDA_PIPELINE = DEFAULT_PIPELINE.replace("flash-tiling", "flash-tiling{block_q_16bit=128}")
#: each backend's default, where it is not ``DEFAULT_PIPELINE`` (cpu's is by its BLAS: :func:`cpu_pipeline`)
DEFAULT_PIPELINES = {"cuda": CUDA_PIPELINE}


def default_pipeline(backend: str, blas: str | None = None) -> str:
    """The pipeline ``ac.compile`` runs for ``backend`` when given none; on ``cpu``, tiled for the BLAS
    kernels named ``blas`` (``ac.compile`` names those the process runs: ``fn.pipeline`` shows them)."""
    if backend == "cpu":
        return cpu_pipeline(blas)
    return DEFAULT_PIPELINES.get(backend, DEFAULT_PIPELINE)


#: Passes a backend runs after any pipeline, on what the pipeline gave: their output is what the
#: backend generates code from (the last stage of ``fn.dump()``), while the call keeps the
#: pipeline's signature.  The cuda backend computes bf16 values in float32 (``widen-bf16``).
BACKEND_PIPELINES = {"cuda": "widen-bf16"}


def backend_pipeline(backend: str) -> str:
    """The passes ``backend`` runs after the pipeline ("" for none)."""
    return BACKEND_PIPELINES.get(backend, "")


_ENTRY = re.compile(r"\s*([A-Za-z0-9_-]+)\s*(?:\{([^{}]*)\})?\s*$")


def split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in (s.strip() for s in parts) if p]


def _convert(value: str, current: object, where: str) -> object:
    try:
        if isinstance(current, bool):
            if value not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value in ("true", "1")
        if isinstance(current, int):
            return int(value)
        if isinstance(current, float):
            return float(value)
    except ValueError:
        raise PipelineError(f"{where}: cannot read {value!r} as {type(current).__name__}") from None
    return value


def parse_pipeline(text: str) -> list[Pass]:
    """Passes named by ``text``; an unknown pass or option lists the valid ones."""
    passes = []
    for entry in split_top_level(text):
        m = _ENTRY.match(entry)
        if not m:
            raise PipelineError(f"cannot read pipeline entry {entry!r}: expected name or name{{opt=value,...}}")
        name, opts = m.group(1), m.group(2)
        if name not in PASSES:
            raise PipelineError(f"unknown pass {name!r}; valid passes: {', '.join(sorted(PASSES))}")
        cls = PASSES[name]
        instance = cls()
        for item in split_top_level(opts or ""):
            key, sep, value = item.partition("=")
            key = key.strip()
            valid = cls.option_names()
            if not sep or key not in valid:
                shown = ", ".join(valid) if valid else "none"
                raise PipelineError(f"pass {name!r} has no option {key!r}; valid options: {shown}")
            setattr(instance, key, _convert(value.strip(), getattr(instance, key), f"{name}.{key}"))
        passes.append(instance)
    return passes


@dataclass
class Stage:
    """The IR text after one pass, and how long the pass took."""

    name: str
    text: str
    seconds: float


def run_pipeline(module: Module, passes: list[Pass], remarks: list[str]) -> tuple[Module, list[Stage]]:
    """Run ``passes`` in order on a copy of ``module``, verifying after each."""
    stages = [Stage("input", print_module(module), 0.0)]
    current = parse_ir(stages[0].text)
    copy_locations(module, current)
    forget_numbers(current)
    for p in passes:
        start = time.perf_counter()
        try:
            p.run(current, remarks)
        except (PipelineError, VerifyError):
            raise
        except Exception as exc:
            raise PipelineError(f"pass {p.name} failed: {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - start
        try:
            verify_module(current)
        except VerifyError as exc:
            raise VerifyError(f"after pass {p.name}: {exc}") from None
        forget_numbers(current)
        stages.append(Stage(p.name, print_module(current), seconds))
    return current, stages
