"""Meshes with an explicit device array in a shuffled order (gt.Mesh(devices, names)):
programs, reshards, variables and gradients give the single-device values, every shard
lives on the physical device of its mesh position, and XLA annotations with an explicit
(non-iota) device list import onto such a mesh."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding

import gspmd_tf as gt
from gspmd_tf.backends.replicas import copy_owners
from lm import NAMES, SPECS, init_params, loss_fn, make_step
from util import assert_close, assert_replicas_equal, check_partitioned, randn

P = gt.P
# mesh position (i, j) holds /device:CPU:ORDER[i][j]; no transpose of an iota gives it
ORDER = [[3, 1, 0, 2], [7, 5, 4, 6]]


@pytest.fixture(scope="module")
def mesh():
    cpus = gt.Mesh.create((8,), ("x",)).devices
    return gt.Mesh([[cpus[k] for k in row] for row in ORDER], ("data", "model"))


def physical_index(name):
    return tf.DeviceSpec.from_string(name).device_index


def test_device_ids_are_the_physical_order(mesh):
    np.testing.assert_array_equal(mesh.device_ids, ORDER)
    assert [physical_index(d) for d in mesh.devices] == list(range(8))


def test_shards_live_on_the_device_of_their_mesh_position(mesh, rng):
    x = randn(rng, 4, 8)
    y = gt.function(lambda v: v * 2.0, mesh=mesh, in_shardings=(P("data", "model"),),
                    out_shardings=(P("data", "model"),))(x)
    assert_close(y.numpy(), x * 2.0)
    for position, device_id in np.ndenumerate(mesh.device_ids):
        shard = y.shards[device_id]
        assert physical_index(shard.backing_device) == ORDER[position[0]][position[1]]
        i, j = position
        np.testing.assert_array_equal(shard.numpy(), 2.0 * x[2 * i:2 * i + 2, 2 * j:2 * j + 2])


@pytest.mark.parametrize("source, target", [
    (P("data", "model"), P("model", "data")),             # all-to-all / reorder
    (P(("data", "model")), P(("model", "data"))),         # collective-permute
    (P("data", "model"), P()),                            # all-gather
    (P(), P(None, ("model", "data"))),                    # local slice
    (P("model"), P(None, "data")),
])
def test_reshards(mesh, rng, source, target):
    x = randn(rng, 8, 8)
    low = check_partitioned(lambda v: tf.identity(v) + 1.0, (x,), mesh, (source,), (target,))
    assert low.output_shardings[0] == gt.Sharding.from_spec(mesh, target, 2)


def test_megatron_mlp_gradients(mesh, rng):
    def step(x, y, w1, b1, w2):
        with tf.GradientTape() as tape:
            tape.watch([x, w1, b1, w2])
            h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1), b1))
            loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - y))
        return (loss,) + tuple(tape.gradient(loss, [x, w1, b1, w2]))

    args = (randn(rng, 8, 16), randn(rng, 8, 16), randn(rng, 16, 32), randn(rng, 32),
            randn(rng, 32, 16))
    low = check_partitioned(step, args, mesh,
                            (P("data"), P("data"), P(None, "model"), P("model"), P("model")))
    assert low.program.replicated_ops == []


def test_transformer_lm_training_with_variables(mesh):
    rng = np.random.default_rng(0)
    params = init_params(rng)
    tokens = rng.integers(0, 16, size=(8, 9)).astype(np.int32)
    variables = {n: gt.Variable(params[n], mesh, SPECS[n], name=n) for n in NAMES}
    step = gt.function(make_step(variables, {}, params["heads"], "sgd"), mesh=mesh,
                       in_shardings=(P("data"),))
    losses = [step(tokens).numpy() for _ in range(3)]
    with tf.device("/device:CPU:0"):
        plain = {n: tf.Variable(params[n]) for n in NAMES}
        plain_step = tf.function(make_step(plain, {}, params["heads"], "sgd"))
        want = [plain_step(tokens).numpy() for _ in range(3)]
    assert_close(np.array(losses), np.array(want), "losses")
    for n in NAMES:
        assert_close(variables[n].numpy(), plain[n].numpy(), n)
        assert_replicas_equal(variables[n])
        # each block's variable sits on the physical device of its first holder's mesh
        # position (the devices holding one block share it)
        owners = copy_owners(mesh, variables[n].layout)
        for device_id, shard in enumerate(variables[n].shard_variables):
            assert physical_index(shard.device) == \
                physical_index(mesh.devices[owners[device_id]])
    evaluate = gt.function(lambda t: loss_fn(variables, params["heads"], t), mesh=mesh,
                           in_shardings=(P("data"),))
    assert_close(evaluate(tokens).numpy(), loss_fn(plain, params["heads"], tokens).numpy(),
                 "trained loss")


def annotated(assignment):
    """x @ w with x annotated by TF's own xla_sharding API with tile `assignment`."""
    def f(x, w):
        x = xla_sharding.tile(tf.identity(x), np.array(assignment))
        return tf.nn.relu(x @ w)
    return f


def test_xla_annotation_with_an_explicit_device_list(mesh, rng):
    x, w = randn(rng, 8, 12), randn(rng, 12, 8)
    low = check_partitioned(annotated(ORDER), (x, w), mesh, (None, None))
    (proto,) = low.graph.annotations.values()
    assert str(gt.Sharding.from_proto(proto)) == "{devices=[2,4]3,1,0,2,7,5,4,6}"
    assert low.input_shardings[0] == gt.Sharding.from_proto(proto)
    # x @ w contracts the dim split over "model": one all-reduce, no reshard of x
    assert [c.kind for c in low.collectives()] == ["all-reduce"]
    # on the row-major mesh no layout places its tiles so: it is the layout with its
    # tiles per dim (an intermediate's placement is not observable), and the report says so
    row_major = gt.Mesh.create((2, 4), ("data", "model"))
    low = check_partitioned(annotated(ORDER), (x, w), row_major, (None, None))
    assert low.input_shardings[0] == gt.Sharding.from_spec(row_major, P("data", "model"), 2)
    (note,) = low.placement_notes()
    assert "{devices=[2,4]3,1,0,2,7,5,4,6} taken as P('data', 'model')" in note


def test_xla_annotation_that_is_an_iota_transpose_of_another_device_array(rng):
    # {devices=[2,4]0,2,4,6,1,3,5,7}: the mesh whose rows are even and odd devices
    cpus = gt.Mesh.create((8,), ("x",)).devices
    mesh = gt.Mesh([cpus[0::2], cpus[1::2]], ("data", "model"))
    x, w = randn(rng, 8, 12), randn(rng, 12, 8)
    low = check_partitioned(annotated([[0, 2, 4, 6], [1, 3, 5, 7]]), (x, w), mesh,
                            (None, None))
    assert low.input_shardings[0] == gt.Sharding.parse("{devices=[2,4]0,2,4,6,1,3,5,7}")
