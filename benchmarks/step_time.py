"""Forward step time of the demo Transformer: gspmd-tf on a mesh vs single-device TF.

    .venv/bin/python benchmarks/step_time.py --meshes=2,4 --repeats=30
    python benchmarks/step_time.py --tpu=local --meshes=2,4     # on a Cloud TPU VM (v3-8)

The model is gspmd_tf.demo's (make_loss_fn), annotated as the demo annotates it. For each
mesh of --meshes (';'-separated shapes, axes data,model) it builds the gt.function, places
the inputs on the mesh once (ShardedTensors in the input shardings the program chose),
and times one forward step (loss to host) beside the same function under a plain
tf.function on one device. Both run in ONE process, their repeats alternating
(sharded, single, sharded, single, ...) after --warmup calls each, so both see the same
machine load. Reported: median and min of each, the ratio of medians, and the
partitioned loss's relative difference from the single-device loss.

The logical CPU devices of a mesh share the host's cores (see the machine line): on a
2-core host, 8 logical devices cannot beat one device; the ratio measures gspmd-tf's
overhead (smaller local ops, collectives, per-device dispatch), not a speed-up.

With --tpu (benchmarks/tpu_flag.py) each mesh must have as many devices as the TPU has
cores: the annotated global graph runs under TPUStrategy, compiled by TF's XLA bridge,
and the table gives its step time and its loss beside the single-device loss on the host
CPU.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from gspmd_tf import demo  # noqa: E402  (no TF import at module level)
import tpu_flag  # noqa: E402  (defines --tpu)

MESHES = flags.DEFINE_string("meshes", "2,4", "';'-separated mesh shapes data,model, "
                             "e.g. '2,4;1,8;8,1'")
REPEATS = flags.DEFINE_integer("repeats", 30, "timed steps of each (alternating)")
WARMUP = flags.DEFINE_integer("warmup", 3, "untimed steps of each first")
_D = demo.ModelConfig()
LAYERS = flags.DEFINE_integer("layers", _D.layers, "Transformer layers")
D_MODEL = flags.DEFINE_integer("d_model", _D.d_model, "model width")
HEADS = flags.DEFINE_integer("heads", _D.heads, "attention heads")
D_FF = flags.DEFINE_integer("d_ff", _D.d_ff, "MLP hidden width")
VOCAB = flags.DEFINE_integer("vocab", _D.vocab, "vocabulary size")
SEQ = flags.DEFINE_integer("seq", _D.seq, "sequence length")
BATCH = flags.DEFINE_integer("batch", _D.batch, "batch size")


def main(argv):
    del argv
    meshes = [tuple(int(x) for x in m.split(",")) for m in MESHES.value.split(";") if m]
    tpu = tpu_flag.connect()  # before any other TF work
    import gspmd_tf as gt
    if tpu is None:
        gt.configure_cpu_devices(max(int(np.prod(m)) for m in meshes))
    import tensorflow as tf
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)

    cfg = demo.ModelConfig(layers=LAYERS.value, d_model=D_MODEL.value, heads=HEADS.value,
                           d_ff=D_FF.value, vocab=VOCAB.value, seq=SEQ.value,
                           batch=BATCH.value)
    loss_fn = demo.make_loss_fn(cfg)
    params = demo.init_params(cfg)
    tokens = demo.make_batch(cfg)
    values = [tokens] + params
    if tpu is not None:
        return run_on_tpu(gt, tf, tpu, meshes, cfg, loss_fn, values)

    print("# forward step time: gspmd-tf vs single-device TF (same process, alternating)\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, TF {tf.__version__}, "
          f"load average at start {os.getloadavg()[0]:.2f}; model {cfg}; "
          f"{WARMUP.value} warm-up + {REPEATS.value} timed steps each\n")

    cpu0 = tf.config.list_logical_devices("CPU")[0].name
    with tf.device(cpu0):
        args = [tf.constant(v) for v in values]
    single = tf.function(loss_fn, autograph=False)

    def run_single():
        with tf.device(cpu0):
            return float(single(*args).numpy())

    print("| mesh | devices | gspmd-tf median ms | min ms | single-device median ms "
          "| min ms | ratio (median) | loss rel. diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape in meshes:
        mesh = gt.Mesh.create(shape, demo.AXES)
        sharded = gt.function(loss_fn, mesh=mesh, in_shardings=demo.in_specs(cfg))
        lowered = sharded.lower(*demo.input_specs(cfg))
        placed = [gt.ShardedTensor.from_value(v, mesh, s.to_layout(mesh, np.ndim(v)))
                  for v, s in zip(values, lowered.input_shardings)]

        def run_sharded():
            return float(sharded(*placed).numpy())

        times = demo.side_by_side([run_sharded, run_single], REPEATS.value, WARMUP.value)
        got, ref = run_sharded(), run_single()
        rel = abs(got - ref) / abs(ref)
        ts, t1 = statistics.median(times[0]), statistics.median(times[1])
        print(f"| {shape[0]}x{shape[1]} | {mesh.size} | {ts * 1e3:.2f} "
              f"| {min(times[0]) * 1e3:.2f} | {t1 * 1e3:.2f} | {min(times[1]) * 1e3:.2f} "
              f"| {ts / t1:.2f} | {rel:.1e} |", flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


def run_on_tpu(gt, tf, tpu, meshes, cfg, loss_fn, values):
    """The --tpu table: per mesh, the TPU program's step time and loss."""
    with tf.device("/CPU:0"):
        reference = float(tf.function(loss_fn, autograph=False)(*values).numpy())
    print(f"# forward step time on TPU {tpu_flag.TPU.value} ({tpu.num_cores} cores, "
          f"TPUStrategy + XLA SPMD), TF {tf.__version__}; model {cfg}; "
          f"{WARMUP.value} warm-up + {REPEATS.value} timed steps\n")
    print("| mesh | cores | TPU median ms | min ms | loss rel. diff vs host CPU |")
    print("|---|---:|---:|---:|---:|")
    for shape in meshes:
        lowered = gt.lower(loss_fn, tpu.mesh(shape, demo.AXES), demo.in_specs(cfg),
                           args=demo.input_specs(cfg))
        run = tpu.program(lowered)
        args = [tf.constant(v) for v in values]

        def step(_):
            return float(run(*args)[0].numpy())
        times, loss = tpu_flag.time_steps(step, None, REPEATS.value, WARMUP.value)
        print(f"| {shape[0]}x{shape[1]} | {tpu.num_cores} | {tpu_flag.summary(times)} "
              f"| {abs(loss - reference) / abs(reference):.1e} |", flush=True)


if __name__ == "__main__":
    app.run(main)
