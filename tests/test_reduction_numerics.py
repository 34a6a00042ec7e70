"""Numerics of partitioned reductions and the TF kernels the SPMD program avoids: means,
half-precision sums and products over split dims at least as accurate as TF's own,
ArgMax ties, batch-matmul broadcasts made explicit, a cut depthwise window feeding a
BiasAdd, grappler's arithmetic optimizer off, empty split reshapes. Found by the
fuzzer's second 10,000-program run, seed 21, and the slices after it
(benchmarks/RESULTS.md §6, "Analysis of the second run")."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.P


@pytest.mark.parametrize("a_shape, b_shape, adj_x, adj_y, spec", [
    ((3, 1, 6, 3), (3, 1), False, False, P()),          # seed 21 #7078
    ((3, 1, 6, 8), (8, 4), False, False, P("x")),        # batch dim split
    ((4, 1, 3, 6), (1, 4, 3), True, True, P(None, None, "z")),
    ((3, 1, 6, 3), (1, 5, 3, 2), False, False, P("x")),  # both operands broadcast
])
def test_batch_matmul_broadcast_is_explicit(a_shape, b_shape, adj_x, adj_y, spec):
    """TF's oneDNN BatchMatMul corrupts memory broadcasting (3, 1, 6, 3) @ (3, 1) (even
    single-device eager TF), so the reference is numpy in float64 and gspmd-tf emits the
    broadcast explicitly; every device's shard is checked."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    mesh = gt.Mesh.create((2, 1, 4), ("x", "y", "z"))

    def f(a, b):
        return tf.linalg.matmul(a, b, adjoint_a=adj_x, adjoint_b=adj_y)

    got = gt.function(f, mesh=mesh, in_shardings=(spec, P()), out_shardings=(P(),))(a, b)
    a64 = np.swapaxes(a, -1, -2) if adj_x else a
    b64 = np.swapaxes(b, -1, -2) if adj_y else b
    want = np.matmul(a64.astype(np.float64), b64.astype(np.float64))
    assert len(got.shards) == 8
    for shard in got.shards:  # replicated: every device holds the whole product
        np.testing.assert_allclose(np.asarray(shard), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", [tf.math.sign, tf.math.floor, tf.nn.relu, tf.math.rint])
@pytest.mark.parametrize("spec", [P(), P("x", None, "z")])
def test_arg_max_of_tied_monotonic_op_is_the_first_index(op, spec):
    """Grappler rewrites ArgMax(Sign(x)) to ArgMax(x) in any tf.function (seed 21 #165:
    other indices where Sign ties); gspmd-tf gives the eager kernel's first index."""
    p = np.random.default_rng(1000).standard_normal((4, 5, 4)).astype(np.float32) * 2
    mesh = gt.Mesh.create((2, 1, 4), ("x", "y", "z"))

    def f(p):
        return [tf.argmax(op(p), axis=-2)]

    want = [t.numpy() for t in f(tf.constant(p))]  # eager: TF's kernel as documented
    got = gt.function(f, mesh=mesh, in_shardings=(spec,))(p)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)


@pytest.mark.parametrize("dtype", [np.float16, tf.bfloat16.as_numpy_dtype, np.float32])
def test_mean_over_split_dims_divides_the_combined_sum_once(dtype):
    """Seed 21 #1464: a float16 mean of round(x) over a 2x4 split whose sum is 0 gave
    6.1e-05 (each shard's sum scaled by 1/84 in float16 first); now exactly TF's 0."""
    x = np.random.default_rng(248207433).standard_normal((12, 7)).astype(np.float16)
    x = x.astype(dtype)
    mesh = gt.Mesh.create((2, 4), ("x", "y"))

    def f(x):
        return [tf.reduce_mean(tf.math.round(x), keepdims=True), tf.reduce_mean(x, axis=0)]

    got = gt.function(f, mesh=mesh, in_shardings=(P("x", "y"),))(x)
    want = f(tf.constant(x))
    assert float(want[0].numpy().astype(np.float32).reshape(())) == 0.0  # the case itself
    np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
    tolerance = {np.float32: 1e-6}.get(dtype, 1e-2)
    np.testing.assert_allclose(got[1].numpy().astype(np.float32),
                               want[1].numpy().astype(np.float32), rtol=tolerance,
                               atol=tolerance)


def test_mean_of_an_empty_split_dim_is_nan_for_floats_and_zero_for_ints():
    """The mean of no elements, with the empty dim split: NaN (float), 0 (int), as TF."""
    mesh = gt.Mesh.create((2, 4), ("x", "y"))
    for dtype in (np.float32, np.int32):
        x = np.zeros((0, 8), dtype)
        got = gt.function(lambda x: tf.reduce_mean(x, axis=0), mesh=mesh,
                          in_shardings=(P("x", "y"),))(x)
        np.testing.assert_array_equal(got.numpy(), tf.reduce_mean(x, axis=0).numpy())


@pytest.mark.parametrize("reduce, axes", [(lambda t: tf.einsum("abc->", t), None),
                                          (lambda t: tf.reduce_sum(t, axis=[0, 1]), (0, 1))])
def test_half_sum_over_split_dims_is_rounded_once(reduce, axes):
    """Seed 21 #5883: a float16 sum over a split dim, partial sums in float16, ended
    further from the exact sum than TF's sequential float16 sum; summed in float32 and
    rounded once it is the exactly rounded sum here (0.4033; TF 0.4011)."""
    x0 = np.random.default_rng(1336156373).standard_normal((3, 7, 1)).astype(np.float16)
    x1 = np.random.default_rng(66625248).standard_normal((3, 1)).astype(np.float16)
    x2 = np.random.default_rng(1370895109).standard_normal((1, 7, 3)).astype(np.float16)
    mesh = gt.Mesh.create((2, 1), ("a", "b"))

    def f(x0, x1, x2):
        terms = tf.multiply(x2, tf.linalg.matmul(x0, x1, transpose_b=True))
        return [reduce(terms), terms]

    got, terms = gt.function(f, mesh=mesh, in_shardings=(P(), P(), P(None, "a")))(x0, x1, x2)
    exact = np.sum(terms.numpy().astype(np.float64), axis=axes)
    np.testing.assert_array_equal(got.numpy(), exact.astype(np.float16))


def test_prod_over_split_dims_does_not_underflow_to_nan():
    """Seed 21 #7937: the product of 180 normals with one +Inf and one -Inf, split 8
    ways: a shard's float32 product underflowed to 0 and 0 * Inf gave NaN; TF and the
    float64 program give -Inf. Finite products stay within float32 rounding."""
    x = np.random.default_rng(1554779449).standard_normal((12, 5, 3)).astype(np.float32)
    mesh = gt.Mesh.create((8, 1), ("data", "model"))
    prod = gt.function(lambda x: tf.reduce_prod(x, axis=[0, 1, 2], keepdims=True), mesh=mesh,
                       in_shardings=(P("data"),))
    scaled = x * 2  # a product float32 holds (x's own underflows to -0.0)
    np.testing.assert_allclose(prod(scaled).numpy(),
                               np.prod(scaled.astype(np.float64), keepdims=True), rtol=1e-5)
    x[8, 0, 1], x[11, 3, 2] = -np.inf, np.inf
    want = tf.reduce_prod(x, axis=[0, 1, 2], keepdims=True).numpy()
    assert np.isneginf(want).all() and np.isneginf(np.prod(x.astype(np.float64)))
    np.testing.assert_array_equal(prod(x).numpy(), want)


@pytest.mark.parametrize("mesh_shape, spec", [((1, 1), P()), ((2, 1), P(None, "a"))])
def test_depthwise_conv_with_a_cut_window_feeding_bias_add(mesh_shape, spec):
    """A strided one-window dim of a depthwise conv is cut to its window, which needs
    explicit padding on the other dim; TF's graph optimizer aborts the process on a
    DepthwiseConv2dNative with EXPLICIT padding feeding a BiasAdd (seed 22 #2960,
    #9704), so the padding is a PadV2 of the input and the conv runs VALID."""
    rng = np.random.default_rng(2960)
    x = rng.standard_normal((2, 3, 4, 3)).astype(np.float32)
    w = rng.standard_normal((1, 2, 3, 2)).astype(np.float32)
    bias = rng.standard_normal((6,)).astype(np.float32)
    mesh = gt.Mesh.create(mesh_shape, ("a", "b"))

    def f(x, w, bias):
        y = tf.nn.depthwise_conv2d(x, w, strides=[1, 3, 3, 1], padding="SAME")
        return tf.nn.bias_add(y, bias)

    got = gt.function(f, mesh=mesh, in_shardings=(spec, P(), P()))(x, w, bias)
    np.testing.assert_allclose(got.numpy(), f(x, w, bias).numpy(), rtol=1e-5, atol=1e-6)


def test_grappler_arithmetic_optimizer_does_not_rewrite_the_program():
    """TF's arithmetic optimizer rewrites tf.maximum(x, tf.add_n([x, x])) into a wrong
    value (x where x > 0) in a tf.function; the SPMD program is called with it off
    (fuzzer seed 24 #2965, seed 47 #129)."""
    mesh = gt.Mesh.create((1, 1, 1), ("data", "model", "pipe"))
    x = np.random.default_rng(16535736).standard_normal((4,)).astype(np.float32)

    def f(x):
        doubled = gt.mesh_split(tf.add_n([x, x]), mesh, P(None))
        return tf.maximum(x, doubled)

    got = gt.function(f, mesh=mesh, in_shardings=(P(None),))(x)
    np.testing.assert_array_equal(got.numpy(), np.maximum(x, x + x))


def test_reshape_to_an_annotated_split_of_an_empty_tensor():
    """Re-blocking a merged dim of no elements moves nothing (ZeroDivisionError in
    reshard.reblock_windows: fuzzer seed 24 #944)."""
    mesh = gt.Mesh.create((2,), ("data",))
    x = np.zeros((0,), np.float32)

    def f(x):
        return gt.mesh_split(tf.reshape(x, [3, 0, 2, 3]), mesh, P("data"))

    got = gt.function(f, mesh=mesh, in_shardings=(P("data"),))(x)
    assert got.numpy().shape == (3, 0, 2, 3)
