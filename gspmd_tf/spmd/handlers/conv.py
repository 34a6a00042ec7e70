"""Handlers of windowed ops split along spatial dims: halo exchange.

The method of GSPMD's spatially partitioned convolutions (and XLA's
ReshardAsWindowedInput): a spatial dim of the input x split over mesh axes A gives a
result dim split over A, shard i computing the W = ceil(windows / k) windows
[i*W, (i+1)*W); the range of x they read comes in through halo exchanges with the
neighbours (windows.py: extend_and_slice), its elements outside [0, n) set to the op's
padding value (0 for convolutions, the lowest finite float for max pooling as TF;
windows.mask_edges).
The local op then runs with VALID padding on the window and yields exactly its W
results. Dims that are not split keep the op's own padding (EXPLICIT padding with those
dims' amounts) where the op takes explicit padding, else go through the same steps with
one shard (a plain pad). A conv's weight gradient reuses the windows its forward pass
built. Every step works per spatial dim: the same handlers serve the 2-D ops (Conv2D,
MaxPool...) and the 3-D ones (Conv3D, MaxPool3D...).

Gradients: Conv2DBackpropFilter (and the depthwise one) reads x through the same
windows (its spatial factor is REDUCE: each device's sum is partial). The input
gradients, Conv2DBackpropInput, DepthwiseConv2dNativeBackpropInput, AvgPoolGrad and
MaxPoolGrad, exchange halos of dy (every forward window reaching this device's block of
the result: gspmd_tf._halo.transposed_plan), run the local op with VALID padding and
slice their block out of its result; MaxPoolGrad also exchanges halos of the forward
input those windows read (set to -inf outside [0, n)), AvgPoolGrad pre-scales dy by
window / in-bounds count for padded windows. TF's max-pool gradient goes to a NaN that
comes first in a window clipped to x, which a -inf pad in front hides: the device whose
window starts before x runs the op with its own explicit padding instead, and
MaxPool3DGrad (no explicit padding) runs whole when padded in front (_clip_low_edge).
"""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import tensorflow as tf

from gspmd_tf import _halo
from gspmd_tf.layout import Layout
from gspmd_tf.propagation import windowed
from gspmd_tf.registry import CONVOLUTION, NAN_ORDER, declare, on_floats, op_family
from gspmd_tf.spmd.handlers.basic import (local_shapes, masked_refs, no_products, replay,
                                          whole_then_sliced)
from gspmd_tf.spmd.handlers.grads import index_dtype
from gspmd_tf.spmd.handlers.windows import (affine_start, extend_and_slice, halos_worth_it,
                                            mask_edges, mask_outside, pad_dims, per_shard,
                                            prepare_input, slice_dims)
from gspmd_tf.spmd.local_ops import identity_of, mask_padding
from gspmd_tf.spmd.program import Local

log = logging.getLogger("gspmd_tf")


# ------------------------------------------------------------------------ forward ops

def _local_padding(explicit_padding, plans):
    """Split off the dims the local op pads itself: (plans to window, padding attrs).
    Ops that take per-dim explicit padding keep their own padding on unsplit spatial
    dims (no copy, no extra work); the others pad unsplit dims like split ones."""
    if not explicit_padding:
        return plans, {"padding": "VALID"}
    kept = [dp for dp in plans if dp.k > 1]
    return kept, _padding_attrs([dp.s for dp in plans if dp.k == 1], len(plans) + 2)


def _padding_attrs(spatial, rank):
    """Padding attrs of an op that takes explicit padding, padding the SpatialDims
    `spatial` by their own amounts (SAME worked out) and no other dim of its rank."""
    pads = [0] * (2 * rank)
    for s in spatial:
        pads[2 * s.x_dim], pads[2 * s.x_dim + 1] = s.pad_lo, s.pad_hi
    if any(pads):
        return {"padding": "EXPLICIT", "explicit_paddings": pads}
    return {"padding": "VALID", "explicit_paddings": []}


def _window(op, filter_shape):
    """Elements of the filter one output element of convolution `op` sums over: the
    spatial window times the input channels, for a depthwise one the window alone."""
    return math.prod(filter_shape[:-2] if op.startswith("Depthwise") else filter_shape[:-1])


def forward_multiply_adds(node, in_shapes):
    """A convolution's multiply-adds: its output's elements times the window."""
    return math.prod(node.out_shapes[0]) * _window(node.op, in_shapes[1])


def input_gradient_multiply_adds(node, in_shapes):
    """An input gradient (input sizes, filter, output gradient) does its forward's
    multiply-adds: the output gradient's elements times the window."""
    return math.prod(in_shapes[2]) * _window(node.op, in_shapes[1])


def filter_gradient_multiply_adds(node, in_shapes):
    """A filter gradient (input, filter sizes, output gradient; the filter is its
    output) does its forward's multiply-adds too."""
    return math.prod(in_shapes[2]) * _window(node.op, node.out_shapes[0])


def explicit_input_gradient_numerics(node, operand_dtype):
    """XLA:CPU computes Conv2DBackpropInput with EXPLICIT padding wrong: values of 1e23 or
    NaN that change from call to call, on one device under plain jit_compile too (a 2x2
    filter over rows padded by 3 in front; issue 25 item 3). TF's kernel is right."""
    if node.attr("padding") == "EXPLICIT":
        return "XLA:CPU computes it wrong with explicit padding (issue 25)"
    return None


# pools that take the max of their windows order NaN (as reductions do)
MAX_POOLS = ["MaxPool", "MaxPoolV2", "MaxPool3D", "MaxPoolGrad", "MaxPoolGradV2",
             "MaxPool3DGrad", "MaxPoolWithArgmax"]
declare(MAX_POOLS, xla_numerics=on_floats(NAN_ORDER))
declare("Conv2DBackpropInput", xla_numerics=explicit_input_gradient_numerics)


# conv_family parameters: positions of x, w, y (an input index or "out"), the parts that
# are REDUCE factors, depthwise, explicit padding
@op_family({"Conv2D": (0, 1, "out", ("C",), False, True),
            "DepthwiseConv2dNative": (0, 1, "out", (), True, True),
            "Conv3D": (0, 1, "out", ("C",), False, False)}, windowed.conv_family,
           multiply_adds=forward_multiply_adds, traits=[CONVOLUTION])
# pool parameters: pooling, explicit padding
@op_family({"MaxPool": ("max", True), "AvgPool": ("avg", False),
            "MaxPool3D": ("max", False), "AvgPool3D": ("avg", False)}, windowed.pool)
def windowed_forward(ctx, operands, layouts):
    """Conv2D, DepthwiseConv2dNative, Conv3D, MaxPool(3D), AvgPool(3D) with split
    spatial dims."""
    node = ctx.node
    params = ctx.rule.params
    if params.pooling is None and (0 in operands[0].shape or 0 in operands[1].shape):
        return no_products(ctx, layouts)
    y_layout = layouts[0]
    geo = params.geometry
    if not any(y_layout.dims[s.y_dim] for s in geo.spatial):
        if params.explicit_padding:
            attrs = _padding_attrs(geo.spatial, len(y_layout.dims))  # SAME as amounts:
            # windows can be cut
        elif node.attr("padding") != "VALID":
            return replay(ctx, operands, layouts)
        else:
            attrs = {}
        refs = masked_refs(ctx, operands)
        window, cut = _one_window_unstrided(ctx, geo, refs[0], attrs, layouts)
        if cut is attrs:  # no dim cut: the op keeps its own attrs
            return replay(ctx, operands, layouts, refs=refs)
        return replay(ctx, operands, layouts, attrs=cut, refs=[window] + refs[1:])
    b = ctx.b
    x, plans = prepare_input(ctx, operands, 0, geo, lambda s: y_layout.dims[s.y_dim])
    plans, attrs = _local_padding(params.explicit_padding, plans)
    refs = masked_refs(ctx, [x] + list(operands[1:]))  # split in-channels -> zeros
    fill = _pool_fill(params.pooling, x.dtype)
    window = mask_edges(b, extend_and_slice(b, refs[0], plans, lambda dp: dp.s.x_dim),
                        plans, fill)
    window, attrs = _one_window_unstrided(ctx, geo, window, attrs, layouts)
    out = replay(ctx, operands, layouts, attrs=attrs, refs=[window] + refs[1:])
    if params.pooling == "avg":
        out = [_avg_counts(ctx, out[0], plans)]
    return out


def _pool_fill(pooling, dtype):
    """The value a forward windowed op's window is padded with: TF's own padding value,
    0 for convolutions and average pools, the lowest finite float for float max pools
    (TF's SAME MaxPool3D pads with it, not -inf: a window of -inf and padding gives
    -3.4e38 in float32 where VALID gives -inf, fuzzer seed 58 #2085 and #3699; its
    MaxPool gives at least that value everywhere). Integer max pools pad with the
    dtype's minimum."""
    if pooling != "max":
        return identity_of("sum", dtype)
    if dtype.is_floating:
        return dtype.as_numpy_dtype(dtype.min)
    return identity_of("max", dtype)


def _one_window_unstrided(ctx, geo, ref, attrs, layouts):
    """The local op's input and attrs with stride 1 on the strided dims that have one
    window locally: the window's extent cut out (x's part of it sliced, its padding kept
    in explicit_paddings). Same values; TF's oneDNN Conv2D computes wrong ones for a
    strided dim whose one window leaves part of the dim unread when x has one channel
    (input (2, 3, 3, 1), filter (1, 2, 1, 1), strides [1, 1, 2, 1], VALID: fuzzer seed 43
    #379; seed 20 #3241 makes such a conv locally by splitting 3 channels over 4
    devices). DepthwiseConv2dNative takes equal row and column strides only: there a
    cut dim takes the other dim's stride (a padded input exactly one window long has one
    window at any stride)."""
    out_shape = local_shapes(ctx, layouts)[0]
    in_shape = ctx.b.shape_of(ref)
    strides = list(ctx.node.attr("strides"))
    pads = list(attrs.get("explicit_paddings") or [0] * (2 * len(in_shape)))
    sizes = {}
    for s in geo.spatial:
        d = s.x_dim
        extent = (s.window - 1) * s.dilation + 1
        read = min(in_shape[d], extent - pads[2 * d])  # x's elements the window reads
        if out_shape[s.y_dim] == 1 and strides[d] > 1 and read > 0:
            sizes[d] = read
            pads[2 * d + 1] = extent - pads[2 * d] - read
            strides[d] = 1
    if not sizes:
        return ref, attrs
    if ctx.node.op == "DepthwiseConv2dNative":
        strides = [max(strides[s.x_dim] for s in geo.spatial) if d in sizes else st
                   for d, st in enumerate(strides)]
    attrs = dict(attrs, strides=strides)
    if any(pads):
        attrs.update(padding="EXPLICIT", explicit_paddings=pads)
    return slice_dims(ctx.b, ref, {}, sizes), attrs


def _avg_counts(ctx, ref, plans):
    """AvgPool with padding divides by the in-bounds elements of each window: the VALID
    average of the zero-padded window times window / count, per dim."""
    b = ctx.b
    dtype = b.graph.dtype(ref)
    for dp in plans:
        s = dp.s
        if s.pad_lo == 0 and s.pad_hi == 0:
            continue
        w = dp.plan["out_shard"]
        j = np.arange(w * dp.k)
        lo = j * s.stride - s.pad_lo
        count = np.clip(np.minimum(lo + s.window, s.n) - np.maximum(lo, 0), 1, None)
        scale = np.where(j < s.out, s.window / count, 1.0)
        if np.all(scale == 1.0):
            continue
        shape = [1] * len(b.shape_of(ref))
        shape[s.y_dim] = w * dp.k
        table = b.const(scale.reshape(shape).astype(dtype.as_numpy_dtype))
        start = affine_start(b, dp.axes, w, 0)
        local = slice_dims(b, table, {s.y_dim: start}, {s.y_dim: w})
        ref = b.op("Mul", [ref, local], b.shape_of(ref), dtype, T=dtype)
    return ref


# ------------------------------------------------------------------------ gradients

@op_family({"Conv2DBackpropFilter": (0, "out", 2, ("batch",), False, True),
            "DepthwiseConv2dNativeBackpropFilter": (0, "out", 2, ("batch",), True, True),
            "Conv3DBackpropFilterV2": (0, "out", 2, ("batch",), False, False)},
           windowed.conv_family, multiply_adds=filter_gradient_multiply_adds,
           traits=[CONVOLUTION])
def backprop_filter(ctx, operands, layouts):
    """Conv2DBackpropFilter / Conv3DBackpropFilterV2 (x, filter_sizes, dy) and the
    depthwise one with split spatial dims: x windowed
    like the forward conv, dy local; the result is partial over the spatial axes."""
    params = ctx.rule.params
    x0, dy = operands[0], operands[2]
    if 0 in x0.shape or 0 in dy.shape:
        return no_products(ctx, layouts)
    geo = params.geometry
    sizes = local_shapes(ctx, layouts)[0]
    size_ref = ctx.b.const(np.asarray(sizes, np.int32))
    if not any(dy.layout.dims[s.y_dim] for s in geo.spatial):
        refs = masked_refs(ctx, operands)
        refs[1] = size_ref
        return replay(ctx, operands, layouts, refs=refs)
    b = ctx.b
    x, plans = prepare_input(ctx, operands, 0, geo, lambda s: dy.layout.dims[s.y_dim])
    plans, attrs = _local_padding(params.explicit_padding, plans)
    refs = masked_refs(ctx, [x, operands[1], dy])  # padding of x and dy -> zeros
    window = extend_and_slice(b, refs[0], plans, lambda dp: dp.s.x_dim)
    for dp in plans:
        if dp.k > 1:
            window = _mask_unread(b, window, dp)
    out = replay(ctx, operands, layouts, attrs=attrs, refs=[window, size_ref, refs[2]])[0]
    # the shard holding some but not all of a dim's windows (uneven split) sums over its
    # real windows only: its padded ones read x elements real ones read too, and
    # 0 (dy's padding) * Inf would be NaN (fuzzer, seed 20 #6689); one op per set of
    # such dims, the shard picks its own
    cut = [dp for dp in plans if _part_windows(dp)]
    for subset in itertools.chain.from_iterable(
            itertools.combinations(cut, m) for m in range(1, len(cut) + 1)):
        part_x, part_dy, here = window, refs[2], None
        for dp in subset:
            s, part = dp.s, _part_windows(dp)
            extent = (s.window - 1) * s.dilation + 1
            part_x = slice_dims(b, part_x, {}, {s.x_dim: (part - 1) * s.stride + extent})
            part_dy = slice_dims(b, part_dy, {}, {s.y_dim: part})
        for dp in cut:
            table = [i == dp.s.out // dp.plan["out_shard"] for i in range(dp.k)]
            on = b.op("Equal", [per_shard(b, dp.axes, table),
                                b.const(np.int32(dp in subset))], (), tf.bool, T=tf.int32)
            here = on if here is None else b.op("LogicalAnd", [here, on], (), tf.bool)
        part_out = replay(ctx, operands, layouts, attrs=attrs,
                          refs=[part_x, size_ref, part_dy])[0]
        out = b.op("SelectV2", [here, part_out, out], b.shape_of(out), b.graph.dtype(out),
                   T=b.graph.dtype(out))
    return [out]


def _part_windows(dp):
    """The real windows of the shard holding some but not all of its W windows of split
    dim `dp` when that shard's padded windows read x elements a real one reads (windows
    overlap); else 0."""
    s, per = dp.s, dp.plan["out_shard"]
    if dp.k == 1 or (s.window - 1) * s.dilation + 1 <= s.stride:
        return 0
    return s.out % per


def _mask_unread(b, window, dp):
    """The window of x with the elements no real window of this shard reads set to 0:
    they meet only dy's padding (zeros), and 0 * Inf would be NaN (fuzzer, seed 46
    #400: a shard of padding read its neighbour's Inf through the halo)."""
    s, per = dp.s, dp.plan["out_shard"]
    extent = (s.window - 1) * s.dilation + 1
    real = [min(max(s.out - i * per, 0), per) for i in range(dp.k)]
    read = [(r - 1) * s.stride + extent if r else 0 for r in real]
    if min(read) >= b.shape_of(window)[s.x_dim]:
        return window
    return mask_outside(b, window, s.x_dim, 0, per_shard(b, dp.axes, read), 0)


class _TransposedDim:
    """Plans of one spatial dim of a transposed op (its result is the forward input):
    `plan` for the window operands (dy, and y for MaxPoolGrad), `x_plan` for the
    forward input a MaxPoolGrad also reads. Whole when any operand does not split the
    dim or a halo is larger than a neighbour's block."""

    def __init__(self, mesh, spatial, axes, whole, with_x):
        self.s = spatial
        self.axes = tuple(axes)
        self.k = mesh.axes_size(self.axes)
        self.whole = self.k > 1 and whole
        self._make(with_x)
        if self.k > 1 and not self.whole and not (
                halos_worth_it(self.plan, self.k)
                and (self.x_plan is None or halos_worth_it(self.x_plan, self.k))):
            self.whole = True  # halos spanning many blocks: gather the dim whole
            self._make(with_x)

    def _make(self, with_x):
        s = self.s
        self.plan = _halo.transposed_plan(s.n, s.out, s.window, s.stride, s.dilation,
                                          s.pad_lo, self.k, self.whole)
        self.x_plan = None
        if with_x:
            self.x_plan = _halo.range_plan(self.plan["first"], self.plan["local_size"],
                                           s.n, self.k, self.whole, self.plan["useful"])

    @property
    def split(self):
        return self.k > 1 and not self.whole


class _View:
    """A _TransposedDim seen through one of its plans (what extend_and_slice reads)."""

    def __init__(self, dim, plan):
        self.s, self.axes, self.k, self.split, self.plan = (dim.s, dim.axes, dim.k,
                                                            dim.split, plan)


@op_family({"Conv2DBackpropInput": ("out", 1, 2, ("O",), False, True),
            "DepthwiseConv2dNativeBackpropInput": ("out", 1, 2, ("O",), True, True),
            "Conv3DBackpropInputV2": ("out", 1, 2, ("O",), False, False)},
           windowed.conv_family, multiply_adds=input_gradient_multiply_adds,
           traits=[CONVOLUTION])
@op_family({"MaxPoolGrad": True, "MaxPool3DGrad": False}, windowed.max_pool_grad)
@op_family(["AvgPoolGrad", "AvgPool3DGrad"], windowed.avg_pool_grad)
def transposed(ctx, operands, layouts):
    """Conv2DBackpropInput, Conv3DBackpropInputV2, AvgPoolGrad, MaxPoolGrad (and the 3-D
    pool gradients) with split spatial dims: halos of
    the window operands (every forward window touching this device's block of the
    result), the local op with VALID padding, then this device's block sliced out."""
    node = ctx.node
    rank = len(node.out_shapes[0])
    if 0 in node.out_shapes[0] or any(0 in x.shape for x in operands
                                      if len(x.shape) == rank):
        return no_products(ctx, layouts)
    b = ctx.b
    params = ctx.rule.params
    shape_input, window_inputs = params.shape_input, params.window_inputs
    x_input = params.forward_input
    out_layout = layouts[0]
    geo = params.geometry
    sizes = list(local_shapes(ctx, layouts)[0])
    if not any(out_layout.dims[s.x_dim] for s in geo.spatial):
        refs = masked_refs(ctx, operands)
        if shape_input is not None:
            refs[shape_input] = b.const(np.asarray(sizes, index_dtype(ctx, "Tshape")))
        return replay(ctx, operands, layouts, refs=refs)
    dims = []
    for s in geo.spatial:
        axes = out_layout.dims[s.x_dim]
        whole = any(not ctx.inputs[i].layout.dims[s.y_dim] for i in window_inputs)
        dims.append(_TransposedDim(ctx.mesh, s, axes, whole, x_input is not None))
    dims, attrs = _local_padding(params.explicit_padding, dims)
    if x_input is not None and not _low_edge_clippable(params, dims):
        return _max_pool_grad_whole(ctx, layouts)
    ops = list(operands)
    for i in window_inputs + ((x_input,) if x_input is not None else ()):
        layout = ops[i].layout
        wanted = Layout(tuple(() if any(dp.whole and dp.s.x_dim == d for dp in dims) else a
                              for d, a in enumerate(layout.dims)),
                        layout.partial, layout.reduce_op)
        if wanted != layout:
            ops[i] = ctx.reshard(ctx.inputs[i], wanted)
    refs = masked_refs(ctx, ops)  # split out-channels (Conv2DBackpropInput) -> zeros
    views = [_View(dp, dp.plan) for dp in dims]
    for i in window_inputs:
        op = ops[i]
        uneven = [dp.s.y_dim for dp in dims if dp.split and dp.s.out % dp.k]
        ref = (mask_padding(b, Local(refs[i], op.layout, op.shape, op.dtype), uneven,
                            identity_of("sum", op.dtype)) if uneven else refs[i])
        refs[i] = extend_and_slice(b, ref, views, lambda v: v.s.y_dim)
    if params.pooling == "avg":
        refs[1] = _avg_grad_scale(b, refs[1], dims)
    if x_input is not None:
        x = ops[x_input]
        ref = extend_and_slice(b, refs[x_input], [_View(dp, dp.x_plan) for dp in dims],
                               lambda v: v.s.x_dim)
        fill = identity_of("max", x.dtype)
        for dp in dims:
            if dp.s.pad_lo > 0 or dp.s.pad_hi > 0 or (dp.split and dp.s.n % dp.k):
                start = per_shard(b, dp.axes, dp.plan["first"], None)
                ref = mask_outside(b, ref, dp.s.x_dim, start, dp.s.n, fill)
        refs[x_input] = ref
    local_sizes = list(sizes)
    for dp in dims:
        local_sizes[dp.s.x_dim] = dp.plan["local_size"]
    if shape_input is not None:
        refs[shape_input] = b.const(np.asarray(local_sizes, index_dtype(ctx, "Tshape")))
    dtype = node.out_dtypes[0]
    full = b.replay(node, refs, [tuple(local_sizes)], [dtype], attrs)[0]
    if x_input is not None:
        full = _clip_low_edge(b, node, refs, x_input, dims, attrs, full, local_sizes)
    starts, block, pads = {}, {}, {}
    for dp in dims:
        d, p = dp.s.x_dim, dp.plan
        pads[d] = (p["lead"], p["local_padded"] - p["local_size"] - p["lead"])
        starts[d] = per_shard(b, dp.axes, p["post"], p["useful"])
        block[d] = sizes[d]
    return [slice_dims(b, pad_dims(b, full, pads), starts, block)]


def _low_edge_clippable(params, dims):
    """Whether _clip_low_edge makes a max-pool gradient's windows exact: TF's kernel
    gives a window's gradient to the first element it visits unless a later one is
    larger, so a NaN first in TF's window (clipped to x) takes it, but not behind a
    -inf element padding x in front (seed 28 #7859). Exact when at most one windowed
    dim is padded in front, the op takes explicit padding, and the devices' windows
    start inside x or all the same distance before it."""
    padded = [dp for dp in dims if dp.s.pad_lo > 0]
    if not padded:
        return True
    if len(padded) > 1 or not params.explicit_padding:
        return False
    return len(set(_front_fill(padded[0]).tolist()) - {0}) <= 1


def _front_fill(dp):
    """Per shard: how many elements before x its window of x starts (0 inside x)."""
    return np.maximum(0, -np.asarray(dp.plan["first"]))


def _clip_low_edge(b, node, refs, x_input, dims, attrs, full, local_sizes):
    """A max-pool gradient's local result `full` (run on -inf padded windows) where the
    device's window starts inside x; where it starts `fill` elements before x, the op
    run on the window without them and with `fill` of its own explicit padding
    instead (the same windows), which TF clips as on one device (see
    _low_edge_clippable)."""
    dp = next((dp for dp in dims if dp.s.pad_lo > 0), None)  # at most one: clippable
    if dp is None:
        return full
    d, fills = dp.s.x_dim, _front_fill(dp)
    fill = int(fills.max())
    at_edge = per_shard(b, dp.axes, (fills > 0).astype(int))
    if fill == 0 or at_edge == 0:
        return full
    dtype = node.out_dtypes[0]
    shape = list(local_sizes)
    shape[d] -= fill
    edge_refs = list(refs)
    edge_refs[x_input] = slice_dims(b, refs[x_input], {d: fill}, {d: shape[d]})
    pads = list(attrs.get("explicit_paddings") or [0] * (2 * len(shape)))
    pads[2 * d] = fill
    edge = b.replay(node, edge_refs, [tuple(shape)], [dtype],
                    {"padding": "EXPLICIT", "explicit_paddings": pads})[0]
    edge = pad_dims(b, edge, {d: (fill, 0)})
    if at_edge == 1:
        return edge
    cond = b.op("Greater", [at_edge, b.const(np.int32(0))], (), tf.bool, T=tf.int32)
    return b.op("SelectV2", [cond, edge, full], b.shape_of(full), dtype, T=dtype)


def _max_pool_grad_whole(ctx, layouts):
    """The max-pool gradient whole on every device, with the op's own padding (where
    _low_edge_clippable says its windows cannot be made exact), then this device's
    block of it; warns naming the op."""
    log.warning("gspmd_tf: op %s (%s) has windowed dims padded in front that its halos "
                "cannot reproduce exactly; it runs whole on every device (TF gives a "
                "window's gradient to a NaN that comes first in it, not behind padding)",
                ctx.node.name, ctx.node.op)
    whole = [ctx.reshard(x, Layout.replicated(len(x.shape))) for x in ctx.inputs]
    return whole_then_sliced(ctx, whole, layouts)


def _avg_grad_scale(b, ref, dims):
    """AvgPool with padding divided each window by its in-bounds count: scale the
    window operand (dy) by window / count before the local VALID AvgPoolGrad."""
    dtype = b.graph.dtype(ref)
    for dp in dims:
        s, p = dp.s, dp.plan
        if s.pad_lo == 0 and s.pad_hi == 0:
            continue
        starts = p["start"]
        lo = int(starts.min())
        j = np.arange(lo, int(starts.max()) + p["span"])
        first = j * s.stride - s.pad_lo
        count = np.clip(np.minimum(first + s.window, s.n) - np.maximum(first, 0), 1, None)
        scale = np.where((j >= 0) & (j < s.out), s.window / count, 0.0)
        shape = [1] * len(b.shape_of(ref))
        shape[s.y_dim] = len(j)
        table = b.const(scale.reshape(shape).astype(dtype.as_numpy_dtype))
        start = per_shard(b, dp.axes, starts - lo, p["useful"])
        local = slice_dims(b, table, {s.y_dim: start}, {s.y_dim: p["span"]})
        ref = b.op("Mul", [ref, local], b.shape_of(ref), dtype, T=dtype)
    return ref
