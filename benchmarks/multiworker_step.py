"""FFN training step on 2 worker processes vs one process, and vs MultiWorkerMirroredStrategy.

    .venv/bin/python benchmarks/multiworker_step.py --steps=10 --warmup=3

The step is benchmarks/train_step.py's (Transformer feed-forward blocks, SGD on every
weight; same flags for the model size). Systems (--run picks some), each in its own
processes on free localhost ports, all started first:
  one      gspmd-tf in ONE process with as many logical CPU devices as the --mesh
           (default (2, 4), axes ("data", "model")), Megatron specs as in train_step.py
  workers  gspmd-tf on --workers processes x --local_devices devices each (or one count
           per worker: --local_devices=4,2), joined by gt.initialize_cluster
           (TF_CONFIG), the same mesh spanning them: the collectives between workers go
           over TF's gRPC collective runtime
  mwms     tf.distribute.MultiWorkerMirroredStrategy on --workers processes: data
           parallel, one replica per worker (MWMS uses one CPU device per worker), each
           on its half of the batch, gradients averaged by its all-reduce
After --warmup untimed steps each, the steps alternate between the systems (one, workers,
mwms, one, ...), as in train_step.py, so that all see the same machine load; the
processes of the systems not stepping wait idle. A timed step ends when the loss is on
the host of every worker of the system; its time is the slowest worker's. The table
gives the median step, the ratio of medians to "one", the median over rounds of the
paired ratio (step / "one"'s step in that round), and the final loss of every system
after the same number of steps from the same start (the systems compute the same SGD,
so the losses agree to float32 round-off).

--model=halo times instead a training step of --conv_layers 3x3 SAME convolutions
(tanh, replicated kernels, SGD) on an image batch P("model", "data"): the height is
split over "data", the axis spanning the workers, so every halo exchange (gt.Permute)
crosses the processes, as the pair gathers of docs/DESIGN_LOG.md, "Multi-worker"
(--run=one,workers: MWMS has no spatial partitioning to compare).

    .venv/bin/python benchmarks/multiworker_step.py --model=halo --run=one,workers

All processes share the host's cores, so this measures the cost of the multi-process
runtime (gRPC between processes instead of in-process copies), not a speed-up.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

import train_step  # noqa: E402  (its model flags and step)

WORKERS = flags.DEFINE_integer("workers", 2, "worker processes")
LOCAL_DEVICES = flags.DEFINE_list("local_devices", ["4"], "logical CPU devices per worker: "
                                  "one count for every worker, or one per worker")
SYSTEMS_RUN = flags.DEFINE_string("run", "one,workers,mwms", "systems to run, in order")
ROLE = flags.DEFINE_string("role", "", "internal: the system this process runs")
TIMEOUT = flags.DEFINE_integer("timeout", 900, "seconds a system may take")
MODEL = flags.DEFINE_enum("model", "ffn", ["ffn", "halo"], "the step to time")
IMAGE = flags.DEFINE_string("image", "8,64,64,16", "--model=halo: batch,height,width,"
                            "channels")
CONV_LAYERS = flags.DEFINE_integer("conv_layers", 4, "--model=halo: convolutions")

FLAGS = flags.FLAGS


def mesh_shape():
    """--mesh (train_step.py's flag) as a tuple of ints."""
    return tuple(int(n) for n in train_step.MESH.value.split(","))


def local_device_counts():
    """--local_devices as one count per worker."""
    counts = [int(n) for n in LOCAL_DEVICES.value]
    if len(counts) == 1:
        return counts * WORKERS.value
    if len(counts) != WORKERS.value:
        raise app.UsageError(f"--local_devices={','.join(LOCAL_DEVICES.value)}: give one "
                             f"count or one per worker ({WORKERS.value})")
    return counts


def problem():
    """(initial weight values, x, target) drawn from seed 0, as train_step.py does."""
    rng = np.random.default_rng(0)
    values = train_step.init_values(rng, FLAGS.layers, FLAGS.d_model, FLAGS.d_ff)
    shape = (FLAGS.batch, FLAGS.seq, FLAGS.d_model)
    x = rng.standard_normal(shape).astype(np.float32)
    target = rng.standard_normal(shape).astype(np.float32)
    return values, x, target


def serve(run):
    """Worker side: --warmup steps of run() -> loss, then "ready"; then one timed step
    per "step" line on stdin, answered by a JSON line {"seconds", "loss"}, until EOF."""
    for _ in range(FLAGS.warmup):
        run()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        loss = run()
        print(json.dumps({"seconds": time.perf_counter() - start, "loss": loss}),
              flush=True)


def run_gspmd(multi_worker):
    """gspmd-tf's step on the --mesh, in one process or on this cluster's workers."""
    import gspmd_tf as gt
    if multi_worker:
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        gt.configure_cpu_devices(local_device_counts()[task])
        gt.initialize_cluster()
    else:
        gt.configure_cpu_devices(int(np.prod(mesh_shape())))
    import tensorflow as tf
    from gspmd_tf.layout import Layout
    P = gt.P
    mesh = gt.Mesh.create(mesh_shape(), train_step.AXES)
    if MODEL.value == "halo":
        return halo_step(gt, tf, mesh)
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model"), "b2": P()}
    values, x, target = problem()
    variables = [{n: gt.Variable(layer[n], mesh, specs[n], name=f"{n}_{i}")
                  for n in train_step.NAMES} for i, layer in enumerate(values)]
    step = gt.function(train_step.make_step(tf, variables, FLAGS.lr), mesh=mesh,
                       in_shardings=(P("data"), P("data")))
    # placed once, each worker its own shards, as train_step.py places them
    layout = Layout.from_spec(mesh, P("data"), 3, "the batch")
    x, target = (gt.ShardedTensor.from_value(v, mesh, layout) for v in (x, target))
    return lambda: float(step(x, target).numpy())


def halo_step(gt, tf, mesh):
    """--model=halo: run() of the convolutions' training step, the image's height split
    over "data" (across the workers), its batch over "model"."""
    from gspmd_tf.layout import Layout
    batch, height, width, channels = (int(v) for v in IMAGE.value.split(","))
    rng = np.random.default_rng(0)
    shape = (batch, height, width, channels)
    x = rng.standard_normal(shape).astype(np.float32)
    target = rng.standard_normal(shape).astype(np.float32)
    kernels = [gt.Variable((rng.standard_normal((3, 3, channels, channels)) /
                            np.sqrt(9 * channels)).astype(np.float32), mesh, gt.P(),
                           name=f"kernel_{i}") for i in range(CONV_LAYERS.value)]

    def step(x, target):
        with tf.GradientTape() as tape:
            h = x
            for kernel in kernels:
                h = tf.tanh(tf.nn.conv2d(h, kernel, 1, "SAME"))
            loss = tf.reduce_mean(tf.square(h - target))
        for kernel, grad in zip(kernels, tape.gradient(loss, kernels)):
            kernel.assign_sub(FLAGS.lr * grad)
        return loss
    spec = gt.P("model", "data")
    function = gt.function(step, mesh=mesh, in_shardings=(spec, spec))
    layout = Layout.from_spec(mesh, spec, 4, "the image")
    x, target = (gt.ShardedTensor.from_value(v, mesh, layout) for v in (x, target))
    kinds = [c.kind for c in function.lower(x, target).collectives()]
    print(f"note: collectives per step {sorted((k, kinds.count(k)) for k in set(kinds))}",
          flush=True)
    return lambda: float(function(x, target).numpy())


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
    return lambda: float(step(x, target).numpy())


class System:
    """The processes of one system, started with --role; step() runs one timed step on
    all of them and returns (slowest worker's seconds, loss)."""

    def __init__(self, name):
        self.name = name
        workers = 1 if name == "one" else WORKERS.value
        from gspmd_tf.cluster import loopback_addresses
        addresses = loopback_addresses(workers)
        args = [a for a in sys.argv[1:] if not a.startswith(("--role", "--run"))]
        self.runs, self.logs = [], []
        for task in range(workers):
            config = {"cluster": {"worker": addresses},
                      "task": {"type": "worker", "index": task}}
            env = dict(os.environ, PYTHONPATH=ROOT, TF_CONFIG=json.dumps(config))
            if name == "one":
                del env["TF_CONFIG"]
            self.logs.append(tempfile.TemporaryFile("w+"))  # TF's log lines, for errors
            self.runs.append(subprocess.Popen(
                [sys.executable, __file__, f"--role={name}"] + args, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self.logs[-1], text=True, env=env))

    def _reply(self, task):
        line = self.runs[task].stdout.readline()
        if not line:
            self.logs[task].seek(0)
            raise SystemExit(f"{self.name} worker {task} failed:\n"
                             f"{self.logs[task].read()[-3000:]}")
        return line

    def wait_ready(self):
        """Waits for every worker's "ready"; prints task 0's "note:" lines before it."""
        for task in range(len(self.runs)):
            while (line := self._reply(task).strip()) != "ready":
                if task == 0 and line.startswith("note:"):
                    print(f"{self.name}: {line[5:].strip()}\n")

    def step(self):
        for run in self.runs:
            run.stdin.write("step\n")
            run.stdin.flush()
        replies = [json.loads(self._reply(task)) for task in range(len(self.runs))]
        return max(r["seconds"] for r in replies), replies[0]["loss"]

    def close(self):
        for run in self.runs:
            run.stdin.close()
            run.wait(timeout=TIMEOUT.value)


def main(argv):
    del argv
    if ROLE.value:
        serve(run_mwms() if ROLE.value == "mwms"
              else run_gspmd(multi_worker=ROLE.value == "workers"))
        return
    import tensorflow as tf
    counts = local_device_counts()
    model = (f"layers={FLAGS.layers} batch={FLAGS.batch} seq={FLAGS.seq} "
             f"d_model={FLAGS.d_model} d_ff={FLAGS.d_ff}" if MODEL.value == "ffn" else
             f"conv_layers={CONV_LAYERS.value} image={IMAGE.value} P('model', 'data')")
    print(f"# {MODEL.value} training step: one process vs {WORKERS.value} worker "
          "processes (vs MultiWorkerMirroredStrategy)\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, TF {tf.__version__}, "
          f"load average at start {os.getloadavg()[0]:.2f}; {model}; {FLAGS.warmup} "
          f"warm-up + {FLAGS.steps} timed steps each\n", flush=True)
    per_worker = counts[0] if len(set(counts)) == 1 else " + ".join(map(str, counts))
    labels = {"one": f"gspmd-tf, 1 process x {int(np.prod(mesh_shape()))} devices, mesh "
                     f"{mesh_shape()}",
              "workers": f"gspmd-tf, {WORKERS.value} processes x {per_worker} devices, "
                         f"mesh {mesh_shape()}",
              "mwms": f"MultiWorkerMirroredStrategy, {WORKERS.value} processes, data "
                      "parallel (1 CPU replica each)"}
    systems = [System(name) for name in SYSTEMS_RUN.value.split(",") if name]
    try:
        for system in systems:
            system.wait_ready()
        times = {system.name: [] for system in systems}
        losses = {}
        for _ in range(FLAGS.steps):
            for system in systems:
                seconds, losses[system.name] = system.step()
                times[system.name].append(seconds)
    finally:
        for system in systems:
            system.close()
    base = times.get("one")
    print("| system | median step ms | ratio to one process (medians) | paired ratio "
          "(median over rounds) | final loss |")
    print("|---|---:|---:|---:|---:|")
    for name, steps in times.items():
        ms = statistics.median(steps) * 1e3
        ratio = f"{statistics.median(steps) / statistics.median(base):.2f}" if base else "-"
        paired = (f"{statistics.median(t / b for t, b in zip(steps, base)):.2f}"
                  if base else "-")
        print(f"| {labels[name]} | {ms:.1f} | {ratio} | {paired} | {losses[name]:.7g} |")

if __name__ == "__main__":
    app.run(main)
