"""FusedBatchNorm(V2, V3) and FusedBatchNormGrad(V2, V3) with the batch or spatial dims
split.

In training mode the per-channel moments (forward) and the sums of the gradient
(backward) run over every dim but the channel. With those dims split, each device sums
its block (padding masked to 0) and an all-reduce over the split axes completes each sum:
the mean first, then the centered sum of squares (the two-pass form, as numerically
careful as TF's kernel), so the variance never comes from E[x^2] - E[x]^2. The normalizing
itself is TF's inference-mode kernel on the local block with those global moments; the
gradient is written in plain ops (its sums combined the same way). A split channel dim
alone is an exact replay, and so is the inference-mode forward op with any split.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import Layout
from gspmd_tf.propagation import rules
from gspmd_tf.registry import op_family
from gspmd_tf.spmd.handlers.basic import local_shapes, replay
from gspmd_tf.spmd.handlers.normalize import _combine
from gspmd_tf.spmd.local_ops import binary, cast, mask_padding, unary
from gspmd_tf.spmd.program import Local


class _Channels:
    """What both handlers share: x's reduced dims, their split axes, and per-channel
    vectors combined over those axes or broadcast against x."""

    def __init__(self, ctx, x):
        self.ctx, self.b = ctx, ctx.b
        channel = ctx.rule.params.channel
        self.reduced = [d for d in range(len(x.shape)) if d != channel]
        self.axes = tuple(a for d in self.reduced for a in x.layout.dims[d])
        self.channel_dims = (x.layout.dims[channel],)
        self.channels = x.shape[channel]
        self.count = int(np.prod([x.shape[d] for d in self.reduced]))
        self.dtype = ctx.node.attr("U") or x.dtype  # (FusedBatchNorm: T only)
        local = self.b.shape_of(x.ref)
        self.bshape = tuple(n if d == channel else 1 for d, n in enumerate(local))

    def masked(self, x):
        """x in the statistics' dtype, the padding of its split dims 0."""
        ref = mask_padding(self.b, x, self.reduced, 0)
        return ref if x.dtype == self.dtype else cast(self.b, ref, x.dtype, self.dtype)

    def total(self, ref):
        """Per-channel sum of `ref` over the reduced dims, on every device."""
        b = self.b
        local = b.op("Sum", [ref, b.const(np.asarray(self.reduced, np.int32))],
                     (self.bshape[self.ctx.rule.params.channel],), self.dtype,
                     T=self.dtype, Tidx=tf.int32, keep_dims=False)
        return _combine(self.ctx, local, self.channel_dims, self.axes, "sum", self.dtype,
                        (self.channels,))

    def broadcast(self, ref):
        """A per-channel vector shaped to broadcast against x's local block."""
        b = self.b
        return b.op("Reshape", [ref, b.const(np.asarray(self.bshape, np.int32))],
                    self.bshape, self.dtype, T=self.dtype, Tshape=tf.int32)

    def scaled(self, ref, factor):
        """ref * factor (a python number)."""
        return binary(self.b, "Mul", ref, self.b.const(np.asarray(factor), self.dtype),
                      self.dtype)

    def local(self, ref):
        """A combined per-channel vector as a result."""
        return Local(ref, Layout(self.channel_dims), (self.channels,), self.dtype)


def _reduced_split(ctx, x):
    """Whether a dim of x other than the channel is split."""
    return any(x.layout.dims[d] for d in range(len(x.shape)) if d != ctx.rule.params.channel)


@op_family(dict.fromkeys(["FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"],
                         (0, (1, 2, 3, 4))), rules.fused_batch_norm)
def fused_batch_norm(ctx, operands, layouts):
    """Training with split batch/spatial dims: global moments, then TF's inference-mode
    kernel on the local block. Outputs as TF's: the running mean and (unbiased) variance
    blended by exponential_avg_factor, the batch mean and (biased) variance as reserve
    spaces."""
    x, _, _, mean_in, var_in = operands
    if not (ctx.node.attr("is_training") and _reduced_split(ctx, x)):
        return replay(ctx, operands, layouts)
    b, node = ctx.b, ctx.node
    ch = _Channels(ctx, x)
    xm = ch.masked(x)
    mean = ch.scaled(ch.total(xm), 1.0 / ch.count)
    centered = binary(b, "Sub", xm, ch.broadcast(mean), ch.dtype)
    centered = mask_padding(b, Local(centered, x.layout, x.shape, ch.dtype), ch.reduced, 0)
    var = ch.scaled(ch.total(unary(b, "Square", centered, ch.dtype)), 1.0 / ch.count)
    shapes = local_shapes(ctx, layouts)
    outs = b.replay(node, [x.ref, operands[1].ref, operands[2].ref, mean, var], shapes,
                    node.out_dtypes, attrs={"is_training": False,
                                            "exponential_avg_factor": 1.0})
    unbiased = ch.scaled(var, ch.count / max(ch.count - 1, 1))
    factor = node.attr("exponential_avg_factor", 1.0)  # (FusedBatchNorm has none)
    running = []
    for batch, old in ((mean, mean_in), (unbiased, var_in)):
        if factor != 1.0:  # (1 - f) * running + f * batch
            batch = binary(b, "AddV2", ch.scaled(old.ref, 1.0 - factor),
                           ch.scaled(batch, factor), ch.dtype)
        running.append(ch.local(batch))
    return [outs[0]] + running + [ch.local(mean), ch.local(var)] + outs[5:]


@op_family(dict.fromkeys(["FusedBatchNormGrad", "FusedBatchNormGradV2",
                          "FusedBatchNormGradV3"], (1, (2, 3, 4))), rules.fused_batch_norm)
def fused_batch_norm_grad(ctx, operands, layouts):
    """Split batch/spatial dims, in plain ops (TF's CPU kernel of the inference-mode
    gradient takes NHWC only): with r = rsqrt(var + eps) and x_hat = (x - mean) * r,
    dscale = sum(dy * x_hat) and doffset = sum(dy), each summed locally then combined;
    dx = dy * scale * r, less in training mode the terms of the batch statistics,
    scale * r * (doffset + x_hat * dscale) / count."""
    dy, x, scale, mean, var = operands[:5]
    if not _reduced_split(ctx, x):
        return replay(ctx, operands, layouts)
    b, node = ctx.b, ctx.node
    ch = _Channels(ctx, x)
    dym, xm = ch.masked(dy), ch.masked(x)
    eps = b.const(np.asarray(node.attr("epsilon")), ch.dtype)
    r = unary(b, "Rsqrt", binary(b, "AddV2", var.ref, eps, ch.dtype), ch.dtype)
    x_hat = binary(b, "Mul", binary(b, "Sub", xm, ch.broadcast(mean.ref), ch.dtype),
                   ch.broadcast(r), ch.dtype)
    dscale = ch.total(binary(b, "Mul", dym, x_hat, ch.dtype))
    doffset = ch.total(dym)
    scale_r = binary(b, "Mul", scale.ref, r, ch.dtype)
    dx = binary(b, "Mul", dym, ch.broadcast(scale_r), ch.dtype)
    if node.attr("is_training"):
        terms = binary(b, "AddV2", ch.broadcast(doffset),
                       binary(b, "Mul", x_hat, ch.broadcast(dscale), ch.dtype), ch.dtype)
        correction = binary(b, "Mul", ch.broadcast(ch.scaled(scale_r, 1.0 / ch.count)),
                            terms, ch.dtype)
        dx = binary(b, "Sub", dx, correction, ch.dtype)
    if x.dtype != ch.dtype:
        dx = cast(b, dx, ch.dtype, x.dtype)
    # reserve_space_4/5: placeholders TF's kernel returns empty
    empty = [b.const(np.zeros(shape, dtype.as_numpy_dtype), dtype) for shape, dtype
             in zip(local_shapes(ctx, layouts)[3:], node.out_dtypes[3:])]
    return [dx, ch.local(dscale), ch.local(doffset)] + empty
