"""gspmd-tf: GSPMD for TensorFlow graphs.

Annotate a few tensors of a single-device TF function with how they split over a mesh
of devices; gspmd-tf infers the rest, rewrites the function into one SPMD program with
collectives and runs it on the mesh.
"""

# The built-in op declarations live beside their emitters (spmd/handlers) and fill the op
# registry when imported. Imported here, above every stage and before anything else, the
# registry is complete before its first lookup, whichever gspmd_tf module is imported
# first; no stage imports up to load them.
from gspmd_tf.spmd import handlers as _builtin_op_declarations  # noqa: F401
from gspmd_tf import keras
from gspmd_tf.autoshard import AUTO
from gspmd_tf.annotations import mesh_split
from gspmd_tf.propagation.knobs import propagation_barrier, sharding_group
from gspmd_tf.attention import ring_attention, ulysses_attention
from gspmd_tf.attention_layer import context_parallel_attention
from gspmd_tf.cluster import initialize_cluster
from gspmd_tf.devices import configure_cpu_devices
from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import Mesh, P, PartitionSpec
from gspmd_tf.pipeline import pipeline, pipeline_schedule, pipeline_value_and_grad
from gspmd_tf.pipeline import layer_order as pipeline_layer_order
from gspmd_tf.registry import register_op
from gspmd_tf.runtime.function import Function, function, lower
from gspmd_tf.runtime.lowered import Collective, Lowered
from gspmd_tf.runtime.sharded_tensor import ShardedTensor
from gspmd_tf.runtime.variables import Variable, restore_checkpoint, save_checkpoint
from gspmd_tf.sharding import Sharding
from gspmd_tf.visualize import visualize_sharding
from gspmd_tf import keras_distribution as _keras_distribution

# Keras' own keras.distribution API runs on gspmd-tf when Keras' backend is TensorFlow
_keras_distribution.install()

__all__ = ["AUTO", "Collective", "Function", "Lowered", "Mesh", "P", "PartitionSpec",
           "ShardedTensor", "Sharding", "ShardingError", "configure_cpu_devices",
           "context_parallel_attention",
           "Variable", "function", "initialize_cluster", "keras", "lower", "mesh_split",
           "pipeline", "pipeline_layer_order", "pipeline_schedule",
           "pipeline_value_and_grad", "propagation_barrier", "register_op",
           "restore_checkpoint", "ring_attention", "save_checkpoint", "sharding_group",
           "ulysses_attention", "visualize_sharding"]
