"""Backends: lowering of the final IR to runnable code (see ``base.Program``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from attncomp.backends.cache import stamp_helpers_by_runtime

stamp_helpers_by_runtime()  # before any compiled helper of attncomp.backends is decorated

if TYPE_CHECKING:
    from attncomp.backends.base import Program
    from attncomp.ir.core import Module

#: backend name -> the module whose ``build(module) -> Program`` builds for it (imported on use:
#: numba-cuda is an optional extra); a backend with passes of its own takes their output too,
#: ``build(module, lowered=...)``
BUILDERS = {
    "interp": "attncomp.backends.interp",
    "cpu": "attncomp.backends.numba_cpu",
    "cuda": "attncomp.backends.numba_cuda",
}
BACKENDS = tuple(BUILDERS)


def check_backend(backend: str) -> None:
    """A ``ValueError`` listing the backends, unless ``backend`` is one."""
    if backend not in BUILDERS:
        raise ValueError(f"unknown backend {backend!r}; available backends: {', '.join(BACKENDS)}")


def build(backend: str, module: Module, lowered: Module | None = None) -> Program:
    """Build ``module``'s final IR for ``backend``; ``lowered``: the output of the backend's own passes
    (``passes.manager.backend_pipeline``), what its code is generated from, when it has any."""
    check_backend(backend)
    builder = importlib.import_module(BUILDERS[backend]).build
    return builder(module) if lowered is None else builder(module, lowered=lowered)
