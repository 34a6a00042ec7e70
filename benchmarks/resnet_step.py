"""ResNet50 data-parallel SGD training step: gspmd-tf backends vs single-device TF.

    .venv/bin/python benchmarks/resnet_step.py --image=64 --batch=16 --repeats=5
    .venv/bin/python benchmarks/resnet_step.py --systems=single,xla_tfdots,local --mesh=8

The model is keras.applications.ResNet50(weights=None) on --image x --image x 3 inputs
with --classes outputs, trained by plain SGD (w -= lr * grad) on one fixed batch;
BatchNormalization's moving statistics are updated too, as Keras does in training mode.
Every system of --systems has its own copy of the model with the same initial weights:
  - xla, local: the model's variables backed by gt.Variables replicated on a
    data-parallel mesh of --mesh devices (gt.keras.shard_model), the step a gt.function
    with the batch split over the mesh, through that backend; xla_tfdots: the XLA
    backend with the convolutions and matmuls of at least --tf_dots_from multiply-adds
    left to TF's kernels (XlaBackend(tf_dots_from=...));
  - single: the same step under tf.function on one device; single_jit: with
    jit_compile=True; shards: the single step on each device's part of the batch
    (--batch / --mesh examples) in turn, --mesh calls on one device: the per-device
    program's kernels alone, without collectives or the multi-device executor;
  - local_each: the local backend running every op on every device
    (replicated_once=False).
All run in one process, their timed steps alternating after --warmup calls each, so all
see the same machine load. Reported: median and min step time, ratios to single and
single_jit, this process's median CPU time per step (with other jobs on the machine
it varies less than wall time), the first call (build, lowering, compilation and
first step) and the relative difference from single's loss: of the first step (the same weights: the
check of the values) and after equal numbers of steps (SGD on one fixed batch drives the
loss towards 0, so this one grows with any rounding difference). With --trace_steps, per
op type the kernels of that many traced steps of each system (benchmarks/op_profile.py).
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

import backend_names  # noqa: E402
import op_profile  # noqa: E402

IMAGE = flags.DEFINE_integer("image", 64, "input height and width")
BATCH = flags.DEFINE_integer("batch", 16, "global batch size")
CLASSES = flags.DEFINE_integer("classes", 10, "output classes")
MESH = flags.DEFINE_integer("mesh", 8, "devices of the data-parallel mesh")
SYSTEMS = flags.DEFINE_string("systems", "single,single_jit,xla,xla_tfdots,local",
                              "systems to time, in this order")
TF_DOTS_FROM = flags.DEFINE_integer("tf_dots_from", 1 << 20, "xla_tfdots: dots of at "
                                    "least this many multiply-adds run on TF's kernels")
REPEATS = flags.DEFINE_integer("repeats", 5, "timed steps of each (alternating)")
WARMUP = flags.DEFINE_integer("warmup", 2, "untimed steps of each after the first call")
TRACE_STEPS = flags.DEFINE_integer("trace_steps", 0, "steps of each system traced by TF's "
                                   "profiler for a per-op-type table (0: none)")
INTER_OP = flags.DEFINE_integer("inter_op_threads", 0, "TF's inter-op threads (0: TF's "
                                "default); 1 runs one kernel at a time, so that the op "
                                "table's kernel times do not overlap")
LEARNING_RATE = 0.01


def main(argv):
    del argv
    import gspmd_tf as gt
    gt.configure_cpu_devices(MESH.value)
    import tensorflow as tf
    import keras
    if INTER_OP.value:
        tf.config.threading.set_inter_op_parallelism_threads(INTER_OP.value)
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)

    images, labels = batch(BATCH.value)
    systems = make_systems(gt, tf, keras, [s for s in SYSTEMS.value.split(",") if s],
                           images, labels)

    print("# ResNet50 data-parallel SGD training step: gspmd-tf vs single-device TF "
          "(same process, alternating)\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, TF {tf.__version__}, "
          f"Keras {keras.__version__}, load average at start {os.getloadavg()[0]:.2f}; "
          f"input {BATCH.value}x{IMAGE.value}x{IMAGE.value}x3, {CLASSES.value} classes, "
          f"mesh ({MESH.value},); {WARMUP.value} warm-up + {REPEATS.value} timed steps "
          "each\n")
    names = list(systems)
    first, first_loss = {}, {}
    for name in names:
        start = time.perf_counter()
        first_loss[name] = systems[name]()
        first[name] = time.perf_counter() - start
        print(f"first call of {name}: {first[name]:.1f} s", flush=True)
    for name in names:
        for _ in range(WARMUP.value):
            systems[name]()
    wall, cpu = op_profile.time_steps([systems[n] for n in names], REPEATS.value)
    times = dict(zip(names, wall))
    cpu_med = {name: statistics.median(t) for name, t in zip(names, cpu)}
    losses = {name: systems[name]() for name in names}  # after equal numbers of steps
    med = {name: statistics.median(t) for name, t in times.items()}
    print("\n| system | median ms | min ms | ratio to single | ratio to single_jit "
          "| median CPU ms | CPU ratio to single "
          "| first call s | first loss rel. diff | last loss rel. diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        diffs = [f"{abs(got[name] - got['single']) / abs(got['single']):.1e}"
                 if "single" in got and name != "shards" else "-"  # another batch
                 for got in (first_loss, losses)]
        ratios = [f"{med[name] / med[other]:.2f}" if other in med else "-"
                  for other in ("single", "single_jit")]
        cpu_ratio = (f"{cpu_med[name] / cpu_med['single']:.2f}" if "single" in cpu_med
                     else "-")
        print(f"| {name} | {med[name] * 1e3:.1f} | {min(times[name]) * 1e3:.1f} "
              f"| {' | '.join(ratios)} | {cpu_med[name] * 1e3:.1f} | {cpu_ratio} "
              f"| {first[name]:.1f} | {' | '.join(diffs)} |", flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")
    if TRACE_STEPS.value:
        print()
        op_profile.print_op_table({name: op_profile.op_table(tf, systems[name],
                                                             TRACE_STEPS.value)
                                   for name in names}, 30)


def batch(size):
    """The fixed (images, labels) batch of `size` examples."""
    rng = np.random.default_rng(0)
    images = rng.standard_normal((size, IMAGE.value, IMAGE.value, 3)).astype(np.float32)
    labels = rng.integers(0, CLASSES.value, size).astype(np.int32)
    return images, labels


def make_systems(gt, tf, keras, names, images, labels):
    """{name: run() -> loss of one step} for the systems `names` (see the module doc),
    each with its own model of the same initial weights."""
    def make_model():
        keras.utils.set_random_seed(0)  # the same initial weights for every system
        return keras.applications.ResNet50(
            weights=None, input_shape=(IMAGE.value, IMAGE.value, 3), classes=CLASSES.value)

    def make_step(model):
        def step(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                    y, logits))
            grads = tape.gradient(loss, model.trainable_variables)
            for variable, grad in zip(model.trainable_variables, grads):
                variable.assign_sub(LEARNING_RATE * grad)
            return loss
        return step

    cpu0 = tf.config.list_logical_devices("CPU")[0].name
    mesh = gt.Mesh.create((MESH.value,), ("data",))
    systems = {}
    for system in names:
        if system == "shards":  # the losses of its first part
            with tf.device(cpu0):
                fn = tf.function(make_step(make_model()), autograph=False)
                parts = [(tf.constant(x), tf.constant(y)) for x, y in zip(
                    np.split(images, MESH.value), np.split(labels, MESH.value))]

            def run(fn=fn, parts=parts):
                with tf.device(cpu0):
                    return [float(fn(x, y).numpy()) for x, y in parts][0]
        elif system in ("single", "single_jit"):
            with tf.device(cpu0):
                model = make_model()
                fn = tf.function(make_step(model), autograph=False,
                                 jit_compile=system == "single_jit")
                x, y = tf.constant(images), tf.constant(labels)

            def run(fn=fn, x=x, y=y):
                with tf.device(cpu0):
                    return float(fn(x, y).numpy())
        else:
            model = make_model()
            gt.keras.shard_model(model, mesh)
            fn = gt.function(make_step(model), mesh=mesh, in_shardings=(gt.P("data"),) * 2,
                             backend=backend_names.backend(system, TF_DOTS_FROM.value))

            def run(fn=fn):
                return float(fn(images, labels).numpy())
        systems[system] = run
    return systems


if __name__ == "__main__":
    app.run(main)
