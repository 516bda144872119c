"""Torch ops compiled while ``torch.compile`` traces a model, and found again in the same trace.

The drop-ins (``attncomp.sdpa``, ``attncomp.flex``, ``attncomp.hf``) compile a spec the first time a
call needs it, inside ``torch.compiler.assume_constant_result`` (at trace time, not in the graph), and
look its op up by the name that call returns.  A trace reads a dict once, when it first meets it, and
does not see what a later ``assume_constant_result`` call adds to it: a model whose layers need two
specs (Gemma 2's sliding and full layers) found the second one missing.  :class:`TracedOps` keeps each
op as an attribute of its own, which a trace reads when the call asks for that name.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable
from typing import Any


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
