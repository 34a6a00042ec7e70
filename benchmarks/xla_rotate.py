"""The collectives XLA's SPMD partitioner emits for a rotation of a split dim (JAX
reference for the pipeline shift; docs/DESIGN_LOG.md, "Pipeline parallelism").

NEEDS JAX (not a dependency of gspmd-tf; see benchmarks/xla_reference.py for the venv):

    /work/jaxref/bin/python benchmarks/xla_rotate.py

A [4, 3, 5] tensor split over a 1-D mesh of 4 host CPU devices on dim 0 is rotated by one
row (jnp.roll, and the slice + concat form), operand and result split alike; the
gradient of the concat form is taken against a weighted sum. Prints, per case, the
collectives of the compiled module (kind and count).
"""

import os
import re

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")

from absl import app  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

_KINDS = ("collective-permute", "all-gather", "all-reduce", "all-to-all", "reduce-scatter")


def _concat(x):
    return jnp.concatenate([x[-1:], x[:-1]], 0)


CASES = {
    "roll": lambda x: jnp.roll(x, 1, 0),
    "slice_concat": _concat,
    "slice_concat_gradient": jax.grad(
        lambda x: (_concat(x) * jnp.arange(1.0, 5.0)[:, None, None]).sum()),
}


def collectives(fn, sharding, x):
    """Kinds of the collectives (start ops of async pairs counted once) in fn's module."""
    text = jax.jit(fn, in_shardings=sharding, out_shardings=sharding).lower(x).compile().as_text()
    found = []
    for line in text.splitlines():
        match = re.search(r"= \S+ (" + "|".join(_KINDS) + r")(-start)?\(", line)
        if match:
            found.append(match.group(1))
    return found


def main(argv):
    del argv
    mesh = Mesh(np.array(jax.devices()[:4]), ("stage",))
    sharding = NamedSharding(mesh, PartitionSpec("stage"))
    x = jnp.arange(60.0).reshape(4, 3, 5)
    print(f"JAX {jax.__version__}")
    for name, fn in CASES.items():
        kinds = collectives(fn, sharding, x)
        print(f"{name}: " + (", ".join(f"{k} x{kinds.count(k)}" for k in sorted(set(kinds)))
                             or "none"))


if __name__ == "__main__":
    app.run(main)
