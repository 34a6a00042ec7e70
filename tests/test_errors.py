"""Bad input gives a gt.ShardingError naming the tensor, op or axis, and what to change."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.P
MESH = gt.Mesh.abstract((2, 4), ("data", "model"))
X = tf.TensorSpec((8, 4), tf.float32)


def lower(fn, in_shardings, *specs, out_shardings=None, mesh=MESH):
    return gt.function(fn, mesh=mesh, in_shardings=in_shardings,
                       out_shardings=out_shardings).lower(*specs)


def test_sharding_error_is_a_value_error():
    assert issubclass(gt.ShardingError, ValueError)


def test_unknown_axis_name():
    with pytest.raises(gt.ShardingError, match=r"unknown mesh axis 'modle'.*\('data', 'model'\)"):
        lower(lambda x: x * 2.0, (P("modle"),), X)


def test_spec_longer_than_rank():
    with pytest.raises(gt.ShardingError, match=r"argument 0 \(x\).*3 entries.*rank 2"):
        lower(lambda x: x * 2.0, (P("data", None, "model"),), X)


def test_axis_used_twice():
    with pytest.raises(gt.ShardingError, match=r"uses mesh axis 'data' twice"):
        lower(lambda x: x * 2.0, (P("data", "data"),), X)


def test_annotation_inside_names_the_tensor():
    def f(x):
        return gt.mesh_split(x * 2.0, MESH, P("model", "model"))
    with pytest.raises(gt.ShardingError, match="twice"):
        lower(f, (None,), X)


def test_mesh_larger_than_devices():
    with pytest.raises(gt.ShardingError, match=r"needs 16 devices but this process has 8"):
        gt.Mesh.create((4, 4), ("data", "model"))


def test_args_not_matching_signature():
    f = gt.function(lambda x, y: x + y, mesh=MESH, in_shardings=(P("data"), None))
    with pytest.raises(TypeError, match="missing a required argument: 'y'"):
        f.lower(X)
    f = gt.function(lambda x, y=1.0: x + y, mesh=MESH, in_shardings=(P("data"), None))
    with pytest.raises(gt.ShardingError,
                       match=r"got 1 arguments \(x\) but in_shardings has 2"):
        f.lower(X)
    g = gt.function(lambda x: x, mesh=MESH, out_shardings=(P("data"), P("data")))
    with pytest.raises(gt.ShardingError, match="1 outputs but out_shardings has 2"):
        g.lower(X)


def test_conflicting_annotations_on_one_tensor():
    from tensorflow.python.compiler.xla.experimental import xla_sharding

    def f(x):
        # TF's own API annotating the argument itself: split dim 1 over "data"
        xla_sharding.mesh_split(x, MESH.device_ids, [-1, 0], use_sharding_op=False)
        return x * 2.0

    with pytest.raises(gt.ShardingError, match=r"'x'.*two shardings that cannot both hold"):
        lower(f, (P("model"),), X)


def test_sharding_the_mesh_cannot_express():
    odd = gt.Sharding.parse("{devices=[8]0,2,4,6,1,3,5,7}")
    with pytest.raises(gt.ShardingError, match="argument 0"):
        lower(lambda x: x * 2.0, (odd,), X)


def test_sharded_tensor_from_a_mesh_of_other_devices():
    # (a mesh of the same devices in another shape or order takes it with its sharding:
    # tests/test_tile_assignments.py)
    mesh_a = gt.Mesh.create((2, 4), ("data", "model"))
    mesh_b = gt.Mesh.create((4,), ("x",))
    y = gt.function(lambda x: x * 1.0, mesh=mesh_a, in_shardings=(P("data"),))(
        np.ones((8, 4), np.float32))
    with pytest.raises(gt.ShardingError, match="another mesh, of other devices"):
        gt.function(lambda x: x + 1.0, mesh=mesh_b)(y)


def test_abstract_mesh_cannot_run():
    f = gt.function(lambda x: x * 2.0, mesh=MESH, in_shardings=(P("data"),))
    with pytest.raises(gt.ShardingError, match="abstract mesh"):
        f(np.ones((8, 4), np.float32))


def test_unknown_shape_names_the_tensor():
    f = gt.function(lambda x: x * 2.0, mesh=MESH)
    with pytest.raises(gt.ShardingError, match="x"):
        f.lower(tf.TensorSpec((None, 4), tf.float32))


def test_sharding_of_unknown_name():
    low = lower(lambda x: x * 2.0, (P("data"),), X)
    with pytest.raises(gt.ShardingError, match="no tensor named 'nope'"):
        low.sharding_of("nope")


def test_dims_past_int32_lower_on_an_abstract_mesh():
    # used to raise OverflowError in propagation
    big = 2**31 + 8
    low = lower(lambda x, w: tf.reduce_sum(tf.nn.relu(x @ w), axis=1), (P("data"), None),
                tf.TensorSpec((big, 4)), tf.TensorSpec((4, 8)))
    assert low.input_shardings[0] == gt.Sharding.from_spec(MESH, P("data"), 2)
    assert low.output_shardings[0] == gt.Sharding.from_spec(MESH, P("data"), 1)


def test_mesh_argument_must_be_a_mesh():
    with pytest.raises(gt.ShardingError, match=r"needs mesh=gt.Mesh\(...\), got \(2, 4\)"):
        gt.function(lambda x: x, mesh=(2, 4))
    with pytest.raises(gt.ShardingError, match="mesh_split needs a gt.Mesh"):
        gt.mesh_split(tf.ones((8, 4)), "mesh", P("data"))
    with pytest.raises(gt.ShardingError, match="give a tuple with one entry per argument"):
        gt.function(lambda x: x, mesh=MESH, in_shardings=P("data"))


def test_collective_timeout_is_checked():
    with pytest.raises(ValueError, match="collective_timeout=-1"):
        gt.function(lambda x: x, mesh=MESH, collective_timeout=-1)
    with pytest.raises(ValueError, match="give it to your backend"):
        gt.function(lambda x: x, mesh=MESH, collective_timeout=5, backend=lambda m: None)


@pytest.mark.parametrize("text, complaint", [
    (5, "a str such as .* not int 5"),
    (b"{replicated}", "not bytes .*decode the bytes first"),
    ("{devices=[2]0,99999999999999999999999}", "99999999999999999999999 is past int64"),
])
def test_sharding_parse_of_a_non_string_or_a_huge_device_id(text, complaint):
    with pytest.raises(gt.ShardingError, match=complaint):
        gt.Sharding.parse(text)


def test_tensor_spec_of_unknown_rank():
    with pytest.raises(gt.ShardingError, match=r"argument 0 \('x'\) .*unknown rank.*full shape"):
        lower(lambda x: x * 2.0, None, tf.TensorSpec(None, tf.float32))


def test_mesh_split_of_a_tensor_leaked_from_an_earlier_trace():
    leaked = []

    def keep(x):
        leaked.append(x * 2.0)
        return x

    lower(keep, None, X)
    with pytest.raises(gt.ShardingError, match=r"tensor mul:0 belongs to another trace "
                                               r"\(graph 'keep'\).*return it from"):
        lower(lambda x: x + gt.mesh_split(leaked[0], MESH, P("data")), None, X)
    with pytest.raises(gt.ShardingError, match="belongs to another trace"):
        gt.mesh_split(leaked[0], MESH, P("data"))  # eagerly, too


def test_a_variable_created_again_after_the_trace(mesh):
    """A notebook re-run: the cached program reads the deleted variable."""
    v = gt.Variable(np.ones((8, 4), np.float32), mesh, P("data"), name="rerun")
    scale = gt.function(lambda x: x * v, mesh=mesh)
    scale(np.ones((8, 4), np.float32))
    v = gt.Variable(np.ones((8, 4), np.float32), mesh, P("data"), name="rerun")
    with pytest.raises(gt.ShardingError, match="reading a gt.Variable that no longer exists.*"
                                               "create the gt.function again"):
        scale(np.ones((8, 4), np.float32))


@pytest.mark.parametrize("model", [object(), lambda x: x])
def test_shard_model_of_something_else_than_a_model(model, mesh):
    with pytest.raises(gt.ShardingError, match="shard_model takes a keras.Model"):
        gt.keras.shard_model(model, mesh, {})


def test_mesh_given_devices_as_a_third_argument():
    devices = [f"/device:CPU:{i}" for i in range(8)]
    with pytest.raises(gt.ShardingError, match="third argument is device_type.*gt.Mesh"):
        gt.Mesh.create((2, 4), ("data", "model"), devices)
    with pytest.raises(gt.ShardingError, match=r"takes 2 arguments, got 3.*reshape\(shape\)"):
        gt.Mesh((2, 4), ("data", "model"), devices)
