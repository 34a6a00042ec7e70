"""Layout: the mesh-axis form of a sharding used by propagation and the partitioner."""

from __future__ import annotations

from dataclasses import dataclass

from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import PartitionSpec


def ceil_div(a, b):
    """Smallest integer >= a / b."""
    return -(-a // b)


@dataclass(frozen=True)
class Layout:
    """Per-dim mesh axes (major to minor), plus axes with a pending reduction.

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
        dims = tuple(spec.axes_of(d) for d in range(rank))
        seen = set()
        for axes in dims:
            for name in axes:
                mesh.axis_index(name)
                if name in seen:
                    raise ShardingError(
                        f"{what}: spec {spec!r} uses mesh axis {name!r} twice; a mesh axis "
                        "can split at most one dim")
                seen.add(name)
        # an axis of one device splits nothing; dropping it keeps handlers on their
        # unsplit paths
        return cls(tuple(tuple(a for a in axes if mesh.axis_size(a) > 1) for axes in dims))

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
        """The PartitionSpec of the dims (trailing unsplit dims dropped)."""
        entries = [None if not a else (a[0] if len(a) == 1 else a) for a in self.dims]
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
        if all(isinstance(a, str) for a in self.used_axes):
            text = str(self.to_spec())
        else:  # the sub-axes (mesh.SubAxis) of a layout inside a reshard plan
            text = "P(" + ", ".join("(" + ", ".join(map(str, axes)) + ")"
                                    for axes in self.dims) + ")"
        if self.partial:
            text += f" partial-{self.reduce_op}{self.partial}"
        return text
