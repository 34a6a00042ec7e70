"""Lowered.memory()'s per-device peak against what TF's CPU allocator measures.

    .venv/bin/python benchmarks/memory_estimate.py

Every program runs on logical CPU devices of this host with TF's CPU allocator keeping
statistics (TF_CPU_ALLOCATOR_USE_BFC, set before TF starts; the devices share it). Its
arguments are placed as ShardedTensors first and it is called once to warm up; then, 3
times, the allocator's peak is reset, the program runs, and the peak above what the
allocator held before the call (the placed arguments, variables, TF's own state) is read.
The estimate of the same quantity is the devices times (peak - arguments - variables) of
Lowered.memory(): the bytes each device makes while the program runs, as if every
device's peak fell at the same moment. Two runs: the local backend as it is by default
on CPU devices, which computes a value several devices hold equal once for all of them
(they share the host's memory: LocalBackend's replicated_once), and with every device
computing its own (replicated_once=False), as separate devices do, which is what the
estimate models. measured / estimate below 1 is the estimate's margin (it counts
outputs live throughout, as XLA's accounting does, where TF makes them late; TF forwards
buffers; the devices' peaks need not coincide); above 1 it misses something.

Programs: a Transformer train step with Adam (gspmd_tf.testing.transformer_step, the
hand Megatron plan, 2x4), GPipe and 1F1B pipeline steps (S=4,
M=16, benchmarks/pipeline_schedules.py's model), ring attention (causal, 8 devices).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # the allocator's statistics
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

LAYERS = flags.DEFINE_integer("layers", 2, "Transformer layers")
WIDTH = flags.DEFINE_integer("width", 256, "Transformer d_model")
SEQ = flags.DEFINE_integer("seq", 128, "sequence length (Transformer and attention)")
BATCH = flags.DEFINE_integer("batch", 16, "global batch (Transformer)")
CALLS = flags.DEFINE_integer("calls", 3, "measured calls per program (median)")


def transformer(gt):
    """(fn, mesh, in_shardings, args) of the Transformer step."""
    from gspmd_tf.testing.transformer_step import Config, make_step
    config = Config(LAYERS.value, WIDTH.value, 8, 4 * WIDTH.value, SEQ.value,
                    BATCH.value)
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    return make_step(config), mesh, config.in_shardings("megatron"), config.values()


def pipelined(gt, tf, schedule):
    """(fn, mesh, in_shardings, args) of pipeline_schedules.py's S=4, M=16 step (its
    flags set the model; microbatch 64)."""
    import pipeline_schedules
    mesh = gt.Mesh.create((4,), ("stage",))
    step, specs, shardings = pipeline_schedules.program(gt, tf, schedule, 4, 16, 1,
                                                        64, mesh)
    rng = np.random.default_rng(0)
    return step, mesh, shardings, [rng.standard_normal(s.shape, dtype=np.float32) * 0.1
                                   for s in specs]


def ring(gt, tf):
    """(fn, mesh, in_shardings, args) of causal ring attention over 8 devices."""
    mesh = gt.Mesh.create((8,), ("seq",))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, SEQ.value * 8, 4, 32), dtype=np.float32)
               for _ in range(3))

    def attend(q, k, v):
        return gt.ring_attention(q, k, v, mesh=mesh, axis="seq", causal=True)
    return attend, mesh, (gt.P(None, "seq"),) * 3, [q, k, v]


def measure(gt, tf, fn, mesh, shardings, args, replicated_once=True):
    """(estimated bytes the devices make, measured [bytes per call]) on the local backend
    (`replicated_once` as LocalBackend's)."""
    from gspmd_tf.backends.local import LocalBackend
    function = gt.function(fn, mesh=mesh, in_shardings=shardings, backend=lambda m: (
        LocalBackend(m, replicated_once=replicated_once)))
    lowered = function.lower(*args)
    placed = [gt.ShardedTensor.from_value(value, mesh, s.to_layout(mesh, np.ndim(value)))
              for value, s in zip(args, lowered.input_shardings)]
    memory = lowered.memory()
    estimate = mesh.size * (memory.peak - memory.arguments - memory.variables)
    function(*placed)  # trace, partition, warm up (its outputs freed at once)
    measured = []
    for _ in range(CALLS.value):
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        outputs = function(*placed)
        measured.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
        del outputs
    return estimate, measured


def main(argv):
    del argv
    import gspmd_tf as gt
    gt.configure_cpu_devices(8)
    import tensorflow as tf
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    programs = {
        "transformer train step (2x4)": lambda: transformer(gt),
        "gpipe S=4 M=16": lambda: pipelined(gt, tf, "gpipe"),
        "1f1b S=4 M=16": lambda: pipelined(gt, tf, "1f1b"),
        "ring attention, causal (8)": lambda: ring(gt, tf),
    }
    print(f"{'program':32s} {'estimate B':>12s} {'measured B':>12s} {'/estimate':>9s} "
          f"{'each device B':>13s} {'/estimate':>9s}")
    for name, make in programs.items():
        estimate, shared = measure(gt, tf, *make())
        _, own = measure(gt, tf, *make(), replicated_once=False)
        shared, own = statistics.median(shared), statistics.median(own)
        print(f"{name:32s} {estimate:12d} {int(shared):12d} {shared / estimate:9.3f} "
              f"{int(own):13d} {own / estimate:9.3f}", flush=True)


if __name__ == "__main__":
    app.run(main)
