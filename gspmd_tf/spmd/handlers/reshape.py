"""Reshape: a local reshape of the shards, or, where dims merge behind an unevenly split
major dim (or a dim splits into such dims), the merged dim re-blocked by
collective-permutes.

A dim of n split k ways unevenly holds blocks of c = ceil(n / k); merged with the whole
dims after it (r elements each), shard s holds [s * c * r, (s + 1) * c * r) of the merged
dim, while the merged dim split k ways wants blocks of ceil(n * r / k), shorter. The
factor rule keeps no uneven split inside a merged dim (it would gather the operand);
`reblock_merged` instead reshapes each shard locally and moves the block boundaries
(reshard.reblock): each device takes the front of its new block from the devices before
it, as XLA's reshape does. The reverse reshape (a split dim split into an unevenly split
major dim and whole dims) re-blocks the other way, then reshapes locally; there XLA
gathers over part of the axes and permutes.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.propagation import rules
from gspmd_tf.registry import VALUE_SHAPED, declare
from gspmd_tf.spmd.handlers.basic import with_local_shape_input
from gspmd_tf.spmd.local_ops import replace_dim
from gspmd_tf.spmd.program import Local
from gspmd_tf.spmd.reshard import reblock

_NOT_MOVABLE = frozenset({tf.string, tf.resource, tf.variant})  # a set: see UNMOVABLE


def merged_uneven_split(wide_shape, narrow_shape, wide_layout, narrow_layout, mesh):
    """(dim, axes) when `narrow_shape` merges dims [dim, j] of `wide_shape` into its dim
    `dim`, `wide_layout` splits dim `dim` unevenly over `axes` and none of the other
    merged dims, `narrow_layout` splits the merged dim over the same `axes`, and every
    other dim keeps its size and axes; else None."""
    merged = len(wide_shape) - len(narrow_shape) + 1
    if wide_layout.partial or narrow_layout.partial:
        return None
    for dim in rules.merge_dims(wide_shape, narrow_shape):
        axes = wide_layout.dims[dim]
        if (not axes or wide_shape[dim] % mesh.axes_size(axes) == 0
                or narrow_layout.dims[dim] != axes
                or any(wide_layout.dims[dim + 1:dim + merged])
                or wide_layout.dims[:dim] != narrow_layout.dims[:dim]
                or wide_layout.dims[dim + merged:] != narrow_layout.dims[dim + 1:]):
            continue
        return dim, axes
    return None


def reblock_merged(ctx):
    """The Reshape's result in its target layout by a local reshape and reshard.reblock
    (before it when dims merge, after it when a dim splits into an unevenly split major
    dim and whole ones), when merged_uneven_split finds the pattern in the operand's own
    layout and the result's target; else None (the operands are resharded to the rule's
    factors)."""
    x, b, mesh = ctx.inputs[0], ctx.b, ctx.mesh
    target, out_shape = ctx.targets[0], ctx.node.out_shapes[0]
    if x.dtype in _NOT_MOVABLE:
        return None
    merging = len(x.shape) > len(out_shape)
    wide, narrow = ((x.shape, x.layout), (out_shape, target)) if merging else \
        ((out_shape, target), (x.shape, x.layout))
    found = merged_uneven_split(wide[0], narrow[0], wide[1], narrow[1], mesh)
    if found is None:
        return _reblock_regrouped(ctx)
    dim, axes = found
    narrow_local = narrow[1].local_shape(mesh, narrow[0])
    wide_local = wide[1].local_shape(mesh, wide[0])
    # the narrow dim in blocks of the wide dims' shards: the block of the merged shard
    block = int(np.prod(wide_local[dim:dim + len(wide_local) - len(narrow_local) + 1]))
    if merging:
        ref = _local_reshape(b, x.ref, replace_dim(narrow_local, dim, block), x.dtype)
        ref = reblock(b, ref, dim, axes, out_shape[dim], narrow_local[dim])
    else:
        ref = reblock(b, x.ref, dim, axes, x.shape[dim], block)
        ref = _local_reshape(b, ref, wide_local, x.dtype)
    return [Local(ref, target, out_shape, x.dtype)]


def regrouped_split(x_shape, y_shape, x_layout, y_layout, mesh):
    """(x dim, y dim, axes) when x_layout and y_layout each split one dim, over the same
    axes, nothing partial, and the dims before them hold as many elements in both shapes:
    then each shard holds one contiguous range of the same flat suffix in both, and a
    re-block of that suffix makes the result; None when not so, or when both split
    evenly in blocks of the same elements (the factor rule keeps the split there)."""
    if x_layout.partial or y_layout.partial:
        return None
    x_split = [d for d, axes in enumerate(x_layout.dims) if axes]
    y_split = [d for d, axes in enumerate(y_layout.dims) if axes]
    if len(x_split) != 1 or len(y_split) != 1:
        return None
    d, e = x_split[0], y_split[0]
    axes = x_layout.dims[d]
    if y_layout.dims[e] != axes or np.prod(x_shape[:d]) != np.prod(y_shape[:e]):
        return None
    k = mesh.axes_size(axes)
    x_block = -(-x_shape[d] // k) * int(np.prod(x_shape[d + 1:]))
    y_block = -(-y_shape[e] // k) * int(np.prod(y_shape[e + 1:]))
    if x_shape[d] % k == 0 and y_shape[e] % k == 0 and x_block == y_block:
        return None
    return d, e, axes


def _reblock_regrouped(ctx):
    """The Reshape's result by a re-block of the flat suffix when regrouped_split finds
    the pattern (XLA's reshape with a halo exchange: (2,3,7,10) split on its 7 into
    (3,2,1,14,5) split on its 14 sends one permute of half a row of 10 per (2,3) entry);
    else None."""
    x, b, mesh = ctx.inputs[0], ctx.b, ctx.mesh
    target, out_shape = ctx.targets[0], ctx.node.out_shapes[0]
    found = regrouped_split(x.shape, out_shape, x.layout, target, mesh)
    if found is None:
        return None
    d, e, axes = found
    x_local = x.layout.local_shape(mesh, x.shape)
    y_local = target.local_shape(mesh, out_shape)
    prefix, x_rows = int(np.prod(x.shape[:d])), int(np.prod(x.shape[d + 1:]))
    y_rows = int(np.prod(out_shape[e + 1:]))
    ref = _local_reshape(b, x.ref, (prefix, x_local[d] * x_rows), x.dtype)
    ref = reblock(b, ref, 1, axes, x.shape[d] * x_rows, y_local[e] * y_rows)
    return [Local(_local_reshape(b, ref, y_local, x.dtype), target, out_shape, x.dtype)]


def _local_reshape(b, ref, shape, dtype):
    return b.op("Reshape", [ref, b.const(np.asarray(shape, np.int32))], tuple(shape), dtype,
                T=dtype, Tshape=tf.int32)


emit_reshape = with_local_shape_input(1)
emit_reshape.without_reshard = reblock_merged
# traits: TF's shape inference leaves the -1 of a reshape of no elements unknown
declare("Reshape", rules.reshape, emit=emit_reshape, traits=[VALUE_SHAPED])
