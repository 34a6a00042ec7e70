"""Reshards where XLA moved fewer bytes than the planner (issue 7, found on one layer of
benchmarks/transformer_scale.py's 1T-16x32 step): the planner now reduce-scatters a
partial sum onto a dim the target splits out of order, and all-to-alls an axis onto such
a dim, then reorders the dim with a collective-permute, so the big collective moves the
small shards. And a Reshape merging an unevenly split dim with the dims after it
re-blocks the merged dim by collective-permutes, as XLA does, instead of gathering it (and
the reverse reshape re-blocks the other way, where XLA gathers over half the axis). Axis
swaps and moves of a whole-axis split to a dim split by a smaller axis run steps over
halves of an axis, as XLA's do (mesh.SubAxis; tests/test_planner_subaxes.py).

XLA's answers were read from the collectives of XLA's compiled HLO (JAX 0.10.2 on 8 host
CPU devices) for the cases of benchmarks/planner_quality_cases.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        /work/jaxref/bin/python benchmarks/xla_planner_quality.py
"""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.mesh import Mesh
from gspmd_tf.spmd.planner import (AllGather, AllReduce, AllToAll, CollectivePermute,
                                   ReduceScatter, cost, plan)
from gspmd_tf.spmd.reshard import reblock_windows
from test_planner import L, check_exact, mesh_of
from util import check_partitioned

MESH = Mesh.abstract((2, 4), ("data", "model"))
MESH_1T = Mesh.abstract((16, 32), ("x", "y"))  # transformer_scale.py's 1T-16x32
MIB = 2**20

# XLA's collectives: (kind, operand bytes per device, group size; 1 for a permute),
# the final sum's scalar all-reduces left out
XLA = {
    # (2, 128, 256) P(data, None, model) -> P(None, None, data)
    "batch_to_model_dim": [("collective-permute", 32768, 1), ("all-gather", 32768, 2),
                           ("all-gather", 65536, 2)],
    # (64, 256) P(data, model) -> P(model, data); the all-to-all's groups are model's
    # minor halves ({0, 1}, {2, 3}, ...: XLA's {'axis_0':(2)2})
    "swap_axes": [("all-to-all", 8192, 2), ("collective-permute", 8192, 1)],
    # bsh,hm->bsm (2, 128, 64) x (64, 256), P(None, None, model) x P(model, data), result
    # constrained to P(data, None, model)
    "partial_sum_to_batch_split": [("all-gather", 8192, 2), ("all-reduce", 131072, 4)],
}
_STEP = {"all-gather": lambda b, k: AllGather(0, (), b, k),
         "all-to-all": lambda b, k: AllToAll((), 0, 1, b, k),
         "collective-permute": lambda b, k: CollectivePermute((), b, k),
         "reduce-scatter": lambda b, k: ReduceScatter(0, (), b, k),
         "all-reduce": lambda b, k: AllReduce((), b, k)}


def xla_moved(name):
    """Bytes XLA's collectives for case `name` move per device (the planner's ring
    model)."""
    return cost([_STEP[kind](nbytes, k) for kind, nbytes, k in XLA[name]]).bytes


def test_whole_axis_to_a_dim_split_by_a_smaller_axis_moves_what_xla_moves():
    src, dst = L(("data",), (), ("model",)), L((), (), ("data",))
    steps = plan(src, dst, (2, 128, 256), tf.float32, MESH)
    # XLA's plan over halves of the model axis (tests/test_planner_subaxes.py): a permute
    # trading data with model's major half, gathers over the minor then the major half;
    # over whole axes the planner moved 147456 (all-to-all, permute, all-gather)
    assert [type(s) for s in steps] == [CollectivePermute, AllGather, AllGather]
    assert [s.group for s in steps[1:]] == [2, 2]
    assert cost(steps).bytes == xla_moved("batch_to_model_dim") == 131072


def test_1t_activation_reshard_moves_what_xla_moves():
    # [B, S, M] split [X, -, Y] to [-, -, X], at the 1T layer's shapes
    src, dst = L(("x",), (), ("y",)), L((), (), ("x",))
    steps = plan(src, dst, (16, 512, 16384), tf.float32, MESH_1T)
    assert [type(s) for s in steps] == [CollectivePermute, AllGather, AllGather]
    old = (AllGather(2, ("y",), 1 * MIB, 32), AllToAll(("x",), 0, 2, 32 * MIB, 16))
    assert cost(old).bytes == 61 * MIB
    assert cost(steps).bytes == 32 * MIB  # XLA's sub-axis plan: 32 MiB


def test_1t_partial_sum_reduce_scatters_before_moving():
    # a dot's [B, S, M] result split [-, -, X], partial over Y, to [X, -, Y]
    src, dst = L((), (), ("x",), partial=("y",)), L(("x",), (), ("y",))
    steps = plan(src, dst, (16, 512, 16384), tf.float32, MESH_1T)
    assert [type(s) for s in steps] == [ReduceScatter, CollectivePermute, AllToAll]
    assert steps[0].dim == 2 and steps[0].bytes_in == 32 * MIB
    old = (AllToAll(("x",), 2, 0, 32 * MIB, 16), ReduceScatter(2, ("y",), 32 * MIB, 32))
    assert cost(steps).bytes < 33 * MIB < cost(old).bytes == 61 * MIB


def test_swap_of_axes_between_dims():
    steps = plan(L(("data",), ("model",)), L(("model",), ("data",)), (64, 256), tf.float32,
                 MESH)
    # XLA's plan: an all-to-all over model's minor half, then a permute; over whole axes
    # the planner moved 18432 (all-to-all, permute, all-to-all), before that 20480
    assert [type(s) for s in steps] == [AllToAll, CollectivePermute]
    assert steps[0].group == 2
    assert cost(steps).bytes == xla_moved("swap_axes") == 12288


def test_partial_sum_dot_moves_no_more_than_xla():
    lowered = gt.lower(lambda a, b: tf.einsum("bsh,hm->bsm", a, b), MESH,
                       (gt.P(None, None, "model"), gt.P("model", "data")),
                       (gt.P("data", None, "model"),),
                       args=[tf.TensorSpec((2, 128, 64)), tf.TensorSpec((64, 256))])
    steps = [_STEP[c.kind](c.bytes, 1 if c.kind == "collective-permute"
                           else len(c.groups[0])) for c in lowered.collectives()]
    assert cost(steps).bytes <= xla_moved("partial_sum_to_batch_split")


def test_new_moves_give_exactly_the_target_shards(rng):
    mesh = mesh_of((2, 4))
    shape = (2, 128, 256)  # large enough for the new plans to win
    value = rng.integers(-100, 100, shape).astype("float32")
    cases = [(L(("data",), (), ("model",)), L((), (), ("data",))),
             (L((), (), ("data",), partial=("model",)), L(("data",), (), ("model",))),
             (L(("data",), ("model",), ()), L(("model",), ("data",), ()))]
    for src, dst in cases:
        steps = plan(src, dst, shape, tf.float32, mesh)
        assert CollectivePermute in [type(s) for s in steps], (src, dst, steps)
        check_exact(mesh, src, dst, value, rng)


# ------------------------------------------------------------------------ reshapes

LINE = Mesh.abstract((4,), ("x",))

# XLA's collectives for reshaping a tensor split over x (4 devices) to one dim split
# over x (benchmarks/planner_quality_cases.py RESHAPES, command at the top of this file)
P_X = ("x",)
XLA_RESHAPES = {
    ((8, 6), ("x",)): [],
    ((6, 8), (None, "x")): [("all-gather", 48, 4)],
    ((6, 8), P_X): [("collective-permute", 48, 1)],
    ((6, 6), P_X): [("collective-permute", 36, 1)],
    ((10, 4), P_X): [("collective-permute", 24, 1)],
    ((4, 6), (None, "x")): [("all-to-all", 32, 4)],
    ((6, 10), (None, "x")): [("all-gather", 72, 4)],
}


@pytest.mark.parametrize("shape, spec", sorted(XLA_RESHAPES, key=str))
def test_merging_reshape_moves_what_xla_does(shape, spec):
    lowered = gt.lower(lambda x: tf.reshape(x * 2.0, (-1,)), LINE, (gt.P(*spec),), (gt.P("x"),),
                       args=[tf.TensorSpec(shape)])
    found = [(c.kind, c.bytes, 1 if c.kind == "collective-permute" else len(c.groups[0]))
             for c in lowered.collectives()]
    assert found == XLA_RESHAPES[(shape, spec)]


@pytest.mark.parametrize("mesh_shape, axes, shape, spec, out_shape", [
    ((4,), ("x",), (6, 8), P_X, (48,)),
    ((4,), ("x",), (10, 4), P_X, (40,)),
    ((8,), ("x",), (6, 8), P_X, (48,)),               # devices past the data get padding
    ((8,), ("x",), (13, 3), P_X, (39,)),              # blocks two shards away
    ((2, 4), ("a", "b"), (6, 2, 5), gt.P(None, "b"), (6, 10)),
    ((2, 4), ("a", "b"), (5, 6, 3), gt.P("a", "b"), (5, 18)),
    ((2, 4), ("a", "b"), (6, 3, 2, 4), gt.P(("a", "b"), None, None, None), (36, 4)),
])
def test_merging_reshape_reblocks_exactly(mesh_shape, axes, shape, spec, out_shape):
    mesh = gt.Mesh.create(mesh_shape, axes)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - 11
    out_spec = gt.P(*[spec[d] if d < len(spec) else None for d in range(len(out_shape))])
    lowered = check_partitioned(lambda t: tf.reshape(t * 2.0, out_shape), (x,), mesh,
                                (spec,), (out_spec,))
    kinds = {c.kind for c in lowered.collectives()}
    assert kinds == {"collective-permute"}, kinds
    # an integer tensor takes the same path (selects, no arithmetic on the values)
    check_partitioned(lambda t: tf.reshape(t + 1, out_shape), (x.astype(np.int32),), mesh,
                      (spec,), (out_spec,))


# XLA's collectives for reshaping a dim of the size split over x to the shape, whose
# major dim is split over x (planner_quality_cases.py SPLITS): a gather over half the
# axis, then a permute
XLA_SPLITS = {
    (48, (6, 8)): [("all-gather", 48, 2), ("collective-permute", 32, 1)],
    (36, (6, 6)): [("all-gather", 36, 2), ("collective-permute", 24, 1)],
    (40, (10, 4)): [("all-gather", 40, 2), ("collective-permute", 16, 1)],
}


@pytest.mark.parametrize("size, shape", sorted(XLA_SPLITS))
def test_splitting_reshape_moves_less_than_xla(size, shape):
    lowered = gt.lower(lambda x: tf.reshape(x * 2.0, shape), LINE, (gt.P("x"),),
                       (gt.P("x"),), args=[tf.TensorSpec((size,))])
    found = [(c.kind, c.bytes, 1) for c in lowered.collectives()]
    assert [kind for kind, _, _ in found] == ["collective-permute"]
    assert cost([_STEP[kind](nbytes, k) for kind, nbytes, k in found]).bytes < \
        cost([_STEP[kind](nbytes, k) for kind, nbytes, k in XLA_SPLITS[(size, shape)]]).bytes


@pytest.mark.parametrize("mesh_shape, axes, shape, spec, out_shape", [
    ((4,), ("x",), (48,), P_X, (6, 8)),
    ((8,), ("x",), (39,), P_X, (13, 3)),
    ((2, 4), ("a", "b"), (6, 10), gt.P(None, "b"), (6, 2, 5)),
    ((2, 4), ("a", "b"), (36, 4), gt.P(("a", "b")), (6, 3, 2, 4)),
])
def test_splitting_reshape_reblocks_exactly(mesh_shape, axes, shape, spec, out_shape):
    mesh = gt.Mesh.create(mesh_shape, axes)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - 11
    out_spec = gt.P(*[spec[d] if d < len(spec) else None for d in range(len(out_shape))])
    lowered = check_partitioned(lambda t: tf.reshape(t * 2.0, out_shape), (x,), mesh,
                                (spec,), (out_spec,))
    assert {c.kind for c in lowered.collectives()} == {"collective-permute"}


def test_reblock_windows():
    # 6 rows of 8 split 4 ways (blocks of 16) to blocks of 12: every target but the
    # first takes the end of its left neighbour's block; all but the last keep some of
    # their own: (source, target, window in the source's block)
    windows = reblock_windows(48, 4, 16, 12)
    assert windows[1] == ((0, 1, 12, 16), (1, 2, 8, 16), (2, 3, 4, 16))
    assert windows[0] == ((0, 0, 0, 12), (1, 1, 0, 8), (2, 2, 0, 4))
    assert set(windows) == {0, 1}
    # rows [4, 8) of 16 split 4 ways (blocks of 4) in blocks of 1: all from shard 1
    assert reblock_windows(16, 4, 4, 1, first=4, last=8) == {
        -1: ((1, 0, 0, 1),), 0: ((1, 1, 1, 2),), 1: ((1, 2, 2, 3),), 2: ((1, 3, 3, 4),)}
