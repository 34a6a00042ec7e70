"""XlaBackend with the local backend's copy collectives and replicated-once execution.

Values equal single-device TF with both options on and off, forward programs and a
training step with gt.Variables, on the meshes 8x1, 2x4, 4x2 and 1x8 (uneven dims
included); and the structure they promise: collectives of a CPU mesh made of copies (no
CollectiveReduceV2), a segment whose outputs several devices hold equal called once for
them (an optimizer's update arithmetic), every variable written on every device.
"""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import segments
from gspmd_tf.backends.xla import XlaBackend
from gspmd_tf.registry import ASSIGNS_VARIABLE, has_trait
from util import assert_close, assert_replicas_equal, randn, single_device

P = gt.P
MESHES = [(8, 1), (2, 4), (4, 2), (1, 8)]
MESH_IDS = ["8x1", "2x4", "4x2", "1x8"]
# (copy_collectives, replicated_once)
OPTIONS = [(True, True), (False, False), (True, False), (False, True)]
OPTION_IDS = ["copies+once", "tf+each", "copies+each", "tf+once"]


def xla(copy_collectives, replicated_once):
    """gt.function's backend: XlaBackend with the two options."""
    return functools.partial(XlaBackend, copy_collectives=copy_collectives,
                             replicated_once=replicated_once)


def segment_calls(run):
    """{segment function name: [device of each call]} of the compiled program `run`."""
    names = {tf.compat.as_str(f.concrete.name) for f in run.plan.functions}
    calls = collections.defaultdict(list)
    for op in run.function.graph.get_operations():
        if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
            name = op.get_attr("f").name
            if name in names:
                calls[name].append(tf.DeviceSpec.from_string(op.device).device_index)
    return calls


def op_types(run):
    """The op types of the traced program of `run`."""
    return {op.type for op in run.function.graph.get_operations()}


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("shape", MESHES, ids=MESH_IDS)
def test_forward_programs_equal_single_device(shape, options, rng):
    """A Megatron MLP (all-reduce over "model"), a data-parallel mean (all-reduce over
    "data"), a gather and uneven shards (10 rows, 10 columns over 4 or 8 devices)."""
    mesh = gt.Mesh.create(shape, ("data", "model"))

    def fn(x, w1, w2, rows, cols):
        mlp = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
        mean = tf.reduce_mean(mlp * mlp, axis=0)
        uneven = tf.reduce_sum(tf.tanh(tf.matmul(rows, cols)), axis=1)
        return mlp, mean, uneven, x * 2.0

    args = [randn(rng, 16, 24), randn(rng, 24, 32), randn(rng, 32, 8),
            randn(rng, 10, 6), randn(rng, 6, 10)]
    specs = (P("data", None), P(None, "model"), P("model", None), P("data", None),
             P(None, "model"))
    f = gt.function(fn, mesh=mesh, in_shardings=specs, out_shardings=(
        P("data"), P(), P("data"), P()), backend=xla(*options))
    got = [t.numpy() for t in tf.nest.flatten(f(*args))]
    for k, (g, w) in enumerate(zip(got, single_device(fn, args))):
        assert_close(g, w, f"output {k}")


def _train(shape, options, rng, steps=2):
    """A momentum SGD step of a 2-layer MLP, data parallel over "data", Megatron over
    "model" (hidden 10: uneven over 4 and 8 devices; batch 12: uneven over 8), run
    `steps` times beside tf.Variables on one device: asserts equal losses, variables
    and replicas; returns the compiled program."""
    mesh = gt.Mesh.create(shape, ("data", "model"))
    values = [randn(rng, 16, 10) * 0.3, randn(rng, 10, 6) * 0.3,
              np.zeros((16, 10), np.float32), np.zeros((), np.float32)]
    x = randn(rng, 12, 16)

    def make_step(w1, w2, m1, count):
        def step(x):
            with tf.GradientTape() as tape:
                h = tf.nn.relu(tf.matmul(x, w1))
                loss = tf.reduce_mean(tf.square(tf.matmul(h, w2)))
            g1, g2 = tape.gradient(loss, [w1, w2])
            m1.assign(0.9 * m1 + g1)
            w1.assign_sub(0.1 * m1.read_value())
            w2.assign_sub(0.1 * g2 + 0.01 * g2 * g2)
            count.assign_add(1.0)
            return loss
        return step

    gvars = [gt.Variable(values[0], mesh, P(None, "model"), name="w1"),
             gt.Variable(values[1], mesh, P("model", None), name="w2"),
             gt.Variable(values[2], mesh, P(None, "model"), name="m1"),
             gt.Variable(values[3], mesh, P(), name="count")]
    step = gt.function(make_step(*gvars), mesh=mesh, in_shardings=(P("data"),),
                       backend=xla(*options))
    with tf.device("/device:CPU:0"):
        svars = [tf.Variable(v) for v in values]
        single = tf.function(make_step(*svars), autograph=False)
        for k in range(steps):
            assert_close(step(x).numpy(), single(x).numpy(), f"loss {k}")
    for g, s in zip(gvars, svars):
        assert_close(g.numpy(), s.numpy(), g.name)
        assert_replicas_equal(g)
    assert gvars[-1].numpy() == steps  # one increment per step, on every device
    return step.lower(x).compile()


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("shape", MESHES, ids=MESH_IDS)
def test_training_step_equals_single_device(shape, options, rng):
    _train(shape, options, rng)


def test_copy_collectives_on_a_cpu_mesh(rng):
    """On a CPU mesh the collectives are copies: no TF collective op in the program;
    with copy_collectives=False they are TF's (CollectiveReduceV2)."""
    runs = {}
    for copies in (True, False):
        mesh = gt.Mesh.create((2, 4), ("data", "model"))
        f = gt.function(lambda x, w: tf.matmul(x, w), mesh=mesh,
                        in_shardings=(P("data", "model"), P("model", None)),
                        out_shardings=(P("data", None),), backend=xla(copies, True))
        x, w = randn(rng, 8, 16), randn(rng, 16, 4)
        assert_close(f(x, w).numpy(), x @ w, "product")
        runs[copies] = op_types(f.lower(x, w).compile())
    assert not any(t.startswith("Collective") for t in runs[True]), runs[True]
    assert "AddN" in runs[True]
    assert "CollectiveReduceV2" in runs[False]


@pytest.mark.parametrize("once", [True, False], ids=["once", "each"])
def test_data_parallel_update_arithmetic_runs_once(once, rng):
    """On 8x1 every weight is replicated: the update arithmetic (the segment after the
    gradient all-reduce) is called once for all 8 devices, and the writes of its values
    run op by op on each device (a compiled segment of writes only would fuse nothing);
    the forward/backward matmuls (data-sharded) are called once per device (pure
    segments run on the first CPU device, see xla._compile_device). Without
    replicated_once every segment is called 8 times and the writes are compiled, in
    segments called on each device."""
    run = _train((8, 1), (True, once), rng)
    calls = segment_calls(run)
    found = [s for s in run.plan.steps if isinstance(s, segments.Segment)]
    counts = collections.defaultdict(list)  # kind -> the calls' devices of each segment
    for segment, function in zip(found, run.plan.functions):
        ops = {run.program.nodes[i].op for i in segment.nodes}
        kind = "writes" if function.touches_variables else "matmuls" if "MatMul" in ops \
            else "after all-reduce" if any(run.program.nodes[r.node].op == "gt.AllReduce"
                                           for r in segment.inputs) else "other"
        counts[kind].append(sorted(calls[tf.compat.as_str(function.concrete.name)]))
    assert counts["matmuls"] and counts["after all-reduce"], counts
    assert all(d == [0] * 8 for d in counts["matmuls"]), counts
    writes = [op for op in run.function.graph.get_operations()
              if has_trait(op.type, ASSIGNS_VARIABLE)]
    if once:
        assert all(d == [0] for d in counts["after all-reduce"]), counts
        assert not counts["writes"], counts
        # m1, w1, w2 and the step count, on each device
        assert sorted(tf.DeviceSpec.from_string(op.device).device_index
                      for op in writes) == sorted(list(range(8)) * 4)
    else:
        assert counts["writes"] and not writes, counts
        assert all(d == list(range(8)) for d in counts["writes"]), counts
        assert all(d == [0] * 8 for d in counts["after all-reduce"] + counts["other"]), \
            counts


def test_megatron_update_arithmetic_runs_once_per_model_shard(rng):
    """On 2x4 a weight split over "model" is equal on the two "data" rows: the update
    arithmetic of such weights runs 4 times, not 8 (segments of one pattern of equal
    devices, segments.cut's `shared`)."""
    run = _train((2, 4), (True, True), rng)
    calls = segment_calls(run)
    count = [len(calls[tf.compat.as_str(f.concrete.name)]) for f in run.plan.functions]
    assert 4 in count, count
