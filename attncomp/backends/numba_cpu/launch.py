"""The parallel launch every kernel shares, and the argument pack its tasks read.

A kernel's driver used to run its tasks in a ``prange`` of its own: Numba's parallel lowering
outlined that loop into a gufunc and compiled it with the driver, about 0.35 s of every kernel
module (a driver without it compiles in 0.2 s).  The tasks now all have one signature,
:data:`TASK` (the worker, the number of workers, whether it merges split units' parts, and the
address of the rest of their arguments), so one parallel function, :func:`launch`, compiled
once a process, runs any kernel's tasks.

The rest of a task's arguments travel as a tuple the driver stores on its stack
(:func:`pack_address`) and each task loads (:func:`unpack`).  The driver holds the arrays for
the whole launch (:func:`keep_alive` after the last call), and the tasks take a reference of
their own to what they load, which Numba gives back when they return.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from attncomp.backends.numba_cpu.intrinsics import task_caller

#: every task: ``task(worker, n_workers, merging, pack_at)``
TASK = types.void(types.int64, types.int64, types.int64, types.intp)
call_task = task_caller(TASK)


@njit(parallel=True, cache=True, nogil=True)
def launch(task_at, n_workers, pack_at):
    """Run the task at ``task_at`` as workers ``0 .. n_workers - 1`` on Numba's threads."""
    for worker in prange(n_workers):
        # np.int64: prange's index is unsigned in Numba's lowering, the task takes an int64
        call_task(task_at, np.int64(worker), n_workers, np.int64(0), pack_at)


@intrinsic
def pack_address(typingctx, values, pack_type):
    """The address of a copy of the tuple ``values`` (as ``pack_type``, a tuple type) on the
    caller's stack: valid until the caller returns."""
    target = getattr(pack_type, "instance_type", None)
    if not isinstance(values, types.BaseTuple) or not isinstance(target, types.BaseTuple):
        raise TypingError(f"pack_address takes a tuple and a tuple type, not {values} and {pack_type}")
    if len(values) != len(target):
        raise TypingError(f"a pack of {len(values)} values for {target}")

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], values, target)
        slot = cgutils.alloca_once_value(builder, value)
        return builder.ptrtoint(slot, context.get_value_type(types.intp))

    return types.intp(values, pack_type), codegen


@intrinsic
def unpack(typingctx, address, pack_type):
    """The tuple of type ``pack_type`` stored at ``address`` (:func:`pack_address`), with a
    reference taken to each array in it."""
    target = getattr(pack_type, "instance_type", None)
    if not isinstance(address, types.Integer) or not isinstance(target, types.BaseTuple):
        raise TypingError(f"unpack takes an address and a tuple type, not {address} and {pack_type}")

    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], context.get_value_type(target).as_pointer())
        value = builder.load(pointer)
        context.nrt.incref(builder, target, value)
        return value

    return target(address, pack_type), codegen


@intrinsic
def keep_alive(typingctx, value):
    """Nothing: a use of ``value`` that keeps Numba from releasing it before this point."""

    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return types.void(value), codegen
