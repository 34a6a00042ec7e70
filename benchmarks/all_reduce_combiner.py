"""Training step time with the all-reduce combiner at several thresholds, side by side.

    .venv/bin/python benchmarks/all_reduce_combiner.py --configs='64:16;16:128;4:512;2:1024' \
        --thresholds=0,65536,262144,1048576,4194304 --repeats=20

Each config LAYERS:WIDTH is an SGD step of a tanh MLP with LAYERS square WIDTH x WIDTH
weights and biases, data-parallel over all 8 logical CPU devices (batch split, weights
replicated gt.Variables), so every weight's and bias's gradient is one all-reduce over
the 8 devices, all independent (2 * LAYERS + 1 with the loss). For each threshold of
--thresholds (bytes; 0 = combiner off; set through GSPMD_TF_ALL_REDUCE_COMBINE_BYTES
while the step is lowered) the same step is built and compiled; then all variants run in
ONE process, their calls interleaved (variant 1, variant 2, ..., variant 1, ...) after
--warmup calls each, so every variant sees the same machine load. Reported per config
and threshold: all-reduces in the program, median and min step time, and the median
relative to the combiner off.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

CONFIGS = flags.DEFINE_string("configs", "64:16;16:128;4:512;2:1024",
                              "';'-separated LAYERS:WIDTH of the MLPs")
THRESHOLDS = flags.DEFINE_string("thresholds", "0,65536,262144,1048576,4194304",
                                 "comma-separated combiner thresholds in bytes (0: off): "
                                 "the largest all-reduce merged")
BATCH = flags.DEFINE_integer("batch", 64, "batch size (split over the 8 devices)")
REPEATS = flags.DEFINE_integer("repeats", 20, "timed steps of each variant (interleaved)")
WARMUP = flags.DEFINE_integer("warmup", 3, "untimed steps of each variant first")


def make_step(tf, weights):
    """SGD step of the tanh MLP over `weights` (w0, b0, w1, b1, ...); returns the loss."""
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for k in range(0, len(weights), 2):
                h = tf.tanh(h @ weights[k] + weights[k + 1])
            loss = tf.reduce_mean(tf.square(h))
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(1e-3 * g)
        return loss
    return step


def main(argv):
    del argv
    import gspmd_tf as gt
    gt.configure_cpu_devices(8)
    import tensorflow as tf
    from gspmd_tf.layout import Layout
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    mesh = gt.Mesh.create((8,), ("data",))
    thresholds = [int(t) for t in THRESHOLDS.value.split(",")]
    configs = [tuple(int(v) for v in c.split(":")) for c in CONFIGS.value.split(";") if c]

    print("# all-reduce combiner: SGD step time by threshold (same process, interleaved)\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, TF {tf.__version__}, "
          f"load average at start {os.getloadavg()[0]:.2f}; mesh 8 (data), batch "
          f"{BATCH.value}; {WARMUP.value} warm-up + {REPEATS.value} timed steps each\n")
    print("| layers x width | bytes per weight grad | threshold | all-reduces | median ms "
          "| min ms | median vs off |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for layers, width in configs:
        x = rng.standard_normal((BATCH.value, width)).astype(np.float32)
        # placed on the mesh once, so a step moves no input through the host
        sharded_x = gt.ShardedTensor.from_value(x, mesh, Layout.from_spec(mesh, gt.P("data"), 2))
        variants = []
        for threshold in thresholds:
            weights = [gt.Variable((rng.standard_normal(s) / np.sqrt(width)).astype(np.float32),
                                   mesh, gt.P(), name=f"w{i}")
                       for i, s in enumerate([(width, width), (width,)] * layers)]
            step = gt.function(make_step(tf, weights), mesh=mesh,
                               in_shardings=(gt.P("data"),))
            os.environ["GSPMD_TF_ALL_REDUCE_COMBINE_BYTES"] = str(threshold)
            try:
                low = step.lower(sharded_x)
            finally:
                del os.environ["GSPMD_TF_ALL_REDUCE_COMBINE_BYTES"]
            count = sum(c.kind == "all-reduce" for c in low.collectives())
            variants.append((threshold, count, step, []))
        for _ in range(WARMUP.value):
            for _, _, step, _ in variants:
                step(sharded_x).numpy()
        for _ in range(REPEATS.value):
            for _, _, step, times in variants:
                start = time.perf_counter()
                step(sharded_x).numpy()
                times.append(time.perf_counter() - start)
        off = statistics.median(variants[0][3])
        for threshold, count, _, times in variants:
            median = statistics.median(times)
            print(f"| {layers} x {width} | {width * width * 4} | {threshold} | {count} | "
                  f"{median * 1e3:.2f} | {min(times) * 1e3:.2f} | {median / off:.2f} |")
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
