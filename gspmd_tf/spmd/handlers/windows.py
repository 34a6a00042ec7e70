"""Windows of split dims: the halo exchange shared by every windowed op handler.

A dim of an op's result split over mesh axes A in blocks of W elements, each result
element reading a window of the operand (a convolution's or pooling's spatial dims
(conv.py), a slice's or pad's dim (slicing.py)): shard i's W results read a contiguous
range of the operand that sticks out of the device's own block by a few elements on
each side (the halos). Per split dim (DimPlan, gspmd_tf._halo computes the sizes):

  1. every device sends the last `halo_lo` elements of its block to the next shard and
     the first `halo_hi` elements to the previous one (collective-permutes with
     (source, target) pairs from mesh.groups(A): reshard.exchange_halo; the first/last
     shards receive zeros, which are the zero padding of the global edges);
  2. concat [left halo, own block, right halo], zero-padded to the largest extension
     any shard needs;
  3. slice the `span` elements this shard's windows read: a static slice when every
     shard starts at the same offset, else a dynamic slice whose start comes from a
     constant per-shard table indexed by the device's shard index;
  4. where the window reaches past the global edges, elements outside [0, n) are set to
     the op's padding value (mask_edges); this also covers the padded tail of uneven
     shards.

A halo longer than a neighbour's block takes one permute per block it spans; when that
would take as many steps or move as much as gathering the dim, the dim is gathered
whole instead and each device slices its windows from the padded whole dim. A plain
slice (window 1, stride 1, no padding) whose blocks lie in other shards' blocks further
away is re-blocked instead where that moves less (reshard.reblock: one permute per
distance between a block and the blocks it reads, of only the part read). A dim whose
input is not split (only the output is) is sliced the same way, with no collective.
Everything here works per dim, so it serves any number of spatial dims.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf import _halo
from gspmd_tf.layout import Layout, ceil_div
from gspmd_tf.spmd.handlers.basic import masked_refs
from gspmd_tf.spmd.local_ops import per_shard
from gspmd_tf.spmd.reshard import exchange_halo, reblock, reblock_windows


def pad_dims(b, ref, amounts):
    """Zero elements before/after dims: `amounts` {dim: (lo, hi)}, in one op.

    A PadV2, not a Pad: TF's graph optimizer (the oneDNN remapper) fuses a Pad into the
    Conv3D it feeds, and when that Pad's input is another Pad the fused op computes a
    wrong shape and values (a Pad of the user's program, then ours)."""
    if not any(lo or hi for lo, hi in amounts.values()):
        return ref
    shape = list(b.shape_of(ref))
    paddings = np.zeros((len(shape), 2), np.int32)
    for dim, (lo, hi) in amounts.items():
        paddings[dim] = (lo, hi)
        shape[dim] += lo + hi
    dtype = b.graph.dtype(ref)
    return b.op("PadV2", [ref, b.const(paddings), b.const(np.zeros((), dtype.as_numpy_dtype))],
                tuple(shape), dtype, T=dtype, Tpaddings=tf.int32)


def halos_worth_it(plan, k):
    """Exchange halos (several hops when a halo is longer than a neighbour's block)
    while that takes fewer steps and moves less than gathering the dim whole (k - 1
    blocks in k - 1 ring steps); else gather."""
    if plan["feasible"]:
        return True
    hops = plan["hops_lo"] + plan["hops_hi"]
    return hops < k - 1 and plan["halo_lo"] + plan["halo_hi"] < (k - 1) * plan["own"]


def slice_dims(b, ref, starts, sizes):
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


def affine_start(b, axes, step, constant):
    """int32 scalar shard_index(axes) * step + constant (python int when unsplit)."""
    if not axes or step == 0:
        return int(constant)
    index = b.shard_index(axes)
    scaled = b.op("Mul", [index, b.const(np.int32(step))], (), tf.int32, T=tf.int32)
    return b.op("AddV2", [scaled, b.const(np.int32(constant))], (), tf.int32, T=tf.int32)


def mask_outside(b, ref, dim, start, n, fill):
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

class DimPlan:
    """How one spatial dim is windowed: its split axes, the halo plan, the mode."""

    def __init__(self, mesh, spatial, axes, input_axes):
        self.s = spatial
        self.axes = tuple(axes)
        k = mesh.axes_size(self.axes)
        self.k = k
        # a dim the input does not split is taken whole (no exchange, just padding)
        self.whole = k > 1 and not input_axes
        self.plan = self._make(k, self.whole)
        if k > 1 and not halos_worth_it(self.plan, k):
            # halos spanning many blocks: gather the dim whole instead
            self.whole = True
            self.plan = self._make(k, True)
        # a plain slice whose blocks lie in a few other shards' blocks (e.g. a
        # block-aligned half of the dim): each shard's block re-blocked from them by
        # collective-permutes (reshard.reblock), as XLA does, where that moves fewer
        # elements than the halos or the gather
        self.reblocked = k > 1 and bool(input_axes) and _reblock_moves(spatial, k) < (
            (k - 1) * ceil_div(spatial.n, k) if self.whole
            else self.plan["halo_lo"] + self.plan["halo_hi"])
        if self.reblocked:
            self.whole = False

    def _make(self, k, whole):
        s = self.s
        return _halo.window_plan(s.n, s.window, s.stride, s.dilation, s.pad_lo, s.pad_hi,
                                 k, whole)

    @property
    def split(self):
        """True when halos come from neighbours (the dim stays split)."""
        return self.k > 1 and not self.whole


def _reblock_moves(s, k):
    """Elements a device receives when a plain slice (window 1, stride 1, no padding)
    of spatial dim `s` split k ways is re-blocked (reshard.reblock): the longest window
    of each distance but 0; infinite for any other windowed op."""
    if (s.window, s.stride, s.dilation) != (1, 1, 1) or s.pad_lo > 0 or s.pad_hi > 0:
        return float("inf")
    out = s.n + s.pad_lo + s.pad_hi
    windows = reblock_windows(s.n, k, ceil_div(s.n, k), ceil_div(out, k), -s.pad_lo,
                              s.n + s.pad_hi)
    return sum(max(hi - lo for _, _, lo, hi in moves)
               for distance, moves in windows.items() if distance)


def _plan_key(dp, d):
    p = dp.plan
    return (d, dp.axes, dp.split, getattr(dp, "reblocked", False), p["ext_lo"],
            p["ext_hi"], p["halo_lo"], p["halo_hi"], p["span"], tuple(p["offset"].tolist()),
            p["useful"])


def extend_and_slice(b, ref, dims_plans, dim_of):
    """Extend each planned dim of local `ref` (halo exchange or padding) and slice the
    span each shard reads. A plan has `axes`, `split` and `plan` (a gspmd_tf._halo plan:
    DimPlan, or MirrorPad's range plans); `dim_of(plan)` gives its tensor dim."""
    # (tensor, plans) -> window, so that a conv's weight gradient reuses the halos its
    # forward pass exchanged
    cache = b.memo.setdefault("conv_windows", {})
    key = (ref, tuple(_plan_key(dp, dim_of(dp)) for dp in dims_plans))
    if key not in cache:
        cache[key] = _extend_and_slice_uncached(b, ref, dims_plans, dim_of)
    return cache[key]


def _extend_and_slice_uncached(b, ref, dims_plans, dim_of):
    starts, sizes, pads = {}, {}, {}
    for dp in dims_plans:
        p = dp.plan
        d = dim_of(dp)
        if getattr(dp, "reblocked", False):
            s = dp.s
            ref = reblock(b, ref, d, dp.axes, s.n, p["span"], -s.pad_lo, s.n + s.pad_hi)
            continue
        pads[d] = (p["ext_lo"], p["ext_hi"])
        if dp.split:
            ref = exchange_halo(b, ref, d, dp.axes, p["halo_lo"], p["halo_hi"])
            pads[d] = (p["ext_lo"] - p["halo_lo"], p["ext_hi"] - p["halo_hi"])
        starts[d] = _offset(b, dp)
        sizes[d] = p["span"]
    # the zeros after every exchange: a later dim's halos carry the earlier dims' halos
    # (the corners) but not their padding, which is zeros on every device anyway
    return slice_dims(b, pad_dims(b, ref, pads), starts, sizes)


def range_plan(starts, span, n, k, operand_split, useful):
    """(plan, whole) of per-shard reads [starts[i], starts[i] + span) of an operand dim
    of `n` elements whose result is split `k` ways: a halo-exchange range plan
    (gspmd_tf._halo.range_plan) where the operand is split and halos cost less than
    gathering (halos_worth_it), else the dim whole (`whole` True)."""
    whole = not operand_split
    plan = _halo.range_plan(starts, span, n, k, whole, useful)
    if not whole and not halos_worth_it(plan, k):
        whole = True
        plan = _halo.range_plan(starts, span, n, k, True, useful)
    return plan, whole


def operand_window(ctx, operands, plans):
    """Operand 0 with each planned dim (`plans`: range plans with `dim`, `axes`,
    `split`, `whole`, `plan`) whole where its plan is (resharded from the op's input),
    its padding masked (masked_refs), then extended and sliced to the range this shard
    reads (extend_and_slice)."""
    x = operands[0]
    whole = {p.dim for p in plans if p.whole}
    wanted = Layout(tuple(() if d in whole else a for d, a in enumerate(x.layout.dims)),
                    x.layout.partial, x.layout.reduce_op)
    if wanted != x.layout:
        x = ctx.reshard(ctx.inputs[0], wanted)
    ref = masked_refs(ctx, [x] + list(operands[1:]))[0]
    return extend_and_slice(ctx.b, ref, plans, lambda p: p.dim)


def _offset(b, dp):
    """Start of shard's span in the extended tensor (python int or int32 scalar)."""
    return per_shard(b, dp.axes, dp.plan["offset"], dp.plan["useful"])


def prepare_input(ctx, operands, index, geo, axes_of):
    """The operand `index` (x) with every spatial dim either split like its windows or
    whole, and the per-dim plans."""
    x = operands[index]
    original = ctx.inputs[index]
    plans = []
    dims = list(x.layout.dims)
    for s in geo.spatial:
        axes = axes_of(s)
        dp = DimPlan(ctx.mesh, s, axes, original.layout.dims[s.x_dim] if axes else ())
        if dp.whole:
            dims[s.x_dim] = ()
        plans.append(dp)
    wanted = Layout(tuple(dims), x.layout.partial, x.layout.reduce_op)
    if wanted != x.layout:
        x = ctx.reshard(original, wanted)
    return x, plans



def needs_mask(dp, fill_zero):
    """Whether the window of a dim must be masked outside [0, n)."""
    s = dp.s
    if s.pad_lo <= 0 and s.pad_hi <= 0:
        return False  # windows of real results never leave [0, n)
    if not fill_zero:
        return True   # edge zeros and padding must become the op's padding value
    # zeros at the edges are right; only the padded tail of uneven blocks may be garbage
    return dp.split and s.n % dp.k != 0



def mask_edges(b, window, plans, fill):
    """`window` (extend_and_slice's result for forward plans) with the elements outside
    each dim's [0, n) set to `fill` where needs_mask says they may be wrong."""
    for dp in plans:
        if needs_mask(dp, fill == 0):
            start = affine_start(b, dp.axes, dp.plan["out_shard"] * dp.s.stride,
                                 -dp.s.pad_lo)
            window = mask_outside(b, window, dp.s.x_dim, start, dp.s.n, fill)
    return window
