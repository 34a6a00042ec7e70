"""The partitioner's choice for one op: the mesh axes of every factor of its rule.

Variables and TensorLists keep their layouts (their shards cannot move); otherwise a few
greedy orders of the operands' and results' layouts are tried and the one whose reshards
cost least on the cost model wins (choose_factor_axes). A factor split into sub-factors
keeps only splits that stay exact (_keep_sub_factors_exact).
"""

from __future__ import annotations

import numpy as np

from gspmd_tf.layout import Layout, merged_layout, overlap
from gspmd_tf.propagation.rules import REDUCE, REPLICATE
from gspmd_tf.spmd import planner
from gspmd_tf.spmd.program import UNMOVABLE

def _split_candidates(mesh, rule, dims_factors, layout):
    """Per factor, the axes a tensor's layout gives it (sub-factors split major first,
    evenly; a dim that is one factor may be split unevenly)."""
    found = {}
    for fs, axes in zip(dims_factors, layout.dims):
        k = 0
        for f in fs:
            start, p, size = k, 1, rule.factor_sizes[f]
            if len(fs) == 1:
                k, p = len(axes), size
            else:
                while k < len(axes) and size % (p * mesh.axis_size(axes[k])) == 0:
                    p *= mesh.axis_size(axes[k])
                    k += 1
            found.setdefault(f, axes[start:k])
            if p != size:
                break
    return found


def choose_factor_axes(mesh, model, rule, inputs, targets, node):
    """Mesh axes for every factor, each axis used once.

    Variables and TensorLists come first (their shards cannot move). Then a few greedy orders are tried
    and the one whose reshards cost least on cost model `model` (planner.seconds of every
    operand's and result's plan) wins, the first on a tie: the result targets before the operands; the operands'
    split reduced factors first (compute a partial result and reduce-scatter it, rather
    than gather an operand); the operands before the results; the operands largest first
    (when operands' splits conflict, keep the larger one's: it is the costlier to move).
    """
    operands = [(dims, x) for dims, x in zip(rule.operands, inputs) if dims is not None]
    fixed = [(dims, x.layout) for dims, x in operands if x.dtype in UNMOVABLE]
    results = [(dims, t) for dims, t in zip(rule.results, targets) if dims is not None]
    movable = [(dims, x) for dims, x in operands if x.dtype not in UNMOVABLE]
    others = [(dims, x.layout) for dims, x in movable]
    pinned = _assign(mesh, rule, fixed)
    # a variable's unsplit dims are as binding as its split ones
    pinned_factors = {f for dims, _ in fixed for fs in dims for f in fs}
    best = _assign(mesh, rule, results + others, start=pinned, pinned=pinned_factors)
    if not others:
        return best
    best_cost = _reshard_cost(mesh, model, rule, best, inputs, targets, node)
    if best_cost == 0:  # nothing moves: no candidate can do better
        return best
    largest_first = [(dims, x.layout) for dims, x in
                     sorted(movable, key=lambda item: -_local_bytes(mesh, item[1]))]
    candidates = []
    if REDUCE in rule.factor_kinds:
        reduced = _assign(mesh, rule, others, kinds=(REDUCE,), start=pinned,
                          pinned=pinned_factors)
        candidates.append(_assign(mesh, rule, results + others, start=reduced,
                                  pinned=pinned_factors))
    candidates += [_assign(mesh, rule, others + results, start=pinned, pinned=pinned_factors),
                   _assign(mesh, rule, largest_first + results, start=pinned,
                           pinned=pinned_factors)]
    tried = [best]
    for chosen in candidates:
        if chosen in tried:
            continue
        tried.append(chosen)
        estimate = _reshard_cost(mesh, model, rule, chosen, inputs, targets, node)
        if estimate < best_cost:
            best, best_cost = chosen, estimate
    return best


def _local_bytes(mesh, x):
    return int(np.prod(x.layout.local_shape(mesh, x.shape), dtype=np.int64)) * (x.dtype.size or 8)


def _assign(mesh, rule, sources, kinds=None, start=None, pinned=()):
    """Factor axes taken greedily from `sources` (dims, layout) in order; factors in
    `pinned` keep what `start` gives them."""
    chosen = list(start) if start else [()] * len(rule.factor_sizes)
    group = rule.independent_groups() or [0] * len(chosen)  # axes are unique per group
    taken = {g: {a for f, axes in enumerate(chosen) if group[f] == g for a in axes}
             for g in set(group)}
    for dims, layout in sources:
        for f, axes in _split_candidates(mesh, rule, dims, layout).items():
            kind = rule.factor_kinds[f]
            if (chosen[f] or not axes or kind == REPLICATE or f in pinned
                    or (kinds and kind not in kinds)):
                continue
            if not any(overlap(a, b) for a in axes for b in taken[group[f]]):
                chosen[f] = tuple(axes)
                taken[group[f]].update(axes)
    _keep_sub_factors_exact(mesh, rule, chosen)
    return chosen


def _reshard_cost(mesh, model, rule, chosen, inputs, targets, node):
    """planner.seconds of a choice on `model`: every operand resharded to its factors' axes,
    every result (partial over the split REDUCE factors) resharded to its target."""
    def layout_of(dims, partial=()):
        return merged_layout(Layout(tuple(tuple(a for f in fs for a in chosen[f])
                                          for fs in dims), partial, rule.reduce_op))

    total = 0.0
    for dims, x in zip(rule.operands, inputs):
        if dims is not None:
            total += planner.plan_estimate(x.layout, layout_of(dims), x.shape, x.dtype, mesh,
                                           model)
    partial = tuple(a for f, kind in enumerate(rule.factor_kinds) if kind == REDUCE
                    for a in chosen[f])
    for dims, target, shape, dtype in zip(rule.results, targets, node.out_shapes,
                                          node.out_dtypes):
        if dims is not None:
            total += planner.plan_estimate(layout_of(dims, partial), target, shape, dtype,
                                           mesh, model)
    return total


def _keep_sub_factors_exact(mesh, rule, chosen):
    """In a dim made of several factors, a factor may be split only evenly, and a minor
    factor only when every factor before it is split completely. Repeated until nothing
    changes: unsplitting a factor in one tensor's dim can block a minor factor in another
    tensor's (fuzzer, seed 46 #198: a reshape to [2, 24, 2, 2] kept a split it lost)."""
    before = None
    while before != chosen:
        before = list(chosen)
        for dims_list in list(rule.operands) + list(rule.results):
            for fs in dims_list or ():
                if len(fs) < 2:
                    continue
                blocked = False
                for f in fs:
                    size = rule.factor_sizes[f]
                    if blocked:
                        chosen[f] = ()
                        continue
                    axes = chosen[f]
                    while axes and size % mesh.axes_size(axes) != 0:
                        axes = axes[:-1]
                    chosen[f] = axes
                    blocked = mesh.axes_size(axes) != size
