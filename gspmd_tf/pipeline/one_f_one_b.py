"""The 1F1B schedule as one SPMD program: forwards and backwards interleaved in one loop.

Every step, every stage (vectorised on the stage dim, as in forward.py) runs

  forward:  its input (microbatch step - s: stage 0 takes it from the feed, the others
            from the previous stage's output, shifted by one roll of the stage dim) through
            stage_fn, stashing the input in a circular buffer of schedule.stash_slots(S)
            slots per stage;
  loss:     on the last stage, loss_fn of the output that just left it and the gradient
            of the loss (divided by M: the mean over microbatches);
  backward: the vector-Jacobian product of stage_fn at the stashed input of microbatch
            step - 2 (S - 1) + s (the forward is recomputed from the stash: only stage
            inputs are kept, never a stage's intermediates), with the cotangent the next
            stage sent (one roll the other way) or, on the last stage, the loss gradient;
            the parameter gradients add up in accumulators shaped like the params.

So a device keeps 2 S - 1 stage inputs per stage it holds, whatever M is, where TF's
gradient of the GPipe loop keeps every intermediate of all M + S - 1 steps. The price:
M + 2 S - 2 steps of one forward, one recomputed forward and one backward each.
Cotangents of idle slots are zero, so they add nothing; the losses of the last stage
are reduced out of the stage dim once, after the loop.
"""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf.annotations import mesh_split
from gspmd_tf.mesh import P
from gspmd_tf.pipeline import schedule as timing


def one_f_one_b(run_stages, run_losses, params, microbatches, targets, annotate, *,
                mesh, stash_spec):
    """(mean loss, gradients of `params`) by the 1F1B loop (module docstring).

    run_stages(params, x [S, b, ...]) -> [S, b, ...] runs every stage on its input;
    run_losses(y [S, b, ...], targets [S, ...]) -> [S] the loss of each stage's output;
    annotate(x) annotates a stage buffer; stash_spec the PartitionSpec of the stash
    [S, slots, b, ...] (None without a mesh).
    """
    stages = tf.nest.flatten(params)[0].shape[0]
    count = microbatches.shape[0]
    steps = timing.one_f_one_b_steps(stages, count)
    slots = timing.stash_slots(stages)
    stage = tf.range(stages)
    buffer_shape = [stages] + microbatches.shape[1:].as_list()
    def along_stages(mask, rank):
        return tf.reshape(mask, [stages] + [1] * (rank - 1))

    def stash_annotate(stash):
        return stash if mesh is None else mesh_split(stash, mesh, stash_spec)

    def body(step, sent_forward, sent_backward, stash, losses, grads):
        (forward, _), (backward, backward_busy) = timing.one_f_one_b_work(
            step, stage, stages, count)
        first = along_stages(stage == 0, len(buffer_shape))
        # past the last microbatch stage 0's input is idle work: any row will do
        feed = tf.gather(microbatches, tf.minimum(step, count - 1))
        inputs = annotate(tf.where(first, feed[tf.newaxis],
                                   tf.roll(sent_forward, 1, axis=0)))
        outputs = annotate(run_stages(params, inputs))
        written = _slot_mask(forward % slots, slots, stash.shape.rank, inputs.dtype)
        stash = stash_annotate(stash * (1 - written) + inputs[:, tf.newaxis] * written)

        last = stage == stages - 1
        leaving = last & (step - (stages - 1) >= 0) & (step - (stages - 1) < count)
        target = tf.gather(targets, tf.clip_by_value(step - (stages - 1), 0, count - 1))
        stage_targets = tf.broadcast_to(target[tf.newaxis],
                                        [stages] + targets.shape[1:].as_list())
        with tf.GradientTape() as tape:
            tape.watch(outputs)
            stage_losses = run_losses(outputs, stage_targets)
        loss_gradient = tape.gradient(stage_losses, outputs) / count
        counted = tf.cast(leaving, outputs.dtype)
        losses += stage_losses * counted
        cotangent = tf.where(along_stages(last, len(buffer_shape)),
                             loss_gradient * along_stages(counted, len(buffer_shape)),
                             tf.roll(sent_backward, -1, axis=0))
        cotangent = annotate(cotangent * along_stages(
            tf.cast(backward_busy, outputs.dtype), len(buffer_shape)))

        read = _slot_mask(backward % slots, slots, stash.shape.rank, inputs.dtype)
        stashed = annotate(tf.reduce_sum(stash * read, axis=1))
        # the params read inside the body (the tape sees this graph's ops only)
        local = tf.nest.map_structure(tf.identity, params)
        with tf.GradientTape() as tape:
            tape.watch([stashed] + tf.nest.flatten(local))
            recomputed = run_stages(local, stashed)
        input_gradient, param_gradients = tape.gradient(
            recomputed, (stashed, local), output_gradients=cotangent)
        grads = tf.nest.map_structure(tf.add, grads, param_gradients)
        return step + 1, outputs, annotate(input_gradient), stash, losses, grads

    zeros = annotate(tf.zeros(buffer_shape, microbatches.dtype))
    initial = (tf.constant(0), zeros, zeros,
               stash_annotate(tf.zeros([stages, slots] + buffer_shape[1:],
                                       microbatches.dtype)),
               tf.zeros([stages], microbatches.dtype),
               tf.nest.map_structure(tf.zeros_like, params))
    *_, losses, grads = tf.while_loop(lambda step, *_: step < steps, body, initial,
                                      maximum_iterations=steps)
    return tf.reduce_sum(losses) / count, grads


def _slot_mask(slot, slots, rank, dtype):
    """[S, slots, 1, ...]: one-hot of each stage's stash slot."""
    return tf.reshape(tf.one_hot(slot, slots, dtype=dtype),
                      [-1, slots] + [1] * (rank - 2))


def stash_spec(stage_axis, microbatch_spec):
    """The stash's PartitionSpec: split like the stage buffer, its slot dim whole."""
    return P(stage_axis, None, *(microbatch_spec or ()))
