"""Handlers of windowed ops split along spatial dims: halo exchange.

The method of GSPMD's spatially partitioned convolutions (and XLA's
ReshardAsWindowedInput): a spatial dim of the input x split over mesh axes A gives a
result dim split over A, shard i computing the W = ceil(windows / k) windows
[i*W, (i+1)*W). Those windows read a contiguous range of x that sticks out of the
device's own block by a few elements on each side (the halos). Per split dim:

  1. every device sends the last `halo_lo` elements of its block to the next shard and
     the first `halo_hi` elements to the previous one (two collective-permutes with
     (source, target) pairs from mesh.groups(A); the first/last shards receive zeros,
     which are the zero padding of the global edges);
  2. concat [left halo, own block, right halo], zero-padded to the largest extension
     any shard needs (gspmd_tf._halo computes the sizes and offsets);
  3. slice the `span` elements this shard's windows read: a static slice when every
     shard starts at the same offset, else a dynamic slice whose start comes from a
     constant per-shard table indexed by the device's shard index;
  4. where the window reaches past the global edges, elements outside [0, n) are set to
     the op's padding value (0 for convolutions, -inf for max pooling); this also
     covers the padded tail of uneven shards.
The local op then runs with VALID padding on the window and yields exactly its W
results. Dims that are not split keep the op's own padding (EXPLICIT padding with those
dims' amounts) where the op takes explicit padding, else go through the same steps with
one shard (a plain pad). A halo longer than a neighbour's block (tiny shards, large
windows, strided windows over uneven shards, whose halos grow with the shard index)
takes one permute per block it spans, as XLA's ExchangeHalo does; when that would take
as many steps or move as much as gathering the dim, the dim is gathered whole instead
and each device slices its windows from the padded whole dim (correct, slower). A dim
whose input is not split (only the output is) is sliced the same way, with no
collective. A conv's weight gradient reuses the windows its forward pass built.

Gradients: Conv2DBackpropFilter (and the depthwise one) reads x through the same
windows (its spatial factor is REDUCE: each device's sum is partial). The input
gradients, Conv2DBackpropInput, DepthwiseConv2dNativeBackpropInput, AvgPoolGrad and
MaxPoolGrad, exchange halos of dy (every forward window reaching this device's block of
the result: gspmd_tf._halo.transposed_plan), run the local op with VALID padding and
slice their block out of its result; MaxPoolGrad also exchanges halos of the forward
input those windows read (set to -inf outside [0, n)), AvgPoolGrad pre-scales dy by
window / in-bounds count for padded windows.
"""

from __future__ import annotations

import itertools

import numpy as np
import tensorflow as tf

from gspmd_tf import _halo
from gspmd_tf.layout import Layout
from gspmd_tf.propagation import windowed
from gspmd_tf.registry import op_family
from gspmd_tf.spmd.handlers.basic import local_shapes, masked_refs, no_products, replay
from gspmd_tf.spmd.local_ops import identity_of, mask_padding, replace_dim
from gspmd_tf.spmd.program import Local
from gspmd_tf.spmd.reshard import exchange_halo


# ------------------------------------------------------------------------ local pieces

def _pad(b, ref, dim, lo, hi):
    """Zero elements before/after `dim`."""
    if lo == 0 and hi == 0:
        return ref
    shape = b.shape_of(ref)
    paddings = np.zeros((len(shape), 2), np.int32)
    paddings[dim] = (lo, hi)
    dtype = b.graph.dtype(ref)
    return b.op("Pad", [ref, b.const(paddings)], replace_dim(shape, dim, shape[dim] + lo + hi),
                dtype, T=dtype, Tpaddings=tf.int32)


def _halos_worth_it(plan, k):
    """Exchange halos (several hops when a halo is longer than a neighbour's block)
    while that takes fewer steps and moves less than gathering the dim whole (k - 1
    blocks in k - 1 ring steps); else gather."""
    if plan["feasible"]:
        return True
    hops = plan["hops_lo"] + plan["hops_hi"]
    return hops < k - 1 and plan["halo_lo"] + plan["halo_hi"] < (k - 1) * plan["own"]


def _per_shard(b, axes, table, useful=None):
    """int32 scalar: table[shard index along axes] (a constant when nothing is split or
    the first `useful` entries agree: the other shards compute only padding)."""
    table = np.asarray(table, np.int64)
    if not axes or np.all(table[:useful] == table[0]):
        return int(table[0])
    index = b.shard_index(axes)
    return b.op("GatherV2", [b.const(table.astype(np.int32)), index, b.const(np.int32(0))],
                (), tf.int32, Tparams=tf.int32, Tindices=tf.int32, Taxis=tf.int32,
                batch_dims=0)


def _slice(b, ref, starts, sizes):
    """ref[start:start+size] on the dims in `starts` (python ints or int32 scalars)."""
    shape = b.shape_of(ref)
    out = tuple(sizes.get(d, s) for d, s in enumerate(shape))
    if all(isinstance(starts.get(d, 0), int) for d in range(len(shape))):
        if out == shape:
            return ref
        begin = b.const(np.asarray([starts.get(d, 0) for d in range(len(shape))], np.int32))
    else:
        parts = [starts.get(d, 0) for d in range(len(shape))]
        parts = [b.const(np.int32(p)) if isinstance(p, int) else p for p in parts]
        begin = b.op("Pack", parts, (len(shape),), tf.int32, N=len(shape), T=tf.int32,
                     axis=0)
    dtype = b.graph.dtype(ref)
    return b.op("Slice", [ref, begin, b.const(np.asarray(out, np.int32))], out, dtype,
                T=dtype, Index=tf.int32)


def _affine_start(b, axes, step, constant):
    """int32 scalar shard_index(axes) * step + constant (python int when unsplit)."""
    if not axes or step == 0:
        return int(constant)
    index = b.shard_index(axes)
    scaled = b.op("Mul", [index, b.const(np.int32(step))], (), tf.int32, T=tf.int32)
    return b.op("AddV2", [scaled, b.const(np.int32(constant))], (), tf.int32, T=tf.int32)


def _mask_outside(b, ref, dim, start, n, fill):
    """Elements of `ref` along `dim` whose global index (start + position) is outside
    [0, n) set to `fill` (start and n: python ints or int32 scalars)."""
    shape = b.shape_of(ref)
    bshape = [1] * len(shape)
    bshape[dim] = shape[dim]
    iota = b.const(np.arange(shape[dim], dtype=np.int32).reshape(bshape))
    if not isinstance(start, int):
        index = b.op("AddV2", [iota, start], tuple(bshape), tf.int32, T=tf.int32)
    else:
        index = b.const((np.arange(shape[dim]) + start).astype(np.int32).reshape(bshape))
    low = b.op("GreaterEqual", [index, b.const(np.int32(0))], tuple(bshape), tf.bool,
               T=tf.int32)
    high = b.op("Less", [index, b.const(np.int32(n)) if isinstance(n, int) else n],
                tuple(bshape), tf.bool, T=tf.int32)
    valid = b.op("LogicalAnd", [low, high], tuple(bshape), tf.bool)
    dtype = b.graph.dtype(ref)
    return b.op("SelectV2", [valid, ref, b.const(np.asarray(fill, dtype.as_numpy_dtype))],
                shape, dtype, T=dtype)


# ------------------------------------------------------------------------ plans

class _DimPlan:
    """How one spatial dim is windowed: its split axes, the halo plan, the mode."""

    def __init__(self, mesh, spatial, axes, input_axes):
        self.s = spatial
        self.axes = tuple(axes)
        k = mesh.axes_size(self.axes)
        self.k = k
        # a dim the input does not split is taken whole (no exchange, just padding)
        self.whole = k > 1 and not input_axes
        self.plan = self._make(k, self.whole)
        if k > 1 and not _halos_worth_it(self.plan, k):
            # halos spanning many blocks: gather the dim whole instead
            self.whole = True
            self.plan = self._make(k, True)

    def _make(self, k, whole):
        s = self.s
        return _halo.window_plan(s.n, s.window, s.stride, s.dilation, s.pad_lo, s.pad_hi,
                                 k, whole)

    @property
    def split(self):
        """True when halos come from neighbours (the dim stays split)."""
        return self.k > 1 and not self.whole


def _plan_key(dp, d):
    p = dp.plan
    return (d, dp.axes, dp.split, p["ext_lo"], p["ext_hi"], p["halo_lo"], p["halo_hi"],
            p["span"], tuple(p["offset"].tolist()), p["useful"])


def _extend_and_slice(b, ref, dims_plans, dim_of):
    """Extend each planned dim of local `ref` (halo exchange or padding) and slice the
    span each shard reads. `dim_of(plan)` gives the tensor dim of a plan."""
    # (tensor, plans) -> window, so that a conv's weight gradient reuses the halos its
    # forward pass exchanged
    cache = b.memo.setdefault("conv_windows", {})
    key = (ref, tuple(_plan_key(dp, dim_of(dp)) for dp in dims_plans))
    if key not in cache:
        cache[key] = _extend_and_slice_uncached(b, ref, dims_plans, dim_of)
    return cache[key]


def _extend_and_slice_uncached(b, ref, dims_plans, dim_of):
    starts, sizes = {}, {}
    for dp in dims_plans:
        p = dp.plan
        d = dim_of(dp)
        if dp.split:
            ref = exchange_halo(b, ref, d, dp.axes, p["halo_lo"], p["halo_hi"])
            ref = _pad(b, ref, d, p["ext_lo"] - p["halo_lo"], p["ext_hi"] - p["halo_hi"])
        else:
            ref = _pad(b, ref, d, p["ext_lo"], p["ext_hi"])
        starts[d] = _offset(b, dp)
        sizes[d] = p["span"]
    return _slice(b, ref, starts, sizes)


def _offset(b, dp):
    """Start of shard's span in the extended tensor (python int or int32 scalar)."""
    return _per_shard(b, dp.axes, dp.plan["offset"], dp.plan["useful"])


# ------------------------------------------------------------------------ forward ops

def _prepare_input(ctx, operands, index, geo, axes_of):
    """The operand `index` (x) with every spatial dim either split like its windows or
    whole, and the per-dim plans."""
    x = operands[index]
    original = ctx.inputs[index]
    plans = []
    dims = list(x.layout.dims)
    for s in geo.spatial:
        axes = axes_of(s)
        dp = _DimPlan(ctx.mesh, s, axes, original.layout.dims[s.x_dim] if axes else ())
        if dp.whole:
            dims[s.x_dim] = ()
        plans.append(dp)
    wanted = Layout(tuple(dims), x.layout.partial, x.layout.reduce_op)
    if wanted != x.layout:
        x = ctx.reshard(original, wanted)
    return x, plans


def _local_padding(explicit_padding, plans):
    """Split off the dims the local op pads itself: (plans to window, padding attrs).
    Ops that take per-dim explicit padding keep their own padding on unsplit spatial
    dims (no copy, no extra work); the others pad unsplit dims like split ones."""
    if not explicit_padding:
        return plans, {"padding": "VALID"}
    kept = [dp for dp in plans if dp.k > 1]
    return kept, _padding_attrs([dp.s for dp in plans if dp.k == 1])


def _padding_attrs(spatial):
    """Padding attrs of an op that takes explicit padding, padding the SpatialDims
    `spatial` by their own amounts (SAME worked out) and no other dim."""
    pads = [0] * 8
    for s in spatial:
        pads[2 * s.x_dim], pads[2 * s.x_dim + 1] = s.pad_lo, s.pad_hi
    if any(pads):
        return {"padding": "EXPLICIT", "explicit_paddings": pads}
    return {"padding": "VALID", "explicit_paddings": []}


def _needs_mask(dp, fill_zero):
    """Whether the window of a dim must be masked outside [0, n)."""
    s = dp.s
    if s.pad_lo <= 0 and s.pad_hi <= 0:
        return False  # windows of real results never leave [0, n)
    if not fill_zero:
        return True   # edge zeros and padding must become the op's padding value
    # zeros at the edges are right; only the padded tail of uneven blocks may be garbage
    return dp.split and s.n % dp.k != 0


# conv_family parameters: positions of x, w, y (an input index or "out"), the parts that
# are REDUCE factors, depthwise
@op_family({"Conv2D": (0, 1, "out", ("C",), False),
            "DepthwiseConv2dNative": (0, 1, "out", (), True)}, windowed.conv_family)
# pool parameters: pooling, explicit padding
@op_family({"MaxPool": ("max", True), "AvgPool": ("avg", False)}, windowed.pool)
def windowed_forward(ctx, operands, layouts):
    """Conv2D, DepthwiseConv2dNative, MaxPool, AvgPool with split spatial dims."""
    node = ctx.node
    params = ctx.rule.params
    if params.pooling is None and (0 in operands[0].shape or 0 in operands[1].shape):
        return no_products(ctx, layouts)
    y_layout = layouts[0]
    geo = params.geometry
    if not any(y_layout.dims[s.y_dim] for s in geo.spatial):
        if params.explicit_padding:
            attrs = _padding_attrs(geo.spatial)  # SAME as amounts: windows can be cut
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
    x, plans = _prepare_input(ctx, operands, 0, geo, lambda s: y_layout.dims[s.y_dim])
    plans, attrs = _local_padding(params.explicit_padding, plans)
    refs = masked_refs(ctx, [x] + list(operands[1:]))  # split in-channels -> zeros
    reduce = "max" if params.pooling == "max" else "sum"  # its identity pads the window
    fill = identity_of(reduce, x.dtype)
    window = _extend_and_slice(b, refs[0], plans, lambda dp: dp.s.x_dim)
    for dp in plans:
        if _needs_mask(dp, reduce == "sum"):
            start = _affine_start(b, dp.axes, dp.plan["out_shard"] * dp.s.stride,
                                  -dp.s.pad_lo)
            window = _mask_outside(b, window, dp.s.x_dim, start, dp.s.n, fill)
    window, attrs = _one_window_unstrided(ctx, geo, window, attrs, layouts)
    out = replay(ctx, operands, layouts, attrs=attrs, refs=[window] + refs[1:])
    if params.pooling == "avg":
        out = [_avg_counts(ctx, out[0], plans)]
    return out


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
    pads = list(attrs.get("explicit_paddings") or [0] * 8)
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
    return _slice(ctx.b, ref, {}, sizes), attrs


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
        start = _affine_start(b, dp.axes, w, 0)
        local = _slice(b, table, {s.y_dim: start}, {s.y_dim: w})
        ref = b.op("Mul", [ref, local], b.shape_of(ref), dtype, T=dtype)
    return ref


# ------------------------------------------------------------------------ gradients

@op_family({"Conv2DBackpropFilter": (0, "out", 2, ("batch",), False),
            "DepthwiseConv2dNativeBackpropFilter": (0, "out", 2, ("batch",), True)},
           windowed.conv_family)
def backprop_filter(ctx, operands, layouts):
    """Conv2DBackpropFilter(x, filter_sizes, dy) with split spatial dims: x windowed
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
    x, plans = _prepare_input(ctx, operands, 0, geo, lambda s: dy.layout.dims[s.y_dim])
    plans, attrs = _local_padding(params.explicit_padding, plans)
    refs = masked_refs(ctx, [x, operands[1], dy])  # padding of x and dy -> zeros
    window = _extend_and_slice(b, refs[0], plans, lambda dp: dp.s.x_dim)
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
            part_x = _slice(b, part_x, {}, {s.x_dim: (part - 1) * s.stride + extent})
            part_dy = _slice(b, part_dy, {}, {s.y_dim: part})
        for dp in cut:
            table = [i == dp.s.out // dp.plan["out_shard"] for i in range(dp.k)]
            on = b.op("Equal", [_per_shard(b, dp.axes, table),
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
    return _mask_outside(b, window, s.x_dim, 0, _per_shard(b, dp.axes, read), 0)


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
                _halos_worth_it(self.plan, self.k)
                and (self.x_plan is None or _halos_worth_it(self.x_plan, self.k))):
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
    """A _TransposedDim seen through one of its plans (what _extend_and_slice reads)."""

    def __init__(self, dim, plan):
        self.s, self.axes, self.k, self.split, self.plan = (dim.s, dim.axes, dim.k,
                                                            dim.split, plan)


@op_family({"Conv2DBackpropInput": ("out", 1, 2, ("O",), False),
            "DepthwiseConv2dNativeBackpropInput": ("out", 1, 2, ("O",), True)},
           windowed.conv_family)
@op_family("MaxPoolGrad", windowed.max_pool_grad)
@op_family("AvgPoolGrad", windowed.avg_pool_grad)
def transposed(ctx, operands, layouts):
    """Conv2DBackpropInput, AvgPoolGrad, MaxPoolGrad with split spatial dims: halos of
    the window operands (every forward window touching this device's block of the
    result), the local op with VALID padding, then this device's block sliced out."""
    node = ctx.node
    if 0 in node.out_shapes[0] or any(0 in x.shape for x in operands if len(x.shape) == 4):
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
            refs[shape_input] = b.const(np.asarray(sizes, np.int32))
        return replay(ctx, operands, layouts, refs=refs)
    dims = []
    for s in geo.spatial:
        axes = out_layout.dims[s.x_dim]
        whole = any(not ctx.inputs[i].layout.dims[s.y_dim] for i in window_inputs)
        dims.append(_TransposedDim(ctx.mesh, s, axes, whole, x_input is not None))
    dims, attrs = _local_padding(params.explicit_padding, dims)
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
        refs[i] = _extend_and_slice(b, ref, views, lambda v: v.s.y_dim)
    if params.pooling == "avg":
        refs[1] = _avg_grad_scale(b, refs[1], dims)
    if x_input is not None:
        x = ops[x_input]
        ref = _extend_and_slice(b, refs[x_input], [_View(dp, dp.x_plan) for dp in dims],
                                lambda v: v.s.x_dim)
        fill = identity_of("max", x.dtype)
        for dp in dims:
            if dp.s.pad_lo > 0 or dp.s.pad_hi > 0 or (dp.split and dp.s.n % dp.k):
                start = _per_shard(b, dp.axes, dp.plan["first"], None)
                ref = _mask_outside(b, ref, dp.s.x_dim, start, dp.s.n, fill)
        refs[x_input] = ref
    local_sizes = list(sizes)
    for dp in dims:
        local_sizes[dp.s.x_dim] = dp.plan["local_size"]
    if shape_input is not None:
        refs[shape_input] = b.const(np.asarray(local_sizes, np.int32))
    dtype = node.out_dtypes[0]
    full = b.replay(node, refs, [tuple(local_sizes)], [dtype], attrs)[0]
    starts, block = {}, {}
    for dp in dims:
        d, p = dp.s.x_dim, dp.plan
        full = _pad(b, full, d, p["lead"], p["local_padded"] - p["local_size"] - p["lead"])
        starts[d] = _per_shard(b, dp.axes, p["post"], p["useful"])
        block[d] = sizes[d]
    return [_slice(b, full, starts, block)]


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
        start = _per_shard(b, dp.axes, starts - lo, p["useful"])
        local = _slice(b, table, {s.y_dim: start}, {s.y_dim: p["span"]})
        ref = b.op("Mul", [ref, local], b.shape_of(ref), dtype, T=dtype)
    return ref
