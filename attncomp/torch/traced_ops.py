"""Torch ops compiled while ``torch.compile`` traces a model, and found again in the same trace.

The drop-ins (``attncomp.sdpa``, ``attncomp.flex``, ``attncomp.hf``) compile a spec the first time a
call needs it, inside ``torch.compiler.assume_constant_result`` (at trace time, not in the graph), and
look its op up by the name that call returns.  A trace reads a dict once, when it first meets it, and
does not see what a later ``assume_constant_result`` call adds to it: a model whose layers need two
specs (Gemma 2's sliding and full layers) found the second one missing.  :class:`TracedOps` keeps each
op as an attribute of its own, which a trace reads when the call asks for that name.

What a spec compiles in (a scale, a window, a dropout rate) must be a Python number when the op is
made: :func:`trace_constant` makes one of a number the trace holds as a symbol.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

#: the numbers a trace may hold as symbols (``torch.compile(..., dynamic=True)`` makes a module's float
#: and int attributes symbolic: a layer's ``scaling``, ``sliding_window``, ``attention_dropout``)
NUMBERS = (bool, int, float, torch.SymBool, torch.SymInt, torch.SymFloat)


def trace_constant(value: Any) -> Any:
    """``value``, a number the spec compiles in, as a Python number.  Outside a trace it is ``value``
    itself; where ``torch.compile`` made it a symbol, the trace takes the value it has now and guards
    on it (another value recompiles, as a new constant compiles another op).  Anything else (None, a
    tensor) is returned as it is."""
    return guard_scalar(value) if type(value) in NUMBERS else value


class TracedOps:
    """Compiled ops (or any values) by key, each under a name made from its key (``ops[name]``)."""

    def __init__(self) -> None:
        self._held = types.SimpleNamespace()

    def name(self, key: str, make: Callable[[], Any]) -> str:
        """The name of ``key``'s value, made by ``make()`` the first time the key is asked for."""
        name = "op_" + hashlib.sha1(key.encode()).hexdigest()
        if not hasattr(self._held, name):
            setattr(self._held, name, make())
        return name

    def __getitem__(self, name: str) -> Any:
        return getattr(self._held, name)

    def __len__(self) -> int:
        return len(vars(self._held))

    def values(self) -> list[Any]:
        return list(vars(self._held).values())
