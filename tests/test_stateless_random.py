"""Stateless random ops on a split result: each shard holds what the single-device
program draws for its slice (the same seed gives the same numbers), with no rule-less
op running replicated."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned, randn

P = gt.P
SEED = (7, 11)
SHAPE = (8, 12)

DRAWS = {
    "binomial": lambda: tf.random.stateless_binomial(SHAPE, SEED, counts=[5.0] * 12,
                                                     probs=0.3, output_dtype=tf.float32),
    "gamma": lambda: tf.random.stateless_gamma(SHAPE, SEED, alpha=tf.linspace(0.5, 3.0, 12)),
    "poisson": lambda: tf.random.stateless_poisson(SHAPE, SEED, lam=[2.0] * 12,
                                                   dtype=tf.float32),
    "parameterized_truncated_normal": lambda: tf.random.stateless_parameterized_truncated_normal(
        SHAPE, SEED, means=0.5, stddevs=2.0, minvals=-1.0, maxvals=1.5),
    "categorical": lambda: tf.cast(tf.random.stateless_categorical(
        tf.math.log([[0.1, 0.2, 0.7]] * 8), 12, SEED), tf.float32),
    "shuffle": lambda: tf.random.experimental.stateless_shuffle(
        tf.reshape(tf.range(96.0), SHAPE), SEED),
}


@pytest.fixture(scope="module")
def mesh():
    return gt.Mesh.create((2, 4), ("a", "b"))


@pytest.mark.parametrize("name", sorted(DRAWS))
@pytest.mark.parametrize("spec", [P("a", "b"), P(None, ("a", "b"))])
def test_stateless_draw_split(mesh, name, spec):
    def fn(x):
        return gt.mesh_split(DRAWS[name]() * x, mesh, spec)
    x = np.float32(1.5)
    low = check_partitioned(fn, (x,), mesh, (P(),))
    assert low.program.replicated_ops == [], low.report()
    assert str(low.output_shardings[0]) != "{replicated}"
    assert [c.kind for c in low.collectives()] == [], low.report()


@pytest.mark.parametrize("spec", [P("a"), P("a", None, "b")])
def test_stateless_dropout_on_split_activations(mesh, rng, spec):
    """tf.nn.experimental.stateless_dropout (and its gradient) keeps the units the
    single-device program keeps."""
    x, w = randn(rng, 4, 6, 8), randn(rng, 8, 8)

    def fn(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            h = tf.nn.experimental.stateless_dropout(tf.nn.relu(x @ w), 0.4, SEED)
            loss = tf.reduce_sum(h * h)
        return h, tape.gradient(loss, w)
    low = check_partitioned(fn, (x, w), mesh, (spec, None))
    assert low.program.replicated_ops == []
