"""Regressions of the fuzzer's runs with seeds 36 and 38 (benchmarks/RESULTS.md §6),
through the fuzzer's own worker.

seed 38 #9023: the gradient of a gather through a concat along dim 0 raised a
ShardingError on TF's data-dependent tf.where, for a concat input no one differentiates
(now dropped with what is computed from it: graph/sparse_rows.py,
tests/test_gradients.py::test_gather_of_concat_with_an_input_not_differentiated).
seed 36 #4500: float32 rounding of a cross-entropy passed through a while loop, a slice
and a roll, which the accuracy rule's term magnitudes did not follow: they now follow
moves and constant scalings, and the fuzzer's loops run unrolled while they are taken.
"""

import numpy as np
import pytest
import tensorflow as tf

from gspmd_tf.testing.accuracy import (Mismatch, check_values, cross_entropy_magnitude,
                                       summed_magnitude, unrolling_while_loops)
from gspmd_tf.testing.generator import generate
from gspmd_tf.testing.workers import run_programs


@pytest.mark.parametrize("seed,index", [(38, 9023), (36, 4500)])
def test_programs_pass(seed, index):
    result = run_programs({index: generate(seed, index)}, jobs=1, batch=1, timeout=120,
                          collective_timeout=30)[index]
    assert result["status"] == "pass", result


def loss_through_a_loop(module):
    """#4500's shape: a cross-entropy halved in a one-trip loop, sliced and rolled; the
    loss, its term magnitude and the cross-entropy's own bound."""
    def f(logits, labels):
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        halved = module.while_loop(lambda i_, c_: i_ < 1, lambda i_, c_: (i_ + 1, c_ * 0.5),
                                   (tf.constant(0), loss))[1]
        out = tf.roll(tf.slice(halved, [1], [2]), 1, axis=0)
        return out, summed_magnitude(tf, out), cross_entropy_magnitude(tf, loss.op)
    logits = tf.constant(np.random.default_rng(0).standard_normal((4, 7)))
    return tf.function(f)(logits, tf.constant([1, 0, 6, 3]))


def test_magnitude_follows_slices_scalings_and_unrolled_loops():
    out, terms, bound = [t.numpy() for t in loss_through_a_loop(unrolling_while_loops(tf))]
    np.testing.assert_allclose(terms, 0.5 * np.roll(bound[1:3], 1))
    assert np.all(terms >= np.abs(out))
    # a real error is still a mismatch: 30x the tolerance relative to those terms
    with pytest.raises(Mismatch):
        check_values(np.float32(out + 30 * 1e-5 * terms), np.float32(out), "loss",
                     "float32", exact=out, terms=terms)


def test_a_kept_loop_gives_its_own_magnitude():
    """A tf.while_loop left as it is (no unrolling) has no summing op to look into."""
    out, terms, _ = [t.numpy() for t in loss_through_a_loop(tf)]
    np.testing.assert_array_equal(terms, np.abs(out))


def test_loops_with_a_data_dependent_condition_stay_loops():
    module = unrolling_while_loops(tf)

    @tf.function
    def f(limit):
        return module.while_loop(lambda i_, c_: i_ < limit, lambda i_, c_: (i_ + 1, c_ * 2.0),
                                 (tf.constant(0), tf.constant(1.0)))[1]
    types = {op.type for op in f.get_concrete_function(
        tf.TensorSpec([], tf.int32)).graph.get_operations()}
    assert types & {"While", "StatelessWhile"}, types
    assert f(tf.constant(3)).numpy() == 8.0
