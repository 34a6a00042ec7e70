"""Programs TF runs with static input shapes are not refused for shapes: every shape
known at trace time is folded (BroadcastGradientArgs' both outputs, in TF's gradients of
tf.einsum with an ellipsis or broadcasting, also inside tf.while_loop / tf.cond bodies);
a tf.slice whose begin is computed at run time keeps its split dims; a string scalar
(a 0-d numpy object array) is an argument like any other. Values equal single-device
TF."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned, randn

P = gt.P


def gradients_of(fn):
    """The gradients of sum(fn(*xs) ** 2) with respect to every argument."""
    def grads(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = tf.reduce_sum(fn(*xs) ** 2)
        return tape.gradient(y, xs)
    return grads


def einsum_in_loop(x, w):
    def body(i, v):
        h = tf.einsum("...ij,jk->...ik", tf.transpose(v, [0, 2, 1]), w)
        return i + 1, tf.transpose(tf.tanh(h), [0, 2, 1])
    return tf.while_loop(lambda i, v: i < 3, body, (0, x))[1]


def einsum_in_cond(x, w):
    return tf.cond(tf.reduce_sum(x) > 0,
                   lambda: tf.einsum("...ij,...jk->...ik", tf.transpose(x, [0, 2, 1]), w),
                   lambda: tf.transpose(x, [0, 2, 1]) * 3.0)


@pytest.mark.parametrize("fn, shapes, specs", [
    (lambda x, w: tf.einsum("...ij,jk->...ik", x, w), [(2, 3, 4, 5), (5, 6)],
     (P("data", None, "model"), P())),
    (lambda x, w: tf.einsum("...ij,...jk->...ik", x, w), [(2, 3, 4, 5), (3, 5, 6)],
     (P("data"), P(None, "model"))),
    (einsum_in_loop, [(2, 4, 4), (4, 4)], (P("data"), P())),
    (einsum_in_cond, [(2, 4, 4), (4, 4)], (P("data", "model"), P())),
], ids=["ellipsis", "broadcasting", "in-while-loop", "in-cond"])
def test_gradient_of_einsum_with_broadcast_shapes(fn, shapes, specs, mesh, rng):
    args = [randn(rng, *shape) for shape in shapes]
    check_partitioned(gradients_of(fn), args, mesh, specs)


def test_broadcast_gradient_args_of_constant_shapes(mesh):
    """Both outputs fold to constants (the second was left unknown)."""
    low = check_partitioned(
        lambda x: (tf.raw_ops.BroadcastGradientArgs(s0=[2, 1, 3], s1=[3]), x * 2.0),
        (np.ones((4, 6), np.float32),), mesh, (P("data"),))
    assert "BroadcastGradientArgs" not in {n.op for n in low.graph.nodes}


@pytest.mark.parametrize("spec", [P("data", "model"), P("model", "data")])
def test_slice_with_a_begin_computed_at_run_time(spec, mesh, rng):
    """The sliced dim is whole, the other one split (6 rows over 4 devices: uneven)."""
    def fn(x, start):
        return tf.slice(x, [0, start], [6, 3]) * 2.0, tf.slice(x, [start - 1, 0], [2, 5])

    check_partitioned(fn, (randn(rng, 6, 5), np.int32(2)), mesh, (spec, P()))


def test_string_scalar_argument(mesh, rng):
    def fn(x, text):
        return x * 2.0, tf.strings.length(text), tf.strings.join([text, "!"])

    check_partitioned(fn, (randn(rng, 6, 5), np.array("hello", dtype=object)), mesh,
                      (P("data", "model"), P()))
