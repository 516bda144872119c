"""numba-cuda's SSA reconstruction, every variable in one pass over the blocks.

numba-cuda's ``reconstruct_ssa`` (0.30's ``numba.cuda.core.ssa``, Numba 0.68's code) fixes one
variable assigned more than once at a time, and for each it rewrites every block of the function
twice (fresh names for its definitions, then its uses pointed at the reaching definition, phis
made where needed), calling a handler on every statement: the number of such variables times the
whole function.  A tensor-core kernel has hundreds of them and blocks of thousands of statements.

:func:`run_ssa` makes the same blocks with one pass for the definitions and one for the uses of
every variable, through numba-cuda's own handler and ``_find_def`` (a variable's fresh names, phis
and reaching definitions depend only on its own definitions and uses, met in the same order).
``tests/backends/test_cuda_ptx.py`` compares the two, statement for statement, on a tensor-core
and a scalar kernel.  The reconstruction of a bf16 ALiBi forward kernel at D = 128 took 3.6 to
3.8 s with numba-cuda's pass and 0.3 to 0.5 s with this one, its whole compile 10.3 to 10.7 s and
7.2 to 7.3 s; the kernels of three specs (float32 and bf16 at D = 64, bf16 ALiBi at D = 128), 22.1 s
and 17.5 s (two runs each).  The cpu backend's tasks have few such variables (Numba's reconstruction
is some 6% of compiling one), so it is not installed there.  Installed beside ``lowering_fix``, and
only over a ``_run_ssa`` that calls the helpers this one calls.
"""

from __future__ import annotations

from collections import defaultdict
from copy import copy
from dataclasses import dataclass
from types import ModuleType
from typing import Any

#: what Numba's ``_run_ssa`` calls, by which :func:`install` recognises it
_CALLS = {"compute_cfg_from_blocks", "_iterated_domfronts", "_find_defs_violators", "_fresh_vars", "_fix_ssa_vars"}


@dataclass(frozen=True)
class Pass:
    """The pieces of numba-cuda's SSA module the replacement runs (its own, unchanged)."""

    ir: Any
    ir_utils: Any
    errors: Any
    compute_cfg: Any
    iterated_domfronts: Any
    find_violators: Any
    list_vars_cache: Any
    phi_locations: Any
    fresh_vars: Any
    fix_uses: Any
    find_def: Any  # ``_FixSSAVars._find_def``: the definition reaching a statement, phis made as needed


def _renamed(ssa: Pass, blocks: dict, states: dict) -> dict:
    """Numba's ``_fresh_vars`` for every variable of ``states`` in one pass: each definition after a
    variable's first gets a fresh name, in the order Numba's one-variable passes give them."""
    fresh = ssa.fresh_vars()
    out = {}
    for label, blk in blocks.items():
        body = []
        for stmt in blk.body:
            if isinstance(stmt, ssa.ir.assign_types) and stmt.target.name in states:
                state = states[stmt.target.name]
                state["label"] = label
                stmt = fresh.on_assign(state, stmt)
            body.append(stmt)
        out[label] = block = ssa.ir.Block(scope=blk.scope, loc=blk.loc)
        block.body = body
    return out


def _replacements(ssa: Pass, fix: Any, states: dict, names: list[str], stmt: Any, label: int, block: Any) -> dict:
    """The reaching definition of each variable of ``names`` that ``stmt`` uses and Numba would
    rename (``_FixSSAVars._fix_var``), asked in the order Numba's passes ask."""
    found = {}
    for name in names:
        state = states[name]
        state["label"] = label
        state["block"] = block
        reaching = ssa.find_def(fix, state, stmt)
        if reaching is not None and reaching.target is not ssa.ir.UNDEFINED and reaching.target.name != name:
            found[name] = reaching.target
    return found


def run_ssa(ssa: Pass, blocks: dict) -> dict:
    """numba-cuda's ``_run_ssa(blocks)``: the same blocks, statements and phi nodes, every variable
    fixed in one pass over the blocks for its definitions and one for its uses.

    Numba's passes fix one variable at a time; a variable's fresh names, phis and reaching
    definitions depend only on its own definitions and uses, met in the same order here, so only
    where the other variables' work falls changes.  A statement is looked up by its own position
    (Numba finds the copy an earlier variable made at the same place), and each block's phis end
    up as Numba leaves them: the last variable's first."""
    if not blocks:
        return {}
    cfg = ssa.compute_cfg(blocks)
    df_plus = ssa.iterated_domfronts(cfg)
    violators = list(ssa.find_violators(blocks, cfg))
    if not violators:
        return blocks
    scope = next(iter(blocks.values())).scope
    states = {v: {"scope": scope, "varname": v, "defmap": defaultdict(list)} for v in violators}
    blocks = _renamed(ssa, blocks, states)
    for state in states.values():
        state["phimap"] = defaultdict(list)
        state["cfg"] = cfg
        state["phi_locations"] = ssa.phi_locations(df_plus, state["defmap"])
    order = {v: n for n, v in enumerate(violators)}
    cache = ssa.list_vars_cache()
    fix = ssa.fix_uses(cache)
    ir = ssa.ir
    out = {}
    for label, blk in blocks.items():
        body = []
        for stmt in blk.body:
            new = stmt
            if not isinstance(stmt, ir.assign_types):
                used = cache.get(stmt)
            elif isinstance(stmt.value, ir.inst_types):
                used = cache.get(stmt.value)
            else:  # a variable copied, else a constant, global or argument: nothing used
                used = [stmt.value] if isinstance(stmt.value, ir.var_types) else []
            names = sorted({v.name for v in used if v.name in order}, key=order.__getitem__)
            found = _replacements(ssa, fix, states, names, stmt, label, blk) if names else {}
            if found and isinstance(stmt, ir.assign_types):
                if isinstance(stmt.value, ir.var_types):
                    new = ir.Assign(target=stmt.target, value=found[stmt.value.name], loc=stmt.loc)
                else:
                    value = copy(stmt.value)
                    ssa.ir_utils.replace_vars_inner(value, found)
                    new = ir.Assign(target=stmt.target, value=value, loc=stmt.loc)
            elif found:
                new = copy(stmt)
                ssa.ir_utils.replace_vars_stmt(new, found)
            body.append(new)
        out[label] = block = ir.Block(scope=blk.scope, loc=blk.loc)
        block.body = body
    for v in violators:
        for label, phis in states[v]["phimap"].items():
            out[label].body = phis + out[label].body
    if ssa.compute_cfg(out) != cfg:
        raise ssa.errors.CompilerError("CFG mutated in SSA pass")
    return out


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
            compute_cfg_from_blocks,
            errors,
            ir,
            ir_utils,
        )
    except ImportError:
        return None
    find_def = vars(_FixSSAVars).get("_find_def")
    if find_def is None:
        return None
    return Pass(
        ir,
        ir_utils,
        errors,
        compute_cfg_from_blocks,
        _iterated_domfronts,
        _find_defs_violators,
        _CacheListVars,
        _compute_phi_locations,
        _FreshVarHandler,
        _FixSSAVars,
        find_def,
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
