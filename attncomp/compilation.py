"""One spec compiled by one pipeline for one backend: the state every feature builds on.

A :class:`Compilation` holds the input IR, the pass list, every stage's text,
the final module, its size constraints and the backend's :class:`Program`.
``CompiledFunction`` is the public face of one; the features (gradients,
decoders, the paged decoder, chunked runs, the torch op) take compilations
and use this surface only:

- :meth:`run` (checked arguments) and :meth:`run_shaped` (arrays the feature
  built to the signature itself);
- :meth:`derive`: the same input compiled by an edited pipeline
  (``passes.pipeline.edit_pipeline``), on this backend or another, kept per
  key with :meth:`variant` so that each is built once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attncomp.backends import build
from attncomp.backends.base import Program
from attncomp.backends.notice import compile_notice
from attncomp.ir.binding import Binder
from attncomp.ir.core import Func, Module
from attncomp.ir.verifier import verify_module
from attncomp.passes.base import Pass
from attncomp.passes.manager import Stage, backend_pipeline, default_pipeline, run_pipeline
from attncomp.passes.pipeline import make_pass, pipeline_passes, pipeline_text


def pipeline_here(backend: str) -> str:
    """The pipeline ``ac.compile`` runs for ``backend`` when given none, on this machine: on ``cpu``
    tiled for the BLAS kernels its tile products run on (``passes.manager.CPU_TILES``)."""
    if backend != "cpu":
        return default_pipeline(backend)
    from attncomp.backends.numba_cpu.intrinsics import blas_kernels  # loads SciPy's BLAS: on use

    return default_pipeline(backend, blas_kernels())


#: ops a compiled backend runs only once flash-tiling has tiled them
UNTILED = ("ac.attention", "ac.attention_grad")


@dataclass
class Compilation:
    name: str
    backend: str
    #: the module the pipeline started from (the traced spec)
    input: Module
    #: the passes, as given (``pipeline`` is their text)
    passes: list[Pass]
    pipeline: str
    module: Module
    stages: list[Stage]
    remarks: list[str]
    constraints: list[Any]
    program: Program
    #: derived compilations by key (see :meth:`variant`), and what features keep per compilation
    variants: dict[Any, Any] = field(default_factory=dict, repr=False)
    called: bool = field(default=False, repr=False)
    binder: Binder | None = field(default=None, repr=False)

    @classmethod
    def build(cls, module: Module, backend: str, pipeline: str | list[Pass] | None, name: str) -> Compilation:
        """Run ``pipeline`` (None: the backend's default) on ``module``, verify, and build for ``backend``.

        The pipeline's result is :attr:`module` (the call's signature); the backend's own passes
        (``passes.manager.backend_pipeline``: ``widen-bf16`` on ``cuda``) run after it, each a stage,
        and the backend generates its code from the last stage."""
        text = pipeline_here(backend) if pipeline is None else pipeline
        passes = pipeline_passes(text)
        text = text if isinstance(text, str) else pipeline_text(passes)
        remarks: list[str] = []
        final, stages = run_pipeline(module, pipeline_passes(passes), remarks)
        if backend != "interp" and any(op.name in UNTILED for op in final.main.body.ops):
            # Backends run attention tiled; a pipeline that stopped after fusion gets the default tiling.
            remarks.append(f"{backend}: attention was tiled with flash-tiling's defaults")
            final, more = run_pipeline(final, [make_pass("flash-tiling")], remarks)
            stages = stages + more[1:]
        constraints = verify_module(final)
        lowered = None
        if backend_pipeline(backend):
            # the backend's own passes: their output, the last stage, is what its code is generated from
            lowered, more = run_pipeline(final, pipeline_passes(backend_pipeline(backend)), remarks)
            stages = stages + more[1:]
        program = build(backend, final, lowered)
        return cls(name, backend, module, passes, text, final, stages, remarks, constraints, program)

    @property
    def source(self) -> str:
        """What the backend runs: generated source, or for ``interp`` the final IR."""
        return self.program.source

    @property
    def func(self) -> Func:
        """The final IR's function: its arguments and results are the call's."""
        return self.module.main

    # running ------------------------------------------------------------------------------
    def first_call(self) -> bool:
        """Whether this call may compile: the first one, with code this process has not compiled yet."""
        if self.called:
            return False
        self.called = True
        return not self.program.compiled

    def run(self, args: Sequence[Any], sizes: dict[str, int] | None = None, exact: bool = False) -> list[Any]:
        """Check ``args`` (with caller-known ``sizes``), run, and give every result.

        ``exact`` (the interpreter only): take float64 arguments and give float64 results.
        """
        program, binder = self.program, self.binder
        if self.called and binder is not None and not exact and program.runs_host_arrays:  # the quick way
            arrays, env = binder.bind(args, sizes)  # a key seen before is bound by the key alone
            return [np.asarray(o, dtype=t) for o, t in zip(program.run_bound(arrays, env), binder.result_dtypes)]
        if exact and program.reference:
            return program.run_exact(self.func, args, self.constraints, sizes)
        if not self.called:
            with compile_notice(self.name, self.backend, self.first_call()):
                return program.run(self.func, args, self.constraints, sizes)
        if program.runs_host_arrays:
            binder = self.binding()
            arrays, env = binder.bind(args, sizes)
            return [np.asarray(o, dtype=t) for o, t in zip(program.run_bound(arrays, env), binder.result_dtypes)]
        return program.run(self.func, args, self.constraints, sizes)

    def run_contiguous(self, arrays: Sequence[np.ndarray]) -> list[Any]:
        """:meth:`run` for C-contiguous numpy ``arrays`` (the torch op's views): a key seen before is
        bound by element types and shapes alone."""
        program, binder = self.program, self.binder
        if self.called and binder is not None and program.runs_host_arrays:
            arrays, env = binder.bind_contiguous(arrays)
            return [np.asarray(o, dtype=t) for o, t in zip(program.run_bound(arrays, env), binder.result_dtypes)]
        return self.run(arrays)

    def run_shaped(self, arrays: Sequence[Any], sizes: dict[str, int]) -> list[Any]:
        """:meth:`run` for arrays the caller built to the signature itself: their sizes are read, not
        checked again, where the program allows it (the first call goes the checked way: it may
        compile, and says so)."""
        if not (self.program.runs_host_arrays and self.called):
            return self.run(arrays, sizes)
        return self.program.run_bound(arrays, self.binding().sizes_of(arrays, sizes))

    def binding(self) -> Binder:
        """The binder of this function's arguments (made once)."""
        if self.binder is None:
            self.binder = Binder(self.func, self.constraints)
        return self.binder

    # derived compilations -------------------------------------------------------------------
    def derive(
        self, passes: list[Pass], backend: str | None = None, name: str | None = None, module: Module | None = None
    ) -> Compilation:
        """The same input (or ``module``) compiled by ``passes``, on this backend or ``backend``."""
        source = self.input if module is None else module
        return Compilation.build(source, backend or self.backend, passes, name or self.name)

    def variant(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, made once per ``key`` for this compilation and kept (derived compilations,
        a chunk plan)."""
        if key not in self.variants:
            self.variants[key] = make()
        return self.variants[key]

    # inspection -------------------------------------------------------------------------------
    def ir(self, stage: str = "final") -> str:
        """The IR text after ``stage``: "input", a pass name, or "final" (the last stage: on ``cuda``,
        ``widen-bf16``'s, what the kernels are generated from)."""
        if stage == "final":
            return self.stages[-1].text
        for s in reversed(self.stages):
            if s.name == stage:
                return s.text
        valid = ", ".join(["input", *(s.name for s in self.stages[1:]), "final"])
        raise KeyError(f"no stage {stage!r}; stages: {valid}")

    def dump(self) -> str:
        """Every stage's IR text in order, each under a ``// ----- after NAME -----`` line."""
        return "\n".join(f"// ----- after {s.name} -----\n{s.text}" for s in self.stages)
