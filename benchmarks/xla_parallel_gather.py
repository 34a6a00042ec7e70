"""What XLA's SPMD partitioner sends for a parallel (batched) gather.

NEEDS JAX (optional, not a dependency of gspmd-tf; see xla_reference.py for the venv):

    /work/jaxref/bin/python benchmarks/xla_parallel_gather.py

The gather of tests/test_registry.py (tf.gather(table, indices, axis=2, batch_dims=1) on
table [8, 5, 7, 8] and indices [8, 3]) written as a vmapped jnp.take, on a 2x4
("data", "model") mesh of host CPU devices, for each split of table and indices the test
checks; prints the collectives of XLA's partitioned HLO. Recorded with JAX 0.10.2: none
for every case (tests/test_registry.py::test_parallel_gather_sends_nothing).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

from absl import app  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
               "reduce-scatter")
CASES = [(P("data"), P("data")),
         (P(("data", "model")), P(("data", "model"))),
         (P("data", None, None, "model"), P("data"))]


def main(argv):
    del argv
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    gather = jax.vmap(lambda t, i: jnp.take(t, i, axis=1))
    for table_spec, indices_spec in CASES:
        table = jax.ShapeDtypeStruct((8, 5, 7, 8), jnp.float32,
                                     sharding=NamedSharding(mesh, table_spec))
        indices = jax.ShapeDtypeStruct((8, 3), jnp.int32,
                                       sharding=NamedSharding(mesh, indices_spec))
        hlo = jax.jit(gather).lower(table, indices).compile().as_text()
        found = [c for c in COLLECTIVES if f" {c}(" in hlo or f" {c}-start(" in hlo]
        print(f"table {table_spec}, indices {indices_spec}: {found or 'no collectives'}")


if __name__ == "__main__":
    app.run(main)
