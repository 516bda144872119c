"""compile(), interpret(), parse_ir() and the compiled-function object."""

from __future__ import annotations

from typing import Any

import numpy as np

from attncomp.backends import BACKENDS
from attncomp.blockmap import block_map
from attncomp.chunked.graph import is_dask
from attncomp.chunked.plan import ChunkPlan
from attncomp.compilation import Compilation
from attncomp.decoder import Decoder, decoding_compilation
from attncomp.dsl import Spec
from attncomp.gradients import backward_of, saving_forward_of, vjp
from attncomp.ir import parser
from attncomp.ir.core import Module
from attncomp.ir.interpreter import interpret_func
from attncomp.serving.decoder import PagedDecoder


def parse_ir(text: str) -> Module:
    """Read IR text (any stage) into a verified module; ``str()`` prints it back."""
    return parser.parse_ir(text)


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
    """The result of :func:`compile`: callable, and inspectable stage by stage.

    Its state is one :class:`~attncomp.compilation.Compilation` (``fn.compilation``), which the
    features built on a compiled function (gradients, decoders, serving, Dask, PyTorch) use.
    """

    def __init__(self, compilation: Compilation):
        self.compilation = compilation

    @classmethod
    def build(cls, module: Module, backend: str, pipeline: str | None, name: str) -> CompiledFunction:
        """Run ``pipeline`` on ``module`` and build for ``backend``."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; available backends: {', '.join(BACKENDS)}")
        return cls(Compilation.build(module, backend, pipeline, name))

    @property
    def name(self) -> str:
        return self.compilation.name

    @property
    def backend(self) -> str:
        return self.compilation.backend

    @property
    def pipeline(self) -> str:
        """The pipeline's text."""
        return self.compilation.pipeline

    @property
    def remarks(self) -> list[str]:
        """What the passes said they did not do."""
        return self.compilation.remarks

    @property
    def module(self) -> Module:
        """The final IR module."""
        return self.compilation.module

    @property
    def constraints(self) -> list[Any]:
        return self.compilation.constraints

    @property
    def func(self):
        return self.compilation.func

    @property
    def stages(self) -> list[str]:
        """The passes run, in order."""
        return [s.name for s in self.compilation.stages[1:]]

    @property
    def timings(self) -> list[tuple[str, float]]:
        """(pass, seconds) for each pass run."""
        return [(s.name, s.seconds) for s in self.compilation.stages[1:]]

    def ir(self, stage: str = "final") -> str:
        """The IR text after ``stage``: "input", a pass name, or "final"."""
        return self.compilation.ir(stage)

    def dump(self) -> str:
        """Every stage's IR text in order, each under a ``// ----- after NAME -----`` line."""
        return self.compilation.dump()

    @property
    def source(self) -> str:
        """What the backend runs: generated Python/Numba source, or for ``interp`` the final IR."""
        return self.compilation.program.source

    @property
    def ptx(self) -> dict[str, str]:
        """The PTX of each CUDA kernel, by kernel name (the ``cuda`` backend)."""
        return self.compilation.program.ptx

    def inspect_llvm(self) -> str:
        """Numba's LLVM IR of the kernels compiled so far (call the function first)."""
        return self.compilation.program.inspect_llvm()

    def inspect_asm(self) -> str:
        """Numba's assembly of the kernels compiled so far (call the function first)."""
        return self.compilation.program.inspect_asm()

    def __call__(self, *args: Any):
        if any(is_dask(a) for a in args):  # a graph of chunk-pair kernel calls; nothing runs yet
            from attncomp.chunked import run_chunked

            return run_chunked(self.compilation, args)
        outputs = self.compilation.run(args)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    # gradients -------------------------------------------------------------------
    @property
    def backward(self) -> CompiledFunction:
        """The compiled backward: ``autodiff`` after the graph passes, then tiled like the forward.

        It takes the spec's arguments, the saved results of the forward (each fused
        attention's output and LSE) and one cotangent per result, and returns one
        gradient per floating argument.
        """
        return CompiledFunction(backward_of(self.compilation))

    @property
    def forward_saving(self) -> CompiledFunction:
        """The forward that also returns what the backward reads (``save-residuals``)."""
        return CompiledFunction(saving_forward_of(self.compilation))

    def vjp(self, *args: Any):
        """Run the forward; return its result and ``pullback(*cotangents) -> one gradient per argument``.

        ``pullback`` takes one cotangent per result (``None``: zero) and gives, per
        argument, an array of its shape and element type (float64 on ``interp``, the
        reference), or ``None`` for integer and boolean arguments.
        """
        return vjp(self.compilation, args)

    # features --------------------------------------------------------------------
    def decoder(self, max_len: int) -> Decoder:
        """An incremental decoder over a cache of ``max_len`` positions (kv-cache-reuse)."""
        return Decoder(decoding_compilation(self.compilation), max_len)

    def paged_decoder(self, page_size: int = 16, num_pages: int = 1024) -> PagedDecoder:
        """A decoder serving many sequences over one pool of key/value pages (docs/api.md section 7)."""
        # the same refusals as fn.decoder: keys must be computable for new tokens alone
        decoding_compilation(self.compilation, backend="interp")
        return PagedDecoder(self.compilation, page_size, num_pages)

    def chunk_parts(self) -> dict[str, CompiledFunction]:
        """The compiled parts a run over Dask arrays schedules (docs/api.md section 8), by name.

        "inputs" (or "queries" and "keys") computes q, k and v per chunk of positions,
        "attention" runs one chunk pair ("attention_unmasked" for pairs proven fully
        visible), "outputs" uses the attention's result per query chunk; parts the spec
        does not need are absent.  Each is inspectable (``.ir(stage)``, ``.dump()``, ``.source``).
        """
        return {name: CompiledFunction(part) for name, part in ChunkPlan.of(self.compilation).parts().items()}

    def block_map(self, *args: Any) -> np.ndarray:
        """int8 ``[*batch, q_blocks, kv_blocks]``: 0 skipped, 1 computed with its mask, 2 without."""
        return block_map(self.func, self.constraints, args)

    def to_torch(self) -> Any:
        """This function as a differentiable ``torch.library`` custom op over tensors (docs/api.md section 6).

        Imported here, not at the top, so that ``import attncomp`` never loads torch (an optional extra).
        """
        from attncomp.torch_op import to_torch

        return to_torch(self)

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
    return CompiledFunction.build(module, backend, pipeline, name)
