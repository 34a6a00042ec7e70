"""Propagation makes XLA's choices on a 2x4 ("data", "model") mesh.

Expected shardings were read from XLA's HLO right after its sharding propagation pass
(GSPMD and Shardy agree on all of these), with benchmarks/xla_reference.py; the table is
in docs/xla_reference_shardings.md. Only lowering runs here; values are checked in
test_values.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.layout import Layout

P = gt.P
B, S, D, H, HEADS, HD, V = 8, 16, 32, 64, 4, 8, 64
MESH = gt.Mesh.abstract((2, 4), ("data", "model"))


def spec(*shape, dtype=tf.float32):
    return tf.TensorSpec(shape, dtype)


def assert_specs(lowered, expected):
    for name, want in expected.items():
        got = lowered.layout_of(name)
        want_layout = Layout.from_spec(MESH, want, len(got.dims))
        assert got == want_layout, f"{name}: got {got.to_spec()!r}, XLA chose {want!r}"


def test_megatron_mlp():
    def mlp(x, w1, w2):
        h = tf.matmul(x, w1, name="h")
        r = tf.nn.relu(h, name="relu")
        return tf.matmul(r, w2, name="y")

    f = gt.function(mlp, mesh=MESH, in_shardings=(P("data"), P(None, "model"), P("model")))
    low = f.lower(spec(B, D), spec(D, H), spec(H, D))
    assert_specs(low, {"h": P("data", "model"), "relu": P("data", "model"), "y": P("data")})
    kinds = [(c.kind, c.axes) for c in low.collectives()]
    assert kinds == [("all-reduce", ("model",))]
    assert str(low.output_shardings[0]) == \
        "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"


def test_attention_logits_split_by_batch_and_heads():
    def attention(x, wq, wk, wv, wo):
        def heads(t, name):
            return tf.reshape(t, [B, S, HEADS, HD], name=name)
        q = heads(tf.matmul(x, wq, name="q"), "q_heads")
        k = heads(tf.matmul(x, wk), "k_heads")
        v = heads(tf.matmul(x, wv), "v_heads")
        logits = tf.identity(tf.einsum("bqhd,bkhd->bhqk", q, k), name="logits")
        probs = tf.nn.softmax(logits, name="probs")
        ctx = tf.identity(tf.einsum("bhqk,bkhd->bqhd", probs, v), name="context")
        merged = tf.reshape(ctx, [B, S, HEADS * HD], name="merged")
        return tf.matmul(merged, wo, name="out")

    w = P(None, "model")
    f = gt.function(attention, mesh=MESH,
                    in_shardings=(P("data"), w, w, w, P("model")))
    low = f.lower(spec(B, S, D), *[spec(D, HEADS * HD)] * 3, spec(HEADS * HD, D))
    assert_specs(low, {
        "q": P("data", None, "model"),
        "q_heads": P("data", None, "model", None),
        "logits": P("data", "model", None, None),
        "probs": P("data", "model", None, None),
        "context": P("data", None, "model", None),
        "merged": P("data", None, "model"),
        "out": P("data", None, None),
    })
    assert [c.kind for c in low.collectives()] == ["all-reduce"]


def test_layer_norm_over_split_last_dim():
    def layer_norm(x, gamma, beta):
        mean = tf.reduce_mean(x, axis=-1, keepdims=True, name="mean")
        centered = tf.subtract(x, mean, name="centered")
        var = tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True, name="var")
        normed = tf.multiply(centered, tf.math.rsqrt(var + 1e-5), name="normed")
        return tf.add(normed * gamma, beta, name="out")

    f = gt.function(layer_norm, mesh=MESH, in_shardings=(P("data", None, "model"), None, None))
    low = f.lower(spec(B, S, D), spec(D), spec(D))
    assert_specs(low, {"gamma": P("model"), "beta": P("model"),
                       "mean": P("data"), "var": P("data"),
                       "centered": P("data", None, "model"), "normed": P("data", None, "model"),
                       "out": P("data", None, "model")})
    assert [c.kind for c in low.collectives()] == ["all-reduce", "all-reduce"]


def test_embedding_lookup_from_vocab_split_table():
    def embed(table, ids):
        return tf.gather(table, ids, name="emb")

    f = gt.function(embed, mesh=MESH, in_shardings=(P("model"), P("data")))
    low = f.lower(spec(V, D), spec(B, S, dtype=tf.int32))
    assert_specs(low, {"emb": P("data")})
    assert [(c.kind, c.axes) for c in low.collectives()] == [("all-reduce", ("model",))]


@pytest.mark.parametrize("in_spec, in_shape, out_shape, out_spec", [
    (P("data", None, "model"), (B, S, HEADS * HD), (B, S, HEADS, HD),
     P("data", None, "model", None)),
    (P("data"), (B, S, D), (B * S, D), P("data")),
    (P(None, "data"), (B, S, D), (B * S, D), P()),
])
def test_reshape(in_spec, in_shape, out_shape, out_spec):
    f = gt.function(lambda x: tf.reshape(x, out_shape, name="r"), mesh=MESH,
                    in_shardings=(in_spec,))
    assert_specs(f.lower(spec(*in_shape)), {"r": out_spec})


def test_transpose():
    f = gt.function(lambda x: tf.transpose(x, [2, 0, 1], name="t"), mesh=MESH,
                    in_shardings=(P("data", None, "model"),))
    low = f.lower(spec(B, S, D))
    assert_specs(low, {"t": P("model", "data")})
    assert low.collectives() == []


def test_reductions_over_split_and_unsplit_dims():
    def reduce(x):
        return (tf.reduce_sum(x, 1, name="s1"), tf.reduce_sum(x, 0, name="s0"),
                tf.reduce_max(x, 1, name="m1"), tf.reduce_sum(x, name="all"))

    f = gt.function(reduce, mesh=MESH, in_shardings=(P("data", "model"),))
    low = f.lower(spec(B, D))
    assert_specs(low, {"s1": P("data"), "s0": P("model"), "m1": P("data"), "all": P()})
    assert [c.kind for c in low.collectives()].count("all-reduce") >= 4


def test_dot_with_contracting_dim_split_on_both_sides():
    f = gt.function(lambda a, b: tf.matmul(a, b, name="c"), mesh=MESH,
                    in_shardings=(P(None, "model"), P("model")))
    low = f.lower(spec(B, D), spec(D, H))
    assert_specs(low, {"c": P()})
    assert [(c.kind, c.axes) for c in low.collectives()] == [("all-reduce", ("model",))]


def test_weight_inferred_backward_from_annotated_activation():
    def f(x, w):
        h = tf.matmul(x, w, name="h")
        return gt.mesh_split(h, MESH, P("data", "model"))

    low = gt.function(f, mesh=MESH, in_shardings=(P("data"), None)).lower(spec(B, D), spec(D, H))
    assert_specs(low, {"w": P(None, "model"), "h": P("data", "model")})
    assert low.collectives() == []


def test_elementwise_broadcast_and_merge():
    def f(x, b, y):
        return tf.add(x, b, name="xb"), tf.add(gt.mesh_split(x, MESH, P("data")), y, name="xy")

    low = gt.function(f, mesh=MESH, in_shardings=(None, None, P(None, "model"))).lower(
        spec(B, D), spec(D), spec(B, D))
    assert_specs(low, {"xy": P("data", "model")})

    low = gt.function(lambda x, b: tf.add(x, b, name="out"), mesh=MESH,
                      in_shardings=(P("data", "model"), None)).lower(spec(B, D), spec(D))
    assert_specs(low, {"b": P("model"), "out": P("data", "model")})


def test_softmax_cross_entropy():
    def loss(logits, labels):
        xent = tf.identity(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits),
                           name="xent")
        return tf.reduce_mean(xent, name="loss")

    low = gt.function(loss, mesh=MESH, in_shardings=(P("data", "model"), P("data"))).lower(
        spec(B, V), spec(B, dtype=tf.int32))
    assert_specs(low, {"xent": P("data"), "loss": P()})


def test_uneven_dot():
    low = gt.function(lambda x, w: tf.matmul(x, w, name="y"), mesh=MESH,
                      in_shardings=(P("data", "model"), P("model"))).lower(spec(6, 10),
                                                                          spec(10, 12))
    assert_specs(low, {"y": P("data")})
