"""A compiled function as a differentiable PyTorch op (docs/api.md section 6).

``fn.to_torch()`` registers two ``torch.library`` custom ops per compiled function:

- ``attncomp::NAME_HASH``: the forward that saves residuals (``fn.forward_saving``).
  It returns the spec's results and what the backward reads (each fused
  attention's output and LSE), each distinct IR value once, so that a result that
  is also a residual is one tensor, not two aliasing ones.
- ``attncomp::NAME_HASH_backward``: the compiled backward (``fn.backward``), taking
  the arguments, the residuals and one cotangent per result.

Both have a fake function (shapes from the IR's result types, symbolic sizes bound
from the input tensors' sizes, which may be ``SymInt``s), so ``torch.compile``
traces them, dynamic shapes included; the forward's autograd saves its inputs and
residuals and calls the backward op, so the forward is never run twice.  The
callable that ``to_torch`` returns hides the residuals.

Tensors cross into numpy without copies: a contiguous CPU tensor is read through
``.numpy()`` and results are wrapped with ``torch.from_numpy``.  Argument checks are
the binding's own (``attncomp/ir/binding.py``), so a tensor of the wrong dtype or size
raises the same ``TypeError`` / ``ShapeError`` as a numpy array.

torch is imported only when ``to_torch`` is called: ``import attncomp`` never loads it.
"""

from __future__ import annotations

import hashlib
import importlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from attncomp.compilation import Compilation
from attncomp.errors import ShapeError
from attncomp.gradients import backward_of, saving_forward_of
from attncomp.ir.binding import bind_arguments, check_dtype
from attncomp.ir.types import NUMPY_DTYPES, is_float

if TYPE_CHECKING:
    import torch

    from attncomp.api import CompiledFunction

#: the device type each backend's tensors must be on
BACKEND_DEVICES = {"cpu": "cpu", "interp": "cpu", "cuda": "cuda"}

#: op name -> the callable registered under it (torch.library refuses to register a name twice)
_REGISTERED: dict[str, TorchFunction] = {}


def require_torch() -> Any:
    """``import torch``, or an ImportError saying how to install it (torch is an optional extra)."""
    try:
        import torch
    except ImportError as error:
        raise ImportError(
            'fn.to_torch() needs PyTorch, the torch extra of attncomp: pip install "attncomp[torch]"'
        ) from error
    return torch


def op_name(fn: CompiledFunction) -> str:
    """``NAME_HASH``: the spec's name and a hash of the backend and every stage's IR text.

    Equal compiled functions get equal names (in every process), different ones
    different names, so ops never collide and graphs that name them stay valid.
    """
    digest = hashlib.sha256(f"{fn.backend}\n{fn.pipeline}\n{fn.dump()}".encode()).hexdigest()[:12]
    return f"{re.sub(r'[^0-9A-Za-z_]', '_', fn.name)}_{digest}"


def check_device(name: str, device: torch.device, backend: str, *, allow_meta: bool = False) -> None:
    """Raise ``ValueError`` naming the argument if ``device`` is not the one ``backend`` runs on.

    ``allow_meta``: the fake (shape-only) function also serves meta tensors.
    """
    want = BACKEND_DEVICES[backend]
    if device.type == want or (allow_meta and device.type == "meta"):
        return
    raise ValueError(
        f"{name}: a {device.type} tensor, but this function runs on the {backend!r} backend, "
        f"which takes {want} tensors (move it with .to({want!r}))"
    )


def numpy_dtype(tensor: torch.Tensor, want: str, name: str) -> np.dtype:
    """The numpy dtype of ``tensor``; a dtype numpy lacks (bfloat16) is the binding's TypeError."""
    try:
        return np.dtype(str(tensor.dtype).removeprefix("torch."))
    except TypeError:
        raise TypeError(
            f"{name}: expected {want} ({np.dtype(NUMPY_DTYPES[want]).name}) elements, "
            f"got {str(tensor.dtype).removeprefix('torch.')}"
        ) from None


class TorchFunction:
    """``fn`` as a PyTorch callable: tensors in, tensors out (one, or a tuple for several results).

    ``op`` and ``backward_op`` are the registered custom ops (for ``torch.library.opcheck``).
    """

    def __init__(self, fn: CompiledFunction, name: str):
        torch = require_torch()
        self.fn = fn
        self.name = name
        #: id of a compilation -> its saving forward and backward (one per float type of a generic spec;
        #: the function's family keeps the compilations alive)
        self._members: dict[int, tuple[Compilation, Compilation]] = {}
        #: the arguments' dtypes -> their member (generic specs; the float type read once per dtypes)
        self._by_dtypes: dict[tuple, tuple[Compilation, Compilation]] = {}
        #: the same for the plain forward (the spec's results alone)
        self._plain_by_dtypes: dict[tuple, Compilation] = {}
        #: the arguments a generic spec's call takes in its float type (``ac.floating``)
        self._generic_args = set(fn.family.spec.float_args) if fn.family is not None else set()
        #: the shapes of the forward op's outputs: every float type's member must have them
        self._layout = [str(v.type.shape) for v in dict.fromkeys(saving_forward_of(fn.compilation).func.results)]
        forward, backward = self.member(())
        self._arg_names = [a.name or f"arg{k}" for k, a in enumerate(fn.func.args)]
        self._floating = [is_float(a.type.dtype) for a in fn.func.args]
        # Each distinct IR value the saving forward returns is one output of the op; a result that is
        # also a residual (the attention's output) is returned once and read twice.
        values = list(forward.func.results)
        distinct = list(dict.fromkeys(values))
        self._outputs = distinct
        self._slots = [distinct.index(v) for v in values]
        n_results = len(fn.func.results)
        self._result_slots, self._saved_slots = self._slots[:n_results], self._slots[n_results:]
        #: the forward's result positions of the op's outputs (each distinct value once)
        self._first = [self._slots.index(k) for k in range(len(self._outputs))]

        params = ", ".join(f"Tensor {n}" for n in self._arg_names)
        self.op = torch.library.custom_op(
            f"attncomp::{name}", self._forward_impl, mutates_args=(), schema=f"({params}) -> {_returns(distinct)}"
        )
        self.op.register_fake(self._forward_fake)
        backward_params = ", ".join(f"Tensor {a.name or f'arg{k}'}" for k, a in enumerate(backward.func.args))
        self.backward_op = torch.library.custom_op(
            f"attncomp::{name}_backward",
            self._backward_impl,
            mutates_args=(),
            schema=f"({backward_params}) -> {_returns(backward.func.results)}",
        )
        self.backward_op.register_fake(self._backward_fake)
        self.op.register_autograd(self._backward_rule, setup_context=self._setup_context)
        #: (compilation, dtype and device per tensor) combinations already checked
        self._checked: set[tuple] = set()

    def member(self, tensors: Sequence[Any], dtypes: tuple | None = None) -> tuple[Compilation, Compilation]:
        """The saving forward and the backward for the float type of ``tensors`` (a generic spec's
        member for it; a spec of declared types has one).  ``dtypes``: the tensors' dtypes, by which
        a generic spec's answer is kept (its float type is read from the tensors once per dtypes)."""
        if dtypes is not None and self._generic_args:
            found = self._by_dtypes.get(dtypes)
            if found is None:
                found = self._by_dtypes[dtypes] = self.member(tensors)
            return found
        c = self.fn.for_args(tensors).compilation if tensors and self._generic_args else self.fn.compilation
        if id(c) not in self._members:  # checked once per float type
            forward = saving_forward_of(c)
            layout = [str(v.type.shape) for v in dict.fromkeys(forward.func.results)]
            if self._members and layout != self._layout:
                raise TypeError(
                    f"@{c.name} does not fuse in {c.func.args[0].type.dtype} as in float32, so one op cannot "
                    f"serve both: {'; '.join(forward.remarks) or 'its residuals differ'} (make the tensors that "
                    "enter the scores ac.floating too)"
                )
            self._members[id(c)] = (forward, backward_of(c))
        return self._members[id(c)]

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if len(tensors) != len(self._arg_names):
            raise TypeError(
                f"@{self.fn.func.name} takes {len(self._arg_names)} arguments ({', '.join(self._arg_names)}), "
                f"got {len(tensors)}"
            )
        tensors = self._autocast(tensors)
        dtypes = eager_dtypes(require_torch(), tensors, BACKEND_DEVICES[self.fn.backend])
        outputs = self._eager(tensors, dtypes) if dtypes is not None else self.op(*tensors)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        slots = self._result_slots
        return outputs[slots[0]] if len(slots) == 1 else tuple([outputs[slot] for slot in slots])

    def _eager(self, tensors: tuple[torch.Tensor, ...], dtypes: tuple) -> Any:
        """The op's forward and autograd without the dispatcher's round trip (``eager_dtypes``): the
        forward's implementation, and, when a gradient is wanted, an ``autograd.Function`` that saves
        what the registered autograd saves and runs the same backward.  ``dtypes``: the tensors'
        (on the backend's device, as ``eager_dtypes`` found)."""
        if require_torch().is_grad_enabled():
            for t in tensors:
                if t.requires_grad:
                    return _EagerAutograd.apply(self, dtypes, *tensors)
        return self._forward_plain(tensors, dtypes)

    def _autocast(self, tensors: tuple[Any, ...]) -> tuple[Any, ...]:
        """Under ``torch.autocast`` a generic spec runs in the autocast type: its ``ac.floating``
        arguments are cast to it.  A spec of declared types keeps them (as PyTorch's float32 ops do)."""
        torch = require_torch()
        if not self._generic_args or not tensors or not _any_autocast(torch):
            return tensors
        device = tensors[0].device.type
        if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
            return tensors
        dtype = torch.get_autocast_dtype(device)
        return tuple(
            t.to(dtype) if k in self._generic_args and t.is_floating_point() else t for k, t in enumerate(tensors)
        )

    def __repr__(self) -> str:
        return f"<attncomp torch op attncomp::{self.name} ({self.fn.backend})>"

    # running ----------------------------------------------------------------------------------
    def _run(
        self,
        compiled: Compilation,
        tensors: Sequence[torch.Tensor],
        picked: Sequence[int] | None = None,
        dtypes: tuple | None = None,
    ) -> list[torch.Tensor]:
        """Run ``compiled`` on ``tensors`` (checked as numpy arguments are); give its ``picked`` results.
        ``dtypes``: the tensors' dtypes, all of them known to be on the backend's device."""
        torch = require_torch()
        if dtypes is None:
            key: tuple = (id(compiled), *[(t.dtype, t.is_cpu, t.is_cuda) for t in tensors])
        else:
            key = (id(compiled), dtypes)
        if key not in self._checked:  # devices and dtypes checked once per combination
            names = [a.name or f"arg{k}" for k, a in enumerate(compiled.func.args)]
            for t, name, arg in zip(tensors, names, compiled.func.args):
                check_device(name, t.device, self.fn.backend)
                # the binding's TypeError before any conversion (.numpy() refuses some dtypes itself)
                check_dtype(np.empty(0, numpy_dtype(t, arg.type.dtype, name)), arg.type.dtype, name)
            if len(self._checked) > 256:
                self._checked.clear()
            self._checked.add(key)
        if self.fn.backend == "cuda":
            # detach: __cuda_array_interface__ refuses tensors that require grad
            inputs = [t.detach().contiguous() if t.requires_grad or not t.is_contiguous() else t for t in tensors]
            outputs = _run_cuda(torch, compiled, inputs)
            return outputs if picked is None else [outputs[k] for k in picked]
        arrays = []  # one loop, no helper calls: a small call's microseconds are these lines
        bf16 = torch.bfloat16
        for t in tensors:
            if t.requires_grad:  # .numpy() refuses tensors that require grad
                t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            arrays.append(t.view(torch.int16).numpy().view(BF16) if t.dtype is bf16 else t.numpy())
        outputs = compiled.run(arrays)
        outputs = outputs if picked is None else [outputs[k] for k in picked]
        return [from_numpy(torch, a) for a in _owned(outputs, arrays)]

    def _forward_plain(self, tensors: Sequence[torch.Tensor], dtypes: tuple | None = None) -> Any:
        """The spec's results alone (no residuals): an eager call that wants no gradient."""
        if not self._generic_args:
            compiled = self.fn.compilation
        elif dtypes is None:
            compiled = self.fn.for_args(tensors).compilation
        else:
            compiled = self._plain_by_dtypes.get(dtypes)
            if compiled is None:
                compiled = self._plain_by_dtypes[dtypes] = self.fn.for_args(tensors).compilation
        return _tuple_or_one(self._run(compiled, tensors, None, dtypes))

    def _forward_impl(self, *tensors: torch.Tensor, dtypes: tuple | None = None) -> Any:
        """The op's outputs: the results and the residuals, each distinct value once."""
        return _tuple_or_one(self._run(self.member(tensors, dtypes)[0], tensors, self._first, dtypes))

    def _backward_impl(self, *tensors: torch.Tensor, dtypes: tuple | None = None) -> Any:
        n = len(self._arg_names)
        backward = self.member(tensors[:n], None if dtypes is None else dtypes[:n])[1]
        return _tuple_or_one(self._run(backward, tensors, None, dtypes))

    # fake (shape-only) functions: what torch.compile and opcheck trace --------------------------
    def _sizes(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        """The spec's sizes bound from the tensors' sizes (ints, or ``SymInt``s under dynamic shapes).

        Static sizes go through the binding itself, so tracing raises the same errors as a call;
        symbolic ones are bound by name without comparing them (a comparison would add guards).
        """
        func = self.member(tensors)[0].func
        dtypes = []
        for t, name, arg in zip(tensors, self._arg_names, func.args):
            check_device(name, t.device, self.fn.backend, allow_meta=True)
            dtypes.append(numpy_dtype(t, arg.type.dtype, name))
        shapes = [tuple(t.shape) for t in tensors]
        if all(type(size) is int for shape in shapes for size in shape):
            # zero-stride arrays of the tensors' dtypes and shapes: checked, never allocated
            stand_ins = [np.broadcast_to(np.zeros((), dtype), shape) for dtype, shape in zip(dtypes, shapes)]
            return bind_arguments(func, stand_ins, self.fn.constraints)[1]
        sizes: dict[str, Any] = {}
        for shape, dtype, name, arg in zip(shapes, dtypes, self._arg_names, func.args):
            check_dtype(np.empty(0, dtype), arg.type.dtype, name)
            if len(shape) != arg.type.rank:
                raise ShapeError(f"{name}: expected rank {arg.type.rank}, got rank {len(shape)}")
            for size, d in zip(shape, arg.type.shape):
                if d.is_symbol:
                    sizes.setdefault(d.symbol, size)
        return sizes

    def _empty(self, value: Any, sizes: dict[str, Any], like: torch.Tensor) -> torch.Tensor:
        torch = require_torch()
        shape = [d.evaluate(sizes) for d in value.type.shape]
        return like.new_empty(shape, dtype=getattr(torch, np.dtype(NUMPY_DTYPES[value.type.dtype]).name))

    def _forward_fake(self, *tensors: torch.Tensor) -> Any:
        sizes = self._sizes(tensors)
        forward = self.member(tensors)[0]
        distinct = list(dict.fromkeys(forward.func.results))
        return _tuple_or_one([self._empty(v, sizes, tensors[0]) for v in distinct])

    def _backward_fake(self, *tensors: torch.Tensor) -> Any:
        torch = require_torch()
        args = tensors[: len(self._arg_names)]
        grads = [
            torch.empty_like(t, dtype=getattr(torch, np.dtype(NUMPY_DTYPES[a.type.dtype]).name))
            for t, a, floating in zip(args, self.member(args)[0].func.args, self._floating)
            if floating
        ]
        return _tuple_or_one(grads)

    # autograd -------------------------------------------------------------------------------------
    def _setup_context(self, ctx: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.save_for_backward(*inputs, *(outputs[slot] for slot in self._saved_slots))

    def _backward_rule(
        self, ctx: Any, *grads: torch.Tensor | None, eager: bool = False
    ) -> tuple[torch.Tensor | None, ...]:
        """The gradients from the compiled backward: inputs and residuals were saved, nothing reruns.
        ``eager``: called by the eager path's ``autograd.Function``, which calls the backward's
        implementation directly when the tensors are where an eager call may take them."""
        torch = require_torch()
        saved = ctx.saved_tensors
        inputs, residuals = saved[: len(self._arg_names)], saved[len(self._arg_names) :]
        cotangents, seen = [], set()
        forward = self.member(inputs, tuple(t.dtype for t in inputs) if eager else None)[0]
        for slot, value in zip(self._result_slots, forward.func.results):
            grad = grads[slot] if slot not in seen else None  # a result returned twice: its grad once
            seen.add(slot)
            if grad is None:  # an unused result: a zero cotangent, as pullback(None) gives
                grad = torch.zeros_like(self._empty(value, self._sizes(inputs), inputs[0]))
            cotangents.append(grad)
        arguments = (*inputs, *residuals, *cotangents)
        dtypes = eager_dtypes(torch, arguments, BACKEND_DEVICES[self.fn.backend]) if eager else None
        if dtypes is not None:
            out = self._backward_impl(*arguments, dtypes=dtypes)
        else:
            out = self.backward_op(*arguments)
        floating = iter(out if isinstance(out, tuple) else (out,))
        grads_out = []
        for t, is_floating in zip(inputs, self._floating):
            g = next(floating) if is_floating else None
            grads_out.append(g if g is None or g.dtype == t.dtype else g.to(t.dtype))
        return tuple(grads_out)


def eager_dtypes(torch: Any, tensors: Sequence[Any], device: str) -> tuple | None:
    """The tensors' dtypes where a call may skip the dispatcher, else None: plain tensors (or
    ``nn.Parameter``s) on the backend's ``device``, outside ``torch.compile``, with no torch
    function or dispatch mode and no functorch transform active.  Anything else (meta or fake
    tensors, tracing, ``vmap``, a mode that watches ops, a tensor on another device, which the op's
    checks name) goes through the registered custom op."""
    if torch.compiler.is_compiling():
        return None
    plain = (torch.Tensor, torch.nn.Parameter)  # a parameter is a tensor whose torch functions are a tensor's
    cpu = device == "cpu"
    for t in tensors:
        if type(t) not in plain or not (t.is_cpu if cpu else t.is_cuda):
            return None
    modes = _mode_checks()
    if modes is None:
        return None
    function_mode, functorch, dispatch_mode = modes
    if function_mode() or functorch() or dispatch_mode():
        return None
    return tuple([t.dtype for t in tensors])


def _any_autocast(torch: Any) -> bool:
    """Whether autocast is on for any device (a cheap first test before asking per device; a torch
    without torch's internal check asks per device every time)."""
    if not _ANY_AUTOCAST:
        _ANY_AUTOCAST.append(getattr(importlib.import_module("torch._C"), "_is_any_autocast_enabled", None))
    check = _ANY_AUTOCAST[0]
    return True if check is None else bool(check())


_ANY_AUTOCAST: list[Any] = []


_MODE_CHECKS: list[Any] = []


def _mode_checks() -> tuple[Any, ...] | None:
    """The functions that tell whether a torch function mode, a functorch transform or a dispatch
    mode is active (None: this torch lacks one of them, and calls always dispatch).

    They are torch's internal checks, looked up by name so that a torch without them only loses
    the eager path."""
    if not _MODE_CHECKS:
        try:
            found = [
                getattr(importlib.import_module(module), name)
                for module, name in (
                    ("torch._C", "_is_torch_function_mode_enabled"),
                    ("torch._C", "_are_functorch_transforms_active"),
                    ("torch.utils._python_dispatch", "_get_current_dispatch_mode"),
                )
            ]
            function_mode, functorch, dispatch_mode = found
            _MODE_CHECKS.append((function_mode, functorch, lambda: dispatch_mode() is not None))
        except (AttributeError, ImportError):
            _MODE_CHECKS.append(None)
    return _MODE_CHECKS[0]


def _eager_autograd(torch: Any) -> type:
    """The ``autograd.Function`` of eager calls that want gradients (made once torch is imported)."""

    class EagerAutograd(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, op: TorchFunction, dtypes: tuple, *tensors: torch.Tensor) -> Any:
            outputs = op._forward_impl(*tensors, dtypes=dtypes)
            ctx.op = op
            op._setup_context(ctx, tensors, outputs)
            return outputs

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            return (None, None, *ctx.op._backward_rule(ctx, *grads, eager=True))

    return EagerAutograd


class _LazyEagerAutograd:
    """``apply`` of the eager ``autograd.Function``, defined on first use (torch is optional)."""

    function: type | None = None

    @classmethod
    def apply(cls, *args: Any) -> Any:
        if cls.function is None:
            cls.function = _eager_autograd(require_torch())
        return cls.function.apply(*args)


_EagerAutograd = _LazyEagerAutograd


def from_numpy(torch: Any, a: np.ndarray) -> torch.Tensor:
    """A numpy array as a CPU tensor sharing its memory (bfloat16 through a 16-bit view)."""
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


BF16 = np.dtype(NUMPY_DTYPES["bf16"])


def _returns(values: Sequence[Any]) -> str:
    return "Tensor" if len(values) == 1 else f"({', '.join('Tensor' for _ in values)})"


def _tuple_or_one(tensors: list[Any]) -> Any:
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def _owned(outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``outputs``, each writable, contiguous and sharing memory with no input and no other output.

    A custom op's outputs must not alias its inputs or each other; a spec that returns an argument
    as it is (or a backward whose gradient is a cotangent) would otherwise hand one buffer out twice.
    """
    owned: list[np.ndarray] = []
    for out in outputs:
        flags = out.flags
        if flags.owndata and flags.c_contiguous and flags.writeable and all(out is not o for o in owned):
            owned.append(out)  # a buffer the call allocated: no input or other output is in it
            continue
        shared = any(np.may_share_memory(out, other) for other in (*inputs, *owned))
        if shared or not (out.flags.writeable and out.flags.c_contiguous):
            out = np.array(out, order="C", copy=True)
        owned.append(out)
    return owned


def _run_cuda(torch: Any, compiled: Compilation, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The cuda backend on CUDA tensors, in place through ``__cuda_array_interface__``.

    Every launch, allocation and copy of the call is enqueued on PyTorch's current stream
    (wrapped as a Numba external stream), so the op orders with the tensors' producers and
    consumers as any torch op does, with no synchronisation.  Not yet run on a GPU (the
    machines it was written on have none); the simulator runs the same launches.
    """
    from numba import cuda

    from attncomp.backends.numba_cuda import runtime

    device = inputs[0].device
    torch_stream = torch.cuda.current_stream(device)
    # bf16 the kernels read in 16 bits (``Program.bf16_bits``: query, key and value of tensor-core
    # attention) goes as its bit patterns; other bf16 runs as float32 (``numba_cuda.widened``)
    bits = compiled.program.bf16_bits
    args = [
        (runtime.Bf16Bits(t.contiguous().view(torch.int16)) if k in bits else t.float())
        if t.dtype == torch.bfloat16
        else t
        for k, t in enumerate(inputs)
    ]
    with runtime.on_stream(cuda.external_stream(torch_stream.cuda_stream)):
        outputs = compiled.run(args)
    results: list[torch.Tensor] = []
    taken = {t.untyped_storage().data_ptr() for t in inputs}
    for out, value in zip(outputs, compiled.func.results):
        if isinstance(out, np.ndarray):  # 0-d results stay on the host
            result = from_numpy(torch, np.array(out)).to(device)
        elif isinstance(out, runtime.Bf16Bits):  # written as bf16 patterns by the kernel
            result = torch.as_tensor(out.bits.view(np.int16), device=device).view(torch.bfloat16)
        else:
            result = torch.as_tensor(out, device=device)
        if value.type.dtype == "bf16":  # rounded to the declared type, on the device
            result = result.to(torch.bfloat16)
        if result.untyped_storage().data_ptr() in taken:  # as in _owned: outputs alias nothing
            result = result.clone()
        taken.add(result.untyped_storage().data_ptr())
        results.append(result)
    return results


def to_torch(fn: CompiledFunction) -> TorchFunction:
    """``fn`` as a differentiable PyTorch op; the same compiled function gives the same op."""
    require_torch()
    name = op_name(fn)
    if name not in _REGISTERED:
        _REGISTERED[name] = TorchFunction(fn, name)
    return _REGISTERED[name]
