"""8-bit key/value caches: rows quantised as they are appended, dequantised as they are read.

A cache of ``f8e4m3`` or ``f8e5m2`` elements (``ir.types.CACHE_DTYPES``) keeps,
beside each row of ``d`` elements (one token of one head), a float32 scale:
``scale = amax / MAX`` (``amax`` the row's largest magnitude, ``MAX`` the
type's largest finite value, 448 or 57344), and the codes ``x / scale``
rounded to nearest (ties to even) and saturated to ``[-MAX, MAX]``.  A row
reads back as ``code * scale``.  A row of zeros has scale 0; a row holding a
NaN or an infinity reads back as NaN.  Every backend quantises with
:func:`quantize` (the cuda kernels with the same arithmetic), so the codes
are the same whoever wrote them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from attncomp.ir.types import CACHE_DTYPES, NUMPY_DTYPES

#: each 8-bit type's largest finite value
CACHE_MAX = {dtype: float(ml_dtypes.finfo(NUMPY_DTYPES[dtype]).max) for dtype in CACHE_DTYPES}


def quantize(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``x[..., d]`` as ``dtype`` codes ``[..., d]`` and their float32 scales ``[...]``."""
    top = np.float32(CACHE_MAX[dtype])
    rows = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(rows), axis=-1)  # NaN propagates: such a row's scale is NaN
    scales = (amax / top).astype(np.float32)
    divisor = np.where(scales > 0, scales, np.float32(1.0))[..., None]  # a row of zeros: codes 0, scale 0
    with np.errstate(all="ignore"):
        codes = np.clip(rows / divisor, -top, top)  # saturating: rounding never leaves the range
    return codes.astype(NUMPY_DTYPES[dtype]), scales


def dequantize(codes: np.ndarray, scales: np.ndarray, dtype: type = np.float32) -> np.ndarray:
    """``codes * scales`` (a scale per row), in ``dtype``."""
    with np.errstate(all="ignore"):
        return np.asarray(codes, dtype=dtype) * np.asarray(scales, dtype=dtype)[..., None]
