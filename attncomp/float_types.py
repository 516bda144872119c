"""One spec for every float type: a generic spec's compilations, one per float type it is called with.

A spec whose arguments are annotated ``ac.floating[...]`` is traced again for
each float type a call brings (f16, bf16, f32 or f64) and compiled once per
type, like shapes: the generated sources differ, so each has its own disk
cache entry.  Every ``floating`` argument of one call has the same float
type; arguments of declared types keep them, and values mixing the two
promote as the IR's rules say (bf16 with f32 is f32; f16 with bf16 is f32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attncomp.compilation import Compilation
from attncomp.dsl import DEFAULT_FLOAT, Spec
from attncomp.ir.core import Module
from attncomp.ir.types import FLOAT_DTYPES, NUMPY_DTYPES

#: numpy's (and torch's) name of each element type -> the IR's
ELEMENT_TYPE_OF_NAME = {np.dtype(t).name: name for name, t in NUMPY_DTYPES.items()}


def element_type(value: Any) -> str | None:
    """The IR element type of an array, tensor, device array or Dask array (None: not one of ours)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        dtype = np.asarray(value).dtype
    return ELEMENT_TYPE_OF_NAME.get(str(dtype).removeprefix("torch."))


class FloatFamily:
    """A generic spec's compilations by float type, each built on first use."""

    def __init__(self, spec: Spec, constants: dict[str, Any], build: Callable[[Module, str], Compilation]):
        self.spec = spec
        self.constants = constants
        self.build = build
        self.members: dict[str, Compilation] = {}

    def member(self, float_type: str) -> Compilation:
        """The compilation for ``float_type``."""
        if float_type not in FLOAT_DTYPES:
            raise TypeError(f"@{self.spec.name}: a float type is one of {', '.join(FLOAT_DTYPES)}, not {float_type!r}")
        if float_type not in self.members:
            module = self.spec.trace_as(float_type, **self.constants)
            self.members[float_type] = self.build(module, float_type)
        return self.members[float_type]

    def float_type_of(self, args: Sequence[Any]) -> str:
        """The float type of a call: its ``ac.floating`` arguments'; a ``TypeError`` names an argument
        of another type, or one that is not a float."""
        first: tuple[str, str] | None = None
        for k in self.spec.float_args:
            if k >= len(args):  # too few arguments: the binding says so
                break
            name = self.spec.arg_names[k]
            dtype = element_type(args[k])
            if dtype not in FLOAT_DTYPES:
                shown = dtype or str(getattr(args[k], "dtype", type(args[k]).__name__))
                raise TypeError(f"{name}: an ac.floating argument takes f16, bf16, f32 or f64 elements, got {shown}")
            if first is None:
                first = (name, dtype)
            elif dtype != first[1]:
                raise TypeError(
                    f"{name}: expected {first[1]} elements, the float type of this call (that of {first[0]}), "
                    f"got {dtype}"
                )
        return DEFAULT_FLOAT if first is None else first[1]
