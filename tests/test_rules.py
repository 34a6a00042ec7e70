"""The sharding rule of every op type with a rule in the op registry, checked in its printed (Shardy) form.

Each row traces a tiny TF function holding the op, imports it and prints rule_for of the
op's node. The expected texts say what the rule must be: letters are factors in order of
id, `[ij]` a dim made of two factors, `1` a dim without a factor, `_` a non-data input.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding as xs
from tensorflow.python.framework import op_def_registry

import gspmd_tf as gt
from gspmd_tf.graph import import_graph
from gspmd_tf.propagation.rules import einsum_rule
from gspmd_tf.registry import ops_with_rules, rule_for
from gspmd_tf.spmd.handlers.replayed import BINARY, SPECIAL, UNARY
from util import check_partitioned, tensor_lists


def f32(*shape):
    return tf.TensorSpec(shape, tf.float32)


def i32(*shape):
    return tf.TensorSpec(shape, tf.int32)


def boolean(*shape):
    return tf.TensorSpec(shape, tf.bool)


def printed_rule(op_type, fn, specs):
    """The printed rule of the last `op_type` node of `fn` traced on `specs`."""
    graph = import_graph(tf.function(fn, autograph=False).get_concrete_function(*specs))
    nodes = [n for n in graph.nodes if n.op == op_type]
    assert nodes, f"no {op_type} in {[n.op for n in graph.nodes]}"
    return str(rule_for(graph, nodes[-1]))


def raw(op_type, **attrs):
    """tf.raw_ops.<op_type> called with its data inputs positionally."""
    names = [a.name for a in op_def_registry.get(op_type).input_arg]
    op = getattr(tf.raw_ops, op_type)
    return lambda *xs_: op(**dict(zip(names, xs_)), **attrs)


SAME_2D = "([i, j])->([i, j]) {i=4, j=6}"
UNARY_ATTRS = {"Cast": {"DstT": tf.int32}, "CheckNumerics": {"message": "m"},
               "CheckNumericsV2": {"message": "m"},
               "EnsureShape": {"shape": [4, 6]}}
UNARY_ROWS = [(op, raw(op, **UNARY_ATTRS.get(op, {})),
               [boolean(4, 6) if op == "LogicalNot" else f32(4, 6)], SAME_2D)
              for op in UNARY + ["EnsureShape"]]

BROADCAST = "([i, 1, k], [j, k])->([i, j, k]) {i=4, j=5, k=6}"
BITWISE = {"LogicalAnd": boolean, "LogicalOr": boolean, "BitwiseAnd": i32, "BitwiseOr": i32,
           "LeftShift": i32, "RightShift": i32,
           "BitwiseXor": i32}
BINARY_ROWS = [(op, raw(op), [BITWISE.get(op, f32)(4, 1, 6), BITWISE.get(op, f32)(5, 6)],
                BROADCAST) for op in BINARY if not op.endswith("Grad")]
GRAD_ROWS = [(op, raw(op), [f32(4, 6), f32(4, 6)], "([i, j], [i, j])->([i, j]) {i=4, j=6}")
             for op in BINARY if op.endswith("Grad")]


def with_variables(op_type, var_shape=(4, 6)):
    """A fused variable update on fresh variables: resource inputs are variables of
    `var_shape`, `grad`/`delta` a tensor of that shape, the other inputs scalars."""
    op_def = op_def_registry.get(op_type)
    args = op_def.input_arg
    attrs = {"dtype": tf.float32} if op_type == "ReadVariableOp" else {}
    variables = {a.name: tf.Variable(tf.zeros(var_shape)) for a in args
                 if a.type == tf.resource.as_datatype_enum}

    def fn(grad):
        values = {a.name: variables[a.name].handle if a.name in variables
                  else grad if a.name in ("grad", "delta", "value") else tf.constant(0.1)
                  for a in args}
        result = getattr(tf.raw_ops, op_type)(**values, **attrs)
        return result if isinstance(result, tf.Tensor) else None  # not an Operation
    return fn


V = "[i, j]"
VARIABLE_EXPECTED = {
    "ReadVariableOp": f"({V})->({V})",
    "AssignVariableOp": f"({V}, {V})->()",
    "AssignAddVariableOp": f"({V}, {V})->()",
    "AssignSubVariableOp": f"({V}, {V})->()",
    "ResourceApplyGradientDescent": f"({V}, _, {V})->()",
    "ResourceApplyMomentum": f"({V}, {V}, _, {V}, _)->()",
    "ResourceApplyKerasMomentum": f"({V}, {V}, _, {V}, _)->()",
    "ResourceApplyAdam": f"({V}, {V}, {V}, _, _, _, _, _, _, {V})->()",
    "ResourceApplyAdamWithAmsgrad": f"({V}, {V}, {V}, {V}, _, _, _, _, _, _, {V})->()",
    "ResourceApplyAdagrad": f"({V}, {V}, _, {V})->()",
    "ResourceApplyAdagradV2": f"({V}, {V}, _, _, {V})->()",
    "ResourceApplyRMSProp": f"({V}, {V}, {V}, _, _, _, _, {V})->()",
    "ResourceApplyCenteredRMSProp": f"({V}, {V}, {V}, {V}, _, _, _, _, {V})->()",
    "ResourceApplyAdadelta": f"({V}, {V}, {V}, _, _, _, {V})->()",
    "ResourceApplyAdaMax": f"({V}, {V}, {V}, _, _, _, _, _, {V})->()",
    "ResourceApplyFtrl": f"({V}, {V}, {V}, {V}, _, _, _, _)->()",
    "ResourceApplyFtrlV2": f"({V}, {V}, {V}, {V}, _, _, _, _, _)->()",
    "ResourceApplyProximalGradientDescent": f"({V}, _, _, _, {V})->()",
    "ResourceApplyProximalAdagrad": f"({V}, {V}, _, _, _, {V})->()",
    "ResourceApplyAddSign": f"({V}, {V}, _, _, _, _, {V})->()",
    "ResourceApplyPowerSign": f"({V}, {V}, _, _, _, _, {V})->()",
    "DisableCopyOnRead": f"({V})->()",
}
VARIABLE_ROWS = [(op, with_variables(op), [f32(4, 6)], text + " {i=4, j=6}")
                 for op, text in VARIABLE_EXPECTED.items()]


def read(shape, batch_dims=0):
    variable = tf.Variable(tf.zeros(shape))
    return lambda i: tf.raw_ops.ResourceGather(resource=variable.handle, indices=i,
                                               dtype=tf.float32, batch_dims=batch_dims)


def resource_scatter(op_type, indices):
    """updates -> ResourceScatter*(Nd*) of a fresh 5x6 variable's rows at `indices`."""
    variable = tf.Variable(tf.zeros((5, 6)))
    handle = "ref" if "Nd" in op_type else "resource"

    def fn(updates):
        getattr(tf.raw_ops, op_type)(**{handle: variable.handle}, indices=indices,
                                     updates=updates)
    return fn


def conv(op_type, x, w, y, **attrs):
    """A conv-family op in the argument order of its raw op (x, w, y: the forward
    image, filter and output shapes; gradient ops get the sizes they compute)."""
    attrs = {"strides": [1, 1, 1, 1], "padding": "SAME", **attrs}
    op = getattr(tf.raw_ops, op_type)
    if op_type.endswith("BackpropInput"):
        return (lambda w_, dy: op(input_sizes=list(x), filter=w_, out_backprop=dy, **attrs),
                [f32(*w), f32(*y)])
    if op_type.endswith("BackpropFilter"):
        return (lambda x_, dy: op(input=x_, filter_sizes=list(w), out_backprop=dy, **attrs),
                [f32(*x), f32(*y)])
    return lambda x_, w_: op(input=x_, filter=w_, **attrs), [f32(*x), f32(*w)]


CONV = ("([i, j, k, l], [n, o, l, m])->([i, j, k, m]) {i=2, j=8, k=8, l=3, m=5, n=3, o=3}")
DEPTHWISE_SIZES = "{i=2, j=8, k=8, l=3, m=2, n=3, o=3}"
CONV_ROWS = [
    ("Conv2D", *conv("Conv2D", (2, 8, 8, 3), (3, 3, 3, 5), None),
     CONV + " reduction={l} need_replication={n, o}"),
    ("Conv2DBackpropInput", *conv("Conv2DBackpropInput", (2, 8, 8, 3), (3, 3, 3, 5),
                                  (2, 8, 8, 5)),
     "(_, [n, o, l, m], [i, j, k, m])->([i, j, k, l]) {i=2, j=8, k=8, l=3, m=5, n=3, o=3}"
     " reduction={m} need_replication={n, o}"),
    ("Conv2DBackpropFilter", *conv("Conv2DBackpropFilter", (2, 8, 8, 3), (3, 3, 3, 5),
                                   (2, 8, 8, 5)),
     "([i, j, k, l], _, [i, j, k, m])->([n, o, l, m]) {i=2, j=8, k=8, l=3, m=5, n=3, o=3}"
     " reduction={i, j, k} need_replication={n, o}"),
    ("DepthwiseConv2dNative", *conv("DepthwiseConv2dNative", (2, 8, 8, 3), (3, 3, 3, 2),
                                    None),
     f"([i, j, k, l], [n, o, l, m])->([i, j, k, lm]) {DEPTHWISE_SIZES}"
     " need_replication={n, o}"),
    ("DepthwiseConv2dNativeBackpropInput",
     *conv("DepthwiseConv2dNativeBackpropInput", (2, 8, 8, 3), (3, 3, 3, 2), (2, 8, 8, 6)),
     f"(_, [n, o, l, m], [i, j, k, lm])->([i, j, k, l]) {DEPTHWISE_SIZES}"
     " reduction={m} need_replication={n, o}"),
    ("DepthwiseConv2dNativeBackpropFilter",
     *conv("DepthwiseConv2dNativeBackpropFilter", (2, 8, 8, 3), (3, 3, 3, 2), (2, 8, 8, 6)),
     f"([i, j, k, l], _, [i, j, k, lm])->([n, o, l, m]) {DEPTHWISE_SIZES}"
     " reduction={i, j, k} need_replication={n, o}"),
    # strided: the spatial factor spans x's 8 and y's 3 (its size is the larger)
    ("Conv2D", *conv("Conv2D", (2, 8, 8, 3), (3, 3, 3, 5), None, strides=[1, 2, 2, 1],
                     padding="VALID"),
     CONV + " reduction={l} need_replication={n, o}"),
]

POOL = {"ksize": [1, 2, 2, 1], "strides": [1, 2, 2, 1], "padding": "VALID"}
POOLED = "[i, k, l, j]"
POOL_SIZES = " {i=2, j=3, k=8, l=8}"
POOL_ROWS = [
    ("MaxPool", lambda x: tf.raw_ops.MaxPool(input=x, **POOL), [f32(2, 8, 8, 3)],
     f"({POOLED})->({POOLED})" + POOL_SIZES),
    ("AvgPool", lambda x: tf.raw_ops.AvgPool(value=x, **POOL), [f32(2, 8, 8, 3)],
     f"({POOLED})->({POOLED})" + POOL_SIZES),
    ("MaxPoolGrad", lambda x, y, dy: tf.raw_ops.MaxPoolGrad(orig_input=x, orig_output=y,
                                                            grad=dy, **POOL),
     [f32(2, 8, 8, 3), f32(2, 4, 4, 3), f32(2, 4, 4, 3)],
     f"({POOLED}, {POOLED}, {POOLED})->({POOLED})" + POOL_SIZES),
    ("AvgPoolGrad", lambda dy: tf.raw_ops.AvgPoolGrad(orig_input_shape=[2, 8, 8, 3],
                                                      grad=dy, **POOL),
     [f32(2, 4, 4, 3)], f"(_, {POOLED})->({POOLED})" + POOL_SIZES),
]

# the 3-D convolutions and pools: the same factors with three spatial dims; MirrorPad(Grad)
# shares a factor between a padded dim of x and y, as Pad does
C3 = {"strides": [1, 1, 1, 1, 1], "padding": "SAME"}
P3 = {"ksize": [1, 2, 2, 2, 1], "strides": [1, 2, 2, 2, 1], "padding": "VALID"}
X3, W3, Y3 = [2, 6, 8, 8, 3], [3, 3, 3, 3, 5], [2, 6, 8, 8, 5]
CONV3D_SIZES = " {i=2, j=6, k=8, l=8, m=3, n=5, o=3, p=3, q=3}"
POOLED3 = "[i, k, l, m, j]"
POOL3D_SIZES = " {i=2, j=3, k=6, l=8, m=8}"
POOL_ROWS += [
    ("Conv3D", lambda x, w: tf.raw_ops.Conv3D(input=x, filter=w, **C3), [f32(*X3), f32(*W3)],
     "([i, j, k, l, m], [o, p, q, m, n])->([i, j, k, l, n])" + CONV3D_SIZES
     + " reduction={m} need_replication={o, p, q}"),
    ("Conv3DBackpropInputV2",
     lambda w, dy: tf.raw_ops.Conv3DBackpropInputV2(input_sizes=X3, filter=w, out_backprop=dy,
                                                   **C3), [f32(*W3), f32(*Y3)],
     "(_, [o, p, q, m, n], [i, j, k, l, n])->([i, j, k, l, m])" + CONV3D_SIZES
     + " reduction={n} need_replication={o, p, q}"),
    ("Conv3DBackpropFilterV2",
     lambda x, dy: tf.raw_ops.Conv3DBackpropFilterV2(input=x, filter_sizes=W3, out_backprop=dy,
                                                    **C3), [f32(*X3), f32(*Y3)],
     "([i, j, k, l, m], _, [i, j, k, l, n])->([o, p, q, m, n])" + CONV3D_SIZES
     + " reduction={i, j, k, l} need_replication={o, p, q}"),
    ("MaxPool3D", lambda x: tf.raw_ops.MaxPool3D(input=x, **P3), [f32(*X3)],
     f"({POOLED3})->({POOLED3})" + POOL3D_SIZES),
    ("AvgPool3D", lambda x: tf.raw_ops.AvgPool3D(input=x, **P3), [f32(*X3)],
     f"({POOLED3})->({POOLED3})" + POOL3D_SIZES),
    ("MaxPool3DGrad", lambda x, y, dy: tf.raw_ops.MaxPool3DGrad(orig_input=x, orig_output=y,
                                                                grad=dy, **P3),
     [f32(*X3), f32(2, 3, 4, 4, 3), f32(2, 3, 4, 4, 3)],
     f"({POOLED3}, {POOLED3}, {POOLED3})->({POOLED3})" + POOL3D_SIZES),
    ("AvgPool3DGrad", lambda dy: tf.raw_ops.AvgPool3DGrad(orig_input_shape=X3, grad=dy, **P3),
     [f32(2, 3, 4, 4, 3)], f"(_, {POOLED3})->({POOLED3})" + POOL3D_SIZES),
    ("MirrorPad", lambda x: tf.raw_ops.MirrorPad(input=x, paddings=[[1, 2], [0, 0]],
                                                 mode="REFLECT"), [f32(8, 6)],
     "([i, j], _)->([i, j]) {i=11, j=6}"),
    ("MirrorPadGrad", lambda dy: tf.raw_ops.MirrorPadGrad(input=dy, paddings=[[1, 2], [0, 0]],
                                                          mode="SYMMETRIC"), [f32(11, 6)],
     "([i, j], _)->([i, j]) {i=11, j=6}"),
]

# stateless draws with distribution parameters, categorical draws, shuffles: sources too
# (every input replicated, the whole draw sliced)
STATELESS_SHAPE = (4, 6)
POOL_ROWS += [
    (op, lambda seed, draw=draw: draw(seed), [i32(2)],
     f"({', '.join(['_'] * n)})->([i, j]) {{i=4, j=6}}")
    for op, draw, n in [
        ("StatelessRandomBinomial", lambda seed: tf.random.stateless_binomial(
            STATELESS_SHAPE, seed, counts=[5.0] * 6, probs=0.3), 4),
        ("StatelessRandomGammaV2", lambda seed: tf.raw_ops.StatelessRandomGammaV2(
            shape=STATELESS_SHAPE, seed=seed, alpha=[1.0] * 6), 3),
        ("StatelessRandomGammaV3", lambda seed: tf.random.stateless_gamma(
            STATELESS_SHAPE, seed, alpha=[1.0] * 6), 5),
        ("StatelessRandomPoisson", lambda seed: tf.random.stateless_poisson(
            STATELESS_SHAPE, seed, lam=[2.0] * 6), 3),
        ("StatelessParameterizedTruncatedNormal",
         lambda seed: tf.random.stateless_parameterized_truncated_normal(
             STATELESS_SHAPE, seed, 0.5, 2.0, -1.0, 1.5), 6),
        ("StatelessMultinomial", lambda seed: tf.random.stateless_categorical(
            tf.zeros([4, 3]), 6, seed), 3),
        ("StatelessShuffle", lambda seed: tf.random.experimental.stateless_shuffle(
            tf.zeros(STATELESS_SHAPE), seed), 4)]]

def select(condition, x, y):
    return tf.raw_ops.Select(condition=condition, x=x, y=y)


MATMUL = "([i, j], [j, k])->([i, k]) {i=4, j=8, k=16} reduction={j}"


ELEMENT = "{i=4, j=6}"
# lists and elements share the element dims' factors; the list index dim is whole
TENSOR_LIST_ROWS = [(op, tensor_lists, [f32(3, 4, 6), f32(4, 6)], expected) for op, expected in [
    ("EmptyTensorList", f"(_, _)->([i, j]) {ELEMENT}"),
    ("TensorListReserve", f"(_, _)->([i, j]) {ELEMENT}"),
    ("TensorListFromTensor", "([k, i, j], _)->([i, j]) {i=4, j=6, k=3} need_replication={k}"),
    ("TensorListSetItem", f"([i, j], _, [i, j])->([i, j]) {ELEMENT}"),
    ("TensorListPushBack", f"([i, j], [i, j])->([i, j]) {ELEMENT}"),
    ("TensorListGetItem", f"([i, j], _, _)->([i, j]) {ELEMENT}"),
    ("TensorListPopBack", f"([i, j], _)->([i, j], [i, j]) {ELEMENT}"),
    ("TensorListResize", f"([i, j], _)->([i, j]) {ELEMENT}"),
    ("TensorListLength", f"([i, j])->([]) {ELEMENT}"),
    ("TensorListStack", "([i, j], _)->([k, i, j]) {i=4, j=6, k=3} need_replication={k}"),
]]


def scattered_lists(x):
    """TensorArray.scatter / gather's list ops (values: tests/test_tensor_list_and_random_op_rules.py)."""
    from tensorflow.python.ops import gen_list_ops as lists
    one = lists.tensor_list_scatter(x, [0, 2, 1], element_shape=[4, 6])
    two = lists.tensor_list_scatter_v2(x, [0, 2, 1], element_shape=[4, 6], num_elements=3)
    two = lists.tensor_list_scatter_into_existing_list(two, x, [2, 1, 0])
    return (lists.tensor_list_gather(two, [1, 0], element_shape=[4, 6],
                                     element_dtype=tf.float32),
            lists.tensor_list_element_shape(one, shape_type=tf.int32))


TENSOR_LIST_ROWS += [(op, scattered_lists, [f32(3, 4, 6)], expected) for op, expected in [
    ("TensorListScatter", "([k, i, j], _, _)->([i, j]) {i=4, j=6, k=3} need_replication={k}"),
    ("TensorListScatterV2",
     "([k, i, j], _, _, _)->([i, j]) {i=4, j=6, k=3} need_replication={k}"),
    ("TensorListScatterIntoExistingList",
     "([i, j], [k, i, j], _)->([i, j]) {i=4, j=6, k=3} need_replication={k}"),
    ("TensorListGather", "([i, j], _, _)->([k, i, j]) {i=4, j=6, k=2} need_replication={k}"),
    ("TensorListElementShape", f"([i, j])->([1]) {ELEMENT}"),
]]
# stateful random ops: sources, as the stateless ones (values: test_tensor_list_and_random_op_rules.py)
STATEFUL_RANDOM_ROWS = [(op, fn, [], "(_)->([i, j]) {i=4, j=6}") for op, fn in [
    ("RandomUniform", lambda: tf.random.uniform((4, 6), seed=1)),
    ("RandomStandardNormal", lambda: tf.random.normal((4, 6), seed=1)),
    ("TruncatedNormal", lambda: tf.random.truncated_normal((4, 6), seed=1))]] + [
    ("RandomUniformInt", lambda: tf.random.uniform((4, 6), 0, 5, dtype=tf.int32, seed=1), [],
     "(_, _, _)->([i, j]) {i=4, j=6}")]



def c64(*shape):
    return tf.TensorSpec(shape, tf.complex64)


def text(*shape):
    return tf.TensorSpec(shape, tf.string)


# special functions are elementwise (broadcasting from the right): unary ones, binary
# ones, the ternary Betainc (equal shapes or scalars), integer and complex ones
SPECIAL_UNARY = {"BesselI0e": f32, "BesselI1e": f32, "Ndtri": f32, "Erfinv": f32,
                 "Invert": i32, "PopulationCount": i32, "ComplexAbs": c64,
                 **dict.fromkeys(("Angle", "Conj", "Real", "Imag"), c64),
                 **dict.fromkeys("""BesselI0 BesselI1 BesselJ0 BesselJ1 BesselK0 BesselK0e
                 BesselK1 BesselK1e BesselY0 BesselY1 Expint FresnelCos FresnelSin Spence
                 DebugGradientIdentity FakeQuantWithMinMaxArgs""".split(), f32)}
# binary ones of equal shapes (no broadcasting)
SPECIAL_SAME_SHAPES = {"InvGrad", "ApproximateEqual", "FakeQuantWithMinMaxArgsGradient"}
SPECIAL_ROWS = [(op, raw(op), [SPECIAL_UNARY[op](4, 6)], SAME_2D)
                if op in SPECIAL_UNARY else
                (op, raw(op), [f32(4, 6)] * 2, "([i, j], [i, j])->([i, j]) {i=4, j=6}")
                if op in SPECIAL_SAME_SHAPES else
                (op, raw(op), [f32(4, 6)] * 3, "([i, j], [i, j], [i, j])->([i, j]) {i=4, j=6}")
                if op == "Betainc" else
                (op, raw(op), [(i32 if op == "Mod" else f32)(4, 1, 6),
                               (i32 if op == "Mod" else f32)(5, 6)], BROADCAST)
                for op in SPECIAL if not op.startswith("FakeQuantWithMinMaxVars")] + [
    # fake quantization by bounds given as inputs: scalars, or per channel (the last dim)
    ("FakeQuantWithMinMaxVars", raw("FakeQuantWithMinMaxVars"), [f32(4, 6), f32(), f32()],
     "([i, j], [], [])->([i, j]) {i=4, j=6}"),
    ("FakeQuantWithMinMaxVarsPerChannel", raw("FakeQuantWithMinMaxVarsPerChannel"),
     [f32(4, 6), f32(6), f32(6)], "([i, j], [j], [j])->([i, j]) {i=4, j=6}")]
def python_function(call):
    """x -> call(double, [x]) (tf.py_function or tf.numpy_function), shaped like x."""
    def fn(x):
        y = call(lambda v: v * 2.0, [x], tf.float32)
        y.set_shape(x.shape)
        return y
    return fn


RNG_STATE = tf.Variable(np.zeros(3, np.int64))  # the state of a tf.random.Generator
PAIRED = "[i, k, l, j]"  # batch and channel dims pass, height and width whole
FAMILY_ROWS = [
    ("AsString", raw("AsString"), [i32(4, 6)], SAME_2D),
    ("StringLength", raw("StringLength"), [text(4, 6)], SAME_2D),
    ("StringToHashBucketFast", raw("StringToHashBucketFast", num_buckets=7), [text(4, 6)],
     SAME_2D),
    *[(op, raw(op, **attrs), [text(4, 6)], SAME_2D) for op, attrs in [
        ("StringToHashBucket", {"num_buckets": 7}),
        ("StringToHashBucketStrong", {"num_buckets": 7, "key": [1, 2]}),
        ("StringToNumber", {}), ("EncodeBase64", {}), ("DecodeBase64", {}),
        ("StringLower", {}), ("StringUpper", {}), ("StringStrip", {}),
        ("StaticRegexReplace", {"pattern": "a", "rewrite": "b"})]],
    ("RegexReplace", raw("RegexReplace"), [text(4, 6), text(), text()],
     "([i, j], [], [])->([i, j]) {i=4, j=6}"),
    ("StringJoin", lambda a, b: tf.raw_ops.StringJoin(inputs=[a, b]), [text(4, 6), text(4, 6)],
     "([i, j], [i, j])->([i, j]) {i=4, j=6}"),
    ("ShardedFilename", raw("ShardedFilename"), [text(), i32(), i32()], "([], [], [])->([]) {}"),
    # every dim summed: partial sums
    ("L2Loss", tf.nn.l2_loss, [f32(4, 6)], "([i, j])->([]) {i=4, j=6} reduction={i, j}"),
    # the v1 Concat: as ConcatV2 with the axis first
    ("Concat", lambda a, b: tf.raw_ops.Concat(concat_dim=1, values=[a, b]),
     [f32(4, 6), f32(4, 2)],
     "(_, [i, j], [i, k])->([i, l]) {i=4, j=6, k=2, l=8} need_replication={j, k, l}"),
    # a dim the slice takes whole passes (shared with the value); a sliced one is whole
    ("TensorStridedSliceUpdate", lambda x, v: tf.raw_ops.TensorStridedSliceUpdate(
        input=x, begin=[1, 0], end=[3, 6], strides=[1, 1], value=v), [f32(4, 6), f32(2, 6)],
     "([i, j], _, _, _, [k, j])->([i, j]) {i=4, j=6, k=2} need_replication={i, k}"),
    ("InTopKV2", lambda p, t: tf.math.in_top_k(t, p, 2), [f32(4, 6), i32(4)],
     "([i, j], [i], _)->([i]) {i=4, j=6} need_replication={j}"),
    # transforms: the transformed dims whole, batch dims pass
    *[(op, raw(op), [c64(3, 4, 5, 6)],
       f"([i, {core}])->([i, {core_out}]) {{{sizes}}} need_replication={{{whole}}}")
      for op, core, core_out, sizes, whole in [
          ("FFT", "j, k, l", "j, k, m", "i=3, j=4, k=5, l=6, m=6", "l, m"),
          ("IFFT", "j, k, l", "j, k, m", "i=3, j=4, k=5, l=6, m=6", "l, m"),
          ("FFT2D", "j, k, l", "j, m, n", "i=3, j=4, k=5, l=6, m=5, n=6", "k, l, m, n"),
          ("IFFT2D", "j, k, l", "j, m, n", "i=3, j=4, k=5, l=6, m=5, n=6", "k, l, m, n"),
          ("FFT3D", "j, k, l", "m, n, o", "i=3, j=4, k=5, l=6, m=4, n=5, o=6",
           "j, k, l, m, n, o"),
          ("IFFT3D", "j, k, l", "m, n, o", "i=3, j=4, k=5, l=6, m=4, n=5, o=6",
           "j, k, l, m, n, o")]],
    ("RFFT", lambda x: tf.signal.rfft(x), [f32(3, 8)],
     "([i, j], _)->([i, k]) {i=3, j=8, k=5} need_replication={j, k}"),
    ("IRFFT", lambda x: tf.signal.irfft(x), [c64(3, 5)],
     "([i, j], _)->([i, k]) {i=3, j=5, k=8} need_replication={j, k}"),
    ("RFFT2D", lambda x: tf.signal.rfft2d(x), [f32(3, 4, 8)],
     "([i, j, k], _)->([i, l, m]) {i=3, j=4, k=8, l=4, m=5} need_replication={j, k, l, m}"),
    ("IRFFT2D", lambda x: tf.signal.irfft2d(x), [c64(3, 4, 5)],
     "([i, j, k], _)->([i, l, m]) {i=3, j=4, k=5, l=4, m=8} need_replication={j, k, l, m}"),
    ("RFFT3D", lambda x: tf.signal.rfft3d(x), [f32(3, 2, 4, 8)],
     "([i, j, k, l], _)->([i, m, n, o]) {i=3, j=2, k=4, l=8, m=2, n=4, o=5}"
     " need_replication={j, k, l, m, n, o}"),
    ("IRFFT3D", lambda x: tf.signal.irfft3d(x), [c64(3, 2, 4, 5)],
     "([i, j, k, l], _)->([i, m, n, o]) {i=3, j=2, k=4, l=5, m=2, n=4, o=8}"
     " need_replication={j, k, l, m, n, o}"),
    # matrices whole, batch dims pass (shared by Qr's q and r)
    ("Qr", lambda x: tf.linalg.qr(x), [f32(3, 4, 6)],
     "([i, j, k])->([i, l, m], [i, n, o]) {i=3, j=4, k=6, l=4, m=4, n=4, o=6}"
     " need_replication={j, k, l, m, n, o}"),
    ("Cholesky", tf.linalg.cholesky, [f32(3, 4, 4)],
     "([i, j, k])->([i, l, m]) {i=3, j=4, k=4, l=4, m=4} need_replication={j, k, l, m}"),
    # bilinear and nearest resizes: every dim passes, height and width each one factor of
    # the image and the resized image (halo exchange, windowed.resize); the gradients alike
    *[(op, lambda x, op=op: getattr(tf.raw_ops, op)(images=x, size=[6, 8]),
       [f32(2, 3, 4, 5)], "([i, j, k, l], _)->([i, j, k, l]) {i=2, j=6, k=8, l=5}")
      for op in ("ResizeBilinear", "ResizeNearestNeighbor")],
    ("ResizeBilinearGrad", lambda g, x: tf.raw_ops.ResizeBilinearGrad(grads=g, original_image=x),
     [f32(2, 6, 8, 5), f32(2, 3, 4, 5)],
     "([i, j, k, l], [i, j, k, l])->([i, j, k, l]) {i=2, j=6, k=8, l=5}"),
    ("ResizeNearestNeighborGrad",
     lambda g: tf.raw_ops.ResizeNearestNeighborGrad(grads=g, size=[3, 4]), [f32(2, 6, 8, 5)],
     "([i, j, k, l], _)->([i, j, k, l]) {i=2, j=6, k=8, l=5}"),
    # other images ops: batch and channels pass, height and width whole
    ("ResizeBicubic", lambda x: tf.raw_ops.ResizeBicubic(images=x, size=[6, 8]),
     [f32(2, 3, 4, 5)], f"({PAIRED}, _)->([i, m, n, j]) {{i=2, j=5, k=3, l=4, m=6, n=8}}"
     " need_replication={k, l, m, n}"),
    ("AdjustContrastv2", lambda x: tf.image.adjust_contrast(x, 2.0), [f32(2, 3, 4, 5)],
     f"({PAIRED}, _)->([i, m, n, j]) {{i=2, j=5, k=3, l=4, m=3, n=4}}"
     " need_replication={k, l, m, n}"),
    ("AdjustSaturation", lambda x: tf.image.adjust_saturation(x, 2.0), [f32(2, 4, 3)],
     "([i, j, k], _)->([i, j, l]) {i=2, j=4, k=3, l=3} need_replication={k, l}"),
    ("AdjustHue", lambda x: tf.image.adjust_hue(x, 0.2), [f32(2, 4, 3)],
     "([i, j, k], _)->([i, j, l]) {i=2, j=4, k=3, l=3} need_replication={k, l}"),
    # pooling's second derivative: the windowed dims whole
    ("MaxPoolGradGrad", lambda x, y, g: tf.raw_ops.MaxPoolGradGrad(
        orig_input=x, orig_output=y, grad=g, **POOL),
     [f32(2, 8, 8, 3), f32(2, 4, 4, 3), f32(2, 8, 8, 3)],
     "([i, k, l, j], [i, m, n, j], [i, o, p, j])->([i, q, r, j])"
     " {i=2, j=3, k=8, l=8, m=4, n=4, o=8, p=8, q=4, r=4}"
     " need_replication={k, l, m, n, o, p, q, r}"),
    ("MaxPool3DGradGrad", lambda x, y, g: tf.raw_ops.MaxPool3DGradGrad(
        orig_input=x, orig_output=y, grad=g, **P3),
     [f32(*X3), f32(2, 3, 4, 4, 3), f32(*X3)],
     "([i, k, l, m, j], [i, n, o, p, j], [i, q, r, s, j])->([i, t, u, v, j])"
     " {i=2, j=3, k=6, l=8, m=8, n=3, o=4, p=4, q=6, r=8, s=8, t=3, u=4, v=4}"
     " need_replication={k, l, m, n, o, p, q, r, s, t, u, v}"),
    # the diagonal: rows pass, columns whole (the handler cuts them to the row block)
    ("DiagPart", raw("DiagPart"), [f32(4, 4)], "([i, j])->([i]) {i=4, j=4} need_replication={j}"),
    # a conjugate transpose as a transpose; reversed dims whole
    ("ConjugateTranspose", lambda x: tf.raw_ops.ConjugateTranspose(x=x, perm=[1, 0]),
     [c64(4, 6)], "([i, j], _)->([j, i]) {i=4, j=6}"),
    ("ReverseV2", lambda x: tf.reverse(x, [1]), [f32(4, 6, 3)],
     "([i, j, l], _)->([i, k, l]) {i=4, j=6, k=6, l=3} need_replication={j, k}"),
    ("Reverse", lambda x: tf.raw_ops.Reverse(tensor=x, dims=[False, True, False]),
     [f32(4, 6, 3)],
     "([i, j, l], _)->([i, k, l]) {i=4, j=6, k=6, l=3} need_replication={j, k}"),
    # each pixel's channels whole (LRN: its window), 3-vectors whole
    *[(op, fn, [f32(2, 4, 3)],
       "([i, j, k])->([i, j, l]) {i=2, j=4, k=3, l=3} need_replication={k, l}")
      for op, fn in (("HSVToRGB", tf.image.hsv_to_rgb), ("RGBToHSV", tf.image.rgb_to_hsv))],
    ("LRN", lambda x: tf.nn.local_response_normalization(x, 2), [f32(2, 4, 5, 6)],
     "([i, j, k, l])->([i, j, k, m]) {i=2, j=4, k=5, l=6, m=6} need_replication={l, m}"),
    ("Cross", tf.linalg.cross, [f32(2, 4, 3)] * 2,
     "([i, j, k], [i, j, l])->([i, j, m]) {i=2, j=4, k=3, l=3, m=3}"
     " need_replication={k, l, m}"),
    # the batch passes, each image or volume whole
    ("SpaceToDepth", lambda x: tf.nn.space_to_depth(x, 2), [f32(2, 4, 6, 3)],
     "([i, j, k, l])->([i, m, n, o]) {i=2, j=4, k=6, l=3, m=2, n=3, o=12}"
     " need_replication={j, k, l, m, n, o}"),
    ("DepthToSpace", lambda x: tf.nn.depth_to_space(x, 2), [f32(2, 4, 6, 8)],
     "([i, j, k, l])->([i, m, n, o]) {i=2, j=4, k=6, l=8, m=8, n=12, o=2}"
     " need_replication={j, k, l, m, n, o}"),
    ("ExtractImagePatches", lambda x: tf.image.extract_patches(
        x, [1, 2, 2, 1], [1, 1, 1, 1], [1, 1, 1, 1], "VALID"), [f32(2, 4, 6, 3)],
     "([i, j, k, l])->([i, m, n, o]) {i=2, j=4, k=6, l=3, m=3, n=5, o=12}"
     " need_replication={j, k, l, m, n, o}"),
    ("ExtractVolumePatches", lambda x: tf.raw_ops.ExtractVolumePatches(
        input=x, ksizes=[1, 2, 2, 2, 1], strides=[1] * 5, padding="VALID"),
     [f32(2, 3, 4, 4, 3)],
     "([i, j, k, l, m])->([i, n, o, p, q]) {i=2, j=3, k=4, l=4, m=3, n=2, o=3, p=3, q=24}"
     " need_replication={j, k, l, m, n, o, p, q}"),
    # overwriting scatters by max / min: index batch dims whole, trailing dims pass
    *[(op, lambda x, u, op=op: getattr(tf.raw_ops, op)(tensor=x, indices=[[1], [3]],
                                                       updates=u),
       [f32(5, 6), f32(2, 6)],
       "([j, k], [i, 1], [i, k])->([j, k]) {i=2, j=5, k=6} need_replication={i, j}")
      for op in ("TensorScatterMax", "TensorScatterMin")],
    # a variable's rows updated in place: rows and index batch whole, trailing dims pass
    *[(op, resource_scatter(op, [1, 3, 1]), [f32(3, 6)],
       "([j, k], [i], [i, k])->() {i=3, j=5, k=6} need_replication={i, j}")
      for op in ("ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterMul",
                 "ResourceScatterDiv", "ResourceScatterMin", "ResourceScatterMax",
                 "ResourceScatterUpdate")],
    *[(op, resource_scatter(op, [[1], [3], [1]]), [f32(3, 6)],
       "([j, k], [i, 1], [i, k])->() {i=3, j=5, k=6} need_replication={i, j}")
      for op in ("ResourceScatterNdAdd", "ResourceScatterNdUpdate")],
    # inverses, square roots and solves: matrices whole, batch dims pass
    *[(op, fn, [f32(3, 4, 4)],
       "([i, j, k])->([i, l, m]) {i=3, j=4, k=4, l=4, m=4} need_replication={j, k, l, m}")
      for op, fn in (("MatrixInverse", tf.linalg.inv), ("MatrixSquareRoot", tf.linalg.sqrtm))],
    *[(op, fn, [f32(3, 4, 4), f32(3, 4, 2)],
       "([i, j, k], [i, l, m])->([i, n, o]) {i=3, j=4, k=4, l=4, m=2, n=4, o=2}"
       " need_replication={j, k, l, m, n, o}")
      for op, fn in (("MatrixSolve", tf.linalg.solve),
                     ("MatrixTriangularSolve", tf.linalg.triangular_solve))],
    # every input whole
    ("StringFormat", lambda x: tf.strings.format("{}", x), [f32(4, 6)],
     "([i, j])->([]) {i=4, j=6} need_replication={i, j}"),
    ("InvertPermutation", raw("InvertPermutation"), [i32(5)],
     "([i])->([j]) {i=5, j=5} need_replication={i, j}"),
    # tf.print: the whole value (printed once per call: backends/replicas.py)
    ("PrintV2", lambda s: (tf.raw_ops.PrintV2(input=s), tf.identity(s))[1],
     [tf.TensorSpec((), tf.string)], "([])->() {}"),
    ("Print", lambda x: tf.raw_ops.Print(input=x, data=[x]), [f32(4, 6)],
     "([i, j], [k, l])->([m, n]) {i=4, j=6, k=4, l=6, m=4, n=6}"
     " need_replication={i, j, k, l, m, n}"),
    # Python functions: inputs whole, run once per call (handlers/py_functions.py)
    *[(op, python_function(call), [f32(4, 6)],
       "([i, j])->([k, l]) {i=4, j=6, k=4, l=6} need_replication={i, j, k, l}")
      for op, call in [("EagerPyFunc", tf.py_function), ("PyFunc", tf.numpy_function)]],
    ("RngReadAndSkip", lambda delta: tf.raw_ops.RngReadAndSkip(
        resource=RNG_STATE.handle, alg=1, delta=delta),
     [tf.TensorSpec((), tf.uint64)], "([i], [], [])->([j]) {i=3, j=3} need_replication={i, j}"),
]


ROWS = (UNARY_ROWS + BINARY_ROWS + GRAD_ROWS + VARIABLE_ROWS + CONV_ROWS + POOL_ROWS
        + TENSOR_LIST_ROWS + STATEFUL_RANDOM_ROWS + SPECIAL_ROWS + FAMILY_ROWS) + [
    ("XlaSharding", lambda x: xs.replicate(x, use_sharding_op=True), [f32(4, 6)], SAME_2D),
    # a bitcast to a narrower type adds a minor dim, to a wider one removes it: that dim
    # is in one tensor only and stays whole
    ("Bitcast", raw("Bitcast", type=tf.int32), [f32(4, 6)], SAME_2D),
    ("Bitcast", raw("Bitcast", type=tf.uint8), [f32(4, 6)],
     "([i, j])->([i, j, k]) {i=4, j=6, k=4} need_replication={k}"),
    ("Bitcast", raw("Bitcast", type=tf.float32), [tf.TensorSpec((4, 6, 4), tf.uint8)],
     "([i, j, k])->([i, j]) {i=4, j=6, k=4} need_replication={k}"),
    ("AddN", lambda *x: tf.raw_ops.AddN(inputs=x), [f32(4, 6)] * 3,
     "([i, j], [i, j], [i, j])->([i, j]) {i=4, j=6}"),
    ("Select", select, [boolean(4), f32(4, 6), f32(4, 6)],
     "([i], [i, j], [i, j])->([i, j]) {i=4, j=6}"),
    ("Select", select, [boolean(4, 6), f32(4, 6), f32(4, 6)],
     "([i, j], [i, j], [i, j])->([i, j]) {i=4, j=6}"),
    ("SelectV2", raw("SelectV2"), [boolean(4, 1), f32(4, 6), f32(6)],
     "([i, 1], [i, j], [j])->([i, j]) {i=4, j=6}"),
    ("MatMul", raw("MatMul"), [f32(4, 8), f32(8, 16)], MATMUL),
    ("MatMul", raw("MatMul", transpose_b=True), [f32(4, 8), f32(16, 8)],
     "([i, j], [k, j])->([i, k]) {i=4, j=8, k=16} reduction={j}"),
    ("BatchMatMul", raw("BatchMatMul"), [f32(3, 4, 8), f32(3, 8, 5)],
     "([i, j, k], [i, k, l])->([i, j, l]) {i=3, j=4, k=8, l=5} reduction={k}"),
    ("BatchMatMulV2", raw("BatchMatMulV2"), [f32(2, 1, 4, 8), f32(3, 8, 5)],
     "([i, 1, k, l], [j, l, m])->([i, j, k, m]) {i=2, j=3, k=4, l=8, m=5} reduction={l}"),
    ("BatchMatMulV3", raw("BatchMatMulV3", adj_x=True, Tout=tf.float32),
     [f32(3, 8, 4), f32(3, 8, 5)],
     "([i, j, k], [i, j, l])->([i, k, l]) {i=3, j=8, k=4, l=5} reduction={j}"),
    ("Einsum", lambda a, b: tf.einsum("abc,cd->abd", a, b), [f32(2, 3, 4), f32(4, 5)],
     "([i, j, k], [k, l])->([i, j, l]) {i=2, j=3, k=4, l=5} reduction={k}"),
    ("Einsum", lambda a, b: tf.einsum("...ij,jk->...ik", a, b), [f32(2, 3, 4), f32(4, 5)],
     "([i, j, k], [k, l])->([i, j, l]) {i=2, j=3, k=4, l=5} reduction={k}"),
    ("BiasAdd", raw("BiasAdd"), [f32(4, 6), f32(6)], "([i, j], [j])->([i, j]) {i=4, j=6}"),
    ("BiasAdd", raw("BiasAdd", data_format="NCHW"), [f32(2, 3, 4, 5), f32(3)],
     "([i, j, k, l], [j])->([i, j, k, l]) {i=2, j=3, k=4, l=5}"),
    ("BiasAddV1", raw("BiasAddV1"), [f32(4, 6), f32(6)], "([i, j], [j])->([i, j]) {i=4, j=6}"),
    ("Sum", lambda x: tf.reduce_sum(x, 1), [f32(4, 6)],
     "([i, j], _)->([i]) {i=4, j=6} reduction={j}"),
    ("Mean", lambda x: tf.reduce_mean(x, 0), [f32(4, 6)],
     "([i, j], _)->([j]) {i=4, j=6} reduction={i}"),
    ("Max", lambda x: tf.reduce_max(x, 1, keepdims=True), [f32(4, 6)],
     "([i, j], _)->([i, 1]) {i=4, j=6} reduction={j} reduce=max"),
    ("Min", lambda x: tf.reduce_min(x, -1), [f32(4, 6)],
     "([i, j], _)->([i]) {i=4, j=6} reduction={j} reduce=min"),
    ("Prod", lambda x: tf.reduce_prod(x, [0, 1]), [f32(4, 6)],
     "([i, j], _)->([]) {i=4, j=6} reduction={i, j} reduce=prod"),
    ("All", lambda x: tf.reduce_all(x, 1), [boolean(4, 6)],
     "([i, j], _)->([i]) {i=4, j=6} reduction={j} reduce=min"),
    ("Any", lambda x: tf.reduce_any(x, 0), [boolean(4, 6)],
     "([i, j], _)->([j]) {i=4, j=6} reduction={i} reduce=max"),
    ("ArgMax", lambda x: tf.argmax(x, 1), [f32(4, 6)],
     "([i, j], _)->([i]) {i=4, j=6} reduction={j} reduce=arg"),
    ("ArgMin", lambda x: tf.argmin(x, 0), [f32(4, 6)],
     "([i, j], _)->([j]) {i=4, j=6} reduction={i} reduce=arg"),
    # the class dim is reduced inside the handler (it combines the pieces itself)
    ("Softmax", tf.nn.softmax, [f32(4, 6)], SAME_2D),
    ("LogSoftmax", tf.nn.log_softmax, [f32(4, 6)], SAME_2D),
    ("SparseSoftmaxCrossEntropyWithLogits", raw("SparseSoftmaxCrossEntropyWithLogits"),
     [f32(4, 6), i32(4)], "([i, j], [i])->([i], [i, j]) {i=4, j=6}"),
    ("SoftmaxCrossEntropyWithLogits", raw("SoftmaxCrossEntropyWithLogits"),
     [f32(4, 6), f32(4, 6)], "([i, j], [i, j])->([i], [i, j]) {i=4, j=6}"),
    ("Transpose", lambda x: tf.transpose(x, [2, 0, 1]), [f32(2, 3, 4)],
     "([i, j, k], _)->([k, i, j]) {i=2, j=3, k=4}"),
    ("Reshape", lambda x: tf.reshape(x, [24]), [f32(6, 4)], "([i, j], _)->([ij]) {i=6, j=4}"),
    ("Reshape", lambda x: tf.reshape(x, [6, 4]), [f32(2, 3, 4)],
     "([i, j, k], _)->([ij, k]) {i=2, j=3, k=4}"),
    ("ExpandDims", lambda x: tf.expand_dims(x, 1), [f32(4, 6)],
     "([i, j], _)->([i, 1, j]) {i=4, j=6}"),
    ("Squeeze", lambda x: tf.squeeze(x, [1]), [f32(4, 1, 6)],
     "([i, 1, j])->([i, j]) {i=4, j=6}"),
    ("ConcatV2", lambda a, b: tf.concat([a, b], 1), [f32(4, 6), f32(4, 2)],
     "([i, j], [i, k], _)->([i, l]) {i=4, j=6, k=2, l=8} need_replication={j, k, l}"),
    # a sliced or padded dim (positive stride) is a window of one element: one factor of
    # the larger size shared by operand and result, split alike (halo exchange); a
    # shrunk dim is a pick: REDUCE (its owner reads the element, the others zeros)
    ("Slice", lambda x: tf.slice(x, [0, 1], [4, 3]), [f32(4, 6)],
     "([i, j], _, _)->([i, j]) {i=4, j=6}"),
    ("StridedSlice", lambda x: x[:, 1:4], [f32(4, 6)],
     "([i, j], _, _, _)->([i, j]) {i=4, j=6}"),
    ("StridedSlice", lambda x: x[::2, 2], [f32(4, 6)],
     "([i, j], _, _, _)->([i]) {i=4, j=6} reduction={j}"),
    ("StridedSlice", lambda x: x[::-1], [f32(4, 6)],
     "([i, j], _, _, _)->([k, j]) {i=4, j=6, k=4} need_replication={i, k}"),
    ("Pad", lambda x: tf.pad(x, [[0, 0], [1, 2]]), [f32(4, 6)],
     "([i, j], _)->([i, j]) {i=4, j=9}"),
    ("PadV2", lambda x: tf.pad(x, [[0, 0], [1, 2]], constant_values=1.0), [f32(4, 6)],
     "([i, j], _, _)->([i, j]) {i=4, j=9}"),
    # a dim tiled from size 1 is a factor of the result only; tiled from more, whole
    ("Tile", lambda x: tf.tile(x, [1, 3]), [f32(4, 1)], "([i, 1], _)->([i, j]) {i=4, j=3}"),
    ("Tile", lambda x: tf.tile(x, [2, 1]), [f32(4, 6)],
     "([i, k], _)->([j, k]) {i=4, j=8, k=6} need_replication={i, j}"),
    # the gathered table dim: a masked local lookup, then a sum of the partial results
    ("GatherV2", lambda t, i: tf.gather(t, i), [f32(10, 6), i32(4, 3)],
     "([i, j], [k, l], _)->([k, l, j]) {i=10, j=6, k=4, l=3} reduction={i}"),
    ("GatherV2", lambda t, i: tf.gather(t, i, axis=1), [f32(10, 6), i32(5)],
     "([i, j], [k], _)->([i, k]) {i=10, j=6, k=5} reduction={j}"),
    ("ResourceGather", read((10, 6)), [i32(4)],
     "([i, j], [k])->([k, j]) {i=10, j=6, k=4} reduction={i}"),
    # batch_dims: the leading dims of table and indices are one factor (a parallel gather)
    ("GatherV2", lambda t, i: tf.gather(t, i, axis=2, batch_dims=1),
     [f32(6, 5, 7, 8), i32(6, 3)],
     "([i, j, k, l], [i, m], _)->([i, j, m, l]) {i=6, j=5, k=7, l=8, m=3} reduction={k}"),
    ("ResourceGather", read((6, 7, 8), batch_dims=1), [i32(6, 3)],
     "([i, j, k], [i, l])->([i, l, k]) {i=6, j=7, k=8, l=3} reduction={j}"),
    ("OneHot", lambda i: tf.one_hot(i, 5), [i32(4)], "([i], _, _, _)->([i, j]) {i=4, j=5}"),
    ("Const", lambda x: x + tf.constant(np.ones((4, 6), np.float32)), [f32(4, 6)],
     "()->([i, j]) {i=4, j=6}"),
    ("Fill", lambda v: tf.fill([4, 6], v), [f32()], "(_, _)->([i, j]) {i=4, j=6}"),
    ("BiasAddGrad", raw("BiasAddGrad"), [f32(4, 6)], "([i, j])->([j]) {i=4, j=6} reduction={i}"),
    ("BroadcastTo", lambda x: tf.broadcast_to(x, [4, 6]), [f32(1, 6)],
     "([1, j], _)->([i, j]) {i=4, j=6}"),
    # a stride-1 sliced dim is a pad of dy (a window); other strides stay whole
    ("StridedSliceGrad", lambda dy: tf.raw_ops.StridedSliceGrad(
        shape=[4, 6], begin=[0, 1], end=[4, 4], strides=[1, 1], dy=dy), [f32(4, 3)],
     "(_, _, _, _, [i, j])->([i, j]) {i=4, j=6}"),
    ("StridedSliceGrad", lambda dy: tf.raw_ops.StridedSliceGrad(
        shape=[4, 6], begin=[0, 1], end=[4, 4], strides=[1, 2], dy=dy), [f32(4, 2)],
     "(_, _, _, _, [i, k])->([i, j]) {i=4, j=6, k=2} need_replication={j, k}"),
    # the split axis whole in the operand and in every piece
    ("Split", lambda x: tf.split(x, 3, axis=1), [f32(4, 6)],
     "(_, [i, j])->([i, k], [i, l], [i, m]) {i=4, j=6, k=2, l=2, m=2}"
     " need_replication={j, k, l, m}"),
    ("SplitV", lambda x: tf.split(x, [1, 5], axis=1), [f32(4, 6)],
     "([i, j], _, _)->([i, 1], [i, k]) {i=4, j=6, k=5} need_replication={j, k}"),
    # the stacked / unstacked dim whole
    ("Pack", lambda a, b: tf.stack([a, b], axis=1), [f32(4, 6), f32(4, 6)],
     "([i, j], [i, j])->([i, k, j]) {i=4, j=6, k=2} need_replication={k}"),
    ("Unpack", lambda x: tf.unstack(x, axis=1), [f32(4, 3, 6)],
     "([i, k, j])->([i, j], [i, j], [i, j]) {i=4, j=6, k=3} need_replication={k}"),
    ("MatrixBandPart", lambda x: tf.linalg.band_part(x, 1, -1), [f32(2, 4, 6)],
     "([i, j, l], _, _)->([i, k, m]) {i=2, j=4, k=4, l=6, m=6} need_replication={j, k, l, m}"),
    ("TopKV2", lambda x: tf.math.top_k(x, 2), [f32(4, 6)],
     "([i, j], _)->([i, k], [i, k]) {i=4, j=6, k=2} need_replication={j, k}"),
    ("Cumsum", lambda x: tf.cumsum(x, 1), [f32(4, 6)],
     "([i, j], _)->([i, k]) {i=4, j=6, k=6} need_replication={j, k}"),
    # a rolled dim passes (cyclic block permutes, handlers/roll.py)
    ("Roll", lambda x: tf.roll(x, [1, -2], [0, 1]), [f32(4, 6)],
     "([i, j], _, _)->([i, j]) {i=4, j=6}"),
    ("Cumprod", lambda x: tf.math.cumprod(x, 0), [f32(4, 6)],
     "([i, k], _)->([j, k]) {i=4, j=4, k=6} need_replication={i, j}"),
    ("ClipByValue", lambda x: tf.raw_ops.ClipByValue(t=x, clip_value_min=-1.,
                                                     clip_value_max=1.), [f32(4, 6)],
     "([i, j], [], [])->([i, j]) {i=4, j=6}"),
    # masks normalized: a new axis is a size-1 dim, the ellipsis' dims pass
    ("StridedSlice", lambda x: x[:, None, ..., 1:3], [f32(4, 5, 6)],
     "([i, j, k], _, _, _)->([i, 1, j, k]) {i=4, j=5, k=6}"),
    ("StridedSlice", lambda x: x[..., 2], [f32(4, 5, 6)],
     "([i, j, k], _, _, _)->([i, j]) {i=4, j=5, k=6} reduction={k}"),
    # index batch dims pass (gather) or add up (scatter); the indexed dims are a masked
    # lookup (gather) or whole (scatter)
    ("GatherNd", lambda p, i: tf.gather_nd(p, i), [f32(4, 5, 6), i32(3, 7, 2)],
     "([l, m, n], [i, j, k])->([i, j, n]) {i=3, j=7, k=2, l=4, m=5, n=6}"
     " reduction={l, m} need_replication={k}"),
    ("ScatterNd", lambda i, u: tf.scatter_nd(i, u, [4, 5, 6]), [i32(3, 7, 2), f32(3, 7, 6)],
     "([i, j, k], [i, j, n], _)->([l, m, n]) {i=3, j=7, k=2, l=4, m=5, n=6}"
     " reduction={i, j} need_replication={k, l, m}"),
    *[(op, raw(op), [f32(4, 5, 6), i32(3, 7, 2), f32(3, 7, 6)],
       "([l, m, n], [i, j, k], [i, j, n])->([l, m, n]) {i=3, j=7, k=2, l=4, m=5, n=6}"
       " reduction={i, j} need_replication={k, l, m}")
      for op in ("TensorScatterAdd", "TensorScatterSub")],
    # updates that overwrite: all of them on every device
    ("TensorScatterUpdate", raw("TensorScatterUpdate"), [f32(4, 5, 6), i32(3, 7, 2),
                                                         f32(3, 7, 6)],
     "([l, m, n], [i, j, k], [i, j, n])->([l, m, n]) {i=3, j=7, k=2, l=4, m=5, n=6}"
     " need_replication={i, j, k, l, m}"),
    # every dim of x passes; the per-channel tensors share the channel factor (empty
    # moments and the scratch reserve spaces have none)
    ("FusedBatchNormV3", lambda x, c: tf.raw_ops.FusedBatchNormV3(
        x=x, scale=c, offset=c, mean=c, variance=c, is_training=False)[:5],
     [f32(2, 4, 4, 3), f32(3)],
     "([i, j, k, l], [l], [l], [l], [l])->([i, j, k, l], [l], [l], [l], [l], [])"
     " {i=2, j=4, k=4, l=3}"),
    ("FusedBatchNormGradV3", lambda dy, x, c: tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=c, reserve_space_1=c, reserve_space_2=c,
        reserve_space_3=tf.zeros(()), data_format="NCHW")[:3],
     [f32(2, 3, 4, 4), f32(2, 3, 4, 4), f32(3)],
     "([i, j, k, l], [i, j, k, l], [j], [j], [j], [])->([i, j, k, l], [j], [j], [1], [1])"
     " {i=2, j=3, k=4, l=4}"),
    *[(op, lambda x, c, op=op: getattr(tf.raw_ops, op)(
        x=x, scale=c, offset=c, mean=c, variance=c, is_training=False)[:5],
       [f32(2, 4, 4, 3), f32(3)],
       "([i, j, k, l], [l], [l], [l], [l])->([i, j, k, l], [l], [l], [l], [l])"
       " {i=2, j=4, k=4, l=3}") for op in ("FusedBatchNorm", "FusedBatchNormV2")],
    *[(op, lambda dy, x, c, op=op: getattr(tf.raw_ops, op)(
        y_backprop=dy, x=x, scale=c, reserve_space_1=c, reserve_space_2=c)[:3],
       [f32(2, 4, 4, 3), f32(2, 4, 4, 3), f32(3)],
       "([i, j, k, l], [i, j, k, l], [l], [l], [l])->([i, j, k, l], [l], [l], [1], [1])"
       " {i=2, j=4, k=4, l=3}") for op in ("FusedBatchNormGrad", "FusedBatchNormGradV2")],
    # stateless random ops: a source (the whole draw, then each device's slice)
    *[(op, lambda seed, op=op, extra=extra: getattr(tf.raw_ops, op)(
        shape=[4, 6], **({"seed": seed} if "V2" not in op else
                         {"key": tf.cast(seed[:1], tf.uint64),
                          "counter": tf.cast(tf.concat([seed, seed], 0), tf.uint64),
                          "alg": 1}), **extra),
       [i32(2)], f"({', '.join(['_'] * n)})->([i, j]) {{i=4, j=6}}")
      for op, extra, n in [
          ("StatelessRandomUniform", {"dtype": tf.float32}, 2),
          ("StatelessRandomNormal", {"dtype": tf.float32}, 2),
          ("StatelessTruncatedNormal", {"dtype": tf.float32}, 2),
          ("StatelessRandomUniformInt", {"minval": 0, "maxval": 5}, 4),
          ("StatelessRandomUniformFullInt", {"dtype": tf.int32}, 2),
          ("StatelessRandomUniformV2", {"dtype": tf.float32}, 4),
          ("StatelessRandomNormalV2", {"dtype": tf.float32}, 4),
          ("StatelessTruncatedNormalV2", {"dtype": tf.float32}, 4),
          ("StatelessRandomUniformIntV2", {"minval": 0, "maxval": 5}, 6),
          ("StatelessRandomUniformFullIntV2", {"dtype": tf.int32}, 4)]],
    *[(op, lambda d, s, op=op: getattr(tf.raw_ops, op)(data=d, segment_ids=s, num_segments=3),
       [f32(6, 4), i32(6)], f"([i, j], [i], _)->([k, j]) {{i=6, j=4, k=3}} reduction={{i}}"
       + ("" if reduce_op == "sum" else f" reduce={reduce_op}"))
      for op, reduce_op in [("UnsortedSegmentSum", "sum"), ("UnsortedSegmentMax", "max"),
                            ("UnsortedSegmentMin", "min"), ("UnsortedSegmentProd", "prod")]],
]


@pytest.mark.parametrize("op_type, fn, specs, expected", ROWS,
                         ids=[f"{row[0]}-{k}" for k, row in enumerate(ROWS)])
def test_rule_of_op(op_type, fn, specs, expected):
    assert printed_rule(op_type, fn, specs) == expected


def test_every_op_with_a_rule_has_a_row():
    assert sorted(set(ops_with_rules()) - {row[0] for row in ROWS}) == []


def test_printed_form_of_a_long_rule():
    """Factors past z are z_1, z_2... as in Shardy."""
    letters = "abcdefghijklmnopqrst"
    text = str(einsum_rule(f"{letters}->{letters}", [(2,) * 20], (2,) * 20))
    assert text.startswith("([i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z, z_1, z_2])")


@pytest.mark.parametrize("spec", [gt.P("a", "b"), gt.P(None, "b")])
def test_bitcast_to_another_width_partitions_exactly(spec):
    """Its rule once gave the added minor dim the factor of a major one (a crash)."""
    mesh = gt.Mesh.create((2, 4), ("a", "b"))
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)

    def f(t):
        narrow = tf.bitcast(t, tf.uint16)
        hinted = gt.mesh_split(narrow, mesh, gt.P(None, None, "b"))
        return tf.bitcast(t, tf.uint8), tf.bitcast(hinted, tf.float32)

    check_partitioned(f, (x,), mesh, (spec,))
