"""compile(), interpret(), parse_ir() and the compiled-function object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from attncomp.backends import check_backend
from attncomp.blockmap import block_map
from attncomp.chunked.graph import is_dask
from attncomp.chunked.plan import ChunkPlan
from attncomp.compilation import Compilation, pipeline_here
from attncomp.decoder import Decoder, cache_type, decoding_compilation
from attncomp.dsl import DEFAULT_FLOAT, Spec
from attncomp.float_types import FloatFamily
from attncomp.gradients import backward_of, saving_forward_of, vjp
from attncomp.ir import parser
from attncomp.ir.core import Module
from attncomp.ir.interpreter import interpret_func
from attncomp.passes.pipeline import tiling_pipeline
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
    A generic spec's function (``ac.floating`` arguments) has one compilation per float type
    (``family``); ``fn.compilation`` is the float32 one, and a call runs its arguments' type's.
    """

    def __init__(self, compilation: Compilation, family: FloatFamily | None = None):
        self.compilation = compilation
        self.family = family
        self.specialised: dict[str, CompiledFunction] = {}

    @property
    def generic(self) -> bool:
        """Whether this function serves every float type (its spec has ``ac.floating`` arguments)."""
        return self.family is not None

    def for_dtype(self, dtype: str | None) -> CompiledFunction:
        """This function for float type ``dtype`` ("f16", "bf16", "f32", "f64"): compiled on first use.
        ``None``, or a function whose spec declares its types, gives the function itself."""
        if dtype is None or self.family is None:
            return self
        if dtype not in self.specialised:
            self.specialised[dtype] = CompiledFunction(self.family.member(dtype))
        return self.specialised[dtype]

    def for_args(self, args: Sequence[Any]) -> CompiledFunction:
        """This function for the float type of a call's arguments (itself unless generic)."""
        return self if self.family is None else self.for_dtype(self.family.float_type_of(args))

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

    def ir(self, stage: str = "final", dtype: str | None = None) -> str:
        """The IR text after ``stage``: "input", a pass name, or "final" (a generic spec's: for ``dtype``)."""
        return self.for_dtype(dtype).compilation.ir(stage)

    def dump(self, dtype: str | None = None) -> str:
        """Every stage's IR text in order, each under a ``// ----- after NAME -----`` line."""
        return self.for_dtype(dtype).compilation.dump()

    @property
    def source(self) -> str:
        """What the backend runs: generated Python/Numba source, or for ``interp`` the final IR."""
        return self.compilation.program.source

    @property
    def ptx(self) -> dict[str, str]:
        """The PTX of each CUDA kernel, by kernel name (the ``cuda`` backend)."""
        return self.compilation.program.ptx

    def kernels(self, head_dim: int | None = None, value_dim: int | None = None) -> list[Any]:
        """The ``cuda`` backend's kernels, each a ``KernelInfo`` (name, Python function, signature,
        source, launch bounds, and for attention and backward kernels ``choice``: which kernel runs,
        ``numba_cuda.choice.KernelChoice``); attention kernels for these head dims (default: the last
        ones called, else 64)."""
        if self.backend != "cuda":
            raise ValueError(f"fn.kernels() lists the cuda backend's kernels; this function's is {self.backend!r}")
        return self.compilation.program.kernels(head_dim, value_dim)

    def inspect_llvm(self) -> str:
        """Numba's LLVM IR of the kernels compiled so far (call the function first)."""
        return self.compilation.program.inspect_llvm()

    def inspect_asm(self) -> str:
        """Numba's assembly of the kernels compiled so far (call the function first)."""
        return self.compilation.program.inspect_asm()

    def __call__(self, *args: Any):
        if self.family is not None:
            return self.for_args(args)(*args)
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

    def vjp(self, *args: Any, wrt: Sequence[str] | None = None):
        """Run the forward; return its result and ``pullback(*cotangents) -> one gradient per argument``.

        ``pullback`` takes one cotangent per result (``None``: zero) and gives, per
        argument, an array of its shape and element type (float64 on ``interp``, the
        reference), or ``None`` for integer and boolean arguments.  ``wrt`` names the floating
        arguments whose gradients are wanted (default: all); the others' are None, and not computed
        where the fused attention does not need them (a mask or bias it reads).
        """
        return vjp(self.for_args(args).compilation, args, wrt)

    # features --------------------------------------------------------------------
    def decoder(self, max_len: int, dtype: str | None = None, cache: Any = None) -> Decoder:
        """An incremental decoder over a cache of ``max_len`` positions (kv-cache-reuse).

        A generic spec's decoder takes the float type of its first call (or ``dtype``); its cache
        holds that type, or with ``cache="f8e4m3"`` / ``"f8e5m2"`` (``ac.f8e4m3``, ``ac.f8e5m2``)
        8-bit codes and a float32 scale per (token, head)."""
        stored = cache_type(cache)
        decoding = self.for_dtype(dtype).compilation
        if self.family is not None and dtype is None:
            decoding_compilation(decoding, cache=stored)  # the refusals, now
            return Decoder(
                None, max_len, lambda inputs: decoding_compilation(self.for_args(inputs).compilation, cache=stored)
            )
        return Decoder(decoding_compilation(decoding, cache=stored), max_len)

    def paged_decoder(
        self, page_size: int = 16, num_pages: int = 1024, dtype: str | None = None, cache: Any = None
    ) -> PagedDecoder:
        """A decoder serving many sequences over one pool of key/value pages (docs/api.md section 7).

        A generic spec's pool holds ``dtype`` (default float32) keys and values, or with
        ``cache="f8e4m3"`` / ``"f8e5m2"`` (``ac.f8e4m3``, ``ac.f8e5m2``) 8-bit codes and a float32
        scale per (token, head) beside the pages."""
        stored = cache_type(cache)
        compilation = self.for_dtype(dtype).compilation
        # the same refusals as fn.decoder: keys must be computable for new tokens alone
        decoding_compilation(compilation, backend="interp")
        return PagedDecoder(compilation, page_size, num_pages, cache=stored)

    def chunk_parts(self, dtype: str | None = None) -> dict[str, CompiledFunction]:
        """The compiled parts a run over Dask arrays schedules (docs/api.md section 8), by name.

        "inputs" (or "queries" and "keys") computes q, k and v per chunk of positions,
        "attention" runs one chunk pair ("attention_unmasked" for pairs proven fully
        visible), "outputs" uses the attention's result per query chunk; parts the spec
        does not need are absent.  Each is inspectable (``.ir(stage)``, ``.dump()``, ``.source``).
        """
        plan = ChunkPlan.of(self.for_dtype(dtype).compilation)
        return {name: CompiledFunction(part) for name, part in plan.parts().items()}

    def block_map(self, *args: Any) -> np.ndarray:
        """int8 ``[*batch, q_blocks, kv_blocks]``: 0 skipped, 1 computed with its mask, 2 without."""
        return block_map(self.func, self.constraints, args)

    def to_torch(self) -> Any:
        """This function as a differentiable ``torch.library`` custom op over tensors (docs/api.md section 6).

        Imported here, not at the top, so that ``import attncomp`` never loads torch (an optional extra).
        """
        from attncomp.torch import to_torch

        return to_torch(self)

    def __repr__(self) -> str:
        return f"<attncomp {self.backend} function {self.name} [{', '.join(self.stages)}]>"


def compile(
    target: Spec | Module | str,
    backend: str = "cpu",
    pipeline: str | None = None,
    *,
    deterministic: bool = False,
    batch_invariant: bool = False,
    **constants: Any,
) -> CompiledFunction:
    """Trace (with ``constants``), run the pass pipeline, and build for ``backend``.

    ``pipeline=None`` is the backend's default optimising pipeline (``passes.default_pipeline``:
    on ``cpu``, tiles of 128 keys, and 64 or 128 query rows by the BLAS kernels that multiply them;
    ``fn.pipeline`` shows it), ``""`` runs no pass,
    and a string such as ``"cse,dce"`` runs exactly the passes it names.
    ``deterministic=True`` gives the pipeline's flash-tiling ``deterministic=true``: gradients
    bit-identical from run to run (a no-op where the backend's sums are ordered already).
    ``batch_invariant=True`` gives it ``batch_invariant=true``: each row's output bits depend on
    the row alone, not on the batch, the other sequences of a step or the pages' layout.
    """
    check_backend(backend)  # before any pass runs
    options = {
        name: True for name, on in (("deterministic", deterministic), ("batch_invariant", batch_invariant)) if on
    }
    if options:
        pipeline = tiling_pipeline(
            pipeline_here(backend) if pipeline is None else pipeline, tiled=backend != "interp", **options
        )
    module = _module_of(target, constants)
    name = target.name if isinstance(target, Spec) else module.main.name
    compilation = Compilation.build(module, backend, pipeline, name)
    if not (isinstance(target, Spec) and target.generic):
        return CompiledFunction(compilation)
    # one compilation per float type: float32's now (``module`` is its trace), the others on first use
    family = FloatFamily(target, constants, lambda m, _: Compilation.build(m, backend, pipeline, name))
    family.members[DEFAULT_FLOAT] = compilation
    return CompiledFunction(compilation, family)
