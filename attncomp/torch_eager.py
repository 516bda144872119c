"""Eager calls of ``fn.to_torch()``: the short path past PyTorch's dispatcher (docs/api.md section 6).

A call on plain tensors on the backend's device, outside ``torch.compile`` and with no mode or
transform watching (:func:`eager_dtypes`), computes what the registered custom op computes
without the dispatcher's round trip.  What such calls share for one key of argument dtypes is an
:class:`EagerPlan`, derived (and checked) on the first call with that key: the compilations,
which outputs are results and which are saved for the backward.  A later call converts its
tensors, runs, and wraps the outputs.  The first call with a key of element types and shapes
binds them the checked way; later ones of that key reuse the sizes it bound, so a bad tensor
after good calls (a new key) gets the same error as on the first.

With a gradient wanted, :class:`EagerAutograd` (an ``autograd.Function``) saves what the
registered autograd saves and runs the same compiled backward, on the numpy views of the saved
tensors its forward made.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from attncomp.ir.types import NUMPY_DTYPES

if TYPE_CHECKING:
    import torch

    from attncomp.compilation import Compilation
    from attncomp.torch_op import TorchFunction

BF16 = np.dtype(NUMPY_DTYPES["bf16"])


class EagerPlan:
    """The work eager calls with one key of argument dtypes share, derived on the first of them.

    ``plain``: the forward without residuals; ``forward`` and ``backward``: the saving forward and
    the backward of the float type the dtypes pick, made by :meth:`saving` on the first call that
    wants a gradient (a call that wants none never makes them: a generic spec whose float type
    fuses otherwise than float32 still runs).  Constructing a plan checks each tensor's dtype
    against the spec (the binding's ``TypeError``, naming the argument), so a plan exists only for
    dtypes a call may take.
    """

    def __init__(self, op: TorchFunction, tensors: Sequence[torch.Tensor], dtypes: tuple):
        self.op = op
        self.dtypes = dtypes
        self.plain = op.plain_member(tensors)
        op.check_tensors(self.plain, tensors)
        self.cpu = op.fn.backend != "cuda"
        self.n_args = len(tensors)
        self.first = op.first
        self.result_slots = op.result_slots
        self.saved_slots = op.saved_slots
        self.floating = op.floating
        #: the op's outputs that are results, each once: the eager autograd function's outputs
        self.outputs = sorted(set(op.result_slots))
        #: per result: its position among ``outputs``
        self.result_positions = [self.outputs.index(slot) for slot in op.result_slots]
        #: the results' cotangents are the outputs' gradients as they are (no result is returned twice)
        self.distinct_results = self.result_positions == list(range(len(self.outputs)))
        #: whether bf16 crosses into or out of a compilation (16-bit views): a bf16 tensor (also one
        #: an f32 argument takes, which widens it without loss) or a bf16 argument or result
        self.bf16_in = op.torch.bfloat16 in dtypes
        #: per key of (compilation, element types and shapes) of contiguous arguments: the sizes
        #: they bound and the results' element types
        self.sizes: dict[tuple, tuple[dict[str, int], list[Any]]] = {}
        self.plain_bf16 = self.bf16_in or crosses_bf16(self.plain)
        self.forward: Compilation | None = None
        self.backward: Compilation | None = None
        self.forward_bf16 = self.backward_bf16 = self.plain_gradients = False

    def execute(self, compiled: Compilation, arrays: Sequence[np.ndarray]) -> Sequence[Any]:
        """``compiled``'s outputs on C-contiguous ``arrays`` (:func:`numpy_views` of tensors of this
        plan's dtypes).  The first call with a key of element types and shapes goes the checked way
        (errors name the argument; a first call compiles); later ones reuse the sizes it bound."""
        key = (id(compiled), *[(a.dtype, a.shape) for a in arrays])
        known = self.sizes.get(key)
        if known is None:
            outputs = compiled.run(arrays)
            if compiled.program.runs_host_arrays:
                if len(self.sizes) > 64:
                    self.sizes.clear()
                result_types = [NUMPY_DTYPES[v.type.dtype] for v in compiled.func.results]
                self.sizes[key] = (compiled.binding().bind(arrays)[1], result_types)
            return outputs
        sizes, result_types = known
        outputs = compiled.program.run_bound(arrays, dict(sizes))
        return [np.asarray(o, dtype=t) for o, t in zip(outputs, result_types)]

    def saving(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make the saving forward and the backward (the first call that wants a gradient)."""
        forward, backward = self.op.member(tensors)
        self.forward_bf16 = self.bf16_in or crosses_bf16(forward)
        self.backward_bf16 = self.bf16_in or crosses_bf16(backward)
        #: the backward's results are the gradients as they are: every argument floating, each
        #: gradient of its argument's dtype
        self.plain_gradients = all(self.floating) and [
            np.dtype(NUMPY_DTYPES[v.type.dtype]).name for v in backward.func.results
        ] == [str(d).removeprefix("torch.") for d in self.dtypes]
        self.forward, self.backward = forward, backward

    def run(
        self, compiled: Compilation, tensors: Sequence[torch.Tensor], picked: Sequence[int] | None, bf16: bool
    ) -> list:
        """Run ``compiled`` on ``tensors`` (of this plan's dtypes, on the backend's device); its
        ``picked`` results (all when None) as tensors that alias no input and no other result.
        ``bf16``: whether a bf16 tensor goes in or comes out (read and wrapped as 16-bit views)."""
        if not self.cpu:
            return self.op.run_tensors(compiled, tensors, picked, self.dtypes)
        arrays = numpy_views(self.op.torch, tensors, bf16)
        return wrap(self.op.torch, self.run_arrays(compiled, arrays, picked), bf16)

    def run_arrays(self, compiled: Compilation, arrays: Sequence[np.ndarray], picked: Sequence[int] | None) -> list:
        """:meth:`execute`'s ``picked`` outputs (all when None), each aliasing no input and no other."""
        return owned(picked_outputs(self.execute(compiled, arrays), picked), arrays)

    def call(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The spec's results, no gradient wanted."""
        results = self.run(self.plain, tensors, None, self.plain_bf16)
        return results[0] if len(results) == 1 else tuple(results)

    def cotangents(self, grads: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """One cotangent per result from the gradients of the eager function's outputs: a result
        returned twice takes its output's gradient once, and zeros for its other places."""
        if self.distinct_results:
            return grads
        seen: set[int] = set()
        cotangents = []
        for k in self.result_positions:
            grad = grads[k]
            cotangents.append(grad if k not in seen else grad.new_zeros(grad.shape))
            seen.add(k)
        return cotangents

    def gradients(self, inputs: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> list:
        """The backward's results as one gradient per argument (None for those not floating), in
        each argument's dtype (``inputs``: the arguments, then anything, which is not read)."""
        return list(out) if self.plain_gradients else argument_gradients(inputs, self.floating, out)


def argument_gradients(inputs: Sequence[Any], floating: Sequence[bool], out: Sequence[Any]) -> list:
    """A backward's results (one per floating argument) as one gradient per argument: None for an
    argument not floating, else its gradient in the argument's dtype."""
    results = iter(out)
    grads: list[Any] = []
    for t, is_floating in zip(inputs, floating):
        g = next(results) if is_floating else None
        grads.append(g if g is None or g.dtype == t.dtype else g.to(t.dtype))
    return grads


def run_numpy(
    torch: Any, compiled: Compilation, tensors: Sequence[torch.Tensor], picked: Sequence[int] | None, bf16: bool = True
) -> list:
    """Run ``compiled`` (a backend of host arrays) on CPU ``tensors`` read as numpy views (a strided
    one made contiguous by torch, faster than numpy's copy); its ``picked`` results (all when None)
    as tensors that alias no input and no other result.  ``bf16``: whether a bf16 tensor may go in
    or come out (read and wrapped as 16-bit views); without one the tensors convert in one pass."""
    arrays = numpy_views(torch, tensors, bf16)
    return wrap(torch, owned(picked_outputs(compiled.run(arrays), picked), arrays), bf16)


def numpy_views(torch: Any, tensors: Sequence[torch.Tensor], bf16: bool) -> list[np.ndarray]:
    """CPU ``tensors`` as C-contiguous numpy arrays sharing their memory (a strided one copied by
    torch; bf16 through a 16-bit view when ``bf16``)."""
    if not bf16:  # .numpy() refuses tensors that require grad
        return [(t.detach() if t.requires_grad else t).contiguous().numpy() for t in tensors]
    arrays = []
    for t in tensors:
        if t.requires_grad:
            t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        arrays.append(t.view(torch.int16).numpy().view(BF16) if t.dtype is torch.bfloat16 else t.numpy())
    return arrays


def picked_outputs(outputs: Sequence[Any], picked: Sequence[int] | None) -> Sequence[Any]:
    """The ``picked`` outputs (all when None)."""
    return outputs if picked is None else [outputs[k] for k in picked]


def wrap(torch: Any, arrays: Sequence[np.ndarray], bf16: bool) -> list:
    """Arrays as CPU tensors sharing their memory."""
    if not bf16:
        return [torch.from_numpy(a) for a in arrays]
    return [from_numpy(torch, a) for a in arrays]


def copy_to_save(t: torch.Tensor) -> torch.Tensor:
    """A strided tensor's contiguous copy, to run on and keep for the backward; an expanded one
    (a zero stride: GQA's ``k.expand(...)``) as it is, whose copy would hold more than the view."""
    return t if 0 in t.stride() else t.contiguous()


def crosses_bf16(compiled: Compilation) -> bool:
    """Whether any argument or result of ``compiled`` is bf16 (numpy knows it only as ml_dtypes')."""
    return any(v.type.dtype == "bf16" for v in (*compiled.func.args, *compiled.func.results))


def owned(outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``outputs``, each writable, contiguous and sharing memory with no input and no other output.

    A custom op's outputs must not alias its inputs or each other; a spec that returns an argument
    as it is (or a backward whose gradient is a cotangent) would otherwise hand one buffer out twice.
    """
    kept: list[np.ndarray] = []
    for out in outputs:
        if out.base is None and all(out is not o for o in kept):
            flags = out.flags
            if flags.c_contiguous and flags.writeable:
                kept.append(out)  # a buffer the call allocated: no input or other output is in it
                continue
        shared = any(np.may_share_memory(out, other) for other in (*inputs, *kept))
        if shared or not (out.flags.writeable and out.flags.c_contiguous):
            out = np.array(out, order="C", copy=True)
        kept.append(out)
    return kept


def from_numpy(torch: Any, a: np.ndarray) -> torch.Tensor:
    """A numpy array as a CPU tensor sharing its memory (bfloat16 through a 16-bit view)."""
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


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
    modes = mode_checks()
    if modes is None:
        return None
    function_mode, functorch, dispatch_mode = modes
    if function_mode() or functorch() or dispatch_mode():
        return None
    return tuple([t.dtype for t in tensors])


def any_autocast(torch: Any) -> bool:
    """Whether autocast is on for any device (a cheap first test before asking per device; a torch
    without torch's internal check asks per device every time)."""
    if not _ANY_AUTOCAST:
        _ANY_AUTOCAST.append(getattr(importlib.import_module("torch._C"), "_is_any_autocast_enabled", None))
    check = _ANY_AUTOCAST[0]
    return True if check is None else bool(check())


_ANY_AUTOCAST: list[Any] = []


_MODE_CHECKS: list[Any] = []


def mode_checks() -> tuple[Any, ...] | None:
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
    """The ``autograd.Function`` of eager calls that want gradients (made once torch is imported).

    Its outputs are the op's outputs that are results (each distinct value once); residuals that
    are no result are saved, not returned, so autograd keeps no gradient slot for them.
    """

    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan = ctx.plan
        saved = ctx.saved_tensors  # torch's check that nothing saved was modified in place since
        cotangents = plan.cotangents(grads)
        if ctx.arrays is None:
            out = plan.run(plan.backward, (*saved, *cotangents), None, plan.backward_bf16)
        else:  # the forward's numpy views of what was saved, not converted again
            bf16 = plan.backward_bf16
            arrays = [*ctx.arrays, *numpy_views(torch, cotangents, bf16)]
            out = wrap(torch, plan.run_arrays(plan.backward, arrays, None), bf16)
        return (None, *plan.gradients(saved, out))

    class EagerAutograd(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, plan: EagerPlan, *tensors: torch.Tensor) -> Any:
            if plan.forward is None:
                plan.saving(tensors)
            ctx.plan = plan
            ctx.arrays = None
            if plan.cpu:  # a strided tensor copied once, and the backward reads the copy
                saved = tuple([t if t.is_contiguous() else copy_to_save(t) for t in tensors])
                bf16 = plan.forward_bf16
                arrays = numpy_views(torch, saved, bf16)
                kept = plan.run_arrays(plan.forward, arrays, plan.first)
                outputs = wrap(torch, kept, bf16)
                # the backward reads these arrays as they are, unless an expanded input's was a copy
                # (saved as the view, its copy made again: a copy kept would hold more than the view)
                if plan.backward_bf16 == bf16 and all([t.is_contiguous() for t in saved]):
                    ctx.arrays = [*arrays, *[kept[slot] for slot in plan.saved_slots]]
            else:
                saved = tensors
                outputs = plan.run(plan.forward, saved, plan.first, plan.forward_bf16)
            ctx.save_for_backward(*saved, *[outputs[slot] for slot in plan.saved_slots])
            if len(plan.outputs) == 1:
                return outputs[plan.outputs[0]]
            return tuple([outputs[slot] for slot in plan.outputs])

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            if torch.is_grad_enabled():  # create_graph: the gradients are not differentiable again
                with torch.no_grad():
                    return not_differentiable(torch, backward(ctx, *grads))
            return backward(ctx, *grads)

    return EagerAutograd


def not_differentiable(torch: Any, gradients: tuple) -> tuple:
    """``gradients`` (None where an argument has none), each given a derivative that raises when
    a second backward reaches it: the compiled backward has no derivative of its own.

    Unlike torch's ``once_differentiable``, which does this only when an incoming gradient needs
    one, always: the backward reads the saved inputs, so ``autograd.grad(..., create_graph=True)``
    of a loss whose cotangent needs no gradient (``out.sum()``) would otherwise give gradients that
    silently lack their second-order terms.  Without torch's ``DelayedError`` (an internal, looked
    up by name), the backward raises at once.
    """
    functions = getattr(importlib.import_module("torch._C"), "_functions", None)
    delayed = getattr(functions, "DelayedError", None)
    message = "attncomp ops have no second derivative: their gradients come from the compiled backward"
    if delayed is None:
        raise RuntimeError(f"{message} (a backward with create_graph=True)")
    error = delayed(message.encode(), len(gradients))
    fake = []
    for g in gradients:
        if g is not None:
            g = g.detach()
            g.requires_grad = True
        fake.append(g)
    out = error(*fake)
    return out if isinstance(out, tuple) else (out,)


class EagerAutograd:
    """``apply(plan, *tensors)`` of the eager ``autograd.Function``, defined on first use (torch
    is optional): the results, each distinct value once (``EagerPlan.outputs``)."""

    function: type | None = None

    @classmethod
    def apply(cls, *args: Any) -> Any:
        if cls.function is None:
            cls.function = _eager_autograd(importlib.import_module("torch"))
        return cls.function.apply(*args)
