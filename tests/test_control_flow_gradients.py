"""Gradients through control flow, and the shapes the importer gives loop and branch
bodies: TF's sparse gradient of a gather entering a cond's (or case's, a nested call's,
a loop's) gradient carries its dense shape as an operand, which the importer reads as a
constant in the body when it is one at the call site (a shape a loop recomputes stays
unknown). Found by the fuzzer's fourth 10,000-program run, seed 24
(benchmarks/RESULTS.md §6, "Open programs of the fourth run")."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.P


def _check(f, args, mesh, in_shardings):
    """gt.function(f) on `mesh` equals single-device eager TF, output by output."""
    want = f(*[tf.convert_to_tensor(a) for a in args])
    got = gt.function(f, mesh=mesh, in_shardings=in_shardings)(*args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == tuple(w.shape)
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5)


def _with_gradient(forward):
    """f(p, index, pick) returning forward's value and the gradient of a weighted sum of
    it with respect to p."""
    def f(p, index, pick):
        with tf.GradientTape() as tape:
            tape.watch(p)
            value = forward(p, index, pick)
            weights = tf.reshape(tf.range(1, tf.size(value) + 1), tf.shape(value))
            loss = tf.reduce_sum(value * tf.cast(weights, value.dtype))
        return [value, tape.gradient(loss, p)]
    return f


def _gathered_cond(p, index, pick):
    """Seed 24 #2379: a gather of a cond's result whose branch rolls; the gather's sparse
    gradient enters the cond's gradient with its dense shape as an operand."""
    rolled = tf.cond(pick > 0, lambda: tf.roll(p, 1, axis=0), lambda: tf.sigmoid(p))
    return tf.gather(rolled, index, axis=0)


def _gathered_case(p, index, pick):
    """The same through a switch_case (a Case op's branches)."""
    branches = [lambda: tf.roll(p, 1, axis=0), lambda: tf.roll(p, -2, axis=0),
                lambda: tf.tanh(p)]
    return tf.gather(tf.switch_case(pick, branches), index, axis=0)


@tf.function
def _called_cond(p, index, pick):
    return _gathered_cond(p, index, pick)


def _gathered_called_cond(p, index, pick):
    """The same cond inside a nested tf.function (a call the importer inlines)."""
    return _called_cond(p, index, pick)


def _gathered_cond_in_loop(p, index, pick):
    """The same cond in a while body (the gradient's cond sits in the gradient loop)."""
    def body(i, acc):
        return i + 1, acc + _gathered_cond(p, index, pick)
    start = tf.zeros(index.shape + p.shape[1:], p.dtype)
    return tf.while_loop(lambda i, acc: i < 2, body, (tf.constant(0), start))[1]


_MESHES = {"4": ((4,), ("data",)), "2x4": ((2, 4), ("x", "y"))}


@pytest.mark.parametrize("mesh_name, shape, dtype, spec, index", [
    ("4", (8,), np.float64, P("data"), 1),                  # as #2379: scalar index
    ("2x4", (8, 6), np.float32, P("x", "y"), [3, 1, 3]),
])
@pytest.mark.parametrize("pick", [0, 1])
def test_roll_gradient_in_a_cond_branch_of_a_gathered_value(mesh_name, shape, dtype, spec,
                                                            index, pick):
    """Seed 24 #2379: the cond branch's UnsortedSegmentSum (densifying the sparse
    gradient) is sized by the dense-shape operand, a constant at the call site: the
    importer now reads it as a constant in the branch, where TF's shape inference gave
    (None,) and the import raised ShardingError. Both branches taken in turn."""
    mesh = gt.Mesh.create(*_MESHES[mesh_name])
    p = np.random.default_rng(1000).standard_normal(shape).astype(dtype)
    args = (p, np.asarray(index, np.int32), np.int32(pick))
    _check(_with_gradient(_gathered_cond), args, mesh, (spec, P(), P()))


@pytest.mark.parametrize("forward", [_gathered_case, _gathered_called_cond,
                                     _gathered_cond_in_loop])
def test_roll_gradient_in_other_regions(forward):
    """The same program through a Case, a nested tf.function and a while loop."""
    mesh = gt.Mesh.create(*_MESHES["2x4"])
    p = np.random.default_rng(7).standard_normal((8, 6)).astype(np.float32)
    args = (p, np.asarray([5, 0, 2], np.int32), np.int32(1))
    _check(_with_gradient(forward), args, mesh, (P("x", "y"), P(), P()))


def _sum_reshaped_in_loop(p, next_shape):
    """A loop reading a loop-carried shape in a Reshape; `next_shape` gives the shape of
    the next iteration."""
    def body(i, shape, acc):
        return i + 1, next_shape(shape), acc + tf.reduce_sum(tf.reshape(p, shape), 0)
    start = (tf.constant(0), tf.constant([8, 6]), tf.zeros((6,), p.dtype))
    return [tf.while_loop(lambda i, shape, acc: i < 3, body, start)[2]]


def test_shape_a_loop_passes_on_is_a_constant_in_its_body():
    """A loop-carried constant the body returns unchanged is the same every iteration:
    the body reads it as a constant (its Reshape gets a static shape)."""
    mesh = gt.Mesh.create(*_MESHES["2x4"])
    p = np.random.default_rng(3).standard_normal((8, 6)).astype(np.float32)
    _check(lambda p: _sum_reshaped_in_loop(p, tf.identity), (p,), mesh, (P("x", "y"),))


def test_shape_a_loop_recomputes_stays_unknown():
    """A loop-carried constant the body recomputes (here to the same value, which only
    its values show) is not taken for a constant: the Reshape's shape stays unknown and
    the import says so."""
    mesh = gt.Mesh.create(*_MESHES["2x4"])
    p = np.zeros((8, 6), np.float32)
    recomputed = lambda shape: shape[::-1] * 0 + shape  # noqa: E731
    f = gt.function(lambda p: _sum_reshaped_in_loop(p, recomputed), mesh=mesh,
                    in_shardings=(P("x", "y"),))
    with pytest.raises(gt.ShardingError, match="while/body/while/Reshape"):
        f(p)


# The fuzzer's comparison rules (gspmd_tf/testing/accuracy.py) for seed 24 #1489.
