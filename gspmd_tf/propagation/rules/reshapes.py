"""Rules of ops that regroup dims: Transpose, Reshape (sub-factors), ExpandDims/Squeeze
and Bitcast.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from gspmd_tf.propagation.oprule import (REPLICATE, OpRule, RuleContext, einsum_letters,
                                        einsum_rule, spread_operands)


def transpose(ctx: RuleContext) -> Optional[OpRule]:
    """Transpose by a constant permutation."""
    perm = ctx.const(1)
    if perm is None:
        return None
    letters = einsum_letters(len(ctx.in_shapes[0]))
    rule = einsum_rule(f"{letters}->{''.join(letters[p] for p in perm)}",
                       ctx.in_shapes[:1], ctx.out_shapes[0])
    rule.operands.append(None)
    return rule


def reshape(ctx: RuleContext, data_inputs=(0,)) -> Optional[OpRule]:
    """Reshape (also ExpandDims, Squeeze): dims split into common sub-factors.

    Where the Reshape merges a dim with the dims after it, an uneven split of the major
    dim cannot be a sub-factor of the merged dim, but the Reshape's handler re-blocks the
    merged dim exactly (spmd/handlers/reshape.py); `uneven_major` lets propagation carry
    such a split forward, from the operand to the result, so the merged dim keeps it.
    Not backward (a free operand's producer is often sliced from a replicated tensor for
    nothing, where the re-block would add a collective-permute), and not into the
    reverse reshape's unevenly split major dim (its padded blocks cost more to gather
    later than the even operand; docs/DESIGN_LOG.md, "Merging reshapes with free
    results")."""
    rule = OpRule()
    in_shape, out_shape = ctx.in_shapes[0], ctx.out_shapes[0]
    in_dims, out_dims = reshape_factors(rule, in_shape, out_shape)
    rule.operands = spread_operands([in_dims], data_inputs, len(ctx.in_shapes))
    rule.results = [out_dims]
    rule.uneven_major = tuple((0, d) for d in merge_dims(in_shape, out_shape)
                              if len(out_dims[d]) > 1 and in_shape[d] > 1)
    return rule


def merge_dims(wide_shape, narrow_shape):
    """The dims d at which `narrow_shape` is `wide_shape` with dims [d, d + m) merged
    into one, m = len(wide_shape) - len(narrow_shape) + 1 >= 2, every other dim equal
    (several when size-1 dims make the place ambiguous; none when not such a merge)."""
    wide, narrow = tuple(wide_shape), tuple(narrow_shape)
    merged = len(wide) - len(narrow) + 1
    if merged < 2:
        return []
    return [d for d in range(len(narrow))
            if wide[:d] == narrow[:d] and wide[d + merged:] == narrow[d + 1:]]


def reshape_factors(rule, in_shape, out_shape):
    """Sub-factors shared by the dims of two shapes of equal size.

    Both shapes index the same flat array. A factor is shared only where it is the same
    digit of the flat index in both: the same size and the same product of everything
    major to it. Walking both shapes major to minor, the gcd of what is left of the
    current dims is such a digit while the walk is aligned. Where the dims share nothing
    (gcd 1), the shapes regroup the flat index differently: what is left of each dim up
    to the next point where the products of whole dims meet again is REPLICATE. A tensor
    without elements has no data to split: its dims are all REPLICATE.
    """
    in_dims = [[] for _ in in_shape]
    out_dims = [[] for _ in out_shape]
    if 0 in in_shape or 0 in out_shape:
        for dims, shape in ((in_dims, in_shape), (out_dims, out_shape)):
            for dim, size in zip(dims, shape):
                if size > 1:
                    dim.append(rule.add_factor(size, REPLICATE))
        return tuple(map(tuple, in_dims)), tuple(map(tuple, out_dims))
    walk_in, walk_out = _DimWalk(in_shape, in_dims), _DimWalk(out_shape, out_dims)
    aligned = True
    while walk_in.more() and walk_out.more():
        if aligned:
            g = int(np.gcd(walk_in.left, walk_out.left))
            if g > 1:
                f = rule.add_factor(g)
                walk_in.take(f, g)
                walk_out.take(f, g)
                continue
            aligned = False
        # misaligned: replicate the rest of the dim that ends first (both on a tie)
        end_in, end_out = walk_in.dim_end(), walk_out.dim_end()
        if end_in <= end_out:
            walk_in.take(rule.add_factor(walk_in.left, REPLICATE), walk_in.left)
        if end_out <= end_in:
            walk_out.take(rule.add_factor(walk_out.left, REPLICATE), walk_out.left)
        aligned = end_in == end_out
    return tuple(map(tuple, in_dims)), tuple(map(tuple, out_dims))


class _DimWalk:
    """A walk over a shape's dims major to minor, taking sub-factors of the current dim
    (size-1 dims skipped); `left` is what is left of the current dim."""

    def __init__(self, shape, dims):
        self.shape, self.dims = shape, dims
        self.dim, self.done = -1, 1  # `done`: product of everything taken
        self.left = 1
        self._skip_finished()

    def _skip_finished(self):
        while self.left == 1 and self.dim + 1 < len(self.shape):
            self.dim += 1
            self.left = self.shape[self.dim]

    def more(self):
        """True while something is left to take."""
        return self.left > 1

    def dim_end(self):
        """Product of everything up to the end of the current dim."""
        return self.done * self.left

    def take(self, factor, size):
        """Give the current dim its next sub-factor, of `size`."""
        self.dims[self.dim].append(factor)
        self.left //= size
        self.done *= size
        self._skip_finished()


def squeeze_or_expand(ctx: RuleContext) -> Optional[OpRule]:
    """ExpandDims/Squeeze are reshapes of size-1 dims."""
    return reshape(ctx)


def bitcast(ctx: RuleContext) -> Optional[OpRule]:
    """Bitcast: the dims both sides have pass; the minor dim a bitcast to a narrower type
    adds (or to a wider one removes) is in one tensor only and stays whole."""
    x, y = ctx.in_shapes[0], ctx.out_shapes[0]
    rule = OpRule()
    shared = tuple((rule.add_factor(n),) if n > 1 else () for n in x[:min(len(x), len(y))])

    def whole(shape):
        return tuple((rule.add_factor(n, REPLICATE),) if n > 1 else ()
                     for n in shape[len(shared):])
    rule.operands = [shared + whole(x)]
    rule.results = [shared + whole(y)]
    return rule
