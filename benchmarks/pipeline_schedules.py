"""Pipeline schedules against their formulas: bubble and per-device peak memory.

    .venv/bin/python benchmarks/pipeline_schedules.py --stages=2,4 --microbatches=4,8,16 \
        --virtual=1,2 --microbatch_size=8 --d_model=64 --d_ff=256

For every schedule (gpipe, 1f1b, interleaved) and every S, M (and V for interleaved) the
script prints the bubble of gt.pipeline_schedule's time table beside the formula
((S-1)/(M+S-1) GPipe, (S-1)/(V M+S-1) interleaved, (2S-2)/(M+2S-2) for this 1F1B, whose
every step runs one forward and one backward on every stage), and the per-device peak
of gt.pipeline_value_and_grad's program as Lowered.memory() estimates it (lowered on an
abstract mesh of S devices: nothing runs, so any S fits), with the stash or activations
the schedule keeps per device: 1F1B (2S-1) stage inputs whatever M, GPipe and
interleaved every step's intermediates (M+S-1, V M+S-1 steps). Stages are residual MLP
blocks x + relu(x W1) W2 on [b, d]; the loss is the mean square error to a target.
"""

from __future__ import annotations

import logging
import os
import sys
from fractions import Fraction

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

STAGES = flags.DEFINE_list("stages", ["2", "4"], "pipeline stages S (devices on the axis)")
MICROBATCHES = flags.DEFINE_list("microbatches", ["4", "8", "16"], "microbatch counts M")
VIRTUAL = flags.DEFINE_list("virtual", ["1", "2"], "virtual stages V for interleaved")
MICROBATCH_SIZE = flags.DEFINE_integer("microbatch_size", 8, "examples per microbatch")
D_MODEL = flags.DEFINE_integer("d_model", 64, "model width")
D_FF = flags.DEFINE_integer("d_ff", 256, "hidden width")


def formula(schedule, stages, microbatches, virtual):
    """The bubble the schedule's shape predicts."""
    if schedule == "1f1b":
        return Fraction(2 * stages - 2, microbatches + 2 * stages - 2)
    return Fraction(stages - 1, virtual * microbatches + stages - 1)


def peak_bytes(gt, tf, schedule, stages, microbatches, virtual):
    """Per-device peak of the loss-and-gradients program on an abstract stage mesh."""
    mesh = gt.Mesh.abstract((stages,), ("stage",))
    layers, d, f, b = stages * virtual, D_MODEL.value, D_FF.value, MICROBATCH_SIZE.value

    def stage(w, x):
        return x + tf.nn.relu(x @ w["w1"]) @ w["w2"]

    def step(w1, w2, x, targets):
        return gt.pipeline_value_and_grad(
            stage, lambda y, t: tf.reduce_mean(tf.square(y - t)), {"w1": w1, "w2": w2},
            x, targets, mesh=mesh, schedule=schedule, virtual_stages=virtual)
    specs = [tf.TensorSpec([layers, d, f]), tf.TensorSpec([layers, f, d]),
             tf.TensorSpec([microbatches, b, d]), tf.TensorSpec([microbatches, b, d])]
    P = gt.P
    low = gt.lower(step, mesh, (P("stage"), P("stage"), P(), P()), args=specs)
    return low.memory().peak


def main(argv):
    del argv
    import gspmd_tf as gt
    import tensorflow as tf
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    print(f"{'schedule':12s} {'S':>3s} {'M':>4s} {'V':>3s} {'bubble':>9s} {'formula':>9s} "
          f"{'peak bytes/device':>18s}")
    for stages in map(int, STAGES.value):
        for microbatches in map(int, MICROBATCHES.value):
            runs = [("gpipe", 1), ("1f1b", 1)] + [
                ("interleaved", int(v)) for v in VIRTUAL.value
                if int(v) > 1 and microbatches % stages == 0]
            for schedule, virtual in runs:
                table = gt.pipeline_schedule(schedule, stages, microbatches, virtual)
                peak = peak_bytes(gt, tf, schedule, stages, microbatches, virtual)
                want = formula(schedule, stages, microbatches, virtual)
                print(f"{schedule:12s} {stages:3d} {microbatches:4d} {virtual:3d} "
                      f"{float(table.bubble):9.4f} {float(want):9.4f} {peak:18d}")


if __name__ == "__main__":
    app.run(main)
