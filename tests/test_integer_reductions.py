"""Regressions of the fuzzer's run with seed 35 (benchmarks/RESULTS.md §6, "The tenth run").

#9094: an integer mean over a split dim; TF sums an int32 (or narrower) mean without
wrapping, so the partitioned mean sums, combines and divides in int64.
#7919: a float64 matmul whose terms' magnitudes overflow: the kind of its non-finite
result is an accident of summation order, which the fuzzer's rule now accepts.
"""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32,
                                   np.uint32, np.int64])
@pytest.mark.parametrize("mesh_shape, spec", [((2,), gt.P("x")), ((8,), gt.P("x")),
                                              ((2, 4), gt.P(("x", "y")))])
def test_integer_mean_over_a_split_dim_does_not_wrap(dtype, mesh_shape, spec):
    axes = ("x", "y")[:len(mesh_shape)]
    mesh = gt.Mesh.create(mesh_shape, axes)
    info = np.iinfo(dtype)
    rng = np.random.default_rng(35)
    # extremes whose sum overflows the type: TF's mean does not wrap (int64 does)
    x = rng.choice([info.min, info.max, info.min + 1, 7], size=(5, 3)).astype(dtype)
    x[:, 0] = info.min
    x[:, 1] = info.max
    check_partitioned(lambda t: tf.reduce_mean(t, axis=0, keepdims=True), (x,), mesh,
                      (spec,))
    check_partitioned(lambda t: tf.reduce_mean(t), (x,), mesh, (spec,))


def test_seed_35_9094_segment_max_fill_values_mean():
    mesh = gt.Mesh.create((2,), ("x",))
    ids = np.array([3], np.int32)
    data = np.array([[[[2]]]], np.int32)

    def f(ids, data):
        t = tf.math.unsorted_segment_max(data, ids, num_segments=5)
        t = gt.mesh_split(t, mesh, gt.P("x"))
        return tf.reduce_mean(t, axis=0, keepdims=True)
    check_partitioned(f, (ids, data), mesh, (gt.P(None), gt.P()))


def test_overflowing_terms_leave_the_kind_to_summation_order():
    """Where the float64 magnitudes of the terms overflow and TF's value is non-finite,
    ours may be any non-finite value; elsewhere the kinds must match."""
    from gspmd_tf.testing.accuracy import Mismatch, check_values

    inf, nan = np.inf, np.nan
    tf_value, exact = np.float64([inf, 1.0]), np.float64([inf, 1.0])
    check_values(np.float64([nan, 1.0]), tf_value, "t3", "float64", exact=exact,
                 terms=np.float64([inf, 2.0]))
    for ours, terms in (([nan, 1.0], [1e308, 2.0]),   # the terms do not overflow
                        ([2.0, 1.0], [inf, 2.0]),     # finite where TF overflowed
                        ([nan, nan], [inf, 2.0])):    # TF finite there
        with pytest.raises(Mismatch):
            check_values(np.float64(ours), tf_value, "t3", "float64", exact=exact,
                         terms=np.float64(terms))
