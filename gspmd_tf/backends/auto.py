"""AutoBackend (backend="auto", opt-in): per program, the XLA backend where it applies by
a multiply-add heuristic, else the local backend; and the default backend, chosen by
platform (for_platform).

The default (for_platform), as JAX chooses by platform: the XLA backend on accelerator
meshes of this process, the local backend (every op on TF's kernels) on CPU meshes and
on meshes spanning several workers. It never changes numerics behind the user's back:
on CPUs the values are TF's kernels'; the XLA backend runs every op whose XLA values
differ from TF's (registry.xla_numerics_differ) on TF's kernels.

AutoBackend's heuristic, for users who opt in:

Where it applies, measured on this project's workloads (benchmarks/RESULTS.md §14.9,
§14.11):
- a mesh of this process's devices (the XLA backend runs no mesh spanning workers);
- on accelerators, always: XLA is the compiler TF's GPU and TPU paths are built around,
  and a GPU pays per kernel launch what compiling removes (not measured here: no GPU);
- on CPUs, for programs of many cheap ops: compiling the compute between collectives
  removes the dispatch of every op's copy on every logical device, but XLA:CPU's dots
  are slower than TF's oneDNN kernels and its convolutions much slower. So a CPU program
  runs on the XLA backend unless it has a convolution of CONVOLUTION multiply-adds per
  device or more (ResNet50: 2.6x slower under XLA), or its dots do DOT_PER_OP
  multiply-adds or more per op of the program (FFN train steps of width 64 to 512:
  4.4e5 to 2.9e7, 1.4-2.1x slower under XLA; a Transformer LM's forward and training
  steps: 6.7e4 to 2.1e5, 1.0-1.7x faster).

Multiply-adds are counted from the op contracts (registry.multiply_adds), loop bodies
included (once each). The choice is logged (logger "gspmd_tf", INFO) with its reason;
`choose` gives it without compiling. Either choice keeps TF's values where XLA's kernels
differ (the XLA backend runs those ops op by op), so choosing XLA changes rounding only.
backend="local" or "xla" (or GSPMD_TF_BACKEND) fixes the backend.
"""

from __future__ import annotations

import logging
from typing import Optional

from gspmd_tf import registry
from gspmd_tf.backends import base
from gspmd_tf.backends.local import LocalBackend
from gspmd_tf.backends.xla import XlaBackend
from gspmd_tf.graph.ir import Graph

log = logging.getLogger("gspmd_tf")

# The thresholds of the module docstring, in multiply-adds per device. CONVOLUTION lies
# below ResNet50's convolutions at 64x64 pixels and 2 images per device (up to 1.9e7);
# it was not calibrated further. DOT_PER_OP is about the geometric middle between the
# LM's 2.1e5 and the FFN's 4.4e5 (RESULTS §14.11).
CONVOLUTION = 2 ** 20
DOT_PER_OP = 2 ** 18


def choose(mesh, program: Optional[Graph]) -> tuple:
    """(backend class, reason in words) AutoBackend runs `program` (an SPMD program,
    local shapes) with on `mesh`."""
    if not mesh.is_fully_addressable:
        return LocalBackend, "the mesh spans several workers (the XLA backend runs meshes " \
                             "of one process)"
    kinds = base.mesh_device_kinds(mesh)
    if kinds != {"CPU"}:
        return XlaBackend, f"the mesh's {'/'.join(sorted(kinds - {'CPU'}))} devices run " \
                           "XLA-compiled segments"
    counts = [(node, base.node_multiply_adds(graph, node))
              for graph, node in base.nodes_with_graphs(program)]
    convolutions = [node for node, count in counts if count >= CONVOLUTION and
                    registry.has_trait(node.op, registry.CONVOLUTION)]
    if convolutions:
        node = convolutions[0]
        return LocalBackend, (
            f"{len(convolutions)} convolutions of {CONVOLUTION:,} multiply-adds per device "
            f"or more (e.g. {node.name}, {node.op}) run faster on TF's CPU kernels than "
            "under XLA:CPU")
    per_op = sum(count for _, count in counts) / max(len(counts), 1)
    if per_op >= DOT_PER_OP:
        return LocalBackend, (
            f"its dots do {per_op:,.0f} multiply-adds per op of the program (from "
            f"{DOT_PER_OP:,} TF's CPU kernels are faster than XLA:CPU's)")
    return XlaBackend, (
        f"its dots do {per_op:,.0f} multiply-adds per op of the program, fewer than "
        f"{DOT_PER_OP:,}: compiled segments save more dispatch than XLA:CPU's dots cost")


def for_platform(mesh, collective_timeout: Optional[float] = None) -> base.Backend:
    """The default backend of `mesh` (module docstring): an XlaBackend on a mesh of this
    process's accelerators, else a LocalBackend. `collective_timeout` as for both."""
    if mesh.is_fully_addressable and base.mesh_device_kinds(mesh) != {"CPU"}:
        return XlaBackend(mesh, collective_timeout)
    return LocalBackend(mesh, collective_timeout)


class AutoBackend(base.Backend):
    """Compiles each program with XlaBackend or LocalBackend, as `choose` says (module
    docstring). `collective_timeout` as for LocalBackend."""

    def __init__(self, mesh, collective_timeout=None):
        super().__init__(mesh)
        self.collective_timeout = collective_timeout

    @property
    def capabilities(self) -> base.Capabilities:
        """Both backends' collectives (copies among this process's CPU devices); segments
        compiled, and XLA's rounding, where it picks the XLA backend."""
        return base.Capabilities(
            copy_collectives=True, several_workers=True, compiles_segments=True,
            device_kinds=frozenset(base.mesh_device_kinds(self.mesh)),
            native_reduce_scatter=False, semantics="xla")

    def compile(self, program: Graph, name: Optional[str] = None) -> base.Compiled:
        """The chosen backend's compile(program, name)."""
        cls, reason = choose(self.mesh, program)
        log.info("gspmd_tf: %s runs on the %s: %s", name or "an SPMD program",
                 cls.__name__, reason)
        if cls is XlaBackend:  # the user did not ask for XLA: its fallbacks are no news
            backend = XlaBackend(self.mesh, self.collective_timeout, fallback_level=logging.INFO)
        else:
            backend = cls(self.mesh, self.collective_timeout)
        return backend.compile(program, name)
