"""Per-layer accounting: collectives, their bytes and tensor bytes per device grouped by
name scope, gradient ops in the layer they differentiate; in report() and the HTML."""

import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.runtime.layers import TOP, LayerOf

P = gt.P
MESH = gt.Mesh.abstract((2, 4), ("data", "model"))


def train_step(x, w1, w2):
    with tf.GradientTape() as tape:
        tape.watch([w1, w2])
        with tf.name_scope("mlp"):
            with tf.name_scope("dense_1"):
                h = tf.nn.relu(x @ w1)
            with tf.name_scope("dense_2"):
                y = h @ w2
        loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, [w1, w2])


@pytest.fixture(scope="module")
def lowered():
    specs = (tf.TensorSpec((8, 16)), tf.TensorSpec((16, 32)), tf.TensorSpec((32, 16)))
    return gt.lower(train_step, MESH, (P("data"), P(None, "model"), P("model")), args=specs)


def test_layers_count_collectives_and_bytes_where_their_ops_are(lowered):
    stats = {s.layer: s for s in lowered.layers()}
    assert set(stats) == {TOP, "mlp/dense_1", "mlp/dense_2"}
    # forward matmul + Relu, and their gradients (ReluGrad, the weight's MatMul)
    assert stats["mlp/dense_1"].ops == 4
    # w1's gradient [16, 32] split over 'model': a [16, 8] f32 all-reduce over 'data'
    assert (stats["mlp/dense_1"].collectives, stats["mlp/dense_1"].collective_bytes) == (1, 512)
    # the forward contraction over 'model' ([4, 16] f32) and w2's gradient ([8, 16] f32)
    assert (stats["mlp/dense_2"].collectives, stats["mlp/dense_2"].collective_bytes) == (2, 768)
    assert stats[TOP].collectives == 0
    assert sum(s.collective_bytes for s in stats.values()) == sum(
        c.bytes for c in lowered.collectives())
    # dense_1's forward matmul and Relu are [8, 32] split 2x4: 4 * 8 f32 each on a device
    assert stats["mlp/dense_1"].tensor_bytes >= 2 * 4 * 8 * 4


def test_report_and_html_have_the_layer_table(lowered):
    dense_2 = next(s for s in lowered.layers() if s.layer == "mlp/dense_2")
    line = next(l for l in lowered.report().splitlines() if l.startswith("mlp/dense_2 "))
    assert line.split()[1:] == [str(dense_2.ops), "2", "768", str(dense_2.tensor_bytes)]
    page = lowered.report(format="html")
    assert '<table class="layers">' in page and "<td>mlp/dense_1</td>" in page


def test_gradient_ops_join_the_forward_layer_they_differentiate():
    layer_of = LayerOf(["model/block/dense/MatMul", "model/block/dense/BiasAdd", "Sum"])
    assert layer_of("gradient_tape/model/block/dense/MatMul/MatMul_1") == "model/block/dense"
    assert layer_of("gradient_tape/Sum/Tile") == TOP
    assert layer_of("model/block/dense/MatMul") == "model/block/dense"
    assert layer_of("Sum") == TOP
