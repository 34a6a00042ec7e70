"""Auto-sharding (gt.AUTO, memory_limit): search seconds and plan quality on an L-layer
Transformer training step with Adam, against the hand Megatron plan and data parallel.

    .venv/bin/python benchmarks/auto_sharding.py --layers=4,8,16,24
    .venv/bin/python benchmarks/auto_sharding.py --layers=2 --d_model=64 --d_ff=256  # tiny

The step is gspmd_tf/testing/transformer_step.py's (weights, Adam's m and v are arguments
and results; nothing runs: the mesh is abstract).

Plans, on a data x model mesh, the activations' batch split over "data":
  data parallel  every weight and its Adam state replicated
  Megatron       Q, K, V and the first FFN weight split over "model" on their output dims
                 (heads, d_ff), O and the second FFN weight on their input dims; layer
                 norm scales replicated; Adam state as its weight
  auto           every weight, m and v gt.AUTO, under memory_limit set --limit_between of
                 the way from the Megatron plan's peak to data parallel's (so data
                 parallelism does not fit and Megatron does)

--model=moe: a GShard MoE layer's SGD step (gspmd_tf/moe.py, top-2 gating; x [G, S, M]
split on G over the mesh's last axis, the gating weight and expert weights [E, M, H],
[E, H, M]) on the same mesh: data parallel (weights replicated, no annotations), the
hand expert plan (moe.MoeSpecs: experts split on E, GShard's annotations inside the
layer) and auto (the weights gt.AUTO, no annotations), memory_limit as above.

--model=gpt2: keras_hub's GPT-2 (GPT2CausalLM, --layers[0] layers, dropout 0, vocabulary
--vocab) compiled with Adam, through gt.keras.shard_model on a 2x4 mesh of CPU devices
(the figures are the train step's lowering; nothing runs): data parallel (no layout
map), Megatron (gspmd_tf/testing/keras_layouts.py's map) and auto ({".*": gt.AUTO},
memory_limit as above, between the two real steps' peaks; the search fits its probe of
the step, gspmd_tf/keras_auto.py, in it, choosing the batch_spec too: shard_model's
default with gt.AUTO in the layout map).

--model=resnet: gspmd_tf/testing/conv_step.py's ResNet-like SGD step (--layers residual
blocks of two 3x3 convolutions, --width channels, --image x --image images, --batch
of them: give --batch smaller than the mesh, e.g. 2, so that data parallelism can use
only "data") on the same mesh: data parallel (images split over "data" on the batch,
weights replicated), the hand spatial plan (the images also split on their height over
"model": halo exchanges) and auto (images as data parallel's, every weight gt.AUTO),
memory_limit as above (between the spatial plan's peak and data parallel's).

--model=resnet50: keras.applications.ResNet50 (weights=None, --image x --image x 3
images, --classes classes, --batch of them, e.g. 8 on the 2x4 mesh so that data
parallelism can use only "data") compiled with --optimizer, jit_compile=False, through
gt.keras.shard_model (the train step's lowering; nothing runs): data parallel (no layout
map, batch_spec P("data")), the hand spatial plan (no layout map, batch_spec
P("data", "model"): the images split on their height over "model", the convolutions'
halos exchanged by collective-permutes; the rank-1 labels split on the batch only) and
auto ({".*": gt.AUTO}, the batch_spec searched, memory_limit between the spatial plan's
peak and data parallel's). The GPT-2 and ResNet50 rows share keras_rows; with --check
they also run one train_on_batch of the auto plan beside Keras on one device (slow);
--floatx=float64 builds the models in float64, where a difference beyond rounding would
be a wrong plan rather than float32's summation order.

    .venv/bin/python benchmarks/auto_sharding.py --model=resnet50 --image=64 --batch=8

Reported per layer count: the ops of the step, the search's classes and variables, its
seconds (all of it, and the HiGHS solver's share), then per plan the per-device peak
(lowered.memory().peak) and the bytes of all collective operands per step
(lowered.collectives(), one device's operand each), and auto's bytes over Megatron's.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("layers", ["4", "8", "16", "24"], "layer counts to search")
flags.DEFINE_integer("d_model", 512, "model dim M")
flags.DEFINE_integer("heads", 8, "attention heads N")
flags.DEFINE_integer("d_ff", 2048, "feed-forward dim H")
flags.DEFINE_integer("seq", 128, "sequence length S")
flags.DEFINE_integer("batch", 16, "global batch B")
flags.DEFINE_string("mesh", "2x4", "mesh shape: data x model, or data x replica x model "
                    "(the hand plans leave \"replica\" unused)")
flags.DEFINE_enum("model", "transformer", ["transformer", "moe", "gpt2", "resnet", "resnet50"],
                  "the step to plan")
flags.DEFINE_integer("image", 56, "--model=resnet: image height and width")
flags.DEFINE_integer("width", 64, "--model=resnet: channels of the residual blocks")
flags.DEFINE_integer("classes", 10, "--model=resnet50: classes")
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam"], "--model=resnet50: optimizer")
flags.DEFINE_integer("vocab", 1024, "--model=gpt2: vocabulary size")
flags.DEFINE_integer("experts", 8, "--model=moe: experts E (the groups G are as many)")
flags.DEFINE_bool("check", False, "--model=gpt2/resnet50: also run one train step of "
                  "the auto plan and compare it with Keras on one device")
flags.DEFINE_enum("floatx", "float32", ["float32", "float64"], "--model=gpt2/resnet50: "
                  "Keras' float type (float64: --check's differences from one device then "
                  "show whether they are float32 rounding, which shrinks by ~1e9)")
flags.DEFINE_float("limit_between", 0.5, "memory_limit: this far from Megatron's peak "
                   "(0) to data parallel's (1)")

def lower(gt, mesh, config, plan, memory_limit=None):
    """The Lowered of `config`'s step with `plan` ("data", "megatron" or "auto")."""
    from gspmd_tf.testing.transformer_step import make_step
    return gt.lower(make_step(config), mesh, config.in_shardings(plan, gt.AUTO),
                    args=config.specs(), memory_limit=memory_limit)


def moe_step(gt, mesh, hand):
    """The MoE layer's SGD step, annotated as GShard's expert plan when `hand`."""
    import tensorflow as tf
    from gspmd_tf import moe
    axis = mesh.axis_names[-1]
    specs = moe.MoeSpecs(groups=gt.P(axis), experts=gt.P(axis),
                         expert_buffers=gt.P(axis)) if hand else None

    def step(x, wg, w_in, w_out):
        weights = (wg, w_in, w_out)
        with tf.GradientTape() as tape:
            tape.watch(weights)
            y, aux = moe.moe_layer(x, *weights, k=2, mesh=mesh if hand else None,
                                   specs=specs)
            loss = tf.reduce_mean(tf.square(y)) + 0.01 * aux
        return [w - 0.01 * g for w, g in zip(weights, tape.gradient(loss, weights))]
    return step


def moe_rows(gt, mesh):
    """Print the MoE rows: data parallel, the hand expert plan and auto."""
    import tensorflow as tf
    P = gt.P
    e, m, h = FLAGS.experts, FLAGS.d_model, FLAGS.d_ff
    shapes = [(e, FLAGS.seq, m), (m, e), (e, m, h), (e, h, m)]
    args = [tf.TensorSpec(s) for s in shapes]
    x = P(mesh.axis_names[-1])

    def lower(plan, memory_limit=None):
        entries = {"data": (x, P(), P(), P()), "hand": (x, P(), x, x),
                   "auto": (x,) + (gt.AUTO,) * 3}[plan]
        return gt.lower(moe_step(gt, mesh, plan == "hand"), mesh, entries, args=args,
                        memory_limit=memory_limit)

    data_plan, hand = lower("data"), lower("hand")
    low, high = hand.memory().peak, data_plan.memory().peak
    auto = lower("auto", int(low + FLAGS.limit_between * (high - low)))
    plan = auto.auto_plan
    print(f"MoE layer SGD step, G=E={e} S={FLAGS.seq} M={m} H={h}, top-2, mesh {FLAGS.mesh}")
    print(f"ops {plan.num_nodes} classes {plan.num_classes} vars {plan.num_variables} "
          f"search {plan.search_seconds:.2f} s (solver {plan.solve_seconds:.2f} s)")
    for name, p in (("data", data_plan), ("expert (hand)", hand), ("auto", auto)):
        print(f"  {name:14s} peak {p.memory().peak / 2 ** 20:8.2f} MiB  collectives "
              f"{collective_bytes(p) / 2 ** 20:8.2f} MiB  in_shardings "
              f"{[s.to_spec() if hasattr(s, 'to_spec') else s for s in p.program.input_layouts[1:]]}")
    print(f"  auto/hand collective bytes {collective_bytes(auto) / collective_bytes(hand):.3f}"
          f"; memory_limit {plan.memory_limit} bytes, auto peak {auto.memory().peak}")


def keras_rows(gt, mesh, title, build, batch, hand_name, hand_map, hand_batch_spec=None,
               data_batch_spec=None):
    """Lower the train step of the Keras model `build()` makes three ways through gt.keras
    and print them: data parallel (no layout map, `data_batch_spec`), the hand plan
    (`hand_map`, `hand_batch_spec`) and auto ({".*": gt.AUTO}, the batch_spec searched,
    memory_limit --limit_between of the way from the hand plan's peak to data
    parallel's). None for a batch_spec is shard_model's default."""
    def lowered(layout_map, batch_spec, memory_limit=None):
        model = build()
        gt.keras.shard_model(model, mesh, layout_map, batch_spec=batch_spec,
                             memory_limit=memory_limit)
        return model, gt.keras.lowered(model, "train", batch)

    _, data_plan = lowered({}, data_batch_spec)
    _, hand = lowered(hand_map, hand_batch_spec)
    low, high = hand.memory().peak, data_plan.memory().peak
    model, auto = lowered({".*": gt.AUTO}, None, int(low + FLAGS.limit_between * (high - low)))
    probe = model._gt_keras.auto_lowered
    plan = probe.auto_plan
    print(title)
    print(f"probe: ops {plan.num_nodes} classes {plan.num_classes} vars {plan.num_variables}"
          f" search {plan.search_seconds:.2f} s (solver {plan.solve_seconds:.2f} s); "
          f"memory_limit {plan.memory_limit} bytes, probe peak {probe.memory().peak}; "
          f"HiGHS: {plan.status}")
    for name, p in (("data", data_plan), (hand_name, hand), ("auto", auto)):
        print(f"  {name:9s} peak {p.memory().peak / 2 ** 20:8.2f} MiB  collectives "
              f"{collective_bytes(p) / 2 ** 20:8.2f} MiB  ({collective_kinds(p)})")
    print(f"  auto/{hand_name} collective bytes "
          f"{collective_bytes(auto) / collective_bytes(hand):.3f}")
    # The probe's plan fits the real step only where the probe's figures track the step's
    # (the last search's probe beside the step partitioned with its plan).
    for name, p in (("probe", probe), ("auto step", auto)):
        m = p.memory()
        print(f"  {name:9s} arguments {m.arguments} variables {m.variables} "
              f"outputs {m.outputs} peak {m.peak} bytes per device")
    state = model._gt_keras
    print(f"  batch_spec {state.batch_spec} ({'chosen by the search' if state.batch_auto else 'given'})")
    print("\n".join(gt.keras.auto_report(model).splitlines()[:12]))
    if FLAGS.check:
        loss, trained, statistics, (name, worst) = step_errors(build, model, batch)
        print(f"  auto step against Keras on one device, one train_on_batch: relative error "
              f"of the loss {loss:.2e}, of the trainable weights' changes {trained:.2e}, "
              f"of the other weights' (batch norm statistics) {statistics:.2e}; largest "
              f"for one weight: {name} {worst:.2e}")


def step_errors(build, model, batch) -> tuple:
    """One train_on_batch of the shard_model `model` beside a plain copy of it (the same
    weights, run by Keras on one device): the relative errors (norm of the difference
    over the norm) of the loss, of the step's change to the trainable weights together
    and to the other weights together (nan when none), and (path, error) of the weight
    whose change has the largest one. Per weight the error can be large where the change
    is only rounding noise: a bias before a batch norm has no gradient but for rounding."""
    import numpy as np

    def error(got, want):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))

    def joint(trainable):
        pairs = [(g.ravel(), w.ravel()) for v, g, w in zip(model.weights, got, want)
                 if v.trainable == trainable]
        return error(*map(np.concatenate, zip(*pairs))) if pairs else float("nan")
    before = model.get_weights()
    ref = build()
    ref.set_weights(before)
    loss = error(model.train_on_batch(*batch), ref.train_on_batch(*batch))
    got = [w - b for w, b in zip(model.get_weights(), before)]
    want = [w - b for w, b in zip(ref.get_weights(), before)]
    worst = max(((v.path, error(g, w)) for v, g, w in zip(model.weights, got, want)),
                key=lambda pair: pair[1])
    return loss, joint(True), joint(False), worst


def gpt2_rows(gt, mesh):
    """Print the GPT-2 rows: data parallel, Megatron and auto through gt.keras."""
    import keras
    import keras_hub
    import numpy as np
    P = gt.P
    keras.config.set_floatx(FLAGS.floatx)
    layers = int(FLAGS.layers[0])
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq)).astype(np.int32),
         "padding_mask": np.ones((FLAGS.batch, FLAGS.seq), np.int32)}
    batch = (x, rng.integers(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq)).astype(np.int32))
    megatron = {".*self_attention/(query|key|value)/kernel": P(None, "model", None),
                ".*self_attention/(query|key|value)/bias": P("model", None),
                ".*attention_output/kernel": P("model", None, None),
                ".*feedforward_intermediate_dense/kernel": P(None, "model"),
                ".*feedforward_output_dense/kernel": P("model", None)}

    def build():
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=FLAGS.vocab, num_layers=layers, num_heads=FLAGS.heads,
            hidden_dim=FLAGS.d_model, intermediate_dim=FLAGS.d_ff, dropout=0.0,
            max_sequence_length=FLAGS.seq)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    keras_rows(gt, mesh, f"keras_hub GPT-2 train step (Adam) through gt.keras, {layers} "
               f"layers, M={FLAGS.d_model} N={FLAGS.heads} H={FLAGS.d_ff} S={FLAGS.seq} "
               f"B={FLAGS.batch} vocab {FLAGS.vocab}, mesh {FLAGS.mesh}",
               build, batch, "megatron", megatron)


def resnet50_rows(gt, mesh):
    """Print the keras.applications.ResNet50 rows: data parallel, the hand spatial plan
    (images split on their height over "model") and auto through gt.keras."""
    import keras
    import numpy as np
    P = gt.P
    keras.config.set_floatx(FLAGS.floatx)
    rng = np.random.default_rng(0)
    shape = (FLAGS.batch, FLAGS.image, FLAGS.image, 3)
    batch = (rng.standard_normal(shape).astype(FLAGS.floatx),
             rng.integers(0, FLAGS.classes, (FLAGS.batch,)).astype(np.int32))

    def build():
        model = keras.applications.ResNet50(weights=None, input_shape=shape[1:],
                                            classes=FLAGS.classes)
        optimizer = {"sgd": keras.optimizers.SGD(0.01),
                     "adam": keras.optimizers.Adam(1e-3)}[FLAGS.optimizer]
        model.compile(optimizer=optimizer, jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy())
        return model

    keras_rows(gt, mesh, f"keras.applications.ResNet50 train step ({FLAGS.optimizer}) "
               f"through gt.keras, image {FLAGS.image}, batch {FLAGS.batch}, classes "
               f"{FLAGS.classes}, {FLAGS.floatx}, mesh {FLAGS.mesh}",
               build, batch, "spatial", {}, hand_batch_spec=P("data", "model"),
               data_batch_spec=P("data"))


def resnet_rows(gt, mesh):
    """Print the ResNet-like rows: data parallel, the hand spatial plan and auto, per
    block count."""
    from gspmd_tf.testing.conv_step import ConvConfig, make_conv_step
    print(f"ResNet-like SGD step, width {FLAGS.width}, image {FLAGS.image}, batch "
          f"{FLAGS.batch}, mesh {FLAGS.mesh}")
    print(f"{'blocks':>6s} {'ops':>5s} {'search s':>9s} | {'peak MiB':>26s} | "
          f"{'collective MiB':>26s} | auto/spatial | auto's images, first weights")
    print(f"{'':22s} | {'data':>8s} {'spatial':>8s} {'auto':>8s} | {'data':>8s} "
          f"{'spatial':>8s} {'auto':>8s} |")
    for blocks in (int(b) for b in FLAGS.layers):
        config = ConvConfig(blocks, FLAGS.width, 10, FLAGS.image, FLAGS.batch)

        def lower(plan, memory_limit=None):
            return gt.lower(make_conv_step(config), mesh, config.in_shardings(plan, gt.AUTO),
                            args=config.specs(), memory_limit=memory_limit)
        data_plan, spatial = lower("data"), lower("spatial")
        low, high = spatial.memory().peak, data_plan.memory().peak
        limit = int(low + FLAGS.limit_between * (high - low))
        auto = lower("auto", limit)
        plans = (data_plan, spatial, auto)
        peaks = [p.memory().peak / 2 ** 20 for p in plans]
        sent = [collective_bytes(p) / 2 ** 20 for p in plans]
        specs = [layout.to_spec() for layout in auto.program.input_layouts[:3]]
        print(f"{blocks:6d} {auto.auto_plan.num_nodes:5d} {auto.auto_plan.search_seconds:9.2f} "
              f"| {peaks[0]:8.2f} {peaks[1]:8.2f} {peaks[2]:8.2f} | {sent[0]:8.3f} "
              f"{sent[1]:8.3f} {sent[2]:8.3f} | {sent[2] / sent[1]:.3f} | {specs}"
              f"{'' if auto.memory().peak <= limit else '  (over the limit)'}")


def collective_bytes(lowered):
    """The bytes of all of `lowered`'s collective operands, one device's each."""
    return sum(c.bytes for c in lowered.collectives())


def collective_kinds(lowered) -> str:
    """`lowered`'s collectives by kind: how many and their MiB, e.g. "all-reduce 3:
    1.50 MiB, collective-permute 8: 0.25 MiB" (collective-permutes are a spatial
    split's halo exchanges)."""
    import collections
    counts, sizes = collections.Counter(), collections.Counter()
    for c in lowered.collectives():
        counts[c.kind] += 1
        sizes[c.kind] += c.bytes
    return ", ".join(f"{kind} {counts[kind]}: {sizes[kind] / 2 ** 20:.2f} MiB"
                     for kind in sorted(counts))


def main(argv):
    del argv
    import logging

    import numpy as np

    import gspmd_tf as gt
    from gspmd_tf.testing.transformer_step import Config
    logging.getLogger("gspmd_tf").setLevel(logging.WARNING)
    shape = tuple(int(s) for s in FLAGS.mesh.split("x"))
    if FLAGS.model in ("gpt2", "resnet50"):  # gt.keras holds variables on devices: a real mesh
        gt.configure_cpu_devices(int(np.prod(shape)))
        rows = gpt2_rows if FLAGS.model == "gpt2" else resnet50_rows
        return rows(gt, gt.Mesh.create(shape, ("data", "model")))
    names = {2: ("data", "model"), 3: ("data", "replica", "model")}[len(shape)]
    mesh = gt.Mesh.abstract(shape, names)
    if FLAGS.model == "moe":
        return moe_rows(gt, mesh)
    if FLAGS.model == "resnet":
        return resnet_rows(gt, mesh)
    print(f"Transformer train step (Adam), M={FLAGS.d_model} N={FLAGS.heads} "
          f"H={FLAGS.d_ff} S={FLAGS.seq} B={FLAGS.batch}, mesh {FLAGS.mesh}")
    print(f"{'layers':>6s} {'ops':>6s} {'classes':>7s} {'vars':>6s} {'search s':>9s} "
          f"{'solver s':>9s} | {'peak MiB':>24s} | {'collective MiB':>24s} | auto/megatron")
    print(f"{'':45s} | {'data':>7s} {'megatron':>8s} {'auto':>7s} | {'data':>7s} "
          f"{'megatron':>8s} {'auto':>7s} |")
    for layers in (int(l) for l in FLAGS.layers):
        config = Config(layers, FLAGS.d_model, FLAGS.heads, FLAGS.d_ff, FLAGS.seq,
                        FLAGS.batch)
        data_plan = lower(gt, mesh, config, "data")
        megatron = lower(gt, mesh, config, "megatron")
        low, high = megatron.memory().peak, data_plan.memory().peak
        limit = int(low + FLAGS.limit_between * (high - low))
        auto = lower(gt, mesh, config, "auto", memory_limit=limit)
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
