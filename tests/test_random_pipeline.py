"""Randomized differential tests of gt.pipeline and gt.pipeline_value_and_grad.

Each example draws a mesh of the 8 CPU devices with a stage axis (and maybe data and
model axes), a schedule (the forward alone, GPipe, 1F1B or interleaved), S stages per
stage-axis device, M microbatches (M < S and M no multiple of S included where the
schedule takes them), V virtual stages, a small stage function and loss (float targets
like the outputs, or int class labels), random shardings of the stage params
(arguments, or gt.Variables), the microbatches and the targets, and a microbatch spec
(uneven dims included), the mesh given to the pipeline (its buffers annotated) or not.
The partitioned loss and gradients (the forward's outputs) must
equal the unpipelined model on single-device TF; sizes a schedule refuses must be a
gt.ShardingError. More examples: GSPMD_TF_EXAMPLES=200, or HYPOTHESIS_PROFILE=fuzz.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import event, given, settings, strategies as st

import gspmd_tf as gt
from gspmd_tf.testing import pipeline_model
from test_pipeline import mlp_stage
from test_pipeline_schedules import rms_normed_stage, squared_error
from util import assert_close, examples, randn, single_device, specs

P = gt.P
# (shape, names): the stage axis first, last, or between data and model
MESHES = [((8,), ("stage",)), ((4, 2), ("stage", "data")), ((2, 4), ("stage", "model")),
          ((2, 2, 2), ("stage", "data", "model")), ((2, 4), ("data", "stage")),
          ((2, 2, 2), ("data", "stage", "model")), ((2, 2, 2), ("data", "model", "stage"))]
APIS = ("forward", "gpipe", "1f1b", "interleaved")
# examples per schedule of the test running on the 8 devices (~1.5 s each): an eighth of
# the profile's


def _without_bias(p, x):
    """mlp_stage without its bias."""
    return x + tf.nn.relu(x @ p["w1"]) @ p["w2"]


def _tanh(p, x):
    """A tanh layer (not residual)."""
    return tf.tanh(x @ p["w"] + p["b"])


def _tanh_without_bias(p, x):
    """A tanh layer without bias."""
    return tf.tanh(x @ p["w"])


def _batch_centred(p, x):
    """A layer whose rows depend on the whole microbatch (a mean over its batch dim)."""
    y = x @ p["w"]
    return y - tf.reduce_mean(y, axis=0, keepdims=True)


def _normed(p, x):
    """A residual layer over the normalized rows (mean and variance over the width)."""
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return x + tf.tanh((x - mean) * tf.math.rsqrt(variance + 0.1) @ p["w"]) * p["b"]


def _gated(p, x):
    """A residual tanh layer scaled by a per-stage scalar (a param [S])."""
    return x + p["gate"] * tf.tanh(x @ p["w"])


# stage function, and its params' shapes after the stage dim ("d": the width of x)
STAGE_FNS = {
    "gated": (_gated, {"gate": (), "w": ("d", "d")}),
    "batch_centred": (_batch_centred, {"w": ("d", "d")}),
    "normed": (_normed, {"w": ("d", "d"), "b": ("d",)}),
    "rms_normed_without_epsilon": (rms_normed_stage, {"w": ("d", "d")}),
    "residual_mlp": (mlp_stage, {"w1": ("d", "f"), "b1": ("f",), "w2": ("f", "d")}),
    "residual_mlp_without_bias": (_without_bias, {"w1": ("d", "f"), "w2": ("f", "d")}),
    "tanh": (_tanh, {"w": ("d", "d"), "b": ("d",)}),
    "tanh_without_bias": (_tanh_without_bias, {"w": ("d", "d")}),
}
# losses of positive terms: a signed sum (tanh(y) t summed) can cancel to far below its
# terms, where float32's rounding alone passes 1e-5 of the value (plain-TF 1F1B's loss
# was 1.0e-5 off float64's on such a draw, seed 117)
LOSSES = {
    "squared_error": squared_error,
    "cross_entropy": lambda y, t: tf.reduce_mean(
        tf.nn.softmax_cross_entropy_with_logits(tf.nn.softmax(t), y)),
    "softplus_product": lambda y, t: tf.reduce_mean(tf.nn.softplus(y * t)),
    "log_cosh": lambda y, t: tf.reduce_mean(tf.math.log(tf.cosh(y - t))),
    # targets are int32 class labels [b, ...] of the width's classes
    "sparse_cross_entropy": lambda y, t: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(t, y)),
}


def refused(case):
    """Whether the pipeline refuses the case (as its docstrings say): S must divide over
    the stage axis, the circular schedule (V > 1, or "interleaved") sends microbatches
    round in groups of S, and the microbatch spec names a microbatch's dims over axes
    other than the stage axis."""
    devices = case["shape"][case["names"].index("stage")]
    circular = case["virtual"] > 1 or case["api"] == "interleaved"
    spec = case["microbatch_spec"] or P()
    return (case["stages"] % devices != 0
            or (circular and case["microbatches"] % case["stages"] != 0)
            or len(spec) > 2 + len(case["rows"])
            or any("stage" in spec.axes_of(dim) for dim in range(len(spec))))


@st.composite
def pipelines(draw, valid, api=None):
    """A random pipelined model: a dict of the drawn choices (`valid`: only sizes the
    schedule takes, else any; `api`: one of APIS, else drawn)."""
    shape, names = draw(st.sampled_from(MESHES))
    devices = shape[names.index("stage")]
    api = api or draw(st.sampled_from(APIS))
    # at most 8 layers (S V) and 8 microbatches: a few seconds per example
    stages = devices * draw(st.integers(1, 8 // devices))
    virtual = (draw(st.integers(1, max(1, 8 // stages)))
               if api in ("forward", "interleaved") else 1)
    circular = virtual > 1 or api == "interleaved"
    microbatches = (stages * draw(st.integers(1, max(1, 8 // stages))) if circular
                    else draw(st.integers(1, 6)))
    if not valid:  # perhaps S or M off by one
        stages += draw(st.sampled_from([0, 1]))
        microbatches += draw(st.sampled_from([0, 1]))
    stage_fn = draw(st.sampled_from(sorted(STAGE_FNS)))
    loss = draw(st.sampled_from(sorted(LOSSES)))
    others = tuple(n for n in names if n != "stage")
    # the width d is the classes of the cross-entropies: at least 2 there. With one
    # class the loss is identically 0 and its gradients exactly 0, so the one ulp by
    # which TF's Eigen Softmax in a functional loop body differs from the oneDNN one of
    # single-device TF's lowered loop (1 - 6e-8 for a one-element row; the strict xfail
    # tests/test_control_flow.py::test_while_body_runs_the_kernels_single_device_tf_runs)
    # is an unbounded relative error
    classes = loss in ("cross_entropy", "sparse_cross_entropy")
    sizes = {"d": draw(st.integers(2 if classes else 1, 6)), "f": draw(st.integers(1, 5)),
             "b": draw(st.integers(1, 5))}
    # a microbatch [b, d] or [b, t, d]
    rows = (draw(st.integers(1, 3)),) if draw(st.booleans()) else ()
    param_specs = {
        name: P(draw(st.sampled_from(["stage", "stage", None])),
                *draw(specs(others, len(dims))))
        for name, dims in STAGE_FNS[stage_fn][1].items()}
    return dict(
        shape=shape, names=names, api=api, stages=stages, microbatches=microbatches,
        virtual=virtual, stage_fn=stage_fn, loss=loss,
        sizes=sizes, rows=rows, param_specs=param_specs,
        x_spec=draw(specs(names, 3 + len(rows))),
        target_spec=draw(specs(names, 3 + len(rows) - (loss == "sparse_cross_entropy"))),
        microbatch_spec=(P(*draw(specs(others if valid else names,
                                       2 + len(rows) + (0 if valid else draw(
                                           st.sampled_from([0, 0, 1]))))))
                         if draw(st.booleans()) else None),
        annotated=draw(st.booleans()) if valid else True,
        seed=draw(st.integers(0, 2 ** 16)))


def _model(case):
    """(stage_fn, loss_fn, params in model order, microbatches, targets)."""
    rng = np.random.default_rng(case["seed"])
    stage_fn, dims = STAGE_FNS[case["stage_fn"]]
    layers = case["stages"] * case["virtual"]
    sizes = case["sizes"]
    params = {name: randn(rng, layers, *(sizes[d] for d in shape)) * 0.5
              for name, shape in dims.items()}
    shape = (case["microbatches"], sizes["b"], *case["rows"])
    targets = (rng.integers(0, sizes["d"], shape).astype(np.int32)
               if case["loss"] == "sparse_cross_entropy" else randn(rng, *shape, sizes["d"]))
    return stage_fn, LOSSES[case["loss"]], params, randn(rng, *shape, sizes["d"]), targets


def _pipelined(case, stage_fn, loss_fn, mesh, names):
    """f(*param leaves, x, targets) -> the pipeline's outputs (forward) or (loss, *grads),
    params in the pipeline's order (gt.pipeline_layer_order)."""
    def run(*args):
        params = dict(zip(names, args[:len(names)]))
        x, targets = args[len(names):]
        # without the mesh the pipeline annotates nothing: propagation lays it out
        options = dict(mesh=mesh if case["annotated"] else None,
                       microbatch_spec=case["microbatch_spec"],
                       virtual_stages=case["virtual"])
        if case["api"] == "forward":
            return gt.pipeline(stage_fn, params, x, **options)
        loss, grads = gt.pipeline_value_and_grad(stage_fn, loss_fn, params, x, targets,
                                                 schedule=case["api"], **options)
        return (loss,) + tuple(grads[n] for n in names)
    return run


def _arguments(case):
    """(mesh, pipelined fn, in_shardings, args in the pipeline's order, wanted values)."""
    stage_fn, loss_fn, params, x, targets = _model(case)
    names = sorted(params)
    order = gt.pipeline_layer_order(case["stages"], case["virtual"])
    mesh = gt.Mesh.create(case["shape"], case["names"])
    fn = _pipelined(case, stage_fn, loss_fn, mesh, names)
    shardings = tuple(case["param_specs"][n] for n in names) + (case["x_spec"],
                                                                case["target_spec"])
    args = tuple(params[n][order] for n in names) + (x, targets)
    return mesh, fn, shardings, args, (stage_fn, loss_fn, params, names, order, x, targets)


def _unpipelined(reference, api):
    """The single-device values the pipeline must give, params in its order."""
    stage_fn, loss_fn, params, names, order, x, targets = reference
    if api == "forward":
        return single_device(lambda p, x: pipeline_model.sequential(p, x, stage_fn),
                             (params, x))
    # [loss, the gradients by name (tf.nest's sorted order)]
    flat = single_device(
        lambda p, x, t: pipeline_model.unpipelined_value_and_grad(stage_fn, loss_fn, p, x, t),
        (params, x, targets))
    return [flat[0]] + [g[order] for g in flat[1:]]


@pytest.mark.parametrize("api", APIS)
@settings(max_examples=examples(8))
@given(data=st.data())
def test_pipeline_equals_unpipelined_model(api, data):
    """A random pipeline of `api` (drawn from `data`) equals the unpipelined model."""
    case = data.draw(pipelines(valid=True, api=api))
    as_variables = data.draw(st.booleans(), "stage params held as gt.Variables")
    mesh, fn, shardings, args, reference = _arguments(case)
    event(f"{api} S={case['stages']} M={case['microbatches']} V={case['virtual']}")
    names = reference[3]
    if as_variables:  # each device stores its own split of them; fn reads them
        variables = [gt.Variable(a, mesh, spec, name=n)
                     for a, spec, n in zip(args, shardings, names)]
        f = gt.function(lambda x, t: fn(*variables, x, t), mesh=mesh,
                        in_shardings=shardings[len(names):])
        got = f(*args[len(names):])
    else:
        got = gt.function(fn, mesh=mesh, in_shardings=shardings)(*args)
    want = _unpipelined(reference, api)
    got = tf.nest.flatten(got)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g.numpy(), w, f"{api} output {i}")


@given(pipelines(valid=False))
def test_pipeline_lowers_or_refuses_the_sizes_and_specs(case):
    mesh, fn, shardings, args, _ = _arguments(case)
    specs_ = [tf.TensorSpec(a.shape, a.dtype) for a in args]
    refuse = refused(case)
    event("refused" if refuse else "lowered")
    if refuse:
        with pytest.raises(gt.ShardingError):
            gt.lower(fn, mesh, shardings, args=specs_)
    else:
        lowered = gt.lower(fn, mesh, shardings, args=specs_)
        # stages on other devices: the shift between them is a collective-permute
        kinds = {c.kind for c in lowered.collectives()}
        assert "collective-permute" in kinds, lowered.report()
