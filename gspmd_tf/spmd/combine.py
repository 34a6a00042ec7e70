"""All-reduce combiner: independent small all-reduces of an SPMD program become one.

Every collective has a fixed cost beside its bytes (on TF's CPU collectives: the launch,
the rendezvous of the group's devices, the ordering token), so a training step's many
small gradient all-reduces are latency-bound. As XLA's AllReduceCombiner does, gt.AllReduce
nodes with the same axes, reduce op and dtype, none reading another's result, are merged:
each operand flattened, one concat, one all-reduce, one split, each piece reshaped
back. Only all-reduces of at most `threshold` bytes are merged, at most GROUP_FACTOR
of the threshold's worth into one: large ones are bandwidth-bound, and the concat and
split would only add copies. The partitioner's threshold is the size below which the
cost model (gspmd_tf/cost_model.py) finds an all-reduce latency-bound: 256 KiB on one
process's devices, where benchmarks/all_reduce_combiner.py measured combining to stop
paying (benchmarks/RESULTS.md, "All-reduce combiner": 1 KiB gradients merged 5x
faster, 64 KiB 3x, 1 or 4 MiB not at all).

The pass schedules the program once, in order, with one open group per (axes, reduce
op, dtype). A node that reads an open group's member (as data or control input, or
through such a node) is deferred when it is a pure TF op: it moves after the group's
combined all-reduce. Any other such node (a stateful TF op, a collective, an op without
outputs) first flushes the groups it depends on: their combined all-reduces are emitted
there, then the deferred nodes that no open group holds back, then the node. A group is
also flushed when the next member would pass the group's limit, and at the end. Members'
operands never depend on their group (that dependence would have flushed it), stateful
ops keep their order (tf.function orders them by creation), and every device runs the
same schedule, so collectives stay matched. XLA checks reachability between candidates
and leaves placement to its scheduler; this pass has no scheduler after it, so it places
the combined all-reduce itself.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import numpy as np
import tensorflow as tf

from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.graph.dce import compact, has_effect
from gspmd_tf.spmd.program import attr_value

ALL_REDUCE = "gt.AllReduce"
# a combined all-reduce carries at most this many thresholds' worth of bytes
GROUP_FACTOR = 16
_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)


def threshold_bytes(default: int) -> int:
    """GSPMD_TF_ALL_REDUCE_COMBINE_BYTES when set (0 turns the combiner off), else
    `default` (the partitioner's: the backend's answer, else the size below which the
    cost model finds an all-reduce latency-bound, CostModel.combine_threshold_bytes):
    the largest all-reduce (operand bytes per device) combined."""
    text = os.environ.get("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES")
    if text is None:
        return default
    try:
        value = int(text)
        if value < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"GSPMD_TF_ALL_REDUCE_COMBINE_BYTES={text!r}: give a number of "
                         "bytes >= 0 (0 turns the all-reduce combiner off)") from None
    return value


def combine_all_reduces(graph, threshold: int, live=None, origins=None):
    """`graph` (an SPMD program) with its independent small all-reduces merged (see the
    module doc); `threshold` in bytes. The nodes are moved into the returned graph, as
    dce.eliminate_dead_code does. `live` (dce.live_nodes of `graph`) drops the dead
    nodes in the same pass: the program is renumbered once. `origins` (collective node
    name -> provenance.Origins, ProgramBuilder.origins) gains each combined all-reduce's
    entry: the origins of all its members, in program order."""
    order = _schedule(graph, threshold, live)
    if not any(isinstance(item, list) for item in order):
        return graph if live is None else compact(graph, live)
    return _rebuild(graph, order, {} if origins is None else origins)


def _operand_bytes(graph, node):
    """Bytes of an all-reduce's operand, or None when `node` cannot be combined."""
    if node.op != ALL_REDUCE or node.out_dtypes[0] not in _DTYPES:
        return None
    return math.prod(graph.shape(node.inputs[0])) * node.out_dtypes[0].size


class _Group:
    """An open group of all-reduces of one (axes, reduce op, dtype)."""

    def __init__(self, key):
        self.key = key
        self.members = []
        self.bytes = 0


def _schedule(graph, threshold, live=None):
    """The new program order: a list of old node indices and lists of node indices (a
    group of all-reduces merged there, in program order); nodes not `live` are left out."""
    order = []
    open_groups = {}  # key -> _Group
    holds = {}        # member or deferred node -> the open groups it depends on
    deferred = []     # deferred node indices, in program order

    def flush(groups):
        for group in groups:
            del open_groups[group.key]
            order.append(group.members if len(group.members) > 1 else group.members[0])
            for m in group.members:
                del holds[m]
        waiting = []
        for i in deferred:
            holds[i] -= groups
            if holds[i]:
                waiting.append(i)
            else:
                del holds[i]
                order.append(i)
        deferred[:] = waiting

    for index, node in enumerate(graph.nodes):
        if live is not None and not live[index]:
            continue
        held = [holds[i] for i in _reads(node) if i in holds] if holds else None
        depends = set().union(*held) if held else _NOTHING
        if depends and not node.op.startswith("gt.") and not has_effect(node):
            holds[index] = depends
            deferred.append(index)
            continue
        if depends:
            flush(depends)
        size = _operand_bytes(graph, node) if node.op == ALL_REDUCE else None
        if size is None or size > threshold:
            order.append(index)
            continue
        key = (tuple(node.params["axes"]), node.params["reduce_op"], node.out_dtypes[0])
        if key in open_groups and open_groups[key].bytes + size > GROUP_FACTOR * threshold:
            flush({open_groups[key]})
        group = open_groups.setdefault(key, _Group(key))
        group.members.append(index)
        group.bytes += size
        holds[index] = {group}
    flush(set(open_groups.values()))
    return order


_NOTHING = frozenset()  # the open groups a node that reads none of them depends on


def _reads(node):
    """Indices of the nodes `node` reads (data and control inputs)."""
    return [ref.node for ref in node.inputs] + list(node.control_inputs)


class _Rebuilt:
    """The new program being built: nodes copied or made, old refs mapped to new ones.

    Old output k of node i is new output k of node index[i]: a merged all-reduce's
    member (one output) maps to the Reshape that gives back its piece."""

    def __init__(self, graph, order, origins):
        self.old = graph
        self.origins = origins
        self.graph = Graph()
        self.index = [-1] * len(graph.nodes)  # old node index -> new node index
        self.names = {graph.nodes[i].name for item in order
                      for i in (item if isinstance(item, list) else (item,))}
        self.consts = {}  # (shape, bytes) -> Ref of an int32 Const

    def ref(self, old):
        """The new Ref of old Ref `old`."""
        return Ref(self.index[old.node], old.out)

    def copy(self, i, node):
        index = self.index
        node.inputs = [Ref(index[r.node], r.out) for r in node.inputs]
        if node.control_inputs:
            node.control_inputs = [index[c] for c in node.control_inputs]
        index[i] = self.graph.add(node)

    def add(self, name, op, inputs, shapes, dtype, attrs=None, params=None):
        """A new node named `name` (made unique) with outputs of `shapes`; its Refs."""
        unique, k = name, 0
        while unique in self.names:
            k += 1
            unique = f"{name}_{k}"
        self.names.add(unique)
        node = Node(unique, op, inputs, {k: attr_value(v) for k, v in (attrs or {}).items()},
                    shapes, [dtype] * len(shapes), params=params)
        index = self.graph.add(node)
        return [Ref(index, k) for k in range(len(shapes))]

    def const(self, value):
        """An int32 constant, one node per value (TensorProtos are slow to build)."""
        value = np.asarray(value, np.int32)
        key = (value.shape, value.tobytes())
        if key not in self.consts:
            self.consts[key] = self.add(f"combined_all_reduce/const_{len(self.consts)}",
                                        "Const", [],
                                        [value.shape], tf.int32,
                                        attrs={"value": value, "dtype": tf.int32})[0]
        return self.consts[key]

    def combined(self, members):
        """The merged all-reduce of old nodes `members`, at the current position."""
        nodes = [self.old.nodes[m] for m in members]
        last = nodes[-1]
        dtype = last.out_dtypes[0]
        stem = f"{last.name}/combined"
        sizes = [math.prod(node.out_shapes[0]) for node in nodes]
        flats = [self.add(f"{stem}/flat_{j}", "Reshape",
                          [self.ref(node.inputs[0]), self.const([size])], [(size,)], dtype,
                          attrs={"T": dtype, "Tshape": tf.int32})[0]
                 for j, (node, size) in enumerate(zip(nodes, sizes))]
        total = sum(sizes)
        (concat,) = self.add(f"{stem}/concat", "ConcatV2", flats + [self.const(0)],
                             [(total,)], dtype,
                             attrs={"N": len(flats), "T": dtype, "Tidx": tf.int32})
        (reduced,) = self.add(stem, ALL_REDUCE, [concat], [(total,)], dtype,
                              params=dict(last.params))
        self.origins[self.graph.nodes[reduced.node].name] = tuple(
            replace(origin, bytes=0 if origin.shared else _operand_bytes(self.old, node))
            for node in nodes for origin in self.origins.get(node.name, ()))
        pieces = self.add(f"{stem}/split", "SplitV",
                          [reduced, self.const(sizes), self.const(0)],
                          [(size,) for size in sizes], dtype,
                          attrs={"num_split": len(sizes), "T": dtype, "Tlen": tf.int32})
        for m, node, piece in zip(members, nodes, pieces):
            shape = node.out_shapes[0]
            (ref,) = self.add(f"{node.name}/split", "Reshape", [piece, self.const(shape)],
                              [shape], dtype, attrs={"T": dtype, "Tshape": tf.int32})
            self.index[m] = ref.node


def _rebuild(graph, order, origins):
    """The program in schedule `order` (see _schedule), groups merged (their `origins`
    recorded, see combine_all_reduces)."""
    out = _Rebuilt(graph, order, origins)
    for item in order:
        if isinstance(item, list):
            out.combined(item)
        else:
            out.copy(item, graph.nodes[item])
    out.graph.inputs = [out.ref(r) for r in graph.inputs]
    out.graph.outputs = [out.ref(r) for r in graph.outputs]
    return out.graph
