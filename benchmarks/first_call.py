"""Where the first call of a training step goes: the local backend's stages beside
single-device TF's, each as wall time and as this process's CPU time.

    .venv/bin/python benchmarks/first_call.py --layers=64 --systems=local,single
    .venv/bin/python benchmarks/first_call.py --layers=64 --d_model=64 --d_ff=256 \
        --batch=2 --seq=8          # tiny tensors: the first execution is all overhead

The model and the flags (--layers, --batch, --seq, --d_model, --d_ff, --mesh, --lr) are
benchmarks/train_step.py's: a stack of feed-forward blocks, one SGD step. Stages:
  local:  variables (gt.Variables), lower (trace, import, propagate, partition),
          build (the per-device tf.function graph), first execution (TF's function
          instantiation: placement, grappler, partitioning, kernels; and the step)
  single: variables (tf.Variables), trace (tf.function's concrete function), first
          execution (instantiation, grappler, the step)
then --steps steady steps (median). --systems takes local and single. CPU time is process time over all threads: on a
loaded machine it moves less than wall time, which there mostly measures waiting; during
an execution it also counts the kernels' worker threads.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import train_step  # noqa: E402  (defines the model's flags)

# --systems and --steps are train_step.py's flags, with defaults for this script
flags.FLAGS.set_default("systems", "local,single")
flags.FLAGS.set_default("steps", 2)
STAGED = ("local", "single")


class Stages:
    """Wall and CPU seconds of named stages, in order."""

    def __init__(self):
        self.rows = []

    def time(self, name, fn):
        """Runs fn(), records its wall and process CPU seconds under `name`; returns its
        result."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        self.rows.append((name, time.perf_counter() - wall, time.process_time() - cpu))
        return out


def run_local(gt, tf, stages):
    """The local backend's stages; returns the step function."""
    specs, values, x, target = train_step.make_problem(gt)
    shape = tuple(int(s) for s in train_step.MESH.value.split(","))
    mesh = gt.Mesh.create(shape, train_step.AXES)
    gvars = stages.time("variables", lambda: [
        {n: gt.Variable(layer[n], mesh, specs[n], name=f"{n}_{i}") for n in train_step.NAMES}
        for i, layer in enumerate(values)])
    gstep = gt.function(train_step.make_step(tf, gvars, train_step.LR.value), mesh=mesh,
                        in_shardings=(gt.P("data"), gt.P("data")), backend="local")
    lowered = stages.time("lower (trace, import, propagate, partition)", lambda: gstep.lower(
        tf.TensorSpec(x.shape, tf.float32), tf.TensorSpec(target.shape, tf.float32)))
    args = [gt.ShardedTensor.from_value(v, mesh, s.to_layout(mesh, v.ndim))
            for v, s in zip((x, target), lowered.input_shardings)]
    stages.time("build (per-device tf.function graph)", lowered.compile)
    return lambda: float(gstep(*args).numpy())


def run_single(gt, tf, stages):
    """Single-device TF's stages; returns the step function."""
    _, values, x, target = train_step.make_problem(gt)
    cpu0 = tf.config.list_logical_devices("CPU")[0].name
    with tf.device(cpu0):
        svars = stages.time("variables", lambda: [
            {n: tf.Variable(layer[n], name=f"{n}_{i}") for n in train_step.NAMES}
            for i, layer in enumerate(values)])
        sx, st = tf.constant(x), tf.constant(target)
    step = tf.function(train_step.make_step(tf, svars, train_step.LR.value), autograph=False)
    stages.time("trace", lambda: step.get_concrete_function(sx, st))

    def run():
        with tf.device(cpu0):
            return float(step(sx, st).numpy())
    return run


def main(argv):
    del argv
    import gspmd_tf as gt
    shape = tuple(int(s) for s in train_step.MESH.value.split(","))
    gt.configure_cpu_devices(math.prod(shape))
    import tensorflow as tf
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    print(f"# first call: layers={train_step.LAYERS.value} batch={train_step.BATCH.value} "
          f"seq={train_step.SEQ.value} d_model={train_step.D_MODEL.value} "
          f"d_ff={train_step.D_FF.value} mesh={shape}, TF {tf.__version__}, load average "
          f"at start {os.getloadavg()[0]:.2f}\n")
    print("| system | stage | wall s | CPU s |")
    print("|---|---|---:|---:|")
    systems = train_step.SYSTEMS.value.split(",")
    if not set(systems) <= set(STAGED):
        raise app.UsageError(f"--systems: this script stages {STAGED} only")
    for system in systems:
        stages = Stages()
        step = (run_local if system == "local" else run_single)(gt, tf, stages)
        loss = stages.time("first execution", step)
        steady = [Stages() for _ in range(train_step.STEPS.value)]
        for s in steady:
            s.time("step", step)
        total_wall = sum(r[1] for r in stages.rows)
        total_cpu = sum(r[2] for r in stages.rows)
        for name, wall, cpu in stages.rows:
            print(f"| {system} | {name} | {wall:.2f} | {cpu:.2f} |")
        print(f"| {system} | **first call (sum)** | **{total_wall:.2f}** | **{total_cpu:.2f}** |")
        if steady:
            print(f"| {system} | steady step (median of {len(steady)}) | "
                  f"{statistics.median(s.rows[0][1] for s in steady):.2f} | "
                  f"{statistics.median(s.rows[0][2] for s in steady):.2f} |")
        print(f"| {system} | (loss of the first step: {loss:.6g}) | | |", flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
