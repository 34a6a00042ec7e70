"""gt.Variable creation: the devices holding the same shard start from one tensor; the
CPU devices of a process holding one block share one variable, on the first of them."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.runtime.sharded_tensor import distinct_boxes
from util import assert_replicas_equal

P = gt.P


def _expected_shard(value, box, local_shape):
    """The slice `box` of `value`, zero-padded to `local_shape` (uneven shards)."""
    piece = value[tuple(slice(a, b) for a, b in box)]
    return np.pad(piece, [(0, n - s) for n, s in zip(local_shape, piece.shape)])


def _device_index(name):
    """(device type, index) of a device name, whatever its job/task prefix."""
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type, spec.device_index


@pytest.mark.parametrize("spec", [P(None, "model"), P("model", "data"), P(), P("data")])
@pytest.mark.parametrize("callable_init", [False, True])
def test_every_block_is_one_variable_on_the_first_device_holding_it(mesh, spec,
                                                                    callable_init):
    value = np.arange(7 * 10, dtype=np.float32).reshape(7, 10)  # uneven on 4
    init = ((lambda shape, dtype: tf.zeros(shape, dtype)) if callable_init else value)
    v = gt.Variable(init, mesh, spec, shape=value.shape, name="w")
    if callable_init:
        value = np.zeros_like(value)
    local_shape = v.layout.local_shape(mesh, v.shape)
    for box, devices in distinct_boxes(mesh, v.layout, v.shape):
        for device in devices:
            shard = v.shard_variables[device]
            assert shard is v.shard_variables[devices[0]]
            assert _device_index(shard.device) == _device_index(mesh.devices[devices[0]])
            assert not shard.trainable
            np.testing.assert_array_equal(shard.numpy(), _expected_shard(value, box,
                                                                         local_shape))
    assert_replicas_equal(v)
    np.testing.assert_array_equal(v.numpy(), value)


def test_the_devices_of_a_block_share_one_copy_that_updates_write_once(mesh):
    value = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    v = gt.Variable(value, mesh, P(None, "model"), name="w")  # replicated over "data"
    boxes = distinct_boxes(mesh, v.layout, v.shape)
    assert len(v.copies()) == len(boxes) < mesh.size
    v.assign_add(np.ones_like(value))
    np.testing.assert_array_equal(v.numpy(), value + 1)
    (box, devices), *_ = boxes
    piece = value[tuple(slice(a, b) for a, b in box)]
    for device in devices:
        np.testing.assert_array_equal(v.shards[device].numpy(), piece + 1)


def test_a_train_step_updates_every_replica_of_a_shard(mesh):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((8, 8)).astype(np.float32)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    v = gt.Variable(w0, mesh, P(None, "model"), name="w")
    plain = tf.Variable(w0)

    def step(variable):
        def run(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(x @ variable))
            variable.assign_sub(0.01 * tape.gradient(loss, variable))
            return loss
        return run

    gstep = gt.function(step(v), mesh=mesh, in_shardings=(P("data"),))
    for _ in range(2):
        gstep(x)
        tf.function(step(plain))(x)
    np.testing.assert_allclose(v.numpy(), plain.numpy(), rtol=1e-5, atol=1e-6)
    assert_replicas_equal(v)
