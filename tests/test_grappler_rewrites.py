"""The SPMD program runs without the grappler rewrites that break on local shapes (fuzzer
seed 36, benchmarks/RESULTS.md §6, "The eleventh run").

#2904: grappler's remapper fused an Add of a (1, 1, 1) tensor into the MatMul of a
(1, 1) shard as its bias, which TF's fused kernel refuses ("bias must be
1-dimensional"); on one device the (1, 3) product is not fused. The SPMD program runs
without the remapper.
"""

import numpy as np
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import tf_kernels
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context
from util import check_partitioned


def test_add_after_a_matmul_of_one_element_shards_is_not_fused_as_its_bias():
    mesh = gt.Mesh.create((4,), ("data",))
    rng = np.random.default_rng(2904)
    x0, x1 = rng.standard_normal((5, 1)), rng.standard_normal((5, 3))
    x2 = rng.standard_normal((1, 1, 1))

    def f(a, b, c):
        return tf.add(tf.linalg.matmul(a, b, transpose_a=True), c)
    check_partitioned(f, tuple(np.float32(v) for v in (x0, x1, x2)), mesh,
                      (gt.P(None, None), gt.P(None, "data"), gt.P(None, None)))


def test_the_spmd_program_runs_without_remapper_and_arithmetic_optimizer():
    for cpu_only in (True, False):
        attrs = dict(zip(*[iter(tf_kernels.call_attrs(
            context.context().function_call_options, cpu_only))] * 2))
        rewrites = config_pb2.ConfigProto.FromString(attrs["config_proto"]) \
            .graph_options.rewrite_options
        assert rewrites.remapping == rewriter_config_pb2.RewriterConfig.OFF
        assert rewrites.arithmetic_optimization == rewriter_config_pb2.RewriterConfig.OFF
