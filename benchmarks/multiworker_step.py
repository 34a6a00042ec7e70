"""FFN training step on 2 worker processes vs one process, and vs MultiWorkerMirroredStrategy.

    .venv/bin/python benchmarks/multiworker_step.py --steps=10 --warmup=3

The step is benchmarks/train_step.py's (Transformer feed-forward blocks, SGD on every
weight; same flags for the model size). Systems, run one after the other (each in fresh
processes on free localhost ports; --systems picks some):
  one      gspmd-tf in ONE process with workers * local_devices logical CPU devices,
           mesh (2, 4) ("data", "model"), Megatron specs as in train_step.py
  workers  gspmd-tf on --workers processes x --local_devices devices each, joined by
           gt.initialize_cluster (TF_CONFIG), the same mesh shape spanning them: the
           collectives between workers go over TF's gRPC collective runtime
  mwms     tf.distribute.MultiWorkerMirroredStrategy on --workers processes: data
           parallel, one replica per worker (MWMS uses one CPU device per worker), each
           on its half of the batch, gradients averaged by its all-reduce
A timed step ends when the loss is on the host (of every worker). Each process reports
its step times; the table gives the median over steps of the slowest worker's time, and
the final loss of every system after the same number of steps from the same start (the
systems compute the same SGD, so the losses agree to float32 round-off).

All processes share the host's cores, so this measures the cost of the multi-process
runtime (gRPC between processes instead of in-process copies), not a speed-up.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

import train_step  # noqa: E402  (its model flags and step)

WORKERS = flags.DEFINE_integer("workers", 2, "worker processes")
LOCAL_DEVICES = flags.DEFINE_integer("local_devices", 4, "logical CPU devices per worker")
SYSTEMS_RUN = flags.DEFINE_string("run", "one,workers,mwms", "systems to run, in order")
ROLE = flags.DEFINE_string("role", "", "internal: the system this process runs")
TIMEOUT = flags.DEFINE_integer("timeout", 900, "seconds a system may take")

FLAGS = flags.FLAGS
MESH_SHAPE = (2, 4)


def free_ports(count):
    """`count` localhost ports that were free a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def problem():
    """(initial weight values, x, target) drawn from seed 0, as train_step.py does."""
    rng = np.random.default_rng(0)
    values = train_step.init_values(rng, FLAGS.layers, FLAGS.d_model, FLAGS.d_ff)
    shape = (FLAGS.batch, FLAGS.seq, FLAGS.d_model)
    x = rng.standard_normal(shape).astype(np.float32)
    target = rng.standard_normal(shape).astype(np.float32)
    return values, x, target


def timed(run):
    """Warm-up, then timed steps of run() -> loss; {"times": [s], "loss": last loss}."""
    for _ in range(FLAGS.warmup):
        run()
    times = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        loss = run()
        times.append(time.perf_counter() - start)
    return {"times": times, "loss": loss}


def run_gspmd(multi_worker):
    """gspmd-tf's step on the (2, 4) mesh, in one process or on this cluster's workers."""
    import gspmd_tf as gt
    if multi_worker:
        gt.configure_cpu_devices(LOCAL_DEVICES.value)
        gt.initialize_cluster()
    else:
        gt.configure_cpu_devices(int(np.prod(MESH_SHAPE)))
    import tensorflow as tf
    from gspmd_tf.layout import Layout
    P = gt.P
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model"), "b2": P()}
    values, x, target = problem()
    mesh = gt.Mesh.create(MESH_SHAPE, train_step.AXES)
    variables = [{n: gt.Variable(layer[n], mesh, specs[n], name=f"{n}_{i}")
                  for n in train_step.NAMES} for i, layer in enumerate(values)]
    step = gt.function(train_step.make_step(tf, variables, FLAGS.lr), mesh=mesh,
                       in_shardings=(P("data"), P("data")))
    # placed once, each worker its own shards, as train_step.py places them
    layout = Layout.from_spec(mesh, P("data"), 3, "the batch")
    x, target = (gt.ShardedTensor.from_value(v, mesh, layout) for v in (x, target))
    return timed(lambda: float(step(x, target).numpy()))


def run_mwms():
    """MultiWorkerMirroredStrategy's data-parallel step on this cluster's workers."""
    import tensorflow as tf
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    replicas = strategy.num_replicas_in_sync
    values, x, target = problem()
    rows = FLAGS.batch // replicas
    x, target = (tf.constant(v[task * rows:(task + 1) * rows]) for v in (x, target))
    with strategy.scope():
        # MEAN: an update in replica context is averaged over the replicas (one
        # all-reduce per variable), which makes the local gradients' SGD data parallel
        variables = [{n: tf.Variable(layer[n], name=f"{n}_{i}",
                                     aggregation=tf.VariableAggregation.MEAN)
                      for n in train_step.NAMES} for i, layer in enumerate(values)]
    replica_step = train_step.make_step(tf, variables, FLAGS.lr)

    @tf.function
    def step(x, target):
        losses = strategy.run(replica_step, args=(x, target))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)
    return timed(lambda: float(step(x, target).numpy()))


def launch(system):
    """Runs `system` in fresh processes; returns their reports."""
    workers = 1 if system == "one" else WORKERS.value
    addresses = [f"localhost:{port}" for port in free_ports(workers)]
    args = [a for a in sys.argv[1:] if not a.startswith(("--role", "--run"))]
    runs = []
    for task in range(workers):
        config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": task}}
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CONFIG=json.dumps(config))
        if system == "one":
            del env["TF_CONFIG"]
        runs.append(subprocess.Popen([sys.executable, __file__, f"--role={system}"] + args,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env))
    reports = []
    for task, run in enumerate(runs):
        out, err = run.communicate(timeout=TIMEOUT.value)
        if run.returncode:
            raise SystemExit(f"{system} worker {task} failed:\n{err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def main(argv):
    del argv
    if ROLE.value:
        report = (run_mwms() if ROLE.value == "mwms"
                  else run_gspmd(multi_worker=ROLE.value == "workers"))
        print(json.dumps(report), flush=True)
        return
    import tensorflow as tf
    devices = WORKERS.value * LOCAL_DEVICES.value
    print(f"# FFN training step: one process vs {WORKERS.value} worker processes vs "
          "MultiWorkerMirroredStrategy\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, TF {tf.__version__}, "
          f"load average at start {os.getloadavg()[0]:.2f}; layers={FLAGS.layers} "
          f"batch={FLAGS.batch} seq={FLAGS.seq} d_model={FLAGS.d_model} d_ff={FLAGS.d_ff}; "
          f"{FLAGS.warmup} warm-up + {FLAGS.steps} timed steps each\n", flush=True)
    labels = {"one": f"gspmd-tf, 1 process x {devices} devices, mesh {MESH_SHAPE}",
              "workers": f"gspmd-tf, {WORKERS.value} processes x {LOCAL_DEVICES.value} "
                         f"devices, mesh {MESH_SHAPE}",
              "mwms": f"MultiWorkerMirroredStrategy, {WORKERS.value} processes, data "
                      "parallel (1 CPU replica each)"}
    rows = {}
    for system in [s for s in SYSTEMS_RUN.value.split(",") if s]:
        reports = launch(system)
        slowest = [max(r["times"][i] for r in reports) for i in range(FLAGS.steps)]
        rows[system] = (statistics.median(slowest) * 1e3, reports[0]["loss"])
    base = rows.get("one", (None,))[0]
    print("| system | median step ms | ratio to one process | final loss |")
    print("|---|---:|---:|---:|")
    for system, (ms, loss) in rows.items():
        ratio = f"{ms / base:.2f}" if base else "-"
        print(f"| {labels[system]} | {ms:.1f} | {ratio} | {loss:.7g} |")


if __name__ == "__main__":
    app.run(main)
