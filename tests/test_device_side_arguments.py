"""Arguments split on the devices (runtime/sharded_tensor.place_value): a global argument
becomes one tensor, and each distinct shard is sliced (and padded) from it by TF ops on
its device; devices holding the same shard share one tensor. The shards equal the host
split's (split_value), and a gt.function fed by them computes single-device TF's values."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.layout import Layout
from gspmd_tf.runtime.sharded_tensor import place_value, split_value
from util import check_partitioned, randn

P = gt.P


def _device(name):
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type, spec.device_index


@pytest.mark.parametrize("dims,shape", [
    ((("data",), ("model",)), (4, 8)),  # every device its own block
    (((), ("model",)), (3, 6)),         # uneven: padded shards; shared over "data"
    (((),), (5,)),                      # replicated
    ((("model",), ()), (0, 2)),         # no elements
])
def test_shards_made_on_their_devices_equal_the_host_split(mesh, rng, dims, shape):
    value = rng.standard_normal(shape).astype(np.float32)
    layout = Layout(dims)
    shards = place_value(tf.constant(value), mesh, layout, tf.float32)
    for device, (shard, piece) in enumerate(zip(shards, split_value(value, mesh, layout))):
        np.testing.assert_array_equal(shard.numpy(), piece)
        if shard.shape != value.shape:  # a slice: made on (the first of) its devices
            holders = [d for d in range(mesh.size) if shards[d] is shard]
            assert _device(shard.device) == _device(mesh.devices[holders[0]])


def test_replicated_argument_is_one_tensor_on_every_device(mesh):
    layout = Layout.replicated(2)
    shards = place_value(np.ones((2, 3), np.float32), mesh, layout, tf.float32)
    assert all(shard is shards[0] for shard in shards)


def test_uneven_arguments_from_tensors_compute_single_device_values(mesh, rng):
    args = [tf.constant(randn(rng, 5, 6)), tf.constant(randn(rng, 6, 7))]
    check_partitioned(lambda x, w: tf.nn.relu(x @ w), args, mesh,
                      (P("data", "model"), P("model", None)))


def test_strings_and_more_dims_than_tf_slice_takes_split_on_the_host(mesh):
    words = np.array([b"a", b"bb", b"ccc"], dtype=object)
    shards = place_value(tf.constant(words), mesh, Layout((("model",),)), tf.string)
    assert [list(s) for s in shards[:4]] == [[b"a"], [b"bb"], [b"ccc"], [b""]]
    deep = np.arange(16, dtype=np.float32).reshape((2,) + (1,) * 7 + (8,))
    shards = place_value(deep, mesh, Layout((("data",),) + ((),) * 7 + (("model",),)),
                         tf.float32)
    for shard, piece in zip(shards, split_value(deep, mesh, Layout(
            (("data",),) + ((),) * 7 + (("model",),)))):
        np.testing.assert_array_equal(np.asarray(shard), piece)
