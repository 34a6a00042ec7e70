"""--tpu for the benchmark scripts: run gspmd-tf's program on a Cloud TPU under
TPUStrategy, compiled by TF's XLA bridge (gspmd_tf.tpu), instead of on logical CPU devices.

A script imports this module (which defines the flag), calls `connect()` before any other
TF work (TF's TPU initialization must come first), and, when it returns a TPUSystem,
lowers its function on `system.mesh(shape, axes)` and times `system.program(lowered)`
with `time_steps`.
"""

from __future__ import annotations

import statistics
import sys
import time

from absl import flags

TPU = flags.DEFINE_string(
    "tpu", None, "Cloud TPU to run on: its name, its grpc://host:8470 address, or 'local' "
    "on a TPU VM. The program runs as one replica over all cores under TPUStrategy with "
    "XLA SPMD partitioning (gspmd-tf's shardings as XlaSharding annotations); without "
    "the flag it runs on logical CPU devices")


def connect():
    """The gspmd_tf.tpu.TPUSystem of --tpu, or None without the flag. Exits with the
    reason when the TPU cannot be reached."""
    if TPU.value is None:
        return None
    from gspmd_tf import tpu
    try:
        return tpu.connect(TPU.value)
    except tpu.TPUNotFoundError as e:
        sys.exit(f"--tpu={TPU.value}: {e}")


def time_steps(step, state, steps, warmup):
    """Times `steps` calls of state = step(state) after `warmup` untimed ones (`step`
    waits for what it needs on the host). Returns (seconds per call, the final state)."""
    for _ in range(warmup):
        state = step(state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state = step(state)
        times.append(time.perf_counter() - start)
    return times, state


def summary(times):
    """'median ms | min ms' of a list of seconds."""
    return f"{statistics.median(times) * 1e3:.2f} | {min(times) * 1e3:.2f}"
