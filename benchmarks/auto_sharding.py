"""Auto-sharding (gt.AUTO, memory_limit): search seconds and plan quality on an L-layer
Transformer training step with Adam, against the hand Megatron plan and data parallel.

    .venv/bin/python benchmarks/auto_sharding.py --layers=4,8,16,24
    .venv/bin/python benchmarks/auto_sharding.py --layers=2 --d_model=64 --d_ff=256  # tiny

The step is gspmd_tf/testing/transformer_step.py's (weights, Adam's m and v are arguments
and results; nothing runs: the mesh is abstract).

Plans, on a data x model mesh, the activations' batch split over "data":
  data parallel  every weight and its Adam state replicated
  Megatron       Q, K, V and the first FFN weight split over "model" on their output dims
                 (heads, d_ff), O and the second FFN weight on their input dims; layer
                 norm scales replicated; Adam state as its weight
  auto           every weight, m and v gt.AUTO, under memory_limit set --limit_between of
                 the way from the Megatron plan's peak to data parallel's (so data
                 parallelism does not fit and Megatron does)

Reported per layer count: the ops of the step, the search's classes and variables, its
seconds (all of it, and the HiGHS solver's share), then per plan the per-device peak
(lowered.memory().peak) and the bytes of all collective operands per step
(lowered.collectives(), one device's operand each), and auto's bytes over Megatron's.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("layers", ["4", "8", "16", "24"], "layer counts to search")
flags.DEFINE_integer("d_model", 512, "model dim M")
flags.DEFINE_integer("heads", 8, "attention heads N")
flags.DEFINE_integer("d_ff", 2048, "feed-forward dim H")
flags.DEFINE_integer("seq", 128, "sequence length S")
flags.DEFINE_integer("batch", 16, "global batch B")
flags.DEFINE_string("mesh", "2x4", "mesh shape: data x model, or data x replica x model "
                    "(the hand plans leave \"replica\" unused)")
flags.DEFINE_float("limit_between", 0.5, "memory_limit: this far from Megatron's peak "
                   "(0) to data parallel's (1)")

def lower(gt, mesh, config, plan, memory_limit=None):
    """The Lowered of `config`'s step with `plan` ("data", "megatron" or "auto")."""
    from gspmd_tf.testing.transformer_step import make_step
    return gt.lower(make_step(config), mesh, config.in_shardings(plan, gt.AUTO),
                    args=config.specs(), memory_limit=memory_limit)


def collective_bytes(lowered):
    return sum(c.bytes for c in lowered.collectives())


def main(argv):
    del argv
    import logging

    import gspmd_tf as gt
    from gspmd_tf.testing.transformer_step import Config
    logging.getLogger("gspmd_tf").setLevel(logging.WARNING)
    shape = tuple(int(s) for s in FLAGS.mesh.split("x"))
    names = {2: ("data", "model"), 3: ("data", "replica", "model")}[len(shape)]
    mesh = gt.Mesh.abstract(shape, names)
    print(f"Transformer train step (Adam), M={FLAGS.d_model} N={FLAGS.heads} "
          f"H={FLAGS.d_ff} S={FLAGS.seq} B={FLAGS.batch}, mesh {FLAGS.mesh}")
    print(f"{'layers':>6s} {'ops':>6s} {'classes':>7s} {'vars':>6s} {'search s':>9s} "
          f"{'solver s':>9s} | {'peak MiB':>24s} | {'collective MiB':>24s} | auto/megatron")
    print(f"{'':45s} | {'data':>7s} {'megatron':>8s} {'auto':>7s} | {'data':>7s} "
          f"{'megatron':>8s} {'auto':>7s} |")
    for layers in (int(l) for l in FLAGS.layers):
        config = Config(layers, FLAGS.d_model, FLAGS.heads, FLAGS.d_ff, FLAGS.seq,
                        FLAGS.batch)
        data_plan = lower(gt, mesh, config, "data")
        megatron = lower(gt, mesh, config, "megatron")
        low, high = megatron.memory().peak, data_plan.memory().peak
        limit = int(low + FLAGS.limit_between * (high - low))
        auto = lower(gt, mesh, config, "auto", memory_limit=limit)
        plan = auto.auto_plan
        peaks = [p.memory().peak / 2 ** 20 for p in (data_plan, megatron, auto)]
        sent = [collective_bytes(p) / 2 ** 20 for p in (data_plan, megatron, auto)]
        ratio = sent[2] / sent[1] if sent[1] else float("nan")
        print(f"{layers:6d} {plan.num_nodes:6d} {plan.num_classes:7d} "
              f"{plan.num_variables:6d} {plan.search_seconds:9.2f} "
              f"{plan.solve_seconds:9.2f} | {peaks[0]:7.1f} {peaks[1]:8.1f} {peaks[2]:7.1f} "
              f"| {sent[0]:7.1f} {sent[1]:8.1f} {sent[2]:7.1f} | {ratio:.3f}"
              f"{'' if peaks[2] * 2 ** 20 <= limit else '  (over the limit)'}")


if __name__ == "__main__":
    app.run(main)
