"""mesh_split: annotate a tensor of traced code with a sharding over a mesh."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding

from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import Mesh
from gspmd_tf.propagation.knobs import record_priority
from gspmd_tf.sharding import Sharding


def mesh_split(tensor, mesh, spec, priority=None, open_dims=None):
    """Ask for `tensor` to be split over `mesh` as PartitionSpec `spec` says (or a
    gt.Sharding: any tile assignment of the mesh's device ids, Sharding.placement).

    A hint that may appear anywhere in code that gspmd-tf traces: propagation treats it
    as a user annotation and spreads it to the surrounding tensors. In a graph it adds an
    XlaSharding op (an identity that carries the sharding, exactly as TF's own
    xla_sharding module does, so either API may be used) and returns its output, which
    the caller must use in place of `tensor`. Outside gspmd-tf the op just passes the
    value through, on any device. In eager mode there is no graph to annotate: the spec
    is checked and `tensor` is returned unchanged. `priority` (an int, 0 first; None:
    0) is Shardy's user priority: annotations propagate in rounds by priority, so a
    p0 annotation (say the batch split) claims the tensors it reaches before a p1
    one (the model split) competes (propagation/knobs.py). `open_dims` (dims of
    `tensor`) are Shardy's open dims: they keep the spec's axes and propagation may
    split them further (a None entry there is left wholly to propagation); the others
    are closed, exactly as the spec says.
    """
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"mesh_split needs a gt.Mesh, got {mesh!r}")
    _check_not_leaked(tensor)
    eager = tf.executing_eagerly()
    value = tensor if eager else tf.convert_to_tensor(tensor)
    what = "tensor" if eager else f"tensor {value.name}"
    rank = tf.TensorShape(value.shape if hasattr(value, "shape") else np.shape(value)).rank
    if rank is None:
        raise ShardingError(
            f"mesh_split: {what} has unknown rank; give it a static rank first "
            "(e.g. tf.ensure_shape) so the spec can be checked against it")
    if isinstance(spec, Sharding):
        spec.placement(mesh, rank, what)  # checked: rank, the mesh's device ids
        sharding = spec
    else:
        sharding = Sharding.from_spec(mesh, spec, rank, what)
    if eager:
        return tensor
    out = xla_sharding.Sharding(proto=sharding.to_proto()).apply_to_tensor(
        value, use_sharding_op=True,
        unspecified_dims=[d % rank for d in open_dims] if open_dims else None)
    if priority is not None:
        record_priority(out, priority)
    return out


def _check_not_leaked(tensor):
    """ShardingError when `tensor` is a graph tensor of a trace that is not the one
    running now nor one it is nested in: a tensor kept from an earlier trace (a Python
    list or attribute filled inside a traced function), which no program can read."""
    if not tf.is_symbolic_tensor(tensor):
        return
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    while graph is not None:
        if tensor.graph is graph:
            return
        graph = getattr(graph, "outer_graph", None)
    raise ShardingError(
        f"mesh_split: tensor {tensor.name} belongs to another trace (graph "
        f"{getattr(tensor.graph, 'name', tensor.graph)!r}): it leaked out of the function "
        "that computed it, e.g. kept in a Python list or attribute; return it from that "
        "function, or compute it again in this one")
