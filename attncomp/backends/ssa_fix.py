"""Numba's SSA reconstruction, every variable in one pass over the blocks.

Numba's ``reconstruct_ssa`` (``numba.core.ssa``, and numba-cuda 0.30's copy of it,
``numba.cuda.core.ssa``) fixes one variable assigned more than once at a time, and for each it
rewrites every block of the function twice (fresh names for its definitions, then its uses
pointed at the reaching definition, phis made where needed), calling a handler on every
statement: the number of such variables times the whole function.  Finding the definition that
reaches a use, it looks for both statements' positions by walking the block from its start.  A
tensor-core kernel has hundreds of such variables and blocks of thousands of statements; a cpu
kernel module's tasks, tens of variables over some 40 functions.

:func:`run_ssa` makes the same blocks with one pass for the definitions and one for the uses of
every variable, through Numba's own handler and ``_find_def`` (a variable's fresh names, phis and
reaching definitions depend only on its own definitions and uses, met in the same order), with
each block's statement positions looked up in a table.  ``tests/backends/test_front_end.py`` compares
the two, statement for statement, on a tensor-core and a scalar CUDA kernel and on a cpu module.
The reconstruction of a bf16 ALiBi forward kernel at D = 128 took 3.6 to 3.8 s with numba-cuda's
pass and 0.3 to 0.5 s with this one, its whole compile 10.3 to 10.7 s and 7.2 to 7.3 s.

numba-cuda's is replaced for good (a GPU launch compiles its kernel outside attncomp's compile
window); Numba's own, which compiles a user's CPU functions too, only inside the window
(:func:`attncomp.backends.call_types.remembered`).  Installed only over a ``_run_ssa`` that
calls the helpers this one calls.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from copy import copy
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from attncomp.backends import call_types, replaced

#: the SSA modules :func:`install` knows: Numba's (its own replaced inside the compile window only)
#: and numba-cuda's
MODULES = ("numba.core.ssa", "numba.cuda.core.ssa")
#: what Numba's ``_run_ssa`` calls, by which :func:`install` recognises it
_CALLS = {"compute_cfg_from_blocks", "_iterated_domfronts", "_find_defs_violators", "_fresh_vars", "_fix_ssa_vars"}


@dataclass(frozen=True)
class Pass:
    """The pieces of a Numba SSA module the replacement runs (its own, unchanged)."""

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
    assign_types: tuple
    inst_types: tuple
    var_types: tuple


class _Positions:
    """``_FixSSAVars._stmt_index`` by table: a statement's position in a block (its first, as
    Numba's walk from the block's start finds it), the block's length where it is not there, or
    not before ``stop`` (the last statement excluded by default, as Numba's ``[:-1]`` does)."""

    def __init__(self) -> None:
        self._tables: dict[int, tuple[Any, dict[int, int]]] = {}

    def __call__(self, stmt: Any, block: Any, stop: int = -1) -> int:
        body = block.body
        held = self._tables.get(id(block))
        if held is None or held[0] is not body:
            table: dict[int, int] = {}
            for n, each in enumerate(body):
                table.setdefault(id(each), n)
            held = self._tables[id(block)] = (body, table)
        count = len(body)
        found = held[1].get(id(stmt))
        limit = count - 1 if stop == -1 else stop
        return found if found is not None and found < limit else count


def _renamed(ssa: Pass, blocks: dict, states: dict) -> dict:
    """Numba's ``_fresh_vars`` for every variable of ``states`` in one pass: each definition after a
    variable's first gets a fresh name, in the order Numba's one-variable passes give them."""
    fresh = ssa.fresh_vars()
    out = {}
    for label, blk in blocks.items():
        body = []
        for stmt in blk.body:
            if isinstance(stmt, ssa.assign_types) and stmt.target.name in states:
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
    """Numba's ``_run_ssa(blocks)``: the same blocks, statements and phi nodes, every variable
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
    fix._stmt_index = _Positions()  # the blocks read below keep their bodies until the pass ends
    out = {}
    for label, blk in blocks.items():
        body = []
        for stmt in blk.body:
            new = stmt
            if not isinstance(stmt, ssa.assign_types):
                used = cache.get(stmt)
            elif isinstance(stmt.value, ssa.inst_types):
                used = cache.get(stmt.value)
            else:  # a variable copied, else a constant, global or argument: nothing used
                used = [stmt.value] if isinstance(stmt.value, ssa.var_types) else []
            names = sorted({v.name for v in used if v.name in order}, key=order.__getitem__)
            found = _replacements(ssa, fix, states, names, stmt, label, blk) if names else {}
            if found and isinstance(stmt, ssa.assign_types):
                if isinstance(stmt.value, ssa.var_types):
                    new = ssa.ir.Assign(target=stmt.target, value=found[stmt.value.name], loc=stmt.loc)
                else:
                    value = copy(stmt.value)
                    ssa.ir_utils.replace_vars_inner(value, found)
                    new = ssa.ir.Assign(target=stmt.target, value=value, loc=stmt.loc)
            elif found:
                new = copy(stmt)
                ssa.ir_utils.replace_vars_stmt(new, found)
            body.append(new)
        out[label] = block = ssa.ir.Block(scope=blk.scope, loc=blk.loc)
        block.body = body
    for v in violators:
        for label, phis in states[v]["phimap"].items():
            out[label].body = phis + out[label].body
    if ssa.compute_cfg(out) != cfg:
        raise ssa.errors.CompilerError("CFG mutated in SSA pass")
    return out


def _module(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ImportError:  # no numba-cuda, or one laid out otherwise
        return None


def pieces(module: str = "numba.cuda.core.ssa") -> Pass | None:
    """The SSA pieces of ``module`` (one of :data:`MODULES`), or None where it lacks one (laid out
    otherwise)."""
    ssa = _module(module)
    names = ("_CacheListVars", "_compute_phi_locations", "_find_defs_violators", "_FixSSAVars", "_FreshVarHandler")
    names += ("_iterated_domfronts", "compute_cfg_from_blocks", "errors", "ir", "ir_utils")
    if ssa is None or not all(hasattr(ssa, name) for name in names):
        return None
    find_def = vars(ssa._FixSSAVars).get("_find_def")
    if find_def is None or "_stmt_index" not in vars(ssa._FixSSAVars):
        return None
    ir = ssa.ir
    return Pass(
        ir,
        ssa.ir_utils,
        ssa.errors,
        ssa.compute_cfg_from_blocks,
        ssa._iterated_domfronts,
        ssa._find_defs_violators,
        ssa._CacheListVars,
        ssa._compute_phi_locations,
        ssa._FreshVarHandler,
        ssa._FixSSAVars,
        find_def,
        getattr(ir, "assign_types", (ir.Assign,)),
        getattr(ir, "inst_types", (ir.Inst,)),
        getattr(ir, "var_types", (ir.Var,)),
    )


def original(module: str = "numba.cuda.core.ssa") -> Any:
    """The ``_run_ssa`` :func:`install` replaced in ``module``, else None."""
    return replaced.original(replaced.module(module), "_run_ssa")


def install(module: str = "numba.cuda.core.ssa") -> bool:
    """Give ``module``'s SSA reconstruction (one of :data:`MODULES`) the per-block rewrite; whether
    it has it now.  Idempotent; a ``_run_ssa`` that is not the one recognised is kept.  Numba's own
    (``numba.core.ssa``) is replaced inside attncomp's compile window only."""
    ssa = _module(module)
    if ssa is None:
        return False
    if replaced.original(ssa, "_run_ssa") is not None:
        return True
    current = getattr(ssa, "_run_ssa", None)
    found = pieces(module)
    if current is None or not _CALLS <= set(current.__code__.co_names) or found is None:
        return False
    windowed = module == "numba.core.ssa"

    def replacement(blocks: dict) -> dict:
        if windowed and not call_types.compiling():
            return current(blocks)
        return run_ssa(found, blocks)

    replaced.replace(ssa, "_run_ssa", lambda _: replacement)
    return True
