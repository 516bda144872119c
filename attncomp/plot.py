"""Pictures: the attention weights of one head, and the tile classes of a block map.

matplotlib is the optional ``plot`` extra (``pip install 'attncomp[plot]'``);
it is imported only when a picture is drawn.  Figures are drawn on an Agg
canvas of their own, never through ``pyplot``, so drawing one neither opens a
window nor changes the caller's matplotlib backend.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from attncomp.dsl import Spec
from attncomp.errors import AttncompError
from attncomp.ir.core import Func, Op, Value
from attncomp.ir.interpreter import interpret_func
from attncomp.ir.printer import Namer

#: heatmaps at most this many cells across and down show each weight as a number, as the tutorials do
ANNOTATE_UP_TO = 16
#: colours of the tile classes 0 skipped, 1 masked, 2 full
TILE_COLOURS = ("#f2f2f2", "#f0a33a", "#2f6db5")
TILE_NAMES = ("skipped", "masked", "full")


def require_matplotlib(feature: str) -> Any:
    """The ``matplotlib`` module, or an ImportError telling how to install it."""
    try:
        import matplotlib  # the package first: a stale submodule in sys.modules must not hide its absence
        import matplotlib.figure  # noqa: F401
        from matplotlib.backends import backend_agg  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{feature} needs matplotlib: pip install 'attncomp[plot]'") from exc
    return matplotlib


def _new_figure(feature: str, size: tuple[float, float]):
    require_matplotlib(feature)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _produced_by(value: Value, op_name: str) -> bool:
    return isinstance(value.owner, Op) and value.owner.name == op_name


def attention_weights_value(func: Func) -> Value:
    """The value holding a graph-level function's attention weights.

    That is the result of its first ``ac.softmax`` or, for a softmax spelled
    out, of the ``ac.div`` that normalises exponentials (``e / sum(e)`` with
    ``e`` from ``ac.exp``, the quotient of the scores' shape).
    """
    ops = list(func.body.walk())
    for op in ops:
        if op.name == "ac.softmax":
            return op.result
    for op in ops:
        if op.name == "ac.div" and len(op.results) == 1:
            numerator = op.operands[0]
            shape = op.result.type.shape
            if _produced_by(numerator, "ac.exp") and numerator.type.shape == shape and len(shape) >= 2:
                return op.result
    raise AttncompError(
        f"{func.name} has no attention weights to plot: it has no ac.softmax, "
        "nor a division of exponentials by their sum (e = ac.exp(...); p = e / ac.sum(e, -1, keepdims=True))"
    )


def _one_head(weights: np.ndarray, batch: int, head: int) -> tuple[np.ndarray, str]:
    """``weights`` [B, H, T, S], [B, T, S] or [T, S] -> the [T, S] matrix shown, and its caption."""
    if weights.ndim == 2:
        return weights, ""
    if weights.ndim not in (3, 4):
        raise ValueError(f"attention weights of rank {weights.ndim}: expected [B, H, T, S], [B, T, S] or [T, S]")
    axes = [("batch", batch, weights.shape[0])]
    if weights.ndim == 4:
        axes.append(("head", head, weights.shape[1]))
    for name, index, size in axes:
        if not -size <= index < size:
            raise IndexError(f"{name} {index} is out of range: the weights have {size}")
    selected = weights[tuple(index for _, index, _ in axes)]
    return selected, ", ".join(f"{name} {index}" for name, index, _ in axes)


def _tick_labels(tokens: Any, rows: int, cols: int) -> tuple[list[str] | None, list[str] | None]:
    """``tokens``: one list for both axes, or a (query_tokens, key_tokens) pair."""
    if tokens is None:
        return None, None
    tokens = list(tokens)
    is_pair = len(tokens) == 2 and all(
        isinstance(t, np.ndarray) or (isinstance(t, Sequence) and not isinstance(t, str)) for t in tokens
    )
    query, key = (list(tokens[0]), list(tokens[1])) if is_pair else (tokens, tokens)
    for what, labels, size in (("query", query, rows), ("key", key, cols)):
        if len(labels) != size:
            raise ValueError(f"{len(labels)} {what} tokens for {size} {what} positions")
    return [str(t) for t in query], [str(t) for t in key]


def plot_attention(
    spec: Spec,
    *args: Any,
    batch: int = 0,
    head: int = 0,
    path: str | os.PathLike[str] = "attention.png",
    tokens: Sequence[Any] | tuple[Sequence[Any], Sequence[Any]] | None = None,
    **constants: Any,
) -> np.ndarray:
    """Draw the attention weights of one head as a heatmap PNG at ``path``; return them.

    The spec runs in the reference interpreter on ``args`` (with compile-time
    ``constants``); the weights are the softmax's result, indexed
    ``[batch, head]`` (rank 4), ``[batch]`` (rank 3) or taken whole (rank 2).
    Rows are query positions, columns key positions; ``tokens`` labels the
    ticks (one list for both axes, or a ``(query_tokens, key_tokens)`` pair).
    """
    require_matplotlib("ac.plot_attention")
    if not isinstance(spec, Spec):
        raise TypeError(f"ac.plot_attention takes a spec, got {type(spec).__name__}")
    func = (spec.trace(**constants) if constants else spec.ir).main
    target = attention_weights_value(func)
    _, values = interpret_func(func, args, trace=True)
    shown, caption = _one_head(values[Namer.for_func(func)[target]], batch, head)
    query_labels, key_labels = _tick_labels(tokens, *shown.shape)

    rows, cols = shown.shape
    figure = _new_figure("ac.plot_attention", (min(3 + 0.5 * cols, 10), min(2.5 + 0.5 * rows, 8.5)))
    ax = figure.add_subplot()
    image = ax.imshow(shown, cmap="Blues", vmin=0.0, vmax=max(float(shown.max(initial=0.0)), 1e-12))
    figure.colorbar(image, ax=ax, label="weight")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(f"{spec.name}: attention weights" + (f", {caption}" if caption else ""))
    for axis_ticks, labels, size in ((ax.set_xticks, key_labels, cols), (ax.set_yticks, query_labels, rows)):
        if labels is not None:
            axis_ticks(range(size), labels)
    if key_labels is not None:
        ax.tick_params(axis="x", labelrotation=45)
    if rows <= ANNOTATE_UP_TO and cols <= ANNOTATE_UP_TO:
        middle = 0.5 * float(shown.max(initial=0.0))
        for (i, j), weight in np.ndenumerate(shown):
            colour = "white" if weight > middle else "black"
            ax.text(j, i, f"{weight:.2f}", ha="center", va="center", fontsize=8, color=colour)
    figure.savefig(path, dpi=120)
    return shown


def plot_block_map(
    tiles: np.ndarray,
    path: str | os.PathLike[str],
    title: str,
    block_q: int | None = None,
    block_k: int | None = None,
    feature: str = "attncomp blocks --png",
) -> None:
    """Draw a ``[q_blocks, kv_blocks]`` map of tile classes (0 skipped, 1 masked, 2 full) as a PNG."""
    require_matplotlib(feature)
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    rows, cols = tiles.shape
    scale = 6.0 / max(rows, cols, 1)
    figure = _new_figure(feature, (max(3.5, 1.5 + cols * scale), max(3.0, 1.2 + rows * scale)))
    ax = figure.add_subplot()
    colours = ListedColormap(TILE_COLOURS)
    ax.imshow(tiles, cmap=colours, norm=BoundaryNorm([-0.5, 0.5, 1.5, 2.5], colours.N), interpolation="nearest")
    ax.set_xlabel("key block" + (f" ({block_k} keys)" if block_k else ""))
    ax.set_ylabel("query block" + (f" ({block_q} queries)" if block_q else ""))
    ax.set_title(title)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    handles = [Patch(facecolor=c, edgecolor="grey", label=n) for c, n in zip(TILE_COLOURS, TILE_NAMES)]
    figure.legend(handles=handles, loc="outside lower center", ncols=3, frameon=False)
    figure.savefig(path, dpi=120)
