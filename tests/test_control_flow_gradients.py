"""Regressions of the fourth 10,000-program fuzzer run's open programs (seed 24) and the
slice after them (benchmarks/RESULTS.md §6, "Open programs of the fourth run")."""

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

def _magnitudes(f, *args):
    """f's float64 outputs and accuracy.summed_magnitude of each, traced."""
    from gspmd_tf.testing.accuracy import summed_magnitude

    def with_magnitudes(*args):
        outs = f(*args)
        return outs + [summed_magnitude(tf, t) for t in outs]
    values = tf.function(with_magnitudes, autograph=False)(*args)
    return [v.numpy() for v in values[:len(values) // 2]], \
        [v.numpy() for v in values[len(values) // 2:]]


def test_summed_magnitude_is_that_of_the_terms_of_the_last_sum():
    """Seed 24 #1489 (shrunk): the gradient of a scalar added before a softmax sums terms
    that cancel to 0; summed_magnitude gives the sum of their magnitudes (the gradient
    at the sum's operand, summed in absolute value). A difference's terms are its two
    operands; a product sums nothing."""
    rng = np.random.default_rng(1000)
    x = tf.constant(rng.standard_normal(()), tf.float64)
    p = tf.constant(rng.standard_normal((3, 8, 1, 2)), tf.float64)
    weights = rng.uniform(0.5, 1.5, (5, 7, 4))

    def f(x, p):
        with tf.GradientTape() as tape:
            tape.watch(x)
            shifted = tf.reduce_sum(p, axis=-3) + x
            tape.watch(shifted)
            padded = tf.pad(tf.nn.softmax(shifted, axis=0), [[1, 1], [3, 3], [1, 1]])
            loss = tf.reduce_sum(padded * weights)
        grad_x, grad_shifted = tape.gradient(loss, [x, shifted])
        a, b = p[0, 0], p[1, 0]
        return [grad_x, grad_shifted, a - b, a * b]

    values, magnitudes = _magnitudes(f, x, p)
    (grad_x, grad_shifted, _, _), (terms, _, diff_terms, product_terms) = values, magnitudes
    assert abs(grad_x) < 1e-15  # 0 in real arithmetic
    np.testing.assert_allclose(terms, np.abs(grad_shifted).sum(), rtol=1e-12)
    assert terms > 1e10 * abs(grad_x)  # far larger than their sum
    a, b = p.numpy()[0, 0], p.numpy()[1, 0]
    np.testing.assert_allclose(diff_terms, np.abs(a) + np.abs(b), rtol=1e-12)
    np.testing.assert_allclose(product_terms, np.abs(a * b), rtol=1e-12)


def test_summed_magnitude_of_a_matmul_reshaped():
    """Through a reshape, a MatMul's terms: |a| @ |b|."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    _, (terms,) = _magnitudes(lambda a, b: [tf.reshape(tf.matmul(a, b), [6])],
                              tf.constant(a), tf.constant(b))
    np.testing.assert_allclose(terms, (np.abs(a) @ np.abs(b)).reshape(6), rtol=1e-12)


def test_accuracy_rule_relative_to_the_cancelling_terms():
    """Seed 24 #1489's output 7 (commands in RESULTS §6): TF 5.2e-8, gspmd-tf 9.3e-8, the
    float64 program 3.1e-16, its 6 terms 0.335 in magnitude. Both are float32 rounding of
    those terms (1.3 and 2.3 eps32 times it): excused relative to the terms, not to the
    value; a dropped term, a wrong sign, or an error 30 times the bound is not."""
    from gspmd_tf.testing.accuracy import Mismatch, check_values

    exact, terms = np.array(3.0531133177191805e-16), np.array(0.3354347574220473)
    tf_value, ours = np.float32(5.2154064e-08), np.float32(9.313226e-08)
    with pytest.raises(Mismatch):
        check_values(ours, tf_value, "grad", "float32", exact=exact)
    check_values(ours, tf_value, "grad", "float32", exact=exact, terms=terms)
    for wrong in (ours + np.float32(0.0662), np.float32(1e-4)):  # a dropped term, 30x
        with pytest.raises(Mismatch):
            check_values(wrong, tf_value, "grad", "float32", exact=exact, terms=terms)
    with pytest.raises(Mismatch):  # a wrong sign of a value that does not cancel
        check_values(np.float32([-0.25, 1.0]), np.float32([0.25000003, 1.0]), "x",
                     "float32", exact=np.array([0.25, 1.0]), terms=np.array([0.6, 1.0]))


@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 4)])
def test_masking_a_tile_gradient_of_ten_dims(mesh_shape):
    """Seed 28 #1986: the gradient of a rank-5 Tile sums a rank-10 view; with the tiled
    result split unevenly (2 over 4) the padding mask is a SelectV2 of 10 dims, which TF
    cannot broadcast ("Broadcast between [1,...] and [...] is not supported yet"): the
    mask runs on a three-dim view of the tensor."""
    p = np.random.default_rng(1000).standard_normal((2, 3, 1, 2, 1)).astype(np.float32)
    weights = np.random.default_rng(0).uniform(0.5, 1.5, (2, 9, 1, 6, 2)).astype(np.float32)
    mesh = gt.Mesh.create(mesh_shape, ("a", "b"))

    def f(p):
        with tf.GradientTape() as tape:
            tape.watch(p)
            tiled = tf.tile(p, [1, 3, 1, 3, 2])
            loss = tf.reduce_sum(tiled * weights)
        return [tiled, tape.gradient(loss, p)]
    want = f(tf.convert_to_tensor(p))
    got = gt.function(f, mesh=mesh, in_shardings=(gt.P(),),
                      out_shardings=[gt.P("a", None, None, None, "b"), None])(p)
    assert got[0].layout.dims[4] == ("b",)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5)


@pytest.mark.parametrize("mesh_shape, spec, pool", [
    ((2,), P(None, None, "data"), "2d"), ((2, 4), P(None, "model", "data"), "2d"),
    ((2, 4), P(None, "model", "data"), "3d")])
def test_max_pool_gradient_of_a_nan_first_in_a_padded_window(mesh_shape, spec, pool):
    """Seed 28 #7859: TF's max-pool gradient goes to the first element of a window (TF
    clips windows to x) unless a later one is larger, so a NaN first in a window takes
    it; behind a -inf halo pad it did not (0.0 vs 2.21). The device whose window starts
    before x runs the op with its own explicit padding (2-D); MaxPool3DGrad, which takes
    none, runs whole."""
    rng = np.random.default_rng(830756739)
    shape = (2, 6, 7, 1) if pool == "2d" else (2, 6, 7, 3, 1)
    x = rng.standard_normal(shape).astype(np.float32)
    x[(0, 3, 3) + (0,) * (len(shape) - 3)] = np.nan
    x[(1, 3, 0) + (0,) * (len(shape) - 3)] = np.nan
    x[(1, 0, 4) + (0,) * (len(shape) - 3)] = np.nan
    mesh = gt.Mesh.create(mesh_shape, ("data",) if len(mesh_shape) == 1 else ("data", "model"))

    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if pool == "2d":
                y = tf.nn.max_pool2d(x, ksize=[3, 3], strides=[1, 2], padding="SAME")
            else:
                y = tf.nn.max_pool3d(x, ksize=[3, 3, 2], strides=[1, 2, 1], padding="SAME")
            weights = tf.reshape(tf.range(1, tf.size(y) + 1, dtype=tf.float32), tf.shape(y))
            loss = tf.reduce_sum(y * weights)
        return [y, tape.gradient(loss, x)]
    _check(f, (x,), mesh, (spec,))
