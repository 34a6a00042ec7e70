"""Rules of ops that cut, pad, tile or join a dim: Slice, StridedSlice(Grad), Pad, Tile,
ConcatV2. A dim whose size changes by a constant window may stay split (halos).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from gspmd_tf.graph.strided_slice import first_read, slice_masks
from gspmd_tf.propagation.oprule import (REDUCE, REPLICATE, OpRule, RuleContext,
                                        SpatialDim, per_dim, spread_operands)


def concat(ctx: RuleContext) -> Optional[OpRule]:
    """ConcatV2: the concat axis is whole; other dims pass."""
    n = len(ctx.in_shapes) - 1
    axis = ctx.const(n)
    if axis is None:
        return None
    axis = int(axis) % len(ctx.out_shapes[0])
    return per_dim(ctx, {axis}, data_inputs=tuple(range(n)))


def changed_dims(ctx: RuleContext) -> Optional[OpRule]:
    """Dims where output and input sizes differ (Slice, StridedSlice, Pad, Tile)."""
    return {d for d, (a, b) in enumerate(zip(ctx.in_shapes[0], ctx.out_shapes[0])) if a != b}


def same_rank_slicing(ctx: RuleContext) -> Optional[OpRule]:
    """Tile/MirrorPad (and Slice/Pad with non-constant bounds) of the same rank:
    changed dims whole."""
    if len(ctx.in_shapes[0]) != len(ctx.out_shapes[0]):
        return None
    return per_dim(ctx, changed_dims(ctx))


def pad_or_slice(ctx: RuleContext, kind) -> Optional[OpRule]:
    """Slice ("slice"), Pad or PadV2 ("pad") x -> y by constant bounds: each dim a
    stride-1 window of 1 element (see _sliced_factors), `pad_lo` = -begin for a slice.
    Without constant bounds (or a PadV2's value) the changed dims stay whole."""
    x, y = ctx.in_shapes[0], ctx.out_shapes[0]
    bounds = ctx.const(1)
    dims = tuple(range(len(x)))
    value_unknown = len(ctx.in_shapes) > 2 and ctx.const(2) is None  # a PadV2's value
    if len(x) != len(y) or bounds is None or value_unknown:
        rule = same_rank_slicing(ctx)
        if rule is not None:
            rule.params = SliceParams(dims, dims)
        return rule
    bounds = np.asarray(bounds, np.int64).reshape(len(x), -1)
    lows = -bounds[:, 0] if kind == "slice" else bounds[:, 0]
    rule = OpRule()
    pick = kind == "slice" and ctx.const(2) is not None
    dims_x, dims_y, windows, picks = _sliced_factors(rule, x, y, dims, dims, [1] * len(x),
                                                     lows, pick)
    rule.params = SliceParams(dims, dims, windows, picks)
    rule.operands = spread_operands([dims_x], (0,), len(ctx.in_shapes))
    rule.results = [dims_y]
    return rule


@dataclass(frozen=True)
class SliceParams:
    """OpRule.params of Slice, Pad and StridedSlice(Grad): `kept` and `spec` as
    graph.strided_slice.SliceMasks has them (the identity for Slice and Pad), and the
    dims that may stay split."""

    kept: tuple
    spec: tuple
    windows: tuple = ()  # oprule.SpatialDim of each dim that may stay split (halos)
    picks: tuple = ()  # (x dim, the one element read) of each dim the slice picks from


def _sliced_factors(rule, x, y, kept, spec, strides, lows=None, pick=False):
    """Dims of a tensor x and of its slice (or padding) y: y dim j is x dim kept[j], or a
    new axis where that is None; x dim d has entry spec[d] (None: taken whole) in
    `strides` and `lows` (its first element read, negated: the low padding; None when
    unknown: changed dims stay whole).

    A kept dim of unchanged size and stride 1 passes. A kept dim whose size changes,
    with a positive stride and both sizes above 1, is a window of one element (stride,
    padding from lows): one factor shared by x and y, PASS-like as a convolution's
    spatial dims are (split x -> split y; the handler exchanges the halos each result
    block needs with its neighbours); its SpatialDim is returned in `windows`. With
    `pick` (a forward slice), a dim of x > 1 from which one element is read (y's dim has
    size 1, or is shrunk away), with a positive stride, is a REDUCE factor of x only:
    split, the element's owner reads it and the other devices zeros (a partial sum, as a
    gather from a split table): only one element's worth moves, never the dim gathered.
    Its (x dim, element) is returned in `picks`. Other dims (shrunk, negative strides,
    size 1) stay whole.
    Returns (dims of x, dims of y, windows, picks)."""
    at = {d: j for j, d in enumerate(kept) if d is not None}
    dims_x, dims_y, windows, picks = [], [()] * len(y), [], []
    for d, n in enumerate(x):
        j = at.get(d)
        stride = 1 if spec[d] is None else int(strides[spec[d]])
        if j is not None and n == y[j] and stride == 1 and n > 1:
            dims_x.append((rule.add_factor(n),))
            dims_y[j] = dims_x[d]
        elif j is not None and lows is not None and stride > 0 and n > 1 and y[j] > 1:
            lo = int(lows[spec[d]]) if spec[d] is not None else 0
            hi = (y[j] - 1) * stride + 1 - n - lo
            dims_x.append((rule.add_factor(max(n, y[j])),))
            dims_y[j] = dims_x[d]
            windows.append(SpatialDim(d, j, int(n), int(y[j]), 1, stride, 1, lo, hi))
        elif (pick and lows is not None and spec[d] is not None and stride > 0 and n > 1
              and (j is None or y[j] == 1)):
            dims_x.append((rule.add_factor(n, REDUCE),))
            picks.append((d, -int(lows[spec[d]])))
        else:
            dims_x.append((rule.add_factor(n, REPLICATE),) if n > 1 else ())
    for j, n in enumerate(y):
        if n > 1 and not dims_y[j]:
            dims_y[j] = (rule.add_factor(n, REPLICATE),)
    return tuple(dims_x), tuple(dims_y), tuple(windows), tuple(picks)


def strided_slice(ctx: RuleContext) -> Optional[OpRule]:
    """StridedSlice x -> y (see _sliced_factors); the first element read on each dim is
    worked out as TF does (masks, negative and out-of-range bounds)."""
    x = ctx.in_shapes[0]
    masks = slice_masks(ctx.node, len(x), ctx.in_shapes[1][0])
    strides = ctx.const(3)
    if strides is None:
        return None
    strides = np.atleast_1d(strides)
    begin = ctx.const(1)
    lows = None if begin is None else -first_read(ctx.node, x, masks, begin, strides)
    rule = OpRule()
    dims_x, dims_y, windows, picks = _sliced_factors(
        rule, x, ctx.out_shapes[0], masks.kept, masks.spec, strides, lows,
        pick=ctx.const(2) is not None)
    rule.params = SliceParams(masks.kept, masks.spec, windows, picks)
    rule.operands = [dims_x, None, None, None]
    rule.results = [dims_y]
    return rule


def strided_slice_grad(ctx: RuleContext) -> Optional[OpRule]:
    """StridedSliceGrad: dy (the slice's shape) scattered into zeros of x's shape; the
    factors of the forward slice (see _sliced_factors). A dim sliced with stride 1 is a
    pad of dy (low padding: the first element the slice read) and may stay split, its
    window read from dy; dims with other strides stay whole."""
    x = ctx.out_shapes[0]
    masks = slice_masks(ctx.node, len(x), ctx.in_shapes[1][0])
    strides, begin = ctx.const(3), ctx.const(1)
    if strides is None or begin is None or ctx.const(2) is None:
        return None
    strides = np.atleast_1d(strides)
    unit = np.where(strides == 1, 1, 0)  # other strides: whole (not windows of dy)
    lows = -first_read(ctx.node, x, masks, begin, unit)
    rule = OpRule()
    dims_x, dims_dy, windows, _ = _sliced_factors(rule, x, ctx.in_shapes[4], masks.kept,
                                                  masks.spec, unit, lows)
    windows = tuple(SpatialDim(w.y_dim, w.x_dim, w.out, w.n, 1, 1, 1, -w.pad_lo, -w.pad_hi)
                    for w in windows)
    rule.params = SliceParams(masks.kept, masks.spec, windows)
    rule.operands = [None, None, None, None, dims_dy]
    rule.results = [dims_x]
    return rule


def tile(ctx: RuleContext) -> Optional[OpRule]:
    """Tile by constant multiples: a dim tiled from size 1 broadcasts (a result-only
    factor, split freely: each device tiles its block); an untiled dim passes; a dim
    tiled from a larger size stays whole."""
    multiples = ctx.const(1)
    if multiples is None:
        return same_rank_slicing(ctx)
    rule = OpRule()
    dims_in, dims_out = [], []
    for n, m in zip(ctx.in_shapes[0], ctx.out_shapes[0]):
        if n == m or n == 1:
            f = rule.add_factor(m) if m > 1 else None
            dims_out.append((f,) if f is not None else ())
            dims_in.append((f,) if f is not None and n == m else ())
        else:
            dims_in.append((rule.add_factor(n, REPLICATE),))
            dims_out.append((rule.add_factor(m, REPLICATE),))
    rule.operands = [tuple(dims_in), None]
    rule.results = [tuple(dims_out)]
    return rule
