"""XlaBackend with variable writes compiled in update segments.

Values equal single-device TF, every variable is updated exactly once per step, the
writes sit in update segments (not op by op) while the main segments stay free of
variables, and per-variable program order holds within a segment and across
collectives; on the meshes (8,), (2, 4) and (1, 8).
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import segments
from gspmd_tf.backends.xla import XlaBackend
from gspmd_tf.registry import ASSIGNS_VARIABLE, has_trait
from util import assert_close, assert_like_tf_variable, assert_replicas_equal, randn

P = gt.P
MESHES = [((8,), ("x",)), ((2, 4), ("data", "model")), ((1, 8), ("data", "model"))]
MESH_IDS = ["8", "2x4", "1x8"]
# replicated_once (the default) computes a replicated write's value once and runs the
# writes of such values op by op (segments.cut); without it every write is compiled
ONCE = [True, False]
ONCE_IDS = ["once", "each"]


def plan_of(step, *args):
    """The XLA backend's plan of gt.function `step` (which has run)."""
    return step.lower(*args).compile().plan


def variable_writes_by_place(step, *args):
    """(variable writes inside segments, variable writes run op by op) of gt.function
    `step` (which has run); asserts that only segments with writes touch variables."""
    run = step.lower(*args).compile()
    program, plan = run.program, run.plan
    found = [s for s in plan.steps if isinstance(s, segments.Segment)]
    for segment, function in zip(found, plan.functions):
        writes = any(has_trait(program.nodes[i].op, ASSIGNS_VARIABLE) for i in segment.nodes)
        assert function.touches_variables == writes, segment
    outside = [i for i in plan.steps if not isinstance(i, segments.Segment)]
    count = lambda indices: sum(has_trait(program.nodes[i].op, ASSIGNS_VARIABLE)
                                for i in indices)
    return count(sum((s.nodes for s in found), [])), count(outside)


@pytest.mark.parametrize("once", ONCE, ids=ONCE_IDS)
@pytest.mark.parametrize("shape,axes", MESHES, ids=MESH_IDS)
def test_momentum_step_equals_single_device_with_variables_in_segments(shape, axes, once,
                                                                        rng):
    """An SGD-with-momentum step (reads, assign, assign_sub, assign_add across the
    gradient all-reduces) for three steps: losses and variables equal TF's, and every
    variable write is compiled (without replicated_once)."""
    mesh = gt.Mesh.create(shape, axes)
    a, b = axes[0], axes[-1]
    values = {"w1": randn(rng, 16, 32) * 0.2, "w2": randn(rng, 32, 16) * 0.2}
    x = randn(rng, 8, 16)

    def make_step(w1, w2, m1, m2, count):
        def step(x):
            with tf.GradientTape() as tape:
                h = tf.nn.relu(tf.matmul(x, w1))
                loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - x))
            g1, g2 = tape.gradient(loss, [w1, w2])
            m1.assign(0.9 * m1 + g1)
            m2.assign(0.9 * m2 + g2)
            w1.assign_sub(0.1 * m1.read_value())
            w2.assign_sub(0.1 * m2.read_value())
            count.assign_add(1.0)
            return loss
        return step

    gvars = [gt.Variable(values["w1"], mesh, P(None, b), name="w1"),
             gt.Variable(values["w2"], mesh, P(b, None), name="w2"),
             gt.Variable(np.zeros((16, 32), np.float32), mesh, P(None, b), name="m1"),
             gt.Variable(np.zeros((32, 16), np.float32), mesh, P(b, None), name="m2"),
             gt.Variable(np.zeros((), np.float32), mesh, P(), name="count")]
    step = gt.function(make_step(*gvars), mesh=mesh, in_shardings=(P(a),),
                       backend=functools.partial(XlaBackend, replicated_once=once))
    with tf.device("/device:CPU:0"):
        svars = [tf.Variable(values["w1"]), tf.Variable(values["w2"]),
                 tf.Variable(tf.zeros((16, 32))), tf.Variable(tf.zeros((32, 16))),
                 tf.Variable(0.0)]
        single = tf.function(make_step(*svars), autograph=False)
        for _ in range(3):
            assert_close(step(x).numpy(), single(x).numpy(), "loss")
    for g, s in zip(gvars, svars):
        assert_close(g.numpy(), s.numpy(), g.name)
        assert_replicas_equal(g)
    assert gvars[-1].numpy() == 3.0  # one increment per step, on every device
    inside, outside = variable_writes_by_place(step, x)
    assert inside + outside == 5 and (once or outside == 0), (inside, outside)


@pytest.mark.parametrize("once", ONCE, ids=ONCE_IDS)
@pytest.mark.parametrize("shape,axes", MESHES, ids=MESH_IDS)
def test_reads_see_the_writes_before_them(shape, axes, once, rng):
    """Reads before and after writes of one variable, in one segment and across an
    all-reduce, see exactly the writes program order puts before them."""
    mesh = gt.Mesh.create(shape, axes)
    value = randn(rng, 4, 8)

    def make(v):
        def fn(x):
            before = v.read_value() * 2.0
            v.assign_add(tf.ones_like(v))                            # same segment
            middle = v.read_value()
            v.assign_add(tf.reduce_sum(x) * tf.ones_like(v))         # after an all-reduce
            after = v.read_value() + 1.0
            v.assign(after * before)
            return before, middle, after, v.read_value()
        return fn

    x = randn(rng, 16, 8)
    gv = gt.Variable(value, mesh, P(None, axes[-1]), name="v")
    fn = gt.function(make(gv), mesh=mesh, in_shardings=(P(axes[0]),),
                     backend=functools.partial(XlaBackend, replicated_once=once))
    assert_like_tf_variable(make, gv, value, [t.numpy() for t in fn(x)], (x,))
    inside, outside = variable_writes_by_place(fn, x)
    assert inside + outside == 3 and (once or outside == 0), (inside, outside)


def test_variable_ops_no_longer_cut_segments(rng):
    """Writes of many variables after a data-parallel gradient all-reduce: at most
    three segments (what needs no variable, forward and backward, the update), however
    many variables there are."""
    mesh = gt.Mesh.create((8,), ("x",))
    values = [randn(rng, 8, 8) * 0.3 for _ in range(6)]
    gvars = [gt.Variable(v, mesh, P(), name=f"w{k}") for k, v in enumerate(values)]

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in gvars:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(h * h)
        for w, g in zip(gvars, tape.gradient(loss, gvars)):
            w.assign_sub(0.01 * g)
        return loss

    x = randn(rng, 16, 8)
    f = gt.function(step, mesh=mesh, in_shardings=(P("x"),), backend="xla")
    f(x)
    plan = plan_of(f, x)
    count = len([s for s in plan.steps if isinstance(s, segments.Segment)])
    assert count <= 3, count
