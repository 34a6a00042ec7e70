"""LocalBackend: runs an SPMD program on the devices of this process with TF collectives.

One tf.function holds the whole program for every device: each node is emitted once per
device under tf.device, gt.* collectives become TF collective ops (see collectives.py),
gt.Permute becomes point-to-point copies, and TF's multi-device function runtime runs the
per-device parts concurrently. A control-flow op (a node with regions) is re-created on
each device with TF functions built from its regions (SPMD sub-programs, collectives
included: see _Lowering._region_op).
"""

from __future__ import annotations

import functools
import os
import re

import tensorflow as tf
from tensorflow.python.eager import context, execute
from tensorflow.python.eager.polymorphic_function import attributes as function_attributes
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util_v2

from gspmd_tf import cluster
from gspmd_tf.backends import base, collectives, ordering, replicas, schedule
from gspmd_tf.errors import ShardingError
from gspmd_tf.gc_pause import gc_paused
from gspmd_tf.graph.ir import REGION_OPS, walk


# Generous: a call that waits this long is hung, not slow, on the meshes of one host.
DEFAULT_TIMEOUT = 300.0


def default_timeout():
    """GSPMD_TF_COLLECTIVE_TIMEOUT (seconds) when set, else DEFAULT_TIMEOUT."""
    text = os.environ.get("GSPMD_TF_COLLECTIVE_TIMEOUT")
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        return check_timeout(float(text))
    except ValueError:
        raise ValueError(f"GSPMD_TF_COLLECTIVE_TIMEOUT={text!r}: give a number of seconds "
                         "(0 for no limit)") from None


def check_timeout(seconds):
    """`seconds` as a float; ValueError unless it is a finite number >= 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"collective_timeout={seconds!r}: give a finite number of seconds "
                         ">= 0 (0 for no limit)")
    return float(seconds)


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
        self.collective_timeout = (default_timeout() if collective_timeout is None
                                   else check_timeout(collective_timeout))
        self.async_collectives = bool(async_collectives)
        self.copy_collectives = bool(copy_collectives)
        self.replicated_once = bool(replicated_once)

    def compile(self, program, name=None):
        """Traces `program` into one tf.function; returns run(inputs) -> outputs.

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
        order = schedule.ready_order if self.async_collectives else schedule.program_order
        return _Compiled(self.mesh, program, self.collective_timeout, name, order,
                         self.copy_collectives, self.replicated_once)

    def all_reduce_combine_bytes(self, in_region):
        """0 (no combining) for the top-level all-reduces when every one of them is
        copies (copy_collectives, every device of the mesh a CPU of this process): a
        copy all-reduce is one AddN with no fixed cost to amortise, and combining only
        adds a flatten, a concat, a split and a reshape per member (benchmarks/
        RESULTS.md §14.10). TF's collectives (bodies, other devices, several workers)
        keep the combiner's default."""
        if in_region or not self.copy_collectives or not self.mesh.is_fully_addressable:
            return None
        if all(_on_cpu(name) for name in self.mesh.devices):
            return 0
        return None


class _Compiled:
    """A program traced into one TF function, traced again when its collective group
    keys were retired (after a cancelled call)."""

    def __init__(self, mesh, program, timeout, name, order=None, copy_collectives=False,
                 replicated_once=False):
        """`order`: program -> node indices in emission order (schedule.py; default
        program order); `copy_collectives` and `replicated_once` as LocalBackend's."""
        self.mesh = mesh
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
        # a variable's handle is a scalar, whatever the shape of the value it holds
        self.specs = [tf.TensorSpec(() if node.out_dtypes[0] == tf.resource
                                    else node.out_shapes[0], node.out_dtypes[0])
                      for node in self.inputs for _ in self.local]
        self.keys = collectives.ProgramKeys(program)
        self.lock = self.keys.lock
        self.what = name or "an SPMD program"
        self._trace()

    def _lowering(self):
        """The lowering that emits the program."""
        return _Lowering(self.mesh, self.keys, order=self.order,
                         copy_collectives=self.copy_collectives,
                         replicated_once=self.replicated_once)

    def _trace(self):
        lowering = self._lowering()
        self.generation = collectives.generation()

        def spmd_program(*flat):
            return lowering.lower(self.program, flat)
        # TF's errors name the function: __inference_<this name>_N
        spmd_program.__name__ = re.sub(r"\W+", "_", self.what).strip("_")
        # A lowering that orders the program's state itself needs no automatic control
        # dependencies (ordering.py: ACD was a quarter of building the graph).
        attributes = {function_attributes.DISABLE_ACD: True} if lowering.orders_state else None
        fn = tf.function(spmd_program, autograph=False, experimental_attributes=attributes)
        with gc_paused():
            concrete = fn.get_concrete_function(*self.specs)
        # Calling the traced function directly skips ConcreteFunction's argument binding
        # (about 0.9 ms of Python for 8 shards); the captures are the ordering tokens.
        self.function = concrete.inference_fn
        self.captures = list(concrete.captured_inputs)
        self.num_outputs = len(concrete.inference_fn.function_type.flat_outputs)

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
        flat = [x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x, spec.dtype)
                for x, spec in zip((s[d] for s in shards for d in self.local), self.specs)]
        with self.lock:
            if self.generation != collectives.generation():
                self._trace()
            with collectives.watchdog.guard(self.timeout, self.what) as call:
                try:
                    outs = self._execute(flat + self.captures, call)
                except tf.errors.OpError as e:
                    if call is not None and call.timed_out:
                        raise call.timeout_error() from None
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
        attrs = _call_attrs(ctx.function_call_options, self.cpu_only)
        if call is None:
            return execute.execute(name, self.num_outputs, inputs, attrs, ctx)
        return execute.execute_with_cancellation(name, self.num_outputs, inputs, attrs, ctx,
                                                 call.manager)


def _call_attrs(options, cpu_only):
    """The function call attrs of `options` (the context's) with two grappler passes
    off, which rewrite the SPMD program wrongly:
    - the arithmetic optimizer: where annotations no longer separate the ops, it
      rewrites tf.maximum(x, tf.add_n([x, x])) into a wrong value (x where x > 0; fuzzer
      seed 24 #2965, seed 47 #129; a single-device tf.function of the same ops is wrong
      too) and ArgMax(Sign(x)) into ArgMax(x), another index where Sign ties (seed 21
      #165);
    - the remapper: it fuses add(c, matmul(a, b)) into one MatMul with c as its "bias"
      when c has the shape (1, ..., 1, N) and the product more than one element, and the
      fused kernel then refuses a c of rank 2 or more. Local shapes make that pattern
      where the global ones do not: a (1, 3) product plus a (1, 1, 1) runs on one
      device, its (1, 1) shards fail (seed 36 #2904; seed 31 #9463 fails on one device
      too). Off, the FFN train step and ResNet50's data-parallel step measured the same
      (benchmarks/RESULTS.md §6, "The eleventh run").
    With `cpu_only` (every device of the mesh a CPU) the grappler passes in
    _SLOW_ON_CPU are off too, where the context leaves them at TF's default."""
    key = (options.config_proto_serialized, options.executor_type or "", cpu_only)
    if key not in _CALL_ATTRS:
        config = config_pb2.ConfigProto.FromString(key[0])
        rewrites = config.graph_options.rewrite_options
        rewrites.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
        rewrites.remapping = rewriter_config_pb2.RewriterConfig.OFF
        for field, value in (_SLOW_ON_CPU if cpu_only else ()):
            if not getattr(rewrites, field):  # 0: TF's default, not the user's choice
                setattr(rewrites, field, value)
        _CALL_ATTRS[key] = ("executor_type", key[1],
                            "config_proto", config.SerializeToString())
    return _CALL_ATTRS[key]


# Grappler settings of the SPMD program on CPU meshes: each pass here cost seconds on the
# first call of the 64-layer FFN train step (a program of 8x the single-device ops) and
# measured no gain on its steady step (benchmarks/RESULTS.md §14, "Time to first step").
# Not applied on other devices, where the layout and memory optimizers do work (NCHW
# convolutions, swapping) that was not measured here.
_SLOW_ON_CPU = (
    ("disable_tfg_optimizer", True),   # MLIR passes: attribute and control-flow clean-ups
    ("experimental_conditional_code_motion", rewriter_config_pb2.RewriterConfig.OFF),
    ("memory_optimization", rewriter_config_pb2.RewriterConfig.NO_MEM_OPT),
    ("layout_optimizer", rewriter_config_pb2.RewriterConfig.OFF),  # no CPU conversion
    ("constant_folding", rewriter_config_pb2.RewriterConfig.OFF),  # the importer folds
    ("meta_optimizer_iterations", rewriter_config_pb2.RewriterConfig.ONE),
)


# (the context's serialized ConfigProto, executor type, cpu_only) -> call attrs
_CALL_ATTRS = {}


def cpu_replica_classes(program, mesh):
    """replicas.replica_classes of `program` over the CPU devices of `mesh` in this
    process: those whose tensors the others read in place."""
    cpus = tuple(d for d in mesh.addressable_ids if _on_cpu(mesh.devices[d]))
    return replicas.replica_classes(program, mesh, cpus)


def traced_region_op(node, operands):
    """The control-flow op `node` of a traced (not SPMD) graph re-created once in the
    current graph, with no device, on the tensors `operands`: its regions, which hold no
    collectives, become TF functions as the backend builds them (for the annotated
    global graph, runtime/annotated.py). Returns the tf.Operation."""
    return _Lowering(None, None, devices=[None])._region_op(node)(0, [[t] for t in operands])


def safe_name(name):
    """`name` made into a valid TF op name."""
    name = re.sub(r"[^A-Za-z0-9_.\-/]", "_", name).strip("/")
    return name if re.match(r"[A-Za-z0-9.]", name) else "n" + name


class _Lowering:
    """Emits an SPMD program into the current (function) graph, once per device.

    lower() adds the control edges that order the program's state on each device
    (ordering.py: variable reads and writes, stateful ops, each device's collectives on
    its ordering token) and makes the stateful ops control outputs, so the function is
    traced without tf.function's automatic control dependencies (`orders_state`)."""

    orders_state = True

    def __init__(self, mesh, keys, devices=None, order=None, copy_collectives=False,
                 replicated_once=False):
        """With `devices` (TF device names, or None for no device) instead of a mesh, it
        emits graphs without collectives on those devices (see traced_region_op).
        `order` gives the emission order of a program's top-level nodes (schedule.py;
        default program order); with `copy_collectives` the collectives of groups of
        this process's CPU devices are copies, with `replicated_once` a pure op runs
        once for the CPU devices holding its value equal (LocalBackend)."""
        self.mesh = mesh
        self.keys = keys
        self.order = order or schedule.program_order
        self.replicated_once = replicated_once
        self.classes = None  # replicas.replica_classes of the program lower() emits
        self.copyable = frozenset()  # device ids whose collectives may be copies
        if mesh is None:
            self.devices, self.local = devices, tuple(range(len(devices)))
            self.tokens = dict.fromkeys(self.local)
        else:
            self.devices = mesh.devices
            # this process's devices: the others belong to other workers, which emit theirs
            self.local = mesh.addressable_ids
            self.tokens = {d: collectives.ordering_token(self.devices[d]) for d in self.local}
            if copy_collectives:
                self.copyable = frozenset(d for d in self.local if _on_cpu(self.devices[d]))
        self.args = None
        self._scalars = {}  # (graph, device id, value) -> int32 Const on that device
        self._consts = {}  # (graph, _const_key) -> (values, ops) of the first such node
        self._emitting = None  # name of the device emit_node is emitting for
        self.ordering = None  # ordering.Ordering of the program lower() emits
        self.last_token = {}  # device id -> op of its last node on its ordering token
        self.must_run = []  # ops to make control outputs of the function

    def _place(self, op):
        """Device function of emit_node: the op's own device (an emitter's tf.device
        scope) or the device being emitted."""
        return op.device or self._emitting

    def _scalar(self, d, value):
        """An int32 scalar constant on device d in the current graph, one per value: the
        group sizes and keys of a device's collectives share these."""
        graph = ops.get_default_graph()
        key = (graph, d, value)
        if key not in self._scalars:
            # no control inputs: the constant serves later collectives too
            with tf.control_dependencies(None), tf.device(self.devices[d]):
                self._scalars[key] = tf.constant(value, tf.int32)
        return self._scalars[key]

    def lower(self, program, flat):
        """Emits every node for every device of this process; returns the outputs,
        output-major."""
        self.bind(program, flat)
        values = {}   # values[node][out][device]: tf.Tensor (None on other workers)
        op_of = {}    # op_of[node][device]: tf.Operation, for control inputs
        # Node-major order: every device's copy of a node is created before the next, so
        # every ordering edge and every device's token chain follow one global order,
        # and no chain waits on a collective emitted later.
        order = list(self.order(program))
        if self.orders_state:  # else tf.function's automatic control dependencies do
            self.ordering = ordering.program_ordering(program, order)
        self.last_token = dict.fromkeys(self.local)
        self.must_run = []
        for index in order:
            self.emit_node(program, index, values, op_of)
        outputs = [self._held_on(values[ref.node][ref.out][d], d)
                   for ref in program.outputs for d in self.local]
        ops.get_default_graph().control_outputs.extend(self.must_run)
        return outputs

    def bind(self, program, flat):
        """Prepares to emit `program` with the function arguments `flat` (input-major,
        this process's devices): sets self.args (args[i][d]: input i on device d, None
        on other workers' devices) and, with replicated_once, self.classes unless
        given."""
        n, k = self.mesh.size, len(self.local)
        self.args = []
        for i in range(0, len(flat), k):
            self.args.append([None] * n)
            for d, x in zip(self.local, flat[i:i + k]):
                self.args[-1][d] = x
        if self.replicated_once and self.classes is None:
            self.classes = cpu_replica_classes(program, self.mesh)

    def _held_on(self, tensor, d):
        """`tensor` as device d's output: a copy on d when it is a function argument or
        another device's tensor (an input or a copy all-reduce's sum, which the program
        reads in place), so that every output of d is held on d."""
        if _device_key(tensor.device) == _device_key(self.devices[d]):
            return tensor
        with tf.device(self.devices[d]):
            return _identity(tensor)

    def emit_node(self, program, index, values, op_of):
        """Emits node `index` of `program` on every device of this process, filling
        values[index] and op_of[index] (None entries for other workers' devices)."""
        node = program.nodes[index]
        const = _const_key(node)
        if const is not None:
            # one Const per value and device: the program repeats a few values (shapes,
            # axes, the learning rate) in every layer, 13% of the FFN step's ops
            const = (ops.get_default_graph(), const)
            if const in self._consts:
                values[index], op_of[index] = self._consts[const]
                return
        emit = self._emitter(node)
        ins = [values[ref.node][ref.out] for ref in node.inputs]
        n = self.mesh.size
        outs, node_ops = [None] * n, [None] * n
        sources = self._sources(node, index)
        control = node.control_inputs
        # with self.ordering: the ordering edges, the token chain and the control outputs
        # (without it, tf.function's automatic control dependencies add them)
        uses_token = self.ordering is not None and getattr(emit, "uses_token", False)
        must_run = uses_token
        if self.ordering is not None:
            control = control + list(self.ordering.after.get(index, ()))
            must_run = must_run or index in self.ordering.must_run
        # One device-function scope for every device's copy: a tf.device scope per copy
        # cost a third of the op's own creation (24 vs 70 us); the function puts each op
        # without a device of its own on the device being emitted.
        with ops.get_default_graph().device(self._place):
            for d in self.local:
                if sources[d] != d:  # run once, on that device, for both
                    outs[d], node_ops[d] = outs[sources[d]], node_ops[sources[d]]
                    continue
                self._emitting = self.devices[d]
                deps = [op_of[c][d] for c in control]
                if uses_token and self.last_token[d] is not None:
                    deps.append(self.last_token[d])
                if deps:
                    with tf.control_dependencies(deps):
                        result = emit(d, ins)
                else:  # (the scope costs ~6 us even when empty)
                    result = emit(d, ins)
                if isinstance(result, ops.Operation):
                    outs[d], node_ops[d] = result.outputs, result
                else:
                    outs[d], node_ops[d] = [result], result.op
                _set_shapes(node, outs[d])
                if uses_token:
                    self.last_token[d] = node_ops[d]
                if must_run:
                    self.must_run.append(node_ops[d])
        values[index] = [[None if outs[d] is None else outs[d][k] for d in range(n)]
                         for k in range(len(outs[self.local[0]]))]
        op_of[index] = node_ops
        if const is not None:
            self._consts[const] = values[index], node_ops

    def _sources(self, node, index):
        """sources[d]: the device whose copy of `node` (node `index` of the program)
        device d reads: d, unless the node runs once for a class of devices
        (replicated_once)."""
        if self.classes is None or not replicas.runs_once(node):
            return range(self.mesh.size)
        return self.common_sources([index])

    def common_sources(self, indices):
        """sources[d]: the device s whose values of all the nodes `indices` device d
        holds equal (self.classes: s runs them for d), when the nodes agree on one s;
        else d (also without classes, or for no nodes)."""
        sources = list(range(self.mesh.size))
        if self.classes is None or not indices:
            return sources
        for d in self.local:
            found = {self.classes[i][d] for i in indices}
            if len(found) == 1 and None not in found:
                sources[d] = found.pop()
        return sources

    def _emitter(self, node, in_region=False):
        """emit(d, inputs): `node` on device d, a tensor or an op (inputs[k][e] is input
        k on device e); `in_region`: inside a control-flow body, where a device reads
        no other device's tensor."""
        p = node.params
        if node.op == base.INPUT:
            # the argument itself: an Identity per input and device was ~10% of the
            # program's ops, all removed again by grappler (outputs: see lower)
            return lambda d, ins: self.args[p["index"]][d]
        if node.op == base.SHARD_INDEX:
            return lambda d, ins: tf.constant(self.mesh.shard_index(d, p["axes"]), tf.int32)
        if node.op == base.PERMUTE:
            return self._permute(node)
        if node.op in collectives.KEYED:
            return self._collective(node, in_region)
        if node.op.startswith("gt."):
            raise ShardingError(f"LocalBackend cannot lower {node.op} (node {node.name})")
        if node.regions:
            return self._region_op(node)
        return _tf_op(node, self.devices)

    def _permute(self, node):
        """Emitter of gt.Permute: targets read their source's tensor, the others get zeros.

        A pair within this process is a copy: an identity on the target reading the
        source's tensor, for which TF inserts the Send/Recv pair. A pair across workers
        cannot be one (each worker runs its own function), so the two devices all-gather
        their tensors in a group of two (the non-sending one gives zeros) and the target
        keeps its source's block; one gather serves a pair exchanging both ways. Every
        device joins its crossing pairs in one global order (sorted pairs), so the pair
        collectives, chained per device by the ordering tokens, cannot wait in a cycle.
        """
        pairs = node.params["pairs"]
        source_of = {}
        for source, target in pairs:
            if int(target) in source_of:
                raise ShardingError(
                    f"gt.Permute pairs {pairs} send twice to device {target}: each device "
                    "may receive from one source")
            source_of[int(target)] = int(source)
        task = [cluster.task_of(name) for name in self.devices]
        crossing = sorted({tuple(sorted((s, t))) for t, s in source_of.items()
                           if task[s] != task[t]})
        if crossing and not collectives.carries(node.out_dtypes[0]):
            raise ShardingError(
                f"node {node.name} (gt.Permute) would send {node.out_dtypes[0].name} values "
                "between worker processes, which TF's collectives cannot carry; keep the "
                "halo'd or shifted dim of that tensor unsplit across workers")
        instance_key = self.keys.instance_key(node.name) if crossing else None

        def emit(d, ins):
            x = ins[0][d]
            received, gathers = None, []
            for pair in (pair for pair in crossing if d in pair):
                other = pair[1] if pair[0] == d else pair[0]
                group = collectives.Group([self.devices[m] for m in pair], instance_key,
                                          self.tokens[d], lambda v: self._scalar(d, v))
                sent = x if source_of.get(other) == d else tf.zeros_like(x)
                blocks = group.all_gather(tf.expand_dims(sent, 0), 0)
                gathers.append(blocks.op)
                if source_of.get(d) == other:
                    received = blocks[pair.index(other)]
            if d not in source_of:
                result = tf.zeros_like(x)
            elif received is not None:
                result = received
            else:
                result = _identity(ins[0][source_of[d]])
            if gathers:  # the result follows every gather, so its token chain does too
                with tf.control_dependencies(gathers):
                    result = _identity(result)
            return result
        emit.uses_token = bool(crossing)
        return emit

    def _collective(self, node, in_region=False):
        p = node.params
        groups = self.mesh.groups(tuple(p["axes"]))
        if groups.shape[1] == 1:
            return lambda d, ins: ins[0][d]
        row_of = {int(dev): [int(x) for x in row] for row in groups for dev in row}
        if not collectives.carries(node.out_dtypes[0]) or (
                not in_region and self.copyable.issuperset(row_of)):
            return self._copy_collective(node, row_of)
        instance_key = self.keys.instance_key(node.name)

        def emit(d, ins):
            row = row_of[d]
            group = collectives.Group([self.devices[x] for x in row], instance_key,
                                      self.tokens[d], lambda v: self._scalar(d, v))
            x = ins[0][d]
            if node.op == base.ALL_REDUCE:
                return group.all_reduce(x, p["reduce_op"])
            rank = x.shape.rank
            if node.op == base.REDUCE_SCATTER:
                return group.reduce_scatter(x, p["dim"] % rank, p["reduce_op"], row.index(d))
            if node.op == base.ALL_GATHER:
                return group.all_gather(x, p["dim"] % rank)
            return group.all_to_all(x, p["split_dim"] % rank, p["concat_dim"] % rank)
        emit.uses_token = True  # chained on the device's ordering token (see emit_node)
        return emit


    def _copy_collective(self, node, row_of):
        """Emitter of a collective made of cross-device copies, for dtypes TF's collective
        ops do not take (strings, complex) and, with copy_collectives, for groups of this
        process's CPU devices: each device reads what it needs from every member of its
        group, and TF inserts the Send/Recv pairs, as for gt.Permute (between CPU devices
        of one process they pass the buffer). An all-reduce is computed once per group,
        on the first member emitted, and read by the others, so every member holds the
        same bits; a sum is one AddN in group order."""
        p = node.params
        dtype = node.out_dtypes[0]
        if any(len({cluster.task_of(self.devices[m]) for m in row}) > 1
               for row in row_of.values()):
            raise ShardingError(
                f"node {node.name} ({node.op}) would move {dtype.name} values between "
                "worker processes, which TF's collectives cannot carry; keep the dims of "
                "that tensor split over one worker's devices only")
        if node.op in (base.ALL_REDUCE, base.REDUCE_SCATTER) and (
                dtype == tf.string or p["reduce_op"] not in _STACKED_REDUCE):
            raise ShardingError(
                f"node {node.name} ({node.op}) would {p['reduce_op']}-reduce {dtype.name} "
                "values across devices, which TF cannot do; keep the reduced dim of that "
                "tensor unsplit")

        sums = {}  # group (tuple of device ids) -> its all-reduced tensor

        def reduce(tensors):
            # in the dtype TF's collectives would reduce in (bool as int32, bfloat16 as
            # float32), so both paths give the same values
            carried = [collectives.carry(t) for t in tensors]
            if p["reduce_op"] == "sum":
                return collectives.restore(_add_n(carried), dtype)
            return collectives.restore(
                _STACKED_REDUCE[p["reduce_op"]](tf.stack(carried), 0), dtype)

        def emit(d, ins):
            row = row_of[d]
            x = ins[0]
            rank = x[d].shape.rank
            if node.op == base.ALL_GATHER:
                return tf.concat([x[m] for m in row], p["dim"] % rank)
            if node.op == base.ALL_TO_ALL:
                pieces = []
                for m in row:
                    with tf.device(self.devices[m]):
                        pieces.append(collectives.chunk(x[m], p["split_dim"] % rank, len(row),
                                                        row.index(d)))
                return tf.concat(pieces, p["concat_dim"] % rank)
            if node.op == base.ALL_REDUCE:
                group = tuple(row)
                if group not in sums:
                    sums[group] = reduce([x[m] for m in row])
                    return sums[group]
                return sums[group]  # read in place (outputs: see lower)
            # reduce-scatter: this member's chunk of every member, reduced here
            pieces = []
            for m in row:
                with tf.device(self.devices[m]):
                    pieces.append(collectives.chunk(x[m], p["dim"] % rank, len(row),
                                                    row.index(d)))
            return reduce(pieces)
        return emit

    def _region_op(self, node):
        """Emitter of a control-flow op (a node with regions): the TF op re-created on
        device d, each of its function attrs naming a TF function built from its region
        (an SPMD sub-program) for d.

        When the regions hold collectives, the device's ordering token is one more
        operand (a loop hands it through as one more loop value) and the bodies' ordering
        token: the op then orders with the device's other collectives, not in one chain
        with every device's stateful ops (which would deadlock, see
        collectives.ordering_token), and it is the stateful op type. Each collective
        keeps one instance key for every iteration: measured with TF 2.21, a functional
        While (not lowered to Switch/Merge: the backend drops TF's
        _lower_using_switch_merge attr) runs the body's collectives once per iteration
        on every device with the same keys, correctly."""
        attrs = {k: v for k, v in node.attrs.items() if not k.startswith("_")}
        name = safe_name(node.name)
        threads_token = any(n.op in collectives.KEYED + (base.PERMUTE,)
                            for region in node.regions for n in walk(region))
        op_type = _STATEFUL.get(node.op, node.op) if threads_token else node.op
        loop = "While" in node.op
        body = len(node.regions) - 1

        def emit(d, ins):
            functions = iter([
                self._region_function(region, d, f"{name}_region{k}_d{d}", threads_token,
                                      threads_token and loop and k == body)
                for k, region in enumerate(node.regions)])
            op_attrs = dict(attrs)
            for attr in REGION_OPS[node.op][0]:
                if attrs[attr].HasField("list"):  # list(func): one region per function
                    count = len(attrs[attr].list.func)
                    op_attrs[attr] = attr_value_pb2.AttrValue(
                        list=attr_value_pb2.AttrValue.ListValue(func=[
                            attr_value_pb2.NameAttrList(name=next(functions))
                            for _ in range(count)]))
                else:
                    op_attrs[attr] = attr_value_pb2.AttrValue(
                        func=attr_value_pb2.NameAttrList(name=next(functions)))
            inputs, dtypes = [x[d] for x in ins], list(node.out_dtypes)
            if threads_token:
                inputs.append(self.tokens[d])
                _append_type(op_attrs, "T" if loop else "Tin", tf.resource)
                if loop:
                    dtypes.append(tf.resource)
                    if "output_shapes" in op_attrs:
                        shapes = list(op_attrs["output_shapes"].list.shape)
                        op_attrs["output_shapes"] = attr_value_pb2.AttrValue(
                            list=attr_value_pb2.AttrValue.ListValue(
                                shape=shapes + [tf.TensorShape([]).as_proto()]))
            return ops.get_default_graph()._create_op_internal(
                op_type, inputs, dtypes=dtypes, attrs=op_attrs, name=f"{name}_d{d}")
        emit.uses_token = threads_token
        return emit

    def _region_function(self, region, d, name, threads_token, returns_token):
        """Builds a TF function running the sub-program `region` on device d, adds it to
        the current graph's library, and returns its (unique) name. With
        `threads_token` it takes the device's ordering token as one more (last)
        parameter, which its collectives use (and a loop body returns last)."""
        signature = [tf.TensorSpec(() if node.out_dtypes[0] in (tf.resource, tf.variant)
                                   else node.out_shapes[0], node.out_dtypes[0])
                     for node in (region.nodes[ref.node] for ref in region.inputs)]
        if threads_token:
            signature.append(tf.TensorSpec((), tf.resource))

        def body(*args):
            outer = self.tokens[d]
            if threads_token:
                self.tokens[d], args = args[-1], args[:-1]
            try:
                with tf.device(self.devices[d]):
                    outs = self._lower_region(region, args, d)
                if returns_token:
                    outs.append(self.tokens[d])
            finally:
                self.tokens[d] = outer
            return outs
        # unique: every traced program registers its functions in one eager context
        graph = func_graph_module.func_graph_from_py_func(
            f"{name}_{ops.uid()}", body, None, None, signature=signature,
            add_control_dependencies=True)
        return control_flow_util_v2.create_new_tf_function(graph)

    def _permute_in_region(self, node):
        """Emitter of gt.Permute inside a body, where a device reaches no other device's
        tensor (the Send/Recv pairs TF inserts between devices outside bodies): each
        source sends to its targets and each target receives from its source with
        collectives.pair_send / pair_receive, groups of two devices, the node's instance
        key (copies to a lower device id: its reverse key, so that the two ways of a
        2-cycle are two broadcasts); a device that is no target gets zeros."""
        targets_of, source_of = {}, {}
        for source, target in node.params["pairs"]:
            targets_of.setdefault(int(source), []).append(int(target))
            source_of[int(target)] = int(source)
        keys = (self.keys.instance_key(node.name),
                self.keys.instance_key(collectives.reverse_key_name(node.name)))
        names = self.devices

        def emit(d, ins):
            x = ins[0][d]
            for t in targets_of.get(d, ()):
                if t != d:  # run by the body's automatic control dependencies
                    collectives.pair_send(x, names[d], names[t], keys[t < d])
            s = source_of.get(d)
            if s is None:
                return tf.zeros_like(x)
            if s == d:
                return tf.identity(x)
            return collectives.pair_receive(x.shape.as_list(), x.dtype, names[s], names[d],
                                            keys[d < s])
        return emit

    def _lower_region(self, region, args, d):
        """Emits the nodes of sub-program `region` for device d into the current graph,
        its parameters (gt.Input nodes) bound to the tensors `args`; returns the tensors
        of its outputs."""
        bound = {ref.node: arg for ref, arg in zip(region.inputs, args)}
        values, op_of = [], []  # per node: its output tensors; its tf.Operation
        for index, node in enumerate(region.nodes):
            if index in bound:
                values.append([bound[index]])
                op_of.append(bound[index].op)
                continue
            if node.op in collectives.KEYED + (base.PERMUTE,) and \
                    not collectives.carries(node.out_dtypes[0]):
                # made of copies that read other devices' tensors, which a body running
                # on one device cannot reach
                raise ShardingError(
                    f"LocalBackend cannot run {node.op} of {node.out_dtypes[0].name} inside "
                    f"a control-flow body (node {node.name}): TF's collectives do not take "
                    "that dtype; keep the split that needs it out of the body")
            emit = (self._permute_in_region(node) if node.op == base.PERMUTE
                    else self._emitter(node, in_region=True))
            with tf.control_dependencies([op_of[c] for c in node.control_inputs]):
                # one device: inputs[k] maps it to its tensor, as emitters index them
                result = emit(d, [{d: values[ref.node][ref.out]} for ref in node.inputs])
            outs = list(result.outputs) if isinstance(result, ops.Operation) else [result]
            _set_shapes(node, outs)
            values.append(outs)
            op_of.append(result if isinstance(result, ops.Operation) else result.op)
        return [values[ref.node][ref.out] for ref in region.outputs]


def _const_key(node):
    """(dtype, serialized value) of a Const node without control inputs, which any
    other such node of equal key can stand for; None for other nodes."""
    if node.op != "Const" or node.control_inputs:
        return None
    return node.attrs["dtype"].type, node.attrs["value"].SerializeToString()


def _identity(x):
    """tf.identity(x) of a graph tensor, without tf.identity's dispatch and op-def
    layers (they doubled the cost of the lowering's most frequent op: one per program
    input and device). Like tf.identity, the result keeps a resource handle's data."""
    result = ops.get_default_graph()._create_op_internal(
        "Identity", [x], dtypes=[x.dtype],
        attrs={"T": attr_value_pb2.AttrValue(type=x.dtype.as_datatype_enum)}).outputs[0]
    if hasattr(x, "_handle_data"):
        result._handle_data = x._handle_data
    return result


def _add_n(tensors):
    """tf.add_n of graph tensors of one dtype, created directly: tf.add_n's dispatch and
    op-def layers cost ~0.35 ms per op against ~0.07 ms, and without the all-reduce
    combiner the copy all-reduces are one AddN per gradient and group (1,282 for the
    64-layer FFN step)."""
    dtype = tensors[0].dtype.as_datatype_enum
    return ops.get_default_graph()._create_op_internal(
        "AddN", tensors, dtypes=[tensors[0].dtype],
        attrs={"N": attr_value_pb2.AttrValue(i=len(tensors)),
               "T": attr_value_pb2.AttrValue(type=dtype)}).outputs[0]


_STACKED_REDUCE = {"sum": tf.reduce_sum, "prod": tf.reduce_prod, "max": tf.reduce_max,
                   "min": tf.reduce_min}


def _set_shapes(node, tensors):
    """Gives `tensors` the program's static local shapes, which TF's shape inference
    cannot always derive (collectives' outputs, reads of variable handles fed without
    handle data). A resource or TensorList tensor is a scalar handle: its program shape
    is its value's (a TensorList's: its element's)."""
    for tensor, shape in zip(tensors, node.out_shapes):
        if tensor.dtype in (tf.resource, tf.variant):  # scalar handles to TF
            continue
        known = tensor.shape
        if known.rank == len(shape) and known.as_list() == list(shape):
            continue  # TF inferred it (most ops): set_shape would cost ~4x this check
        try:
            tensor.set_shape(shape)
        except ValueError:
            raise ShardingError(
                f"node {node.name} ({node.op}): the program says its local shape is "
                f"{shape}, TF computes {tensor.shape}") from None


def _tf_op(node, devices):
    """Emitter re-creating a TF op from its type and attrs."""
    # Underscore attrs (_class, _XlaSharding, ...) describe the traced graph, not the op;
    # colocation constraints in particular would fight the per-device placement.
    attrs = {k: v for k, v in node.attrs.items() if not k.startswith("_")}
    name = safe_name(node.name)
    if node.op in _NCHW_ON_CPU and attrs.get("data_format") is not None and \
            attrs["data_format"].s in _CHANNELS_LAST:
        return _nhwc_on_cpu(node, attrs, name, devices)

    def emit(d, ins):
        args, op_attrs = [x[d] for x in ins], attrs
        if node.op in _FILTER_GRADIENTS and _on_cpu(devices[d]):
            args, op_attrs = _input_ending_at_last_window(node, args, attrs)
        return ops.get_default_graph()._create_op_internal(
            node.op, args, dtypes=node.out_dtypes, attrs=op_attrs, name=f"{name}_d{d}")
    return emit


@functools.lru_cache(maxsize=None)
def _device_key(device):
    """`device` (a device string, "" for none) parsed, to compare devices however their
    names are spelled."""
    return tf.DeviceSpec.from_string(device)


def _on_cpu(device):
    """Whether `device` (a device string) is a CPU."""
    return "CPU" in tf.DeviceSpec.from_string(device).device_type.upper()


# Filter gradients whose CPU kernels the backend gives an input ending at the last
# window. TF 2.21's oneDNN Conv2DBackpropFilter corrupts the heap (SIGABRT "free():
# invalid size", SIGSEGV within a few hundred calls; Eigen's kernels,
# TF_ENABLE_ONEDNN_OPTS=0, never do) for some strided windows that leave input rows past
# the last window, e.g. input (3, 8, 5, 2), 1x1 filter, stride (2, 1), VALID (fuzzer
# seed 31 #814; the grid of benchmarks/conv_filter_crash_grid.py in benchmarks/RESULTS.md
# §6: no input ending at its last window crashed, nor did the depthwise and 3-D filter
# gradients on the same shapes). Those rows contribute nothing to the filter gradient,
# so slicing them off is exact.
_FILTER_GRADIENTS = {"Conv2DBackpropFilter"}


def _input_ending_at_last_window(node, args, attrs):
    """(args, attrs) of filter-gradient `node` (inputs: input, filter_sizes,
    out_backprop; NHWC: NCHW ones come through _nhwc_on_cpu's transposes) with the
    input sliced, on every spatial dim where it extends past the last window (static
    shapes), to end there, and the padding made to agree: the high pad of a sliced dim
    is 0, so SAME (whose pads are 0 on such a dim, or it would reach the end) becomes
    VALID if no dim is padded, else EXPLICIT. Unchanged if no dim extends past its last
    window or a shape is not static."""
    x, dy = args[0], args[2]
    rank = len(node.out_shapes[0])
    if not (x.shape.is_fully_defined() and dy.shape.is_fully_defined()) or \
            x.shape.num_elements() == 0 or dy.shape.num_elements() == 0:
        return args, attrs
    padding = attrs["padding"].s
    pairs = (list(attrs["explicit_paddings"].list.i) if padding == b"EXPLICIT"
             else [0] * 2 * rank)
    dilations = list(attrs["dilations"].list.i) if "dilations" in attrs else [1] * rank
    sizes = x.shape.as_list()
    for window, dim in zip(node.out_shapes[0], range(1, rank - 1)):
        stride, extent, out = attrs["strides"].list.i[dim], sizes[dim], dy.shape[dim]
        span = (window - 1) * dilations[dim] + 1
        if padding == b"SAME":
            total = max((out - 1) * stride + span - extent, 0)
            pairs[2 * dim:2 * dim + 2] = [total // 2, total - total // 2]
        end = (out - 1) * stride + span - pairs[2 * dim]  # one past the last window's row
        if end < extent:
            sizes[dim], pairs[2 * dim + 1] = end, 0
    if sizes == x.shape.as_list():
        return args, attrs
    trimmed = dict(attrs, padding=attr_value_pb2.AttrValue(
        s=b"EXPLICIT" if any(pairs) else b"VALID"))
    trimmed.pop("explicit_paddings", None)
    if any(pairs):
        trimmed["explicit_paddings"] = attr_value_pb2.AttrValue(
            list=attr_value_pb2.AttrValue.ListValue(i=pairs))
    return [tf.slice(x, [0] * rank, sizes)] + list(args[1:]), trimmed


# Windowed ops whose CPU kernels take only NHWC: (inputs in NCHW, inputs that are NCHW
# shape vectors, whether the output is NCHW). A single-device tf.function relies on
# grappler's layout optimizer for these, which is not guaranteed to run on the SPMD
# program, so the backend transposes itself.
_NCHW_ON_CPU = {
    "Conv2D": ((0,), (), True),
    "Conv2DBackpropInput": ((2,), (0,), True),
    "Conv2DBackpropFilter": ((0, 2), (), False),
    "DepthwiseConv2dNative": ((0,), (), True),
    "DepthwiseConv2dNativeBackpropInput": ((2,), (0,), True),
    "DepthwiseConv2dNativeBackpropFilter": ((0, 2), (), False),
    "MaxPool": ((0,), (), True),
    "AvgPool": ((0,), (), True),
    "MaxPoolGrad": ((0, 1, 2), (), True),
    "AvgPoolGrad": ((1,), (0,), True),
    "MaxPool3DGrad": ((0, 1, 2), (), True),  # the other 3-D CPU kernels take NCDHW
}
_CHANNELS_LAST = {b"NCHW": b"NHWC", b"NCDHW": b"NDHWC"}


def _nhwc_on_cpu(node, attrs, name, devices):
    """Emitter of an NCHW (NCDHW) windowed op: on CPU devices as the NHWC (NDHWC) op
    between transposes (per-dim attrs permuted); elsewhere as it is."""
    data, vectors, nchw_out = _NCHW_ON_CPU[node.op]
    channels_first = attrs["data_format"].s
    rank = len(channels_first)
    to_last = [0] + list(range(2, rank)) + [1]  # NCHW -> NHWC, NCDHW -> NDHWC
    to_first = [0, rank - 1] + list(range(1, rank - 1))
    nhwc = dict(attrs, data_format=attr_value_pb2.AttrValue(s=_CHANNELS_LAST[channels_first]))
    for key in ("strides", "dilations", "ksize"):
        if key in attrs and len(attrs[key].list.i) == rank:
            values = list(attrs[key].list.i)
            nhwc[key] = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                i=[values[k] for k in to_last]))
    if "explicit_paddings" in attrs and len(attrs["explicit_paddings"].list.i) == 2 * rank:
        pairs = list(attrs["explicit_paddings"].list.i)
        nhwc["explicit_paddings"] = attr_value_pb2.AttrValue(
            list=attr_value_pb2.AttrValue.ListValue(
                i=[v for k in to_last for v in pairs[2 * k:2 * k + 2]]))

    def emit(d, ins):
        graph = ops.get_default_graph()
        if not _on_cpu(devices[d]):
            return graph._create_op_internal(node.op, [x[d] for x in ins],
                                             dtypes=node.out_dtypes, attrs=attrs,
                                             name=f"{name}_d{d}")
        args = []
        for k, x in enumerate(ins):
            if k in data:
                args.append(tf.transpose(x[d], to_last))
            elif k in vectors:
                args.append(tf.gather(x[d], to_last))
            else:
                args.append(x[d])
        op_attrs = nhwc
        if node.op in _FILTER_GRADIENTS:
            args, op_attrs = _input_ending_at_last_window(node, args, nhwc)
        op = graph._create_op_internal(node.op, args, dtypes=node.out_dtypes,
                                       attrs=op_attrs, name=f"{name}_d{d}")
        return tf.transpose(op.outputs[0], to_first) if nchw_out else op.outputs[0]
    return emit



# The stateful op of a stateless control-flow op whose bodies now hold collectives.
_STATEFUL = {"StatelessWhile": "While", "StatelessIf": "If", "StatelessCase": "Case"}


def _append_type(attrs, key, dtype):
    """attrs[key], a list(type) attr, with `dtype` appended."""
    types = list(attrs[key].list.type) + [dtype.as_datatype_enum]
    attrs[key] = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=types))

