"""TF collective ops for one device of a group, in mesh shard order, and their keys.

TF numbers the members of a collective group by device name (its "rank"); a mesh group
is ordered by shard index. The helpers here put chunks in rank order before TF's
collectives and back in shard order after, so results follow mesh.groups(axes) rows.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import itertools
import logging
import threading
import time

import tensorflow as tf
from tensorflow.python.eager import cancellation, context
from tensorflow.python.framework import errors, ops
from tensorflow.python.ops import gen_collective_ops, resource_variable_ops

from gspmd_tf import cluster
from gspmd_tf.backends import base
from gspmd_tf.collective_dtypes import CARRIERS
from gspmd_tf.errors import ShardingError
from gspmd_tf.graph.ir import walk
from gspmd_tf.timeouts import default_timeout

MERGE_OPS = {"sum": "Add", "max": "Max", "min": "Min", "prod": "Mul"}

# Keys are int32 in [_KEY_BASE, _KEY_LIMIT), far from tf.distribute's (which count up
# from small numbers), so both can run collectives in one process without sharing a key.
_KEY_BASE = 0x4753_0000
_KEY_LIMIT = 1 << 31
# the collectives that take group and instance keys (gt.Permute is point-to-point copies)
KEYED = (base.ALL_REDUCE, base.ALL_GATHER, base.REDUCE_SCATTER, base.ALL_TO_ALL)
_lock = threading.Lock()
_group_keys = {}    # (generation, members) -> group key
_group_owner = {}   # group key -> (generation, members): TF binds a key to one device set
_program_keys = {}  # program fingerprint -> (first instance key, lock of its calls)
_instance_ranges = []  # sorted [first, end) instance key ranges handed out
_tokens = {}
_generation = 0
log = logging.getLogger("gspmd_tf")


def _hashed_key(parts, span=1):
    """A key in [_KEY_BASE, _KEY_LIMIT - span] from a hash of `parts` that every process
    computes alike (Python's hash() of strings differs between processes)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    room = _KEY_LIMIT - span - _KEY_BASE
    if room <= 0:
        raise ShardingError(f"a program with {span} collectives needs more collective "
                            "instance keys than TF's int32 keys leave")
    return _KEY_BASE + int.from_bytes(digest, "little") % room


def group_key(device_names):
    """The collective group key of a set of devices, within one generation.

    A hash of the generation and the sorted device names, so every process (every worker
    of a multi-worker mesh) computes the same key for the same set whatever it built
    before. TF binds a group key to one device set for the life of the process: a set
    whose hash lands on another set's key takes the next free hash, with a warning (the
    processes then agree only if they meet the two sets in the same order).
    """
    members = tuple(sorted(device_names))
    with _lock:
        ident = (_generation, members)
        if ident not in _group_keys:
            key, attempt = _hashed_key(ident), 0
            while key in _group_owner:
                attempt += 1
                key = _hashed_key(ident + (attempt,))
            if attempt:
                log.warning("gspmd_tf: the group key of devices %s collided with another "
                            "device set's; it was moved, so processes that form these sets "
                            "in another order will disagree on it", members)
            _group_keys[ident], _group_owner[key] = key, ident
        return _group_keys[ident]


def generation():
    """How often group keys were retired; a program traced in an older generation holds
    retired keys and must be traced again before it runs."""
    return _generation


def retire_group_keys():
    """Give every device set a new group key from now on.

    A cancelled collective may leave its group cancelled inside TF (measured with TF
    2.21: when its group never completed, the next collective on that group key fails
    and aborts every collective of the process); fresh keys avoid those groups.
    """
    global _generation
    with _lock:
        _generation += 1


def program_fingerprint(program):
    """A digest of an SPMD program's structure, the same in every process that builds it.

    It covers every node's op, inputs, control inputs, local shapes, dtypes and gt.*
    params, not node names or TF attrs: names and function-valued attrs carry counters
    that differ between processes (__inference_f_123), and two programs alike but for
    their attrs run the same collectives on the same shapes, so sharing keys (and a lock,
    see ProgramKeys) is safe for them.
    """
    digest = hashlib.blake2b(digest_size=16)
    _digest_graph(digest, program)
    return digest.hexdigest()


def _digest_graph(digest, graph):
    """Feed a graph's structure (and its regions', in place) to `digest`."""
    for node in graph.nodes:
        digest.update(repr((
            node.op, [tuple(r) for r in node.inputs], node.control_inputs,
            node.out_shapes, [d.name for d in node.out_dtypes],
            sorted(node.params.items()))).encode())
        for region in node.regions:
            digest.update(b"region")
            _digest_graph(digest, region)
    digest.update(repr([tuple(r) for r in graph.outputs]).encode())


class ProgramKeys:
    """The collective instance keys of one SPMD program and the lock its calls hold.

    The i-th keyed collective of the program (in program order, the collectives of a
    control-flow op's bodies after the op: ir.walk) has instance key
    `first + i`, where `first` comes from the program's fingerprint: every process that
    builds the program gives it the same keys, whatever else it compiled and in what
    order. Programs with different fingerprints get disjoint key ranges in a process;
    programs with the same fingerprint share the keys and one lock, so their calls never
    overlap (a program's keys are fixed at trace time, and concurrent calls would mix up
    their collectives).
    """

    def __init__(self, program):
        # gt.Permute takes keys too: across workers its pairs are collectives, inside a
        # body it is pair_send / pair_receive
        nodes = [node for node in walk(program) if node.op in KEYED + (base.PERMUTE,)]
        # a permute inside a body sends both ways between two devices (a 2-cycle) in
        # two broadcasts of one group: the way back takes a key of its own, after all
        # the others
        names = [node.name for node in nodes] + [
            reverse_key_name(node.name) for node in nodes if node.op == base.PERMUTE]
        self.fingerprint = program_fingerprint(program)
        self.first, self.lock = _program_range(self.fingerprint, len(names))
        self._ordinal = {name: i for i, name in enumerate(names)}

    def instance_key(self, node_name):
        """The instance key of collective node `node_name`."""
        return self.first + self._ordinal[node_name]


def reverse_key_name(node_name):
    """The name ProgramKeys gives the key of a permute's copies from a higher device id
    to a lower one (pair_send / pair_receive), apart from the other way's."""
    return node_name + "#reverse"


def named_keys(name, count=1):
    """(first instance key, lock) of `count` keys reserved for the collectives of a
    helper outside any program (e.g. the workers' barrier), the same in every process."""
    return _program_range(("named", name), count)


def _program_range(fingerprint, count):
    """(first instance key, lock) of the programs with this fingerprint: a range of
    `count` keys from a hash of the fingerprint, moved (with a warning) only if it
    overlaps a range another program of this process holds."""
    with _lock:
        if fingerprint not in _program_keys:
            first, attempt = _hashed_key((fingerprint,), count), 0
            while _overlaps(first, first + count):
                attempt += 1
                first = _hashed_key((fingerprint, attempt), count)
            if attempt:
                log.warning("gspmd_tf: the collective instance keys of a program collided "
                            "with another program's; they were moved, so processes that "
                            "build these programs in another order will disagree on them")
            bisect.insort(_instance_ranges, (first, first + count))
            _program_keys[fingerprint] = (first, threading.Lock())
        return _program_keys[fingerprint]


def _overlaps(first, end):
    """Whether [first, end) meets a range already handed out."""
    i = bisect.bisect_left(_instance_ranges, (first, first))
    before = _instance_ranges[i - 1] if i else None
    after = _instance_ranges[i] if i < len(_instance_ranges) else None
    return (before is not None and before[1] > first) or (after is not None and after[0] < end)


def ordering_token(device_name):
    """The resource handle ordering the collectives of one device.

    Every collective of a device takes the same resource as its ordering_token, so
    they are chained in program order, as tf.distribute's CollectiveReplicaLauncher
    does: by tf.function's automatic control dependencies (control-flow bodies, the
    XLA backend), or by the local lowering itself, which chains a device's token users
    (backends/emitter.py, ordering.py). Without it, tf.function chains all
    stateful ops of all devices in one order, and the first collective waits forever for
    peers that are queued behind it. Created once per device, as a plain ResourceVariable
    so that no distribution strategy or Keras scope turns it into something else.
    """
    with _lock:
        if device_name not in _tokens:
            with ops.init_scope(), tf.device(device_name):
                _tokens[device_name] = resource_variable_ops.ResourceVariable(
                    0.0, trainable=False)
        return _tokens[device_name].handle


def rank_order(device_names):
    """The devices of a group in TF's collective rank order.

    Measured with TF 2.21: gather and all-to-all ranks follow the parsed device name
    (job, replica, task, type, index: CPU:2 before CPU:10), whatever order the members
    join in or the program lists them in.
    """
    return list(_rank_order(tuple(device_names)))


@functools.lru_cache(maxsize=None)
def _rank_order(device_names):
    """rank_order of a tuple of names, cached: the lowering asks it per collective per
    device, for the few groups of a mesh."""
    def key(name):
        spec = tf.DeviceSpec.from_string(name)
        return (spec.job or "", spec.replica or 0, spec.task or 0, spec.device_type or "",
                spec.device_index or 0)
    return tuple(sorted(device_names, key=key))


class Group:
    """One device's view of a collective group: keys, token and chunk orders.

    `names` are the members' device names in shard order. `rank_of_shard[s]` is the TF
    rank of shard s; `shard_of_rank[r]` the shard of TF rank r. `scalar(n)` gives the
    int32 tensor of a key or size (by default each op converts its own): a lowering
    that passes shared constants saves creating three per collective per device.
    """

    def __init__(self, names, instance_key, token, scalar=int):
        ranked = rank_order(names)
        self.size = len(names)
        self.rank_of_shard = [ranked.index(name) for name in names]
        self.shard_of_rank = [names.index(name) for name in ranked]
        self.kwargs = dict(group_size=scalar(self.size), group_key=scalar(group_key(names)),
                           instance_key=scalar(instance_key), ordering_token=[token])

    def all_reduce(self, x, reduce_op):
        """CollectiveReduceV2 of x with `reduce_op` (sum|max|min|prod)."""
        if reduce_op not in MERGE_OPS:
            raise ShardingError(f"unknown reduce_op {reduce_op!r}: use one of {list(MERGE_OPS)}")
        carried = carry(x)
        return restore(gen_collective_ops.collective_reduce_v2(
            carried, merge_op=MERGE_OPS[reduce_op], final_op="Id", **self.kwargs), x.dtype)

    def reduce_scatter(self, x, dim, reduce_op, shard):
        """Chunk `shard` along `dim` of the reduction of x.

        TF's CollectiveReduceScatterV2 has no CPU implementation in TF 2.21 (its param
        resolver finds no collective for it), so this is an all-reduce and a local slice:
        twice the traffic of a true reduce-scatter.
        """
        return chunk(self.all_reduce(x, reduce_op), dim, self.size, shard)

    def all_gather(self, x, dim):
        """Every member's x concatenated along `dim` in shard order.

        TF gathers along dim 0 in rank order: each member contributes x as one [1, ...]
        block; the blocks are put in shard order, then merged into `dim`.
        """
        shape = x.shape.as_list()
        blocks = gen_collective_ops.collective_gather_v2(
            tf.expand_dims(carry(x), 0), **self.kwargs)
        blocks.set_shape([self.size] + shape)
        return restore(_merge_leading(_pick(blocks, self.rank_of_shard), dim, shape), x.dtype)

    def all_to_all(self, x, split_dim, concat_dim):
        """Chunk s of x along split_dim goes to shard s; received chunks concat on concat_dim.

        TF's all-to-all needs dim 0 of size group_size (block r goes to rank r), so
        split_dim is split into [k, chunk] in place and the k axis moved to the front; the
        blocks go out in rank order and come back in shard order, merged into concat_dim.
        """
        k = self.size
        shape = x.shape.as_list()
        chunk = list(shape)
        chunk[split_dim] = _chunk_size(shape, split_dim, k)
        blocks = tf.reshape(carry(x), shape[:split_dim] + [k] + chunk[split_dim:])
        if split_dim:
            rank = len(shape) + 1
            blocks = tf.transpose(blocks,
                                  [split_dim] + [i for i in range(rank) if i != split_dim])
        received = gen_collective_ops.collective_all_to_all_v2(
            _pick(blocks, self.shard_of_rank), **self.kwargs)
        received.set_shape([k] + chunk)
        merged = _merge_leading(_pick(received, self.rank_of_shard), concat_dim, chunk)
        return restore(merged, x.dtype)


def pair_send(x, source, target, instance_key):
    """CollectiveBcastSendV2 of x from device `source` to device `target` (names), a
    group of the two: a point-to-point copy a function running on `source` alone can
    make (inside a loop body). Measured with TF 2.21: it completes without waiting for
    the receive, so sends and receives chained in any order on each device (a cyclic
    shift) do not deadlock; the op takes no ordering token."""
    return gen_collective_ops.collective_bcast_send_v2(
        carry(x), group_size=2, group_key=group_key([source, target]),
        instance_key=instance_key)


def pair_receive(shape, dtype, source, target, instance_key):
    """The tensor of `shape` and `dtype` that pair_send sends from `source` to `target`,
    received on `target`."""
    received = gen_collective_ops.collective_bcast_recv_v2(
        group_size=2, group_key=group_key([source, target]), instance_key=instance_key,
        shape=list(shape), T=CARRIERS.get(dtype, dtype))
    received.set_shape(shape)
    return restore(received, dtype)


def chunk(x, dim, k, index):
    """Chunk `index` of k equal chunks of x along `dim`."""
    begin = [0] * x.shape.rank
    size = [-1] * x.shape.rank
    size[dim] = _chunk_size(x.shape.as_list(), dim, k)
    begin[dim] = index * size[dim]
    return tf.slice(x, begin, size)


def carry(x):
    """x in a dtype TF's collectives accept."""
    return tf.cast(x, CARRIERS[x.dtype]) if x.dtype in CARRIERS else x


def restore(x, dtype):
    """x back in `dtype` after carry."""
    return x if x.dtype == dtype else tf.cast(x, dtype)


def _chunk_size(shape, dim, k):
    """Size of one of k equal chunks of dim `dim`."""
    if shape[dim] is None or shape[dim] % k:
        raise ShardingError(
            f"cannot split dim {dim} of local shape {shape} into {k} equal chunks: the "
            "partitioner must pad it to a multiple of the group size")
    return shape[dim] // k


def _pick(x, order):
    """x[order[0]], x[order[1]], ... along dim 0 (no op for the identity order)."""
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


class Watchdog:
    """Cancels a guarded call that runs past its deadline.

    TF's own per-op timeout_seconds starts a detached thread per collective per device
    per call, each sleeping for the whole timeout (measured: 2 per device per collective
    with TF 2.21), so a test suite with a 60 s timeout can run out of threads; and on
    expiry it aborts every collective of the process for good, as abort_collective_ops
    does. One watchdog thread per process instead cancels the late call through its
    CancellationManager: TF then fails that call's pending collectives without aborting
    the process's collective executor, and retire_group_keys steers later programs away
    from the groups the call left behind. Measured with TF 2.21: collectives of any
    group work after such a cancellation. Should a cancelled call still not return
    within `grace` seconds, the watchdog falls back to abort_collective_ops, after which
    this process can run no more collectives.
    """

    def __init__(self, grace=30.0):
        self._cond = threading.Condition()
        self._calls = {}
        self._keys = itertools.count()
        self._thread = None
        self.grace = grace

    @contextlib.contextmanager
    def guard(self, seconds, what):
        """Runs the body with a deadline of `seconds` (none when seconds <= 0).

        Yields a GuardedCall whose `manager` the body must run its TF function under,
        or None without a deadline.
        """
        if seconds <= 0:
            yield None
            return
        call = GuardedCall(time.monotonic() + seconds, what, seconds)
        with self._cond:
            key = next(self._keys)
            self._calls[key] = call
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="gspmd-tf-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield call
        finally:
            with self._cond:
                self._calls.pop(key, None)

    def _watch(self):
        with self._cond:
            while True:
                if not self._calls:
                    self._cond.wait()
                    continue
                key, call = min(self._calls.items(), key=lambda item: item[1].deadline)
                delay = call.deadline - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                if not call.timed_out:
                    call.timed_out = True
                    call.deadline = time.monotonic() + self.grace
                    retire_group_keys()
                    call.manager.start_cancel()
                    continue
                del self._calls[key]
                context.context().abort_collective_ops(
                    errors.DEADLINE_EXCEEDED,
                    f"gspmd-tf: {call.what} did not finish in {call.seconds:g} s and could "
                    "not be cancelled; collectives are aborted for the rest of this process: "
                    "restart it")


_PEER_LOST = ("a worker of the cluster may have died or be unreachable; this worker's "
              "collective keys have moved on, so restart every worker (from the last "
              "checkpoint).")


class GuardedCall:
    """One call under the watchdog: its CancellationManager and whether it timed out."""

    def __init__(self, deadline, what, seconds):
        self.deadline = deadline
        self.what = what
        self.seconds = seconds
        self.manager = cancellation.CancellationManager()
        self.timed_out = False

    def timeout_error(self):
        """The DeadlineExceededError to raise for this call."""
        joined = cluster.current()
        after = ("later calls run normally." if joined is None or joined.num_workers == 1
                 else _PEER_LOST)
        return errors.DeadlineExceededError(
            None, None,
            f"{self.what} did not finish within {self.seconds:g} s, so it was cancelled: a "
            "collective waited for peers that did not come (or the program is slower than "
            "the limit: raise it with collective_timeout= or GSPMD_TF_COLLECTIVE_TIMEOUT). "
            f"Variables it assigns may be partly updated; {after}")


    def peer_lost_error(self, error):
        """The error to raise for this call when TF's runtime reports a worker of the
        cluster unreachable (an UnavailableError) before the timeout; None on one
        worker (the error is TF's own then)."""
        joined = cluster.current()
        if (not isinstance(error, errors.UnavailableError) or joined is None
                or joined.num_workers == 1):
            return None
        first = (error.message or "").strip().splitlines()[:1]
        return errors.UnavailableError(
            None, None, f"{self.what} failed: {_PEER_LOST} (TF: {first[0] if first else ''})")


watchdog = Watchdog()


_barriers = {}  # this worker's first device -> the traced barrier function


def barrier():
    """Returns once every worker of the cluster (cluster.py) has called it: an all-reduce
    of one number between the first devices of every worker, under the collective
    timeout (GSPMD_TF_COLLECTIVE_TIMEOUT) so that a dead worker makes it fail instead of
    hang."""
    joined = cluster.current()
    if joined is None or joined.num_workers == 1:
        return
    firsts = {}  # task -> its first device
    for name in cluster.global_device_names(
            d.name for d in tf.config.list_logical_devices()):
        firsts.setdefault(cluster.task_of(name), name)
    names = list(firsts.values())
    own = firsts[joined.task_index]
    if own not in _barriers:
        instance_key, _ = named_keys("barrier")
        group = Group(names, instance_key, ordering_token(own))
        group.kwargs["timeout_seconds"] = default_timeout()

        def wait():
            with tf.device(own):
                return group.all_reduce(tf.constant(1.0), "sum")
        _barriers[own] = tf.function(wait, autograph=False)
    arrived = int(_barriers[own]().numpy())
    if arrived != joined.num_workers:
        raise ShardingError(f"barrier: {arrived} of {joined.num_workers} workers arrived")
