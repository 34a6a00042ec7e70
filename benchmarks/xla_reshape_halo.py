"""XLA's collectives for a Reshape whose split dims regroup with a halo (JAX reference).

NEEDS JAX (not a dependency of gspmd-tf; see benchmarks/xla_reference.py for the venv):

    <jax venv>/bin/python benchmarks/xla_reshape_halo.py

The program of XLA's spmd_partitioner_test ReshapeMergeDimsWithHaloExchange, on the
first 2 of 8 host CPU devices: x (2, 3, 7, 10) split on its 7, reshaped to
(3, 2, 1, 14, 5) split on its 14 (operand and result constrained), times 3. Prints the
collectives of the compiled HLO as (kind, operand bytes per device, group size), read
as benchmarks/xla_collectives.py reads them; tests/test_reshape_regroup.py holds the
result as a constant and checks gspmd-tf's side.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from xla_collectives import collectives  # noqa: E402

SHAPE, SPEC = (2, 3, 7, 10), (None, None, "x")
NEW_SHAPE, NEW_SPEC = (3, 2, 1, 14, 5), (None, None, None, "x")


def main():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    spec, new_spec = NamedSharding(mesh, P(*SPEC)), NamedSharding(mesh, P(*NEW_SPEC))

    def fn(x):
        y = jax.lax.with_sharding_constraint(x * 2, spec)
        return jax.lax.with_sharding_constraint(y.reshape(NEW_SHAPE), new_spec) * 3
    f = jax.jit(fn, in_shardings=NamedSharding(mesh, P()), out_shardings=new_spec)
    found = collectives(f.lower(jax.ShapeDtypeStruct(SHAPE, jnp.float32)).compile()
                        .as_text())
    print(f"{SHAPE} P{SPEC} -> {NEW_SHAPE} P{NEW_SPEC}")
    print(f"    {found}  total operand bytes {sum(b for _, b, _ in found)}")


if __name__ == "__main__":
    main()
