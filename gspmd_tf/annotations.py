"""mesh_split: annotate a tensor of traced code with a sharding over a mesh."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding

from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import Mesh
from gspmd_tf.sharding import Sharding


def mesh_split(tensor, mesh, spec):
    """Ask for `tensor` to be split over `mesh` as PartitionSpec `spec` says.

    A hint that may appear anywhere in code that gspmd-tf traces: propagation treats it
    as a user annotation and spreads it to the surrounding tensors. In a graph it adds an
    XlaSharding op (an identity that carries the sharding, exactly as TF's own
    xla_sharding module does, so either API may be used) and returns its output, which
    the caller must use in place of `tensor`. Outside gspmd-tf the op just passes the
    value through, on any device. In eager mode there is no graph to annotate: the spec
    is checked and `tensor` is returned unchanged.
    """
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"mesh_split needs a gt.Mesh, got {mesh!r}")
    eager = tf.executing_eagerly()
    value = tensor if eager else tf.convert_to_tensor(tensor)
    what = "tensor" if eager else f"tensor {value.name}"
    rank = tf.TensorShape(value.shape if hasattr(value, "shape") else np.shape(value)).rank
    if rank is None:
        raise ShardingError(
            f"mesh_split: {what} has unknown rank; give it a static rank first "
            "(e.g. tf.ensure_shape) so the spec can be checked against it")
    sharding = Sharding.from_spec(mesh, spec, rank, what)
    if eager:
        return tensor
    return xla_sharding.Sharding(proto=sharding.to_proto()).apply_to_tensor(
        value, use_sharding_op=True)
