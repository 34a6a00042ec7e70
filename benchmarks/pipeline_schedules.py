"""Pipeline schedules against their formulas: bubble and per-device peak memory.

    .venv/bin/python benchmarks/pipeline_schedules.py --stages=2,4 --microbatches=4,8,16 \
        --virtual=1,2 --microbatch_size=8,64 --d_model=64 --d_ff=256

For every S, M, V and microbatch size b the model is the same: L = S V residual MLP
layers x + relu(x W1) W2 on [b, d], the loss the mean square error to a target. GPipe
and 1F1B run it as S stages of V consecutive layers each; the interleaved (circular)
schedule as V rounds of S one-layer stages (layers round-robin over the devices; only
for V > 1 and M a multiple of S). For each the script prints the bubble of
gt.pipeline_schedule's time table beside the formula ((S-1)/(M+S-1) GPipe and 1F1B,
(S-1)/(V M+S-1) interleaved), what the schedule keeps alive per device by its shape
(GPipe: the intermediates of all M+S-1 steps, for TF's gradient of the loop; 1F1B:
S stage inputs, the stash, whatever M; interleaved: the input of each of its V M+S-1
steps, each step rematerialised in the backward), and the per-device peak of
gt.pipeline_value_and_grad's program as Lowered.memory() estimates it (lowered on an
abstract mesh of S devices: nothing runs, so any S fits), also as a ratio to GPipe's
on the same model, and the operand bytes per device of its collectives
(Lowered.collectives(), a loop body's once). The peak includes the program's arguments
and outputs (the weights, the microbatches and targets, replicated, and the gradients:
"args+outs", the same for every schedule), and the loop bodies' temporaries, e.g. one
step's weight gradients (TF's gradient makes each as a new tensor before adding it to
its accumulator): with a small b these, not the activations a schedule keeps, dominate.
"rest /gpipe" is the peak less its arguments and outputs, as a ratio to GPipe's.

--measure_memory also runs every step on S logical CPU devices with TF's CPU allocator
keeping statistics and prints the peak bytes it measured above what it held before the
call (the S devices together: they share the host's allocator; TF's buffer reuse and
forwarding included), the median of 3 calls: a check of the estimate's ratios.

--time_steps=N also runs every step on S logical CPU devices (they share the host's
cores: the shape of the schedule's cost, not a speed-up) and prints the median time of
N calls and its ratio to GPipe's, the schedules' calls alternating round by round.
In the SPMD 1F1B loop every stage runs one forward and one backward every tick (the
backward with a zero cotangent on its forward ticks), 2M+2S-2 ticks; GPipe runs M+S-1
forward steps and as many backward ones; interleaved recomputes each forward step in
the backward.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from fractions import Fraction

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

STAGES = flags.DEFINE_list("stages", ["2", "4"], "pipeline stages S (devices on the axis)")
MICROBATCHES = flags.DEFINE_list("microbatches", ["4", "8", "16"], "microbatch counts M")
VIRTUAL = flags.DEFINE_list("virtual", ["1", "2"],
                            "layers per device V (interleaved's virtual stages)")
MICROBATCH_SIZE = flags.DEFINE_list("microbatch_size", ["8"], "examples per microbatch b")
D_MODEL = flags.DEFINE_integer("d_model", 64, "model width")
D_FF = flags.DEFINE_integer("d_ff", 256, "hidden width")
TIME_STEPS = flags.DEFINE_integer(
    "time_steps", 0, "when > 0, also run each step on S logical CPU devices this many "
    "times (after one warm-up call) and print the median seconds")
MEASURE_MEMORY = flags.DEFINE_bool(
    "measure_memory", False, "also run each step on S logical CPU devices with TF's CPU "
    "allocator keeping statistics (TF_CPU_ALLOCATOR_USE_BFC) and print the measured "
    "peak bytes of the S devices together (they share the host's allocator), the median "
    "of 3 calls after a warm-up, and its ratio to GPipe's")


def formula(schedule, stages, microbatches, virtual):
    """The bubble the schedule's shape predicts."""
    if schedule == "interleaved":
        return Fraction(stages - 1, virtual * microbatches + stages - 1)
    return Fraction(stages - 1, microbatches + stages - 1)


def kept(schedule, stages, microbatches, virtual):
    """What the schedule keeps alive per device for its backward, by its shape."""
    if schedule == "gpipe":
        return f"{microbatches + stages - 1} steps' activations"
    if schedule == "1f1b":
        return f"{stages} stage inputs"
    return f"{virtual * microbatches + stages - 1} step inputs"


def program(gt, tf, schedule, stages, microbatches, virtual, batch, mesh):
    """(step, argument specs, in_shardings): the loss-and-gradients step of the model."""
    d, f = D_MODEL.value, D_FF.value

    def stage(w, x):  # V consecutive layers (one, interleaved)
        for w1, w2 in zip(w["w1"], w["w2"]):
            x = x + tf.nn.relu(x @ w1) @ w2
        return x

    def step(w1, w2, x, targets):
        # GPipe and 1F1B: stage params a list of V tensors [S, ...] (not one [S, V, ...]
        # indexed in the stage: TF's gradient loop would keep each step's slices)
        def per_stage(w):
            if schedule == "interleaved" or virtual == 1:
                return [w]
            return tf.unstack(tf.reshape(w, [stages, virtual] + w.shape[1:].as_list()),
                              axis=1)
        w1, w2 = per_stage(w1), per_stage(w2)
        return gt.pipeline_value_and_grad(
            stage, lambda y, t: tf.reduce_mean(tf.square(y - t)), {"w1": w1, "w2": w2},
            x, targets, mesh=mesh, schedule=schedule,
            virtual_stages=virtual if schedule == "interleaved" else 1)
    layers = stages * virtual
    specs = [tf.TensorSpec([layers, d, f]), tf.TensorSpec([layers, f, d])] + [
        tf.TensorSpec([microbatches, batch, d])] * 2
    P = gt.P
    return step, specs, (P("stage"), P("stage"), P(), P())


def lowered_figures(gt, tf, schedule, stages, microbatches, virtual, batch):
    """(per-device peak, its arguments and outputs, collective operand bytes per device,
    loop bodies once) of the step's program, lowered on an abstract stage mesh."""
    mesh = gt.Mesh.abstract((stages,), ("stage",))
    step, specs, shardings = program(gt, tf, schedule, stages, microbatches, virtual,
                                     batch, mesh)
    lowered = gt.lower(step, mesh, shardings, args=specs)
    memory = lowered.memory()
    return (memory.peak, memory.arguments + memory.outputs,
            sum(c.bytes for c in lowered.collectives()))


def warmed_up_steps(gt, tf, schedules, stages, microbatches, virtual, batch):
    """[(gt.function, numpy args)] of each schedule's step on S logical CPU devices,
    each called once (traced, partitioned, warmed up)."""
    mesh = gt.Mesh.create((stages,), ("stage",))
    rng = np.random.default_rng(0)
    calls = []
    for schedule in schedules:
        step, specs, shardings = program(gt, tf, schedule, stages, microbatches, virtual,
                                         batch, mesh)
        args = [rng.standard_normal(spec.shape, dtype=np.float32) * 0.1 for spec in specs]
        function = gt.function(step, mesh=mesh, in_shardings=shardings)
        tf.nest.map_structure(lambda t: t.numpy(), function(*args))
        calls.append((function, args))
    return calls


def step_times(tf, calls):
    """Median seconds of one call of each step, the calls alternating round by round
    (so all see the same machine load)."""
    times = [[] for _ in calls]
    for _ in range(TIME_STEPS.value):
        for (function, args), measured in zip(calls, times):
            start = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy(), function(*args))
            measured.append(time.perf_counter() - start)
    return [statistics.median(measured) for measured in times]


def measured_peaks(tf, calls):
    """Median over 3 calls of each step's peak bytes above what the host's CPU allocator
    held before the call (its arguments' conversion and placement included)."""
    peaks = [[] for _ in calls]
    for _ in range(3):
        for (function, args), measured in zip(calls, peaks):
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            tf.config.experimental.reset_memory_stats("CPU:0")
            tf.nest.map_structure(lambda t: t.numpy(), function(*args))
            measured.append(tf.config.experimental.get_memory_info("CPU:0")["peak"]
                            - before)
    return [int(statistics.median(measured)) for measured in peaks]


def main(argv):
    del argv
    run = TIME_STEPS.value > 0 or MEASURE_MEMORY.value
    if MEASURE_MEMORY.value:  # read when TensorFlow starts
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    import gspmd_tf as gt
    if run:
        gt.configure_cpu_devices(max(map(int, STAGES.value)))
    import tensorflow as tf
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    timed = TIME_STEPS.value > 0
    measured = MEASURE_MEMORY.value
    print(f"{'schedule':12s} {'S':>3s} {'M':>4s} {'V':>3s} {'b':>4s} {'bubble':>8s} "
          f"{'formula':>8s} {'kept per device':>24s} {'peak B/device':>14s} "
          f"{'/gpipe':>7s} {'args+outs B':>12s} {'rest /gpipe':>11s} "
          f"{'coll. B/device':>14s}"
          + (f" {'step s':>8s} {'/gpipe':>7s}" if timed else "")
          + (f" {'measured B, S dev':>17s} {'/gpipe':>7s}" if measured else ""))
    for batch in map(int, MICROBATCH_SIZE.value):
        for stages in map(int, STAGES.value):
            for microbatches in map(int, MICROBATCHES.value):
                for virtual in map(int, VIRTUAL.value):
                    runs = ["gpipe", "1f1b"] + (
                        ["interleaved"] if virtual > 1 and microbatches % stages == 0
                        else [])
                    calls = (warmed_up_steps(gt, tf, runs, stages, microbatches, virtual,
                                             batch) if run else None)
                    times = step_times(tf, calls) if timed else [None] * len(runs)
                    real = measured_peaks(tf, calls) if measured else [None] * len(runs)
                    figures = [lowered_figures(gt, tf, schedule, stages, microbatches,
                                               virtual, batch) for schedule in runs]
                    gpipe_peak, gpipe_held, _ = figures[0]
                    for schedule, (peak, held, moved), seconds, used in zip(
                            runs, figures, times, real):
                        table = gt.pipeline_schedule(
                            schedule, stages, microbatches,
                            virtual if schedule == "interleaved" else 1)
                        want = formula(schedule, stages, microbatches, virtual)
                        print(f"{schedule:12s} {stages:3d} {microbatches:4d} {virtual:3d} "
                              f"{batch:4d} {float(table.bubble):8.4f} {float(want):8.4f} "
                              f"{kept(schedule, stages, microbatches, virtual):>24s} "
                              f"{peak:14d} {peak / gpipe_peak:7.3f} {held:12d} "
                              f"{(peak - held) / (gpipe_peak - gpipe_held):11.3f} "
                              f"{moved:14d}"
                              + (f" {seconds:8.4f} {seconds / times[0]:7.3f}" if timed
                                 else "")
                              + (f" {used:17d} {used / real[0]:7.3f}" if measured else ""),
                              flush=True)


if __name__ == "__main__":
    app.run(main)
