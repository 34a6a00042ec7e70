"""AutoBackend, the default backend: per program, the XLA backend where it applies, else
the local backend.

Where it applies, measured on this project's workloads (benchmarks/RESULTS.md §14.9,
§14.11):
- a mesh of this process's devices (the XLA backend runs no mesh spanning workers);
- on accelerators, always: XLA is the compiler TF's GPU and TPU paths are built around,
  and a GPU pays per kernel launch what compiling removes (not measured here: no GPU);
- on CPUs, for programs without a large dot or convolution: compiling the program's
  compute between collectives removes the per-op dispatch of 8 logical devices' copies
  of every small op (a Transformer LM's training step 1.6x faster data parallel, its
  forward 1.35x on 2x4), while XLA:CPU's dots and convolutions are slower than TF's
  oneDNN kernels once they are large (an FFN with 268M multiply-adds per device and
  dot: 2.1x slower; ResNet50: 2.6x).

The choice is logged (logger "gspmd_tf", INFO) with its reason; `choose` gives it
without compiling. backend="local" or "xla" (or GSPMD_TF_BACKEND) fixes the backend.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from gspmd_tf.backends import base, segments
from gspmd_tf.backends.local import LocalBackend
from gspmd_tf.backends.xla import XlaBackend

log = logging.getLogger("gspmd_tf")

# Multiply-adds per device from which a dot or convolution runs faster on TF's oneDNN
# kernels than under XLA:CPU (benchmarks/RESULTS.md §14.11: the crossover of the FFN
# train step's width).
LARGE_DOT = 2 ** 24


def choose(mesh, program):
    """(backend class, reason in words) AutoBackend runs `program` (an SPMD program,
    local shapes) with on `mesh`."""
    if not mesh.is_fully_addressable:
        return LocalBackend, "the mesh spans several workers (the XLA backend runs meshes " \
                             "of one process)"
    kinds = {(tf.DeviceSpec.from_string(name).device_type or "CPU").upper()
             for name in mesh.devices}
    if kinds != {"CPU"}:
        return XlaBackend, f"the mesh's {'/'.join(sorted(kinds - {'CPU'}))} devices run " \
                           "XLA-compiled segments"
    large = sorted(segments.large_dots(program, LARGE_DOT))
    if large:
        node = program.nodes[large[0]]
        return LocalBackend, (
            f"{len(large)} dots or convolutions of {LARGE_DOT:,} multiply-adds per device "
            f"or more (e.g. {node.name}, {node.op}) run faster on TF's CPU kernels than "
            "under XLA:CPU")
    return XlaBackend, "no dot or convolution of 2^24 multiply-adds per device or more " \
                       "on a CPU mesh: compiled segments save the per-op dispatch"


class AutoBackend(base.Backend):
    """The default backend: compiles each program with XlaBackend or LocalBackend, as
    `choose` says (module docstring). `collective_timeout` as for LocalBackend."""

    def __init__(self, mesh, collective_timeout=None):
        super().__init__(mesh)
        self.collective_timeout = collective_timeout

    def compile(self, program, name=None):
        """The chosen backend's compile(program, name)."""
        cls, reason = choose(self.mesh, program)
        log.info("gspmd_tf: %s runs on the %s: %s", name or "an SPMD program",
                 cls.__name__, reason)
        return cls(self.mesh, self.collective_timeout).compile(program, name)
