"""Running a lowered program on Cloud TPUs: connect() to a TPU, and a TPUSystem that
compiles programs with the XLA-bridge backend (backends/xla_bridge.py).

On TPUs gspmd-tf does not emit its per-device SPMD program: the annotated global graph
(gspmd_tf.runtime.annotated: the traced ops with every tensor's sharding as an XlaSharding
annotation) runs as ONE replica spanning all cores of the TPU, under a TPUStrategy with
XLA's SPMD partitioning on, so the TPU bridge hands XLA's partitioner our shardings
(docs/DESIGN_LOG.md, "TPU / XLA bridge"). Lower for the TPU on an abstract mesh with as
many devices as the strategy has cores (`TPUSystem.mesh`).

    from gspmd_tf import tpu
    system = tpu.connect("local")              # on a Cloud TPU VM; else its name/address
    mesh = system.mesh((2, 4), ("data", "model"))
    lowered = gt.lower(fn, mesh, in_shardings, args=specs)
    run = system.program(lowered)
    outputs = run(*args)                       # global values in, global values out
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from gspmd_tf.backends.xla_bridge import TPUNotFoundError, XlaBridgeBackend
from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import Mesh
from gspmd_tf.runtime.annotated import GlobalProgram

__all__ = ["TPUNotFoundError", "TPUSystem", "connect"]


def connect(tpu):
    """A TPUSystem: a TPUStrategy running one replica over every core of TPU `tpu` (a
    Cloud TPU name, a grpc:// address, or "local" on a TPU VM) with XLA SPMD
    partitioning.

    Connects to the TPU and initializes it (as TF's TPU setup requires, before other TF
    work in the process). Raises TPUNotFoundError, naming `tpu`, when it cannot be
    reached or has no TPU cores."""
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    except Exception as e:  # noqa: BLE001 -- resolver, network and runtime errors alike
        first_line = str(e).splitlines()[0][:300] if str(e) else ""
        raise TPUNotFoundError(
            f"TPU {tpu!r} could not be reached ({type(e).__name__}: {first_line}); on a "
            "Cloud TPU VM pass 'local', elsewhere the TPU's name (with gcloud "
            "credentials) or its grpc://host:8470 address") from e
    # every core in one replica: computation_shape covers the whole topology
    assignment = tf.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=np.asarray(topology.mesh_shape, np.int32),
        num_replicas=1)
    strategy = tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment,
                                         experimental_spmd_xla_partitioning=True)
    return TPUSystem(strategy, assignment.num_cores_per_replica)


@dataclass(frozen=True)
class TPUSystem:
    """A connected TPU: `strategy` (TPUStrategy, one replica of `num_cores` cores)."""

    strategy: object
    num_cores: int

    def mesh(self, shape, axis_names):
        """An abstract gt.Mesh of `shape` over the cores; device id k is logical core k
        of the replica (what XLA's shardings name). ShardingError when sizes differ."""
        if int(np.prod(shape)) != self.num_cores:
            raise ShardingError(
                f"mesh shape {tuple(shape)} has {int(np.prod(shape))} devices but the TPU "
                f"has {self.num_cores} cores: give a shape of {self.num_cores} devices")
        return Mesh.abstract(shape, axis_names)

    def program(self, lowered):
        """`lowered` compiled for this TPU by the XLA-bridge backend
        (backends/xla_bridge.py: its annotated global program, one replica over every
        core): called with the program's global arguments, returns its flat outputs;
        `.variables` are the strategy's copies of its captured gt.Variables (see
        BridgeCompiled)."""
        return XlaBridgeBackend(lowered.mesh, self.strategy).compile(
            GlobalProgram(lowered), lowered.name)
