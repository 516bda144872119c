"""The functions a spec body calls: ``ac.exp``, ``ac.where``, ``ac.softmax``, ..."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attncomp.errors import SpecError
from attncomp.tensor import SymDim, Tensor

inf = float("inf")


def _tracer(*values: Any):
    for v in values:
        if isinstance(v, (Tensor, SymDim)):
            return v.tracer
        if isinstance(v, (list, tuple)):
            found = _tracer(*v)
            if found is not None:
                return found
    return None


def _need_tracer(fname: str, *values: Any):
    tracer = _tracer(*values)
    if tracer is None:
        raise SpecError(f"ac.{fname} needs a traced tensor argument (it is only used inside a spec)")
    return tracer


def _unary(opname: str, fname: str):
    def fn(x: Tensor) -> Tensor:
        tracer = _need_tracer(fname, x)
        return tracer.emit(opname, [tracer.lift(x)])

    fn.__name__ = fname
    fn.__doc__ = f"Elementwise {fname} (op ``{opname}``)."
    return fn


exp = _unary("ac.exp", "exp")
log = _unary("ac.log", "log")
tanh = _unary("ac.tanh", "tanh")
sqrt = _unary("ac.sqrt", "sqrt")
sin = _unary("ac.sin", "sin")
cos = _unary("ac.cos", "cos")
rsqrt = _unary("ac.rsqrt", "rsqrt")
abs = _unary("ac.abs", "abs")  # noqa: A001 - the DSL's name


def sigmoid(x: Any) -> Tensor:
    """Elementwise logistic function ``1 / (1 + exp(-x))`` (a gate on the scores, ``torch.sigmoid`` in a
    FlexAttention score_mod), traced as ops whose gradients follow: with ``e = exp(-|x|)`` in (0, 1],
    ``1 / (1 + e)`` where ``x >= 0`` and ``e / (1 + e)`` elsewhere, so that nothing overflows, forward
    or backward (``exp(-x)`` is infinite in float32 below -88, and its gradient NaN); ``-|x|`` is a
    choice between ``-x`` and ``x`` made by the same condition, so that at 0 its gradient is the
    branch's (an ``abs`` would give 0 there, and the gradient at 0 a quarter too little)."""
    x = _need_tracer("sigmoid", x).lift(x)
    right = x >= 0.0
    e = exp(where(right, -x, x))
    r = 1.0 / (1.0 + e)
    return where(right, r, e * r)


def maximum(a: Any, b: Any) -> Tensor:
    """Elementwise maximum."""
    tracer = _need_tracer("maximum", a, b)
    return tracer.emit("ac.maximum", [tracer.lift(a), tracer.lift(b)])


def minimum(a: Any, b: Any) -> Tensor:
    """Elementwise minimum."""
    tracer = _need_tracer("minimum", a, b)
    return tracer.emit("ac.minimum", [tracer.lift(a), tracer.lift(b)])


def where(cond: Any, a: Any, b: Any) -> Tensor:
    """``a`` where ``cond`` holds, else ``b``; all three broadcast."""
    tracer = _need_tracer("where", cond, a, b)
    return tracer.emit("ac.where", [tracer.lift(cond), tracer.lift(a), tracer.lift(b)])


def max(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Maximum over ``axis`` (an int, a tuple, or None for all axes)."""
    return _need_tracer("max", x).reduce(x, "max", axis, keepdims)


def min(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Minimum over ``axis``."""
    return _need_tracer("min", x).reduce(x, "min", axis, keepdims)


def sum(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``axis``."""
    return _need_tracer("sum", x).reduce(x, "sum", axis, keepdims)


def mean(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis``."""
    return _need_tracer("mean", x).reduce(x, "mean", axis, keepdims)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """Softmax along ``axis``; a slice that is all -inf gives zeros."""
    tracer = _need_tracer("softmax", x)
    return tracer.emit("ac.softmax", [x], {"axis": tracer.axis(axis, x.ndim)})


def logsumexp(x: Tensor, axis: int = -1, keepdims: bool = False) -> Tensor:
    """Natural-log ``log(sum(exp(x)))`` along ``axis``; all -inf gives -inf."""
    tracer = _need_tracer("logsumexp", x)
    attrs = {"axis": tracer.axis(axis, x.ndim), "keepdims": bool(keepdims)}
    return tracer.emit("ac.logsumexp", [x], attrs)


def index(x: Tensor) -> tuple[Tensor, ...]:
    """The absolute position along each axis of ``x``, shaped to broadcast against it.

    ``b, h, i, j = ac.index(s)`` for scores ``s`` of shape (B, H, T, S) gives
    ``i`` of shape (1, 1, T, 1) and ``j`` of shape (1, 1, 1, S).
    """
    tracer = _need_tracer("index", x)
    out = []
    for axis, size in enumerate(x.type.shape):
        shape = [1] * x.ndim
        shape[axis] = size
        declared = [x.type.with_shape(shape).with_dtype("i64")]
        out.append(tracer.emit("ac.iota", [], {"axis": axis}, declared=declared))
    return tuple(out)


def concat(xs: Sequence[Tensor], axis: int = -1) -> Tensor:
    """Join tensors along ``axis``."""
    tracer = _need_tracer("concat", xs)
    items = [tracer.lift(x) for x in xs]
    return tracer.emit("ac.concat", items, {"axis": tracer.axis(axis, items[0].ndim)})


def repeat_kv(x: Tensor, n_rep: Any) -> Tensor:
    """Repeat each head of ``x`` (axis 1) ``n_rep`` times, as in grouped-query attention."""
    tracer = _need_tracer("repeat_kv", x)
    reps = tracer.size(n_rep)
    if reps.is_const and reps.value == 1:
        return x
    if reps.is_const and reps.value < 1:
        raise tracer.located(SpecError(f"repeat_kv: n_rep must be at least 1, got {reps.value}"))
    return tracer.emit("ac.repeat_kv", [x], {"n_rep": reps.value if reps.is_const else reps})


def page_view(pages: Tensor, table: Tensor, rows: Any, slot: int | None = None) -> Tensor:
    """The first ``rows`` rows of sequences kept in pages (op ``ac.page_view``): row ``r`` of sequence
    ``b`` is slot ``r % P`` of page ``table[b, r // P]``; nothing is copied, the kernels read the pages
    through the table.

    ``pages`` is ``[num_pages, *heads, P, d]``, or with ``slot=1`` ``[num_pages, P, *heads, d]``
    (FlashAttention's and vLLM's layout); ``table`` is integer ``[batch, pages a sequence]`` (or
    ``[pages]``: one sequence); the view is ``[batch, *heads, rows, d]``.  Page numbers are checked
    before a call reads them.
    """
    tracer = _need_tracer("page_view", pages, table)
    pages, table = tracer.lift(pages), tracer.lift(table)
    attrs: dict[str, Any] = {"rows": tracer.size(rows)}
    if slot is not None:
        if not isinstance(slot, int) or isinstance(slot, bool) or slot not in (1, pages.ndim - 2, -2):
            raise tracer.located(
                SpecError(f"ac.page_view: slot is 1 or -2 (the pages' axis holding a page's rows), got {slot!r}")
            )
        attrs["slot"] = slot % pages.ndim
    return tracer.emit("ac.page_view", [pages, table], attrs)


def random(*counters: Any) -> Tensor:
    """A uniform float32 in [0, 1) per element, hashed from integer counters (op ``ac.random``).

    ``ac.random(seed, b, h, i, j)`` with ``b, h, i, j = ac.index(s)`` draws one number per score;
    the same counters draw the same number on every backend and in the backward, nothing stored.
    """
    if not counters:
        raise SpecError("ac.random needs at least one integer counter (a seed, positions)")
    tracer = _need_tracer("random", *counters)
    items = [tracer.lift(c) for c in counters]
    for at, item in enumerate(items):
        if not item.type.dtype.startswith("i") or item.type.dtype == "i1":
            raise tracer.located(SpecError(f"ac.random: counter {at} must be an integer tensor, got {item.type.dtype}"))
    return tracer.emit("ac.random", items)


def dropout(p: Tensor, rate: float, seed: Any) -> Tensor:
    """Attention dropout of the probabilities ``p``: each element kept with probability ``1 - rate``
    and scaled by ``1 / (1 - rate)``, else zero; ``ac.dropout(ac.softmax(s), 0.1, seed) @ v``.

    The element at positions ``(b, h, i, j)`` is kept where ``ac.random(seed, b, h, i, j) >= rate``:
    ``seed`` is an integer argument of the spec (a new one each training step), ``rate`` a number
    in [0, 1) (a keyword-only argument, a compile-time constant); a rate of 0 returns ``p``.
    softmax-fusion keeps the dropout in the fused attention (its weight region): the mask is drawn
    tile by tile and drawn again in the backward.
    """
    tracer = _need_tracer("dropout", p, seed)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise tracer.located(SpecError(f"ac.dropout: rate must be a number, got {rate!r}"))
    if not 0.0 <= rate < 1.0:
        raise tracer.located(SpecError(f"ac.dropout: rate must be in [0, 1), got {rate}"))
    if rate == 0.0:
        return p
    keep = random(seed, *index(p)) >= rate
    return p * where(keep, 1.0 / (1.0 - rate), 0.0)
