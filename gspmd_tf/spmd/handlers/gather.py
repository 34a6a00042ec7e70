"""Handlers for lookups whose table dim is split (GatherV2, OneHot) and for scatters
whose index batch dims are split (ScatterNd, TensorScatterAdd/Sub)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.propagation import rules
from gspmd_tf.registry import READS_VARIABLE, declare, op_family
from gspmd_tf.spmd.handlers.basic import local_shapes, masked_refs, replay
from gspmd_tf.spmd.local_ops import binary, cast, select, shard_offset


def _local_indices(ctx, indices, axes, size):
    """Indices minus the start of this device's block of a dim split over `axes`."""
    b = ctx.b
    dtype = indices.dtype
    offset = shard_offset(b, axes, size)
    if dtype != tf.int32:
        offset = cast(b, offset, tf.int32, dtype)
    return binary(b, "Sub", indices.ref, offset, dtype)


# gathers from a variable only read it
declare(["ResourceGather", "ResourceGatherNd"], traits=[READS_VARIABLE])


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


# safe_padding: the padding rows of a split, uneven index batch dim are set to index 0
# (TF's kernel refuses a bad index)
@op_family("GatherNd", rules.gather_nd, safe_padding={1: 0})
def gather_nd(ctx, operands, layouts):
    """GatherNd from params split on indexed dims: each device looks up the index rows
    that fall in its block (shifted to local indices), zeros for the others; the
    partitioner sums the partial results."""
    params, indices = operands
    k = indices.shape[-1]
    split = [d for d in range(k) if params.layout.dims[d]]
    if not split:
        return replay(ctx, operands, layouts)
    b = ctx.b
    local = params.layout.local_shape(ctx.mesh, params.shape)
    refs = masked_refs(ctx, operands)
    itype = indices.dtype
    np_itype = itype.as_numpy_dtype
    offsets = [shard_offset(b, params.layout.dims[d], local[d]) if d in split
               else b.const(np.int32(0)) for d in range(k)]
    offset = b.op("Pack", offsets, (k,), tf.int32, N=k, T=tf.int32, axis=0)
    if itype != tf.int32:
        offset = cast(b, offset, tf.int32, itype)
    shifted = binary(b, "Sub", refs[1], offset, itype)
    inside = b.op("LogicalAnd", [
        binary(b, "GreaterEqual", shifted, b.const(np.zeros((), np_itype)), itype, tf.bool),
        binary(b, "Less", shifted, b.const(np.asarray(local[:k], np_itype)), itype,
               tf.bool)], b.shape_of(shifted), tf.bool)
    batch = b.shape_of(shifted)[:-1]
    valid = b.op("All", [inside, b.const(np.int32(-1))], batch + (1,), tf.bool,
                 Tidx=tf.int32, keep_dims=True)
    safe = select(b, valid, shifted, b.const(np.zeros((), np_itype)), itype)
    out = replay(ctx, operands, layouts, refs=[refs[0], safe])[0]
    out_shape = local_shapes(ctx, layouts)[0]
    mask_shape = batch + (1,) * (len(out_shape) - len(batch))
    valid = b.op("Reshape", [valid, b.const(np.asarray(mask_shape, np.int32))], mask_shape,
                 tf.bool, T=tf.bool, Tshape=tf.int32)
    dtype = ctx.node.out_dtypes[0]
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


@op_family({"ScatterNd": (0, rules.REDUCE)}, rules.scatter_nd)
def scatter_nd(ctx, operands, layouts):
    """ScatterNd into the local result shape. With the index batch dims split, each
    device scatters its updates (padding rows masked to index 0, update 0): the partial
    sums the partitioner adds up."""
    refs = masked_refs(ctx, operands)
    shape = local_shapes(ctx, layouts)[0]
    refs[2] = ctx.b.const(np.asarray(shape, ctx.node.attr("Tindices").as_numpy_dtype))
    return replay(ctx, operands, layouts, refs=refs)


@op_family({"TensorScatterAdd": (1, rules.REDUCE), "TensorScatterSub": (1, rules.REDUCE)},
           rules.scatter_nd)
def tensor_scatter_add(ctx, operands, layouts):
    """TensorScatterAdd/Sub with the index batch dims split: a partial sum, the tensor
    written into counted once (by the first device of the split axes), each device's own
    updates added (or subtracted) on every device."""
    axes = ctx.split_reduce_axes()
    if not axes:
        return replay(ctx, operands, layouts)
    b = ctx.b
    refs = masked_refs(ctx, operands)
    dtype = operands[0].dtype
    first = binary(b, "Equal", b.shard_index(axes), b.const(np.int32(0)), tf.int32, tf.bool)
    refs[0] = select(b, first, refs[0], b.const(np.zeros((), dtype.as_numpy_dtype)), dtype)
    return replay(ctx, operands, layouts, refs=refs)
