"""Shape computations fold to constants at import (gspmd_tf/graph/fold.py)."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.graph.importer import import_graph
from util import check_partitioned, randn

P = gt.P


def imported(fn, *specs):
    return import_graph(tf.function(fn, autograph=False).get_concrete_function(*specs))


def spec(*shape, dtype=tf.float32):
    return tf.TensorSpec(shape, dtype)


def test_shape_ops_and_their_arithmetic_fold():
    def f(x):
        shape = tf.raw_ops.Shape(input=x, name="shape")
        rows = tf.raw_ops.StridedSlice(input=shape, begin=[0], end=[1], strides=[1],
                                       shrink_axis_mask=1, name="rows")
        size = tf.raw_ops.Size(input=x, name="size")
        new_shape = tf.stack([rows * 2, size // (rows * 2)], name="new_shape")
        return tf.reshape(x, new_shape, name="out")

    g = imported(f, spec(4, 6))
    ops = {n.name: n.op for n in g.nodes}
    for name in ("shape", "rows", "size", "new_shape"):
        assert ops[name] == "Const", name
    assert g.const_value(g.ref("new_shape")).tolist() == [8, 3]
    assert g.shape(g.ref("out")) == (8, 3)


def test_broadcast_gradient_args_fold_and_refs_renumbered():
    """Two outputs: the second becomes a Const of its own, inserted before; every Ref is
    renumbered and the function still partitions to the single-device values."""
    def f(x, y):
        r0, r1 = tf.raw_ops.BroadcastGradientArgs(s0=tf.raw_ops.Shape(input=x),
                                                  s1=tf.raw_ops.Shape(input=y), name="bga")
        dy = tf.reshape(tf.reduce_sum(x * 2.0, r1, keepdims=True), y.shape, name="dy")
        return dy, tf.reduce_sum(x, r0)

    g = imported(f, spec(6, 8), spec(6, 1))
    r0, r1 = g.ref("bga"), g.ref("bga/output_1")
    assert g.nodes[r0.node].op == g.nodes[r1.node].op == "Const"
    assert g.const_value(r0).size == 0 and g.const_value(r1).tolist() == [1]
    for i, node in enumerate(g.nodes):  # still topologically ordered, Refs valid
        assert all(ref.node < i for ref in node.inputs), node
    assert [g.nodes[r.node].op for r in g.inputs] == ["Placeholder", "Placeholder"]
    rng = np.random.default_rng(0)
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    low = check_partitioned(f, (randn(rng, 6, 8), randn(rng, 6, 1)), mesh,
                            (P("data", "model"), P("data")))
    assert low.program.replicated_ops == []


def test_data_is_not_turned_into_big_constants():
    def f(x):
        ones = tf.fill([16, 16], 1.0, name="ones")
        tiled = tf.tile(tf.constant([[2.0]]), [16, 16], name="tiled")
        return x + ones + tiled

    g = imported(f, spec(16, 16))
    ops = {n.name: n.op for n in g.nodes}
    assert ops["ones"] == "Fill" and ops["tiled"] == "Tile"


def test_value_shaped_op_on_arguments_still_needs_static_shapes():
    def f(i, x):
        return tf.raw_ops.DynamicStitch(indices=[i], data=[x], name="stitch")

    with pytest.raises(gt.ShardingError, match="'stitch'.*unknown dimensions"):
        imported(f, spec(4, dtype=tf.int32), spec(4, 3))


@pytest.mark.parametrize("in_shape,target,want", [
    ((0, 3), [0, -1], (0, 3)), ((2, 0, 3), [0, -1], (0, 6)), ((2, 0, 3), [-1, 0, 5], (1, 0, 5)),
    ((0,), [2, -1], (2, 0))])
def test_reshape_of_no_elements_gets_the_shape_tf_runs_with(in_shape, target, want):
    """TF's shape inference leaves the -1 of a reshape of no elements unknown (it could be
    anything); its kernel picks one (the gradient of a gather from an empty table
    reshapes to [0, -1]). The import gives the kernel's shape."""
    def f(x, shape):
        return tf.reshape(x * 2.0, shape, name="out")

    g = imported(lambda x: f(x, tf.constant(target) + 0), spec(*in_shape))
    assert g.shape(g.ref("out")) == want
    assert tf.reshape(tf.zeros(in_shape), target).shape == want
