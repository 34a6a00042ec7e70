"""Small programs lowered by gspmd-tf for a check of the annotated global graph through
XLA's SPMD partitioner (benchmarks/bridge_cases.py writes them, benchmarks/xla_spmd_check.py
checks them under JAX; tests/test_tpu_bridge.py and tests/test_annotated_device_order.py
run both). Each case_NAME(gt, tf, rng) returns (fn, argument values, in_shardings[,
captured variables as (value, spec)]); write_case writes one case's files:
  NAME.hlo.pb   the HloModuleProto TF's XLA bridge makes of the annotated global graph
  NAME.npz      the inputs (in0, in1, ...) and the single-device TF outputs (out0, ...)
  NAME.json     input and output shardings (XLA text), the device count and gspmd-tf's
                own collectives (kind, bytes of one device's operand)
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.runtime.annotated import compiler_ir
from gspmd_tf.sharding import Sharding

MESH_SHAPE, AXES = (2, 4), ("data", "model")


def _mlp(tf, rng):
    def mlp(x, w1, w2):
        return tf.nn.relu(x @ w1) @ w2
    return mlp, [rng.standard_normal(s).astype(np.float32) for s in
                 ((16, 32), (32, 64), (64, 32))]


def case_matmul_data(gt, tf, rng):
    """Data parallel MLP: batch split over both axes, weights replicated."""
    fn, values = _mlp(tf, rng)
    return fn, values, (gt.P(("data", "model")), None, None)


def case_matmul_model(gt, tf, rng):
    """Megatron MLP: batch over data, W1 columns and W2 rows over model."""
    fn, values = _mlp(tf, rng)
    return fn, values, (gt.P("data"), gt.P(None, "model"), gt.P("model"))


def case_conv_spatial(gt, tf, rng):
    """3x3 SAME conv, then 3x3 VALID conv with stride 1, image height split over model
    (halo exchange), batch over data."""
    def conv(x, k1, k2):
        y = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME"))
        return tf.nn.conv2d(y, k2, 1, "SAME")
    values = [rng.standard_normal(s).astype(np.float32) for s in
              ((2, 32, 16, 4), (3, 3, 4, 8), (3, 3, 8, 4))]
    return conv, values, (gt.P("data", "model"), None, None)


def case_control_flow(gt, tf, rng):
    """A while loop of x -> tanh(x @ w), then a cond on the sum; x split over data. gspmd-tf
    runs control flow replicated; XLA's partitioner partitions the loop itself."""
    def loop(x, w):
        y = tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.tanh(y @ w)),
                          (tf.constant(0), x))[1]
        return tf.cond(tf.reduce_sum(y) > 0, lambda: y * 2.0, lambda: y - 1.0)
    values = [rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (8, 8))]
    return loop, values, (gt.P("data"), None)


def case_swap_axes(gt, tf, rng):
    """x split P(data, model) constrained to P(model, data): the planner swaps the axes
    through layouts with the mesh's devices in other orders (all-to-all, permute,
    all-to-all; RESULTS section 7.1), which the annotated graph carries step by step."""
    mesh = gt.Mesh.abstract(MESH_SHAPE, AXES)

    def swap(x):
        return gt.mesh_split(x * 2.0, mesh, gt.P("model", "data")) + 1.0
    return swap, [rng.standard_normal((64, 256)).astype(np.float32)], (gt.P("data", "model"),)


def case_partial_sum_to_batch_split(gt, tf, rng):
    """einsum bsh,hm->bsm with h split over model and m over data, the result constrained
    to P(data, None, model): the partial sum is reduce-scattered, permuted and
    all-to-all'd (RESULTS section 7.1)."""
    mesh = gt.Mesh.abstract(MESH_SHAPE, AXES)

    def dot(a, b):
        y = tf.einsum("bsh,hm->bsm", a, b)
        return gt.mesh_split(y, mesh, gt.P("data", None, "model")) * 2.0
    values = [rng.standard_normal(s).astype(np.float32) for s in ((2, 128, 64), (64, 256))]
    return dot, values, (gt.P(None, None, "model"), gt.P("model", "data"))


def case_train_step_variables(gt, tf, rng):
    """One SGD step of the Megatron MLP whose weights are captured gt.Variables (W1
    columns and W2 rows over model), batch over data: the variables enter the HLO as
    sharded parameters and leave updated, sharded, after the loss. Returns a 4th item:
    the variables' (initial value, spec); the function is built from the variables."""
    def make_step(w1, w2):
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.nn.relu(x @ w1) @ w2))
            g1, g2 = tape.gradient(loss, [w1, w2])
            w1.assign_sub(0.01 * g1)
            w2.assign_sub(0.01 * g2)
            return loss
        return step
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in
                 ((16, 32), (32, 64), (64, 32)))
    return make_step, [x], (gt.P("data"),), [(w1, gt.P(None, "model")), (w2, gt.P("model"))]


def case_embedding_step_variables(gt, tf, rng):
    """A captured gt.Variable embedding table (replicated, as gspmd-tf keeps tables that
    sparse updates write) read with a gather of the batch's rows and updated sparsely,
    as Keras' SGD updates an Embedding (ResourceGather, ResourceScatterSub); batch over
    data. Returns the table's (initial value, spec) as a 4th item."""
    def make_step(table):
        def step(ids, target):
            rows = tf.gather(table, ids)
            loss = tf.reduce_sum(tf.square(rows - target))
            table.scatter_sub(tf.IndexedSlices(0.2 * (rows - target), ids))
            return loss
        return step
    ids = rng.integers(0, 24, (16,)).astype(np.int32)
    target = rng.standard_normal((16, 8)).astype(np.float32)
    table = rng.standard_normal((24, 8)).astype(np.float32)
    return make_step, [ids, target], (gt.P("data"), gt.P("data")), [(table, gt.P())]


def case_transformer(gt, tf, rng):
    """The demo's 2-layer Transformer LM loss (embedding, attention, layer norm, MLP,
    cross entropy), Megatron annotations."""
    del rng
    from gspmd_tf import demo
    cfg = demo.ModelConfig(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq=16,
                           batch=8)
    values = [demo.make_batch(cfg)] + demo.init_params(cfg)
    return demo.make_loss_fn(cfg), values, tuple(demo.in_specs(cfg))


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items())
         if name.startswith("case_")}


def write_case(name, out_dir):
    """Lowers case `name`, writes its three files into `out_dir`; returns the Lowered.

    A case with captured variables (a 4th item, see case_train_step_variables) runs on
    a mesh of this process's 8 CPU devices (gt.Variables live on devices); their
    initial values follow the arguments in NAME.npz, their final values the outputs."""
    fn, values, specs, *initial = CASES[name](gt, tf, np.random.default_rng(0))
    initial = initial[0] if initial else []
    arg_specs = [tf.TensorSpec(v.shape, v.dtype) for v in values]
    if initial:
        mesh = gt.Mesh.create(MESH_SHAPE, AXES)
        lowered = gt.lower(fn(*[gt.Variable(v, mesh, spec) for v, spec in initial]), mesh,
                           specs, args=arg_specs)
        with tf.device("/CPU:0"):
            reference = [tf.Variable(v) for v, _ in initial]
            expected = tf.nest.flatten(tf.function(fn(*reference), autograph=False)(*values))
            expected += [v.read_value() for v in reference]
    else:
        lowered = gt.lower(fn, gt.Mesh.abstract(MESH_SHAPE, AXES), specs, args=arg_specs)
        with tf.device("/CPU:0"):
            expected = tf.nest.flatten(tf.function(fn, autograph=False)(*values))
    arrays = {f"in{i}": v for i, v in enumerate(values + [v for v, _ in initial])}
    arrays.update({f"out{j}": t.numpy() for j, t in enumerate(expected)})
    np.savez(os.path.join(out_dir, f"{name}.npz"), **arrays)
    write_program(lowered, name, out_dir)
    return lowered


def write_program(lowered, name, out_dir, operand_shardings=True):
    """NAME.hlo.pb (the bridge's HloModuleProto) and NAME.json (shardings, device count,
    gspmd-tf's collectives)."""
    with open(os.path.join(out_dir, f"{name}.hlo.pb"), "wb") as f:
        f.write(compiler_ir(lowered, "hlo_serialized", operand_shardings))
    # captured variables: parameters after the arguments, final values after the outputs
    variables = [str(Sharding.from_layout(lowered.mesh, layout)) for layout in
                 lowered.program.input_layouts[len(lowered.input_shardings):]]
    meta = {"num_devices": lowered.mesh.size,
            "input_shardings": [str(s) for s in lowered.input_shardings] + variables,
            "output_shardings": [str(s) for s in lowered.output_shardings] + variables,
            "gt_collectives": [[c.kind, c.bytes] for c in lowered.collectives()]}
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(meta, f, indent=1)
