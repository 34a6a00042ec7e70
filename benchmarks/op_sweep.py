"""The op sweep (gspmd_tf/testing/op_sweep.py): every TF op type with a registered
gradient, partitioned on generated inputs over 2x4 and 4x2 meshes and compared with
single-device TF; writes the coverage table (partitioned / replicated with a reason /
refused / wrong / error / not generated) as markdown.

    .venv/bin/python benchmarks/op_sweep.py --out=op_sweep.md [--ops=Relu,MatMul] [--every=1]
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.DEFINE_string("out", "op_sweep.md", "where to write the markdown table")
OPS = flags.DEFINE_list("ops", [], "op types to sweep (default: every op type with a "
                        "registered gradient)")
EVERY = flags.DEFINE_integer("every", 1, "sweep every n-th op type of the sorted list")
SEED = flags.DEFINE_integer("seed", 0, "seed of the inputs and layouts")


def main(_):
    import gspmd_tf as gt
    gt.configure_cpu_devices(8)
    from gspmd_tf.testing import op_sweep
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)  # the table says it all
    op_types = OPS.value or op_sweep.sweep_op_types()[::EVERY.value]
    outcomes = op_sweep.sweep(op_types, op_sweep.sweep_meshes(), SEED.value,
                              progress=lambda o: print(f"{o.op_type}: {o.kind} {o.reason}",
                                                       flush=True))
    text = op_sweep.table(outcomes)
    with open(FLAGS.value, "w") as out:
        out.write(text + "\n")
    counts = {kind: sum(o.kind == kind for o in outcomes) for kind in op_sweep.OUTCOMES}
    print(", ".join(f"{kind} {n}" for kind, n in counts.items()))


if __name__ == "__main__":
    app.run(main)
