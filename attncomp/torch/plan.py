"""What the calls of one ``fn.to_torch()`` op share: where each output goes (:class:`Slots`), and per key
of argument dtypes the compilations and how tensors cross into them (:class:`Plan`).

A plan is derived, and its dtypes checked against the spec (the binding's ``TypeError``, naming the
argument), on the first call with its key; the op keeps its plans in one cache
(``TorchFunction.plans``), which the registered op, its fake functions, its autograd and the eager
calls all read.  Argument sizes are bound by the compilation's own binder (``Compilation.run``):
the first call with a key of element types and shapes binds them the checked way, later ones by
the key alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from attncomp.gradients import backward_of, saving_forward_of
from attncomp.ir.types import NUMPY_DTYPES
from attncomp.torch.tensors import (
    check_dtypes,
    crosses_bf16,
    numpy_views,
    owned,
    run_in_place,
    torch_dtype,
    wrap,
)

if TYPE_CHECKING:
    import torch

    from attncomp.compilation import Compilation
    from attncomp.torch.op import TorchFunction


@dataclass(frozen=True)
class Slots:
    """Where each value of the saving forward goes.

    The registered forward op returns each distinct IR value the saving forward returns once (the
    spec's results, then the residuals the backward reads), so that a result that is also a
    residual (the attention's output) is one tensor, not two aliasing ones.  The eager
    ``autograd.Function`` returns only the outputs that are results, each once: the residuals are
    saved, not returned, so autograd keeps no gradient slot for them.
    """

    #: per result: its output of the op
    result_slots: tuple[int, ...]
    #: per residual the backward reads: its output of the op
    saved_slots: tuple[int, ...]
    #: per output of the op: its position among the saving forward's results
    first: tuple[int, ...]
    #: the op's outputs that are results, each once: the eager function's outputs
    outputs: tuple[int, ...]
    #: per result: its position among ``outputs``
    result_positions: tuple[int, ...]

    @classmethod
    def of(cls, forward: Compilation, n_results: int) -> Slots:
        """The slots of ``forward`` (a saving forward) whose first ``n_results`` results are the spec's."""
        values = list(forward.func.results)
        distinct = list(dict.fromkeys(values))
        slots = [distinct.index(v) for v in values]
        outputs = sorted(set(slots[:n_results]))
        return cls(
            result_slots=tuple(slots[:n_results]),
            saved_slots=tuple(slots[n_results:]),
            first=tuple(slots.index(k) for k in range(len(distinct))),
            outputs=tuple(outputs),
            result_positions=tuple(outputs.index(slot) for slot in slots[:n_results]),
        )


class Plan:
    """The work calls with one key of argument dtypes share, derived on the first of them.

    ``plain``: the forward without residuals, for the float type the dtypes pick (a generic spec's
    member); ``forward`` and ``backward``: the saving forward and the backward, made by
    :meth:`saving` on the first call that needs them (a call that wants no gradient never makes
    them: a generic spec whose float type fuses otherwise than float32 still runs).  Constructing a
    plan checks each tensor's dtype against the spec, so a plan exists only for dtypes a call may take.
    """

    def __init__(self, op: TorchFunction, tensors: Sequence[torch.Tensor], dtypes: tuple):
        self.op = op
        self.torch = op.torch
        self.dtypes = dtypes
        self.plain = op.fn.for_args(tensors).compilation if op.generic_args else op.fn.compilation
        check_dtypes(self.plain, tensors)
        #: whether the program reads host memory (CPU tensors as numpy views), else a device's in place
        self.host = self.plain.program.device_type == "cpu"
        #: whether bf16 crosses into or out of a compilation (16-bit views): a bf16 tensor (also one
        #: an f32 argument takes, which widens it without loss) or a bf16 argument or result
        self.bf16_in = self.torch.bfloat16 in dtypes
        self.plain_bf16 = self.bf16_in or crosses_bf16(self.plain)
        self.forward: Compilation | None = None
        self.backward: Compilation | None = None
        self.forward_bf16 = self.backward_bf16 = self.plain_gradients = False
        #: the dtypes the backward op's tensors have when autograd calls it: these arguments', then
        #: the residuals' and the cotangents' (others, from a hand-made call, are checked first)
        self.backward_dtypes: tuple = ()
        #: backwards without some arguments' gradients (:meth:`backward_without`), by their names
        self.partial: dict[tuple[str, ...], tuple[Compilation, bool]] = {}

    def saving(self, tensors: Sequence[torch.Tensor]) -> Plan:
        """Make the saving forward and the backward, once (the first call that needs them); a spec
        without a gradient (``TorchFunction.no_gradient``) has the saving forward alone."""
        if self.forward is not None:
            return self
        forward = saving_forward_of(self.plain)
        layout = [str(v.type.shape) for v in dict.fromkeys(forward.func.results)]
        if layout != self.op.layout:
            c = self.plain
            raise TypeError(
                f"@{c.name} does not fuse in {c.func.args[0].type.dtype} as in float32, so one op cannot "
                f"serve both: {'; '.join(forward.remarks) or 'its residuals differ'}"
            )
        self.forward_bf16 = self.bf16_in or crosses_bf16(forward)
        if self.op.no_gradient is not None:
            self.forward = forward
            return self
        backward = backward_of(self.plain)
        self.backward_bf16 = self.bf16_in or crosses_bf16(backward)
        #: the backward's results are the gradients as they are: every argument floating, each
        #: gradient of its argument's dtype
        self.plain_gradients = all(self.op.floating) and [
            np.dtype(NUMPY_DTYPES[v.type.dtype]).name for v in backward.func.results
        ] == [str(d).removeprefix("torch.") for d in self.dtypes]
        rest = backward.func.args[len(self.dtypes) :]
        self.backward_dtypes = (*self.dtypes, *[torch_dtype(self.torch, a.type.dtype) for a in rest])
        self.forward, self.backward = forward, backward
        return self

    def backward_without(self, names: tuple[str, ...]) -> tuple[Compilation, bool]:
        """The backward that neither computes nor returns the gradients of the floating arguments
        ``names`` (a call where they need none; none: the whole backward), and whether bf16 crosses
        it; made on first use."""
        if not names:
            return self.backward, self.backward_bf16
        if names not in self.partial:
            backward = backward_of(self.plain, names)
            self.partial[names] = (backward, self.bf16_in or crosses_bf16(backward))
        return self.partial[names]

    # running ---------------------------------------------------------------------------------------
    def run_arrays(self, compiled: Compilation, arrays: Sequence[np.ndarray], picked: Sequence[int] | None) -> list:
        """``compiled``'s ``picked`` outputs (all when None) on host ``arrays`` (:func:`numpy_views` of
        tensors of this plan's dtypes), each aliasing no input and no other.  The compilation's binder
        binds them (the checked way for a key not seen before: errors name the argument)."""
        outputs = compiled.run_contiguous(arrays)
        return owned(outputs if picked is None else [outputs[k] for k in picked], arrays)

    def run(
        self, compiled: Compilation, tensors: Sequence[torch.Tensor], picked: Sequence[int] | None, bf16: bool
    ) -> list:
        """Run ``compiled`` on ``tensors`` (of this plan's dtypes, where the program reads them); its
        ``picked`` results (all when None) as tensors that alias no input and no other result.
        ``bf16``: whether a bf16 tensor goes in or comes out (read and wrapped as 16-bit views)."""
        torch = self.torch
        if not self.host:
            outputs = run_in_place(torch, compiled, tensors)
            return outputs if picked is None else [outputs[k] for k in picked]
        arrays = numpy_views(torch, tensors, bf16)
        return wrap(torch, self.run_arrays(compiled, arrays, picked), bf16)

    def call(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The spec's results, no gradient wanted: one tensor, or a tuple."""
        results = self.run(self.plain, tensors, None, self.plain_bf16)
        return results[0] if len(results) == 1 else tuple(results)

    def gradients(
        self, inputs: Sequence[torch.Tensor], out: Sequence[torch.Tensor], without: tuple[str, ...] = ()
    ) -> list:
        """The backward's results as one gradient per argument (None for those not floating and
        those ``without``), in each argument's dtype."""
        if without:
            floating = [f and name not in without for f, name in zip(self.op.floating, self.op.arg_names)]
            return argument_gradients(inputs, floating, out)
        return list(out) if self.plain_gradients else argument_gradients(inputs, self.op.floating, out)


def argument_gradients(inputs: Sequence[Any], floating: Sequence[bool], out: Sequence[Any]) -> list:
    """A backward's results (one per floating argument) as one gradient per argument: None for an
    argument not floating, else its gradient in the argument's dtype."""
    results = iter(out)
    grads: list[Any] = []
    for t, is_floating in zip(inputs, floating):
        g = next(results) if is_floating else None
        grads.append(g if g is None or g.dtype == t.dtype else g.to(t.dtype))
    return grads
