"""Candidate strategies of one node, made from its registry rule.

A strategy of an op is which mesh axes split which of its rule's factors (each axis
splits one factor or none, as XLA's auto-sharding enumerates a dot's strategies per mesh
dim). From it follow every operand's and result's layout, the axes a contraction leaves
partial (an all-reduce) and how many ways the op's work is divided. A strategy leaving
its one result partial comes also in reduce-scatter forms (the partial axes split one
more result dim): without them the search could not see the partitioner's cheapest
row-parallel plan (reduce-scatter into a split activation) and priced a gather instead,
which the partitioner then did not emit. Because candidates
come from OpRules, any op with a rule (also a user's, gt.register_op) takes part in the
search. A program input has no rule: its candidates are which axes split which dim.

On a mesh of three or more axes, every axis choosing freely makes (factors + 1) ** axes
strategies per op and the reshard costs between two ops grow with the square of that
(a 2x2x2 mesh: 216 strategies per attention einsum, 810k variables for two layers). As
XLA's auto-sharding solves an N-d mesh as 2-d ones, the candidates are those of the
2-axis meshes made by cutting the axes in two runs (major and minor) that each split one
thing: on (a, b, c), (a | b c) and (a b | c). A layout splitting three factors over
three axes is left out; `merged=False` lists every strategy (a given layout that only
the full list has).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

from gspmd_tf.layout import Layout
from gspmd_tf.mesh import Mesh
from gspmd_tf.propagation.oprule import REDUCE, REPLICATE, OpRule


@dataclass(frozen=True)
class Strategy:
    """One candidate of a node: the layout of each data operand (None for an input that
    is not data), of each result, the mesh axes its contraction leaves partial, and the
    number of devices its work is divided over. `scattered`: the partial sum is
    reduce-scattered into the result's layout (which splits a dim over the partial axes)
    rather than all-reduced."""

    operands: tuple
    results: tuple
    partial: tuple
    divisor: int
    scattered: bool = False


def _split_axes(mesh: Mesh) -> tuple:
    """The mesh axes that split anything (an axis of one device splits nothing)."""
    return tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1)


def _dim_axes(factors: tuple, factor_axes: dict, sizes: Sequence[int],
              mesh: Mesh) -> Optional[tuple]:
    """The axes of a dim made of `factors` (major first), or None when they do not make
    a tiling of the dim: a minor factor may be split only below a major one split whole
    (Shardy's rule for merged dims)."""
    axes = ()
    for position, f in enumerate(factors):
        own = factor_axes.get(f, ())
        if own and position > 0:
            major = factors[position - 1]
            if mesh.axes_size(factor_axes.get(major, ())) != sizes[major]:
                return None
        axes += own
    return axes


def _axis_choices(options: list, count: int, merged: bool):
    """What each of `count` mesh axes splits (an entry of `options` per axis): every
    combination, or with `merged` on 3+ axes only those of two runs of axes (module
    doc). The all-first-option choice comes first."""
    if not merged or count <= 2:
        yield from itertools.product(options, repeat=count)
        return
    for cut in range(1, count):
        for major, minor in itertools.product(options, repeat=2):
            yield (major,) * cut + (minor,) * (count - cut)


def rule_strategies(rule: OpRule, mesh: Mesh, merged: bool = True) -> list[Strategy]:
    """The strategies of an op with `rule` on `mesh`, distinct by layouts: each mesh
    axis splits one factor that is not REPLICATE and whose size the axes on it divide
    evenly, or none (on 3+ axes with `merged`, in two runs of axes: module doc). The
    replicated strategy comes first."""
    axes = _split_axes(mesh)
    sizes = rule.factor_sizes
    splittable = [f for f, kind in enumerate(rule.factor_kinds) if kind != REPLICATE]
    found = {}
    for choice in _axis_choices([None] + splittable, len(axes), merged):
        factor_axes = {}
        for axis, f in zip(axes, choice):
            if f is not None:
                factor_axes[f] = factor_axes.get(f, ()) + (axis,)
        if any(sizes[f] % mesh.axes_size(a) for f, a in factor_axes.items()):
            continue
        strategy = _strategy(rule, factor_axes, mesh)
        if strategy is not None:
            for s in (strategy, *_scattered(strategy, rule, mesh)):
                found.setdefault((s.operands, s.results, s.partial), s)
    return list(found.values())


def _scattered(strategy: Strategy, rule: OpRule, mesh: Mesh) -> list[Strategy]:
    """The reduce-scatter forms of a strategy whose one result is left partial: the
    partial axes split one more result dim (minor to the axes it has), where they divide
    it. XLA's auto-sharding lists these beside the all-reduce form of a dot: the sum then
    moves as much as an all-reduce's would (less with a native reduce-scatter) and the
    result takes 1/k of the memory, the layout the Megatron plan's row-parallel
    projections produce."""
    if not strategy.partial or len(strategy.results) != 1 or strategy.results[0] is None:
        return []
    result = strategy.results[0]
    k = mesh.axes_size(strategy.partial)
    shape = [rule.factor_sizes[fs[0]] if len(fs) == 1 else None for fs in rule.results[0]]
    out = []
    for d, axes in enumerate(result.dims):
        if shape[d] is None or shape[d] % (mesh.axes_size(axes) * k):
            continue
        out.append(Strategy(strategy.operands, (result.with_dim(d, axes + strategy.partial),),
                            strategy.partial, strategy.divisor, scattered=True))
    return out


def _strategy(rule, factor_axes, mesh) -> Optional[Strategy]:
    """The Strategy of one factor -> axes assignment (None: not a tiling)."""
    sizes = rule.factor_sizes

    def layouts(tensors):
        out = []
        for dims in tensors:
            if dims is None:
                out.append(None)
                continue
            per_dim = tuple(_dim_axes(fs, factor_axes, sizes, mesh) for fs in dims)
            if any(d is None for d in per_dim):
                return None
            out.append(Layout(per_dim))
        return tuple(out)

    operands, results = layouts(rule.operands), layouts(rule.results)
    if operands is None or results is None:
        return None
    partial = tuple(a for f, a_s in factor_axes.items() if rule.factor_kinds[f] == REDUCE
                    for a in a_s)
    divisor = mesh.axes_size(tuple(a for a_s in factor_axes.values() for a in a_s))
    return Strategy(operands, results, tuple(sorted(partial, key=mesh.axis_index)), divisor)


def tensor_strategies(shape: Sequence[int], mesh: Mesh) -> list[Strategy]:
    """The even layouts of a program input of `shape` (each mesh axis splits one dim
    it divides, or none; several axes on one dim in mesh order; on 3+ axes in two runs
    of axes), as Strategies with that layout as their one result. The replicated layout
    comes first."""
    axes = _split_axes(mesh)
    found = {}
    dims = [d for d, n in enumerate(shape) if n > 1]
    for choice in _axis_choices([None] + dims, len(axes), True):
        per_dim = [()] * len(shape)
        for axis, d in zip(axes, choice):
            if d is not None:
                per_dim[d] += (axis,)
        if any(n % mesh.axes_size(a) for n, a in zip(shape, per_dim)):
            continue
        layout = Layout(tuple(per_dim))
        found.setdefault(layout, Strategy((), (layout,), (), 1))
    return list(found.values())


def fixed_strategy(layout: Layout) -> Strategy:
    """The one strategy of an input whose layout is given."""
    return Strategy((), (layout,), (), 1)
