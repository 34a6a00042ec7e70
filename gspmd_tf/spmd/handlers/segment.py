"""UnsortedSegmentSum/Max/Min/Prod: segments split by block, rows split exactly.

Split segment rows (the data dims the ids index, REDUCE factors) give a partial result
the devices combine; a split result segment dim keeps, on each device, the segments of
its block.

Max and Min of floats need more than a max/min of the partial results. TF folds each
segment's rows in order from dtype.min (for max; dtype.max for min), keeping the old value
unless the new one is not smaller: a NaN replaces it, and the next row replaces a NaN. The
result is the fold of the rows after the last NaN (NaN when that is the last row), so it
depends on the order. Each device folds its own block of rows in order; the devices then
agree on the last block that holds a NaN and fold its value with the blocks after it.
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import Layout
from gspmd_tf.propagation import rules
from gspmd_tf.propagation.rules import REDUCE
from gspmd_tf.registry import NAN_ORDER, declare, on_floats, op_family
from gspmd_tf.spmd.handlers.basic import local_shapes, masked_refs, replay
from gspmd_tf.spmd.local_ops import binary, cast, mask_padding, select, shard_offset
from gspmd_tf.spmd.program import Local

log = logging.getLogger("gspmd_tf")


# segment extrema order NaN (as reductions do; the sorted ones run replicated)
declare(["UnsortedSegmentMax", "UnsortedSegmentMin", "SegmentMax", "SegmentMin",
         "SegmentMaxV2", "SegmentMinV2"], xla_numerics=on_floats(NAN_ORDER))


@op_family({"UnsortedSegmentSum": "sum", "UnsortedSegmentMax": "max",
            "UnsortedSegmentMin": "min", "UnsortedSegmentProd": "prod"},
           rules.unsorted_segment)
def unsorted_segment(ctx, operands, layouts):
    """UnsortedSegment{Sum,Max,Min,Prod} on local rows and segments (see above)."""
    rows_split = _split_row_dims(ctx)
    order_matters = (ctx.node.op in ("UnsortedSegmentMax", "UnsortedSegmentMin")
                     and operands[0].dtype.is_floating and rows_split)
    if order_matters and (len(rows_split) > 1
                          or any(n != 1 for n in operands[1].shape[:rows_split[0]])):
        return _with_whole_rows(ctx, operands, layouts)
    refs = masked_refs(ctx, operands)  # data padding -> the reduction's identity
    refs[1:3] = _local_ids(ctx, operands[1], rows_split, layouts[0])
    if order_matters:
        return _fold_blocks(ctx, operands, refs, rows_split[0], layouts[0])
    return replay(ctx, operands, layouts, refs=refs)


def _split_row_dims(ctx):
    """The ids dims whose (REDUCE) factors are split."""
    rule = ctx.rule
    return [d for d, fs in enumerate(rule.operands[1])
            if any(rule.factor_kinds[f] == REDUCE and ctx.factor_axes[f] for f in fs)]


def _local_ids(ctx, ids, rows_split, layout):
    """[ids, num_segments] for this device: padding rows, and (when the result's segment
    dim is split) rows of segments outside this device's block, get id -1, which TF drops;
    the others are shifted to the block's start."""
    b = ctx.b
    itype = ids.dtype
    np_itype = itype.as_numpy_dtype
    id_ref = mask_padding(b, ids, rows_split, np_itype(-1)) if rows_split else ids.ref
    axes = layout.dims[0]
    num = ctx.local_shape(layout)[0]
    if axes:
        offset = shard_offset(b, axes, num)
        if itype != tf.int32:
            offset = cast(b, offset, tf.int32, itype)
        shifted = binary(b, "Sub", id_ref, offset, itype)
        inside = _and(b, binary(b, "GreaterEqual", shifted, b.const(0, itype), itype, tf.bool),
                      binary(b, "Less", shifted, b.const(num, itype), itype, tf.bool))
        id_ref = select(b, inside, shifted, b.const(-1, itype), itype)
    return [id_ref, b.const(num, ctx.node.attr("Tnumsegments"))]


def _with_whole_rows(ctx, operands, layouts):
    """Rows split in several dims are not one block per device: gather them first."""
    log.warning("gspmd_tf: op %s (%s) has its segment rows split in more than one dim; "
                "they are gathered first", ctx.node.name, ctx.node.op)
    rows = len(operands[1].shape)
    whole = [ctx.reshard(x, Layout(((),) * rows + x.layout.dims[rows:]))
             for x in operands[:2]] + list(operands[2:])
    layout = Layout(layouts[0].dims)
    refs = [x.ref for x in whole]
    refs[1:3] = _local_ids(ctx, whole[1], [], layout)
    ref = replay(ctx, whole, [layout], refs=refs)[0]
    return [Local(ref, layout, ctx.node.out_shapes[0], ctx.node.out_dtypes[0])]


def _fold_blocks(ctx, operands, refs, dim, partial_layout):
    """The fold over all devices' blocks of rows (split along ids dim `dim`), see above."""
    b = ctx.b
    data, ids = operands[0], operands[1]
    dtype = data.dtype
    best = "max" if ctx.node.op == "UnsortedSegmentMax" else "min"
    worst = -np.inf if best == "max" else np.inf
    shape = ctx.local_shape(partial_layout)
    folded = b.replay(ctx.node, refs, [shape], [dtype])[0]

    def count_per_segment(cond):
        return b.op("UnsortedSegmentSum", [cast(b, cond, tf.bool, tf.int32)] + refs[1:3],
                    shape, tf.int32, T=tf.int32, Tindices=ids.dtype,
                    Tnumsegments=ctx.node.attr("Tnumsegments"))

    data_shape = b.shape_of(data.ref)
    rows = count_per_segment(b.op("Fill", [b.const(np.asarray(data_shape, np.int32)),
                                           b.const(True)], data_shape, tf.bool, T=tf.bool,
                                  index_type=tf.int32))
    has_rows = _positive(b, rows)
    has_nan = _positive(b, count_per_segment(
        b.op("IsNan", [data.ref], data_shape, tf.bool, T=dtype)))
    worst_rows = count_per_segment(binary(b, "Equal", data.ref, b.const(worst, dtype), dtype,
                                          tf.bool))
    only_worst = _and(b, has_rows, binary(b, "Equal", rows, worst_rows, tf.int32, tf.bool))
    # a NaN-free block folded on from a NaN gives its own extremum: +-inf, not the fold's
    # start, when all its rows are +-inf
    own_extremum = select(b, only_worst, b.const(worst, dtype), folded, dtype)

    axes = ids.layout.dims[dim]
    device = b.shard_index(axes)
    last_nan = _over_devices(ctx, select(b, has_nan, device, b.const(-1, tf.int32), tf.int32),
                             partial_layout, axes, "max", tf.int32)
    no_nan = binary(b, "Less", last_nan, b.const(0, tf.int32), tf.int32, tf.bool)
    after_last_nan = _and(b, binary(b, "Greater", device, last_nan, tf.int32, tf.bool),
                          has_rows)
    in_fold = _or(b, _or(b, no_nan, binary(b, "Equal", device, last_nan, tf.int32, tf.bool)),
                  after_last_nan)
    value = select(b, no_nan, folded, own_extremum, dtype)
    real = _and(b, in_fold, b.op("LogicalNot", [b.op("IsNan", [value], shape, tf.bool,
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


def _or(b, x, y):
    return b.op("LogicalOr", [x, y], tuple(np.broadcast_shapes(b.shape_of(x),
                                                                b.shape_of(y))), tf.bool)


def _positive(b, ref):
    return binary(b, "Greater", ref, b.const(0, tf.int32), tf.int32, tf.bool)


def _over_devices(ctx, ref, partial_layout, axes, reduce_op, dtype):
    """`reduce_op` of a local per-segment value over the devices of `axes`."""
    partial = Local(ref, Layout(partial_layout.dims, axes, reduce_op),
                    ctx.node.out_shapes[0], dtype)
    return ctx.reshard(partial, Layout(partial_layout.dims)).ref
