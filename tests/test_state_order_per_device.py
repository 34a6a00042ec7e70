"""The local backend's per-device graph orders state itself (backends/ordering.py), without
tf.function's automatic control dependencies: variable reads and writes in program order
on every device, stateful ops chained, unused effects still run; and the all-reduce
combiner merges copy all-reduces as it merges TF's collectives (as XLA on every backend)."""

import collections
import functools

import numpy as np
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import LocalBackend
from gspmd_tf.backends import ordering
from gspmd_tf.graph.ir import Graph, Node, Ref
from util import assert_close, assert_like_tf_variable

P = gt.P


def rows(seed, shape=(8, 4)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _compiled(f, *args):
    """The local backend's compiled program of gt.function `f` on `args`."""
    return f.lower(*args).compile()


def test_reads_and_writes_of_one_variable_keep_program_order(mesh):
    def make(v):
        def f(x):
            before = v.read_value()       # read, then a write after it
            v.assign(x)
            written = v.read_value()      # read after the write
            v.assign_add(before * 2.0)    # write after a read and a write
            v.assign_sub(x * 0.5)         # write after a write
            return before, written, v.read_value()
        return f

    initial, x = rows(0), rows(1)
    v = gt.Variable(initial, mesh, P("data", "model"), name="v")
    step = gt.function(make(v), mesh=mesh, in_shardings=(P("data", "model"),),
                       backend="local")
    got = [t.numpy() for t in step(x)]
    assert_like_tf_variable(make, v, initial, got, [x])
    program = _compiled(step, x)
    assert program.function.definition.attr["_disable_acd"].b  # no ACD: ordered by us


def test_two_variables_swap_through_reads(mesh):
    def make(v1, v2):
        def f():
            a, b = v1.read_value(), v2.read_value()
            v1.assign(b)
            v2.assign(a * 3.0)
            return v1.read_value() + v2.read_value(), a
        return f

    first, second = rows(2), rows(3)
    v1 = gt.Variable(first, mesh, P("model"), name="v1")
    v2 = gt.Variable(second, mesh, P(None, "data"), name="v2")
    step = gt.function(make(v1, v2), mesh=mesh)
    got = [[t.numpy() for t in step()] for _ in range(2)]
    with tf.device("/device:CPU:0"):
        r1, r2 = tf.Variable(first), tf.Variable(second)
        ref = tf.function(make(r1, r2), autograph=False)
        want = [[t.numpy() for t in ref()] for _ in range(2)]
    for k in range(2):
        for g, w in zip(got[k], want[k]):
            assert_close(g, w, f"step {k}")
    assert_close(v1.numpy(), r1.numpy(), "v1")
    assert_close(v2.numpy(), r2.numpy(), "v2")


def test_unused_assign_still_runs(mesh):
    def make(v):
        def f(x):
            v.assign(x * 2.0)  # nothing returned depends on it
            return (x + 1.0,)
        return f

    initial, x = rows(4), rows(5)
    v = gt.Variable(initial, mesh, P("data"), name="unused")
    step = gt.function(make(v), mesh=mesh, in_shardings=(P("data"),))
    got = [t.numpy() for t in step(x)]
    assert_like_tf_variable(make, v, initial, got, [x])


def test_stateful_ops_without_resources_run_in_program_order_per_device(mesh):
    log = []

    def tagged(tag):
        def call(v):
            log.append(tag)
            return v * 2.0
        return call

    def f(x):
        # the second call does not read the first's result: only the stateful chain
        # orders them on a device
        first = tf.py_function(tagged("first"), [x], tf.float32)
        second = tf.py_function(tagged("second"), [x + 1.0], tf.float32)
        first.set_shape(x.shape)
        second.set_shape(x.shape)
        return first + second

    x = rows(6)
    step = gt.function(f, mesh=mesh, in_shardings=(P("data"),))
    for _ in range(3):
        log.clear()
        assert_close(step(x).numpy(), 2.0 * x + 2.0 * (x + 1.0))
        # once per call (handlers/py_functions.py); each device runs its "first"
        # before its "second", so the first device to call "second" has called "first"
        assert collections.Counter(log) == {"first": 1, "second": 1}
        assert all(log[:k].count("second") <= log[:k].count("first")
                   for k in range(len(log) + 1)), log


def test_ordering_from_the_program():
    """The edges program_ordering finds on a hand-made program: per resource (through
    an Identity), reads after the last write, writes after the reads since; stateful ops
    without resources chained; unused reads need not run."""
    g = Graph()
    f32 = tf.float32

    def add(name, op, inputs=(), dtypes=(f32,), attrs=None):
        return g.add(Node(name, op, [Ref(i, 0) for i in inputs], attrs=attrs,
                          out_shapes=[()] * len(dtypes), out_dtypes=list(dtypes),
                          params={"index": len(g.nodes)} if op == "gt.Input" else None))

    handle = add("h", "gt.Input", dtypes=(tf.resource,))
    other = add("h2", "gt.Input", dtypes=(tf.resource,))
    alias = add("alias", "Identity", [handle], dtypes=(tf.resource,))
    value = add("x", "gt.Input")
    read = add("read", "ReadVariableOp", [handle])
    write = add("write", "AssignVariableOp", [alias, value], dtypes=())
    read2 = add("read2", "ReadVariableOp", [handle])
    unused = add("unused_read", "ReadVariableOp", [other])
    write2 = add("write2", "AssignAddVariableOp", [handle, read2], dtypes=())
    print1 = add("print1", "EagerPyFunc", [value])
    print2 = add("print2", "EagerPyFunc", [value])
    g.outputs = [Ref(read, 0)]
    result = ordering.program_ordering(g, range(len(g.nodes)))
    assert result.after == {write: (read,), read2: (write,), write2: (write, read2),
                            print2: (print1,)}
    assert result.must_run == {read, write, read2, write2, print1, print2}
    assert unused not in result.must_run


def _all_reduce_counts(lowered):
    return collections.Counter(c.kind for c in lowered.collectives())


def test_copy_all_reduces_are_combined_as_tf_collectives_are(mesh, monkeypatch):
    monkeypatch.delenv("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES", raising=False)
    values = [rows(10 + k, (4, 4)) for k in range(4)]

    def make(weights):
        def step(x):
            with tf.GradientTape() as tape:
                h = x
                for w in weights:
                    h = tf.tanh(h @ w)
                loss = tf.reduce_mean(tf.square(h))
            for w, grad in zip(weights, tape.gradient(loss, weights)):
                w.assign_sub(0.1 * grad)
            return loss
        return step

    x = rows(20, (8, 4))
    results = {}
    for name, backend in [("copies", "local"),
                          ("tf", functools.partial(LocalBackend, copy_collectives=False))]:
        weights = [gt.Variable(v, mesh, P(), name=f"w{k}") for k, v in enumerate(values)]
        step = gt.function(make(weights), mesh=mesh, in_shardings=(P("data"),),
                           backend=backend)
        loss = step(x).numpy()
        lowered = step.lower(x)
        ops = collections.Counter(n.op for n in lowered.program.graph.nodes)
        results[name] = (loss, [w.numpy() for w in weights], _all_reduce_counts(lowered),
                         ops)
    with tf.device("/device:CPU:0"):
        plain = [tf.Variable(v) for v in values]
        want = tf.function(make(plain), autograph=False)(x).numpy()
    for name, (loss, weights, _, _) in results.items():
        assert_close(loss, want, f"{name}: loss")
        for w, p in zip(weights, plain):
            assert_close(w, p.numpy(), f"{name}: weight")
    # copies and TF's collectives alike: the gradients and the loss in one all-reduce,
    # through a concat and a split
    for counts, ops in (results["copies"][2:], results["tf"][2:]):
        assert counts["all-reduce"] == 1
        assert ops["ConcatV2"] >= 1 and ops["SplitV"] >= 1


def test_an_explicit_combine_threshold_applies_to_copies_too(mesh, monkeypatch):
    monkeypatch.setenv("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES", str(256 * 1024))

    def f(x, y):
        return tf.reduce_sum(x), tf.reduce_sum(y)

    x, y = rows(30), rows(31)
    step = gt.function(f, mesh=mesh, in_shardings=(P("data"), P("data")))
    got = [t.numpy() for t in step(x, y)]
    assert_close(got[0], x.sum())
    assert_close(got[1], y.sum())
    assert _all_reduce_counts(step.lower(x, y))["all-reduce"] == 1
