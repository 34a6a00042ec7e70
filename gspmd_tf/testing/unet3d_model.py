"""A small 3-D U-Net (the GSPMD paper's spatially partitioned model): weights, loss and
a loss-and-gradients step in plain single-device TF. Shared by tests/test_unet3d.py and
benchmarks/unet3d.py."""

import numpy as np
import tensorflow as tf

# name -> weight shape (kernels DHW, in, out; Conv3DTranspose: DHW, out, in)
SHAPES = {
    "enc1": (3, 3, 3, 2, 4), "enc1_b": (4,), "enc2": (3, 3, 3, 4, 4),
    "mid1": (3, 3, 3, 4, 8), "mid2": (3, 3, 3, 8, 8), "mid2_b": (8,),
    "up": (2, 2, 2, 4, 8), "dec": (3, 3, 3, 8, 4), "head": (1, 1, 1, 4, 1),
}
NAMES = sorted(SHAPES)


def unet(x, w, upsample="transpose"):
    """x [N, D, H, W, 2] -> [N, D, H, W, 1]; w: name -> weight. Two 3x3x3 convs, a 2x2x2
    max pool, two convs, upsampling, the skip connection concatenated, a conv and a
    1x1x1 head. `upsample`: "transpose" (Conv3DTranspose, stride 2) or "repeat" (each
    voxel repeated 2x2x2, as Keras' UpSampling3D does, then a 1x1x1 conv with the centre
    of the same filter)."""
    def conv(h, name, bias=None):
        h = tf.nn.conv3d(h, w[name], [1] * 5, "SAME")
        return tf.nn.relu(h if bias is None else tf.nn.bias_add(h, w[bias]))
    skip = conv(conv(x, "enc1", "enc1_b"), "enc2")
    h = tf.nn.max_pool3d(skip, 2, 2, "VALID")
    h = conv(conv(h, "mid1"), "mid2", "mid2_b")
    n, d, hh, ww, _ = skip.shape
    if upsample == "transpose":
        h = tf.nn.conv3d_transpose(h, w["up"], [n, d, hh, ww, 4], [1, 2, 2, 2, 1], "SAME")
    else:
        for axis in (1, 2, 3):
            h = tf.repeat(h, 2, axis=axis)
        kernel = tf.reshape(tf.transpose(w["up"][0, 0, 0]), [1, 1, 1, 8, 4])
        h = tf.nn.conv3d(h, kernel, [1] * 5, "SAME")
    h = conv(tf.concat([h, skip], axis=-1), "dec")
    return tf.nn.conv3d(h, w["head"], [1] * 5, "VALID")


def loss_fn(x, target, w, upsample="transpose"):
    """Mean squared error of the U-Net's output against `target`."""
    return tf.reduce_mean(tf.square(unet(x, w, upsample) - target))


def init(rng, size=8):
    """(weights, x, target) as float32 numpy arrays: fan-in scaled normal weights, a
    [1, size, size, size, 2] input and its target."""
    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    # a conv transpose's filter reads its last dim: fan-in is every dim but the last
    weights = {n: normal(*s) / np.float32(np.sqrt(np.prod(s[:-1]) if len(s) > 1 else 10))
               for n, s in SHAPES.items()}
    return weights, normal(1, size, size, size, 2), normal(1, size, size, size, 1)


def loss_and_grads(upsample="transpose"):
    """(x, target, *weights in NAMES order) -> [loss] + the weights' gradients."""
    def step(x, target, *ws):
        with tf.GradientTape() as tape:
            tape.watch(ws)
            loss = loss_fn(x, target, dict(zip(NAMES, ws)), upsample)
        return [loss] + tape.gradient(loss, list(ws))
    return step
