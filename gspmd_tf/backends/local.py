"""LocalBackend: runs an SPMD program on the devices of this process (and, on a cluster,
each worker its own) op by op on TF's kernels, with TF collectives.

One tf.function holds the whole program for every device of this process: each node is
emitted once per device (emitter.DeviceEmitter), gt.* collectives become TF collective
ops or copies (collective_emitters.py), control-flow ops TF functions built from their
regions (region_emitter.py), and TF's multi-device function runtime runs the per-device
parts concurrently. CompiledProgram is that function, called with per-device shards.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Optional

import tensorflow as tf
from tensorflow.python.eager import context, execute
from tensorflow.python.eager.polymorphic_function import attributes as function_attributes
from tensorflow.python.ops import handle_data_util

from gspmd_tf.backends import base, collectives, schedule
from gspmd_tf.backends.emitter import DeviceEmitter
from gspmd_tf.backends.replicas import copy_owners
from gspmd_tf.backends.tf_kernels import call_attrs
from gspmd_tf.cost_model import CostModel
from gspmd_tf.errors import ShardingError
from gspmd_tf.gc_pause import gc_paused
from gspmd_tf.graph.ir import Graph, walk
from gspmd_tf.timeouts import check_timeout, default_timeout


@dataclass(frozen=True)
class EmissionSettings:
    """How the per-device program is emitted and run: the options of LocalBackend (its
    docstring), which the XLA backend shares. `checked` validates them."""

    collective_timeout: float
    async_collectives: bool = False
    copy_collectives: bool = True
    replicated_once: bool = True

    @classmethod
    def checked(cls, collective_timeout=None, async_collectives=False,
                copy_collectives=True, replicated_once=True):
        """The settings, the timeout defaulted (timeouts.default_timeout) and checked."""
        return cls(default_timeout() if collective_timeout is None
                   else check_timeout(collective_timeout), bool(async_collectives),
                   bool(copy_collectives), bool(replicated_once))


class LocalBackend(base.Backend):
    """Runs SPMD programs on the mesh's devices in this process.

    `collective_timeout` (seconds; 0 means none) bounds every call of a compiled program;
    it defaults to the GSPMD_TF_COLLECTIVE_TIMEOUT environment variable, else
    DEFAULT_TIMEOUT. A call past it is cancelled and raises DeadlineExceededError naming
    the program; later calls, of this program or any other, run normally (see
    collectives.Watchdog).

    `async_collectives`: emit the program in the order of estimated start times
    (schedule.ready_order), so that each device's chain of collectives follows when
    their operands are ready rather than program order; False keeps program order.

    `copy_collectives` (default True): a collective whose group is CPU devices of this
    process, outside control-flow bodies, is made of cross-device reads (TF passes the
    buffer between CPU devices of one process) instead of TF's collective ops: an
    all-reduce sums once per group (AddN) and the other members read the sum, a
    reduce-scatter sums each member's chunk on that member, gathers and all-to-alls
    concatenate what the members read. False keeps TF's collective ops (CollectiveReduceV2
    and friends, TF's ring implementation on CPU) everywhere.

    `replicated_once` (default True): a pure op whose value several CPU devices of this
    process hold equal (a replicated tensor, e.g. a data-parallel optimizer update) runs
    on the first of them only; the others read its result (see replicas.py). False runs
    every op on every device.
    """

    def __init__(self, mesh, collective_timeout=None, async_collectives=False,
                 copy_collectives=True, replicated_once=True):
        super().__init__(mesh)
        self.settings = EmissionSettings.checked(collective_timeout, async_collectives,
                                                 copy_collectives, replicated_once)

    def compile(self, program: Graph, name: Optional[str] = None) -> "CompiledProgram":
        """Traces `program` into one tf.function; returns its CompiledProgram, called
        as run(inputs) -> outputs.

        inputs[i][d]: shard of program input i for device id d (tensors or arrays; only
        those of this process's devices, mesh.addressable_ids, are read);
        outputs[j][d]: shard of program.outputs[j] (None on other workers' devices),
        held in device d's memory (its
        `backing_device`; TF labels every output of a function call with the call's device
        in `.device`). `name` names the program in errors.
        Calls of one compiled program (and of programs with the same fingerprint, which
        share its collective instance keys; see collectives.ProgramKeys) are serialized:
        the keys are fixed at trace time and concurrent calls would mix them up. A
        GradientTape does not record the call.
        """
        settings = self.settings
        order = (functools.partial(schedule.ready_order, model=self.cost_model)
                 if settings.async_collectives else schedule.program_order)
        return CompiledProgram(self.mesh, program, settings.collective_timeout, name, order,
                               settings.copy_collectives, settings.replicated_once)

    @property
    def capabilities(self) -> base.Capabilities:
        """Op by op on TF's kernels, any worker's devices; collectives among this
        process's CPU devices are copies with copy_collectives, a reduce-scatter among
        them a true one (each member sums its chunk): native_reduce_scatter there."""
        native = base.collectives_are_copies(self.mesh, self.settings.copy_collectives)
        return base.Capabilities(
            copy_collectives=self.settings.copy_collectives, several_workers=True,
            compiles_segments=False, device_kinds=frozenset(base.mesh_device_kinds(self.mesh)),
            native_reduce_scatter=native, semantics="tf",
            cost_model=CostModel.for_mesh(self.mesh, native_reduce_scatter=native))


class CompiledProgram(base.Compiled):
    """A program traced into one TF function (the DeviceEmitter's per-device graph),
    traced again when its collective group keys were retired (after a cancelled call).
    The local and the XLA backends' Compiled: the XLA backend composes it with a segment
    compiler."""

    def __init__(self, mesh, program, timeout, name, order=None, copy_collectives=False,
                 replicated_once=False, segment_compiler=None):
        """`order`: program -> node indices in emission order (schedule.py; default
        program order); `copy_collectives` and `replicated_once` as LocalBackend's;
        `segment_compiler`: None (every node op by op) or a factory
        (mesh, program, name, replicated_once) -> segment plan (xla.SegmentPlan), made
        once, whose plan the emitter follows (`plan`)."""
        self.mesh = mesh
        self.segment_compiler = segment_compiler
        self.plan = None
        self.copy_collectives = copy_collectives
        self.replicated_once = replicated_once
        self.program = program
        self.order = order or schedule.program_order
        self.timeout = timeout
        self.inputs = base.program_inputs(program)
        if not mesh.addressable_ids:
            raise ShardingError(
                f"{name or 'an SPMD program'}: mesh {mesh!r} has no device of this worker; "
                "every worker of the cluster must hold devices of the meshes it runs")
        self.local = mesh.addressable_ids
        self.cpu_only = all(tf.DeviceSpec.from_string(mesh.devices[d]).device_type == "CPU"
                            for d in self.local)
        # given[k]: the devices whose shard of input k the function takes; copy_of[k][i]:
        # the one whose shard the i-th local device reads (see _trace)
        self.given, self.copy_of = [], []
        self.keys = collectives.ProgramKeys(program)
        self.lock = self.keys.lock
        self.what = name or "an SPMD program"
        self._trace()

    def _lowering(self):
        """The DeviceEmitter that emits the program (with the segment plan, made on the
        first trace and kept when traced again)."""
        if self.segment_compiler is not None and self.plan is None:
            self.plan = self.segment_compiler(self.mesh, self.program, self.what,
                                              self.replicated_once)
        return DeviceEmitter(self.mesh, self.keys, order=self.order,
                             copy_collectives=self.copy_collectives,
                             replicated_once=self.replicated_once, segments=self.plan)

    def _trace(self):
        lowering = self._lowering()
        lowering.prepare(self.program)
        self.generation = collectives.generation()
        self.shares_variable_copies = lowering.variable_writes is not None
        self._arguments()
        # a variable's handle is a scalar, whatever the shape of the value it holds
        specs = [tf.TensorSpec(() if node.out_dtypes[0] == tf.resource
                               else node.out_shapes[0], node.out_dtypes[0])
                 for node, given in zip(self.inputs, self.given) for _ in given]

        def spmd_program(*flat):
            full, start = [], 0  # input-major, every local device
            for node, given, copy_of in zip(self.inputs, self.given, self.copy_of):
                args = flat[start:start + len(given)]
                start += len(given)
                if "var_dtype" in node.params:
                    # a handle argument says which variable it holds, as a captured
                    # one does: the shape functions of ResourceScatterNd* read it
                    data = handle_data_util.create_handle_data(
                        tf.TensorShape(node.out_shapes[0]), node.params["var_dtype"])
                    for handle in args:
                        handle_data_util.set_handle_data(handle, data)
                full.extend(args[i] for i in copy_of)
            return lowering.lower(self.program, full)
        # TF's errors name the function: __inference_<this name>_N
        spmd_program.__name__ = re.sub(r"\W+", "_", self.what).strip("_")
        # A lowering that orders the program's state itself needs no automatic control
        # dependencies (ordering.py: ACD was a quarter of building the graph).
        attributes = {function_attributes.DISABLE_ACD: True} if lowering.orders_state else None
        fn = tf.function(spmd_program, autograph=False, experimental_attributes=attributes)
        with gc_paused():
            concrete = fn.get_concrete_function(*specs)
        # Calling the traced function directly skips ConcreteFunction's argument binding
        # (about 0.9 ms of Python for 8 shards); the captures are the ordering tokens.
        self.function = concrete.inference_fn
        self.captures = list(concrete.captured_inputs)
        self.num_outputs = len(concrete.inference_fn.function_type.flat_outputs)

    def _arguments(self):
        """Sets given and copy_of: a program that shares variable copies takes the
        handle of a shared copy once, from its owner (replicas.copy_owners), and hands
        it to each device of the class (MobileNetV2's data-parallel step on 8 devices:
        2,144 arguments, 2,144 - 7 x 266 now); every other input from every device."""
        self.given, self.copy_of = [], []
        for node in self.inputs:
            layout = node.params.get("layout")
            owners = (copy_owners(self.mesh, layout) if self.shares_variable_copies and
                      layout is not None and node.out_dtypes[0] == tf.resource
                      else range(self.mesh.size))
            given = [d for d in self.local if owners[d] == d]
            index = {d: i for i, d in enumerate(given)}
            self.given.append(given)
            self.copy_of.append([index[owners[d]] for d in self.local])

    def collective_keys(self):
        """[(node name, op, instance key, group keys)] of the program's keyed collectives,
        in program order: the keys its next call runs with (group keys: one per group of
        mesh.groups(axes), sorted; a group of one device runs no collective)."""
        out = []
        for node in walk(self.program):
            if node.op not in collectives.KEYED:
                continue
            rows = self.mesh.groups(tuple(node.params["axes"]))
            groups = () if rows.shape[1] == 1 else tuple(sorted(
                collectives.group_key([self.mesh.devices[d] for d in row]) for row in rows))
            out.append((node.name, node.op, self.keys.instance_key(node.name), groups))
        return out

    def __call__(self, shards):
        n = self.mesh.size
        if len(shards) != len(self.inputs) or any(len(s) != n for s in shards):
            raise ValueError(
                f"expected {len(self.inputs)} inputs with {n} shards each, got "
                f"{[len(s) for s in shards]}")
        flat = [x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x, node.out_dtypes[0])
                for s, node, given in zip(shards, self.inputs, self.given)
                for x in (s[d] for d in given)]
        with self.lock:
            if self.generation != collectives.generation():
                self._trace()
            with collectives.watchdog.guard(self.timeout, self.what) as call:
                try:
                    outs = self._execute(flat + self.captures, call)
                except tf.errors.OpError as e:
                    if call is not None and call.timed_out:
                        raise call.timeout_error() from None
                    lost = call and call.peer_lost_error(e)
                    if lost is not None:
                        raise lost from e
                    e.add_note(f"while running {self.what}")
                    raise
        k = len(self.local)
        results = []
        for j in range(len(self.program.outputs)):
            shards = [None] * n
            for d, out in zip(self.local, outs[j * k:(j + 1) * k]):
                shards[d] = out
            results.append(shards)
        return results

    def _execute(self, inputs, call):
        """Runs the traced function, under the call's CancellationManager if guarded."""
        ctx = context.context()
        name = self.function.name.decode()
        attrs = call_attrs(ctx.function_call_options, self.cpu_only)
        if call is None:
            return execute.execute(name, self.num_outputs, inputs, attrs, ctx)
        return execute.execute_with_cancellation(name, self.num_outputs, inputs, attrs, ctx,
                                                 call.manager)
