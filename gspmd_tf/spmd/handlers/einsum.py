"""Einsum: letters reduced out of one operand are summed before the contraction.

TF's Einsum sums a letter found in one operand only (and not in the result) out of that
operand first, then contracts: 'abc,cd->' is (sum_ab x0) . (sum_d x1). A local einsum
over a shard of such a letter would instead leave a partial product, summed across the
devices afterwards: x.a + x.b where one device computes x.(a + b). The two agree on
finite values (up to rounding) but not with infinities: Inf * (a + b) is +-Inf where
Inf * a + Inf * b is Inf - Inf = NaN when a and b differ in sign. So a split letter of
one operand is summed out of it locally, all-reduced, and only then contracted, in TF's
order.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import Layout
from gspmd_tf.propagation import rules
from gspmd_tf.propagation.rules import REDUCE
from gspmd_tf.registry import DOT, declare
from gspmd_tf.spmd.handlers.basic import (HALF_TYPES, local_shapes, masked_refs,
                                          reduced_in, replay)
from gspmd_tf.spmd.program import Local


def einsum(ctx, operands, layouts):
    """Einsum of two operands (see the module docstring); others are replayed, a
    half-precision one over split dims summed in float32 (as basic.reduce_sum)."""
    rule = ctx.rule
    if len(operands) != 2:
        if ctx.node.out_dtypes[0] in HALF_TYPES and ctx.split_reduce_axes():
            return reduced_in(ctx, operands, layouts, tf.float32)
        return replay(ctx, operands, layouts)
    refs = masked_refs(ctx, operands)
    summed = _split_own_letters(rule, operands)
    if not summed:
        return replay(ctx, operands, layouts)
    summed_axes = []
    for i, own, axes in summed:
        refs[i] = _sum_out(ctx, operands[i]._replace(ref=refs[i]), own, axes)
        summed_axes += axes
    ref = replay(ctx, operands, layouts, refs=refs)[0]
    layout = layouts[0]
    partial = tuple(a for a in layout.partial if a not in summed_axes)
    return [Local(ref, Layout(layout.dims, partial, layout.reduce_op), ctx.node.out_shapes[0],
                  ctx.node.out_dtypes[0])]


def _split_own_letters(rule, operands):
    """[(i, dims, axes)] for each of two operands with split letters found in it only
    (and not in the result): its dims of those letters and their mesh axes."""
    found = []
    for i, x in enumerate(operands):
        others = {f for fs in rule.operands[1 - i] for f in fs}
        own = [d for d, fs in enumerate(rule.operands[i])
               if len(fs) == 1 and rule.factor_kinds[fs[0]] == REDUCE and fs[0] not in others]
        axes = tuple(a for d in own for a in x.layout.dims[d])
        if axes:
            found.append((i, own, axes))
    return found


def _replays(ctx, operands):
    """Whether einsum() emits what replay() would for these resharded operands (a
    function of the op's Decision: see Partitioner._replay_memoised)."""
    if len(operands) != 2:
        return not (ctx.node.out_dtypes[0] in HALF_TYPES and ctx.split_reduce_axes())
    return not _split_own_letters(ctx.rule, operands)


einsum.replays = _replays


def _sum_out(ctx, x, dims, axes):
    """Local `x` summed over `dims` (kept, as size 1) and all-reduced over `axes`."""
    b = ctx.b
    local = b.shape_of(x.ref)
    ref = b.op("Sum", [x.ref, b.const(np.asarray(dims, np.int32))],
               tuple(1 if d in dims else n for d, n in enumerate(local)), x.dtype, T=x.dtype,
               Tidx=tf.int32, keep_dims=True)
    shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape))
    layout_dims = tuple(() if d in dims else a for d, a in enumerate(x.layout.dims))
    partial = Local(ref, Layout(layout_dims, axes, "sum"), shape, x.dtype)
    return ctx.reshard(partial, Layout(layout_dims)).ref


def einsum_multiply_adds(node, in_shapes):
    """An Einsum's multiply-adds: its output's elements times the sizes of the letters it
    sums over (an ellipsis's dims are batch dims); 0 for one operand (sums only)."""
    if len(in_shapes) < 2:
        return 0
    terms, output = node.attr("equation").replace(" ", "").split("->")
    size = {}
    for term, shape in zip(terms.split(","), in_shapes):
        front, _, back = term.partition("...")
        size.update(zip(front, shape))
        if back:
            size.update(zip(back, shape[len(shape) - len(back):]))
    return math.prod(node.out_shapes[0]) * math.prod(
        n for letter, n in size.items() if letter not in output)


declare("Einsum", rules.einsum, emit=einsum, multiply_adds=einsum_multiply_adds,
        traits=[DOT])
