"""Auto-sharding (gt.AUTO, memory_limit): search seconds and plan quality on an L-layer
Transformer training step with Adam, against the hand Megatron plan and data parallel.

    .venv/bin/python benchmarks/auto_sharding.py --layers=4,8,16,24
    .venv/bin/python benchmarks/auto_sharding.py --layers=2 --d_model=64 --d_ff=256  # tiny

The step (weights, Adam's m and v are arguments and results; nothing runs: the mesh is
abstract) is, per layer, a pre-norm self-attention block (Q, K, V projections as
[M, N, K] einsums, softmax over keys, O as [N, K, M]) and a ReLU feed-forward block, both
residual; loss mean(x^2); then Adam on every weight. Each layer's ops are in a name scope
(`layer3/attention/query`), as Keras and Lingvo name them.

Plans, on a data x model mesh, the activations' batch split over "data":
  data parallel  every weight and its Adam state replicated
  Megatron       Q, K, V and the first FFN weight split over "model" on their output dims
                 (heads, d_ff), O and the second FFN weight on their input dims; layer
                 norm scales replicated; Adam state as its weight
  auto           every weight, m and v gt.AUTO, under memory_limit set --limit_between of
                 the way from the Megatron plan's peak to data parallel's (so data
                 parallelism does not fit and Megatron does)

Reported per layer count: the ops of the step, the search's classes and variables, its
seconds (all of it, and the HiGHS solver's share), then per plan the per-device peak
(lowered.memory().peak) and the bytes of all collective operands per step
(lowered.collectives(), one device's operand each), and auto's bytes over Megatron's.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("layers", ["4", "8", "16", "24"], "layer counts to search")
flags.DEFINE_integer("d_model", 512, "model dim M")
flags.DEFINE_integer("heads", 8, "attention heads N")
flags.DEFINE_integer("d_ff", 2048, "feed-forward dim H")
flags.DEFINE_integer("seq", 128, "sequence length S")
flags.DEFINE_integer("batch", 16, "global batch B")
flags.DEFINE_string("mesh", "2x4", "data x model mesh shape")
flags.DEFINE_float("limit_between", 0.5, "memory_limit: this far from Megatron's peak "
                   "(0) to data parallel's (1)")

# weight name -> (shape from (M, N, K, H), Megatron spec)
WEIGHTS = {
    "attention/norm": (lambda m, n, k, h: (m,), ()),
    "attention/query": (lambda m, n, k, h: (m, n, k), (None, "model")),
    "attention/key": (lambda m, n, k, h: (m, n, k), (None, "model")),
    "attention/value": (lambda m, n, k, h: (m, n, k), (None, "model")),
    "attention/output": (lambda m, n, k, h: (n, k, m), ("model",)),
    "mlp/norm": (lambda m, n, k, h: (m,), ()),
    "mlp/up": (lambda m, n, k, h: (m, h), (None, "model")),
    "mlp/down": (lambda m, n, k, h: (h, m), ("model",)),
}


def layer_norm(x, scale, tf):
    mean = tf.reduce_mean(x, -1, keepdims=True)
    var = tf.reduce_mean(tf.square(x - mean), -1, keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-5) * scale


def make_step(layers, tf):
    """step(x, *weights, *m, *v) -> (*weights, *m, *v) after one Adam update."""
    names = [f"layer{l}/{w}" for l in range(layers) for w in WEIGHTS]
    count = len(names)

    def forward(x, w):
        for l in range(layers):
            p = {name: w[f"layer{l}/{name}"] for name in WEIGHTS}
            with tf.name_scope(f"layer{l}"):
                with tf.name_scope("attention"):
                    h = layer_norm(x, p["attention/norm"], tf)
                    q, k, v = (tf.einsum("bsm,mnk->bsnk", h, p[f"attention/{n}"], name=n)
                               for n in ("query", "key", "value"))
                    scores = tf.einsum("bqnk,bsnk->bnqs", q, k, name="scores")
                    probs = tf.nn.softmax(scores / float(q.shape[-1]) ** 0.5)
                    context = tf.einsum("bnqs,bsnk->bqnk", probs, v, name="context")
                    x = x + tf.einsum("bqnk,nkm->bqm", context, p["attention/output"],
                                      name="output")
                with tf.name_scope("mlp"):
                    h = layer_norm(x, p["mlp/norm"], tf)
                    hidden = tf.nn.relu(tf.einsum("bsm,mh->bsh", h, p["mlp/up"], name="up"))
                    x = x + tf.einsum("bsh,hm->bsm", hidden, p["mlp/down"], name="down")
        return tf.reduce_mean(tf.square(x))

    def step(x, *state):
        weights, ms, vs = state[:count], state[count:2 * count], state[2 * count:]
        with tf.GradientTape() as tape:
            tape.watch(weights)
            loss = forward(x, dict(zip(names, weights)))
        grads = tape.gradient(loss, weights)
        out_w, out_m, out_v = [], [], []
        with tf.name_scope("adam"):
            for w, m, v, g in zip(weights, ms, vs, grads):
                m = 0.9 * m + 0.1 * g
                v = 0.999 * v + 0.001 * tf.square(g)
                out_w.append(w - 0.001 * m / (tf.sqrt(v) + 1e-7))
                out_m.append(m)
                out_v.append(v)
        return out_w + out_m + out_v

    return step, names


def lower(gt, tf, mesh, layers, plan, memory_limit=None):
    """The Lowered of the step with `plan` ("data", "megatron" or "auto")."""
    m, n, h = FLAGS.d_model, FLAGS.heads, FLAGS.d_ff
    step, names = make_step(layers, tf)
    shapes = [WEIGHTS[name.split("/", 1)[1]][0](m, n, m // n, h) for name in names]
    specs = [tf.TensorSpec((FLAGS.batch, FLAGS.seq, m), tf.float32)] + [
        tf.TensorSpec(s, tf.float32) for s in shapes * 3]
    if plan == "auto":
        weights = [gt.AUTO] * len(names)
    elif plan == "megatron":
        weights = [gt.P(*WEIGHTS[name.split("/", 1)[1]][1]) for name in names]
    else:
        weights = [gt.P()] * len(names)
    return gt.lower(step, mesh, (gt.P("data"),) + tuple(weights) * 3, args=specs,
                    memory_limit=memory_limit)


def collective_bytes(lowered):
    return sum(c.bytes for c in lowered.collectives())


def main(argv):
    del argv
    import logging

    import tensorflow as tf

    import gspmd_tf as gt
    logging.getLogger("gspmd_tf").setLevel(logging.WARNING)
    data, model = (int(s) for s in FLAGS.mesh.split("x"))
    mesh = gt.Mesh.abstract((data, model), ("data", "model"))
    print(f"Transformer train step (Adam), M={FLAGS.d_model} N={FLAGS.heads} "
          f"H={FLAGS.d_ff} S={FLAGS.seq} B={FLAGS.batch}, mesh {FLAGS.mesh}")
    print(f"{'layers':>6s} {'ops':>6s} {'classes':>7s} {'vars':>6s} {'search s':>9s} "
          f"{'solver s':>9s} | {'peak MiB':>24s} | {'collective MiB':>24s} | auto/megatron")
    print(f"{'':45s} | {'data':>7s} {'megatron':>8s} {'auto':>7s} | {'data':>7s} "
          f"{'megatron':>8s} {'auto':>7s} |")
    for layers in (int(l) for l in FLAGS.layers):
        data_plan = lower(gt, tf, mesh, layers, "data")
        megatron = lower(gt, tf, mesh, layers, "megatron")
        low, high = megatron.memory().peak, data_plan.memory().peak
        limit = int(low + FLAGS.limit_between * (high - low))
        auto = lower(gt, tf, mesh, layers, "auto", memory_limit=limit)
        plan = auto.auto_plan
        peaks = [p.memory().peak / 2 ** 20 for p in (data_plan, megatron, auto)]
        sent = [collective_bytes(p) / 2 ** 20 for p in (data_plan, megatron, auto)]
        ratio = sent[2] / sent[1] if sent[1] else float("nan")
        print(f"{layers:6d} {plan.num_nodes:6d} {plan.num_classes:7d} "
              f"{plan.num_variables:6d} {plan.search_seconds:9.2f} "
              f"{plan.solve_seconds:9.2f} | {peaks[0]:7.1f} {peaks[1]:8.1f} {peaks[2]:7.1f} "
              f"| {sent[0]:7.1f} {sent[1]:8.1f} {sent[2]:7.1f} | {ratio:.3f}"
              f"{'' if peaks[2] * 2 ** 20 <= limit else '  (over the limit)'}")


if __name__ == "__main__":
    app.run(main)
