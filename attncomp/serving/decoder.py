"""``fn.paged_decoder(page_size, num_pages)``: many sequences over one pool of key/value pages.

A step takes each sequence's new tokens (batch size 1, any number of them:
prefill and decode in one call) and:

1. checks every sequence's arguments, and that the pool has the pages the
   appends need (copies on write included), before any work;
2. computes the new tokens' queries, keys and values with the spec's own
   code (the ``chunk-pairs`` inputs part: projections, rotary embeddings
   with positions offset to the sequence's length);
3. attends, with absolute positions as ``fn.decoder`` gives them.  Sequences
   sharing a prefix of pages (forks of one prompt) are attended in cascade:
   the shared pages once, against the new queries of every sharer stacked
   into one block (each row carrying its own position, ``rows = true``),
   then each sequence's own suffix, the two partial results merged by their
   log-sum-exp;
4. only then appends the new keys and values to the pages, in place.

Anything that fails before step 4 leaves every sequence and the pool as they
were.  Cascade pays when a prefix is read by at least ``cascade_sharers``
sequences and is at least ``cascade_min`` positions long: below that, the
extra merge and call cost more than the reads saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from attncomp.backends.codegen import size_names
from attncomp.chunked.plan import ChunkPlan
from attncomp.chunked.tasks import merge
from attncomp.errors import ShapeError
from attncomp.ir.binding import bind_arguments
from attncomp.serving.pool import PagePool, PoolExhausted

if TYPE_CHECKING:
    from attncomp.api import CompiledFunction


@dataclass
class Pending:
    """One sequence's share of a step, computed before anything is written."""

    seq: int
    args: dict[str, np.ndarray]
    env: dict[str, int]
    start: int  # cached positions
    count: int  # new positions
    q: np.ndarray | None = None
    k: np.ndarray | None = None
    v: np.ndarray | None = None
    partials: list[tuple[np.ndarray, np.ndarray]] | None = None

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start, self.start + self.count, dtype=np.int64)


def to_rows(x: np.ndarray) -> np.ndarray:
    """``[1, *heads, n, d]`` (the spec's layout) to ``[n, *heads, d]`` (a page's rows)."""
    return np.moveaxis(x[0], -2, 0)


class PagedDecoder:
    """See ``CompiledFunction.paged_decoder`` and API.md section 7."""

    def __init__(
        self,
        fn: CompiledFunction,
        page_size: int,
        num_pages: int,
        cascade_min: int = 64,
        cascade_sharers: int = 2,
    ):
        self.fn = fn
        self.pool = PagePool(num_pages, page_size)
        self.plan = ChunkPlan.of(fn)
        self.attention = self.plan.rows_attention()
        self.cascade_min, self.cascade_sharers = cascade_min, cascade_sharers
        func = self.attention.fn.func
        seq_sizes = {s for s in (self.plan.seq_q, self.plan.seq_k) if s}
        # a score or mask reading the sequences' sizes needs them per sequence: no stacking then
        self._stackable = not (seq_sizes & set(size_names(func)))
        self._captured = [a.name for a in func.args[4:]]
        self._offsets = [name for name in func.attrs["chunk_offsets"] if name]
        #: cascade steps run, and sequences they served (for tests and benchmarks)
        self.cascades = 0

    # the pool ----------------------------------------------------------------------------
    def new(self) -> int:
        """A new, empty sequence."""
        return self.pool.new()

    def fork(self, seq: int) -> int:
        """A sequence sharing every cached position of ``seq`` (copy on write)."""
        return self.pool.fork(seq)

    def free(self, seq: int) -> None:
        """Forget ``seq``; its pages return to the pool once no other sequence holds them."""
        self.pool.free(seq)

    def length(self, seq: int) -> int:
        return self.pool.sequence(seq).length

    @property
    def pages_free(self) -> int:
        return self.pool.pages_free

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    # a step --------------------------------------------------------------------------------
    def step(self, batch: dict[int, tuple[Any, ...]]) -> dict[int, Any]:
        """Each sequence's new tokens in, each sequence's outputs out (see the module docstring)."""
        pending = [self._check(seq, args) for seq, args in batch.items()]
        needed = self.pool.pages_needed({p.seq: p.count for p in pending})
        if needed > self.pool.pages_free:
            raise PoolExhausted(
                f"the pool is exhausted: this step needs {needed} pages, {self.pool.pages_free} are free "
                f"(of {self.pool.num_pages}); nothing was changed"
            )
        for p in pending:
            self._inputs(p)
        if self.pool.arrays is None:
            self.pool.allocate([(to_rows(x).shape[1:], x.dtype) for x in (pending[0].k, pending[0].v)])
        for p in pending:
            p.partials = []
        start = self._cascade(pending)
        for p in pending:
            self._suffix(p, start.get(p.seq, 0))
        results = {p.seq: self._outputs(p) for p in pending}
        for p in pending:  # everything computed: now the pages change
            self.pool.append(p.seq, [to_rows(p.k), to_rows(p.v)])
        return results

    def _check(self, seq: int, args: tuple[Any, ...]) -> Pending:
        s = self.pool.sequence(seq)
        func = self.fn.func
        if not isinstance(args, tuple | list):
            args = (args,)
        arrays, env = bind_arguments(func, list(args), self.fn.constraints)
        for arg, array in zip(func.args, arrays):
            for axis, d in enumerate(arg.type.shape[:1]):
                if d.is_symbol and d.symbol == self.plan.batch_size and array.shape[axis] != 1:
                    raise ShapeError(
                        f"sequence {seq}: {arg.name}: dimension {axis} ({d}) is the batch; "
                        f"each sequence brings batch size 1, got {array.shape[axis]}"
                    )
        counts = {env[s] for s in (self.plan.seq_q, self.plan.seq_k) if s}
        if len(counts) != 1 or min(counts) < 1:
            raise ShapeError(
                f"sequence {seq}: new queries and new keys must be the same number of tokens, at least one "
                f"({self.plan.seq_q} = {env.get(self.plan.seq_q)}, {self.plan.seq_k} = {env.get(self.plan.seq_k)})"
            )
        named = {a.name: x for a, x in zip(func.args, arrays)}
        return Pending(seq, named, env, s.length, counts.pop())

    def _inputs(self, p: Pending) -> None:
        got = {role: p.args[name] for role, name in self.plan.direct.items() if name is not None}
        for part, produced in self.plan.inputs:
            sizes = {size: p.start for size in part.offsets().values()}
            outs = part.fn._run([p.args[a.name] for a in part.fn.func.args], sizes)
            for role, out in zip(produced, outs):
                got.setdefault(role, out)
        p.q, p.k, p.v = got["q"], got["k"], got["v"]

    def _run_attention(self, q, k, v, positions, k_start: int, p: Pending, rows: int):
        sizes = dict(p.env, **{name: 0 for name in self._offsets})
        sizes[self.attention.fn.func.attrs["chunk_offsets"][-1]] = k_start
        for s in (self.plan.seq_q,):
            if s:
                sizes[s] = rows
        if self.plan.seq_k:
            sizes[self.plan.seq_k] = p.start + p.count
        captured = [p.args[name] for name in self._captured]
        return self.attention.fn._run([q, k, v, positions, *captured], sizes)

    def _cascade(self, pending: list[Pending]) -> dict[int, int]:
        """Attend shared prefixes once per group of sharers; the position each sharer's own keys start at."""
        if not self._stackable:
            return {}
        size = self.pool.page_size
        groups: dict[int, list[Pending]] = {}
        for p in pending:
            pages = self.pool.sequence(p.seq).pages
            if p.start >= size and self.pool.refs[pages[0]] > 1:
                groups.setdefault(pages[0], []).append(p)
        starts = {}
        for members in groups.values():
            if len(members) < self.cascade_sharers:
                continue
            tables = [self.pool.sequence(p.seq).pages[: p.start // size] for p in members]
            shared = 0
            while all(len(t) > shared and t[shared] == tables[0][shared] for t in tables):
                shared += 1
            first = members[0]
            same = all(all(np.array_equal(p.args[name], first.args[name]) for name in self._captured) for p in members)
            if shared * size < self.cascade_min or not same:
                continue
            keys, values = self.pool.read(first.seq, 0, shared * size)
            q = np.concatenate([p.q for p in members], axis=-2)
            positions = np.concatenate([p.positions for p in members])
            out, lse = self._run_attention(q, keys, values, positions, 0, first, q.shape[-2])
            at = 0
            for p in members:
                p.partials.append((out[..., at : at + p.count, :], lse[..., at : at + p.count]))
                at += p.count
                starts[p.seq] = shared * size
            self.cascades += 1
        return starts

    def _suffix(self, p: Pending, start: int) -> None:
        """Attend the sequence's own keys from ``start``: cached ones read from its pages, then the new ones."""
        if start < p.start:
            keys, values = self.pool.read(p.seq, start, p.start, room=p.count)
            keys[..., p.start - start :, :] = p.k
            values[..., p.start - start :, :] = p.v
        else:
            keys, values = p.k, p.v
        p.partials.append(tuple(self._run_attention(p.q, keys, values, p.positions, start, p, p.count)))

    def _outputs(self, p: Pending) -> Any:
        out, lse = merge(*p.partials) if len(p.partials) > 1 else p.partials[0]
        if self.plan.passthrough is not None:
            results = [out if role == "out" else lse for role in self.plan.passthrough]
        else:
            part = self.plan.outputs
            sizes = {size: p.start for size in part.offsets().values()}
            args = [out, lse, *(p.args[a.name] for a in part.fn.func.args[2:])]
            results = part.fn._run(args, sizes)
        return results[0] if len(results) == 1 else tuple(results)

    def __repr__(self) -> str:
        pool = self.pool
        return (
            f"<attncomp paged decoder {self.fn.name}: {len(pool.sequences)} sequences, "
            f"{pool.pages_free}/{pool.num_pages} pages of {pool.page_size} free>"
        )
