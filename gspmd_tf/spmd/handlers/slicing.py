"""Slice, StridedSlice, Pad, PadV2 and MirrorPad(Grad) with a split dim whose size they
change; DiagPart with split rows.

Such a dim is a window of one element (stride s, low padding -first element read for a
slice, the pad amount for a pad: rules/slices.py), so the method is that of the
convolutions' spatial dims (windows.py; XLA pads and slices a split dim the same way): the
result keeps the dim split over the same axes in blocks of W = ceil(out / k), and shard
i's block reads the operand elements [i*W*s - pad_lo, ...) with stride s; the parts of
them held by neighbours come in by collective-permute (reshard.exchange_halo), the
elements outside [0, n) (a pad's padding, the tail of uneven blocks) are set to the pad
value. The local op then runs with bounds that leave the windowed dims alone (begin 0,
their local extent; no padding on them) and does the rest: dims it does not change,
dims that are not split. When the halos would span more blocks than gathering the dim
costs, the dim is gathered whole and each device slices its block from it.

A slice reading one element of a split dim (x[i], x[i:i+1]: a pipeline taking the last
stage's element out of a stage-split buffer) picks it (rules/slices.py `picks`): the
element's owner reads it, the other devices give zeros, and the result is a partial sum
over the dim's axes, so only the element's bytes move (one all-reduce where the result
is needed whole), never the dim gathered. XLA keeps such a result split on its size-1
dim, the element on the group's first device (a collective-permute from the owner, then
an all-reduce where it is needed whole). Rules carry no split of a size-1 dim, so
gspmd-tf takes XLA's form only where it is no worse: where the result's every consumer
is an identity whose layout (a user's annotation) splits that dim over the operand
dim's axes (`picked_targets`): one collective-permute to the first device, none when
it owns the element; the identity then passes it on as it is (partitioner), and a
reshard that needs it whole later is one all-reduce of the first shard (planner
Broadcast), not an all-gather of the others' padding.

MirrorPad is no window (its padding repeats elements near the edges), but each result
block still reads one contiguous range of x, mirrored where the block meets a global
edge: that range comes in the same way (gspmd_tf._halo.range_plan), and a gather with a
per-shard index table picks the block's elements; MirrorPadGrad sums the dy elements
mirroring onto each position of its block (a segment sum).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import Layout, ceil_div
from gspmd_tf.propagation import rules, windowed
from gspmd_tf.propagation.rules import batched
from gspmd_tf.propagation.windowed import Geometry
from gspmd_tf.registry import op_family
from gspmd_tf.spmd.handlers.basic import local_shapes, masked_refs, replay
from gspmd_tf.spmd.handlers.grads import index_dtype
from gspmd_tf.spmd.handlers.windows import (affine_start, extend_and_slice, mask_edges,
                                            operand_window, pad_dims, per_shard,
                                            prepare_input, range_plan, slice_dims)
from gspmd_tf.spmd.local_ops import dynamic_slice_dim, select
from gspmd_tf.spmd.program import Local
from gspmd_tf.spmd.reshard import send_to_first


def _windowed_input(ctx, operands, layouts, fill, index=0):
    """Operand `index` with each windowed dim the result splits cut to the elements
    this shard's block reads (halo exchange), padding set to `fill`: (ref, its windowed
    dims), or (None, ()) when the result splits no windowed dim."""
    params = ctx.rule.params
    y_layout = layouts[0]
    split = tuple(s for s in params.windows if y_layout.dims[s.y_dim])
    if not split:
        return None, ()
    geo = Geometry("", 0, 0, split)  # only its spatial dims are read
    x, plans = prepare_input(ctx, operands, index, geo, lambda s: y_layout.dims[s.y_dim])
    b = ctx.b
    resharded = list(operands)
    resharded[index] = x
    window = extend_and_slice(b, masked_refs(ctx, resharded)[index], plans,
                              lambda dp: dp.s.x_dim)
    return mask_edges(b, window, plans, fill), tuple(s.x_dim for s in split)


@op_family({"Slice": "slice"}, rules.pad_or_slice)
@op_family("StridedSlice", rules.strided_slice)
def slicing(ctx, operands, layouts):
    """Slice/StridedSlice: windowed split dims read through halos, the element picked
    from a split dim read by its owner (zeros elsewhere: a partial result); on every
    split dim the local op takes its whole local extent (begin 0, size -1 / end =
    extent)."""
    window, _ = _windowed_input(ctx, operands, layouts, 0)
    refs = masked_refs(ctx, operands)
    if window is not None:
        refs[0] = window
    params = ctx.rule.params
    x_dims = operands[0].layout.dims
    picks = [(d, element) for d, element in params.picks if x_dims[d]]
    moved = _moved_picks(ctx, picks, x_dims)
    if picks:
        refs[0] = _picked(ctx, refs[0], operands[0], picks, moved)
    split = [params.kept[j] for j, axes in enumerate(layouts[0].dims) if axes]
    split += [d for d, _ in picks]
    if not split:
        return replay(ctx, operands, layouts, refs=refs)
    _local_bounds(ctx, refs, split)
    results = replay(ctx, operands, layouts, refs=refs)
    if not moved:
        return results
    return _sent_to_first(ctx, results[0], operands[0], layouts[0], moved)


# ops whose result is their operand (what a user's annotation of a tensor traces to)
IDENTITIES = frozenset({"Identity", "XlaSharding"})


def picked_targets(p, index, targets):
    """The result layouts slice `index` (a rule with `picks`) is partitioned to, given
    propagation's `targets`: each picked dim's size-1 result dim split over the axes its
    operand dim is split over where every consumer of the result is an identity whose
    layout splits it so (a user's annotation, XLA's layout for the element: the
    handler then sends it to the group's first device by one collective-permute). Rules
    carry no split of a size-1 dim; elsewhere the element is a partial sum (one
    all-reduce where it is needed whole, no worse than XLA's permute then all-reduce)."""
    graph, layouts = p.graph, p.propagation.layouts
    node = graph.nodes[index]
    params = p.propagation.rules[index].params
    x_dims = p.values[node.inputs[0]].layout.dims
    users = p.consumers(index)
    y = targets[0]
    for d, _ in params.picks:
        j = params.kept.index(d) if d in params.kept else None
        if j is None or not x_dims[d] or y.dims[j] or not users:
            continue
        if all(graph.nodes[c].op in IDENTITIES and layouts[c][0].dims[j] == x_dims[d]
               for c, _ in users):
            y = y.with_dim(j, x_dims[d])
    return targets if y is targets[0] else type(targets)([y, *targets[1:]])


def _local_bounds(ctx, refs, split):
    """The slice's bounds in `refs` rewritten to take every split dim whole."""
    node, params = ctx.node, ctx.rule.params
    # A split dim is taken whole (the rule splits only dims the op leaves as they are,
    # and a picked dim has one element left), so a begin computed at run time is 0 there
    # in every program TF runs (a StridedSlice's begin and end are clamped to the local
    # extent anyway): constant bounds are rewritten to the local extent, run-time ones
    # kept.
    local = ctx.b.shape_of(refs[0])
    begin = _constant(ctx, 1)
    if node.op == "Slice":
        if begin is not None:
            begin[split] = 0
        size = _constant(ctx, 2)  # constant: the result's shape is static
        size[split] = -1
        refs[2] = ctx.b.const(size)
    else:
        end = _constant(ctx, 2)
        for d in split:
            if params.spec[d] is not None:  # dims outside the spec are taken whole anyway
                if begin is not None:
                    begin[params.spec[d]] = 0
                if end is not None:
                    end[params.spec[d]] = local[d]
        if end is not None:
            refs[2] = ctx.b.const(end)
    if begin is not None:
        refs[1] = ctx.b.const(begin)


def _moved_picks(ctx, picks, x_dims):
    """{x dim: result dim} of the picks whose size-1 result dim the result's target
    layout splits over the axes the operand's dim is split over (XLA's form: the element
    on the group's first shard, padding on the others): those are sent there by one
    collective-permute, not summed (an all-reduce sends 1.5x a permute's bytes at 4
    devices). A pick whose result is wanted whole stays a partial sum: one all-reduce,
    where XLA permutes and then all-reduces."""
    at = {d: j for j, d in enumerate(ctx.rule.params.kept) if d is not None}
    target = ctx.targets[0].dims
    return {d: at[d] for d, _ in picks
            if d in at and target[at[d]] and target[at[d]] == x_dims[d]}


def _sent_to_first(ctx, ref, x, layout, moved):
    """Result `ref` (each moved pick's element on its owner) as a Local with those picks'
    result dims split over their operand dims' axes: the owners' elements sent to the
    groups' first devices (no collective where the owners are those)."""
    axes, owner, sizes = (), [], []
    for d in moved:
        dim_axes = x.layout.dims[d]
        block = ceil_div(x.shape[d], ctx.mesh.axes_size(dim_axes))
        element = dict(ctx.rule.params.picks)[d]
        axes += dim_axes
        owner.append(element // block)
        sizes.append(ctx.mesh.axes_size(dim_axes))
    ref = send_to_first(ctx.b, ref, axes, int(np.ravel_multi_index(owner, sizes)))
    dims = list(layout.dims)
    for d, j in moved.items():
        dims[j] = x.layout.dims[d]
    partial = tuple(a for a in layout.partial if a not in axes)
    layout = Layout(tuple(dims), partial, layout.reduce_op)
    return [Local(ref, layout, ctx.node.out_shapes[0], ctx.node.out_dtypes[0])]


def _picked(ctx, ref, x, picks, moved):
    """x's local block `ref` cut to the one element read on each picked split dim
    ((dim, global element) pairs): the owner's element, zeros on the other devices (a
    select, so a NaN elsewhere in the block never reaches the sum), except on the
    `moved` dims, whose owner alone sends it on (_sent_to_first)."""
    b = ctx.b
    block = x.layout.local_shape(ctx.mesh, x.shape)
    owner = None
    for d, element in picks:
        axes = x.layout.dims[d]
        k = ctx.mesh.axes_size(axes)
        at = element - block[d] * np.arange(k)  # the element's index in each block
        inside = (at >= 0) & (at < block[d])
        ref = dynamic_slice_dim(b, ref, d, _as_ref(b, per_shard(b, axes, np.where(
            inside, at, 0))), 1)
        if d in moved:
            continue
        mine = per_shard(b, axes, inside.astype(np.int64))
        mine = b.op("NotEqual", [_as_ref(b, mine), b.const(np.int32(0))], (), tf.bool,
                    T=tf.int32, incompatible_shape_error=True)
        owner = mine if owner is None else b.op("LogicalAnd", [owner, mine], (), tf.bool)
    if owner is None:
        return ref
    dtype = b.graph.dtype(ref)
    return select(b, owner, ref, b.const(np.zeros((), dtype.as_numpy_dtype)), dtype)


def _as_ref(b, value):
    """A per_shard result as an int32 Ref (it is a python int when every shard agrees)."""
    return b.const(np.int32(value)) if isinstance(value, int) else value


def _constant(ctx, i):
    """A writable copy of the node's constant input i (a 1-D bound), or None when it is
    computed at run time."""
    value = ctx.graph.const_value(ctx.node.inputs[i])
    return None if value is None else np.array(value)



@op_family({"Pad": "pad", "PadV2": "pad"}, rules.pad_or_slice)
def pad(ctx, operands, layouts):
    """Pad/PadV2: windowed split dims read through halos and padded with the pad value
    there; the local op pads the other dims."""
    node = ctx.node
    value = ctx.graph.const_value(node.inputs[2]) if len(node.inputs) > 2 else 0
    window, dims = _windowed_input(ctx, operands, layouts, value)
    refs = masked_refs(ctx, operands)
    if window is None:
        return replay(ctx, operands, layouts, refs=refs)
    refs[0] = window
    paddings = np.array(ctx.graph.const_value(node.inputs[1]))
    paddings[list(dims)] = 0
    refs[1] = ctx.b.const(paddings)
    return replay(ctx, operands, layouts, refs=refs)


@op_family("StridedSliceGrad", rules.strided_slice_grad)
def strided_slice_grad(ctx, operands, layouts):
    """StridedSliceGrad: windowed split dims read dy through halos (zeros outside it);
    local `shape`, and on split dims the local op scatters the whole local extent."""
    refs = masked_refs(ctx, operands)
    window, _ = _windowed_input(ctx, operands, layouts, 0, index=4)
    if window is not None:
        refs[4] = window
    node = ctx.node
    shape = local_shapes(ctx, layouts)[0]
    dtype = index_dtype(ctx, "Index")
    begin = np.array(ctx.graph.const_value(node.inputs[1]))
    end = np.array(ctx.graph.const_value(node.inputs[2]))
    spec = ctx.rule.params.spec
    for d, axes in enumerate(layouts[0].dims):
        if axes and spec[d] is not None:
            begin[spec[d]], end[spec[d]] = 0, shape[d]
    refs[0] = ctx.b.const(np.asarray(shape, dtype))
    refs[1] = ctx.b.const(begin.astype(dtype))
    refs[2] = ctx.b.const(end.astype(dtype))
    return replay(ctx, operands, layouts, refs=refs)


# ------------------------------------------------------------------------ MirrorPad

def _mirrored(j, n, symmetric):
    """x index that position j of x's padded line reads (j < 0 and j >= n are padding,
    mirrored at the edges; SYMMETRIC repeats the edge element, REFLECT does not)."""
    edge = 1 if symmetric else 0
    j = np.where(j < 0, -j - edge, j)
    return np.where(j >= n, 2 * n - 2 + edge - j, j)


def _pad_reads(m, k, symmetric):
    """MirrorPad along MirrorDim m split k ways: each shard's block of y reads a
    contiguous range of x. (starts, span, table, useful): shard i reads x[starts[i]:
    starts[i] + span], its block gathers elements table[i] of that range."""
    size = m.n + m.pad_lo + m.pad_hi
    per = -(-size // k)
    j = np.arange(k * per).reshape(k, per)
    src = _mirrored(j - m.pad_lo, m.n, symmetric)
    real = j < size
    starts = np.where(real, src, m.n).min(axis=1)
    starts = np.where(starts == m.n, 0, starts)  # shards of padding only
    span = int(np.where(real, src - starts[:, None] + 1, 1).max())
    return starts, span, np.where(real, src - starts[:, None], 0), -(-size // per)


def _grad_reads(m, k, symmetric):
    """MirrorPadGrad along MirrorDim m, dx split k ways: shard i sums the elements of dy
    mirroring onto its block, within dy[starts[i]: starts[i] + span] (segment ids
    table[i]: the position in the block, -1 for the others)."""
    size = m.n + m.pad_lo + m.pad_hi
    per = -(-m.n // k)
    src = _mirrored(np.arange(size) - m.pad_lo, m.n, symmetric)
    owner = src // per
    useful = -(-m.n // per)
    starts = np.array([np.flatnonzero(owner == i).min() if i < useful else 0
                       for i in range(k)])
    span = max(int(np.flatnonzero(owner == i).max()) - starts[i] + 1
               for i in range(useful))
    j = starts[:, None] + np.arange(span)
    inside = np.minimum(j, size - 1)
    mine = (j < size) & (owner[inside] == np.arange(k)[:, None])
    return starts, span, np.where(mine, src[inside] - owner[inside] * per, -1), useful


class _MirrorPlan:
    """How one split padded dim of a MirrorPad(Grad) reads its operand: halo exchange
    of the range each shard reads (gspmd_tf._halo.range_plan), or the dim gathered whole
    when the operand does not split it or the halos would cost more than gathering."""

    def __init__(self, mesh, m, axes, grad, symmetric, operand_split):
        self.dim, self.axes = m.dim, tuple(axes)
        self.k = mesh.axes_size(self.axes)
        self.grad = grad
        reads = _grad_reads if grad else _pad_reads
        starts, span, self.table, useful = reads(m, self.k, symmetric)
        self.useful = useful
        self.per = -(-m.n // self.k)
        n = m.n + m.pad_lo + m.pad_hi if grad else m.n  # the operand's size
        self.plan, self.whole = range_plan(starts, span, n, self.k, operand_split, useful)

    @property
    def split(self):
        """True when the range comes from neighbours (the dim stays split)."""
        return not self.whole

    def local(self, b, window):
        """This shard's block along the dim, from the range it reads."""
        rows = per_shard(b, self.axes, self.table, self.useful)
        dtype = b.graph.dtype(window)
        shape = list(b.shape_of(window))
        if not self.grad:  # a gather of the mirrored elements
            shape[self.dim] = self.table.shape[1]
            return b.op("GatherV2", [window, rows, b.const(np.int32(self.dim))],
                        tuple(shape), dtype, Tparams=dtype, Tindices=tf.int32,
                        Taxis=tf.int32, batch_dims=0)
        # a sum of the elements mirroring onto each position: a segment sum (not a
        # product with a 0/1 matrix: 0 * Inf would be NaN) over the dim moved first
        order = [self.dim] + [d for d in range(len(shape)) if d != self.dim]
        moved = b.op("Transpose", [window, b.const(np.asarray(order, np.int32))],
                     tuple(shape[d] for d in order), dtype, T=dtype, Tperm=tf.int32)
        summed_shape = (self.per,) + tuple(shape[d] for d in order[1:])
        summed = b.op("UnsortedSegmentSum", [moved, rows, b.const(np.int32(self.per))],
                      summed_shape, dtype, T=dtype, Tindices=tf.int32,
                      Tnumsegments=tf.int32)
        back = np.argsort(order).astype(np.int32)
        shape[self.dim] = self.per
        return b.op("Transpose", [summed, b.const(back)], tuple(shape), dtype, T=dtype,
                    Tperm=tf.int32)


@op_family({"MirrorPad": False, "MirrorPadGrad": True}, windowed.mirror_pad)
def mirror_pad(ctx, operands, layouts):
    """MirrorPad / MirrorPadGrad with a split padded dim: each shard's block reads a
    contiguous range of the operand, mirrored at the global edges (the first and last
    shards read their own neighbourhood backwards); that range comes in by halo
    exchange and a gather (MirrorPad) or a segment sum (MirrorPadGrad, where elements
    mirroring onto the same position add up) makes the block. The local op then pads
    the dims that are not split."""
    params = ctx.rule.params
    refs = masked_refs(ctx, operands)
    grad = ctx.node.op == "MirrorPadGrad"
    dims = [m for m in getattr(params, "dims", ()) if layouts[0].dims[m.dim]]
    if not dims:
        return replay(ctx, operands, layouts, refs=refs)
    original = ctx.inputs[0]
    plans = [_MirrorPlan(ctx.mesh, m, layouts[0].dims[m.dim], grad, params.symmetric,
                         bool(original.layout.dims[m.dim])) for m in dims]
    window = operand_window(ctx, operands, plans)
    for p in plans:
        window = p.local(ctx.b, window)
    paddings = np.array(ctx.graph.const_value(ctx.node.inputs[1]))
    paddings[[m.dim for m in dims]] = 0
    refs[0], refs[1] = window, ctx.b.const(paddings)
    return replay(ctx, operands, layouts, refs=refs)


@op_family("DiagPart", batched.diagonal_part)
def diagonal_part(ctx, operands, layouts):
    """DiagPart with split rows: each device's columns cut to its own row block (padded
    to whole blocks first), then the TF op on the square block: the diagonal of the
    rows this device holds."""
    x = operands[0]
    b = ctx.b
    half = len(x.shape) // 2
    rows = x.layout.dims[:half]
    if not any(rows):
        return replay(ctx, operands, layouts)
    block = x.layout.local_shape(ctx.mesh, x.shape)[:half]
    ref = pad_dims(b, x.ref, {half + i: (0, block[i] * ctx.mesh.axes_size(axes) - n)
                              for i, (axes, n) in enumerate(zip(rows, x.shape[:half]))
                              if axes})
    starts = {half + i: affine_start(b, axes, block[i], 0)
              for i, axes in enumerate(rows) if axes}
    square = slice_dims(b, ref, starts, {half + i: block[i] for i, axes in enumerate(rows)
                                         if axes})
    return replay(ctx, operands, layouts, refs=[square])
