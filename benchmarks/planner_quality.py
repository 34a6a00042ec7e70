"""gspmd-tf's collectives for planner_quality_cases.py's reshards, dots, reshapes, splits
(XLA's side: xla_planner_quality.py).

    .venv/bin/python benchmarks/planner_quality.py

Each collective is (kind, operand bytes per device, group size; 1 for a permute), as
XLA's side prints them, followed by the bytes each device moves under the planner's ring
model (planner.step_cost). Reshards are the planner's plans, each collective then listed
with its mesh axes and device groups (a permute's pairs); dots and reshapes are lowered
by gt.lower on abstract meshes (2x4 ("data", "model"), 4 ("x",)).
"""

import logging
import os
import sys

from absl import app
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gspmd_tf as gt  # noqa: E402
from gspmd_tf.layout import Layout, permute_pairs  # noqa: E402
from gspmd_tf.spmd import planner  # noqa: E402

from planner_quality_cases import (DOTS, FREE_RESHAPES, RESHAPES, RESHARDS, SPLITS,  # noqa: E402
                                   flat_size)

MESH = gt.Mesh.abstract((2, 4), ("data", "model"))
LINE = gt.Mesh.abstract((4,), ("x",))
KIND = {planner.AllGather: "all-gather", planner.AllToAll: "all-to-all",
        planner.CollectivePermute: "collective-permute",
        planner.ReduceScatter: "reduce-scatter", planner.AllReduce: "all-reduce",
        planner.Broadcast: "all-reduce"}
# a collective of (operand bytes, group size) as a planner step, for step_cost
STEP = {"all-gather": lambda b, k: planner.AllGather(0, (), b, k),
        "all-to-all": lambda b, k: planner.AllToAll((), 0, 1, b, k),
        "reduce-scatter": lambda b, k: planner.ReduceScatter(0, (), b, k),
        "collective-permute": lambda b, k: planner.CollectivePermute((), b, k),
        "all-reduce": lambda b, k: planner.AllReduce((), b, k)}


def moved(found):
    """Bytes each device moves for [(kind, operand bytes, group)], by the ring model."""
    return planner.cost([STEP[kind](nbytes, k) for kind, nbytes, k in found]).bytes


def reshard_steps(shape, src, dst):
    """The planner's plan."""
    layouts = [Layout.from_spec(MESH, spec, len(shape)) for spec in (src, dst)]
    return planner.plan(*layouts, shape, tf.float32, MESH)


def reshard_case(shape, src, dst):
    """[(kind, operand bytes, group)] of the planner's plan."""
    return [(KIND[type(s)], s.bytes_in, 1 if isinstance(s, planner.CollectivePermute)
             else s.group) for s in reshard_steps(shape, src, dst) if type(s) in KIND]


def device_groups(shape, src, dst):
    """Per collective of the plan, its mesh axes (sub-axes as axis:(pre)size) and device
    groups (a permute: its (source, target) pairs), to compare with XLA's HLO
    (xla_planner_quality.py --hlo)."""
    layouts = [Layout.from_spec(MESH, spec, len(shape)) for spec in (src, dst)]
    out, layout = [], layouts[0]
    for step in reshard_steps(shape, src, dst):
        after = step.apply(layout)
        if isinstance(step, planner.CollectivePermute):
            out.append(("permute", permute_pairs(MESH, layout, after)))
        elif type(step) in KIND:
            out.append((",".join(map(str, step.axes)), MESH.groups(step.axes).tolist()))
        layout = after
    return out


def _found(lowered):
    return [(c.kind, c.bytes, 1 if c.kind == "collective-permute" else len(c.groups[0]))
            for c in lowered.collectives()]


def dot_case(equation, shapes, specs, out_spec):
    """Collectives of the einsum lowered with its result constrained to `out_spec`."""
    lowered = gt.lower(lambda a, b: tf.einsum(equation, a, b), MESH,
                       tuple(gt.P(*s) for s in specs), (gt.P(*out_spec),),
                       args=[tf.TensorSpec(s) for s in shapes])
    return _found(lowered)


def reshape_case(shape, spec, out_spec, new_shape=None):
    """Collectives of reshaping to `new_shape` (default: one dim) on the 1-D mesh
    (result `out_spec`, or left to propagation when None)."""
    lowered = gt.lower(lambda x: tf.reshape(x * 2.0, new_shape or (flat_size(shape),)), LINE,
                       (gt.P(*spec),), None if out_spec is None else (gt.P(*out_spec),),
                       args=[tf.TensorSpec(shape)])
    return _found(lowered)


def free_reshape_case(mesh, shape, spec, new_shape, consumer):
    """Collectives of the Reshape to `new_shape` with the result's sharding left to
    propagation, then `consumer`: "sum" (the sum of its squares, output free) or
    "replicated" (the result times 3, output replicated); as xla_planner_quality.py's."""
    def fn(x):
        z = tf.reshape(x * 2.0, new_shape)
        return tf.reduce_sum(z * z) if consumer == "sum" else z * 3.0
    lowered = gt.lower(fn, {"line": LINE, "2x4": MESH}[mesh], (gt.P(*spec),),
                       None if consumer == "sum" else (gt.P(),), args=[tf.TensorSpec(shape)])
    return _found(lowered)


def main(argv):
    del argv
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    for name, case in RESHARDS.items():
        found = reshard_case(*case)
        print(f"{name}: {found}  moved {moved(found)}")
        for axes, groups in device_groups(*case):
            print(f"    {axes}: {groups}")
    for name, case in DOTS.items():
        found = dot_case(*case)
        print(f"{name}: {found}  moved {moved(found)}")
    for name, (shape, spec, out_spec) in RESHAPES.items():
        for label, out in (("", out_spec), (" (result left to propagation)", None)):
            found = reshape_case(shape, spec, out)
            print(f"{name}{label}: {found}  moved {moved(found)}")
    for name, (size, new_shape) in SPLITS.items():
        found = reshape_case((size,), ("x",), ("x",), new_shape)
        print(f"{name}: {found}  moved {moved(found)}")
    for name, case in FREE_RESHAPES.items():
        for consumer in ("sum", "replicated"):
            found = free_reshape_case(*case, consumer)
            print(f"{name} (result free, {consumer} consumer): {found}  moved {moved(found)}")


if __name__ == "__main__":
    app.run(main)
