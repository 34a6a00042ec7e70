"""Ops re-created on local shards whose attrs or constant inputs depend on the global
shape: a dim that is size 1 only in a shard (6 split over 8), global shape attrs, type
widths, integer division of a split mean, negative indices on split dims."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned

P = gt.P

CASES = {
    "squeeze_all": (lambda x: tf.squeeze(x) * 2.0, (6, 1, 3)),
    "squeeze_negative_axis": (lambda x: tf.squeeze(x, -2) * 2.0, (6, 1, 3)),
    "expand_dims": (lambda x: tf.expand_dims(x, -1) * 2.0, (6, 1, 3)),
    "ensure_shape": (lambda x: tf.ensure_shape(x, [6, 1, 3]) * 2.0, (6, 1, 3)),
    "bitcast_to_bytes": (lambda x: tf.bitcast(x, tf.uint8), (6, 1, 3)),
    "bitcast_round_trip": (lambda x: tf.bitcast(tf.bitcast(x, tf.uint16) + 0, tf.float32),
                           (6, 1, 3)),
    "negative_slice_bounds": (lambda x: x[-6:, :, -3:] * 2.0, (6, 1, 3)),
    "tile_from_one": (lambda x: tf.tile(x, [1, 6, 1]), (6, 1, 3)),
    "broadcast_to": (lambda x: tf.broadcast_to(x, [6, 5, 3]), (6, 1, 3)),
    "int_mean": (lambda x: tf.reduce_mean(tf.cast(x * 10.0, tf.int32), 0), (6, 1, 3)),
}


@pytest.mark.parametrize("spec", [P("x"), P(None, None, "x")])
@pytest.mark.parametrize("case", list(CASES))
def test_replay_on_local_shapes(case, spec):
    mesh = gt.Mesh.create((8,), ("x",))
    fn, shape = CASES[case]
    x = (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - 7) / 3
    check_partitioned(fn, (x,), mesh, (spec,))


@pytest.mark.parametrize("spec", [P("b"), P(("a", "b"))])
def test_int_mean_truncates_after_summing(spec):
    """Integer Mean over a split dim divides the whole sum (not each device's part)."""
    mesh = gt.Mesh.create((2, 4), ("a", "b"))
    x = np.array([3, -7, 5, 2, 9, -1, 4, 6], np.int32)
    check_partitioned(lambda t: tf.reduce_mean(t), (x,), mesh, (spec,))
