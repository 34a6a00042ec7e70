"""The collectives XLA's SPMD partitioner emits for reshards, dots, pads and slices (JAX
reference).

NEEDS JAX (not a dependency of gspmd-tf; see benchmarks/xla_reference.py for the venv):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        /work/jaxref/bin/python benchmarks/xla_collectives.py [--case=NAME]

Each case is jitted on a 2x4 ("data", "model") mesh of 8 host CPU devices and compiled;
the collectives are read from `.compile().as_text()`: kind, the bytes of its operands on
one device (the sum over a tuple operand, as XLA's CPU all-to-all takes one array per
peer), and its group size. Reshard cases compute `y = x * 2` constrained to the source
sharding (so uneven source shardings are allowed), then constrain y to the target and
reduce it (the reduction's scalar all-reduce is reported too; tests skip it by shape).
Window cases pad or slice a split dim, operand and result constrained alike, then reduce.
tests/test_planner.py (tests/test_slicing.py for the window cases) holds the results as
constants; benchmarks/reshard_plans.py prints
gspmd-tf's side of the same cases (gspmd_tf/testing/collective_cases.py).
"""

import importlib.util
import os
import re

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

# The cases module is loaded by its path: importing it as gspmd_tf.testing.collective_cases
# would import gspmd_tf, and with it TensorFlow, which JAX's environment lacks.
_CASES_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "gspmd_tf", "testing", "collective_cases.py")
_spec = importlib.util.spec_from_file_location("collective_cases", _CASES_PATH)
collective_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(collective_cases)
print_cases, window_op = collective_cases.print_cases, collective_cases.window_op

CASE = flags.DEFINE_string("case", "all", "case name, or 'all'")

MESH = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
KINDS = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")
DTYPE_BYTES = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1, "f64": 8, "s64": 8}


def _sharded(spec):
    return NamedSharding(MESH, P(*spec))


def collectives(hlo_text):
    """[(kind, operand bytes per device, group size)] of a compiled HLO module's entry."""
    shapes = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%\S+) = (\(.*?\)|\S+) ", line)
        if m:
            shapes[m.group(1)] = m.group(2)
    out = []
    for line in hlo_text.splitlines():
        m = re.search(r"= (?:\(.*?\)|\S+) (" + "|".join(KINDS) + r")(?:-start)?\((.*?)\)",
                      line)
        if not m:
            continue
        operands = [re.sub(r"/\*.*?\*/", "", o).strip() for o in m.group(2).split(",")]
        nbytes = sum(_bytes(shapes[o]) for o in operands if o in shapes)
        out.append((m.group(1), nbytes, _group_size(line)))
    return out


def _bytes(type_text):
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", type_text):
        count = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
        total += count * DTYPE_BYTES[dtype]
    return total


def _group_size(line):
    """Devices per group of a collective (1 for a collective-permute)."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if m:
        # {'a'} is a whole mesh axis, {'a':(2)2} a sub-axis of it (pre-size 2, size 2)
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return int(np.prod([int(sub or sizes[a]) for a, sub in
                            re.findall(r"'(\w+)'(?::\(\d+\)(\d+))?", m.group(2))]))
    return 1


def reshard_hlo(shape, src, dst):
    """The compiled HLO text of constraining a `src`-sharded tensor to `dst`."""
    def fn(x):
        y = jax.lax.with_sharding_constraint(x * 2, _sharded(src))
        z = jax.lax.with_sharding_constraint(y, _sharded(dst))
        return jnp.sum(z * z)
    f = jax.jit(fn, in_shardings=_sharded(()))
    return f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()


def reshard_case(shape, src, dst):
    """Collectives of constraining a `src`-sharded tensor to `dst`."""
    return collectives(reshard_hlo(shape, src, dst))


def dot_case(equation, shapes, specs):
    """Collectives of an einsum of operands sharded by `specs`, the result left to XLA."""
    f = jax.jit(lambda a, b: jnp.einsum(equation, a, b),
                in_shardings=tuple(_sharded(s) for s in specs))
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    compiled = f.lower(*args).compile()
    return collectives(compiled.as_text()), compiled.output_shardings


def window_case(shape, spec, op):
    """Collectives of a pad or slice of a tensor sharded by `spec`, the result
    constrained to the same sharding and reduced (as reshard cases do: uneven shardings
    are allowed inside a jit only)."""
    op_fn = window_op(op, jnp.pad, lambda x, index: x[index])

    def fn(x):
        y = jax.lax.with_sharding_constraint(x * 2, _sharded(spec))
        z = jax.lax.with_sharding_constraint(op_fn(y), _sharded(spec))
        return jnp.sum(z * z)
    f = jax.jit(fn, in_shardings=_sharded(()))
    return collectives(f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text())


def main(argv):
    del argv
    print_cases(CASE.value, lambda *case: [str(reshard_case(*case))], dot_case, window_case,
                P)

if __name__ == "__main__":
    app.run(main)
