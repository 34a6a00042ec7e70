"""gt.pipeline_value_and_grad: a pipelined model's mean loss and the gradients of its
stage params, by the GPipe, interleaved (circular) or 1F1B schedule (schedule.py).

GPipe and interleaved run forward.py's loop under a tape: TF's gradient of the loop is
the backward pipeline; it keeps the forward's activations of every step (GPipe) or every
step's input (interleaved, whose steps are rematerialised). 1F1B runs one_f_one_b.py's
loop, which computes the gradients itself.
"""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf.errors import ShardingError
from gspmd_tf.pipeline import schedule as timing
from gspmd_tf.pipeline.forward import annotator, num_stages, pipeline, vectorized
from gspmd_tf.pipeline.one_f_one_b import one_f_one_b, stash_spec


def pipeline_value_and_grad(stage_fn, loss_fn, stage_params, microbatches, targets, *,
                            mesh=None, stage_axis="stage", schedule="gpipe",
                            virtual_stages=1, microbatch_spec=None):
    """(mean loss, gradients of `stage_params`) of a pipelined model, one SPMD program.

    The model: each microbatch x through the stages in order, `x = stage_fn(params of
    stage s, x)`, then `loss_fn(x, target)`; the loss is the mean over the M microbatches.
    Call it inside a gt.function (or any traced code); on plain TF it computes the same
    values on one device.

    Args:
      stage_fn: stage_fn(params, x) -> y of x's shape and dtype (gt.pipeline's).
      loss_fn: loss_fn(y, target) -> scalar, y one microbatch's last-stage output and
        target its row of `targets`.
      stage_params: a nest of tensors with the stage dim leading, split over
        `stage_axis` (gt.pipeline's); for "interleaved" it holds S * V layers in
        gt.pipeline_layer_order(S, V).
      microbatches: [M, b, ...]; targets: [M, ...], one row per microbatch.
      mesh, stage_axis, microbatch_spec: as gt.pipeline.
      schedule: "gpipe" (all forwards, then all backwards: keeps every step's
        activations), "1f1b" (each stage alternating forwards and backwards: keeps
        at most S stage inputs per stage, recomputes the forward in the backward;
        bubble (S-1)/(M+S-1)) or
        "interleaved" (GPipe's order over V virtual stages per device, the circular
        schedule: bubble (S-1)/(V M+S-1); M a multiple of S; each step recomputed in
        the backward, so only the steps' inputs are kept).
      virtual_stages: V, for "interleaved".

    Returns:
      (the mean loss, a nest like `stage_params` of its gradients). Its ops lie in a
      name scope naming the schedule, so the HTML report of the program shows it.

    Raises:
      gt.ShardingError: an unknown schedule, sizes it cannot run, or gt.pipeline's.
    """
    params = tf.nest.map_structure(tf.convert_to_tensor, stage_params)
    microbatches = tf.convert_to_tensor(microbatches)
    targets = tf.convert_to_tensor(targets)
    if targets.shape.rank is None or targets.shape[:1] != microbatches.shape[:1]:
        raise ShardingError(f"pipeline_value_and_grad: targets {targets.shape} need one "
                            f"row per microbatch (microbatches {microbatches.shape})")
    stages = num_stages(params) // max(virtual_stages, 1)
    timing.check_schedule(schedule, stages, microbatches.shape[0], virtual_stages)
    with tf.name_scope(timing.scope_name(schedule, stages, microbatches.shape[0],
                                         virtual_stages)):
        return _run(schedule, stage_fn, loss_fn, params, microbatches, targets, mesh,
                    stage_axis, virtual_stages, microbatch_spec)


def _run(schedule, stage_fn, loss_fn, params, microbatches, targets, mesh, stage_axis,
         virtual_stages, microbatch_spec):
    """pipeline_value_and_grad's work, checked arguments given."""
    if schedule == "1f1b":
        annotate = annotator(mesh, stage_axis, microbatch_spec, num_stages(params),
                             microbatches.shape.rank)
        return one_f_one_b(vectorized(stage_fn), _vectorized_loss(loss_fn), params,
                           microbatches, targets, annotate, mesh=mesh,
                           stash_spec=stash_spec(stage_axis, microbatch_spec))
    leaves = tf.nest.flatten(params)
    with tf.GradientTape() as tape:
        tape.watch(leaves)
        outputs = pipeline(stage_fn, params, microbatches, mesh=mesh,
                           stage_axis=stage_axis, microbatch_spec=microbatch_spec,
                           virtual_stages=virtual_stages)
        loss = tf.reduce_mean(_vectorized_loss(loss_fn)(outputs, targets))
    return loss, tf.nest.pack_sequence_as(params, tape.gradient(loss, leaves))


def _vectorized_loss(loss_fn):
    """loss_fn over a leading dim of outputs and targets: [n, ...] x [n, ...] -> [n]."""
    def run(outputs, targets):
        return tf.vectorized_map(lambda args: loss_fn(*args), (outputs, targets),
                                 fallback_to_while_loop=False)
    return run
