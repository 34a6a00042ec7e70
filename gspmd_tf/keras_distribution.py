"""Keras 3's distribution API (keras.distribution) on the TensorFlow backend, run by gspmd-tf.

    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"))
    model = build_model()          # variables get the layout map's layouts
    model.compile(...); model.fit(x, y)    # every step partitioned over the mesh

Keras' TensorFlow backend has no working distribution_lib (its own is a prototype marked
"DO NOT USE"); this module is one, behaving as the JAX backend's does, with gspmd-tf in
the place of jax.sharding: a DeviceMesh's backend mesh is a gt.Mesh, a TensorLayout's
backend layout a gt.Sharding. `install()` (run by `import gspmd_tf` when Keras' backend
is tensorflow) touches Keras at three named points, each marked "Keras touch point":
  1. keras.src.distribution.distribution_lib calls its backend by the module-level name
     `distribution_lib`: that name (and keras.src.backend.distribution_lib) becomes this
     module, so list_devices, DeviceMesh.backend_mesh, TensorLayout.backend_layout,
     distribute_tensor, initialize and the process counts are ours.
  2. the TF backend Variable's `_initialize` records the current distribution's layout
     for the variable (`variable._layout`), as the JAX backend's Variable does; optimizer
     slots inherit it from their model variable (Keras passes the reference's _layout).
  3. TensorFlowTrainer.make_train/test/predict_function: a model one of whose variables
     has a layout, or used while a distribution is set, is taken over by gspmd-tf (as
     gt.keras.shard_model does, with the variables' layouts as the layout map and the
     distribution's batch_dim_name splitting the batch) before its first step.
The steps then run as gt.functions; gt.keras.lowered(model, "train") shows them.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Optional

import tensorflow as tf

from gspmd_tf import cluster
from gspmd_tf import keras as gt_keras
from gspmd_tf.annotations import mesh_split
from gspmd_tf.errors import ShardingError
from gspmd_tf.layout import Layout
from gspmd_tf.layout_map import as_spec
from gspmd_tf.mesh import Mesh, PartitionSpec, global_device_names
from gspmd_tf.runtime.sharded_tensor import ShardedTensor
from gspmd_tf.sharding import Sharding

__all__ = ["install", "list_devices", "get_device_count", "distribute_tensor", "initialize",
           "num_processes", "process_id"]


# --------------------------------------------------------------------------- backend API

def list_devices(device_type: Optional[str] = None) -> list:
    """The devices of every process as "cpu:0", "cpu:1", ... (as the JAX backend names
    them: platform and global id): GPUs when present and no `device_type` is given,
    else CPUs."""
    names = global_device_names(device_type.upper() if device_type else None)
    return [f"{name.split('device:')[-1].split(':')[0].lower()}:{i}"
            for i, name in enumerate(names)]


def get_device_count(device_type: Optional[str] = None) -> int:
    """How many devices list_devices(device_type) lists."""
    return len(list_devices(device_type))


def _to_backend_mesh(device_mesh) -> Mesh:
    """The gt.Mesh of a keras DeviceMesh (its devices as list_devices names them)."""
    return gt_keras._as_mesh(device_mesh, None)


def _spec_of(tensor_layout) -> PartitionSpec:
    return PartitionSpec(*tensor_layout.axes)


def _to_backend_layout(tensor_layout) -> Sharding:
    """The gt.Sharding of a keras TensorLayout (JAX's backend gives a NamedSharding)."""
    if tensor_layout.device_mesh is None:
        raise ShardingError(f"TensorLayout {tensor_layout.axes} has no device_mesh; give it "
                            "one (TensorLayout(axes, device_mesh)) before using it")
    return Sharding.from_spec(tensor_layout.device_mesh.backend_mesh, _spec_of(tensor_layout),
                              len(tensor_layout.axes), f"TensorLayout {tensor_layout.axes}")


def distribute_tensor(tensor, layout):
    """`tensor` laid out as keras TensorLayout `layout`, as the JAX backend does it:

    - in traced code (a gt.function, such as the steps of a distributed model's fit)
      the counterpart of jax.lax.with_sharding_constraint: an annotation
      (gt.mesh_split), whose result the caller uses in place of `tensor`;
    - eagerly the counterpart of jax.device_put: a gt.ShardedTensor holding each
      device's shard (`.numpy()` gives the global value back).
    """
    if not hasattr(layout, "axes") or layout.device_mesh is None:
        raise ShardingError(f"distribute_tensor takes a keras TensorLayout with a "
                            f"device_mesh, got {layout!r}")
    mesh = layout.device_mesh.backend_mesh
    spec = _spec_of(layout)
    if not tf.executing_eagerly():
        return mesh_split(tensor, mesh, spec)
    value = tf.convert_to_tensor(tensor)
    return ShardedTensor.from_value(
        value, mesh, Layout.from_spec(mesh, spec, value.shape.rank, "distribute_tensor"))


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """Join the processes of a multi-worker run (gt.initialize_cluster): the
    comma-separated `job_addresses` "host:port" of every process and this one's
    `process_id`, or, without them, the TF_CONFIG environment variable. As with JAX,
    call it before anything runs on a device."""
    if job_addresses:
        workers = job_addresses.split(",")
        if num_processes is not None and num_processes != len(workers):
            raise ShardingError(f"keras.distribution.initialize: {len(workers)} job "
                                f"addresses for num_processes={num_processes}")
        return cluster.initialize_cluster({"worker": workers}, process_id)
    return cluster.initialize_cluster()


def num_processes() -> int:
    """How many processes run the program (1 without gt.initialize_cluster)."""
    joined = cluster.current()
    return joined.num_workers if joined is not None else 1


def process_id() -> int:
    """This process's index among them."""
    joined = cluster.current()
    return joined.task_index if joined is not None else 0


# --------------------------------------------------------------------------- models

class _VariableLayouts:
    """The layout map of a model built under a keras Distribution: each variable's own
    layout (recorded at its creation), else the current distribution's; replicated when
    neither gives one. Read as gt.keras.take_over reads a layout map."""

    items = ()  # no regex keys: nothing to report as unmatched

    def lookup(self, variable):
        """("distribution", PartitionSpec) for a variable with a layout, else (None, None)."""
        layout = getattr(variable, "_layout", None)
        if layout is None:
            distribution = _keras_distribution()
            if distribution is not None:
                layout = distribution.get_variable_layout(variable)
        if layout is None:
            return None, None
        return "distribution", as_spec(variable.path, layout)


def _keras_distribution():
    from keras.src.distribution import distribution_lib
    return distribution_lib.distribution()


def _mesh_and_batch_axis(model):
    """(keras DeviceMesh, batch axis name) a model runs with, or None when no
    distribution applies to it: the current distribution's, else that of the mesh its
    variables were laid out on, its batch split over the mesh's first axis (Keras'
    default batch_dim_name)."""
    distribution = _keras_distribution()
    if distribution is not None:
        return distribution.device_mesh, distribution.batch_dim_name
    for variable in model.variables:
        device_mesh = getattr(getattr(variable, "_layout", None), "device_mesh", None)
        if device_mesh is not None:
            return device_mesh, device_mesh.axis_names[0]
    return None


def _taken_over_first(make_function):
    """Keras touch point 3: wrap a TensorFlowTrainer.make_*_function so that a model a
    distribution applies to is taken over before Keras makes its step; take_over gives
    the model its own make_*_function, so the wrapper runs once per model."""

    @functools.wraps(make_function)
    def make(model, force=False):
        placement = None if hasattr(model, "_gt_keras") else _mesh_and_batch_axis(model)
        if placement is None:
            return make_function(model, force)
        device_mesh, batch_axis = placement
        gt_keras.take_over(model, device_mesh.backend_mesh, _VariableLayouts(),
                           PartitionSpec(batch_axis))
        return getattr(model, make_function.__name__)(force)
    return make


def _recording_layout(initialize):
    """Keras touch point 2: wrap the TF backend Variable's _initialize to record the
    current distribution's layout for the variable, as the JAX backend's Variable does
    (keras/src/backend/jax/core.py, _initialize_layout)."""

    @functools.wraps(initialize)
    def recording(variable, value):
        distribution = _keras_distribution()
        if getattr(variable, "_layout", None) is None and distribution is not None:
            if not callable(value):  # Keras sets the shape after _initialize from a value
                variable._shape = variable._validate_shape(value.shape)
            variable._layout = distribution.get_variable_layout(variable)
        return initialize(variable, value)
    return recording


_installed = False


def install() -> None:
    """Make this module Keras' distribution backend (the TF backend only; once)."""
    global _installed
    if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
        return  # another backend asked for: not even imported
    try:
        import keras
    except ImportError:  # no Keras, or its configured backend is not installed
        return
    if _installed or keras.backend.backend() != "tensorflow":
        return
    from keras.src import backend
    from keras.src.backend.tensorflow import core, trainer
    from keras.src.distribution import distribution_lib

    this = sys.modules[__name__]
    # Keras touch point 1: the name the keras.distribution API calls its backend by
    distribution_lib.distribution_lib = this
    backend.distribution_lib = this
    core.Variable._initialize = _recording_layout(core.Variable._initialize)
    for name in ("make_train_function", "make_test_function", "make_predict_function"):
        setattr(trainer.TensorFlowTrainer, name,
                _taken_over_first(getattr(trainer.TensorFlowTrainer, name)))
    _installed = True
