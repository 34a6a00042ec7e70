"""XLA's collectives for planner_quality_cases.py's reshards, dots, reshapes and splits (JAX
reference; records the answers tests/test_planner_quality.py and
tests/test_reshape_free_result.py hold as constants).

NEEDS JAX (not a dependency of gspmd-tf; see benchmarks/xla_reference.py for the venv):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        /work/jaxref/bin/python benchmarks/xla_planner_quality.py

Each case is jitted on 8 host CPU devices and compiled; the collectives (kind, operand
bytes on one device, group size) are read from `.compile().as_text()` as
xla_collectives.py reads them. --hlo also prints each reshard's collective instructions
(their replica_groups / source_target_pairs: which devices XLA groups). Every case ends
in the sum of its result, whose scalar all-reduce(s) are printed too (the tests leave them out: 4-byte operands).
"""

import jax  # noqa: E402  (xla_collectives sets XLA_FLAGS before JAX starts)
from absl import app, flags  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import re  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from planner_quality_cases import (DOTS, FREE_RESHAPES, RESHAPES, RESHARDS, SPLITS,  # noqa: E402
                                   flat_size)
from xla_collectives import KINDS, MESH, collectives, reshard_case, reshard_hlo  # noqa: E402

HLO = flags.DEFINE_bool("hlo", False, "print the reshards' collective HLO instructions")

LINE = Mesh(np.array(jax.devices()[:4]), ("x",))


def dot_case(equation, shapes, specs, out_spec):
    """Collectives of an einsum of operands sharded by `specs`, result constrained."""
    def fn(a, b):
        out = jnp.einsum(equation, a, b)
        return jnp.sum(jax.lax.with_sharding_constraint(out, NamedSharding(MESH, P(*out_spec))))
    f = jax.jit(fn, in_shardings=tuple(NamedSharding(MESH, P(*s)) for s in specs))
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return collectives(f.lower(*args).compile().as_text())


def reshape_case(shape, spec, out_spec, new_shape=None):
    """Collectives of reshaping a `spec`-sharded tensor to `new_shape` (default: one dim;
    the result constrained to `out_spec`, or left to XLA when None)."""
    def fn(x):
        y = jax.lax.with_sharding_constraint(x * 2, NamedSharding(LINE, P(*spec)))
        z = jnp.reshape(y, new_shape or (flat_size(shape),))
        if out_spec is not None:
            z = jax.lax.with_sharding_constraint(z, NamedSharding(LINE, P(*out_spec)))
        return jnp.sum(z * z)
    f = jax.jit(fn, in_shardings=NamedSharding(LINE, P()))
    return collectives(f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text())


def free_reshape_case(mesh, shape, spec, new_shape, consumer):
    """Collectives of reshaping a `spec`-sharded tensor to `new_shape`, the result's
    sharding left to XLA, then `consumer` "sum" (the sum of its squares) or
    "replicated" (the result times 3, constrained to be replicated)."""
    mesh = {"line": LINE, "2x4": MESH}[mesh]

    def fn(x):
        y = jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P(*spec)))
        z = jnp.reshape(y, new_shape)
        if consumer == "sum":
            return jnp.sum(z * z)
        return jax.lax.with_sharding_constraint(z * 3, NamedSharding(mesh, P()))
    f = jax.jit(fn, in_shardings=NamedSharding(mesh, P()))
    return collectives(f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text())


def main(argv):
    del argv
    for name, case in RESHARDS.items():
        print(f"{name}: {reshard_case(*case)}")
        if HLO.value:
            for line in reshard_hlo(*case).splitlines():
                if any(f" {kind}(" in line or f" {kind}-start(" in line for kind in KINDS):
                    print("   ", re.sub(r", metadata=\{.*", "", line.strip()))
    for name, case in DOTS.items():
        print(f"{name}: {dot_case(*case)}")
    for name, (shape, spec, out_spec) in RESHAPES.items():
        print(f"{name}: {reshape_case(shape, spec, out_spec)}")
        print(f"{name} (result left to XLA): {reshape_case(shape, spec, None)}")
    for name, (size, new_shape) in SPLITS.items():
        print(f"{name}: {reshape_case((size,), ('x',), ('x',), new_shape)}")
    for name, case in FREE_RESHAPES.items():
        for consumer in ("sum", "replicated"):
            print(f"{name} (result free, {consumer} consumer): "
                  f"{free_reshape_case(*case, consumer)}")


if __name__ == "__main__":
    app.run(main)
