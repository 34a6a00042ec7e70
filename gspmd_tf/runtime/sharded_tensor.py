"""ShardedTensor: a global tensor held as one shard per device of a mesh."""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from gspmd_tf import cluster
from gspmd_tf.layout import Layout
from gspmd_tf.sharding import Sharding


def shard_bounds(mesh, layout, shape, device_id):
    """Per dim, the (start, stop) of the global elements device `device_id` holds."""
    bounds = []
    for n, axes in zip(shape, layout.dims):
        size = -(-n // mesh.axes_size(axes))
        start = min(n, mesh.shard_index(device_id, axes) * size)
        bounds.append((start, min(n, start + size)))
    return bounds


def distinct_boxes(mesh, layout, shape):
    """[(box, device ids holding it)] for each distinct shard, in device order; a box is
    the (start, stop) per dim of the global elements the shard holds."""
    holders = {}
    for device in range(mesh.size):
        holders.setdefault(tuple(shard_bounds(mesh, layout, shape, device)), []).append(device)
    return list(holders.items())


def padding(box, local_shape):
    """np.pad widths that grow the elements of `box` to the (padded) local shape."""
    return [(0, l - (b - a)) for l, (a, b) in zip(local_shape, box)]


def pad_piece(piece, box, local_shape):
    """`piece` (the elements of `box`, numpy) zero-padded to the local shape."""
    pad = padding(box, local_shape)
    # TF hands out string tensors as object arrays of bytes, which numpy pads with 0
    fill = b"" if piece.dtype == object else 0
    return np.pad(piece, pad, constant_values=fill) if any(p for _, p in pad) else piece


def split_value(value, mesh, layout):
    """numpy pieces of a global value, one per device, padded to the local shape."""
    value = np.asarray(value)
    local = layout.local_shape(mesh, value.shape)
    # (the Ellipsis keeps a 0-d piece an array: a string scalar's, of dtype object)
    return [pad_piece(value[tuple(slice(a, b) for a, b in bounds) + (Ellipsis,)], bounds,
                      local)
            for bounds in (shard_bounds(mesh, layout, value.shape, device)
                           for device in range(mesh.size))]


_DEVICE_SPLIT_RANK = 8  # the most dims TF's CPU Slice and Pad kernels take


def place_value(value, mesh, layout, dtype):
    """Per-device shards of the global `value` in `layout`, made on the devices (None
    for other workers' devices): the value becomes one tensor of `dtype`, placed once
    (where TF puts it; a tf.Tensor stays where it is), and each distinct shard is sliced
    from it, and zero-padded to the local shape, by TF ops on the first of this worker's
    devices holding it; the devices holding one shard share that tensor (a replicated
    value is the one tensor on every device). The values are split_value's, which
    splits on the host what TF's Slice and Pad kernels cannot take: strings, and ranks
    over _DEVICE_SPLIT_RANK."""
    if dtype == tf.string or len(layout.dims) > _DEVICE_SPLIT_RANK:
        return split_value(value.numpy() if hasattr(value, "numpy") else np.asarray(value),
                           mesh, layout)
    tensor = value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(value, dtype)
    shape = tuple(tensor.shape)
    local = layout.local_shape(mesh, shape)
    addressable = set(mesh.addressable_ids)
    shards = [None] * mesh.size
    for box, devices in distinct_boxes(mesh, layout, shape):
        mine = [d for d in devices if d in addressable]
        if not mine:
            continue
        piece, pad = tensor, padding(box, local)
        if any(start or stop != n for (start, stop), n in zip(box, shape)) or any(
                p for _, p in pad):
            with tf.device(mesh.devices[mine[0]]):
                piece = tf.slice(tensor, [start for start, _ in box],
                                 [stop - start for start, stop in box])
                if any(p for _, p in pad):
                    piece = tf.pad(piece, pad)
        for device in mine:
            shards[device] = piece
    return shards


def shard_bytes(mesh, layout, shape, dtype):
    """Bytes each device holds for a tensor: every shard has the padded local shape, on
    this process's devices and on other workers'."""
    size = int(np.prod(layout.local_shape(mesh, shape))) * tf.as_dtype(dtype).size
    return [size] * mesh.size


def readable_on_every_worker(mesh, layout, shape):
    """True when every worker of the mesh holds a copy of every distinct shard, so each
    can assemble the global value from its own devices (always so on one process)."""
    if mesh.is_fully_addressable:
        return True
    tasks = {cluster.task_of(name) for name in mesh.devices}
    return all({cluster.task_of(mesh.devices[d]) for d in devices} == tasks
               for _, devices in distinct_boxes(mesh, layout, shape))


class ShardedTensor:
    """A tensor of global `shape` split over `mesh` by `layout`.

    `shards[d]` is the tensor device d holds (padded to equal size along uneven dims;
    None for devices of other workers on a multi-worker mesh: see addressable_shards);
    `numpy()` assembles the global value; `sharding` is the gt.Sharding. A program's
    output whose out_shardings entry orders the devices in a way no layout of the
    program's mesh does lives on a mesh of the same devices in that order
    (Sharding.placement); any program on those devices takes it with its sharding.
    """

    def __init__(self, mesh, layout, shape, dtype, shards):
        self.mesh = mesh
        self.layout = layout
        self.shape = tuple(shape)
        self.dtype = tf.as_dtype(dtype)
        self.shards = list(shards)

    @classmethod
    def from_value(cls, value, mesh, layout):
        """Split a global value (array or tensor) and place the pieces on the devices."""
        value = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
        shards = [None] * mesh.size
        pieces = split_value(value, mesh, layout)
        for device in mesh.addressable_ids:  # each worker places only its own shards
            with tf.device(mesh.devices[device]):
                shards[device] = tf.identity(tf.constant(pieces[device]))
        return cls(mesh, layout, value.shape, tf.as_dtype(value.dtype), shards)

    @property
    def addressable_shards(self):
        """{device id: shard} of this process's devices (all of them on one process)."""
        return {d: self.shards[d] for d in self.mesh.addressable_ids}

    @property
    def sharding(self):
        """The gt.Sharding (XLA HloSharding form) of this tensor."""
        return Sharding.from_layout(self.mesh, self.layout)

    @property
    def spec(self):
        """The PartitionSpec of this tensor."""
        return self.layout.to_spec()

    def numpy(self):
        """The global value, on every worker.

        On a multi-worker mesh where some shard is not on every worker, this is a
        collective (an all-gather program): every worker must call it, in the same order
        as its other gt.function calls.
        """
        whole = tuple((0, n) for n in self.shape)
        if readable_on_every_worker(self.mesh, self.layout, self.shape):
            return self.read_box(whole)
        return _replicated(self).read_box(whole)

    def read_box(self, box):
        """numpy value of the global elements in `box` ((start, stop) per dim), copied
        from the shards that overlap it: at most one whole shard is read at a time. Every
        overlapping shard must be on a device of this process."""
        out = np.empty([b - a for a, b in box], self.dtype.as_numpy_dtype)
        for held, devices in distinct_boxes(self.mesh, self.layout, self.shape):
            overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, held)]
            if any(lo >= hi for lo, hi in overlap):
                continue
            holder = next((d for d in devices if self.shards[d] is not None), None)
            if holder is None:
                raise ValueError(f"{self!r}: elements {held} are held only by other "
                                 "workers' devices; read them with numpy() on every worker")
            local = _as_numpy(self.shards[holder])
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, box))] = \
                local[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, held))]
        return out

    def pieces_on(self, mesh, layout):
        """Yield (device ids, numpy piece) of this value resharded to `layout` on `mesh`
        (any mesh: only the shard boxes matter), one distinct piece at a time, padded to
        the local shape. When some shard is on other workers only, the value is first
        replicated on its mesh (a collective call, see numpy())."""
        if not readable_on_every_worker(self.mesh, self.layout, self.shape):
            yield from _replicated(self).pieces_on(mesh, layout)
            return
        local = layout.local_shape(mesh, self.shape)
        for box, devices in distinct_boxes(mesh, layout, self.shape):
            yield devices, pad_piece(self.read_box(box), box, local)

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def shard_bytes(self):
        """Bytes each device holds for this tensor."""
        return shard_bytes(self.mesh, self.layout, self.shape, self.dtype)

    def __repr__(self):
        return (f"<ShardedTensor shape={self.shape} dtype={self.dtype.name} "
                f"spec={self.layout.to_spec()!r} on {self.mesh!r}>")


# How a tensor some workers do not hold is read on every worker: a partitioned identity
# program with replicated outputs. The program runner (runtime/function.py) sits above
# this value type and sets it when imported (set_replicator).
_replicator = None


def set_replicator(replicate: Callable[["ShardedTensor"], "ShardedTensor"]) -> None:
    """Set the function that copies a ShardedTensor to every device of its mesh (a
    collective program every worker runs)."""
    global _replicator
    _replicator = replicate


def _replicated(tensor):
    """`tensor` replicated on every device of its mesh (see set_replicator)."""
    return _replicator(tensor)


def _as_numpy(shard):
    """A shard (tf.Tensor or array) as numpy; TF's scalar bfloat16 tensors refuse
    np.asarray, their .numpy() works."""
    return np.asarray(shard.numpy() if hasattr(shard, "numpy") else shard)
