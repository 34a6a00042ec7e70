"""Image resizes (ResizeBilinear, ResizeNearestNeighbor) and their gradients with a split
height or width keep the split: the rows each block reads come by halo exchange
(collective-permutes), not a gather; every TF mode (align_corners, half_pixel_centers),
up and down, uneven blocks; values equal single-device TF (issue 25 item 1)."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned, randn

P = gt.P
RNG = np.random.default_rng(25)
MODES = {"half_pixel": dict(half_pixel_centers=True), "align_corners":
         dict(align_corners=True), "legacy": {}}


@pytest.fixture(scope="module")
def mesh():
    return gt.Mesh.create((2, 4), ("data", "model"))


def _resize(op, size, mode):
    def resize(x):
        return getattr(tf.raw_ops, op)(images=x, size=size, **MODES[mode])
    return resize


def _gathered_dims(low):
    """Collectives other than collective-permutes (a gather of the image would be one)."""
    return [c.kind for c in low.collectives() if c.kind != "collective-permute"]


# every op and mode on an upsampled height over 4 uneven blocks and a downsampled width;
# half-pixel centers also on a height of 6 rows over 8 blocks (two compute padding only)
CASES = [(op, mode, *geometry) for op in ("ResizeBilinear", "ResizeNearestNeighbor")
         for mode, geometry in [*((m, ((2, 9, 6, 3), (13, 4), P(None, "model", "data")))
                                   for m in MODES),
                                ("half_pixel", ((1, 16, 7, 2), (6, 11),
                                                P(None, ("model", "data"))))]]


@pytest.mark.parametrize("op, mode, shape, size, spec", CASES)
def test_resize_with_split_spatial_dims_equals_single_device(op, mode, shape, size, spec, mesh):
    x = randn(RNG, *shape)
    low = check_partitioned(_resize(op, size, mode), (x,), mesh, (spec,),
                            out_shardings=(spec,))
    assert not _gathered_dims(low), low.collectives()
    assert not low.program.replicated_ops


def _gradient(op, image_shape, mode):
    """The raw gradient op of `op` into an image of `image_shape`."""
    def gradient(g):
        if op == "ResizeBilinear":
            return tf.raw_ops.ResizeBilinearGrad(grads=g, original_image=tf.zeros(image_shape),
                                                 **MODES[mode])
        return tf.raw_ops.ResizeNearestNeighborGrad(grads=g, size=image_shape[1:3],
                                                    **MODES[mode])
    return gradient


@pytest.mark.parametrize("op, mode, image_shape, size, spec", CASES)
def test_resize_gradient_with_split_spatial_dims_equals_single_device(
        op, mode, image_shape, size, spec, mesh):
    g = randn(RNG, image_shape[0], *size, image_shape[3])
    low = check_partitioned(_gradient(op, image_shape, mode), (g,), mesh, (spec,),
                            out_shardings=(spec,))
    assert not _gathered_dims(low), low.collectives()
    assert not low.program.replicated_ops


def test_training_through_a_split_resize_equals_single_device(mesh):
    """tf.image.resize's gradients (by tape) through a split height, both methods."""
    def loss_gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = (tf.reduce_sum(tf.image.resize(x, [7, 5]) ** 2)
                 + tf.reduce_sum(tf.image.resize(x, [11, 3], "nearest") ** 3))
        return tape.gradient(y, x)

    check_partitioned(loss_gradient, (randn(RNG, 2, 10, 6, 3),), mesh,
                      (P("data", "model"),), out_shardings=(P("data", "model"),))
