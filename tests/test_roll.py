"""Roll of a split dim moves whole blocks by collective-permute (handlers/roll.py):
one permute when the shift is a multiple of the block or less than one block, two
otherwise; never an all-gather of an even split. Values against single-device TF."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned, randn

P = gt.P
_STAGES = gt.Mesh.create((4,), ("stage",))
_GRID = gt.Mesh.create((2, 4), ("a", "b"))

# (mesh, spec, rows, roll, permutes)
CASES = {
    "one_row_per_device": (_STAGES, P("stage"), 4, lambda x: tf.roll(x, 1, 0), 1),
    "halo_of_one_row": (_STAGES, P("stage"), 8, lambda x: tf.roll(x, 1, 0), 1),
    "whole_blocks": (_STAGES, P("stage"), 8, lambda x: tf.roll(x, 6, 0), 1),
    "block_and_part": (_STAGES, P("stage"), 8, lambda x: tf.roll(x, 3, 0), 2),
    "negative": (_STAGES, P("stage"), 8, lambda x: tf.roll(x, -5, 0), 2),
    "full_cycle": (_STAGES, P("stage"), 8, lambda x: tf.roll(x, 16, 0), 0),
    "two_axes_one_dim": (_GRID, P(("a", "b")), 8, lambda x: tf.roll(x, 9, 0), 1),
    "several_dims": (_GRID, P("a", "b"), 8, lambda x: tf.roll(x, [1, 2, -1, 1], [0, 1, 0, 2]), 1),
    "unsplit_dim": (_STAGES, P(None, "stage"), 8, lambda x: tf.roll(x, 3, 0), 0),
}


def _kinds(low):
    return [c.kind for c in low.collectives()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_and_permutes(name):
    mesh, spec, rows, fn, permutes = CASES[name]
    x = randn(np.random.default_rng(0), rows, 8, 3)
    low = check_partitioned(fn, (x,), mesh, (spec,), (spec,))
    assert _kinds(low) == ["collective-permute"] * permutes, low.report()
    assert not low.program.replicated_ops


@pytest.mark.parametrize("name", ["one_row_per_device", "block_and_part", "several_dims"])
def test_gradient_is_the_reverse_roll(name):
    mesh, spec, rows, fn, permutes = CASES[name]
    x = randn(np.random.default_rng(1), rows, 8, 3)
    weights = tf.constant(randn(np.random.default_rng(2), rows, 8, 3))

    def grad(x):
        return tf.gradients(tf.reduce_sum(fn(x) * weights), x)[0]
    low = check_partitioned(grad, (x,), mesh, (spec,), (spec,))
    assert _kinds(low) == ["collective-permute"] * permutes, low.report()


def test_uneven_split_is_gathered_rolled_and_sliced():
    # 6 rows over 4 devices: padding would sit inside the cycle
    x = randn(np.random.default_rng(3), 6, 5)
    low = check_partitioned(lambda x: tf.roll(x, 1, 0), (x,), _STAGES, (P("stage"),),
                            (P("stage"),))
    assert _kinds(low) == ["all-gather"], low.report()


def test_shift_from_a_tensor_keeps_the_rolled_dim_whole():
    x = randn(np.random.default_rng(4), 8, 4)
    shift = tf.constant(3)

    def fn(x):
        return tf.roll(x, shift + tf.cast(tf.reduce_sum(x) * 0, tf.int32), 0)
    low = check_partitioned(fn, (x,), _STAGES, (P("stage", None),), (P("stage"),))
    assert "all-gather" in _kinds(low), low.report()


# rotations written as slices and a concat (graph/rotate.py makes them Roll), and
# concats that are not rotations (left as written)
ROTATIONS = {
    "last_to_front": lambda x: tf.concat([x[-1:], x[:-1]], axis=0),
    "tf_slice": lambda x: tf.concat([tf.slice(x, [7, 0, 0], [1, -1, -1]),
                                     tf.slice(x, [0, 0, 0], [7, -1, -1])], axis=0),
    "two_rows": lambda x: tf.concat([x[2:], x[:2]], axis=0),
    "three_pieces": lambda x: tf.concat([x[6:], x[:2], x[2:6]], axis=0),
    "read_twice": lambda x: tf.concat([x[-1:], x[:-1]], axis=0) + 2.0 * x,
}
NOT_ROTATIONS = {
    "repeats_a_row": lambda x: tf.concat([x[1:], x[1:2]], axis=0),
    "two_tensors": lambda x: tf.concat([x[-1:], tf.reverse(x, [0])[1:]], axis=0),
}


@pytest.mark.parametrize("name", sorted(ROTATIONS))
def test_slice_and_concat_rotation_is_one_permute_both_ways(name):
    fn = ROTATIONS[name]
    x = randn(np.random.default_rng(5), 8, 3, 2)
    weights = tf.constant(randn(np.random.default_rng(6), 8, 3, 2))

    def grad(x, w):
        return tf.gradients(tf.reduce_sum(fn(x) * w), x)[0]
    spec = P("stage")
    low = check_partitioned(fn, (x,), _STAGES, (spec,), (spec,))
    assert _kinds(low) == ["collective-permute"], low.report()
    assert [n.op for n in low.graph.nodes if n.op == "ConcatV2"] == []
    low = check_partitioned(grad, (x, weights), _STAGES, (spec, spec), (spec,))
    assert _kinds(low) == ["collective-permute"], low.report()


@pytest.mark.parametrize("name", sorted(NOT_ROTATIONS))
def test_other_concats_of_slices_are_left_as_written(name):
    fn = NOT_ROTATIONS[name]
    x = randn(np.random.default_rng(7), 8, 3)
    low = check_partitioned(fn, (x,), _STAGES, (P("stage"),), (P("stage"),))
    assert [n.op for n in low.graph.nodes if n.op in ("Roll", "ConcatV2")] == ["ConcatV2"]
