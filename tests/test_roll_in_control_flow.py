"""tf.roll of an empty dim inside loop bodies and cond branches (found by the fuzzer's roll,
while and cond families, benchmarks/RESULTS.md §6, "Control flow and roll")."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.P


def _check(f, args, mesh, in_shardings):
    want = f(*[tf.convert_to_tensor(a) for a in args])
    got = gt.function(f, mesh=mesh, in_shardings=in_shardings)(*args)
    for g, w in zip(got, want):
        assert g.shape == tuple(w.shape)
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5)


@pytest.mark.parametrize("shape, spec", [
    ((0, 4, 4), P(None, "x")),   # seed 100 #102: an empty dim rolled inside a while body
    ((4, 0, 3), P("x")),
])
def test_roll_of_an_empty_dim_in_a_loop_body(shape, spec):
    """A roll of an empty dim (TF accepts any shift of it) has no net shift; its rule took
    the shift modulo the dim size: ZeroDivisionError (seed 100 #102, #109, #111, #279)."""
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    mesh = gt.Mesh.create((2, 4), ("x", "y"))

    def f(x):
        loop = tf.while_loop(lambda i, c: i < 4,
                             lambda i, c: (i + 1, tf.roll(tf.roll(c, 6, axis=1), 5, axis=0)),
                             (tf.constant(0), x))
        return [loop[1], tf.roll(x, [3, -7], axis=[0, 1])]

    _check(f, (x,), mesh, (spec,))


def test_roll_of_an_empty_dim_in_a_cond_branch():
    """Seed 100 #276: the same rule inside a cond branch."""
    x = np.random.default_rng(1).standard_normal((3, 0)).astype(np.float32)
    mesh = gt.Mesh.create((4,), ("x",))

    def f(x):
        return [tf.cond(tf.reduce_sum(x) > 0, lambda: tf.roll(x, -2, axis=1),
                        lambda: tf.tanh(x))]

    _check(f, (x,), mesh, (P("x"),))
