"""Rule builders of op families that mix some dims and leave the others independent:
ops on a batch of matrices or signals (Cholesky, Qr, FFT...), image ops, reversals, pooling's
second derivative, the v1 Concat, InTopKV2, TensorStridedSliceUpdate, L2Loss, and ops
that need every input whole (StringFormat, InvertPermutation...).

The common form (`core_dims_whole`): each listed tensor's mixed dims are a REPLICATE
factor of their own, every other dim is a PASS factor shared by all the tensors that
have it at the same place. Which builder serves which op type is the op registry's
(declared in gspmd_tf/spmd/handlers/replayed.py and linalg.py).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from gspmd_tf.graph.strided_slice import slice_masks
from gspmd_tf.propagation.oprule import (REDUCE, OpRule, RuleContext, passing_dims, per_dim,
                                         whole_dims)


def core_dims_whole(ctx: RuleContext, core: Callable[[int], Sequence[int]],
                    data_inputs: Sequence[int] = (0,)) -> Optional[OpRule]:
    """Ops whose `core(rank)` dims (of every data input and result) stay whole and whose
    other dims pass: dim d of a data input or result shares the factor of the first
    result's dim d (same rank, same size), else it gets one of its own. Inputs not in
    `data_inputs` are not data. None when a data tensor's rank differs from the
    result's (no batch dims to pair)."""
    out = ctx.out_shapes[0]
    mixed = set(core(len(out)))
    shapes = [ctx.in_shapes[i] for i in data_inputs] + list(ctx.out_shapes)
    if any(len(shape) != len(out) for shape in shapes):
        return None
    rule = OpRule()
    batch = passing_dims(rule, tuple(1 if d in mixed else n for d, n in enumerate(out)))

    def dims(shape):
        return tuple(whole_dims(rule, n) if d in mixed else
                     batch[d] if n == out[d] else whole_dims(rule, n)
                     for d, n in enumerate(shape))
    rule.operands = [dims(ctx.in_shapes[i]) if i in data_inputs else None
                     for i in range(len(ctx.in_shapes))]
    rule.results = [dims(shape) for shape in ctx.out_shapes]
    return rule


def last_dims(count: int) -> Callable[[int], range]:
    """core for core_dims_whole: the last `count` dims (matrices, 1-3 D transforms)."""
    return lambda rank: range(max(rank - count, 0), rank)


def matrices(ctx: RuleContext, data_inputs: Sequence[int] = (0,)) -> Optional[OpRule]:
    """Cholesky, Qr, MatrixInverse, MatrixSolve...: each matrix (the last two dims) of the
    `data_inputs` and results whole, batch dims pass (Qr's q and r share them)."""
    return core_dims_whole(ctx, last_dims(2), data_inputs)


def transform(ctx: RuleContext, count: int) -> Optional[OpRule]:
    """FFT/IFFT/RFFT/IRFFT over the last `count` dims: those whole (a split one
    reshards), batch dims pass; RFFT's fft_length is not data."""
    return core_dims_whole(ctx, last_dims(count))


def _height_and_width(rank: int) -> range:
    """The spatial dims of a [..., height, width, channels] image batch."""
    return range(rank - 3, rank - 1)


def images_spatial_whole(ctx: RuleContext, data_inputs: Sequence[int] = (0,)
                         ) -> Optional[OpRule]:
    """Resize*, their gradients, AdjustContrastv2 on [..., H, W, C]: height and width
    whole, batch and channel dims pass (ResizeBilinearGrad: its original_image, read
    for its shape, is data too, so its batch and channels are split alike)."""
    return core_dims_whole(ctx, _height_and_width, data_inputs)


def channels_whole(ctx: RuleContext, data_inputs: Sequence[int] = (0,)
                   ) -> Optional[OpRule]:
    """AdjustSaturation, AdjustHue, HSVToRGB, RGBToHSV on [..., 3]: each pixel's
    channels whole (an HSV round trip), every other dim passes; LRN (its window runs
    over the channels) and Cross (of 3-vectors, both `data_inputs`) alike."""
    return core_dims_whole(ctx, last_dims(1), data_inputs)


def batch_only(ctx: RuleContext) -> Optional[OpRule]:
    """SpaceToDepth, DepthToSpace, Extract{Image,Volume}Patches: the batch dim (the
    first) passes, every other dim whole (each image's blocks or windows move)."""
    return core_dims_whole(ctx, lambda rank: range(1, rank))


def reverse(ctx: RuleContext) -> Optional[OpRule]:
    """ReverseV2 (constant axes) and Reverse (v1: a constant bool per dim): the
    reversed dims whole, the others pass."""
    given = ctx.const(1)
    if given is None:
        return None
    rank = len(ctx.out_shapes[0])
    given = np.atleast_1d(given)
    axes = ({d for d, flag in enumerate(given) if flag} if given.dtype == bool
            else {int(d) % rank for d in given})
    return per_dim(ctx, axes)


def pool_grad_grad(ctx: RuleContext) -> Optional[OpRule]:
    """MaxPoolGradGrad / MaxPool3DGradGrad (orig_input, orig_output, grad) -> [orig_output
    shape]: batch and channel dims pass, the spatial (windowed) dims whole."""
    data_format = ctx.node.attr("data_format") or b""
    if isinstance(data_format, bytes):
        data_format = data_format.decode()
    channel_first = data_format.startswith("NC")
    return core_dims_whole(
        ctx, lambda rank: range(2, rank) if channel_first else range(1, rank - 1),
        data_inputs=(0, 1, 2))


def concat_v1(ctx: RuleContext) -> Optional[OpRule]:
    """Concat (v1: the axis is input 0, then the values): as ConcatV2, the axis whole."""
    n = len(ctx.in_shapes) - 1
    axis = ctx.const(0)
    if axis is None:
        return None
    axis = int(axis) % len(ctx.out_shapes[0])
    return per_dim(ctx, {axis}, data_inputs=tuple(range(1, n + 1)))


def in_top_k(ctx: RuleContext) -> Optional[OpRule]:
    """InTopKV2 (predictions [B, C], targets [B], k) -> [B]: B passes, each row's classes
    C stay whole."""
    b, c = ctx.in_shapes[0]
    rule = OpRule()
    batch = passing_dims(rule, (b,))
    rule.operands = [batch + (whole_dims(rule, c),), batch, None]
    rule.results = [batch]
    return rule


def sum_of_everything(ctx: RuleContext) -> OpRule:
    """L2Loss (sum(x ** 2) / 2 to a scalar): every dim a REDUCE factor (split: a partial
    sum per device, padding masked to 0, combined by the partitioner)."""
    rule = OpRule()
    rule.operands = [tuple((rule.add_factor(n, REDUCE),) if n > 1 else ()
                           for n in ctx.in_shapes[0])]
    rule.results = [()]
    return rule


def diagonal_part(ctx: RuleContext) -> Optional[OpRule]:
    """DiagPart x [d1..dk, d1..dk] -> [d1..dk]: dim i of x and of the result share a
    factor (each device reads the diagonal of its rows: the handler slices the matching
    columns), x's dims k..2k-1 whole (a mesh axis splits one dim of a tensor, so no
    layout holds just the diagonal blocks)."""
    shape = ctx.in_shapes[0]
    half = len(shape) // 2
    if len(shape) != 2 * half or tuple(shape[:half]) != tuple(shape[half:]):
        return None
    rule = OpRule()
    rows = passing_dims(rule, shape[:half])
    rule.operands = [rows + tuple(whole_dims(rule, n) for n in shape[half:])]
    rule.results = [rows]
    return rule


def all_whole(ctx: RuleContext) -> OpRule:
    """Ops that need every data input and result whole (StringFormat formats whole
    tensors, InvertPermutation inverts one permutation; RngReadAndSkip's state is a
    scalar resource):
    each dim a REPLICATE factor, non-numeric resource inputs not data."""
    rule = OpRule()

    def whole(shape):
        return tuple(whole_dims(rule, n) for n in shape)
    rule.operands = [whole(shape) for shape in ctx.in_shapes]
    rule.results = [whole(shape) for shape in ctx.out_shapes]
    return rule


def strided_slice_update(ctx: RuleContext) -> Optional[OpRule]:
    """TensorStridedSliceUpdate (input, begin, end, strides, value): the dims the slice
    takes whole with stride 1 pass, shared by input, value and result (each device
    updates its block); every other dim of input and value stays whole."""
    x, value = ctx.in_shapes[0], ctx.in_shapes[4]
    strides = ctx.const(3)
    if strides is None:
        return None
    params = slice_masks(ctx.node, len(x), ctx.in_shapes[1][0])
    strides = np.atleast_1d(strides)
    rule = OpRule()
    dims_x, dims_value = [], [()] * len(value)
    at = {d: j for j, d in enumerate(params.kept) if d is not None}
    for d, n in enumerate(x):
        j = at.get(d)
        stride = 1 if params.spec[d] is None else int(strides[params.spec[d]])
        if j is not None and j < len(value) and value[j] == n and stride == 1:
            dims_x.append(passing_dims(rule, (n,))[0])
            dims_value[j] = dims_x[d]
        else:
            dims_x.append(whole_dims(rule, n))
    dims_value = tuple(dims or whole_dims(rule, n) for dims, n in zip(dims_value, value))
    rule.operands = [tuple(dims_x), None, None, None, dims_value]
    rule.results = [tuple(dims_x)]
    return rule

