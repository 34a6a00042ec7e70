"""The local backend's per-device graph: equal constants are emitted once per device,
program inputs are read in place, and the values stay those of TF."""

import collections

import numpy as np
import tensorflow as tf

import gspmd_tf as gt
from util import assert_close

P = gt.P


def _program(x):
    # the two reshapes repeat the shape [4, 6] and the factor 3.0: equal constants
    a = tf.reshape(x, [4, 6]) * 3.0
    b = tf.reshape(x + 1.0, [4, 6]) * 3.0
    return tf.nn.relu(a - b * 0.5)


def test_equal_constants_are_one_const_per_device(mesh):
    x = np.arange(24, dtype=np.float32).reshape(8, 3) - 10.0
    step = gt.function(_program, mesh=mesh, in_shardings=(P("data"),), backend="local")
    lowered = step.lower(tf.TensorSpec(x.shape, tf.float32))
    ir_consts = collections.Counter(
        (node.attrs["dtype"].type, node.attrs["value"].SerializeToString())
        for node in lowered.program.graph.nodes if node.op == "Const")
    assert sum(ir_consts.values()) > len(ir_consts)  # some value is repeated
    graph = lowered.compile().function.graph
    emitted = collections.Counter((op.get_attr("dtype"), op.device) for op in
                                  graph.get_operations() if op.type == "Const")
    consts_per_device = collections.Counter(device for _, device in emitted.elements())
    assert set(consts_per_device.values()) == {len(ir_consts)}
    assert len(consts_per_device) == mesh.size
    assert_close(step(x).numpy(), _program(tf.constant(x)).numpy(), "output")


def test_inputs_are_read_in_place(mesh):
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    step = gt.function(_program, mesh=mesh, in_shardings=(P("data"),), backend="local")
    graph = step.lower(tf.TensorSpec(x.shape, tf.float32)).compile().function.graph
    placeholders = [op for op in graph.get_operations() if op.type == "Placeholder"]
    assert placeholders and all(consumer.type != "Identity" for op in placeholders
                                for consumer in op.outputs[0].consumers())


def _pass_through_program(x):
    # an identity, a stop_gradient and a reshape to the shape x already has: on every
    # device their value is their input's
    y = tf.stop_gradient(tf.identity(x * 2.0))
    return tf.reshape(y, [8, 3]) + 1.0


def test_identities_and_no_op_reshapes_emit_no_op(mesh):
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    step = gt.function(_pass_through_program, mesh=mesh, in_shardings=(P("data"),),
                       backend="local")
    lowered = step.lower(tf.TensorSpec(x.shape, tf.float32))
    program_ops = {node.op for node in lowered.program.graph.nodes}
    assert {"Identity", "StopGradient", "Reshape"} <= program_ops
    graph = lowered.compile().function.graph
    emitted = collections.Counter(op.type for op in graph.get_operations())
    assert emitted["StopGradient"] == 0 and emitted["Reshape"] == 0
    # Identities left: at most the copies that hold each device's output on it
    assert emitted["Identity"] <= mesh.size
    assert_close(step(x).numpy(), _pass_through_program(tf.constant(x)).numpy(), "output")
