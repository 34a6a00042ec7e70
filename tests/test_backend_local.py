"""LocalBackend: hand-built SPMD programs against numpy references over the shards."""

import functools
import os

os.environ.setdefault("GSPMD_TF_COLLECTIVE_TIMEOUT", "10")  # a hung collective fails fast

import sys
import time
import types

import numpy as np
import pytest
import tensorflow as tf

from gspmd_tf.devices import configure_cpu_devices

configure_cpu_devices(8)  # conftest normally has; a no-op then

from gspmd_tf import timeouts  # noqa: E402
from gspmd_tf.backends import LocalBackend, collectives  # noqa: E402
from gspmd_tf.errors import ShardingError  # noqa: E402
from gspmd_tf.graph.ir import Graph, Node, Ref  # noqa: E402
from gspmd_tf.mesh import Mesh  # noqa: E402
from util import Background, run_together, session_environ  # noqa: E402


class Program:
    """Builds an SPMD program Graph node by node."""

    def __init__(self):
        self.graph = Graph()

    def _add(self, op, inputs, shapes, dtypes, attrs=None, params=None):
        index = self.graph.add(Node(f"n{len(self.graph.nodes)}", op, inputs, attrs=attrs,
                                    out_shapes=shapes, out_dtypes=dtypes, params=params))
        return Ref(index, 0)

    def input(self, index, shape, dtype=tf.float32):
        """gt.Input: this device's shard of program input `index`."""
        ref = self._add("gt.Input", [], [shape], [dtype], params={"index": index})
        self.graph.inputs.append(ref)
        return ref

    def gt(self, op, x, shape=None, **params):
        """A gt.* collective on x; shape defaults to x's."""
        shape = self.graph.shape(x) if shape is None else shape
        return self._add("gt." + op, [x], [shape], [self.graph.dtype(x)], params=params)

    def shard_index(self, axes):
        """gt.ShardIndex along axes."""
        return self._add("gt.ShardIndex", [], [()], [tf.int32], params={"axes": axes})

    def tf(self, fn, *inputs):
        """The last op of fn(*placeholders), traced in a scratch graph, on `inputs`.

        Its other inputs must be constants (an axis, say); they become Const nodes.
        """
        with tf.Graph().as_default():
            args = [tf.compat.v1.placeholder(self.graph.dtype(r), self.graph.shape(r))
                    for r in inputs]
            op = fn(*args).op
            position = {id(a): i for i, a in enumerate(args)}
            refs = [inputs[position[id(t)]] if id(t) in position else self._node(t.op)
                    for t in op.inputs]
        return self._node(op, refs)

    def const(self, value):
        """A Const node."""
        with tf.Graph().as_default():
            return self._node(tf.constant(value).op)

    def _node(self, op, inputs=()):
        return self._add(op.type, inputs, [tuple(t.shape) for t in op.outputs],
                         [t.dtype for t in op.outputs], attrs=dict(op.node_def.attr))

    def outputs(self, *refs):
        """Sets the program outputs; returns the graph."""
        self.graph.outputs = list(refs)
        return self.graph


@pytest.fixture(scope="module")
def mesh():
    return Mesh.create((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def mesh3():
    return Mesh.create((2, 2, 2), ("x", "y", "z"))


@pytest.fixture(params=[True, False], ids=["copies", "tf_collectives"])
def local_backend(request):
    """LocalBackend with the collectives of this process's CPU devices as copies (the
    default) or as TF's collective ops (what groups across workers and bodies use)."""
    return functools.partial(LocalBackend, copy_collectives=request.param)


def shards(mesh, shape, seed=0):
    """One random float32 array per device."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(mesh.size)]


def per_group(mesh, axes, fn):
    """fn(device, group_row) for every device, as a list indexed by device id."""
    out = [None] * mesh.size
    for row in mesh.groups(axes):
        for d in row:
            out[d] = fn(d, list(row))
    return out


def check(got, want):
    for d, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5, err_msg=f"device {d}")


REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def test_all_reduce_over_each_axis_and_both(mesh, local_backend):
    cases = [(("data",), "sum"), (("model",), "max"), (("data", "model"), "sum"),
             (("model", "data"), "min"), (("model",), "prod")]
    p = Program()
    x = p.input(0, (3, 5))
    graph = p.outputs(*[p.gt("AllReduce", x, axes=axes, reduce_op=op) for axes, op in cases])
    xs = shards(mesh, (3, 5))
    outs = local_backend(mesh).compile(graph)([xs])
    for out, (axes, op) in zip(outs, cases):
        check(out, per_group(mesh, axes, lambda d, row: REDUCE[op]([xs[i] for i in row], 0)))


def test_all_reduce_over_axis_subset_of_3d_mesh(mesh3, local_backend):
    p = Program()
    x = p.input(0, (4,))
    graph = p.outputs(p.gt("AllReduce", x, axes=("x", "z"), reduce_op="sum"),
                      p.gt("AllReduce", x, axes=("y",), reduce_op="max"))
    xs = shards(mesh3, (4,))
    outs = local_backend(mesh3).compile(graph)([xs])
    check(outs[0], per_group(mesh3, ("x", "z"), lambda d, row: np.sum([xs[i] for i in row], 0)))
    check(outs[1], per_group(mesh3, ("y",), lambda d, row: np.max([xs[i] for i in row], 0)))


def test_all_gather_dims_and_axis_orders(mesh, local_backend):
    cases = [(("model",), 0), (("model",), 1), (("data", "model"), 1), (("model", "data"), 0),
             (("model", "data"), 1)]
    p = Program()
    x = p.input(0, (2, 3))
    gathered = []
    for axes, dim in cases:
        shape = [2, 3]
        shape[dim] *= mesh.axes_size(axes)
        gathered.append(p.gt("AllGather", x, tuple(shape), axes=axes, dim=dim))
    xs = shards(mesh, (2, 3))
    outs = local_backend(mesh).compile(p.outputs(*gathered))([xs])
    for out, (axes, dim) in zip(outs, cases):
        # mesh.groups rows are in shard-index order: chunk i comes from row[i].
        check(out, per_group(mesh, axes,
                             lambda d, row: np.concatenate([xs[i] for i in row], dim)))


def all_to_all_reference(xs, row, d, split_dim, concat_dim):
    k = len(row)
    mine = row.index(d)
    return np.concatenate([np.split(xs[i], k, split_dim)[mine] for i in row], concat_dim)


def test_all_to_all_moves_split_between_dims(mesh, local_backend):
    cases = [(("model",), 0, 1), (("model", "data"), 0, 1), (("data", "model"), 1, 0),
             (("model",), 2, 0), (("model", "data"), 1, 1)]
    p = Program()
    x = p.input(0, (8, 8, 4))
    results = []
    for axes, split_dim, concat_dim in cases:
        shape = [8, 8, 4]
        shape[split_dim] //= mesh.axes_size(axes)
        shape[concat_dim] *= mesh.axes_size(axes)
        results.append(p.gt("AllToAll", x, tuple(shape), axes=axes, split_dim=split_dim,
                            concat_dim=concat_dim))
    xs = shards(mesh, (8, 8, 4))
    outs = local_backend(mesh).compile(p.outputs(*results))([xs])
    for out, (axes, split_dim, concat_dim) in zip(outs, cases):
        check(out, per_group(mesh, axes, lambda d, row: all_to_all_reference(
            xs, row, d, split_dim, concat_dim)))


def test_groups_not_in_device_id_order(mesh3, local_backend):
    # Rows of groups(("z", "x")) are [0, 4, 1, 5], [2, 6, 3, 7]: TF ranks members by
    # device name, so chunks must be reordered into shard order around TF's collectives.
    axes = ("z", "x")
    assert [list(r) for r in mesh3.groups(axes)] == [[0, 4, 1, 5], [2, 6, 3, 7]]
    p = Program()
    x = p.input(0, (4, 2))
    graph = p.outputs(p.gt("AllGather", x, (4, 8), axes=axes, dim=1),
                      p.gt("AllToAll", x, (1, 8), axes=axes, split_dim=0, concat_dim=1),
                      p.gt("ReduceScatter", x, (1, 2), axes=axes, dim=0, reduce_op="sum"))
    xs = shards(mesh3, (4, 2))
    outs = local_backend(mesh3).compile(graph)([xs])
    check(outs[0], per_group(mesh3, axes,
                             lambda d, row: np.concatenate([xs[i] for i in row], 1)))
    check(outs[1], per_group(mesh3, axes, lambda d, row: all_to_all_reference(
        xs, row, d, 0, 1)))
    check(outs[2], per_group(mesh3, axes, lambda d, row: np.split(
        np.sum([xs[i] for i in row], 0), 4)[row.index(d)]))


def test_reduce_scatter(mesh, local_backend):
    cases = [(("model",), 1, "sum"), (("model", "data"), 0, "max"), (("data",), 0, "sum")]
    p = Program()
    x = p.input(0, (8, 4))
    results = []
    for axes, dim, op in cases:
        shape = [8, 4]
        shape[dim] //= mesh.axes_size(axes)
        results.append(p.gt("ReduceScatter", x, tuple(shape), axes=axes, dim=dim,
                            reduce_op=op))
    xs = shards(mesh, (8, 4))
    outs = local_backend(mesh).compile(p.outputs(*results))([xs])
    for out, (axes, dim, op) in zip(outs, cases):
        check(out, per_group(mesh, axes, lambda d, row: np.split(
            REDUCE[op]([xs[i] for i in row], 0), len(row), dim)[row.index(d)]))


def test_permute_cyclic_shift_and_non_targets(mesh, local_backend):
    # Each device sends to the next one along "model"; the second permute only feeds
    # data row 0 from row 1, so row 1 receives zeros.
    shift = [(int(row[i]), int(row[(i + 1) % 4])) for row in mesh.groups(("model",))
             for i in range(4)]
    partial = [(int(mesh.device_ids[1, m]), int(mesh.device_ids[0, m])) for m in range(4)]
    p = Program()
    x = p.input(0, (3,))
    graph = p.outputs(p.gt("Permute", x, pairs=shift), p.gt("Permute", x, pairs=partial))
    xs = shards(mesh, (3,))
    outs = local_backend(mesh).compile(graph)([xs])
    source = {t: s for s, t in shift}
    check(outs[0], [xs[source[d]] for d in range(8)])
    check(outs[1], [xs[d + 4] if d < 4 else np.zeros(3) for d in range(8)])


def test_shard_index(mesh, local_backend):
    p = Program()
    graph = p.outputs(*[p.shard_index(axes) for axes in [("data",), ("model", "data"), ()]])
    outs = local_backend(mesh).compile(graph)([])
    for out, axes in zip(outs, [("data",), ("model", "data"), ()]):
        assert [int(t) for t in out] == [mesh.shard_index(d, axes) for d in range(8)]


def test_tf_ops_between_collectives_and_repeated_runs(mesh, local_backend):
    p = Program()
    x = p.input(0, (2, 4))
    w = p.input(1, (3, 4))
    h = p.tf(lambda a, b: tf.matmul(a, b, transpose_b=True), x, w)  # attrs carry over
    h = p.gt("AllReduce", h, axes=("model",), reduce_op="sum")
    two = p.const(np.float32(2.0))
    p.graph.nodes[two.node].control_inputs = [h.node]
    h = p.tf(tf.multiply, h, two)
    h = p.tf(lambda a, b: tf.concat([a, b], axis=1), h, h)
    y = p.gt("AllGather", h, (4, 6), axes=("data",), dim=0)
    index = p.shard_index(("model",))
    run = local_backend(mesh).compile(p.outputs(y, index))
    for seed in range(5):
        xs, ws = shards(mesh, (2, 4), seed), shards(mesh, (3, 4), seed + 100)

        def local(d):
            row = mesh.groups(("model",))[d // 4]
            return np.tile(2 * np.sum([xs[i] @ ws[i].T for i in row], 0), (1, 2))

        ys, indices = run([xs, [tf.constant(v) for v in ws]])
        check(ys, per_group(mesh, ("data",),
                            lambda d, row: np.concatenate([local(i) for i in row])))
        assert [int(t) for t in indices] == [d % 4 for d in range(8)]


def test_dtypes_tf_collectives_lack(mesh, local_backend):
    p = Program()
    flags = p.input(0, (2,), tf.bool)
    half = p.input(1, (2,), tf.bfloat16)
    graph = p.outputs(p.gt("AllGather", flags, (8,), axes=("model",), dim=0),
                      p.gt("AllReduce", flags, axes=("data",), reduce_op="max"),
                      p.gt("AllToAll", flags, axes=("data",), split_dim=0, concat_dim=0),
                      p.gt("AllReduce", half, axes=("model",), reduce_op="sum"))
    rng = np.random.default_rng(1)
    bits = [rng.random(2) < 0.5 for _ in range(8)]
    halves = [np.float32(rng.integers(-8, 8, 2)) for _ in range(8)]
    outs = local_backend(mesh).compile(graph)([bits, [tf.constant(h, tf.bfloat16)
                                                     for h in halves]])
    assert outs[0][0].dtype == tf.bool and outs[3][0].dtype == tf.bfloat16
    check(outs[0], per_group(mesh, ("model",), lambda d, row: np.concatenate(
        [bits[i] for i in row])))
    check(outs[1], per_group(mesh, ("data",), lambda d, row: np.any([bits[i] for i in row], 0)))
    check(outs[2], per_group(mesh, ("data",), lambda d, row: all_to_all_reference(
        bits, row, d, 0, 0)))
    check([tf.cast(t, tf.float32) for t in outs[3]], per_group(
        mesh, ("model",), lambda d, row: np.sum([halves[i] for i in row], 0)))


def test_outputs_live_on_their_devices(mesh, local_backend):
    p = Program()
    x = p.input(0, (2,))
    graph = p.outputs(x, p.gt("AllReduce", x, axes=("model",), reduce_op="sum"))
    outs = local_backend(mesh).compile(graph)([shards(mesh, (2,))])
    for out in outs:
        # `.device` names the function call's device; the memory is on the shard's own.
        assert [tf.DeviceSpec.from_string(t.backing_device).device_index for t in out] == [
            tf.DeviceSpec.from_string(name).device_index for name in mesh.devices]


@pytest.mark.parametrize("copies", [True, False])
def test_copies_replace_tf_collectives_within_the_process(mesh, copies):
    """With copy_collectives the program holds no TF collective op and an all-reduce's
    members hold the same bits (one AddN per group); without, CollectiveReduceV2."""
    p = Program()
    x = p.input(0, (64,))
    graph = p.outputs(p.gt("AllReduce", x, axes=("data", "model"), reduce_op="sum"),
                      p.gt("ReduceScatter", x, (16,), axes=("model",), dim=0,
                           reduce_op="sum"))
    run = LocalBackend(mesh, copy_collectives=copies).compile(graph)
    kinds = {op.type for op in run.function.graph.get_operations()}
    assert ("CollectiveReduceV2" in kinds) != copies
    assert ("AddN" in kinds) == copies
    xs = shards(mesh, (64,), seed=3)
    outs = run([xs])
    assert len({t.numpy().tobytes() for t in outs[0]}) == 1
    check(outs[0], [np.sum(xs, 0)] * mesh.size)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_many_calls_do_not_pile_up_threads(mesh):
    # TF's per-op collective timeouts would start 2 threads per device per collective per
    # call, each living for the whole timeout; the watchdog must not.
    p = Program()
    x = p.input(0, (4,))
    y = p.gt("AllReduce", x, axes=("model",), reduce_op="sum")
    run = LocalBackend(mesh, collective_timeout=30).compile(
        p.outputs(p.gt("AllGather", y, (8,), axes=("data",), dim=0)))
    xs = shards(mesh, (4,))
    run([xs])
    before = len(os.listdir(f"/proc/{os.getpid()}/task"))
    for _ in range(30):
        out = run([xs])
    after = len(os.listdir(f"/proc/{os.getpid()}/task"))
    assert after - before < 16, (before, after)
    check(out[0], per_group(mesh, ("data",), lambda d, row: np.concatenate(
        [np.sum([xs[j] for j in mesh.groups(("model",))[i // 4]], 0) for i in row])))


def test_watchdog_cancels_late_calls_and_aborts_only_as_a_last_resort(monkeypatch):
    aborted = []
    fake = types.SimpleNamespace(abort_collective_ops=lambda code, message: aborted.append(
        (code, message)))
    monkeypatch.setattr(collectives, "context", types.SimpleNamespace(context=lambda: fake))
    watchdog = collectives.Watchdog(grace=5.0)
    with watchdog.guard(0.05, "a quick call") as call:
        pass
    assert not call.timed_out and not call.manager.is_cancelled
    generation = collectives.generation()
    with watchdog.guard(0.2, "a slow call") as call:
        time.sleep(0.6)
    assert call.timed_out and call.manager.is_cancelled and not aborted
    assert collectives.generation() == generation + 1  # group keys retired
    assert "a slow call did not finish within 0.2 s" in call.timeout_error().message
    with watchdog.guard(0, "an unguarded call") as call:
        time.sleep(0.1)
    assert call is None
    watchdog.grace = 0.1
    with watchdog.guard(0.1, "a call that ignores cancellation"):
        time.sleep(0.6)
    assert len(aborted) == 1 and "restart" in aborted[0][1], aborted


@Background
def timeout_probe_run():
    """tests/timeout_probe.py's finished run."""
    probe = os.path.join(os.path.dirname(__file__), "timeout_probe.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done, = run_together([[sys.executable, probe]], timeout=300,
                         env=dict(session_environ(), PYTHONPATH=root))
    return done


def test_a_hung_call_times_out_and_the_process_stays_usable():
    # One device's collective never gets its peers; in its own process, so that a
    # regression cannot abort this process's collectives or hang the suite.
    done = timeout_probe_run.result()
    assert done.returncode == 0 and "usable after the timeout" in done.stdout, (
        done.stdout[-2000:] + done.stderr[-4000:])


def test_timeouts_are_finite_by_default_and_checked(monkeypatch):
    monkeypatch.delenv("GSPMD_TF_COLLECTIVE_TIMEOUT")
    assert timeouts.default_timeout() == timeouts.DEFAULT_TIMEOUT == 300
    monkeypatch.setenv("GSPMD_TF_COLLECTIVE_TIMEOUT", "2.5")
    assert timeouts.default_timeout() == 2.5
    monkeypatch.setenv("GSPMD_TF_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="GSPMD_TF_COLLECTIVE_TIMEOUT='soon'"):
        timeouts.default_timeout()
    for bad in (-1, "5", float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="collective_timeout"):
            timeouts.check_timeout(bad)
    assert timeouts.check_timeout(0) == 0.0


def test_errors(mesh):
    p = Program()
    x = p.input(0, (2,))
    with pytest.raises(ShardingError, match="send twice"):
        LocalBackend(mesh).compile(p.outputs(p.gt("Permute", x, pairs=[(0, 1), (2, 1)])))
    p = Program()
    p.input(1, (2,))
    with pytest.raises(ShardingError, match="indices"):
        LocalBackend(mesh).compile(p.outputs())
    p = Program()
    x = p.input(0, (6,))
    with pytest.raises(ShardingError, match="equal chunks"):
        LocalBackend(mesh).compile(p.outputs(p.gt("AllToAll", x, axes=("model",), split_dim=0,
                                                  concat_dim=0)))
    with pytest.raises(ShardingError, match="mesh with devices"):
        LocalBackend(Mesh.abstract((2,), ("a",)))
