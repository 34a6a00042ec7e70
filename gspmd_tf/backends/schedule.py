"""The order a backend emits an SPMD program's nodes in, which orders its collectives.

Every collective of a device takes the device's ordering token (collectives.
ordering_token), and collectives on one token are chained in the order they are created
(by tf.function's automatic control dependencies, or the local lowering's own ordering,
ordering.py): a collective
starts only when the one created before it on its device has finished, whatever its
operand. Emitted in program order, a collective whose operand is ready early (a weight's
all-gather, whose variable read the importer places where the graph uses it) waits
behind every collective created before it, and those wait for the compute their operands
need.

`ready_order` emits the program in the order of an estimate of when each node can start
(the heaviest path to it from the program's inputs, each node weighted by its seconds
on the backend's cost model, base.node_seconds), so
the collectives are chained by when their operands are ready: a weight's all-gather
whose variable read is ready at the start goes first, overlapping the compute before
its use, instead of after the collectives of the layers before. It is one order
computed from the program, the same for every device, so all members of a group still
issue their collectives in one consistent order, which TF's collectives over several
devices need (tf.distribute's CollectiveReplicaLauncher gives each device one ordering
token for the same reason; a collective with no token at all joins tf.function's single
chain of stateful ops across every device, where the first collective waits for peers
queued behind it). It is a topological order of the program and the emission stays
node-major, so every cross-device wait still points to nodes created earlier and none
can close a cycle. Nodes that tf.function chains in creation order besides the
collectives (stateful ops, ops on a resource such as a variable's reads and writes,
control-flow ops) keep their program order among themselves, so each variable sees its
reads and writes in the program's order.
"""

from __future__ import annotations

import heapq

import tensorflow as tf

from gspmd_tf.backends import base
from gspmd_tf.cost_model import CostModel
from gspmd_tf.graph.ir import Graph
from gspmd_tf.registry import is_stateful

def program_order(program):
    """The nodes' indices as the program lists them."""
    return range(len(program.nodes))


def ready_order(program: Graph, model: CostModel) -> list:
    """The nodes' indices in the order of start_times on `model` (program order on
    ties), the chained nodes (see the module docstring) in program order among
    themselves."""
    nodes = program.nodes
    start = start_times(program, model)
    needs = [set([ref.node for ref in node.inputs] + list(node.control_inputs))
             for node in nodes]
    previous = None
    for index, node in enumerate(nodes):
        if _chained(program, node):
            if previous is not None:
                needs[index].add(previous)
            previous = index
    missing = [len(deps) for deps in needs]
    releases = [[] for _ in nodes]
    for index, deps in enumerate(needs):
        for dep in deps:
            releases[dep].append(index)
    ready = [(start[i], i) for i in range(len(nodes)) if not missing[i]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, index = heapq.heappop(ready)
        order.append(index)
        for waiting in releases[index]:
            missing[waiting] -= 1
            if not missing[waiting]:
                heapq.heappush(ready, (start[waiting], waiting))
    assert len(order) == len(nodes)
    return order


def _chained(program, node):
    """Whether tf.function orders `node` by creation among other nodes: a stateful TF
    op, a control-flow op, or one with a resource input or output."""
    if node.op in base.COLLECTIVES:  # gt.Permute across workers: pair all-gathers
        return False  # chained by its token: the order being chosen
    if node.regions or tf.resource in node.out_dtypes or \
            any(program.dtype(ref) == tf.resource for ref in node.inputs):
        return True
    return is_stateful(node.op)


def start_times(program: Graph, model: CostModel) -> list:
    """Per node, the estimated time its inputs are ready: the heaviest path to them
    from the program's inputs, a node weighing its seconds on `model`
    (base.node_seconds: compute, or a collective's latency and bytes)."""
    start = [0.0] * len(program.nodes)
    done = [0.0] * len(program.nodes)
    for index, node in enumerate(program.nodes):
        start[index] = max([done[ref.node] for ref in node.inputs] +
                           [done[c] for c in node.control_inputs], default=0.0)
        done[index] = start[index] + base.node_seconds(program, node, model)
    return start
