"""XLA compile cost vs device count: where the XLA backend runs each device's segments.

    .venv/bin/python benchmarks/xla_compile_devices.py --devices=1,2,4,8 --layers=16

One segment (a chain of --layers `relu(h @ w) + h * 0.5` on [--batch, --width] tensors)
as tf.function(jit_compile=True), called once per device inside one outer tf.function,
as backends/xla.py does. Two placements of the calls:
  own     each device's call on that device: TF's XLA compilation cache is per device,
          so every device compiles the segment
  first   every call on the first CPU device (what XlaBackend does on CPU): one
          compilation, each device's inputs read in place
For each device count: the first call (compilation included) of each placement, each
with a freshly traced segment so that no compilation is reused, then the median of
--steps alternating steady-state calls.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

DEVICES = flags.DEFINE_string("devices", "1,2,4,8", "comma-separated device counts")
LAYERS = flags.DEFINE_integer("layers", 16, "matmul layers in the segment")
BATCH = flags.DEFINE_integer("batch", 64, "rows")
WIDTH = flags.DEFINE_integer("width", 256, "columns (and the square weight's size)")
STEPS = flags.DEFINE_integer("steps", 15, "timed steady-state calls of each placement")


def main(argv):
    del argv
    counts = [int(n) for n in DEVICES.value.split(",") if n]
    import gspmd_tf as gt
    gt.configure_cpu_devices(max(counts))
    import tensorflow as tf
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    spec = [tf.TensorSpec((BATCH.value, WIDTH.value)), tf.TensorSpec((WIDTH.value,) * 2)]

    def segment():
        def chain(h, w):
            for _ in range(LAYERS.value):
                h = tf.nn.relu(h @ w) + h * 0.5
            return h
        return tf.function(chain, jit_compile=True, autograph=False).get_concrete_function(
            *spec)

    def program(devices, placement):
        call = segment()

        def run(*args):
            outs = []
            for i, device in enumerate(devices):
                with tf.device(devices[0] if placement == "first" else device):
                    result = call(args[2 * i], args[2 * i + 1])
                with tf.device(device):
                    outs.append(tf.identity(result))
            return outs
        return tf.function(run, autograph=False)

    print(f"# XLA compile cost vs device count (TF {tf.__version__}, {os.cpu_count()} cores, "
          f"load average at start {os.getloadavg()[0]:.2f}); segment of {LAYERS.value} "
          f"layers on [{BATCH.value}, {WIDTH.value}]\n")
    print("| devices | placement | first call s | steady median ms |")
    print("|---:|---|---:|---:|")
    for n in counts:
        devices = names[:n]
        args = []
        for device in devices:
            with tf.device(device):
                args += [tf.random.normal(spec[0].shape),
                         tf.random.normal(spec[1].shape) * 0.01]
        runs, first = {}, {}
        for placement in ("own", "first"):
            fn = program(devices, placement).get_concrete_function(*args)
            start = time.perf_counter()
            [t.numpy() for t in fn(*args)]
            first[placement] = time.perf_counter() - start
            runs[placement] = fn
        times = {p: [] for p in runs}
        for _ in range(STEPS.value):
            for p, fn in runs.items():
                start = time.perf_counter()
                [t.numpy() for t in fn(*args)]
                times[p].append(time.perf_counter() - start)
        for p in runs:
            print(f"| {n} | {p} | {first[p]:.2f} | {statistics.median(times[p]) * 1e3:.1f} |",
                  flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
