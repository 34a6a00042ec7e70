"""Context parallelism: per-device memory and collective bytes against sequence length.

    .venv/bin/python benchmarks/ring_attention.py --devices=4 --seq=1024,2048,4096,8192 \
        --batch=1 --heads=8 --head_dim=64 [--causal] [--gradients]

For each sequence length the script lowers, on an abstract mesh of --devices devices
along a "seq" axis (nothing runs), attention over q, k, v [batch, seq, heads, head_dim]
split on seq four ways, and prints per way the per-device peak (Lowered.memory()), the
multiply-adds of one iteration of its loops, and the collectives' bytes per device by
kind:
  ring     gt.ring_attention: K/V blocks round the ring by collective-permutes; a device
           holds seq/n of everything plus one [seq/n, seq/n] block of logits per head
  zigzag   the same, layout="zigzag" (with --causal): two [seq/2n, seq/2n] pairs a step,
           no masked block computed after the first step
  ulysses  gt.ulysses_attention: all-to-alls seq <-> heads, full-sequence attention of
           heads/n heads per device ([seq, seq] logits for each)
  plain    single-device attention with only its inputs and output annotated: what the
           partitioner makes of it unaided
Expected shape: ring's memory grows as seq^2/n^2 per block and its bytes as n K/V
blocks of seq/n (linear in seq); ulysses' bytes are linear in seq too, its memory
seq^2/n. With --gradients the programs include the backward (TF's gradient of each).
A loop body's collectives are counted once (Lowered.collectives() lists them once): the
ring's bytes per call are its body's times n.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

DEVICES = flags.DEFINE_integer("devices", 4, "devices on the seq axis")
SEQ = flags.DEFINE_list("seq", ["1024", "2048", "4096"], "sequence lengths")
BATCH = flags.DEFINE_integer("batch", 1, "batch size")
HEADS = flags.DEFINE_integer("heads", 8, "attention heads (a multiple of --devices)")
HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "head width")
CAUSAL = flags.DEFINE_bool("causal", True, "causal attention")
GRADIENTS = flags.DEFINE_bool("gradients", False, "include the gradients of q, k, v")


def lowered(gt, tf, way, seq):
    """The Lowered of one way of attention at one sequence length."""
    from gspmd_tf.attention import dot_product_attention
    mesh = gt.Mesh.abstract((DEVICES.value,), ("seq",))
    causal = CAUSAL.value
    attend = {
        "ring": lambda q, k, v: gt.ring_attention(q, k, v, mesh=mesh, axis="seq",
                                                  causal=causal),
        "zigzag": lambda q, k, v: gt.ring_attention(q, k, v, mesh=mesh, axis="seq",
                                                    causal=causal, layout="zigzag"),
        "ulysses": lambda q, k, v: gt.ulysses_attention(q, k, v, mesh=mesh, axis="seq",
                                                        causal=causal),
        "plain": lambda q, k, v: dot_product_attention(q, k, v, causal),
    }[way]

    def f(q, k, v):
        if not GRADIENTS.value:
            return attend(q, k, v)
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attend(q, k, v)
            loss = tf.reduce_sum(out * out)
        return [out] + tape.gradient(loss, [q, k, v])
    spec = tf.TensorSpec([BATCH.value, seq, HEADS.value, HEAD_DIM.value])
    split = gt.P(None, "seq")
    return gt.lower(f, mesh, (split,) * 3, out_shardings=None, args=[spec] * 3)


def loop_multiply_adds(low):
    """Multiply-adds of the program's loop bodies (one iteration each)."""
    from gspmd_tf.backends.base import node_multiply_adds, nodes_with_graphs
    return sum(node_multiply_adds(g, n) for loop in low.program.graph.nodes
               for region in loop.regions for g, n in nodes_with_graphs(region))


def main(argv):
    del argv
    import gspmd_tf as gt
    import tensorflow as tf
    logging.getLogger("gspmd_tf").setLevel(logging.ERROR)
    print(f"{'way':8s} {'seq':>7s} {'peak bytes/device':>18s} {'loop multiply-adds':>19s}"
          "  collective bytes/device")
    for seq in map(int, SEQ.value):
        for way in ("ring", "zigzag", "ulysses", "plain"):
            low = lowered(gt, tf, way, seq)
            moved = Counter()
            for c in low.collectives():
                moved[c.kind] += c.bytes
            kinds = ", ".join(f"{kind} {moved[kind]}" for kind in sorted(moved)) or "none"
            print(f"{way:8s} {seq:7d} {low.memory().peak:18d} {loop_multiply_adds(low):19d}"
                  f"  {kinds}")


if __name__ == "__main__":
    app.run(main)
