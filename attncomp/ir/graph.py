"""Use-def graphs of blocks, built with networkx: ordering and liveness.

A node is an op; an edge ``a -> b`` means ``b`` uses a result of ``a``.
Uses from inside an op's regions count as uses by that op.
"""

from __future__ import annotations

import networkx as nx

from attncomp.ir.core import Block, Op, Value


def _used_values(op: Op) -> set[Value]:
    """Operands of ``op`` and values its regions use from outside them."""
    used = set(op.operands)
    for region in op.regions:
        inner = set(region.args)
        for inner_op in region.ops:
            used |= _used_values(inner_op) - inner
            inner |= set(inner_op.results)
    return used


def use_def_graph(block: Block) -> nx.DiGraph:
    graph = nx.DiGraph()
    producer: dict[Value, Op] = {}
    for op in block.ops:
        graph.add_node(op)
        for value in _used_values(op):
            if value in producer:
                graph.add_edge(producer[value], op)
        for result in op.results:
            producer[result] = op
    return graph


def users(block: Block) -> dict[Value, list[Op]]:
    """For each value defined or used in ``block``, the ops of ``block`` using it."""
    table: dict[Value, list[Op]] = {}
    for op in block.ops:
        for value in _used_values(op):
            table.setdefault(value, []).append(op)
    return table


def live_ops(block: Block) -> set[Op]:
    """Ops that the block's terminator or its checks (ops with an effect) depend on, directly or not."""
    if not block.ops:
        return set()
    from attncomp.ir.ops import OP_DEFS

    graph = use_def_graph(block)
    roots = [block.ops[-1]] + [op for op in block.ops if op.name in OP_DEFS and OP_DEFS[op.name].effect]
    live = set(roots)
    for root in roots:
        live |= nx.ancestors(graph, root)
    return live


def remove_dead_ops(block: Block) -> int:
    """Drop ops whose results nothing live uses; returns how many were dropped."""
    live = live_ops(block)
    before = len(block.ops)
    block.ops = [op for op in block.ops if op in live]
    for op in block.ops:
        for region in op.regions:
            remove_dead_ops(region)
    return before - len(block.ops)


def topological_order(block: Block) -> list[Op]:
    """The block's ops in a dependency order, ties broken by current position."""
    position = {op: k for k, op in enumerate(block.ops)}
    graph = use_def_graph(block)
    return list(nx.lexicographical_topological_sort(graph, key=position.__getitem__))
