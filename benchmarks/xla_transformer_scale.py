"""XLA's collectives for benchmarks/transformer_scale.py's model (JAX reference).

NEEDS JAX (not a dependency of gspmd-tf; see benchmarks/xla_reference.py for the venv):

    /work/jaxref/bin/python benchmarks/xla_transformer_scale.py --config=128B-8x16

The same training step (attention + feed-forward layers, SGD update, weights as
arguments and results) written in jax.numpy, with the same 2-D shardings: the same
in_shardings on the batch and the weights, and the same with_sharding_constraint hints
on q, k, v, the attention context, the residual stream and the feed-forward hidden
activations (transformer_scale.make_step's `hint`s). It is compiled by XLA's SPMD
partitioner (GSPMD, or Shardy with --partitioner=shardy) for the config's mesh on that
many host CPU devices (compiling allocates nothing), with 1 and 2 layers, and the
collectives of the compiled modules are counted as benchmarks/xla_collectives.py does
(bytes of one device's operands), then scaled to the full depth as transformer_scale.py
does. Prints one table row in transformer_scale.py's columns.
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformer_scale import AXES, CONFIGS, KINDS, fmt  # noqa: E402  (no TF import)

CONFIG = flags.DEFINE_string("config", "128B-8x16", "a transformer_scale.py config name")
PARTITIONER = flags.DEFINE_enum("partitioner", "gspmd", ["gspmd", "shardy"],
                                "XLA's partitioner")


def _step(jax, jnp, mesh, layers, gated, lr=0.01):
    from jax.sharding import NamedSharding, PartitionSpec as P

    def hint(t, *spec):
        return jax.lax.with_sharding_constraint(t, NamedSharding(mesh, P(*spec)))

    def layer(x, wq, wk, wv, wo, *ffn):
        q = hint(jnp.einsum("bsm,mnk->bsnk", x, wq), "x", None, "y", None)
        k = hint(jnp.einsum("bsm,mnk->bsnk", x, wk), "x", None, "y", None)
        v = hint(jnp.einsum("bsm,mnk->bsnk", x, wv), "x", None, "y", None)
        scale = 1.0 / float(q.shape[-1]) ** 0.5
        probs = jax.nn.softmax(jnp.einsum("bsnk,btnk->bnst", q, k) * scale, axis=-1)
        context = hint(jnp.einsum("bnst,btnk->bsnk", probs, v), "x", None, "y", None)
        x = hint(x + jnp.einsum("bsnk,nkm->bsm", context, wo), "x", None, "y")
        hidden = hint(jnp.einsum("bsm,mh->bsh", x, ffn[0]), "x", None, "y")
        if gated:
            gate = hint(jnp.einsum("bsm,mh->bsh", x, ffn[1]), "x", None, "y")
            hidden = jax.nn.gelu(hidden, approximate=True) * gate
        else:
            hidden = jax.nn.relu(hidden)
        return hint(x + jnp.einsum("bsh,hm->bsm", hidden, ffn[-1]), "x", None, "y")

    per_layer = 6 + gated

    def loss_fn(weights, x):
        h = x
        for i in range(layers):
            h = layer(h, *weights[per_layer * i:per_layer * (i + 1)])
        return jnp.mean(jnp.square(h))

    def step(x, *weights):
        loss, grads = jax.value_and_grad(loss_fn)(weights, x)
        return (loss,) + tuple(w - lr * g for w, g in zip(weights, grads))
    return step


def measure(config, layers):
    """{kind: bytes per device} of XLA's compiled step with `layers` layers."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from transformer_scale import weight_shapes
    from xla_collectives import collectives  # starts the backend: after main's config
    _, m, h, n, k, s, b, mesh_shape, gated = config
    count = int(np.prod(mesh_shape))
    mesh = Mesh(np.array(jax.devices()[:count]).reshape(mesh_shape), AXES)
    shapes = weight_shapes(m, h, n, k, gated) * layers
    args = [jax.ShapeDtypeStruct((b, s, m), jnp.float32)] + [
        jax.ShapeDtypeStruct(shape, jnp.float32) for _, shape, _ in shapes]
    in_shardings = [NamedSharding(mesh, P("x", None, "y"))] + [
        NamedSharding(mesh, P(*spec)) for _, _, spec in shapes]
    fn = jax.jit(_step(jax, jnp, mesh, layers, gated), in_shardings=in_shardings)
    text = fn.lower(*args).compile().as_text()
    out = {kind: 0 for kind in KINDS}
    for kind, nbytes, _ in collectives(text):
        out[kind] += nbytes
    return out


def main(argv):
    del argv
    config = CONFIGS[CONFIG.value]
    count = config[7][0] * config[7][1]
    import jax
    # before JAX starts its CPU backend
    jax.config.update("jax_num_cpu_devices", count)
    jax.config.update("jax_use_shardy_partitioner", PARTITIONER.value == "shardy")
    layers = config[0]
    f1, f2 = measure(config, 1), measure(config, 2)
    full = {kind: f1[kind] + (layers - 1) * (f2[kind] - f1[kind]) for kind in KINDS}
    total = sum(full.values())
    print(f"JAX {jax.__version__}, XLA {PARTITIONER.value} on {count} host CPU devices\n")
    print("| config | XLA collective bytes/device/step | " + " | ".join(KINDS) + " |")
    print("|---|---:|" + "---:|" * len(KINDS))
    print(f"| {CONFIG.value} | {fmt(total)} | "
          + " | ".join(fmt(full[kind]) if full[kind] else "0" for kind in KINDS) + " |")


if __name__ == "__main__":
    app.run(main)
