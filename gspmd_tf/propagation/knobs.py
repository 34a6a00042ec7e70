"""Shardy's control knobs on propagation: sharding groups, user priorities and
propagation barriers.

A sharding group (Shardy's sdy.sharding_group) is a set of tensors of one shape that
must share a sharding: propagation sees one extra "gt.Tie" node per group (the identity
rule control flow uses for a loop's carried values, propagation/regions.py), so the
most-split sharding any member gets from the rest of the graph reaches them all.

User priorities (Shardy's p0, p1, ...): annotations propagate in rounds, lowest
priority number first. Round k seeds the annotations of priority <= k (fixed) and
starts every other tensor from what round k-1 gave it (axes only ever get appended),
so what a p0 annotation decided is in place before a p1 annotation competes with it.
Annotations and in/out_shardings without a priority are p0.

Open dims (Shardy's open dimension shardings, XLA's unspecified_dims, JAX's
P.UNCONSTRAINED): gt.mesh_split(..., open_dims=(d, ...)) keeps the axes the spec gives
those dims and lets propagation add more (a dim the spec leaves None is then fully
propagation's); the other dims stay exactly as given. They are the XlaSharding op's
`unspecified_dims` attr, so TF's own xla_sharding.mesh_split(unspecified_dims=...)
means the same.

A propagation barrier (Shardy's sdy.propagation_barrier) is an identity shardings pass
one way only: "forward" (operand to result), "backward" (result to operand) or "none";
the core never extends the tensor on the closed side through it (no_write slots). The
identity itself is partitioned like any: where its two sides differ, it reshards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.propagation.regions import TIE, FlatGraph, flat_copy

# what gt.sharding_group and gt.mesh_split(priority=...) leave on the traced tf.Graph
GROUPS_ATTR, PRIORITIES_ATTR = "_gt_sharding_groups", "_gt_priorities"
BARRIERS_ATTR = "_gt_propagation_barriers"
DIRECTIONS = ("forward", "backward", "none")


@dataclass
class Knobs:
    """What a traced program asks of propagation: `priorities` {annotated Ref: int},
    `groups` (lists of Refs sharing a sharding), `barriers` {node index: allowed
    direction}, `open_dims` {annotated Ref: its open dims}."""

    priorities: dict = field(default_factory=dict)
    groups: list = field(default_factory=list)
    barriers: dict = field(default_factory=dict)
    open_dims: dict = field(default_factory=dict)


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


def propagation_barrier(tensor, allowed_direction: str = "none"):
    """`tensor` through an identity that propagation crosses only in
    `allowed_direction`: "forward" (its sharding reaches the result, not back),
    "backward" (the result's reaches `tensor`, not forward) or "none" (neither), as
    Shardy's propagation barrier. Returns the identity's output (`tensor` outside a
    trace)."""
    if allowed_direction not in DIRECTIONS:
        raise ShardingError(f"allowed_direction={allowed_direction!r}: use one of "
                            f"{list(DIRECTIONS)}")
    if tf.executing_eagerly():
        return tensor
    out = tf.identity(tensor)
    _graph_dict(BARRIERS_ATTR)[out.op.name] = allowed_direction
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


def traced_knobs(source_graph, graph: Graph) -> Knobs:
    """The Knobs of imported `graph`: what its traced tf.Graph `source_graph` records
    (None: nothing) and the open dims its XlaSharding ops carry."""
    open_dims = {}
    for ref in graph.annotations:
        node = graph.nodes[ref.node]
        dims = node.attr("unspecified_dims") if node.op == "XlaSharding" else None
        if dims:
            open_dims[ref] = tuple(int(d) for d in dims)
    if source_graph is None:
        return Knobs(open_dims=open_dims)
    priorities = {graph.ref(name): priority for name, priority
                  in getattr(source_graph, PRIORITIES_ATTR, {}).items()}
    groups = {}
    for name, group in getattr(source_graph, GROUPS_ATTR, {}).items():
        groups.setdefault(group, []).append(graph.ref(name))
    barriers = {graph.node_index(name): direction for name, direction
                in getattr(source_graph, BARRIERS_ATTR, {}).items()}
    return Knobs(priorities, [refs for refs in groups.values() if len(refs) > 1], barriers,
                 open_dims)


def barrier_slots(op_node, slot_start, barriers: Mapping[int, str]) -> Optional[np.ndarray]:
    """The core's no_write array (one entry per slot) closing each barrier's
    disallowed side (None without barriers); `op_node`/`slot_start` as Encoded has
    them (a barrier's slots: its operand, then its result)."""
    if not barriers:
        return None
    no_write = np.zeros(int(slot_start[-1]), np.uint8)
    for op in np.flatnonzero(np.isin(op_node, list(barriers))).tolist():
        direction = barriers[int(op_node[op])]
        start, stop = int(slot_start[op]), int(slot_start[op + 1])
        if direction != "forward":  # the result is not written
            no_write[stop - 1] = 1
        if direction != "backward":  # nor the operand
            no_write[start:stop - 1] = 1
    return no_write


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
