"""The local backend runs a replicated value's pure ops once per group of devices holding
it equal (LocalBackend(replicated_once=True), backends/replicas.py)."""

import functools

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import LocalBackend, replicas
from gspmd_tf.graph.ir import Graph, Node, Ref
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import Mesh

from util import assert_close


def _add(graph, op, inputs=(), shape=(4,), dtype=tf.float32, params=None):
    index = graph.add(Node(f"n{len(graph.nodes)}", op, list(inputs), out_shapes=[shape],
                           out_dtypes=[dtype], params=params or {}))
    return Ref(index, 0)


def _input(graph, index, shape, layout=None):
    params = {"index": index} if layout is None else {"index": index, "layout": layout}
    ref = _add(graph, "gt.Input", shape=shape, params=params)
    graph.inputs.append(ref)
    return ref


def test_classes_follow_input_layouts_shard_indices_and_collectives(mesh):
    """Mesh 2x4 ("data", "model"): device d = 4 * data + model."""
    g = Graph()
    by_model = _input(g, 0, (4,), Layout((("model",),)))
    unknown = _input(g, 1, (4,))  # no layout: every device its own
    index = _add(g, "gt.ShardIndex", shape=(), dtype=tf.int32, params={"axes": ("data",)})
    summed = _add(g, "gt.AllReduce", [unknown], params={"axes": ("data",),
                                                        "reduce_op": "sum"})
    both = _add(g, "AddV2", [by_model, summed])
    mixed = _add(g, "AddV2", [by_model, unknown])
    scattered = _add(g, "gt.ReduceScatter", [by_model], shape=(1,),
                     params={"axes": ("model",), "dim": 0, "reduce_op": "sum"})
    drawn = _add(g, "RandomUniform", [_add(g, "Const", shape=(1,), dtype=tf.int32)],
                 params={})
    replicated = _input(g, 2, (4,), Layout(((),)))
    read = _add(g, "ReadVariableOp", [replicated])
    classes = replicas.replica_classes(g, mesh, tuple(range(8)))
    every = list(range(8))
    assert list(classes[by_model.node]) == [d % 4 for d in every]
    assert list(classes[unknown.node]) == every
    assert list(classes[index.node]) == [0] * 4 + [4] * 4
    # an all-reduce over "data" sums the pair (m, 4 + m): equal within the pair
    assert list(classes[summed.node]) == [d % 4 for d in every]
    assert list(classes[both.node]) == [d % 4 for d in every]
    assert list(classes[mixed.node]) == every
    # a reduce-scatter over "model" of a value equal across "data": position matters
    assert list(classes[scattered.node]) == [d % 4 for d in every]
    assert list(classes[drawn.node]) == every  # stateful: never assumed equal
    assert list(classes[read.node]) == [0] * 8  # a replicated variable's reads
    # only devices of `local` are classed (the others: another worker's, or not CPUs)
    assert replicas.replica_classes(g, mesh, (1, 5))[by_model.node] == (
        None, 1, None, None, None, 1, None, None)


def test_runs_once_takes_pure_ops_that_compute():
    g = Graph()
    x = _input(g, 0, (64, 64))
    pure = [g.nodes[_add(g, "Mul", [x, x], shape=shape).node] for shape in ((64, 64), ())]
    const = g.nodes[_add(g, "Const", shape=(64, 64)).node]
    identity = g.nodes[_add(g, "Identity", [x], shape=(64, 64)).node]
    stateful = g.nodes[_add(g, "RandomUniform", [x], shape=(64, 64)).node]
    handle = g.nodes[_add(g, "ZerosLike", [x], shape=(), dtype=tf.resource).node]
    collective = g.nodes[_add(g, "gt.AllReduce", [x], shape=(64, 64)).node]
    variable = _add(g, "gt.Input", shape=(), dtype=tf.resource, params={"index": 1})
    read = g.nodes[_add(g, "ReadVariableOp", [variable], shape=(64, 64)).node]
    assert all(replicas.runs_once(n) for n in pure + [read])
    assert not any(replicas.runs_once(n)
                   for n in (const, identity, stateful, handle, collective))


def _adam_like_step(x, y, w, m):
    """One step of a least-squares model with a momentum update of its weights."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    grad = tape.gradient(loss, w)
    m.assign(0.9 * m + 0.1 * grad)
    w.assign_sub(0.01 * m / (tf.sqrt(tf.abs(m)) + 1e-3))
    return loss


KINDS = ("Sqrt", "ReadVariableOp", "AssignVariableOp", "AssignSubVariableOp")


@pytest.mark.parametrize("shape,w_spec", [((8,), gt.P()), ((2, 4), gt.P(None, "model"))],
                         ids=["data_parallel", "data_model"])
def test_update_reads_and_writes_run_once_per_replica_group_with_tf_values(shape, w_spec):
    """The momentum update of the weights (replicated over "data"), the reads of the
    variables and their writes run once per group of devices holding them equal (one
    copy of a block per group), the values those of single-device TF on every device;
    without replica classes (replicated_once=False) every device runs its own on
    private copies, with the same values."""
    axes = ("data",) if len(shape) == 1 else ("data", "model")
    mesh = Mesh.create(shape, axes)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    y = rng.standard_normal((16, 64)).astype(np.float32)
    w0 = rng.standard_normal((64, 64)).astype(np.float32)
    want_w, want_m = tf.Variable(w0), tf.Variable(np.zeros_like(w0))
    graphs = {}
    for once in (True, False):
        w = gt.Variable(w0, mesh, w_spec)
        m = gt.Variable(np.zeros_like(w0), mesh, w_spec)
        step = gt.function(lambda x, y: _adam_like_step(x, y, w, m), mesh=mesh,
                           in_shardings=(gt.P("data"), gt.P("data")),
                           backend=functools.partial(LocalBackend, replicated_once=once))
        losses = [float(step(x, y).numpy()) for _ in range(3)]
        if once:
            want = [float(_adam_like_step(x, y, want_w, want_m).numpy()) for _ in range(3)]
        assert_close(losses, want, f"losses, replicated_once={once}")
        assert_close(w.numpy(), want_w.numpy(), "weights")
        assert_close(m.numpy(), want_m.numpy(), "momentum")
        for variable in (w, m):  # the copies of a block hold the same bits
            blocks = {}
            for d, shard in enumerate(variable.shards):
                key = mesh.shard_index(d, ("model",)) if len(shape) == 2 else 0
                blocks.setdefault(key, []).append(shard.numpy())
            for copies in blocks.values():
                for other in copies[1:]:
                    np.testing.assert_array_equal(other, copies[0])
        run = step.lower(x, y).compile()
        graphs[once] = {kind: [op for op in run.function.graph.get_operations()
                               if op.type == kind] for kind in KINDS}
        assert run.shares_variable_copies == once
    groups = 1 if len(shape) == 1 else 4  # devices holding different blocks of w
    for kind in KINDS:
        once, every = graphs[True][kind], graphs[False][kind]
        assert len(once) * 8 == len(every) * groups and once, kind
        assert {op.device for op in once} == {mesh.devices[d] for d in range(groups)}


def test_outputs_of_ops_run_once_live_on_their_devices(mesh):
    g = Graph()
    x = _input(g, 0, (4096,), Layout(((),)))
    g.outputs = [_add(g, "Mul", [x, x], shape=(4096,))]
    value = np.arange(4096, dtype=np.float32)
    run = LocalBackend(mesh).compile(g)
    out, = run([[value] * 8])
    assert sum(op.type == "Mul" for op in run.function.graph.get_operations()) == 1
    for d, t in enumerate(out):
        np.testing.assert_array_equal(t.numpy(), value * value)
        assert tf.DeviceSpec.from_string(t.backing_device).device_index == \
            tf.DeviceSpec.from_string(mesh.devices[d]).device_index


def test_a_loop_writing_a_replicated_variable_runs_on_private_copies_with_tf_values(mesh):
    """A while body that writes a variable would write the shared copy on every device:
    such a program runs each device on a copy of its own (the owner's is the shared
    one), kept between its runs and refreshed after a sharing program or an eager
    assign wrote the shared copy, with single-device TF's values."""
    w0 = np.arange(8, dtype=np.float32)
    x = np.linspace(0.0, 1.0, 8).astype(np.float32)
    v, plain = gt.Variable(w0, mesh, gt.P()), tf.Variable(w0)

    def accumulate(variable):
        def run(x):
            def body(i, total):  # each device reads its own copy in the body
                variable.assign_add(x * tf.cast(i + 1, tf.float32))
                return [i + 1, total + variable.read_value()]
            _, total = tf.while_loop(lambda i, t: i < 3, body, [tf.constant(0), x * 0.0])
            return variable.read_value() * 2.0, total
        return run

    def scale(variable):
        def run():
            variable.assign(variable * 0.5)
            return variable.read_value()
        return run

    step = gt.function(accumulate(v), mesh=mesh, in_shardings=(gt.P(),),
                       out_shardings=(gt.P(), gt.P(("data", "model"))))
    want = tf.function(accumulate(plain))
    halve, halve_plain = gt.function(scale(v), mesh=mesh), tf.function(scale(plain))
    assert not step.lower(x).compile().shares_variable_copies
    assert halve.lower().compile().shares_variable_copies
    def check():
        for got, expected in zip(step(x), want(x)):
            assert_close(got.numpy(), expected.numpy(), "output")

    for _ in range(2):
        check()
    private = list(v._private)  # pylint: disable=protected-access
    # the shared copy written elsewhere (a sharing program, an eager assign): the private
    # copies, kept between runs, take its value before the next run on them
    for update, update_plain in ((halve, halve_plain),
                                 (lambda: v.assign(w0 + 1.0), lambda: plain.assign(w0 + 1.0))):
        update(), update_plain()
        check()
    assert [a is b for a, b in zip(private, v._private)] == [True] * len(private)  # pylint: disable=protected-access
    assert len(v.copies()) == 1
    assert_close(v.numpy(), plain.numpy(), "variable")
