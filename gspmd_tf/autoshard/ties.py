"""Ties: AUTO inputs that meet in element-wise ops share one decision.

An optimizer's state (Adam's m and v, momentum, any slot) is combined with its weight and
the weight's gradient element by element: `w - lr * m / (sqrt(v) + eps)`. Decided apart
(clustering goes by name, and `m` is not named like `w`), a slot could take another
layout than its weight, and every step would then reshard one of them for the update.
So AUTO inputs connected through ops whose rule is all PASS and whose operand has the
result's shape (no broadcast: `lr * m` links m to the product, not lr) take one decision,
as the search decides a class: the slot follows its weight.
"""

from __future__ import annotations

from typing import Sequence

from gspmd_tf.disjoint_sets import DisjointSets
from gspmd_tf.graph.ir import Graph
from gspmd_tf.propagation.oprule import PASS


def tied_inputs(graph: Graph, rules: Sequence, auto_nodes: Sequence[int]) -> dict:
    """{AUTO input node: the first AUTO input node (in `auto_nodes` order) of its
    element-wise component} for every AUTO input tied to an earlier one."""
    sets = DisjointSets()
    for i, node in enumerate(graph.nodes):
        rule = rules[i]
        if rule is None or node.regions or len(node.out_shapes) != 1 or \
                any(kind != PASS for kind in rule.factor_kinds):
            continue
        shape = tuple(node.out_shapes[0])
        for ref in node.inputs:
            if tuple(graph.shape(ref)) == shape and graph.dtype(ref) == node.out_dtypes[0]:
                sets.union(i, ref.node)
    first, ties = {}, {}
    for i in auto_nodes:
        leader = first.setdefault(sets.find(i), i)
        if leader != i:
            ties[i] = leader
    return ties
