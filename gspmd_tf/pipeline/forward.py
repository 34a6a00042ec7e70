"""gt.pipeline: pipeline parallelism the GSPMD way (GPipe or circular schedule, one SPMD
program).

The layers of S stages are stacked on a leading stage dim, split over a mesh axis, so
each device of that axis holds its stages' weights. A buffer [S, b, ...] holds every
stage's current microbatch. Each iteration runs all stages at once (one computation
vectorized over the stage dim: partitioning gives each device its own stages' slice),
then shifts the buffer one stage on (tf.roll on the stage dim: one collective-permute)
and puts the next microbatch into stage 0 (a select). After M + S - 1 iterations every
microbatch has passed all stages; the last stage's outputs are collected and reduced out
of the stage dim once, at the end. Gradients are TF's through the same program, so the
backward pass is the reversed pipeline (the rolls' gradients are rolls the other way).

The schedule is one tf.while_loop over the M + S - 1 iterations (`_iteration` is its
body): partitioned control flow partitions the body once, so the program does not grow
with M, and the shift is a collective-permute inside the body, run on every iteration.
Each iteration's buffer is written to a TensorArray (a list of stage-split elements).

With virtual_stages=V > 1 (the circular, interleaved schedule of schedule.py) each device
holds V layers; every iteration each device picks the layer of its current repeat (a
masked sum over its V layers, local), device 0 takes a new microbatch only at repeat 0
and otherwise the wrapped-round output of device S - 1, and a microbatch's output is the
last device's buffer at the step its last layer ends. Each of its steps is rematerialised
in the backward (recomputed from the step's input), so TF's gradient of the loop keeps
one [S, b, ...] input per step rather than every step's picked layers and activations.
"""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf.annotations import mesh_split
from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import P
from gspmd_tf.pipeline import schedule as timing


def pipeline(stage_fn, stage_params, microbatches, *, mesh=None, stage_axis="stage",
             microbatch_spec=None, vectorize=True, virtual_stages=1):
    """Run `stage_fn` as an S-stage pipeline over M microbatches (GPipe schedule, or the
    circular one with virtual_stages > 1).

    Equal to the unpipelined model `for s in range(S): x = stage_fn(params[s], x)` applied
    to each microbatch, computed as one SPMD program where each device of mesh axis
    `stage_axis` runs only its own stages. Call it inside a gt.function (or any traced
    code); on plain TF it computes the same values on one device.

    Args:
      stage_fn: stage_fn(params, x) -> y, one stage: `params` is a nest like
        `stage_params` holding one stage's slices, `x` one microbatch [b, ...]; `y` must
        have x's shape and dtype (it feeds the next stage). With vectorize=False it gets
        the stacked params and the [S, b, ...] buffer of all stages instead and must
        treat the leading dim as the stage dim.
      stage_params: a nest of tensors (or gt.Variables read in traced code), each with
        the stage dim S leading. Give them a sharding splitting that dim over
        `stage_axis` (in_shardings or a gt.Variable spec), plus any model-parallel
        split of the other dims (e.g. P("stage", None, "model")).
      microbatches: a tensor [M, b, ...], M microbatches (split b over a data axis for
        data parallelism).
      mesh: the gt.Mesh; when given, the stage buffer is annotated
        P(stage_axis, *microbatch_spec) every iteration, and S must be a multiple of the
        stage axis size. Without it, propagation infers the buffer's split from the
        params (and the values are those of single-device TF anyway).
      stage_axis: the mesh axis splitting the stage dim.
      microbatch_spec: the PartitionSpec of one microbatch [b, ...], e.g. P("data")
        (default: not split).
      vectorize: whether to vectorize stage_fn over the stage dim (tf.vectorized_map).
      virtual_stages: V layers per device, run in the circular schedule (bubble
        (S-1)/(V M+S-1), M a multiple of S): the params' leading dim holds S * V layers
        device-major, entry d * V + k being layer k * S + d
        (gt.pipeline_layer_order(S, V) lists the layers in that order), so a split of
        it over `stage_axis` gives each of the S devices its own V layers.

    Returns:
      A tensor [M, b, ...]: the last stage's output for each microbatch.

    Raises:
      gt.ShardingError: the params disagree on S, the microbatches have no static
        count, S does not divide over the stage axis, or stage_fn changes the shape.
    """
    params = tf.nest.map_structure(tf.convert_to_tensor, stage_params)
    microbatches = tf.convert_to_tensor(microbatches)
    layers = num_stages(params)
    if microbatches.shape.rank is None or microbatches.shape[0] is None:
        raise ShardingError(f"pipeline: microbatches of shape {microbatches.shape} need a "
                            "static leading dim (the number of microbatches)")
    num_microbatches = microbatches.shape[0]
    schedule = "interleaved" if virtual_stages != 1 else "gpipe"
    if layers % virtual_stages:
        raise ShardingError(f"pipeline: {layers} layers do not split into "
                            f"virtual_stages={virtual_stages} per device")
    stages = layers // virtual_stages
    timing.check_schedule(schedule, stages, num_microbatches, virtual_stages)
    annotate = annotator(mesh, stage_axis, microbatch_spec, stages,
                         microbatches.shape.rank)
    run_stages = vectorized(stage_fn) if vectorize else stage_fn
    if virtual_stages > 1:
        run_step = _circular_layers(run_stages, params, stages, virtual_stages,
                                    num_microbatches, mesh, stage_axis)
    else:
        run_step = lambda inputs, step: run_stages(params, inputs)  # noqa: E731
    shape = [stages] + microbatches.shape[1:].as_list()
    first_stage = tf.reshape(tf.range(stages) == 0, [stages] + [1] * (len(shape) - 1))
    iterations = timing.circular_steps(stages, num_microbatches, virtual_stages)
    feeds = padded_feed(microbatches, iterations)

    def body(t, state, states):
        microbatch, repeat, _ = timing.circular_work(t, 0, stages, num_microbatches,
                                                     virtual_stages)
        feeding = first_stage if virtual_stages == 1 else first_stage & (repeat == 0)
        state = _iteration(lambda inputs: run_step(inputs, t), state,
                           tf.gather(feeds, microbatch), feeding, annotate)
        return t + 1, state, states.write(t, state)

    _, _, states = tf.while_loop(
        lambda t, *_: t < iterations, body,
        (tf.constant(0), annotate(idle_input(microbatches, stages)),
         tf.TensorArray(microbatches.dtype, size=iterations, element_shape=shape)),
        maximum_iterations=iterations)
    # the last stage holds microbatch m's output after step circular_exit_step(m)
    exits = [timing.circular_exit_step(m, stages, virtual_stages)
             for m in range(num_microbatches)]
    stacked = states.stack()
    if exits == list(range(stages - 1, iterations)):
        stacked = stacked[stages - 1:]
    else:
        stacked = tf.gather(stacked, exits)
    return last_stage(stacked, stages)


def padded_feed(microbatches, steps):
    """The microbatches, then the last one again up to `steps` rows (what stage 0 takes
    when no microbatch is left: row t is fed at step t, or at work item t). Idle work
    runs on real inputs, never zeros (idle_input)."""
    last = microbatches[-1:]
    drain = tf.broadcast_to(last, [steps - microbatches.shape[0]] + last.shape[1:].as_list())
    return tf.concat([microbatches, drain], 0)


def idle_input(microbatches, stages):
    """[S, b, ...], microbatch 0 at every stage: what the stages hold before their first
    microbatch arrives. The schedule drops what a stage computes on it, but a stage
    function undefined at zero (a norm without epsilon, a division by a norm) would make
    NaN there, and NaN reaches the gradients anyway (TF's gradient of an idle step is
    its zero cotangent times the infinite derivative): so a real input, not zeros."""
    return tf.broadcast_to(microbatches[:1], [stages] + microbatches.shape[1:].as_list())


def _circular_layers(run_stages, params, stages, virtual, num_microbatches, mesh,
                     stage_axis):
    """run(x, step) for the circular schedule: run_stages with each device's layer of its
    current repeat, picked from its V layers ([S * V, ...] viewed [S, V, ...]).

    The step is rematerialised (a tf.custom_gradient recomputing it from its input in the
    backward): TF's gradient of the loop would otherwise keep each step's picked layers,
    V M + S - 1 copies of a device's weights; this way a step keeps only its input."""
    def by_device(p):
        viewed = tf.reshape(p, [stages, virtual] + p.shape[1:].as_list())
        if mesh is None:
            return viewed
        return mesh_split(viewed, mesh, P(stage_axis))
    layers = tf.nest.map_structure(by_device, params)
    leaves = tf.nest.flatten(layers)

    def forward(inputs, pick, leaves):
        current = [pick_along_stages(leaf, pick) for leaf in leaves]
        return run_stages(tf.nest.pack_sequence_as(layers, current), inputs)

    @tf.custom_gradient
    def rematerialised(inputs, pick, *leaves):
        def gradient(output_gradient):
            with tf.GradientTape() as tape:
                tape.watch([inputs, *leaves])
                outputs = forward(inputs, pick, leaves)
            input_gradient, *leaf_gradients = tape.gradient(
                outputs, [inputs, *leaves], output_gradients=output_gradient)
            return [input_gradient, None, *leaf_gradients]
        return forward(inputs, pick, leaves), gradient

    def run(inputs, step):
        _, repeat, _ = timing.circular_work(step, tf.range(stages), stages,
                                            num_microbatches, virtual)
        return rematerialised(inputs, tf.one_hot(repeat, virtual, dtype=inputs.dtype),
                              *leaves)
    return run


def pick_along_stages(values, one_hot):
    """[S, ...]: each stage's entry of dim 1 of `values` [S, n, ...], `one_hot` [S, n]
    (a contraction over that dim: no product of values' size is made)."""
    letters = "abcdefghij"[:values.shape.rank - 2]
    return tf.einsum(f"sk{letters},sk->s{letters}", values,
                     tf.cast(one_hot, values.dtype))


def _iteration(run_stages, state, feed, first_stage, annotate):
    """One step of the schedule: shift every stage's output to the next stage (the last
    one's wraps to stage 0), give stage 0 the microbatch `feed`, run all stages."""
    shifted = tf.roll(state, 1, axis=0)
    inputs = annotate(tf.where(first_stage, feed[tf.newaxis], shifted))
    outputs = run_stages(inputs)
    if outputs.shape != inputs.shape or outputs.dtype != inputs.dtype:
        raise ShardingError(
            f"pipeline: stage_fn maps {inputs.dtype.name}{inputs.shape[1:]} to "
            f"{outputs.dtype.name}{outputs.shape[1:]}; a stage must keep its input's shape "
            "and dtype (it feeds the next stage)")
    return annotate(outputs)


def last_stage(stacked, stages):
    """[M, b, ...] from [M, S, b, ...]: stage S-1's slice, as a select and a sum over the
    stage dim, so a stage-split buffer costs one all-reduce (once, after the loop) rather
    than an all-gather of the whole buffer (a select, not a one-hot product: another
    stage's inf or NaN stays out)."""
    last = tf.reshape(tf.range(stages) == stages - 1,
                      [1, stages] + [1] * (stacked.shape.rank - 2))
    return tf.reduce_sum(tf.where(last, stacked, tf.zeros_like(stacked)), axis=1)


def num_stages(params):
    """The stage dim S every leaf of `params` leads with (a ShardingError if they
    differ)."""
    leaves = tf.nest.flatten(params)
    if not leaves:
        raise ShardingError("pipeline: stage_params is empty; give each stage's weights "
                            "stacked on a leading stage dim")
    sizes = {leaf.shape[0] if leaf.shape.rank else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        shapes = ", ".join(str(leaf.shape) for leaf in leaves)
        raise ShardingError(f"pipeline: stage_params must all have the same static stage "
                            f"dim leading; got shapes (in tf.nest.flatten order) {shapes}")
    return sizes.pop()


def annotator(mesh, stage_axis, microbatch_spec, stages, rank):
    """The function annotating a stage buffer [S, b, ...] (identity without a mesh)."""
    if mesh is None:
        return lambda x: x
    devices = mesh.axis_size(stage_axis)
    if stages % devices:
        raise ShardingError(
            f"pipeline: {stages} stages do not divide over the {devices} devices of "
            f"mesh axis {stage_axis!r}; give a multiple of {devices} stages (an uneven "
            "split would gather the stage buffer every iteration)")
    spec = P(stage_axis, *(microbatch_spec or ()))
    if any(stage_axis in spec.axes_of(dim) for dim in range(1, len(spec))):
        raise ShardingError(f"pipeline: microbatch_spec {microbatch_spec} splits a "
                            f"microbatch over the stage axis {stage_axis!r}, which splits "
                            "the stages; split it over other axes")
    if len(spec) > rank:
        raise ShardingError(f"pipeline: microbatch_spec {microbatch_spec} has more "
                            f"entries than a microbatch has dims ({rank - 1})")
    return lambda x: mesh_split(x, mesh, spec)


def vectorized(stage_fn):
    """stage_fn over stacked params and a [S, b, ...] buffer, stage by stage."""
    def run(params, inputs):
        return tf.vectorized_map(lambda args: stage_fn(*args), (params, inputs),
                                 fallback_to_while_loop=False)
    return run
