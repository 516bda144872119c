"""compile(), interpret(), parse_ir() and the compiled-function object."""

from __future__ import annotations

from typing import Any

import numpy as np

from attncomp.backends import BACKENDS
from attncomp.backends.notice import compile_notice
from attncomp.blockmap import block_map
from attncomp.chunked.graph import is_dask
from attncomp.decoder import Decoder
from attncomp.dsl import Spec
from attncomp.errors import ShapeError
from attncomp.ir import parser as _parser
from attncomp.ir.binding import bind_arguments
from attncomp.ir.core import Module
from attncomp.ir.interpreter import Interpreter, interpret_func, interpret_unrounded
from attncomp.ir.types import NUMPY_DTYPES, is_float
from attncomp.ir.verifier import verify_module
from attncomp.passes import DEFAULT_PIPELINE, parse_pipeline, run_pipeline
from attncomp.passes.manager import split_top_level
from attncomp.serving.decoder import PagedDecoder

#: ops a compiled backend runs only once flash-tiling has tiled them
UNTILED = ("ac.attention", "ac.attention_grad")


def with_graph_pass(pipeline: str, name: str) -> str:
    """``pipeline`` with pass ``name`` run on the graph: just before flash-tiling, or last."""
    entries = split_top_level(pipeline)
    names = [e.split("{")[0].strip() for e in entries]
    at = names.index("flash-tiling") if "flash-tiling" in names else len(entries)
    entries.insert(at, name)
    return ",".join(entries)


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
        if backend != "interp" and any(op.name in UNTILED for op in self.module.main.body.ops):
            # Backends run attention tiled; a pipeline that stopped after fusion gets the default tiling.
            self.remarks.append(f"{backend}: attention was tiled with flash-tiling's defaults")
            more, stages = run_pipeline(self.module, parse_pipeline("flash-tiling"), self.remarks)
            self.module, self._stages = more, self._stages + stages[1:]
        self.constraints = verify_module(self.module)
        self._impl = None
        self._called = False
        self._named_sizes: list[tuple[int, int, str]] | None = None
        self._saving: CompiledFunction | None = None
        self._backward: CompiledFunction | None = None
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
        if any(is_dask(a) for a in args):  # a graph of chunk-pair kernel calls; nothing runs yet
            from attncomp.chunked import run_chunked

            return run_chunked(self, args)
        outputs = self._run(args)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _run(self, args, sizes: dict[str, int] | None = None, exact: bool = False) -> list[np.ndarray]:
        """Check ``args`` (with caller-known ``sizes``), run, return every result.

        ``exact`` (the interpreter only): take float64 arguments and give float64 results.
        """
        if self.backend == "cuda":  # device arrays are bound in place and results may stay on the device
            with compile_notice(self.name, self.backend, self._first_call()):
                return self._impl.run(self.func, args, self.constraints, sizes)
        if exact and self._impl is None:
            return interpret_unrounded(self.func, args, self.constraints, sizes)
        arrays, env = bind_arguments(self.func, args, self.constraints, sizes)
        if self._impl is not None:
            with compile_notice(self.name, self.backend, self._first_call()):
                outputs = self._impl(arrays, env)
        else:
            outputs = Interpreter(self.func, env).run(arrays)
        return [np.asarray(out, dtype=NUMPY_DTYPES[value.type.dtype]) for out, value in zip(outputs, self.func.results)]

    def _run_shaped(self, arrays: list[np.ndarray], sizes: dict[str, int]) -> list[np.ndarray]:
        """``_run`` for arrays the caller built to the signature itself: sizes are read from their
        shapes, not checked again (the cpu backend; the first call goes the checked way: it may
        compile, and says so)."""
        if self.backend != "cpu" or not self._called:
            return self._run(arrays, sizes)
        if self._named_sizes is None:
            self._named_sizes = [
                (k, axis, d.symbol)
                for k, arg in enumerate(self.func.args)
                for axis, d in enumerate(arg.type.shape)
                if d.is_symbol
            ]
        env = dict(sizes)
        for k, axis, name in self._named_sizes:
            env[name] = arrays[k].shape[axis]
        return self._impl(arrays, env)

    def _first_call(self) -> bool:
        """Whether this call may compile: the first one, with a kernel Numba has not compiled yet."""
        if self._called:
            return False
        self._called = True
        loaded = getattr(self._impl, "loaded", None)
        if isinstance(loaded, bool):  # the cpu backend: loading its kernels compiles them (or reads the cache)
            return not loaded
        return True

    # gradients -------------------------------------------------------------------
    @property
    def backward(self) -> CompiledFunction:
        """The compiled backward: ``autodiff`` after the graph passes, then tiled like the forward.

        It takes the spec's arguments, the saved results of the forward (each fused
        attention's output and LSE) and one cotangent per result, and returns one
        gradient per floating argument.
        """
        if self._backward is None:
            pipeline = with_graph_pass(self.pipeline, "autodiff")
            self._backward = CompiledFunction(self._input, self.backend, pipeline, f"{self.name}_backward")
        return self._backward

    @property
    def forward_saving(self) -> CompiledFunction:
        """The forward that also returns what the backward reads (``save-residuals``)."""
        if self._saving is None:
            pipeline = with_graph_pass(self.pipeline, "save-residuals")
            self._saving = CompiledFunction(self._input, self.backend, pipeline, self.name)
        return self._saving

    def vjp(self, *args: Any):
        """Run the forward; return its result and ``pullback(*cotangents) -> one gradient per argument``.

        ``pullback`` takes one cotangent per result (``None``: zero) and gives, per
        argument, an array of its shape and element type (float64 on ``interp``, the
        reference), or ``None`` for integer and boolean arguments.
        """
        forward = self.forward_saving
        exact = self.backend == "interp"
        outputs = forward._run(args, exact=exact)
        n_saved = forward.func.attrs.get("residuals", 0)
        results, saved = outputs[: len(outputs) - n_saved], outputs[len(outputs) - n_saved :]
        backward = self.backward
        result_types = [v.type for v in self.func.results]
        arg_names = [a.name for a in self.func.args]

        def pullback(*cotangents: Any) -> tuple[np.ndarray | None, ...]:
            if len(cotangents) != len(results):
                raise TypeError(
                    f"pullback of @{self.name} takes {len(results)} cotangent(s), one per result, got {len(cotangents)}"
                )
            filled = []
            for k, (c, r, t) in enumerate(zip(cotangents, results, result_types)):
                if c is None:
                    filled.append(np.zeros(np.shape(r), dtype=np.float64 if exact else NUMPY_DTYPES[t.dtype]))
                    continue
                c = np.asarray(c)
                if c.shape != np.shape(r):
                    raise ShapeError(f"cotangent {k}: expected shape {np.shape(r)} (result {k}), got {c.shape}")
                filled.append(c.astype(np.float64 if exact else NUMPY_DTYPES[t.dtype], copy=False))
            grads = iter(backward._run([*args, *saved, *filled], exact=exact))
            return tuple(next(grads) if is_float(v.type.dtype) else None for v in self.func.args)

        pullback.__doc__ = f"Gradients of ({', '.join(arg_names)}) from one cotangent per result."
        primal = results[0] if len(results) == 1 else tuple(results)
        return primal, pullback

    def _decoding_pipeline(self) -> str:
        """This function's pipeline with kv-cache-reuse right after softmax-fusion."""
        entries = split_top_level(self.pipeline)
        names = [e.split("{")[0].strip() for e in entries]
        if "kv-cache-reuse" not in names:
            if "softmax-fusion" in names:
                entries.insert(names.index("softmax-fusion") + 1, "kv-cache-reuse")
            else:
                entries[0:0] = ["softmax-fusion", "kv-cache-reuse"]
        return ",".join(entries)

    def decoder(self, max_len: int) -> Decoder:
        """An incremental decoder over a cache of ``max_len`` positions (kv-cache-reuse)."""
        decode = CompiledFunction(self._input, self.backend, self._decoding_pipeline(), self.name)
        return Decoder(decode, max_len)

    def paged_decoder(self, page_size: int = 16, num_pages: int = 1024) -> PagedDecoder:
        """A decoder serving many sequences over one pool of key/value pages (API.md section 7)."""
        # the same refusals as fn.decoder: keys must be computable for new tokens alone
        CompiledFunction(self._input, "interp", self._decoding_pipeline(), self.name)
        return PagedDecoder(self, page_size, num_pages)

    def chunk_parts(self) -> dict[str, CompiledFunction]:
        """The compiled parts a run over Dask arrays schedules (API.md section 8), by name.

        "inputs" (or "queries" and "keys") computes q, k and v per chunk of positions,
        "attention" runs one chunk pair ("attention_unmasked" for pairs proven fully
        visible), "outputs" uses the attention's result per query chunk; parts the spec
        does not need are absent.  Each is inspectable (``.ir(stage)``, ``.dump()``, ``.source``).
        """
        from attncomp.chunked.plan import ChunkPlan

        return ChunkPlan.of(self).parts()

    def block_map(self, *args: Any) -> np.ndarray:
        """int8 ``[*batch, q_blocks, kv_blocks]``: 0 skipped, 1 computed with its mask, 2 without."""
        return block_map(self.func, self.constraints, args)

    def to_torch(self) -> Any:
        """This function as a differentiable ``torch.library`` custom op over tensors (API.md section 6).

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
    return CompiledFunction(module, backend, pipeline, name)
