"""The collectives XLA's SPMD partitioner emits for the GShard MoE layer (JAX reference).

NEEDS JAX (not a dependency of gspmd-tf; see benchmarks/xla_reference.py for the venv):

    /work/jaxref/bin/python benchmarks/xla_moe.py --mesh=8 [--train] [--partitioner=gspmd]
    /work/jaxref/bin/python benchmarks/xla_moe.py --mesh=2,4 [--train]
    /work/jaxref/bin/python benchmarks/xla_moe.py --mesh=2,2,2 [--train]

The same program as gspmd_tf/moe.py (top-k softmax gating, exclusive cumsum positions
over first then second choices, capacity, dispatch/expert/combine einsums), written with
jax.numpy, annotated the same way (x split on G, expert weights on E, the dispatched
tensor and the expert output on E, the dispatch mask and combine weights on G unless
--paper_annotations; on --mesh=2,2,2, axes (data, expert, model), each expert's hidden dim
also on model, as moe_layer's MoeSpecs(hidden="model")) with with_sharding_constraint,
jitted on a mesh of
host CPU devices and compiled. Prints every collective of the compiled entry (kind,
operand bytes per device, group size) and their count by kind; tests/test_moe.py holds
the counts as constants.
"""

import math
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from xla_collectives import collectives  # noqa: E402

MESH = flags.DEFINE_string("mesh", "8", "mesh shape: 8 (expert), 2,4 (data, expert) or "
                           "2,2,2 (data, expert, model)")
TRAIN = flags.DEFINE_bool("train", False, "gradients of a loss too (a training step)")
SHAPE = flags.DEFINE_string("shape", "8,16,8,16,8", "G,S,M,H,E")
K = flags.DEFINE_integer("k", 2, "experts per token")
CAPACITY_FACTOR = flags.DEFINE_float("capacity_factor", 1.0, "capacity factor")
PAPER_ANNOTATIONS = flags.DEFINE_bool(
    "paper_annotations", False, "leave the dispatch mask and combine weights unconstrained "
    "(the GShard paper's Algorithm 2), as moe_layer(annotate_gating=False)")
PARTITIONER = flags.DEFINE_enum("partitioner", "gspmd", ["gspmd", "shardy"],
                                "XLA partitioner")


def moe(x, wg, w_in, w_out, k, capacity_factor, constrain, specs):
    """gspmd_tf/moe.py's moe_layer in jax.numpy."""
    x = constrain(x, specs["groups"])
    w_in, w_out = constrain(w_in, specs["w_in"]), constrain(w_out, specs["w_out"])
    g, s, _ = x.shape
    e = wg.shape[1]
    cap = max(1, math.ceil(k * s * capacity_factor / e))
    probs = jax.nn.softmax(jnp.einsum("GSM,ME->GSE", x, wg), axis=-1)
    choices = (jnp.argmax(probs, -1)[..., None] if k == 1 else jax.lax.top_k(probs, k)[1])
    masks = jax.nn.one_hot(choices, e, dtype=probs.dtype)
    gates = jnp.sum(probs[:, :, None, :] * masks, -1)
    if k > 1:
        gates = gates / jnp.sum(gates, -1, keepdims=True)
    by_rank = jnp.transpose(masks, (0, 2, 1, 3)).reshape(g, k * s, e)
    before = jnp.cumsum(by_rank, axis=1) - by_rank
    before = jnp.transpose(before.reshape(g, k, s, e), (0, 2, 1, 3))
    position = jnp.sum(before * masks, -1)
    slots = jax.nn.one_hot(position.astype(jnp.int32), cap, dtype=masks.dtype)
    routed = masks[..., None] * slots[:, :, :, None, :]
    dispatch_mask = jnp.sum(routed, 2)
    combine_weights = jnp.einsum("GSK,GSKEC->GSEC", gates, routed)
    if not PAPER_ANNOTATIONS.value:
        dispatch_mask = constrain(dispatch_mask, specs["groups"])
        combine_weights = constrain(combine_weights, specs["groups"])
    aux = jnp.mean(jnp.mean(masks[:, :, 0, :], 1) * jnp.mean(probs, 1)) * e ** 2
    dispatched = constrain(jnp.einsum("GSEC,GSM->EGCM", dispatch_mask, x),
                           specs["expert_buffers"])
    h = jax.nn.relu(jnp.einsum("EGCM,EMH->EGCH", dispatched, w_in))
    if "hidden" in specs:
        h = constrain(h, specs["hidden"])
    expert_out = constrain(jnp.einsum("EGCH,EHM->EGCM", h, w_out), specs["expert_buffers"])
    y = constrain(jnp.einsum("GSEC,EGCM->GSM", combine_weights, expert_out), specs["groups"])
    return y, aux


def main(argv):
    del argv
    jax.config.update("jax_use_shardy_partitioner", PARTITIONER.value == "shardy")
    shape = tuple(int(n) for n in MESH.value.split(","))
    names = {1: ("expert",), 2: ("data", "expert"), 3: ("data", "expert", "model")}
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names[len(shape)])
    if len(shape) == 1:
        specs = {"groups": P("expert"), "w_in": P("expert"), "w_out": P("expert"),
                 "expert_buffers": P("expert")}
    else:
        specs = {"groups": P(("data", "expert")), "w_in": P("expert"), "w_out": P("expert"),
                 "expert_buffers": P("expert", "data")}
    if len(shape) == 3:
        specs.update(w_in=P("expert", None, "model"), w_out=P("expert", "model"),
                     hidden=P("expert", "data", None, "model"))

    def constrain(t, spec):
        return jax.lax.with_sharding_constraint(t, NamedSharding(mesh, spec))

    g, s, m, h, e = (int(n) for n in SHAPE.value.split(","))

    def forward(x, wg, w_in, w_out):
        return moe(x, wg, w_in, w_out, K.value, CAPACITY_FACTOR.value, constrain, specs)

    def train(x, wg, w_in, w_out):
        def loss(wg, w_in, w_out):
            y, aux = forward(x, wg, w_in, w_out)
            return jnp.mean(y * y) + 0.01 * aux
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(wg, w_in, w_out)

    fn = train if TRAIN.value else forward
    in_shardings = tuple(NamedSharding(mesh, p) for p in
                         (specs["groups"], P(), specs["w_in"], specs["w_out"]))
    args = [jax.ShapeDtypeStruct(shp, jnp.float32)
            for shp in ((g, s, m), (m, e), (e, m, h), (e, h, m))]
    compiled = jax.jit(fn, in_shardings=in_shardings).lower(*args).compile()
    found = collectives(compiled.as_text())
    for kind, nbytes, group in found:
        print(f"{kind:20s} {nbytes:8d} bytes  group {group}")
    counts = {}
    for kind, _, _ in found:
        counts[kind] = counts.get(kind, 0) + 1
    print("counts:", dict(sorted(counts.items())))


if __name__ == "__main__":
    app.run(main)
