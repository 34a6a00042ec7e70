"""Dead-code elimination of a graph in topological order: which nodes its outputs or side
effects need (live_nodes), and the graph of those (eliminate_dead_code, compact).

The graph clean-ups use it (sparse_rows.py); so does the partitioner, on the SPMD
program: the partitioner emits what each op needs and reshards results to their propagated
layouts, so some emitted nodes are never read: a reshard to a layout no consumer takes, a
handler's operand resharded again. TF would keep the dead collectives among them (they are
stateful) and run them on every device. Since the program is the same on every device, a
node dead on one device is dead on all, and dropping it keeps collectives matched.
"""

from __future__ import annotations

from gspmd_tf.graph.ir import Graph, Ref
from gspmd_tf.registry import is_stateful

_ALWAYS_KEPT = frozenset({"gt.Input"})  # program inputs keep their positions


def has_effect(node):
    """Whether a node must run even when nothing reads it: a program input, a TF op with
    no outputs (variable updates) or a stateful TF op (its state would change otherwise).
    gt.* collectives and shard indices are pure functions of their operands
    (registry.is_stateful: an op TF does not know counts as stateful)."""
    if node.op in _ALWAYS_KEPT:
        return True
    if node.op.startswith("gt."):
        return False
    return not node.out_shapes or is_stateful(node.op)


def eliminate_dead_code(graph):
    """The graph of the nodes of `graph` that its outputs or side effects need (the kept
    nodes are moved into it, their inputs renumbered)."""
    return compact(graph, live_nodes(graph))


def live_nodes(graph):
    """Per node of `graph` (in topological order, as every SPMD program is), whether
    its outputs or side effects need it (one sweep back from the last node)."""
    nodes = graph.nodes
    live = [False] * len(nodes)
    for ref in graph.outputs:
        live[ref.node] = True
    # One sweep from the last node: a node reads only nodes before it (the builder
    # appends), so its liveness is settled when the sweep reaches it.
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if not live[i]:
            if not has_effect(node):
                continue
            live[i] = True
        for ref in node.inputs:
            live[ref.node] = True
        for c in node.control_inputs:
            live[c] = True
    return live


def compact(graph, keep):
    """The graph of the nodes of `graph` whose `keep` entry is true, in order (moved into
    it, their inputs renumbered); kept nodes must read only kept nodes."""
    new_index = [-1] * len(graph.nodes)
    pruned = Graph()
    for i, node in enumerate(graph.nodes):
        if not keep[i]:
            continue
        node.inputs = [Ref(new_index[r.node], r.out) for r in node.inputs]
        node.control_inputs = [new_index[c] for c in node.control_inputs]
        new_index[i] = pruned.add(node)
    pruned.inputs = [Ref(new_index[r.node], r.out) for r in graph.inputs]
    pruned.outputs = [Ref(new_index[r.node], r.out) for r in graph.outputs]
    return pruned
