"""Regressions of the fuzzer's run with seed 37 (benchmarks/RESULTS.md §6, "The twelfth
run"), through the fuzzer's own worker.

#9544: a bfloat16 mean near 0 over a split dim, summed in bfloat16 per shard, came out
1.2x TF's; a half mean is now summed, combined and divided in float32.
#3936: a soft-label cross-entropy over a split class dim, 1.7e-5 relative off TF by a
cancellation; the accuracy rule now bounds the terms a cross-entropy cancels.
"""

import numpy as np
import pytest
import tensorflow as tf

from gspmd_tf.testing.generator import generate
from gspmd_tf.testing.workers import run_programs


@pytest.mark.parametrize("index", [9544, 3936])
def test_seed_37_programs_pass(index):
    result = run_programs({index: generate(37, index)}, jobs=1, batch=1, timeout=120,
                          collective_timeout=30)[index]
    assert result["status"] == "pass", result


def test_cross_entropy_magnitude_bounds_the_cancelled_terms():
    """|labels| * (|logsumexp| + max|logits|) per example, for dense and sparse labels;
    a 30x error relative to it is still a mismatch."""
    from gspmd_tf.testing.accuracy import Mismatch, check_values, summed_magnitude

    logits = np.array([[1.0, -2.0, 0.5, 3.0]])
    labels = np.array([[0.5, -1.0, 2.0, 0.25]])

    @tf.function
    def magnitudes(a, b, sparse):
        dense = tf.nn.softmax_cross_entropy_with_logits(labels=b, logits=a)
        one = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=sparse, logits=a)
        return summed_magnitude(tf, dense), summed_magnitude(tf, one), dense
    dense, sparse, loss = magnitudes(tf.constant(logits), tf.constant(labels),
                                     tf.constant([2]))
    bound = abs(np.log(np.exp(logits).sum())) + 3.0
    np.testing.assert_allclose(dense.numpy(), [3.75 * bound])
    np.testing.assert_allclose(sparse.numpy(), [bound])
    exact = loss.numpy()
    check_values(np.float32(exact + 1e-6), np.float32(exact), "ce", "float32", exact=exact,
                 terms=dense.numpy())
    with pytest.raises(Mismatch):
        check_values(np.float32(exact + 30 * 1e-5 * dense.numpy()), np.float32(exact),
                     "ce", "float32", exact=exact, terms=dense.numpy())
