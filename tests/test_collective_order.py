"""The order collectives are chained in (backends/schedule.py): LocalBackend with
async_collectives=True chains them by estimated operand readiness; values against
single-device TF."""

import functools

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import base, schedule
from gspmd_tf.backends.local import LocalBackend
from gspmd_tf.backends.xla import XlaBackend

P = gt.PartitionSpec
ASYNC = functools.partial(LocalBackend, async_collectives=True)
# FSDP-style weights (split over "data" too): each layer gathers its weights before use
SPECS = {"w1": P("data", "model"), "w2": P("model", "data")}


def _weights(rng, layers, d, f):
    return [{"w1": (rng.standard_normal((d, f)) / np.sqrt(d)).astype(np.float32),
             "w2": (rng.standard_normal((f, d)) / np.sqrt(f)).astype(np.float32)}
            for _ in range(layers)]


def _step(variables, lr=0.1):
    flat = [layer[n] for layer in variables for n in ("w1", "w2")]

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for layer in variables:
                h = h + tf.matmul(tf.nn.relu(tf.matmul(h, layer["w1"])), layer["w2"])
            loss = tf.reduce_mean(h * h)
        for v, g in zip(flat, tape.gradient(loss, flat)):
            v.assign_sub(lr * g)
        return loss
    return step


def _fsdp_function(mesh, values, backend):
    variables = [{n: gt.Variable(w, mesh, SPECS[n]) for n, w in layer.items()}
                 for layer in values]
    return gt.function(_step(variables), mesh=mesh, in_shardings=(P("data"),),
                       backend=backend), variables


def test_ready_order_prefetches_weight_gathers(mesh, rng):
    """Every layer's weight all-gathers are chained before the first all-reduce of an
    activation, the order is topological, and the nodes tf.function chains by creation
    (variable reads and writes) keep program order."""
    values = _weights(rng, 3, 16, 32)
    f, _ = _fsdp_function(mesh, values, ASYNC)
    program = f.lower(tf.TensorSpec((8, 16))).program.graph
    order = schedule.ready_order(program, LocalBackend(mesh).cost_model)
    assert sorted(order) == list(range(len(program.nodes)))
    position = {index: k for k, index in enumerate(order)}
    for index, node in enumerate(program.nodes):
        for ref in node.inputs:
            assert position[ref.node] < position[index]
    kinds = [program.nodes[i].op for i in order if program.nodes[i].op in
             base.COLLECTIVES]
    in_program = [n.op for n in program.nodes if n.op in base.COLLECTIVES]
    gathers = in_program.count("gt.AllGather")
    assert kinds[:gathers] == ["gt.AllGather"] * gathers, kinds
    assert in_program[:gathers] != kinds[:gathers]  # program order interleaves them
    chained = [i for i in order if schedule._chained(program, program.nodes[i])]
    assert chained == sorted(chained)


@pytest.mark.parametrize("backend", ["local", ASYNC])
def test_fsdp_training_matches_single_device(mesh, rng, backend):
    values = _weights(rng, 3, 16, 32)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    f, variables = _fsdp_function(mesh, values, backend)
    single_vars = [{n: tf.Variable(w) for n, w in layer.items()} for layer in values]
    single = tf.function(_step(single_vars))
    for _ in range(2):
        np.testing.assert_allclose(f(x).numpy(), single(x).numpy(), rtol=1e-5)
    for layer, want in zip(variables, single_vars):
        for n in layer:
            np.testing.assert_allclose(layer[n].numpy(), want[n].numpy(), rtol=1e-5,
                                       atol=1e-6)


def test_loop_with_collectives_and_random_op(mesh, rng):
    """A While whose body all-reduces, a seeded random op and a variable read before and
    after its update: values as single-device TF with the ready order."""
    w = rng.standard_normal((16, 16)).astype(np.float32) / 4
    x = rng.standard_normal((8, 16)).astype(np.float32)

    def run(v):
        def fn(x):
            before = v.read_value()
            h = tf.while_loop(lambda i, h: i < 3,
                              lambda i, h: (i + 1, tf.tanh(tf.matmul(h, before))),
                              (0, x))[1]
            noise = tf.random.uniform((8, 16), seed=3)
            v.assign_add(tf.ones_like(before))
            return h + noise + tf.reduce_sum(v.read_value())
        return fn

    gv = gt.Variable(w, mesh, P("model"))
    f = gt.function(run(gv), mesh=mesh, in_shardings=(P(None, "model"),), backend=ASYNC)
    want = tf.function(run(tf.Variable(w)))(x).numpy()
    np.testing.assert_allclose(f(x).numpy(), want, rtol=1e-5, atol=1e-5)


def test_xla_backend_refuses_the_option(mesh):
    f = gt.function(lambda x: x * 2.0, mesh=mesh,
                    backend=functools.partial(XlaBackend, async_collectives=True))
    with pytest.raises(gt.ShardingError, match="async_collectives"):
        f(np.ones((8, 4), np.float32))
