"""gt.pipeline_value_and_grad (GPipe, 1F1B, interleaved) equals the unpipelined model's
mean loss and stage-param gradients (single-device TF, relative 1e-5), partitioned over
a stage axis (with data and model axes too); 1F1B's per-device peak memory is at most
half of GPipe's at M=16, S=4 (estimated, and as TF's allocator measures it), does not
grow with M (GPipe's grows by each step's activations), and its stage s holds at most
S - s microbatches; interleaved keeps stage buffers per step, not layers;
gt.pipeline_schedule's table has the formulas' bubbles, and the HTML report shows it."""

import os
import sys
from fractions import Fraction

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.testing import pipeline_model
from test_pipeline import BATCH, D, mlp_params, mlp_stage
from util import Background, assert_close, randn, run_together, session_environ, single_device

P = gt.P
_CUBE = gt.Mesh.create((2, 2, 2), ("stage", "data", "model"))
_PAIR = gt.Mesh.create((2,), ("stage",))


def squared_error(y, target):
    return tf.reduce_mean(tf.square(y - target))


def unpipelined(w1, b1, w2, x, targets):
    """Mean loss and gradients of the layers in model order, no pipeline."""
    loss, grads = pipeline_model.unpipelined_value_and_grad(
        mlp_stage, squared_error, dict(w1=w1, b1=b1, w2=w2), x, targets)
    return loss, grads["w1"], grads["b1"], grads["w2"]


def pipelined(schedule, mesh=None, virtual=1, microbatch_spec=None):
    def run(w1, b1, w2, x, targets):
        loss, grads = gt.pipeline_value_and_grad(
            mlp_stage, squared_error, dict(w1=w1, b1=b1, w2=w2), x, targets, mesh=mesh,
            schedule=schedule, virtual_stages=virtual, microbatch_spec=microbatch_spec)
        return loss, grads["w1"], grads["b1"], grads["w2"]
    return run


def _args(seed, layers, microbatches):
    rng = np.random.default_rng(seed)
    params = mlp_params(rng, layers)
    return (params["w1"], params["b1"], params["w2"], randn(rng, microbatches, BATCH, D),
            randn(rng, microbatches, BATCH, D))


def _assert_equal(got, want):
    for name, g, w in zip(["loss", "dw1", "db1", "dw2"], got, want):
        assert_close(np.asarray(g), np.asarray(w), name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_single_device_equals_unpipelined(schedule):
    args = _args(0, 4, 3)
    _assert_equal(single_device(pipelined(schedule), args), single_device(unpipelined, args))


def test_1f1b_on_stage_data_and_model_axes_equals_unpipelined_without_gathers():
    # 4 stages over 2 devices (two each), microbatches over "data", w1 column- and w2
    # row-split over "model" (Megatron)
    args = _args(1, 4, 5)
    f = gt.function(pipelined("1f1b", _CUBE, microbatch_spec=P("data")), mesh=_CUBE,
                    in_shardings=(P("stage", None, "model"), P("stage", "model"),
                                  P("stage", "model"), P(None, "data"), P(None, "data")))
    _assert_equal([t.numpy() for t in f(*args)], single_device(unpipelined, args))
    low = f.lower(*args)
    kinds = [c.kind for c in low.collectives()]
    assert "all-gather" not in kinds and "all-to-all" not in kinds, low.report()
    assert not low.program.replicated_ops
    # a shift moves one stage slice (the halo to the next device) of a data half
    permutes = {c.shape for c in low.collectives() if c.kind == "collective-permute"}
    assert permutes == {(1, BATCH // 2, D)}, low.report()


def test_interleaved_equals_unpipelined_in_layer_order():
    stages, virtual = 2, 2
    w1, b1, w2, x, targets = _args(2, stages * virtual, 4)
    order = gt.pipeline_layer_order(stages, virtual)
    stored = [p[order] for p in (w1, b1, w2)]
    f = gt.function(pipelined("interleaved", _PAIR, virtual=virtual), mesh=_PAIR,
                    in_shardings=(P("stage"),) * 3 + (P(),) * 2)
    got = [t.numpy() for t in f(*stored, x, targets)]
    loss, dw1, db1, dw2 = single_device(unpipelined, (w1, b1, w2, x, targets))
    _assert_equal(got, [loss, dw1[order], db1[order], dw2[order]])
    kinds = [c.kind for c in f.lower(*stored, x, targets).collectives()]
    assert "all-gather" not in kinds and "all-to-all" not in kinds


def test_1f1b_peak_memory_at_most_half_of_gpipe_at_16_microbatches_4_stages():
    # a stage's activations several times its input, as in a model's MLP block
    mesh, rng, hidden = gt.Mesh.create((4,), ("stage",)), np.random.default_rng(3), 64
    args = (randn(rng, 4, D, hidden) * 0.3, randn(rng, 4, hidden),
            randn(rng, 4, hidden, D) * 0.3, randn(rng, 16, BATCH, D),
            randn(rng, 16, BATCH, D))
    peaks = {schedule: gt.lower(pipelined(schedule, mesh), mesh,
                                (P("stage"),) * 3 + (P(),) * 2, args=args).memory().peak
             for schedule in ("gpipe", "1f1b")}
    assert peaks["1f1b"] * 2 <= peaks["gpipe"], peaks


@Background
def measured_peaks():
    """{schedule: peak bytes} TF's CPU allocator measured running benchmarks/
    pipeline_schedules.py's S=4, M=16 step (microbatch 64) on 4 devices (its own
    process: the allocator's statistics are chosen when TF starts)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done, = run_together([[sys.executable, os.path.join(root, "benchmarks",
                                                         "pipeline_schedules.py"),
                           "--stages=4", "--microbatches=16", "--virtual=1",
                           "--microbatch_size=64", "--measure_memory"]],
                         timeout=600, env=dict(session_environ(), PYTHONPATH=root))
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    return {row[0]: int(row[-2]) for row in rows if row and row[0] in ("gpipe", "1f1b")}


def test_1f1b_measured_peak_is_at_most_half_of_gpipe_s_as_tf_allocates_it():
    peaks = measured_peaks.result()
    assert 0 < peaks["1f1b"] * 2 <= peaks["gpipe"], peaks


def test_1f1b_keeps_the_same_activations_whatever_the_microbatch_count_gpipe_one_per_step():
    # peak minus what both schedules hold (weights, microbatches, targets, gradients)
    mesh, rng, hidden = gt.Mesh.create((4,), ("stage",)), np.random.default_rng(4), 64
    weights = (randn(rng, 4, D, hidden), randn(rng, 4, hidden), randn(rng, 4, hidden, D))

    def above_arguments_and_outputs(schedule, microbatches):
        args = weights + (randn(rng, microbatches, BATCH, D),) * 2
        memory = gt.lower(pipelined(schedule, mesh), mesh, (P("stage"),) * 3 + (P(),) * 2,
                          args=args).memory()
        return memory.peak - memory.arguments - memory.outputs
    assert above_arguments_and_outputs("1f1b", 16) == above_arguments_and_outputs("1f1b", 8)
    # GPipe's loop keeps each step's activations: 8 more steps, at least 8 more hidden
    # activations [1, BATCH, hidden] per device
    grown = above_arguments_and_outputs("gpipe", 16) - above_arguments_and_outputs("gpipe", 8)
    assert grown >= 8 * BATCH * hidden * 4, grown


def test_interleaved_keeps_a_step_input_per_step_not_its_layers():
    # S=2, V=2: 4 more microbatches are 8 more steps; a step's layer (w1, b1, w2 of one
    # device) is 1088 bytes, a stage buffer [1, BATCH, D] 128
    def peak(microbatches):
        w1, b1, w2, x, targets = _args(6, 4, microbatches)
        return gt.lower(pipelined("interleaved", _PAIR, virtual=2), _PAIR,
                        (P("stage"),) * 3 + (P(),) * 2,
                        args=(w1, b1, w2, x, targets)).memory().peak
    inputs_bytes = 2 * (BATCH * D * 4)  # the microbatch and its target, replicated
    per_step = (peak(8) - peak(4) - 4 * inputs_bytes) / 8
    # the loops' lists of stage buffers, a few per step
    assert 0 < per_step <= 5 * BATCH * D * 4, per_step


@pytest.mark.parametrize("schedule,stages,microbatches,virtual,bubble", [
    ("gpipe", 4, 16, 1, Fraction(3, 19)), ("gpipe", 2, 3, 1, Fraction(1, 4)),
    ("interleaved", 4, 8, 2, Fraction(3, 19)), ("interleaved", 2, 4, 3, Fraction(1, 13)),
    ("1f1b", 4, 16, 1, Fraction(3, 19)), ("1f1b", 2, 3, 1, Fraction(1, 4))])
def test_schedule_table_bubble_matches_formula(schedule, stages, microbatches, virtual,
                                               bubble):
    table = gt.pipeline_schedule(schedule, stages, microbatches, virtual)
    assert table.bubble == bubble
    # every device runs every (microbatch, repeat) forward once and backward once
    for row in table.cells:
        busy = [cell for cell in row if cell]
        assert len(busy) == len(set(busy)) == 2 * microbatches * virtual
    assert str(bubble) in table.text() and table.text().startswith("slot")


@pytest.mark.parametrize("stages,microbatches", [(4, 16), (3, 2), (2, 5)])
def test_1f1b_stage_holds_at_most_stages_minus_its_index_microbatches(stages,
                                                                     microbatches):
    table = gt.pipeline_schedule("1f1b", stages, microbatches)
    for stage, row in enumerate(table.cells):
        alive, most = set(), 0
        for cell in row:
            if cell.startswith("F"):
                alive.add(cell[1:])
            elif cell:
                alive.remove(cell[1:])  # a backward follows its own forward
            most = max(most, len(alive))
        assert not alive and most == min(stages - stage, microbatches), (stage, row)


def test_html_report_shows_the_schedule_grid_of_a_pipelined_program():
    args = _args(5, 2, 3)
    page = gt.lower(pipelined("1f1b", _PAIR), _PAIR, (P("stage"),) * 3 + (P(),) * 2,
                    args=args).report(format="html")
    table = gt.pipeline_schedule("1f1b", 2, 3)
    assert "Pipeline schedule (1f1b)" in page and f"bubble {table.bubble}" in page
    for stage, row in enumerate(table.cells):
        cells = "".join(f'<td class="{c[0] if c else "idle"}">{c or "."}</td>' for c in row)
        assert f"<tr><th>stage {stage}</th>{cells}</tr>" in page


def test_bad_schedules_name_what_to_change():
    args = _args(4, 4, 3)
    with pytest.raises(gt.ShardingError, match="schedule 'zb'"):
        pipelined("zb")(*args)
    with pytest.raises(gt.ShardingError, match="no multiple of 2"):
        pipelined("interleaved", virtual=2)(*args)
    with pytest.raises(gt.ShardingError, match="virtual_stages=2 needs"):
        pipelined("1f1b", virtual=2)(*args)
    with pytest.raises(gt.ShardingError, match="one row per microbatch"):
        pipelined("gpipe")(*args[:4], args[4][:2])


def rms_normed_stage(p, x):
    """A stage undefined at zero: an RMS norm without epsilon, then a linear layer."""
    return x * tf.math.rsqrt(tf.reduce_mean(x * x, -1, keepdims=True)) @ p["w"]


@pytest.mark.parametrize("schedule,virtual,microbatches", [
    ("gpipe", 1, 3), ("1f1b", 1, 3), ("interleaved", 2, 4)])
def test_stage_undefined_at_zero_gives_the_unpipelined_loss_and_gradients(
        schedule, virtual, microbatches):
    # idle steps (warm-up, drain, 1F1B's idle backwards) ran the stages on zeros, whose
    # NaN reached the loss and every gradient; they run on real microbatches now
    rng = np.random.default_rng(8)
    w = randn(rng, 2 * virtual, D, D)
    x, targets = randn(rng, microbatches, BATCH, D), randn(rng, microbatches, BATCH, D)
    order = gt.pipeline_layer_order(2, virtual)

    def run(w, x, targets):
        loss, grads = gt.pipeline_value_and_grad(
            rms_normed_stage, squared_error, dict(w=w), x, targets, mesh=_PAIR,
            schedule=schedule, virtual_stages=virtual)
        return loss, grads["w"]
    got = gt.function(run, mesh=_PAIR, in_shardings=(P("stage"), P(), P()))(
        w[order], x, targets)
    loss, grads = single_device(
        lambda w, x, t: pipeline_model.unpipelined_value_and_grad(
            rms_normed_stage, squared_error, dict(w=w), x, t), (w, x, targets))
    _assert_equal([t.numpy() for t in got], [loss, grads[order]])

