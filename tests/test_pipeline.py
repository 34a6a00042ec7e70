"""gt.pipeline (GPipe schedule, gspmd_tf/pipeline.py) equals the unpipelined sequential
model on single-device TF (forward and the gradients of the stacked weights, relative
1e-5), on a 1-D stage mesh and on a 3-D (stage, data, model) mesh; the shift between
stages is collective-permutes, never an all-gather; a pipelined Transformer stack trains
on the 3-D mesh as it does on one device."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.graph.ir import walk
from gspmd_tf.spmd.program import COLLECTIVES
from gspmd_tf.testing import pipeline_model
from util import assert_close, randn, single_device

P = gt.P
_LINE = gt.Mesh.create((4,), ("stage",))
_CUBE = gt.Mesh.create((2, 2, 2), ("stage", "data", "model"))
STAGES, MICROBATCHES, BATCH, D, F = 4, 3, 4, 8, 16


def mlp_stage(p, x):
    """A residual MLP block: one pipeline stage."""
    return x + tf.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]


def mlp_params(rng, stages=STAGES):
    return {"w1": randn(rng, stages, D, F) * 0.3, "b1": randn(rng, stages, F),
            "w2": randn(rng, stages, F, D) * 0.3}


def loss_and_grads(run):
    """f(w1, b1, w2, x) -> (y, dloss/dw1, dloss/db1, dloss/dw2) of loss = sum(y * y)."""
    def f(w1, b1, w2, x):
        weights = [w1, b1, w2]
        with tf.GradientTape() as tape:
            tape.watch(weights)
            y = run(dict(w1=w1, b1=b1, w2=w2), x)
            loss = tf.reduce_sum(y * y)
        return (y,) + tuple(tape.gradient(loss, weights))
    return f


def _args(rng, stages=STAGES):
    params = mlp_params(rng, stages)
    return (params["w1"], params["b1"], params["w2"], randn(rng, MICROBATCHES, BATCH, D))


def _assert_equal_to_sequential(got, args):
    unpipelined = lambda p, x: pipeline_model.sequential(p, x, mlp_stage)  # noqa: E731
    want = single_device(loss_and_grads(unpipelined), args)
    for name, g, w in zip(["output", "dw1", "db1", "dw2"], got, want):
        assert_close(np.asarray(g), w, name)


def _collectives(low):
    return [(c.kind, c.shape) for c in low.collectives()]


def test_single_device_tf_equals_sequential():
    args = _args(np.random.default_rng(0))
    got = single_device(loss_and_grads(lambda p, x: gt.pipeline(mlp_stage, p, x)), args)
    _assert_equal_to_sequential(got, args)


def test_stage_mesh_values_and_one_permute_per_shift():
    args = _args(np.random.default_rng(1))
    run = loss_and_grads(lambda p, x: gt.pipeline(mlp_stage, p, x, mesh=_LINE))
    f = gt.function(run, mesh=_LINE, in_shardings=(P("stage"),) * 3 + (P(),))
    _assert_equal_to_sequential([t.numpy() for t in f(*args)], args)
    low = f.lower(*args)
    assert not low.program.replicated_ops
    kinds = [kind for kind, _ in _collectives(low)]
    assert "all-gather" not in kinds and "all-to-all" not in kinds, low.report()
    # each device's stage buffer [1, b, d] moves to the next stage (forward) or back
    permutes = [c for c in low.collectives() if c.kind == "collective-permute"]
    assert {c.shape for c in permutes} == {(1, BATCH, D)}, low.report()
    # the only other collective: the last stage's outputs, reduced out of the stage dim
    assert kinds.count("all-reduce") == 1, low.report()


def _loops(low):
    return [n for n in low.program.graph.nodes if n.regions]


def _body_collectives(loop):
    return [(n.op, tuple(n.out_shapes[0])) for region in loop.regions
            for n in walk(region) if n.op in COLLECTIVES]


def test_forward_is_one_loop_with_one_permute_in_its_body():
    args = _args(np.random.default_rng(2))
    low = gt.lower(lambda w1, b1, w2, x: gt.pipeline(mlp_stage, dict(w1=w1, b1=b1, w2=w2),
                                                      x, mesh=_LINE),
                   _LINE, (P("stage"),) * 3 + (P(),), args=args)
    assert _collectives(low) == [("collective-permute", (1, BATCH, D)),
                                 ("all-reduce", (MICROBATCHES, BATCH, D))], low.report()
    [loop] = _loops(low)
    assert _body_collectives(loop) == [("gt.Permute", (1, BATCH, D))], low.report()


def test_backward_loop_shifts_with_one_permute_and_keeps_lists_split():
    # TF's gradient of the while loop is a second loop reading the forward loop's
    # TensorList accumulators: they hold each device's own stage (element [1, ...])
    args = _args(np.random.default_rng(7))
    run = loss_and_grads(lambda p, x: gt.pipeline(mlp_stage, p, x, mesh=_LINE))
    low = gt.lower(run, _LINE, (P("stage"),) * 3 + (P(),), args=args)
    loops = _loops(low)
    assert len(loops) == 2, low.report()
    for loop in loops:
        assert _body_collectives(loop) == [("gt.Permute", (1, BATCH, D))], low.report()
    lists = [n for n in walk(low.program.graph)
             if n.op in ("EmptyTensorList", "TensorListReserve") and n.out_shapes[0]]
    assert lists and all(n.out_shapes[0][0] == 1 for n in lists), low.report()


def test_3d_mesh_with_data_and_model_splits():
    # 4 stages over 2 devices (two per device: the shift is a one-stage halo), the
    # microbatch over "data", w1 column- and w2 row-split over "model" (Megatron)
    args = _args(np.random.default_rng(3))
    run = loss_and_grads(lambda p, x: gt.pipeline(mlp_stage, p, x, mesh=_CUBE,
                                                  microbatch_spec=P("data")))
    f = gt.function(run, mesh=_CUBE, in_shardings=(
        P("stage", None, "model"), P("stage", "model"), P("stage", "model"),
        P(None, "data")))
    _assert_equal_to_sequential([t.numpy() for t in f(*args)], args)
    low = f.lower(*args)
    assert not low.program.replicated_ops
    assert "all-gather" not in [c.kind for c in low.collectives()], low.report()
    permutes = [c for c in low.collectives() if c.kind == "collective-permute"]
    assert permutes and {c.shape for c in permutes} == {(1, BATCH // 2, D)}, low.report()
    stage_of = {int(d): g for g, row in enumerate(_CUBE.groups(("stage",))) for d in row}
    assert all(stage_of[src] == stage_of[dst] for c in permutes for src, dst in c.groups)
    # weights stay split: a device holds its stages' half of w1's columns
    assert low.input_shardings[0] == gt.Sharding.from_spec(_CUBE, P("stage", None, "model"), 3)


def test_stacked_stage_function_without_vectorizing():
    args = _args(np.random.default_rng(4))

    def stacked_stage(p, x):  # x [S, b, d]: the leading dim is the stage dim
        h = tf.nn.relu(tf.einsum("sbd,sdf->sbf", x, p["w1"]) + p["b1"][:, None])
        return x + tf.einsum("sbf,sfd->sbd", h, p["w2"])
    run = loss_and_grads(lambda p, x: gt.pipeline(stacked_stage, p, x, mesh=_LINE,
                                                  vectorize=False))
    f = gt.function(run, mesh=_LINE, in_shardings=(P("stage"),) * 3 + (P(),))
    _assert_equal_to_sequential([t.numpy() for t in f(*args)], args)
    assert "all-gather" not in [c.kind for c in f.lower(*args).collectives()]


def test_stage_undefined_at_zero_gives_the_sequential_outputs():
    # the warm-up and the drain ran the stages on zeros (NaN here), and the last stage's
    # outputs were picked by a one-hot product, so that NaN reached every output
    from test_pipeline_schedules import rms_normed_stage
    rng = np.random.default_rng(8)
    w, x = randn(rng, STAGES, D, D), randn(rng, MICROBATCHES, BATCH, D)
    f = gt.function(lambda w, x: gt.pipeline(rms_normed_stage, dict(w=w), x, mesh=_LINE),
                    mesh=_LINE, in_shardings=(P("stage"), P()))
    want = single_device(lambda w, x: pipeline_model.sequential(dict(w=w), x,
                                                                rms_normed_stage), (w, x))
    assert_close(f(w, x).numpy(), want[0], "outputs")


def test_bad_input_names_what_to_change():
    rng = np.random.default_rng(5)
    w1, b1, w2, x = _args(rng)
    with pytest.raises(gt.ShardingError, match="same static stage dim"):
        gt.pipeline(mlp_stage, dict(w1=w1, b1=b1[:3], w2=w2), x)
    with pytest.raises(gt.ShardingError, match="3 stages do not divide"):
        gt.pipeline(mlp_stage, dict(w1=w1[:3], b1=b1[:3], w2=w2[:3]), x, mesh=_LINE)
    with pytest.raises(gt.ShardingError, match="over the stage axis 'stage'"):
        gt.pipeline(mlp_stage, dict(w1=w1, b1=b1, w2=w2), x, mesh=_CUBE,
                    microbatch_spec=P("data", "stage"))
    with pytest.raises(gt.ShardingError, match="must keep its input's shape"):
        gt.pipeline(lambda p, x: x @ p["w1"], dict(w1=w1), x)


def _train(variables, run_stages, tokens, steps, mesh=None):
    step = pipeline_model.make_step(variables, run_stages)
    if mesh is None:
        with tf.device("/device:CPU:0"):
            step = tf.function(step)
            return [float(step(tokens)) for _ in range(steps)], None
    step = gt.function(step, mesh=mesh, in_shardings=(P(None, "data"),))
    return [float(step(tokens).numpy()) for _ in range(steps)], step.lower(tokens)


def test_pipelined_transformer_trains_on_3d_mesh_as_on_one_device():
    rng = np.random.default_rng(6)
    params = pipeline_model.init_params(rng)
    tokens = rng.integers(0, 16, size=(2, 4, 5)).astype(np.int32)  # [M, b, t + 1]
    steps = 3
    with tf.device("/device:CPU:0"):
        single = {n: tf.Variable(params[n]) for n in pipeline_model.NAMES}
    want, _ = _train(single, pipeline_model.sequential, tokens, steps)
    sharded = {n: gt.Variable(params[n], _CUBE, pipeline_model.SPECS[n], name=n)
               for n in pipeline_model.NAMES}
    got, low = _train(sharded, pipeline_model.pipelined(_CUBE), tokens, steps, _CUBE)
    assert_close(got, want, "losses")
    assert want[-1] < want[0], want
    for n in pipeline_model.NAMES:
        assert_close(sharded[n].numpy(), single[n].numpy(), n)
    assert not low.program.replicated_ops
    # nothing moves over "stage" but the shifts and, once, the last stage's outputs
    # (the embedding's gradient gathers its data-split token rows: not the pipeline's)
    over_stage = [c for c in low.collectives() if "stage" in c.axes]
    assert all(c.kind == "all-reduce" for c in over_stage), low.report()
