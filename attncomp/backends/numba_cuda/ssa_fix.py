"""numba-cuda's SSA reconstruction, rewriting only the blocks that mention each variable.

numba-cuda's ``reconstruct_ssa`` (0.30's ``numba.cuda.core.ssa``, Numba 0.68's code) fixes one
variable assigned more than once at a time, and for each it rewrites every block of the function
twice (fresh names for its definitions, then its uses pointed at the reaching definition), calling
a handler on every statement.  A block that neither defines nor uses the variable comes out as it
went in, so the work is the number of such variables times the whole function: a tensor-core
kernel has hundreds of them and blocks of thousands of statements (a bf16 D = 128 forward kernel
compiled in 7.8 s with numba-cuda's pass, 7.1 s with this one; the cpu backend's tasks, with few
such variables, compile in the same time with either, so it is not installed there).

:func:`install` replaces the module's ``_run_ssa`` with the same algorithm over the same handlers,
which hands the handlers only the blocks that mention the variable (the names each block holds are
listed once: fixing one variable adds only fresh names of it, so whether a block mentions another
never changes) and copies the rest.  The blocks, their statements and the phi nodes are the ones
numba-cuda makes (``tests/backends/test_cuda_ptx.py`` compiles a kernel with both: the same PTX).
Installed beside ``lowering_fix``, and only over a ``_run_ssa`` that calls the helpers this one
calls.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from types import ModuleType
from typing import Any

#: what Numba's ``_run_ssa`` calls, by which :func:`install` recognises it
_CALLS = {"compute_cfg_from_blocks", "_iterated_domfronts", "_find_defs_violators", "_fresh_vars", "_fix_ssa_vars"}


@dataclass(frozen=True)
class Pass:
    """The pieces of numba-cuda's SSA module the replacement runs (its own, unchanged)."""

    ir: Any
    errors: Any
    compute_cfg: Any
    iterated_domfronts: Any
    find_violators: Any
    list_vars_cache: Any
    make_states: Any
    phi_locations: Any
    block_pass: Any
    fresh_vars: Any
    fix_uses: Any


def _rewrite(ssa: Pass, blocks: dict, states: dict, handler: Any, mentions: dict) -> dict:
    """Numba's ``_run_block_rewrite`` over the blocks that mention ``states["varname"]``; the others
    are new blocks holding the same statements (what the handlers would have returned)."""
    name = states["varname"]
    out = {}
    for label, blk in blocks.items():
        block = ssa.ir.Block(scope=blk.scope, loc=blk.loc)
        if name in mentions[label]:
            states["label"] = label
            states["block"] = blk
            block.body = list(ssa.block_pass(states, blk, handler))
        else:
            block.body = list(blk.body)
        out[label] = block
    return out


def run_ssa(ssa: Pass, blocks: dict) -> dict:
    """numba-cuda's ``_run_ssa(blocks)``: the same blocks, statements and phi nodes."""
    if not blocks:
        return {}
    cfg = ssa.compute_cfg(blocks)
    df_plus = ssa.iterated_domfronts(cfg)
    violators = ssa.find_violators(blocks, cfg)
    cache_list_vars = ssa.list_vars_cache()
    mentions = {
        label: {var.name for stmt in blk.body for var in cache_list_vars.get(stmt)} for label, blk in blocks.items()
    }
    for varname in violators:
        states = ssa.make_states(blocks)
        states["varname"] = varname
        states["defmap"] = defmap = defaultdict(list)
        blocks = _rewrite(ssa, blocks, states, ssa.fresh_vars(), mentions)
        states = ssa.make_states(blocks)
        states["varname"] = varname
        states["defmap"] = defmap
        states["phimap"] = phimap = defaultdict(list)
        states["cfg"] = cfg
        states["phi_locations"] = ssa.phi_locations(df_plus, defmap)
        blocks = _rewrite(ssa, blocks, states, ssa.fix_uses(cache_list_vars), mentions)
        for label, phis in phimap.items():
            blocks[label].body = phis + blocks[label].body
    if ssa.compute_cfg(blocks) != cfg:
        raise ssa.errors.CompilerError("CFG mutated in SSA pass")
    return blocks


def _module() -> ModuleType | None:
    try:
        from numba.cuda.core import ssa
    except ImportError:  # no numba-cuda, or one laid out otherwise
        return None
    return ssa


def pieces() -> Pass | None:
    """numba-cuda's SSA pieces, or None where its module lacks one (laid out otherwise)."""
    try:
        from numba.cuda.core.ssa import (
            _CacheListVars,
            _compute_phi_locations,
            _find_defs_violators,
            _FixSSAVars,
            _FreshVarHandler,
            _iterated_domfronts,
            _make_states,
            _run_ssa_block_pass,
            compute_cfg_from_blocks,
            errors,
            ir,
        )
    except ImportError:
        return None
    return Pass(
        ir,
        errors,
        compute_cfg_from_blocks,
        _iterated_domfronts,
        _find_defs_violators,
        _CacheListVars,
        _make_states,
        _compute_phi_locations,
        _run_ssa_block_pass,
        _FreshVarHandler,
        _FixSSAVars,
    )


def original() -> Any:
    """numba-cuda's own ``_run_ssa`` where :func:`install` replaced it, else None."""
    ssa = _module()
    return None if ssa is None else getattr(ssa, "attncomp_replaced", None)


def install() -> bool:
    """Give numba-cuda's SSA reconstruction the per-block rewrite; whether it has it now.
    Idempotent; a ``_run_ssa`` that is not the one recognised is kept."""
    ssa = _module()
    if ssa is None:
        return False
    current = getattr(ssa, "_run_ssa", None)
    if getattr(current, "attncomp_ssa", False):
        return True
    found = pieces()
    if current is None or not _CALLS <= set(current.__code__.co_names) or found is None:
        return False

    def replacement(blocks: dict) -> dict:
        return run_ssa(found, blocks)

    replacement.attncomp_ssa = True  # type: ignore[attr-defined]
    ssa.attncomp_replaced = current
    ssa._run_ssa = replacement
    return True
