"""The collectives XLA's SPMD partitioner emits for the 3-D U-Net of benchmarks/unet3d.py
(one step's loss and gradients, input split 2x2x2 over D, H, W; JAX reference).

NEEDS JAX (not a dependency of gspmd-tf; see benchmarks/xla_reference.py for the venv):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        /work/jaxref/bin/python benchmarks/xla_unet3d.py [--size=8]

The same layers as unet3d.unet ("transpose" upsampling) written with jax.lax, jitted
with the input and target sharded P(None, "a", "b", "c") and the weights replicated;
prints each collective of the compiled module (kind, operand bytes per device, group
size, as benchmarks/xla_collectives.py reads them) and the totals by kind.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from xla_collectives import collectives  # noqa: E402

SIZE = flags.DEFINE_integer("size", 8, "spatial size of the input volume (D = H = W)")

# name -> weight shape, as benchmarks/unet3d.py (which JAX cannot import: it imports TF)
SHAPES = {
    "enc1": (3, 3, 3, 2, 4), "enc1_b": (4,), "enc2": (3, 3, 3, 4, 4),
    "mid1": (3, 3, 3, 4, 8), "mid2": (3, 3, 3, 8, 8), "mid2_b": (8,),
    "up": (2, 2, 2, 4, 8), "dec": (3, 3, 3, 8, 4), "head": (1, 1, 1, 4, 1),
}
DIMS = ("NDHWC", "DHWIO", "NDHWC")


def unet(x, w):
    def conv(h, name, bias=None):
        h = jax.lax.conv_general_dilated(h, w[name], (1, 1, 1), "SAME",
                                         dimension_numbers=DIMS)
        return jax.nn.relu(h if bias is None else h + w[bias])
    skip = conv(conv(x, "enc1", "enc1_b"), "enc2")
    h = jax.lax.reduce_window(skip, -jnp.inf, jax.lax.max, (1, 2, 2, 2, 1),
                              (1, 2, 2, 2, 1), "VALID")
    h = conv(conv(h, "mid1"), "mid2", "mid2_b")
    # TF's conv3d_transpose filter is [D, H, W, out, in]: the transposed conv of a
    # DHWOI kernel (transpose_kernel swaps I and O and flips the window)
    h = jax.lax.conv_transpose(h, w["up"], (2, 2, 2), "SAME",
                               dimension_numbers=DIMS, transpose_kernel=True)
    h = conv(jnp.concatenate([h, skip], axis=-1), "dec")
    return jax.lax.conv_general_dilated(h, w["head"], (1, 1, 1), "VALID",
                                        dimension_numbers=DIMS)


def main(argv):
    del argv
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a", "b", "c"))
    spatial = NamedSharding(mesh, P(None, "a", "b", "c"))
    whole = NamedSharding(mesh, P())

    def loss(w, x, target):
        return jnp.mean(jnp.square(unet(x, w) - target))
    step = jax.jit(jax.value_and_grad(loss),
                   in_shardings=({n: whole for n in SHAPES}, spatial, spatial))
    size = SIZE.value
    args = ({n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in SHAPES.items()},
            jax.ShapeDtypeStruct((1, size, size, size, 2), jnp.float32),
            jax.ShapeDtypeStruct((1, size, size, size, 1), jnp.float32))
    totals = {}
    for kind, nbytes, group in collectives(step.lower(*args).compile().as_text()):
        totals[kind] = totals.get(kind, 0) + nbytes
        print(f"{kind:20s} {nbytes:8d} bytes  group {group}")
    for kind, nbytes in sorted(totals.items()):
        print(f"total {kind}: {nbytes} bytes per device")


if __name__ == "__main__":
    app.run(main)
