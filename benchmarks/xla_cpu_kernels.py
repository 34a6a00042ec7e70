"""Which of TF's collective ops TF's XLA bridge compiles for XLA_CPU_JIT (this host).

    .venv/bin/python benchmarks/xla_cpu_kernels.py

Each op is put alone in a tf.function(jit_compile=True) on a [8, 4] float32 input, one
group of one device (compile-time constant group assignments, as the XLA ops require),
and asked for its HLO (experimental_get_compiler_ir: nothing runs). Prints a markdown
table: the op, whether the bridge has an XLA_CPU_JIT kernel for it, and the HLO
collective it becomes. docs/DESIGN_LOG.md ("TPU / XLA bridge") records the result.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app  # noqa: E402

HLO_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
                   "reduce-scatter")


def _ops(tf, xla):
    """op name -> function of x building it (group = [[0]])."""
    def groups():
        return tf.constant([[0]])
    keys = dict(group_size=1, group_key=1, instance_key=1, ordering_token=[])
    return {
        "XlaAllReduce": lambda x: xla.xla_all_reduce(
            input=x, group_assignment=groups(), reduce_op="Add", mode="CrossReplica"),
        "XlaReduceScatter": lambda x: xla.xla_reduce_scatter(
            input=x, group_assignment=groups(), scatter_dimension=0, reduce_op="Add"),
        "CrossReplicaSum": lambda x: tf.raw_ops.CrossReplicaSum(
            input=x, group_assignment=groups()),
        "AllToAll": lambda x: tf.raw_ops.AllToAll(
            input=x, group_assignment=groups(), concat_dimension=0, split_dimension=0,
            split_count=1),
        "CollectivePermute": lambda x: tf.raw_ops.CollectivePermute(
            input=x, source_target_pairs=tf.constant([[0, 0]])),
        "CollectiveReduceV2": lambda x: tf.raw_ops.CollectiveReduceV2(
            input=x, merge_op="Add", final_op="Id", **keys),
        "CollectiveGatherV2": lambda x: tf.raw_ops.CollectiveGatherV2(input=x, **keys),
        "CollectiveAllToAllV2": lambda x: tf.raw_ops.CollectiveAllToAllV2(input=x, **keys),
        "CollectiveReduceScatterV2": lambda x: tf.raw_ops.CollectiveReduceScatterV2(
            input=x, merge_op="Add", final_op="Id", **keys),
        "XlaSharding": lambda x: xla.xla_sharding(input=x),
        "XlaSpmdFullToShardShape": lambda x: xla.xla_spmd_full_to_shard_shape(
            input=x, manual_sharding=b"", dim=-1),
    }


def main(argv):
    del argv
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops
    spec = tf.TensorSpec((8, 4))
    print(f"TF {tf.__version__}, XLA_CPU_JIT\n")
    print("| TF op | compiles on XLA_CPU_JIT | HLO |")
    print("|---|---|---|")
    for name, build in _ops(tf, gen_xla_ops).items():
        try:
            hlo = tf.function(build, jit_compile=True).experimental_get_compiler_ir(spec)(
                stage="hlo")
        except Exception as e:  # noqa: BLE001 -- the error is the answer
            reason = "no XLA_CPU_JIT kernel" if "No registered" in str(e) else \
                str(e).splitlines()[0][:80]
            print(f"| {name} | no | {reason} |")
            continue
        found = [c for c in HLO_COLLECTIVES if f" {c}(" in hlo]
        if not found:
            found = ["custom-call " + t for t in dict.fromkeys(
                re.findall(r'custom_call_target="([^"]+)"', hlo))]
        print(f"| {name} | yes | {', '.join(found) or 'none (a group of one)'} |")


if __name__ == "__main__":
    app.run(main)
