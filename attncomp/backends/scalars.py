"""Host values as kernel arguments: what each element type is passed as.

A 0-d value goes to a kernel in its accumulation type (``accumulation_dtype``:
float16 and bfloat16 as float32, int32 as int64), so one kernel signature
serves every call; a boolean stays a boolean.  An array of 16-bit floats that
a kernel reads whole (a captured table, not a tile source) is widened to
float32 (``array_dtype``).  The CPU and CUDA signatures name the same types
(``SCALAR_TYPES``), spelled in their dialects.
"""

from __future__ import annotations

from typing import Any

from attncomp.ir.types import DTYPES, NUMPY_DTYPES, accumulation_dtype, is_float


def scalar_dtype(dtype: str) -> str:
    """The element type a 0-d ``dtype`` value is passed to a kernel as."""
    return dtype if dtype == "i1" else accumulation_dtype(dtype)


#: element type -> the element type of the kernel argument of a 0-d value
SCALAR_TYPES = {d: scalar_dtype(d) for d in DTYPES}


def array_dtype(dtype: str) -> str:
    """The element type an array of ``dtype`` is passed to a kernel as: floats in their
    accumulation type, others as they are."""
    return accumulation_dtype(dtype) if is_float(dtype) else dtype


def kernel_scalar(x: Any, dtype: str) -> Any:
    """A host 0-d value as a kernel argument (``SCALAR_TYPES``)."""
    if dtype == "i1":
        return bool(x)
    return NUMPY_DTYPES[scalar_dtype(dtype)](x)
