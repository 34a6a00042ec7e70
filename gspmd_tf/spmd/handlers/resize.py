"""Image resizes with a split height or width: halo exchange, not a gather.

ResizeBilinear and ResizeNearestNeighbor read, for each row (column) o of the resized
image, the rows lower(o) and upper(o) of the image (nearest neighbour: one row), with a
weight lerp(o); both grow with o. So the resized rows of one shard's block read one
contiguous range of image rows, which comes in by halo exchange (gspmd_tf._halo.
range_plan, windows.extend_and_slice, as MirrorPad's ranges do), and a gather with a
per-shard table of local row indices, then the interpolation, makes the block. The
gradients run the other way: an image row's block receives from a contiguous range of
resized rows (those whose lower or upper row lies in it), brought in the same way and
summed per image row (a segment sum). Rows and weights are TF's kernels' (its float32
scale and scalers: tensorflow/core/util/image_resizer_state.h), computed here once per
lowering; the interpolation is TF's: along the width first, then the height.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.propagation import windowed
from gspmd_tf.registry import op_family
from gspmd_tf.spmd.handlers.basic import replay
from gspmd_tf.spmd.handlers.windows import operand_window, range_plan


def source_rows(node, n: int, out: int):
    """(lower, upper, lerp) of the `out` resized rows of `n` image rows, as TF's kernel
    of `node` computes them (float32): bilinear reads lower and upper, weighting upper
    by lerp; nearest neighbour reads lower (upper = lower, lerp = 0)."""
    align = bool(node.attr("align_corners", False))
    half_pixel = bool(node.attr("half_pixel_centers", False))
    f32 = np.float32
    scale = f32(n - 1) / f32(out - 1) if align and out > 1 else f32(n) / f32(out)
    o = np.arange(out, dtype=f32)
    if node.op.startswith("ResizeBilinear"):
        at = (o + f32(0.5)) * scale - f32(0.5) if half_pixel else o * scale
        floor = np.floor(at)
        lower = np.maximum(floor, 0).astype(np.int64)
        upper = np.minimum(np.ceil(at), n - 1).astype(np.int64)
        return lower, upper, (at - floor).astype(f32)
    at = (o + f32(0.5)) * scale if half_pixel else o * scale
    rows = np.minimum(np.round(at) if align else np.floor(at), n - 1).astype(np.int64)
    if half_pixel:
        rows = np.maximum(rows, 0)
    return rows, rows, np.zeros(out, f32)


class _ResizePlan:
    """How one resized dim of a shard's block reads its operand: the contiguous range
    each shard reads (a gspmd_tf._halo range plan: halo exchange, or the dim gathered
    whole when the operand does not split it or halos would cost more), and per shard
    the local operand row (forward) or local result row (gradient, -1: another
    shard's) and the weight of each of the block's lower and upper reads."""

    def __init__(self, mesh, node, resized: windowed.ResizeDim, axes, grad: bool,
                 operand_split: bool):
        self.dim, self.axes = resized.dim, tuple(axes)
        self.k = k = mesh.axes_size(self.axes)
        lower, upper, lerp = source_rows(node, resized.n, resized.out)
        if grad:  # image rows of a block, from the resized rows landing in it
            block = -(-resized.n // k)
            first, last = lower // block, upper // block
            useful = -(-resized.n // block)
            reads = [np.flatnonzero((first <= i) & (last >= i)) for i in range(k)]
            size = resized.out
        else:  # resized rows of a block, from the image rows they read
            block = -(-resized.out // k)
            useful = -(-resized.out // block)
            ends = np.minimum(np.arange(k + 1) * block, resized.out)
            reads = [np.arange(lower[ends[i]], upper[ends[i + 1] - 1] + 1)
                     if i < useful else np.zeros(0, np.int64) for i in range(k)]
            size = resized.n
        if k == 1:  # not split: the whole operand dim, read in place
            reads = [np.arange(size)]
        starts = np.array([r[0] if len(r) else 0 for r in reads])
        span = max(max((len(r) for r in reads), default=1), 1)
        self.plan, self.whole = range_plan(starts, span, size, k, operand_split, useful)
        if grad:  # per read resized row: its lower and upper rows in the block, or -1
            rows = starts[:, None] + np.arange(span)
            inside = np.minimum(rows, resized.out - 1)
            own = (np.arange(k) * block)[:, None]
            real = rows < resized.out
            self.lower = np.where(real, _local(lower[inside] - own, block), -1)
            self.upper = np.where(real, _local(upper[inside] - own, block), -1)
            self.lerp = np.where(real, lerp[inside], 0)
            self.rows = block
        else:  # per resized row of the block: the local operand rows it reads
            rows = np.arange(k)[:, None] * block + np.arange(block)
            real = rows < resized.out
            inside = np.minimum(rows, resized.out - 1)
            self.lower = np.where(real, lower[inside] - starts[:, None], 0)
            self.upper = np.where(real, upper[inside] - starts[:, None], 0)
            self.lerp = np.where(real, lerp[inside], 0)
            self.rows = block
        self.useful = useful

    @property
    def split(self):
        """True when the range comes from neighbours (the dim stays split)."""
        return not self.whole


def _local(rows, block):
    """Rows of a block of `block` rows, -1 outside it."""
    return np.where((rows >= 0) & (rows < block), rows, -1)


def _table(b, axes, table, dtype):
    """table[this shard's index along axes] as a constant-or-gathered vector of
    `dtype` (a constant when every row is the same)."""
    table = np.asarray(table).astype(dtype.as_numpy_dtype)
    if not axes or np.all(table == table[0]):
        return b.const(table[0])
    return b.op("GatherV2", [b.const(table), b.shard_index(axes), b.const(np.int32(0))],
                table.shape[1:], dtype, Tparams=dtype, Tindices=tf.int32, Taxis=tf.int32,
                batch_dims=0)


def _along(b, vector, dim, rank):
    """`vector` reshaped to broadcast along `dim` of a rank-`rank` tensor."""
    shape = [1] * rank
    shape[dim] = b.shape_of(vector)[0]
    dtype = b.graph.dtype(vector)
    return b.op("Reshape", [vector, b.const(np.asarray(shape, np.int32))], tuple(shape),
                dtype, T=dtype, Tshape=tf.int32)


def _binary(b, op, x, y, dtype):
    """x op y, broadcasting y."""
    return b.op(op, [x, y], b.shape_of(x), dtype, T=dtype)


def _gather_rows(b, x, rows, dim):
    """x's rows `rows` (int32 vector) along `dim`."""
    shape = list(b.shape_of(x))
    shape[dim] = b.shape_of(rows)[0]
    dtype = b.graph.dtype(x)
    return b.op("GatherV2", [x, rows, b.const(np.int32(dim))], tuple(shape), dtype,
                Tparams=dtype, Tindices=tf.int32, Taxis=tf.int32, batch_dims=0)


def _interpolate(b, window, p, bilinear):
    """The block's resized rows along p.dim: lower + (upper - lower) * lerp (bilinear,
    as TF's kernel), or the lower rows."""
    lower = _gather_rows(b, window, _table(b, p.axes, p.lower, tf.int32), p.dim)
    if not bilinear:
        return lower
    upper = _gather_rows(b, window, _table(b, p.axes, p.upper, tf.int32), p.dim)
    lerp = _along(b, _table(b, p.axes, p.lerp, tf.float32), p.dim, 4)
    step = _binary(b, "Mul", _binary(b, "Sub", upper, lower, tf.float32), lerp, tf.float32)
    return _binary(b, "AddV2", lower, step, tf.float32)


def _sum_into_rows(b, window, p, bilinear):
    """The block's image rows along p.dim: the sum of the read resized rows weighted
    (1 - lerp) into their lower row and lerp into their upper row (bilinear), or summed
    into their row; a segment sum over the dim moved first."""
    order = [p.dim] + [d for d in range(4) if d != p.dim]
    shape = b.shape_of(window)
    dtype = b.graph.dtype(window)
    moved_shape = tuple(shape[d] for d in order)
    summed_shape = (p.rows,) + moved_shape[1:]

    def summed(weighted, rows):
        moved = b.op("Transpose", [weighted, b.const(np.asarray(order, np.int32))],
                     moved_shape, dtype, T=dtype, Tperm=tf.int32)
        return b.op("UnsortedSegmentSum", [moved, _table(b, p.axes, rows, tf.int32),
                                           b.const(np.int32(p.rows))],
                    summed_shape, dtype, T=dtype, Tindices=tf.int32, Tnumsegments=tf.int32)

    if bilinear:
        lerp = _along(b, _table(b, p.axes, p.lerp, dtype), p.dim, 4)
        keep = b.op("Sub", [b.const(np.ones((), dtype.as_numpy_dtype)), lerp],
                    b.shape_of(lerp), dtype, T=dtype)
        total = b.op("AddV2", [summed(_binary(b, "Mul", window, keep, dtype), p.lower),
                               summed(_binary(b, "Mul", window, lerp, dtype), p.upper)],
                     summed_shape, dtype, T=dtype)
    else:
        total = summed(window, p.lower)
    back = np.argsort(order).astype(np.int32)
    out = list(shape)
    out[p.dim] = p.rows
    return b.op("Transpose", [total, b.const(back)], tuple(out), dtype, T=dtype,
                Tperm=tf.int32)


def _cast(b, ref, dtype):
    """`ref` as `dtype` (itself when it is)."""
    have = b.graph.dtype(ref)
    if have == dtype:
        return ref
    return b.op("Cast", [ref], b.shape_of(ref), dtype, SrcT=have, DstT=dtype, Truncate=False)


@op_family({"ResizeBilinear": False, "ResizeNearestNeighbor": False,
            "ResizeBilinearGrad": True, "ResizeNearestNeighborGrad": True}, windowed.resize)
def resize(ctx, operands, layouts):
    """A resize or its gradient with a split height or width (module docstring); with
    neither split, the TF op on the local blocks (batch and channels pass)."""
    grad = ctx.node.op.endswith("Grad")
    result_layout = layouts[0]
    dims = [r for r in ctx.rule.params if result_layout.dims[r.dim]]
    if not dims:
        return replay(ctx, operands, layouts)
    b = ctx.b
    plans = [_ResizePlan(ctx.mesh, ctx.node, r, result_layout.dims[r.dim], grad,
                         bool(ctx.inputs[0].layout.dims[r.dim])) for r in dims]
    window = operand_window(ctx, operands, plans)
    bilinear = ctx.node.op.startswith("ResizeBilinear")
    if bilinear:
        window = _cast(b, window, tf.float32)
    unsplit = [windowed.ResizeDim(r.dim, r.n, r.out) for r in ctx.rule.params
               if not result_layout.dims[r.dim]]
    plans += [_ResizePlan(ctx.mesh, ctx.node, r, (), grad, False) for r in unsplit]
    for p in sorted(plans, key=lambda p: -p.dim):  # width first, as TF's kernel
        window = (_sum_into_rows if grad else _interpolate)(b, window, p, bilinear)
    return [b.op("Identity", [_cast(b, window, ctx.node.out_dtypes[0])],
                 b.shape_of(window), ctx.node.out_dtypes[0], name=ctx.node.name,
                 T=ctx.node.out_dtypes[0])]
