"""The paper's 3-D U-Net, small: conv3d + max pool + Conv3DTranspose upsampling + concat
skip connection, trained on a 2x2x2 spatial split (depth, height and width over three
mesh axes). Loss, gradients and trained weights equal single-device TF, and the
activations move only as halos (collective-permutes), never all-gathered. The model is
benchmarks/unet3d.py (which also prints these collectives beside XLA's, RESULTS.md)."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.testing.unet3d_model import NAMES, SHAPES, init, loss_and_grads, loss_fn
from util import assert_close, check_partitioned, randn

P = gt.P
SPATIAL = P(None, "a", "b", "c")  # NDHWC: D, H, W over a, b, c
LR = 0.05
STEPS = 3


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
    low = check_partitioned(loss_and_grads(upsample),
                            (x, target, *[weights[n] for n in NAMES]), mesh,
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
