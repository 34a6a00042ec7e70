"""Integer means over split dims do not wrap: TF sums an int32 (or narrower) mean without
wrapping, so the partitioned mean sums, combines and divides in int64 (fuzzer seed 35
#9094, benchmarks/RESULTS.md §6, "The tenth run")."""

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


def test_mean_of_empty_segment_max_fill_values_over_a_split_dim():
    """#9094 itself: the mean of UnsortedSegmentMax's fill values (the int32 lowest) over
    a split dim."""
    mesh = gt.Mesh.create((2,), ("x",))
    ids = np.array([3], np.int32)
    data = np.array([[[[2]]]], np.int32)

    def f(ids, data):
        t = tf.math.unsorted_segment_max(data, ids, num_segments=5)
        t = gt.mesh_split(t, mesh, gt.P("x"))
        return tf.reduce_mean(t, axis=0, keepdims=True)
    check_partitioned(f, (ids, data), mesh, (gt.P(None), gt.P()))
