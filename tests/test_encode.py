"""The propagation encoder shares one rule among nodes with equal rule keys, and only them."""

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

import gspmd_tf as gt
from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.propagation.propagate import encode
from gspmd_tf.registry import rule_for


def _graph():
    """AddN(a, c) with c a constant, and AddN(a, a, a): same op type, shapes and output,
    different inputs; a key that mixed constant ids with shape ids would mistake one for
    the other."""
    g = Graph()
    f32 = tf.float32
    a = Ref(g.add(Node("a", "Placeholder", (), {}, [(3,)], [f32])), 0)
    value = np.asarray([1.0, 2.0, 3.0], np.float32)
    c = Ref(g.add(Node("c", "Const", (), {
        "value": attr_value_pb2.AttrValue(tensor=tf.make_tensor_proto(value)),
        "dtype": attr_value_pb2.AttrValue(type=f32.as_datatype_enum)}, [(3,)], [f32])), 0)
    g.inputs.append(a)
    two = g.add(Node("two", "AddN", (a, c), {}, [(3,)], [f32]))
    three = g.add(Node("three", "AddN", (a, a, a), {}, [(3,)], [f32]))
    g.outputs += [Ref(two, 0), Ref(three, 0)]
    return g, two, three


def test_each_node_gets_its_own_rule():
    g, two, three = _graph()
    mesh = gt.Mesh.abstract((2,), ("x",))
    rules = encode(g, mesh, {}).rules
    assert len(rules[two].operands) == 2
    assert len(rules[three].operands) == 3
    for index, node in enumerate(g.nodes):
        assert rules[index] == rule_for(g, node), node.name
