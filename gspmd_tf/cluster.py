"""Multi-worker: this process as one task of a TF cluster, so a mesh spans every worker.

`gt.initialize_cluster()` reads TF's standard TF_CONFIG (or takes the same as arguments)
and starts this process's gRPC server with TF's collective ops and coordination service
enabled, the way tf.distribute.MultiWorkerMirroredStrategy does: collective ops then run
between devices of all workers, over gRPC, and every worker knows the devices of all
(however many each has). Every worker runs the same program (multi-client SPMD); each
emits and runs only its own devices' part (see docs/DESIGN_LOG.md, "Multi-worker").
"""

from __future__ import annotations

import json
import os
import socket

from gspmd_tf.errors import ShardingError
from gspmd_tf.timeouts import default_timeout

JOB = "worker"
# The task whose collective executor resolves every group (TF's collective_leader).
LEADER_TASK = 0


class Cluster:
    """The workers' addresses and this process's task index."""

    def __init__(self, workers, task_index):
        self.workers = tuple(workers)
        self.task_index = task_index

    @property
    def num_workers(self):
        """How many worker processes run the program."""
        return len(self.workers)

    def device_prefix(self, task):
        """The TF device name prefix of task `task`'s devices."""
        return f"/job:{JOB}/replica:0/task:{task}"

    def __repr__(self):
        return f"<Cluster task {self.task_index} of {self.num_workers}: {list(self.workers)}>"


_cluster = None


def current():
    """The Cluster this process joined with initialize_cluster, or None (one process)."""
    return _cluster


def initialize_cluster(cluster=None, task_index=None):
    """Join this process to a cluster of worker processes; call it before TF starts.

    `cluster` is {"worker": ["host:port", ...]} (or the list of addresses) and
    `task_index` this process's index in it; without them both come from the TF_CONFIG
    environment variable, `{"cluster": {"worker": [...]}, "task": {"type": "worker",
    "index": i}}`. Call gt.configure_cpu_devices(n) first for n local devices; workers
    may have different numbers. It returns once every worker has joined: a worker that
    has not started within the collective timeout (GSPMD_TF_COLLECTIVE_TIMEOUT, default
    300 s) makes it raise DeadlineExceededError. Afterwards gt.Mesh.create spans the
    devices of all workers, worker-major (global device id = the number of devices of
    the earlier workers + local id; task * n + local id when each has n), and every
    worker must run the same gt.functions in the same order. Returns the Cluster.
    """
    global _cluster
    workers, task = _parse(cluster, task_index)
    if _cluster is not None:
        if (_cluster.workers, _cluster.task_index) == (tuple(workers), task):
            return _cluster
        raise ShardingError(f"initialize_cluster: this process already joined {_cluster}; "
                            "a process can join one cluster, once")
    import tensorflow as tf  # late: importing gspmd_tf must not start TF
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    if ctx._context_handle is not None:  # pylint: disable=protected-access
        raise ShardingError(
            "initialize_cluster: TensorFlow already started in this process (an op ran or "
            "its devices were listed); call gt.configure_cpu_devices(n) and then "
            "gt.initialize_cluster() first thing, before any TensorFlow op")
    port = _port_of(workers[task])
    spec = tf.train.ClusterSpec({JOB: list(workers)})
    leader = f"/job:{JOB}/replica:0/task:{LEADER_TASK}"
    ctx.configure_collective_ops(collective_leader=leader,
                                 device_filters=(f"/job:{JOB}/task:{task}",))
    # TF's coordination service, as MultiWorkerMirroredStrategy configures it: each worker
    # then lists the devices of all workers, however many each has (global_device_names).
    # Registering waits at a barrier for every worker, under the collective timeout
    # (without the barrier the leader would wait for a missing worker forever).
    timeout = default_timeout()
    ctx.configure_coordination_service(
        service_type="standalone", service_leader=leader,
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name=JOB,
                                                                 num_tasks=len(workers))],
        cluster_register_timeout_in_ms=int(timeout * 1000))
    ctx.coordination_service.cluster_register_with_barrier = True
    server = tensorflow_server_pb2.ServerDef(
        cluster=spec.as_cluster_def(), default_session_config=ctx.config, job_name=JOB,
        task_index=task, protocol="grpc", port=port)
    try:
        ctx.enable_collective_ops(server)
        ctx.ensure_initialized()
    except tf.errors.DeadlineExceededError as e:
        raise tf.errors.DeadlineExceededError(
            None, None,
            f"initialize_cluster: the {len(workers)} workers {list(workers)} did not all "
            f"start within {timeout:g} s (GSPMD_TF_COLLECTIVE_TIMEOUT): start every worker "
            f"of the cluster, or raise the limit. TensorFlow said: {e.message}") from None
    _cluster = Cluster(workers, task)
    return _cluster


def global_device_names(names):
    """`names` (TF's logical devices) in the order of global device ids: worker-major.

    After gt.initialize_cluster TF lists the devices of every worker, however many each
    has (its coordination service gathers them at startup); ordered by (task, device
    type, index), the position of a device is the number of devices of earlier workers
    plus its local index (task * n + local index when every worker has n), the same in
    every process. Without a cluster, `names` unchanged (TF's order).
    """
    if _cluster is None:
        return list(names)
    import tensorflow as tf

    def rank(name):
        spec = tf.DeviceSpec.from_string(name)
        return spec.task or 0, spec.device_type or "", spec.device_index or 0
    return sorted(names, key=rank)


def task_of(device_name):
    """The worker task of a device name (0 without a cluster)."""
    if _cluster is None:
        return 0
    import tensorflow as tf
    return tf.DeviceSpec.from_string(device_name).task or 0


def is_addressable(device_name):
    """True when `device_name` is a device of this process."""
    return _cluster is None or task_of(device_name) == _cluster.task_index


def loopback_addresses(count):
    """`count` "localhost:PORT" worker addresses on ports that were free a moment ago: a
    cluster of worker processes on this host (tests, benchmarks, trying a multi-worker
    script without several machines)."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return [f"localhost:{port}" for port in ports]


def _parse(cluster, task_index):
    """(worker addresses, task index) from the arguments or TF_CONFIG, checked."""
    if cluster is None and task_index is None:
        text = os.environ.get("TF_CONFIG")
        if not text:
            raise ShardingError(
                "initialize_cluster: no cluster given and TF_CONFIG is not set; set "
                'TF_CONFIG=\'{"cluster": {"worker": ["host:port", ...]}, "task": '
                '{"type": "worker", "index": i}}\' or pass cluster= and task_index=')
        try:
            config = json.loads(text)
        except ValueError as e:
            raise ShardingError(f"initialize_cluster: TF_CONFIG is not JSON ({e})") from None
        if not isinstance(config, dict) or not isinstance(config.get("task"), dict):
            raise ShardingError(
                "initialize_cluster: TF_CONFIG needs a \"cluster\" and a \"task\" "
                f'({{"type": "worker", "index": i}}) entry, got {text!r}')
        kind = config["task"].get("type")
        if kind != JOB:
            raise ShardingError(
                f"initialize_cluster: TF_CONFIG task type {kind!r}: gspmd-tf runs every "
                "process as a \"worker\" (no chief, ps or evaluator tasks)")
        cluster, task_index = config.get("cluster"), config["task"].get("index")
    if cluster is None or task_index is None:
        raise ShardingError("initialize_cluster: give both cluster= and task_index=")
    workers = cluster.get(JOB) if isinstance(cluster, dict) else cluster
    if isinstance(cluster, dict) and set(cluster) - {JOB}:
        raise ShardingError(
            f"initialize_cluster: cluster jobs {sorted(cluster)}: gspmd-tf runs only "
            "\"worker\" tasks; list every process under \"worker\"")
    if not isinstance(workers, (list, tuple)) or not workers or \
            not all(isinstance(w, str) and ":" in w for w in workers):
        raise ShardingError(
            f"initialize_cluster: cluster {cluster!r}: give the workers as a non-empty list "
            "of \"host:port\" strings")
    if len(set(workers)) != len(workers):
        raise ShardingError(f"initialize_cluster: workers {list(workers)} repeat an address")
    if isinstance(task_index, bool) or not isinstance(task_index, int) or \
            not 0 <= task_index < len(workers):
        raise ShardingError(
            f"initialize_cluster: task index {task_index!r} is not one of the "
            f"{len(workers)} workers' (0..{len(workers) - 1})")
    _port_of(workers[task_index])
    return list(workers), task_index


def _port_of(address):
    """The port of a "host:port" address; ShardingError if it has none."""
    try:
        return int(address.rsplit(":", 1)[1])
    except ValueError:
        raise ShardingError(f"initialize_cluster: worker address {address!r} has no port "
                            "number (give \"host:port\")") from None
