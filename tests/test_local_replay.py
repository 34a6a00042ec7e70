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
    # no dim of size 1 globally: the squeeze keeps every dim, though shards have size 1
    "squeeze_nothing": (lambda x: tf.squeeze(x) * 2.0, (6, 2, 3)),
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


PADDING_CHECKED = {
    "floordiv": lambda x, y: x // y,
    "floormod": lambda x, y: x % y,
    "truncatediv": lambda x, y: tf.truncatediv(x, y),
    "truncatemod": lambda x, y: tf.truncatemod(x, y),
    "int_pow": lambda x, y: tf.pow(x, y - 1),
    "gather_computed_indices": lambda x, y: tf.gather(tf.range(10) * 3, y - 1),
    "labels_computed": lambda x, y: tf.nn.sparse_softmax_cross_entropy_with_logits(
        (y - 1) // 2, tf.cast(tf.stack([x, x + 1, x * 2], 1), tf.float32)),
    "check_numerics": lambda x, y: tf.debugging.check_numerics(
        tf.math.log(tf.cast(y - 1, tf.float32) + 0.5) / tf.cast(y + 1, tf.float32), "x"),
}


@pytest.mark.parametrize("case", list(PADDING_CHECKED))
def test_padding_never_fails_a_local_op(case):
    """The padding of a dim split unevenly (6 over 8) holds values the op would reject
    (y == 0 and y - 1 == -1 there): it is set to a harmless value first."""
    mesh = gt.Mesh.create((8,), ("x",))
    x = np.array([7, -8, 9, 10, 11, 12], np.int32)
    y = np.array([1, 2, 3, 4, 5, 6], np.int32)
    check_partitioned(PADDING_CHECKED[case], (x, y), mesh, (P("x"), P("x")))
