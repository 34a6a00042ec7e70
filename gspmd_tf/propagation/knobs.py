"""Shardy's control knobs on propagation: sharding groups and user priorities.

A sharding group (Shardy's sdy.sharding_group) is a set of tensors of one shape that
must share a sharding: propagation sees one extra "gt.Tie" node per group (the identity
rule control flow uses for a loop's carried values, propagation/regions.py), so the
most-split sharding any member gets from the rest of the graph reaches them all.

User priorities (Shardy's p0, p1, ...): annotations propagate in rounds, lowest
priority number first. Round k seeds the annotations of priority <= k (fixed) and
starts every other tensor from what round k-1 gave it (axes only ever get appended),
so what a p0 annotation decided is in place before a p1 annotation competes with it.
Annotations and in/out_shardings without a priority are p0.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import tensorflow as tf

from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.propagation.regions import TIE, FlatGraph, flat_copy

# what gt.sharding_group and gt.mesh_split(priority=...) leave on the traced tf.Graph
GROUPS_ATTR, PRIORITIES_ATTR = "_gt_sharding_groups", "_gt_priorities"


def sharding_group(tensor, group):
    """Ask for `tensor` to share one sharding with every other tensor of traced code
    given the same `group` (any hashable; the tensors must have one shape), as Shardy's
    sharding groups: propagation gives them all the most-split sharding any of them
    gets. Returns the tensor to use in its place (an identity); outside a trace it
    returns `tensor` unchanged."""
    if tf.executing_eagerly():
        return tensor
    out = tf.identity(tensor)
    _graph_dict(GROUPS_ATTR)[out.op.name] = group
    return out


def record_priority(tensor, priority: int) -> None:
    """Record the user priority of annotated `tensor` (an XlaSharding op's output) on
    the graph being traced (gt.mesh_split(..., priority=)."""
    if not isinstance(priority, int) or priority < 0:
        raise ShardingError(f"priority={priority!r}: give an int >= 0 (0 propagates first)")
    _graph_dict(PRIORITIES_ATTR)[tensor.op.name] = priority


def _graph_dict(attr):
    graph = tf.compat.v1.get_default_graph()
    if not hasattr(graph, attr):
        setattr(graph, attr, {})
    return getattr(graph, attr)


def traced_knobs(source_graph, graph: Graph):
    """({Ref: priority}, [[Ref, ...] per group]) of imported `graph` from what its
    traced tf.Graph `source_graph` records (nothing for None)."""
    if source_graph is None:
        return {}, []
    priorities = {}
    for name, priority in getattr(source_graph, PRIORITIES_ATTR, {}).items():
        priorities[graph.ref(name)] = priority
    groups = {}
    for name, group in getattr(source_graph, GROUPS_ATTR, {}).items():
        groups.setdefault(group, []).append(graph.ref(name))
    return priorities, [refs for refs in groups.values() if len(refs) > 1]


def tie_groups(flat: Graph, groups: Sequence[Sequence[Ref]]) -> Graph:
    """`flat` (a graph as propagation sees it) with a Tie node per group appended; a
    FlatGraph copy when `flat` has none of its own (the user's graph stays as it is)."""
    if not groups:
        return flat
    if not isinstance(flat, FlatGraph):
        flat = flat_copy(flat)
    for k, refs in enumerate(groups):
        shapes = {tuple(flat.shape(r)) for r in refs}
        if len(shapes) != 1:
            names = [flat.tensor_name(r) for r in refs]
            raise ShardingError(f"sharding group {names} holds tensors of shapes "
                                f"{sorted(shapes)}: a group's tensors must have one shape")
        flat.add(Node(f"gt_sharding_group_{k}", TIE, list(refs), out_shapes=[shapes.pop()],
                      out_dtypes=[flat.dtype(refs[0])]))
    return flat


def rounds(seeds: Mapping[Ref, object], priorities: Mapping[Ref, int]) -> list:
    """The seeds of each propagation round, by priority (see the module doc): one dict
    per distinct priority, each holding the seeds of that priority and lower."""
    levels = sorted({priorities.get(ref, 0) for ref in seeds})
    return [{ref: layout for ref, layout in seeds.items() if priorities.get(ref, 0) <= level}
            for level in levels]
