"""The all-reduce combiner: independent small all-reduces merge into one, values unchanged."""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import LocalBackend
from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.spmd import combine
from util import assert_close, assert_replicas_equal

P = gt.P
LAYERS, WIDTH = 8, 8


def init(rng):
    return [rng.standard_normal(s).astype(np.float32) * 0.3
            for _ in range(LAYERS) for s in [(WIDTH, WIDTH), (WIDTH,)]]


def make_step(weights):
    """SGD on a deep narrow MLP: 2 * LAYERS small weights, each gradient one all-reduce
    over the data axis, all independent; the updates read them after the backward pass."""
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for k in range(LAYERS):
                h = tf.tanh(h @ weights[2 * k] + weights[2 * k + 1])
            loss = tf.reduce_mean(tf.square(h))
        grads = tape.gradient(loss, weights)
        for w, g in zip(weights, grads):
            w.assign_sub(0.1 * g)
        return loss
    return step


def counts(low):
    return collections.Counter((c.kind, c.axes) for c in low.collectives())


@pytest.mark.parametrize("threshold, expected", [
    (None, 1),                     # default: every gradient and the loss in one
    ("0", 2 * LAYERS + 1),         # off
    (str(4 * WIDTH), LAYERS + 1),  # biases and the loss merge, matrices stay apart
])
def test_training_step_values_and_all_reduce_counts(monkeypatch, threshold, expected):
    if threshold is not None:
        monkeypatch.setenv("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES", threshold)
    rng = np.random.default_rng(0)
    values = init(rng)
    x = rng.standard_normal((16, WIDTH)).astype(np.float32)
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    weights = [gt.Variable(v, mesh, P(), name=f"w{i}") for i, v in enumerate(values)]
    # TF's collectives (copies are combined alike: test_mlp_step_combines_as_xla)
    step = gt.function(make_step(weights), mesh=mesh, in_shardings=(P(("data", "model")),),
                       backend=functools.partial(LocalBackend, copy_collectives=False))
    losses = [step(x).numpy() for _ in range(3)]
    with tf.device("/device:CPU:0"):
        plain = [tf.Variable(v) for v in values]
        plain_step = tf.function(make_step(plain))
        want = [plain_step(x).numpy() for _ in range(3)]
    assert_close(np.array(losses), np.array(want), "losses")
    for w, p in zip(weights, plain):
        assert_close(w.numpy(), p.numpy(), w.name)
        assert_replicas_equal(w)
    low = step.lower(x)
    assert counts(low) == {("all-reduce", ("data", "model")): expected}, low.report()


def mlp_step(weights):
    """SGD on a 2-layer Megatron MLP (hidden dim split over model): the forward pass
    all-reduces over model, the four gradients and the loss over data."""
    def step(x, y):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(x @ weights[0] + weights[1])
            loss = tf.reduce_mean(tf.square(h @ weights[2] + weights[3] - y))
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(0.1 * g)
        return loss
    return step


@pytest.mark.parametrize("backend", ["local", "xla"])
def test_mlp_step_combines_as_xla(backend):
    # XLA (JAX 0.10.2, 8 CPU devices, same specs) compiles this step to 2 all-reduces:
    # the forward one over model and one over data of the gradients and the loss
    rng = np.random.default_rng(2)
    shapes = [(16, 32), (32,), (32, 16), (16,)]
    specs = [P(None, "model"), P("model"), P("model", None), P()]
    values = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in shapes]
    x, y = (rng.standard_normal((16, 16)).astype(np.float32) for _ in range(2))
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    weights = [gt.Variable(v, mesh, s, name=f"w{i}") for i, (v, s) in
               enumerate(zip(values, specs))]
    step = gt.function(mlp_step(weights), mesh=mesh, in_shardings=(P("data"), P("data")),
                       backend=backend)
    losses = [step(x, y).numpy() for _ in range(2)]
    with tf.device("/device:CPU:0"):
        plain = [tf.Variable(v) for v in values]
        plain_step = tf.function(mlp_step(plain))
        want = [plain_step(x, y).numpy() for _ in range(2)]
    assert_close(np.array(losses), np.array(want), "losses")
    for w, p in zip(weights, plain):
        assert_close(w.numpy(), p.numpy(), w.name)
    low = step.lower(x, y)
    assert counts(low) == {("all-reduce", ("model",)): 1, ("all-reduce", ("data",)): 1}, \
        low.report()


def test_dependent_all_reduces_stay_apart():
    # Megatron layers: each layer's "model" all-reduce feeds the next layer's
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    rng = np.random.default_rng(1)
    ws = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(4)]

    def f(x, *ws):
        for k in range(0, 4, 2):
            x = tf.nn.relu(x @ ws[k]) @ ws[k + 1]
        return x

    g = gt.function(f, mesh=mesh,
                    in_shardings=(P("data"),) + (P(None, "model"), P("model")) * 2)
    args = (rng.standard_normal((4, 8)).astype(np.float32),) + tuple(ws)
    with tf.device("/device:CPU:0"):
        want = tf.function(f)(*args).numpy()
    assert_close(g(*args).numpy(), want)
    assert counts(g.lower(*args)) == {("all-reduce", ("model",)): 2}


class Program:
    """A hand-built SPMD program of float32 vectors."""

    def __init__(self):
        self.graph = Graph()

    def add(self, op, inputs=(), shape=(4,), control=(), **params):
        shapes = [] if shape is None else [shape]
        index = self.graph.add(Node(f"n{len(self.graph.nodes)}", op, inputs,
                                    out_shapes=shapes, out_dtypes=[tf.float32] * len(shapes),
                                    control_inputs=control, params=params))
        return Ref(index, 0)

    def all_reduce(self, x, axes=("data",), reduce_op="sum"):
        return self.add("gt.AllReduce", [x], axes=axes, reduce_op=reduce_op)


def merged_groups(graph, threshold=1 << 20):
    return [item for item in combine._schedule(graph, threshold) if isinstance(item, list)]


def test_groups_by_key_readers_deferred_effects_flush():
    p = Program()
    x = p.add("gt.Input", index=0)
    a = p.all_reduce(x)
    b = p.all_reduce(x, axes=("model",))   # other axes: its own group
    c = p.all_reduce(x, reduce_op="max")   # other reduce op: its own group
    r = p.add("Neg", [a])                   # a pure reader of a: deferred
    d = p.all_reduce(x)                     # joins a
    e = p.all_reduce(r)                     # reads a (through r): flushes {a, d}, opens anew
    g = p.all_reduce(x, axes=("model",))   # joins b
    h = p.add("NoOp", shape=None, control=[e.node])  # an effect reading e: flushes {e}
    i = p.all_reduce(x)                     # a group of its own
    p.graph.outputs = [a, b, c, d, e, g, i]
    order = combine._schedule(p.graph, 1 << 20)
    assert merged_groups(p.graph) == [[a.node, d.node], [b.node, g.node]]
    position = {(item if isinstance(item, int) else tuple(item)): k
                for k, item in enumerate(order)}
    assert position[(a.node, d.node)] < position[r.node] < position[e.node] < position[h.node]
    assert sorted(i for item in order for i in ([item] if isinstance(item, int) else item)) \
        == list(range(len(p.graph.nodes)))  # every node scheduled once
    merged = combine.combine_all_reduces(p.graph, threshold=1 << 20)
    assert [node.op for node in merged.nodes].count("gt.AllReduce") == 5  # 7 - 2 merged
    for index, node in enumerate(merged.nodes):  # inputs come before their readers
        assert all(ref.node < index for ref in node.inputs)
        assert all(k < index for k in node.control_inputs)
    assert [merged.shape(ref) for ref in merged.outputs] == [(4,)] * 7


def test_the_threshold_bounds_each_member_and_the_sum():
    p = Program()
    x = p.add("gt.Input", index=0)
    refs = [p.all_reduce(x) for _ in range(2 * combine.GROUP_FACTOR + 1)]  # 16 bytes each
    big = p.add("gt.Input", index=1, shape=(5,))
    refs.append(p.all_reduce(big))  # 20 bytes: above a threshold of 16, never merged
    p.graph.outputs = refs
    # GROUP_FACTOR members fill a group; the last one is left alone
    n = combine.GROUP_FACTOR
    assert merged_groups(p.graph, threshold=16) == [list(range(1, n + 1)),
                                                    list(range(n + 1, 2 * n + 1))]
    # at 20 the large one joins too; a group then holds 20 * n // 16 of the small ones
    per = 20 * n // 16
    assert merged_groups(p.graph, threshold=20) == [
        list(range(1, per + 1)), list(range(per + 1, 2 * n + 2)) + [big.node + 1]]
    assert merged_groups(p.graph, threshold=0) == []
    assert combine.combine_all_reduces(p.graph, threshold=0) is p.graph


def test_the_threshold_setting_is_checked(monkeypatch):
    monkeypatch.setenv("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES", "lots")
    with pytest.raises(ValueError, match="GSPMD_TF_ALL_REDUCE_COMBINE_BYTES='lots'"):
        combine.threshold_bytes(1024)
    monkeypatch.setenv("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES", "0")
    assert combine.threshold_bytes(1024) == 0  # the setting wins over the default
    monkeypatch.delenv("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES")
    assert combine.threshold_bytes(1024) == 1024
