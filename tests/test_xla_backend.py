"""XlaBackend: programs run with their compute compiled by XLA equal single-device TF.

Every mesh shape the suite uses; one gt.function per mesh holds the representative
programs (matmul chain, conv with halos, a reshard of every collective kind, uneven
shards), plus a training step with gt.Variables.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import segments
from gspmd_tf.backends.xla import XlaBackend
from util import assert_close, assert_like_tf_variable, randn, single_device

P = gt.P
# every mesh shape of 8 devices or fewer that the test suite runs on
MESHES = [((8,), ("x",)), ((2, 4), ("data", "model")), ((4, 2), ("data", "model")),
          ((2, 2, 2), ("a", "b", "c")), ((1,), ("x",)), ((2,), ("x",)), ((4,), ("x",)),
          ((8, 1), ("data", "model")), ((4, 1), ("data", "model")),
          ((1, 4), ("data", "model")), ((2, 1), ("data", "model")),
          ((2, 2), ("data", "model")), ((2, 1, 4), ("a", "b", "c")),
          ((1, 1, 1), ("a", "b", "c"))]


def run_xla(fn, mesh, args, in_shardings, out_shardings=None):
    """`fn` through the XLA backend: (outputs as numpy, the compiled program)."""
    f = gt.function(fn, mesh=mesh, in_shardings=in_shardings, out_shardings=out_shardings,
                    backend="xla")
    got = [t.numpy() for t in tf.nest.flatten(f(*args))]
    return got, f.lower(*args)


def compiled_segments(lowered):
    """The Segments the XLA backend compiled for `lowered` (it has run once)."""
    return [s for s in lowered.compile().plan.steps if isinstance(s, segments.Segment)]


@pytest.mark.parametrize("shape,axes", MESHES, ids=lambda v: "x".join(map(str, v))
                         if isinstance(v[0], int) else None)
def test_programs_equal_single_device(shape, axes, rng):
    mesh = gt.Mesh.create(shape, axes)
    a, b = axes[0], axes[-1]

    def programs(x, w1, w2, image, kernel, rows, cols):
        chain = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)                   # all-reduce
        conv = tf.nn.conv2d(image, kernel, strides=1, padding="SAME")          # halos
        gathered = x * 2.0                                                     # all-gather
        swapped = x + 1.0                                                      # all-to-all
        scattered = tf.matmul(x, w1)                                           # reduce-scatter
        uneven = tf.reduce_sum(tf.matmul(rows, cols), axis=0)                  # 10 rows
        return chain, conv, gathered, swapped, scattered, uneven

    args = [randn(rng, 16, 24), randn(rng, 24, 32), randn(rng, 32, 8),
            randn(rng, 2, 12, 12, 3), randn(rng, 3, 3, 3, 4), randn(rng, 10, 6),
            randn(rng, 6, 5)]
    in_shardings = (P(a, None), P(None, b), P(b, None), P(None, a), None, P(a), None)
    out_shardings = (None, None, P(), P(None, a), P(None, b), None)
    got, lowered = run_xla(programs, mesh, args, in_shardings, out_shardings)
    for i, (g, w) in enumerate(zip(got, single_device(programs, args))):
        assert_close(g, w, f"output {i}")
    assert compiled_segments(lowered)
    if mesh.size == 8 and len(shape) == 2:
        kinds = {c.kind for c in lowered.collectives()}
        assert {"all-reduce", "all-gather", "all-to-all"} <= kinds, kinds


@pytest.mark.parametrize("shape,axes", MESHES, ids=lambda v: "x".join(map(str, v))
                         if isinstance(v[0], int) else None)
def test_training_step_equals_single_device(shape, axes, rng):
    mesh = gt.Mesh.create(shape, axes)
    a, b = axes[0], axes[-1]
    w1_value, w2_value = randn(rng, 16, 32) * 0.2, randn(rng, 32, 16) * 0.2
    x = randn(rng, 8, 16)

    def make_step(w1, w2):
        def step(x):
            with tf.GradientTape() as tape:
                h = tf.nn.relu(tf.matmul(x, w1))
                loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - x))
            g1, g2 = tape.gradient(loss, [w1, w2])
            w1.assign_sub(0.1 * g1)
            w2.assign_sub(0.1 * g2)
            return loss
        return step

    gw1 = gt.Variable(w1_value, mesh, P(None, b), name="w1")
    gw2 = gt.Variable(w2_value, mesh, P(b, None), name="w2")
    step = gt.function(make_step(gw1, gw2), mesh=mesh, in_shardings=(P(a),), backend="xla")
    with tf.device("/device:CPU:0"):
        sw1, sw2 = tf.Variable(w1_value), tf.Variable(w2_value)
        single = tf.function(make_step(sw1, sw2), autograph=False)
        for _ in range(3):
            assert_close(step(x).numpy(), single(x).numpy(), "loss")
    assert_close(gw1.numpy(), sw1.numpy(), "w1")
    assert_close(gw2.numpy(), sw2.numpy(), "w2")
    assert compiled_segments(step.lower(x))


def test_identical_layers_share_one_segment_function(rng):
    """Stacked identical layers cut into segments of one structure: one traced function
    (and one XLA compilation per device) serves them all."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    weights = [randn(rng, 16, 16) for _ in range(6)]

    def stack(x, *ws):
        for w in ws:
            x = tf.nn.relu(tf.matmul(x, w)) + x
        return x

    args = [randn(rng, 8, 16)] + weights
    in_shardings = (P("data"),) + (P("model"),) * len(weights)
    got, lowered = run_xla(stack, mesh, args, in_shardings)
    assert_close(got[0], single_device(stack, args)[0])
    run = lowered.compile()
    functions = {id(f) for f in run.plan.functions}
    assert len(run.plan.functions) > len(weights) and len(functions) <= 4, \
        (len(run.plan.functions), len(functions))


def test_uncompilable_ops_run_op_by_op_with_a_warning(rng, caplog):
    """String ops have no XLA kernel and random ops draw other numbers under XLA: both
    stay op by op, named in a warning, and the values still equal TF's."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))

    def fn(x):
        text = tf.strings.as_string(tf.reduce_sum(x))
        noise = tf.random.stateless_uniform([4], seed=[1, 2])
        return tf.strings.length(text), tf.reduce_sum(x * 2.0) + tf.reduce_sum(noise)

    x = randn(rng, 8, 4)
    with caplog.at_level(logging.WARNING, logger="gspmd_tf"):
        got, lowered = run_xla(fn, mesh, [x], (P("data"),))
    for g, w in zip(got, single_device(fn, [x])):
        assert_close(g, w)
    text = caplog.text
    assert "AsString" in text and "StatelessRandomUniformV2" in text, text


def test_compile_time_constant_from_the_shard_index_falls_back(caplog):
    """A hand-built program whose Pad amounts come from gt.ShardIndex: XLA needs them as
    compile-time constants, so its bridge rejects the Pad, which then runs op by op
    (named in a warning) while the ops around it stay compiled."""
    from test_backend_local import Program, shards
    mesh = gt.Mesh.create((8,), ("x",))
    p = Program()
    x = p.input(0, (4,))
    zero = p.tf(lambda i: i - i, p.shard_index(("x",)))
    pads = p.tf(lambda v: tf.reshape(v, [1, 2]), p.tf(lambda z: tf.stack([z, z]), zero))
    padded = p.tf(lambda a, q: tf.pad(a, q), p.tf(lambda a: a * 3.0, x), pads)
    p.graph.nodes[padded.node].out_shapes = [(4,)]  # the amounts are 0
    graph = p.outputs(p.tf(lambda a: a + 1.0, padded))
    xs = shards(mesh, (4,))
    with caplog.at_level(logging.WARNING, logger="gspmd_tf"):
        run = XlaBackend(mesh).compile(graph)
        outs = run([xs])
    for d in range(mesh.size):
        np.testing.assert_allclose(outs[0][d].numpy(), xs[d] * 3.0 + 1.0, rtol=1e-6)
        # segments of every CPU device run on the first one; outputs come back home
        assert outs[0][d].backing_device.endswith(f"CPU:{d}"), outs[0][d].backing_device
    pad_name = graph.nodes[padded.node].name
    assert f"XLA cannot compile {pad_name} (Pad)" in caplog.text, caplog.text
    assert padded.node in run.plan.steps
    assert len([s for s in run.plan.steps if isinstance(s, segments.Segment)]) >= 2


def test_variable_reads_and_writes_keep_program_order(rng):
    """A read after a write sees it, across a collective: reads and writes of variables
    run op by op, in program order, between the segments."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    value = randn(rng, 4, 8)

    def make(v):
        def fn(x):
            before = v.read_value() * 2.0
            v.assign_add(tf.reduce_sum(x) * tf.ones_like(v))         # all-reduce over data
            after = v.read_value() + 1.0
            v.assign(after * before)
            return before, after, v.read_value()
        return fn

    x = randn(rng, 8, 8)
    gv = gt.Variable(value, mesh, P(None, "model"), name="v")
    fn = gt.function(make(gv), mesh=mesh, in_shardings=(P("data"),), backend="xla")
    assert_like_tf_variable(make, gv, value, [t.numpy() for t in fn(x)], (x,))


def test_ops_xla_defines_otherwise_stay_op_by_op(rng):
    """Max/min/arg-extrema over NaNs (XLA propagates NaN, TF's CPU kernels do not) and
    an integer mean of no elements (XLA divides by zero to -1) equal single-device TF."""
    mesh = gt.Mesh.create((8,), ("x",))

    def fn(x, empty):
        return (tf.reduce_max(x, 0), tf.reduce_min(x, 1), tf.argmax(x, 0),
                tf.reduce_mean(empty, 0, keepdims=True))

    x = randn(rng, 16, 6)
    x[::3, 1] = np.nan
    x[2, ::2] = np.inf
    args = [x, np.zeros((0, 3), np.int32)]
    got, _ = run_xla(fn, mesh, args, (P("x"), P(None, "x")))
    for i, (g, w) in enumerate(zip(got, single_device(fn, args))):
        assert_close(g, w, f"output {i}")
