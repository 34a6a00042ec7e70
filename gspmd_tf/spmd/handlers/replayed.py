"""Op families emitted by replaying the TF op on local shards, and ops without a rule.

Replaying (handlers.basic.replay: the TF op re-created from its attrs on the local
operands, padding of split reduced dims masked) is exact for an op when its local result
depends only on the local operands and nothing in it names a global size. Each family
below says why that holds for it. Families whose local op differs are declared beside
their handlers (basic.py, gather.py, grads.py, normalize.py, segment.py, conv.py,
linalg.py, py_functions.py).
"""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf.propagation import rules
from gspmd_tf.propagation.rules import batched
from gspmd_tf.registry import (ASSIGNS_VARIABLE, FOLD_SHAPE, FOLD_VALUES, INTEGER_DIVISION,
                               NAN_ORDER, PRINTS, READS_VARIABLE, VALUE_SHAPED, VIEW,
                               ZERO_GRADIENT, declare, on_floats, on_integers, read_result_bytes)

UNARY = """Abs Acos Acosh Asin Asinh Atan Atanh Ceil Cos Cosh Digamma Elu Erf Erfc Exp Expm1
Floor Identity Inv IsFinite IsInf IsNan Lgamma Log Log1p LogicalNot Neg OnesLike Reciprocal
Relu Relu6 Rint Round Rsqrt Selu Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Square Tan
Tanh ZerosLike Cast StopGradient PreventGradient Snapshot CheckNumerics CheckNumericsV2
LeakyRelu""".split()

BINARY = """Add AddV2 Sub Mul Div DivNoNan RealDiv FloorDiv FloorMod TruncateDiv TruncateMod
Maximum Minimum Pow SquaredDifference Equal NotEqual Less LessEqual Greater GreaterEqual
LogicalAnd LogicalOr Atan2 Xdivy Xlogy Xlog1py MulNoNan BitwiseAnd BitwiseOr BitwiseXor
LeftShift RightShift
ReluGrad Relu6Grad TanhGrad SigmoidGrad SoftplusGrad RsqrtGrad SqrtGrad EluGrad
SeluGrad LeakyReluGrad ReciprocalGrad""".split()

# special functions, bit and complex ops (a complex number's parts, angle, conjugate),
# an elementwise comparison within a tolerance, fake quantization by constant bounds
# (and its gradient) or by bounds given as inputs (scalars, or per channel: the last
# dim, broadcast from the right as any operand), string ops of each element
# (ShardedFilename: of scalars or elementwise). Dawsn is left without a rule: the tests
# of gt.register_op register it as a user would an op gspmd-tf does not know.
SPECIAL = """BesselI0e BesselI1e Ndtri Erfinv Invert PopulationCount ComplexAbs Igamma
Igammac IgammaGradA Polygamma Zeta NextAfter Mod Complex Betainc BesselI0 BesselI1 BesselJ0
BesselJ1 BesselK0 BesselK0e BesselK1 BesselK1e BesselY0 BesselY1 Expint FresnelCos
FresnelSin Spence InvGrad ApproximateEqual DebugGradientIdentity FakeQuantWithMinMaxArgs
FakeQuantWithMinMaxArgsGradient Angle Conj Real Imag FakeQuantWithMinMaxVars
FakeQuantWithMinMaxVarsPerChannel""".split()
STRINGS = """AsString StringLength StringToHashBucketFast StringToHashBucket
StringToHashBucketStrong StringToNumber EncodeBase64 DecodeBase64 RegexReplace
StaticRegexReplace StringJoin StringLower StringUpper StringStrip
ShardedFilename""".split()

VARIABLE_OPS = """ReadVariableOp AssignVariableOp AssignAddVariableOp AssignSubVariableOp
ResourceApplyGradientDescent ResourceApplyMomentum ResourceApplyKerasMomentum
ResourceApplyAdam ResourceApplyAdamWithAmsgrad ResourceApplyAdagrad ResourceApplyAdagradV2
ResourceApplyRMSProp ResourceApplyCenteredRMSProp ResourceApplyAdadelta ResourceApplyAdaMax
ResourceApplyFtrl ResourceApplyFtrlV2 ResourceApplyProximalGradientDescent
ResourceApplyProximalAdagrad ResourceApplyAddSign ResourceApplyPowerSign""".split()

# elementwise (broadcasting from the right): each element of the result reads the same
# element of every operand
declare(UNARY + BINARY + SPECIAL + STRINGS + ["AddN", "SelectV2", "ClipByValue"],
        rules.elementwise, replay=True)
declare("Select", rules.select_v1, replay=True)
declare("Bitcast", rules.bitcast, replay=True)  # the changed minor dim stays whole

# contractions and reductions: a split contracted or reduced dim gives a partial result
# the partitioner combines (its padding masked to the reduction's identity first)
declare("BiasAddGrad", rules.bias_add_grad, replay=True)
declare({"Max": "max", "Min": "min", "All": "min",
         "Any": "max"}, rules.reduction, replay=True)
declare("L2Loss", batched.sum_of_everything, replay=True)  # sum(x ** 2) / 2

# data movement whose moved dims stay whole: the local op moves the local block
declare(["Transpose", "ConjugateTranspose"], rules.transpose, replay=True)
# reversed dims whole (a device's block reversed in place is another device's block)
declare(["ReverseV2", "Reverse"], batched.reverse, replay=True)
declare("ExpandDims", rules.squeeze_or_expand, replay=True)  # inserts a size-1 dim by index
declare("ConcatV2", rules.concat, replay=True)
declare("Concat", batched.concat_v1, replay=True)
# a slice updated in place: the dims it takes whole pass (each device updates its block)
declare("TensorStridedSliceUpdate", batched.strided_slice_update, replay=True)
declare({"Split": (1, 0), "SplitV": (0, 2)}, rules.split, replay=True)  # (value, axis)
declare("Pack", rules.pack, replay=True)
declare("Unpack", rules.unpack, replay=True)

# ops along their last dims or one axis, which stay whole: each device runs the op on its
# block of the other (batch) dims
declare({"MatrixBandPart": 2, "TopKV2": 1}, rules.last_dims_whole, replay=True)
declare(["Cumsum", "Cumprod"], rules.cumulative, replay=True)
declare("InTopKV2", batched.in_top_k, replay=True, safe_padding={1: 0})  # targets
# transforms over the last 1-3 dims; image ops mixing height and width, or channels;
# pooling's second derivative (its windows whole)
declare({op + suffix: int(suffix[:1] or 1) for op in ("FFT", "IFFT", "RFFT", "IRFFT")
         for suffix in ("", "2D", "3D")}, batched.transform, replay=True)
declare(["ResizeBicubic", "AdjustContrastv2"], batched.images_spatial_whole, replay=True)
declare(["AdjustSaturation", "AdjustHue", "HSVToRGB", "RGBToHSV", "LRN"],
        batched.channels_whole, replay=True)  # LRN: a window over each pixel's channels
declare({"Cross": ((0, 1),)}, batched.channels_whole, replay=True)  # 3-vectors whole
# each image (or volume) of the batch whole: blocks moved between space and depth,
# patches of windows
declare(["SpaceToDepth", "DepthToSpace", "ExtractImagePatches", "ExtractVolumePatches"],
        batched.batch_only, replay=True)
declare(["MaxPoolGradGrad", "MaxPool3DGradGrad"], batched.pool_grad_grad,
        replay=True)
# ops that need every input whole: a rule keeps their inputs' producers from being split
# for nothing, and the op is not reported as lacking one
declare(["StringFormat", "InvertPermutation", "RngReadAndSkip"],
        batched.all_whole, replay=True)
# tf.print: the whole value, printed once per call (PRINTS: backends/replicas.py), not
# once per device
declare(["PrintV2", "Print"], batched.all_whole, replay=True, traits=[PRINTS])
# updates that overwrite: every device applies all of them (index batch dims whole) to
# its block of the trailing dims
declare({op: (1, rules.REPLICATE) for op in ("TensorScatterUpdate", "TensorScatterMax",
                                              "TensorScatterMin")},
        rules.scatter_nd, replay=True)  # (max and min: in any order)

# a variable's rows updated in place (by add, max, overwrite...): every device applies
# all updates to its block of the trailing dims (the indexed dims stay whole)
declare({**{"ResourceScatter" + op: False for op in ("Add", "Sub", "Mul", "Div", "Min",
                                                    "Max", "Update")},
         "ResourceScatterNdAdd": True, "ResourceScatterNdUpdate": True},
        rules.resource_scatter, replay=True)
# variables: reads, assignments and fused optimizer updates are elementwise on the shard
declare(VARIABLE_OPS + ["DisableCopyOnRead"], rules.variable_update, replay=True)
declare(["ReadVariableOp", "VariableShape"], traits=[READS_VARIABLE])
declare(["AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"],
        traits=[ASSIGNS_VARIABLE])

# inputs the op checks (an integer divisor or exponent, a value checked for NaN/Inf):
# their padding (the tail of an uneven split dim, arbitrary values) could make the local
# op fail where the global one does not, so it is set to a harmless value first
declare(["Div", "FloorDiv", "FloorMod", "TruncateDiv", "TruncateMod", "Mod"],
        safe_padding={1: 1})
declare("Pow", safe_padding={1: 0})
declare(["CheckNumerics", "CheckNumericsV2"], safe_padding={0: 0})
declare("StringToNumber", safe_padding={0: "0"})  # padding strings need not be numbers

# where XLA's kernels define other values than TF's (a backend compiling with XLA runs
# these on TF's kernels): NaN against numbers in max and min; gradients of a zero or NaN
# upstream gradient (tests/test_fuzz_xla_backend.py); an integer divided by zero
declare(["Max", "Min", "Maximum", "Minimum"], xla_numerics=on_floats(NAN_ORDER))
# XLA:CPU's Relu6 of a one-element tensor gives 0 for NaN (longer ones NaN, as TF): a
# shard of one element differs where the whole tensor on one device does not (fuzz
# seed 64 #50 under --backend=auto)
declare("Relu6", xla_numerics=on_floats(NAN_ORDER))
# Each with an xla_form: TF's CPU kernel written as TF ops whose XLA values are the
# kernel's (up to the sign of a zero), so the XLA backend compiles them instead of
# cutting its segments there (the LM's backward step was cut into 11 segments at its
# RsqrtGrad and ReluGrad ops).
declare(["SqrtGrad", "RsqrtGrad", "ReciprocalGrad"], xla_numerics=on_floats(ZERO_GRADIENT),
        xla_form=lambda node, inputs: _zero_where_no_gradient(node, *inputs))
declare("EluGrad", xla_numerics=on_floats(ZERO_GRADIENT),
        xla_form=lambda node, inputs: _elu_grad(*inputs, 1.0, 1.0))
# SELU's scale and scale * alpha as TF's kernel rounds them (relu_op_functor.h)
declare("SeluGrad", xla_numerics=on_floats(ZERO_GRADIENT),
        xla_form=lambda node, inputs: _elu_grad(*inputs, 1.0507009873554804934193349852946,
                                                1.7580993408473768599402175208123))
declare("ReluGrad", xla_numerics=on_floats(ZERO_GRADIENT),
        xla_form=lambda node, inputs: _masked_gradient(*inputs, None))
declare("Relu6Grad", xla_numerics=on_floats(ZERO_GRADIENT),
        xla_form=lambda node, inputs: _masked_gradient(*inputs, 6.0))

declare(["Div", "FloorDiv", "TruncateDiv", "FloorMod", "TruncateMod", "Mod"],
        xla_numerics=on_integers(INTEGER_DIVISION))

# ---------------------------------------------------------------- flags of ops in general
# ops whose result is their first operand's value (VIEW: no data moves, so the cost model
# counts no bytes and a backend need not run one whose local shape is its operand's);
# slices and gathers copy only what they keep (others: every operand and result once)
declare(["Reshape", "Identity", "Squeeze", "ExpandDims", "StopGradient", "PreventGradient",
         "Snapshot", "EnsureShape", "IdentityN"], traits=[VIEW])
declare(["Slice", "StridedSlice", "GatherV2", "GatherNd", "ResourceGather", "ResourceGatherNd",
         "Split", "SplitV", "Unpack"], bytes_touched=read_result_bytes)
# shape ops graph.fold turns into constants from their inputs' static shapes
# (VariableShape: of the variable behind the handle, see fold._variable_shape)
declare(["Shape", "ShapeN", "Size", "Rank", "VariableShape"], fold=FOLD_SHAPE)
# pure ops (no state, no randomness, value-determined results) graph.fold evaluates when
# every input is a constant
declare("""Pack Unpack ConcatV2 Concat ConcatOffset StridedSlice Slice Cast Bitcast
Add AddV2 Sub Mul Div RealDiv FloorDiv FloorMod TruncateDiv TruncateMod Maximum Minimum
Neg Abs Sign Square Range Reshape Prod Sum Max Min Mean All Any
Fill GatherV2 Gather GatherNd DynamicStitch Identity Snapshot StopGradient
ExpandDims Squeeze Transpose ReverseV2 Equal NotEqual Less LessEqual Greater GreaterEqual
LogicalAnd LogicalOr LogicalNot Select SelectV2 ZerosLike OnesLike Tile BroadcastTo
InvertPermutation BroadcastArgs BroadcastGradientArgs Cumsum Cumprod ListDiff Where
PlaceholderWithDefault
""".split(), fold=FOLD_VALUES)
# output shapes that depend on input VALUES: TF's shape inference may leave them unknown;
# the importer defers them (and their unknown-shaped consumers) to graph.fold (a
# Reshape's too, declared beside its emitter). Where: TF's gradient of a ConcatV2 that
# receives a sparse gradient (from a GatherV2) picks each input's rows with a Where.
declare(["BroadcastGradientArgs", "DynamicStitch", "ListDiff", "Where"],
        traits=[VALUE_SHAPED])
# naturally whole (scalars, shapes): no warning when they run replicated
declare(["Shape", "Size", "Rank", "NoOp", "Range"], silent_replicated=True)
# a random op's key and counter from its seed (a few scalars); a random crop box (begin
# and size vectors, one box)
declare(["StatelessRandomGetKeyCounter", "StatelessRandomGetAlg",
         "StatelessRandomGetKeyCounterAlg", "StatelessSampleDistortedBoundingBox"],
        silent_replicated=True)


def _zero_where_no_gradient(node, y, dy):
    """Sqrt/Rsqrt/ReciprocalGrad as TF's kernels: 0 where dy is 0, whatever y."""
    op = getattr(tf.raw_ops, node.op)(y=y, dy=dy)
    return tf.where(tf.equal(dy, 0), tf.zeros_like(op), op)


def _elu_grad(gradients, outputs, scale, scale_alpha):
    """Elu/SeluGrad as TF's kernels: outputs < 0 selects gradients * (outputs +
    scale_alpha), else gradients * scale (ELU: both 1)."""
    dtype = gradients.dtype
    negative = gradients * (outputs + tf.constant(scale_alpha, dtype))
    positive = gradients if scale == 1 else gradients * tf.constant(scale, dtype)
    return tf.where(outputs < tf.constant(0, dtype), negative, positive)


def _masked_gradient(gradients, features, upper):
    """Relu/Relu6Grad as TF's kernels: gradients times (features > 0 [and < upper]) as
    a number, so a masked NaN or Inf gradient is NaN (0 * Inf), not 0 (a masked finite
    one +0, where TF's product may give -0). Written as selects: XLA turns a product
    with a converted mask into a select of 0."""
    dtype = gradients.dtype
    mask = features > tf.constant(0, dtype)
    if upper is not None:
        mask = tf.logical_and(mask, features < tf.constant(upper, dtype))
    masked = tf.where(tf.math.is_finite(gradients), tf.zeros_like(gradients),
                      tf.fill(tf.shape(gradients), tf.constant(float("nan"), dtype)))
    return tf.where(mask, gradients, masked)
