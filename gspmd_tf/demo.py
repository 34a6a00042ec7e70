"""gspmd-tf demo: a small Transformer language model partitioned over a mesh of CPU devices.

    python -m gspmd_tf.demo --mesh=2,4 --layers=2

The model is plain single-device TensorFlow code (`loss_fn`). Only the weights and the
input batch are annotated (`in_shardings`, Megatron style): token ids split over "data",
the embedding table over "model" on its vocab dim, Wq/Wk/Wv/W1 over "model" on their
output dim, Wo/W2 over "model" on their input dim. Every other tensor's sharding is
inferred. The demo prints what was annotated and inferred, the collectives of the SPMD
program, the bytes each device holds, the loss beside the single-device loss, and the
forward step time beside single-device TensorFlow, measured side by side.

The model-building code (ModelConfig, init_params, loss_fn, param_specs, make_batch) is
importable: benchmarks/step_time.py and benchmarks/lowering_time.py reuse it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import numpy as np

from gspmd_tf.optimizer import adam_update, slot_spec

AXES = ("data", "model")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo Transformer."""

    layers: int = 2
    d_model: int = 128
    heads: int = 8
    d_ff: int = 512
    vocab: int = 512
    seq: int = 64
    batch: int = 8

    @property
    def head_dim(self):
        """Width of one attention head."""
        return self.d_model // self.heads


# Per-layer weights in the order loss_fn takes them, with the spec each is annotated with.
# None: not annotated (inferred); a tuple: the PartitionSpec entries.
LAYER_PARAMS = (("ln1_gamma", None), ("ln1_beta", None),
                ("wq", (None, "model")), ("wk", (None, "model")), ("wv", (None, "model")),
                ("wo", ("model",)),
                ("ln2_gamma", None), ("ln2_beta", None),
                ("w1", (None, "model")), ("w2", ("model",)))


def param_names(cfg):
    """Names of loss_fn's weight arguments, in order (after the tokens)."""
    names = ["embed"]
    for i in range(cfg.layers):
        names += [f"layer{i}/{n}" for n, _ in LAYER_PARAMS]
    return names + ["final_gamma", "final_beta"]


def param_shapes(cfg):
    """Global shape of every weight, in loss_fn's order."""
    d, f = cfg.d_model, cfg.d_ff
    layer = {"ln1_gamma": (d,), "ln1_beta": (d,), "wq": (d, d), "wk": (d, d),
             "wv": (d, d), "wo": (d, d), "ln2_gamma": (d,), "ln2_beta": (d,),
             "w1": (d, f), "w2": (f, d)}
    shapes = [(cfg.vocab, d)]
    for _ in range(cfg.layers):
        shapes += [layer[n] for n, _ in LAYER_PARAMS]
    return shapes + [(d,), (d,)]


def in_specs(cfg):
    """in_shardings for loss_fn(tokens, *weights): only the batch and the weights
    that Megatron splits are annotated; layer-norm scales are left to inference."""
    from gspmd_tf import P

    specs = [P("data"), P("model")]            # tokens [B, S+1]; embed [vocab, d]
    for _ in range(cfg.layers):
        specs += [None if e is None else P(*e) for _, e in LAYER_PARAMS]
    return specs + [None, None]                # final layer norm


def init_params(cfg, seed=0):
    """numpy float32 weights, in loss_fn's order."""
    rng = np.random.default_rng(seed)
    out = []
    for name, shape in zip(param_names(cfg), param_shapes(cfg)):
        if name.endswith("gamma"):
            out.append(np.ones(shape, np.float32) + 0.1 * rng.standard_normal(shape, np.float32))
        elif name.endswith("beta"):
            out.append(0.1 * rng.standard_normal(shape, np.float32))
        else:
            scale = 1.0 / math.sqrt(shape[0]) if name != "embed" else 0.05
            out.append((scale * rng.standard_normal(shape)).astype(np.float32))
    return out


def make_batch(cfg, seed=1):
    """Token ids [batch, seq + 1] (inputs are [:, :-1], next-token targets [:, 1:])."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1), dtype=np.int32)


def input_specs(cfg):
    """tf.TensorSpecs of loss_fn's arguments."""
    import tensorflow as tf
    return [tf.TensorSpec((cfg.batch, cfg.seq + 1), tf.int32)] + \
        [tf.TensorSpec(s, tf.float32) for s in param_shapes(cfg)]


def make_loss_fn(cfg):
    """loss_fn(tokens, *weights) -> scalar loss: plain single-device TensorFlow."""
    import tensorflow as tf

    b, s, d, h, hd = cfg.batch, cfg.seq, cfg.d_model, cfg.heads, cfg.head_dim
    causal = np.triu(np.full((s, s), -1e9, np.float32), k=1)   # [query, key]

    def layer_norm(x, gamma, beta):
        mean = tf.reduce_mean(x, axis=-1, keepdims=True)
        centered = x - mean
        var = tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True)
        return centered * tf.math.rsqrt(var + 1e-5) * gamma + beta

    def attention(x, wq, wk, wv, wo):
        q = tf.reshape(tf.einsum("bsd,de->bse", x, wq), (b, s, h, hd))
        k = tf.reshape(tf.einsum("bsd,de->bse", x, wk), (b, s, h, hd))
        v = tf.reshape(tf.einsum("bsd,de->bse", x, wv), (b, s, h, hd))
        logits = tf.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(hd))
        logits = logits + tf.constant(causal)
        probs = tf.nn.softmax(logits, axis=-1)
        context = tf.reshape(tf.einsum("bhqk,bkhd->bqhd", probs, v), (b, s, d))
        return tf.einsum("bse,ed->bsd", context, wo)

    def mlp(x, w1, w2):
        hidden = tf.nn.relu(tf.einsum("bsd,df->bsf", x, w1))
        return tf.einsum("bsf,fd->bsd", hidden, w2)

    def loss_fn(tokens, embed, *weights):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = tf.gather(embed, inputs)                          # [b, s, d]
        per = len(LAYER_PARAMS)
        for i in range(cfg.layers):
            g1, b1, wq, wk, wv, wo, g2, b2, w1, w2 = weights[i * per:(i + 1) * per]
            x = x + attention(layer_norm(x, g1, b1), wq, wk, wv, wo)
            x = x + mlp(layer_norm(x, g2, b2), w1, w2)
        x = layer_norm(x, weights[-2], weights[-1])
        logits = tf.einsum("bsd,vd->bsv", x, embed)          # tied output embedding
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
        return tf.reduce_mean(loss)

    return loss_fn


def make_train_step(loss_fn, variables, slots, counter):
    """train_step(tokens) -> loss: one Adam step of `loss_fn` over `variables`."""
    import tensorflow as tf

    def train_step(tokens):
        with tf.GradientTape() as tape:
            loss = loss_fn(tokens, *variables)
        grads = tape.gradient(loss, variables)
        adam_update(variables, slots, grads, counter.assign_add(1.0))
        return loss
    return train_step


# ----------------------------------------------------------------------------- helpers

def side_by_side(fns, steps, warmup=2):
    """Wall times (seconds) of `steps` calls of each zero-argument callable, after
    `warmup` untimed calls each; the calls alternate (f0, f1, f0, f1, ...) so that all
    see the same machine load. Returns one list of times per callable."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(steps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return times


def fmt_bytes(n):
    """A byte count for people: B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def collective_table(collectives):
    """Rows (kind, local shape, dtype, bytes, count, over axes) grouped, program order."""
    rows = {}
    for c in collectives:
        key = (c.kind, c.shape, c.dtype.name, c.bytes, c.axes)
        rows[key] = rows.get(key, 0) + 1
    return [(k[0], k[1], k[2], k[3], n, k[4]) for k, n in rows.items()]


# ----------------------------------------------------------------------------- main

def main(argv):
    """The demo: lower and report, compare the forward loss and time, then train."""
    del argv
    from absl import flags
    f = flags.FLAGS
    mesh_shape = tuple(int(x) for x in f.mesh.split(","))
    if len(mesh_shape) != 2:
        raise SystemExit("--mesh takes two sizes: data,model (e.g. 2,4)")

    import gspmd_tf as gt
    gt.configure_cpu_devices(int(np.prod(mesh_shape)))
    import tensorflow as tf
    # The partitioner warns once per op without a rule (per lowering); the summary below
    # lists them once.
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)

    cfg = ModelConfig(layers=f.layers, d_model=f.d_model, heads=f.heads, d_ff=f.d_ff,
                      vocab=f.vocab, seq=f.seq, batch=f.batch)
    mesh = gt.Mesh.create(mesh_shape, AXES)
    print(f"gspmd-tf demo: Transformer LM {cfg} on {mesh!r}\n")

    loss_fn = make_loss_fn(cfg)
    params = init_params(cfg)
    tokens = make_batch(cfg)
    specs = in_specs(cfg)
    sharded = gt.function(loss_fn, mesh=mesh, in_shardings=specs)

    start = time.perf_counter()
    lowered = sharded.lower(*input_specs(cfg))
    lower_s = time.perf_counter() - start
    annotated, inferred = lowered.counts()
    total_tensors = sum(len(n.out_shapes) for n in lowered.graph.nodes)
    print(f"lowered in {lower_s:.2f} s (trace + import + propagate + partition)")
    print(f"traced graph: {len(lowered.graph.nodes)} ops, {total_tensors} tensors; "
          f"SPMD program: {len(lowered.program.graph.nodes)} ops")
    print(f"  {annotated} tensors annotated (tokens + {annotated - 1} weights)")
    print(f"  {inferred} tensors got a (non-replicated) sharding by inference")
    if lowered.program.replicated_ops:
        print(f"  {len(lowered.program.replicated_ops)} ops have no rule and run replicated: "
              + ", ".join(lowered.program.replicated_ops))

    # ------------------------------------------------------------- collectives
    collectives = lowered.collectives()
    print(f"\ncollectives of the SPMD program ({len(collectives)}; bytes = one device's "
          "operand):")
    print(f"  {'kind':19s} {'local shape':18s} {'dtype':8s} {'bytes':>10s} {'count':>5s}  axes")
    for kind, shape, dtype, nbytes, count, axes in collective_table(collectives):
        print(f"  {kind:19s} {str(shape):18s} {dtype:8s} {nbytes:10d} {count:5d}  "
              f"{','.join(axes)}")
    by_kind = {}
    for c in collectives:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + c.bytes
    total = sum(by_kind.values())
    print(f"  total per device: {fmt_bytes(total)} ({total} bytes)" +
          "".join(f"{' =' if i == 0 else ' +'} {k} {fmt_bytes(v)}"
                  for i, (k, v) in enumerate(sorted(by_kind.items()))))

    # ------------------------------------------------------------- parameter bytes
    # What each device holds: the local (per-device, padded) shape of every argument
    # under the input sharding the program chose for it.
    shardings = lowered.input_shardings
    names = ["tokens"] + param_names(cfg)
    shapes = [tokens.shape] + param_shapes(cfg)
    local_shapes = [s.to_layout(mesh, len(shape)).local_shape(mesh, shape)
                    for s, shape in zip(shardings, shapes)]
    full = sum(int(np.prod(shape)) * 4 for shape in shapes[1:])
    per_device = sum(int(np.prod(shape)) * 4 for shape in local_shapes[1:])
    print(f"\nparameters: {len(names) - 1} arrays, {fmt_bytes(full)} ({full} bytes) unsharded;"
          f" each device holds {fmt_bytes(per_device)} ({per_device} bytes, "
          f"{per_device / full:.1%} = 1/{full / per_device:.2f})")
    shown = [i for i, n in enumerate(names)
             if n in ("tokens", "embed") or n.startswith(("layer0/", "final"))]
    print(f"  {'argument':18s} {'shape':11s} {'spec':18s} {'local shape':12s} "
          f"{'bytes/device':>12s} {'unsharded':>10s}  XLA sharding")
    for i in shown:
        spec = shardings[i].to_layout(mesh, len(shapes[i])).to_spec()
        print(f"  {names[i]:18s} {str(tuple(shapes[i])):11s} {str(spec):18s} "
              f"{str(local_shapes[i]):12s} {int(np.prod(local_shapes[i])) * 4:12d} "
              f"{int(np.prod(shapes[i])) * 4:10d}  {shardings[i]}")
    if cfg.layers > 1:
        print(f"  (layers 1..{cfg.layers - 1} are sharded like layer0)")

    # ------------------------------------------------------------- run and compare
    with tf.device(mesh.devices[0]):
        args = [tf.constant(tokens)] + [tf.constant(p) for p in params]
    single = tf.function(loss_fn, autograph=False)
    with tf.device(mesh.devices[0]):
        ref = float(single(*args).numpy())
    # Place the inputs on the mesh once, in the shardings the program expects.
    placed = [gt.ShardedTensor.from_value(a, mesh, s.to_layout(mesh, np.ndim(a)))
              for a, s in zip([tokens] + params, shardings)]
    held = sum(max(t.shard_bytes()) for t in placed[1:])
    assert held == per_device, (held, per_device)  # ShardedTensors hold what we printed
    out = sharded(*placed)
    got = float(out.numpy())
    rel = abs(got - ref) / max(abs(ref), 1e-30)
    status = "OK" if rel <= 1e-5 else "MISMATCH (> 1e-5): a bug"
    print(f"\nloss: partitioned {got:.7f}   single device {ref:.7f}   "
          f"relative difference {rel:.2e}  [{status}]")

    def run_single():
        with tf.device(mesh.devices[0]):
            return single(*args).numpy()

    def run_sharded():
        return sharded(*placed).numpy()

    t_sharded, t_single = (float(np.median(t)) for t in
                           side_by_side([run_sharded, run_single], f.steps_timed))
    print(f"\nforward step (median of {f.steps_timed}, interleaved, after warm-up):")
    print(f"  {mesh.size} logical devices (gspmd-tf): {t_sharded * 1e3:8.2f} ms")
    print(f"  single device (tf.function)     : {t_single * 1e3:8.2f} ms")
    print(f"  ratio sharded / single          : {t_sharded / t_single:8.2f}x  "
          f"(logical devices share {os.cpu_count()} CPU core(s))")
    train_ok = train(f, gt, tf, cfg, mesh, loss_fn, params, tokens)
    if rel > 1e-5 or not train_ok:
        raise SystemExit(1)


def train(f, gt, tf, cfg, mesh, loss_fn, params, tokens):
    """Adam training steps on the mesh beside the same steps on one device."""
    wus = f.weight_update_sharding
    print(f"\ntraining: {f.train_steps} Adam steps, weights and optimizer state as "
          f"gt.Variables{' (optimizer state also split over data)' if wus else ''}")
    specs = [gt.P() if s is None else s for s in in_specs(cfg)[1:]]
    names = param_names(cfg)
    variables = [gt.Variable(p, mesh, s, name=n.replace("/", "_"))
                 for p, s, n in zip(params, specs, names)]
    slots = []
    for p, s, n in zip(params, specs, names):
        state_spec = slot_spec(s, p.shape, mesh) if wus else s
        slots.append(tuple(gt.Variable(np.zeros_like(p), mesh, state_spec,
                                       name=f"{n.replace('/', '_')}_{k}") for k in "mv"))
    counter = gt.Variable(np.float32(0), mesh, gt.P(), name="step")
    sharded_step = gt.function(make_train_step(loss_fn, variables, slots, counter), mesh=mesh,
                               in_shardings=(gt.P("data"),))
    with tf.device(mesh.devices[0]):
        ref_vars = [tf.Variable(p) for p in params]
        ref_slots = [(tf.Variable(np.zeros_like(p)), tf.Variable(np.zeros_like(p)))
                     for p in params]
        ref_counter = tf.Variable(np.float32(0))
        ref_tokens = tf.constant(tokens)
    single_step = tf.function(make_train_step(loss_fn, ref_vars, ref_slots, ref_counter),
                              autograph=False)
    placed = gt.ShardedTensor.from_value(tokens, mesh,
                                         sharded_step.lower(tokens).program.input_layouts[0])
    worst = 0.0
    print(f"  {'step':>4s} {'partitioned loss':>17s} {'single-device loss':>19s} {'rel diff':>9s}")
    for step in range(f.train_steps):
        got = float(sharded_step(placed).numpy())
        with tf.device(mesh.devices[0]):
            want = float(single_step(ref_tokens).numpy())
        rel = abs(got - want) / max(abs(want), 1e-30)
        worst = max(worst, rel)
        print(f"  {step:4d} {got:17.7f} {want:19.7f} {rel:9.2e}")
    weights = sum(max(v.shard_bytes()) for v in variables)
    state = sum(max(s.shard_bytes()) for pair in slots for s in pair)
    whole = sum(p.nbytes for p in params)
    print(f"  per device: weights {fmt_bytes(weights)}, optimizer state {fmt_bytes(state)} "
          f"(single device: {fmt_bytes(whole)} and {fmt_bytes(2 * whole)})")

    def run_sharded():
        return sharded_step(placed).numpy()

    def run_single():
        with tf.device(mesh.devices[0]):
            return single_step(ref_tokens).numpy()

    t_sharded, t_single = (float(np.median(t)) for t in
                           side_by_side([run_sharded, run_single], f.steps_timed // 2))
    print(f"  training step (median of {f.steps_timed // 2}, interleaved): gspmd-tf "
          f"{t_sharded * 1e3:.2f} ms, single device {t_single * 1e3:.2f} ms, ratio "
          f"{t_sharded / t_single:.2f}x")
    ok = worst <= 1e-4
    print(f"  largest loss difference {worst:.2e} [{'OK' if ok else 'MISMATCH (> 1e-4)'}]")
    return ok


def define_flags():
    """The demo's absl flags (mesh shape, model sizes, steps)."""
    from absl import flags
    d = ModelConfig()
    flags.DEFINE_string("mesh", "2,4", "mesh shape data,model")
    flags.DEFINE_integer("layers", d.layers, "Transformer layers")
    flags.DEFINE_integer("d_model", d.d_model, "model width")
    flags.DEFINE_integer("heads", d.heads, "attention heads")
    flags.DEFINE_integer("d_ff", d.d_ff, "MLP hidden width")
    flags.DEFINE_integer("vocab", d.vocab, "vocabulary size")
    flags.DEFINE_integer("seq", d.seq, "sequence length")
    flags.DEFINE_integer("batch", d.batch, "batch size")
    flags.DEFINE_integer("steps_timed", 20, "timed forward steps (median reported)")
    flags.DEFINE_integer("train_steps", 5, "Adam steps compared with single device")
    flags.DEFINE_bool("weight_update_sharding", True,
                      "split the optimizer state over the data axis too")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from absl import app
    define_flags()
    app.run(main)
