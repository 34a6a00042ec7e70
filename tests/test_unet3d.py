"""The paper's 3-D U-Net, small: conv3d + max pool + Conv3DTranspose upsampling + concat
skip connection, trained on a 2x2x2 spatial split (depth, height and width over three
mesh axes). Loss, gradients and trained weights equal single-device TF, and the
activations move only as halos (collective-permutes), never all-gathered."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import assert_close, check_partitioned, randn

P = gt.P
SPATIAL = P(None, "a", "b", "c")  # NDHWC: D, H, W over a, b, c
SHAPES = {  # name -> weight shape (kernels DHW, in, out; Conv3DTranspose: out, in)
    "enc1": (3, 3, 3, 2, 4), "enc1_b": (4,), "enc2": (3, 3, 3, 4, 4),
    "mid1": (3, 3, 3, 4, 8), "mid2": (3, 3, 3, 8, 8), "mid2_b": (8,),
    "up": (2, 2, 2, 4, 8), "dec": (3, 3, 3, 8, 4), "head": (1, 1, 1, 4, 1),
}
NAMES = sorted(SHAPES)
LR = 0.05
STEPS = 3


def unet(x, w, upsample="transpose"):
    """x [N, D, H, W, 2] -> [N, D, H, W, 1]; w: name -> weight. `upsample`: "transpose"
    (Conv3DTranspose, stride 2) or "repeat" (each voxel repeated 2x2x2, as Keras'
    UpSampling3D does, then a 1x1x1 conv with the centre of the same filter)."""
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
    return tf.reduce_mean(tf.square(unet(x, w, upsample) - target))


def init(rng, size=8):
    # fan-in scaled (a conv transpose's filter reads its last dim)
    weights = {n: randn(rng, *s) / np.float32(np.sqrt(np.prod(s[:-1]) if len(s) > 1 else 10))
               for n, s in SHAPES.items()}
    x = randn(rng, 1, size, size, size, 2)
    target = randn(rng, 1, size, size, size, 1)
    return weights, x, target


@pytest.fixture(scope="module")
def mesh():
    return gt.Mesh.create((2, 2, 2), ("a", "b", "c"))


def kinds(low):
    return sorted(c.kind for c in low.collectives())


@pytest.mark.parametrize("size, upsample", [(8, "transpose"), (8, "repeat"),
                                           (6, "transpose")])
def test_unet3d_loss_and_gradients(mesh, size, upsample):
    """One step's loss and every weight gradient, 2x2x2 spatial split (size 6: the
    pooled 3^3 splits unevenly over 2)."""
    weights, x, target = init(np.random.default_rng(size), size)

    def step(x, target, *ws):
        w = dict(zip(NAMES, ws))
        with tf.GradientTape() as tape:
            tape.watch(ws)
            loss = loss_fn(x, target, w, upsample)
        return [loss] + tape.gradient(loss, list(ws))
    low = check_partitioned(step, (x, target, *[weights[n] for n in NAMES]), mesh,
                            (SPATIAL, SPATIAL) + (P(),) * len(NAMES))
    assert low.program.replicated_ops == []
    collectives = low.collectives()
    if size == 8:
        # activations move as halos only; the all-reduces sum the weight gradients and
        # the loss over the spatial shards
        assert {c.kind for c in collectives} == {"collective-permute", "all-reduce"}, \
            low.report()
        permuted = [c for c in collectives if c.kind == "collective-permute"]
        # every halo is one plane thick (3x3x3 kernels, SAME) and never a whole block
        assert all(1 in c.shape[1:4] for c in permuted), low.report()
        # the all-reduces (combined into one) carry the gradients and the loss, no
        # activations ("repeat" sums the gradient of the filter's centre only)
        reduced = sum(int(np.prod(c.shape)) for c in collectives if c.kind == "all-reduce")
        assert reduced <= 1 + sum(int(np.prod(s)) for s in SHAPES.values()), low.report()


def test_unet3d_trains_on_2x2x2_split(mesh):
    """A few SGD steps with sharded-program variables: losses and weights equal the
    single-device run."""
    weights, x, target = init(np.random.default_rng(1))

    def make_step(variables):
        def step(x, target):
            with tf.GradientTape() as tape:
                loss = loss_fn(x, target, variables)
            grads = tape.gradient(loss, [variables[n] for n in NAMES])
            for n, g in zip(NAMES, grads):
                variables[n].assign_sub(LR * g)
            return loss
        return step

    with tf.device("/device:CPU:0"):
        plain = {n: tf.Variable(weights[n]) for n in NAMES}
        plain_step = tf.function(make_step(plain), autograph=False)
        want = [plain_step(x, target).numpy() for _ in range(STEPS)]
    sharded = {n: gt.Variable(weights[n], mesh, P(), name=n) for n in NAMES}
    step = gt.function(make_step(sharded), mesh=mesh, in_shardings=(SPATIAL, SPATIAL))
    got = [step(x, target).numpy() for _ in range(STEPS)]
    assert_close(got, want, "losses")
    assert want[-1] < want[0]  # it trains
    for n in NAMES:
        assert_close(sharded[n].numpy(), plain[n].numpy(), n)
    low = step.lower(x, target)
    assert "all-gather" not in kinds(low), low.report()
    assert low.program.replicated_ops == []


def test_keras_unet3d_layers(mesh):
    """The same with Keras 3 layers (Conv3D, MaxPooling3D, AveragePooling3D,
    Conv3DTranspose, UpSampling3D, ZeroPadding3D, Concatenate), weights backed by
    gt.Variables: loss and gradients equal single device, halos and gradient sums only."""
    import keras
    from util import single_device
    keras.utils.set_random_seed(0)
    layers = keras.layers
    inputs = keras.Input((8, 8, 8, 2), batch_size=1)
    skip = layers.Conv3D(4, 3, padding="same", activation="relu")(inputs)
    h = layers.Conv3D(8, 3, padding="same", activation="relu")(layers.MaxPooling3D(2)(skip))
    up = layers.Conv3DTranspose(4, 2, strides=2, padding="same")(h)
    smooth = layers.UpSampling3D(2)(layers.AveragePooling3D(2)(skip))
    h = layers.Concatenate()([up, skip, smooth])
    model = keras.Model(inputs, layers.Conv3D(1, 3)(layers.ZeroPadding3D(1)(h)))
    x = randn(np.random.default_rng(0), 1, 8, 8, 8, 2)

    def step(x):
        with tf.GradientTape() as tape:
            y = model(x)
            loss = tf.reduce_mean(y * y)
        return [loss] + tape.gradient(loss, model.trainable_weights)
    want = single_device(step, (x,))
    gt.keras.shard_model(model, mesh, batch_spec=P())
    sharded = gt.function(step, mesh=mesh, in_shardings=(SPATIAL,))
    got = tf.nest.flatten(sharded(x))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g.numpy(), w, f"output {i}")
    low = sharded.lower(x)
    assert low.program.replicated_ops == []
    assert set(kinds(low)) == {"collective-permute", "all-reduce"}, low.report()
