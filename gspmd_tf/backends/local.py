"""LocalBackend: runs an SPMD program on the devices of this process with TF collectives.

One tf.function holds the whole program for every device: each node is emitted once per
device under tf.device, gt.* nodes become TF collective ops (CollectiveReduceV2,
CollectiveGatherV2, CollectiveAllToAllV2) or point-to-point copies (gt.Permute), and TF's
multi-device function runtime runs the per-device parts concurrently.
"""

from __future__ import annotations

import itertools
import os
import re
import threading

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import gen_collective_ops

from gspmd_tf.backends import base
from gspmd_tf.errors import ShardingError

_MERGE_OPS = {"sum": "Add", "max": "Max", "min": "Min", "prod": "Mul"}

# Keys start far from tf.distribute's (which count up from small numbers), so both can
# run collectives in one process without sharing a key.
_GROUP_KEY_BASE = 0x4753_0000
_INSTANCE_KEY_BASE = 0x4753_0000
_lock = threading.Lock()
_group_keys = {}
_instance_keys = itertools.count(_INSTANCE_KEY_BASE)
_tokens = {}


def group_key(device_names):
    """The process-wide collective group key of a set of devices.

    TF binds a group key to one device set for the life of the process, so the same set
    always gets the same key and different sets get different keys.
    """
    members = tuple(sorted(device_names))
    with _lock:
        if members not in _group_keys:
            _group_keys[members] = _GROUP_KEY_BASE + len(_group_keys)
        return _group_keys[members]


def next_instance_key():
    """A process-wide unique collective instance key."""
    with _lock:
        return next(_instance_keys)


def ordering_token(device_name):
    """The resource handle ordering the collectives of one device.

    Every collective of a device takes the same resource as its ordering_token, so
    tf.function's automatic control dependencies chain them in program order, as
    tf.distribute's CollectiveReplicaLauncher does. Created once per device.
    """
    with _lock:
        if device_name not in _tokens:
            with ops.init_scope(), tf.device(device_name):
                _tokens[device_name] = tf.Variable(0.0, trainable=False)
        return _tokens[device_name].handle


def rank_order(device_names):
    """The devices of a group in TF's collective rank order.

    Measured with TF 2.21: gather and all-to-all ranks follow the parsed device name
    (job, replica, task, type, index: CPU:2 before CPU:10), whatever order the members
    join in or the program lists them in.
    """
    def key(name):
        spec = tf.DeviceSpec.from_string(name)
        return (spec.job or "", spec.replica or 0, spec.task or 0, spec.device_type or "",
                spec.device_index or 0)
    return sorted(device_names, key=key)


def _safe_name(name):
    """`name` made into a valid TF op name."""
    name = re.sub(r"[^A-Za-z0-9_.\-/]", "_", name).strip("/")
    return name if re.match(r"[A-Za-z0-9.]", name or "") else "n" + name


class LocalBackend(base.Backend):
    """Runs SPMD programs on the mesh's devices in this process.

    `collective_timeout` (seconds; 0 waits forever) bounds every collective; it defaults to
    the GSPMD_TF_COLLECTIVE_TIMEOUT environment variable. Note that a failed or timed-out
    collective aborts TF's collective executor for the rest of the process.
    """

    def __init__(self, mesh, collective_timeout=None):
        super().__init__(mesh)
        if collective_timeout is None:
            collective_timeout = float(os.environ.get("GSPMD_TF_COLLECTIVE_TIMEOUT", 0))
        self.collective_timeout = float(collective_timeout)

    def compile(self, program):
        """Traces `program` into one tf.function; returns run(inputs) -> outputs.

        inputs[i][d]: shard of program input i for device id d (tensors or arrays);
        outputs[j][d]: shard of program.outputs[j], held in device d's memory. Calls of
        one compiled program are serialized: its collective instance keys are fixed at
        trace time, and two concurrent calls would mix up their instances.
        """
        inputs = base.program_inputs(program)
        n = self.mesh.size
        # a variable's handle is a scalar, whatever the shape of the value it holds
        specs = [tf.TensorSpec(() if node.out_dtypes[0] == tf.resource else node.out_shapes[0],
                               node.out_dtypes[0])
                 for node in inputs for _ in range(n)]
        lowering = _Lowering(self.mesh, self.collective_timeout)
        fn = tf.function(lambda *flat: lowering.lower(program, flat), autograph=False)
        concrete = fn.get_concrete_function(*specs)
        # The flat call skips ConcreteFunction's argument binding (about 0.9 ms of
        # Python for 8 shards); the captures are the ordering tokens.
        call_flat = concrete.inference_fn.call_flat
        captures = list(concrete.captured_inputs)
        n_out = len(program.outputs)
        call_lock = threading.Lock()

        def run(shards):
            flat = [x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x, spec.dtype)
                    for x, spec in zip((x for per_input in shards for x in per_input), specs)]
            if len(flat) != len(specs) or len(shards) != len(inputs):
                raise ValueError(
                    f"expected {len(inputs)} inputs with {n} shards each, got "
                    f"{[len(per_input) for per_input in shards]}")
            with call_lock:
                outs = call_flat(*flat, *captures)
            return [outs[j * n:(j + 1) * n] for j in range(n_out)]

        return run


class _Lowering:
    """Emits an SPMD program into the current (function) graph, once per device."""

    def __init__(self, mesh, timeout):
        self.mesh = mesh
        self.timeout = timeout
        self.devices = mesh.devices
        self.tokens = [ordering_token(name) for name in self.devices]

    def lower(self, program, flat):
        """Emits every node for every device; returns the outputs, output-major."""
        n = self.mesh.size
        self.args = [flat[i:i + n] for i in range(0, len(flat), n)]
        values = []   # values[node][out][device] -> tf.Tensor
        op_of = []    # op_of[node][device] -> tf.Operation (for control inputs)
        # Node-major order: every device's copy of node i is created before node i+1.
        # tf.function chains stateful ops without resource inputs in creation order, and
        # this order keeps those chains from waiting on a later collective.
        for node in program.nodes:
            emit = self._emitter(node)
            outs, node_ops = [], []
            ins = [values[ref.node][ref.out] for ref in node.inputs]
            for d in range(n):
                control = [op_of[c][d] for c in node.control_inputs]
                with tf.device(self.devices[d]), tf.control_dependencies(control):
                    result = emit(d, ins)
                if isinstance(result, ops.Operation):
                    outs.append(result.outputs)
                    node_ops.append(result)
                else:
                    outs.append([result])
                    node_ops.append(result.op)
            values.append([[outs[d][k] for d in range(n)] for k in range(len(outs[0]))])
            op_of.append(node_ops)
        return [values[ref.node][ref.out][d] for ref in program.outputs for d in range(n)]

    def _emitter(self, node):
        """emit(device, inputs) for `node`: inputs[k][d] is input k on device d."""
        p = node.params
        if node.op == base.INPUT:
            return lambda d, ins: tf.identity(self.args[p["index"]][d])
        if node.op == base.SHARD_INDEX:
            return lambda d, ins: tf.constant(self.mesh.shard_index(d, p["axes"]), tf.int32)
        if node.op == base.PERMUTE:
            return self._permute(p["pairs"])
        if node.op in (base.ALL_REDUCE, base.ALL_GATHER, base.REDUCE_SCATTER,
                       base.ALL_TO_ALL):
            return self._collective(node)
        if node.op.startswith("gt."):
            raise ShardingError(f"LocalBackend cannot lower {node.op} (node {node.name})")
        return self._tf_op(node)

    def _tf_op(self, node):
        # Underscore attrs (_class, _XlaSharding, ...) describe the traced graph, not the
        # op; colocation constraints in particular would fight the per-device placement.
        attrs = {k: v for k, v in node.attrs.items() if not k.startswith("_")}
        name = _safe_name(node.name)

        def emit(d, ins):
            op = ops.get_default_graph()._create_op_internal(
                node.op, [x[d] for x in ins], dtypes=node.out_dtypes, attrs=attrs,
                name=f"{name}_d{d}")
            # the program knows every local shape; TF may not (e.g. reads of variable
            # handles fed without handle data)
            for tensor, shape in zip(op.outputs, node.out_shapes):
                if tensor.dtype != tf.resource:
                    tensor.set_shape(shape)
            return op
        return emit

    def _permute(self, pairs):
        source_of = {}
        for source, target in pairs:
            if target in source_of:
                raise ShardingError(
                    f"gt.Permute pairs {pairs} send twice to device {target}: each device "
                    "may receive from one source")
            source_of[int(target)] = int(source)

        def emit(d, ins):
            if d in source_of:
                # An identity on the target reading the source's tensor: TF inserts the
                # Send/Recv pair between the two devices.
                return tf.identity(ins[0][source_of[d]])
            return tf.zeros_like(ins[0][d])
        return emit

    def _collective(self, node):
        p = node.params
        axes = tuple(p["axes"])
        groups = self.mesh.groups(axes)
        k = groups.shape[1]
        if k == 1:
            return lambda d, ins: ins[0][d]
        instance_key = next_instance_key()
        group_of = {int(dev): row for row in groups for dev in row}
        # Per group: shard index -> TF rank, and TF rank -> shard index.
        rank_of_shard, shard_of_rank, keys = {}, {}, {}
        for row in groups:
            names = [self.devices[dev] for dev in row]
            ranked = rank_order(names)
            rank = tuple(ranked.index(name) for name in names)
            rank_of_shard[tuple(row)] = rank
            shard_of_rank[tuple(row)] = tuple(names.index(name) for name in ranked)
            keys[tuple(row)] = group_key(names)

        def emit(d, ins):
            row = tuple(int(x) for x in group_of[d])
            call = _CollectiveCall(k, keys[row], instance_key, self.tokens[d], self.timeout)
            x = ins[0][d]
            if node.op == base.ALL_REDUCE:
                return call.all_reduce(x, p["reduce_op"])
            rank = x.shape.rank
            if node.op == base.REDUCE_SCATTER:
                reduced = call.all_reduce(x, p["reduce_op"])
                return _chunk(reduced, p["dim"] % rank, k, row.index(d))
            if node.op == base.ALL_GATHER:
                return _all_gather(call, x, p["dim"] % rank, rank_of_shard[row])
            return _all_to_all(call, x, p["split_dim"] % rank, p["concat_dim"] % rank,
                               shard_of_rank[row], rank_of_shard[row])
        return emit


class _CollectiveCall:
    """The TF collective ops of one device for one collective instruction."""

    def __init__(self, group_size, group_key, instance_key, token, timeout):
        self.kwargs = dict(group_size=group_size, group_key=group_key,
                           instance_key=instance_key, ordering_token=[token],
                           timeout_seconds=timeout)

    def all_reduce(self, x, reduce_op):
        """CollectiveReduceV2 with `reduce_op` (sum|max|min|prod)."""
        if reduce_op not in _MERGE_OPS:
            raise ShardingError(f"unknown reduce_op {reduce_op!r}: use one of {list(_MERGE_OPS)}")
        return gen_collective_ops.collective_reduce_v2(
            x, merge_op=_MERGE_OPS[reduce_op], final_op="Id", **self.kwargs)

    def gather(self, x):
        """CollectiveGatherV2: dim-0 concat of every member's x, in TF rank order."""
        return gen_collective_ops.collective_gather_v2(x, **self.kwargs)

    def all_to_all(self, x):
        """CollectiveAllToAllV2: dim-0 chunk r goes to rank r; received in rank order."""
        return gen_collective_ops.collective_all_to_all_v2(x, **self.kwargs)


def _chunk(x, dim, k, index):
    """Chunk `index` of `k` equal chunks of x along `dim`.

    TF's CollectiveReduceScatterV2 has no CPU implementation in TF 2.21 (its resolver
    finds no collective for it), so reduce-scatter is an all-reduce and this local slice.
    """
    size = x.shape[dim] // k
    begin = [0] * x.shape.rank
    begin[dim] = index * size
    shape = [-1] * x.shape.rank
    shape[dim] = size
    return tf.slice(x, begin, shape)


def _pick(x, order):
    """x[order[0]], x[order[1]], ... stacked along dim 0 (no op for the identity order)."""
    if list(order) == list(range(len(order))):
        return x
    return tf.gather(x, list(order), axis=0)


def _merge_leading(x, dim, shape):
    """x of shape [k] + shape, with the k axis merged into dim `dim` (k major)."""
    merged = list(shape)
    merged[dim] *= x.shape[0]
    if dim:
        perm = [i + 1 for i in range(dim)] + [0] + [i + 1 for i in range(dim, len(shape))]
        x = tf.transpose(x, perm)
    return tf.reshape(x, merged)


def _all_gather(call, x, dim, rank_of_shard):
    """Concat along `dim` of every member's x in shard-index order.

    TF gathers along dim 0 in rank order: each member contributes x as one [1, ...]
    block, the blocks are put in shard order, then merged into `dim`.
    """
    k = len(rank_of_shard)
    shape = x.shape.as_list()
    blocks = call.gather(tf.expand_dims(x, 0))
    blocks.set_shape([k] + shape)
    return _merge_leading(_pick(blocks, rank_of_shard), dim, shape)


def _all_to_all(call, x, split_dim, concat_dim, shard_of_rank, rank_of_shard):
    """Chunk s of x along split_dim goes to shard s; received chunks concat on concat_dim.

    TF's all-to-all needs dim 0 of size k (block r goes to rank r), so split_dim is split
    into [k, chunk] in place, the k axis moved to the front, and the blocks put in rank
    order; the received blocks are put back in shard order and merged into concat_dim.
    """
    k = len(rank_of_shard)
    shape = x.shape.as_list()
    chunk = list(shape)
    chunk[split_dim] //= k
    blocks = tf.reshape(x, shape[:split_dim] + [k] + chunk[split_dim:])
    if split_dim:
        rank = len(shape) + 1
        blocks = tf.transpose(blocks, [split_dim] + [i for i in range(rank) if i != split_dim])
    received = call.all_to_all(_pick(blocks, shard_of_rank))
    received.set_shape([k] + chunk)
    return _merge_leading(_pick(received, rank_of_shard), concat_dim, chunk)
