"""Emitters of control-flow ops (nodes with regions) on this process's devices: the TF
op re-created per device, each region (an SPMD sub-program, collectives included) a TF
function built for that device. Each function takes the DeviceEmitter emitting the
program.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util_v2

from gspmd_tf.backends import base, collective_emitters, collectives
from gspmd_tf.backends.tf_kernels import identity, safe_name, set_shapes
from gspmd_tf.collective_dtypes import carries
from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import REGION_OPS, walk
from gspmd_tf.registry import PRINTS, has_trait


def region_op(emitter, node):
    """Emitter of a control-flow op (a node with regions): the TF op re-created on
    device d, each of its function attrs naming a TF function built from its region
    (an SPMD sub-program) for d.

    When the regions hold collectives, the device's ordering token is one more
    operand (a loop hands it through as one more loop value) and the bodies' ordering
    token: the op then orders with the device's other collectives, not in one chain
    with every device's stateful ops (which would deadlock, see
    collectives.ordering_token), and it is the stateful op type. Each collective
    keeps one instance key for every iteration: measured with TF 2.21, a functional
    While (not lowered to Switch/Merge: the backend drops TF's
    _lower_using_switch_merge attr) runs the body's collectives once per iteration
    on every device with the same keys, correctly."""
    attrs = {k: v for k, v in node.attrs.items() if not k.startswith("_")}
    name = safe_name(node.name)
    threads_token = any(n.op in collectives.KEYED + (base.PERMUTE,)
                        for region in node.regions for n in walk(region))
    op_type = _STATEFUL.get(node.op, node.op) if threads_token else node.op
    loop = "While" in node.op
    body = len(node.regions) - 1

    def emit(d, ins):
        functions = iter([
            _region_function(emitter, region, d, f"{name}_region{k}_d{d}", threads_token,
                             threads_token and loop and k == body)
            for k, region in enumerate(node.regions)])
        op_attrs = dict(attrs)
        for attr in REGION_OPS[node.op][0]:
            if attrs[attr].HasField("list"):  # list(func): one region per function
                count = len(attrs[attr].list.func)
                op_attrs[attr] = attr_value_pb2.AttrValue(
                    list=attr_value_pb2.AttrValue.ListValue(func=[
                        attr_value_pb2.NameAttrList(name=next(functions))
                        for _ in range(count)]))
            else:
                op_attrs[attr] = attr_value_pb2.AttrValue(
                    func=attr_value_pb2.NameAttrList(name=next(functions)))
        inputs, dtypes = [x[d] for x in ins], list(node.out_dtypes)
        if threads_token:
            inputs.append(emitter.tokens[d])
            _append_type(op_attrs, "T" if loop else "Tin", tf.resource)
            if loop:
                dtypes.append(tf.resource)
                if "output_shapes" in op_attrs:
                    shapes = list(op_attrs["output_shapes"].list.shape)
                    op_attrs["output_shapes"] = attr_value_pb2.AttrValue(
                        list=attr_value_pb2.AttrValue.ListValue(
                            shape=shapes + [tf.TensorShape([]).as_proto()]))
        return ops.get_default_graph()._create_op_internal(
            op_type, inputs, dtypes=dtypes, attrs=op_attrs, name=f"{name}_d{d}")
    emit.uses_token = threads_token
    return emit


def _region_function(emitter, region, d, name, threads_token, returns_token):
    """Builds a TF function running the sub-program `region` on device d, adds it to
    the current graph's library, and returns its (unique) name. With
    `threads_token` it takes the device's ordering token as one more (last)
    parameter, which its collectives use (and a loop body returns last)."""
    signature = [tf.TensorSpec(() if node.out_dtypes[0] in (tf.resource, tf.variant)
                               else node.out_shapes[0], node.out_dtypes[0])
                 for node in (region.nodes[ref.node] for ref in region.inputs)]
    if threads_token:
        signature.append(tf.TensorSpec((), tf.resource))

    def body(*args):
        outer = emitter.tokens[d]
        if threads_token:
            emitter.tokens[d], args = args[-1], args[:-1]
        try:
            with tf.device(emitter.devices[d]):
                outs = _lower_region(emitter, region, args, d)
            if returns_token:
                outs.append(emitter.tokens[d])
        finally:
            emitter.tokens[d] = outer
        return outs
    # unique: every traced program registers its functions in one eager context
    graph = func_graph_module.func_graph_from_py_func(
        f"{name}_{ops.uid()}", body, None, None, signature=signature,
        add_control_dependencies=True)
    return control_flow_util_v2.create_new_tf_function(graph)


def _lower_region(emitter, region, args, d):
    """Emits the nodes of sub-program `region` for device d into the current graph,
    its parameters (gt.Input nodes) bound to the tensors `args`; returns the tensors
    of its outputs."""
    bound = {ref.node: arg for ref, arg in zip(region.inputs, args)}
    values, op_of = [], []  # per node: its output tensors; its tf.Operation
    for index, node in enumerate(region.nodes):
        if index in bound:
            values.append([bound[index]])
            op_of.append(bound[index].op)
            continue
        if node.op in collectives.KEYED + (base.PERMUTE,) and \
                not carries(node.out_dtypes[0]):
            # made of copies that read other devices' tensors, which a body running
            # on one device cannot reach
            raise ShardingError(
                f"LocalBackend cannot run {node.op} of {node.out_dtypes[0].name} inside "
                f"a control-flow body (node {node.name}): TF's collectives do not take "
                "that dtype; keep the split that needs it out of the body")
        if node.op == base.PERMUTE:
            emit = collective_emitters.permute_in_region(emitter, node)
        elif has_trait(node.op, PRINTS) and d != emitter.local[0]:
            emit = _not_printed(node)
        else:
            emit = emitter.emitter_of(node, in_region=True)
        with tf.control_dependencies([op_of[c] for c in node.control_inputs]):
            # one device: inputs[k] maps it to its tensor, as emitters index them
            result = emit(d, [{d: values[ref.node][ref.out]} for ref in node.inputs])
        outs = list(result.outputs) if isinstance(result, ops.Operation) else [result]
        set_shapes(node, outs)
        values.append(outs)
        op_of.append(result if isinstance(result, ops.Operation) else result.op)
    return [values[ref.node][ref.out] for ref in region.outputs]


def _not_printed(node):
    """emit(d, inputs) of a PRINTS op (tf.print) in a body on a device other than this
    process's first: its rule takes its inputs whole, equal on every device, so the
    first device's body prints them once per iteration or taken branch, as one device
    does (each device's body printed them once more). Here it is a NoOp (PrintV2) or
    its first input (v1 Print's result), which the device's other nodes wait on as
    before."""
    if node.out_dtypes:
        return lambda d, ins: identity(ins[0][d])
    return lambda d, ins: tf.no_op()


# The stateful op of a stateless control-flow op whose bodies now hold collectives.
_STATEFUL = {"StatelessWhile": "While", "StatelessIf": "If", "StatelessCase": "Case"}


def _append_type(attrs, key, dtype):
    """attrs[key], a list(type) attr, with `dtype` appended."""
    types = list(attrs[key].list.type) + [dtype.as_datatype_enum]
    attrs[key] = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=types))
