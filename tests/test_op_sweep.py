"""A fast slice of the op sweep (gspmd_tf/testing/op_sweep.py; benchmarks/op_sweep.py
sweeps every op type with a registered gradient, and those models emit without one):
generated inputs over random layouts of 2x4 and 4x2 meshes, compared with single-device
TF, each op classified (issue 25 item 6); and what the sweep found."""

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
         "FractionalMaxPool": "refused",
         # variables (compared after the call too), a table made and filled in the
         # program, a conditional, a TF1 table; an op that needs a GPU
         "ReadVariableOp": "partitioned", "AssignAddVariableOp": "partitioned",
         "HashTableV2": "replicated", "If": "partitioned", "LookupTableFind": "refused",
         "CudnnRNN": "not generated",
         # shrinks v1 refs in place with no output to order their reads after it
         "SdcaShrinkL1": "refused"}


@pytest.fixture(scope="module")
def outcomes():
    op_types = sorted(set(op_sweep.sweep_op_types()[::10]) | set(NAMED))
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
    set, a split variable read and added to, a conditional of split values); an op
    without a rule replicated, saying so (a CSR matrix made of a dense one, a hash
    table); a result shape decided by values (segment ids) refused, one TF's shape
    inference gets wrong (a fractional pool's sequences), and a TF1 table; ops TF
    cannot run here (removed from GraphDef, a GPU kernel) not generated."""
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

    for op_type, recipe in op_sweep.RECIPES.items():
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


# the reasons the OpDef alone gives (op_sweep.generated_call): each op they once covered
# now has a recipe or a hard reason in stateful_recipes.CANNOT_RUN
_SOFT_REASONS = ("a stateful op", "is a list of types or a ref", "takes no float32",
                 "attrs without a default")


# op types still without a recipe (this list only shrinks; empty: every op type of the
# sweep has inputs or a hard reason)
WITHOUT_RECIPE = set()


def test_ops_are_not_generated_only_for_a_hard_reason():
    """Every op type of the sweep gets inputs (the OpDef's, or a recipe's), or a reason
    it cannot run in this process (not in this TF build, a GPU/TPU kernel, a TF1 queue,
    a file...; the sweep then says TF's own refusal where TF refuses the inputs), but
    for the few WITHOUT_RECIPE."""
    import numpy as np
    soft = []
    for op_type in op_sweep.sweep_op_types():
        try:
            op_sweep.generated_call(op_type, np.random.default_rng(0))
        except op_sweep.NotGenerated as reason:
            if any(text in str(reason) for text in _SOFT_REASONS):
                soft.append(op_type)
    assert set(soft) == WITHOUT_RECIPE


def _mesh():
    import gspmd_tf as gt
    return gt.Mesh.create((2,), ("data",))


def test_variables_an_op_updates_together_split_otherwise_are_refused():
    """ResourceApplyMomentum of a variable split over "data" and a replicated
    accumulator: the rule splits both alike, and gspmd-tf resharded the accumulator's
    handle (a TF error building the program: Pad of a resource). Now a ShardingError
    naming the op and the variable."""
    import numpy as np
    import tensorflow as tf

    import gspmd_tf as gt
    mesh = _mesh()
    var = gt.Variable(np.ones((4, 6), np.float32), mesh, gt.P("data"))
    accum = gt.Variable(np.ones((4, 6), np.float32), mesh, gt.P())

    def step(grad):
        tf.raw_ops.ResourceApplyMomentum(var=var.handle, accum=accum.handle, lr=0.1,
                                         grad=grad, momentum=0.9)
        return []
    with pytest.raises(gt.ShardingError,
                       match=r"ResourceApplyMomentum.*variable.*same spec"):
        gt.function(step, mesh=mesh, in_shardings=(gt.P("data"),))(
            np.ones((4, 6), np.float32))


def test_a_scatter_into_a_replicated_variable_runs_as_on_one_device():
    """ResourceScatterNdUpdate's shape function reads the variable's shape from its
    handle, and the program's handle arguments had none (a TF error building it); they
    now carry their variable's shard shape and dtype."""
    import numpy as np
    import tensorflow as tf

    import gspmd_tf as gt
    mesh = _mesh()
    start = np.arange(24, dtype=np.float32).reshape(4, 6)
    rows = np.full((2, 6), -1.0, np.float32)

    def scatter(variable, updates):
        tf.raw_ops.ResourceScatterNdUpdate(ref=variable.handle, indices=[[3], [0]],
                                           updates=updates)
        return []
    single = tf.Variable(start)
    tf.function(lambda u: scatter(single, u))(rows)
    split = gt.Variable(start, mesh, gt.P())
    gt.function(lambda u: scatter(split, u), mesh=mesh, in_shardings=(gt.P("data"),))(rows)
    np.testing.assert_array_equal(split.numpy(), single.numpy())


def test_a_tf1_lookup_table_is_refused_rather_than_missing_its_keys():
    """A TF1 MutableHashTable (a ref-typed handle) filled then read gave the default
    value for every key partitioned (op sweep); TF1 table ops are now refused."""
    import numpy as np
    import tensorflow as tf

    import gspmd_tf as gt

    def lookup(keys):
        table = tf.raw_ops.MutableHashTable(key_dtype=tf.int64, value_dtype=tf.float32)
        filled = tf.raw_ops.LookupTableInsert(table_handle=table, keys=[1, 2],
                                              values=[0.5, 1.5])
        with tf.control_dependencies([filled]):
            return tf.raw_ops.LookupTableFind(table_handle=table, keys=keys,
                                              default_value=-1.0)
    with pytest.raises(gt.ShardingError, match="MutableHashTable.*TF1 lookup table"):
        gt.function(lookup, mesh=_mesh(), in_shardings=(gt.P("data"),))(
            np.array([1, 2, 3, 1], np.int64))
