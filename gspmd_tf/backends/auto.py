"""AutoBackend (backend="auto", opt-in): per program, the XLA backend where it applies by
a multiply-add heuristic, else the local backend; and the default backend, chosen by
platform (for_platform).

The default (for_platform), as JAX chooses by platform: the XLA backend on accelerator
meshes of this process, the local backend (every op on TF's kernels) on CPU meshes and
on meshes spanning several workers. It never changes numerics behind the user's back:
on CPUs the values are TF's kernels'; the XLA backend runs every op whose XLA values
differ from TF's (registry.xla_numerics_differ) on TF's kernels.

AutoBackend's choice, for users who opt in, reads the one cost model (cost_model.py):

- a mesh of this process's devices (the XLA backend runs no mesh spanning workers);
- on accelerators, always: XLA is the compiler TF's GPU and TPU paths are built around,
  and a GPU pays per kernel launch what compiling removes (not measured here: no GPU);
- on CPUs, the backend whose cost model (Backend.cost_model) gives the program fewer
  seconds per device (base.program_seconds: every node's compute, collectives' latency
  and bytes, loop bodies counted once each). TF's kernels launch a kernel per op
  (dispatch on every logical device); XLA:CPU's segments launch none per op but run
  dots 1.5x and convolutions 2.6x slower than TF's oneDNN kernels (RESULTS §14.9,
  §14.11). So programs of many cheap ops compile (the Transformer LM, <= 2.1e5
  multiply-adds per op: 1.0-1.7x faster under XLA) and programs whose dots or
  convolutions outweigh their dispatch stay on TF's kernels (FFN train steps of width
  64 to 512, 4.4e5 to 2.9e7 per op: 1.4-2.1x slower under XLA; ResNet50: 2.6x): for
  dots alone the crossover is 2.4e5 multiply-adds per op (cost_model.py).

The choice is logged (logger "gspmd_tf", INFO) with both estimates; `choose` gives it
without compiling. Either choice keeps TF's values where XLA's kernels differ (the XLA
backend runs those ops op by op), so choosing XLA changes rounding only.
backend="local" or "xla" (or GSPMD_TF_BACKEND) fixes the backend.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional

from gspmd_tf.backends import base
from gspmd_tf.backends.local import LocalBackend
from gspmd_tf.backends.xla import XlaBackend
from gspmd_tf.cost_model import CostModel
from gspmd_tf.graph.ir import Graph

log = logging.getLogger("gspmd_tf")


def choose(mesh, program: Optional[Graph],
           models: Optional[Mapping[type, CostModel]] = None) -> tuple:
    """(backend class, reason in words) AutoBackend runs `program` (an SPMD program,
    local shapes) with on `mesh` (module docstring). `models`: the CostModel of each of
    LocalBackend and XlaBackend (default: their cost_model on `mesh`)."""
    if not mesh.is_fully_addressable:
        return LocalBackend, "the mesh spans several workers (the XLA backend runs meshes " \
                             "of one process)"
    kinds = base.mesh_device_kinds(mesh)
    if kinds != {"CPU"}:
        return XlaBackend, f"the mesh's {'/'.join(sorted(kinds - {'CPU'}))} devices run " \
                           "XLA-compiled segments"
    models = models or {cls: cls(mesh).cost_model for cls in (LocalBackend, XlaBackend)}
    local = base.program_seconds(program, models[LocalBackend])
    compiled = base.program_seconds(program, models[XlaBackend])
    estimates = (f"its cost model estimates {compiled * 1e3:.3g} ms per device under "
                 f"XLA:CPU, {local * 1e3:.3g} ms on TF's kernels")
    if compiled < local:
        return XlaBackend, f"{estimates}: compiled segments save more kernel launches " \
                           "than XLA:CPU's dots and convolutions cost"
    return LocalBackend, f"{estimates}: TF's CPU kernels run its dots and convolutions " \
                         "faster than compiling saves"


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
        compiled, and XLA's rounding, where it picks the XLA backend. Its programs are
        partitioned on the local backend's cost model (the two share collectives)."""
        local = LocalBackend(self.mesh, self.collective_timeout).capabilities
        return base.Capabilities(
            copy_collectives=True, several_workers=True, compiles_segments=True,
            device_kinds=frozenset(base.mesh_device_kinds(self.mesh)),
            native_reduce_scatter=local.native_reduce_scatter, semantics="xla",
            cost_model=local.cost_model)

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
