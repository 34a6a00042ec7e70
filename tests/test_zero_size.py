"""Tensors with a dim of size 0 behave as on one device: no crash (TF's collectives die on
empty tensors, so none is emitted for them), no division by zero, the same values and
shapes, forward and through gradients, with the empty dim split or not."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned

P = gt.P
MESHES = {"1d": ((8,), ("a",)), "2d": ((2, 4), ("a", "b")), "3d": ((2, 2, 2), ("a", "b", "c"))}

OPS = {
    "negate": lambda x: -x,
    "concat": lambda x: tf.concat([x, x * 2.0], 0),
    "concat_split_dim": lambda x: tf.concat([x, x * 2.0], 1),
    "gather": lambda x: tf.gather(x, [0, 2, 1], axis=1),
    "transpose": lambda x: tf.transpose(x) * 1.0,
    "matmul": lambda x: x @ tf.ones([x.shape[1], 3]),
    "matmul_empty_contraction": lambda x: tf.transpose(x) @ x,
    "segment_sum": lambda x: tf.math.unsorted_segment_sum(
        x, tf.zeros([x.shape[0]], tf.int32), 3),
    "log_softmax": tf.nn.log_softmax,
    "softmax": tf.nn.softmax,
    "slice_emptying": lambda x: x[:, 3:3] * 1.0,
    "mean": lambda x: tf.reduce_mean(x, 0),
    "mean_all": tf.reduce_mean,
    "sum": lambda x: tf.reduce_sum(x, 1),
    "max": lambda x: tf.reduce_max(x, 0),
    "reshape": lambda x: tf.reshape(x, [x.shape[1], x.shape[0], 1]) * 1.0,
    "tile": lambda x: tf.tile(x, [2, 1]),
    "pad": lambda x: tf.pad(x, [[1, 1], [0, 0]]),
    "broadcast": lambda x: x + tf.ones([1, x.shape[1]]),
    "expand_squeeze": lambda x: tf.squeeze(tf.expand_dims(x, 1), 1) * 1.0,
}


def gradient_of(fn):
    def grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(fn(x) * 3.0)
        return tape.gradient(loss, x)
    return grad


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("shape", [(0, 8), (6, 0)])
@pytest.mark.parametrize("op", list(OPS))
def test_empty_tensor_ops(op, shape, mesh_name):
    mesh_shape, axes = MESHES[mesh_name]
    mesh = gt.Mesh.create(mesh_shape, axes)
    spec = P(axes[0], axes[-1]) if len(axes) > 1 else P(None, axes[0])
    x = np.ones(shape, np.float32)
    fn = OPS[op]
    if op == "gather" and shape[1] == 0:
        pytest.skip("no index into an empty dim")
    check_partitioned(fn, (x,), mesh, (spec,))
    check_partitioned(fn, (x,), mesh, (P(axes),))
    check_partitioned(gradient_of(fn), (x,), mesh, (spec,))


def test_collective_of_empty_tensor_is_a_constant():
    """Resharding an empty tensor emits no collective."""
    mesh = gt.Mesh.create((2, 4), ("a", "b"))
    low = check_partitioned(lambda x: tf.transpose(x) * 1.0, (np.ones((0, 8), np.float32),),
                            mesh, (P("a", "b"),), out_shardings=(P("b", "a"),))
    assert not low.collectives()


@pytest.mark.parametrize("spec", [P("a"), P(None, "a")])
def test_integer_mean_of_nothing_is_zero(spec):
    """TF's integer mean over no elements is 0 (not a division by zero), split or not."""
    mesh = gt.Mesh.create((8,), ("a",))
    x = np.zeros((0, 3), np.int32)
    check_partitioned(lambda x: tf.reduce_mean(x, 0, keepdims=True), (x,), mesh, (spec,))


def test_ops_with_empty_results_are_empty_constants():
    """Grappler's rewrite of a multiplication by ones divides by the dims of the other
    operand and dies (SIGFPE) when one is 0 and an empty constant counts as "ones"
    (fuzzer, seed 31 #53: the gradient of a select of a min over a split empty tensor).
    So no TF op with only empty results is emitted: each becomes an empty constant."""
    mesh = gt.Mesh.create((2, 1), ("x", "y"))

    def fn(x, cond, y):
        with tf.GradientTape() as tape:
            tape.watch([x, y])
            z = tf.where(cond, tf.reduce_min(x, axis=2), y)
            loss = tf.reduce_sum(tf.sin(z))
        return [z] + tape.gradient(loss, [x, y])

    args = (np.zeros((0, 1, 8), np.float32), np.array([True]), np.zeros((0, 1), np.float32))
    low = check_partitioned(fn, args, mesh, (P("x"), P(), P()))
    for node in low.program.graph.nodes:
        if node.out_shapes and all(0 in s for s in node.out_shapes):
            assert node.op in ("Const", "gt.Input"), node


def test_equal_empty_constants_of_other_tensors_do_not_mix():
    """Every empty local tensor of one shape is the same constant node; resharding one
    must not return the reshard of another that shares the node (fuzzer, seed 40 #27:
    a (1, 0, 0) result came back with the (3, 0, 0) shards of its operand)."""
    mesh = gt.Mesh.create((4, 1), ("a", "b"))

    def fn(x):
        t = gt.mesh_split(tf.slice(x, [3, 4, 0], [-1, 0, 0]), mesh, P("a", None))
        return tf.slice(tf.cast(t, tf.int32), [2, 0, 0], [1, 0, 0])

    f = gt.function(fn, mesh=mesh, in_shardings=(P(),))
    got = f(np.zeros((6, 4, 0), np.float32))
    assert got.shape == (1, 0, 0)
    local = got.layout.local_shape(mesh, (1, 0, 0))
    assert [tuple(s.shape) for s in got.shards] == [local] * 4


@pytest.mark.parametrize("spec", [P(None, None, "b"), P(None, "a", "b")])
def test_conv_of_an_empty_dim_with_padding_is_zeros(spec):
    """Explicit padding makes a result of an empty H (windows of padding only): zeros,
    forward and through the gradients (fuzzer, seed 46 #505: a halo plan of n=0)."""
    mesh = gt.Mesh.create((2, 4), ("a", "b"))
    x = np.zeros((2, 0, 6, 12), np.float32)
    w = np.random.default_rng(505).standard_normal((2, 3, 12, 3)).astype(np.float32)

    def fn(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.conv2d(x, w, [2, 2], [[0, 0], [1, 1], [2, 0], [0, 0]])
            loss = tf.reduce_sum(y * 3.0)
        return [y] + tape.gradient(loss, [x, w])
    check_partitioned(fn, (x, w), mesh, (spec, P()))


@pytest.mark.parametrize("spec", [P(), P(None, "b"), P("a", "b")])
@pytest.mark.parametrize("add", ["bias_add", "add"])
def test_empty_contraction_then_bias_add_is_the_bias(add, spec):
    """A MatMul over an empty dim is zeros. TF's graph optimizer fuses MatMul -> BiasAdd
    (or Add) into one oneDNN op that aborts the process or returns garbage on an empty
    contraction (fuzzer, seed 20 #5261), so the reference is the bias written without a
    MatMul."""
    mesh = gt.Mesh.create((2, 4), ("a", "b"))
    x = np.ones((0, 8), np.float32)
    bias = np.arange(8, dtype=np.float32)
    plus = tf.nn.bias_add if add == "bias_add" else tf.add
    check_partitioned(lambda x, bias: plus(tf.transpose(x) @ x, bias), (x, bias), mesh,
                      (spec, None),
                      reference=lambda x, bias: tf.zeros([8, 8]) + bias)
