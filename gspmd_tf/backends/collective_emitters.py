"""Emitters of the gt.* collectives of an SPMD program on this process's devices: TF's
collective ops (collectives.Group, chained on each device's ordering token), or copies
between devices of one process (TF passes the buffer between CPU devices), and
gt.Permute's point-to-point copies. Each function takes the DeviceEmitter emitting the
program and returns an emitter emit(d, inputs) (inputs[k][e]: input k on device e).
"""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf import cluster
from gspmd_tf.collective_dtypes import carries
from gspmd_tf.backends import base, collectives
from gspmd_tf.backends.tf_kernels import add_n, identity
from gspmd_tf.errors import ShardingError


def permute(emitter, node):
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
    task = [cluster.task_of(name) for name in emitter.devices]
    crossing = sorted({tuple(sorted((s, t))) for t, s in source_of.items()
                       if task[s] != task[t]})
    if crossing and not carries(node.out_dtypes[0]):
        raise ShardingError(
            f"node {node.name} (gt.Permute) would send {node.out_dtypes[0].name} values "
            "between worker processes, which TF's collectives cannot carry; keep the "
            "halo'd or shifted dim of that tensor unsplit across workers")
    instance_key = emitter.keys.instance_key(node.name) if crossing else None

    def emit(d, ins):
        x = ins[0][d]
        received, gathers = None, []
        for pair in (pair for pair in crossing if d in pair):
            other = pair[1] if pair[0] == d else pair[0]
            group = collectives.Group([emitter.devices[m] for m in pair], instance_key,
                                      emitter.tokens[d], lambda v: emitter.scalar(d, v))
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
            result = identity(ins[0][source_of[d]])
        if gathers:  # the result follows every gather, so its token chain does too
            with tf.control_dependencies(gathers):
                result = identity(result)
        return result
    emit.uses_token = bool(crossing)
    return emit


def collective(emitter, node, in_region=False):
    p = node.params
    groups = emitter.mesh.groups(tuple(p["axes"]))
    if groups.shape[1] == 1:
        return lambda d, ins: ins[0][d]
    row_of = {int(dev): [int(x) for x in row] for row in groups for dev in row}
    if not carries(node.out_dtypes[0]) or (
            not in_region and emitter.copyable.issuperset(row_of)):
        return copy_collective(emitter, node, row_of)
    instance_key = emitter.keys.instance_key(node.name)

    def emit(d, ins):
        row = row_of[d]
        group = collectives.Group([emitter.devices[x] for x in row], instance_key,
                                  emitter.tokens[d], lambda v: emitter.scalar(d, v))
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


def copy_collective(emitter, node, row_of):
    """Emitter of a collective made of cross-device copies, for dtypes TF's collective
    ops do not take (strings, complex) and, with copy_collectives, for groups of this
    process's CPU devices: each device reads what it needs from every member of its
    group, and TF inserts the Send/Recv pairs, as for gt.Permute (between CPU devices
    of one process they pass the buffer). An all-reduce is computed once per group,
    on the first member emitted, and read by the others, so every member holds the
    same bits; a sum is one AddN in group order."""
    p = node.params
    dtype = node.out_dtypes[0]
    if any(len({cluster.task_of(emitter.devices[m]) for m in row}) > 1
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
            return collectives.restore(add_n(carried), dtype)
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
                with tf.device(emitter.devices[m]):
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
            with tf.device(emitter.devices[m]):
                pieces.append(collectives.chunk(x[m], p["dim"] % rank, len(row),
                                                row.index(d)))
        return reduce(pieces)
    return emit


def permute_in_region(emitter, node):
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
    keys = (emitter.keys.instance_key(node.name),
            emitter.keys.instance_key(collectives.reverse_key_name(node.name)))
    names = emitter.devices

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


_STACKED_REDUCE = {"sum": tf.reduce_sum, "prod": tf.reduce_prod, "max": tf.reduce_max,
                   "min": tf.reduce_min}
