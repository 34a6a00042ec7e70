"""Rules of windowed ops: 2-D and 3-D convolutions, pooling and their gradients.

Every op here is seen through its forward geometry: an input x [batch, spatial...,
channels] (or channels first), windows over the spatial dims, an output y. Factors:

  batch        PASS (REDUCE in Conv2DBackpropFilter, which sums over it)
  spatial      one factor per spatial dim shared by x's and y's dim ("PASS-like": a
               split input dim gives a split output dim, as XLA propagates it); its
               sizes differ between x and y, the handler exchanges halos
               (gspmd_tf/spmd/handlers/conv.py). REDUCE in Conv2DBackpropFilter. When
               either side has size 1 the dims are REPLICATE instead.
  kernel dims  REPLICATE (the filter's spatial dims stay whole)
  (the same factors for 2 or 3 spatial dims: NHWC/NCHW and NDHWC/NCDHW)
  in channels  REDUCE in Conv2D (shared with the filter's in dim: partial result)
  out channels PASS (the filter's out dim)
  depthwise    channels PASS, the output channel dim made of (channel, multiplier)
  pooling      channels PASS (ksize/strides 1 there, else no rule)
  pool grads   the spatial factor spans x, y, dy and dx

MirrorPad and MirrorPadGrad: a padded dim is one factor shared by x and y, PASS-like as a
Pad's (its result blocks read mirrored ranges of the operand; MirrorPadParams).
ResizeBilinear, ResizeNearestNeighbor and their gradients likewise: height and width
each one factor shared by the image and the resized image (resize; ResizeDim params).

Every windowed op's rule carries a WindowedParams (OpRule.params): the geometry and layout
its emitter needs. The op types these builders serve, with their parameters, are declared
beside the emitters (gspmd_tf/spmd/handlers/conv.py, slicing.py for MirrorPad).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from gspmd_tf._halo import same_padding
from gspmd_tf.propagation.oprule import PASS, REDUCE, REPLICATE, OpRule, RuleContext, SpatialDim
from gspmd_tf.propagation.rules.slices import same_rank_slicing


@dataclass(frozen=True)
class Geometry:
    """The forward geometry of a windowed op: dims of x / y and one SpatialDim each."""

    data_format: str
    batch_dim: int
    channel_dim: int
    spatial: tuple

    @property
    def spatial_dims(self):
        return tuple(s.x_dim for s in self.spatial)


@dataclass(frozen=True)
class WindowedParams:
    """What a windowed op's emitter needs, worked out once by its rule (OpRule.params).

    geometry          the forward geometry
    pooling           None (a convolution), "max" (pads with -inf) or "avg" (divides by
                      the in-bounds count of each window)
    explicit_padding  the op takes per-dim explicit padding: its unsplit spatial dims
                      keep their own padding
    window_inputs     the inputs read through windows (halo exchange): x, or a
                      transposed op's dy (and y)
    forward_input     the forward input x a MaxPoolGrad also reads, else None
    shape_input       the input holding the result's shape (gradients), else None
    """

    geometry: Geometry
    pooling: Optional[str]
    explicit_padding: bool
    window_inputs: tuple
    forward_input: Optional[int]
    shape_input: Optional[int]


def _padding(node, n, window, stride, dilation, dim, data_format):
    padding = node.attr("padding")
    if padding == "VALID":
        return 0, 0
    if padding == "SAME":
        return same_padding(n, window, stride, dilation)
    if padding == "EXPLICIT":
        pads = node.attr("explicit_paddings") or []
        return int(pads[2 * dim]), int(pads[2 * dim + 1])
    return None


# data formats of windowed ops: the channel dim (batch is dim 0, the rest are spatial)
_CHANNEL_DIM = {"NHWC": 3, "NCHW": 1, "NDHWC": 4, "NCDHW": 1}


def geometry(node, x_shape, y_shape, window_sizes=None):
    """Geometry of a convolution or pooling node, 2-D or 3-D (x, y shapes of the
    forward op).

    `window_sizes`: kernel sizes of the spatial dims (a filter's); pooling ops read
    ksize. None when the node's attrs are not understood (the op then has no rule).
    """
    rank = len(x_shape)
    data_format = node.attr("data_format") or ("NHWC" if rank == 4 else "NDHWC")
    if isinstance(data_format, bytes):
        data_format = data_format.decode()
    if (data_format not in _CHANNEL_DIM or rank != len(data_format)
            or len(y_shape) != rank):
        return None
    channel = _CHANNEL_DIM[data_format]
    spatial_dims = tuple(d for d in range(1, rank) if d != channel)
    strides = node.attr("strides") or [1] * rank
    dilations = node.attr("dilations") or [1] * rank
    if len(strides) != rank or len(dilations) != rank:
        return None
    if rank == 5 and dilations[spatial_dims[1]] != dilations[spatial_dims[2]]:
        # TF's Conv3D shape function swaps the H and W dilations: the local op (VALID
        # on a window) would get a static shape its kernel does not compute. The
        # global op (SAME, or shapes where it does not matter) runs replicated.
        return None
    if window_sizes is None:
        ksize = node.attr("ksize")
        if ksize is None or len(ksize) != rank or any(ksize[d] != 1 for d in (0, channel)):
            return None
        window_sizes = [ksize[d] for d in spatial_dims]
    if any(strides[d] != 1 or dilations[d] != 1 for d in (0, channel)):
        return None
    dims = []
    for d, k in zip(spatial_dims, window_sizes):
        pads = _padding(node, x_shape[d], k, strides[d], dilations[d], d, data_format)
        if pads is None:
            return None
        dims.append(SpatialDim(d, d, int(x_shape[d]), int(y_shape[d]), int(k),
                               int(strides[d]), int(dilations[d]), *pads))
        dilated = (k - 1) * dilations[d] + 1
        if (x_shape[d] + sum(pads) - dilated) // strides[d] + 1 != y_shape[d]:
            return None  # not the geometry TF computed: leave the op alone
    return Geometry(data_format, 0, channel, tuple(dims))


class _Builder:
    """Collects factors per tensor dim: rule.operands / results as lists of lists."""

    def __init__(self, num_inputs):
        self.rule = OpRule()
        self.inputs = [None] * num_inputs

    def factor(self, size, kind=PASS):
        return self.rule.add_factor(size, kind) if size > 1 else None

    def tensor(self, shape):
        return [()] * len(shape)

    @staticmethod
    def put(dims, d, f):
        if f is not None:
            dims[d] = (f,) if not isinstance(f, tuple) else f

    def done(self, operands, results):
        """operands: {input index: dims list}; results: list of dims lists."""
        for i, dims in operands.items():
            self.inputs[i] = tuple(dims)
        self.rule.operands = self.inputs
        self.rule.results = [tuple(r) for r in results]
        return self.rule


def _spatial_factors(b, geo, x_dims, y_dims, kind=PASS):
    """One factor per spatial dim shared by the x-sized and y-sized tensors (a dims
    list or a tuple of them); REPLICATE when either size is 1."""
    xs = x_dims if isinstance(x_dims, tuple) else (x_dims,)
    ys = y_dims if isinstance(y_dims, tuple) else (y_dims,)
    for s in geo.spatial:
        shared = b.factor(max(s.n, s.out), kind) if s.n > 1 and s.out > 1 else None
        for group, dim, size in ((xs, s.x_dim, s.n), (ys, s.y_dim, s.out)):
            for dims in group:
                b.put(dims, dim, shared if shared is not None
                      else b.factor(size, REPLICATE))


def conv_family(ctx: RuleContext, x_at, w_at, y_at, reduced, depthwise,
                explicit_padding) -> Optional[OpRule]:
    """The convolutions and their gradients, one rule: image x [N,H,W,C] (or [N,D,H,W,C]),
    filter w [KH,KW,C,O] ([KD,KH,KW,C,O]; O is the multiplier M when `depthwise`) and
    image y [N,H',W',O] (C*M when depthwise), each an input index or "out". Batch and the
    spatial factors (shared by x and y: halo exchange) and the C and O factors are PASS
    unless named in `reduced` ("batch" covers the spatial factors too, as a filter
    gradient sums over both). `explicit_padding`: the op takes per-dim explicit padding
    (the 2-D ones; Conv3D takes SAME or VALID only)."""
    def shape(at):
        return ctx.out_shapes[0] if at == "out" else ctx.in_shapes[at]
    x, w, y = shape(x_at), shape(w_at), shape(y_at)
    spatial = len(w) - 2
    if len(x) != spatial + 2:
        return None
    geo = geometry(ctx.node, x, y, w[:spatial])
    if geo is None or w[spatial] != x[geo.channel_dim]:
        return None
    kind = lambda part: REDUCE if part in reduced else PASS
    b = _Builder(len(ctx.in_shapes))
    xd, wd, yd = b.tensor(x), b.tensor(w), b.tensor(y)
    n = b.factor(x[0], kind("batch"))
    b.put(xd, 0, n)
    b.put(yd, 0, n)
    _spatial_factors(b, geo, xd, yd, kind=kind("batch"))
    c = b.factor(w[spatial], kind("C"))
    b.put(xd, geo.channel_dim, c)
    b.put(wd, spatial, c)
    o = b.factor(w[spatial + 1], kind("O"))
    b.put(wd, spatial + 1, o)
    b.put(yd, geo.channel_dim,
          tuple(f for f in (c, o) if f is not None) if depthwise else o)
    for d in range(spatial):  # the filter's spatial dims stay whole
        b.put(wd, d, b.factor(w[d], REPLICATE))
    tensors = {x_at: xd, w_at: wd, y_at: yd}
    rule = b.done({at: dims for at, dims in tensors.items() if at != "out"},
                  [tensors["out"]])
    shape_input = next((i for i in range(len(ctx.in_shapes)) if i not in tensors), None)
    rule.params = WindowedParams(geo, None, explicit_padding,
                                 (y_at,) if x_at == "out" else (x_at,), None, shape_input)
    return rule


def _batch_and_channels(b, shape, geo, *tensors_dims):
    """One PASS factor each for the batch and channel dims, shared by `tensors_dims`."""
    for d in (0, geo.channel_dim):
        f = b.factor(shape[d])
        for dims in tensors_dims:
            b.put(dims, d, f)


def pool(ctx: RuleContext, pooling, explicit_padding) -> Optional[OpRule]:
    """MaxPool/AvgPool (2-D or 3-D): batch and channels pass, spatial dims shared by x and y.
    `pooling` ("max" or "avg") and `explicit_padding` (whether the op takes per-dim
    explicit padding) go to the emitter in WindowedParams."""
    x = ctx.in_shapes[0]
    y = ctx.out_shapes[0]
    geo = geometry(ctx.node, x, y)
    if geo is None:
        return None
    b = _Builder(len(ctx.in_shapes))
    xd, yd = b.tensor(x), b.tensor(y)
    _batch_and_channels(b, x, geo, xd, yd)
    _spatial_factors(b, geo, xd, yd)
    rule = b.done({0: xd}, [yd])
    rule.params = WindowedParams(geo, pooling, explicit_padding, (0,), None, None)
    return rule


def max_pool_grad(ctx: RuleContext, explicit_padding) -> Optional[OpRule]:
    """MaxPoolGrad / MaxPool3DGrad (x, y, dy) -> dx: batch and channels pass; each
    spatial dim one factor shared by x, dx and the window dims of y, dy (halo exchange
    on all three). `explicit_padding` as for pool."""
    x, y, dy = ctx.in_shapes
    geo = geometry(ctx.node, x, y)
    if geo is None or dy != y:
        return None
    b = _Builder(3)
    xd, yd, dyd, dxd = b.tensor(x), b.tensor(y), b.tensor(dy), b.tensor(x)
    _batch_and_channels(b, x, geo, xd, yd, dyd, dxd)
    _spatial_factors(b, geo, (xd, dxd), (yd, dyd))
    rule = b.done({0: xd, 1: yd, 2: dyd}, [dxd])
    rule.params = WindowedParams(geo, "max", explicit_padding, (1, 2), 0, None)
    return rule


def avg_pool_grad(ctx: RuleContext) -> Optional[OpRule]:
    """AvgPoolGrad / AvgPool3DGrad (x_shape, dy) -> dx: batch and channels pass;
    spatial dims of dy and dx share a factor (halo exchange on dy)."""
    dy = ctx.in_shapes[1]
    dx = ctx.out_shapes[0]
    geo = geometry(ctx.node, dx, dy)
    if geo is None:
        return None
    b = _Builder(2)
    dyd, dxd = b.tensor(dy), b.tensor(dx)
    _batch_and_channels(b, dx, geo, dyd, dxd)
    _spatial_factors(b, geo, dxd, dyd)
    rule = b.done({1: dyd}, [dxd])
    rule.params = WindowedParams(geo, "avg", False, (1,), None, 0)
    return rule



@dataclass(frozen=True)
class MirrorDim:
    """A dim MirrorPad pads that may stay split: x's size n and the pad amounts."""

    dim: int
    n: int
    pad_lo: int
    pad_hi: int


@dataclass(frozen=True)
class MirrorPadParams:
    """OpRule.params of MirrorPad / MirrorPadGrad: the padded dims that share a factor
    between x and y, and the mode (SYMMETRIC repeats the edge element, REFLECT not)."""

    dims: tuple
    symmetric: bool


def mirror_pad(ctx: RuleContext, grad) -> Optional[OpRule]:
    """MirrorPad x -> y, or MirrorPadGrad dy -> dx (`grad`), by constant paddings: a
    dim it does not pad passes; a padded dim is one factor shared by x and y, PASS-like
    as a Pad's (each result block reads a contiguous range of the operand, mirrored at
    the edges: the handler exchanges halos); whole where either size is 1. Without
    constant paddings the padded dims stay whole (the op is then replayed as it is)."""
    operand, result = ctx.in_shapes[0], ctx.out_shapes[0]
    x, y = (result, operand) if grad else (operand, result)  # x unpadded, y padded
    paddings = ctx.const(1)
    mode = ctx.node.attr("mode")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if paddings is None or len(x) != len(y) or mode not in ("REFLECT", "SYMMETRIC"):
        return same_rank_slicing(ctx)
    paddings = np.asarray(paddings, np.int64).reshape(len(x), 2)
    b = _Builder(len(ctx.in_shapes))
    xd, yd = b.tensor(x), b.tensor(y)
    dims = []
    for d, (n, m) in enumerate(zip(x, y)):
        if n == m:
            f = b.factor(n)
            b.put(xd, d, f)
            b.put(yd, d, f)
        elif n > 1 and m > 1:
            f = b.factor(m)
            b.put(xd, d, f)
            b.put(yd, d, f)
            dims.append(MirrorDim(d, int(n), int(paddings[d, 0]), int(paddings[d, 1])))
        else:
            b.put(xd, d, b.factor(n, REPLICATE))
            b.put(yd, d, b.factor(m, REPLICATE))
    rule = b.done({0: yd if grad else xd}, [xd if grad else yd])
    rule.params = MirrorPadParams(tuple(dims), mode == "SYMMETRIC")
    return rule


@dataclass(frozen=True)
class ResizeDim:
    """One resized dim of an image op: its index, its size `n` in the image and `out`
    in the resized image."""

    dim: int
    n: int
    out: int


def resize(ctx: RuleContext, grad: bool) -> Optional[OpRule]:
    """ResizeBilinear / ResizeNearestNeighbor x [B, H, W, C] -> y [B, h, w, C], or their
    gradients dy [B, h, w, C] -> dx [B, H, W, C] (`grad`; ResizeBilinearGrad's second
    input, the original image, read for its shape, aligned with dx). Batch and channels
    pass; height and width each one factor shared by the image and the resized image,
    PASS-like (each result block reads a contiguous range of its operand: the handler
    exchanges halos, gspmd_tf/spmd/handlers/resize.py); whole where either size is 1.
    OpRule.params: the ResizeDims of the two spatial dims."""
    operand, result = ctx.in_shapes[0], ctx.out_shapes[0]
    if len(operand) != 4 or len(result) != 4 or None in operand or None in result:
        return None
    image, resized = (result, operand) if grad else (operand, result)
    b = _Builder(len(ctx.in_shapes))
    xd, yd = b.tensor(image), b.tensor(resized)
    dims = []
    for d in range(4):
        n, m = image[d], resized[d]
        if d in (0, 3) or n == m:
            f = b.factor(n)
        elif n > 1 and m > 1:
            f = b.factor(max(n, m))
            dims.append(ResizeDim(d, int(n), int(m)))
        else:
            b.put(xd, d, b.factor(n, REPLICATE))
            b.put(yd, d, b.factor(m, REPLICATE))
            continue
        b.put(xd, d, f)
        b.put(yd, d, f)
    operands = {0: yd if grad else xd}
    if grad and ctx.node.op == "ResizeBilinearGrad":
        operands[1] = list(xd)
    rule = b.done(operands, [xd if grad else yd])
    rule.params = tuple(dims)
    return rule
