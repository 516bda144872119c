"""``fn.to_torch()``: a compiled function as a differentiable PyTorch op (docs/api.md section 6).

:func:`to_torch` registers two ``torch.library`` custom ops per compiled function:

- ``attncomp::NAME_HASH``: the forward that saves residuals (``fn.forward_saving``), returning
  each distinct IR value once (``plan.Slots``);
- ``attncomp::NAME_HASH_backward``: the compiled backward (``fn.backward``), taking the arguments,
  the residuals and one cotangent per result.

Both have a fake function (shapes from the IR's result types, symbolic sizes bound from the
input tensors' sizes, which may be ``SymInt``s), so ``torch.compile`` traces them, dynamic
shapes included; the forward's autograd is the package's one autograd path
(``attncomp/torch/autograd.py``).  The callable :func:`to_torch` returns
(:class:`TorchFunction`) hides the residuals; its eager calls skip the dispatcher
(``attncomp/torch/eager.py``) and run the same plans and the same autograd.

torch is imported only when ``to_torch`` is called: ``import attncomp`` never loads it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from attncomp.errors import PipelineError, ShapeError
from attncomp.gradients import backward_of, saving_forward_of
from attncomp.ir.binding import bind_arguments, check_dtype
from attncomp.ir.types import is_float
from attncomp.torch import autograd
from attncomp.torch.eager import autocast, eager_dtypes
from attncomp.torch.plan import Plan, Slots
from attncomp.torch.tensors import check_device, check_dtypes, numpy_dtype, torch_dtype

if TYPE_CHECKING:
    import torch

    from attncomp.api import CompiledFunction

#: the most plans (keys of argument dtypes) an op keeps; past it they are made again
PLANS = 256

#: op name -> the callable registered under it (torch.library refuses to register a name twice)
REGISTERED: dict[str, TorchFunction] = {}


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

    Equal compiled functions get equal names (in every process), different ones different names,
    so ops never collide and graphs that name them stay valid.
    """
    digest = hashlib.sha256(f"{fn.backend}\n{fn.pipeline}\n{fn.dump()}".encode()).hexdigest()[:12]
    return f"{re.sub(r'[^0-9A-Za-z_]', '_', fn.name)}_{digest}"


class TorchFunction:
    """``fn`` as a PyTorch callable: tensors in, tensors out (one, or a tuple for several results).

    ``op`` and ``backward_op`` are the registered custom ops (for ``torch.library.opcheck``).
    """

    def __init__(self, fn: CompiledFunction, name: str):
        torch = require_torch()
        self.torch = torch
        self.fn = fn
        self.name = name
        #: the device type whose tensors the program reads (``Program.device_type``)
        self.device_type = fn.compilation.program.device_type
        #: the arguments a generic spec's call takes in its float type (``ac.floating``)
        self.generic_args = set(fn.family.spec.float_args) if fn.family is not None else set()
        #: the one cache: argument dtypes -> what calls with them share (``plan.Plan``)
        self.plans: dict[tuple, Plan] = {}
        forward = saving_forward_of(fn.compilation)
        #: why the spec has no gradient (an op without a gradient rule, such as ``ac.page_view``), else None
        self.no_gradient: str | None = None
        try:
            backward = backward_of(fn.compilation)
        except PipelineError as error:  # a forward-only op: calls that need a gradient raise this
            backward, self.no_gradient = None, f"@{fn.func.name} has no gradient ({error})"
        #: the shapes of the forward op's outputs: every float type's member must have them
        self.layout = [str(v.type.shape) for v in dict.fromkeys(forward.func.results)]
        self.arg_names = [a.name or f"arg{k}" for k, a in enumerate(fn.func.args)]
        self.n_args = len(self.arg_names)
        #: per argument: whether it is of a float type (and has a gradient)
        self.floating = [is_float(a.type.dtype) for a in fn.func.args]
        self.slots = Slots.of(forward, len(fn.func.results))
        self.eager_autograd = autograd.eager_function(torch)

        params = ", ".join(f"Tensor {n}" for n in self.arg_names)
        distinct = list(dict.fromkeys(forward.func.results))
        self.op = torch.library.custom_op(
            f"attncomp::{name}", self.forward_impl, mutates_args=(), schema=f"({params}) -> {_returns(distinct)}"
        )
        self.op.register_fake(self.forward_fake)
        #: the registered backward ops by the floating arguments they leave out (``backward_op_without``)
        self.backward_ops: dict[tuple[str, ...], Any] = {}
        self.backward_op = None
        if backward is not None:
            #: the backward op's arguments: the spec's, the residuals, one cotangent per result
            self.backward_names = [a.name or f"arg{k}" for k, a in enumerate(backward.func.args)]
            backward_params = ", ".join(f"Tensor {n}" for n in self.backward_names)
            self.backward_op = torch.library.custom_op(
                f"attncomp::{name}_backward",
                self.backward_impl,
                mutates_args=(),
                schema=f"({backward_params}) -> {_returns(backward.func.results)}",
            )
            self.backward_op.register_fake(self.backward_fake)
            self.backward_ops[()] = self.backward_op
        self.op.register_autograd(self.backward_rule, setup_context=self.setup_context)

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if len(tensors) != self.n_args:
            raise TypeError(
                f"@{self.fn.func.name} takes {self.n_args} arguments ({', '.join(self.arg_names)}), got {len(tensors)}"
            )
        torch = self.torch
        if self.generic_args:
            tensors = autocast(torch, tensors, self.generic_args, self.device_type)
        dtypes = eager_dtypes(torch, tensors, self.device_type)
        if dtypes is None:  # tracing, fake tensors, a mode or transform: the registered op
            outputs = self.op(*tensors)
            positions: Sequence[int] = self.slots.result_slots
        else:  # the short path (eager.py)
            plan = self.plans.get(dtypes)
            if plan is None:
                plan = self.plan_of(tensors, dtypes)
            if not torch.is_grad_enabled() or not any([t.requires_grad for t in tensors]):
                return plan.call(tensors)
            if self.no_gradient is not None:
                raise RuntimeError(f"attncomp: {self.no_gradient}: call it on tensors that need no gradient")
            outputs = self.eager_autograd.apply(plan, *tensors)
            positions = self.slots.result_positions
            if len(positions) == 1:
                return outputs
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs[positions[0]] if len(positions) == 1 else tuple([outputs[k] for k in positions])

    def plan_of(self, tensors: Sequence[torch.Tensor], dtypes: tuple | None = None) -> Plan:
        """The plan of the tensors' dtypes, made (and the dtypes checked) on first use and kept."""
        if dtypes is None:
            dtypes = tuple([t.dtype for t in tensors])
        plan = self.plans.get(dtypes)
        if plan is None:
            plan = Plan(self, tensors, dtypes)
            if len(self.plans) >= PLANS:
                self.plans.clear()
            self.plans[dtypes] = plan
        return plan

    def check_devices(
        self, tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None, *, allow_meta: bool = False
    ) -> None:
        """Each tensor on the program's device (``ValueError`` naming the argument: of the spec, or ``names``)."""
        program = self.fn.compilation.program
        for t, name in zip(tensors, self.arg_names if names is None else names):
            check_device(name, t.device, program, allow_meta=allow_meta, scalar=t.dim() == 0)

    def __repr__(self) -> str:
        return f"<attncomp torch op attncomp::{self.name} ({self.fn.backend})>"

    # the registered ops: what the dispatcher runs ------------------------------------------------
    def forward_impl(self, *tensors: torch.Tensor) -> Any:
        """The forward op: the results and the residuals, each distinct value once."""
        self.check_devices(tensors)
        plan = self.plan_of(tensors).saving(tensors)
        return _tuple_or_one(autograd.run_saving(plan, tensors)[0])

    def backward_impl(self, *tensors: torch.Tensor) -> Any:
        """The backward op: one gradient per floating argument."""
        self.check_devices(tensors, self.backward_names)
        plan = self.plan_of(tensors[: self.n_args]).saving(tensors[: self.n_args])
        bf16 = plan.backward_bf16
        if tuple([t.dtype for t in tensors]) != plan.backward_dtypes:  # a call autograd did not make
            check_dtypes(plan.backward, tensors)
            bf16 = True
        return _tuple_or_one(plan.run(plan.backward, tensors, None, bf16))

    def backward_op_without(self, without: tuple[str, ...]) -> Any:
        """The registered backward op that neither computes nor returns the gradients of the floating
        arguments ``without`` (none: ``backward_op``): what a traced backward (``torch.compile``)
        calls where they need none, registered on first use as ``attncomp::NAME_backward_without_A_B``.
        Its arguments are ``backward_op``'s; its results the other floating arguments' gradients."""
        if without not in self.backward_ops:
            torch = self.torch
            params = ", ".join(f"Tensor {n}" for n in self.backward_names)
            wanted = [f and n not in without for f, n in zip(self.floating, self.arg_names)]

            def impl(*tensors: torch.Tensor) -> Any:
                self.check_devices(tensors, self.backward_names)
                plan = self.plan_of(tensors[: self.n_args]).saving(tensors[: self.n_args])
                backward, bf16 = plan.backward_without(without)
                return _tuple_or_one(plan.run(backward, tensors, None, bf16))

            def fake(*tensors: torch.Tensor) -> Any:
                return _tuple_or_one([g for g, want in zip(self.gradient_fakes(tensors), wanted) if want])

            op = torch.library.custom_op(
                f"attncomp::{self.name}_backward_without_{'_'.join(without)}",
                impl,
                mutates_args=(),
                schema=f"({params}) -> {_returns([w for w in wanted if w])}",
            )
            op.register_fake(fake)
            self.backward_ops[without] = op
        return self.backward_ops[without]

    def setup_context(self, ctx: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
        """The forward op's autograd: what it saves (``autograd.setup_context``)."""
        autograd.setup_context(self, ctx, inputs, output)

    def backward_rule(self, ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """The forward op's gradients: the one backward (``autograd.gradients``)."""
        if self.no_gradient is not None:
            raise RuntimeError(f"attncomp: {self.no_gradient}")
        return autograd.gradients(ctx, grads)

    # fake (shape-only) functions: what torch.compile and opcheck trace --------------------------
    def sizes(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        """The spec's sizes bound from the tensors' sizes (ints, or ``SymInt``s under dynamic shapes).

        Static sizes go through the binding itself, so tracing raises the same errors as a call;
        symbolic ones are bound by name without comparing them (a comparison would add guards).
        """
        self.check_devices(tensors, allow_meta=True)
        func = self.plan_of(tensors).saving(tensors).forward.func
        dtypes = [numpy_dtype(t, arg.type.dtype, name) for t, name, arg in zip(tensors, self.arg_names, func.args)]
        shapes = [tuple(t.shape) for t in tensors]
        if all(type(size) is int for shape in shapes for size in shape):
            # zero-stride arrays of the tensors' dtypes and shapes: checked, never allocated
            stand_ins = [np.broadcast_to(np.zeros((), dtype), shape) for dtype, shape in zip(dtypes, shapes)]
            return bind_arguments(func, stand_ins, self.fn.constraints)[1]
        sizes: dict[str, Any] = {}
        for shape, dtype, name, arg in zip(shapes, dtypes, self.arg_names, func.args):
            check_dtype(np.empty(0, dtype), arg.type.dtype, name)
            if len(shape) != arg.type.rank:
                raise ShapeError(f"{name}: expected rank {arg.type.rank}, got rank {len(shape)}")
            for size, d in zip(shape, arg.type.shape):
                if d.is_symbol:
                    sizes.setdefault(d.symbol, size)
        return sizes

    def empty(self, value: Any, sizes: dict[str, Any], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of IR ``value``'s type, its sizes from ``sizes``, on ``like``'s device."""
        shape = [d.evaluate(sizes) for d in value.type.shape]
        return like.new_empty(shape, dtype=torch_dtype(self.torch, value.type.dtype))

    def empty_results(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One uninitialised tensor per result of the spec, for these inputs."""
        sizes = self.sizes(inputs)
        forward = self.plan_of(inputs).saving(inputs).forward
        return [self.empty(v, sizes, inputs[0]) for v in forward.func.results[: len(self.slots.result_slots)]]

    def forward_fake(self, *tensors: torch.Tensor) -> Any:
        sizes = self.sizes(tensors)
        forward = self.plan_of(tensors).forward
        distinct = list(dict.fromkeys(forward.func.results))
        return _tuple_or_one([self.empty(v, sizes, tensors[0]) for v in distinct])

    def backward_fake(self, *tensors: torch.Tensor) -> Any:
        return _tuple_or_one([g for g, floating in zip(self.gradient_fakes(tensors), self.floating) if floating])

    def gradient_fakes(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per argument of a backward call's ``tensors``: an uninitialised gradient of its type, None
        where it is not floating."""
        torch = self.torch
        args = tensors[: self.n_args]
        func = self.plan_of(args).saving(args).forward.func
        return [
            torch.empty_like(t, dtype=torch_dtype(torch, a.type.dtype)) if floating else None
            for t, a, floating in zip(args, func.args, self.floating)
        ]


def _returns(values: Sequence[Any]) -> str:
    return "Tensor" if len(values) == 1 else f"({', '.join('Tensor' for _ in values)})"


def _tuple_or_one(tensors: list[Any]) -> Any:
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def to_torch(fn: CompiledFunction) -> TorchFunction:
    """``fn`` as a differentiable PyTorch op; the same compiled function gives the same op."""
    require_torch()
    name = op_name(fn)
    if name not in REGISTERED:
        REGISTERED[name] = TorchFunction(fn, name)
    return REGISTERED[name]
