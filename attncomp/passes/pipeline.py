"""Pipelines as lists of passes, and the one way to edit them.

Features derive pipelines from a compiled function's: the backward runs
``autodiff`` on the fused graph, a decoder ``kv-cache-reuse`` right after
fusion, a chunked part ``chunk-pairs`` and a tiling of its own.  Each edit is
a call of :func:`edit_pipeline` on a list of :class:`Pass` objects; text is
only read (``parse_pipeline``) and printed (:func:`pipeline_text`).
"""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import Any

from attncomp.passes.base import PASSES, Pass
from attncomp.passes.manager import DEFAULT_PIPELINE, parse_pipeline


def make_pass(name: str, **options: Any) -> Pass:
    """The pass ``name`` with ``options`` (its dataclass fields)."""
    return PASSES[name](**options)


def pass_text(p: Pass) -> str:
    """``name{opt=value,...}``, naming the options that differ from their defaults (as parsed back)."""
    defaults = type(p)()
    opts = []
    for f in fields(p):
        value = getattr(p, f.name)
        if value != getattr(defaults, f.name):
            opts.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
    return p.name + (f"{{{','.join(opts)}}}" if opts else "")


def pipeline_text(passes: list[Pass]) -> str:
    """The pipeline string that ``parse_pipeline`` reads back into ``passes``."""
    return ",".join(pass_text(p) for p in passes)


def pipeline_passes(pipeline: str | list[Pass]) -> list[Pass]:
    """A pipeline string, or a list of passes, as a new list of new passes (a pass may keep state)."""
    if isinstance(pipeline, str):
        return parse_pipeline(pipeline)
    return [copy.deepcopy(p) for p in pipeline]


def pass_names(passes: list[Pass]) -> list[str]:
    return [p.name for p in passes]


def edit_pipeline(
    passes: list[Pass],
    *,
    insert: Pass | None = None,
    before: str | None = None,
    after: str | None = None,
    replace: Pass | None = None,
    until: str | None = None,
) -> list[Pass]:
    """A new pass list from ``passes`` (which is left as it is):

    - ``until=NAME``: the passes up to and including the first ``NAME`` (none when it is absent);
    - ``insert=P, before=NAME``: ``P`` just before the first ``NAME``, or last when there is none;
    - ``insert=P, after=NAME``: ``P`` just after the first ``NAME``, or first when there is none;
    - ``replace=P``: ``P`` in place of the first pass of its name, or last when there is none.
    """
    result = pipeline_passes(passes)
    present = pass_names(result)
    if until is not None:
        result = result[: present.index(until) + 1] if until in present else []
        present = pass_names(result)
    if insert is not None:
        if (before is None) == (after is None):
            raise ValueError("edit_pipeline: insert takes exactly one of before= and after=")
        if before is not None:
            at = present.index(before) if before in present else len(result)
        else:
            at = present.index(after) + 1 if after in present else 0
        result.insert(at, copy.deepcopy(insert))
        present = pass_names(result)
    if replace is not None:
        if replace.name in present:
            result[present.index(replace.name)] = copy.deepcopy(replace)
        else:
            result.append(copy.deepcopy(replace))
    return result


def tiling_pipeline(pipeline: str | None, tiled: bool = True, **options: Any) -> str:
    """``pipeline`` (None: the default) with ``options`` given to its ``flash-tiling``
    (``deterministic=True``, ``batch_invariant=True``).

    Every ``flash-tiling`` of the pipeline gets them.  A pipeline without one gets
    ``flash-tiling{...}`` last when ``tiled`` (a compiled backend, which tiles what the pipeline
    left untiled with flash-tiling's defaults), and stays as it is for the interpreter.
    """
    passes = pipeline_passes(DEFAULT_PIPELINE if pipeline is None else pipeline)
    tilings = [p for p in passes if p.name == "flash-tiling"]
    for p in tilings:
        for name, value in options.items():
            setattr(p, name, value)
    if not tilings and tiled:
        passes.append(make_pass("flash-tiling", **options))
    return pipeline_text(passes)


def is_batch_invariant(passes: list[Pass]) -> bool:
    """Whether ``passes`` tile with ``flash-tiling{batch_invariant=true}``."""
    return any(p.name == "flash-tiling" and getattr(p, "batch_invariant", False) for p in passes)
