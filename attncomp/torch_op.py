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
callable that ``to_torch`` returns hides the residuals; its eager calls skip the
dispatcher (``attncomp/torch_eager.py``) and compute the same.

Tensors cross into numpy without copies: a contiguous CPU tensor is read through
``.numpy()`` and results are wrapped with ``torch.from_numpy``.  Argument checks are
the binding's own (``attncomp/ir/binding.py``), so a tensor of the wrong dtype or size
raises the same ``TypeError`` / ``ShapeError`` as a numpy array.

torch is imported only when ``to_torch`` is called: ``import attncomp`` never loads it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from attncomp.compilation import Compilation
from attncomp.errors import ShapeError
from attncomp.gradients import backward_of, saving_forward_of
from attncomp.ir.binding import bind_arguments, check_dtype
from attncomp.ir.types import NUMPY_DTYPES, is_float
from attncomp.torch_eager import (
    EagerAutograd,
    EagerPlan,
    any_autocast,
    argument_gradients,
    eager_dtypes,
    from_numpy,
    run_numpy,
)

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
        self.torch = torch
        self.fn = fn
        self.name = name
        #: the device type the backend's tensors are on
        self.device = BACKEND_DEVICES[fn.backend]
        #: id of a compilation -> its saving forward and backward (one per float type of a generic spec;
        #: the function's family keeps the compilations alive)
        self._members: dict[int, tuple[Compilation, Compilation]] = {}
        #: the arguments' dtypes -> what eager calls with them share (``torch_eager.EagerPlan``)
        self._plans: dict[tuple, EagerPlan] = {}
        #: the arguments a generic spec's call takes in its float type (``ac.floating``)
        self._generic_args = set(fn.family.spec.float_args) if fn.family is not None else set()
        #: the shapes of the forward op's outputs: every float type's member must have them
        self._layout = [str(v.type.shape) for v in dict.fromkeys(saving_forward_of(fn.compilation).func.results)]
        forward, backward = self.member(())
        self._arg_names = [a.name or f"arg{k}" for k, a in enumerate(fn.func.args)]
        #: per argument: whether it is of a float type (and has a gradient)
        self.floating = [is_float(a.type.dtype) for a in fn.func.args]
        # Each distinct IR value the saving forward returns is one output of the op; a result that is
        # also a residual (the attention's output) is returned once and read twice.
        values = list(forward.func.results)
        distinct = list(dict.fromkeys(values))
        slots = [distinct.index(v) for v in values]
        n_results = len(fn.func.results)
        #: the op's output (slot) of each result, and of each residual the backward reads
        self.result_slots, self.saved_slots = slots[:n_results], slots[n_results:]
        #: the forward's result positions of the op's outputs (each distinct value once)
        self.first = [slots.index(k) for k in range(len(distinct))]

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

    def member(self, tensors: Sequence[Any]) -> tuple[Compilation, Compilation]:
        """The saving forward and the backward for the float type of ``tensors`` (a generic spec's
        member for it; a spec of declared types has one)."""
        c = self.fn.for_args(tensors).compilation if tensors and self._generic_args else self.fn.compilation
        if id(c) not in self._members:  # checked once per float type
            forward = saving_forward_of(c)
            layout = [str(v.type.shape) for v in dict.fromkeys(forward.func.results)]
            if self._members and layout != self._layout:
                raise TypeError(
                    f"@{c.name} does not fuse in {c.func.args[0].type.dtype} as in float32, so one op cannot "
                    f"serve both: {'; '.join(forward.remarks) or 'its residuals differ'}"
                )
            self._members[id(c)] = (forward, backward_of(c))
        return self._members[id(c)]

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if len(tensors) != len(self._arg_names):
            raise TypeError(
                f"@{self.fn.func.name} takes {len(self._arg_names)} arguments ({', '.join(self._arg_names)}), "
                f"got {len(tensors)}"
            )
        torch = self.torch
        if self._generic_args:
            tensors = self._autocast(tensors)
        dtypes = eager_dtypes(torch, tensors, self.device)
        slots = self.result_slots
        if dtypes is None:
            outputs = self.op(*tensors)
        else:  # the short path (torch_eager.py)
            plan = self._plans.get(dtypes)
            if plan is None:
                plan = self.plan(tensors, dtypes)
            if not torch.is_grad_enabled() or not any([t.requires_grad for t in tensors]):
                return plan.call(tensors)
            outputs = EagerAutograd.apply(plan, *tensors)
            if len(slots) == 1:
                return outputs
            slots = plan.result_positions
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs[slots[0]] if len(slots) == 1 else tuple([outputs[slot] for slot in slots])

    def plan(self, tensors: Sequence[torch.Tensor], dtypes: tuple) -> EagerPlan:
        """The eager calls' plan for ``dtypes`` (the tensors' dtypes), made and kept on first use."""
        plan = EagerPlan(self, tensors, dtypes)
        if len(self._plans) > 256:
            self._plans.clear()
        self._plans[dtypes] = plan
        return plan

    def plain_member(self, tensors: Sequence[torch.Tensor]) -> Compilation:
        """The forward without residuals for the float type of ``tensors``."""
        return self.fn.for_args(tensors).compilation if self._generic_args else self.fn.compilation

    def check_tensors(self, compiled: Compilation, tensors: Sequence[torch.Tensor]) -> None:
        """Each tensor's device and dtype against ``compiled``'s arguments: ``ValueError`` or the
        binding's ``TypeError``, naming the argument, before any conversion (``.numpy()`` refuses
        some dtypes itself)."""
        names = [a.name or f"arg{k}" for k, a in enumerate(compiled.func.args)]
        for t, name, arg in zip(tensors, names, compiled.func.args):
            check_device(name, t.device, self.fn.backend)
            check_dtype(np.empty(0, numpy_dtype(t, arg.type.dtype, name)), arg.type.dtype, name)

    def _autocast(self, tensors: tuple[Any, ...]) -> tuple[Any, ...]:
        """Under ``torch.autocast`` a generic spec runs in the autocast type: its ``ac.floating``
        arguments are cast to it.  A spec of declared types keeps them (as PyTorch's float32 ops do)."""
        torch = self.torch
        if not self._generic_args or not tensors or not any_autocast(torch):
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
    def run_tensors(
        self,
        compiled: Compilation,
        tensors: Sequence[torch.Tensor],
        picked: Sequence[int] | None = None,
        dtypes: tuple | None = None,
    ) -> list[torch.Tensor]:
        """Run ``compiled`` on ``tensors`` (checked as numpy arguments are); give its ``picked`` results.
        ``dtypes``: the tensors' dtypes, all of them known to be on the backend's device."""
        torch = self.torch
        if dtypes is None:
            key: tuple = (id(compiled), *[(t.dtype, t.is_cpu, t.is_cuda) for t in tensors])
        else:
            key = (id(compiled), dtypes)
        if key not in self._checked:  # devices and dtypes checked once per combination
            self.check_tensors(compiled, tensors)
            if len(self._checked) > 256:
                self._checked.clear()
            self._checked.add(key)
        if self.fn.backend == "cuda":
            # detach: __cuda_array_interface__ refuses tensors that require grad
            inputs = [t.detach().contiguous() if t.requires_grad or not t.is_contiguous() else t for t in tensors]
            outputs = run_cuda(torch, compiled, inputs)
            return outputs if picked is None else [outputs[k] for k in picked]
        return run_numpy(torch, compiled, tensors, picked)

    def _forward_impl(self, *tensors: torch.Tensor) -> Any:
        """The op's outputs: the results and the residuals, each distinct value once."""
        return _tuple_or_one(self.run_tensors(self.member(tensors)[0], tensors, self.first))

    def _backward_impl(self, *tensors: torch.Tensor) -> Any:
        backward = self.member(tensors[: len(self._arg_names)])[1]
        return _tuple_or_one(self.run_tensors(backward, tensors))

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
            for t, a, floating in zip(args, self.member(args)[0].func.args, self.floating)
            if floating
        ]
        return _tuple_or_one(grads)

    # autograd -------------------------------------------------------------------------------------
    def _setup_context(self, ctx: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.save_for_backward(*inputs, *(outputs[slot] for slot in self.saved_slots))

    def _backward_rule(self, ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """The gradients from the compiled backward: inputs and residuals were saved, nothing reruns."""
        torch = self.torch
        saved = ctx.saved_tensors
        inputs, residuals = saved[: len(self._arg_names)], saved[len(self._arg_names) :]
        cotangents, seen = [], set()
        forward = self.member(inputs)[0]
        for slot, value in zip(self.result_slots, forward.func.results):
            grad = grads[slot] if slot not in seen else None  # a result returned twice: its grad once
            seen.add(slot)
            if grad is None:  # an unused result: a zero cotangent, as pullback(None) gives
                grad = torch.zeros_like(self._empty(value, self._sizes(inputs), inputs[0]))
            cotangents.append(grad)
        out = self.backward_op(*inputs, *residuals, *cotangents)
        return tuple(argument_gradients(inputs, self.floating, out if isinstance(out, tuple) else (out,)))


def _returns(values: Sequence[Any]) -> str:
    return "Tensor" if len(values) == 1 else f"({', '.join('Tensor' for _ in values)})"


def _tuple_or_one(tensors: list[Any]) -> Any:
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def run_cuda(
    torch: Any, compiled: Compilation, inputs: Sequence[torch.Tensor], sizes: dict[str, int] | None = None
) -> list[torch.Tensor]:
    """The cuda backend on CUDA tensors, in place through ``__cuda_array_interface__``
    (``sizes``: those no argument carries, such as a chunk's offsets).

    Every launch, allocation and copy of the call is enqueued on PyTorch's current stream
    (wrapped as a Numba external stream), so the op orders with the tensors' producers and
    consumers as any torch op does, with no synchronisation.  Not yet run on a GPU (the
    machines it was written on have none); the simulator runs the same launches.
    """
    from numba import cuda

    from attncomp.backends.numba_cuda.host.arrays import Bf16Bits
    from attncomp.backends.numba_cuda.host.launches import on_stream

    device = inputs[0].device
    torch_stream = torch.cuda.current_stream(device)
    # bf16 the kernels read in 16 bits (``Program.bf16_bits``: query, key and value of tensor-core
    # attention) goes as its bit patterns; other bf16 runs as float32 (``widen-bf16``)
    bits = compiled.program.bf16_bits
    args = [
        (Bf16Bits(t.contiguous().view(torch.int16)) if k in bits else t.float()) if t.dtype == torch.bfloat16 else t
        for k, t in enumerate(inputs)
    ]
    with on_stream(cuda.external_stream(torch_stream.cuda_stream)):
        outputs = compiled.run(args, sizes)
    results: list[torch.Tensor] = []
    taken = {t.untyped_storage().data_ptr() for t in inputs}
    for out, value in zip(outputs, compiled.func.results):
        if isinstance(out, np.ndarray):  # 0-d results stay on the host
            result = from_numpy(torch, np.array(out)).to(device)
        elif isinstance(out, Bf16Bits):  # written as bf16 patterns by the kernel
            result = torch.as_tensor(out.bits.view(np.int16), device=device).view(torch.bfloat16)
        else:
            result = torch.as_tensor(out, device=device)
        if value.type.dtype == "bf16":  # rounded to the declared type, on the device
            result = result.to(torch.bfloat16)
        if result.untyped_storage().data_ptr() in taken:  # as in torch_eager.owned: outputs alias nothing
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
