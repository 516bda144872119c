"""Calls from a kernel into the shared tile code without a copy of it in the kernel's module.

Numba links every ``@njit`` function a kernel calls into the kernel's LLVM module, where LLVM
optimises it and emits its machine code again: in a forward task, the few-row helpers
(``tile_math.group_scores`` and ``group_values``) and the two softmax steps were 55% of the
module's instructions, compiled anew by every kernel (about 0.4 s of a 3.8 s module).  Called
through :func:`unlinked`, a helper is compiled once a process for each signature (and cached on
disk, as before); the kernel's module only declares it, under a name of attncomp's own, and the
JIT resolves the declaration to that compiled code, as it resolves Numba's runtime functions.

A kernel loaded from Numba's cache in a new process has not typed its calls, so nothing would
compile the helpers it declares: each call registers, with the library being lowered, a
function Numba runs before it loads the kernel's cached code (``reload_init``, as Numba does
for its parallel runtime), and that function compiles (or loads) the helper for the signature
the call was typed with and gives the JIT its address.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from typing import Any

from llvmlite import binding as llvm
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from attncomp.backends.numba_cpu import launch as launches
from attncomp.backends.numba_cpu import tile_math


def symbol_name(module: str, name: str, args: tuple) -> str:
    """The name a kernel calls helper ``module.name`` for argument types ``args`` by: the same in
    every process (Numba's own names for a compiled function number its versions in the order a
    process compiled them, so a kernel and a helper cached by two processes could disagree)."""
    digest = hashlib.sha256(repr(tuple(args)).encode()).hexdigest()[:20]
    return f"attncomp.shared.{module}.{name}.{digest}"


def provide(module: str, name: str, args: tuple) -> str:
    """Compile (or load from the cache) helper ``module.name`` for the argument types ``args`` and
    give the JIT its entry point (Numba's calling convention) under :func:`symbol_name`."""
    dispatcher = getattr(importlib.import_module(module), name)
    compiled = dispatcher.overloads.get(args)
    if compiled is None:
        dispatcher.compile(args)
        compiled = dispatcher.overloads[args]
    symbol = symbol_name(module, name, args)
    llvm.add_symbol(symbol, compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name))
    return symbol


def unlinked(dispatcher: Any) -> Any:
    """An intrinsic calling ``dispatcher`` (an ``@njit`` function of a module, compiled for the
    arguments' types as a call of it would be) without linking its code into the caller."""
    module, name = dispatcher.py_func.__module__, dispatcher.py_func.__name__

    @intrinsic
    def call(typingctx, *args):
        if len(args) == 1 and isinstance(args[0], types.StarArgTuple):
            args = tuple(args[0].types)
        found = typingctx.resolve_function_type(types.Dispatcher(dispatcher), tuple(args), {})
        if found is None:
            raise TypingError(f"{name} cannot be called with {tuple(args)}")
        target = found.args

        def codegen(context, builder, signature, llargs):
            symbol = provide(module, name, target)
            context.active_code_library._reload_init.add(functools.partial(provide, module, name, target))
            values = cgutils.unpack_tuple(builder, llargs[0], len(target))
            values = [context.cast(builder, v, a, t) for v, a, t in zip(values, args, target)]
            fnty = context.call_conv.get_function_type(found.return_type, target)
            callee = cgutils.get_or_insert_function(builder.module, fnty, symbol)
            status, result = context.call_conv.call_function(builder, callee, found.return_type, target, values)
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            return result

        return found.return_type(types.StarArgTuple.from_types(tuple(args))), codegen

    call.__name__ = name
    return call


dequantize_rows = unlinked(tile_math.dequantize_rows)
group_scores = unlinked(tile_math.group_scores)
group_values = unlinked(tile_math.group_values)
launch = unlinked(launches.launch)
query_bits = unlinked(tile_math.query_bits)
scale_keys = unlinked(tile_math.scale_keys)
softmax_by_keys = unlinked(tile_math.softmax_by_keys)
softmax_by_rows = unlinked(tile_math.softmax_by_rows)
transpose_into = unlinked(tile_math.transpose_into)
