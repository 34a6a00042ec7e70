"""Control-flow ops run replicated: reading sharded variables in their bodies.

Until control flow is partitioned, a node with regions (While / If / Case) runs whole on
every device. A variable handle it takes cannot be gathered: a device's handle points to
its shard only. Where its bodies only READ the variable (ReadVariableOp, and a While
body handing the handle on unchanged, as TF's loops do), the op can take the variable's
value instead: read once before the op, gathered like any operand, with each read in the
bodies becoming an Identity of the parameter. A body that writes, or hands the handle to
anything else, keeps the handle (and the partitioner refuses a sharded one).
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from gspmd_tf.graph.ir import REGION_OPS, Graph, Node
from gspmd_tf.spmd.program import Local, attr_value


def read_variables_whole(builder, node, operands):
    """For each sharded variable among `operands` (Locals of node.inputs) that the
    regions of `node` only read: the variable's value read on the program's side.

    Returns (node, operands, through): a copy of `node` whose regions and attrs take
    those values in place of the handles, the operands with the values in place of the
    handles, and {output index: Local} for While outputs that are the handles handed
    through (the loop returns them unchanged)."""
    first = REGION_OPS[node.op][1]
    loop = "While" in node.op
    operands = list(operands)
    through = {}
    for p, x in enumerate(operands):
        if x.dtype != tf.resource or x.layout.is_replicated or not reads_only(node, p):
            continue
        j = p - first
        dtype, shape = _variable_type(node, j)
        if shape != x.shape:  # unread, or TF could not tell the variable's shape
            continue
        local_shape = x.layout.local_shape(builder.mesh, x.shape)
        value = builder.op("ReadVariableOp", [x.ref], local_shape, dtype, dtype=dtype)
        operands[p] = Local(value, x.layout, x.shape, dtype)
        node = _taking_value(node, p, j, shape, dtype)
        if loop:
            through[p] = x
    return node, operands, through


def reads_only(node, p):
    """Whether the regions of control-flow `node` only read the variable handle that is
    its input `p`: ReadVariableOps of it, and a While body returning it unchanged."""
    first = REGION_OPS[node.op][1]
    if p < first:
        return False
    j, loop = p - first, "While" in node.op
    if not all(_only_read(region, j, loop) for region in node.regions):
        return False
    body = node.regions[-1]
    return not loop or body.outputs[j] == body.inputs[j]  # a loop must hand it on


def _only_read(region, j, loop):
    """Whether region parameter `j` is only read (ReadVariableOp) in `region`, or, in a
    loop, also returned unchanged as result `j`."""
    param = region.inputs[j]
    if any(param in node.inputs and node.op != "ReadVariableOp" for node in region.nodes):
        return False
    return all(ref != param or (loop and k == j) for k, ref in enumerate(region.outputs))


def _variable_type(node, j):
    """(dtype, shape) of the variable behind region parameter `j`, as its first read
    gives them ((None, None) when no region reads it)."""
    for region in node.regions:
        param = region.inputs[j]
        for n in region.nodes:
            if param in n.inputs:
                return n.out_dtypes[0], n.out_shapes[0]
    return None, None


def _taking_value(node, p, j, shape, dtype):
    """A copy of control-flow `node` whose operand `p` (region parameter `j`) is the
    value of the variable instead of its handle."""
    attrs = dict(node.attrs)
    types = "T" if "While" in node.op else "Tin"
    listed = list(attrs[types].list.type)
    listed[j if types == "Tin" else p] = dtype.as_datatype_enum
    attrs[types] = attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(type=listed))
    out_shapes, out_dtypes = list(node.out_shapes), list(node.out_dtypes)
    if "While" in node.op:  # the loop carries the value: its output p is the value too
        out_shapes[p], out_dtypes[p] = shape, dtype
        shapes = list(attrs["output_shapes"].list.shape)
        shapes[p] = tf.TensorShape(shape).as_proto()
        attrs["output_shapes"] = attr_value_pb2.AttrValue(
            list=attr_value_pb2.AttrValue.ListValue(shape=shapes))
    return Node(node.name, node.op, node.inputs, attrs, out_shapes, out_dtypes,
                node.control_inputs, node.params,
                [_region_taking_value(region, j, shape, dtype) for region in node.regions])


def _region_taking_value(region, j, shape, dtype):
    """A copy of `region` whose parameter `j` is a value, its reads Identities of it."""
    param = region.inputs[j]
    copy = Graph()
    for index, n in enumerate(region.nodes):
        if index == param.node:
            n = Node(n.name, "Placeholder", (), {
                "dtype": attr_value(dtype),
                "shape": attr_value_pb2.AttrValue(shape=tf.TensorShape(shape).as_proto())},
                [shape], [dtype])
        elif param in n.inputs:  # a ReadVariableOp (see _only_read)
            n = Node(n.name, "Identity", n.inputs, {"T": attr_value(dtype)}, n.out_shapes,
                     n.out_dtypes, n.control_inputs)
        copy.add(n)
    copy.inputs, copy.outputs = list(region.inputs), list(region.outputs)
    copy.annotations, copy.aliases = dict(region.annotations), dict(region.aliases)
    return copy
