"""The cost model (gspmd_tf/cost_model.py): links per mesh axis from the workers holding
the devices, seconds per collective kind, reduce-scatter as the backend emits it, compute,
the combiner's threshold; and the planner and combiner reading it."""

import collections
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf import cost_model
from gspmd_tf.backends import base, schedule
from gspmd_tf.backends.local import LocalBackend
from gspmd_tf.backends.xla import XlaBackend
from gspmd_tf.cost_model import CROSS_WORKER, INTRA_PROCESS, CostModel, Link
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import SubAxis
from gspmd_tf.spmd import planner

P = gt.P
KIB = 1024
# two workers of 4 devices, worker-major (as gt.Mesh.create lays out a cluster): "data"
# spans the workers, "model" stays in each
TWO_WORKERS = [0, 0, 0, 0, 1, 1, 1, 1]


def two_worker_mesh():
    return gt.Mesh.abstract((2, 4), ("data", "model"), workers=TWO_WORKERS)


def test_axes_whose_groups_span_workers_are_cross_worker():
    model = CostModel.for_mesh(two_worker_mesh())
    assert model.links == {"data": CROSS_WORKER, "model": INTRA_PROCESS}
    # workers laid out the other way round: now "model" crosses them
    other = gt.Mesh.abstract((2, 4), ("data", "model"), workers=[0, 0, 1, 1, 0, 0, 1, 1])
    assert CostModel.for_mesh(other).links == {"data": INTRA_PROCESS, "model": CROSS_WORKER}
    one = CostModel.for_mesh(gt.Mesh.abstract((2, 4), ("data", "model")))
    assert one.links == {"data": INTRA_PROCESS, "model": INTRA_PROCESS}


def test_mesh_workers_come_from_the_device_names():
    assert gt.Mesh.create((2, 4), ("data", "model")).workers.tolist() == [0] * 8
    from gspmd_tf.mesh import _worker_numbers
    names = [f"/job:worker/replica:0/task:{t}/device:CPU:{i}" for t in (1, 0) for i in (0, 1)]
    assert _worker_numbers(names).tolist() == [0, 0, 1, 1]
    with pytest.raises(gt.ShardingError, match="workers .* must be 8 integers >= 0"):
        gt.Mesh.abstract((2, 4), ("data", "model"), workers=[0, 1])
    assert gt.Mesh.abstract((2, 4), ("a", "b")) != gt.Mesh.abstract((2, 4), ("a", "b"),
                                                                     workers=TWO_WORKERS)


@pytest.mark.parametrize("kind, wire", [
    ("all-gather", 3 * KIB),             # (k - 1) x the operand
    ("all-reduce", 2 * 3 * KIB // 4),    # 2 (k - 1) / k
    ("all-to-all", 3 * KIB // 4),        # (k - 1) / k
    ("collective-permute", KIB),         # the operand
    ("reduce-scatter", 2 * 3 * KIB // 4),  # not native: an all-reduce, then a slice
])
def test_seconds_per_kind_on_the_intra_process_axis(kind, wire):
    model = CostModel.for_mesh(two_worker_mesh())
    assert model.wire_bytes(kind, KIB, ("model",)) == wire
    assert model.collective_seconds(kind, KIB, ("model",)) == \
        INTRA_PROCESS.latency + wire / INTRA_PROCESS.bandwidth


def test_the_cross_worker_axis_and_groups_over_it_run_at_the_slow_link():
    model = CostModel.for_mesh(two_worker_mesh())
    assert model.collective_seconds("all-gather", KIB, ("data",)) == \
        CROSS_WORKER.latency + KIB / CROSS_WORKER.bandwidth
    # a group over both axes crosses the workers; a sub-axis runs at its axis's link
    assert model.link(("data", "model")) == CROSS_WORKER
    assert model.link((SubAxis("model", 1, 2, 4),)) == INTRA_PROCESS
    assert model.group_size(("data", SubAxis("model", 1, 2, 4))) == 4
    assert model.collective_seconds("all-reduce", KIB, ("data", "model")) == \
        CROSS_WORKER.latency + (2 * 7 * KIB // 8) / CROSS_WORKER.bandwidth
    # the same bytes cost more across the workers
    assert model.collective_seconds("all-gather", KIB, ("data",)) > \
        model.collective_seconds("all-gather", KIB, ("model",))


def test_a_native_reduce_scatter_sends_half_of_an_all_reduce():
    mesh = gt.Mesh.abstract((8,), ("x",))
    emulated, native = CostModel.for_mesh(mesh), CostModel.for_mesh(
        mesh, native_reduce_scatter=True)
    assert emulated.wire_bytes("reduce-scatter", 8 * KIB, ("x",)) == 2 * 7 * KIB
    assert native.wire_bytes("reduce-scatter", 8 * KIB, ("x",)) == 7 * KIB
    assert native != emulated and hash(native) != hash(emulated)


def test_compute_seconds_and_the_latency_bound_size():
    model = CostModel({"x": 8})
    assert model.compute_seconds(0) == cost_model.KERNEL_SECONDS
    assert model.compute_seconds(1.1e10, kernels=2) == pytest.approx(
        2 * cost_model.KERNEL_SECONDS + 1.0)
    # latency x bandwidth: 256 KiB in one process, where the combiner stopped paying
    # (benchmarks/RESULTS.md, "All-reduce combiner")
    assert model.combine_threshold_bytes() == 256 * KIB
    cross = CostModel.for_mesh(two_worker_mesh())
    assert cross.combine_threshold_bytes() == int(CROSS_WORKER.latency_bytes)
    assert cross.combine_threshold_bytes(("model",)) == 256 * KIB


def test_bad_models_are_refused():
    with pytest.raises(gt.ShardingError, match=r"links name axes \['y'\]"):
        CostModel({"x": 2}, {"y": INTRA_PROCESS})
    with pytest.raises(gt.ShardingError, match="x's bandwidth is 0"):
        CostModel({"x": 2}, {"x": Link(1e-3, 0)})
    with pytest.raises(gt.ShardingError, match="unknown collective kind 'broadcast'"):
        CostModel({"x": 2}).wire_bytes("broadcast", 8, ("x",))


def test_the_planner_keeps_traffic_off_the_cross_worker_axis_for_equal_bytes():
    # [8, 8] float32 split over "i" moved to a split over "w": in one process a
    # collective-permute (every device sends its 128 bytes, half of them to the other
    # worker); across workers ("w" spans them) a gather over "i" and a local slice: the
    # same 128 bytes, none crossing the workers
    square = dict(shape=(2, 2), axis_names=("w", "i"))
    src, dst = Layout((("i",), ())), Layout((("w",), ()))
    in_one = planner.plan(src, dst, (8, 8), tf.float32, gt.Mesh.abstract(**square))
    across = planner.plan(src, dst, (8, 8), tf.float32,
                          gt.Mesh.abstract(**square, workers=[0, 0, 1, 1]))
    assert [type(s) for s in in_one] == [planner.CollectivePermute]
    assert across == (planner.AllGather(0, ("i",), 128, 2), planner.LocalSlice(0, ("w",)))
    assert planner.cost(in_one).bytes == planner.cost(across).bytes == 128


def test_lowering_on_two_workers_keeps_the_reshard_on_the_intra_worker_axis():
    def f(x):
        return x * 2.0

    spec = [tf.TensorSpec((8, 8), tf.float32)]
    axes = ("w", "i")
    kinds = {}
    for name, workers in (("one", None), ("two", [0, 0, 1, 1])):
        mesh = gt.Mesh.abstract((2, 2), axes, workers=workers)
        low = gt.lower(f, mesh, in_shardings=(P("i"),), out_shardings=(P("w"),), args=spec)
        kinds[name] = [(c.kind, c.axes) for c in low.collectives()]
    assert kinds["one"] == [("collective-permute", ())]  # a permute names no axes
    assert kinds["two"] == [("all-gather", ("i",))]


def test_the_combiner_merges_below_the_models_threshold(monkeypatch):
    # 8 weight gradients x^T g of 192 KiB (64 x 768 float32), each a partial sum over
    # "data" all-reduced: latency-bound in one process (below 256 KiB: all merged into
    # one), bandwidth-bound across workers (above ~164 KiB: left apart)
    monkeypatch.delenv("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES", raising=False)

    def f(x, *gs):
        return [tf.matmul(x, g, transpose_a=True) for g in gs]

    spec = [tf.TensorSpec((1024, 64), tf.float32)] + [tf.TensorSpec((1024, 768),
                                                                    tf.float32)] * 8
    shardings = dict(in_shardings=(P("data"),) * 9, out_shardings=(P(),) * 8, args=spec)
    gradient = 64 * 768 * 4
    found = {}
    for name, workers in (("one", None), ("two", TWO_WORKERS)):
        mesh = gt.Mesh.abstract((2, 4), ("data", "model"), workers=workers)
        low = gt.lower(f, mesh, **shardings)
        found[name] = collections.Counter((c.kind, c.bytes) for c in low.collectives())
    assert found["one"] == {("all-reduce", 8 * gradient): 1}
    assert found["two"] == {("all-reduce", gradient): 8}
    # the setting still wins
    monkeypatch.setenv("GSPMD_TF_ALL_REDUCE_COMBINE_BYTES", str(1 << 20))
    low = gt.lower(f, two_worker_mesh(), **shardings)
    assert [(c.kind, c.bytes) for c in low.collectives()] == [("all-reduce", 8 * gradient)]


def test_a_backends_native_reduce_scatter_brings_back_xlas_plan():
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    native = CostModel.for_mesh(mesh, native_reduce_scatter=True)
    src = Layout(((), ()), ("data", "model"))
    steps = planner.plan(src, Layout((("model",), ())), (16, 32), tf.float32, mesh, native)
    assert [type(s) for s in steps] == [planner.ReduceScatter, planner.AllReduce]
    np.testing.assert_equal(planner.plan_estimate(src, Layout((("model",), ())), (16, 32),
                                                  tf.float32, mesh, native),
                            planner.seconds(steps, native))


class _ModelledBackend(LocalBackend):
    """The local backend, its cost model built with `options` (CostModel.for_mesh)."""

    def __init__(self, mesh, copy_collectives=True, **options):
        super().__init__(mesh, copy_collectives=copy_collectives)
        self.options = options

    @property
    def capabilities(self):
        return dataclasses.replace(super().capabilities,
                                   cost_model=CostModel.for_mesh(self.mesh, **self.options))


def _modelled(copy_collectives=True, **options):
    """A backend factory (mesh -> backend) of _ModelledBackend."""
    return lambda mesh: _ModelledBackend(mesh, copy_collectives, **options)


def test_the_local_backend_prices_its_copy_reduce_scatter_as_native():
    """Copies among this process's CPU devices do a true reduce-scatter; TF's collective
    ops (copy_collectives=False) an all-reduce and a slice."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    assert LocalBackend(mesh).cost_model.native_reduce_scatter
    assert XlaBackend(mesh).cost_model.native_reduce_scatter
    assert not LocalBackend(mesh, copy_collectives=False).cost_model.native_reduce_scatter


def _partial_sum_to_split(x, w):
    """x @ w summed over the split contraction dim, wanted split over "model"."""
    return tf.matmul(x, w)


def test_the_planner_reads_the_backends_cost_model(rng):
    """A partial sum over both axes wanted split over "model": a reduce-scatter over
    "model" and an all-reduce over "data" on a backend whose model has a native
    reduce-scatter (XLA's plan), one all-reduce (and a slice) where it has not; the
    values equal single-device TF either way."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    args = [rng.standard_normal((16, 16)).astype(np.float32),
            rng.standard_normal((16, 32)).astype(np.float32)]
    want = tf.matmul(*args).numpy()
    for native, kinds in ((True, ["reduce-scatter", "all-reduce"]), (False, ["all-reduce"])):
        f = gt.function(_partial_sum_to_split, mesh=mesh,
                        in_shardings=(P(None, ("data", "model")), P(("data", "model"))),
                        out_shardings=(P("model"),),
                        backend=_modelled(native_reduce_scatter=native))
        assert [c.kind for c in f.lower(*args).collectives()] == kinds
        np.testing.assert_allclose(f(*args).numpy(), want, rtol=1e-5, atol=1e-5)


def test_the_combiner_reads_the_backends_cost_model():
    """TF's collective ops (no copies): 8 gradient all-reduces of 192 KiB merge below the
    model's latency-bound size (256 KiB in one process) and stay apart on a model of
    links with a tenth of the latency."""
    def f(x, *gs):
        return [tf.matmul(x, g, transpose_a=True) for g in gs]

    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    specs = [tf.TensorSpec((1024, 64))] + [tf.TensorSpec((1024, 768))] * 8
    counts = {}
    for latency in (INTRA_PROCESS.latency, INTRA_PROCESS.latency / 10):
        fast = Link(latency, INTRA_PROCESS.bandwidth)
        low = gt.function(f, mesh=mesh, in_shardings=(P("data"),) * 9,
                          out_shardings=(P(),) * 8,
                          backend=_modelled(copy_collectives=False, intra=fast)).lower(*specs)
        counts[latency] = len(low.collectives())
    assert counts == {INTRA_PROCESS.latency: 1, INTRA_PROCESS.latency / 10: 8}


def test_the_scheduler_reads_the_cost_model():
    """Two independent branches, each ending in a collective: a dot of many
    multiply-adds (all-reduced) and a chain of elementwise kernels (all-gathered).
    Launches priced high put the dot branch's collective first; multiply-adds priced
    high, the elementwise branch's."""
    def f(x, w, y):
        for _ in range(6):
            y = y * 2.0 + 1.0
        return tf.matmul(x, w), y

    mesh = gt.Mesh.create((2,), ("x",))
    specs = [tf.TensorSpec((8, 64)), tf.TensorSpec((64, 64)), tf.TensorSpec((8, 64))]
    program = gt.lower(f, mesh, (P(None, "x"), P("x", None), P("x")), args=specs,
                       out_shardings=(P(), P())).program.graph

    def collectives_in_order(**options):
        order = schedule.ready_order(program, CostModel.for_mesh(mesh, **options))
        return [program.nodes[i].op for i in order if program.nodes[i].op in base.COLLECTIVES]

    assert collectives_in_order(kernel_seconds=1e-3) == ["gt.AllReduce", "gt.AllGather"]
    assert collectives_in_order(kernel_seconds=0.0, multiply_adds_per_second=1e3) == \
        ["gt.AllGather", "gt.AllReduce"]
