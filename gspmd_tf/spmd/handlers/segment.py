"""UnsortedSegmentMax/Min of floats whose segment rows are split: TF's exact NaN order.

TF folds each segment's rows in order from dtype.min (max; dtype.max for min), keeping the
old value unless the new one is not smaller (so a NaN replaces it, and the next row
replaces a NaN). The result is thus order-dependent: it is the fold after the last NaN.
Each device folds its own block of rows, in order; the devices then agree on the last
device whose block holds a NaN, and combine its value with the blocks after it.
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import Layout
from gspmd_tf.spmd.handlers.basic import local_shapes, replay
from gspmd_tf.spmd.local_ops import binary, cast, mask_padding, select
from gspmd_tf.spmd.program import Local

log = logging.getLogger("gspmd_tf")


def segment_extremum(ctx, operands, layouts):
    """UnsortedSegmentMax/Min with split segment rows (data dims the ids index)."""
    data, ids = operands[0], operands[1]
    split = [d for d, fs in enumerate(ctx.rule.operands[1])
             if any(ctx.factor_axes[f] for f in fs)]
    if not split or not data.dtype.is_floating:
        return replay(ctx, operands, layouts)
    if len(split) > 1 or any(n != 1 for n in ids.shape[:split[0]]):
        return _with_whole_rows(ctx, operands, layouts)
    return _combine_blocks(ctx, operands, split[0], layouts[0])


def _with_whole_rows(ctx, operands, layouts):
    """Rows split in several dims are not one block per device: gather them first."""
    log.warning("gspmd_tf: op %s (%s) has its segment rows split in more than one dim; "
                "they are gathered first", ctx.node.name, ctx.node.op)
    rows = len(operands[1].shape)
    whole = [ctx.reshard(x, Layout(((),) * rows + x.layout.dims[rows:]))
             for x in operands[:2]]
    layout = Layout(layouts[0].dims)
    ref = replay(ctx, whole + list(operands[2:]), [layout],
                 refs=[x.ref for x in whole + list(operands[2:])])[0]
    return [Local(ref, layout, ctx.node.out_shapes[0], ctx.node.out_dtypes[0])]


def _combine_blocks(ctx, operands, dim, partial_layout):
    """The fold over all devices' blocks of rows (split along ids dim `dim`), see above."""
    b = ctx.b
    data, ids, num_segments = operands[0], operands[1], operands[2].ref
    dtype = data.dtype
    best = "max" if ctx.node.op == "UnsortedSegmentMax" else "min"
    worst = -np.inf if best == "max" else np.inf
    axes = ids.layout.dims[dim]
    shape = local_shapes(ctx, [partial_layout])[0]
    ids_ref = mask_padding(b, ids, [dim], -1)  # TF drops rows with a negative id
    folded = b.replay(ctx.node, [data.ref, ids_ref, num_segments], [shape], [dtype])[0]

    def per_segment_count(cond):
        return b.op("UnsortedSegmentSum", [cast(b, cond, tf.bool, tf.int32), ids_ref,
                                           num_segments], shape, tf.int32, T=tf.int32,
                    Tindices=ids.dtype, Tnumsegments=ctx.node.attr("Tnumsegments"))

    data_shape = b.shape_of(data.ref)
    rows = per_segment_count(b.const(np.ones(data_shape, bool)))
    has_rows = _positive(b, rows)
    has_nan = _positive(b, per_segment_count(
        b.op("IsNan", [data.ref], data_shape, tf.bool, T=dtype)))
    worst_rows = per_segment_count(binary(b, "Equal", data.ref, b.const(worst, dtype), dtype,
                                          tf.bool))
    only_worst = _and(b, has_rows, binary(b, "Equal", rows, worst_rows, tf.int32, tf.bool))
    # a NaN-free block folded on from a NaN gives its true extremum: +-inf, not the fold's
    # start, when all its rows are +-inf
    true_extremum = select(b, only_worst, b.const(worst, dtype), folded, dtype)

    device = b.shard_index(axes)
    last_nan = _over_devices(ctx, select(b, has_nan, device, b.const(-1, tf.int32), tf.int32),
                             partial_layout, axes, "max", tf.int32)
    no_nan = binary(b, "Less", last_nan, b.const(0, tf.int32), tf.int32, tf.bool)
    at_last_nan = binary(b, "Equal", device, last_nan, tf.int32, tf.bool)
    after = _and(b, binary(b, "Greater", device, last_nan, tf.int32, tf.bool), has_rows)
    counts = b.op("LogicalOr", [b.op("LogicalOr", [no_nan, at_last_nan], shape, tf.bool),
                                after], shape, tf.bool)
    value = select(b, no_nan, folded, true_extremum, dtype)
    real = _and(b, counts, b.op("LogicalNot", [b.op("IsNan", [value], shape, tf.bool,
                                                     T=dtype)], shape, tf.bool))
    combined = _over_devices(ctx, select(b, real, value, b.const(worst, dtype), dtype),
                             partial_layout, axes, best, dtype)
    any_real = _positive(b, _over_devices(ctx, cast(b, real, tf.bool, tf.int32),
                                          partial_layout, axes, "max", tf.int32))
    result = select(b, any_real, combined, b.const(np.nan, dtype), dtype)
    return [Local(result, Layout(partial_layout.dims), ctx.node.out_shapes[0], dtype)]


def _and(b, x, y):
    return b.op("LogicalAnd", [x, y], tuple(np.broadcast_shapes(b.shape_of(x),
                                                                 b.shape_of(y))), tf.bool)


def _positive(b, ref):
    return binary(b, "Greater", ref, b.const(0, tf.int32), tf.int32, tf.bool)


def _over_devices(ctx, ref, partial_layout, axes, reduce_op, dtype):
    """`reduce_op` of a local per-segment value over the devices of `axes`."""
    partial = Local(ref, Layout(partial_layout.dims, axes, reduce_op),
                    ctx.node.out_shapes[0], dtype)
    return ctx.reshard(partial, Layout(partial_layout.dims)).ref


SEGMENT_HANDLERS = {
    "UnsortedSegmentMax": segment_extremum,
    "UnsortedSegmentMin": segment_extremum,
}
