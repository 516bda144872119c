"""Dask arrays in, Dask arrays out: the task graph of a chunked run (docs/api.md section 8).

``fn(*args)`` with any argument a ``dask.array.Array`` builds, without running
anything, one graph:

1. per chunk of positions (and of batch entries), the part computing q, k
   and v (projections, rotary embeddings: position-wise, so chunk by chunk,
   positions offset to the chunk's place), when the spec computes them;
2. per (batch chunk, query chunk, key chunk) that the mask leaves visible,
   the attention of that pair, returning a partial output and its LSE.
   Before the graph is built the pairs are classified with the same interval
   analysis that classifies tiles, run in the interpreter with one tile per
   chunk pair (per-chunk min/max summaries of captured tensors included):
   pairs proven fully masked are not in the graph, pairs proven fully
   visible run the attention compiled without its mask;
3. per query chunk, a tree of log-sum-exp merges of its pairs;
4. per query chunk, what the spec does with the attention's result.

Captured inputs the score and mask functions read (slopes, tables, lengths,
document ids) are computed if lazy and enter the graph once, as one key each
that every task reads; so does each part's reference (its IR and pipeline),
which a worker builds once.  Chunking: an argument's chunks along a size
the attention splits (batch axes, the query axis, the key axis) set that
size's chunks (the first argument carrying it wins; irregular chunks are
made regular); every other axis is one chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from attncomp.blockmap import block_map
from attncomp.chunked import tasks
from attncomp.chunked.plan import ChunkPlan, Part
from attncomp.ir.binding import as_array, bind_arguments
from attncomp.ir.types import NUMPY_DTYPES

if TYPE_CHECKING:
    from attncomp.compilation import Compilation

PAIR = "attncomp-pair"


def is_dask(value: Any) -> bool:
    """Whether ``value`` is a Dask collection (checked without importing Dask)."""
    return hasattr(value, "__dask_graph__") and type(value).__module__.split(".")[0] == "dask"


@dataclass
class Chunked:
    """An array of the graph: the name of its keys and its chunks along each axis."""

    name: str
    chunks: tuple[tuple[int, ...], ...]

    def key(self, index: tuple[int, ...]) -> tuple:
        return (self.name, *index)


def regular(chunks: tuple[int, ...]) -> tuple[int, ...]:
    """``chunks`` if every chunk but a shorter last one has one size, else the same total in chunks of the largest."""
    if all(c == chunks[0] for c in chunks[:-1]) and chunks[-1] <= chunks[0]:
        return tuple(chunks)
    size, total = max(chunks), sum(chunks)
    return (size,) * (total // size) + ((total % size,) if total % size else ())


def starts(chunks: tuple[int, ...]) -> list[int]:
    return [int(s) for s in np.cumsum((0, *chunks[:-1]))]


def _standin(value: Any, name: str) -> np.ndarray:
    """An array of ``value``'s shape and type that holds no memory (shapes are checked on it)."""
    if is_dask(value):
        return np.broadcast_to(np.zeros((), dtype=value.dtype), value.shape)
    return as_array(value, name)


class GraphBuilder:
    def __init__(self, fn: Compilation, args: tuple[Any, ...]):
        import dask.array as da
        from dask.base import tokenize

        self.da = da
        self.fn = fn
        self.plan = ChunkPlan.of(fn)
        self.args = {a.name: (a, x) for a, x in zip(fn.func.args, args)}
        standins = [_standin(x, a.name) for a, x in zip(fn.func.args, args)]
        _, self.env = bind_arguments(fn.func, standins, fn.constraints)
        self.token = tokenize(fn.name, fn.backend, fn.pipeline, str(fn.input), *args)
        self.layer: dict[Any, Any] = {}
        self.deps: list[Any] = []
        self.layout = self._layout()
        self.refs: dict[int, str] = {}

    # chunking -----------------------------------------------------------------------
    def _layout(self) -> dict[str, tuple[int, ...]]:
        chunkable = self.plan.chunkable
        layout: dict[str, tuple[int, ...]] = {}
        for arg, x in self.args.values():
            if not is_dask(x):
                continue
            for axis, d in enumerate(arg.type.shape):
                if d.is_symbol and d.symbol in chunkable and d.symbol not in layout and x.shape[axis] > 0:
                    layout[d.symbol] = regular(x.chunks[axis])
        for symbol in chunkable:
            layout.setdefault(symbol, (self.env[symbol],))
        return layout

    def chunked_arg(self, name: str) -> Chunked:
        """The spec's argument ``name`` in the graph, chunked along the sizes the run splits."""
        arg, x = self.args[name]
        target = tuple(
            self.layout[d.symbol] if d.is_symbol and d.symbol in self.layout else (int(n),)
            for d, n in zip(arg.type.shape, np.shape(x) if not is_dask(x) else x.shape)
        )
        array = x.rechunk(target) if is_dask(x) else self.da.from_array(np.asarray(x), chunks=target)
        self.deps.append(array)
        return Chunked(array.name, array.chunks)

    def whole_arg(self, name: str) -> str:
        """The spec's argument ``name`` as one key every task reads (computed first if lazy)."""
        key = f"attncomp-captured-{name}-{self.token}"
        if key not in self.layer:
            _, x = self.args[name]
            self.layer[key] = np.asarray(x.compute() if is_dask(x) else x)
        return key

    def ref_key(self, part: Part) -> str:
        """The key holding ``part``'s reference: a worker reads it once and builds the part once."""
        if id(part) not in self.refs:
            key = f"attncomp-part-{part.ref.name}-{len(self.refs)}-{self.token}"
            self.refs[id(part)] = key
            self.layer[key] = part.ref
        return self.refs[id(part)]

    # stages ---------------------------------------------------------------------------
    def blockwise(self, part: Part, inputs: dict[str, Chunked], stage: str) -> list[Chunked]:
        """Run ``part`` once per chunk of its inputs' split sizes; its results, chunked alike."""
        func = part.fn.func
        ins = [inputs[a.name] if a.name in inputs else self.chunked_arg(a.name) for a in func.args]
        grid = []
        for a in func.args:
            for d in a.type.shape:
                if d.is_symbol and d.symbol in self.layout and d.symbol not in grid:
                    grid.append(d.symbol)
        offsets = part.offsets()
        ref = self.ref_key(part)
        task_name = f"attncomp-{stage}-{self.token}"
        outs = [f"attncomp-{stage}-{k}-{self.token}" for k in range(len(func.results))]

        def index(value_type, point: dict[str, int]) -> tuple[int, ...]:
            return tuple(point[d.symbol] if d.is_symbol and d.symbol in point else 0 for d in value_type.shape)

        for numbers in itertools.product(*(range(len(self.layout[s])) for s in grid)):
            point = dict(zip(grid, numbers))
            sizes = tuple(
                (size, starts(self.layout[axis])[point[axis]] if axis in point else 0)
                for axis, size in sorted(offsets.items())
            )
            keys = [c.key(index(a.type, point)) for a, c in zip(func.args, ins)]
            task = (task_name, *numbers)
            self.layer[task] = (tasks.run_part, ref, sizes, *keys)
            for k, value in enumerate(func.results):
                self.layer[(outs[k], *index(value.type, point))] = (tasks.pick, task, k)
        results = []
        for name, value in zip(outs, func.results):
            chunks = tuple(
                self.layout[d.symbol] if d.is_symbol and d.symbol in grid else (d.evaluate(self.env),)
                for d in value.type.shape
            )
            results.append(Chunked(name, chunks))
        return results

    def attention(self, q: Chunked, k: Chunked, v: Chunked) -> list[Chunked]:
        """The attention's output and LSE (and each row's max score, ``plan.with_max``), chunked."""
        plan, layout = self.plan, self.layout
        part = plan.attention
        names = part.fn.func.attrs["chunk_offsets"]
        captured = [self.whole_arg(a.name) for a in part.fn.func.args[3:]]
        batch_chunks = [layout[s] if s is not None else (q.chunks[a][0],) for a, s in enumerate(plan.batch)]
        q_chunks = layout[plan.seq_q] if plan.seq_q else q.chunks[-2]
        k_chunks = layout[plan.seq_k] if plan.seq_k else k.chunks[-2]
        classes = self.classify(q, k, v, captured)
        totals = tuple(sorted((s, n) for s, n in self.env.items()))
        dtypes = tuple(np.dtype(NUMPY_DTYPES[r.type.dtype]).str for r in part.fn.func.results)
        out_name, lse_name = f"attncomp-out-{self.token}", f"attncomp-lse-{self.token}"
        max_name = f"attncomp-max-{self.token}"
        runs = {}  # tile class -> the part's reference and the captured inputs it reads
        for tile_class, run in ((1, part), (2, plan.unmasked or part)):
            runs[tile_class] = (self.ref_key(run), [self.whole_arg(a.name) for a in run.fn.func.args[3:]])
        for pb in itertools.product(*(range(len(c)) for c in batch_chunks)):
            offsets = [(names[a], starts(batch_chunks[a])[n]) for a, n in enumerate(pb) if names[a]]
            k_batch = tuple(n if follow else 0 for n, follow in zip(pb, plan.keys_follow))
            for qi in range(len(q_chunks)):
                pairs = []
                for kj in range(len(k_chunks)):
                    tile_class = int(classes[(*pb, qi, kj)])
                    if tile_class == 0:
                        continue
                    sizes = (
                        totals
                        + tuple(offsets)
                        + (
                            (names[-2], starts(q_chunks)[qi]),
                            (names[-1], starts(k_chunks)[kj]),
                        )
                    )
                    key = (PAIR + "-" + self.token, *pb, qi, kj)
                    ref, reads = runs[tile_class]
                    self.layer[key] = (
                        tasks.run_part,
                        ref,
                        sizes,
                        q.key((*pb, qi, 0)),
                        k.key((*k_batch, kj, 0)),
                        v.key((*k_batch, kj, 0)),
                        *reads,
                    )
                    pairs.append(key)
                merged = self.merge_tree(pairs, (*pb, qi))
                if merged is None:
                    shape = (*(c[n] for c, n in zip(batch_chunks, pb)), q_chunks[qi], v.chunks[-1][0])
                    merged = (f"attncomp-none-{self.token}", *pb, qi)
                    self.layer[merged] = (tasks.no_keys, shape, dtypes)
                self.layer[(out_name, *pb, qi, 0)] = (tasks.pick, merged, 0)
                self.layer[(lse_name, *pb, qi)] = (tasks.pick, merged, 1)
                if plan.with_max:
                    self.layer[(max_name, *pb, qi)] = (tasks.pick, merged, 2)
        results = [Chunked(out_name, (*batch_chunks, q_chunks, v.chunks[-1]))]
        results.append(Chunked(lse_name, (*batch_chunks, q_chunks)))
        if plan.with_max:
            results.append(Chunked(max_name, (*batch_chunks, q_chunks)))
        return results

    def merge_tree(self, keys: list[tuple], where: tuple[int, ...]) -> tuple | None:
        """Pairwise log-sum-exp merges, level by level: depth ceil(log2(len(keys)))."""
        level = 0
        merge = tasks.merge if self.plan.normalized else tasks.merge_sums
        while len(keys) > 1:
            merged = []
            for n in range(0, len(keys) - 1, 2):
                key = (f"attncomp-merge-{self.token}", *where, level, n // 2)
                self.layer[key] = (merge, keys[n], keys[n + 1])
                merged.append(key)
            if len(keys) % 2:
                merged.append(keys[-1])
            keys, level = merged, level + 1
        return keys[0] if keys else None

    def classify(self, q: Chunked, k: Chunked, v: Chunked, captured: list[str]) -> np.ndarray:
        """Per (batch chunk, query chunk, key chunk): 0 fully masked, 1 partly, 2 fully visible."""
        plan = self.plan
        q_total = tuple(sum(c) for c in q.chunks)
        k_total, v_total = tuple(sum(c) for c in k.chunks), tuple(sum(c) for c in v.chunks)
        blocks = (max(q.chunks[-2][0], 1), max(k.chunks[-2][0], 1))
        classifier = plan.classifiers.get(blocks)
        if classifier is None:
            classifier = plan.classifiers[blocks] = plan.classifier(blocks)
        func = classifier.func
        standins = [
            np.broadcast_to(np.zeros((), dtype=NUMPY_DTYPES[a.type.dtype]), shape)
            for a, shape in zip(func.args[:3], (q_total, k_total, v_total))
        ]
        whole = [self.layer[key] for key in captured]
        names = func.attrs["chunk_offsets"]
        sizes = dict(self.env, **{n: 0 for n in names if n})
        tiles = block_map(func, classifier.constraints, (*standins, *whole), sizes)
        # tiles: [*batch, q_chunks, k_chunks]; fold each batch chunk's entries together
        visible, full = tiles != 0, tiles == 2
        for axis, symbol in enumerate(plan.batch):
            if symbol is None:
                visible = visible.any(axis=axis, keepdims=True)
                full = full.all(axis=axis, keepdims=True)
            else:
                bounds = starts(self.layout[symbol])
                visible = np.logical_or.reduceat(visible, bounds, axis=axis)
                full = np.logical_and.reduceat(full, bounds, axis=axis)
        return np.where(full, 2, np.where(visible, 1, 0)).astype(np.int8)

    # the whole run ---------------------------------------------------------------------
    def build(self) -> list[Chunked]:
        plan = self.plan
        qkv: dict[str, Chunked] = {}
        for role in ("q", "k", "v"):
            if plan.direct[role] is not None:
                qkv[role] = self.chunked_arg(plan.direct[role])
        for n, (part, produced) in enumerate(plan.inputs):
            for role, made in zip(produced, self.blockwise(part, {}, f"inputs{n}")):
                qkv.setdefault(role, made)
        results = self.attention(qkv["q"], qkv["k"], qkv["v"])
        if plan.passthrough is not None:
            roles = dict(zip(("out", "lse", "max"), results))
            return [roles[role] for role in plan.passthrough]
        args = plan.outputs.fn.func.args
        return self.blockwise(plan.outputs, {a.name: r for a, r in zip(args, results)}, "outputs")

    def arrays(self, results: list[Chunked]) -> list[Any]:
        from dask.highlevelgraph import HighLevelGraph

        arrays = []
        for chunked, value in zip(results, self.fn.func.results):
            dtype = NUMPY_DTYPES[value.type.dtype]
            graph = HighLevelGraph.from_collections(chunked.name, dict(self.layer), dependencies=self.deps)
            meta = np.empty((0,) * len(chunked.chunks), dtype=dtype)
            arrays.append(self.da.Array(graph, chunked.name, chunked.chunks, dtype=dtype, meta=meta))
        return arrays


def run_chunked(fn: Compilation, args: tuple[Any, ...]) -> Any:
    """``fn`` over Dask arrays: a Dask array per result, sharing one graph; nothing runs yet."""
    builder = GraphBuilder(fn, args)
    arrays = builder.arrays(builder.build())
    return arrays[0] if len(arrays) == 1 else tuple(arrays)
