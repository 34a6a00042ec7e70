"""The 1F1B schedule as one SPMD program: forwards and backwards interleaved in one loop.

One loop over the ticks of schedule.py's 1F1B table. Every tick, every stage (vectorised
on the stage dim, as in forward.py) runs stage_fn once under a tape, at

  forward ticks:  its input (microbatch m: stage 0 takes it from the feed, the others
                  from the previous stage's output of the tick before, shifted by one
                  roll of the stage dim), which it stashes in slot m % S of a ring of S
                  slots per stage;
  backward ticks: the stashed input of microbatch m (the forward recomputed from the
                  stash: only stage inputs are kept, never a stage's intermediates);

then the vector-Jacobian product of one objective: on backward ticks the output times
the cotangent the next stage sent (one roll the other way) and, on the last stage, the
loss of that output divided by M (the mean over microbatches); zero on forward ticks.
Its input gradient goes to the previous stage, the parameter gradients add up in
accumulators shaped like the params.

So a device keeps S stage inputs per stage it holds (stage s needs S - s), whatever M is,
where TF's gradient of the GPipe loop keeps every intermediate of all M + S - 1 steps.
The price: 2 M + 2 S - 2 ticks of one forward and one backward each, the backward run
(with a zero cotangent) on forward ticks too, as every stage runs the same program; the
bubble in forward-or-backward slots is the classic (S - 1) / (M + S - 1). The stash is
read and written with one-hot masks over its slot dim (each stage its own slot), so a
tick makes no stash-sized temporary but the new stash. The losses of the last stage are
reduced out of the stage dim once, after the loop.
"""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf.annotations import mesh_split
from gspmd_tf.mesh import P
from gspmd_tf.pipeline import schedule as timing
from gspmd_tf.pipeline.forward import idle_input, pick_along_stages


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
    ticks = timing.one_f_one_b_ticks(stages, count)
    slots = timing.stash_slots(stages)
    stage = tf.range(stages)
    buffer_shape = [stages] + microbatches.shape[1:].as_list()
    rank = len(buffer_shape)
    last = stage == stages - 1

    def along_stages(mask):
        """mask [S] (or [S, slots]) broadcastable against a stage buffer (the stash)."""
        return tf.reshape(mask, mask.shape.as_list() + [1] * (rank - 1))

    def stash_annotate(stash):
        return stash if mesh is None else mesh_split(stash, mesh, stash_spec)

    def body(tick, sent_forward, sent_backward, stash, losses, grads):
        microbatch, forward, busy = timing.one_f_one_b_work(tick, stage, stages, count)
        slot = tf.one_hot(microbatch % slots, slots, dtype=microbatches.dtype)  # [S, slots]
        # stage 0 forwards microbatch tick // 2 (past the last, idle work: any row will do)
        feed = tf.gather(microbatches, tf.minimum(tick // 2, count - 1))
        incoming = tf.where(along_stages(stage == 0), feed[tf.newaxis],
                            tf.roll(sent_forward, 1, axis=0))
        stashed = pick_along_stages(stash, slot)
        inputs = annotate(tf.where(along_stages(forward), incoming, stashed))
        written = along_stages(tf.cast(slot, tf.bool) & (forward & busy)[:, tf.newaxis])
        stash = stash_annotate(tf.where(written, inputs[:, tf.newaxis], stash))

        backward = tf.cast(~forward & busy, microbatches.dtype)            # [S]
        # the last stage's microbatch on its backward ticks (other ticks: weight 0)
        target = tf.gather(targets, tf.clip_by_value((tick + stages) // 2 - stages, 0,
                                                     count - 1))
        stage_targets = tf.broadcast_to(target[tf.newaxis],
                                        [stages] + targets.shape[1:].as_list())
        weight = backward * tf.cast(last, microbatches.dtype)
        # the params read inside the body (the tape sees this graph's ops only)
        local = tf.nest.map_structure(tf.identity, params)
        cotangent = annotate(tf.roll(sent_backward, -1, axis=0) * along_stages(
            backward - weight))
        with tf.GradientTape() as tape:
            tape.watch([inputs] + tf.nest.flatten(local))
            outputs = annotate(run_stages(local, inputs))
            stage_losses = run_losses(outputs, stage_targets)
            objective = (tf.reduce_sum(stage_losses * weight) / count
                         + tf.reduce_sum(outputs * cotangent))
        input_gradient, param_gradients = tape.gradient(objective, (inputs, local))
        grads = tf.nest.map_structure(tf.add, grads, param_gradients)
        return (tick + 1, outputs, annotate(input_gradient), stash,
                losses + stage_losses * weight, grads)

    # before a stage's first microbatch arrives it runs on microbatch 0 (idle_input)
    idle = annotate(idle_input(microbatches, stages))
    initial = (tf.constant(0), idle, annotate(tf.zeros(buffer_shape, microbatches.dtype)),
               stash_annotate(tf.broadcast_to(idle[:, tf.newaxis],
                                              [stages, slots] + buffer_shape[1:])),
               tf.zeros([stages], microbatches.dtype),
               tf.nest.map_structure(tf.zeros_like, params))
    *_, losses, grads = tf.while_loop(lambda tick, *_: tick < ticks, body, initial,
                                      maximum_iterations=ticks)
    return tf.reduce_sum(losses) / count, grads


def stash_spec(stage_axis, microbatch_spec):
    """The stash's PartitionSpec: split like the stage buffer, its slot dim whole."""
    return P(stage_axis, None, *(microbatch_spec or ()))
