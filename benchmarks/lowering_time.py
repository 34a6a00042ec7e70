"""Lowering time of a Transformer stack or a feed-forward training step, excluding tracing.

    .venv/bin/python benchmarks/lowering_time.py --layers=1,4,16,64,256 \
        --devices=8,64,512,2048 --stack_layers=16
    .venv/bin/python benchmarks/lowering_time.py --model=ffn_train --layers=256 \
        --devices= --batch=16 --seq=128 --d_model=512 --d_ff=2048

--model=transformer is the demo's Transformer LM (gspmd_tf.demo.make_loss_fn), annotated
as the demo annotates it. --model=ffn_train is the training step of
benchmarks/xla_lowering_time.py (the same program in JAX, to compare with XLA): per layer
x -> relu(x @ W1 + b1) @ W2 + b2 + x, loss = mean((out - target)^2), one SGD step
returning (loss, new weights); x and target P("data"), W1 P(None, "model"), b1
P("model"), W2 P("model"), b2 replicated, new weights in their weights' shardings.

The program is traced ONCE per layer count with tf.function; the timed part is
gt.lower(concrete function, mesh, in_shardings, out_shardings), i.e. what gt.function
does after tracing, with its stages (Lowered.stage_seconds):

    import     gspmd_tf.graph.importer.import_graph(concrete function)
    propagate  seeds from the shardings, then gspmd_tf.propagation.propagate.propagate
    partition  gspmd_tf.spmd.partitioner.partition(graph, mesh, propagation, out_layouts)

on an abstract mesh (gt.Mesh.abstract: no devices, nothing runs). Two sweeps:
  1. --layers on a 2x4 mesh (data, model);
  2. a fixed stack of --stack_layers layers as the mesh grows: --devices picks the mesh
     shapes (8: 2x4, 64: 8x8, 512: 16x32, 2048: 32x64); --devices= (empty) skips it.
Each cell is the median of --repeats runs after one untimed warm-up run. Stage times are
wall-clock; "total CPU ms" is the process CPU time of the whole lowering (less sensitive
to other load on a shared machine than wall time). gt.lower pauses Python's garbage
collector (see docs/DESIGN_LOG.md); "GC after ms" is a full collection run right after
each lowering (gc.collect()), not in the total; --no_gc_pause lowers with the collector
running, as before the pause, to compare both. Model sizes default to ones every mesh axis
divides (d_model 1024 = 64 heads x 16, d_ff 4096, vocab 32768, batch 64), so the same
program splits evenly on every mesh.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import statistics
import sys
import time
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import ffn_flags  # noqa: E402

MODEL = flags.DEFINE_enum("model", "transformer", ["transformer", "ffn_train"],
                          "program to lower (see the module docstring)")
LAYERS = flags.DEFINE_list("layers", ["1", "4", "16", "64", "256"],
                           "layer counts for the layer sweep (2x4 mesh)")
DEVICES = flags.DEFINE_list("devices", ["8", "64", "512", "2048"],
                            "device counts for the mesh sweep (shapes from MESHES)")
STACK = flags.DEFINE_integer("stack_layers", 16, "layers of the program of the mesh sweep")
BATCH, SEQ, D_MODEL, D_FF, REPEATS = ffn_flags.define_sizes(batch=64, d_model=1024,
                                                            d_ff=4096)
HEADS = flags.DEFINE_integer("heads", 64, "attention heads")
VOCAB = flags.DEFINE_integer("vocab", 32768, "vocabulary size")
NO_GC = flags.DEFINE_bool("disable_gc", False,
                          "turn Python's cyclic GC off while timing (to see its share)")
NO_PAUSE = flags.DEFINE_bool("no_gc_pause", False,
                             "keep Python's GC running inside gt.lower (which pauses it), "
                             "to measure what the pause saves")

MESHES = {8: (2, 4), 64: (8, 8), 512: (16, 32), 2048: (32, 64)}


def trace(cfg):
    """(concrete function, in_shardings, out_shardings) of the --model program for `cfg`
    (tracing is not timed)."""
    import tensorflow as tf
    from gspmd_tf import demo
    if MODEL.value == "transformer":
        fn = tf.function(demo.make_loss_fn(cfg), autograph=False)
        return fn.get_concrete_function(*demo.input_specs(cfg)), demo.in_specs(cfg), None
    return trace_ffn_train(cfg)


def trace_ffn_train(cfg):
    """The feed-forward training step (see the module docstring), traced."""
    import tensorflow as tf
    import gspmd_tf as gt
    layers, d, f = cfg.layers, cfg.d_model, cfg.d_ff

    def step(x, target, *weights):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            h = x
            for i in range(layers):
                w1, b1, w2, b2 = weights[4 * i:4 * i + 4]
                hidden = tf.nn.relu(tf.einsum("bsd,df->bsf", h, w1) + b1)
                h = tf.einsum("bsf,fd->bsd", hidden, w2) + b2 + h
            loss = tf.reduce_mean(tf.square(h - target))
        grads = tape.gradient(loss, weights)
        return (loss,) + tuple(w - ffn_flags.LR * g for w, g in zip(weights, grads))

    act = tf.TensorSpec((cfg.batch, cfg.seq, d), tf.float32)
    per_layer = [tf.TensorSpec(s, tf.float32) for s in ((d, f), (f,), (f, d), (d,))]
    weight_specs = [gt.P(*s) for s in ffn_flags.WEIGHT_SPECS] * layers
    concrete = tf.function(step, autograph=False).get_concrete_function(
        act, act, *per_layer * layers)
    return concrete, [gt.P("data")] * 2 + weight_specs, [gt.P()] + weight_specs


def lower_once(program, mesh):
    """One gt.lower of a traced program; returns per-stage seconds and sizes."""
    import gspmd_tf as gt
    from gspmd_tf.spmd.program import COLLECTIVES

    from gspmd_tf.runtime import lowering

    concrete, in_shardings, out_shardings = program
    if NO_PAUSE.value:  # gt.lower's gc.disable() becomes a no-op (the importer and the
        lowering.gc = types.SimpleNamespace(  # encoder still pause it on their own)
            isenabled=gc.isenabled, disable=lambda: None, enable=gc.enable)
    c0 = time.process_time()
    t0 = time.perf_counter()
    try:
        lowered = gt.lower(concrete, mesh, in_shardings, out_shardings)
    finally:
        lowering.gc = gc
    t1 = time.perf_counter()
    c1 = time.process_time()
    gc.collect()  # a full collection after each lowering, timed on its own
    t2 = time.perf_counter()
    nodes = lowered.program.graph.nodes
    return {**lowered.stage_seconds, "total": t1 - t0, "cpu": c1 - c0, "gc": t2 - t1,
            "ops": len(lowered.graph.nodes), "program_ops": len(nodes),
            "collectives": sum(1 for n in nodes if n.op in COLLECTIVES),
            "sweeps": lowered.propagation.sweeps}


def measure(program, meshes, repeats):
    """Median per-stage times of `repeats` lowerings on each mesh, after one untimed
    warm-up each; the meshes take turns, so all see the same machine load."""
    for mesh in meshes:
        lower_once(program, mesh)
    runs = [[] for _ in meshes]
    for _ in range(repeats):
        for i, mesh in enumerate(meshes):
            gc.collect()
            if NO_GC.value:
                gc.disable()
            try:
                runs[i].append(lower_once(program, mesh))
            finally:
                gc.enable()
    out = []
    for mesh_runs in runs:
        r = {k: statistics.median(run[k] for run in mesh_runs)
             for k in ("import", "propagate", "partition", "total", "cpu", "gc")}
        r.update({k: mesh_runs[0][k] for k in ("ops", "program_ops", "collectives", "sweeps")})
        out.append(r)
    return out


HEADER = ("| {first} | traced ops | SPMD ops | collectives | import ms | propagate ms "
          "| partition ms | total ms | total CPU ms | CPU µs/op | GC after ms "
          "| (trace s, not in total) |")
RULE = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"


def row(first, r, trace_s):
    return (f"| {first} | {r['ops']} | {r['program_ops']} | {r['collectives']} "
            f"| {r['import'] * 1e3:.1f} | {r['propagate'] * 1e3:.1f} "
            f"| {r['partition'] * 1e3:.1f} | {r['total'] * 1e3:.1f} "
            f"| {r['cpu'] * 1e3:.1f} | {r['cpu'] / r['ops'] * 1e6:.0f} | {r['gc'] * 1e3:.1f} "
            f"| {trace_s} |")


def main(argv):
    del argv
    import gspmd_tf as gt
    from gspmd_tf import demo
    # The partitioner warns about the scalar shape ops of the cross-entropy (no rule) on
    # every lowering; keep the table readable.
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)

    base = dict(d_model=D_MODEL.value, heads=HEADS.value, d_ff=D_FF.value,
                vocab=VOCAB.value, seq=SEQ.value, batch=BATCH.value)
    print(f"# lowering time (import + propagate + partition, tracing excluded)\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}; load average at start "
          f"{os.getloadavg()[0]:.2f}; median of {REPEATS.value} repeats; "
          f"Python GC {'off' if NO_GC.value else 'on'} while timing"
          f"{', not paused inside gt.lower' if NO_PAUSE.value else ''}; model "
          f"{MODEL.value} {base}\n")

    print(f"## layer sweep, abstract mesh 2x4 (data, model)\n")
    print(HEADER.format(first="layers"))
    print(RULE)
    mesh = gt.Mesh.abstract((2, 4), demo.AXES)
    traced = {}
    for n in map(int, LAYERS.value):
        cfg = demo.ModelConfig(layers=n, **base)
        start = time.perf_counter()
        traced[n] = trace(cfg)
        trace_s = time.perf_counter() - start
        r, = measure(traced[n], [mesh], REPEATS.value)
        print(row(n, r, f"{trace_s:.1f}"), flush=True)

    if not DEVICES.value:
        print(f"\nload average at end {os.getloadavg()[0]:.2f}")
        return
    print(f"\n## mesh sweep, {STACK.value} layers\n")
    print(HEADER.format(first="devices (mesh)").replace("(trace s, not in total)",
                                                          "total vs first mesh"))
    print(RULE)
    cfg = demo.ModelConfig(layers=STACK.value, **base)
    program = traced.get(STACK.value) or trace(cfg)
    devices = list(map(int, DEVICES.value))
    unknown = [n for n in devices if n not in MESHES]
    if unknown:
        raise SystemExit(f"--devices: no mesh shape for {unknown}; known: {sorted(MESHES)}")
    meshes = [gt.Mesh.abstract(MESHES[n], demo.AXES) for n in devices]
    results = measure(program, meshes, REPEATS.value)
    for n, r in zip(devices, results):
        shape = MESHES[n]
        ratio = r["total"] / results[0]["total"]
        print(row(f"{n} ({shape[0]}x{shape[1]})", r, f"{ratio:.2f}x of {devices[0]}"),
              flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
