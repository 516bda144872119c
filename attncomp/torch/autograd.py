"""The one autograd path of ``fn.to_torch()``: what a forward saves, and the backward.

The registered custom op's autograd (``register_autograd`` with :func:`setup_context` and
:func:`gradients`) and the eager calls' ``autograd.Function`` (:func:`eager_function`) run the
same code: the forward is ``fn.forward_saving`` (:func:`run_saving`), autograd keeps the inputs
and the residuals (each fused attention's output and LSE), and the backward makes one cotangent
per result, runs ``fn.backward`` on the saved tensors and gives one gradient per argument, so
nothing runs twice.  Integer inputs get no gradient.

The backward's tensors take the call's rule (``eager.skips_dispatcher``): plain ones skip the
dispatcher, reading the numpy views the eager forward made where it made them, and their
gradients raise where a second backward reaches them; any others (tracing, fake tensors, a mode
watching) go through the registered backward op, which ``torch.compile`` traces.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from attncomp.torch.eager import skips_dispatcher
from attncomp.torch.plan import Plan, argument_gradients
from attncomp.torch.tensors import copy_to_save, numpy_views, wrap

if TYPE_CHECKING:
    import torch

    from attncomp.torch.op import TorchFunction

NO_SECOND_DERIVATIVE = "attncomp ops have no second derivative: their gradients come from the compiled backward"


def run_saving(plan: Plan, tensors: Sequence[torch.Tensor]) -> tuple[list, tuple, list | None]:
    """The saving forward on ``tensors``: the op's outputs (each distinct value once), the inputs to
    save, and the host arrays the backward may read as they are (else None).

    On the host a strided tensor is copied once, and the copy is both run on and saved; an expanded
    one (a zero stride) is saved as the view, whose copy would hold more than it.
    """
    torch, slots = plan.torch, plan.op.slots
    if not plan.host:
        return plan.run(plan.forward, tensors, slots.first, plan.forward_bf16), tuple(tensors), None
    saved = tuple([t if t.is_contiguous() else copy_to_save(t) for t in tensors])
    bf16 = plan.forward_bf16
    arrays = numpy_views(torch, saved, bf16)
    kept = plan.run_arrays(plan.forward, arrays, slots.first)
    outputs = wrap(torch, kept, bf16)
    # the backward reads these arrays as they are, unless an expanded input's was a copy
    if plan.backward_bf16 == bf16 and all([t.is_contiguous() for t in saved]):
        return outputs, saved, [*arrays, *[kept[slot] for slot in slots.saved_slots]]
    return outputs, saved, None


def save(
    ctx: Any,
    op: TorchFunction,
    plan: Plan | None,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    grad_slots: Sequence[int],
    arrays: list | None = None,
) -> None:
    """Keep what the backward reads: the inputs and the residuals (torch checks at the backward that
    none was modified in place since), and per result which incoming gradient is its cotangent."""
    ctx.save_for_backward(*inputs, *[outputs[slot] for slot in op.slots.saved_slots])
    ctx.op, ctx.plan, ctx.grad_slots, ctx.arrays = op, plan, grad_slots, arrays


def setup_context(op: TorchFunction, ctx: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
    """The registered op's ``setup_context``: its outputs are every distinct value of the saving forward."""
    save(ctx, op, None, inputs, output if isinstance(output, tuple) else (output,), op.slots.result_slots)


def cotangents_of(op: TorchFunction, ctx: Any, inputs: Sequence[torch.Tensor], grads: Sequence[Any]) -> list:
    """One cotangent per result: a result returned twice takes its output's gradient once (zeros in its
    other places); a result whose gradient is None (unused) a zero cotangent, as ``pullback(None)``."""
    slots = ctx.grad_slots
    if len(slots) == 1 and grads[slots[0]] is not None:  # one result (the usual case)
        return [grads[slots[0]]]
    cotangents: list[Any] = []
    seen: set[int] = set()
    results = None
    for k, slot in enumerate(ctx.grad_slots):
        grad = grads[slot] if slot not in seen else None
        seen.add(slot)
        if grad is None:
            if results is None:
                results = op.empty_results(inputs)
            grad = op.torch.zeros_like(results[k])
        cotangents.append(grad)
    return cotangents


def gradients(ctx: Any, grads: Sequence[Any]) -> tuple[torch.Tensor | None, ...]:
    """The backward of both paths: one gradient per argument (None for one not floating)."""
    op: TorchFunction = ctx.op
    torch = op.torch
    saved = ctx.saved_tensors  # torch's check that nothing saved was modified in place since
    inputs, residuals = saved[: op.n_args], saved[op.n_args :]
    cotangents = cotangents_of(op, ctx, inputs, grads)
    tensors = (*inputs, *residuals, *cotangents)
    plan = ctx.plan  # an eager forward's: what it saved are plain tensors on the device, as it took them
    without = unwanted(op, ctx)
    if not skips_dispatcher(torch, tensors if plan is None else cotangents, op.device_type):
        # traced, fake, or watched: the registered op, without the gradients nobody wants
        floating = [f and name not in without for f, name in zip(op.floating, op.arg_names)]
        if not any(floating):
            return tuple(None for _ in inputs)
        out = op.backward_op_without(without)(*tensors)
        return tuple(argument_gradients(inputs, floating, out if isinstance(out, tuple) else (out,)))
    if plan is None:
        plan = op.plan_of(inputs).saving(inputs)
    if not torch.is_grad_enabled():
        return tuple(run_backward(plan, ctx.arrays, tensors, without))
    with torch.no_grad():  # create_graph: the gradients are not differentiable again
        out = run_backward(plan, ctx.arrays, tensors, without)
    return not_differentiable(torch, out)


def unwanted(op: TorchFunction, ctx: Any) -> tuple[str, ...]:
    """The floating arguments, by name, whose tensors need no gradient in this backward (a mask added
    to the scores): the backward run without them neither computes nor returns theirs."""
    needs = getattr(ctx, "needs_input_grad", None)
    if needs is None:
        return ()
    needs = needs[len(needs) - op.n_args :]  # an eager call's Function also takes the plan, first
    return tuple(name for name, f, need in zip(op.arg_names, op.floating, needs) if f and not need)


def run_backward(plan: Plan, arrays: list | None, tensors: tuple[torch.Tensor, ...], without: tuple = ()) -> list:
    """The compiled backward on the arguments, residuals and cotangents (``tensors``), reading the eager
    forward's host ``arrays`` of the first two where it kept them; one gradient per argument (None for
    the floating arguments ``without``, whose gradients the backward it runs does not compute)."""
    inputs = tensors[: len(plan.dtypes)]
    backward, bf16 = plan.backward_without(without)
    if arrays is None:
        out = plan.run(backward, tensors, None, bf16)
    else:  # the forward's numpy views of what was saved, not converted again
        torch = plan.torch
        cotangents = tensors[len(arrays) :]
        out = wrap(torch, plan.run_arrays(backward, [*arrays, *numpy_views(torch, cotangents, bf16)], None), bf16)
    return plan.gradients(inputs, out, without)


@functools.cache
def eager_function(torch: Any) -> type:
    """The ``autograd.Function`` of eager calls that want gradients: ``apply(plan, *tensors)`` gives the
    results, each distinct value once (``Slots.outputs``)."""

    class EagerAutograd(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, plan: Plan, *tensors: torch.Tensor) -> Any:
            outputs, saved, arrays = run_saving(plan.saving(tensors), tensors)
            slots = plan.op.slots
            save(ctx, plan.op, plan, saved, outputs, slots.result_positions, arrays)
            if len(slots.outputs) == 1:
                return outputs[slots.outputs[0]]
            return tuple([outputs[slot] for slot in slots.outputs])

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            return (None, *gradients(ctx, grads))

    return EagerAutograd


@functools.cache
def no_second_derivative(torch: Any) -> type:
    """An identity ``autograd.Function`` whose backward raises: what the gradients pass through under
    ``create_graph``."""

    class NoSecondDerivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *gradients: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return gradients

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
            raise RuntimeError(NO_SECOND_DERIVATIVE)

    return NoSecondDerivative


def not_differentiable(torch: Any, gradients: Sequence[Any]) -> tuple:
    """``gradients`` (None where an argument has none), each given a derivative that raises when a
    second backward reaches it: the compiled backward has no derivative of its own.

    Unlike torch's ``once_differentiable``, which does this only when an incoming gradient needs
    one, always: the backward reads the saved inputs, so ``autograd.grad(..., create_graph=True)``
    of a loss whose cotangent needs no gradient (``out.sum()``) would otherwise give gradients that
    silently lack their second-order terms.
    """
    present = []
    for g in gradients:
        if g is not None:
            g = g.detach()
            g.requires_grad = True
            present.append(g)
    if not present:
        return tuple(gradients)
    marked = iter(no_second_derivative(torch).apply(*present))
    return tuple(None if g is None else next(marked) for g in gradients)
