"""Tile assignments XLA accepts that no order of the mesh axes (or of their parts) gives:
inside a program an annotation is the layout with its tiles per dim; at the program's
boundary (in/out_shardings, a ShardedTensor argument) the shards are on the devices the
tile assignment names, moved there by one collective-permute (Sharding.placement)."""

import itertools

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding

import gspmd_tf as gt
from gspmd_tf.layout import Layout
from gspmd_tf.mesh import SubAxis
from gspmd_tf.layout import permute_pairs
from util import check_partitioned, randn

P = gt.P
MESH = gt.Mesh.abstract((2, 4), ("data", "model"))
SWAPPED = "{devices=[8,1]0,2,1,3,4,5,6,7}"  # devices 1 and 2 trade rows
# replica groups {0, 1, 2, 4} and {3, 5, 6, 7}: no mesh axis
PARTIAL = "{devices=[2,1,4]0,1,2,4,3,5,6,7 last_tile_dim_replicate}"


@pytest.mark.parametrize("text, spec, moved", [
    ("{devices=[8]0,2,1,3,4,5,6,7}", P(("data", "model")), 2),
    ("{devices=[2,2,2]0,2,1,3,4,5,6,7}", P("data", "model:(1)2", "model:(2)2"), 2),
    (PARTIAL, P("data"), 2),
    ("{devices=[8]7,6,5,4,3,2,1,0}", None, None),
])
def test_placement_keeps_the_tiles_on_a_mesh_of_the_named_device_order(text, spec, moved):
    sharding = gt.Sharding.parse(text)
    rank = len(sharding.tile_shape)
    layout, placed = sharding.placement(MESH, rank)
    assert placed is not MESH and placed.same_devices(MESH)
    assert gt.Sharding.from_layout(placed, layout) == sharding  # tiles where it says
    assert tuple(MESH.axes_size(axes) for axes in layout.dims) == tuple(sharding.tile_shape)
    if spec is not None:
        assert layout.to_spec() == spec
        pairs = permute_pairs(MESH, layout, layout, placed, MESH)
        assert sum(s != t for s, t in pairs) == moved
    # to_layout still names only layouts of the mesh itself
    with pytest.raises(gt.ShardingError, match="Sharding.placement gives the layout"):
        sharding.to_layout(MESH, rank)


@pytest.fixture(scope="module")
def mesh():
    return gt.Mesh.create((2, 4), ("data", "model"))


def tile_of(sharding, device):
    """The tile index (per dim) `sharding` gives device id `device`."""
    where = np.argwhere(sharding.tile_assignment == device)[0]
    return tuple(where[:len(sharding.tile_shape)])


@pytest.mark.parametrize("text", [SWAPPED, PARTIAL])
def test_out_shardings_in_a_device_order_of_their_own_end_with_one_permute(mesh, rng, text):
    sharding = gt.Sharding.parse(text)
    x = randn(rng, 8, 6)
    f = gt.function(lambda v: v * 2.0, mesh=mesh, in_shardings=(P("data"),),
                    out_shardings=(sharding,))
    y = f(x)
    low = f.lower(x)
    assert low.output_shardings[0] == sharding and y.sharding == sharding
    assert [c.kind for c in low.collectives()] == ["collective-permute"]
    rows = 8 // sharding.tile_shape[0]
    for device in range(mesh.size):
        shard = y.shards[device]
        assert tf.DeviceSpec.from_string(shard.backing_device).device_index == device
        row = tile_of(sharding, device)[0]
        np.testing.assert_array_equal(shard.numpy(), 2.0 * x[row * rows:(row + 1) * rows])
    # such a ShardedTensor enters another program (here on another mesh of the same
    # devices) with its sharding: one permute in
    g = gt.function(lambda v: tf.reduce_sum(v, axis=1), mesh=gt.Mesh.create((8,), ("x",)))
    np.testing.assert_allclose(g(y).numpy(), (2.0 * x).sum(axis=1), rtol=1e-5)
    low = g.lower(y)
    assert low.input_shardings[0] == sharding
    assert [c.kind for c in low.collectives()] == ["collective-permute"]


def test_in_shardings_in_a_device_order_of_their_own_start_with_one_permute(mesh, rng):
    sharding = gt.Sharding.parse("{devices=[2,2,2]0,2,1,3,4,5,6,7}")
    x = randn(rng, 4, 6, 8)
    low = check_partitioned(lambda v: tf.nn.relu(v) * 3.0, (x,), mesh, (sharding,),
                            (sharding,))
    assert low.input_shardings[0] == sharding and low.output_shardings[0] == sharding
    # in and out: the tiles each move once; the program between them moves nothing
    assert [c.kind for c in low.collectives()] == ["collective-permute"] * 2


def test_annotations_in_a_device_order_of_their_own_take_the_layout_of_their_tiles(mesh,
                                                                                   rng):
    swapped, partial = gt.Sharding.parse(SWAPPED), gt.Sharding.parse(PARTIAL)

    def g(x, w):
        x = gt.mesh_split(tf.identity(x), mesh, swapped)
        return gt.mesh_split(tf.nn.relu(x @ w), mesh, partial)

    x, w = randn(rng, 8, 12), randn(rng, 12, 8)
    low = check_partitioned(g, (x, w), mesh, (None, None))
    layouts = {low.graph.tensor_name(ref): low.propagation.layout(ref).to_spec()
               for ref in low.graph.annotations}
    assert sorted(layouts.values(), key=str) == [P("data"), P(("data", "model"))]
    notes = low.placement_notes()
    assert len(notes) == 2 and all("2 of 8 devices" in note for note in notes)
    first = next(iter(layouts))
    assert notes[0].startswith(first) and notes[0] in low.explain(first)
    assert notes[0] in low.report()
    # x enters split 8 ways (the annotation seeds it); h gathers its model split only
    assert [c.kind for c in low.collectives()] == ["all-gather"]


@pytest.mark.parametrize("tile_shape", [(8,), (2, 4), (4, 1, 2)])
def test_placement_moves_the_fewest_shards_any_layout_of_those_tiles_would(tile_shape):
    parts = ["data", SubAxis("model", 1, 2, 4), SubAxis("model", 2, 2, 4)]
    cuts = np.cumsum([0] + [int(np.log2(t)) for t in tile_shape])
    rng = np.random.default_rng(3)
    for _ in range(6):
        sharding = gt.Sharding.tile(rng.permutation(8).reshape(tile_shape))

        def moved(layout):
            placed = MESH.with_arrangement([a for axes in layout.dims for a in axes],
                                           sharding.tile_assignment)
            return sum(s != t for s, t in permute_pairs(MESH, layout, layout, placed, MESH))

        fewest = min(moved(Layout(tuple(tuple(order[a:b]) for a, b in zip(cuts, cuts[1:]))))
                     for order in itertools.permutations(parts))
        layout, placed = sharding.placement(MESH, len(tile_shape))
        assert gt.Sharding.from_layout(placed, layout) == sharding
        assert moved(layout) == fewest
