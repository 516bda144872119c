"""Reductions that take their elementwise neighbours inline: one kernel, no intermediate buffers.

An ``ac.reduce`` whose operand is computed by elementwise ops (casts, products, differences) used
nowhere else computes that operand per element inside its loop over the reduced axes: its
*producers*.  Elementwise ops that only transform its result (``x - y`` with ``x`` the sum, then
``- z``...), each the one user of the value before it, are computed per output element after the
loop: its *epilogue*, with the elementwise ops computing the epilogue's other operands that are used
nowhere else.  A reshape that only inserts or removes axes of size 1 counts as elementwise (the
same element, its index with or without the size-1 axes).  The backward's
``delta = rowsum(cast(d_out) * cast(out)) - reshape(cast(d_lse))`` is then one kernel reading
``d_out``, ``out`` and ``d_lse`` as it receives them (f16 as stored; bf16 ones as their 16-bit
patterns where the device keeps them so, ``choice.tensor_core_types``; a transposed view of an
argument indexed where it lies, ``host/views.py``), summing in float32, where it was one kernel per
op with a buffer between each.  Values stay in their compute type (float32 for 16-bit floats) between fused
ops, as in the attention kernels.

:func:`plan_fused_reductions` decides what fuses; ``reduction_kernels.reduce_kernel`` writes the
kernel; the driver launches it where the last fused op stood and skips the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attncomp.backends.numba_cuda.host.map_kernels import ELEMENTWISE
from attncomp.ir.core import Func, Op, Value
from attncomp.ir.graph import users

#: elementwise ops computed from their operands alone (no index checks, no iteration index)
INLINE = ELEMENTWISE - {"ac.gather", "ac.iota", "ac.constant"}


@dataclass
class FusedReduction:
    """An ``ac.reduce`` with the elementwise ops it computes inline."""

    reduce: Op
    #: computed per element of the reduced operand, in program order
    producers: list[Op] = field(default_factory=list)
    #: computed per output element from the reduced value, in program order
    epilogue: list[Op] = field(default_factory=list)
    #: computed per output element for the epilogue's other operands, in program order
    epilogue_producers: list[Op] = field(default_factory=list)

    @property
    def out(self) -> Value:
        """The value the kernel writes: the last epilogue op's, else the reduction's."""
        return (self.epilogue[-1] if self.epilogue else self.reduce).results[0]

    @property
    def last(self) -> Op:
        """The op where the kernel is launched: every operand of every fused op is ready there."""
        return self.epilogue[-1] if self.epilogue else self.reduce

    @property
    def absorbed(self) -> list[Op]:
        """The fused ops other than the reduction (the driver launches nothing for them)."""
        return self.producers + self.epilogue_producers + self.epilogue

    def leaves(self) -> list[Value]:
        """The producers' operands computed outside the kernel (arrays it reads, host scalars)."""
        return _leaves(self.producers, [self.reduce.operands[0]])

    def epilogue_leaves(self) -> list[Value]:
        """The epilogue's operands computed outside the kernel."""
        chain = [self.reduce, *self.epilogue]
        made = {o.results[0] for o in chain}
        outside = [v for e in self.epilogue for v in e.operands if v not in made]
        return _leaves(self.epilogue_producers, outside)


def _leaves(producers: list[Op], roots: list[Value]) -> list[Value]:
    """The operands of ``producers`` (or ``roots`` themselves) that none of them makes."""
    made = {p.results[0] for p in producers}
    found = [v for v in roots if v not in made] + [v for p in producers for v in p.operands if v not in made]
    return list(dict.fromkeys(found))


def _gather_producers(roots: list[Value], table: dict[Value, list[Op]], inside: set[Op], claimed: set[Op]) -> list[Op]:
    """The elementwise ops computing ``roots`` whose every result is used only by ``inside`` ops or by
    other such producers, and that no other reduction computes (``claimed``): computed inline, element
    by element."""
    found: list[Op] = []
    pending = list(roots)
    while pending:
        value = pending.pop()
        producer = value.owner if isinstance(value.owner, Op) else None
        if not _device_elementwise(producer) or producer in found or producer in claimed:
            continue
        consumers = table.get(value, [])
        if len(consumers) != 1 or not (consumers[0] in inside or consumers[0] in found):
            continue
        found.append(producer)
        pending.extend(producer.operands)
    return found


def _only_user(value: Value, table: dict[Value, list[Op]]) -> Op | None:
    found = table.get(value, [])
    return found[0] if len(found) == 1 else None


def _unit(d) -> bool:
    return d.is_const and d.value == 1


def unit_reshape(op: Op) -> bool:
    """Whether ``op`` is an ``ac.reshape`` that only inserts or removes axes of size 1: element
    ``i`` of its result is element ``i`` of its operand, the size-1 axes' indices dropped or added."""
    if op.name != "ac.reshape" or op.operands[0].type.rank == 0:
        return False
    kept = [[d for d in v.type.shape if not _unit(d)] for v in (op.operands[0], op.results[0])]
    return kept[0] == kept[1]


def source_index(op: Op, index: list[str]) -> list[str]:
    """The operand's index of element ``index`` of a unit reshape's result."""
    inner = iter(i for i, d in zip(index, op.results[0].type.shape) if not _unit(d))
    return ["0" if _unit(d) else next(inner) for d in op.operands[0].type.shape]


def _device_elementwise(op: Op | None) -> bool:
    inline = op is not None and (op.name in INLINE or unit_reshape(op))
    return inline and len(op.results) == 1 and op.results[0].type.rank > 0


def plan_fused_reductions(func: Func) -> dict[Op, FusedReduction]:
    """For each top-level ``ac.reduce`` over a device array: what it computes inline.

    A producer is an elementwise op whose one result has the reduction (or another producer) as its
    only user; an epilogue op is the only user of the reduced value (or of the epilogue op before
    it), elementwise, and of the same shape, so that each output element is computed once."""
    block = func.body
    table = users(block)
    position = {op: n for n, op in enumerate(block.ops)}
    fused: dict[Op, FusedReduction] = {}
    claimed: set[Op] = set()  # ops an earlier reduction computes: one kernel each
    for op in block.ops:
        if op.name != "ac.reduce" or op.operands[0].type.rank == 0:
            continue

        plan = FusedReduction(op)
        plan.producers = sorted(_gather_producers([op.operands[0]], table, {op}, claimed), key=position.__getitem__)
        current = op.results[0]
        while True:
            consumer = _only_user(current, table)
            if not _device_elementwise(consumer) or consumer.results[0].type.shape != current.type.shape:
                break
            if consumer in claimed:
                break
            plan.epilogue.append(consumer)
            current = consumer.results[0]
        inside = set(plan.epilogue)
        others = [v for e in plan.epilogue for v in e.operands if v is not op.results[0] and v.owner not in inside]
        plan.epilogue_producers = sorted(_gather_producers(others, table, inside, claimed), key=position.__getitem__)
        claimed.update(plan.absorbed)
        fused[op] = plan
    return fused
