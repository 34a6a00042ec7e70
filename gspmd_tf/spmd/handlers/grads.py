"""Handlers for ops of TF's gradient code: Tile, BroadcastTo, StridedSliceGrad (shape
arguments made local) and UnsortedSegmentSum/Max/Min/Prod (segments split by block)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.propagation.rules import REDUCE
from gspmd_tf.spmd.handlers.basic import local_shapes, masked_refs, replay
from gspmd_tf.spmd.local_ops import binary, cast, mask_padding, select, shard_offset


def _index_dtype(ctx, attr):
    """numpy dtype of an int32/int64 index input whose type is attr `attr`."""
    dtype = ctx.node.attr(attr)
    return np.int64 if dtype == tf.int64 else np.int32


def tile(ctx, operands, layouts):
    """Tile: each dim's multiple is its local result size over its local input size
    (any multiple of an empty dim is empty)."""
    refs = masked_refs(ctx, operands)
    out = local_shapes(ctx, layouts)[0]
    local_in = ctx.b.shape_of(refs[0])
    multiples = [o // i if i else 1 for o, i in zip(out, local_in)]
    refs[1] = ctx.b.const(np.asarray(multiples, _index_dtype(ctx, "Tmultiples")))
    return replay(ctx, operands, layouts, refs=refs)


def broadcast_to(ctx, operands, layouts):
    """BroadcastTo the local result shape."""
    refs = masked_refs(ctx, operands)
    shape = local_shapes(ctx, layouts)[0]
    refs[1] = ctx.b.const(np.asarray(shape, _index_dtype(ctx, "Tidx")))
    return replay(ctx, operands, layouts, refs=refs)


def strided_slice_grad(ctx, operands, layouts):
    """StridedSliceGrad: local `shape`; split dims (whole in the slice) taken whole."""
    refs = masked_refs(ctx, operands)
    node = ctx.node
    shape = local_shapes(ctx, layouts)[0]
    dtype = _index_dtype(ctx, "Index")
    begin = np.array(ctx.graph.const_value(node.inputs[1]))
    end = np.array(ctx.graph.const_value(node.inputs[2]))
    for d, axes in enumerate(layouts[0].dims):
        if axes and d < len(end):
            begin[d], end[d] = 0, shape[d]
    refs[0] = ctx.b.const(np.asarray(shape, dtype))
    refs[1] = ctx.b.const(begin.astype(dtype))
    refs[2] = ctx.b.const(end.astype(dtype))
    return replay(ctx, operands, layouts, refs=refs)


def unsorted_segment(ctx, operands, layouts):
    """UnsortedSegment{Sum,Max,Min,Prod}. Split segment (REDUCE) dims give a partial
    result the partitioner combines; a split result segment dim keeps, on each device,
    the segments of its block: ids shifted by the block start, ids outside the block
    (and padding) set to -1, which TF drops."""
    b = ctx.b
    data, ids = operands[0], operands[1]
    refs = masked_refs(ctx, operands)  # data padding -> the reduction's identity
    itype = ids.dtype
    np_itype = itype.as_numpy_dtype
    rule = ctx.rule
    split = [d for d, fs in enumerate(rule.operands[1])
             if any(rule.factor_kinds[f] == REDUCE and ctx.factor_axes[f] for f in fs)]
    id_ref = mask_padding(b, ids, split, np_itype(-1)) if split else ids.ref
    axes = layouts[0].dims[0]
    num = local_shapes(ctx, layouts)[0][0]
    if axes:
        offset = shard_offset(b, axes, num)
        if itype != tf.int32:
            offset = cast(b, offset, tf.int32, itype)
        shifted = binary(b, "Sub", id_ref, offset, itype)
        inside = b.op("LogicalAnd", [
            binary(b, "GreaterEqual", shifted, b.const(np.zeros((), np_itype)), itype,
                   tf.bool),
            binary(b, "Less", shifted, b.const(np.asarray(num, np_itype)), itype, tf.bool)],
            b.shape_of(shifted), tf.bool)
        id_ref = select(b, inside, shifted, b.const(np.asarray(-1, np_itype)), itype)
    refs[1] = id_ref
    refs[2] = b.const(np.asarray(num, _index_dtype(ctx, "Tnumsegments")))
    return replay(ctx, operands, layouts, refs=refs)


GRAD_HANDLERS = {
    "Tile": tile,
    "BroadcastTo": broadcast_to,
    "StridedSliceGrad": strided_slice_grad,
    "UnsortedSegmentSum": unsorted_segment,
    "UnsortedSegmentMax": unsorted_segment,
    "UnsortedSegmentMin": unsorted_segment,
    "UnsortedSegmentProd": unsorted_segment,
}
