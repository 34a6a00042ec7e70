"""Training step time: gspmd-tf vs single-device TF vs TF's DTensor, in one process.

    .venv/bin/python benchmarks/train_step.py --layers=4 --batch=16 --seq=128 \
        --d_model=512 --d_ff=2048 --mesh=2,4 --steps=10 --warmup=3
    python benchmarks/train_step.py --tpu=local --mesh=2,4    # on a Cloud TPU VM (v3-8)

The model is a stack of Transformer feed-forward blocks,
    x -> relu(x @ W1 + b1) @ W2 + b2 + x        (per layer)
with loss = mean((out - target)^2); one step is forward, backward and an SGD update of
every weight. Sharding (Megatron style, batch over "data"): x and target P("data"),
W1 P(None, "model"), b1 P("model"), W2 P("model"), b2 replicated.

Systems (--systems, comma-separated, all in this process, same initial values, same
batch, same plain TF step function):
  xla      gt.Variables + gt.function(step, backend="xla") on a --mesh of logical CPU
           devices: the compute between collectives compiled by XLA
  local    the same with backend="local": every op emitted op by op per device, the
           collectives of this process's CPU devices as cross-device reads
  local_tf the local backend with TF's collective ops (LocalBackend(copy_collectives=False))
  local_each  the local backend running every op on every device
           (LocalBackend(replicated_once=False))
  xla_tfdots  the XLA backend with the dots of at least --tf_dots_from multiply-adds
           left to TF's kernels (oneDNN), op by op between the compiled segments
  xla_plain  the XLA backend with TF's collective ops and every segment and op on
           every device (XlaBackend(copy_collectives=False, replicated_once=False))
  single   tf.Variables + tf.function(step) on /CPU:0
  single_jit  the same with tf.function(step, jit_compile=True): XLA on one device
  dtensor  TF's DTensor (tf.experimental.dtensor): DVariables with the same layouts on
           the same logical CPU devices, inputs placed with dtensor.copy_to_mesh +
           relayout, a tf.function step
Steps alternate between the systems (in --systems order, round after round) after
--warmup untimed steps each, so that all see the same machine load; besides the ratio of medians
the table gives the median over rounds of (system's step / single's step in that round),
which is less sensitive to load that changes between rounds. A timed step ends when the
loss is on the host. After timing, every system has taken the same number of steps from
the same start: the losses (and one weight) of gspmd and dtensor are compared with
single's. "first call s" is the system's build (variables, lowering) plus its first
step, in the order the systems run (with --steps=0 only that is measured).

The logical devices of the mesh share the host's cores: on a 2-core host 8 logical
devices cannot beat one device, so the ratio to single-device measures each system's
overhead (smaller local ops, collectives, per-device dispatch), not a speed-up.
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

import backend_names  # noqa: E402

import tpu_flag  # noqa: E402  (defines --tpu)

LAYERS = flags.DEFINE_integer("layers", 4, "feed-forward blocks")
BATCH = flags.DEFINE_integer("batch", 16, "batch size")
SEQ = flags.DEFINE_integer("seq", 128, "sequence length")
D_MODEL = flags.DEFINE_integer("d_model", 512, "model width")
D_FF = flags.DEFINE_integer("d_ff", 2048, "hidden width")
MESH = flags.DEFINE_string("mesh", "2,4", "mesh shape data,model")
STEPS = flags.DEFINE_integer("steps", 10, "timed steps of each system (alternating)")
WARMUP = flags.DEFINE_integer("warmup", 3, "untimed steps of each system first")
SYSTEMS = flags.DEFINE_string("systems", "xla,local,single,single_jit,dtensor",
                              "systems to run, in this order")
LR = flags.DEFINE_float("lr", 0.01, "SGD learning rate")
TF_DOTS_FROM = flags.DEFINE_integer("tf_dots_from", 1 << 20, "xla_tfdots: dots of at "
                                    "least this many multiply-adds run on TF's kernels")
PROFILE = flags.DEFINE_bool("profile", False, "print the gspmd-tf program's op and "
                            "collective counts")

AXES = ("data", "model")
NAMES = ("w1", "b1", "w2", "b2")


def init_values(rng, layers, d, f):
    """Global initial weights: one dict per layer."""
    out = []
    for _ in range(layers):
        out.append({
            "w1": (rng.standard_normal((d, f)) / np.sqrt(d)).astype(np.float32),
            "b1": (rng.standard_normal(f) * 0.1).astype(np.float32),
            "w2": (rng.standard_normal((f, d)) / np.sqrt(f)).astype(np.float32),
            "b2": (rng.standard_normal(d) * 0.1).astype(np.float32)})
    return out


def make_step(tf, variables, lr):
    """The single-device training step over `variables` (one dict of 4 per layer)."""
    flat = [layer[n] for layer in variables for n in NAMES]

    def step(x, target):
        with tf.GradientTape() as tape:
            loss = ffn_loss(tf, x, target, variables)
        grads = tape.gradient(loss, flat)
        for v, g in zip(flat, grads):
            v.assign_sub(lr * g)
        return loss
    return step


def ffn_loss(tf, x, target, layers):
    """The model's loss; `layers`: one dict of 4 weights (variables or tensors) per layer."""
    h = x
    for layer in layers:
        hidden = tf.nn.relu(tf.einsum("bsd,df->bsf", h, layer["w1"]) + layer["b1"])
        h = tf.einsum("bsf,fd->bsd", hidden, layer["w2"]) + layer["b2"] + h
    return tf.reduce_mean(tf.square(h - target))


def make_functional_step(tf, layers, lr):
    """The same SGD step with the weights as arguments and results, for --tpu:
    step(x, target, *weights) -> (loss, *new weights), weights in NAMES order per layer."""
    def step(x, target, *weights):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            loss = ffn_loss(tf, x, target, [dict(zip(NAMES, weights[i:i + len(NAMES)]))
                                            for i in range(0, layers * len(NAMES),
                                                           len(NAMES))])
        grads = tape.gradient(loss, weights)
        return (loss,) + tuple(w - lr * g for w, g in zip(weights, grads))
    return step


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def make_problem(gt):
    """(weight specs by name, per-layer weights, x, target) of the flags' model, from
    seed 0: every system and the --tpu step start from these."""
    P = gt.P
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model"), "b2": P()}
    rng = np.random.default_rng(0)
    values = init_values(rng, LAYERS.value, D_MODEL.value, D_FF.value)
    x = rng.standard_normal((BATCH.value, SEQ.value, D_MODEL.value)).astype(np.float32)
    target = rng.standard_normal((BATCH.value, SEQ.value, D_MODEL.value)).astype(np.float32)
    return specs, values, x, target


def main(argv):
    del argv
    shape = tuple(int(x) for x in MESH.value.split(","))
    n_dev = int(np.prod(shape))
    systems = [s for s in SYSTEMS.value.split(",") if s]
    tpu = tpu_flag.connect()  # before any other TF work
    import gspmd_tf as gt
    if tpu is not None:
        return run_on_tpu(gt, tpu, shape)
    gt.configure_cpu_devices(n_dev)
    import tensorflow as tf
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)  # DTensor's mesh log lines
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    P = gt.P
    specs, values, x, target = make_problem(gt)
    d, f = D_MODEL.value, D_FF.value
    whole_bytes = sum(v.nbytes for layer in values for v in layer.values())

    print("# training step: gspmd-tf vs single-device TF vs DTensor (one process, "
          "alternating)\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {n_dev} logical CPU "
          f"devices, TF {tf.__version__}, load average at start {os.getloadavg()[0]:.2f}; "
          f"layers={LAYERS.value} batch={BATCH.value} seq={SEQ.value} d_model={d} "
          f"d_ff={f} mesh={shape}; {WARMUP.value} warm-up + {STEPS.value} timed steps "
          "each\n", flush=True)

    runners, finals, weight_bytes, builds = {}, {}, {}, {}
    cpu0 = tf.config.list_logical_devices("CPU")[0].name

    # ---------------------------------------------------------------- single device
    def build_single(jit):
        start = time.perf_counter()
        with tf.device(cpu0):
            svars = [{n: tf.Variable(layer[n], name=f"{n}_{i}") for n in NAMES}
                     for i, layer in enumerate(values)]
            sx, st = tf.constant(x), tf.constant(target)
        single_step = tf.function(make_step(tf, svars, LR.value), autograph=False,
                                  jit_compile=jit)

        def run_single():
            with tf.device(cpu0):
                return float(single_step(sx, st).numpy())
        return run_single, lambda: svars[0]["w1"].numpy(), whole_bytes, start

    # ---------------------------------------------------------------- gspmd-tf
    def build_gspmd(backend):
        start = time.perf_counter()
        mesh = gt.Mesh.create(shape, AXES)
        gvars = [{n: gt.Variable(layer[n], mesh, specs[n], name=f"{n}_{i}") for n in NAMES}
                 for i, layer in enumerate(values)]
        gstep = gt.function(make_step(tf, gvars, LR.value), mesh=mesh,
                            in_shardings=(P("data"), P("data")), backend=backend)
        lowered = gstep.lower(tf.TensorSpec(x.shape, tf.float32),
                              tf.TensorSpec(target.shape, tf.float32))
        gx, gtgt = (gt.ShardedTensor.from_value(v, mesh, s.to_layout(mesh, v.ndim))
                    for v, s in zip((x, target), lowered.input_shardings))

        def run_gspmd():
            return float(gstep(gx, gtgt).numpy())
        if PROFILE.value:
            profile_program(lowered)
        return run_gspmd, lambda: gvars[0]["w1"].numpy(), sum(
            max(v.shard_bytes()) for layer in gvars for v in layer.values()), start

    for system in systems:
        if system in backend_names.NAMES + ("single", "single_jit"):
            built = (build_gspmd(backend_names.backend(system, TF_DOTS_FROM.value))
                     if system in backend_names.NAMES
                     else build_single(system == "single_jit"))
            runners[system], finals[system], weight_bytes[system], start = built
            builds[system] = time.perf_counter() - start

    # ---------------------------------------------------------------- DTensor
    if "dtensor" in systems:
        from tensorflow.experimental import dtensor
        start = time.perf_counter()
        devices = [f"CPU:{i}" for i in range(n_dev)]
        dmesh = dtensor.create_mesh(list(zip(AXES, shape)), devices=devices)
        U = dtensor.UNSHARDED
        dlayouts = {"w1": dtensor.Layout([U, "model"], dmesh),
                    "b1": dtensor.Layout(["model"], dmesh),
                    "w2": dtensor.Layout(["model", U], dmesh),
                    "b2": dtensor.Layout([U], dmesh)}
        batch_layout = dtensor.Layout(["data", U, U], dmesh)

        def place(value, layout):
            return dtensor.relayout(
                dtensor.copy_to_mesh(tf.constant(value), dtensor.Layout.replicated(
                    dmesh, value.ndim)), layout)
        dvars = [{n: dtensor.DVariable(place(layer[n], dlayouts[n]), name=f"d{n}_{i}")
                  for n in NAMES} for i, layer in enumerate(values)]
        dx, dt = place(x, batch_layout), place(target, batch_layout)
        dstep = tf.function(make_step(tf, dvars, LR.value), autograph=False)

        def run_dtensor():
            return float(dstep(dx, dt).numpy())
        runners["dtensor"] = run_dtensor
        finals["dtensor"] = lambda: _dtensor_global(dtensor, dvars[0]["w1"])
        weight_bytes["dtensor"] = sum(
            int(np.prod(dtensor.unpack(v.read_value())[0].shape)) * 4
            for layer in dvars for v in layer.values())
        builds["dtensor"] = time.perf_counter() - start

    order = [s for s in systems if s in runners]
    fns = [runners[s] for s in order]
    warm = {}
    for s, fn in zip(order, fns):
        start = time.perf_counter()
        fn()
        warm[s] = time.perf_counter() - start
        for _ in range(WARMUP.value - 1):
            fn()
    times = {s: [] for s in order}
    for _ in range(STEPS.value):
        for s, fn in zip(order, fns):
            start = time.perf_counter()
            fn()
            times[s].append(time.perf_counter() - start)
    # every system has now taken warmup + steps SGD steps; one more gives the loss after them
    losses = {s: runners[s]() for s in order}
    weights = {s: finals[s]() for s in order}

    print("| system | median step ms | min ms | ratio to single (medians) "
          "| paired ratio to single (median over rounds) | ratio to single_jit (medians) "
          "| weights per device | first call s (incl. build) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    med = {s: statistics.median(times[s]) for s in order if times[s]}
    for s in order:
        cells = ["-"] * 5
        if s in med:
            cells[:2] = [f"{med[s] * 1e3:.1f}", f"{min(times[s]) * 1e3:.1f}"]
            if "single" in med:
                cells[2] = f"{med[s] / med['single']:.2f}"
                cells[3] = f"{statistics.median(a / b for a, b in zip(times[s], times['single'])):.2f}"
            if "single_jit" in med:
                cells[4] = f"{med[s] / med['single_jit']:.2f}"
        print(f"| {LABEL[s]} | {' | '.join(cells)} | {fmt_bytes(weight_bytes[s])} "
              f"| {builds[s] + warm[s]:.2f} |")
    print()
    if "single" in losses:
        for s in order:
            if s != "single":
                print(f"{LABEL[s]}: loss after {WARMUP.value + STEPS.value} steps "
                      f"{losses[s]:.6f} vs single {losses['single']:.6f}, rel. diff "
                      f"{abs(losses[s] - losses['single']) / abs(losses['single']):.1e}; "
                      f"layer-0 W1 rel. diff {rel(weights[s], weights['single']):.1e}")
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


def run_on_tpu(gt, tpu, shape):
    """--tpu: the functional SGD step (weights in, weights out) as the annotated global
    graph under TPUStrategy; its step time, and its loss after warmup + steps steps beside
    single-device TF's on the host CPU after as many."""
    import tensorflow as tf
    P = gt.P
    specs, values, x, target = make_problem(gt)
    d, f = D_MODEL.value, D_FF.value
    weights = [layer[n] for layer in values for n in NAMES]
    step_fn = make_functional_step(tf, LAYERS.value, LR.value)
    lowered = gt.lower(step_fn, tpu.mesh(shape, AXES),
                       (P("data"), P("data")) + tuple(specs[n] for _ in values for n in NAMES),
                       args=[tf.TensorSpec(v.shape, tf.float32) for v in [x, target] + weights])
    run = tpu.program(lowered)
    tx, tt = tf.constant(x), tf.constant(target)

    def step(state):
        outs = run(tx, tt, *state[1])
        return float(outs[0].numpy()), list(outs[1:])
    times, (loss, _) = tpu_flag.time_steps(step, (None, [tf.constant(w) for w in weights]),
                                           STEPS.value, WARMUP.value)
    with tf.device("/CPU:0"):
        svars = [{n: tf.Variable(layer[n]) for n in NAMES} for layer in values]
        single = tf.function(make_step(tf, svars, LR.value), autograph=False)
        for _ in range(WARMUP.value + STEPS.value - 1):
            single(tx, tt)
        reference = float(single(tx, tt).numpy())
    print(f"# training step on TPU {tpu_flag.TPU.value} ({tpu.num_cores} cores, "
          f"TPUStrategy + XLA SPMD), TF {tf.__version__}; layers={LAYERS.value} "
          f"batch={BATCH.value} seq={SEQ.value} d_model={d} d_ff={f} mesh={shape}\n")
    print("| mesh | TPU median step ms | min ms | loss after the steps | single-device "
          "(host CPU) loss | rel. diff |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| {shape[0]}x{shape[1]} | {tpu_flag.summary(times)} | {loss:.6f} "
          f"| {reference:.6f} | {abs(loss - reference) / abs(reference):.1e} |")


LABEL = {"auto": "gspmd-tf, default backend (auto: XLA or local per program)",
         "xla": "gspmd-tf, XLA backend (gt.Variable + gt.function)",
         "local": "gspmd-tf, local backend (op by op)",
         "local_tf": "gspmd-tf, local backend with TF's collective ops",
         "local_each": "gspmd-tf, local backend, every op on every device",
         "xla_tfdots": "gspmd-tf, XLA backend, large dots on TF's kernels",
         "xla_plain": "gspmd-tf, XLA backend, TF's collectives, every op on every device",
         "single": "single-device TF (tf.function, /CPU:0)",
         "single_jit": "single-device TF + XLA (tf.function jit_compile, /CPU:0)",
         "dtensor": "TF DTensor (DVariable + tf.function)"}


def _dtensor_global(dtensor, var):
    """Global value of a DVariable (relayout to replicated, then one component)."""
    import tensorflow as tf
    value = var.read_value()
    layout = dtensor.fetch_layout(value)
    full = dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, layout.rank))
    return tf.identity(dtensor.unpack(full)[0]).numpy()


def profile_program(lowered):
    """Counts of the SPMD program's ops by type and of its collectives."""
    import collections
    g = lowered.program.graph
    ops = collections.Counter(node.op for node in g.nodes)
    print(f"SPMD program: {len(g.nodes)} nodes (x{lowered.mesh.size} devices)")
    print("  ops: " + ", ".join(f"{k} {v}" for k, v in ops.most_common()))
    rows = collections.Counter((c.kind, c.shape, c.axes) for c in lowered.collectives())
    total = sum(c.bytes for c in lowered.collectives())
    print(f"  collectives: {sum(rows.values())}, {fmt_bytes(total)} per device")
    for (kind, shp, axes), k in rows.most_common():
        print(f"    {kind:20s} {str(shp):20s} over {axes} x{k}")
    print(flush=True)


if __name__ == "__main__":
    app.run(main)
