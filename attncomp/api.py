"""compile(), interpret(), parse_ir() and the compiled-function object."""

from __future__ import annotations

from typing import Any

import numpy as np

from attncomp.backends import BACKENDS
from attncomp.blockmap import block_map
from attncomp.decoder import Decoder
from attncomp.dsl import Spec
from attncomp.ir import parser as _parser
from attncomp.ir.binding import bind_arguments
from attncomp.ir.core import Module
from attncomp.ir.interpreter import Interpreter, interpret_func
from attncomp.ir.types import NUMPY_DTYPES
from attncomp.ir.verifier import verify_module
from attncomp.passes import DEFAULT_PIPELINE, parse_pipeline, run_pipeline
from attncomp.passes.manager import split_top_level


def parse_ir(text: str) -> Module:
    """Read IR text (any stage) into a verified module; ``str()`` prints it back."""
    return _parser.parse_ir(text)


def _module_of(target: Spec | Module | str, constants: dict[str, Any]) -> Module:
    if isinstance(target, Spec):
        return target.trace(**constants) if constants else target.ir
    if constants:
        raise TypeError("constants can only be given with a spec, not with IR")
    if isinstance(target, Module):
        return target
    if isinstance(target, str):
        return parse_ir(target)
    raise TypeError(f"expected a spec, an IR module or IR text, got {type(target).__name__}")


def interpret(
    target: Spec | Module | str,
    *args: Any,
    trace: bool = False,
    sizes: dict[str, int] | None = None,
    **constants: Any,
):
    """Run a spec or IR module of any stage in the float64 reference interpreter.

    Returns the result (a tuple for several); with ``trace=True`` also a dict
    from SSA name to array of every value, in program order.  ``sizes`` binds
    dimensions no argument carries (a decoder stage's ``N_cached``).
    """
    return interpret_func(_module_of(target, constants).main, args, trace=trace, sizes=sizes)


class CompiledFunction:
    """The result of :func:`compile`: callable, and inspectable stage by stage."""

    def __init__(self, module: Module, backend: str, pipeline: str | None, name: str):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; available backends: {', '.join(BACKENDS)}")
        self.name = name
        self._input = module
        self.backend = backend
        self.pipeline = DEFAULT_PIPELINE if pipeline is None else pipeline
        self.remarks: list[str] = []
        self.module, self._stages = run_pipeline(module, parse_pipeline(self.pipeline), self.remarks)
        if backend != "interp" and any(op.name == "ac.attention" for op in self.module.main.body.ops):
            # Backends run attention tiled; a pipeline that stopped after fusion gets the default tiling.
            self.remarks.append(f"{backend}: ac.attention was tiled with flash-tiling's defaults")
            more, stages = run_pipeline(self.module, parse_pipeline("flash-tiling"), self.remarks)
            self.module, self._stages = more, self._stages + stages[1:]
        self.constraints = verify_module(self.module)
        self._impl = None
        if backend == "cpu":
            from attncomp.backends import numba_cpu

            self._impl = numba_cpu.build(self.module)
        elif backend == "cuda":
            from attncomp.backends import numba_cuda

            self._impl = numba_cuda.build(self.module)

    @property
    def func(self):
        return self.module.main

    @property
    def stages(self) -> list[str]:
        """The passes run, in order."""
        return [s.name for s in self._stages[1:]]

    @property
    def timings(self) -> list[tuple[str, float]]:
        """(pass, seconds) for each pass run."""
        return [(s.name, s.seconds) for s in self._stages[1:]]

    def ir(self, stage: str = "final") -> str:
        """The IR text after ``stage``: "input", a pass name, or "final"."""
        if stage == "final":
            return self._stages[-1].text
        for s in reversed(self._stages):
            if s.name == stage:
                return s.text
        valid = ", ".join(["input", *self.stages, "final"])
        raise KeyError(f"no stage {stage!r}; stages: {valid}")

    def dump(self) -> str:
        """Every stage's IR text in order, each under a ``// ----- after NAME -----`` line."""
        return "\n".join(f"// ----- after {s.name} -----\n{s.text}" for s in self._stages)

    @property
    def source(self) -> str:
        """What the backend runs: generated Python/Numba source, or for ``interp`` the final IR."""
        return self._impl.source if self._impl is not None else self.ir("final")

    @property
    def ptx(self) -> dict[str, str]:
        """The PTX of each CUDA kernel, by kernel name (the ``cuda`` backend)."""
        if self.backend != "cuda":
            raise ValueError(f"ptx needs the cuda backend, not {self.backend!r}")
        return self._impl.ptx

    def inspect_llvm(self) -> str:
        """Numba's LLVM IR of the kernels compiled so far (call the function first)."""
        return self._compiled("inspect_llvm")

    def inspect_asm(self) -> str:
        """Numba's assembly of the kernels compiled so far (call the function first)."""
        return self._compiled("inspect_asm")

    def _compiled(self, what: str) -> str:
        if self._impl is None:
            raise ValueError(f"{what} needs a compiled backend, not {self.backend!r}")
        return getattr(self._impl, what)()

    def __call__(self, *args: Any):
        outputs = self._run(args)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _run(self, args, sizes: dict[str, int] | None = None) -> list[np.ndarray]:
        """Check ``args`` (with caller-known ``sizes``), run, return every result."""
        if self.backend == "cuda":  # device arrays are bound in place and results may stay on the device
            return self._impl.run(self.func, args, self.constraints, sizes)
        arrays, env = bind_arguments(self.func, args, self.constraints, sizes)
        if self._impl is not None:
            outputs = self._impl(arrays, env)
        else:
            outputs = Interpreter(self.func, env).run(arrays)
        return [np.asarray(out, dtype=NUMPY_DTYPES[value.type.dtype]) for out, value in zip(outputs, self.func.results)]

    def decoder(self, max_len: int) -> Decoder:
        """An incremental decoder over a cache of ``max_len`` positions (kv-cache-reuse)."""
        entries = split_top_level(self.pipeline)
        names = [e.split("{")[0].strip() for e in entries]
        if "kv-cache-reuse" not in names:
            if "softmax-fusion" in names:
                entries.insert(names.index("softmax-fusion") + 1, "kv-cache-reuse")
            else:
                entries[0:0] = ["softmax-fusion", "kv-cache-reuse"]
        pipeline = ",".join(entries)
        decode = CompiledFunction(self._input, self.backend, pipeline, self.name)
        return Decoder(decode, max_len)

    def block_map(self, *args: Any) -> np.ndarray:
        """int8 ``[*batch, q_blocks, kv_blocks]``: 0 skipped, 1 computed with its mask, 2 without."""
        return block_map(self.func, self.constraints, args)

    def __repr__(self) -> str:
        return f"<attncomp {self.backend} function {self.name} [{', '.join(self.stages)}]>"


def compile(
    target: Spec | Module | str, backend: str = "cpu", pipeline: str | None = None, **constants: Any
) -> CompiledFunction:
    """Trace (with ``constants``), run the pass pipeline, and build for ``backend``.

    ``pipeline=None`` is the default optimising pipeline, ``""`` runs no pass,
    and a string such as ``"cse,dce"`` runs exactly the passes it names.
    """
    module = _module_of(target, constants)
    name = target.name if isinstance(target, Spec) else module.main.name
    return CompiledFunction(module, backend, pipeline, name)
