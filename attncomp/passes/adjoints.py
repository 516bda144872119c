"""Reverse-mode rules: for each op, the gradients of its operands from those of its results.

A rule gets the :class:`Adjoint` builder, the op, the op's operands and
results as they are recomputed in the backward function, and the gradient of
each result (``None``: zero).  It returns one gradient per operand (``None``:
none, as for integer operands or a mask), shaped like the op's result; the
sweep then sums it over broadcast axes to the operand's type.  The rules
work unchanged on tensors at graph level and on the 0-d values of fused
regions.  One rule per op kind, with its formula in a comment.
"""

from __future__ import annotations

from collections.abc import Callable

from attncomp.ir.core import Op, Value
from attncomp.ir.dims import dim
from attncomp.ir.types import TensorType, is_float
from attncomp.passes.builder import Builder


class Adjoint(Builder):
    """A builder with the few compound emitters the rules share."""

    def like(self, value: float, like: Value) -> Value:
        """A 0-d constant of ``like``'s element type (a float type for integers)."""
        dtype = like.type.dtype if is_float(like.type.dtype) else "f32"
        return self.const(value, dtype)

    def zeros(self, t: TensorType) -> Value:
        return self.const(0.0, t.dtype, t.shape)

    def expand(self, g: Value, t: TensorType) -> Value:
        """``g`` broadcast to type ``t`` (adding zeros of that type)."""
        if g.type.shape == t.shape:
            return g
        return self.emit("ac.add", g, self.zeros(t.with_dtype(g.type.dtype)))

    def keep_axes(self, g: Value, x: TensorType, axes: list[int], keepdims: bool) -> Value:
        """A reduction's result with its reduced ``axes`` put back as size 1."""
        if keepdims:
            return g
        shape = [dim(1) if k in axes else d for k, d in enumerate(x.shape)]
        return self.op("ac.reshape", [g], declared=[g.type.with_shape(shape)]).result

    def sum_to(self, g: Value, t: TensorType) -> Value:
        """``g`` summed over the axes broadcasting added or stretched, as type ``t``."""
        extra = g.type.rank - t.rank
        if extra > 0:
            g = self.op("ac.reduce", [g], {"kind": "sum", "axes": list(range(extra)), "keepdims": False}).result
        stretched = [
            k
            for k, (have, want) in enumerate(zip(g.type.shape, t.shape))
            if want.is_const and want.value == 1 and not (have.is_const and have.value == 1)
        ]
        if stretched:
            g = self.op("ac.reduce", [g], {"kind": "sum", "axes": stretched, "keepdims": True}).result
        if g.type.shape != t.shape:
            g = self.op("ac.reshape", [g], declared=[g.type.with_shape(t.shape)]).result
        return self.cast(g, t.dtype)

    def swap_last(self, x: Value) -> Value:
        perm = list(range(x.type.rank))
        perm[-2], perm[-1] = perm[-1], perm[-2]
        return self.emit("ac.transpose", x, perm=perm)

    def select(self, cond: Value, a: Value, b: Value) -> Value:
        return self.emit("ac.where", cond, a, b)


Grads = list[Value | None]
Rule = Callable[[Adjoint, Op, list[Value], list[Value], list[Value | None]], Grads]
RULES: dict[str, Rule] = {}

#: ops whose results carry no gradient (integers, booleans, positions, constants)
NO_GRADIENT = frozenset(
    "ac.constant ac.dim ac.iota ac.cmp ac.and ac.or ac.not ac.floordiv ac.block_reduce ac.check_index ac.random".split()
)


def rule(*names: str):
    def register(fn: Rule) -> Rule:
        for name in names:
            RULES[name] = fn
        return fn

    return register


def _sign(ad: Adjoint, x: Value) -> Value:
    zero, one = ad.like(0.0, x), ad.like(1.0, x)
    positive = ad.emit("ac.cmp", x, zero, pred="gt")
    negative = ad.emit("ac.cmp", x, zero, pred="lt")
    return ad.select(positive, one, ad.select(negative, ad.like(-1.0, x), zero))


@rule("ac.neg")  # -x: -g
def _neg(ad, op, x, y, g):
    return [ad.emit("ac.neg", g[0])]


@rule("ac.abs")  # |x|: g * sign(x)
def _abs(ad, op, x, y, g):
    return [ad.emit("ac.mul", g[0], _sign(ad, x[0]))]


@rule("ac.exp")  # e**x: g * y
def _exp(ad, op, x, y, g):
    return [ad.emit("ac.mul", g[0], y[0])]


@rule("ac.log")  # log x: g / x
def _log(ad, op, x, y, g):
    return [ad.emit("ac.div", g[0], x[0])]


@rule("ac.tanh")  # tanh x: g * (1 - y**2)
def _tanh(ad, op, x, y, g):
    return [ad.emit("ac.mul", g[0], ad.emit("ac.sub", ad.like(1.0, y[0]), ad.emit("ac.mul", y[0], y[0])))]


@rule("ac.sqrt")  # sqrt x: g * 0.5 / y
def _sqrt(ad, op, x, y, g):
    return [ad.emit("ac.div", ad.emit("ac.mul", g[0], ad.like(0.5, y[0])), y[0])]


@rule("ac.rsqrt")  # x ** -0.5: g * -0.5 * y**3
def _rsqrt(ad, op, x, y, g):
    cube = ad.emit("ac.mul", ad.emit("ac.mul", y[0], y[0]), y[0])
    return [ad.emit("ac.mul", g[0], ad.emit("ac.mul", cube, ad.like(-0.5, y[0])))]


@rule("ac.sin")  # sin x: g * cos x
def _sin(ad, op, x, y, g):
    return [ad.emit("ac.mul", g[0], ad.emit("ac.cos", x[0]))]


@rule("ac.cos")  # cos x: -g * sin x
def _cos(ad, op, x, y, g):
    return [ad.emit("ac.neg", ad.emit("ac.mul", g[0], ad.emit("ac.sin", x[0])))]


@rule("ac.add")  # a + b: g, g
def _add(ad, op, x, y, g):
    return [g[0], g[0]]


@rule("ac.sub")  # a - b: g, -g
def _sub(ad, op, x, y, g):
    return [g[0], ad.emit("ac.neg", g[0])]


@rule("ac.mul")  # a * b: g * b, g * a
def _mul(ad, op, x, y, g):
    return [ad.emit("ac.mul", g[0], x[1]), ad.emit("ac.mul", g[0], x[0])]


@rule("ac.div")  # a / b: g / b, -g * y / b
def _div(ad, op, x, y, g):
    da = ad.emit("ac.div", g[0], x[1])
    return [da, ad.emit("ac.neg", ad.emit("ac.mul", da, y[0]))]


@rule("ac.pow")  # a ** b: g * b * a ** (b - 1), g * log(a) * y
def _pow(ad, op, x, y, g):
    a, b = x
    lower = ad.emit("ac.pow", a, ad.emit("ac.sub", b, ad.like(1.0, b)))
    da = ad.emit("ac.mul", g[0], ad.emit("ac.mul", b, lower))
    db = ad.emit("ac.mul", g[0], ad.emit("ac.mul", ad.emit("ac.log", a), y[0])) if is_float(b.type.dtype) else None
    return [da, db]


def _choose(ad: Adjoint, g: Value, wins: Value, ties: Value, like: Value) -> Value:
    share = ad.select(wins, ad.like(1.0, like), ad.select(ties, ad.like(0.5, like), ad.like(0.0, like)))
    return ad.emit("ac.mul", g, share)


@rule("ac.maximum", "ac.minimum")  # the larger (smaller) operand takes g; a tie splits it in halves
def _extremum(ad, op, x, y, g):
    a, b = x
    pred = "gt" if op.name == "ac.maximum" else "lt"
    ties = ad.emit("ac.cmp", a, b, pred="eq")
    like = g[0]
    return [
        _choose(ad, g[0], ad.emit("ac.cmp", a, b, pred=pred), ties, like),
        _choose(ad, g[0], ad.emit("ac.cmp", b, a, pred=pred), ties, like),
    ]


@rule("ac.mod")  # a - floor(a / b) * b: g, -g * floor(a / b)
def _mod(ad, op, x, y, g):
    return [g[0], ad.emit("ac.neg", ad.emit("ac.mul", g[0], ad.emit("ac.floordiv", x[0], x[1])))]


@rule("ac.where")  # where(c, a, b): -, g where c, g where not c
def _where(ad, op, x, y, g):
    zero = ad.like(0.0, g[0])
    return [None, ad.select(x[0], g[0], zero), ad.select(x[0], zero, g[0])]


@rule("ac.cast")  # a float cast passes g back in the operand's type
def _cast(ad, op, x, y, g):
    return [g[0] if is_float(x[0].type.dtype) else None]


@rule("ac.matmul")  # a @ b: g @ bᵀ, aᵀ @ g
def _matmul(ad, op, x, y, g):
    a, b = x
    return [ad.emit("ac.matmul", g[0], ad.swap_last(b)), ad.emit("ac.matmul", ad.swap_last(a), g[0])]


@rule("ac.reduce")  # sum: g everywhere; mean: g / n; max, min: g shared by the elements equal to y
def _reduce(ad, op, x, y, g):
    src = x[0].type
    axes, keepdims, kind = op.attrs["axes"], op.attrs["keepdims"], op.attrs["kind"]
    gk = ad.keep_axes(g[0], src, axes, keepdims)
    if kind == "sum":
        return [ad.expand(gk, src.with_dtype(gk.type.dtype))]
    if kind == "mean":
        count = dim(1)
        for axis in axes:
            count = count * src.shape[axis]
        gk = ad.emit("ac.div", gk, ad.cast(ad.dim(count), gk.type.dtype))
        return [ad.expand(gk, src.with_dtype(gk.type.dtype))]
    yk = ad.keep_axes(y[0], src, axes, keepdims)
    hit = ad.cast(ad.emit("ac.cmp", x[0], yk, pred="eq"), gk.type.dtype)
    count = ad.op("ac.reduce", [hit], {"kind": "sum", "axes": axes, "keepdims": True}).result
    return [ad.emit("ac.mul", hit, ad.emit("ac.div", gk, count))]


@rule("ac.softmax")  # p = softmax(x): p * (g - sum(g * p))
def _softmax(ad, op, x, y, g):
    p = y[0]
    attrs = {"kind": "sum", "axes": [op.attrs["axis"]], "keepdims": True}
    inner = ad.op("ac.reduce", [ad.emit("ac.mul", g[0], p)], attrs)
    return [ad.emit("ac.mul", p, ad.emit("ac.sub", g[0], inner.result))]


@rule("ac.logsumexp")  # logsumexp(x): g * softmax(x) (zero for an all -inf row)
def _logsumexp(ad, op, x, y, g):
    axis = op.attrs["axis"]
    gk = ad.keep_axes(g[0], x[0].type, [axis], op.attrs["keepdims"])
    return [ad.emit("ac.mul", gk, ad.emit("ac.softmax", x[0], axis=axis))]


@rule("ac.transpose")  # permute back
def _transpose(ad, op, x, y, g):
    perm = op.attrs["perm"]
    inverse = [perm.index(k) for k in range(len(perm))]
    return [ad.emit("ac.transpose", g[0], perm=inverse)]


@rule("ac.reshape")  # reshape back
def _reshape(ad, op, x, y, g):
    return [ad.op("ac.reshape", [g[0]], declared=[g[0].type.with_shape(x[0].type.shape)]).result]


def _zeros_along(ad: Adjoint, like: TensorType, axis: int, size) -> Value | None:
    size = dim(size)
    if size.is_const and size.value == 0:
        return None
    shape = list(like.shape)
    shape[axis] = size
    return ad.zeros(like.with_shape(shape))


def _concat(ad: Adjoint, parts: list[Value | None], axis: int) -> Value:
    parts = [p for p in parts if p is not None]
    return parts[0] if len(parts) == 1 else ad.emit("ac.concat", *parts, axis=axis)


@rule("ac.slice")  # the slice's gradient placed in zeros of the operand's size (every step-th element)
def _slice(ad, op, x, y, g):
    axis, step = op.attrs["axis"], op.attrs["step"]
    start, stop = dim(op.attrs["start"]), dim(op.attrs["stop"])
    size = x[0].type.shape[axis]
    gt = g[0].type
    if step == 1:
        return [_concat(ad, [_zeros_along(ad, gt, axis, start), g[0], _zeros_along(ad, gt, axis, size - stop)], axis)]
    # step > 1: each element followed by step - 1 zeros, then placed at start and cut to the axis size
    count = gt.shape[axis]
    column = list(gt.shape)
    column.insert(axis + 1, dim(1))
    spaced = ad.op("ac.reshape", [g[0]], declared=[gt.with_shape(column)]).result
    gaps = list(column)
    gaps[axis + 1] = dim(step - 1)
    spaced = ad.emit("ac.concat", spaced, ad.zeros(gt.with_shape(gaps)), axis=axis + 1)
    flat = list(gt.shape)
    flat[axis] = count * step
    spaced = ad.op("ac.reshape", [spaced], declared=[gt.with_shape(flat)]).result
    padded = _concat(ad, [_zeros_along(ad, gt, axis, start), spaced, _zeros_along(ad, gt, axis, size)], axis)
    return [ad.emit("ac.slice", padded, axis=axis, start=0, stop=size, step=1)]


@rule("ac.concat")  # each operand takes its range of g
def _concat_rule(ad, op, x, y, g):
    axis = op.attrs["axis"]
    out, at = [], dim(0)
    for operand in x:
        end = at + operand.type.shape[axis]
        out.append(ad.emit("ac.slice", g[0], axis=axis, start=at, stop=end, step=1))
        at = end
    return out


@rule("ac.repeat_kv")  # heads h * n_rep .. h * n_rep + n_rep - 1 of g summed into head h
def _repeat_kv(ad, op, x, y, g):
    src = x[0].type
    n_rep = dim(op.attrs["n_rep"])
    grouped = [src.shape[0], src.shape[1], n_rep, *src.shape[2:]]
    split = ad.op("ac.reshape", [g[0]], declared=[g[0].type.with_shape(grouped)]).result
    return [ad.op("ac.reduce", [split], {"kind": "sum", "axes": [2], "keepdims": False}).result]


@rule("ac.gather")  # src[idx...]: g added at idx (positions read twice add up)
def _gather(ad, op, x, y, g):
    src, *indices = x
    target = src.type.with_dtype(g[0].type.dtype)
    return [ad.op("ac.scatter_add", [g[0], *indices], declared=[target]).result] + [None] * len(indices)
