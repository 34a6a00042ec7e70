"""backends/graph_ops.py: the lean op creation makes the op Graph._create_op_internal
makes (type, attrs, inputs, device, control inputs), and falls back to it where a graph
state it does not handle is active."""

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import func_graph, ops

from gspmd_tf.backends import graph_ops

DEVICE = "/job:localhost/replica:0/task:0/device:CPU:3"


def _concat_attrs(n):
    return {"N": attr_value_pb2.AttrValue(i=n),
            "T": attr_value_pb2.AttrValue(type=tf.float32.as_datatype_enum),
            "Tidx": attr_value_pb2.AttrValue(type=tf.int32.as_datatype_enum)}


def _described(op):
    """What makes an op the op it is, its name aside."""
    node = op.node_def
    return (op.type, op.device, dict(node.attr), [t.name for t in op.inputs],
            sorted(c.name for c in op.control_inputs), [t.dtype for t in op.outputs],
            [t.shape.as_list() for t in op.outputs])


def _both_ways(make_inputs, template, dtypes, scope):
    """(lean op, _create_op_internal's op) made on the same inputs in one function
    graph under the context `scope` (a function of the graph)."""
    graph = func_graph.FuncGraph("graph_ops_test")
    with graph.as_default():
        inputs, control = make_inputs()
        with graph.device(lambda op: op.device or DEVICE), scope(graph), \
                tf.control_dependencies(control):
            lean = graph_ops.create_op(template, inputs, dtypes, "lean", DEVICE)
            plain = graph._create_op_internal(template.op_type, list(inputs), dtypes=dtypes,
                                              attrs=template.attrs, name="plain")
    return lean, plain


def _inputs():
    a = tf.constant(np.ones((2, 3), np.float32))
    b = tf.constant(np.zeros((4, 3), np.float32))
    axis = tf.constant(0)
    return [a, b, axis], [tf.raw_ops.NoOp(name="before")]


def _no_scope(graph):
    return ops.NullContextmanager()


def test_lean_op_is_the_op_create_op_internal_makes():
    template = graph_ops.OpTemplate(ops.get_default_graph().op_def_for_type("ConcatV2"),
                                    _concat_attrs(2))
    lean, plain = _both_ways(_inputs, template, [tf.float32], _no_scope)
    assert _described(lean) == _described(plain)
    assert lean.device == DEVICE and [c.name for c in lean.control_inputs] == ["before"]
    assert lean.outputs[0].shape.as_list() == [6, 3]  # TF's shape inference ran


def test_device_functions_place_an_op_made_without_device():
    graph = func_graph.FuncGraph("graph_ops_device")
    with graph.as_default(), graph.device(DEVICE):
        x = tf.constant([1.0, 2.0])
        y = graph_ops.create_op(graph_ops.simple_template("AddN", tf.float32, 2), [x, x],
                                [tf.float32], "AddN")
    assert tf.DeviceSpec.from_string(y.device) == tf.DeviceSpec.from_string(DEVICE)
    assert y.type == "AddN" and y.get_attr("N") == 2


def test_colocation_falls_back_to_create_op_internal():
    template = graph_ops.OpTemplate(ops.get_default_graph().op_def_for_type("ConcatV2"),
                                    _concat_attrs(2))

    def colocated(graph):
        return graph.colocate_with(graph.get_operation_by_name("before"))
    lean, plain = _both_ways(_inputs, template, [tf.float32], colocated)
    # the colocation group is the op's attr: the lean path cannot have set it
    assert lean.get_attr("_class") == plain.get_attr("_class") == [b"loc:@before"]
    assert _described(lean) == _described(plain)


def test_input_of_another_graph_is_captured():
    outer = tf.constant([1.0, 2.0])  # eager: the function graph captures it
    graph = func_graph.FuncGraph("graph_ops_capture")
    with graph.as_default():
        y = graph_ops.create_op(graph_ops.simple_template("Identity", tf.float32), [outer],
                                [tf.float32], "Identity")
    assert y.inputs[0].graph is graph
    assert len(graph.captures) == 1
