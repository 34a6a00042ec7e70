"""gspmd-tf's collectives for the reshard, dot, pad and slice cases XLA is compared on.

    .venv/bin/python benchmarks/reshard_plans.py [--case=NAME]

The cases are in gspmd_tf/testing/collective_cases.py; XLA's side comes from
benchmarks/xla_collectives.py (run under JAX). Reshards print the planner's steps,
each collective as (kind, operand bytes per device, group size) and the bytes the
planner's cost model says each device moves; dots are lowered by gt.function on an
abstract 2x4 mesh with the result left to propagation, like XLA's; pads and slices
(WINDOWS) with the result sharded like the operand.
"""

import logging
import os
import sys

from absl import app, flags
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gspmd_tf as gt  # noqa: E402
from gspmd_tf.layout import Layout  # noqa: E402
from gspmd_tf.spmd import planner  # noqa: E402

from gspmd_tf.testing.collective_cases import print_cases, window_op  # noqa: E402

CASE = flags.DEFINE_string("case", "all", "case name, or 'all'")

MESH = gt.Mesh.abstract((2, 4), ("data", "model"))
KIND = {planner.AllGather: "all-gather", planner.AllToAll: "all-to-all",
        planner.CollectivePermute: "collective-permute",
        planner.ReduceScatter: "reduce-scatter", planner.AllReduce: "all-reduce",
        planner.Broadcast: "all-reduce"}


def reshard_case(shape, src, dst):
    """(steps, [(kind, operand bytes, group)], moved bytes) of the planner's plan."""
    layouts = [Layout.from_spec(MESH, spec, len(shape)) for spec in (src, dst)]
    steps = planner.plan(*layouts, shape, tf.float32, MESH)
    found = [(KIND[type(s)], s.bytes_in, s.group) for s in steps if type(s) in KIND]
    return steps, found, planner.cost(steps).bytes


def dot_case(equation, shapes, specs):
    """([(kind, operand bytes, group)], result spec) of a lowered einsum."""
    f = gt.function(lambda a, b: tf.einsum(equation, a, b), mesh=MESH,
                    in_shardings=tuple(gt.P(*s) for s in specs))
    low = f.lower(*[tf.TensorSpec(s, tf.float32) for s in shapes])
    found = [(c.kind, c.bytes, 1 if c.kind == "collective-permute" else len(c.groups[0]))
             for c in low.collectives()]
    return found, low.program.output_layouts[0].to_spec()


def window_case(shape, spec, op):
    """[(kind, operand bytes, group)] of a lowered pad or slice, operand and result
    sharded by `spec`."""
    fn = window_op(op, tf.pad, lambda x, index: x[index])
    f = gt.function(fn, mesh=MESH, in_shardings=(gt.P(*spec),), out_shardings=(gt.P(*spec),))
    low = f.lower(tf.TensorSpec(shape, tf.float32))
    return [(c.kind, c.bytes, 1 if c.kind == "collective-permute" else len(c.groups[0]))
            for c in low.collectives()]


def main(argv):
    del argv
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)

    def describe(shape, src, dst):
        steps, found, moved = reshard_case(shape, src, dst)
        return [str([type(s).__name__ for s in steps]),
                f"{found}  moved bytes per device {moved}"]

    print_cases(CASE.value, describe, dot_case, window_case, gt.P)


if __name__ == "__main__":
    app.run(main)
