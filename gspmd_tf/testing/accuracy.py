"""The fuzzer's comparison rules: when a partitioned value equals single-device TF's.

Exact for integers, bools and the positions of NaN/Inf; for floats a relative error
bound per dtype (TOLERANCE), or else "as accurate as single-device TF": no further from
the float64 program's value than TF is, up to the tolerance relative to the magnitude
of the terms the value sums (summed_magnitude). check_output also compares every
device's shard and the requested out_sharding.
"""

from __future__ import annotations

import numpy as np

from gspmd_tf.layout import Layout
from gspmd_tf.mesh import PartitionSpec
from gspmd_tf.runtime.sharded_tensor import shard_bounds

# Relative error bound (norm of the error over norm of the value, finite entries) per
# dtype: float32 as the test suite; half types only as loose as their precision forces.
TOLERANCE = {"float32": 1e-5, "float64": 1e-10, "float16": 5e-3, "bfloat16": 4e-2}


class Mismatch(Exception):
    """A partitioned value that differs from single-device TF."""


def check_values(got, want, what, precision, scale=None, exact=None, terms=None):
    """Raise Mismatch unless `got` equals `want` (NaN/Inf positions exactly, finite
    floats within the relative error of `precision`, the least precise float type the
    value was computed in, or else no further from `exact` than `want` is, up to the
    tolerance relative to `terms`, see as_accurate; everything else exactly)."""
    if got.shape != want.shape:
        raise Mismatch(f"{what}: shape {got.shape} != {want.shape}")
    name = str(want.dtype)
    if name not in TOLERANCE or precision is None:
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)
            raise Mismatch(f"{what}: {len(bad)} of {want.size} values differ, first at "
                           f"{tuple(bad[0])}: {got[tuple(bad[0])]} != {want[tuple(bad[0])]}")
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    kind_g, kind_w = value_kinds(g), value_kinds(w)
    # Where TF's value is of another kind than the float64 program's non-finite one (TF
    # overflowed to NaN, say, where the float64 program gives -Inf: seed 21 #8884), ours
    # may be of the float64 program's kind; where both are non-finite of different
    # kinds, the kind is an accident of summation order (seed 20 #4063: TF's float32
    # einsum gives -Inf, the same sum in reverse order +Inf, the float64 program +Inf,
    # the float32 values summed in float64 7.5e37) and any non-finite value of ours is.
    # Where the magnitudes of the terms a value sums overflow the float64 program too
    # (`terms` non-finite), no float64 order decides the kind either: a float64 matmul
    # of unsorted_segment_min's fill value (the float64 maximum) gives TF +Inf and a
    # split contraction +Inf + -Inf = NaN (seed 35 #7919); where TF's value is
    # non-finite there, any non-finite value of ours is as good.
    # Where TF's value is non-finite and the float64 program's finite, TF overflowed in
    # its order of operations, and ours may be finite within the tolerance of the float64
    # value (seed 80 #401: a float16 product of 72 exp values, TF +Inf, the float64
    # program and ours, multiplied in float64 and rounded once, 8.3e-7).
    closer = False
    if exact is not None:
        kind_e = value_kinds(exact)
        disputed = (kind_w != kind_e) & (kind_e != 0)
        closer = disputed & ((kind_g == kind_e) | ((kind_w != 0) & (kind_g != 0)))
        e = np.where(kind_e == 0, np.asarray(exact, np.float64), 0.0)
        near = np.abs(np.where(kind_g == 0, g, 0.0) - e) <= TOLERANCE[precision] * np.abs(e)
        closer = closer | ((kind_w != 0) & (kind_e == 0) & (kind_g == 0) & near)
    if terms is not None:
        overflowing = ~np.isfinite(np.asarray(terms, np.float64))
        closer = closer | (overflowing & (kind_w != 0) & (kind_g != 0))
    if not np.all((kind_g == kind_w) | closer):
        where = tuple(np.argwhere((kind_g != kind_w) & ~closer)[0])
        label = KIND_NAMES[max(kind_g[where], kind_w[where])]
        raise Mismatch(f"{what}: {label} positions differ, e.g. at {where}: "
                       f"{g[where]} vs {w[where]}")
    finite = (kind_g == 0) & (kind_w == 0)
    if scale is None:
        scale = np.linalg.norm(w[finite])
    err = np.linalg.norm(g[finite] - w[finite]) / max(scale, 1e-30)
    if err > TOLERANCE[precision] and not as_accurate(g, w, exact, finite, precision,
                                                      terms):
        where = np.unravel_index(np.argmax(np.where(finite, np.abs(g - w), -1)), w.shape)
        raise Mismatch(f"{what}: relative error {err:.2e} > {TOLERANCE[precision]} "
                       f"(e.g. at {tuple(int(i) for i in where)}: {g[where]} vs {w[where]})")


KIND_NAMES = ("finite", "NaN", "+Inf", "-Inf")


def value_kinds(values):
    """Per element: 0 finite, 1 NaN, 2 +Inf, 3 -Inf (the indices of KIND_NAMES)."""
    values = np.asarray(values, np.float64)
    return np.select([np.isnan(values), np.isposinf(values), np.isneginf(values)],
                     [1, 2, 3], 0)


def as_accurate(got, want, exact, finite, precision, terms=None):
    """Whether `got` is no further from `exact` (the same program with every float32,
    float16 and bfloat16 made float64) than single-device TF's `want` is, up to the
    tolerance relative to `terms` (the magnitude of the terms each exact value sums, see
    summed_magnitude; |exact| when not given): then the difference from TF is rounding
    error (a float32 sum of terms that cancel is off by up to n*eps*sum|x| in any order,
    which can be far more than eps*|sum x|: seed 24 #1489, the gradient of a shift
    before a softmax, 0 in real arithmetic, sum|x| 0.335, TF 5.2e-8, gspmd-tf 9.3e-8;
    TF sums float16 sequentially in float16, seed 21 #5883: 0.4011, the float64 program
    0.4080, gspmd-tf's partial sums 0.4062)."""
    if exact is None:
        return False
    e = exact.astype(np.float64)
    # where ours and TF's are finite the float64 program must be; it may be finite where
    # both overflowed float32 alike (seed 29 #8498: exp of values past 88)
    if not np.all(np.isfinite(e)[finite]):
        return False
    scale = np.abs(e) if terms is None else np.asarray(terms, np.float64)
    return (np.linalg.norm(got[finite] - e[finite])
            <= np.linalg.norm(want[finite] - e[finite])
            + TOLERANCE[precision] * np.linalg.norm(scale[finite]))


# Ops each of whose results is one value of their first input, moved, selected or
# re-typed: the same op on that input's term magnitudes gives the result's.
_MOVING = frozenset({"Identity", "Reshape", "Squeeze", "ExpandDims", "Cast", "Slice",
                     "StridedSlice", "GatherV2", "Transpose", "Roll", "Tile", "ReverseV2",
                     "BroadcastTo", "XlaSharding"})
# Ops that scale their operand by a constant: the magnitude scales alike.
_SCALING = frozenset({"Mul", "RealDiv"})
# Ops each of whose results is a sum of products of input values with constant
# non-negative coefficients: the same op on the inputs' magnitudes gives the magnitude
# of the terms it sums. A difference is a sum of the magnitudes.
_SUMMING = frozenset({
    "Sum", "Mean", "AddN", "AddV2", "BiasAdd", "BiasAddGrad", "MatMul", "BatchMatMulV2",
    "BatchMatMulV3", "Einsum", "Conv2D", "Conv3D", "Conv2DBackpropFilter",
    "Conv2DBackpropInput", "Conv3DBackpropFilterV2", "Conv3DBackpropInputV2",
    "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropFilter",
    "DepthwiseConv2dNativeBackpropInput", "UnsortedSegmentSum", "SegmentSum", "Cumsum"})


_CROSS_ENTROPY = frozenset({"SoftmaxCrossEntropyWithLogits",
                            "SparseSoftmaxCrossEntropyWithLogits"})


def cross_entropy_magnitude(tf, op):
    """A bound of the terms a cross-entropy loss sums, per example: sum_j labels_j *
    (logsumexp(logits) - logits_j) cancels terms up to sum_j |labels_j| * (|logsumexp| +
    max_j |logits_j|) (a sparse label weighs one class); a partitioned class dim sums
    them in another order (seed 37 #3936: soft labels, float32, 1.7e-5 relative off TF
    by a cancellation)."""
    logits, labels = op.inputs[0], op.inputs[1]
    lse = tf.abs(tf.reduce_logsumexp(logits, axis=-1))
    bound = lse + tf.reduce_max(tf.abs(logits), axis=-1)
    if op.type == "SparseSoftmaxCrossEntropyWithLogits":
        return bound
    return tf.reduce_sum(tf.abs(labels), axis=-1) * bound


def summed_magnitude(tf, tensor):
    """The magnitude of the terms that graph tensor `tensor` (traced in a tf.function, in
    float64) sums at its last summing op, carried through the ops after it that move,
    select or re-type values (_MOVING) or scale them by a constant (_SCALING, seed 36
    #4500: a slice of a loop's half of a cross-entropy): that op re-created on the
    absolute values of its floating inputs (a Sub as an AddV2); |tensor| where that op
    sums nothing (see _SUMMING). A float32 sum of those terms in any order is off by up
    to n*eps times this, however small the sum itself is.
    An Exp's result is |exp(x)| * max(1, |x|): a relative rounding error r of x (a sum's
    partial sums in another order) changes exp(x) by a relative x*r (seed 29 #8498,
    exp of about 79: TF 1.24e-5 and gspmd-tf 2.76e-5 off the float64 program, 1.3 and 3
    units of float32 rounding of the argument)."""
    if not tensor.dtype.is_floating:
        return tensor
    op = tensor.op
    if op.type in _MOVING and op.inputs[0].dtype.is_floating:
        inner = summed_magnitude(tf, op.inputs[0])
        if op.type == "Cast":
            return tf.cast(inner, tensor.dtype)
        attrs = {k: v for k, v in op.node_def.attr.items() if not k.startswith("_")}
        return op.graph.create_op(op.type, [inner] + list(op.inputs[1:]),
                                  [tensor.dtype], attrs=attrs).outputs[0]
    constant = [k for k, t in enumerate(op.inputs) if t.op.type == "Const"]
    if op.type in _SCALING and len(op.inputs) == 2 and constant and (
            op.type == "Mul" or constant == [1]):
        other = summed_magnitude(tf, op.inputs[1 - constant[0]])
        scale = tf.abs(op.inputs[constant[0]])
        return tf.broadcast_to(other * scale if op.type == "Mul" else other / scale,
                               tf.shape(tensor))
    if op.type == "Exp":
        scale = tf.maximum(tf.abs(op.inputs[0]), tf.ones_like(op.inputs[0]))
        return tf.abs(tensor) * scale
    if op.type in _CROSS_ENTROPY and tensor.value_index == 0:
        return tf.cast(cross_entropy_magnitude(tf, op), tensor.dtype)
    if (op.type in _SUMMING or op.type == "Sub") and len(op.outputs) == 1:
        inputs = [term_magnitude(tf, t) if t.dtype.is_floating else t for t in op.inputs]
        attrs = {k: v for k, v in op.node_def.attr.items() if not k.startswith("_")}
        return op.graph.create_op("AddV2" if op.type == "Sub" else op.type, inputs,
                                  [tensor.dtype], attrs=attrs).outputs[0]
    return tf.abs(tensor)


def term_magnitude(tf, tensor):
    """The magnitude a summed term `tensor` carries: |tensor|, but for a softmax's
    gradient, (grad - sum(grad * softmax)) * softmax (TF's _SoftmaxGrad, maybe negated),
    the magnitude of what it cancels, (|grad| + sum|grad * softmax|) * softmax: the sum
    over the softmax axis is off by up to n*eps times that in any order, and a split
    softmax axis sums it in another order. Its terms cancel to 0 in real arithmetic where
    the input broadcast over the softmax axis (seed 7 #13: the gradient of
    softmax(x1 - x0), x1 of one column: TF 4.7e-9, gspmd-tf -1.1e-7, sum|grad * softmax|
    about 1)."""
    op = tensor.op
    if op.type == "Neg":
        return term_magnitude(tf, op.inputs[0])
    if op.type == "Mul" and len(op.inputs) == 2:
        for k in (0, 1):
            difference, softmax = op.inputs[k], op.inputs[1 - k]
            if softmax.op.type == "Softmax" and difference.op.type == "Sub":
                grad = difference.op.inputs[0]
                cancelled = tf.reduce_sum(tf.abs(grad * softmax), -1, keepdims=True)
                return (tf.abs(grad) + cancelled) * softmax
    return tf.abs(tensor)


def unrolling_while_loops(tf):
    """A stand-in for the tf module whose while_loop runs the body as straight-line code
    when its counter starts from a constant and the condition depends on the counter
    alone (the fuzzer's loops: `i_ < trips`), so that summed_magnitude sees through the
    loop; any other loop stays a tf.while_loop."""
    def while_loop(cond, body, loop_vars, **kwargs):
        start = tf.get_static_value(loop_vars[0])
        values = (int(start),) + tuple(loop_vars[1:]) if start is not None else None
        while values is not None:
            go = cond(*values)
            if not isinstance(go, (bool, np.bool_)):
                break
            if not go:
                return values
            values = tuple(body(*values))
        return tf.while_loop(cond, body, loop_vars, **kwargs)

    class Module:  # pylint: disable=too-few-public-methods
        def __getattr__(self, name):
            return while_loop if name == "while_loop" else getattr(tf, name)
    return Module()


def check_output(got, want, spec, mesh, what, precision, exact=None, terms=None):
    """Compare one ShardedTensor with the single-device value: the assembled value,
    every device's shard (replicas must agree) and the requested out_sharding."""
    want = np.asarray(want)
    if tuple(got.shape) != want.shape or got.dtype.as_numpy_dtype != want.dtype:
        raise Mismatch(f"{what}: {got.shape} {got.dtype.name} != {want.shape} "
                       f"{want.dtype}")
    check_values(got.numpy(), want, what, precision, exact=exact, terms=terms)
    finite = want[np.isfinite(want)] if want.dtype.kind == "f" or str(want.dtype) in \
        TOLERANCE else None
    scale = None if finite is None else np.linalg.norm(finite.astype(np.float64))
    local = got.layout.local_shape(mesh, want.shape)
    for device, shard in enumerate(got.shards):
        value = np.asarray(shard.numpy())
        if value.shape != local:
            raise Mismatch(f"{what}: device {device} holds shape {value.shape}, "
                           f"expected {local}")
        bounds = shard_bounds(mesh, got.layout, want.shape, device)
        valid = value[tuple(slice(0, b - a) for a, b in bounds)]
        box = tuple(slice(a, b) for a, b in bounds)
        check_values(valid, want[box], f"{what} on device {device}", precision, scale,
                     None if exact is None else np.asarray(exact)[box],
                     None if terms is None else np.asarray(terms)[box])
    if spec is not None:
        expected = Layout.from_spec(mesh, PartitionSpec(*spec), want.ndim)
        if got.layout.dims != expected.dims:
            raise Mismatch(f"{what}: sharding {got.layout} but out_shardings asked "
                           f"for {expected}")
