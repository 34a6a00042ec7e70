"""The reshard planner: emit(plan) gives exactly the target shards; the plans it picks.

XLA's answers below were read from the collectives of XLA's compiled HLO (JAX 0.10.2 on 8
host CPU devices) by benchmarks/xla_collectives.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        /work/jaxref/bin/python benchmarks/xla_collectives.py
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, strategies as st

import gspmd_tf as gt
from gspmd_tf.backends import LocalBackend
from gspmd_tf.cost_model import CostModel
from gspmd_tf.layout import Layout, ceil_div
from gspmd_tf.mesh import Mesh
from gspmd_tf.spmd import planner
from gspmd_tf.spmd.planner import AllGather, AllToAll, LocalSlice, cost, plan
from gspmd_tf.spmd.program import Local, ProgramBuilder
from gspmd_tf.spmd.reshard import reshard
from util import check_partitioned, randn

MESHES = {
    (8,): ("x",),
    (2, 4): ("data", "model"),
    (4, 2): ("a", "b"),
    (2, 2, 2): ("x", "y", "z"),
}
_MESH_CACHE = {}


def mesh_of(shape, meshes=MESHES):
    """The mesh of `shape` with the axis names `meshes` gives it (made once)."""
    key = (shape, meshes[shape])
    if key not in _MESH_CACHE:
        _MESH_CACHE[key] = Mesh.create(shape, meshes[shape])
    return _MESH_CACHE[key]


def L(*dims, partial=(), reduce_op="sum"):
    return Layout(tuple(tuple(d) for d in dims), tuple(partial), reduce_op)


# ------------------------------------------------------------------------ exact shards

def block(mesh, layout, shape, device):
    """The global index ranges device `device` holds under `layout`."""
    out = []
    for n, axes in zip(shape, layout.dims):
        size = ceil_div(n, mesh.axes_size(axes))
        start = min(n, mesh.shard_index(device, axes) * size)
        out.append(slice(start, min(n, start + size)))
    return tuple(out)


def source_shards(mesh, layout, value, rng):
    """Each device's padded shard of `value` in `layout`; padding is garbage. A partial
    layout splits the value into per-device terms whose reduction over the partial axes
    is the value (sum: the index-0 device holds value - the others' random terms; max:
    the others hold smaller values)."""
    local = layout.local_shape(mesh, value.shape)
    shards = []
    for d in range(mesh.size):
        shard = rng.integers(-1000, 1000, local).astype(np.float32)  # garbage padding
        box = block(mesh, layout, value.shape, d)
        part = value[box]
        if layout.partial and mesh.shard_index(d, layout.partial):
            part = part - rng.integers(0 if layout.reduce_op == "sum" else 1, 5, part.shape)
        shard[tuple(slice(0, s.stop - s.start) for s in box)] = part
        shards.append(shard)
    if layout.partial and layout.reduce_op == "sum":
        for row in mesh.groups(layout.partial):
            box = block(mesh, layout, value.shape, row[0])
            inside = tuple(slice(0, s.stop - s.start) for s in box)
            others = sum(shards[d][inside] for d in row[1:])
            shards[row[0]][inside] = value[box] - others
    return shards


def run_reshard(mesh, src, dst, value, rng):
    b = ProgramBuilder(mesh)
    dtype = tf.as_dtype(value.dtype)
    ref = b.input(0, src.local_shape(mesh, value.shape), dtype)
    out = reshard(b, Local(ref, src, value.shape, dtype), dst)
    assert out.layout == dst
    b.graph.outputs.append(out.ref)
    shards = source_shards(mesh, src, value, rng)
    return LocalBackend(mesh).compile(b.graph)([shards])[0]


def check_exact(mesh, src, dst, value, rng):
    got = run_reshard(mesh, src, dst, value, rng)
    local = dst.local_shape(mesh, value.shape)
    for d in range(mesh.size):
        shard = got[d].numpy()
        assert shard.shape == local, (d, shard.shape, local)
        box = block(mesh, dst, value.shape, d)
        inside = tuple(slice(0, s.stop - s.start) for s in box)
        np.testing.assert_array_equal(shard[inside], value[box],
                                      err_msg=f"device {d}: {src} -> {dst}")


def reshard_cases(meshes=MESHES, max_size=9, unnamed=()):
    """Strategy: a mesh shape of `meshes`, a global shape (dims up to `max_size`, uneven
    likely), and two layouts (src maybe partial) that never name the axes `unnamed`."""
    @st.composite
    def cases(draw):
        mesh_shape = draw(st.sampled_from(sorted(meshes)))
        rank = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(1, max_size), min_size=rank, max_size=rank)))

        def layout(allow_partial):
            dims = [[] for _ in range(rank)]
            partial = []
            for name in draw(st.permutations(meshes[mesh_shape])):
                where = draw(st.integers(-2 if allow_partial else -1, rank - 1))
                if name in unnamed:
                    continue
                if where >= 0:
                    dims[where].append(name)
                elif where == -2:
                    partial.append(name)
            return L(*dims, partial=partial)

        return mesh_shape, shape, layout(True), layout(False)
    return cases()


@given(reshard_cases(), st.integers(0, 2**31 - 1))
def test_emit_plan_gives_exactly_the_target_shards(case, seed):
    mesh_shape, shape, src, dst = case
    mesh = mesh_of(mesh_shape)
    rng = np.random.default_rng(seed)
    value = rng.integers(-100, 100, shape).astype(np.float32)
    check_exact(mesh, src, dst, value, rng)


@pytest.mark.parametrize("mesh_shape, shape, src, dst", [
    ((2, 4), (6, 10), L(("model",), ()), L((), ("model",))),          # uneven all-to-all
    ((2, 4), (7, 5), L(("data",), ()), L(("data", "model"), ())),     # nested uneven slice
    ((2, 4), (7, 5), L(("data", "model"), ()), L(("data",), ())),     # nested uneven gather
    ((2, 4), (5, 9, 8), L((), ("data", "model"), ()), L((), (), ("data", "model"))),
    ((2, 4), (16, 3), L(("data", "model"), ()), L(("model",), ())),   # reorder + gather
    ((2, 2, 2), (5, 6), L(("x",), ("y",)), L(("y",), ("x",))),         # swap: permute
    ((2, 4), (6, 5), L((), (), partial=("model",)), L(("model",), ())),  # reduce-scatter
    ((2, 4), (6, 5), L(("data",), (), partial=("model",), reduce_op="max"), L((), ())),
    ((2, 4), (7, 5), L((), (), partial=("data", "model")), L(("model",), ())),
    ((2, 2, 2), (5, 3), L((), ("z",), partial=("x", "y")), L(("y", "x"), ("z",))),
    # several source and target dims in one all-to-all: even, crossed, uneven, three
    ((2, 4), (4, 8, 6, 4), L(("data",), ("model",), (), ()), L((), (), ("data",), ("model",))),
    ((2, 4), (4, 8, 4, 6), L(("data",), ("model",), (), ()), L((), (), ("model",), ("data",))),
    ((2, 4), (3, 6, 5, 7), L(("data",), (), ("model",), ()), L((), ("model",), (), ("data",))),
    ((2, 2, 2), (2, 3, 2, 4, 5, 2), L(("x",), ("y",), ("z",), (), (), ()),
     L((), (), (), ("z",), ("x",), ("y",))),
])
def test_exact_on_chosen_cases(mesh_shape, shape, src, dst, rng):
    value = np.random.default_rng(0).integers(-100, 100, shape).astype(np.float32)
    check_exact(mesh_of(mesh_shape), src, dst, value, rng)


@pytest.fixture
def rng():
    return np.random.default_rng(1)


# ------------------------------------------------------------------------ chosen plans

XLA_MESH = Mesh.abstract((2, 4), ("data", "model"))
XLA_NAME = {AllGather: "all-gather", AllToAll: "all-to-all",
            planner.CollectivePermute: "collective-permute",
            planner.ReduceScatter: "reduce-scatter", planner.AllReduce: "all-reduce"}

# XLA's collectives (kind, operand bytes per device, group size) for constraining a
# float32 tensor of `shape` from the first layout to the second on the 2x4 mesh (the
# scalar all-reduce of the script's final sum left out); benchmarks/xla_collectives.py,
# command at the top of this file.
XLA_RESHARDS = {
    "two_axes_one_all_to_all": ((8, 16, 32), L((), ("data", "model"), ()),
                                L((), (), ("data", "model")), [("all-to-all", 2048, 8)]),
    "uneven_all_to_all": ((6, 10), L(("model",), ()), L((), ("model",)),
                          [("all-to-all", 96, 4)]),
    "slice_before_gather": ((16, 32), L(("data",), ()), L((), ("model",)),
                            [("all-gather", 1024, 2)]),
    "reorder_then_gather": ((16, 32), L(("data", "model"), ()), L(("model",), ()),
                            [("collective-permute", 256, 1), ("all-gather", 256, 2)]),
    "both_axes_move_right": ((8, 16, 32), L(("data",), ("model",), ()),
                             L((), ("data",), ("model",)),
                             [("all-to-all", 2048, 4), ("all-to-all", 2048, 2)]),
    # XLA's all-to-all of several source and target dims at once
    "two_dims_one_all_to_all": ((8, 16, 32, 8), L(("data",), ("model",), (), ()),
                                L((), (), ("data",), ("model",)), [("all-to-all", 16384, 8)]),
    "crossed_dims_one_all_to_all": ((8, 16, 32, 8), L(("data",), ("model",), (), ()),
                                    L((), (), ("model",), ("data",)),
                                    [("all-to-all", 16384, 8)]),
    # XLA warns "involuntary full rematerialization" and gathers the whole tensor
    "xla_rematerializes": ((8, 16, 32), L(("data", "model"), (), ()),
                           L((), ("data",), ("model",)), [("all-gather", 2048, 8)]),
}
_STEP_OF = {"all-gather": lambda b, k: AllGather(0, (), b, k),
            "all-to-all": lambda b, k: AllToAll((), 0, 1, b, k),
            "collective-permute": lambda b, k: planner.CollectivePermute((), b, k),
            "all-reduce": lambda b, k: planner.AllReduce((), b, k)}


def collectives_of(steps):
    """(XLA kind, operand bytes per device) of a plan's collectives."""
    return [(XLA_NAME[type(s)], s.bytes_in) for s in steps if type(s) in XLA_NAME]


def xla_moved_bytes(collectives):
    """Bytes XLA's collectives move per device, priced by the planner's cost model."""
    return cost([_STEP_OF[kind](nbytes, k) for kind, nbytes, k in collectives]).bytes


@pytest.mark.parametrize("name", sorted(XLA_RESHARDS))
def test_reshard_moves_no_more_than_xla(name):
    shape, src, dst, xla = XLA_RESHARDS[name]
    steps = plan(src, dst, shape, tf.float32, XLA_MESH)
    assert cost(steps).bytes <= xla_moved_bytes(xla), (steps, xla)


def test_reshard_collectives_match_xla():
    for name in ("two_axes_one_all_to_all", "uneven_all_to_all", "reorder_then_gather",
                 "both_axes_move_right", "two_dims_one_all_to_all",
                 "crossed_dims_one_all_to_all"):
        shape, src, dst, xla = XLA_RESHARDS[name]
        steps = plan(src, dst, shape, tf.float32, XLA_MESH)
        assert collectives_of(steps) == [(kind, b) for kind, b, _ in xla], name


def test_two_axes_move_in_one_all_to_all():
    shape, src, dst, _ = XLA_RESHARDS["two_axes_one_all_to_all"]
    steps = plan(src, dst, shape, tf.float32, XLA_MESH)
    assert steps == (AllToAll(("data", "model"), 1, 2, bytes_in=2048, group=8),)


def test_several_source_and_target_dims_move_in_one_all_to_all():
    shape, src, dst, _ = XLA_RESHARDS["crossed_dims_one_all_to_all"]
    steps = plan(src, dst, shape, tf.float32, XLA_MESH)
    assert steps == (AllToAll(("data",), 0, 3, bytes_in=16384, group=8,
                              also=((("model",), 1, 2),)),)
    # one collective over both axes sends 7/8 of the tensor; two in turn would send
    # 1/2 + 3/4 of it
    assert cost(steps).bytes == 16384 * 7 // 8


def test_uneven_tiled_to_tiled_is_one_all_to_all():
    shape, src, dst, xla = XLA_RESHARDS["uneven_all_to_all"]
    steps = plan(src, dst, shape, tf.float32, XLA_MESH)
    # the split dim 10 is padded to 12 (4 chunks of 3), as XLA pads it
    assert collectives_of(steps) == [("all-to-all", 96)]
    assert xla == [("all-to-all", 96, 4)]
    assert [type(s) for s in steps] == [AllToAll]


def test_slicing_comes_before_gathering():
    shape, src, dst, xla = XLA_RESHARDS["slice_before_gather"]
    steps = plan(src, dst, shape, tf.float32, XLA_MESH)
    assert [type(s) for s in steps] == [LocalSlice, AllGather]
    # the gather moves the sliced shard: a quarter of what XLA's gather-then-slice moves
    assert collectives_of(steps) == [("all-gather", 256)]
    assert cost(steps).bytes == 256 < xla_moved_bytes(xla) == 1024


def test_cost_per_step_and_axes():
    steps = plan(L(("data",), ()), L((), ("model",)), (16, 32), tf.float32, XLA_MESH)
    c = cost(steps)
    assert c.bytes_by_axes == ((("data",), 256),)  # (2 - 1) * 256 bytes gathered
    assert c.collectives == 1 and c.steps == 2
    # a cross-worker link on "data" makes the same plan dearer
    intra = CostModel.for_mesh(XLA_MESH)
    cross = CostModel.for_mesh(Mesh.abstract((2, 4), ("data", "model"),
                                             workers=[0, 0, 0, 0, 1, 1, 1, 1]))
    assert planner.seconds(steps, cross) > planner.seconds(steps, intra) > 0


def test_partial_sum_reduce_scatters_what_the_target_splits_then_all_reduces_the_rest():
    # on a backend with a true reduce-scatter (XLA's plan)
    native = CostModel.for_mesh(XLA_MESH, native_reduce_scatter=True)
    src = L((), (), partial=("data", "model"))
    steps = plan(src, L(("model",), ()), (16, 32), tf.float32, XLA_MESH, native)
    assert [type(s) for s in steps] == [planner.ReduceScatter, planner.AllReduce]
    # 3/4 of 2048 bytes, then 2 * 1/2 of the 512 left, against 2 * 7/8 * 2048 at once
    assert cost(steps).bytes == 1536 + 512 < cost((planner.AllReduce(("data", "model"), 2048,
                                                                     8),)).bytes


def test_reduce_scatter_is_priced_as_the_all_reduce_and_slice_the_backend_emits():
    # TF's collectives reduce-scatter by an all-reduce and a slice (the default model):
    # the reduce-scatter above then moves 2 * 3/4 of 2048 bytes, and with the 512 of the
    # all-reduce after it as many as one all-reduce over both axes, 2 * 7/8 * 2048, in
    # one collective instead of two
    src = L((), (), partial=("data", "model"))
    steps = plan(src, L(("model",), ()), (16, 32), tf.float32, XLA_MESH)
    assert steps == (planner.AllReduce(("data", "model"), 2048, 8), LocalSlice(0, ("model",)))
    default = CostModel.for_mesh(XLA_MESH)
    scatter = planner.ReduceScatter(0, ("model",), 2048, 4)
    assert default.wire_bytes("reduce-scatter", 2048, ("model",)) == 3072 == \
        default.wire_bytes("all-reduce", 2048, ("model",))
    assert planner.step_seconds(scatter, default) == \
        planner.step_seconds(planner.AllReduce(("model",), 2048, 4), default)
    native = CostModel.for_mesh(XLA_MESH, native_reduce_scatter=True)
    assert native.wire_bytes("reduce-scatter", 2048, ("model",)) == 1536
    assert planner.step_seconds(scatter, native) < planner.step_seconds(scatter, default)


def test_plans_are_cached():
    args = (L(("data",), ()), L((), ("model",)), (16, 32), tf.float32, XLA_MESH)
    assert plan(*args) is plan(*args)


# ------------------------------------------------------------------------ dots

P = gt.P

# XLA's collectives for einsums of operands sharded as given, the result's sharding left
# to XLA (total operand bytes per device; XLA's result sharding in the comment), from
# benchmarks/xla_collectives.py (command at the top of this file).
XLA_DOTS = {
    # all-gather of the smaller rhs (2048); result P("model")
    "conflict_keep_larger_lhs": ("mk,kn->mn", ((512, 64), (64, 32)),
                                 (P("model", None), P("model", None)), None, 2048),
    # all-gather of the smaller lhs (2048); result P(None, "model") (propagation chooses it
    # too; see test_conflicting_splits_keep_the_larger_operands)
    "conflict_keep_larger_rhs": ("mk,kn->mn", ((32, 64), (64, 512)),
                                 (P(None, "model"), P(None, "model")), None, 2048),
    # all-reduce of the partial result (4096); result P("data")
    "batch_and_contracting_2d": ("bk,kn->bn", ((64, 128), (128, 32)),
                                 (P("data", "model"), P("model", None)), None, 4096),
    # all-reduce of the partial result (8192); result P("data")
    "batched_matmul_batch_contracting": ("bmk,bkn->bmn", ((8, 16, 64), (8, 64, 32)),
                                         (P("data", None, "model"), P("data", "model", None)),
                                         None, 8192),
    # all-gather of the rhs (512); result P(("data", "model"))
    "partial_match_non_contracting": ("mk,kn->mn", ((64, 32), (32, 16)),
                                      (P(("data", "model"), None), P(None, "model")), None,
                                      512),
}


def lower_einsum(equation, shapes, specs, out=None, mesh=XLA_MESH):
    f = gt.function(lambda a, b: tf.einsum(equation, a, b), mesh=mesh, in_shardings=specs,
                    out_shardings=out)
    return f.lower(*[tf.TensorSpec(s, tf.float32) for s in shapes])


@pytest.mark.parametrize("name", sorted(XLA_DOTS))
def test_dot_moves_no_more_bytes_than_xla(name):
    equation, shapes, specs, out, xla_bytes = XLA_DOTS[name]
    low = lower_einsum(equation, shapes, specs, out)
    assert sum(c.bytes for c in low.collectives()) <= xla_bytes, low.report()


def test_conflicting_splits_keep_the_larger_operands():
    # k and n tie for "model"; the result holds only n, so propagation splits it there, as
    # XLA does; keeping the larger rhs's split and gathering the small lhs beats moving
    # the rhs to a contracting split (all-to-all) and all-reducing the partial result
    equation, shapes, specs, _, _ = XLA_DOTS["conflict_keep_larger_rhs"]
    low = lower_einsum(equation, shapes, specs)
    assert low.output_shardings[0] == gt.Sharding.from_spec(XLA_MESH, P(None, "model"), 2)
    assert [(c.kind, c.bytes) for c in low.collectives()] == [("all-gather", 32 * 16 * 4)]


@pytest.mark.parametrize("name", ["conflict_keep_larger_lhs", "conflict_keep_larger_rhs",
                                  "partial_match_non_contracting"])
def test_dot_choices_are_exact(name, rng):
    equation, shapes, specs, out, _ = XLA_DOTS[name]
    args = [randn(rng, *s) for s in shapes]
    check_partitioned(lambda a, b: tf.einsum(equation, a, b), args,
                      mesh_of((2, 4)), specs, out)
