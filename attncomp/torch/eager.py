"""When a call of ``fn.to_torch()`` may skip PyTorch's dispatcher, and what autocast makes of its tensors.

A call on plain tensors (or ``nn.Parameter``s) on the device the program reads
(``Program.device_type``), outside ``torch.compile``, with no torch function mode, functorch
transform or dispatch mode active, computes what the registered custom op computes without the
dispatcher's round trip (:func:`skips_dispatcher`).  Anything else (meta or fake tensors, tracing,
``vmap``, a mode that watches ops, a tensor on another device, which the op's checks name) goes
through the registered op, so every mode and transform sees it.

Two of these checks have no public spelling in torch and read torch's internal names
(docs/architecture.md, "Private torch names"): :func:`mode_checks` looks them up by name, once,
so that a torch without them only loses the eager path.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from attncomp.torch.tensors import is_host_scalar

#: torch's internal checks, by module and name: whether a functorch transform (``vmap``, ``grad``,
#: ``functionalize``) is active, and the innermost dispatch mode (None when none is)
PRIVATE_CHECKS = (
    ("torch._C", "_are_functorch_transforms_active"),
    ("torch.utils._python_dispatch", "_get_current_dispatch_mode"),
)

_MODE_CHECKS: list[Any] = []


def mode_checks() -> tuple[Any, Any] | None:
    """The functions of :data:`PRIVATE_CHECKS` (None: this torch lacks one, and calls always dispatch)."""
    if not _MODE_CHECKS:
        try:
            functorch, dispatch_mode = (getattr(importlib.import_module(m), name) for m, name in PRIVATE_CHECKS)
            _MODE_CHECKS.append((functorch, dispatch_mode))
        except (AttributeError, ImportError):
            _MODE_CHECKS.append(None)
    return _MODE_CHECKS[0]


def skips_dispatcher(torch: Any, tensors: Sequence[Any], device_type: str) -> bool:
    """Whether a call on ``tensors`` may skip the dispatcher: plain tensors on ``device_type`` (the
    program's), outside ``torch.compile``, with no torch function mode
    (``torch.overrides.has_torch_function``), functorch transform or dispatch mode active."""
    if torch.compiler.is_compiling():
        return False
    plain = (torch.Tensor, torch.nn.Parameter)  # a parameter is a tensor whose torch functions are a tensor's
    cpu = device_type == "cpu"
    for t in tensors:  # on the device, or a CPU scalar (0-d), which a device call takes by value
        if type(t) not in plain or not (t.is_cpu if cpu else t.device.type == device_type or is_host_scalar(t)):
            return False
    if torch.overrides.has_torch_function(tensors):
        return False
    checks = mode_checks()
    if checks is None:
        return False
    functorch, dispatch_mode = checks
    return not functorch() and dispatch_mode() is None


def eager_dtypes(torch: Any, tensors: Sequence[Any], device_type: str) -> tuple | None:
    """The tensors' dtypes where a call may skip the dispatcher (:func:`skips_dispatcher`), else None."""
    if not skips_dispatcher(torch, tensors, device_type):
        return None
    return tuple([t.dtype for t in tensors])


def autocast(torch: Any, tensors: tuple[Any, ...], generic_args: set[int], device_type: str) -> tuple[Any, ...]:
    """Under ``torch.autocast`` on the program's device a generic spec runs in the autocast type: its
    ``ac.floating`` arguments (``generic_args``) are cast to it.  A spec of declared types keeps
    them (as PyTorch's float32 ops do)."""
    if not generic_args or not tensors or tensors[0].device.type != device_type:
        return tensors
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if k in generic_args and t.is_floating_point() else t for k, t in enumerate(tensors))
