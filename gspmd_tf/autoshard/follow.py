"""Followers: element-wise ops take their operand's layout instead of a decision.

An op whose rule is all PASS and whose result is made of the same factors as one operand
(Relu, Add, Mul, Sqrt, Identity...) is almost never worth resharding around: as in Alpa's
intra-operator pass, it follows that operand's producer. Its strategies are re-listed in
the leader's order (strategy s of the follower: the one whose operand has the layout the
leader's strategy s makes), so both share the leader's variables and the edge between
them costs nothing. Most of an optimizer update and of a layer's element-wise tail then
adds no variable to the integer program.
"""

from __future__ import annotations

from typing import Sequence

from gspmd_tf.graph.ir import Graph, Ref
from gspmd_tf.propagation.oprule import PASS


def follow(graph: Graph, rules: Sequence, class_of: Sequence[int], strategies: dict,
           seeds: dict) -> dict:
    """{follower class: root leader class}; each follower's entry of `strategies` is
    replaced by its list aligned with its leader's. A class follows when every member
    has its leader operand made by the same class (the same output of it), that class is
    not itself, and every leader layout has a strategy of the follower; classes are
    visited in order of first appearance, so a leader is settled before its followers."""
    members = {}
    for i, c in enumerate(class_of):
        members.setdefault(c, []).append(i)
    leaders = {}
    for c in sorted(strategies):
        first = members[c][0]
        position = _leader_operand(graph, rules[first], first, class_of, strategies, seeds)
        if position is None:
            continue
        ref = graph.nodes[first].inputs[position]
        leader = class_of[ref.node]
        if any(class_of[graph.nodes[m].inputs[position].node] != leader
               or graph.nodes[m].inputs[position].out != ref.out for m in members[c]):
            continue
        by_operand = {s.operands[position]: s for s in strategies[c]}
        aligned = [by_operand.get(s.results[ref.out]) for s in strategies[leader]]
        if None in aligned:
            continue
        strategies[c] = aligned
        leaders[c] = leaders.get(leader, leader)
    return leaders


def _leader_operand(graph, rule, node_index, class_of, strategies, seeds):
    """The position of the operand node `node_index` may follow, or None."""
    node = graph.nodes[node_index]
    if rule is None or len(rule.results) != 1 or rule.results[0] is None or \
            any(kind != PASS for kind in rule.factor_kinds) or Ref(node_index, 0) in seeds:
        return None
    own = class_of[node_index]
    for position, dims in enumerate(rule.operands):
        if dims != rule.results[0] or position >= len(node.inputs):
            continue
        producer = class_of[node.inputs[position].node]
        if producer != own and producer in strategies:
            return position
    return None
