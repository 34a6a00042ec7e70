"""Forward step time of the demo Transformer: gspmd-tf on a mesh vs single-device TF.

    .venv/bin/python benchmarks/step_time.py --meshes=2,4 --repeats=30

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
    import gspmd_tf as gt
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


if __name__ == "__main__":
    app.run(main)
