"""Handlers for lookups whose table dim is split: GatherV2 and OneHot."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.propagation import rules
from gspmd_tf.registry import op_family
from gspmd_tf.spmd.handlers.basic import local_shapes, replay
from gspmd_tf.spmd.local_ops import binary, cast, select, shard_offset


def _local_indices(ctx, indices, axes, size):
    """Indices minus the start of this device's block of a dim split over `axes`."""
    b = ctx.b
    dtype = indices.dtype
    offset = shard_offset(b, axes, size)
    if dtype != tf.int32:
        offset = cast(b, offset, tf.int32, dtype)
    return binary(b, "Sub", indices.ref, offset, dtype)


@op_family(["GatherV2", "ResourceGather"], rules.gather, safe_padding={1: 0})  # indices
def gather(ctx, operands, layouts):
    """GatherV2 from a table split on the gathered dim: a masked local lookup whose
    partial result the partitioner all-reduces."""
    table, indices = operands[0], operands[1]
    axis, batch_dims = ctx.rule.params.axis, ctx.rule.params.batch_dims
    axes = table.layout.dims[axis]
    if not axes:
        return replay(ctx, operands, layouts)
    b = ctx.b
    local = table.layout.local_shape(ctx.mesh, table.shape)[axis]
    itype = indices.dtype
    shifted = _local_indices(ctx, indices, axes, local)
    valid = b.op("LogicalAnd", [
        binary(b, "GreaterEqual", shifted, b.const(np.zeros((), itype.as_numpy_dtype)), itype,
               tf.bool),
        binary(b, "Less", shifted, b.const(np.asarray(local, itype.as_numpy_dtype)), itype,
               tf.bool)], b.shape_of(shifted), tf.bool)
    safe = select(b, valid, shifted, b.const(np.zeros((), itype.as_numpy_dtype)), itype)
    refs = [table.ref, safe] + [x.ref for x in operands[2:]]
    out = replay(ctx, operands, layouts, refs=refs)[0]
    out_shape = local_shapes(ctx, layouts)[0]
    # the mask broadcast over the result: its batch dims, then the table dims before the
    # axis, then the other indices dims, then the table dims after the axis
    idx = b.shape_of(safe)
    bshape = (idx[:batch_dims] + (1,) * (axis - batch_dims) + idx[batch_dims:]
              + (1,) * (len(out_shape) - axis - len(idx) + batch_dims))
    valid = b.op("Reshape", [valid, b.const(np.asarray(bshape, np.int32))], bshape, tf.bool,
                 T=tf.bool, Tshape=tf.int32)
    dtype = ctx.node.out_dtypes[0]  # the table may be a variable handle
    return [select(b, valid, out, b.const(np.zeros((), dtype.as_numpy_dtype)), dtype)]


@op_family("OneHot", rules.one_hot)
def one_hot(ctx, operands, layouts):
    """OneHot with the depth dim split: each device encodes its block of classes."""
    axis = ctx.node.attr("axis")
    out_rank = len(ctx.node.out_shapes[0])
    axis = out_rank - 1 if axis == -1 else axis
    axes = layouts[0].dims[axis]
    if not axes:
        return replay(ctx, operands, layouts)
    local = local_shapes(ctx, layouts)[0][axis]
    refs = [_local_indices(ctx, operands[0], axes, local), ctx.b.const(np.int32(local)),
            operands[2].ref, operands[3].ref]
    return replay(ctx, operands, layouts, refs=refs)
