"""Strict mode: data movement the partitioner adds on its own is a ShardingError at
lowering naming op, source line, shardings and the annotation to write; movement at the
user's own shardings and the sums of contractions pass, and run to the same values."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.P
MESH = gt.Mesh.abstract((2, 4), ("data", "model"))
SPEC = tf.TensorSpec
SPECS = (SPEC((8, 16)), SPEC((16, 32)), SPEC((32, 16)))
CONFLICTING = (P("data"), P(None, "model"), P(None, "model"))


def implicit_gather(x, w1, w2):
    h = tf.nn.relu(x @ w1)
    return tf.matmul(h, w2, name="second")


def test_implicit_all_gather_is_refused_with_op_line_shardings_and_fix():
    with pytest.raises(gt.ShardingError) as error:
        gt.lower(implicit_gather, MESH, CONFLICTING, args=SPECS, strict=True)
    text = str(error.value)
    assert "strict=True" in text and "all-gather: op 'second' at test_strict.py:" in text
    assert "'Relu' from P('data', 'model') to P('data')" in text
    assert "gt.mesh_split(relu, mesh, P('data'))" in text


def test_same_program_lowers_without_strict():
    low = gt.lower(implicit_gather, MESH, CONFLICTING, args=SPECS)
    assert [c.kind for c in low.collectives()] == ["all-gather"]


def test_the_suggested_annotation_makes_it_pass(mesh):
    def explicit(x, w1, w2):
        h = gt.mesh_split(tf.nn.relu(x @ w1), mesh, P("data"))
        return tf.matmul(h, w2, name="second")

    f = gt.function(explicit, mesh=mesh, in_shardings=CONFLICTING, strict=True)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s.shape).astype(np.float32) for s in SPECS]
    assert [c.reason for c in f.lower(*args).collectives()] == ["annotation"]
    np.testing.assert_allclose(f(*args).numpy(), explicit(*map(tf.constant, args)).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_contraction_sum_and_out_shardings_are_allowed():
    def contract(x, w):
        return tf.matmul(x, w)

    low = gt.lower(contract, MESH, (P("data", "model"), P("model")), (P(None, "model"),),
                   args=(SPEC((8, 16)), SPEC((16, 8))), strict=True)
    kinds = {(c.kind, c.reason) for c in low.collectives()}
    assert ("all-reduce", "contraction") in kinds or ("reduce-scatter", "contraction") in kinds
    assert {reason for _, reason in kinds} <= {"contraction", "annotation"}


def test_replicated_fallback_is_refused():
    def no_rule(x):
        return tf.math.cumulative_logsumexp(x, axis=0)

    with pytest.raises(gt.ShardingError, match=r"all-gather: op 'Cumulative\w*' at "
                                               r"test_strict.py:\d+ \(no rule"):
        gt.lower(no_rule, MESH, (P("data"),), args=(SPEC((8, 4)),), strict=True)


def test_a_result_resharded_to_its_propagated_layout_is_named_as_the_ops_result():
    def dot_then_tanh(x, w):
        return tf.tanh(tf.matmul(x, w, name="dot"))

    # the output's sharding reaches the dot's result backward; the dot computes its
    # result split the other way round, so the result is moved
    with pytest.raises(gt.ShardingError) as error:
        gt.lower(dot_then_tanh, MESH, (P("data"), P(None, "model")), (P("model", "data"),),
                 args=(SPEC((8, 16)), SPEC((16, 8))), strict=True)
    text = str(error.value)
    assert "op 'dot' at test_strict.py:" in text and "(result layout:" in text
    assert ("`gt.mesh_split(dot, mesh, P('model', 'data'))` on 'dot' (the result of op "
            "'dot')") in text
