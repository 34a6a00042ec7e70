"""Step time of the demo Transformer: gspmd-tf on a mesh vs single-device TF.

    .venv/bin/python benchmarks/step_time.py --meshes=2,4 --repeats=30
    .venv/bin/python benchmarks/step_time.py --meshes=2,4 --train --backends=xla,local
    python benchmarks/step_time.py --tpu=local --meshes=2,4     # on a Cloud TPU VM (v3-8)

The model is gspmd_tf.demo's (make_loss_fn), annotated as the demo annotates it. One step
is the forward loss, or with --train one Adam training step (demo.make_train_step:
forward, backward, update of every weight and its two optimizer slots, variables as
gt.Variables / tf.Variables). For each mesh of --meshes (';'-separated shapes, axes
data,model) and each gspmd-tf backend of --backends it builds the gt.function, places
the inputs on the mesh once (ShardedTensors in the input shardings the program chose),
and times the step beside the same function under a plain tf.function on one device
("single") and, unless --nosingle_jit, under tf.function(jit_compile=True) on one device
("single+XLA"). All run in ONE process, their repeats alternating after --warmup calls
each, so all see the same machine load. Reported: medians, the ratios of medians, the
first call of each (build, lowering and compilation included) and the loss's relative
difference from the single-device loss (with --train after the same number of steps).

The logical CPU devices of a mesh share the host's cores (see the machine line): on a
2-core host, 8 logical devices cannot beat one device; the ratio measures gspmd-tf's
overhead (smaller local ops, collectives, per-device dispatch), not a speed-up.

With --tpu (benchmarks/tpu_flag.py) each mesh must have as many devices as the TPU has
cores: the annotated global graph runs under TPUStrategy, compiled by TF's XLA bridge,
and the table gives its step time and its loss beside the single-device loss on the host
CPU.
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

from gspmd_tf import demo  # noqa: E402  (no TF import at module level)
import tpu_flag  # noqa: E402  (defines --tpu)

MESHES = flags.DEFINE_string("meshes", "2,4", "';'-separated mesh shapes data,model, "
                             "e.g. '2,4;1,8;8,1'")
REPEATS = flags.DEFINE_integer("repeats", 30, "timed steps of each (alternating)")
WARMUP = flags.DEFINE_integer("warmup", 3, "untimed steps of each first")
_D = demo.ModelConfig()
LAYERS = flags.DEFINE_integer("layers", _D.layers, "Transformer layers")
D_MODEL = flags.DEFINE_integer("d_model", _D.d_model, "model width")
HEADS = flags.DEFINE_integer("heads", _D.heads, "attention heads")
D_FF = flags.DEFINE_integer("d_ff", _D.d_ff, "MLP hidden width")
VOCAB = flags.DEFINE_integer("vocab", _D.vocab, "vocabulary size")
SEQ = flags.DEFINE_integer("seq", _D.seq, "sequence length")
BATCH = flags.DEFINE_integer("batch", _D.batch, "batch size")
BACKENDS = flags.DEFINE_string("backends", "xla,local", "gspmd-tf backends to time: "
                               "xla, local, local_tf (the local backend with TF's "
                               "collective ops), local_each (the local backend running "
                               "every op on every device), or xla_tfdots (the XLA "
                               "backend with dots of at least --tf_dots_from "
                               "multiply-adds on TF's kernels)")
TF_DOTS_FROM = flags.DEFINE_integer("tf_dots_from", 1 << 20, "see --backends")
TRAIN = flags.DEFINE_bool("train", False, "time the Adam training step, not the forward")
SINGLE_JIT = flags.DEFINE_bool("single_jit", True, "also time single-device TF with "
                               "jit_compile=True")


def main(argv):
    del argv
    meshes = [tuple(int(x) for x in m.split(",")) for m in MESHES.value.split(";") if m]
    tpu = tpu_flag.connect()  # before any other TF work
    backends = [b for b in BACKENDS.value.split(",") if b]
    import gspmd_tf as gt
    if tpu is None:
        gt.configure_cpu_devices(max(int(np.prod(m)) for m in meshes))
    import tensorflow as tf
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)

    cfg = demo.ModelConfig(layers=LAYERS.value, d_model=D_MODEL.value, heads=HEADS.value,
                           d_ff=D_FF.value, vocab=VOCAB.value, seq=SEQ.value,
                           batch=BATCH.value)
    params = demo.init_params(cfg)
    tokens = demo.make_batch(cfg)
    if tpu is not None:
        return run_on_tpu(gt, tf, tpu, meshes, cfg, demo.make_loss_fn(cfg),
                          [tokens] + params)
    step = "Adam training step" if TRAIN.value else "forward step"

    print(f"# {step} time: gspmd-tf vs single-device TF (same process, alternating)\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, TF {tf.__version__}, "
          f"load average at start {os.getloadavg()[0]:.2f}; model {cfg}; "
          f"{WARMUP.value} warm-up + {REPEATS.value} timed steps each\n")

    cpu0 = tf.config.list_logical_devices("CPU")[0].name

    print("| mesh | devices | system | median ms | min ms | ratio to single "
          "| ratio to single+XLA | first call s | loss rel. diff |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for shape in meshes:
        mesh = gt.Mesh.create(shape, demo.AXES)
        # built anew per mesh: with --train every system starts from the same weights
        systems = {"single": single_step(tf, cfg, params, tokens, cpu0, jit=False)}
        if SINGLE_JIT.value:
            systems["single+XLA"] = single_step(tf, cfg, params, tokens, cpu0, jit=True)
        for backend in backends:
            systems[f"gspmd-tf {backend}"] = sharded_step(gt, tf, cfg, mesh, backend,
                                                          params, tokens)
        names = list(systems)
        first = {}
        for name in names:
            start = time.perf_counter()
            systems[name]()
            first[name] = time.perf_counter() - start
        times = dict(zip(names, demo.side_by_side([systems[n] for n in names],
                                                  REPEATS.value, WARMUP.value - 1)))
        losses = {name: systems[name]() for name in names}  # after equal numbers of steps
        med = {name: statistics.median(t) for name, t in times.items()}
        for name in names:
            rel = abs(losses[name] - losses["single"]) / abs(losses["single"])
            jit = f"{med[name] / med['single+XLA']:.2f}" if "single+XLA" in med else "-"
            print(f"| {shape[0]}x{shape[1]} | {mesh.size} | {name} | {med[name] * 1e3:.2f} "
                  f"| {min(times[name]) * 1e3:.2f} | {med[name] / med['single']:.2f} "
                  f"| {jit} | {first[name]:.2f} | {rel:.1e} |", flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


def run_on_tpu(gt, tf, tpu, meshes, cfg, loss_fn, values):
    """The --tpu table: per mesh, the TPU program's step time and loss."""
    with tf.device("/CPU:0"):
        reference = float(tf.function(loss_fn, autograph=False)(*values).numpy())
    print(f"# forward step time on TPU {tpu_flag.TPU.value} ({tpu.num_cores} cores, "
          f"TPUStrategy + XLA SPMD), TF {tf.__version__}; model {cfg}; "
          f"{WARMUP.value} warm-up + {REPEATS.value} timed steps\n")
    print("| mesh | cores | TPU median ms | min ms | loss rel. diff vs host CPU |")
    print("|---|---:|---:|---:|---:|")
    for shape in meshes:
        lowered = gt.lower(loss_fn, tpu.mesh(shape, demo.AXES), demo.in_specs(cfg),
                           args=demo.input_specs(cfg))
        run = tpu.program(lowered)
        args = [tf.constant(v) for v in values]

        def step(_):
            return float(run(*args)[0].numpy())
        times, loss = tpu_flag.time_steps(step, None, REPEATS.value, WARMUP.value)
        print(f"| {shape[0]}x{shape[1]} | {tpu.num_cores} | {tpu_flag.summary(times)} "
              f"| {abs(loss - reference) / abs(reference):.1e} |", flush=True)


def single_step(tf, cfg, params, tokens, device, jit):
    """run() -> loss of one step of single-device TF on `device` (the first call of a
    --train step makes its variables)."""
    loss_fn = demo.make_loss_fn(cfg)
    with tf.device(device):
        args = [tf.constant(tokens)] + [tf.constant(p) for p in params]
        if TRAIN.value:
            variables = [tf.Variable(p) for p in params]
            slots = [(tf.Variable(np.zeros_like(p)), tf.Variable(np.zeros_like(p)))
                     for p in params]
            fn = demo.make_train_step(loss_fn, variables, slots, tf.Variable(np.float32(0)))
            args = args[:1]
        else:
            fn = loss_fn
    step = tf.function(fn, autograph=False, jit_compile=jit)

    def run():
        with tf.device(device):
            return float(step(*args).numpy())
    return run


def sharded_step(gt, tf, cfg, mesh, backend, params, tokens):
    """run() -> loss of one gspmd-tf step on `mesh` through `backend`."""
    loss_fn = demo.make_loss_fn(cfg)
    specs = demo.in_specs(cfg)
    values = [tokens] + params
    if TRAIN.value:
        weight_specs = [gt.P() if s is None else s for s in specs[1:]]
        variables = [gt.Variable(p, mesh, s) for p, s in zip(params, weight_specs)]
        slots = [(gt.Variable(np.zeros_like(p), mesh, s), gt.Variable(np.zeros_like(p),
                                                                      mesh, s))
                 for p, s in zip(params, weight_specs)]
        counter = gt.Variable(np.float32(0), mesh, gt.P())
        fn = demo.make_train_step(loss_fn, variables, slots, counter)
        specs, values = specs[:1], values[:1]
    else:
        fn = loss_fn
    sharded = gt.function(fn, mesh=mesh, in_shardings=specs,
                          backend=backend_names.backend(backend, TF_DOTS_FROM.value))
    lowered = sharded.lower(*[tf.TensorSpec(np.shape(v), tf.as_dtype(np.asarray(v).dtype))
                              for v in values])
    placed = [gt.ShardedTensor.from_value(v, mesh, s.to_layout(mesh, np.ndim(v)))
              for v, s in zip(values, lowered.input_shardings)]

    def run():
        return float(sharded(*placed).numpy())
    return run


if __name__ == "__main__":
    app.run(main)
