"""A fast slice of the op sweep (gspmd_tf/testing/op_sweep.py; benchmarks/op_sweep.py
sweeps every op type with a registered gradient): generated inputs over random layouts of
2x4 and 4x2 meshes, compared with single-device TF, each op classified (issue 25 item 6)."""

import pytest

from gspmd_tf.testing import op_sweep

# every 10th op type with a registered gradient, and ops whose class is pinned below
NAMED = {"Relu": "partitioned", "MatMul": "partitioned", "BesselY1": "partitioned",
         "ResizeBilinear": "partitioned", "NextIteration": "refused",
         "SegmentSum": "refused", "AudioSummary": "not generated",
         # inputs from op_recipes (ranks, constants, complex values) and raw ops whose
         # parameters are named otherwise than their OpDef's inputs (Sum's axis)
         "BiasAdd": "partitioned", "Conv2DBackpropInput": "partitioned",
         "FFT": "partitioned", "UnsortedSegmentSum": "partitioned", "Sum": "partitioned",
         # inputs made in the program (strings of split numbers, a TensorList of a split
         # tensor's rows, a CSR matrix), results finished into numbers (a list stacked)
         "StringToHashBucketFast": "partitioned", "TensorListSetItem": "partitioned",
         "DenseToCSRSparseMatrix": "replicated",
         # TF's shape inference contradicts its kernel: refused, never cut short
         "FractionalMaxPool": "refused"}


@pytest.fixture(scope="module")
def outcomes():
    op_types = sorted(set(op_sweep.gradient_op_types()[::10]) | set(NAMED))
    return {o.op_type: o for o in op_sweep.sweep(op_types, op_sweep.sweep_meshes())}


def test_the_slice_has_no_wrong_value_and_no_error(outcomes):
    bad = [o for o in outcomes.values() if o.kind in ("wrong", "error")]
    assert not bad, bad
    assert sum(o.kind == "partitioned" for o in outcomes.values()) >= 10


@pytest.mark.parametrize("op_type", sorted(NAMED))
def test_ops_are_classified_by_what_ran(outcomes, op_type):
    """Split inputs partitioned (Relu, MatMul, the Bessel functions, a resize, ops of
    recipe inputs: a bias, a convolution's input gradient, an FFT of complex values,
    segment sums, a sum over a constant axis, hashes of strings, a TensorList's item
    set); an op without a rule replicated, saying so (a CSR matrix made of a dense
    one); a result shape decided by values (segment ids) refused, and one TF's shape
    inference gets wrong (a fractional pool's sequences); an op of string inputs
    without a recipe not generated."""
    outcome = outcomes[op_type]
    assert outcome.kind == NAMED[op_type], outcome
    if outcome.kind == "replicated":
        assert outcome.reason == "no partitioning rule"


def test_the_table_counts_every_outcome(outcomes):
    text = op_sweep.table(list(outcomes.values()))
    for kind in op_sweep.OUTCOMES:
        count = sum(o.kind == kind for o in outcomes.values())
        assert f"| {kind} | {count} |" in text
    assert "| Relu | partitioned |" in text


def test_every_recipe_gives_each_input_of_its_op():
    """A recipe's inputs are its OpDef's, in order (a list input as a list)."""
    from tensorflow.python.framework import op_def_registry

    from gspmd_tf.testing.op_recipes import RECIPES
    for op_type, recipe in RECIPES.items():
        op_def = op_def_registry.get(op_type)
        assert op_def is not None, op_type
        assert len(recipe.inputs) == len(op_def.input_arg), op_type
        for given, arg in zip(recipe.inputs, op_def.input_arg):
            is_list = bool(arg.number_attr or arg.type_list_attr)
            assert isinstance(given, list) == is_list, (op_type, arg.name)


def test_a_fractional_pool_is_refused_rather_than_its_sequences_cut_short():
    """TF's shape inference makes FractionalMaxPool's pooling sequences one shorter than
    its kernel returns; gspmd-tf placed them at the inferred size and dropped the last
    boundary (op sweep: (4,) where single-device TF gives (5,)). It now refuses."""
    import numpy as np
    import tensorflow as tf

    import gspmd_tf as gt

    def pool(x):
        return tf.raw_ops.FractionalMaxPool(value=x, pooling_ratio=[1.0, 1.5, 1.25, 1.0],
                                            seed=1, seed2=2, deterministic=True)
    x = np.zeros((2, 6, 5, 3), np.float32)
    assert [t.shape for t in pool(tf.constant(x))][1:] == [(5,), (5,)]  # TF's kernel
    mesh = gt.Mesh.create((2,), ("data",))
    with pytest.raises(gt.ShardingError, match="FractionalMaxPool.*pooling sequences"):
        gt.function(pool, mesh=mesh, in_shardings=(gt.P("data"),))(x)
