"""Propagation in priority layers (XLA's aggressiveness levels), sharding origins, and
user shardings of size-1 dims.

The expected shardings of the layer cases are XLA's, read from its HLO right after the
propagation pass (GSPMD and Shardy agree on every one) with

    /work/jaxref/bin/python benchmarks/xla_reference.py --case=13a_broadcast_priority
    (likewise 13b_broadcast_after_dot, 13c_elementwise_before_dot,
     13d_elementwise_before_reduce, 13e_reshape_tie)

(tables in docs/xla_reference_shardings.md, cases 13a-13e). The same programs in TF ops
here: on each, propagation in one layer (every op at once) chooses otherwise than XLA,
except 13e, which checks the tie between equally split operands.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, strategies as st

import gspmd_tf as gt
from gspmd_tf.layout import Layout
from gspmd_tf.propagation.propagate import encode, propagate, run
from util import check_partitioned, randn

P = gt.P
B, D = 8, 32
MESH = gt.Mesh.abstract((2, 4), ("data", "model"))


def spec(*shape):
    return tf.TensorSpec(shape, tf.float32)


def broadcast_priority(a, c):
    b = tf.broadcast_to(tf.expand_dims(a, 1), (B, D), name="b")
    return tf.add(b, c, name="d")


def implicit_broadcast_priority(a, c):
    return tf.add(tf.expand_dims(a, 1), c, name="d")  # TF broadcasts inside the add


def broadcast_after_dot(a, c, w):
    b = tf.broadcast_to(tf.expand_dims(a, 1), (B, D), name="b")
    y = tf.matmul(c, w, name="y")
    return tf.add(b, y, name="d")


def elementwise_before_dot(x, w, c):
    y = tf.matmul(x, w, name="y")
    r = tf.tanh(y, name="r")
    return tf.add(r, c, name="d")


def elementwise_before_reduce(x, c):
    s = tf.reduce_sum(x, axis=1, name="s")
    return tf.add(s, c, name="d")


def reshape_tie(x, c):
    r = tf.reshape(x, (B, D), name="r")
    return tf.add(r, c, name="d")


# (function, in_shardings, argument specs, XLA's choice, tensors one layer gets wrong)
CASES = {
    "13a_broadcast_priority": (
        broadcast_priority, (P("model"), P(None, "model")), (spec(B), spec(B, D)),
        {"b": P(None, "model"), "d": P(None, "model")}, {"b", "d"}),
    "13a_implicit_broadcast": (
        implicit_broadcast_priority, (P("model"), P(None, "model")), (spec(B), spec(B, D)),
        {"d": P(None, "model")}, {"d"}),
    "13b_broadcast_after_dot": (
        broadcast_after_dot, (P("model"), None, P(None, "model")),
        (spec(B), spec(B, 16), spec(16, D)),
        {"c": P(), "b": P(None, "model"), "y": P(None, "model"), "d": P(None, "model")},
        {"b", "d"}),
    # w takes y's split although the dot's operand x holds "model" on another factor
    "13c_elementwise_before_dot": (
        elementwise_before_dot, (P("model"), None, P(None, "model")),
        (spec(B, 16), spec(16, D), spec(B, D)),
        {"w": P(None, "model"), "y": P(None, "model"), "r": P(None, "model"),
         "d": P(None, "model")},
        {"w", "y", "r", "d"}),
    "13d_elementwise_before_reduce": (
        elementwise_before_reduce, (P(None, None, "model"), P("model")),
        (spec(B, 4, D), spec(B, D)), {"s": P("model"), "d": P("model")}, {"s", "d"}),
    "13e_reshape_tie": (
        reshape_tie, (P(None, "model"), P("model")), (spec(B, 4, D // 4), spec(B, D)),
        {"r": P(None, "model"), "d": P(None, "model")}, set()),
}


def _seeds(low, in_shardings):
    """The arguments' user shardings (the only ones in these programs), by Ref."""
    return {ref: low.propagation.layout(ref)
            for ref, sharding in zip(low.graph.inputs, in_shardings) if sharding is not None}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layers_choose_what_xla_chooses(name):
    fn, in_shardings, specs, xla, single_differs = CASES[name]
    low = gt.function(fn, mesh=MESH, in_shardings=in_shardings).lower(*specs)
    single = propagate(low.graph, MESH, _seeds(low, in_shardings), layered=False)
    for tensor, want in xla.items():
        got = low.layout_of(tensor)
        assert got == Layout.from_spec(MESH, want, got.rank), \
            f"{tensor}: got {got.to_spec()!r}, XLA chose {want!r}"
        one_layer = single.layout(low.graph.ref(tensor))
        assert (one_layer != got) == (tensor in single_differs), \
            f"{tensor}: one layer gives {one_layer.to_spec()!r}, layers {got.to_spec()!r}"


@st.composite
def specs(draw, rank):
    """A PartitionSpec on MESH: each dim unsplit, "data", "model" or both; axes used once."""
    free, entries = ["data", "model"], []
    for _ in range(rank):
        axes = [a for a in draw(st.permutations(free)) if draw(st.booleans())]
        for a in axes:
            free.remove(a)
        entries.append(tuple(axes) if len(axes) > 1 else axes[0] if axes else None)
    return P(*entries)


@given(st.data(), st.booleans())
def test_result_is_a_fixed_point(data, layered):
    """Running the core again from its result, every op revisited, changes nothing (the
    core skips re-running an op just after its own step: that step is idempotent)."""
    programs = [(case[0], case[2]) for case in CASES.values()] + \
        [(mlp, (spec(B, D), spec(D, 64), spec(64, D)))]
    fn, arg_specs = data.draw(st.sampled_from(programs))
    in_shardings = tuple(data.draw(specs(len(a.shape))) for a in arg_specs)
    low = gt.function(fn, mesh=MESH, in_shardings=in_shardings).lower(*arg_specs)
    encoded = encode(low.graph, MESH, _seeds(low, in_shardings), layered)
    run(encoded)
    axes_after, naxes_after = encoded.axes.copy(), encoded.naxes.copy()
    run(encoded)
    np.testing.assert_array_equal(encoded.naxes, naxes_after)
    np.testing.assert_array_equal(encoded.axes, axes_after)


def test_layered_broadcast_values():
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    check_partitioned(broadcast_after_dot, (randn(rng, B), randn(rng, B, 16), randn(rng, 16, D)),
                      mesh, (P("model"), None, P(None, "model")))


# ------------------------------------------------------------------------------ origins

def mlp(x, w1, w2):
    h = tf.matmul(x, w1, name="h")
    r = tf.nn.relu(h, name="relu")
    return tf.matmul(r, w2, name="y")


def test_origin_of_hidden_activation_names_weight_and_matmul():
    f = gt.function(mlp, mesh=MESH, in_shardings=(P("data"), P(None, "model"), None))
    low = f.lower(spec(B, D), spec(D, 64), spec(64, D))
    x, w1, w2 = (low.graph.tensor_name(ref) for ref in low.graph.inputs)
    origins = {o.axis: o for o in low.propagation.origin("relu")}
    assert sorted(origins) == ["data", "model"]
    model = origins["model"]
    assert (model.tensor, model.dim, model.seed, model.seed_kind) == \
        ("relu", 1, w1, "argument 1")
    assert [(h.source, h.op_type, h.op, h.direction, h.layer, h.tensor) for h in model.hops] \
        == [(w1, "MatMul", "h", "forward", "all ops", "h"),
            ("h", "Relu", "relu", "forward", "all ops", "relu")]  # the layer it ran in
    assert (origins["data"].dim, origins["data"].seed, origins["data"].seed_kind) == \
        (0, x, "argument 0")
    assert "MatMul 'h' (forward, all ops)" in str(model) and repr(w1) in str(model)
    # the unannotated second weight took "model" backward from the second matmul
    (back,) = low.propagation.origin(w2)
    assert (back.axis, back.dim, back.seed) == ("model", 0, w1)
    assert [(h.op, h.direction) for h in back.hops] == \
        [("h", "forward"), ("relu", "forward"), ("y", "backward")]
    # the output keeps the batch split only ("model" is summed away)
    (out,) = low.propagation.origin("y")
    assert (out.axis, out.seed, [h.op for h in out.hops]) == ("data", x, ["h", "relu", "y"])
    # a seed is its own origin
    (own,) = low.propagation.origin(w1)
    assert (own.seed, own.hops) == (w1, ())


def test_origin_names_an_annotation():
    def f(x, w):
        h = gt.mesh_split(tf.matmul(x, w), MESH, P(None, "model"))
        return tf.tanh(h, name="out")

    low = gt.function(f, mesh=MESH).lower(spec(B, D), spec(D, 64))
    (origin,) = low.propagation.origin("out")
    assert origin.seed_kind == "annotation" and origin.axis == "model"
    assert [(h.op_type, h.direction, h.layer) for h in origin.hops] == \
        [("Tanh", "forward", "pass-through")]


# ------------------------------------------------------------------ size-1 dims

def test_split_of_size1_dim_is_kept_and_reported(caplog):
    mesh = gt.Mesh.create((2, 4), ("data", "model"))

    def f(x):
        return tf.tanh(gt.mesh_split(x * 2.0, mesh, P("data", "model")), name="out")

    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    with caplog.at_level("WARNING", logger="gspmd_tf"):
        low = check_partitioned(f, (x,), mesh, (None,))
    (annotated,) = low.graph.annotations
    name = low.graph.tensor_name(annotated)
    assert low.propagation.layout(annotated).dims == (("data",), ("model",))
    messages = [r.getMessage() for r in caplog.records if "size 1" in r.getMessage()]
    assert len(messages) == 1 and repr(name) in messages[0] and "'data'" in messages[0]


def test_mesh_axis_of_size1_is_dropped_silently(caplog):
    mesh = gt.Mesh.abstract((1, 8), ("data", "model"))
    with caplog.at_level("WARNING", logger="gspmd_tf"):
        low = gt.function(lambda x: tf.tanh(x), mesh=mesh,
                          in_shardings=(P("data", "model"),)).lower(spec(4, 8))
    assert low.propagation.layout(low.graph.inputs[0]).dims == ((), ("model",))
    assert not [r for r in caplog.records if "size 1" in r.getMessage()]
