"""Lowered.explain: the chain from a tensor's sharding back to the user shardings it came
from, and why a dim was left unsplit (conflicts, REPLICATE factors)."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.P
B, D, H = 8, 32, 64
ABSTRACT = gt.Mesh.abstract((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def mesh():
    return gt.Mesh.create((2, 4), ("data", "model"))


def spec(*shape):
    return tf.TensorSpec(shape, tf.float32)


def lines_about(text, start):
    """The lines of `text` that start with `start`."""
    return [line for line in text.splitlines() if line.startswith(start)]


def test_mlp_names_its_input_and_weight_variables(mesh):
    rng = np.random.default_rng(0)
    w1 = gt.Variable(rng.standard_normal((D, H)).astype(np.float32), mesh, P(None, "model"),
                     name="w1")
    w2 = gt.Variable(rng.standard_normal((H, D)).astype(np.float32), mesh, P("model", None),
                     name="w2")

    def mlp(x):
        h = tf.matmul(x, w1.read_value(), name="h")
        r = tf.nn.relu(h, name="relu")
        return tf.matmul(r, w2.read_value(), name="y")

    low = gt.function(mlp, mesh=mesh, in_shardings=(P("data"),)).lower(spec(B, D))
    text = low.explain("relu")
    assert text.startswith("relu (Relu, [8, 64]) is split P('data', 'model').")
    (data,) = lines_about(text, "- 'data' (dim 0)")
    assert "argument 0 ('x', in_shardings[0])" in data
    assert "forward through MatMul 'h', Relu 'relu' (layer 1: all ops)" in data
    (model,) = lines_about(text, "- 'model' (dim 1)")
    assert "variable 'w1:0' (a captured gt.Variable, spec P(None, 'model'))" in model
    assert "MatMul 'h'" in model and "w2" not in text
    # 'model' is summed away in y: its dim 1 has no user sharding
    text = low.explain("y")
    assert "is split P('data')" in text
    assert lines_about(text, "- dim 1: replicated, no user sharding reaches it")
    # a user sharding explains itself
    x = low.graph.tensor_name(low.graph.inputs[0])
    assert "It is a user sharding: argument 0" in low.explain(x)


def test_backward_hop_into_an_unannotated_weight():
    def mlp(x, w1, w2):
        r = tf.nn.relu(tf.matmul(x, w1, name="h"), name="relu")
        return tf.matmul(r, w2, name="y")

    low = gt.function(mlp, mesh=ABSTRACT, in_shardings=(P("data"), P(None, "model"), None)) \
        .lower(spec(B, D), spec(D, H), spec(H, D))
    (model,) = lines_about(low.explain("w2"), "- 'model' (dim 0)")
    assert model == ("- 'model' (dim 0) comes from argument 1 ('w1', in_shardings[1]) "
                     "forward through MatMul 'h', Relu 'relu' (layer 1: all ops), then "
                     "backward through MatMul 'y' (layer 1: all ops).")


def matmul(x, w):
    return tf.matmul(x, w, name="y")


def test_conflict_on_a_tie_goes_to_the_earlier_operand():
    low = gt.function(matmul, mesh=ABSTRACT, in_shardings=(P("model", None), P(None, "model"))) \
        .lower(spec(B, D), spec(D, H))
    text = low.explain("y")
    assert "is split P('model')" in text
    (conflict,) = lines_about(text, "- dim 1 lacks 'model'")
    assert "argument 1 ('w', in_shardings[1]) wanted it here" in conflict
    assert "already splits dim 0, from argument 0 ('x', in_shardings[0])" in conflict
    assert "both split 4 ways, and on a tie the earlier tensor of the op wins ('x' comes " \
        "before 'w'" in conflict


def test_conflict_goes_to_the_larger_split():
    low = gt.function(matmul, mesh=ABSTRACT,
                      in_shardings=(P("model", None), P(None, ("data", "model")))) \
        .lower(spec(B, D), spec(D, H))
    text = low.explain("y")
    assert "is split P(None, ('data', 'model'))" in text
    assert lines_about(text, "- 'data' and 'model' (dim 1) come from argument 1 ('w'")
    (conflict,) = lines_about(text, "- dim 0 lacks 'model'")
    assert "argument 0 ('x', in_shardings[0]) wanted it here" in conflict
    assert "the larger split wins (8 ways, ('data', 'model') on 'w', against 4 ways)" \
        in conflict


def test_conflict_decided_by_an_earlier_layer():
    """The add (pass-through, layer 0) gives y x's split before the dot (layer 1) can
    offer w's: elementwise ops before dots, as XLA's aggressiveness levels order them
    (docs/xla_reference_shardings.md, case 13c)."""
    def f(x, c, w):
        return tf.add(x, tf.matmul(c, w, name="y"), name="d")

    low = gt.function(f, mesh=ABSTRACT, in_shardings=(P("model", None), None, P(None, "model"))) \
        .lower(spec(B, D), spec(B, 16), spec(16, D))
    text = low.explain("y")
    assert "is split P('model')" in text
    (model,) = lines_about(text, "- 'model' (dim 0)")
    assert "argument 0 ('x', in_shardings[0]) backward through AddV2 'd' (layer 0: " \
        "pass-through)" in model
    (conflict,) = lines_about(text, "- dim 1 lacks 'model'")
    assert "argument 2 ('w', in_shardings[2]) wanted it here" in conflict
    assert "'model' got there first, through AddV2 'd' (layer 0: pass-through)" in conflict


def test_hint_and_out_shardings_are_named():
    def f(x):
        h = gt.mesh_split(tf.matmul(x, x, transpose_b=True), ABSTRACT, P(None, "model"))
        m = tf.multiply(tf.tanh(h, name="t"), 2.0, name="m")
        return m, tf.tanh(x, name="out")

    low = gt.function(f, mesh=ABSTRACT, out_shardings=(None, P("data"))).lower(spec(B, D))
    (annotated,) = low.graph.annotations
    hint = low.graph.tensor_name(annotated)
    (model,) = lines_about(low.explain("m"), "- 'model' (dim 1)")
    assert f"the annotation on {hint!r} (gt.mesh_split or an XlaSharding op)" in model
    assert "forward through Tanh 't', Mul 'm' (layer 0: pass-through)" in model
    output = low.graph.tensor_name(low.graph.outputs[1])
    (data,) = lines_about(low.explain("out"), "- 'data' (dim 0)")
    assert f"out_shardings[1] (output 1, {output!r}) backward through" in data


def test_replicate_factor_is_named():
    low = gt.function(lambda x: tf.tile(x, [1, 2], name="t"), mesh=ABSTRACT,
                      in_shardings=(P(None, "model"),)).lower(spec(B, 16))
    (line,) = lines_about(low.explain("t"), "- dim 1: replicated, Tile 't' keeps it whole")
    assert "need_replication" in line


def test_unknown_name_lists_close_names():
    low = gt.function(matmul, mesh=ABSTRACT, in_shardings=(P("data"), None)) \
        .lower(spec(B, D), spec(D, H))
    with pytest.raises(gt.ShardingError, match=r"no tensor named 'w_'.*close names: 'w'"):
        low.explain("w_")


def test_keras_lowered_step_explains(mesh):
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("gt.keras needs Keras' TensorFlow backend")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)),
                              keras.layers.Dense(32, activation="relu", name="d1"),
                              keras.layers.Dense(5, name="d2")], name="explained")
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    gt.keras.shard_model(model, mesh, {".*/d1/kernel": P(None, "model")},
                         batch_spec=P("data", None))
    x = np.zeros((8, 12), np.float32)
    low = gt.keras.lowered(model, "predict", data=(x,))
    (hidden,) = [n.name for n in low.graph.nodes if n.op == "MatMul" and "d1" in n.name]
    text = low.explain(hidden)
    assert "is split P('data', 'model')" in text
    (model_axis,) = lines_about(text, "- 'model' (dim 1)")
    assert "variable 'explained/d1/kernel:0' (a captured gt.Variable" in model_axis
    (data_axis,) = lines_about(text, "- 'data' (dim 0)")
    assert "argument 0" in data_axis


def test_argument_committed_by_a_sharded_tensor(mesh):
    from gspmd_tf.layout import Layout
    x = gt.ShardedTensor.from_value(np.ones((B, D), np.float32), mesh,
                                    Layout.from_spec(mesh, P("data"), 2))
    low = gt.function(lambda t: tf.tanh(t, name="out"), mesh=mesh).lower(x)
    (data,) = lines_about(low.explain("out"), "- 'data' (dim 0)")
    assert "argument 0 ('t', the ShardedTensor passed there)" in data


def test_incompatible_splits_of_one_dim_go_to_the_larger():
    low = gt.function(lambda x, y: tf.add(x, y, name="a"), mesh=ABSTRACT,
                      in_shardings=(P("data"), P("model"))).lower(spec(B, 16), spec(B, 16))
    text = low.explain("a")
    assert "is split P('model')" in text
    (line,) = lines_about(text, "- dim 0 lacks 'data'")
    assert "AddV2 'a' chose ('model',) (4 ways, from 'y') over ('data',) (2 ways): the " \
        "larger split wins" in line


def test_op_without_a_rule_is_named():
    def f(x):
        y = tf.math.cumulative_logsumexp(x, axis=1)
        return tf.tanh(y, name="t")

    low = gt.function(f, mesh=ABSTRACT, in_shardings=(P("data"),)).lower(spec(B, 16))
    (name,) = [n.name for n in low.graph.nodes if n.op == "CumulativeLogsumexp"]
    text = low.explain(name)
    assert "is replicated" in text
    assert lines_about(text, f"- CumulativeLogsumexp {name!r} has no sharding rule: it runs "
                             "replicated")


def test_long_chain_shows_its_ends():
    def f(x):
        for k in range(8):
            x = tf.tanh(x, name=f"t{k}")
        return x

    low = gt.function(f, mesh=ABSTRACT, in_shardings=(P("data"),)).lower(spec(B, 16))
    (line,) = lines_about(low.explain("t7"), "- 'data' (dim 0)")
    assert line.endswith("forward through Tanh 't0', Tanh 't1', Tanh 't2' (layer 0: "
                         "pass-through), then ... 2 more ops ..., then forward through "
                         "Tanh 't5', Tanh 't6', Tanh 't7' (layer 0: pass-through).")
