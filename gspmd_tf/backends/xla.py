"""XlaBackend: the per-device program's compute compiled by XLA, collectives through TF.

The program is cut into collective-free segments (segments.py). Each segment becomes one
tf.function(jit_compile=True), traced once and shared by every device and by every
segment with the same structure (identical layers of a model compile once); TF's XLA
bridge compiles it on its first call on a device, and on CPU the segments of every
logical device run on the first one (_compile_device), so it compiles once. One outer
tf.function holds, per device, the calls of the segments and the nodes between them,
which are emitted op by op as in LocalBackend: collectives (copies between this
process's CPU devices, else TF's collective ops with their ordering tokens and keys),
gt.Permute, control flow, variable reads, and what XLA cannot compile. With
replicated_once (as LocalBackend's) a segment whose outputs several CPU devices hold
equal is called once for them, the others read its results; the optimizer arithmetic
on replicated weights is cut into such segments (segments.cut's `shared`).
Variable writes are compiled, in update segments (segments.py) that take the handles of
the variables they write as arguments and run on the variables' device (TF touches a
variable only on its own device), so an update segment compiles once per device; with
replicated_once, an update segment left with writes only runs op by op instead. The outer
graph has about (segments + collectives) x devices nodes instead of (all nodes) x
devices.

When the program is traced every distinct segment goes through TF's XLA bridge
(experimental_get_compiler_ir); a node the bridge rejects (no XLA kernel, an argument
that must be a compile-time constant but depends on the shard index, ...) is taken out
of its segment and run op by op, with a warning naming it, and the program is cut again.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Optional

import tensorflow as tf
from tensorflow.python.framework import ops

from gspmd_tf.backends import base, ordering, segments
from gspmd_tf.backends.emitter import cpu_replica_classes
from gspmd_tf.backends.local import CompiledProgram, EmissionSettings
from gspmd_tf.backends.tf_kernels import set_shapes, tf_op_emitter
from gspmd_tf.cost_model import (XLA_CPU_CONVOLUTION_MULTIPLY_ADDS_PER_SECOND,
                                 XLA_CPU_MULTIPLY_ADDS_PER_SECOND, XLA_SEGMENT_KERNEL_SECONDS,
                                 CostModel)
from gspmd_tf.errors import ShardingError
from gspmd_tf.registry import ASSIGNS_VARIABLE, READS_VARIABLE, has_trait, xla_form
from gspmd_tf.graph.ir import Graph, Ref

log = logging.getLogger("gspmd_tf")

# segment key -> _SegmentFunction, for the process: programs that share a segment's
# structure (the same model lowered again, a different step of it) share its function,
# and so TF's XLA compilation cache entry on each device.
_functions = {}
_functions_lock = threading.Lock()


class XlaBackend(base.Backend):
    """Runs SPMD programs on the mesh's devices in this process, the compute between
    collectives compiled by XLA (one compilation per distinct segment; on devices other
    than CPUs one per device): LocalBackend's CompiledProgram composed with a
    SegmentPlan.

    `collective_timeout`, `copy_collectives` and `replicated_once` as for LocalBackend
    (collectives of this process's CPU devices as cross-device reads; a value several
    CPU devices hold equal computed once: the op-by-op nodes as there, and a segment
    writing no variable is called once for the devices whose outputs of it are equal).
    `tf_dots_from`: when set, dot-like ops (matmuls, einsums, 2-D convolutions and their
    gradients) of at least this many multiply-adds run op by op on TF's kernels instead
    of in the segments. `fallback_level`: the logging level of the messages naming the
    ops that run op by op (WARNING; AutoBackend, which chose XLA for the user, INFO).
    `async_collectives` is LocalBackend's: refused here, the segment plan orders the
    collectives.
    """

    def __init__(self, mesh, collective_timeout=None, tf_dots_from=None,
                 async_collectives=False, copy_collectives=True, replicated_once=True,
                 fallback_level=logging.WARNING):
        super().__init__(mesh)
        self.settings = EmissionSettings.checked(collective_timeout, async_collectives,
                                                 copy_collectives, replicated_once)
        self.tf_dots_from = tf_dots_from
        self.fallback_level = fallback_level

    @property
    def capabilities(self) -> base.Capabilities:
        """Compiled segments, this process's devices only; XLA's rounding, TF's values
        where XLA's kernels differ (those ops run op by op)."""
        native = base.collectives_are_copies(self.mesh, self.settings.copy_collectives)
        return base.Capabilities(
            copy_collectives=self.settings.copy_collectives, several_workers=False,
            compiles_segments=True, device_kinds=frozenset(base.mesh_device_kinds(self.mesh)),
            native_reduce_scatter=native, semantics="xla",
            cost_model=xla_cost_model(self.mesh, native))

    def compile(self, program: Graph, name: Optional[str] = None) -> CompiledProgram:
        """The CompiledProgram of `program` (as LocalBackend.compile), following a
        SegmentPlan (its `plan`)."""
        if not self.mesh.is_fully_addressable:
            raise ShardingError(
                f"backend='xla' runs meshes of one process; {self.mesh!r} spans several "
                "workers: use backend='local' (or the default) there")
        if self.settings.async_collectives:
            raise ShardingError("async_collectives applies to LocalBackend: the XLA "
                                "backend's segment plan orders its collectives")
        plan = functools.partial(SegmentPlan, tf_dots_from=self.tf_dots_from,
                                 fallback_level=self.fallback_level)
        return CompiledProgram(self.mesh, program, self.settings.collective_timeout, name,
                               copy_collectives=self.settings.copy_collectives,
                               replicated_once=self.settings.replicated_once,
                               segment_compiler=plan)


def xla_cost_model(mesh, native_reduce_scatter: bool) -> CostModel:
    """The XLA backend's CostModel of `mesh`: its links, `native_reduce_scatter`, and
    XLA:CPU's compiled segments' compute (cost_model.py: slower dots and convolutions
    than TF's kernels, no kernel launch per op)."""
    return CostModel.for_mesh(
        mesh, native_reduce_scatter=native_reduce_scatter,
        multiply_adds_per_second=XLA_CPU_MULTIPLY_ADDS_PER_SECOND,
        convolution_multiply_adds_per_second=XLA_CPU_CONVOLUTION_MULTIPLY_ADDS_PER_SECOND,
        kernel_seconds=XLA_SEGMENT_KERNEL_SECONDS)


class SegmentPlan:
    """The XLA segment compiler of a program: its steps (segments.cut) after the compile
    check, each segment's function (`functions[k]` for the k-th Segment of `steps`) and,
    with `replicated_once`, the program's replica classes (cpu_replica_classes; else
    None). The ops that run op by op are logged at `fallback_level`. A DeviceEmitter
    composed with it emits the steps (lower)."""

    def __init__(self, mesh, program, what, replicated_once, tf_dots_from=None,
                 fallback_level=logging.WARNING):
        device_type = tf.DeviceSpec.from_string(mesh.devices[0]).device_type or "CPU"
        excluded = set() if tf_dots_from is None else \
            segments.large_dots(program, tf_dots_from)
        self.classes = cpu_replica_classes(program, mesh) if replicated_once else None
        # where each device's segments run (_compile_device)
        self.runs_on = [_compile_device(mesh.devices, d) for d in range(mesh.size)]
        # node -> its classes row, for the nodes some device reads from another
        shared = {i: row for i, row in enumerate(self.classes or ())
                  if any(s not in (None, d) for d, s in enumerate(row))}
        while True:
            self.steps = segments.cut(program, excluded, shared)
            self.functions = []
            rejected = set()
            for step in self.steps:
                if not isinstance(step, segments.Segment):
                    continue
                function = _segment_function(program, step, mesh.devices[0], device_type)
                self.functions.append(function)
                failed = function.check()
                if failed is not None:
                    positions, message = failed
                    for k in positions or range(len(step.nodes)):
                        node = program.nodes[step.nodes[k]]
                        log.log(fallback_level, "gspmd_tf: XLA cannot compile %s (%s) of "
                                "%s; it runs op by op: %s", node.name, node.op, what, message)
                        rejected.add(step.nodes[k])
            if not rejected:
                break
            excluded |= rejected
        reasons = {}
        for i in self.steps:
            if isinstance(i, segments.Segment) or i in excluded:
                continue
            why = segments.why_not_compiled(program, program.nodes[i])
            if why and not program.nodes[i].op.startswith("gt.") and \
                    not _expected(program.nodes[i].op):
                reasons.setdefault((program.nodes[i].op, why), None)
        if reasons:
            log.log(fallback_level, "gspmd_tf: the XLA backend runs these ops of %s op by op: "
                    "%s", what, "; ".join(f"{op} ({why})" for op, why in reasons))

    def lower(self, emitter, program):
        """Emits the steps with DeviceEmitter `emitter` (bound to the arguments): each
        segment's calls, the other nodes op by op; returns the outputs, output-major."""
        values, op_of = {}, {}
        functions = iter(self.functions)
        chained = None  # the last op-by-op node on ACD's chain of stateful ops
        for step in self.steps:
            if isinstance(step, segments.Segment):
                self._emit_segment(emitter, program, step, next(functions), values, op_of)
                continue
            # ACD chains the stateful ops without resource inputs, but a control-flow
            # op whose bodies hold collectives takes its device's ordering token (a
            # resource) and left that chain: a loop printing in its body printed
            # before a tf.print the program runs ahead of it. The program order of
            # those nodes (kept by segments.cut) is made explicit.
            node = program.nodes[step]
            on_chain = ordering.stateful(node.op) and not any(
                program.dtype(ref) == tf.resource for ref in node.inputs)
            emitter.emit_node(program, step, values, op_of,
                              after=(chained,) if on_chain and chained is not None else ())
            if on_chain:
                chained = step
        # outputs live on their device: segments ran on runs_on, copies read in place
        return [emitter.held_on(values[ref.node][ref.out][d], d)
                for ref in program.outputs for d in emitter.local]

    def _emit_segment(self, emitter, program, segment, function, values, op_of):
        inside = set(segment.nodes)
        control = sorted({c for i in segment.nodes for c in program.nodes[i].control_inputs
                          if c not in inside})
        graph = ops.get_default_graph()
        n = emitter.mesh.size
        # a segment is pure but for its variable writes: called once for the devices
        # holding equal values of all its outputs, the others read the results
        sources = (range(n) if function.touches_variables else
                   emitter.common_sources(sorted({ref.node for ref in segment.outputs})))
        calls, results = [], []
        for d in range(n):
            if sources[d] != d:
                calls.append(calls[sources[d]])
                results.append(results[sources[d]])
                continue
            args = [values[ref.node][ref.out][d] for ref in segment.inputs]
            # TF touches a variable only on its own device
            runs_on = emitter.devices[d] if function.touches_variables else self.runs_on[d]
            with tf.device(runs_on), \
                    tf.control_dependencies([op_of[c][d] for c in control]):
                outs = function.concrete(*args)
            outs = list(outs) if outs is not None else []
            # the call op; with no outputs it is the op the call just added
            calls.append(outs[0].op if outs else graph.get_operations()[-1])
            results.append(outs)
        for k, ref in enumerate(segment.outputs):
            values.setdefault(ref.node, [None] * len(program.nodes[ref.node].out_dtypes))
            values[ref.node][ref.out] = [results[d][k] for d in range(n)]
        for i in segment.nodes:
            op_of[i] = calls



# Ops that run op by op by design (variable reads; writes reaching their variable
# through a resource Identity, see segments.why_not_compiled): no warning for them.
def _expected(op_type):
    """Whether ops of `op_type` run op by op by design (no warning for them): variable
    reads and writes, handles passed on, no-ops and constants."""
    return has_trait(op_type, ASSIGNS_VARIABLE) or has_trait(op_type, READS_VARIABLE) or \
        op_type in ("Identity", "NoOp", "Const")


def _segment_function(program, segment, device, device_type):
    key = segments.segment_key(program, segment, device_type)
    with _functions_lock:
        if key not in _functions:
            _functions[key] = _SegmentFunction(program, segment, device)
        return _functions[key]


class _SegmentFunction:
    """One segment as a tf.function(jit_compile=True) over its inputs, returning its
    outputs (segment.inputs / segment.outputs order), traced once."""

    def __init__(self, program, segment, device):
        # a variable's handle is a scalar; program.shape gives the variable's shape
        specs = [tf.TensorSpec(() if program.dtype(ref) == tf.resource else
                               program.shape(ref), program.dtype(ref))
                 for ref in segment.inputs]
        # (shape, dtype) of the variable behind each resource argument, else None
        self.variables = [_variable(program, segment, ref) for ref in segment.inputs]
        self.names = {}  # op name in the function graph -> position in the segment

        def gt_segment(*args):
            values = dict(zip(segment.inputs, args))
            op_of = {}
            for k, i in enumerate(segment.nodes):
                node = program.nodes[i]
                control = [op_of[c] for c in node.control_inputs if c in op_of]
                form = xla_form(node, program.dtype(node.inputs[0]) if node.inputs else None)
                with tf.control_dependencies(control):
                    result = tf_op_emitter(node, [device])(
                        0, [[values[r]] for r in node.inputs]) if form is None else \
                        form(node, [values[r] for r in node.inputs])
                op = result if isinstance(result, ops.Operation) else result.op
                outs = op.outputs if isinstance(result, ops.Operation) else [result]
                set_shapes(node, outs)
                values.update((Ref(i, out), t) for out, t in enumerate(outs))
                op_of[i] = op
                self.names[op.name] = k
            return [values[ref] for ref in segment.outputs]
        self.function = tf.function(gt_segment, jit_compile=True, autograph=False,
                                    input_signature=specs)
        self.concrete = self.function.get_concrete_function()
        self.specs = specs
        self.checked = False
        self.failure = None

    @property
    def touches_variables(self):
        """Whether the segment writes variables (takes their handles as arguments)."""
        return any(self.variables)

    def check(self):
        """None when TF's XLA bridge takes the segment, else (positions of the nodes it
        names, or [] for the whole segment; its message's first line). Checked once."""
        if not self.checked:
            self.checked = True
            try:
                with tf.init_scope():  # eagerly, also while the outer function traces
                    stand_ins = self._check_args()
                    self.function.experimental_get_compiler_ir(
                        *[getattr(x, "handle", x) for x in stand_ins])(stage="hlo")
            except (ValueError, tf.errors.OpError) as e:
                text = str(e)
                named = re.findall(r"node `([^`]+)`|\{\{node ([^}]+)\}\}", text)
                positions = sorted({self.names[name] for pair in named for name in pair
                                    if name in self.names})
                lines = [line for line in text.splitlines() if line.strip()]
                self.failure = (positions, lines[0][:300] if lines else type(e).__name__)
        return self.failure

    def _check_args(self):
        """What the bridge checks the segment with: its TensorSpecs, or, when it touches
        variables, stand-in tensors and variables (the bridge takes all specs or all
        tensors, and crashes on a resource spec). Given tensors, the bridge would take
        an argument that must be a compile-time constant as one (XLA then compiles per
        value when it runs), so a segment with variables does not reject those."""
        if not self.touches_variables:
            return self.specs
        return [tf.Variable(tf.zeros(*variable), trainable=False)
                if variable else tf.zeros(spec.shape, spec.dtype)
                for spec, variable in zip(self.specs, self.variables)]


def _variable(program, segment, ref):
    """(shape, dtype) of the variable whose handle `ref` is, from the first variable
    write of `segment` on it; None when `ref` is no handle."""
    if program.dtype(ref) != tf.resource:
        return None
    for i in segment.nodes:
        node = program.nodes[i]
        if has_trait(node.op, ASSIGNS_VARIABLE) and node.inputs[0] == ref:
            return program.shape(ref), tf.dtypes.as_dtype(node.attrs["dtype"].type)
    raise AssertionError(f"segment argument {ref} is a resource no variable write takes")


def _compile_device(devices, d):
    """Where device d's segments run: on CPU, the first CPU device of the mesh in d's
    process, so that one XLA compilation serves every logical CPU device (TF keeps its
    XLA compilation cache per device); elsewhere device d itself.

    Logical CPU devices share the host's memory and cores, so a segment of device d run
    there reads d's tensors in place (TF passes host tensors between the devices of a
    process without copying) and the launches of all devices still run concurrently.
    """
    spec = tf.DeviceSpec.from_string(devices[d])
    if (spec.device_type or "").upper() != "CPU":
        return devices[d]
    for name in devices:
        other = tf.DeviceSpec.from_string(name)
        if (other.device_type or "").upper() == "CPU" and (other.job, other.replica,
                                                            other.task) == (
                spec.job, spec.replica, spec.task):
            return name
    return devices[d]
