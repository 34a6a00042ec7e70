"""Reshape: a local reshape of the shards, or, where dims merge behind an unevenly split
major dim, the merged dim re-blocked by collective-permutes.

A dim of n split k ways unevenly holds blocks of c = ceil(n / k); merged with the whole
dims after it (r elements each), shard s holds [s * c * r, (s + 1) * c * r) of the merged
dim, while the merged dim split k ways wants blocks of ceil(n * r / k), shorter. The
factor rule keeps no uneven split inside a merged dim (it would gather the operand);
`reblock_merged` instead reshapes each shard locally and moves the block boundaries
(reshard.reblock): each device takes the front of its new block from the devices before
it, as XLA's reshape does.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import ceil_div
from gspmd_tf.propagation import rules
from gspmd_tf.registry import declare
from gspmd_tf.spmd.handlers.basic import with_local_shape_input
from gspmd_tf.spmd.program import Local
from gspmd_tf.spmd.reshard import reblock

_NOT_MOVABLE = (tf.string, tf.resource, tf.variant)


def merged_uneven_split(in_shape, out_shape, in_layout, out_layout, mesh):
    """(dim, axes) when `out_shape` merges dims [dim, j] of `in_shape` into its dim `dim`,
    `in_layout` splits dim `dim` unevenly over `axes` and none of the other merged dims,
    `out_layout` splits the merged dim over the same `axes`, and every other dim keeps
    its size and axes; else None."""
    rank_in, rank_out = len(in_shape), len(out_shape)
    merged = rank_in - rank_out + 1
    if merged < 2 or in_layout.partial or out_layout.partial:
        return None
    for dim in range(rank_out):
        if (in_shape[:dim] != out_shape[:dim]
                or in_shape[dim + merged:] != out_shape[dim + 1:]):
            continue
        axes = in_layout.dims[dim]
        k = mesh.axes_size(axes)
        if (not axes or in_shape[dim] % k == 0 or out_layout.dims[dim] != axes
                or any(in_layout.dims[dim + 1:dim + merged])
                or in_layout.dims[:dim] != out_layout.dims[:dim]
                or in_layout.dims[dim + merged:] != out_layout.dims[dim + 1:]):
            continue
        return dim, axes
    return None


def reblock_merged(ctx):
    """The Reshape's result in its target layout by a local reshape and reshard.reblock,
    when merged_uneven_split finds the pattern in the operand's own layout; else None
    (the operands are resharded to the rule's factors)."""
    x, node, b = ctx.inputs[0], ctx.node, ctx.b
    target = ctx.targets[0]
    out_shape = node.out_shapes[0]
    if x.dtype in _NOT_MOVABLE:
        return None
    found = merged_uneven_split(x.shape, out_shape, x.layout, target, ctx.mesh)
    if found is None:
        return None
    dim, axes = found
    local = b.shape_of(x.ref)
    merged = len(x.shape) - len(out_shape) + 1
    block = 1
    for size in local[dim:dim + merged]:
        block *= size
    shape = local[:dim] + (block,) + local[dim + merged:]
    ref = b.op("Reshape", [x.ref, b.const(np.asarray(shape, np.int32))], shape,
               x.dtype, T=x.dtype, Tshape=tf.int32)
    ref = reblock(b, ref, dim, axes, out_shape[dim],
                  ceil_div(out_shape[dim], ctx.mesh.axes_size(axes)))
    return [Local(ref, target, out_shape, x.dtype)]


emit_reshape = with_local_shape_input(1)
emit_reshape.without_reshard = reblock_merged
declare("Reshape", rules.reshape, emit=emit_reshape)
