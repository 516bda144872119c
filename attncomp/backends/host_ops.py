"""What both backends' host drivers share: graph ops as numpy calls, constants and shapes as source.

The cpu driver (``numba_cpu/driver.py``) runs every graph-level op with numpy; the cuda driver
(``numba_cuda/host/driver.py``) runs on the host what it does not launch as a kernel, spelled the same.
"""

from __future__ import annotations

from attncomp.backends.codegen import dim_expr
from attncomp.ir.core import Op, Value
from attncomp.ir.dims import dim

NUMPY_UNARY = {
    "ac.neg": "np.negative",
    "ac.abs": "np.abs",
    "ac.exp": "np.exp",
    "ac.log": "np.log",
    "ac.tanh": "np.tanh",
    "ac.sqrt": "np.sqrt",
    "ac.sin": "np.sin",
    "ac.cos": "np.cos",
    "ac.not": "np.logical_not",
}
NUMPY_BINARY = {
    "ac.add": "np.add",
    "ac.sub": "np.subtract",
    "ac.mul": "np.multiply",
    "ac.div": "np.true_divide",
    "ac.floordiv": "np.floor_divide",
    "ac.mod": "np.mod",
    "ac.pow": "np.power",
    "ac.maximum": "np.maximum",
    "ac.minimum": "np.minimum",
    "ac.and": "np.logical_and",
    "ac.or": "np.logical_or",
}
NUMPY_COMPARE = {
    "lt": "np.less",
    "le": "np.less_equal",
    "gt": "np.greater",
    "ge": "np.greater_equal",
    "eq": "np.equal",
    "ne": "np.not_equal",
}


def py_literal(value: int | float | bool) -> str:
    """A constant as Python source (``float('inf')`` for infinities, ``float('nan')``)."""
    text = repr(value)
    return f"float({text!r})" if text in ("inf", "-inf", "nan") else text


def shape_expr(value: Value) -> str:
    dims = [dim_expr(d) for d in value.type.shape]
    return "(" + "".join(f"{d}, " for d in dims) + ")"


def check_index_call(op: Op, operands: list[str]) -> str:
    """The driver line of an ``ac.check_index``: raises before the kernels run."""
    attrs = op.attrs
    size = dim_expr(dim(attrs["size"]))
    return (
        f"rt.check_index_range(int({operands[0]}), int({operands[1]}), int({operands[2]}), {size}, "
        f"{attrs['axis']}, {attrs['exact']}, {attrs.get('at', '')!r})"
    )


def scalar_expr(op: Op, operands: list[str]) -> str | None:
    """A 0-d op as a numpy expression of its ``operands`` (their names), or None where it has none."""
    name, a, attrs = op.name, operands, op.attrs
    if name == "ac.constant":
        return f"np.full((), {py_literal(attrs['value'])})"
    if name == "ac.dim":
        return dim_expr(attrs["value"])
    if name in NUMPY_UNARY:
        return f"{NUMPY_UNARY[name]}({a[0]})"
    if name == "ac.rsqrt":
        return f"1.0 / np.sqrt({a[0]})"
    if name in NUMPY_BINARY:
        return f"{NUMPY_BINARY[name]}({a[0]}, {a[1]})"
    if name == "ac.cmp":
        return f"{NUMPY_COMPARE[attrs['pred']]}({a[0]}, {a[1]})"
    if name == "ac.where":
        return f"np.where({a[0]}, {a[1]}, {a[2]})"
    if name in ("ac.cast", "ac.reshape"):
        return a[0]
    return None
