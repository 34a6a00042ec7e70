"""tf.recompute_grad (activation checkpointing) inside a partitioned train step: the loss
and gradients equal single-device TF's (relative 1e-5), and the per-device peak is below
the same step's without it (each block's activations recomputed in the backward, not
kept from the forward)."""

import numpy as np
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned

P = gt.P
LAYERS, BATCH, D, F = 4, 16, 64, 256


def _block(x, w_in, w_out):
    return x + tf.nn.relu(x @ w_in) @ w_out


def _train_step(checkpointed):
    block = tf.recompute_grad(_block) if checkpointed else _block

    def step(x, w_in, w_out):
        with tf.GradientTape() as tape:
            tape.watch([w_in, w_out])
            y = x
            for layer in range(LAYERS):
                y = block(y, w_in[layer], w_out[layer])
            loss = tf.reduce_mean(tf.square(y))
        return (loss,) + tuple(tape.gradient(loss, [w_in, w_out]))
    return step


def test_recompute_grad_blocks_give_single_device_gradients_with_a_lower_peak(mesh):
    rng = np.random.default_rng(0)
    args = (rng.standard_normal((BATCH, D)).astype(np.float32),
            (rng.standard_normal((LAYERS, D, F)) * 0.1).astype(np.float32),
            (rng.standard_normal((LAYERS, F, D)) * 0.1).astype(np.float32))
    megatron = (P("data"), P(None, None, "model"), P(None, "model"))
    checkpointed = check_partitioned(_train_step(True), args, mesh, megatron)
    plain = gt.lower(_train_step(False), mesh, megatron, args=args)
    assert not checkpointed.program.replicated_ops
    assert checkpointed.memory().peak < plain.memory().peak, (
        checkpointed.memory(), plain.memory())
