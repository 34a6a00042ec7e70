"""Advice: for a collective above a size, the user sharding whose change removes it,
found by lowering alternatives and pricing them on the cost model; applying it works."""

import html

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.P
MESH = gt.Mesh.abstract((2, 4), ("data", "model"))
SPECS = (tf.TensorSpec((8, 16)), tf.TensorSpec((16, 64)), tf.TensorSpec((64, 8)))
# Megatron's MLP wants w2 split on its rows; this one splits its columns, so the hidden
# activation is all-gathered before the second matmul
BAD = (P("data"), P(None, "model"), P(None, "model"))


def mlp(x, w1, w2):
    h = tf.nn.relu(x @ w1)
    return tf.matmul(h, w2, name="second")


@pytest.fixture(scope="module")
def advice():
    low = gt.lower(mlp, MESH, BAD, args=SPECS)
    assert [c.kind for c in low.collectives()] == ["all-gather"]
    return low, low.advise(threshold_bytes=100)


def test_advice_names_the_badly_annotated_weight_and_the_better_spec(advice):
    low, [tip] = advice
    assert tip.collective == low.collectives()[0]
    assert tip.tensor == "w2" and tip.where == "in_shardings[2] (argument 'w2')"
    assert (tip.current, tip.spec) == (P(None, "model"), P("model"))
    assert tip.removes and tip.seconds_saved > 0
    # a [4, 16] f32 all-gather becomes the [4, 8] f32 all-reduce of the partial sums
    assert tip.bytes_saved == 4 * 16 * 4 - 4 * 8 * 4
    assert "in_shardings[2] (argument 'w2'): P(None, 'model') -> P('model') removes the " \
           "all-gather" in tip.text()


def test_applying_the_advice_removes_the_collective(advice, mesh):
    _, [tip] = advice
    fixed = (BAD[0], BAD[1], tip.spec)
    low = gt.lower(mlp, MESH, fixed, args=SPECS)
    assert "all-gather" not in [c.kind for c in low.collectives()]
    assert low.advise(threshold_bytes=100) == []
    f = gt.function(mlp, mesh=mesh, in_shardings=fixed)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s.shape).astype(np.float32) for s in SPECS]
    np.testing.assert_allclose(f(*args).numpy(), mlp(*map(tf.constant, args)).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_threshold_and_report(advice):
    low, [tip] = advice
    assert low.advise(threshold_bytes=4 * 16 * 4) == []  # not above the threshold
    assert tip.text() in low.report(advise_bytes=100)
    assert html.escape(tip.text()) in low.report(format="html", advise_bytes=100)


def test_advice_names_a_badly_split_variable(mesh):
    w1 = gt.Variable(np.ones((16, 64), np.float32), mesh=mesh, spec=P(None, "model"))
    w2 = gt.Variable(np.ones((64, 8), np.float32), mesh=mesh, spec=P(None, "model"))

    @gt.function(mesh=mesh, in_shardings=(P("data"),))
    def step(x):
        return mlp(x, w1, w2)

    [tip] = step.lower(np.ones((8, 16), np.float32)).advise(threshold_bytes=100)
    assert tip.where == f"the spec of gt.Variable {w2.name!r}"
    assert (tip.current, tip.spec) == (P(None, "model"), P("model")) and tip.removes
