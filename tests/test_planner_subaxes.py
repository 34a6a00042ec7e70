"""Reshard plans whose steps run over sub-groups of a mesh axis (mesh.SubAxis): the
planner cuts one axis in two inside a plan (spmd/planner.py, `_sub_axis_splits`), and
every plan it could pick, with or without the cut, gives exactly the target shards.

XLA's plans for the two 2x4 cases (tests/test_planner_quality.py holds their bytes):
P(data, model) -> P(model, data) is an all-to-all over model's minor half plus a permute
trading data with model's major half; P(data, None, model) -> P(None, None, data) a
permute trading data with model's major half, then all-gathers over model's minor and
major halves.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, strategies as st

import gspmd_tf as gt
from gspmd_tf.backends import LocalBackend
from gspmd_tf.cost_model import CostModel
from gspmd_tf.mesh import Mesh, SubAxis
from gspmd_tf.sharding import Sharding
from gspmd_tf.spmd import planner
from gspmd_tf.spmd.planner import AllGather, AllToAll, CollectivePermute, cost, plan
from gspmd_tf.spmd.program import Local, ProgramBuilder
from gspmd_tf.spmd.reshard import emit
from test_planner import L, block, check_exact, reshard_cases, source_shards
from test_planner import mesh_of as planner_mesh_of
from util import check_partitioned

MESHES = {
    (2, 4): ("data", "model"),
    (4, 2): ("a", "b"),
    (2, 2, 2): ("x", "y", "z"),
    (1, 8): ("one", "x"),
}


def mesh_of(shape):
    """The mesh of `shape` in MESHES."""
    return planner_mesh_of(shape, MESHES)


def names_sub_axes(steps):
    """True when some step runs over part of a mesh axis."""
    return any(isinstance(a, SubAxis) for step in steps for a in step.axes)


def check_steps_exact(mesh, src, dst, steps, value, rng):
    """Emit `steps` from `src` and check every device holds its shard of `dst`."""
    b = ProgramBuilder(mesh)
    dtype = tf.as_dtype(value.dtype)
    ref = b.input(0, src.local_shape(mesh, value.shape), dtype)
    out = emit(steps, b, Local(ref, src, value.shape, dtype))
    assert out.layout == dst, (out.layout, dst, steps)
    b.graph.outputs.append(out.ref)
    got = LocalBackend(mesh).compile(b.graph)([source_shards(mesh, src, value, rng)])[0]
    for d in range(mesh.size):
        box = block(mesh, dst, value.shape, d)
        inside = tuple(slice(0, s.stop - s.start) for s in box)
        np.testing.assert_array_equal(got[d].numpy()[inside], value[box],
                                      err_msg=f"device {d}: {src} -> {dst} by {steps}")


def candidates(mesh, src, dst, shape):
    """Every plan the search compares: over whole axes, and with each axis cut."""
    model = CostModel.for_mesh(mesh)
    return [steps for _, steps in planner._candidates(src, dst, tuple(shape), 4, model)]


# ------------------------------------------------------------------------ mesh

def test_sub_axis_groups_and_shard_indices():
    mesh = Mesh.abstract((2, 4), ("data", "model"))
    minor, major = SubAxis("model", 2, 2, 4), SubAxis("model", 1, 2, 4)
    assert str(minor) == "model:(2)2" and mesh.axis_size(minor) == 2
    assert mesh.groups((minor,)).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups((major,)).tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # XLA's all-to-all group of data and half of model: {0, 1, 4, 5}, {2, 3, 6, 7}
    assert mesh.groups(("data", minor)).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # the two halves in order are the axis
    assert mesh.groups((major, minor)).tolist() == mesh.groups(("model",)).tolist()
    assert [mesh.shard_index(d, (major,)) for d in range(8)] == [0, 0, 1, 1] * 2
    assert mesh.arrange((minor,)).shape == (2, 4)


def test_sub_axes_follow_the_device_order():
    ids = np.array([[3, 1, 0, 2], [7, 6, 4, 5]])
    mesh = Mesh.abstract((2, 4), ("data", "model"), device_ids=ids)
    minor = SubAxis("model", 2, 2, 4)
    assert mesh.groups((minor,)).tolist() == [[3, 1], [0, 2], [7, 6], [4, 5]]
    for row in mesh.groups(("data", minor)):
        assert [mesh.shard_index(d, ("data", minor)) for d in row] == [0, 1, 2, 3]


def test_bad_sub_axes_are_refused():
    mesh = Mesh.abstract((2, 4), ("data", "model"))
    with pytest.raises(gt.ShardingError, match="does not cut"):
        mesh.groups((SubAxis("model", 1, 3, 4),))
    with pytest.raises(gt.ShardingError, match="overlap"):
        mesh.groups(("model", SubAxis("model", 2, 2, 4)))
    line = Mesh.abstract((12,), ("x",))
    with pytest.raises(gt.ShardingError, match="do not nest"):  # cuts at 4 and 6 of 12
        line.groups((SubAxis("x", 1, 4, 12), SubAxis("x", 1, 6, 12)))


# ------------------------------------------------------------------------ chosen plans

MESH = Mesh.abstract((2, 4), ("data", "model"))
MODEL_MAJOR = SubAxis("model", 1, 2, 4)
MODEL_MINOR = SubAxis("model", 2, 2, 4)


def test_axis_swap_is_an_all_to_all_over_half_the_axis_and_a_permute():
    steps = plan(L(("data",), ("model",)), L(("model",), ("data",)), (64, 256), tf.float32,
                 MESH)
    assert steps == (AllToAll((MODEL_MINOR,), 1, 0, 8192, 2),
                     CollectivePermute(((0, ("model",)), (1, ("data",))), 8192, 8))
    assert cost(steps).bytes == 4096 + 8192


def test_whole_axis_to_a_dim_split_by_a_smaller_axis_gathers_half_axes():
    steps = plan(L(("data",), (), ("model",)), L((), (), ("data",)), (2, 128, 256),
                 tf.float32, MESH)
    assert steps == (CollectivePermute(((0, (MODEL_MAJOR,)), (2, ("data", MODEL_MINOR))),
                                       32768, 8),
                     AllGather(0, (MODEL_MAJOR,), 32768, 2),
                     AllGather(2, (MODEL_MINOR,), 65536, 2))
    assert cost(steps).bytes == 131072


def test_layouts_between_plans_name_whole_axes():
    src, dst = L(("data",), ("model",)), L(("model",), ("data",))
    layout = src
    seen = []
    for step in plan(src, dst, (64, 256), tf.float32, MESH):
        layout = step.apply(layout)
        seen.append(layout)
    assert seen[0] == L(("data", MODEL_MINOR), (MODEL_MAJOR,))
    assert seen[-1] == dst
    # an XLA sharding expresses the sub-axis layout (device data * 4 + model): dim 0 split
    # over (data, model's minor half), dim 1 over model's major half
    tiles = Sharding.from_layout(MESH, seen[0]).tile_assignment
    assert tiles.tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_1t_activation_reshard_moves_what_xla_moves():
    # [B, S, M] split [X, -, Y] to [-, -, X] on the 1T step's 16x32 mesh: XLA's 32 MiB
    mesh = Mesh.abstract((16, 32), ("x", "y"))
    steps = plan(L(("x",), (), ("y",)), L((), (), ("x",)), (16, 512, 16384), tf.float32,
                 mesh)
    assert [type(s) for s in steps] == [CollectivePermute, AllGather, AllGather]
    assert cost(steps).bytes == 32 * 2**20


def test_equal_axes_need_no_cut():
    # every axis of 2x2x2 has two devices: nothing to cut, the plan is over whole axes
    mesh = Mesh.abstract((2, 2, 2), ("x", "y", "z"))
    steps = plan(L(("x",), ("y",)), L(("y",), ("x",)), (64, 256), tf.float32, mesh)
    assert not names_sub_axes(steps)
    assert [type(s) for s in steps] == [CollectivePermute]


# ------------------------------------------------------------------------ exact shards

# the two families on several meshes, even and uneven dims: an axis swap between dims
# where one axis is larger, and a whole-axis split moved to a dim split by a smaller axis
FAMILY = [
    ((2, 4), (64, 256), L(("data",), ("model",)), L(("model",), ("data",))),
    ((2, 4), (6, 10), L(("data",), ("model",)), L(("model",), ("data",))),
    ((2, 4), (7, 5), L(("model",), ("data",)), L(("data",), ("model",))),
    ((2, 4), (2, 128, 256), L(("data",), (), ("model",)), L((), (), ("data",))),
    ((2, 4), (3, 5, 10), L(("data",), (), ("model",)), L((), (), ("data",))),
    ((2, 4), (5, 3, 7), L(("data",), (), ("model",)), L((), (), ("data",))),
    ((4, 2), (64, 256), L(("a",), ("b",)), L(("b",), ("a",))),
    ((4, 2), (9, 6), L(("a",), ("b",)), L(("b",), ("a",))),
    ((4, 2), (4, 64, 128), L(("b",), (), ("a",)), L((), (), ("b",))),
    ((4, 2), (3, 7, 10), L(("b",), (), ("a",)), L((), (), ("b",))),
    ((2, 2, 2), (16, 64), L(("x",), ("y", "z")), L(("y", "z"), ("x",))),
    ((2, 2, 2), (5, 9), L(("x", "y"), ("z",)), L(("z",), ("x", "y"))),
    ((1, 8), (16, 64), L((), ("x",)), L(("x",), ())),
    ((1, 8), (5, 11), L(("x",), ()), L((), ("x",))),
]


@pytest.mark.parametrize("mesh_shape, shape, src, dst", FAMILY)
def test_family_plans_are_exact(mesh_shape, shape, src, dst, rng):
    mesh = mesh_of(mesh_shape)
    value = rng.integers(-100, 100, shape).astype(np.float32)
    check_exact(mesh, src, dst, value, rng)
    for steps in candidates(mesh, src, dst, shape):
        check_steps_exact(mesh, src, dst, steps, value, rng)


SWAP = (L(("data",), ("model",)), L(("model",), ("data",)))
TO_SMALLER = (L(("data",), (), ("model",)), L((), (), ("data",)))


@pytest.mark.parametrize("mesh_shape, shape, src, dst, cut", [
    ((2, 4), (64, 256), *SWAP, True),
    ((2, 4), (2, 128, 256), *TO_SMALLER, True),
    ((4, 2), (64, 256), L(("a",), ("b",)), L(("b",), ("a",)), True),
    ((4, 2), (4, 64, 128), L(("b",), (), ("a",)), L((), (), ("b",)), True),
    # uneven: 63 and 251 split in 2 then 2 nest (shards of 32 and 126 cut in two are
    # the 4-way shards of 16 and 63), so the cut plan is exact
    ((2, 4), (63, 251), *SWAP, True),
    # 62 and 250 do not nest (shards of 31 are not two 4-way shards of 16): whole axes
    ((2, 4), (62, 250), *SWAP, False),
    ((2, 4), (2, 128, 250), *TO_SMALLER, False),
])
def test_large_tensors_take_sub_axis_plans_where_exact(mesh_shape, shape, src, dst, cut):
    mesh = mesh_of(mesh_shape)
    steps = plan(src, dst, shape, tf.float32, mesh)
    assert names_sub_axes(steps) == cut, steps
    whole = candidates(mesh, src, dst, shape)[0]
    if cut:  # cheaper than the best plan over whole axes
        assert cost(steps).bytes < cost(whole).bytes
    else:
        assert steps == whole


@given(reshard_cases(MESHES, max_size=12, unnamed=("one",)), st.integers(0, 2**31 - 1))
def test_every_candidate_plan_gives_exactly_the_target_shards(case, seed):
    mesh_shape, shape, src, dst = case
    mesh = mesh_of(mesh_shape)
    rng = np.random.default_rng(seed)
    value = rng.integers(-100, 100, shape).astype(np.float32)
    if src == dst:
        return
    for steps in candidates(mesh, src, dst, shape):
        check_steps_exact(mesh, src, dst, steps, value, rng)


@pytest.fixture
def rng():
    return np.random.default_rng(3)


# ------------------------------------------------------------------------ end to end

def test_partitioned_function_runs_sub_axis_collectives_with_keys_from_the_program(rng):
    """A constrained swap in a gt.function: single-device values, the all-to-all over
    model's minor halves, and the same collective keys for the same program."""
    mesh = mesh_of((2, 4))
    x = rng.standard_normal((64, 256)).astype(np.float32)

    def swap(v):
        return gt.mesh_split(v * 2.0, mesh, gt.P("model", "data")) + 1.0

    lowered = check_partitioned(swap, (x,), mesh, (gt.P("data", "model"),))
    kinds = [(c.kind, c.groups) for c in lowered.collectives()]
    assert kinds[0] == ("all-to-all", ((0, 1), (2, 3), (4, 5), (6, 7)))
    assert [k for k, _ in kinds] == ["all-to-all", "collective-permute"]
    keys = [gt.function(swap, mesh=mesh, in_shardings=(gt.P("data", "model"),))
            .lower(x).compile().collective_keys() for _ in range(2)]
    assert keys[0] == keys[1] and len(keys[0][0][3]) == 4  # four groups of two


# ------------------------------------------------------------------------ steps over parts

def test_a_step_over_part_of_an_axis_keeps_the_layouts_other_parts_whole():
    """Fuzz seed 89 #131 (shrunk: a reshape of an uneven split, added to an operand split
    over the minor part of an axis of 8): a local slice over x:(4)2 applied to a layout
    holding x:(1)2 and x:(2)2 took x:(1)2 for x:(1)4 (the axis was cut at 4 alone), so
    the layout said the dim had 4 shards where the emitted slice made 2."""
    mesh = mesh_of((1, 8))
    major, middle, minor = (SubAxis("x", pre, 2, 8) for pre in (1, 2, 4))
    src = L((), (), (), (major,))
    dst = L((), (middle,), (minor,), (major,))
    steps = plan(src, dst, (4, 2, 2, 4), tf.float32, mesh)
    layout = src
    for step in steps:
        layout = step.apply(layout)
    assert layout == dst
    value = np.random.default_rng(5).integers(-100, 100, (4, 2, 2, 4)).astype(np.float32)
    check_steps_exact(mesh, src, dst, steps, value, np.random.default_rng(6))


def test_reshape_of_a_split_added_to_an_operand_split_over_an_axis_part(rng):
    """The program of fuzz seed 89 #131, values against single-device TF."""
    mesh = mesh_of((1, 8))
    x = rng.standard_normal((2, 8, 7, 1)).astype(np.float32)
    keep = rng.integers(0, 2, (2, 8, 4, 1)).astype(bool)
    other = rng.standard_normal((2, 8, 4, 1)).astype(np.float32)
    y = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)

    def f(x, keep, other, y):
        pooled = tf.nn.avg_pool2d(x, ksize=[1, 1], strides=[1, 2], padding="VALID")
        summed = tf.reshape(tf.where(keep, pooled, other), [4, 2, -1, 4]) + y
        return summed, tf.reshape(other, [8, 8])[-6::3, :]

    check_partitioned(f, (x, keep, other, y), mesh,
                      (gt.P(None, "x"), gt.P(), gt.P(), gt.P(None, None, None, "x")))
