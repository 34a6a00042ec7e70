"""Recipes of the op sweep (op_sweep.py) for ops that hold or change state: variables
(reads, assignments, scatters, optimizer kernels: the variables are compared after the
call too), hash tables, TensorArrays, stateful random ops (seeded, so the first call's
values are fixed: a fresh kernel of a fixed seed pair draws one stream), side-effect
ops (assertions, prints, numerics checks), v1 summaries (serialized protos, compared
by fingerprint), v1 refs, and control flow (functional and TF1); and CANNOT_RUN, the
op types that cannot run in this process, each with the hard reason. RECIPES maps an op
type to its op_recipes.Recipe.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import script_ops

from gspmd_tf.testing.op_recipes import C, F, G, Int, Made, Recipe, V, shaped

_GPU = "a CUDA kernel only (cuDNN, NCCL, box proposals): no GPU in this process"
_REPLICA = "a TPU/XLA replica-context collective: runs only inside a TPU computation"
_QUEUE = ("a TF1 queue/reader/stack of ref-typed handles fed by a Session "
          "(tf.compat.v1 input pipelines): no TF2 function makes one")
_SESSION = "a TF1 Session handle: needs a tf.compat.v1.Session"
_FILE = "reads files (vocabulary or checkpoint) named by its inputs"
_TF1_ARRAY = ("a TensorArray op of GraphDef version < 26: TF refuses it (TensorArrayV3 "
              "replaced it)")
# op types that cannot run here, with the reason (the sweep reports them as not generated)
CANNOT_RUN = {
    **dict.fromkeys(("CudnnRNN", "CudnnRNNV2", "CudnnRNNV3", "NcclAllReduce",
                     "NcclBroadcast", "NcclReduce", "GenerateBoundingBoxProposals"), _GPU),
    **dict.fromkeys(("AllToAll", "CollectivePermute", "CrossReplicaSum",
                     "TPUEmbeddingActivations"), _REPLICA),
    **dict.fromkeys(("FixedLengthRecordReader", "IdentityReader", "LMDBReader",
                     "TFRecordReader", "TextLineReader", "WholeFileReader",
                     "ReaderNumRecordsProduced", "ReaderNumWorkUnitsCompleted",
                     "ReaderRead", "ReaderReadUpTo", "ReaderReset", "ReaderRestoreState",
                     "ReaderSerializeState", "QueueClose", "QueueDequeue",
                     "QueueDequeueMany", "QueueDequeueUpTo", "QueueEnqueue",
                     "QueueEnqueueMany", "QueueSize", "Stack", "StackClose", "StackPop",
                     "StackPush"), _QUEUE),
    **dict.fromkeys(("GetSessionHandle", "GetSessionHandleV2", "GetSessionTensor",
                     "DeleteSessionTensor"), _SESSION),
    **dict.fromkeys(("GenerateVocabRemapping", "LoadAndRemapMatrix",
                     "InitializeTableFromTextFile", "InitializeTableFromTextFileV2"), _FILE),
    **dict.fromkeys(("TensorArray", "TensorArrayV2", "TensorArrayClose",
                     "TensorArrayCloseV2", "TensorArrayConcat", "TensorArrayConcatV2",
                     "TensorArrayGather", "TensorArrayGatherV2", "TensorArrayGrad",
                     "TensorArrayGradV2", "TensorArrayRead", "TensorArrayReadV2",
                     "TensorArrayScatter", "TensorArrayScatterV2", "TensorArraySize",
                     "TensorArraySizeV2", "TensorArraySplit", "TensorArraySplitV2",
                     "TensorArrayWrite", "TensorArrayWriteV2"), _TF1_ARRAY),
    **dict.fromkeys(("Exit", "RefExit", "RefEnter"),
                    "a TF1 while loop's frame op: TF runs it only inside a frame "
                    "(Enter ... LoopCond ... Exit, whose ops gspmd-tf refuses: the sweep "
                    "shows Enter, LoopCond, NextIteration refused)"),
    "MutableDenseHashTable": "TF's kernel reads an input its OpDef lacks (\"Unknown "
                             "input name: deleted_key\"): TF cannot run it",
    "AudioSummary": "removed in GraphDef version 15 (AudioSummaryV2 replaced it): TF "
                    "refuses it",
    "RandomCrop": "removed in GraphDef version 8 (random crop is Python now): TF "
                  "refuses it",
    "Timestamp": "its value is the wall-clock time: no two runs agree",
    **dict.fromkeys(("SdcaOptimizer", "SdcaOptimizerV2"),
                    "SDCA visits its examples in a random order: single-device TF's own "
                    "values differ from run to run, so there is no value to compare"),
    "ReduceDataset": "reduces a tf.data dataset (a variant of a pipeline's ops), which "
                     "the function cannot take as an argument or split",
}


def _four_key_table(make, fill):
    """A maker of a table (`make`: HashTableV2 or MutableHashTableV2) holding four int64
    keys (a Keras IntegerLookup's vocabulary), filled by `fill` (InitializeTableV2 or
    LookupTableInsertV2) before it is read."""
    def table(_):
        handle = make(key_dtype=tf.int64, value_dtype=tf.float32)
        filled = fill(table_handle=handle, keys=tf.constant([0, 1, 2, 5], tf.int64),
                      values=tf.constant([0.5, 1.5, 2.5, 5.5]))
        with tf.control_dependencies([filled]):
            return tf.identity(handle)
    return table


def _as_keys(values, _inputs=()):
    """A lookup's values given the keys' shape, as tf.lookup's tables give them (the
    raw op's shape inference does not know the table's value shape)."""
    values.set_shape([4, 6])
    return values


def _hash_tables() -> dict:
    """Lookups of split keys in tables the program builds (Keras' lookup layers)."""
    static = Made(C(0), _four_key_table(tf.raw_ops.HashTableV2, tf.raw_ops.InitializeTableV2))
    mutable = Made(C(0), _four_key_table(tf.raw_ops.MutableHashTableV2,
                                         tf.raw_ops.LookupTableInsertV2))
    keys, default = Int((4, 6), 7, "int64"), C(-1.0, "float32")
    return {"LookupTableFindV2": Recipe((static, keys, default), finish=_as_keys),
            "LookupTableSizeV2": Recipe((mutable,))}


def _tensor_array(t):
    """The handle of a TensorArrayV3 (tf.TensorArray in graphs of TF1 style) holding
    t's four rows, scattered before the handle is read."""
    handle, flow = tf.raw_ops.TensorArrayV3(size=4, dtype=tf.float32,
                                             element_shape=tf.TensorShape([6]))
    flow = tf.raw_ops.TensorArrayScatterV3(handle=handle, indices=tf.range(4), value=t,
                                           flow_in=flow)
    with tf.control_dependencies([flow]):
        return tf.identity(handle)


def _tensor_arrays() -> dict:
    """Reads of a TensorArrayV3 of a split tensor's rows. The flow passed is a constant:
    the reads come after the scatter as TF orders stateful ops (in program order)."""
    array, flow = Made(F(4, 6), _tensor_array), C(0.0, "float32")
    dtype = {"dtype": "float32"}
    return {"TensorArrayReadV3": Recipe((array, C(2), flow), dtype),
            "TensorArrayGatherV3": Recipe((array, C([3, 0]), flow),
                                          dict(dtype, element_shape=[6])),
            "TensorArraySizeV3": Recipe((array, flow))}


def _variables() -> dict:
    """Reads, assignments, scatters and the optimizer kernels of resource variables
    (tf-keras' optimizers call the ResourceApply* kernels; Keras 3's and gt's assign)."""
    f32 = {"dtype": "float32"}
    rows = G([2, 0, 3])  # distinct: an update of one row twice keeps either value
    r = {"ReadVariableOp": Recipe((V(4, 6),), f32),
         "ResourceGather": Recipe((V(4, 6), Int((3,), 4)), f32),
         "ResourceGatherNd": Recipe((V(4, 6), Int((3, 1), 4)), f32),
         "VariableShape": Recipe((V(4, 6),)),
         "VarIsInitializedOp": Recipe((V(4, 6),)),
         "AssignVariableOp": Recipe((V(4, 6), F(4, 6))),
         "AssignAddVariableOp": Recipe((V(4, 6), F(4, 6))),
         "AssignSubVariableOp": Recipe((V(4, 6), F(4, 6))),
         "ResourceScatterNdUpdate": Recipe((V(4, 6), G([[2], [0], [3]]), F(3, 6))),
         "ResourceScatterNdAdd": Recipe((V(4, 6), Int((3, 1), 4), F(3, 6)))}
    for op in ("Add", "Sub", "Mul", "Div", "Min", "Max", "Update"):
        r["ResourceScatter" + op] = Recipe((V(4, 6), rows, F(3, 6)))
    # optimizer kernels: accumulators positive where the update takes a square root
    var, grad, acc = V(4, 6), F(4, 6), _positive(4, 6)
    lr, decay, eps = C(0.1, "float32"), C(0.9, "float32"), C(1e-3, "float32")
    r["ResourceApplyGradientDescent"] = Recipe((var, lr, grad))
    r["ResourceApplyMomentum"] = Recipe((var, V(4, 6), lr, grad, decay))
    r["ResourceApplyKerasMomentum"] = Recipe((var, V(4, 6), lr, grad, decay))
    r["ResourceApplyAdagrad"] = Recipe((var, acc, lr, grad))
    r["ResourceApplyAdagradV2"] = Recipe((var, acc, lr, eps, grad))
    r["ResourceApplyAdam"] = Recipe((var, V(4, 6), acc, C(0.9, "float32"),
                                     C(0.99, "float32"), lr, decay, C(0.999, "float32"),
                                     eps, grad))
    r["ResourceApplyAdaMax"] = Recipe((var, V(4, 6), acc, C(0.9, "float32"), lr, decay,
                                       C(0.999, "float32"), eps, grad))
    r["ResourceApplyRMSProp"] = Recipe((var, acc, V(4, 6), lr, decay, C(0.0, "float32"),
                                        eps, grad))
    r["ResourceApplyCenteredRMSProp"] = Recipe((var, V(4, 6), _positive(4, 6, low=2.0),
                                                V(4, 6), lr, decay, C(0.0, "float32"), eps,
                                                grad))
    r["ResourceApplyAdadelta"] = Recipe((var, acc, _positive(4, 6), lr, decay, eps, grad))
    r["ResourceApplyFtrl"] = Recipe((var, acc, V(4, 6), grad, lr, C(0.01, "float32"),
                                     C(0.01, "float32"), C(-0.5, "float32")))
    r["ResourceSparseApplyAdagrad"] = Recipe((var, acc, lr, F(3, 6), rows))
    return r


def _positive(*shape, low=1.0):
    """A variable of `shape` holding values in [low, low + 1) (an accumulator of
    squares)."""
    return V(*shape, value=low + np.random.default_rng(list(shape)).random(shape))


# a fixed seed pair: a fresh kernel draws the same numbers on every device and in
# single-device TF (gt draws a stateful random tensor whole and slices it)
SEEDS = {"seed": 1, "seed2": 2}


def _random() -> dict:
    """Stateful random ops of fixed seeds."""
    shape, f32 = C([4, 6]), dict(SEEDS, dtype="float32")
    box = C([[[0.1, 0.1, 0.9, 0.9]]], "float32")
    return {
        "RandomUniform": Recipe((shape,), f32),
        "RandomStandardNormal": Recipe((shape,), f32),
        "TruncatedNormal": Recipe((shape,), f32),
        "RandomUniformInt": Recipe((shape, C(0), C(10)), SEEDS),
        "RandomGamma": Recipe((shape, G(np.full(3, 2.0), "float32")), SEEDS),
        "RandomShuffle": Recipe((F(6, 4),), SEEDS),
        "Multinomial": Recipe((F(4, 6), C(3)), SEEDS),
        "ParameterizedTruncatedNormal": Recipe(
            (shape, F(4), G(np.ones(4), "float32"), G(np.full(4, -2.0), "float32"),
             G(np.full(4, 2.0), "float32")), SEEDS),
        "SampleDistortedBoundingBox": Recipe((C([6, 5, 3]), box),
                                             dict(SEEDS, min_object_covered=0.1)),
        "SampleDistortedBoundingBoxV2": Recipe((C([6, 5, 3]), box, C(0.1, "float32")),
                                               SEEDS)}


def _all_finite(t):
    return tf.reduce_all(tf.math.is_finite(t))


def _fingerprint(summary, _inputs=()):
    """A serialized Summary proto as a number (its bytes' fingerprint)."""
    return tf.strings.to_hash_bucket_fast(summary, 2**62)


def _side_effects() -> dict:
    """Assertions, numerics checks, prints and the debugger's identity (inputs that
    pass: the values are compared, the side effect is not)."""
    return {"Assert": Recipe((Made(F(4, 6), _all_finite), [F(4, 6)]), {"summarize": 2}),
            "CheckNumerics": Recipe((F(4, 6),), {"message": "sweep"}),
            "CheckNumericsV2": Recipe((F(4, 6),), {"message": "sweep"}),
            "Print": Recipe((F(4, 6), [F(4, 6)]), {"summarize": 1, "first_n": 0}),
            "DebugIdentityV2": Recipe((F(4, 6),)),
            "DebugGradientRefIdentity": Recipe((Made(F(4, 6), _ref),),
                                               finish=lambda out, _: out * 1.0)}


def _summaries() -> dict:
    """v1 summaries of split values: serialized protos, compared by fingerprint."""
    tag = C("sweep", "object")
    scalar = Made(F(), lambda t: tf.raw_ops.ScalarSummary(tags="s", values=t))
    images = {"max_images": 2}
    return {"ScalarSummary": Recipe((tag, F()), finish=_fingerprint),
            "HistogramSummary": Recipe((tag, F(4, 6)), finish=_fingerprint),
            "ImageSummary": Recipe((tag, G(np.linspace(0, 1, 180).reshape(2, 6, 5, 3),
                                           "float32")), images, finish=_fingerprint),
            "AudioSummaryV2": Recipe((tag, F(2, 6), C(8000.0, "float32")),
                                     finish=_fingerprint),
            "MergeSummary": Recipe(([scalar, Made(F(), lambda t: tf.raw_ops.ScalarSummary(
                tags="t", values=t))],), finish=_fingerprint),
            "TensorSummaryV2": Recipe((tag, F(4, 6), C(b"", "object")), finish=_fingerprint)}


def _ref(t):
    """A ref tensor (a v1 VariableV2 of t's value, assigned)."""
    variable = tf.raw_ops.VariableV2(shape=t.shape, dtype=t.dtype)
    return tf.raw_ops.Assign(ref=variable, value=t)


def _refs() -> dict:
    """v1 ref ops on a VariableV2 assigned in the program (tf.compat.v1 graphs)."""
    ref = Made(F(4, 6), _ref)
    value, rows = F(4, 6), G([2, 0, 3])
    r = {"Assign": Recipe((ref, value)), "AssignAdd": Recipe((ref, value)),
         "AssignSub": Recipe((ref, value)), "RefIdentity": Recipe((ref,))}
    for op in ("Add", "Sub", "Mul", "Div"):
        r["Scatter" + op] = Recipe((ref, rows, F(3, 6)))
    for op in ("Add", "Sub", "Update"):
        r["ScatterNd" + op] = Recipe((ref, G([[2], [0], [3]]), F(3, 6)))
    r = {op: Recipe(recipe.inputs, recipe.attrs, lambda out, _: out * 1.0)
         for op, recipe in r.items()}
    # SDCA's L1 shrink of a list of weights in place (no outputs): the weights after it
    r["SdcaShrinkL1"] = Recipe(([ref, ref],), {"l1": 0.5, "l2": 2.0},
                               _read_after)
    return r


def _read_after(op, refs):
    """A Recipe.finish of an op updating refs in place: their values after it."""
    with tf.control_dependencies([op]):
        return [ref * 1.0 for ref in refs]


KEYS, VALUES = [0, 1, 2, 5], [0.5, 1.5, 2.5, 5.5]
_KV = {"key_dtype": "int64", "value_dtype": "float32"}


def _found(fill=None, find=tf.raw_ops.LookupTableFindV2, of_vectors=False):
    """A Recipe.finish reading the op's table (its output, else its first input),
    filled first by `fill(table_handle, keys, values)` when given: the extra keys
    (the program's last input) looked up. A table `of_vectors` holds each value as a
    vector of one."""
    def finish(outputs, inputs):
        done = [outputs] if isinstance(outputs, tf.Operation) else []
        handle = inputs[0] if done else outputs
        shape = [-1, 1] if of_vectors else [-1]
        if fill is not None:
            done.append(fill(table_handle=handle, keys=tf.constant(KEYS, tf.int64),
                             values=tf.reshape(tf.constant(VALUES), shape)))
        with tf.control_dependencies(done):
            found = find(table_handle=handle, keys=inputs[-1],
                         default_value=tf.reshape(tf.constant(-1.0), shape[1:]))
        found.set_shape(inputs[-1].shape.concatenate(shape[1:]))
        return found
    return finish


def _more_tables() -> dict:
    """Tables made, filled and read in the program, v1 (ref handles) and v2."""
    keys = (Int((4, 6), 7, "int64"),)
    init, insert = tf.raw_ops.InitializeTableV2, tf.raw_ops.LookupTableInsertV2
    v1 = {"fill": tf.raw_ops.LookupTableInsert, "find": tf.raw_ops.LookupTableFind}
    empty = Made(C(0), lambda _: tf.raw_ops.HashTableV2(**_as_dtypes(_KV)))
    mutable = Made(C(0), lambda _: tf.raw_ops.MutableHashTableV2(**_as_dtypes(_KV)))
    v1_mutable = Made(C(0), lambda _: tf.raw_ops.MutableHashTable(**_as_dtypes(_KV)))
    given = (C(KEYS, "int64"), G(VALUES, "float32"))
    dense = {"value_dtype": "float32"}
    return {
        "HashTableV2": Recipe((), _KV, _found(init), keys),
        "MutableHashTableV2": Recipe((), _KV, _found(insert), keys),
        "MutableHashTableOfTensorsV2": Recipe((), dict(_KV, value_shape=[1]),
                                              _found(insert, of_vectors=True), keys),
        # a dense table looks up a vector of keys
        "MutableDenseHashTableV2": Recipe((C(-1, "int64"), C(-2, "int64")), dense,
                                          _found(insert), (Int((6,), 7, "int64"),)),
        "InitializeTableV2": Recipe((empty, *given), finish=_found(), extra=keys),
        "LookupTableInsertV2": Recipe((mutable, *given), finish=_found(), extra=keys),
        "HashTable": Recipe((), _KV, _found(tf.raw_ops.InitializeTable, v1["find"]), keys),
        "MutableHashTable": Recipe((), _KV, _found(**v1), keys),
        "MutableHashTableOfTensors": Recipe((), dict(_KV, value_shape=[1]),
                                            _found(**v1, of_vectors=True), keys),
        "LookupTableInsert": Recipe((v1_mutable, *given), finish=_found(find=v1["find"]),
                                    extra=keys),
        "LookupTableFind": Recipe((Made(C(0), _v1_table), keys[0], C(-1.0, "float32")),
                                  finish=_as_keys),
        "LookupTableSize": Recipe((Made(C(0), _v1_table),)),
        "InitializeTable": Recipe((Made(C(0), lambda _: tf.raw_ops.HashTable(
            **_as_dtypes(_KV))), *given), finish=_found(find=v1["find"]), extra=keys)}


def _as_dtypes(attrs):
    return {name: tf.as_dtype(v) for name, v in attrs.items()}


def _v1_table(_):
    """A v1 (ref handle) mutable table holding KEYS."""
    handle = tf.raw_ops.MutableHashTable(**_as_dtypes(_KV))
    done = tf.raw_ops.LookupTableInsert(table_handle=handle, keys=tf.constant(KEYS, tf.int64),
                                        values=tf.constant(VALUES))
    with tf.control_dependencies([done]):
        return tf.raw_ops.RefIdentity(input=handle)


def _empty_array(_):
    """The handle of an empty TensorArrayV3 of four rows of 6 floats (the flow is a
    constant: TF orders the array's stateful ops in program order)."""
    return tf.raw_ops.TensorArrayV3(size=4, dtype=tf.float32,
                                    element_shape=tf.TensorShape([6]))[0]


def _gathered(flow, inputs):
    """A Recipe.finish: the rows of the op's TensorArray (its first input) after the op
    (whose output is the flow)."""
    return tf.raw_ops.TensorArrayGatherV3(handle=inputs[0], indices=tf.range(4),
                                          flow_in=flow, dtype=tf.float32,
                                          element_shape=[6])


def _filled(outputs, inputs):
    """A Recipe.finish: the rows of the TensorArray the op made, the extra input
    (the program's last) scattered into it."""
    handle, flow = outputs
    flow = tf.raw_ops.TensorArrayScatterV3(handle=handle, indices=tf.range(4),
                                           value=inputs[-1], flow_in=flow)
    return _gathered(flow, [handle])


def _read_second(flow, inputs):
    """A Recipe.finish: element 1 of the op's TensorArray (its first input) after the
    op (whose output is the flow)."""
    return tf.raw_ops.TensorArrayReadV3(handle=inputs[0], index=1, flow_in=flow,
                                        dtype=tf.float32)


def _size(outputs, _inputs):
    """A Recipe.finish: the size of the TensorArray the op made."""
    return tf.raw_ops.TensorArraySizeV3(handle=outputs[0], flow_in=outputs[1])


def _more_tensor_arrays() -> dict:
    """TensorArrayV3 made, written, scattered, split, concatenated, closed, and its
    gradient array."""
    array, flow = Made(F(4, 6), _tensor_array), C(0.0, "float32")
    empty = Made(C(0), _empty_array)
    f32 = {"dtype": "float32"}
    return {
        "TensorArrayV3": Recipe((C(4),), dict(f32, element_shape=[6]), _filled,
                                (F(4, 6),)),
        "TensorArrayWriteV3": Recipe((empty, C(1), F(6), flow), finish=_read_second),
        "TensorArrayScatterV3": Recipe((empty, C([2, 0, 1, 3]), F(4, 6), flow),
                                       finish=_gathered),
        "TensorArraySplitV3": Recipe((empty, F(24), C([6, 6, 6, 6], "int64"), flow),
                                     finish=_gathered),
        "TensorArrayConcatV3": Recipe((array, flow), dict(f32, element_shape_except0=[]),
                                      finish=lambda outs, _: shaped(outs, [24], [4])),
        "TensorArrayCloseV3": Recipe((array,)),
        "TensorArrayGradV3": Recipe((array, flow), {"source": "sweep"}, finish=_size),
        "TensorArrayGradWithShape": Recipe((array, flow, C([2])), {"source": "sweep"},
                                           finish=_size)}


def _traced(fn, *shapes):
    """`fn` traced on float32/int32 inputs of `shapes` (a branch or loop body attr)."""
    specs = [tf.TensorSpec(s, tf.int32 if len(s) == 0 else tf.float32) for s in shapes]
    return tf.function(fn, autograph=False).get_concrete_function(*specs)


def _positive_sum(t):
    return tf.reduce_sum(t) > 0


def _control_flow() -> dict:
    """Functional conditionals and loops (tf.cond, tf.switch_case, tf.while_loop) of a
    condition computed from split values; TF1 Switch/Merge/Enter of constants."""
    double = _traced(lambda x: [x * 2.0], (4, 6))
    shifted = _traced(lambda x: [x - 1.0], (4, 6))
    branches = {"Tout": [tf.float32], "output_shapes": [[4, 6]]}
    cond = dict(branches, then_branch=double, else_branch=shifted)
    case = dict(branches, branches=[double, shifted])
    index = Made(F(4, 6), lambda t: tf.cast(_positive_sum(t), tf.int32))
    loop = {"cond": _traced(lambda x, i: i < 3, (4, 6), ()),
            "body": _traced(lambda x, i: [x * 0.5 + 1.0, i + 1], (4, 6), ()),
            "output_shapes": [[4, 6], []]}
    dead = Made(F(4, 6), lambda t: tf.raw_ops.Switch(data=t, pred=tf.constant(False))[1])
    ref = Made(F(4, 6), _ref)
    dead_ref = Made(F(4, 6), lambda t: tf.raw_ops.RefSwitch(data=_ref(t),
                                                            pred=tf.constant(False))[1])
    frame = {"frame_name": "sweep"}
    second = lambda outs, _: outs[1]  # noqa: E731 - the taken branch of a Switch
    r = {op: Recipe((Made(F(4, 6), _positive_sum), [F(4, 6)]), cond)
         for op in ("If", "StatelessIf")}
    r.update({op: Recipe((index, [F(4, 6)]), case) for op in ("Case", "StatelessCase")})
    r.update({op: Recipe(([F(4, 6), C(0)],), loop) for op in ("While", "StatelessWhile")})
    r.update({"Switch": Recipe((F(4, 6), C(True, "bool")), finish=second),
              "RefSwitch": Recipe((ref, C(True, "bool")),
                                  finish=lambda outs, _: outs[1] * 1.0),
              # a dead Switch branch and a live tensor: Merge forwards the live one (of
              # two live ones it forwards whichever arrives first: no value to compare)
              "Merge": Recipe(([dead, F(4, 6)],)),
              "RefMerge": Recipe(([dead_ref, ref],), finish=lambda outs, _: outs[0] * 1.0),
              "Enter": Recipe((F(4, 6),), frame),
              "RefNextIteration": Recipe((ref,)),
              "LoopCond": Recipe((C(True, "bool"),))})
    return r


def _py_functions() -> dict:
    """tf.numpy_function's and tf.py_function's ops (a registered Python function)."""
    def halved(x):
        return x / 2
    # pylint: disable=protected-access
    registry = script_ops._py_funcs
    eager = script_ops.EagerFunc(halved, [tf.float32], False)
    numpy_token, eager_token = registry.insert(halved), registry.insert(eager)
    _ALIVE.extend([halved, eager])  # TF's registry holds its functions weakly
    out = {"Tout": [tf.float32]}
    def fixed(outs, _):  # TF's shape inference does not know a Python function's
        return shaped(outs, [4, 6])
    return {"PyFunc": Recipe(([F(4, 6)],), dict(out, token=numpy_token), fixed),
            "PyFuncStateless": Recipe(([F(4, 6)],), dict(out, token=numpy_token), fixed),
            "EagerPyFunc": Recipe(([F(4, 6)],), dict(out, token=eager_token), fixed)}


_ALIVE = []  # the Python functions of _py_functions' ops


def _recipes() -> dict:
    r = {**_hash_tables(), **_tensor_arrays()}
    for part in (_variables, _random, _side_effects, _summaries, _refs, _more_tables,
                 _more_tensor_arrays, _control_flow, _py_functions):
        r.update(part())
    return r


RECIPES = _recipes()
