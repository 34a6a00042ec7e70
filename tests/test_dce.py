"""Dead-code elimination of SPMD programs."""

import tensorflow as tf

from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.graph.dce import eliminate_dead_code


def test_dead_collectives_go_effects_and_inputs_stay():
    g = Graph()
    f32 = tf.float32
    x = Ref(g.add(Node("x", "gt.Input", (), {}, [(4,)], [f32], params={"index": 0})), 0)
    unused = Ref(g.add(Node("unused", "gt.Input", (), {}, [(4,)], [f32],
                            params={"index": 1})), 0)
    g.inputs += [x, unused]
    dead = Ref(g.add(Node("dead", "gt.AllReduce", (x,), {}, [(4,)], [f32],
                          params={"axes": ("a",), "reduce_op": "sum"})), 0)
    g.add(Node("dead_neg", "Neg", (dead,), {}, [(4,)], [f32]))
    handle = Ref(g.add(Node("v", "gt.Input", (), {}, [()], [tf.resource],
                            params={"index": 2})), 0)
    g.inputs.append(handle)
    g.add(Node("assign", "AssignVariableOp", (handle, x), {}, [], []))
    live = Ref(g.add(Node("live", "gt.AllGather", (x,), {}, [(8,)], [f32],
                          params={"axes": ("a",), "dim": 0})), 0)
    g.outputs.append(live)

    pruned = eliminate_dead_code(g)

    assert [n.name for n in pruned.nodes] == ["x", "unused", "v", "assign", "live"]
    assert [pruned.nodes[r.node].name for r in pruned.inputs] == ["x", "unused", "v"]
    assert pruned.nodes[pruned.outputs[0].node].name == "live"
    assign = pruned.nodes[pruned.node_index("assign")]
    assert [pruned.nodes[r.node].name for r in assign.inputs] == ["v", "x"]
