"""Per-device memory and communication of the GSPMD paper's dense Transformers on abstract
meshes of up to 2048 devices (no devices: gspmd-tf lowers, nothing runs).

    .venv/bin/python benchmarks/transformer_scale.py --configs=all

Configurations. GSPMD's dense-Transformer experiments (Xu et al. 2021, the 2-D sharded
dense LMs of 128B and 1T parameters on TPUv3) were run from the Lingvo configurations its
authors published in tensorflow/lingvo, lingvo/tasks/lm/params/synthetic_packed_input.py;
the sizes below are copied from those classes (layers, model dim M, feed-forward dim H,
heads N, per-head dim K, sequence S, global batch B = BATCH_DIM_PER_DEVICE x devices,
device mesh shape):

    name        lingvo class        layers    M       H      N    K    S     B    mesh  FFN
    128B-8x16   DenseLm128B8x8        64    8192   65536   128  128  1024    16   8x16  gated
    128B-16x32  DenseLm128B16x16      64    8192   65536   128  128  1024   128  16x32  gated
    128B-32x64  DenseLm128B32x32      64    8192   65536   128  128  1024   512  32x64  gated
    175B-64x32  DenseLm175B32x32      96   12288   49152    96  128  2048  1024  64x32  ReLU
    1T-16x32    DenseLm1T16x16       128   16384  131072   256  128   512    16  16x32  gated

The model (one training step: forward, backward, SGD update; weights are arguments and
results) is each layer's self-attention (Q, K, V, O projections as [M, N, K] / [N, K, M]
einsums, softmax over keys) and a feed-forward block, both residual, loss mean(x^2). The
feed-forward block is gelu(x W0) * (x W1) W2 where Lingvo's GATED_GELU is on (three
[M, H]-sized weights: the parameter counts then match the file's totals, 137.7B and
1.100T, less the embedding) and relu(x W0) W2 where it is off (175B). Simplified from
Lingvo's: no embedding/softmax layer (32k vocab: under 0.5% of the parameters), no layer
norm, no relative attention bias, and float32 throughout (Lingvo keeps float32 weights
but computes in bfloat16, which halves activation bytes).

Sharding: the paper's 2-D sharding (mesh axes X, Y): activations [B, S, M] split
[X, -, Y], [B, S, H] [X, -, Y], attention [B, S, N, K] [X, -, Y, -]; weights [M, H] split
[X, Y], [H, M] [Y, X], [M, N, K] [X, Y, -], [N, K, M] [Y, -, X]; the batch splits over X.
Every other tensor's sharding is gspmd-tf's inference.

Scaling: the full model (up to 128 layers at M = 16384) lowers in minutes on this host,
so each configuration is traced with its real shapes and --trace_layers=1 and 2 layers:
the difference is one layer's figures, and each figure is reported for the full depth
as f(1) + (layers - 1) x (f(2) - f(1)). Collective bytes and the weight, argument and
output bytes are linear in the layers, so that is exact for them; the peak is gspmd-tf's
live-range estimate (Lowered.memory(), program order), scaled the same way.

Reported per device: weight bytes (its shards of the weights), the estimated peak, the
bytes of all collective operands per step (Lowered.collectives(): each collective
counts one device's operand), split by kind, and the bytes each device sends for them
("sent": CostModel.wire_bytes of the mesh's model, the figure the auto-sharding search
and the partitioner price; an all-gather over k devices sends k - 1 times its operand,
an all-reduce 2 (k - 1) / k times, so operand bytes undercount gathers).

--auto adds a row per configuration planned by the auto-sharding search: every weight
gt.AUTO, no activation hints (--auto_hints: the hand plan's kept, so only the weights
are searched), x split as in the hand plan, and memory_limit the hand
plan's estimated peak of the same trace (so the plan must fit where the hand plan
does); its row gives the search's seconds (both traces) and its collective bytes over
the hand plan's.
"""

from __future__ import annotations

import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

CONFIGS = {
    # name: (layers, M, H, N, K, S, B, mesh, gated GELU)
    "128B-8x16": (64, 8192, 65536, 128, 128, 1024, 16, (8, 16), True),
    "128B-16x32": (64, 8192, 65536, 128, 128, 1024, 128, (16, 32), True),
    "128B-32x64": (64, 8192, 65536, 128, 128, 1024, 512, (32, 64), True),
    "175B-64x32": (96, 12288, 49152, 96, 128, 2048, 1024, (64, 32), False),
    "1T-16x32": (128, 16384, 131072, 256, 128, 512, 16, (16, 32), True),
}
AXES = ("x", "y")
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

CONFIG = flags.DEFINE_string("configs", "all", "comma-separated names, or 'all': "
                             + ", ".join(CONFIGS))
TRACE_LAYERS = flags.DEFINE_integer("trace_layers", 1, "layers of the smaller trace (the "
                                    "larger has one more)")
DETAIL = flags.DEFINE_bool("detail", False, "print each config's collectives per layer")
AUTO = flags.DEFINE_bool("auto", False, "add an auto-sharded row per config (weights "
                         "gt.AUTO within the hand plan's peak)")
AUTO_HINTS = flags.DEFINE_bool("auto_hints", False, "the auto row keeps the hand plan's "
                               "activation hints (the search decides the weights only)")


def weight_shapes(m, h, n, k, gated):
    """One layer's weights, in argument order, with their PartitionSpec entries."""
    ffn_in = [("wi0", (m, h), ("x", "y"))] + [("wi1", (m, h), ("x", "y"))] * gated
    return [("wq", (m, n, k), ("x", "y", None)), ("wk", (m, n, k), ("x", "y", None)),
            ("wv", (m, n, k), ("x", "y", None)), ("wo", (n, k, m), ("y", None, "x")),
            *ffn_in, ("wf", (h, m), ("y", "x"))]


def make_step(tf, gt, mesh, layers, gated, lr=0.01, hints=True):
    """step(x, *weights) -> (loss, *new weights): one SGD step of the model; `hints`:
    the hand plan's activation shardings (else none)."""
    P = gt.P

    def hint(t, *spec):
        return gt.mesh_split(t, mesh, P(*spec)) if hints else t

    def layer(x, wq, wk, wv, wo, *ffn):
        q = hint(tf.einsum("bsm,mnk->bsnk", x, wq), "x", None, "y", None)
        k = hint(tf.einsum("bsm,mnk->bsnk", x, wk), "x", None, "y", None)
        v = hint(tf.einsum("bsm,mnk->bsnk", x, wv), "x", None, "y", None)
        scale = 1.0 / float(q.shape[-1]) ** 0.5
        probs = tf.nn.softmax(tf.einsum("bsnk,btnk->bnst", q, k) * scale, axis=-1)
        context = hint(tf.einsum("bnst,btnk->bsnk", probs, v), "x", None, "y", None)
        x = hint(x + tf.einsum("bsnk,nkm->bsm", context, wo), "x", None, "y")
        hidden = hint(tf.einsum("bsm,mh->bsh", x, ffn[0]), "x", None, "y")
        if gated:
            gate = hint(tf.einsum("bsm,mh->bsh", x, ffn[1]), "x", None, "y")
            hidden = tf.nn.gelu(hidden, approximate=True) * gate
        else:
            hidden = tf.nn.relu(hidden)
        return hint(x + tf.einsum("bsh,hm->bsm", hidden, ffn[-1]), "x", None, "y")

    per_layer = 6 + gated

    def step(x, *weights):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            h = x
            for i in range(layers):
                h = layer(h, *weights[per_layer * i:per_layer * (i + 1)])
            loss = tf.reduce_mean(tf.square(h))
        grads = tape.gradient(loss, weights)
        return (loss,) + tuple(w - lr * g for w, g in zip(weights, grads))
    return step


def lower_step(gt, tf, config, layers, memory_limit=None):
    """The training step of `config` with `layers` layers, lowered on its abstract mesh:
    the hand plan, or with a `memory_limit` the auto-sharding search's (weights
    gt.AUTO, no activation hints)."""
    _, m, h, n, k, s, b, mesh_shape, gated = config
    mesh = gt.Mesh.abstract(mesh_shape, AXES)
    P = gt.P
    shapes = weight_shapes(m, h, n, k, gated) * layers
    specs = [tf.TensorSpec((b, s, m))] + [tf.TensorSpec(shape) for _, shape, _ in shapes]
    auto = memory_limit is not None
    in_shardings = (P("x", None, "y"),) + tuple(gt.AUTO if auto else P(*spec)
                                                for _, _, spec in shapes)
    hints = not auto or AUTO_HINTS.value
    return gt.lower(make_step(tf, gt, mesh, layers, gated, hints=hints), mesh,
                    in_shardings, args=specs, memory_limit=memory_limit)


def measure(gt, tf, config, layers, memory_limit=None):
    """Figures of one lowering of `config` with `layers` layers (lower_step): dict of
    per-device bytes (weights, peak, collectives by kind) and the lowering time."""
    start = time.perf_counter()
    lowered = lower_step(gt, tf, config, layers, memory_limit)
    seconds = time.perf_counter() - start
    memory = lowered.memory()
    weights = sum(_local_bytes(lowered, i) for i in range(1, len(lowered.input_shardings)))
    figures = {"weights": weights, "arguments": memory.arguments, "peak": memory.peak}
    for kind in KINDS:
        figures[kind] = sum(c.bytes for c in lowered.collectives() if c.kind == kind)
    figures["collectives"] = sum(figures[kind] for kind in KINDS)
    from gspmd_tf.cost_model import CostModel
    model = CostModel.for_mesh(lowered.mesh)
    figures["sent"] = sum(model.wire_bytes(c.kind, c.bytes, c.axes)
                          for c in lowered.collectives())
    return figures, seconds, lowered


def _local_bytes(lowered, index):
    """Bytes of one device's shard of flat argument `index`."""
    program = lowered.program.graph
    ref = program.inputs[index]
    count = 1
    for d in program.shape(ref):
        count *= d
    return count * program.dtype(ref).size


def fmt(n):
    """Bytes in GiB/MiB (B below 1 KiB) for the table."""
    if n < 1024:
        return f"{n} B"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main(argv):
    del argv
    import gspmd_tf as gt
    import tensorflow as tf
    logging.getLogger("gspmd_tf").setLevel(logging.WARNING)
    names = list(CONFIGS) if CONFIG.value == "all" else CONFIG.value.split(",")
    small, large = TRACE_LAYERS.value, TRACE_LAYERS.value + 1
    print(f"# dense Transformer training step, per device, on abstract meshes "
          f"(traced with {small} and {large} layers, scaled to the full depth)\n")
    print("| config | devices (X x Y) | params | weights/device | peak/device (est.) "
          "| collective bytes/device/step | sent/device/step | all-gather | all-reduce | reduce-scatter "
          "| all-to-all | permute | lowering s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        config = CONFIGS[name]
        layers, m, h, n, k = config[:5]
        mesh_shape, gated = config[7:]
        f1, t1, _ = measure(gt, tf, config, small)
        f2, t2, lowered = measure(gt, tf, config, large)
        params = layers * sum(_count(shape) for _, shape, _ in weight_shapes(m, h, n, k, gated))
        hand = _row(name, mesh_shape, params, layers, small, f1, f2, f"{t1 + t2:.1f}")
        if DETAIL.value:
            print(lowered.report().split("\n\ncollective", 1)[1][:4000])
        if AUTO.value:
            a1, _, auto1 = measure(gt, tf, config, small, f1["peak"])
            a2, _, auto2 = measure(gt, tf, config, large, f2["peak"])
            search = auto1.auto_plan.search_seconds + auto2.auto_plan.search_seconds
            auto = _row(f"{name} auto", mesh_shape, params, layers, small, a1, a2,
                        f"search {search:.1f}")
            print(f"  auto/hand: collective bytes {auto['collectives'] / hand['collectives']:.3f}"
                  f", sent {auto['sent'] / hand['sent']:.3f}"
                  f", peak {auto['peak'] / hand['peak']:.3f}", flush=True)


def _row(name, mesh_shape, params, layers, small, f1, f2, seconds):
    """Print one table row, scaled to the full depth from the two traces' figures;
    returns the scaled figures."""
    full = {key: f1[key] + (layers - small) * (f2[key] - f1[key]) for key in f1}
    print(f"| {name} | {mesh_shape[0] * mesh_shape[1]} ({mesh_shape[0]} x "
          f"{mesh_shape[1]}) | {params / 1e9:.1f}B | {fmt(full['weights'])} "
          f"| {fmt(full['peak'])} | {fmt(full['collectives'])} | {fmt(full['sent'])} | "
          + " | ".join(fmt(full[kind]) if full[kind] else "0" for kind in KINDS)
          + f" | {seconds} |", flush=True)
    return full


def _count(shape):
    count = 1
    for d in shape:
        count *= d
    return count


if __name__ == "__main__":
    app.run(main)
