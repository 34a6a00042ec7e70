"""Sharding: XLA's HloSharding (text and OpSharding proto) and its mesh-axis Layout form.

A sharding is one of
  replicated   every device holds the whole value               {replicated}
  maximal      one device computes the value                    {maximal device=3}
  tiled        tile_assignment[i0, i1, ...] is the device that holds tile (i0, i1, ...)
               {devices=[2,4]0,1,2,3,4,5,6,7}
  partially tiled: the last tile_assignment dim lists the devices holding copies of a tile
               {devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}
  manual       the user partitioned the value by hand           {manual}
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
from google.protobuf import message, text_format
from tensorflow.compiler.xla import xla_data_pb2

from gspmd_tf.errors import ShardingError
from gspmd_tf.layout import Layout, merged_layout
from gspmd_tf.mesh import MAX_DEVICES, Mesh, SubAxis, check_count, check_num_devices

_OpSharding = xla_data_pb2.OpSharding

REPLICATED = "replicated"
MAXIMAL = "maximal"
TILED = "tiled"
MANUAL = "manual"

_INTS = r"\d+(?:\s*,\s*\d+)*"
_DEVICES = re.compile(
    rf"devices=\[(?P<dims>{_INTS})\]\s*"
    rf"(?:<=\[(?P<iota>{_INTS})\](?:T\((?P<perm>{_INTS})\))?|(?P<list>{_INTS}))"
    r"(?P<replicate>\s+last_tile_dim_replicate)?"
    r"(?:\s+last_tile_dims=\{(?P<subgroups>[a-z_,\s]*)\})?")
_MAXIMAL = re.compile(r"maximal\s+device=(\d+)")
# XLA prints metadata last; it says where an annotation came from and is not kept.
_METADATA = re.compile(r"\s+metadata=\{.*\}$", re.S)


_INT64_MAX = np.iinfo(np.int64).max


def _ints(text):
    """The comma-separated integers of `text`; ShardingError for one past int64."""
    values = [int(t) for t in text.split(",")]
    for value in values:
        if value > _INT64_MAX:
            raise ShardingError(f"{value} is past int64; a sharding has at most "
                                f"{MAX_DEVICES} devices, with ids 0..{MAX_DEVICES - 1}")
    return values


def _short(text, limit=300):
    return text if len(text) <= limit else text[:limit] + "...}"


def _proto_text(proto):
    """A one-line, length-limited text form of an OpSharding for error messages."""
    return _short("{" + text_format.MessageToString(proto, as_one_line=True) + "}")


def _num_tiles(dims, what):
    """The number of devices tile dims `dims` name, checked before anything is built."""
    count = 1
    for d in dims:
        count *= check_count(d, f"{what} {list(dims)}: a dim")
    check_num_devices(count, f"{what} {list(dims)}")
    return count


def _iota(dims, reshape_dims, perm):
    """XLA's iota tile assignment: arange, reshape, transpose, reshape to `dims`."""
    n = _num_tiles(reshape_dims, "iota reshape dims")
    if sorted(perm) != list(range(len(reshape_dims))) or n != _num_tiles(dims, "tile dims"):
        raise ShardingError(
            f"bad iota tile assignment: the transpose must permute the {len(reshape_dims)} "
            "reshape dims and both shapes must hold the same number of devices")
    return np.arange(n, dtype=np.int64).reshape(reshape_dims).transpose(perm).reshape(dims)


def _from_tiles(dims, devices, replicate, subgroups):
    """A tiled sharding from text or proto fields; `subgroups`: last_tile_dims kinds."""
    needed = _num_tiles(dims, "tile dims")
    devices = np.asarray(devices, dtype=np.int64)
    if not dims or devices.size != needed:
        raise ShardingError(
            f"bad tile assignment: tile dims {list(dims)} need {needed} devices, got "
            f"{devices.size}")
    tiles = devices.reshape(dims)
    if subgroups:
        if any(kind != REPLICATED for kind in subgroups):
            raise ShardingError(
                f"last_tile_dims {subgroups} are not supported (only replicated subgroups "
                "are); use a replicated or tiled sharding")
        if replicate or len(subgroups) > tiles.ndim:
            raise ShardingError(
                f"last_tile_dims lists {len(subgroups)} dims, which conflicts with the tile "
                "assignment or with last_tile_dim_replicate")
        # Several replicated subgroup dims mean one replication dim of their product.
        tiles = tiles.reshape(tiles.shape[:tiles.ndim - len(subgroups)] + (-1,))
        replicate = True
    return Sharding.tile(tiles, last_tile_dim_replicate=replicate)


class Placement(NamedTuple):
    """Where a sharding puts a tensor: `layout` over the axes of the mesh asked about,
    and `mesh`, that mesh or the same devices in the order the sharding names
    (Sharding.placement)."""

    layout: Layout
    mesh: Mesh


class Sharding:
    """XLA's HloSharding: how a tensor's value is spread over device ids.

    Build one with the factories (replicate, maximal, manual, tile, from_layout,
    from_spec, parse, from_proto); the constructor takes already-canonical fields.
    Attributes: `kind` (REPLICATED, MAXIMAL, TILED or MANUAL), `tile_assignment`
    (read-only int64 array of device ids, TILED only), `last_tile_dim_replicate` (the last
    tile_assignment dim holds copies, TILED only) and `device` (MAXIMAL only).

    Canonical form, as XLA: a tiling that splits no dim is replicated, a replication dim
    of size 1 is dropped, and the devices of each replication group are sorted (their
    order carries no meaning), so equal shardings compare and hash equal.
    """

    __slots__ = ("kind", "tile_assignment", "last_tile_dim_replicate", "device")

    def __init__(self, kind, tile_assignment=None, last_tile_dim_replicate=False,
                 device=None):
        self.kind = kind
        self.tile_assignment = tile_assignment
        self.last_tile_dim_replicate = last_tile_dim_replicate
        self.device = device

    # ---- factories

    @classmethod
    def replicate(cls):
        """Every device holds the whole value."""
        return cls(REPLICATED)

    @classmethod
    def maximal(cls, device):
        """Device `device` alone computes the value."""
        device = check_count(device, "maximal sharding device", low=0, high=MAX_DEVICES - 1)
        return cls(MAXIMAL, device=device)

    @classmethod
    def manual(cls):
        """The value was partitioned by hand; gspmd-tf must not change it."""
        return cls(MANUAL)

    @classmethod
    def tile(cls, tile_assignment, last_tile_dim_replicate=False):
        """Tiles of the value on the devices in `tile_assignment` (array of device ids).

        With `last_tile_dim_replicate`, the last dim of `tile_assignment` lists the
        devices holding copies of the same tile. Returns the canonical form.
        """
        tiles = np.array(tile_assignment, dtype=np.int64)
        check_num_devices(tiles.size, f"tile assignment of shape {list(tiles.shape)}")
        if tiles.size == 0 or tiles.max() >= MAX_DEVICES or tiles.min() < 0 or np.unique(tiles).size != tiles.size:
            raise ShardingError(
                f"tile assignment {_short(str(tiles.tolist()))}: list each device id "
                f"(0 <= id < {MAX_DEVICES}) exactly once")
        if last_tile_dim_replicate and tiles.ndim and tiles.shape[-1] == 1:
            tiles = tiles.reshape(tiles.shape[:-1])
            last_tile_dim_replicate = False
        split_dims = tiles.shape[:-1] if last_tile_dim_replicate else tiles.shape
        if np.prod(split_dims, dtype=np.int64) == 1:
            return cls.replicate()
        if last_tile_dim_replicate:
            tiles = np.sort(tiles, axis=-1)
        tiles.setflags(write=False)
        return cls(TILED, tiles, bool(last_tile_dim_replicate))

    @classmethod
    def from_layout(cls, mesh, layout):
        """The sharding of `layout` (a gspmd_tf.layout.Layout) on `mesh`.

        The tile assignment is mesh.device_ids transposed to [axes of dim 0, axes of
        dim 1, ..., unused axes in mesh order] and reshaped to the tile shape, plus a
        replication dim when some unused axis has more than one device.
        """
        if layout.partial:
            raise ShardingError(
                f"layout {layout} has a reduction pending over {layout.partial}; an XLA "
                "sharding cannot express it: reduce the value first")
        split = [name for axes in layout.dims for name in axes]
        if len(set(split)) != len(split):
            raise ShardingError(
                f"layout {layout} uses a mesh axis twice; a mesh axis can split at most "
                "one dim")
        ids = mesh.arrange(split)  # the planner's layouts may name sub-axes
        tile_shape = [mesh.axes_size(axes) for axes in layout.dims]
        replicas = mesh.size // int(np.prod(tile_shape, dtype=np.int64))
        return cls.tile(ids.reshape(tile_shape + [replicas]), last_tile_dim_replicate=True)

    @classmethod
    def from_spec(cls, mesh, spec, rank, what="tensor"):
        """The sharding of PartitionSpec `spec` for a tensor of rank `rank` on `mesh`."""
        return cls.from_layout(mesh, Layout.from_spec(mesh, spec, rank, what))

    # ---- text

    @classmethod
    def parse(cls, text):
        """Read XLA's text form, e.g. `{devices=[4,2]<=[2,4]T(1,0)}` (see module doc)."""
        if not isinstance(text, str):
            raise ShardingError(
                f"Sharding.parse reads XLA's text form, a str such as '{{replicated}}' or "
                f"'{{devices=[2,1]0,1}}', not {type(text).__name__} {text!r}"
                + ("; decode the bytes first" if isinstance(text, bytes) else ""))
        body = text.strip()
        if not (body.startswith("{") and body.endswith("}")):
            raise ShardingError(f"cannot parse sharding {text!r}: expected text in braces")
        body = _METADATA.sub("", body[1:-1].strip())
        if body in (REPLICATED, MANUAL):
            return cls(body)
        match = _MAXIMAL.fullmatch(body)
        if match:
            return cls.maximal(int(match.group(1)))
        match = _DEVICES.fullmatch(body)
        if not match:
            raise ShardingError(
                f"cannot parse sharding {text!r}: expected {{replicated}}, {{manual}}, "
                "{maximal device=D} or {devices=[dims]ids...} (tuple shardings are read "
                "element by element)")
        dims = _ints(match["dims"])
        subgroups = [s.strip() for s in (match["subgroups"] or "").split(",") if s.strip()]
        try:
            if match["list"]:
                devices = _ints(match["list"])
            else:
                reshape = _ints(match["iota"])
                perm = _ints(match["perm"]) if match["perm"] else list(range(len(reshape)))
                devices = _iota(dims, reshape, perm).ravel()
            return _from_tiles(dims, devices, bool(match["replicate"]), subgroups)
        except ShardingError as e:
            raise ShardingError(f"sharding {text!r}: {e}") from None

    def __str__(self):
        if self.kind == MAXIMAL:
            return f"{{maximal device={self.device}}}"
        if self.kind != TILED:
            return f"{{{self.kind}}}"
        dims = ",".join(str(d) for d in self.tile_assignment.shape)
        devices = ",".join(str(d) for d in self.tile_assignment.ravel())
        suffix = " last_tile_dim_replicate" if self.last_tile_dim_replicate else ""
        return f"{{devices=[{dims}]{devices}{suffix}}}"

    def __repr__(self):
        return f"Sharding.parse({str(self)!r})"

    # ---- proto

    @classmethod
    def from_proto(cls, proto):
        """From an xla_data_pb2.OpSharding (or its serialized bytes, as in `_XlaSharding`)."""
        proto = _as_proto(proto)
        source = _proto_text(proto)
        if proto.type == _OpSharding.REPLICATED:
            return cls.replicate()
        if proto.type == _OpSharding.MANUAL:
            return cls.manual()
        if proto.type == _OpSharding.MAXIMAL:
            if len(proto.tile_assignment_devices) != 1:
                raise ShardingError(f"maximal OpSharding {source} needs exactly one device")
            return cls.maximal(proto.tile_assignment_devices[0])
        if proto.type == _OpSharding.TUPLE:
            raise ShardingError(
                f"OpSharding {source} is a tuple: read its elements with "
                "Sharding.tuple_elements_from_proto")
        if proto.type != _OpSharding.OTHER:
            raise ShardingError(
                f"OpSharding {source}: type {_OpSharding.Type.Name(proto.type)} is not "
                "supported; use a replicated, maximal or tiled sharding")
        dims = list(proto.tile_assignment_dimensions)
        subgroups = [_OpSharding.Type.Name(t).lower() for t in proto.last_tile_dims]
        try:
            if proto.iota_reshape_dims:
                devices = _iota(dims, list(proto.iota_reshape_dims),
                                list(proto.iota_transpose_perm)).ravel()
            else:
                devices = list(proto.tile_assignment_devices)
            return _from_tiles(dims, devices, proto.replicate_on_last_tile_dim, subgroups)
        except ShardingError as e:
            raise ShardingError(f"OpSharding {source}: {e}") from None

    @classmethod
    def tuple_elements_from_proto(cls, proto):
        """The element shardings of a TUPLE OpSharding (proto or bytes), in order."""
        proto = _as_proto(proto)
        if proto.type != _OpSharding.TUPLE:
            raise ShardingError(
                f"OpSharding {_proto_text(proto)} is not a tuple: read it with "
                "Sharding.from_proto")
        return [cls.from_proto(element) for element in proto.tuple_shardings]

    def to_proto(self):
        """This sharding as an xla_data_pb2.OpSharding, with an explicit device list."""
        if self.kind == REPLICATED:
            return _OpSharding(type=_OpSharding.REPLICATED)
        if self.kind == MANUAL:
            return _OpSharding(type=_OpSharding.MANUAL)
        if self.kind == MAXIMAL:
            # Same fields as TF's xla_sharding.Sharding.assign_device.
            return _OpSharding(type=_OpSharding.MAXIMAL, tile_assignment_dimensions=[1],
                               tile_assignment_devices=[self.device])
        return _OpSharding(
            type=_OpSharding.OTHER,
            tile_assignment_dimensions=list(self.tile_assignment.shape),
            tile_assignment_devices=self.tile_assignment.ravel().tolist(),
            replicate_on_last_tile_dim=self.last_tile_dim_replicate)

    # ---- queries

    @property
    def is_replicated(self):
        """True when every device holds the whole value."""
        return self.kind == REPLICATED

    @property
    def is_maximal(self):
        """True when one device computes the value."""
        return self.kind == MAXIMAL

    @property
    def is_manual(self):
        """True for a by-hand partitioned value."""
        return self.kind == MANUAL

    @property
    def is_tiled(self):
        """True when some dim is split (possibly with replication)."""
        return self.kind == TILED

    @property
    def tile_shape(self):
        """Number of tiles along each tensor dim (no replication dim); None unless tiled."""
        if self.kind != TILED:
            return None
        shape = self.tile_assignment.shape
        return shape[:-1] if self.last_tile_dim_replicate else shape

    @property
    def num_devices(self):
        """Devices in the tile assignment (1 if maximal); None (any) if replicated/manual."""
        if self.kind == MAXIMAL:
            return 1
        return int(self.tile_assignment.size) if self.kind == TILED else None

    def to_layout(self, mesh, rank, what="tensor"):
        """The Layout (mesh-axis form) of this sharding for a tensor of rank `rank`.

        Accepts any tile assignment that is a transpose and reshape of mesh.device_ids:
        each tile dim is a run of consecutive axes of some order of the mesh axes, the
        remaining axes form the replication dim; failing that, of the mesh axes cut into
        parts (sub-axes, mesh.SubAxis, as Shardy's "x":(2)2). Size-1 mesh axes are never used. The axis
        order is computed directly (linear in the devices), not searched.
        A maximal sharding gives a replicated layout: gspmd-tf computes such a value on
        every device. Raises ShardingError, naming `what`, when the sharding is manual, does
        not fit `rank`, or uses a device set the mesh lacks, or a device order no layout
        of the mesh gives (`placement` gives the layout and a mesh of that order).
        """
        layout, placed = self.placement(mesh, rank, what)
        if placed is not mesh:
            raise ShardingError(
                f"{what}: sharding {_short(str(self))} on {mesh!r}: its device order is "
                f"not a transpose of the mesh axes {mesh.axis_names} or of parts of them "
                "(over the mesh's device_ids), so no layout of the mesh places its tiles; "
                "Sharding.placement gives the layout with its tiles and the mesh of its "
                "device order (gt.function takes it in in/out_shardings and annotations)")
        return layout

    def placement(self, mesh, rank, what="tensor") -> "Placement":
        """Where this sharding puts a tensor of rank `rank`: a Placement(layout, mesh).

        `layout` is a Layout over `mesh`'s axes (or parts of them) with this sharding's
        number of tiles along every dim. Its `mesh` is `mesh` itself when that layout puts
        every tile on the devices this sharding names (to_layout's case), else a mesh of
        the same devices in another order (Mesh.with_arrangement) on which it does: any
        tile assignment XLA accepts. The layout then is the one whose tiles are where
        this sharding puts them on the most devices (a beam search, _nearest_layout), so
        the fewest shards move between the two placements.
        Raises ShardingError, naming `what`, as to_layout, save for the device order.
        """
        where = f"{what}: sharding {_short(str(self))} on {mesh!r}"
        if self.kind == MAXIMAL and self.device >= mesh.size:
            raise ShardingError(
                f"{where}: the mesh has no device {self.device} (its ids are "
                f"0..{mesh.size - 1}); name one of them")
        if self.kind in (REPLICATED, MAXIMAL):
            return Placement(Layout.replicated(rank), mesh)
        if self.kind == MANUAL:
            raise ShardingError(f"{where}: manual shardings are not supported yet; annotate "
                                "the tensor with a mesh sharding instead")
        if len(self.tile_shape) != rank:
            raise ShardingError(
                f"{where}: it tiles {len(self.tile_shape)} dims but the tensor has rank "
                f"{rank}; give one tile dim per tensor dim (plus the replication dim)")
        if set(self.tile_assignment.ravel().tolist()) != set(mesh.device_ids.ravel().tolist()):
            raise ShardingError(
                f"{where}: it must use every device id of the mesh (0..{mesh.size - 1}) "
                "exactly once; give a tile assignment over the mesh's devices")
        layout = _layout_of_tiles(self, mesh, mesh.axis_names, mesh.shape)
        if layout is None:  # perhaps over parts of axes (sub-axes, as Shardy's)
            layout = _layout_of_tiles(self, mesh, *_prime_parts(mesh))
        if layout is not None:
            return Placement(layout, mesh)
        layout = _nearest_layout(self, mesh)
        split = [name for axes in layout.dims for name in axes]
        return Placement(layout, mesh.with_arrangement(split, self.tile_assignment))

    # ---- equality

    def _key(self):
        tiles = self.tile_assignment
        return (self.kind, self.device, self.last_tile_dim_replicate,
                None if tiles is None else (tiles.shape, tiles.tobytes()))

    def __eq__(self, other):
        return isinstance(other, Sharding) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


def _prime_parts(mesh):
    """The mesh's axes cut into parts of prime sizes (SubAxis), major first: (their
    names, their sizes)."""
    names, sizes = [], []
    for name, size in zip(mesh.axis_names, mesh.shape):
        pre, left, p = 1, size, 2
        while left > 1:
            while left % p:
                p += 1
            names.append(SubAxis(name, pre, p, size))
            sizes.append(p)
            pre, left = pre * p, left // p
    return tuple(names), tuple(sizes)


# partial layouts _nearest_layout keeps per digit: enough to try every one on meshes of
# up to 5 prime parts (32 devices of 2s); larger meshes keep the best so far
NEAREST_BEAM = 120


def _nearest_layout(sharding, mesh):
    """The Layout of `mesh` with `sharding`'s tiles per dim that puts the tile a device
    holds where `sharding` puts it on the most devices: each dim's tile index is read
    digit by digit, major first, each digit from an unused prime part of the mesh axes;
    a beam search over those choices, counting the devices agreeing on every digit so
    far (ties: mesh order). Unused parts replicate."""
    names, sizes = _prime_parts(mesh)
    coords = np.stack(np.unravel_index(mesh.positions(), sizes), axis=-1)  # [id, part]
    tile_shape = tuple(sharding.tile_shape)
    tiles = sharding.tile_assignment.reshape(tile_shape + (-1,))
    want = np.empty((mesh.size, len(tile_shape)), np.int64)  # [id, dim]: its tile
    for d, index in enumerate(np.indices(tiles.shape)[:len(tile_shape)]):
        want[tiles.ravel(), d] = index.ravel()
    states = [(np.ones(mesh.size, bool), ())]  # (devices agreeing, runs of parts per dim)
    for d, count in enumerate(tile_shape):
        states = [(agree, runs + ((),)) for agree, runs in states]
        while True:
            grown = []
            for agree, runs in states:
                used = {p for run in runs for p in run}
                left = count // int(np.prod([sizes[p] for p in runs[-1]], dtype=np.int64))
                for part in range(len(sizes)):
                    if part in used or left % sizes[part]:
                        continue
                    digit = want[:, d] // (left // sizes[part]) % sizes[part]
                    grown.append((agree & (coords[:, part] == digit),
                                  runs[:-1] + (runs[-1] + (part,),)))
            if not grown:  # every digit of dim d read
                break
            grown.sort(key=lambda state: -int(state[0].sum()))  # stable: mesh order
            states = grown[:NEAREST_BEAM]
    runs = states[0][1]
    return merged_layout(Layout(tuple(tuple(names[p] for p in run) for run in runs)))


def _layout_of_tiles(sharding, mesh, axis_names, shape):
    """The Layout of `mesh` whose sharding is tiled `sharding`, or None when none is,
    over axes `axis_names` of sizes `shape` (the mesh's axes, or parts of them cut
    row-major; parts a layout holds in order merged back).

    Computed from where each mesh axis varies, in time linear in the devices: an axis
    splitting a tensor dim is constant within every replication group and changes along
    exactly one tile dim; within that dim, the axis whose coordinate changes after more
    steps is the more major one. The candidate is then checked by rebuilding it.
    """
    tile_shape = tuple(sharding.tile_shape)
    groups = sharding.tile_assignment.reshape(int(np.prod(tile_shape)), -1)
    coords = np.stack(np.unravel_index(mesh.positions(), shape), axis=-1)[groups]
    constant = (coords == coords[:, :1]).all(axis=(0, 1))
    tile_coords = coords[:, 0].reshape(tile_shape + (len(shape),))
    dims = [[] for _ in tile_shape]
    for axis, size in enumerate(shape):
        if size == 1 or not constant[axis]:
            continue  # never used, or a replication axis
        along = [d for d in range(len(tile_shape))
                 if (np.diff(tile_coords[..., axis], axis=d) != 0).any()]
        if len(along) != 1:
            return None
        d = along[0]
        line = np.moveaxis(tile_coords[..., axis], d, 0).reshape(tile_shape[d], -1)[:, 0]
        steps = int(np.argmax(line != line[0]))  # > 0: the axis changes along d
        dims[d].append((-steps, axis, axis_names[axis]))
    layout = merged_layout(Layout(tuple(tuple(name for *_, name in sorted(run))
                                        for run in dims)))
    return layout if Sharding.from_layout(mesh, layout) == sharding else None


def _as_proto(proto):
    """An OpSharding from a proto or its serialized bytes."""
    if isinstance(proto, (bytes, bytearray)):
        parsed = _OpSharding()
        try:
            parsed.ParseFromString(bytes(proto))
        except message.DecodeError as e:
            raise ShardingError(
                f"bytes {bytes(proto)[:64]!r} are not an OpSharding: {e}") from None
        return parsed
    return proto
