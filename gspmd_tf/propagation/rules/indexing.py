"""Rules of ops that index a tensor: GatherV2, GatherNd, ScatterNd and TensorScatter*,
OneHot and Roll.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from gspmd_tf.propagation.oprule import (PASS, REDUCE, REPLICATE, OpRule, RuleContext,
                                        einsum_letters, einsum_rule, passing_dims, per_dim,
                                        whole_dims)


@dataclass(frozen=True)
class GatherParams:
    """OpRule.params of GatherV2/ResourceGather: the gathered table dim, and how many
    leading dims table and indices share (batch_dims)."""

    axis: int
    batch_dims: int


def gather(ctx: RuleContext) -> Optional[OpRule]:
    """GatherV2/ResourceGather: indices dims and the table's other dims pass; the gathered
    table dim is REDUCE (masked local lookup, then all-reduce of the partial result).
    The first batch_dims dims of table and indices are one PASS factor each, shared with
    the result: a parallel gather, each device looking up its own batch, as XLA does."""
    table, indices = ctx.in_shapes[0], ctx.in_shapes[1]
    batch_dims = ctx.node.attr("batch_dims") or 0
    if batch_dims < 0:
        batch_dims += len(indices)
    if ctx.node.op == "ResourceGather":  # gathers the first dim after the batch
        axis = batch_dims
    else:
        axis = ctx.const(2)
        if axis is None:
            return None
        axis = int(axis) % len(table)
    if not 0 <= batch_dims <= min(axis, len(indices)):
        return None
    t = einsum_letters(len(table))
    ind = t[:batch_dims] + einsum_letters(len(indices) - batch_dims, len(table))
    out = t[:axis] + ind[batch_dims:] + t[axis + 1:]
    rule = einsum_rule(f"{t},{ind}->{out}", [table, indices], ctx.out_shapes[0])
    rule.operands += [None] * (len(ctx.in_shapes) - 2)
    rule.params = GatherParams(axis, batch_dims)
    return rule


def one_hot(ctx: RuleContext) -> Optional[OpRule]:
    """OneHot: indices dims pass; the new depth dim is a fresh factor."""
    out = ctx.out_shapes[0]
    axis = ctx.node.attr("axis")
    axis = len(out) - 1 if axis == -1 else axis
    ind = einsum_letters(len(ctx.in_shapes[0]))
    out_letters = ind[:axis] + "Z" + ind[axis:]
    rule = einsum_rule(f"{ind}->{out_letters}", ctx.in_shapes[:1], out)
    rule.operands += [None, None, None]
    return rule


def _nd_indexed(rule, indices, table, batch_kind, indexed_kind=REPLICATE):
    """Dims of a GatherNd/ScatterNd's indices [B..., K] and of its indexed tensor: the
    index batch dims B are factors of `batch_kind`, K whole, the K indexed dims of the
    tensor of `indexed_kind`, its trailing dims pass (shared with the slices). Returns
    (index dims, tensor dims, batch dims, trailing dims)."""
    k = indices[-1]
    batch = tuple((rule.add_factor(n, batch_kind),) if n > 1 else () for n in indices[:-1])
    index_dims = batch + (whole_dims(rule, k),)
    indexed = tuple((rule.add_factor(n, indexed_kind),) if n > 1 else () for n in table[:k])
    trailing = passing_dims(rule, table[k:])
    return index_dims, indexed + trailing, batch, trailing


def gather_nd(ctx: RuleContext) -> Optional[OpRule]:
    """GatherNd params [P...], indices [B..., K] -> [B..., P[K:]]: index batch dims pass,
    the trailing params dims pass; the K indexed params dims are REDUCE (split: a masked
    local lookup, partial results summed, as GatherV2's gathered dim)."""
    rule = OpRule()
    index_dims, params_dims, batch, trailing = _nd_indexed(
        rule, ctx.in_shapes[1], ctx.in_shapes[0], PASS, REDUCE)
    rule.operands = [params_dims, index_dims]
    rule.results = [batch + trailing]
    return rule


def scatter_nd(ctx: RuleContext, indices_input, batch_kind) -> Optional[OpRule]:
    """ScatterNd (indices, updates, shape) and TensorScatter* (tensor, indices, updates):
    updates [B..., S[K:]] go to the K indexed dims of a result of shape S. The index batch
    dims B are `batch_kind`: REDUCE where scattered sums add up (split: partial results),
    REPLICATE where a later update overwrites an earlier one. The K indexed dims stay whole,
    the trailing dims pass."""
    rule = OpRule()
    out = ctx.out_shapes[0]
    index_dims, out_dims, batch, trailing = _nd_indexed(
        rule, ctx.in_shapes[indices_input], out, batch_kind)
    operands = [None] * len(ctx.in_shapes)
    operands[indices_input] = index_dims
    operands[indices_input + 1] = batch + trailing  # updates
    if indices_input == 1:  # TensorScatter*: the tensor written into
        operands[0] = out_dims
    rule.operands = operands
    rule.results = [out_dims]
    return rule


def resource_scatter(ctx: RuleContext, nd: bool) -> Optional[OpRule]:
    """ResourceScatter* (variable, indices [B...], updates [B..., S[1:]]) and, with `nd`,
    ResourceScatterNd* (indices [B..., K], updates [B..., S[K:]]) on a variable of shape
    S, updated in place (no result): the indexed dims and the index batch dims whole, the
    trailing dims pass (each device applies every update to its block of them, in TF's
    order). None for updates of another rank (a scalar broadcast)."""
    variable, indices, updates = ctx.in_shapes[:3]
    rule = OpRule()
    index_dims, variable_dims, batch, trailing = _nd_indexed(
        rule, tuple(indices) if nd else tuple(indices) + (1,), variable, REPLICATE)
    if len(updates) != len(batch) + len(trailing):
        return None
    rule.operands = [variable_dims, index_dims if nd else index_dims[:-1], batch + trailing]
    rule.results = []
    return rule


@dataclass(frozen=True)
class RollParams:
    """OpRule.params of Roll: per rolled dim, its net shift in [1, n) as (dim, shift)
    pairs (TF adds the shifts of an axis named twice; a shift of a multiple of n is no
    roll and left out)."""

    shifts: tuple


def roll(ctx: RuleContext) -> Optional[OpRule]:
    """Roll with constant shift and axis: every dim passes, a rolled one too (a cyclic
    shift of a split dim is a collective-permute of blocks: handlers/roll.py). Without
    a constant axis the op has no rule; without a constant shift the axes stay whole."""
    x = ctx.in_shapes[0]
    axis, shift = ctx.const(2), ctx.const(1)
    if axis is None:
        return None
    axes = [int(a) % len(x) for a in np.atleast_1d(axis)]
    if shift is None:
        return per_dim(ctx, set(axes))
    net = {}
    for a, s in zip(axes, np.broadcast_to(np.atleast_1d(shift), (len(axes),))):
        # an empty dim has nothing to roll (TF accepts any shift of it)
        net[a] = (net.get(a, 0) + int(s)) % x[a] if x[a] else 0
    rule = per_dim(ctx, set())
    rule.params = RollParams(tuple(sorted((a, s) for a, s in net.items() if s)))
    return rule
