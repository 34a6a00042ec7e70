"""The pipeline bubble of gt.pipeline: step time against the number of microbatches.

    .venv/bin/python benchmarks/pipeline_bubble.py --mesh=4 --stages=4 \
        --microbatches=1,2,4,8,16 --microbatch_size=8 --seq=32 --d_model=128 --d_ff=512
    .venv/bin/python benchmarks/pipeline_bubble.py --microbatches= --train_steps=5

An S-stage GPipe schedule runs M + S - 1 iterations for M microbatches; in each, every
stage computes (in the SPMD form the stages without a microbatch compute on zeros), so
S - 1 of the iterations are the bubble: the ideal step time is T(M) = c + t (M + S - 1)
with t the time of one iteration and c the fixed cost of a call, and the bubble's share
of the pipeline's time is (S-1)/(M+S-1). The script times a forward-and-backward step
(loss and the gradients of the stacked weights; no update, so every call is the same) of
a stack of residual MLP stages (x + relu(x W1) W2 on [b, seq, d]) for each M, alternating
between the Ms round by round so all see the same machine load, fits c and t to the
medians by least squares, and prints per M: the median step, the step per microbatch,
the measured bubble share (S-1) t / T(M) (the time of the S-1 bubble iterations over the
whole step) beside (S-1)/(M+S-1), and the fit's residual.

On a mesh "S" the stage dim is split over one "stage" axis; on "S,D,M" over
(stage, data, model): microbatches split over "data", W1 column- and W2 row-split over
"model". The logical devices share the host's cores, so this measures the schedule's
shape, not a speed-up over one device.

--train_steps=N also trains the small pipelined Transformer stack of
gspmd_tf/testing/pipeline_model.py for N SGD steps on a 2x2x2 (stage, data, model) mesh and
on one device (the unpipelined sequential model), and prints both losses per step.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

MESH = flags.DEFINE_string("mesh", "4", "mesh shape: S (stage) or S,D,M (stage,data,model)")
STAGES = flags.DEFINE_integer("stages", 4, "pipeline stages (a multiple of the stage axis)")
MICROBATCHES = flags.DEFINE_string("microbatches", "1,2,4,8,16",
                                   "microbatch counts to time (empty: none)")
MICROBATCH_SIZE = flags.DEFINE_integer("microbatch_size", 8, "examples per microbatch")
SEQ = flags.DEFINE_integer("seq", 32, "sequence length")
D_MODEL = flags.DEFINE_integer("d_model", 128, "model width")
D_FF = flags.DEFINE_integer("d_ff", 512, "hidden width")
REPEATS = flags.DEFINE_integer("repeats", 7, "timed rounds (one call per M each)")
WARMUP = flags.DEFINE_integer("warmup", 2, "untimed calls per M first")
TRAIN_STEPS = flags.DEFINE_integer("train_steps", 0, "Transformer SGD steps (0: skip)")


def stage(w, x):
    """One residual MLP stage on x [b, seq, d]."""
    import tensorflow as tf
    return x + tf.einsum("bsf,fd->bsd", tf.nn.relu(tf.einsum("bsd,df->bsf", x, w["w1"])),
                         w["w2"])


def _step_fn(gt, tf, mesh, microbatch_spec):
    """Forward and backward: the loss and the sum of squares of the weight gradients."""
    def step(w1, w2, x):
        with tf.GradientTape() as tape:
            tape.watch([w1, w2])
            y = gt.pipeline(stage, {"w1": w1, "w2": w2}, x, mesh=mesh,
                            microbatch_spec=microbatch_spec)
            loss = tf.reduce_mean(tf.square(y))
        grads = tape.gradient(loss, [w1, w2])
        return loss, tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
    return step


def time_bubble(gt, tf, mesh):
    """Median step per M, the fit T(M) = c + t (M + S - 1), one table row per M."""
    from gspmd_tf.layout import Layout
    P = gt.P
    model = "model" in mesh.axis_names
    data = "data" in mesh.axis_names
    S, b, d, f = STAGES.value, MICROBATCH_SIZE.value, D_MODEL.value, D_FF.value
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((S, d, f)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.standard_normal((S, f, d)) / np.sqrt(f)).astype(np.float32)
    counts = [int(m) for m in MICROBATCHES.value.split(",") if m]
    specs = (P("stage", None, "model" if model else None), P("stage", "model" if model else None),
             P(None, "data" if data else None))
    steps = {}
    for m in counts:
        x = rng.standard_normal((m, b, SEQ.value, d)).astype(np.float32)
        fn = gt.function(_step_fn(gt, tf, mesh, P("data") if data else None), mesh=mesh,
                         in_shardings=specs)
        # placed on the devices once: the timed calls move no inputs
        args = [gt.ShardedTensor.from_value(v, mesh, Layout.from_spec(mesh, s, v.ndim))
                for v, s in zip((w1, w2, x), specs)]
        t0 = time.perf_counter()
        fn(*args)[0].numpy()
        low = fn.lower(*args)
        kinds = [c.kind for c in low.collectives()]
        print(f"M={m}: first call {time.perf_counter() - t0:.1f} s; collectives "
              + ", ".join(f"{k} x{kinds.count(k)}" for k in sorted(set(kinds))), flush=True)
        for _ in range(WARMUP.value - 1):
            fn(*args)[0].numpy()
        steps[m] = (fn, args)
    times = {m: [] for m in counts}
    for _ in range(REPEATS.value):
        for m in counts:
            fn, args = steps[m]
            t0 = time.perf_counter()
            fn(*args)[0].numpy()
            times[m].append(time.perf_counter() - t0)
    medians = np.array([statistics.median(times[m]) for m in counts])
    iterations = np.array([m + S - 1 for m in counts], np.float64)
    (c, t), *_ = np.linalg.lstsq(np.stack([np.ones_like(iterations), iterations], 1),
                                 medians, rcond=None)
    print(f"\nfit: T(M) = c + t (M + S - 1), c = {c * 1e3:.1f} ms, t = {t * 1e3:.2f} ms "
          f"per iteration (S = {S})")
    print("| M | iterations | step (median) | step / M | bubble measured (S-1)t/T | "
          "(S-1)/(M+S-1) | fit residual |")
    print("|---|---|---|---|---|---|---|")
    for m, n, median in zip(counts, iterations, medians):
        print(f"| {m} | {int(n)} | {median * 1e3:.1f} ms | {median / m * 1e3:.1f} ms | "
              f"{(S - 1) * t / median:.3f} | {(S - 1) / (m + S - 1):.3f} | "
              f"{(median - c - t * n) / median:+.1%} |")


def train_transformer(gt, tf):
    """The pipelined Transformer of gspmd_tf/testing/pipeline_model.py on a 2x2x2 mesh vs
    one device."""
    from gspmd_tf.testing import pipeline_model as pm
    P = gt.P
    mesh = gt.Mesh.create((2, 2, 2), ("stage", "data", "model"))
    rng = np.random.default_rng(0)
    params = pm.init_params(rng)
    tokens = rng.integers(0, 16, size=(4, 4, 9)).astype(np.int32)
    with tf.device("/device:CPU:0"):
        single = {n: tf.Variable(params[n]) for n in pm.NAMES}
        single_step = tf.function(pm.make_step(single, pm.sequential))
    sharded = {n: gt.Variable(params[n], mesh, pm.SPECS[n], name=n) for n in pm.NAMES}
    step = gt.function(pm.make_step(sharded, pm.pipelined(mesh)), mesh=mesh,
                       in_shardings=(P(None, "data"),))
    print("\n| step | loss, pipelined on (stage 2, data 2, model 2) | loss, one device "
          "(sequential) | relative difference |")
    print("|---|---|---|---|")
    for i in range(TRAIN_STEPS.value):
        got = float(step(tokens).numpy())
        with tf.device("/device:CPU:0"):
            want = float(single_step(tokens))
        print(f"| {i} | {got:.6f} | {want:.6f} | {abs(got - want) / abs(want):.1e} |")
    worst = max(float(np.linalg.norm(sharded[n].numpy() - single[n].numpy())
                      / np.linalg.norm(single[n].numpy())) for n in pm.NAMES)
    kinds = [c.kind for c in step.lower(tokens).collectives()]
    print(f"\nweights after training, worst relative difference: {worst:.1e}; "
          "collectives per step: " + ", ".join(f"{k} x{kinds.count(k)}"
                                               for k in sorted(set(kinds))))


def main(argv):
    del argv
    shape = tuple(int(s) for s in MESH.value.split(","))
    axes = {1: ("stage",), 3: ("stage", "data", "model")}[len(shape)]
    import gspmd_tf as gt
    gt.configure_cpu_devices(max(int(np.prod(shape)), 8 if TRAIN_STEPS.value else 1))
    import tensorflow as tf
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    if MICROBATCHES.value:
        time_bubble(gt, tf, gt.Mesh.create(shape, axes))
    if TRAIN_STEPS.value:
        train_transformer(gt, tf)


if __name__ == "__main__":
    app.run(main)
