"""gt.Variable: a tf.Variable whose value lives only as shards on the devices of a mesh.

To traced code it is an ordinary (resource) tf.Variable of the global shape: read it,
take gradients with respect to it, assign to it, hand it to an optimizer. Its own handle
holds no memory (an uninitialized variable); when a gt.function runs, every device's
program gets the handle of that device's shard variable instead, so reads, assigns and
optimizer updates act on the shards.
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from gspmd_tf.errors import ShardingError
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import PartitionSpec
from gspmd_tf.runtime.sharded_tensor import ShardedTensor, shard_bounds, split_value

# id(handle tensor) -> Variable, so a traced function's captured handles lead back to
# their variables
_BY_HANDLE = weakref.WeakValueDictionary()


def variable_of_handle(handle):
    """The gt.Variable whose (template) handle is `handle`, or None."""
    return _BY_HANDLE.get(id(handle))


class Variable(resource_variable_ops.UninitializedVariable):
    """A variable of global `shape` split over `mesh` by `spec`; each device stores only
    its shard.

    `initial_value` is a global value (array or tensor), or a callable
    `initial_value(shape, dtype)` called for each distinct shard with that shard's
    shape, so no device ever builds the whole tensor (then `shape` is required).
    """

    def __init__(self, initial_value, mesh, spec=None, *, shape=None, dtype=None, name=None,
                 trainable=True):
        if mesh.is_abstract:
            raise ShardingError(f"variable {name or ''}: an abstract mesh has no devices to "
                                "hold shards; use gt.Mesh.create")
        value = None
        if callable(initial_value):
            if shape is None:
                raise ShardingError(f"variable {name or ''}: a callable initial value needs "
                                    "shape=")
            dtype = tf.as_dtype(dtype or tf.float32)
        else:
            value = initial_value.numpy() if hasattr(initial_value, "numpy") \
                else np.asarray(initial_value)
            dtype = tf.as_dtype(dtype or value.dtype)
            value = value.astype(dtype.as_numpy_dtype)
            if shape is not None and tuple(shape) != value.shape:
                raise ShardingError(f"variable {name or ''}: shape {tuple(shape)} does not "
                                    f"match the initial value's {value.shape}")
            shape = value.shape
        shape = tuple(int(s) for s in shape)
        super().__init__(trainable=trainable, name=name, shape=shape, dtype=dtype)
        what = f"variable {self.name!r}"
        self.mesh = mesh
        self.layout = Layout.from_spec(mesh, spec or PartitionSpec(), len(shape), what)
        pieces = (split_value(value, mesh, self.layout) if value is not None
                  else self._initial_pieces(initial_value, shape, dtype))
        self.shard_variables = []
        for device, piece in zip(mesh.devices, pieces):
            with tf.device(device):
                self.shard_variables.append(tf.Variable(piece, trainable=False, dtype=dtype,
                                                        name=f"{self._shared_name}_shard"))
        _BY_HANDLE[id(self.handle)] = self

    def _initial_pieces(self, init, shape, dtype):
        """One call of `init` per distinct shard (replicas copy it), padded locally."""
        local = self.layout.local_shape(self.mesh, shape)
        made, pieces = {}, []
        for device in range(self.mesh.size):
            bounds = tuple(shard_bounds(self.mesh, self.layout, shape, device))
            if bounds not in made:
                with tf.device(self.mesh.devices[device]):
                    piece = np.asarray(init(tuple(b - a for a, b in bounds), dtype))
                pad = [(0, l - (b - a)) for l, (a, b) in zip(local, bounds)]
                made[bounds] = np.pad(piece, pad) if any(p for _, p in pad) else piece
            pieces.append(made[bounds])
        return pieces

    # ------------------------------------------------------------------ host side
    @property
    def sharding(self):
        """The gt.Sharding of the variable."""
        return self.sharded().sharding

    @property
    def spec(self):
        """The PartitionSpec of the variable."""
        return self.layout.to_spec()

    @property
    def shards(self):
        """The per-device shard values (padded to equal size along uneven dims)."""
        return [v.read_value() for v in self.shard_variables]

    def sharded(self):
        """The current value as a ShardedTensor."""
        return ShardedTensor(self.mesh, self.layout, self.shape, self.dtype, self.shards)

    def numpy(self):
        """The global value, assembled from the shards."""
        return self.sharded().numpy()

    def shard_bytes(self):
        """Bytes each device holds for this variable."""
        return [int(np.prod(v.shape)) * self.dtype.size for v in self.shard_variables]

    def assign_global(self, value):
        """Set the global value from the host (each device takes its shard)."""
        value = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
        if tuple(value.shape) != tuple(self.shape):
            raise ShardingError(f"variable {self.name!r} has shape {tuple(self.shape)}; "
                                f"cannot assign a value of shape {value.shape}")
        for var, piece in zip(self.shard_variables,
                              split_value(value.astype(self.dtype.as_numpy_dtype), self.mesh,
                                          self.layout)):
            var.assign(piece)

    # Eagerly (between steps: metrics, get/set weights, checkpoints) a read is the global
    # value assembled from the shards and an update is split over them; in traced code
    # they are ordinary variable ops, partitioned onto the shards.
    def _read_variable_op(self, no_copy=False):
        if tf.executing_eagerly():
            return tf.constant(self.numpy())
        return super()._read_variable_op(no_copy)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        """Set the value (see the class docstring for eager vs traced)."""
        if tf.executing_eagerly():
            self.assign_global(value)
            return self if read_value else None
        return super().assign(value, use_locking, name, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        """Add to the value."""
        if tf.executing_eagerly():
            return self.assign(self.numpy() + np.asarray(delta, self.dtype.as_numpy_dtype),
                               read_value=read_value)
        return super().assign_add(delta, use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        """Subtract from the value."""
        if tf.executing_eagerly():
            return self.assign(self.numpy() - np.asarray(delta, self.dtype.as_numpy_dtype),
                               read_value=read_value)
        return super().assign_sub(delta, use_locking, name, read_value)

    @classmethod
    def _variable_call(cls, *args, **kwargs):
        # tf.Variable's metaclass would route construction through variable creator
        # scopes that bind our positional `mesh` to `trainable`; construct directly.
        return None

    # ------------------------------------------------------------------ checkpoints
    def _serialize_to_tensors(self):
        """Checkpoints hold the global value, so they restore onto any mesh or spec."""
        return {"VARIABLE_VALUE": tf.constant(self.numpy())}

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors["VARIABLE_VALUE"]
        if tuple(value.shape) != tuple(self.shape):
            raise ShardingError(
                f"checkpoint value for variable {self.name!r} has shape {tuple(value.shape)} "
                f"but the variable has {tuple(self.shape)}: restore into a variable of the "
                "saved shape")
        self.assign_global(value)
        return tf.no_op()

    def __repr__(self):
        return (f"<gt.Variable {self.name!r} shape={tuple(self.shape)} "
                f"dtype={self.dtype.name} spec={self.spec!r} on {self.mesh!r}>")
