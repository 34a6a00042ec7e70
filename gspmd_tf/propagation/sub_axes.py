"""Mesh sub-axes in propagation: the mesh as the core sees it, some axes cut into parts.

Shardy writes a part of a mesh axis as "x":(2)2 (mesh.SubAxis: `size` devices of the axis
with `pre` devices in the parts more major). The core (csrc/propagation.pyx) knows only
numbered axes of given sizes, so sub-axes enter it as axes of their own: an AxisView is
the mesh with each axis that is cut replaced by its parts, major first. Every layout
going in names the parts (a whole axis is all its parts, in order, in one dim), and every
layout coming out is merged back (layout.merged_layout): a whole axis wherever a tensor
holds all its parts in order, a SubAxis where it holds only some.

Which axes are cut: at the bounds of the sub-axes the seeds name, and where a Reshape
splits a dim into dims whose major one is smaller than an axis it shares a factor with
((48,) -> (6, 8) on an axis of 4 devices: cut at gcd(6, 4) = 2). There the major part
can split the major dim and the minor part the next one, so (8,) -> (2, 4) split over x
is a local reshape with the result split over (x:(1)2, x:(2)2), and (48,) -> (6, 8) needs
only a gather over the minor part x:(2)2, as XLA's plans (issue 24, item 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd

from gspmd_tf.layout import Layout, axis_parts, cut_axes, sub_axes_of
from gspmd_tf.mesh import Mesh, SubAxis
from gspmd_tf.propagation.oprule import OpRule
from gspmd_tf.propagation.rules.reshapes import reshape_factors

# op types whose rule is rules.reshape and whose dims regroup (the cut candidates)
_RESHAPES = frozenset({"Reshape"})


@dataclass(frozen=True)
class AxisView:
    """The mesh's axes as propagation numbers them: `axis_names` (names, or SubAxis
    parts of a cut axis) and their `shape`; `cuts` the SubAxis parts (empty: the mesh's
    own axes)."""

    axis_names: tuple
    shape: tuple
    cuts: tuple = ()

    def cut(self, layout: Layout) -> Layout:
        """`layout` in this view's axes (each cut axis as its parts)."""
        return cut_axes(layout, self.cuts) if self.cuts else layout


def axis_view(graph, mesh: Mesh, seeds, max_axes: int) -> AxisView:
    """The AxisView propagation of `graph` runs on: `mesh`'s axes cut where the seeds
    name sub-axes or a Reshape splits a dim into a major dim smaller than an axis
    (module doc); no cut where a seed would then hold more than `max_axes` axes in a
    dim (the core's limit)."""
    cuts = [a for layout in seeds.values() for a in sub_axes_of(layout)]
    cuts += _reshape_cuts(graph, mesh)
    parts = axis_parts(cuts)
    if not parts:
        return AxisView(mesh.axis_names, mesh.shape)
    names, shape = [], []
    for name, size in zip(mesh.axis_names, mesh.shape):
        for p in parts.get(name, (name,)):
            names.append(p)
            shape.append(p.size if isinstance(p, SubAxis) else size)
    view = AxisView(tuple(names), tuple(shape), tuple(p for ps in parts.values() for p in ps))
    if any(len(axes) > max_axes for layout in seeds.values()
           for axes in view.cut(layout).dims):
        return AxisView(mesh.axis_names, mesh.shape)
    return view


def _reshape_cuts(graph, mesh):
    """SubAxis parts (major) cutting an axis of s devices at g = gcd(a, s), 1 < g < s,
    for each Reshape dim made of several factors whose major factor a the whole axis
    does not divide."""
    if all(_is_prime_or_one(s) for s in mesh.shape):
        return []  # no axis has a g with 1 < g < s: nothing to look for (exact)
    majors = set()
    for node in graph.nodes:
        if node.op not in _RESHAPES or not node.inputs:
            continue
        in_shape, out_shape = graph.shape(node.inputs[0]), node.out_shapes[0]
        if None in in_shape or None in out_shape:
            continue
        majors.update(_split_majors(tuple(in_shape), tuple(out_shape)))
    return sorted({SubAxis(name, 1, g, s) for major in majors
                   for name, s in zip(mesh.axis_names, mesh.shape)
                   for g in (gcd(major, s),) if 1 < g < s})


@lru_cache(maxsize=4096)
def _split_majors(in_shape, out_shape):
    """The major factor sizes of the dims of a reshape `in_shape` -> `out_shape` made of
    several factors (per distinct pair of shapes: a stack of layers repeats a few)."""
    rule = OpRule()
    return frozenset(rule.factor_sizes[fs[0]]
                     for dims in reshape_factors(rule, in_shape, out_shape)
                     for fs in dims if len(fs) > 1)


def _is_prime_or_one(n):
    """Whether `n` has no divisor g with 1 < g < n."""
    return all(n % g for g in range(2, int(n ** 0.5) + 1))
