"""The per-device emitter: an SPMD program emitted into the current (function) graph once
per device of this process, as TF ops (see local.py for the program it builds).

DeviceEmitter emits every node op by op (tf_kernels.tf_op_emitter for TF ops,
collective_emitters for gt.* collectives, region_emitter for control flow), in the
order `order` gives, with the control edges that order each device's state
(ordering.py). Composed with a segment plan (xla.SegmentPlan) it emits the plan's steps
instead: compiled segment calls and the nodes between them op by op. The same emitter
re-creates the control-flow ops of a traced global graph for the XLA bridge
(traced_region_op, runtime/annotated.py).
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps_utils as acd_utils
from tensorflow.python.framework import ops

from gspmd_tf.backends import base, collective_emitters, collectives, ordering, \
    region_emitter, replicas, schedule
from gspmd_tf.backends.tf_kernels import identity, on_cpu, set_shapes, tf_op_emitter
from gspmd_tf.errors import ShardingError
from gspmd_tf.registry import VIEW, has_trait


def cpu_replica_classes(program, mesh):
    """replicas.replica_classes of `program` over the CPU devices of `mesh` in this
    process: those whose tensors the others read in place."""
    return replicas.replica_classes(program, mesh, replicas.cpu_devices(mesh))


def traced_region_op(node, operands):
    """The control-flow op `node` of a traced (not SPMD) graph re-created once in the
    current graph, with no device, on the tensors `operands`: its regions, which hold no
    collectives, become TF functions as the backend builds them (for the annotated
    global graph, runtime/annotated.py). Returns the tf.Operation."""
    emitter = DeviceEmitter(None, None, devices=[None])
    return region_emitter.region_op(emitter, node)(0, [[t] for t in operands])


class DeviceEmitter:
    """Emits an SPMD program into the current (function) graph, once per device.

    lower() adds the control edges that order the program's state on each device
    (ordering.py: variable reads and writes, stateful ops, each device's collectives on
    its ordering token) and makes the stateful ops control outputs, so the function is
    traced without tf.function's automatic control dependencies (`orders_state`)."""

    def __init__(self, mesh, keys, devices=None, order=None, copy_collectives=False,
                 replicated_once=False, segments=None):
        """With `devices` (TF device names, or None for no device) instead of a mesh, it
        emits graphs without collectives on those devices (see traced_region_op).
        `order` gives the emission order of a program's top-level nodes (schedule.py;
        default program order); with `copy_collectives` the collectives of groups of
        this process's CPU devices are copies, with `replicated_once` a pure op runs
        once for the CPU devices holding its value equal (LocalBackend). `segments`: a
        segment plan (xla.SegmentPlan: the compute between collectives compiled) that
        drives the emission, or None (every node op by op)."""
        self.mesh = mesh
        self.keys = keys
        self.order = order or schedule.program_order
        self.replicated_once = replicated_once
        self.segments = segments
        # without segments the emitter orders the program's state itself (ordering.py);
        # a plan's segment calls are ordered by tf.function's automatic control deps
        self.orders_state = segments is None
        # replicas.replica_classes of the program lower() emits (a plan computes them)
        self.classes = None if segments is None else segments.classes
        # {node index: sources} of the nodes writing variables, run on the device
        # holding each class's copy (replicas.copy_owners); None when the program cannot
        # run on shared copies (bind: _variable_writes)
        self.variable_writes = None
        self._prepared = None  # the program prepare() decided for
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
                self.copyable = frozenset(d for d in self.local if on_cpu(self.devices[d]))
        self.args = None
        self._scalars = {}  # (graph, device id, value) -> int32 Const on that device
        self._consts = {}  # (graph, _const_key) -> (values, ops) of the first such node
        self._emitting = None  # name of the device emit_node is emitting for
        self.ordering = None  # ordering.Ordering of the program lower() emits
        self.last_token = {}  # device id -> op of its last node on its ordering token
        self.must_run = []  # ops to make control outputs of the function
        self.controlling = frozenset()  # nodes some node of lower()'s program waits for

    def _place(self, op):
        """Device function of emit_node: the op's own device (an emitter's tf.device
        scope) or the device being emitted."""
        return op.device or self._emitting

    def scalar(self, d, value):
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
        if self.segments is not None:
            return self.segments.lower(self, program)
        values = {}   # values[node][out][device]: tf.Tensor (None on other workers)
        op_of = {}    # op_of[node][device]: tf.Operation, for control inputs
        # Node-major order: every device's copy of a node is created before the next, so
        # every ordering edge and every device's token chain follow one global order,
        # and no chain waits on a collective emitted later.
        order = list(self.order(program))
        if self.orders_state:  # else tf.function's automatic control dependencies do
            self.ordering = ordering.program_ordering(program, order)
            self.controlling = frozenset(
                c for node in program.nodes for c in node.control_inputs).union(
                *self.ordering.after.values())
        self.last_token = dict.fromkeys(self.local)
        self.must_run = []
        for index in order:
            self.emit_node(program, index, values, op_of)
        outputs = [self.held_on(values[ref.node][ref.out][d], d)
                   for ref in program.outputs for d in self.local]
        ops.get_default_graph().control_outputs.extend(self.must_run)
        return outputs

    def bind(self, program, flat):
        """Prepares to emit `program` with the function arguments `flat` (input-major,
        this process's devices): sets self.args (args[i][d]: input i on device d, None
        on other workers' devices) and what prepare() decides."""
        n, k = self.mesh.size, len(self.local)
        self.args = []
        for i in range(0, len(flat), k):
            self.args.append([None] * n)
            for d, x in zip(self.local, flat[i:i + k]):
                self.args[-1][d] = x
        if self._prepared is not program:
            self.prepare(program)

    def prepare(self, program):
        """What emitting `program` decides from the program alone, before its function
        is traced (bind does it if not done): with replicated_once its replica classes
        unless given, and the variable writes on shared copies (variable_writes)."""
        if self.replicated_once and self.classes is None:
            self.classes = cpu_replica_classes(program, self.mesh)
        self.variable_writes = self._variable_writes(program)
        self._prepared = program

    def _variable_writes(self, program):
        """{node index: sources} for the top-level nodes that write a variable (take a
        handle and are no read, ordering.py's rule): each runs on the class's owner of
        its handles (replica classes of the program inputs: replicas.copy_owners), for
        the devices sharing that copy. None when the program cannot run on shared
        copies: without replica classes, with a segment plan (its update segments write
        on every device), when a control-flow body takes a handle (each device's body
        would write it), or a write's handles belong to different classes."""
        if self.classes is None or self.segments is not None:
            return None
        writes = {}
        for index, node in enumerate(program.nodes):
            handles = [ref.node for ref in node.inputs if program.dtype(ref) == tf.resource]
            if not handles or node.op == "Identity" \
                    or node.op in acd_utils.RESOURCE_READ_OPS and not node.regions:
                continue  # a handle passed on, or read (ordered with the owner's writes)
            if node.regions or node.op.startswith("gt."):
                return None
            if any(len({self.classes[i][d] for i in handles}) > 1 for d in self.local):
                return None
            writes[index] = self.common_sources(handles)
        return writes

    def held_on(self, tensor, d):
        """`tensor` as device d's output: a copy on d when it is a function argument or
        another device's tensor (an input or a copy all-reduce's sum, which the program
        reads in place), so that every output of d is held on d."""
        if _device_key(tensor.device) == _device_key(self.devices[d]):
            return tensor
        with tf.device(self.devices[d]):
            return identity(tensor)

    def emit_node(self, program, index, values, op_of, after=()):
        """Emits node `index` of `program` on every device of this process, filling
        values[index] and op_of[index] (None entries for other workers' devices); each
        device's copy waits for that device's copies of the nodes `after` too."""
        node = program.nodes[index]
        if self._passes_through(program, index):
            # the node's value is its input's on every device: no op (Identities and
            # no-op reshapes were 9% of GPT-2's train step and cost the first call's
            # graph building and optimization that much)
            values[index] = [values[node.inputs[0].node][node.inputs[0].out]]
            op_of[index] = [None if t is None else t.op for t in values[index][0]]
            return
        const = _const_key(node)
        if const is not None:
            # one Const per value and device: the program repeats a few values (shapes,
            # axes, the learning rate) in every layer, 13% of the FFN step's ops
            const = (ops.get_default_graph(), const)
            if const in self._consts:
                values[index], op_of[index] = self._consts[const]
                return
        emit = self.emitter_of(node)
        ins = [values[ref.node][ref.out] for ref in node.inputs]
        n = self.mesh.size
        outs, node_ops = [None] * n, [None] * n
        sources = self._sources(node, index)
        control = node.control_inputs + list(after)
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
        # a node run once for a class waits for what each member's copy waits for: a
        # write on a shared variable copy comes after every member's reads of it
        members = {} if isinstance(sources, range) or not control else _members(sources)
        with ops.get_default_graph().device(self._place):
            for d in self.local:
                if sources[d] != d:  # run once, on that device, for both
                    outs[d], node_ops[d] = outs[sources[d]], node_ops[sources[d]]
                    continue
                self._emitting = self.devices[d]
                if d in members:
                    deps = list(dict.fromkeys(op_of[c][e] for c in control
                                              for e in members[d]))
                else:
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
                set_shapes(node, outs[d])
                if uses_token:
                    self.last_token[d] = node_ops[d]
                if must_run:
                    self.must_run.append(node_ops[d])
        values[index] = [[None if outs[d] is None else outs[d][k] for d in range(n)]
                         for k in range(len(outs[self.local[0]]))]
        op_of[index] = node_ops
        if const is not None:
            self._consts[const] = values[index], node_ops

    def _passes_through(self, program, index):
        """Whether node `index` may be left out, its consumers reading its first input:
        a VIEW op (registry) of one result with its input's local shape, of a dense
        value (not a handle, whose identities ordering.py resolves), that waits for
        nothing and that nothing waits for (orders_state: the program says which)."""
        node = program.nodes[index]
        if not has_trait(node.op, VIEW) or len(node.out_shapes) != 1 or not node.inputs \
                or self.ordering is None or node.control_inputs \
                or index in self.controlling or index in self.ordering.must_run:
            return False
        source = node.inputs[0]
        if program.dtype(source) in (tf.resource, tf.variant):
            return False
        return tuple(program.shape(source)) == tuple(node.out_shapes[0])

    def _sources(self, node, index):
        """sources[d]: the device whose copy of `node` (node `index` of the program)
        device d reads: d, unless the node runs once for a class of devices
        (replicated_once, or a variable write on shared copies)."""
        if self.variable_writes is not None and index in self.variable_writes:
            return self.variable_writes[index]
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

    def emitter_of(self, node, in_region=False):
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
            return collective_emitters.permute(self, node)
        if node.op in collectives.KEYED:
            return collective_emitters.collective(self, node, in_region)
        if node.op.startswith("gt."):
            raise ShardingError(f"LocalBackend cannot lower {node.op} (node {node.name})")
        if node.regions:
            return region_emitter.region_op(self, node)
        return tf_op_emitter(node, self.devices)


def _members(sources):
    """{s: [s and the devices d with sources[d] == s]} for the devices s that run a
    node for others."""
    members = {}
    for d, s in enumerate(sources):
        if s != d:
            members.setdefault(s, [s]).append(d)
    return members


def _const_key(node):
    """(dtype, serialized value) of a Const node without control inputs, which any
    other such node of equal key can stand for; None for other nodes."""
    if node.op != "Const" or node.control_inputs:
        return None
    return node.attrs["dtype"].type, node.attrs["value"].SerializeToString()


@functools.lru_cache(maxsize=None)
def _device_key(device):
    """`device` (a device string, "" for none) parsed, to compare devices however their
    names are spelled."""
    return tf.DeviceSpec.from_string(device)
