"""Rows picked by a data-dependent Where and only summed: masked instead of picked.

TF's gradient of a ConcatV2 (axis 0) that receives a sparse gradient (IndexedSlices, e.g.
from a GatherV2) gives each input the rows whose indices fall in its range:

    keep = Squeeze(Where(LogicalAnd(indices >= start, indices < end)))
    values_i, indices_i = GatherV2(values, keep), GatherV2(indices, keep) - start

and the sparse gradient becomes dense with UnsortedSegmentSum(values_i, indices_i, n).
The number of kept rows depends on the index values, so no static shape exists. When
every use of the picked rows ends in UnsortedSegmentSums (the values as data, the
indices, less a scalar, as ids; through ConcatV2 on axis 0, Identity, Cast), keeping ALL
the rows, those outside the mask zeroed, sums the same, in the same order: each pick
GatherV2(x, keep) becomes Select(mask, x, 0). A zeroed row's index becomes 0 - start:
dropped by the sum when negative, else it adds zeros. A Where nothing needs (the
gradient of a concat input no one asked for: the tape differentiates every input, seed
38 #9023) is dropped with everything computed from it. Other uses keep the unknown shape
(a ShardingError from fold).
"""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf.graph.ir import Node, Ref
from gspmd_tf.graph.dce import live_nodes

# ops a picked row passes through unchanged (see _only_summed for Sub and ConcatV2)
_ROWWISE = frozenset({"Identity", "Cast"})
_SUM = "UnsortedSegmentSum"


def mask_summed_row_picks(graph):
    """Rewrite (in place) the picks of rows by a 1-D Where whose rows are only summed,
    see the module docstring. The rewritten tensors leave graph.unknown_shapes (the
    importer's tensors of unknown shape); fold infers their consumers' shapes. Returns
    `graph`."""
    unknown = getattr(graph, "unknown_shapes", None) or {}
    wheres = sorted(ref.node for ref in unknown
                    if ref.out == 0 and graph.nodes[ref.node].op == "Where")
    if not wheres:  # (other unknown shapes are common: no graph walk for them)
        return graph
    users = graph.consumers()
    live = live_nodes(graph)
    dead = set()
    zeros_for = {}  # gather node index -> ZerosLike node to insert before it
    for w in wheres:
        node = graph.nodes[w]
        if not live[w]:  # then nothing computed from it is live either
            dead.update(_computed_from(users, w))
            continue
        mask = node.inputs[0]
        if (mask in unknown or len(graph.shape(mask)) != 1
                or graph.dtype(mask) != tf.bool):
            continue
        gathers = _row_gathers(graph, users, w, graph.shape(mask)[0])
        if gathers is None or not _only_summed(graph, users, gathers, unknown):
            continue
        for g in gathers:
            gather = graph.nodes[g]
            x = gather.inputs[0]
            zeros_for[g] = Node(f"{gather.name}/masked_rows", "ZerosLike", [x],
                                attrs={"T": gather.attrs["Tparams"]},
                                out_shapes=[graph.shape(x)], out_dtypes=[graph.dtype(x)])
            gather.op = "Select"
            gather.inputs = [mask, x]  # the zeros are appended once inserted
            gather.attrs = {"T": gather.attrs["Tparams"]}
            gather.out_shapes = [graph.shape(x)]
            unknown.pop(Ref(g, 0), None)
        dead.update([w] + [q for q, _ in users[w]])  # the Where and its Squeezes: unused
    for i in dead:
        for k in range(len(graph.nodes[i].out_shapes)):
            unknown.pop(Ref(i, k), None)
    if dead:
        _insert_and_drop(graph, zeros_for, dead)
    return graph


def _computed_from(users, start):
    """Node `start` and every node that reads it, directly or not."""
    found, todo = {start}, [start]
    while todo:
        for user, _ in users[todo.pop()]:
            if user not in found:
                found.add(user)
                todo.append(user)
    return found


def _row_gathers(graph, users, where, rows):
    """The GatherV2 nodes (axis 0) picking rows of a [rows, ...] tensor by
    Squeeze(Where), the only uses of the Where; None when there are other uses."""
    gathers = []
    for squeeze, _ in users[where]:
        node = graph.nodes[squeeze]
        if node.op != "Squeeze" or node.attr("squeeze_dims") not in ([1], [-1]):
            return None
        for g, pos in users[squeeze]:
            gather = graph.nodes[g]
            axis = graph.const_value(gather.inputs[2]) if gather.op == "GatherV2" else None
            if (pos != 1 or axis is None or int(axis) != 0 or gather.attr("batch_dims")
                    or graph.shape(gather.inputs[0])[:1] != (rows,)):
                return None
            gathers.append(g)
    return gathers or None


def _only_summed(graph, users, starts, unknown):
    """Whether every use of the rows picked by the nodes `starts` (transitively) ends in
    UnsortedSegmentSums, each reached both as data (through ConcatV2 on axis 0, Identity,
    Cast: the zeroed rows stay zero) and as ids (also through a Sub of a scalar: a zeroed
    row's id becomes 0 - start, dropped or adding zeros)."""
    sums = {0: set(), 1: set()}
    outputs = {ref.node for ref in graph.outputs}
    seen, todo = set(), [(i, False) for i in starts]
    while todo:
        i, shifted = todo.pop()
        if (i, shifted) in seen:
            continue
        if i in outputs:
            return False
        seen.add((i, shifted))
        for user, pos in users[i]:
            node = graph.nodes[user]
            if node.op == _SUM and pos in (0, 1) and not (shifted and pos == 0):
                sums[pos].add(user)
                continue
            if node.op == "Sub":
                other = node.inputs[1]
                if pos != 0 or other in unknown or graph.shape(other) != ():
                    return False
            elif node.op == "ConcatV2":
                axis = graph.const_value(node.inputs[-1])
                if axis is None or int(axis) != 0 or pos == len(node.inputs) - 1:
                    return False
            elif node.op not in _ROWWISE:
                return False
            todo.append((user, shifted or node.op == "Sub"))
    return bool(sums[0]) and sums[0] == sums[1]


def _insert_and_drop(graph, zeros_for, dead):
    """Insert each ZerosLike node before its Select (a gather index) and append it as
    the Select's third input; drop the `dead` nodes; renumber the graph."""
    old_nodes = graph.nodes
    new_index = {}
    zeros_index = {}
    graph.nodes, graph._by_name = [], {}
    for i, node in enumerate(old_nodes):
        if i in dead:
            continue
        if i in zeros_for:
            zeros_index[i] = graph.add(zeros_for[i])
        new_index[i] = graph.add(node)
    renumber(graph, new_index)
    for i, z in zeros_index.items():
        graph.nodes[new_index[i]].inputs.append(Ref(z, 0))


def renumber(graph, new_index, new_ref=None):
    """Point every Ref and node index of `graph` (nodes already in their new places) at
    the new numbering: old node index -> `new_index` (control edges on a node not in
    it are dropped); `new_ref` maps (old node, out) to a Ref for outputs moved to a node
    of their own."""
    new_ref = new_ref or {}

    def remap(ref):
        return new_ref.get((ref.node, ref.out)) or Ref(new_index[ref.node], ref.out)

    def kept(ref):  # annotations and aliases of dropped nodes go with them
        return (ref.node, ref.out) in new_ref or ref.node in new_index

    for node in graph.nodes:
        node.inputs = [remap(r) for r in node.inputs]
        node.control_inputs = [new_index[c] for c in node.control_inputs if c in new_index]
    graph.inputs = [remap(r) for r in graph.inputs]
    graph.outputs = [remap(r) for r in graph.outputs]
    graph.annotations = {remap(r): s for r, s in graph.annotations.items() if kept(r)}
    graph.aliases = {name: remap(r) for name, r in graph.aliases.items() if kept(r)}
    unknown = getattr(graph, "unknown_shapes", None)
    if unknown:  # renumbered in place: fold holds it
        moved = {remap(r): s for r, s in unknown.items()}
        unknown.clear()
        unknown.update(moved)
