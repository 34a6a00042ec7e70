"""Mesh sub-axes (Shardy's "x":(2)2) in layouts: a Reshape splitting a dim split over an
axis into a major dim smaller than the axis keeps the split on parts of the axis
(propagation/sub_axes.py), moving no more than XLA; specs, shardings and reports spell
the parts "x:(pre)size".

XLA's collectives (bytes per device by the ring model; free result summed, or constrained
replicated) are RESULTS §7.3's split_into rows, measured with JAX 0.10.2 on 8 host CPU
devices by benchmarks/xla_planner_quality.py.
"""

from math import gcd

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings, strategies as st

import gspmd_tf as gt
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import Mesh, SubAxis
from gspmd_tf.sharding import Sharding
from test_reshape_free_result import consumer_fn, moved
from util import check_partitioned

LINE = Mesh.abstract((4,), ("x",))
X1, X2 = SubAxis("x", 1, 2, 4), SubAxis("x", 2, 2, 4)

# (flat size, new shape) -> consumer -> XLA's (kind, operand bytes, group size)
XLA = {
    (48, (6, 8)): {"sum": [("all-gather", 48, 2)],
                   "replicated": [("all-gather", 48, 2), ("all-gather", 96, 2)]},
    (8, (2, 4)): {"sum": [],
                  "replicated": [("all-gather", 8, 2), ("all-gather", 16, 2)]},
}


def collectives(lowered):
    """(kind, operand bytes, group size) of the collectives, scalars left out."""
    return [(c.kind, c.bytes, 1 if c.kind == "collective-permute" else len(c.groups[0]))
            for c in lowered.collectives() if c.shape != ()]


@pytest.mark.parametrize("consumer", ["sum", "replicated"])
@pytest.mark.parametrize("case", sorted(XLA))
def test_split_into_major_smaller_than_axis_moves_no_more_than_xla(case, consumer):
    size, shape = case
    lowered = gt.lower(consumer_fn(shape, consumer), LINE, (gt.P("x"),),
                       None if consumer == "sum" else (gt.P(),),
                       args=[tf.TensorSpec((size,))])
    found, want = collectives(lowered), XLA[case][consumer]
    assert moved(found) <= moved(want), (found, want)
    assert len(found) <= len(want), (found, want)


@pytest.mark.parametrize("consumer", ["sum", "replicated"])
@pytest.mark.parametrize("case", sorted(XLA))
def test_split_into_major_smaller_than_axis_values_equal_single_device(case, consumer):
    size, shape = case
    x = np.linspace(-2.0, 2.0, size, dtype=np.float32)
    check_partitioned(consumer_fn(shape, consumer), (x,), gt.Mesh.create((4,), ("x",)),
                      (gt.P("x"),), None if consumer == "sum" else (gt.P(),))


def test_reshape_result_is_split_over_parts_of_the_axis():
    lowered = gt.lower(lambda x: tf.reshape(x * 2.0, (2, 4), name="r") * 3.0, LINE,
                       (gt.P("x"),), None, args=[tf.TensorSpec((8,))])
    assert lowered.layout_of("r") == Layout(((X1,), (X2,)))
    assert lowered.output_shardings[0] == Sharding.from_spec(LINE, gt.P("x:(1)2", "x:(2)2"), 2)
    assert not lowered.collectives()
    assert "Reshape                  (2, 4)             P('x:(1)2', 'x:(2)2')" in \
        lowered.report()
    assert "'x:(2)2' (dim 1) comes from argument 0" in lowered.explain("r")
    lowered = gt.lower(lambda x: tf.reshape(x * 2.0, (6, 8), name="r") * 3.0, LINE,
                       (gt.P("x"),), None, args=[tf.TensorSpec((48,))])
    assert lowered.layout_of("r") == Layout(((X1,), ()))


def test_parts_merge_back_through_elementwise_ops_and_a_merging_reshape():
    # given on parts, the merged dim holds the whole axis: nothing moves
    lowered = gt.lower(lambda x: tf.reshape(tf.exp(x), (-1,), name="flat") + 1.0, LINE,
                       (gt.P("x:(1)2", "x:(2)2"),), None, args=[tf.TensorSpec((2, 4))])
    assert lowered.layout_of("flat") == Layout((("x",),))
    assert not lowered.collectives()


def test_spec_spelling_round_trips():
    mesh = Mesh.abstract((2, 4), ("data", "model"))
    for spec in [gt.P("model:(1)2"), gt.P(None, "model:(2)2"), gt.P(("data", "model:(2)2")),
                 gt.P("model:(2)2", ("data", "model:(1)2"))]:
        layout = Layout.from_spec(mesh, spec, 2)
        assert layout.to_spec() == spec
        sharding = Sharding.from_layout(mesh, layout)
        assert sharding.to_layout(mesh, 2) == layout
        assert Sharding.parse(str(sharding)) == sharding
    # parts making up the axis are the axis
    assert Layout.from_spec(mesh, gt.P(("model:(1)2", "model:(2)2")), 1) == \
        Layout((("model",),))
    assert Layout.from_spec(mesh, gt.P("model:(1)4"), 1) == Layout((("model",),))
    assert str(Sharding.from_spec(mesh, gt.P("model:(1)2"), 1)) == \
        "{devices=[2,4]0,1,4,5,2,3,6,7 last_tile_dim_replicate}"
    # a tile assignment over parts of axes reads back as sub-axes
    assert Sharding.parse("{devices=[2,2,2]<=[8]}").to_layout(mesh, 3) == \
        Layout.from_spec(mesh, gt.P("data", "model:(1)2", "model:(2)2"), 3)


@pytest.mark.parametrize("spec, message", [
    (gt.P("model:(1)3"), "does not cut"),
    (gt.P("model:(2)4"), "does not cut"),
    (gt.P("model", "model:(2)2"), "twice"),
    (gt.P(("model:(1)2", "model:(1)4")), "twice"),
    (gt.P("other:(1)2"), "unknown mesh axis"),
])
def test_bad_sub_axis_is_a_sharding_error(spec, message):
    mesh = Mesh.abstract((2, 4), ("data", "model"))
    with pytest.raises(gt.ShardingError, match=message):
        Layout.from_spec(mesh, spec, 2)


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([(4, "x"), (8, "x"), (24, "ab")]), st.data())
def test_split_into_dims_sharing_a_factor_with_the_axis_values_equal_single_device(
        mesh_kind, data):
    """(n,) -> (a, b) with a sharing a factor with the axis's devices that does not
    split it whole ((48,) -> (6, 8) on 4, (8,) -> (2, 4); uneven n / devices included):
    summed and elementwise results equal one device's."""
    devices, kind = mesh_kind
    if kind == "x":
        mesh, spec = gt.Mesh.create((devices,), ("x",)), gt.P("x")
    else:
        mesh, spec = gt.Mesh.create((2, 4), ("a", "b")), gt.P(("a", "b"))
        devices = 8
    a = data.draw(st.sampled_from([d for d in (2, 4, 6, 10) if 1 < gcd(d, devices) < devices]),
                  label="a")
    b = data.draw(st.integers(1, 7), label="b")
    x = np.random.default_rng(a * 10 + b).standard_normal(a * b).astype(np.float32)
    lowered = check_partitioned(
        lambda t: (tf.reduce_sum(tf.square(tf.reshape(t * 2.0, (a, b))), axis=1),
                   tf.reshape(t, (a, b)) - 1.0), (x,), mesh, (spec,))
    assert not lowered.program.replicated_ops


def test_annotation_on_parts_of_an_axis():
    # a mesh_split inside the program names a part: the matmul's rows follow it, and the
    # result's sharding (a tile assignment over parts) reads back as the part
    mesh = Mesh.abstract((2, 4), ("data", "model"))

    def fn(x, w):
        h = gt.mesh_split(tf.nn.relu(x), mesh, gt.P(("data", "model:(2)2")))
        return tf.matmul(h, w, name="y")

    lowered = gt.lower(fn, mesh, (gt.P(), gt.P()), None,
                       args=[tf.TensorSpec((16, 8)), tf.TensorSpec((8, 4))])
    part = Layout.from_spec(mesh, gt.P(("data", "model:(2)2")), 2)
    assert lowered.layout_of("y") == part
    assert lowered.output_shardings[0].to_layout(mesh, 2) == part
