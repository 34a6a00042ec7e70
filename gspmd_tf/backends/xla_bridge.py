"""The XLA-bridge backend: the whole annotated global program, for XLA's SPMD partitioner.

The other backends run gspmd-tf's per-device SPMD program. This one (the TPU route)
compiles the GLOBAL program instead: the traced ops at global shapes, every tensor and
every reshard the partitioner made carrying its sharding as an XlaSharding annotation
(runtime/annotated.py derives it from the explicit-reshard program, the artifact the
per-device program is exported from). A tf.distribute strategy runs it as ONE replica:
under a TPUStrategy with XLA SPMD partitioning (gspmd_tf.tpu.connect), TF's TPU bridge
hands the annotations to XLA's partitioner, which partitions the program with our
decisions, and XLA compiles it whole. Global values go in and come out; XLA splits them.

The compiler takes what runtime/annotated.GlobalProgram offers (this module does not
import the runtime): `emit(*inputs)`, `written_variables()`, `num_outputs`,
`variable_values()`, `spmd` (gspmd-tf's own per-device program of it) and `as_text()`.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from gspmd_tf.backends.base import Backend, Capabilities, Compiled


class TPUNotFoundError(RuntimeError):
    """No TPU could be reached under the given name or address, or none was given."""


class XlaBridgeBackend(Backend):
    """Compiles a lowered program's annotated global program (runtime/annotated.
    GlobalProgram) to run under `strategy`, one replica over every core: a TPUStrategy
    with XLA SPMD partitioning (gspmd_tf.tpu.connect), or any strategy for the same code
    path without a TPU (TF's default one runs it on the host). Without a strategy the
    program compiles (as_text, cost_analysis) but a call is a TPUNotFoundError.

    The mesh may be abstract: its device ids are the replica's logical cores, which is
    what XLA's shardings name."""

    def __init__(self, mesh, strategy: Optional[tf.distribute.Strategy] = None):
        # not Backend.__init__: an abstract mesh is what a TPU replica's cores are
        self.mesh = mesh
        self.strategy = strategy

    @property
    def capabilities(self) -> Capabilities:
        """TPU cores, the whole program compiled by XLA (collectives XLA's own, a
        reduce-scatter one collective), one process driving the replica."""
        return Capabilities(copy_collectives=False, several_workers=False,
                            compiles_segments=False, device_kinds=frozenset({"TPU"}),
                            native_reduce_scatter=True, semantics="xla", whole_program=True)

    def compile(self, program, name: Optional[str] = None) -> "BridgeCompiled":
        """`program`: a runtime/annotated.GlobalProgram (capabilities.whole_program)."""
        return BridgeCompiled(program, self.strategy, name or program.name)


class BridgeCompiled(Compiled):
    """The annotated global program built for a strategy: called with the program's
    global arguments, returns its flat outputs (the strategy's values of its one
    replica). `program` is gspmd-tf's per-device SPMD program of it (what cost_analysis
    and memory count: XLA's partitioner is steered to the same partitioning);
    `global_program` what runs; as_text() prints the annotated graph.

    Captured gt.Variables become variables of the strategy (`variables`, in capture
    order), initialized from their global values; the gt.Variables are not changed
    (copy back with gt_variable.assign_global(v.numpy())). Each step reads them, runs
    the graph on their values (the values carry the variables' shardings, so XLA
    computes on shards) and assigns the ones the program writes. TPUStrategy keeps a
    whole copy of every variable on each core, so XLA gathers each written variable's
    update once per step."""

    def __init__(self, global_program, strategy, name):
        self.program = global_program.spmd
        self.global_program = global_program
        self.name = name
        self.variables = []
        self._run = None
        if strategy is not None:
            with strategy.scope():
                self.variables = [tf.Variable(value, name=f"tpu_{k}")
                                  for k, value in enumerate(global_program.variable_values())]
            self._run = self._replica_function(strategy)

    def _replica_function(self, strategy):
        """The tf.function running one step of the program as the strategy's replica."""
        program, variables = self.global_program, self.variables
        written = program.written_variables()

        def step(*args):
            results = program.emit(*args, *[v.read_value() for v in variables])
            updates = [variables[k].assign(results[program.num_outputs + k])
                       for k in written]
            with tf.control_dependencies(updates):
                return [tf.identity(t) for t in results[:program.num_outputs]]

        @tf.function(autograph=False)
        def run(*args):
            return strategy.run(step, args=args)
        return run

    def __call__(self, *args):
        """The program's flat outputs from its global arguments `args`."""
        if self._run is None:
            raise TPUNotFoundError(
                f"{self.name or 'the program'} was compiled for XLA's bridge without a "
                "strategy to run it: connect to a TPU with gspmd_tf.tpu.connect(name) "
                "and run system.program(lowered) (as_text() and cost_analysis() work "
                "without one)")
        return self._run(*args)

    def as_text(self) -> str:
        """The annotated global graph, one TF op a line (runtime/annotated.py)."""
        return self.global_program.as_text()
