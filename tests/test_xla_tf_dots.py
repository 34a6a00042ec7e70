"""XlaBackend(tf_dots_from=N): large dots run op by op on TF's kernels, the rest
compiled; values equal single-device TF, and segments.large_dots counts multiply-adds."""

import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import segments
from gspmd_tf.backends.xla import XlaBackend
from util import assert_close, randn, single_device

P = gt.P


def test_multiply_adds_of_dots(rng):
    """MatMul, BatchMatMulV2, Einsum and Conv2D with its two gradients: the nodes at or
    above the threshold, by their multiply-adds."""
    mesh = gt.Mesh.create((1,), ("x",))

    def fn(a, b, batched, image, kernel):
        with tf.GradientTape() as tape:
            tape.watch([image, kernel])
            conv = tf.nn.conv2d(image, kernel, strides=1, padding="VALID")
            loss = tf.reduce_sum(conv)
        return (tf.matmul(a, b, transpose_a=True), tf.matmul(batched, batched),
                tf.einsum("ij,jk->ik", b, tf.transpose(b)), conv,
                *tape.gradient(loss, [image, kernel]))

    args = [randn(rng, 6, 4), randn(rng, 6, 5), randn(rng, 3, 5, 5), randn(rng, 1, 6, 6, 2),
            randn(rng, 3, 3, 2, 4)]
    program = gt.lower(fn, mesh, (None,) * 5, args=args).compile().program
    found = {}
    for threshold in (1, 126, 150, 577):
        found[threshold] = sorted(program.nodes[i].op
                                  for i in segments.large_dots(program, threshold))
    # matmul 4x5 over 6: 120; batched 3x5x5 over 5: 375; einsum 6x6 over 5: 180;
    # conv 4x4x4 outputs over 3x3x2: 1152, and so each gradient
    assert found[1] == sorted(["MatMul", "BatchMatMulV2", "Einsum", "Conv2D",
                               "Conv2DBackpropInput", "Conv2DBackpropFilter"]), found[1]
    assert found[126] == sorted(["BatchMatMulV2", "Einsum", "Conv2D",
                                 "Conv2DBackpropInput", "Conv2DBackpropFilter"]), found[126]
    assert found[577] == sorted(["Conv2D", "Conv2DBackpropInput",
                                 "Conv2DBackpropFilter"]), found[577]


def test_multiply_adds_of_3d_and_depthwise_convolutions(rng):
    """Conv3D sums over its window and input channels, a depthwise convolution over its
    window alone; each gradient does the forward's multiply-adds."""
    mesh = gt.Mesh.create((1,), ("x",))

    def fn(volume, kernel3d, image, depthwise):
        with tf.GradientTape() as tape:
            tape.watch([volume, kernel3d, image, depthwise])
            conv3d = tf.nn.conv3d(volume, kernel3d, strides=[1] * 5, padding="VALID")
            dw = tf.nn.depthwise_conv2d(image, depthwise, strides=[1] * 4, padding="VALID")
            loss = tf.reduce_sum(conv3d) + tf.reduce_sum(dw)
        return (conv3d, dw, *tape.gradient(loss, [volume, kernel3d, image, depthwise]))

    args = [randn(rng, 1, 4, 4, 4, 2), randn(rng, 3, 3, 3, 2, 4), randn(rng, 1, 6, 6, 2),
            randn(rng, 3, 3, 2, 2)]
    program = gt.lower(fn, mesh, (None,) * 4, args=args).compile().program

    def found(threshold):
        return sorted(program.nodes[i].op for i in segments.large_dots(program, threshold))
    # conv3d: 2x2x2x4 outputs over 3x3x3x2: 1728; depthwise: 4x4x4 outputs over 3x3: 576
    conv3d = ["Conv3D", "Conv3DBackpropFilterV2", "Conv3DBackpropInputV2"]
    depthwise = ["DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropFilter",
                 "DepthwiseConv2dNativeBackpropInput"]
    assert found(576) == sorted(conv3d + depthwise), found(576)
    assert found(577) == found(1728) == conv3d, found(577)
    assert found(1729) == [], found(1729)


def test_an_einsum_of_one_operand_multiplies_nothing(rng):
    """'aa->a' and 'ij->j' sum without products: no multiply-adds (it crashed the count)."""
    mesh = gt.Mesh.create((1,), ("x",))

    def fn(square, matrix):
        return tf.einsum("aa->a", square), tf.einsum("ij->j", matrix), \
            tf.einsum("ij,jk->ik", matrix, tf.transpose(matrix))

    args = [randn(rng, 5, 5), randn(rng, 4, 3)]
    program = gt.lower(fn, mesh, (None,) * 2, args=args).compile().program
    counts = sorted(segments.dot_multiply_adds(program).values())
    assert counts == [0, 0, 4 * 4 * 3], counts


@pytest.mark.parametrize("shape,axes", [((8,), ("x",)), ((2, 4), ("data", "model"))],
                         ids=["8", "2x4"])
def test_large_dots_on_tf_kernels_equal_single_device(shape, axes, rng):
    """A Megatron MLP training step with its dots left to TF: every dot runs op by op,
    the elementwise rest in segments (forward 2, gradients 3 dots), and the values equal
    TF's."""
    mesh = gt.Mesh.create(shape, axes)
    a, b = axes[0], axes[-1]

    def fn(x, w1, w2):
        with tf.GradientTape() as tape:
            tape.watch([w1, w2])
            h = tf.nn.relu(tf.matmul(x, w1))
            loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - x))
        return (loss, *tape.gradient(loss, [w1, w2]))

    args = [randn(rng, 16, 24), randn(rng, 24, 32), randn(rng, 32, 24)]
    f = gt.function(fn, mesh=mesh, in_shardings=(P(a), P(None, b), P(b, None)),
                    backend=lambda m: XlaBackend(m, tf_dots_from=1))
    got = [t.numpy() for t in tf.nest.flatten(f(*args))]
    for i, (g, w) in enumerate(zip(got, single_device(fn, args))):
        assert_close(g, w, f"output {i}")
    run = f.lower(*args).compile()
    compiled = {i for s in run.plan.steps if isinstance(s, segments.Segment)
                for i in s.nodes}
    dots = [i for i, node in enumerate(run.program.nodes) if node.op == "MatMul"]
    assert len(dots) == 5 and not compiled & set(dots), (dots, compiled)
    assert compiled
