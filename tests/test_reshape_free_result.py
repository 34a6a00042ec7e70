"""A Reshape merging an unevenly split major dim with the dims after it, the result's
sharding left to the partitioner (issue 7): propagation gives the merged dim the split
(rules.reshape's `uneven_major`), the handler re-blocks it by collective-permutes, and
everything downstream follows the split, where gspmd-tf gathered the operand before.

XLA's answers were read from the collectives of XLA's compiled HLO (JAX 0.10.2 on 8 host
CPU devices) for benchmarks/planner_quality_cases.py FREE_RESHAPES:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        /work/jaxref/bin/python benchmarks/xla_planner_quality.py

(the lines "(result free, ...)"; gspmd-tf's side: benchmarks/planner_quality.py).
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, strategies as st

import gspmd_tf as gt
from gspmd_tf.mesh import Mesh
from gspmd_tf.spmd.planner import AllGather, AllReduce, AllToAll, CollectivePermute, cost
from util import check_partitioned

MESHES = {"line": Mesh.abstract((4,), ("x",)), "2x4": Mesh.abstract((2, 4), ("data", "model"))}

# XLA's collectives: (kind, operand bytes per device, group size; 1 for a permute), the
# final sum's 4-byte all-reduces left out; per case (mesh, shape, spec, new shape) and
# consumer: "sum" (the sum of the result's squares) or "replicated" (the result times 3,
# constrained to be replicated)
XLA = {
    ("line", (6, 8), ("x",), (48,)): {
        "sum": [("collective-permute", 32, 1), ("all-gather", 64, 2)],
        "replicated": [("collective-permute", 32, 1), ("all-gather", 64, 2),
                       ("all-gather", 96, 2)]},
    ("line", (6, 6), ("x",), (36,)): {
        "sum": [("collective-permute", 24, 1), ("all-gather", 48, 2)],
        "replicated": [("collective-permute", 24, 1), ("all-gather", 48, 2),
                       ("all-gather", 72, 2)]},
    ("line", (10, 4), ("x",), (40,)): {
        "sum": [("collective-permute", 16, 1), ("all-gather", 48, 2)],
        "replicated": [("collective-permute", 16, 1), ("all-gather", 48, 2),
                       ("all-gather", 80, 2)]},
    ("line", (6, 10), ("x",), (60,)): {
        "sum": [("collective-permute", 40, 1), ("all-gather", 80, 2)],
        "replicated": [("collective-permute", 40, 1), ("all-gather", 80, 2),
                       ("all-gather", 120, 2)]},
    ("line", (2, 4), ("x",), (8,)): {
        "sum": [("collective-permute", 16, 1), ("all-reduce", 16, 2)],
        "replicated": [("collective-permute", 16, 1), ("all-reduce", 16, 2),
                       ("all-gather", 16, 2)]},
    ("line", (8, 6), ("x",), (48,)): {
        "sum": [],
        "replicated": [("all-gather", 48, 4)]},
    ("line", (6, 8), (None, "x"), (48,)): {
        "sum": [("all-gather", 48, 4)],
        "replicated": [("all-gather", 48, 4)]},
    ("line", (4, 6), (None, "x"), (24,)): {
        "sum": [("all-gather", 32, 4)],
        "replicated": [("all-gather", 32, 4)]},
    ("2x4", (6, 8), (("data", "model"),), (48,)): {
        "sum": [("collective-permute", 32, 1), ("all-gather", 32, 4)],
        "replicated": [("collective-permute", 32, 1), ("all-gather", 32, 4),
                       ("all-gather", 96, 2)]},
    ("2x4", (2, 6, 8), ("data", "model"), (2, 48)): {
        "sum": [("collective-permute", 32, 1), ("all-gather", 64, 2)],
        "replicated": [("collective-permute", 32, 1), ("all-gather", 64, 2),
                       ("all-gather", 96, 2), ("all-gather", 192, 2)]},
}
_STEP = {"all-gather": lambda b, k: AllGather(0, (), b, k),
         "all-to-all": lambda b, k: AllToAll((), 0, 1, b, k),
         "collective-permute": lambda b, k: CollectivePermute((), b, k),
         "all-reduce": lambda b, k: AllReduce((), b, k)}


def moved(found):
    """Bytes per device of [(kind, operand bytes, group)] by the planner's ring model."""
    return cost([_STEP[kind](nbytes, k) for kind, nbytes, k in found]).bytes


def consumer_fn(new_shape, consumer):
    """x * 2 reshaped to `new_shape`, then the sum of its squares or times 3."""
    def fn(x):
        z = tf.reshape(x * 2.0, new_shape)
        return tf.reduce_sum(z * z) if consumer == "sum" else z * 3.0
    return fn


def lower_case(case, consumer):
    """gspmd-tf's collectives for XLA case `case` (the scalar all-reduces left out)."""
    mesh, shape, spec, new_shape = case
    lowered = gt.lower(consumer_fn(new_shape, consumer), MESHES[mesh], (gt.P(*spec),),
                       None if consumer == "sum" else (gt.P(),),
                       args=[tf.TensorSpec(shape)])
    return [(c.kind, c.bytes, 1 if c.kind == "collective-permute" else len(c.groups[0]))
            for c in lowered.collectives() if c.shape != ()]


@pytest.mark.parametrize("consumer", ["sum", "replicated"])
@pytest.mark.parametrize("case", sorted(XLA, key=str))
def test_free_result_moves_no_more_than_xla(case, consumer):
    found = lower_case(case, consumer)
    want = XLA[case][consumer]
    assert moved(found) <= moved(want), (found, want)
    assert len(found) <= len(want), (found, want)
    if consumer == "sum" and any(kind == "collective-permute" for kind, _, _ in want):
        # where XLA splits the merged dim, we keep the split: one re-block, no gather
        assert {kind for kind, _, _ in found} == {"collective-permute"}, found


@pytest.mark.parametrize("case, before", [
    # gspmd-tf before this change (main 0615192): the operand gathered
    (("line", (6, 8), ("x",), (48,)), 192),
    (("line", (6, 6), ("x",), (36,)), 144),
    (("line", (10, 4), ("x",), (40,)), 144),
    (("2x4", (6, 8), (("data", "model"),), (48,)), 224),
])
def test_free_result_moves_less_than_before(case, before):
    assert moved(lower_case(case, "sum")) < before / 2


def test_merged_dim_takes_the_uneven_split():
    lowered = gt.lower(lambda x: tf.reshape(x * 2.0, (-1,)) * 3.0, MESHES["line"],
                       (gt.P("x"),), None, args=[tf.TensorSpec((6, 8))])
    assert str(lowered.output_shardings[0]) == "{devices=[4]0,1,2,3}"
    # a minor split still cannot split the merged dim (XLA gathers too)
    lowered = gt.lower(lambda x: tf.reshape(x * 2.0, (-1,)) * 3.0, MESHES["line"],
                       (gt.P(None, "x"),), None, args=[tf.TensorSpec((6, 8))])
    assert str(lowered.output_shardings[0]) == "{replicated}"


def test_split_does_not_flow_backward_into_a_free_operand():
    """x replicated, sin(x) free, its merge constrained to P(x): sin(x) is not given the
    uneven split (that would add a re-block where slicing the replicated tensor is free;
    XLA moves nothing either)."""
    lowered = gt.lower(lambda x: tf.reshape(tf.sin(x), (-1,)), MESHES["line"], (gt.P(),),
                       (gt.P("x"),), args=[tf.TensorSpec((6, 8))])
    assert lowered.collectives() == []


def test_reverse_reshape_splits_over_part_of_the_axis():
    """The reverse, a split dim reshaped so that the new major dim would be split
    unevenly, is not given that split when its result is free (its padded blocks cost more
    to gather later than the even operand, docs/DESIGN_LOG.md), but, as XLA's, a split
    over the major half of the axis, x:(1)2 (tests/test_sub_axes.py)."""
    lowered = gt.lower(lambda x: tf.reshape(x * 2.0, (6, 8)) * 3.0, MESHES["line"],
                       (gt.P("x"),), None, args=[tf.TensorSpec((48,))])
    assert str(lowered.output_shardings[0]) == "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"


@pytest.mark.parametrize("mesh_shape, axes, shape, spec, out_shape", [
    ((4,), ("x",), (6, 8), gt.P("x"), (48,)),
    ((8,), ("x",), (13, 3), gt.P("x"), (39,)),                 # blocks two shards away
    ((8,), ("x",), (6, 1, 8), gt.P("x"), (48,)),               # a size-1 dim merged too
    ((2, 4), ("a", "b"), (6, 8), gt.P(("a", "b")), (48,)),    # two axes
    ((2, 4), ("a", "b"), (2, 6, 8), gt.P("a", "b"), (2, 48)),  # merge behind a split dim
    ((2, 4), ("a", "b"), (5, 6, 3), gt.P("a", "b"), (5, 18)),
    ((2, 4), ("a", "b"), (6, 3, 2, 4), gt.P(("b", "a")), (36, 4)),
])
def test_free_result_values_exact(mesh_shape, axes, shape, spec, out_shape):
    mesh = gt.Mesh.create(mesh_shape, axes)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - 11

    def fn(t):  # the merged result, a consumer of it, and a reduction of both
        z = tf.reshape(t * 2.0, out_shape)
        return z, tf.tanh(z) + 1.0, tf.reduce_sum(z * z)
    lowered = check_partitioned(fn, (x,), mesh, (spec,))
    assert {c.kind for c in lowered.collectives() if c.shape != ()} == \
        {"collective-permute"}
    assert lowered.output_shardings[0] == lowered.output_shardings[1] != \
        gt.Sharding.parse("{replicated}")
    # an integer tensor takes the same path; and a replicated consumer after it
    check_partitioned(lambda t: tf.reshape(t + 1, out_shape), (x.astype(np.int32),), mesh,
                      (spec,))
    check_partitioned(lambda t: tf.reshape(t * 2.0, out_shape) * 3.0, (x,), mesh, (spec,),
                      (gt.P(),))


@st.composite
def merges(draw):
    """(mesh shape, axis names, shape, spec, merged shape): a random shape, one dim split
    over one or two mesh axes (evenly or not), that dim merged with 1-3 dims after it."""
    mesh_shape, axes = draw(st.sampled_from([((2,), ("x",)), ((4,), ("x",)), ((8,), ("x",)),
                                             ((2, 4), ("a", "b")), ((4, 2), ("a", "b"))]))
    rank = draw(st.integers(2, 4))
    shape = draw(st.lists(st.integers(1, 7), min_size=rank, max_size=rank))
    dim = draw(st.integers(0, rank - 2))
    shape[dim] = draw(st.integers(2, 9))  # the split dim (a size-1 one passes nothing)
    shape = tuple(shape)
    merged = draw(st.integers(2, rank - dim))
    split = draw(st.sampled_from([axes[:1], axes[-1:], axes, axes[::-1]]))
    spec = [None] * rank
    spec[dim] = split if len(split) > 1 else split[0]
    new_shape = shape[:dim] + (int(np.prod(shape[dim:dim + merged])),) + shape[dim + merged:]
    return mesh_shape, axes, shape, gt.P(*spec), new_shape


@given(merges())
def test_free_result_merge_matches_single_device(case):
    mesh_shape, axes, shape, spec, new_shape = case
    mesh = gt.Mesh.create(mesh_shape, axes)
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    check_partitioned(lambda t: tf.reshape(t * 2.0, new_shape) * 3.0, (x,), mesh, (spec,))


@pytest.mark.parametrize("mesh_shape, axes, shape, spec", [
    ((4,), ("x",), (6, 8), gt.P("x")),
    ((2, 4), ("a", "b"), (2, 6, 8), gt.P("a", "b")),
])
def test_free_result_gradient_exact(mesh_shape, axes, shape, spec):
    """The gradient reshapes the merged dim's gradient back (the reverse re-block)."""
    mesh = gt.Mesh.create(mesh_shape, axes)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    new_shape = shape[:-2] + (shape[-2] * shape[-1],)
    w = rng.standard_normal(new_shape).astype(np.float32)

    def fn(t, v):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(tf.tanh(tf.reshape(t * t, new_shape)) * v)
        return tape.gradient(loss, t)
    check_partitioned(fn, (x, w), mesh, (spec, None))
