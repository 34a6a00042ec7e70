"""Rules of ops that reduce or scan dims: reductions, arg-reductions, segment sums,
cumulative ops and ops that mix their last dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from gspmd_tf.propagation.oprule import (REDUCE, OpRule, RuleContext, einsum_letters,
                                        einsum_rule, per_dim)


@dataclass(frozen=True)
class ReductionParams:
    """OpRule.params of a reduction (Sum, Mean, ArgMax...): its reduced dims, sorted."""

    axes: tuple


def _axes(ctx: RuleContext, i, rank) -> Optional[OpRule]:
    value = ctx.const(i)
    if value is None:
        return None
    return sorted({int(a) % rank for a in np.atleast_1d(value)})


def reduction(ctx: RuleContext, reduce_op) -> Optional[OpRule]:
    """Sum/Mean/Max/...: reduced dims are REDUCE factors."""
    shape = ctx.in_shapes[0]
    axes = _axes(ctx, 1, len(shape))
    if axes is None:
        return None
    letters = einsum_letters(len(shape))
    keep = ctx.node.attr("keep_dims")
    out = "".join(l for d, l in enumerate(letters) if d not in axes or keep)
    rule = einsum_rule(f"{letters}->{out}", [shape], ctx.out_shapes[0], reduce_op)
    if keep:  # kept reduced dims have size 1 in the result: no factor there
        rule.results[0] = tuple(() if d in axes else f for d, f in enumerate(rule.results[0]))
        for d in axes:
            if shape[d] > 1:
                rule.factor_kinds[rule.operands[0][d][0]] = REDUCE
    rule.operands.append(None)
    rule.params = ReductionParams(tuple(axes))
    return rule


def arg_reduction(ctx: RuleContext) -> Optional[OpRule]:
    """ArgMax/ArgMin: the reduced dim may be split (the handler combines (value, index))."""
    shape = ctx.in_shapes[0]
    axes = _axes(ctx, 1, len(shape))
    if axes is None:
        return None
    letters = einsum_letters(len(shape))
    out = "".join(l for d, l in enumerate(letters) if d not in axes)
    rule = einsum_rule(f"{letters}->{out}", [shape], ctx.out_shapes[0], "arg")
    rule.operands.append(None)
    rule.params = ReductionParams(tuple(axes))
    return rule


def unsorted_segment(ctx: RuleContext, reduce_op) -> Optional[OpRule]:
    """UnsortedSegmentSum/Max/Min/Prod: data [N..., D...], segment_ids [N...] ->
    [num_segments, D...]. The segment dims N are REDUCE (partial result); D pass; the
    segment dim of the result is a factor of its own (each device keeps the segments of
    its block)."""
    data, ids = ctx.in_shapes[0], ctx.in_shapes[1]
    letters = einsum_letters(len(data) + 1)
    seg = letters[-1]
    out = seg + letters[len(ids):len(data)]
    rule = einsum_rule(f"{letters[:len(data)]},{letters[:len(ids)]}->{out}",
                       [data, ids], ctx.out_shapes[0], reduce_op)
    rule.operands.append(None)
    return rule


def cumulative(ctx: RuleContext) -> Optional[OpRule]:
    """Cumsum/Cumprod along a constant axis: that axis whole, the others pass."""
    axis = ctx.const(1)
    if axis is None:
        return None
    return per_dim(ctx, {int(axis) % len(ctx.in_shapes[0])})


def last_dims_whole(ctx: RuleContext, count) -> Optional[OpRule]:
    """Ops that mix the last `count` dims (MatrixBandPart: 2, TopKV2: 1): those whole,
    batch dims pass; every result (TopKV2's values and indices) shares the rule's."""
    rank = len(ctx.in_shapes[0])
    rule = per_dim(ctx, set(range(rank - count, rank)))
    rule.results *= len(ctx.out_shapes)
    return rule
