"""ShardedTensor: a global tensor held as one shard per device of a mesh."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gspmd_tf.layout import Layout


def shard_bounds(mesh, layout, shape, device_id):
    """Per dim, the (start, stop) of the global elements device `device_id` holds."""
    bounds = []
    for n, axes in zip(shape, layout.dims):
        size = -(-n // mesh.axes_size(axes))
        start = min(n, mesh.shard_index(device_id, axes) * size)
        bounds.append((start, min(n, start + size)))
    return bounds


def split_value(value, mesh, layout):
    """numpy pieces of a global value, one per device, padded to the local shape."""
    value = np.asarray(value)
    local = layout.local_shape(mesh, value.shape)
    # TF hands out string tensors as object arrays of bytes, which numpy pads with 0
    fill = b"" if value.dtype == object else 0
    pieces = []
    for device in range(mesh.size):
        bounds = shard_bounds(mesh, layout, value.shape, device)
        piece = value[tuple(slice(a, b) for a, b in bounds)]
        pad = [(0, l - (b - a)) for l, (a, b) in zip(local, bounds)]
        pieces.append(np.pad(piece, pad, constant_values=fill) if any(p for _, p in pad)
                      else piece)
    return pieces


class ShardedTensor:
    """A tensor of global `shape` split over `mesh` by `layout`.

    `shards[d]` is the tensor device d holds (padded to equal size along uneven dims);
    `numpy()` assembles the global value; `sharding` is the gt.Sharding.
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
        shards = []
        for device, piece in zip(mesh.devices, split_value(value, mesh, layout)):
            with tf.device(device):
                shards.append(tf.identity(tf.constant(piece)))
        return cls(mesh, layout, value.shape, tf.as_dtype(value.dtype), shards)

    @property
    def sharding(self):
        """The gt.Sharding (XLA HloSharding form) of this tensor."""
        from gspmd_tf.sharding import Sharding
        return Sharding.from_layout(self.mesh, self.layout)

    @property
    def spec(self):
        """The PartitionSpec of this tensor."""
        return self.layout.to_spec()

    def numpy(self):
        """The global value."""
        out = np.empty(self.shape, self.dtype.as_numpy_dtype)
        done = set()
        for device, shard in enumerate(self.shards):
            bounds = tuple(shard_bounds(self.mesh, self.layout, self.shape, device))
            if bounds in done:
                continue
            done.add(bounds)
            local = shard.numpy()
            out[tuple(slice(a, b) for a, b in bounds)] = \
                local[tuple(slice(0, b - a) for a, b in bounds)]
        return out

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def shard_bytes(self):
        """Bytes each device holds for this tensor."""
        return [int(np.prod(s.shape)) * self.dtype.size for s in self.shards]

    def __repr__(self):
        return (f"<ShardedTensor shape={self.shape} dtype={self.dtype.name} "
                f"spec={self.layout.to_spec()!r} on {self.mesh!r}>")
