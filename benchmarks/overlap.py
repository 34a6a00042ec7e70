"""Overlapping communication with compute: async collectives and windowed einsum.

    .venv/bin/python benchmarks/overlap.py --mesh=2,4 --steps=10 --warmup=3

For each model of --models, the same training step (forward, backward, SGD update; the
LM: the demo's Adam step) runs on the --mesh of logical CPU devices through the local
backend in several variants, in ONE process, steps alternating between the variants
(and single-device TF) after --warmup untimed steps each:
  plain       gt.function as it is
  async       LocalBackend(async_collectives=True): collectives chained by estimated
              operand readiness (backends/schedule.py)
  windowed    gt.function(windowed_einsum=True): a dot's all-gather / reduce-scatter as
              a loop of local dots and collective-permutes (spmd/windowed_einsum.py)
  windowed+async  both
Models:
  megatron  FFN blocks x -> relu(x W1) W2 + x, batch over "data", W1 P(None, "model"),
            W2 P("model") (train_step.py's model without biases): all-reduces only
  fsdp      the same with the weights also split over "data" (W1 P("data", "model"),
            W2 P("model", "data")): every layer all-gathers its weights before use
  seqpar    sequence-parallel Megatron: activations split over "model" along the
            sequence between blocks, the hidden layer along its features: an
            all-gather before W1 and a reduce-scatter after W2 in every block
  lm        the demo's 2-layer Transformer LM Adam step (demo.make_train_step)
Reported per variant: median and min step ms, the ratio to plain's (the median over rounds of
the per-round ratio, less sensitive to load changing between rounds), the program's
collectives, how many of them take another place in the per-device chain under the
ready order than in program order (async variants; gt.Permute copies take no token), the bytes each device sends per step (ring algorithms: an all-reduce
2(n-1)/n of its operand, an all-gather (n-1) times its shard, a reduce-scatter (n-1)/n
of its operand, which TF's CPU collectives run as an all-reduce, twice that, given
after the slash), and the loss's relative difference from single-device TF after the
same number of steps.

The logical devices share the host's cores: on a 2-core host the collectives are
memory copies between threads, not transfers over links, so overlap has little
communication time to hide; the table measures what it costs or gains here.
"""

from __future__ import annotations

import functools
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

MODELS = flags.DEFINE_string("models", "megatron,fsdp,seqpar,lm", "models to run")
LAYERS = flags.DEFINE_integer("layers", 4, "FFN blocks")
BATCH = flags.DEFINE_integer("batch", 16, "batch size")
SEQ = flags.DEFINE_integer("seq", 128, "sequence length")
D_MODEL = flags.DEFINE_integer("d_model", 512, "model width")
D_FF = flags.DEFINE_integer("d_ff", 2048, "hidden width")
MESH = flags.DEFINE_string("mesh", "2,4", "mesh shape data,model")
STEPS = flags.DEFINE_integer("steps", 10, "timed steps of each variant (alternating)")
WARMUP = flags.DEFINE_integer("warmup", 3, "untimed steps of each variant first")
LR = 0.01
AXES = ("data", "model")
VARIANTS = {"megatron": ("plain", "async"), "fsdp": ("plain", "async"),
            "seqpar": ("plain", "async", "windowed", "windowed+async"), "lm": ("plain", "async")}


def ffn_specs(gt, model):
    """Weight specs (W1, W2) of an FFN model."""
    P = gt.P
    if model == "fsdp":
        return P("data", "model"), P("model", "data")
    return P(None, "model"), P("model", None)


def ffn_step(tf, weights, split=None):
    """The SGD step over `weights` ([(W1, W2)] variables); `split(tensor, spec entries)`
    annotates the sequence-parallel layouts (None: no annotations)."""
    flat = [w for pair in weights for w in pair]

    def step(x, target):
        with tf.GradientTape() as tape:
            h = x
            for w1, w2 in weights:
                hidden = tf.nn.relu(tf.einsum("bsd,df->bsf", h, w1))
                if split:
                    hidden = split(hidden, ("data", None, "model"))
                out = tf.einsum("bsf,fd->bsd", hidden, w2)
                if split:
                    out = split(out, ("data", "model"))
                h = h + out
            loss = tf.reduce_mean(tf.square(h - target))
        for w, g in zip(flat, tape.gradient(loss, flat)):
            w.assign_sub(LR * g)
        return loss
    return step


def chain_moves(program, mesh):
    """How many of the program's token-chained collectives take another place in their
    devices' chain under schedule.ready_order (on the local backend's cost model of
    `mesh`) than in program order."""
    from gspmd_tf.backends import collectives, schedule
    from gspmd_tf.backends.local import LocalBackend
    ops = collectives.KEYED
    chained = [i for i, node in enumerate(program.nodes) if node.op in ops]
    ready = [i for i in schedule.ready_order(program, LocalBackend(mesh).cost_model)
             if program.nodes[i].op in ops]
    return sum(a != b for a, b in zip(chained, ready))


def bytes_sent(collectives, mesh):
    """(ring bytes, bytes on TF's CPU collectives) each device sends in one step."""
    ring = cpu = 0.0
    for c in collectives:
        if c.kind == "collective-permute":
            ring += c.bytes
            cpu += c.bytes
            continue
        n = mesh.axes_size(c.axes)
        share = {"all-reduce": 2 * (n - 1) / n, "all-gather": n - 1,
                 "reduce-scatter": (n - 1) / n, "all-to-all": (n - 1) / n}[c.kind]
        ring += share * c.bytes
        cpu += (2 * (n - 1) / n if c.kind == "reduce-scatter" else share) * c.bytes
    return ring, cpu


def build(gt, tf, model, variant, mesh):
    """(run() -> loss, Lowered) of one variant of `model`."""
    from gspmd_tf import demo
    from gspmd_tf.backends.local import LocalBackend
    backend = (functools.partial(LocalBackend, async_collectives=True)
               if variant.endswith("async") else "local")
    windowed = variant.startswith("windowed")
    P = gt.P
    if model == "lm":
        cfg = demo.ModelConfig()
        params = demo.init_params(cfg)
        tokens = demo.make_batch(cfg)
        specs = [P() if s is None else s for s in demo.in_specs(cfg)[1:]]
        variables = [gt.Variable(p, mesh, s) for p, s in zip(params, specs)]
        slots = [(gt.Variable(np.zeros_like(p), mesh, s), gt.Variable(np.zeros_like(p),
                                                                      mesh, s))
                 for p, s in zip(params, specs)]
        counter = gt.Variable(np.float32(0), mesh, P())
        fn = gt.function(demo.make_train_step(demo.make_loss_fn(cfg), variables, slots,
                                              counter),
                         mesh=mesh, in_shardings=(P("data"),), backend=backend,
                         windowed_einsum=windowed)
        args = [tokens]
    else:
        weights, x, target = ffn_values()
        w1_spec, w2_spec = ffn_specs(gt, model)
        variables = [(gt.Variable(w1, mesh, w1_spec), gt.Variable(w2, mesh, w2_spec))
                     for w1, w2 in weights]
        split = None
        rows = P("data")
        if model == "seqpar":
            rows = P("data", "model")

            def split(t, entries):
                return gt.mesh_split(t, mesh, P(*entries))
        fn = gt.function(ffn_step(tf, variables, split), mesh=mesh,
                         in_shardings=(rows, rows), backend=backend,
                         windowed_einsum=windowed)
        args = [x, target]
    lowered = fn.lower(*[tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype))
                         for a in args])
    placed = [gt.ShardedTensor.from_value(a, mesh, s.to_layout(mesh, np.ndim(a)))
              for a, s in zip(args, lowered.input_shardings)]
    return (lambda: float(fn(*placed).numpy())), lowered


def ffn_values():
    """Initial FFN weights [(W1, W2)], input and target, from seed 0."""
    rng = np.random.default_rng(0)
    d, f = D_MODEL.value, D_FF.value
    weights = [((rng.standard_normal((d, f)) / np.sqrt(d)).astype(np.float32),
                (rng.standard_normal((f, d)) / np.sqrt(f)).astype(np.float32))
               for _ in range(LAYERS.value)]
    x = rng.standard_normal((BATCH.value, SEQ.value, d)).astype(np.float32)
    target = rng.standard_normal((BATCH.value, SEQ.value, d)).astype(np.float32)
    return weights, x, target


def build_single(tf, model):
    """run() -> loss of the single-device TF step of `model` on the first CPU device."""
    from gspmd_tf import demo
    device = tf.config.list_logical_devices("CPU")[0].name
    with tf.device(device):
        if model == "lm":
            cfg = demo.ModelConfig()
            params = demo.init_params(cfg)
            variables = [tf.Variable(p) for p in params]
            slots = [(tf.Variable(np.zeros_like(p)), tf.Variable(np.zeros_like(p)))
                     for p in params]
            fn = demo.make_train_step(demo.make_loss_fn(cfg), variables, slots,
                                      tf.Variable(np.float32(0)))
            args = [tf.constant(demo.make_batch(cfg))]
        else:
            weights, x, target = ffn_values()
            fn = ffn_step(tf, [(tf.Variable(w1), tf.Variable(w2)) for w1, w2 in weights])
            args = [tf.constant(x), tf.constant(target)]
    step = tf.function(fn, autograph=False)

    def run():
        with tf.device(device):
            return float(step(*args).numpy())
    return run


def fmt_bytes(n):
    """n bytes in KiB or MiB."""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def main(argv):
    del argv
    shape = tuple(int(x) for x in MESH.value.split(","))
    import gspmd_tf as gt
    gt.configure_cpu_devices(int(np.prod(shape)))
    import tensorflow as tf
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    mesh = gt.Mesh.create(shape, AXES)
    print("# overlap: async collectives and windowed einsum (local backend, one process, "
          "alternating)\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {mesh.size} logical CPU "
          f"devices, TF {tf.__version__}, load average at start {os.getloadavg()[0]:.2f}; "
          f"FFN layers={LAYERS.value} batch={BATCH.value} seq={SEQ.value} "
          f"d_model={D_MODEL.value} d_ff={D_FF.value}; mesh={shape}; {WARMUP.value} "
          f"warm-up + {STEPS.value} timed steps each\n", flush=True)
    print("| model | variant | median step ms | min ms | ratio to plain (paired) "
          "| collectives | moved in the chain | bytes sent per device (ring / TF CPU) "
          "| loss rel. diff vs single |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|")
    for model in MODELS.value.split(","):
        variants = VARIANTS[model]
        runs, lowered = {}, {}
        for variant in variants:
            runs[variant], lowered[variant] = build(gt, tf, model, variant, mesh)
        runs["single"] = build_single(tf, model)
        names = list(runs)
        for name in names:
            for _ in range(WARMUP.value):
                runs[name]()
        times = {name: [] for name in names}
        for _ in range(STEPS.value):
            for name in names:
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
        losses = {name: runs[name]() for name in names}
        for variant in variants:
            kinds = {}
            for c in lowered[variant].collectives():
                kinds[c.kind] = kinds.get(c.kind, 0) + 1
            ring, cpu = bytes_sent(lowered[variant].collectives(), mesh)
            paired = statistics.median(a / b for a, b in zip(times[variant],
                                                              times["plain"]))
            rel = abs(losses[variant] - losses["single"]) / abs(losses["single"])
            moved = (chain_moves(lowered[variant].program.graph, mesh)
                     if variant.endswith("async") else "-")
            print(f"| {model} | {variant} | {statistics.median(times[variant]) * 1e3:.1f} "
                  f"| {min(times[variant]) * 1e3:.1f} | {paired:.2f} "
                  f"| {', '.join(f'{k} {v}' for k, v in kinds.items())} "
                  f"| {moved} "
                  f"| {fmt_bytes(ring)} / {fmt_bytes(cpu)} | {rel:.1e} |", flush=True)
        print(f"| {model} | single-device TF | "
              f"{statistics.median(times['single']) * 1e3:.1f} | "
              f"{min(times['single']) * 1e3:.1f} | - | - | - | - | - |", flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
