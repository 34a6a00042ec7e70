"""The global values the multi-worker checkpoint tests save and restore (shared by the
worker probe and the test process)."""

import numpy as np


def checkpoint_values():
    """{name: global value} of the saved variables."""
    values = np.random.default_rng(1)
    return {"split": values.standard_normal((8, 12)).astype(np.float32),
            "rows": values.standard_normal((10, 3)).astype(np.float32),
            "replicated": values.standard_normal((5,)).astype(np.float32)}


def check_plain_restore(prefix):
    """The checkpoint at `prefix` restores into plain tf.Variables on one device: step 7
    and checkpoint_values()."""
    import tensorflow as tf
    want = checkpoint_values()
    with tf.device("/device:CPU:0"):
        variables = {name: tf.Variable(np.zeros_like(value)) for name, value in want.items()}
        step = tf.Variable(0, dtype=tf.int64)
    tf.train.Checkpoint(step=step, **variables).read(prefix).assert_consumed()
    assert step.numpy() == 7
    for name, value in want.items():
        np.testing.assert_array_equal(variables[name].numpy(), value)
