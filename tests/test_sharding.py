"""Sharding: XLA text and proto forms, Layout conversion, and graph annotations."""

import tracemalloc

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from tensorflow.compiler.xla import xla_data_pb2
from tensorflow.python.compiler.xla.experimental import xla_sharding

from gspmd_tf.annotations import mesh_split
from gspmd_tf.errors import ShardingError
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import MAX_DEVICES, Mesh, P, SubAxis
from gspmd_tf.sharding import Sharding

OpSharding = xla_data_pb2.OpSharding
MESHES = [Mesh.abstract((8,), ("x",)), Mesh.abstract((2, 4), ("data", "model")),
          Mesh.abstract((2, 2, 2), ("a", "b", "c")),
          # explicit device orders that no transpose of an iota gives
          Mesh.abstract((2, 4), ("data", "model"), device_ids=[[3, 1, 0, 2], [7, 5, 4, 6]]),
          Mesh.abstract((2, 3, 2), ("a", "b", "c"),
                        device_ids=np.random.default_rng(0).permutation(12).reshape(2, 3, 2))]
MESH = MESHES[1]

TEXTS = [
    "{replicated}",
    "{manual}",
    "{maximal device=3}",
    "{devices=[2,4]0,1,2,3,4,5,6,7}",
    "{devices=[4,2]0,4,1,5,2,6,3,7}",
    "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}",
    "{devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}",
    "{devices=[8]3,1,2,0,4,5,7,6}",
]


@st.composite
def layouts(draw, mesh):
    """A random layout of rank 0..4: each mesh axis splits some dim or none, in any order."""
    rank = draw(st.integers(0, 4))
    dims = [[] for _ in range(rank)]
    for name in draw(st.permutations(mesh.axis_names)):
        dim = draw(st.integers(-1, rank - 1))
        if dim >= 0:
            dims[dim].append(name)
    return Layout(tuple(tuple(axes) for axes in dims))


# ---- text and proto


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trip(text):
    sharding = Sharding.parse(text)
    assert str(sharding) == text
    assert Sharding.parse(str(sharding)) == sharding
    assert eval(repr(sharding), {"Sharding": Sharding}) == sharding


@pytest.mark.parametrize("text", TEXTS)
def test_proto_round_trip(text):
    sharding = Sharding.parse(text)
    proto = sharding.to_proto()
    assert Sharding.from_proto(proto) == sharding
    assert Sharding.from_proto(proto.SerializeToString()) == sharding


@pytest.mark.parametrize("text, expected", [
    ("{devices=[4,2]<=[2,4]T(1,0)}", "{devices=[4,2]0,4,1,5,2,6,3,7}"),
    ("{devices=[2,4]<=[8]}", "{devices=[2,4]0,1,2,3,4,5,6,7}"),
    ("{devices=[2,2,2]<=[2,2,2]T(2,1,0) last_tile_dim_replicate}",
     "{devices=[2,2,2]0,4,2,6,1,5,3,7 last_tile_dim_replicate}"),
    ("{devices=[2,1,4]<=[8] last_tile_dims={replicated}}",
     "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"),
    ("{devices=[2,1,2,2]<=[8] last_tile_dims={replicated, replicated}}",
     "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"),
    # Canonical forms, as XLA: no split dim is replicated, a size-1 replication dim is
    # dropped, replication groups are sorted, metadata is ignored.
    ("{devices=[1,1,8]<=[8] last_tile_dim_replicate}", "{replicated}"),
    ("{devices=[1,1]5}", "{replicated}"),
    ("{devices=[4,2,1]<=[8] last_tile_dim_replicate}", "{devices=[4,2]0,1,2,3,4,5,6,7}"),
    ("{devices=[2,1,4]3,1,2,0,4,6,5,7 last_tile_dim_replicate}",
     "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"),
    ('  { devices=[2]0,1 metadata={op_name="a}b" source_line=3} } ', "{devices=[2]0,1}"),
])
def test_parse_normalizes(text, expected):
    assert str(Sharding.parse(text)) == expected


@pytest.mark.parametrize("text", [
    "replicated", "{}", "{tiled}", "{maximal device=-1}", "{devices=[2,2]0,1,2}",
    "{devices=[2]0,0}", "{devices=[2]<=[2]T(1,0)}", "{devices=[4]<=[2,4]}",
    "{devices=[2,2]0,1,2,3 last_tile_dims={manual}}",
    "{devices=[2,2]0,1,2,3 last_tile_dim_replicate last_tile_dims={replicated}}",
    "{{replicated}, {manual}}",
])
def test_parse_rejects_bad_text(text):
    with pytest.raises(ShardingError) as info:
        Sharding.parse(text)
    assert repr(text) in str(info.value) or text in str(info.value)


def test_queries():
    tiled = Sharding.parse("{devices=[2,1,4]<=[8] last_tile_dim_replicate}")
    assert tiled.is_tiled and not (tiled.is_replicated or tiled.is_maximal or tiled.is_manual)
    assert tiled.tile_shape == (2, 1) and tiled.num_devices == 8
    assert Sharding.parse("{devices=[4,2]<=[8]}").tile_shape == (4, 2)
    assert Sharding.replicate().is_replicated and Sharding.replicate().tile_shape is None
    assert Sharding.maximal(3).is_maximal and Sharding.maximal(3).num_devices == 1
    assert Sharding.manual().is_manual and Sharding.manual().num_devices is None
    assert not tiled.tile_assignment.flags.writeable


def test_equality_and_hash():
    texts = ["{devices=[2,1,4]3,1,2,0,4,6,5,7 last_tile_dim_replicate}",
             "{devices=[2,1,4]<=[8] last_tile_dim_replicate}",
             "{devices=[2,1,4]<=[8] last_tile_dims={replicated}}"]
    assert len({Sharding.parse(t) for t in texts}) == 1
    distinct = ["{replicated}", "{manual}", "{maximal device=0}", "{maximal device=1}",
                "{devices=[8]<=[8]}", "{devices=[8,1]<=[8]}", "{devices=[1,8]<=[8]}",
                "{devices=[8]<=[2,4]T(1,0)}", "{devices=[4,1,2]<=[8] last_tile_dim_replicate}"]
    assert len({Sharding.parse(t) for t in distinct}) == len(distinct)
    assert Sharding.replicate() != "{replicated}"


def test_proto_forms():
    iota = OpSharding(type=OpSharding.OTHER, tile_assignment_dimensions=[4, 2],
                      iota_reshape_dims=[2, 4], iota_transpose_perm=[1, 0])
    assert Sharding.from_proto(iota) == Sharding.parse("{devices=[4,2]<=[2,4]T(1,0)}")
    subgroup = OpSharding(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 4],
                          tile_assignment_devices=range(8),
                          last_tile_dims=[OpSharding.REPLICATED])
    assert str(Sharding.from_proto(subgroup)) == (
        "{devices=[2,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}")
    tiled = Sharding.parse("{devices=[2,1,4]<=[8] last_tile_dim_replicate}").to_proto()
    assert tiled.type == OpSharding.OTHER and tiled.replicate_on_last_tile_dim
    assert list(tiled.tile_assignment_dimensions) == [2, 1, 4]
    assert list(tiled.tile_assignment_devices) == list(range(8))
    assert Sharding.maximal(3).to_proto() == xla_sharding.Sharding.assign_device(3).proto
    assert Sharding.replicate().to_proto() == xla_sharding.Sharding.replicate().proto
    assert Sharding.manual().to_proto() == xla_sharding.Sharding.manual().proto


def test_tuple_protos():
    elements = [Sharding.replicate(), Sharding.parse("{devices=[2,4]<=[8]}"),
                Sharding.maximal(1)]
    proto = OpSharding(type=OpSharding.TUPLE,
                       tuple_shardings=[s.to_proto() for s in elements])
    assert Sharding.tuple_elements_from_proto(proto) == elements
    assert Sharding.tuple_elements_from_proto(proto.SerializeToString()) == elements
    with pytest.raises(ShardingError, match="tuple_elements_from_proto"):
        Sharding.from_proto(proto)
    with pytest.raises(ShardingError, match="is not a tuple"):
        Sharding.tuple_elements_from_proto(Sharding.replicate().to_proto())


@pytest.mark.parametrize("proto", [
    OpSharding(type=OpSharding.MAXIMAL, tile_assignment_devices=[0, 1]),
    OpSharding(type=OpSharding.UNKNOWN),
    OpSharding(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 2],
               tile_assignment_devices=[0, 1, 2]),
    OpSharding(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 2],
               tile_assignment_devices=range(4), last_tile_dims=[OpSharding.MANUAL]),
    OpSharding(type=OpSharding.OTHER, tile_assignment_dimensions=[4],
               iota_reshape_dims=[2, 2], iota_transpose_perm=[0, 0]),
    b"\xff\xff",
])
def test_bad_protos(proto):
    with pytest.raises(ShardingError):
        Sharding.from_proto(proto)


_TILE_OF_2_18 = np.arange(1 << 18)  # made here, outside the measured allocation


@pytest.mark.parametrize("make", [
    lambda: Sharding.parse("{devices=[10000000]<=[10000000]}"),
    lambda: Sharding.parse("{devices=[100000000]<=[100000000]}"),
    lambda: Sharding.parse("{devices=[4294967296,4294967296]<=[18446744073709551616]}"),
    lambda: Sharding.parse("{maximal device=10000000000000000000000}"),
    lambda: Sharding.from_proto(OpSharding(type=OpSharding.OTHER,
                                           tile_assignment_dimensions=[1 << 20, 1 << 20],
                                           iota_reshape_dims=[1 << 40])),
    lambda: Sharding.tile(_TILE_OF_2_18),
    lambda: Sharding.maximal(1 << 40),
])
def test_absurd_device_counts_are_refused_at_once(make):
    # each used to allocate its device table first: 10**7 devices took 9 s and 700 MiB;
    # refused before any table exists: at most a copy of the 2 MiB tile array given, far
    # below the 80 MiB table of 10**7 devices
    tracemalloc.start()
    try:
        with pytest.raises(ShardingError, match=r"at most 131072|between 0 and 131071"):
            make()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated before refusing"


@pytest.mark.parametrize("make, message", [
    (lambda: Sharding.maximal(2.5), "must be an integer"),
    (lambda: Sharding.maximal("3"), "must be an integer"),
    (lambda: Sharding.maximal(-1), "between 0 and"),
    (lambda: Sharding.parse("{devices=[2,0]0,1}"), "a dim is 0"),
    (lambda: Sharding.from_proto(OpSharding(type=OpSharding.OTHER,
                                            tile_assignment_dimensions=[2, 0])), "a dim is 0"),
])
def test_bad_device_fields(make, message):
    with pytest.raises(ShardingError, match=message):
        make()


def test_largest_supported_sharding_parses():
    sharding = Sharding.parse(f"{{devices=[{MAX_DEVICES}]<=[{MAX_DEVICES}]}}")
    assert sharding.num_devices == MAX_DEVICES


# ---- Layout conversion


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@given(data=st.data())
def test_layout_round_trip(mesh, data):
    layout = data.draw(layouts(mesh))
    sharding = Sharding.from_layout(mesh, layout)
    assert Sharding.from_spec(mesh, layout.to_spec(), layout.rank) == sharding
    assert sharding.to_layout(mesh, layout.rank) == layout
    assert Sharding.parse(str(sharding)) == sharding
    assert Sharding.from_proto(sharding.to_proto()) == sharding
    assert sharding.is_replicated == layout.is_replicated
    if sharding.is_replicated:
        return
    # The device at tile index (i0, i1, ...) holds shard i_k of dim k: the contract of
    # mesh.shard_index that the partitioner relies on.
    assert sharding.tile_shape == tuple(mesh.axes_size(a) for a in layout.dims)
    for index, device in np.ndenumerate(sharding.tile_assignment):
        for dim, axes in enumerate(layout.dims):
            assert index[dim] == mesh.shard_index(device, axes)


def test_from_layout_examples():
    assert str(Sharding.from_spec(MESH, P("data"), 2)) == (
        "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}")
    assert str(Sharding.from_spec(MESH, P("model", "data"), 2)) == (
        "{devices=[4,2]0,4,1,5,2,6,3,7}")
    assert str(Sharding.from_spec(MESH, P(("model", "data")), 1)) == (
        "{devices=[8]0,4,1,5,2,6,3,7}")
    assert str(Sharding.from_spec(MESH, P(None, "model"), 3)) == (
        "{devices=[1,4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}")
    assert Sharding.from_spec(MESH, P(), 2).is_replicated
    assert Sharding.from_spec(MESH, P(), 0).is_replicated


@pytest.mark.parametrize("text, dims", [
    ("{devices=[8]<=[8]}", (("data", "model"),)),
    ("{devices=[4,2]<=[2,4]T(1,0)}", (("model",), ("data",))),
    ("{devices=[1,8]<=[2,4]T(1,0)}", ((), ("model", "data"))),
    ("{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}", (("model",), ())),
    ("{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dims={replicated}}", (("model",), ())),
    ("{replicated}", ((), ())),
    ("{maximal device=5}", ((), ())),  # computed on every device
])
def test_to_layout_examples(text, dims):
    assert Sharding.parse(text).to_layout(MESH, len(dims)) == Layout(dims)


def test_to_layout_of_an_explicit_device_list():
    # the device list of a mesh made from that same device array: each tile dim one axis
    mesh = Mesh.abstract((2, 4), ("data", "model"), device_ids=[[0, 2, 4, 6], [1, 3, 5, 7]])
    sharding = Sharding.parse("{devices=[2,4]0,2,4,6,1,3,5,7}")
    assert sharding.to_layout(mesh, 2) == Layout((("data",), ("model",)))
    # the row-major mesh expresses it over parts of "model" (sub-axes, as Shardy's)
    assert sharding.to_layout(MESH, 2) == Layout(
        ((SubAxis("model", 2, 2, 4),), ("data", SubAxis("model", 1, 2, 4))))
    with pytest.raises(ShardingError, match="not a transpose of the mesh axes"):
        Sharding.parse("{devices=[8]1,0,2,3,4,5,6,7}").to_layout(MESH, 1)  # nor parts
    shuffled = Mesh.abstract((2, 4), ("data", "model"), device_ids=[[3, 1, 0, 2], [7, 5, 4, 6]])
    assert Sharding.parse("{devices=[1,8]3,7,1,5,0,4,2,6}").to_layout(shuffled, 2) == \
        Layout(((), ("model", "data")))
    assert Sharding.parse("{devices=[4,1,2]3,7,1,5,0,4,2,6 last_tile_dim_replicate}") \
        .to_layout(shuffled, 2) == Layout((("model",), ()))


def test_to_layout_computes_the_axis_order_on_many_axes():
    # 12 axes: trying every order of the mesh axes (12! of them) would not finish
    names = tuple("abcdefghijkl")
    ids = np.random.default_rng(1).permutation(1 << 12).reshape((2,) * 12)
    mesh = Mesh.abstract((2,) * 12, names, device_ids=ids)
    layout = Layout((("l", "a", "f"), (), ("c",), ("k", "b", "j", "d")))
    assert Sharding.from_layout(mesh, layout).to_layout(mesh, 4) == layout


def test_size_one_axes_are_dropped():
    mesh = Mesh.abstract((2, 1, 4), ("a", "one", "b"))
    sharding = Sharding.from_spec(mesh, P(("one", "b"), "a"), 2)
    assert sharding == Sharding.from_spec(mesh, P("b", "a"), 2)
    assert sharding.to_layout(mesh, 2) == Layout((("b",), ("a",)))


@pytest.mark.parametrize("text, rank, message", [
    # no layout of MESH places these tiles: Sharding.placement gives a mesh that does
    # (gt.function takes them: tests/test_tile_assignments.py)
    ("{devices=[8]0,2,1,3,4,5,6,7}", 1, "not a transpose of the mesh axes.*placement"),
    ("{devices=[2,2,2]0,2,1,3,4,5,6,7}", 3, "not a transpose of the mesh axes"),
    ("{devices=[2,1,4]0,1,2,4,3,5,6,7 last_tile_dim_replicate}", 2,
     "not a transpose of the mesh axes"),
    ("{devices=[4]0,1,2,3}", 1, "every device id of the mesh"),
    ("{devices=[16]<=[16]}", 1, "every device id of the mesh"),
    ("{devices=[2,4]<=[8]}", 3, "tiles 2 dims but the tensor has rank 3"),
    ("{manual}", 2, "manual shardings are not supported"),
    ("{maximal device=99}", 2, "the mesh has no device 99"),
])
def test_to_layout_rejects(text, rank, message):
    # ({devices=[2,2,2]<=[8]} is P(data, model:(1)2, model:(2)2): tests/test_sub_axes.py)
    sharding = Sharding.parse(text)
    with pytest.raises(ShardingError, match=message) as info:
        sharding.to_layout(MESH, rank, what="input x")
    assert str(info.value).startswith(f"input x: sharding {sharding} on {MESH!r}")


def test_from_layout_rejects():
    with pytest.raises(ShardingError, match="reduction pending"):
        Sharding.from_layout(MESH, Layout((("data",),), partial=("model",)))
    with pytest.raises(ShardingError, match="twice"):
        Sharding.from_layout(MESH, Layout((("data",), ("data",))))
    with pytest.raises(ShardingError, match="unknown mesh axis 'nope'"):
        Sharding.from_layout(MESH, Layout((("nope",),)))
    with pytest.raises(ShardingError, match="w: spec .* has 3 entries"):
        Sharding.from_spec(MESH, P("data", None, "model"), 2, what="w")


# ---- TF's own annotation API


SPEC_OF_TF = [
    (xla_sharding.Sharding.split(None, 0, 8, input_shape=[16, 4]), P(("data", "model"))),
    (xla_sharding.Sharding.split(None, 1, 8, input_shape=[16, 8]), P(None, ("data", "model"))),
    (xla_sharding.Sharding.tile(np.arange(8).reshape(2, 4)), P("data", "model")),
    (xla_sharding.Sharding.tile(np.arange(8).reshape(2, 4).T), P("model", "data")),
    (xla_sharding.Sharding.partial_tile(np.arange(8).reshape(2, 1, 4)), P("data")),
    (xla_sharding.Sharding.partial_tile(np.arange(8).reshape(2, 4).T.reshape(4, 1, 2)),
     P("model")),
    (xla_sharding.Sharding.replicate(), P()),
    (xla_sharding.Sharding.assign_device(3), P()),
    (xla_sharding.mesh_split_sharding(np.arange(8).reshape(2, 4), [-1, 1, 0]),
     P(None, "model", "data")),
    (xla_sharding.mesh_split_sharding(np.arange(8).reshape(2, 4), [0, -1]), P("data")),
]


@pytest.mark.parametrize("tf_sharding, spec", SPEC_OF_TF)
def test_tf_xla_sharding_protos(tf_sharding, spec):
    rank = max(len(spec), 2)
    layout = Sharding.from_proto(tf_sharding.proto).to_layout(MESH, rank)
    assert layout == Layout.from_spec(MESH, spec, rank)


def _sharding_ops(fn, *specs):
    graph = fn.get_concrete_function(*specs).graph
    return [op for op in graph.get_operations() if op.type == "XlaSharding"]


def test_mesh_split_in_tf_function():
    mesh = Mesh.create((2, 4), ("data", "model"))

    @tf.function
    def f(x):
        return mesh_split(tf.nn.relu(x), mesh, P("model", "data")) * 2.0

    (op,) = _sharding_ops(f, tf.TensorSpec([8, 6]))
    expected = Sharding.from_spec(mesh, P("model", "data"), 2)
    assert Sharding.from_proto(op.get_attr("sharding")) == expected
    assert Sharding.from_proto(op.get_attr("_XlaSharding")) == expected
    x = np.arange(48, dtype=np.float32).reshape(8, 6) - 20
    # XlaSharding is an identity outside XLA, with a CPU kernel.
    with tf.device(mesh.devices[3]):
        np.testing.assert_allclose(f(tf.constant(x)).numpy(), np.maximum(x, 0) * 2)


def test_tf_split_in_tf_function():
    @tf.function
    def f(x):
        return xla_sharding.split(x, 1, 4, use_sharding_op=True) + 1.0

    (op,) = _sharding_ops(f, tf.TensorSpec([2, 8]))
    layout = Sharding.from_proto(op.get_attr("sharding")).to_layout(
        Mesh.abstract((4,), ("x",)), 2)
    assert layout == Layout(((), ("x",)))


def test_mesh_split_eager_returns_input():
    x = tf.ones([4, 4])
    assert mesh_split(x, MESH, P("data")) is x
    array = np.ones([4])
    assert mesh_split(array, MESH, P("model")) is array
    with pytest.raises(ShardingError, match="tensor: spec"):
        mesh_split(x, MESH, P("data", "model", None))


def test_mesh_split_errors_name_the_tensor():
    @tf.function
    def bad_spec(x):
        return mesh_split(tf.identity(x, name="hidden"), MESH, P("data", "data"))

    with pytest.raises(ShardingError, match="tensor hidden:0: spec .* twice"):
        bad_spec.get_concrete_function(tf.TensorSpec([4, 4]))

    @tf.function
    def unknown_rank(x):
        return mesh_split(x, MESH, P("data"))

    with pytest.raises(ShardingError, match="unknown rank"):
        unknown_rank.get_concrete_function(tf.TensorSpec(None))
