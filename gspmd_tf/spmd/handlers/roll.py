"""Roll: a cyclic shift, of a split dim too, by collective-permutes of whole blocks.

A dim of n elements split evenly k ways holds blocks of W = n / k. Rolled by s = q*W + r
(0 <= r < W), result block i is [the last r elements of block i-q-1 | the first W-r
elements of block i-q] (indices mod k): at most two collective-permutes, one when r is
0 (whole blocks move q places: the pipeline's stage shift) or when q is a multiple of k
(a one-block halo: the last r elements move to the next device). An uneven split has
padding inside the cycle, so that dim is gathered, rolled locally and sliced again.
"""

from __future__ import annotations

import numpy as np

from gspmd_tf.propagation import rules
from gspmd_tf.registry import op_family
from gspmd_tf.spmd.handlers.basic import replay
from gspmd_tf.spmd.local_ops import concat_dim, static_slice_dim
from gspmd_tf.spmd.program import Local
from gspmd_tf.spmd.reshard import rotate


def _roll_split_dim(b, ref, dim, axes, shift):
    """`ref`'s blocks of a dim split evenly over `axes`, the global dim rolled by `shift`."""
    width = b.shape_of(ref)[dim]
    q, r = divmod(shift, width)
    parts = []
    if r:  # the last r elements of each block start the block q+1 places on
        parts.append(rotate(b, static_slice_dim(b, ref, dim, width - r, r), axes, q + 1))
    if width - r:  # the rest of each block ends the block q places on
        parts.append(rotate(b, static_slice_dim(b, ref, dim, 0, width - r), axes, q))
    return concat_dim(b, parts, dim)


@op_family("Roll", rules.roll)
def roll(ctx, operands, layouts):
    """Roll: rolled split dims by _roll_split_dim (uneven ones gathered first), the rest
    by a local Roll."""
    params = ctx.rule.params
    if params is None:  # no constant shift: the rolled dims are whole
        return replay(ctx, operands, layouts)
    x, mesh, b = operands[0], ctx.mesh, ctx.b
    uneven = {d for d, _ in params.shifts
              if x.layout.dims[d] and x.shape[d] % mesh.axes_size(x.layout.dims[d])}
    if uneven:
        layout = x.layout
        for d in uneven:
            layout = layout.with_dim(d, ())
        x = ctx.reshard(x, layout)
    ref, local = x.ref, []
    for dim, shift in params.shifts:
        if x.layout.dims[dim]:
            ref = _roll_split_dim(b, ref, dim, x.layout.dims[dim], shift)
        else:
            local.append((dim, shift))
    if local:
        dims, shifts = zip(*local)
        node = ctx.node
        ref = b.replay(node, [ref, b.const(np.array(shifts, node.attr("Tshift").as_numpy_dtype)),
                              b.const(np.array(dims, node.attr("Taxis").as_numpy_dtype))],
                       [b.shape_of(ref)], node.out_dtypes)[0]
    return [Local(ref, x.layout, x.shape, x.dtype)]
