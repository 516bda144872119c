"""``fn.paged_decoder(page_size, num_pages)``: many sequences over one pool of key/value pages.

A step takes each sequence's new tokens (batch size 1, any number of them:
prefill and decode in one call) and:

1. checks every sequence's arguments, and that the pool has the pages the
   appends need (copies on write included), before any work;
2. computes the new tokens' queries, keys and values with the spec's own
   code (the ``chunk-pairs`` inputs part: projections, rotary embeddings
   with positions offset to the sequence's length);
3. appends the new keys and values to the pages, in place: past every
   sequence's length, in pages only that sequence holds (a shared last page
   is copied on write first), so nothing any sequence attended changes;
4. attends, with absolute positions as ``fn.decoder`` gives them, in ragged
   batches: the sequences bringing as many new tokens run as one batch, one
   entry per sequence with its own positions, key start and key count
   (``chunk-pairs{ragged=true}``), no padding of the keys.  Their keys and
   values, cached and new alike, are read in place through their page tables
   (``chunk-pairs{paged=true}``, ``ac.page_view``): one call for the batch.
   Sequences sharing a prefix of pages (forks of one prompt) attend it in
   cascade first: once, the new queries of every sharer stacked into one
   batch entry, each row at its own position; the two partial results are
   merged by their log-sum-exp.

Anything that fails leaves every sequence and the pool as they were: before
step 3 nothing has changed, and a failure after it takes the append back (the
lengths, page tables and reference counts restored, the pages it took freed:
``Appended.undo``; the rows it wrote lie past every length, never read).

An 8-bit pool (``cache="f8e4m3"`` or ``"f8e5m2"``) holds codes and a float32
scale per (token, head) row: the step's new keys and values are quantised in
step 2, step 3 writes their codes and scales, and step 4 reads them back like
every cached row (``chunk-pairs{paged=true,cache=...}``): every key a query sees
is read from 8 bits.  A batch-invariant function
(``flash-tiling{batch_invariant=true}``) gives each sequence the bits it would
get alone: no cascade (stacking a group's queries into one entry, and cutting
their keys at the shared prefix, would make a row's sums depend on the other
sequences), and every tile of keys read whole, the ragged batch's key rows
rounded up to whole key blocks (so the last tile's width is the block's, not
set by the longest sequence).  Cascade pays when a prefix is read by at least ``cascade_sharers``
sequences and is at least ``cascade_min`` positions long: below that, the
extra merge and call cost more than the reads saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from attncomp.backends.codegen import size_names
from attncomp.backends.lse_merge import merge_partials
from attncomp.chunked.plan import ChunkPlan
from attncomp.compilation import Compilation
from attncomp.errors import ShapeError
from attncomp.ir.quantized import quantize
from attncomp.passes.pipeline import is_batch_invariant
from attncomp.serving.pool import PagePool, PoolExhausted


@dataclass
class Pending:
    """One sequence's share of a step, computed before anything is written."""

    seq: int
    args: dict[str, np.ndarray]
    env: dict[str, int]
    start: int  # cached positions
    count: int  # new positions
    q: np.ndarray | None = None
    #: the new keys and values as the spec computes them (appended, then read back from the pool)
    k: np.ndarray | None = None
    v: np.ndarray | None = None
    partials: list[tuple[np.ndarray, ...]] | None = None
    #: what the pool's arrays get: the new keys' and values' rows, or an 8-bit pool's codes and scales
    stored: list[np.ndarray] | None = None

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start, self.start + self.count, dtype=np.int64)


def to_rows(x: np.ndarray) -> np.ndarray:
    """``[1, *heads, n, d]`` (the spec's layout) to ``[n, *heads, d]`` (a page's rows): a view."""
    rank = x.ndim - 1
    return x[0].transpose(rank - 2, *range(rank - 2), rank - 1)


class PagedDecoder:
    """See ``CompiledFunction.paged_decoder`` and docs/api.md section 7."""

    def __init__(
        self,
        fn: Compilation,
        page_size: int,
        num_pages: int,
        cascade_min: int = 64,
        cascade_sharers: int = 2,
        cache: str = "",
    ):
        self.fn = fn
        #: the pool's 8-bit type ("" for the keys' own type)
        self.cache = cache
        self.plan = ChunkPlan.of(fn)
        #: the attention of a ragged batch of sequences over keys and values read in place from the
        #: pages (``ac.page_view``): the one function that reads the pool (cascade, cached and new keys
        #: alike), so the pool is stored as it reads it (a device pool copies in only a step's new
        #: tokens, and holds bf16 in 16 bits where its kernels take that)
        self.paged = self.plan.ragged_attention(paged=True, cache=cache)
        self.pool = PagePool(num_pages, page_size, self.paged.fn.program.page_storage(), cache)
        self.cascade_min, self.cascade_sharers = cascade_min, cascade_sharers
        #: each sequence's bits as it would get them alone (no cascade; whole key tiles)
        self.batch_invariant = is_batch_invariant(self.paged.fn.passes)
        #: the paged attention's key block: a batch-invariant step reads whole ones
        self.block_k = next(p.block_k for p in self.paged.fn.passes if p.name == "flash-tiling")
        func = self.paged.fn.func
        seq_sizes = {s for s in (self.plan.seq_q, self.plan.seq_k) if s}
        # a score or mask reading the sequences' sizes needs them per sequence: no stacking then
        self._stackable = not (seq_sizes & set(size_names(func)))
        # its arguments: q, the pool's arrays (keys and values; an 8-bit pool's codes and scales of each),
        # the page table, the query positions, the key starts and counts, then the captured inputs
        captured = func.args[1 + (4 if cache else 2) + 4 :]
        self._captured = [a.name for a in captured]
        # captured inputs with a batch axis are per sequence: such sequences are not stacked
        self._per_sequence = any(
            self.plan.batch_size in {d.symbol for d in a.type.shape if d.is_symbol} for a in captured
        )
        self._offsets = [name for name in func.attrs["chunk_offsets"] if name]
        #: the spec's arguments whose first axis is the batch (each sequence brings 1)
        self._batched = [
            k
            for k, a in enumerate(fn.func.args)
            if a.type.rank and a.type.shape[0].is_symbol and a.type.shape[0].symbol == self.plan.batch_size
        ]
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
        # the new rows in place, past every sequence's length: what any sequence attended so far is unchanged
        appended = self.pool.append_many({p.seq: p.stored for p in pending})
        try:
            start = self._cascade(pending)
            self._own(pending, start)
            return {p.seq: self._outputs(p) for p in pending}
        except BaseException:
            appended.undo()
            raise

    def _check(self, seq: int, args: tuple[Any, ...]) -> Pending:
        s = self.pool.sequence(seq)
        func = self.fn.func
        if not isinstance(args, tuple | list):
            args = (args,)
        arrays, env = self.fn.binding().bind(list(args))
        for k in self._batched:
            if arrays[k].shape[0] != 1:
                arg = func.args[k]
                raise ShapeError(
                    f"sequence {seq}: {arg.name}: dimension 0 ({arg.type.shape[0]}) is the batch; "
                    f"each sequence brings batch size 1, got {arrays[k].shape[0]}"
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
            outs = part.fn.run([p.args[a.name] for a in part.fn.func.args], sizes)
            for role, out in zip(produced, outs):
                got.setdefault(role, out)
        p.q, p.k, p.v = got["q"], got["k"], got["v"]
        if not self.cache:
            p.stored = [to_rows(p.k), to_rows(p.v)]
            return
        p.stored = []
        for x in (p.k, p.v):  # quantised once: appended as codes and scales, attended as read back
            codes, scales = quantize(x, self.cache)
            p.stored += [to_rows(codes), np.moveaxis(scales[0], -1, 0)]

    def _sizes(self, p: Pending, k_rows: int | None = None) -> dict[str, int]:
        """The sizes of a call for ``p`` (and the sequences stacked with it, which then read no
        sequence size): the spec's query and key lengths are the whole sequence's so far, as the
        spec run on every token sees them (a mask aligned to the last query reads both)."""
        sizes = dict(p.env, **{name: 0 for name in self._offsets})
        for size in (self.plan.seq_q, self.plan.seq_k):
            if size:
                sizes[size] = p.start + p.count
        if k_rows is not None:
            sizes["k_rows"] = k_rows
        return sizes

    def _attend(self, members: list[Pending], q, positions, starts, stops) -> tuple[np.ndarray, ...]:
        """Queries ``q`` (one batch entry per member) against positions ``[starts, stops)`` of each,
        their keys and values read in place through the members' page tables."""
        first = members[0]
        captured, ragged, lengths = self._ragged(members, positions, starts, stops)
        size, rows = self.pool.page_size, int(lengths.max())
        if self.batch_invariant:  # whole key tiles: the last one's width is not the longest sequence's
            rows = -(-rows // self.block_k) * self.block_k
        entries = max(-(-rows // size), 1)
        table = np.zeros((len(members), entries), np.int64)  # page 0 pads: rows past a count are never read
        for b, (p, s) in enumerate(zip(members, ragged[1])):
            pages = self.pool.sequence(p.seq).pages[s // size : -(-(s + lengths[b]) // size)]
            table[b, : len(pages)] = pages
        pools = self.pool.arrays  # keys, values; or keys' codes and scales, values' codes and scales
        sizes = self._sizes(first, rows)
        # positions, key starts and counts: a device pool's in one copy; the table as it is, checked on the host
        indices = self.pool.storage.staged([*ragged, lengths])
        outputs = self.paged.fn.run_shaped([q, *pools, table, *indices, *captured], sizes)
        return [self.pool.storage.host(x) for x in outputs]  # a device pool leaves them on the device

    def _ragged(self, members: list[Pending], positions, starts, stops) -> tuple[list, list, np.ndarray]:
        """A ragged call's captured inputs (the first member's), its query positions and key starts,
        and its key counts ``stops - starts``."""
        captured = [members[0].args[name] for name in self._captured]
        ragged = [np.asarray(positions, np.int64), np.asarray(starts, np.int64)]
        return captured, ragged, np.asarray(stops, np.int64) - ragged[1]

    def _attend_new(self, members: list[Pending], q, positions) -> tuple[np.ndarray, ...]:
        """Queries ``q`` of sequences that were empty against the step's new keys and values, held
        contiguously (``plan.ragged_attention()``, built at the first prompt): a prompt's keys read as
        the step brought them rather than through the pages (some 15% of a 2,048-token prompt on the
        cpu backend)."""
        first = members[0]
        captured, ragged, lengths = self._ragged(members, positions, [0] * len(members), [p.count for p in members])
        keys, values = np.concatenate([p.k for p in members]), np.concatenate([p.v for p in members])
        attention = self.plan.ragged_attention()
        return attention.fn.run_shaped([q, keys, values, *ragged, lengths, *captured], self._sizes(first))

    def _cascade(self, pending: list[Pending]) -> dict[int, int]:
        """Attend shared prefixes once per group of sharers; the position each sharer's own keys start at."""
        if not self._stackable or self.batch_invariant:
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
            full = min(p.start // size for p in members)
            shared = self._shared_pages([self.pool.sequence(p.seq).pages for p in members], full)
            first = members[0]
            if shared * size < self.cascade_min or not self._same_captured(members):
                continue
            # every sharer's new queries in one batch entry, each row at its own position
            q = np.concatenate([p.q for p in members], axis=-2)
            positions = np.concatenate([p.positions for p in members])[None]
            out, *rows = self._attend([first], q, positions, [0], [shared * size])
            at = 0
            for p in members:
                p.partials.append((out[..., at : at + p.count, :], *(x[..., at : at + p.count] for x in rows)))
                at += p.count
                starts[p.seq] = shared * size
            self.cascades += 1
        return starts

    @staticmethod
    def _shared_pages(tables: list[list[int]], full: int) -> int:
        """How many of the first ``full`` pages every table holds alike: the common prefix of the
        lexicographically first and last of them (list comparisons, no array of every table)."""
        heads = [t[:full] for t in tables]
        lo, hi = min(heads), max(heads)
        differs = np.flatnonzero(np.asarray(lo, np.int64) != np.asarray(hi, np.int64))
        return int(differs[0]) if differs.size else full

    def _same_captured(self, members: list[Pending]) -> bool:
        first = members[0]
        return all(all(np.array_equal(p.args[n], first.args[n]) for n in self._captured) for p in members[1:])

    def _own(self, pending: list[Pending], start: dict[int, int]) -> None:
        """Each sequence's own keys, from where its cascade (if any) stopped: the cached ones and the
        step's new ones (appended), in place through the pages.  Sequences with as many new tokens and
        the same captured inputs run as one ragged batch: one call for all of them.  A sequence that
        was empty (a prompt) attends its new keys as the step brought them, held contiguously
        (:meth:`_attend_new`), where the pool holds them as they are (not in 8 bits)."""
        groups: dict[tuple, list[Pending]] = {}
        alone = self._per_sequence or not self._stackable  # per-sequence inputs or sizes: one entry each
        for p in pending:
            key = (p.q.shape, len(p.partials), p.start == 0 and not self.cache, p.seq if alone else None)
            groups.setdefault(key, []).append(p)
        for members in groups.values():
            batches = [members]
            if not self._same_captured(members):
                batches = [[p] for p in members]
            for batch in batches:
                q = np.concatenate([p.q for p in batch])
                positions = np.stack([p.positions for p in batch])
                firsts = [start.get(p.seq, 0) for p in batch]
                stops = [p.start + p.count for p in batch]
                if batch[0].start == 0 and not self.cache:
                    parts = [self._attend_new(batch, q, positions)]
                else:
                    parts = [self._attend(batch, q, positions, firsts, stops)]
                if batch[0].partials:  # their cascade's partial results, one batch entry each
                    parts.append(tuple(np.concatenate(x) for x in zip(*(p.partials[0] for p in batch))))
                # every sequence of the batch at once
                merged = merge_partials(*parts, normalized=self.plan.normalized) if len(parts) > 1 else parts[0]
                for b, p in enumerate(batch):
                    p.partials = [tuple(x[b : b + 1] for x in merged)]

    def _outputs(self, p: Pending) -> Any:
        attended = p.partials[0]  # merged by _own: output, LSE (and each row's max score)
        if self.plan.passthrough is not None:
            roles = dict(zip(("out", "lse", "max"), attended))
            results = [roles[role] for role in self.plan.passthrough]
        else:
            part = self.plan.outputs
            sizes = {size: p.start for size in part.offsets().values()}
            args = [*attended, *(p.args[a.name] for a in part.fn.func.args[len(attended) :])]
            results = part.fn.run(args, sizes)
        return results[0] if len(results) == 1 else tuple(results)

    def __repr__(self) -> str:
        pool = self.pool
        stored = f", {self.cache} pages" if self.cache else ""
        return (
            f"<attncomp paged decoder {self.fn.name}: {len(pool.sequences)} sequences, "
            f"{pool.pages_free}/{pool.num_pages} pages of {pool.page_size} free{stored}>"
        )
