"""gt.Variable: a tf.Variable whose value lives only as shards on the devices of a mesh.

To traced code it is an ordinary (resource) tf.Variable of the global shape: read it,
take gradients with respect to it, assign to it, hand it to an optimizer. Its own handle
holds no memory (an uninitialized variable); when a gt.function runs, every device's
program gets the handle of that device's shard variable instead, so reads, assigns and
optimizer updates act on the shards. (A gt.function on another mesh only reads it, from
copies resharded onto its mesh; see gt.function.)

The CPU devices of this process that hold the same block share one tf.Variable, on the
first of them (replicas.copy_owners): a replicated variable is one tf.Variable per
process, not one per device. The local backend reads and writes it on that device for
all of them (backends/emitter.py); a program that cannot (Compiled.shares_variable_copies
false: a control-flow body or a compiled segment touching variables) runs on private copies
for the other devices, kept between such runs (Variable.handles).

Checkpoints store each distinct shard as a slice of the global variable, so saving and
restoring move one shard at a time, and any mesh, spec or plain tf.Variable restores them.

On a mesh spanning several workers each worker creates, updates, saves and restores
only the shards of its own devices (shard_variables[d] is None for the others):
save_checkpoint writes one checkpoint from all of them, and tf.train.Checkpoint.read
restores it on any number of workers.
"""

from __future__ import annotations

import os
import re
import weakref
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import base as trackable
from tensorflow.python.training.saving import saveable_object

from gspmd_tf import cluster
from gspmd_tf.backends import collectives
from gspmd_tf.backends.replicas import copy_owners
from gspmd_tf.errors import ShardingError
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import Mesh, PartitionSpec
from gspmd_tf.runtime.sharded_tensor import (ShardedTensor, distinct_boxes, pad_piece,
                                             padding, shard_bytes, split_value)

# id(handle tensor) -> Variable, so a traced function's captured handles lead back to
# their variables
_BY_HANDLE = weakref.WeakValueDictionary()
# The name of every shard's tf.Variable. An eager variable's name is an attribute of
# its VarHandleOp, and TF caches eager kernels by attributes and device: a name per
# variable made every shard instantiate a kernel of its own (~0.5 ms, most of creating a
# shard). A shard is reached through its gt.Variable only, which names it.
_SHARD_NAME = "gt_shard"
# True while save_checkpoint gathers this worker's entries: each distinct shard is then
# saved by one worker only, the one holding its first device
_saving_own_shards = False


def variable_of_handle(handle):
    """The gt.Variable whose (template) handle is `handle`, or None."""
    return _BY_HANDLE.get(id(handle))


class _WholeValueCheckpoint(resource_variable_ops.UninitializedVariable):
    """The _serialize_to_tensors protocol for objects that delegate to a gt.Variable
    (keras.Variable calls its value's methods): the whole value, one key."""

    def _serialize_to_tensors(self):
        return {trackable.VARIABLE_VALUE_KEY: tf.constant(self.numpy())}

    def _restore_from_tensors(self, restored_tensors):
        self.assign_global(restored_tensors[trackable.VARIABLE_VALUE_KEY])
        return tf.no_op()


class Variable(_WholeValueCheckpoint):
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
            # tf.Variable's conversion rules: numpy values are cast, tensors and python
            # numbers of another dtype are refused
            value = tf.convert_to_tensor(initial_value, dtype=dtype)
            dtype = value.dtype
            if shape is not None and tuple(shape) != tuple(value.shape):
                raise ShardingError(f"variable {name or ''}: shape {tuple(shape)} does not "
                                    f"match the initial value's {tuple(value.shape)}")
            shape = value.shape
        shape = tuple(int(s) for s in shape)
        super().__init__(trainable=trainable, name=name, shape=shape, dtype=dtype)
        self.mesh = mesh
        self.layout = self.layout_for(mesh, spec, shape, f"variable {self.name!r}")
        pieces = (self._global_pieces(np.asarray(value)) if value is not None
                  else self._initial_pieces(initial_value))
        # the CPU devices of this process holding one block share one tf.Variable, on
        # the first of them (a copy per process, not per device); others hold their own
        self._owners = copy_owners(mesh, self.layout)
        self._private = None  # private copies of the devices sharing another's copy
        self._private_current = False  # they hold the shared copies' values
        self.shard_variables = [None] * mesh.size
        for devices, piece in pieces:  # devices: this process's holders of the piece
            # one tensor per distinct shard, which its devices' variables start from
            # (TF shares the buffer between devices until a variable is updated)
            with tf.device(mesh.devices[devices[0]]):
                piece = tf.convert_to_tensor(piece, dtype=dtype)
            for device in devices:  # an owner comes before the devices sharing its copy
                owner = self._owners[device]
                if owner != device:
                    self.shard_variables[device] = self.shard_variables[owner]
                    continue
                with tf.device(mesh.devices[device]):
                    self.shard_variables[device] = tf.Variable(piece, trainable=False,
                                                               name=_SHARD_NAME)
        _BY_HANDLE[id(self.handle)] = self

    @staticmethod
    def layout_for(mesh: Mesh, spec: Optional[PartitionSpec], shape: Sequence[int],
                   what: str = "variable") -> Layout:
        """The layout a variable of `shape` split by `spec` is stored with.

        A dim of size 0 or 1 is the same on every device split or not (ceil(n/k) = n):
        kept unsplit, so that op rules, which give such dims no factor, use the shards
        in place (a variable's shards cannot be resharded)."""
        layout = Layout.from_spec(mesh, spec or PartitionSpec(), len(shape), what)
        return Layout(tuple(() if n <= 1 else axes for n, axes in zip(shape, layout.dims)))

    def _local_boxes(self):
        """[(box, device ids)] of the distinct shards some device of this process holds,
        the ids narrowed to this process's devices."""
        local = set(self.mesh.addressable_ids)
        boxes = []
        for box, devices in distinct_boxes(self.mesh, self.layout, self.shape):
            mine = [d for d in devices if d in local]
            if mine:
                boxes.append((box, mine))
        return boxes

    def _global_pieces(self, value):
        """Yield (device ids, piece) of a global numpy value, one distinct shard at a time."""
        local = self.layout.local_shape(self.mesh, self.shape)
        for box, devices in self._local_boxes():
            yield devices, pad_piece(value[tuple(slice(a, b) for a, b in box)], box, local)

    def _initial_pieces(self, init):
        """Yield (device ids, piece): one call of `init` per distinct shard (of this
        process's devices), checked and padded on the first device that holds it; one
        piece is alive at a time."""
        local = self.layout.local_shape(self.mesh, self.shape)
        for box, devices in self._local_boxes():
            extent = tuple(b - a for a, b in box)
            with tf.device(self.mesh.devices[devices[0]]):
                piece = self._checked_piece(init(extent, self.dtype), extent)
                pad = padding(box, local)
                yield devices, (tf.pad(piece, pad) if any(p for _, p in pad) else piece)

    def _checked_piece(self, piece, extent):
        """`piece` (what initial_value(shape, dtype) returned) as a tensor of one shard;
        ShardingError naming the variable and the expected shard if it is not one."""
        expected = (f"initial_value(shape, dtype) of variable {self.name!r} is called once "
                    f"per distinct shard and must return that shard: shape {extent}, dtype "
                    f"{self.dtype.name} (the whole variable is {tuple(self.shape)})")
        if piece is None:
            raise ShardingError(f"{expected}; it returned None")
        try:
            piece = tf.convert_to_tensor(piece, dtype=self.dtype)
        except (TypeError, ValueError) as error:
            raise ShardingError(f"{expected}; it returned a value that does not convert: "
                                f"{error}") from None
        if tuple(piece.shape) != extent:
            raise ShardingError(f"{expected}; it returned shape {tuple(piece.shape)}")
        return piece

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
        """The per-device shard values (padded to equal size along uneven dims; None on
        other workers' devices): one read per copy, which the devices sharing it share."""
        reads = {}
        for v in self.shard_variables:
            if v is not None and id(v) not in reads:
                reads[id(v)] = v.read_value()
        return [None if v is None else reads[id(v)] for v in self.shard_variables]

    def copies(self):
        """The distinct tf.Variables holding this process's shards (a copy per class of
        devices holding one block: see the class docstring), for a caller that may
        write them."""
        self._private_current = False
        return list({id(v): v for v in self.shard_variables if v is not None}.values())

    def handles(self, shared: bool) -> list:
        """Per-device handles for a program on this variable's mesh (None on other
        workers' devices). `shared` (the program's Compiled.shares_variable_copies): the
        handles of the copies, repeated for the devices sharing one. Else each device
        sharing another's copy gets a private copy of its value, written by that
        device's program only; the owner's program writes the shared copy, with the
        same values. Private copies are kept between such runs and refreshed from the
        shared ones after anything else may have written those (a sharing program,
        an eager update, a restore, copies())."""
        handles = [None if v is None else v.handle for v in self.shard_variables]
        if shared:
            self._private_current = False
            return handles
        if self._private is None:
            self._private = [None] * self.mesh.size
            for d, (v, owner) in enumerate(zip(self.shard_variables, self._owners)):
                if v is not None and owner != d:
                    with tf.device(self.mesh.devices[d]):
                        self._private[d] = tf.Variable(v.read_value(), trainable=False,
                                                       name=_SHARD_NAME)
        elif not self._private_current:
            for d, private in enumerate(self._private):
                if private is not None:
                    private.assign(self.shard_variables[d].read_value(), read_value=False)
        self._private_current = True
        return [h if private is None else private.handle
                for h, private in zip(handles, self._private)]

    def private_copies_differ(self):
        """A program on private copies failed midway: they may hold other values than
        the shared copies now; the next such program refreshes them."""
        self._private_current = False

    def sharded(self):
        """The current value as a ShardedTensor."""
        return ShardedTensor(self.mesh, self.layout, self.shape, self.dtype, self.shards)

    def numpy(self):
        """The global value, assembled from the shards."""
        return self.sharded().numpy()

    def shard_bytes(self):
        """Bytes each device holds for this variable."""
        return shard_bytes(self.mesh, self.layout, self.shape, self.dtype)

    def assign_global(self, value):
        """Set the global value from the host (each device takes its shard)."""
        self._update_shards("assign", self._global_operand(value, "assign"))

    def _global_operand(self, value, update):
        """`value` as a numpy array of the variable's dtype and shape, converted and
        refused as tf.Variable does (numpy values are cast, tensors of another dtype are
        not; assign raises ValueError, assign_add/sub InvalidArgumentError)."""
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        if tuple(value.shape) == tuple(self.shape):
            return np.asarray(value)
        if update == "assign":
            raise ShardingError(f"variable {self.name!r} has shape {tuple(self.shape)}; "
                                f"cannot assign a value of shape {tuple(value.shape)}")
        raise tf.errors.InvalidArgumentError(
            None, None, f"Cannot update variable {self.name!r} with shape "
            f"{list(self.shape)} using a Tensor with shape {list(value.shape)}, shapes must "
            "be equal.")

    def _update_shards(self, update, value):
        """Apply `update` ("assign", "assign_add", "assign_sub") of a global numpy value
        shard by shard."""
        pieces = split_value(value, self.mesh, self.layout)
        self._private_current = False
        for d, (var, piece) in enumerate(zip(self.shard_variables, pieces)):
            if var is not None and self._owners[d] == d:  # once per copy
                getattr(var, update)(piece)

    # Eagerly (between steps: metrics, get/set weights, checkpoints) a read is the global
    # value assembled from the shards and an update is split over them; in traced code
    # they are ordinary variable ops, partitioned onto the shards.
    def _read_variable_op(self, no_copy=False):
        if tf.executing_eagerly():
            return tf.constant(self.numpy())
        return super()._read_variable_op(no_copy)

    def _update(self, update, value, use_locking, name, read_value):
        if tf.executing_eagerly():
            self._update_shards(update, self._global_operand(value, update))
            return self if read_value else None
        return getattr(super(), update)(value, use_locking, name, read_value)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        """Set the value (see the class docstring for eager vs traced)."""
        return self._update("assign", value, use_locking, name, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        """Add to the value."""
        return self._update("assign_add", delta, use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        """Subtract from the value."""
        return self._update("assign_sub", delta, use_locking, name, read_value)

    @classmethod
    def _variable_call(cls, *args, **kwargs):
        # tf.Variable's metaclass would route construction through variable creator
        # scopes that bind our positional `mesh` to `trainable`; construct directly.
        return None

    # ------------------------------------------------------------------ checkpoints
    # TF's own checkpoints (tf.train.Checkpoint) take the legacy saveable path below,
    # because this class defines _gather_saveables_for_checkpoint and not
    # _serialize_to_tensors (TF checks the class itself first): its restore hands every
    # slice to its own saveable, where the _serialize_to_tensors path would keep only one
    # slice per key.
    def _gather_saveables_for_checkpoint(self):
        return {trackable.VARIABLE_VALUE_KEY: self._shard_saveables}

    def _shard_saveables(self, name):
        """This variable's checkpoint entries: each distinct shard is one slice of the
        full variable, so save and restore move one shard at a time and any mesh, spec or
        plain tf.Variable can restore the checkpoint."""
        # On a cluster each worker restores the shards of its own devices, and saves
        # (through save_checkpoint) those whose first device is its own.
        local = set(self.mesh.addressable_ids)

        def ours(devices):
            return devices[0] in local if _saving_own_shards else bool(local & set(devices))
        boxes = [(box, [d for d in devices if d in local]) for box, devices in
                 distinct_boxes(self.mesh, self.layout, self.shape)
                 if all(b > a for a, b in box) and ours(devices)]
        if boxes:
            return [_ShardSaveable(self, box, devices, name) for box, devices in boxes]
        if 0 in self.shape:  # no elements: one empty entry, nothing to write back
            return [_ShardSaveable(self, tuple((0, n) for n in self.shape), [], name,
                                   saved_here=0 in local or not _saving_own_shards)]
        # Other workers hold (save) every shard. TF wants an entry all the same: the
        # first shard, which this worker neither writes nor restores.
        box, _ = distinct_boxes(self.mesh, self.layout, self.shape)[0]
        return [_ShardSaveable(self, box, [], name, saved_here=False)]

    def __repr__(self):
        return (f"<gt.Variable {self.name!r} shape={tuple(self.shape)} "
                f"dtype={self.dtype.name} spec={self.spec!r} on {self.mesh!r}>")


class _ShardSaveable(saveable_object.SaveableObject):
    """One distinct shard of a gt.Variable in a checkpoint: saved as the slice `box` of
    the full variable, restored by reading just that slice into the devices holding it
    (`devices`: this process's).

    Reading the slice with its full-shape slice spec makes TF's RestoreV2 check the
    stored shape and dtype before any restored value is written.
    """

    def __init__(self, variable, box, devices, name, saved_here=True):
        self.saved_here = saved_here  # False: another worker saves this entry
        self._variable = variable
        self._box = box
        self._devices = devices
        self._extent = tuple(b - a for a, b in box)
        source = variable.shard_variables[devices[0] if devices else
                                          variable.mesh.addressable_ids[0]]
        spec = saveable_object.SaveSpec(self._read, _slice_spec(variable.shape, box), name,
                                        dtype=variable.dtype, device=source.device)
        super().__init__(source, [spec], name)

    def _read(self):
        variable = self._variable
        if not self.saved_here:  # only worker 0's checkpoint.write gets here
            raise ShardingError(
                f"variable {variable.name!r} has no shard that worker 0 saves: "
                "gt.save_checkpoint needs device 0 of every variable's mesh on worker 0 "
                "(gt.Mesh.create puts it there)")
        if not variable.mesh.is_fully_addressable and not _saving_own_shards:
            raise ShardingError(
                f"variable {variable.name!r} lives on several workers: save its checkpoint "
                "with gt.save_checkpoint(checkpoint, prefix) on every worker, which writes "
                "each shard once (tf.train.Checkpoint.read restores it)")
        if not self._devices:  # a variable with no elements
            return tf.zeros(self._extent, variable.dtype)
        source = variable.shard_variables[self._devices[0]]
        with tf.device(source.device):
            value = source.read_value()
            if tuple(source.shape) != self._extent:  # drop the padding of uneven shards
                value = value[tuple(slice(0, n) for n in self._extent)]
        return value

    def restore(self, restored_tensors, restored_shapes):
        """Write the restored slice to each device that holds it (padded)."""
        value, = restored_tensors
        variable = self._variable
        if tuple(value.shape) != self._extent:  # only unsliced entries get here unchecked
            raise ShardingError(
                f"checkpoint value for variable {variable.name!r} has shape "
                f"{tuple(value.shape)} but the variable has {tuple(variable.shape)}: restore "
                "into a variable of the saved shape")
        updates = []
        variable._private_current = False  # pylint: disable=protected-access
        for device in self._devices:
            if variable._owners[device] != device:  # pylint: disable=protected-access
                continue  # shares the copy its owner writes
            shard = variable.shard_variables[device]
            pad = padding(self._box, shard.shape)
            with tf.device(shard.device):
                updates.append(shard.assign(tf.pad(value, pad) if any(p for _, p in pad)
                                            else value, read_value=False))
        return tf.group(updates)


def _slice_spec(shape, box):
    """The checkpoint slice spec of `box` in a tensor of `shape`; "" (the whole tensor)
    for a scalar or a tensor with no elements, which slice specs cannot describe."""
    if len(shape) == 0 or 0 in tuple(shape):
        return ""
    return tf.Variable.SaveSliceInfo(
        full_name="", full_shape=list(shape), var_offset=[a for a, _ in box],
        var_shape=[b - a for a, b in box]).spec


def save_checkpoint(checkpoint, prefix):
    """Write `checkpoint` (a tf.train.Checkpoint) to `prefix`; returns `prefix`.

    On one process this is checkpoint.write(prefix). On a cluster every worker must call
    it: each writes the shards its devices hold first (no worker ever holds a whole split
    variable), the first worker also the object graph and the other (replicated) values,
    into `prefix`_parts/; the first worker merges the parts into the one checkpoint
    `prefix` (TF's MergeV2Checkpoints keeps every slice), and all return once it exists.
    `prefix` must be on a filesystem every worker sees. `checkpoint.read(prefix)` (or
    restore, or gt.restore_checkpoint: errors naming what to change) then restores it
    on any number of workers, mesh or spec, or into plain tf.Variables: each variable
    reads only the slices its devices hold.
    """
    global _saving_own_shards
    joined = cluster.current()
    if joined is None or joined.num_workers == 1:
        return checkpoint.write(prefix)
    from tensorflow.python.ops import gen_io_ops
    parts = [f"{prefix}_parts/worker-{task}" for task in range(joined.num_workers)]
    _saving_own_shards = True
    try:
        if joined.task_index == 0:
            checkpoint.write(parts[0])
        else:
            _write_own_shards(checkpoint, parts[joined.task_index])
    finally:
        _saving_own_shards = False
    collectives.barrier()
    if joined.task_index == 0:
        written = [part for part in parts if tf.io.gfile.exists(part + ".index")]
        gen_io_ops.merge_v2_checkpoints(written, prefix, delete_old_dirs=True)
    collectives.barrier()
    return prefix


def restore_checkpoint(checkpoint, prefix):
    """checkpoint.read(prefix) (a tf.train.Checkpoint of gt.Variables, tf.Variables or
    any trackables); returns its status. A checkpoint that does not fit raises a
    ShardingError naming the file, the entry and what to change, TF's error its cause:
    no files at `prefix`, a corrupt file, or an entry whose stored shape or dtype is not
    its variable's. (tf.train.Checkpoint's own read and restore raise the same errors
    where the checkpoint holds a gt.Variable, see _wrap_checkpoint_errors.)

    On one process a failed restore changes no variable: TF reads every entry of the
    checkpoint, checking each stored shape and dtype against the slice its variable
    reads (a gt.Variable's shards read as slices of the full shape), before any value
    is written. On a cluster each worker reads its own entries.
    """
    try:
        return checkpoint.read(prefix)
    except _CHECKPOINT_ERRORS as error:
        raise checkpoint_error(error, prefix) from error


# TF's errors for a checkpoint that does not fit its objects
_CHECKPOINT_ERRORS = (tf.errors.NotFoundError, tf.errors.DataLossError,
                      tf.errors.InvalidArgumentError)


def checkpoint_error(error: tf.errors.OpError, prefix) -> ShardingError:
    """The ShardingError saying what to change for TF's `error` (one of
    _CHECKPOINT_ERRORS) restoring the checkpoint at `prefix`."""
    if isinstance(error, tf.errors.NotFoundError):
        return ShardingError(
            f"no checkpoint at {prefix!r} ({_first_line(error)}): give the prefix "
            "checkpoint.write (or gt.save_checkpoint) returned, e.g. "
            "tf.train.latest_checkpoint(directory)")
    if isinstance(error, tf.errors.DataLossError):
        return ShardingError(
            f"checkpoint {prefix!r} is corrupt ({_first_line(error)}): restore from an "
            "intact copy, or save it again")
    entry = re.search(r"tensor_name = ([^;\s]+)", error.message or "")
    what = (f"its entry {entry.group(1).split('/.ATTRIBUTES/')[0]!r}" if entry
            else "an entry")
    return ShardingError(
        f"checkpoint {prefix!r}: {what} does not fit the variable restoring it "
        f"({_first_line(error)}): restore into a variable of the saved shape and "
        "dtype (create it with the shape the checkpoint holds, then reshard or "
        "reshape it), or save the checkpoint again from these variables")


def _wrap_checkpoint_errors():
    """Make TF's checkpoint restore (tf.train.Checkpoint.read and restore, and what
    calls them) raise checkpoint_error's ShardingError, TF's error its cause, where the
    checkpoint's objects include a gt.Variable; other checkpoints keep TF's errors.
    TF gives no hook for this, so the method is wrapped once, when gspmd_tf is
    imported. A failed restore has written no variable (restore_checkpoint)."""
    from tensorflow.python.checkpoint import checkpoint as tf_checkpoint
    from tensorflow.python.checkpoint import util as checkpoint_util
    saver = tf_checkpoint.TrackableSaver
    if getattr(saver.restore, "_gspmd_tf_wrapped", False):
        return
    original = saver.restore

    def restore(self, save_path, options=None):
        try:
            return original(self, save_path, options)
        except _CHECKPOINT_ERRORS as error:
            objects = checkpoint_util.list_objects(self._graph_view)  # pylint: disable=protected-access
            if not any(isinstance(o, Variable) for o in objects):
                raise
            prefix = save_path.numpy().decode() if hasattr(save_path, "numpy") else save_path
            raise checkpoint_error(error, prefix) from error
    restore.__doc__ = original.__doc__
    restore._gspmd_tf_wrapped = True
    saver.restore = restore


def _first_line(error):
    """The first line of a TF error's message without TF's function-node prefix."""
    message = (error.message or str(error)).strip().splitlines()[0]
    return re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", message)


def _write_own_shards(checkpoint, part):
    """Save the gt.Variable shards this worker saves (their checkpoint keys and slice
    specs as tf.train.Checkpoint names them) to the bundle `part`; nothing if none."""
    from tensorflow.python.ops import gen_io_ops
    # the saveables TF's checkpoint would write, with their keys (a private TF API: the
    # public one writes the object graph too, which only one part may hold)
    serialized = checkpoint._saver._gather_serialized_tensors(None)[0]  # pylint: disable=protected-access
    names, slices, tensors = [], [], []
    for trackable in serialized:
        for saveable in getattr(trackable, "saveables", ()):
            if not isinstance(saveable, _ShardSaveable) or not saveable.saved_here:
                continue
            for spec in saveable.specs:
                names.append(spec.name)
                slices.append(spec.slice_spec)
                tensors.append(spec.tensor)
    if names:
        tf.io.gfile.makedirs(os.path.dirname(part))
        gen_io_ops.save_v2(part, names, slices, tensors)


_wrap_checkpoint_errors()
