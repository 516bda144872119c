"""The log-sum-exp merge of partial attention results: the one rule, and its spellings.

Attention over disjoint key sets gives partial results that combine exactly.
A part holds, per query row, its running maximum ``m``, the sum ``l`` of
``exp(score - m)`` over its keys and the unnormalised output ``acc`` (the
same sums weighting the values); or, finished, its output ``acc / l`` and its
LSE ``m + log l``.  With ``M = max m_s``:

    out = sum exp(m_s - M) acc_s / sum exp(m_s - M) l_s
    lse = M + log(sum exp(m_s - M) l_s)

A row no key reaches (every ``m_s = -inf``) is zeros with LSE ``-inf``.  Unnormalised parts
(sigmoid attention: ``normalized = false``) are sums of ``exp(score) v`` with nothing to divide by:
``out = sum exp(m_s - M) acc_s * exp(M)``, and finished ones add up.

Three places merge: the CPU and CUDA kernels' key splits (flash-decoding),
written as generated source by :func:`write_merge` from a
:class:`MergeSpelling` that says where each part's values are in that
dialect; and host code merging finished ``(output, LSE)`` pairs (Dask chunk
pairs, a paged decoder's cascade), :func:`merge_partials`, in numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from attncomp.backends.codegen import SourceWriter


@dataclass(frozen=True)
class MergeSpelling:
    """Where a kernel's parts are, as source templates (``{s}``: the part, ``{e}``: the feature)."""

    #: the number of parts (with ``first``: the end of their range)
    count: str
    #: a part's row maximum, row sum and unnormalised output
    m: str
    l: str  # noqa: E741 (the name the online-softmax literature uses)
    o: str
    #: where the merged output and LSE go
    out: str
    lse: str | None
    #: a part's weight ``exp(m - top)`` in the maxima's unit (``{m}``: its maximum), in the accumulation type
    weight: str
    #: what turns a maximum into natural-log units (`` * LN2`` for base 2)
    to_natural: str = ""
    #: the features a thread merges: a loop over ``range(features)``, or (None) one ``e`` it was given
    features: str | None = None
    #: the condition under which this thread stores the LSE (one thread per row)
    lse_when: str | None = None
    #: what the merged output is stored as (``{}``: the value; ``round_bf16({})``: its bf16 pattern)
    narrow: str = "{}"
    #: the first part merged (parts ``first`` to ``count``; None: from 0)
    first: str | None = None
    #: where the merged row's max score goes (the parts' largest maximum, in natural units), if returned
    top: str | None = None
    #: False: the parts are unnormalised (sigmoid attention), the output ``acc exp(M)``
    normalized: bool = True


def write_merge(w: SourceWriter, spelling: MergeSpelling) -> None:
    """The merge of one row's parts, as statements (``ACC`` is the accumulation type's constructor)."""
    how = spelling

    def weight(s: str) -> str:
        return how.weight.format(m=how.m.format(s=s))

    parts = how.count if how.first is None else f"{how.first}, {how.count}"
    w.line("top = ACC(-np.inf)")
    w.line(f"for sp in range({parts}):")
    with w.indent():
        w.line(f"top = max(top, {how.m.format(s='sp')})")
    w.line("top_safe = ACC(0.0) if top == -np.inf else top")
    w.line("total = ACC(0.0)")
    w.line(f"for sp in range({parts}):")
    with w.indent():
        w.line(f"total += {weight('sp')} * {how.l.format(s='sp')}")
    if how.normalized:
        w.line("denominator = total if total != 0.0 else ACC(1.0)")
    else:
        w.line(f"denominator = {natural_exp('-top_safe', how.to_natural)}  # acc exp(M): nothing to divide by")
    loop = how.features is not None
    if loop:
        w.line(f"for e in range({how.features}):")
        w.depth += 1
    w.line("value = ACC(0.0)")
    w.line(f"for sp in range({parts}):")
    with w.indent():
        w.line(f"value += {weight('sp')} * {how.o.format(s='sp', e='e')}")
    w.line(f"{how.out.format(e='e')} = {how.narrow.format('value / denominator')}")
    if loop:
        w.depth -= 1
    stores = []
    if how.lse is not None:
        stores.append(f"{how.lse} = ACC(-np.inf) if total == 0.0 else top_safe{how.to_natural} + math.log(total)")
    if how.top is not None:
        stores.append(f"{how.top} = ACC(-np.inf) if total == 0.0 else top{how.to_natural}")
    _store_rows(w, stores, how.lse_when)


def natural_exp(x: str, to_natural: str) -> str:
    """``exp`` of a maximum ``x`` given in the kernel's unit (``to_natural``: what turns it natural)."""
    return f"ACC(math.exp(({x}){to_natural}))"


def _store_rows(w: SourceWriter, stores: list[str], when: str | None) -> None:
    """A row's log-sum-exp and max stores, under ``when`` (the thread that stores them) if given."""
    if not stores:
        return
    if when is not None:
        w.line(f"if {when}:")
        w.depth += 1
    for store in stores:
        w.line(store)
    if when is not None:
        w.depth -= 1


def write_finish(
    w: SourceWriter,
    m: str,
    l: str,  # noqa: E741
    store_outputs: Callable[[str], None],
    lse: str | None,
    to_natural: str = "",
    lse_when: str | None = None,
    top: str | None = None,
    normalized: bool = True,
) -> None:
    """One part's state finished (a merge of one): ``out = acc / l``, ``lse = m + log l`` and (where
    ``top`` is given) the row's max score ``m``; a row with no visible key (``l = 0``) gets zeros and
    ``-inf``.  ``store_outputs(denominator)`` writes the output stores in the writer's layout.
    Unnormalised (``normalized=False``, sigmoid attention): ``out = acc exp(m)``, the denominator
    ``exp(-m)`` (infinite for a row with no visible key, whose ``acc`` is 0)."""
    if normalized:
        w.line(f"denominator = {l} if {l} != 0.0 else ACC(1.0)")
    else:
        w.line(f"denominator = {natural_exp(f'-{m}', to_natural)}  # acc exp(m): nothing to divide by")
    store_outputs("denominator")
    stores = []
    if lse is not None:
        stores.append(f"{lse} = ACC(-np.inf) if {l} == 0.0 else {m}{to_natural} + math.log({l})")
    if top is not None:
        stores.append(f"{top} = ACC(-np.inf) if {l} == 0.0 else {m}{to_natural}")
    _store_rows(w, stores, lse_when)


def merge_partials(*partials: tuple[np.ndarray, ...], normalized: bool = True) -> tuple[np.ndarray, ...]:
    """Combine finished (output, LSE) pairs over disjoint key sets into one, by their log-sum-exp.

    Each output is a softmax-weighted mean over its keys, and its LSE the log of the weights'
    sum, so the merged output weighs each by ``exp(lse - max lse)``.  In float64; rows no key
    reaches (every LSE -inf) stay zero with LSE -inf.  Partials of three (output, LSE, each
    row's max score) merge their maxima too: the largest.  ``normalized=False``: the outputs are
    unnormalised (sigmoid attention's sums over their keys), and add up.
    """
    dtype = partials[0][0].dtype
    lses = np.stack([np.asarray(part[1], dtype=np.float64) for part in partials])
    top = lses.max(axis=0)
    safe = np.where(np.isneginf(top), 0.0, top)
    weights = np.exp(lses - safe)
    total = weights.sum(axis=0)
    reached = total > 0
    if normalized:
        out = sum(w[..., None] * np.asarray(part[0], dtype=np.float64) for w, part in zip(weights, partials))
        out = out / np.where(reached, total, 1.0)[..., None]
    else:  # unnormalised parts (sigmoid attention): sums over their keys, which add up
        out = sum(np.asarray(part[0], dtype=np.float64) for part in partials)
    lse = np.where(reached, safe + np.log(np.where(reached, total, 1.0)), -np.inf)
    merged = (out.astype(dtype), lse.astype(np.asarray(partials[0][1]).dtype))
    if len(partials[0]) == 3:  # each row's max score: the parts' largest
        return (*merged, np.maximum.reduce([np.asarray(part[2]) for part in partials]))
    return merged
