"""The propagation encoder: one rule shared among nodes with equal rule keys, and only
them; every op's slots."""

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

import gspmd_tf as gt
from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.layout import Layout
from gspmd_tf.propagation.propagate import encode, run
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


def test_slots_of_many_operand_ops():
    """More slots than the encoder first makes room for (AddN of four operands, five
    slots a node): every op's slots are its operands then its result, in node order."""
    g = Graph()
    f32 = tf.float32
    x = Ref(g.add(Node("x", "Placeholder", (), {}, [(4,)], [f32])), 0)
    g.inputs.append(x)
    for i in range(40):
        x = Ref(g.add(Node(f"sum{i}", "AddN", (x, x, x, x), {}, [(4,)], [f32])), 0)
    g.outputs.append(x)
    mesh = gt.Mesh.abstract((2,), ("x",))
    encoded = encode(g, mesh, {g.inputs[0]: Layout.from_spec(mesh, gt.P("x"), 1)})
    slot_start, slot_tensor = encoded.core_args[6], encoded.core_args[8]
    assert slot_start.tolist() == list(range(0, 5 * 40 + 1, 5))
    assert slot_tensor.tolist() == [t for i in range(40) for t in (i, i, i, i, i + 1)]
    run(encoded)
    assert all(encoded.naxes[:41] == 1)  # the split reached every sum


def test_identity_n_over_forty_tensors_keeps_every_inputs_split(caplog):
    """A rule of more factors than any fixed limit (IdentityN of 40 matrices: 80 factors,
    as a Keras optimizer step's IdentityN has hundreds) propagates and partitions like any
    other: every result keeps its input's split, nothing moves, and no op is reported
    without a rule."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    specs = [gt.P("model", None) if i % 2 else gt.P(None, "data") for i in range(40)]

    def doubled_identities(*xs):
        return [2.0 * y for y in tf.identity_n(list(xs))]

    args = [tf.TensorSpec((8, 4), tf.float32)] * 40
    with caplog.at_level("WARNING", logger="gspmd_tf"):
        lowered = gt.lower(doubled_identities, mesh, in_shardings=specs, args=args)
    assert lowered.output_shardings == [gt.Sharding.from_spec(mesh, s, 2) for s in specs]
    # each part of IdentityN keeps its own split, even where two parts use one mesh axis
    assert lowered.collectives() == []
    assert "no partitioning rule" not in caplog.text
