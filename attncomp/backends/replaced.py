"""The Numba functions attncomp replaces (``front_end.py``), each replaced once, the one it
replaced kept: the replacement runs it outside attncomp's compile window, and the tests compare
the two."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

#: what each replaced attribute held, by (owner, attribute)
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def replace(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Set ``owner.name`` (a module's function, a class's method) to ``make(what it holds)``, once:
    a second call changes nothing."""
    if (owner, name) in _ORIGINALS:
        return
    current = getattr(owner, name)
    _ORIGINALS[owner, name] = current
    setattr(owner, name, make(current))


def original(owner: Any, name: str) -> Any:
    """What :func:`replace` replaced in ``owner.name`` (None if it did not)."""
    return _ORIGINALS.get((owner, name))


def module(name: str) -> Any:
    """The module ``name`` if it is imported, else None (asking for an original imports nothing)."""
    return sys.modules.get(name)
