"""Handlers for ops that reduce inside: softmax, log-softmax, cross-entropy, arg-max.

When the reduced dim is split, each keeps a local partial (max, sum of exponentials,
(value, index) pair) that reshard() combines across the devices of that dim.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import Layout
from gspmd_tf.propagation import rules
from gspmd_tf.registry import NAN_ORDER, declare, on_floats, op_family
from gspmd_tf.spmd.handlers.basic import local_shapes, replay
from gspmd_tf.spmd.local_ops import (binary, cast, global_index, identity_of, mask_padding,
                                     reduce_last, select, shard_offset, unary)
from gspmd_tf.spmd.program import Local


def _combine(ctx, ref, dims, axes, reduce_op, dtype, shape):
    """All devices' `reduce_op` of a local partial (through reshard)."""
    partial = Local(ref, Layout(dims, axes, reduce_op), shape, dtype)
    return ctx.reshard(partial, Layout(dims)).ref


class _Rows:
    """Log-sum-exp pieces of logits whose last dim is split over `axes`."""

    def __init__(self, ctx, logits):
        b = self.b = ctx.b
        self.dtype = dtype = logits.dtype
        self.axes = logits.layout.dims[-1]
        self.logits = mask_padding(b, logits, [len(logits.shape) - 1], -np.inf)
        dims = logits.layout.dims[:-1] + ((),)
        shape = logits.shape[:-1] + (1,)
        self.keep = lambda ref, op: _combine(ctx, ref, dims, self.axes, op, dtype, shape)
        local_max = reduce_last(b, "Max", self.logits, dtype)
        self.max = self.keep(local_max, "max")
        self.shifted = binary(b, "Sub", self.logits, self.max, dtype)
        self.exp = unary(b, "Exp", self.shifted, dtype)
        self.sum = self.keep(reduce_last(b, "Sum", self.exp, dtype), "sum")
        self.log_sum = unary(b, "Log", self.sum, dtype)

    def softmax(self):
        """exp(x - max) / sum over the whole (split) row."""
        return binary(self.b, "RealDiv", self.exp, self.sum, self.dtype)

    def log_softmax(self):
        """x - max - log(sum of exponentials) over the whole (split) row."""
        return binary(self.b, "Sub", self.shifted, self.log_sum, self.dtype)


def _class_split(operands):
    return bool(operands[0].layout.dims[-1])


@op_family(["Softmax", "LogSoftmax"], rules.last_dim_normalizer)
def softmax(ctx, operands, layouts):
    """Softmax / LogSoftmax over a split last dim."""
    if not _class_split(operands):
        return replay(ctx, operands, layouts)
    rows = _Rows(ctx, operands[0])
    out = rows.softmax() if ctx.node.op == "Softmax" else rows.log_softmax()
    return [ctx.b.op("Identity", [out], local_shapes(ctx, layouts)[0], rows.dtype,
                     name=ctx.node.name, T=rows.dtype)]


declare("SparseSoftmaxCrossEntropyWithLogits", safe_padding={1: 0})  # labels (indices)


@op_family({"SparseSoftmaxCrossEntropyWithLogits": True,
            "SoftmaxCrossEntropyWithLogits": False}, rules.cross_entropy)
def cross_entropy(ctx, operands, layouts):
    """(Sparse)SoftmaxCrossEntropyWithLogits over split classes: loss and backprop."""
    if not _class_split(operands):
        return replay(ctx, operands, layouts)
    b = ctx.b
    logits, labels = operands[0], operands[1]
    rows = _Rows(ctx, logits)
    dtype = rows.dtype
    probs = rows.softmax()
    safe_logits = mask_padding(b, logits, [1], 0.0)
    if ctx.node.op == "SparseSoftmaxCrossEntropyWithLogits":
        classes = global_index(b, logits.ref, 1, rows.axes)
        label_col = b.op("ExpandDims", [labels.ref, b.const(np.int32(-1))],
                         b.shape_of(labels.ref) + (1,), labels.dtype, T=labels.dtype,
                         Tdim=tf.int32)
        if labels.dtype != tf.int32:
            label_col = cast(b, label_col, labels.dtype, tf.int32)
        hit = binary(b, "Equal", classes, label_col, tf.int32, tf.bool)
        target = cast(b, hit, tf.bool, dtype)
    else:
        target = mask_padding(b, labels, [1], 0.0)
    # loss = sum_c target * (log_sum_exp - logit) = sum_c target * (log_sum - (logit - max)),
    # in TF's order: max + log_sum would round log_sum away next to a huge max (logits
    # of 3.4e38 gave a loss of 0, not log(classes))
    shifted = binary(b, "Sub", safe_logits, rows.max, dtype)
    per_class = binary(b, "Sub", rows.log_sum, shifted, dtype)
    if ctx.node.op == "SparseSoftmaxCrossEntropyWithLogits":
        # like TF, take the label's term only: 0 * inf from a -inf logit must not be NaN
        per_class = select(b, hit, per_class, b.const(0, dtype), dtype)
    else:  # TF multiplies here, so a zero label on a -inf logit is NaN there too
        per_class = binary(b, "Mul", target, per_class, dtype)
    local_loss = reduce_last(b, "Sum", per_class, dtype, keep_dims=False)
    batch_dims = logits.layout.dims[:1]
    loss = _combine(ctx, local_loss, batch_dims, rows.axes, "sum", dtype, logits.shape[:1])
    backprop = binary(b, "Sub", probs, target, dtype)
    shapes = local_shapes(ctx, layouts)
    return [b.op("Identity", [loss], shapes[0], dtype, name=ctx.node.name, T=dtype),
            b.op("Identity", [backprop], shapes[1], dtype, T=dtype)]


@op_family(["ArgMax", "ArgMin"], rules.arg_reduction, xla_numerics=on_floats(NAN_ORDER))
def arg_reduce(ctx, operands, layouts):
    """ArgMax/ArgMin over a split dim, as TF's kernel on one device: the first index of
    the best value, NaN never a candidate, nor a value no better than the kernel's start
    (dtype.min for ArgMax, dtype.max for ArgMin); index 0 when nothing is a candidate.

    Each device takes its best candidate value and its global index; all devices agree on
    the best value, then on the smallest index that holds it. (Over a whole dim it is
    replayed; grappler's rewrite of ArgMax(Sign(x)) into ArgMax(x), seed 21 #165, does
    not run on the SPMD program: backends/tf_kernels.py call_attrs.)"""
    x = operands[0]
    axis, = ctx.rule.params.axes
    axes = x.layout.dims[axis]
    if not axes:
        return replay(ctx, operands, layouts)
    b = ctx.b
    node = ctx.node
    best = "max" if node.op == "ArgMax" else "min"
    dtype = x.dtype
    out_type = node.attr("output_type")
    values = mask_padding(b, x, [axis], identity_of(best, dtype))
    shape = local_shapes(ctx, layouts)[0]
    axis_ref = b.const(np.int32(axis))
    local_best = b.op(best.capitalize(), [_without_nan(b, values, best, dtype), axis_ref],
                      shape, dtype, T=dtype, Tidx=tf.int32, keep_dims=False)
    out_dims = layouts[0].dims
    out_shape = node.out_shapes[0]
    best_all = _combine(ctx, local_best, out_dims, axes, best, dtype, out_shape)
    index = b.op(node.op, [values, axis_ref], shape, out_type, T=dtype, Tidx=tf.int32,
                 output_type=out_type)
    start = shard_offset(b, axes, b.shape_of(values)[axis])
    if out_type != tf.int32:
        start = cast(b, start, tf.int32, out_type)
    index = binary(b, "AddV2", index, start, out_type)
    is_best = binary(b, "Equal", local_best, best_all, dtype, tf.bool)
    candidate = select(b, is_best, index, b.const(out_type.max, out_type), out_type)
    kernel_start = b.const(dtype.min if best == "max" else dtype.max, dtype)
    found = binary(b, "Greater" if best == "max" else "Less", best_all, kernel_start, dtype,
                   tf.bool)
    candidate = select(b, found, candidate, b.const(0, out_type), out_type)
    combined = _combine(ctx, candidate, out_dims, axes, "min", out_type, out_shape)
    return [Local(combined, Layout(out_dims), out_shape, out_type)]


def _without_nan(b, ref, best, dtype):
    """`ref` with NaN replaced by the identity of `best` (floats; others unchanged)."""
    if not dtype.is_floating:
        return ref
    is_nan = b.op("IsNan", [ref], b.shape_of(ref), tf.bool, T=dtype)
    return select(b, is_nan, b.const(identity_of(best, dtype), dtype), ref, dtype)
