"""MoE training step time: gspmd-tf on an expert mesh beside single-device TF, in one run.

    .venv/bin/python benchmarks/moe_step.py --mesh=8 --groups=8 --tokens=256 \
        --d_model=64 --d_ff=256 --experts=8 --k=2 --capacity_factor=1.25 --steps=20

The layer is gspmd_tf/moe.py (GShard: top-k softmax gating, cumsum capacity, dispatch and
combine einsums, a ReLU expert FFN per expert), loss = mean(y^2) + 0.01 * aux_loss; one
step is forward, backward and an SGD update of the gating and expert weights. Sharding
(GShard): x [G, S, M] split on G over every device, expert weights [E, ...] on the
"expert" axis, the expert buffers [E, G, C, M] on "expert" (and G on "data" on a 2-D
--mesh=D,E, axes ("data", "expert")); the gating weights replicated.

Both systems run the same step function from the same initial values on the same batch:
  gspmd    gt.Variables + gt.function(step) on the --mesh of logical CPU devices
  single   tf.Variables + tf.function(step) on /CPU:0
Steps alternate (gspmd, single, gspmd, ...) after --warmup untimed steps each (see
train_step.py for why); a timed step ends when the loss is on the host. Printed: the
step-time table, the program's collectives (kind, bytes per device, count), and the
loss and weights of both after the same number of steps. The logical devices share the
host's cores, so the ratio measures the partitioned program's overhead (smaller local
ops, all-to-alls, per-device dispatch), not a speed-up.
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

MESH = flags.DEFINE_string("mesh", "8", "mesh shape: E (axis 'expert') or D,E "
                           "(axes 'data', 'expert')")
GROUPS = flags.DEFINE_integer("groups", 8, "G: token groups")
TOKENS = flags.DEFINE_integer("tokens", 256, "S: tokens per group")
D_MODEL = flags.DEFINE_integer("d_model", 64, "M: model width")
D_FF = flags.DEFINE_integer("d_ff", 256, "H: expert hidden width")
EXPERTS = flags.DEFINE_integer("experts", 8, "E: experts")
K = flags.DEFINE_integer("k", 2, "experts per token (1: ArgMax, else TopKV2)")
CAPACITY_FACTOR = flags.DEFINE_float("capacity_factor", 1.25, "capacity factor")
PAPER_ANNOTATIONS = flags.DEFINE_bool(
    "paper_annotations", False, "annotate only what the GShard paper's Algorithm 2 does "
    "(not the dispatch mask and combine weights)")
STEPS = flags.DEFINE_integer("steps", 20, "timed steps of each system (alternating)")
WARMUP = flags.DEFINE_integer("warmup", 3, "untimed steps of each system first")
LR = flags.DEFINE_float("lr", 0.1, "SGD learning rate")

NAMES = ("wg", "w_in", "w_out")


def make_step(tf, moe, variables, mesh, specs):
    """The training step over `variables` (dict of NAMES); mesh/specs None: one device."""
    flat = [variables[n] for n in NAMES]

    def step(x):
        with tf.GradientTape() as tape:
            y, aux = moe.moe_layer(x, *flat, k=K.value, capacity_factor=CAPACITY_FACTOR.value,
                                   mesh=mesh, specs=specs,
                                   annotate_gating=not PAPER_ANNOTATIONS.value)
            loss = tf.reduce_mean(tf.square(y)) + 0.01 * aux
        for v, g in zip(flat, tape.gradient(loss, flat)):
            v.assign_sub(LR.value * g)
        return loss
    return step


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv):
    del argv
    shape = tuple(int(n) for n in MESH.value.split(","))
    import gspmd_tf as gt
    gt.configure_cpu_devices(int(np.prod(shape)))
    import tensorflow as tf
    from gspmd_tf import moe
    from gspmd_tf.demo import collective_table, fmt_bytes, side_by_side
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    P = gt.P
    if len(shape) == 1:
        axes = ("expert",)
        specs = moe.MoeSpecs(P("expert"), P("expert"), P("expert"))
    else:
        axes = ("data", "expert")
        specs = moe.MoeSpecs(P(("data", "expert")), P("expert"), P("expert", "data"))
    var_specs = {"wg": P(), "w_in": specs.experts, "w_out": specs.experts}

    g, s, m, h, e = GROUPS.value, TOKENS.value, D_MODEL.value, D_FF.value, EXPERTS.value
    rng = np.random.default_rng(0)
    values = {"wg": (rng.standard_normal((m, e)) / np.sqrt(m)).astype(np.float32),
              "w_in": (rng.standard_normal((e, m, h)) / np.sqrt(m)).astype(np.float32),
              "w_out": (rng.standard_normal((e, h, m)) / np.sqrt(h)).astype(np.float32)}
    x = rng.standard_normal((g, s, m)).astype(np.float32)
    cap = moe.capacity(s, e, K.value, CAPACITY_FACTOR.value)
    print("# MoE training step: gspmd-tf vs single-device TF (one process, alternating)\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, TF {tf.__version__}, "
          f"load average at start {os.getloadavg()[0]:.2f}; mesh={shape} {axes}; G={g} "
          f"S={s} M={m} H={h} E={e} k={K.value} capacity_factor={CAPACITY_FACTOR.value} "
          f"(C={cap}); paper_annotations={PAPER_ANNOTATIONS.value}; {WARMUP.value} warm-up "
          f"+ {STEPS.value} timed steps each\n", flush=True)

    cpu0 = tf.config.list_logical_devices("CPU")[0].name
    with tf.device(cpu0):
        svars = {n: tf.Variable(values[n], name=n) for n in NAMES}
        sx = tf.constant(x)
    single_step = tf.function(make_step(tf, moe, svars, None, None), autograph=False)

    def run_single():
        with tf.device(cpu0):
            return float(single_step(sx).numpy())

    mesh = gt.Mesh.create(shape, axes)
    gvars = {n: gt.Variable(values[n], mesh, var_specs[n], name=n) for n in NAMES}
    gstep = gt.function(make_step(tf, moe, gvars, mesh, specs), mesh=mesh,
                        in_shardings=(specs.groups,))
    start = time.perf_counter()
    lowered = gstep.lower(tf.TensorSpec(x.shape, tf.float32))
    lower_s = time.perf_counter() - start
    gx = gt.ShardedTensor.from_value(x, mesh, lowered.input_shardings[0].to_layout(mesh, 3))

    def run_gspmd():
        return float(gstep(gx).numpy())

    order, fns = ("gspmd", "single"), (run_gspmd, run_single)
    first = {}
    for name, fn in zip(order, fns):
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
    times = dict(zip(order, side_by_side(fns, STEPS.value, warmup=WARMUP.value - 1)))
    steps_taken = WARMUP.value + STEPS.value
    losses = {name: fn() for name, fn in zip(order, fns)}

    med = {name: statistics.median(t) for name, t in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["gspmd"], times["single"]))
    print("| system | median step ms | min ms | ratio to single (medians) | paired ratio "
          "(median over rounds) | first call s |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| gspmd-tf, mesh {'x'.join(map(str, shape))} | {med['gspmd'] * 1e3:.1f} | "
          f"{min(times['gspmd']) * 1e3:.1f} | {med['gspmd'] / med['single']:.2f} | "
          f"{paired:.2f} | {first['gspmd'] + lower_s:.1f} |")
    print(f"| single-device TF | {med['single'] * 1e3:.1f} | {min(times['single']) * 1e3:.1f} "
          f"| 1.00 | 1.00 | {first['single']:.1f} |\n")
    print("collectives of the gspmd-tf step (per device):\n")
    print("| kind | local shape | bytes | count | axes |")
    print("|---|---|---:|---:|---|")
    for kind, local, _, nbytes, count, over in collective_table(lowered.collectives()):
        print(f"| {kind} | {local} | {fmt_bytes(nbytes)} | {count} | {','.join(over)} |")
    print(f"\nreplicated ops: {lowered.program.replicated_ops or 'none'}")
    print(f"loss after {steps_taken} steps: gspmd {losses['gspmd']:.6f}, single "
          f"{losses['single']:.6f}, rel. diff "
          f"{abs(losses['gspmd'] - losses['single']) / abs(losses['single']):.1e}; weights "
          "rel. diff " + ", ".join(f"{n} {rel(gvars[n].numpy(), svars[n].numpy()):.1e}"
                                   for n in NAMES))
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
