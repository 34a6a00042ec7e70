"""The compute rates of the cost model (gspmd_tf/cost_model.py), measured on this machine.

    .venv/bin/python benchmarks/kernel_rates.py --devices=8

Times TF's CPU kernels on one TF device that uses every core, as one partitioned step's
ops run: a float32 matmul (multiply-adds per second) and memory-bound ops (bytes read
and written per second: an elementwise add of two vectors, a transpose, a slice copied
out), each the fastest of --repeats calls (the least disturbed by other processes), then
divided by --devices, the logical devices that share those cores in a partitioned step
(the cost model's rates are one device's). The cost model's constants cite this output.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

DEVICES = flags.DEFINE_integer("devices", 8, "logical devices sharing the cores")
REPEATS = flags.DEFINE_integer("repeats", 30, "calls of each kernel (the fastest counts)")
ELEMENTS = flags.DEFINE_integer("elements", 1 << 22, "elements of each memory-bound op's "
                                "operand (float32; 16 MiB by default: beyond the caches)")
WIDTH = flags.DEFINE_integer("width", 1024, "the square matmul's size")


def fastest(fn, *args) -> float:
    """Seconds of the fastest of --repeats calls of `fn` (a tf.function; the result is
    reduced on the device so no copy to the host is timed)."""
    fn(*args)
    best = float("inf")
    for _ in range(REPEATS.value):
        start = time.perf_counter()
        fn(*args)[0].numpy()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv):
    del argv
    n, w = ELEMENTS.value, WIDTH.value
    rng = np.random.default_rng(0)
    a = tf.constant(rng.random(n, np.float32))
    b = tf.constant(rng.random(n, np.float32))
    m = tf.constant(rng.random((w, w), np.float32))
    rows = n // 1024
    # each function returns (a scalar read back, the op's result), so only the op runs
    cases = [
        ("matmul", "multiply-adds", w ** 3,
         tf.function(lambda x: (tf.linalg.matmul(x, x)[0, 0], 0)), (m,)),
        ("add", "bytes", 12 * n, tf.function(lambda x, y: ((x + y)[0], 0)), (a, b)),
        ("transpose", "bytes", 8 * n,
         tf.function(lambda x: (tf.transpose(tf.reshape(x, [1024, rows]))[0, 0], 0)), (a,)),
        ("slice (half)", "bytes", 4 * n,
         tf.function(lambda x: (tf.identity(x[: n // 2])[0] + 0, 0)), (a,)),
    ]
    print(f"load average at start {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores; "
          f"rates per logical device = one device's / {DEVICES.value}")
    print("| kernel | unit | per second (one device, all cores) | per logical device |")
    print("|---|---|---:|---:|")
    for name, unit, amount, fn, args in cases:
        rate = amount / fastest(fn, *args)
        print(f"| {name} | {unit} | {rate:.3g} | {rate / DEVICES.value:.3g} |")


if __name__ == "__main__":
    app.run(main)
