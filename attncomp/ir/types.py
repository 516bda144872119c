"""Tensor types: a shape of symbolic dimensions and an element type.

Printed as ``tensor<B x H x T x S x f32>``; a 0-d tensor is ``tensor<f32>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import ml_dtypes
import numpy as np

from attncomp.ir.dims import Dim, DimLike, dim

FLOAT_DTYPES = ("f16", "bf16", "f32", "f64")
INT_DTYPES = ("i32", "i64")
BOOL_DTYPE = "i1"
#: 8-bit floats a key/value cache may store (``fn.decoder(cache=...)``), each row with a float32
#: scale: storage only, never a spec's argument or an op's computed type
CACHE_DTYPES = ("f8e4m3", "f8e5m2")
DTYPES = FLOAT_DTYPES + INT_DTYPES + (BOOL_DTYPE,) + CACHE_DTYPES

NUMPY_DTYPES = {
    "f16": np.float16,
    "bf16": ml_dtypes.bfloat16,  # numpy's bfloat16: the dtype extension JAX and ONNX use
    "f32": np.float32,
    "f64": np.float64,
    "i32": np.int32,
    "i64": np.int64,
    "i1": np.bool_,
    "f8e4m3": ml_dtypes.float8_e4m3fn,  # 4 exponent bits, 3 mantissa bits, no infinities: at most 448
    "f8e5m2": ml_dtypes.float8_e5m2,  # 5 exponent bits, 2 mantissa bits: at most 57344
}

_BITS = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64, "i32": 32, "i64": 64, "i1": 1, "f8e4m3": 8, "f8e5m2": 8}


def category(dtype: str) -> int:
    """0 for bool, 1 for integers, 2 for floats: the promotion order."""
    if dtype == BOOL_DTYPE:
        return 0
    return 1 if dtype in INT_DTYPES else 2


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def is_int(dtype: str) -> bool:
    return dtype in INT_DTYPES


def wider(a: str, b: str) -> str:
    """The wider of two dtypes of one category; f16 and bf16 (neither holds the other) meet in f32."""
    if {a, b} == {"f16", "bf16"}:
        return "f32"
    return a if _BITS[a] >= _BITS[b] else b


def accumulation_dtype(dtype: str) -> str:
    """The type a kernel accumulates ``dtype`` values in: float64 for float64, float32 for every
    narrower float (products, sums and the online-softmax state), int64 for integers.  Every
    backend asks this one function; each writer spells the answer in its own dialect."""
    if dtype == "f64":
        return "f64"
    if dtype in FLOAT_DTYPES or dtype in CACHE_DTYPES:
        return "f32"
    return "i64" if dtype in INT_DTYPES else dtype


def weak_float_dtype(arg_dtypes: list[str]) -> str:
    """The type a spec traces its Python floats in (weak scalars, docs/ir.md): float64 in a spec with
    a float64 argument, float32 otherwise.  A weak value takes the type of the float tensor it meets."""
    return "f64" if "f64" in arg_dtypes else "f32"


def score_dtype(dtype: str) -> str:
    """The type a fused attention over ``dtype`` inputs computes its scores and score function in:
    the accumulation type, float32 for f16, bf16 and f32 and float64 for f64, whatever narrower type
    the spec's graph rounds its scores to.  A float32 parameter entering the scores is read as float32."""
    return accumulation_dtype(dtype)


def dtype_of_numpy(np_dtype: np.dtype) -> str | None:
    for name, np_type in NUMPY_DTYPES.items():
        if np.dtype(np_type) == np_dtype:
            return name
    return None


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown element type {self.dtype!r}")

    @staticmethod
    def of(shape: tuple[DimLike, ...] | list[DimLike], dtype: str) -> TensorType:
        return TensorType(tuple(dim(d) for d in shape), dtype)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_dtype(self, dtype: str) -> TensorType:
        return TensorType(self.shape, dtype)

    def with_shape(self, shape: tuple[DimLike, ...] | list[DimLike]) -> TensorType:
        return TensorType.of(shape, self.dtype)

    def concrete_shape(self, env: dict[str, int]) -> tuple[int, ...]:
        return tuple(d.evaluate(env) for d in self.shape)

    def __str__(self) -> str:
        return self._text

    @cached_property
    def _text(self) -> str:  # computed once: the type is immutable
        parts = [str(d) for d in self.shape] + [self.dtype]
        return "tensor<" + " x ".join(parts) + ">"
