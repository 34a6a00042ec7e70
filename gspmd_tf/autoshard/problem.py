"""The search's costs, per class of nodes (clusters.py), all priced by one CostModel.

- node cost of a strategy: its compute per device (multiply-adds divided over the axes
  that split the op, plus one unit per result element a device writes) and the
  all-reduce (for a scattered strategy: reduce-scatter) of a result its contraction
  leaves partial, with the collective's whole latency;
- edge cost between a producer's and a consumer's strategies: the seconds of the reshard
  plan (spmd/planner.plan) from the layout the producer makes to the one the consumer
  needs as the backends price the program (reshard_seconds: whole latencies, slices as
  kernels), per pair of distinct layouts;
- memory rows: per-device bytes live at a few points of the program, counted as
  runtime/memory.py counts the lowered program (arguments and outputs live throughout, an
  intermediate from its op to its last reader), as a linear function of the strategies.

Classes share costs: a class of n nodes counts its node cost n times, and the n edges
between two classes (same operand position) one edge group of count n.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from gspmd_tf.autoshard.strategies import Strategy
from gspmd_tf.cost_model import CostModel
from gspmd_tf.graph.ir import Graph
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import Mesh
from gspmd_tf.registry import multiply_adds
from gspmd_tf.spmd.planner import plan

# Memory is checked at the points where the most bytes are live, replicated and split
# as far as each tensor can be: as many of each.
MEMORY_POINTS = 8


@dataclass
class NodeClass:
    """Nodes that take one strategy together: `members` (node indices), the
    `strategies` they choose from, `node_cost` (seconds per strategy, one member) and
    `leader`: the index of the class whose choice this one follows (its strategies
    listed in the leader's order: follow.py), or -1 when it decides for itself."""

    members: list
    strategies: list
    node_cost: np.ndarray = None
    leader: int = -1


@dataclass
class EdgeGroup:
    """`count` edges from output `out` of class `producer` to operand `operand` of class
    `consumer`: `cost[a, b]` seconds for producer layout a and consumer layout b;
    `source[s]` / `target[s]` the layout index of each producer / consumer strategy."""

    producer: int
    out: int
    consumer: int
    operand: int
    count: int
    cost: np.ndarray
    source: np.ndarray
    target: np.ndarray


@dataclass
class MemoryRow:
    """Per-device bytes live at node `point`: `constant` plus, per class, the bytes of
    each strategy (`coefficients[c][s]`)."""

    point: int
    constant: int
    coefficients: dict = field(default_factory=dict)

    def value(self, choice) -> int:
        """The bytes under `choice` (a strategy index per class)."""
        return self.constant + int(sum(v[choice[c]] for c, v in self.coefficients.items()))


@dataclass
class Problem:
    """What the solver sees: classes, edge groups and memory rows."""

    classes: list
    edges: list
    memory: list


def tensor_bytes(shape, dtype, layout: Layout, mesh: Mesh) -> int:
    """Bytes one device holds of a tensor of `shape` in `layout` (0 for handles)."""
    if dtype in (tf.resource, tf.variant):
        return 0
    return int(np.prod(layout.local_shape(mesh, shape), dtype=np.int64)) * dtype.size


def build(graph: Graph, mesh: Mesh, model: CostModel, class_of: list, strategies: dict,
          leaders: dict, resident_bytes: int) -> Problem:
    """The Problem of `graph` whose node classes are `class_of`; `strategies` maps each
    class that has candidates to its list of Strategies (other nodes keep the layout
    propagation gives them and count as replicated for memory), `leaders` a follower
    class to the class it follows (follow.py); `resident_bytes` are held throughout
    besides the program's tensors (variable shards)."""
    classes = {c: NodeClass([], s) for c, s in strategies.items()}
    for i, c in enumerate(class_of):
        if c in classes:
            classes[c].members.append(i)
    ids = sorted(classes)
    index = {c: k for k, c in enumerate(ids)}
    ordered = [classes[c] for c in ids]
    for c, cls in zip(ids, ordered):
        cls.node_cost = _node_costs(graph, mesh, model, cls)
        cls.leader = index[leaders[c]] if c in leaders else -1
    node_class = [index.get(c, -1) for c in class_of]
    edges = _edge_groups(graph, mesh, model, ordered, node_class)
    rows = _memory_rows(graph, mesh, ordered, node_class, resident_bytes)
    return Problem(ordered, edges, rows)


def _node_costs(graph, mesh, model, cls) -> np.ndarray:
    """Seconds of one member of `cls` per strategy: its multiply-adds over the devices
    that split them plus one unit per result element a device writes, and the
    reduction of a partial result (all-reduce, or reduce-scatter when scattered)."""
    node = graph.nodes[cls.members[0]]
    work = multiply_adds(node, [graph.shape(r) for r in node.inputs])
    costs = []
    for s in cls.strategies:
        seconds = 0.0
        written = 0
        for shape, dtype, layout in zip(node.out_shapes, node.out_dtypes, s.results):
            if layout is None:
                continue
            local = tensor_bytes(shape, dtype, layout, mesh)
            written += int(np.prod(layout.local_shape(mesh, shape), dtype=np.int64))
            if s.scattered:  # the sum reduced is k times the scattered result
                seconds += model.collective_seconds(
                    "reduce-scatter", local * mesh.axes_size(s.partial), s.partial)
            elif s.partial:
                seconds += model.collective_seconds("all-reduce", local, s.partial)
        costs.append(seconds + model.compute_seconds(work / s.divisor + written))
    return np.asarray(costs)


def reshard_seconds(src: Layout, dst: Layout, shape, dtype, mesh: Mesh,
                    model: CostModel) -> float:
    """Seconds of the partitioner's reshard from `src` to `dst` (planner.plan) as the
    backends price the program it emits (base.node_seconds): each collective with its
    whole latency (the planner ranks plans with a fraction of it), each local slice a
    kernel reading the tensor."""
    total = 0.0
    for step in plan(src, dst, shape, dtype, mesh, model) if src != dst else ():
        if step.kind is None:
            total += model.compute_seconds(0, bytes_touched=tensor_bytes(shape, dtype, src,
                                                                         mesh))
        else:
            total += model.collective_seconds(step.kind, step.bytes_in, step.link_axes)
    return total


def _cached(memo: dict, key: tuple, price, mesh: Mesh, model: CostModel) -> float:
    """`price(*key, mesh, model)`, computed once per key in `memo`."""
    if key not in memo:
        memo[key] = price(*key, mesh, model)
    return memo[key]


def _distinct(layouts) -> tuple:
    """(the distinct layouts in order of first appearance, the index of each entry)."""
    order = list(dict.fromkeys(layouts))
    position = {layout: k for k, layout in enumerate(order)}
    return order, np.asarray([position[layout] for layout in layouts])


def _edge_groups(graph, mesh, model, classes, node_class) -> list:
    counts = {}
    for v, node in enumerate(graph.nodes):
        cv = node_class[v]
        if cv < 0:
            continue
        for pos, ref in enumerate(node.inputs):
            cu = node_class[ref.node]
            if cu < 0 or classes[cv].strategies[0].operands[pos] is None:
                continue
            key = (cu, ref.out, cv, pos)
            if key not in counts:
                counts[key] = [0, ref]
            counts[key][0] += 1
    groups = []
    # repeated blocks' tensors share shapes: one reshard plan per distinct case (the
    # planner is most of the search's set-up time on ResNet50 without this)
    seconds = {}
    for (cu, out, cv, pos), (count, ref) in counts.items():
        sources, source = _distinct([s.results[out] for s in classes[cu].strategies])
        targets, target = _distinct([s.operands[pos] for s in classes[cv].strategies])
        shape, dtype = graph.shape(ref), graph.dtype(ref)
        if dtype in (tf.resource, tf.variant):
            continue
        cost = np.asarray([[_cached(seconds, (a, b, tuple(shape), dtype), reshard_seconds,
                                    mesh, model) for b in targets] for a in sources])
        if cost.any():
            groups.append(EdgeGroup(cu, out, cv, pos, count, cost, source, target))
    return groups


def _memory_rows(graph, mesh, classes, node_class, resident_bytes) -> list:
    """Rows at the MEMORY_POINTS fullest points by replicated bytes and as many by bytes
    split as far as each tensor can be."""
    n = len(graph.nodes)
    pinned = [r.node for r in graph.inputs] + [r.node for r in graph.outputs]
    end = np.arange(n)  # the last reader of each node's outputs (itself if none)
    for i, node in enumerate(graph.nodes):
        for ref in node.inputs:
            end[ref.node] = max(end[ref.node], i)
    # bytes per strategy of one member of each class (members share shapes), and the
    # replicated bytes of the nodes no class holds
    class_bytes = [_class_bytes(graph, mesh, cls) for cls in classes]
    node_class = np.asarray(node_class)
    held = node_class >= 0
    free_bytes = np.asarray([0 if held[i] else sum(
        tensor_bytes(sh, dt, Layout.replicated(len(sh)), mesh)
        for sh, dt in zip(node.out_shapes, node.out_dtypes))
        for i, node in enumerate(graph.nodes)], np.int64)
    most = free_bytes.copy()
    least = free_bytes.copy()
    most[held] = [class_bytes[c].max() for c in node_class[held]]
    least[held] = [class_bytes[c].min() for c in node_class[held]]
    always = np.zeros(n, bool)
    always[pinned] = True
    start = np.arange(n)
    points = set()
    for sizes in (most, least):
        # live bytes after each node: a difference array over live ranges
        delta = np.zeros(n + 1, np.int64)
        np.add.at(delta, start[~always], sizes[~always])
        np.add.at(delta, end[~always] + 1, -sizes[~always])
        live = np.cumsum(delta)[:n]
        points.update(int(p) for p in np.argsort(-live, kind="stable")[:MEMORY_POINTS])
    rows = []
    for p in sorted(points):
        alive = always | ((start <= p) & (end >= p))
        row = MemoryRow(p, resident_bytes + int(free_bytes[alive].sum()))
        counts = np.bincount(node_class[alive & held], minlength=len(classes))
        for c in np.flatnonzero(counts):
            row.coefficients[int(c)] = counts[c] * class_bytes[c]
        rows.append(row)
    return rows


def _class_bytes(graph, mesh, cls) -> np.ndarray:
    """Bytes one member of `cls` holds of its outputs, per strategy."""
    node = graph.nodes[cls.members[0]]
    return np.asarray([sum(tensor_bytes(shape, dtype, layout, mesh) for shape, dtype, layout
                           in zip(node.out_shapes, node.out_dtypes, s.results)
                           if layout is not None) for s in cls.strategies], np.int64)
