"""Slice, StridedSlice, Pad and PadV2 with a split dim whose size they change.

Such a dim is a window of one element (stride s, low padding -first element read for a
slice, the pad amount for a pad: rules._sliced_factors), so the method is that of the
convolutions' spatial dims (windows.py; XLA pads and slices a split dim the same way): the
result keeps the dim split over the same axes in blocks of W = ceil(out / k), and shard
i's block reads the operand elements [i*W*s - pad_lo, ...) with stride s; the parts of
them held by neighbours come in by collective-permute (reshard.exchange_halo), the
elements outside [0, n) (a pad's padding, the tail of uneven blocks) are set to the pad
value. The local op then runs with bounds that leave the windowed dims alone (begin 0,
their local extent; no padding on them) and does the rest: dims it does not change,
dims that are not split. When the halos would span more blocks than gathering the dim
costs, the dim is gathered whole and each device slices its block from it.
"""

from __future__ import annotations

import numpy as np

from gspmd_tf.propagation import rules
from gspmd_tf.propagation.windowed import Geometry
from gspmd_tf.registry import op_family
from gspmd_tf.spmd.handlers.basic import local_shapes, masked_refs, replay
from gspmd_tf.spmd.handlers.grads import index_dtype
from gspmd_tf.spmd.handlers.windows import extend_and_slice, mask_edges, prepare_input


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
    """Slice/StridedSlice: windowed split dims read through halos; on every split dim
    the local op takes its whole local extent (begin 0, size -1 / end = extent)."""
    node = ctx.node
    window, _ = _windowed_input(ctx, operands, layouts, 0)
    refs = masked_refs(ctx, operands)
    if window is not None:
        refs[0] = window
    params = ctx.rule.params
    split = [params.kept[j] for j, axes in enumerate(layouts[0].dims) if axes]
    if not split:
        return replay(ctx, operands, layouts, refs=refs)
    local = ctx.b.shape_of(refs[0])
    begin = np.array(ctx.graph.const_value(node.inputs[1]))
    if node.op == "Slice":
        size = np.array(ctx.graph.const_value(node.inputs[2]))
        begin[split], size[split] = 0, -1
        refs[2] = ctx.b.const(size)
    else:
        end = np.array(ctx.graph.const_value(node.inputs[2]))
        for d in split:
            if params.spec[d] is not None:  # dims outside the spec are taken whole anyway
                begin[params.spec[d]], end[params.spec[d]] = 0, local[d]
        refs[2] = ctx.b.const(end)
    if begin.ndim:  # a StridedSlice of a dim outside the spec may have no constant begin
        refs[1] = ctx.b.const(begin)
    return replay(ctx, operands, layouts, refs=refs)


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
