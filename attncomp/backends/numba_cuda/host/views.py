"""Transposes that cost nothing: arrays the kernels read, and results they write, through a view.

FlashAttention's ``[B, T, H, D]`` tensors reach a spec as ``x.transpose(0, 2, 1, 3)``: the kernels read
the argument through a transposed view (:func:`transposes_in_place`), the forward writes its output
into the function's ``[B, T, H, D]`` result through one (:func:`outputs_in_place`), and a float32
transpose the function returns as bf16 is rounded as it is copied (:func:`rounded_transposes`).
"""

from __future__ import annotations

from attncomp.ir.core import Func, Op, Value


def _readers(func: Func) -> dict[Value, list[Op]]:
    readers: dict[Value, list[Op]] = {}
    for op in func.body.walk():
        for value in op.operands:
            readers.setdefault(value, []).append(op)
    return readers


def transposes_in_place(func: Func) -> set[Value]:
    """The ``ac.transpose`` results kernels read through a view of the argument transposed, nothing
    copied: an argument's axes permuted with its last axis kept last (FlashAttention's ``[B, T, H, D]``
    read as ``[B, H, T, D]``: a head's rows a pitch apart, each row contiguous), read by tile loads
    (the asynchronous copies step by the rows' pitch, ``arrays.pitched_rows``; the staged kernels
    index any layout) and fused reductions (``host/fused_reductions.py``: the backward's ``delta =
    rowsum(d_out * out)`` indexes the view) alone.  Any other transpose is a copy the device makes."""
    from attncomp.backends.numba_cuda.host.fused_reductions import plan_fused_reductions

    readers = _readers(func)
    fused = {id(o) for f in plan_fused_reductions(func).values() for o in [f.reduce, *f.absorbed]}
    found = set()
    for op in func.body.ops:
        if op.name != "ac.transpose" or op.operands[0] not in func.args:
            continue
        value, perm = op.results[0], list(op.attrs["perm"])
        users = readers.get(value, [])
        in_place = all((u.name == "ac.tile_load" and u.operands[0] is value) or id(u) in fused for u in users)
        if users and perm[-1] == len(perm) - 1 and in_place:
            found.add(value)
    return found


def outputs_in_place(func: Func) -> dict[Value, Op]:
    """Per ``ac.tile_grid`` output written through a transposed view of the function's result: the
    output whose one reader is an ``ac.transpose`` keeping the last axis last, whose result the
    function returns and nothing else reads (FlashAttention's ``[B, T, H, D]`` output, computed as
    ``[B, H, T, D]``): the output -> that transpose.  The driver allocates the result and hands the
    kernel the view; nothing is transposed after it."""
    readers = _readers(func)
    ret = func.body.ops[-1]
    found = {}
    for op in func.body.ops:
        if op.name != "ac.tile_grid":
            continue
        users = readers.get(op.results[0], [])
        if len(users) != 1 or users[0].name != "ac.transpose" or users[0].operands[0] is not op.results[0]:
            continue
        transpose = users[0]
        perm = list(transpose.attrs["perm"])
        returned = readers.get(transpose.results[0], [])
        if perm[-1] == len(perm) - 1 and returned == [ret] and ret.operands.count(transpose.results[0]) == 1:
            found[op.results[0]] = transpose
    return found


def rounded_transposes(func: Func, narrowed: tuple[bool, ...]) -> set[Value]:
    """The float32 ``ac.transpose`` results the function returns, once, as bf16 (``narrowed``: per
    result, whether it is declared bf16) and nothing else reads, but those an attention kernel writes
    in place (:func:`outputs_in_place`): FlashAttention's layout's gradients, transposed from the
    backward's float32 sums and rounded in the same pass."""
    readers, ret = _readers(func), func.body.ops[-1]
    written = {t.results[0] for t in outputs_in_place(func).values()}
    found = set()
    for value, narrow in zip(ret.operands, narrowed):
        owner = getattr(value.owner, "name", None)
        alone = readers.get(value) == [ret] and ret.operands.count(value) == 1
        if narrow and owner == "ac.transpose" and value.type.dtype == "f32" and alone and value not in written:
            found.add(value)
    return found
