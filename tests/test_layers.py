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


def deep_mlp(x, *weights):
    h = x
    for k, w in enumerate(weights):
        with tf.name_scope(f"block_{k}"):
            h = tf.nn.relu(h @ w)
    return h


def test_html_of_a_large_program_is_grouped_by_layer_with_collectives_marked():
    from gspmd_tf.runtime.html_report import GRAPH_OPS_DRAWN

    depth = GRAPH_OPS_DRAWN // 2 + 1
    # every other weight split on its columns: its block's output is gathered by the next
    specs = [P("data")] + [P(None, "model") if k % 2 else P() for k in range(depth)]
    low = gt.lower(deep_mlp, MESH, specs,
                   args=[tf.TensorSpec((8, 8))] + [tf.TensorSpec((8, 8))] * depth)
    assert len(low.graph.nodes) > GRAPH_OPS_DRAWN
    page = low.report(format="html")
    assert '<g class="op"' not in page and "too many to draw" in page
    # one section per layer (no enclosing scopes here) and the collectives and layer tables
    assert page.count("<details") == len(low.layers()) + 2
    needing = {layer_of.layer for layer_of in low.layers() if layer_of.collectives}
    assert needing and page.count('<details class="coll">') == len(needing)
    assert '<svg class="timeline"' in page and page.count('stroke="#d33"') == len(
        low.collectives())


def test_an_ops_own_constants_stay_in_its_layer():
    layer_of = LayerOf(["mul_1", "mul_1/y", "block/dense/MatMul", "block/dense/MatMul/b"])
    assert layer_of("mul_1/y") == TOP
    assert layer_of("block/dense/MatMul/b") == "block/dense"
