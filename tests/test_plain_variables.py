"""gt.function(..., layout_map=...) takes the plain tf.Variables a function captures
(tf.Module models, Keras 2 / tf_keras layers) over as gt.Variables, in place."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.P


class _TwoLayers(tf.Module):
    """A tf.Module model as one-device code writes it: attributes and a list."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w1 = tf.Variable(rng.standard_normal((8, 16)).astype(np.float32), name="w1")
        self.biases = [tf.Variable(np.zeros(16, np.float32), name="b1")]
        self.w2 = tf.Variable(rng.standard_normal((16, 4)).astype(np.float32), name="w2")

    def __call__(self, x):
        return tf.nn.relu(x @ self.w1 + self.biases[0]) @ self.w2


def _sgd_step(model, variables):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        for variable, grad in zip(variables(), tape.gradient(loss, variables())):
            variable.assign_sub(0.1 * grad)
        return loss
    return step


def _data():
    rng = np.random.default_rng(1)
    return (rng.standard_normal((8, 8)).astype(np.float32),
            rng.standard_normal((8, 4)).astype(np.float32))


def _train_twice(model, variables, layout_map, mesh):
    """Losses and final values of 3 SGD steps on one device (tf.function), then of the
    same steps from the same start under gt.function with `layout_map`."""
    x, y = _data()
    step = _sgd_step(model, variables)
    start = [v.numpy() for v in variables()]
    single = tf.function(step)
    want = [float(single(x, y)) for _ in range(3)]
    want_values = [v.numpy() for v in variables()]
    for variable, value in zip(variables(), start):
        variable.assign(value)
    partitioned = gt.function(step, mesh=mesh, in_shardings=(P("data"), P("data")),
                              layout_map=layout_map)
    got = [float(partitioned(x, y).numpy()) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for variable, value in zip(variables(), want_values):
        np.testing.assert_allclose(variable.numpy(), value, rtol=1e-5, atol=1e-6)


def test_tf_module_variables_are_taken_over_by_the_layout_map(mesh):
    model = _TwoLayers()
    held = model.biases[0]
    _train_twice(model, lambda: model.trainable_variables,
                 {"w1": P(None, "model"), "w2": P("model", None)}, mesh)
    assert isinstance(model.w1, gt.Variable) and model.w1.spec == P(None, "model")
    assert model.w2.spec == P("model")
    # unmatched: replicated; the list holds the same object, taken over in place
    assert model.biases[0] is held and isinstance(held, gt.Variable) and held.spec == P()


def test_tf_keras_model_trains_under_gt_function(mesh):
    tf_keras = pytest.importorskip("tf_keras")
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Dense(16, activation="relu", name="d1"),
                                 tf_keras.layers.Dense(4, name="d2")])
    model.build((None, 8))
    _train_twice(model, lambda: model.trainable_variables,
                 {"d1/kernel": P(None, "model"), "d2/kernel": P("model", None)}, mesh)
    assert model.get_layer("d1").kernel.spec == P(None, "model")
    assert model.get_layer("d2").bias.spec == P()


def test_without_a_layout_map_a_plain_variable_is_refused_naming_the_option(mesh):
    variable = tf.Variable(np.ones((4, 8), np.float32))
    f = gt.function(lambda x: x @ variable, mesh=mesh)
    with pytest.raises(gt.ShardingError, match="layout_map="):
        f(np.ones((2, 4), np.float32))
    assert not isinstance(variable, gt.Variable)


def test_a_bad_spec_leaves_every_variable_as_it_was(mesh):
    model = _TwoLayers()
    f = gt.function(lambda x: model(x), mesh=mesh,
                    layout_map={"w1": P(None, "model"), "w2": P("nope", None)})
    with pytest.raises(gt.ShardingError, match="w2"):
        f(_data()[0])
    assert not any(isinstance(v, gt.Variable) for v in model.trainable_variables)
