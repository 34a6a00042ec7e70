"""Layout: the mesh-axis form of a sharding used by propagation and the partitioner."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import PartitionSpec, SubAxis


def ceil_div(a, b):
    """Smallest integer >= a / b."""
    return -(-a // b)


@dataclass(frozen=True)
class Layout:
    """Per-dim mesh axes (major to minor), plus axes with a pending reduction.

    An axis is a mesh axis name or a mesh.SubAxis, part of one ("x:(1)2"), in the form
    merged_layout gives (a whole axis wherever all its parts are, in order, in one dim).
    Axes used neither in `dims` nor in `partial` are replicated. `partial` is only ever
    set inside the partitioner: the local values still need `reduce_op` over those axes.
    """

    dims: tuple
    partial: tuple = ()
    reduce_op: str = "sum"

    def __post_init__(self):
        if not self.partial:  # the reduction only matters while something is pending
            object.__setattr__(self, "reduce_op", "sum")

    def __hash__(self):
        # computed once per object: the partitioner's memo keys hash layouts per op
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash((self.dims, self.partial, self.reduce_op))
            object.__setattr__(self, "_hash", value)
            return value

    def __getstate__(self):
        # a str hash differs between processes: an unpickled layout computes its own
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    @classmethod
    def replicated(cls, rank):
        """No dim split."""
        return cls(((),) * rank)

    @classmethod
    def from_spec(cls, mesh, spec, rank, what="tensor"):
        """Check `spec` against the mesh and rank; ShardingError names `what` if bad."""
        spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)
        if len(spec) > rank:
            raise ShardingError(
                f"{what}: spec {spec!r} has {len(spec)} entries but the tensor has rank "
                f"{rank}; give at most {rank} entries")
        dims = tuple(tuple(mesh.parse_axis(name) for name in spec.axes_of(d))
                     for d in range(rank))
        seen = []
        for axes in dims:
            for name in axes:
                if any(overlap(name, other) for other in seen):
                    raise ShardingError(
                        f"{what}: spec {spec!r} uses mesh axis {str(name)!r} twice (or parts "
                        "of it that overlap); a mesh axis can split at most one dim")
                seen.append(name)
        # an axis of one device splits nothing; dropping it keeps handlers on their
        # unsplit paths
        return merged_layout(cls(tuple(tuple(a for a in axes if mesh.axis_size(a) > 1)
                                       for axes in dims)))

    @property
    def rank(self):
        """Number of tensor dims."""
        return len(self.dims)

    @property
    def used_axes(self):
        """Axes splitting some dim or pending a reduction."""
        return tuple(a for axes in self.dims for a in axes) + self.partial

    @property
    def is_replicated(self):
        """True when no dim is split and nothing is pending."""
        return not self.partial and not any(self.dims)

    def to_spec(self):
        """The PartitionSpec of the dims (trailing unsplit dims dropped; a sub-axis
        written "x:(2)2", as Mesh.parse_axis reads it)."""
        entries = [None if not a else (str(a[0]) if len(a) == 1 else tuple(map(str, a)))
                   for a in self.dims]
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def shards(self, mesh, dim):
        """How many shards dim `dim` has."""
        return mesh.axes_size(self.dims[dim])

    def local_shape(self, mesh, global_shape):
        """The per-device (padded) shape of a tensor of `global_shape`."""
        return tuple(ceil_div(n, mesh.axes_size(a)) for n, a in zip(global_shape, self.dims))

    def with_dim(self, dim, axes):
        """A copy with dim `dim` split over `axes`."""
        dims = list(self.dims)
        dims[dim] = tuple(axes)
        return Layout(tuple(dims), self.partial, self.reduce_op)

    def without_partial(self):
        """A copy with no pending reduction."""
        return Layout(self.dims)

    def __str__(self):
        text = str(self.to_spec())
        if self.partial:
            text += f" partial-{self.reduce_op}{tuple(map(str, self.partial))}"
        return text


# ------------------------------------------------------------------------ sub-axes

def axis_parts(sub_axes):
    """{axis: its parts, major first}: every whole axis some of `sub_axes` (SubAxis) cut,
    cut at all their bounds."""
    cuts = {}
    for a in sub_axes:
        cuts.setdefault((a.axis, a.whole), {1, a.whole}).update((a.pre, a.pre * a.size))
    parts = {}
    for (axis, whole), points in cuts.items():
        points = sorted(points)
        parts[axis] = tuple(SubAxis(axis, lo, hi // lo, whole)
                            for lo, hi in zip(points, points[1:]))
    return parts


def cut_axes(layout, sub_axes):
    """`layout` with every axis (whole, or a SubAxis) that the bounds of `sub_axes` cut
    replaced by its parts, major first (in a dim, or pending). The layout's own sub-axes
    cut too, so no part reaches past the sub-axis it replaces (x:(1)2 stays itself when
    x:(4)2 cuts an axis of 8, not the part x:(1)4: fuzz seed 89 #131)."""
    parts = axis_parts(list(sub_axes) + sub_axes_of(layout))

    def pieces(a):
        if isinstance(a, SubAxis):
            return tuple(p for p in parts.get(a.axis, (a,))
                         if a.pre <= p.pre < a.pre * a.size) or (a,)
        return parts.get(a, (a,))

    def cut(axes):
        return tuple(p for a in axes for p in pieces(a))

    return Layout(tuple(cut(axes) for axes in layout.dims), cut(layout.partial),
                  layout.reduce_op)


def merged_axes(axes):
    """`axes` with each run of sub-axes that chain, major to minor, merged: into the
    whole axis where they make it up, else into one larger sub-axis."""
    out = []
    for a in axes:
        last = out[-1] if out else None
        if (isinstance(a, SubAxis) and isinstance(last, SubAxis) and last.axis == a.axis
                and last.pre * last.size == a.pre):
            a = SubAxis(a.axis, last.pre, last.size * a.size, a.whole)
            out.pop()
        out.append(a.axis if isinstance(a, SubAxis) and a.size == a.whole else a)
    return tuple(out)


def merged_layout(layout):
    """`layout` in its one form: sub-axes that chain merged (merged_axes), so a layout
    names a whole axis wherever it holds all of it in order, in one dim or pending."""
    if all(type(a) is str for a in layout.used_axes):  # the common case: no sub-axis
        return layout
    return Layout(tuple(merged_axes(axes) for axes in layout.dims),
                  merged_axes(layout.partial), layout.reduce_op)


def sub_axes_of(layout):
    """The SubAxis entries among the layout's axes."""
    return [a for a in layout.used_axes if isinstance(a, SubAxis)]


def overlap(a, b):
    """True when mesh axes (names or SubAxis) `a` and `b` share devices' coordinates:
    the same axis, and their ranges of it meet."""
    if getattr(a, "axis", a) != getattr(b, "axis", b):
        return False
    if not (isinstance(a, SubAxis) and isinstance(b, SubAxis)):
        return True
    return a.pre < b.pre * b.size and b.pre < a.pre * a.size


def permute_pairs(mesh, src, dst, src_mesh=None, dst_mesh=None):
    """(source, target) device pairs taking every device's shards of layout `dst` from a
    device holding them in layout `src` (same shard counts per dim); a device keeps its
    own data where it can, the others pair up in mesh order (vectorised: meshes may have
    thousands of devices). The layouts may name sub-axes. `src_mesh` / `dst_mesh`: the
    mesh (same devices, another order: Sharding.placement) each is read on, else `mesh`."""
    ids = np.asarray(mesh.device_ids).ravel()  # the device at each mesh position

    def shard_key(on, layout):
        key = np.zeros(ids.size, np.int64)
        for axes in layout.dims:
            if axes:
                key = key * on.axes_size(axes) + on.shard_indices(axes)[ids]
        return key

    have, want = shard_key(src_mesh or mesh, src), shard_key(dst_mesh or mesh, dst)
    position = np.arange(ids.size)
    moving = position[have != want]
    source = position.copy()
    # holders and takers of each shard are equally many: pair them in order
    source[moving[np.argsort(want[moving], kind="stable")]] = \
        moving[np.argsort(have[moving], kind="stable")]
    return tuple((int(ids[s]), int(ids[t])) for s, t in zip(source, position))
