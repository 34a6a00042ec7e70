"""Mesh, PartitionSpec and logical CPU devices."""

import numpy as np
import pytest
import tensorflow as tf

from gspmd_tf.devices import configure_cpu_devices
from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import MAX_DEVICES, Mesh, P


def test_create_uses_local_devices_row_major():
    mesh = Mesh.create((2, 4), ("data", "model"))
    assert mesh.shape == (2, 4) and mesh.size == 8 and not mesh.is_abstract
    np.testing.assert_array_equal(mesh.device_ids, np.arange(8).reshape(2, 4))
    assert [tf.DeviceSpec.from_string(d).device_index for d in mesh.devices] == list(range(8))
    assert mesh.axis_size("model") == 4 and mesh.axis_index("model") == 1
    assert mesh.axes_size(("data", "model")) == 8


def test_abstract_mesh_may_exceed_local_devices():
    mesh = Mesh.abstract((32, 64), ("data", "model"))
    assert mesh.is_abstract and mesh.devices is None and mesh.size == 2048
    assert mesh == Mesh.abstract((32, 64), ("data", "model"))
    assert hash(mesh) == hash(Mesh.abstract((32, 64), ("data", "model")))
    assert mesh != Mesh.abstract((64, 32), ("data", "model"))


def test_coords_and_shard_index():
    mesh = Mesh.abstract((2, 4), ("data", "model"))
    assert mesh.coords(6) == (1, 2)
    assert mesh.shard_index(6, ("data",)) == 1
    assert mesh.shard_index(6, ("model",)) == 2
    assert mesh.shard_index(6, ("data", "model")) == 6
    assert mesh.shard_index(6, ("model", "data")) == 2 * 2 + 1
    assert mesh.shard_index(6, ()) == 0


def test_groups():
    mesh = Mesh.abstract((2, 4), ("data", "model"))
    np.testing.assert_array_equal(mesh.groups(("model",)), [[0, 1, 2, 3], [4, 5, 6, 7]])
    np.testing.assert_array_equal(mesh.groups(("data",)), [[0, 4], [1, 5], [2, 6], [3, 7]])
    np.testing.assert_array_equal(mesh.groups(("model", "data")), [[0, 4, 1, 5, 2, 6, 3, 7]])
    np.testing.assert_array_equal(mesh.groups(()), np.arange(8).reshape(8, 1))
    for axes in [("data",), ("model",), ("data", "model"), ("model", "data")]:
        for row in mesh.groups(axes):
            assert [mesh.shard_index(d, axes) for d in row] == list(range(len(row)))


def test_partition_spec():
    spec = P("data", None, ("x", "y"))
    assert spec.axes_of(0) == ("data",) and spec.axes_of(1) == ()
    assert spec.axes_of(2) == ("x", "y") and spec.axes_of(7) == ()
    assert repr(spec) == "P('data', None, ('x', 'y'))"
    with pytest.raises(ShardingError, match="PartitionSpec entry"):
        P(3)


@pytest.mark.parametrize("make, message", [
    (lambda: Mesh.abstract((2, 4), ("a", "a")), "repeat a name"),
    (lambda: Mesh.abstract((2, 4), ("a",)), "one name per dim"),
    (lambda: Mesh.abstract((2, 0), ("a", "b")), r"an axis size is 0; it must be at least 1"),
    (lambda: Mesh.abstract((2, 4), ("a", "b")).axis_size("c"), "unknown mesh axis 'c'"),
    (lambda: Mesh.abstract((2, 4), ("a", "b")).groups(("c",)), "unknown mesh axis 'c'"),
    (lambda: Mesh.create((4, 4), ("a", "b")), r"needs 16 devices but this process has 8"),
])
def test_mesh_errors(make, message):
    with pytest.raises(ShardingError, match=message):
        make()


def test_configure_cpu_devices_after_start():
    assert len(tf.config.list_logical_devices("CPU")) == 8  # the runtime has started
    configure_cpu_devices(8)
    configure_cpu_devices(4)
    with pytest.raises(ShardingError, match="before TensorFlow runs"):
        configure_cpu_devices(16)


@pytest.mark.parametrize("make, message", [
    (lambda: Mesh.create((1.5, 4), ("a", "b")), r"an axis size must be an integer, got 1.5"),
    (lambda: Mesh.abstract(("2", 4), ("a", "b")), r"an axis size must be an integer, got '2'"),
    (lambda: Mesh.abstract((True, 4), ("a", "b")), r"must be an integer, got True"),
    (lambda: Mesh.abstract((-2, 4), ("a", "b")), r"an axis size is -2"),
    (lambda: Mesh.create((2, 4), (1, 2)), r"1 is not a non-empty string"),
    (lambda: Mesh.abstract((2, 4), ("a", None)), r"None is not a non-empty string"),
    (lambda: Mesh.abstract((2, 4), ("a", "")), r"'' is not a non-empty string"),
    (lambda: Mesh.abstract(8, "x"), r"give a tuple of sizes and a tuple of names"),
    (lambda: Mesh.abstract((100000, 100000), ("a", "b")), r"needs 10000000000 devices.*at most"),
])
def test_mesh_shape_and_names_are_checked(make, message):
    with pytest.raises(ShardingError, match=message):
        make()


def test_numpy_sizes_and_the_largest_abstract_mesh_are_accepted():
    assert Mesh.abstract((np.int64(2), np.int32(4)), ("a", "b")).shape == (2, 4)
    assert Mesh.abstract((MAX_DEVICES // 64, 64), ("a", "b")).size == MAX_DEVICES


@pytest.mark.parametrize("devices, message", [
    (["/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0"],
     r"list /device:CPU:0 twice \(positions 0 and 1\)"),
    (["/device:CPU:0", "/cpu:0"], r"list /device:CPU:0 twice"),
    (["/device:CPU:0", "/device:CPU:99"], r"'/device:CPU:99' names no logical device"),
    (["/device:CPU:0", "/device:GPU:0"], r"'/device:GPU:0' names no logical device"),
    (["/device:CPU:0", "/job:localhost"], r"'/job:localhost' names 8 logical devices"),
    (["/device:CPU:0"], r"mesh shape \(1,\) has 1 dims but 2 axis names"),
    (["/device:CPU:0", 3], r"takes an array of TF device names"),
    ([0, 1], r"for local devices 0..N-1 in row-major order use\s+gt.Mesh.create"),
    (["/device:CPU:0", None], r"None is not a TF device name"),
])
def test_mesh_devices_must_exist_once(devices, message):
    # a duplicated device used to be accepted and its first collective hung forever
    names = ("a",) if len(devices) == 2 else ("a", "b")
    with pytest.raises(ShardingError, match=message):
        Mesh(devices, names)


def test_mesh_devices_are_resolved_to_local_names():
    mesh = Mesh(["/cpu:1", "/job:localhost/replica:0/task:0/device:CPU:0"], ("a",))
    # ids follow the process's device order: CPU:0 is id 0 though listed second
    assert mesh.devices == ["/device:CPU:0", "/device:CPU:1"]
    np.testing.assert_array_equal(mesh.device_ids, [1, 0])
    created = Mesh.create((2, 4), ("a", "b"))
    assert Mesh(np.reshape(created.devices, (2, 4)), ("a", "b")) == created
    assert Mesh([[tf.config.list_logical_devices("CPU")[i] for i in range(4 * r, 4 * r + 4)]
                 for r in range(2)], ("a", "b")) == created


# a device order no transpose of a 2x4 iota gives
SHUFFLED = [[3, 1, 0, 2], [7, 5, 4, 6]]


def shuffled_mesh(order=SHUFFLED, names=("data", "model")):
    """A mesh whose position (i, j) holds /device:CPU:order[i][j]."""
    cpus = Mesh.create((8,), ("x",)).devices
    return Mesh([[cpus[k] for k in row] for row in order], names)


def test_explicit_device_array_gives_device_ids_coords_and_groups():
    mesh = shuffled_mesh()
    np.testing.assert_array_equal(mesh.device_ids, SHUFFLED)
    assert [tf.DeviceSpec.from_string(d).device_index for d in mesh.devices] == list(range(8))
    assert mesh != Mesh.create((2, 4), ("data", "model"))
    assert mesh == shuffled_mesh() and hash(mesh) == hash(shuffled_mesh())
    for position, device in np.ndenumerate(mesh.device_ids):
        assert mesh.coords(device) == position
    assert mesh.shard_index(0, ("model",)) == 2 and mesh.shard_index(5, ("data", "model")) == 5
    np.testing.assert_array_equal(mesh.groups(("model",)), SHUFFLED)
    np.testing.assert_array_equal(mesh.groups(("data",)), np.transpose(SHUFFLED))
    for axes in [("data",), ("model",), ("data", "model"), ("model", "data")]:
        for row in mesh.groups(axes):
            assert [mesh.shard_index(d, axes) for d in row] == list(range(len(row)))


def test_abstract_mesh_with_device_ids():
    mesh = Mesh.abstract((2, 4), ("data", "model"), device_ids=SHUFFLED)
    assert mesh.is_abstract and mesh.coords(7) == (1, 0)
    assert mesh != Mesh.abstract((2, 4), ("data", "model"))
    for bad in ([[0, 1, 2, 3], [4, 5, 6, 6]], [[0, 1, 2, 3]], [[0, 1, 2, 3], [4, 5, 6, 8]]):
        with pytest.raises(ShardingError, match="holding each id 0..7 once"):
            Mesh.abstract((2, 4), ("data", "model"), device_ids=bad)


@pytest.mark.parametrize("n, message", [
    (0, "is 0; it must be between 1 and 4096"), (-3, "is -3"),
    ("8", r"must be an integer, got '8' \(str\)"), (8.0, "must be an integer"),
    (1 << 20, "between 1 and 4096"),
])
def test_configure_cpu_devices_checks_its_count(n, message):
    with pytest.raises(ShardingError, match=message):
        configure_cpu_devices(n)
