"""Device meshes and partition specs."""

from __future__ import annotations

import numbers
import re
from typing import NamedTuple

import numpy as np

from gspmd_tf import cluster
from gspmd_tf.errors import ShardingError


class PartitionSpec(tuple):
    """How each dim of a tensor is split over mesh axes.

    Each entry is None (not split), an axis name, or a tuple of axis names (split over
    their product, first name major). A spec shorter than the rank leaves the trailing
    dims unsplit. A name may be part of an axis, a sub-axis, written as Shardy writes
    one: "x:(2)2" is 2 devices of axis x with 2 devices in the parts before it (x of 8
    devices is "x:(1)2", "x:(2)2", "x:(4)2", major to minor; see Mesh.parse_axis).
    """

    def __new__(cls, *entries):
        for entry in entries:
            names = entry if isinstance(entry, tuple) else (entry,)
            if not all(name is None or isinstance(name, str) for name in names):
                raise ShardingError(
                    f"PartitionSpec entry {entry!r}: use None, an axis name or a tuple of "
                    "axis names")
        return super().__new__(cls, entries)

    def __repr__(self):
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def axes_of(self, dim):
        """The axis names splitting `dim`, as a tuple (empty when unsplit)."""
        if dim >= len(self) or self[dim] is None:
            return ()
        entry = self[dim]
        return tuple(entry) if isinstance(entry, tuple) else (entry,)


P = PartitionSpec

# The most devices a mesh or sharding may name: far above the 2048 of the GSPMD paper's
# largest runs, and small enough that a mistyped count fails at once instead of
# allocating its device tables (a 10**8-device sharding took 8 GiB).
MAX_DEVICES = 1 << 17


def check_count(value, what, low=1, high=None):
    """`value` as an int in [low, high]; ShardingError naming `what` otherwise.

    Accepts Python and numpy integers, refuses bools, floats and strings (a mesh of
    1.5 devices must not become 1).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ShardingError(f"{what} must be an integer, got {value!r} "
                            f"({type(value).__name__})")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ShardingError(f"{what} is {value}; it must be {bound}")
    return value


def check_num_devices(count, what):
    """Refuse a device count above MAX_DEVICES (an int, possibly huge)."""
    if count > MAX_DEVICES:
        raise ShardingError(
            f"{what} needs {count} devices; gspmd-tf supports at most {MAX_DEVICES} "
            "(gspmd_tf.mesh.MAX_DEVICES)")


def local_device_names(device_type=None):
    """Names of the logical TF devices of this process, CPU unless GPUs are present."""
    return [name for name in global_device_names(device_type) if cluster.is_addressable(name)]


def global_device_names(device_type=None):
    """Names of the logical TF devices of every worker in device id order (worker-major),
    this process's alone without a cluster; CPU unless GPUs are present."""
    import tensorflow as tf  # late: configure_cpu_devices must run before TF starts

    if device_type is None:
        device_type = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    return cluster.global_device_names(
        d.name for d in tf.config.list_logical_devices(device_type))


class SubAxis(NamedTuple):
    """Part of mesh axis `axis` (of `whole` devices), as in Shardy's "model":(2)2: the
    axis's coordinate cut into major-to-minor factors, this one of `size` devices with
    `pre` devices in the factors more major than it.

    A Layout may hold them beside axis names (in the one form layout.merged_layout
    gives: parts making up an axis are the axis); specs write them "x:(2)2"
    (Mesh.parse_axis). Propagation cuts axes into them where a Reshape needs it
    (propagation/sub_axes.py), the reshard planner inside its plans (spmd/planner.py,
    "Sub-axis steps" in docs/DESIGN_LOG.md); Mesh.groups, shard_index and arrange accept
    them wherever they accept an axis name. (A named tuple: the planner hashes layouts
    holding them in its search.)"""

    axis: str
    pre: int
    size: int
    whole: int

    def __str__(self):
        return f"{self.axis}:({self.pre}){self.size}"

    def __repr__(self):  # as specs write it (Mesh.parse_axis), in messages beside names
        return repr(str(self))


# a sub-axis as specs write it, Shardy's spelling: "x:(2)4"
_SUB_AXIS = re.compile(r"(.+):\((\d+)\)(\d+)")


class Mesh:
    """An n-d array of devices with named axes, like jax.sharding.Mesh(devices, names).

    `Mesh(devices, axis_names)` takes an array (nested lists or np.ndarray) of TF device
    names (or tf.config.LogicalDevice) in any order; its shape is the mesh shape.
    Every device has a device id, the number XLA tile assignments use: the devices of the
    mesh numbered 0..N-1 in this process's device order (so /device:CPU:k has id k on a
    mesh of all local CPUs; after gt.initialize_cluster, the devices of all workers,
    worker-major). `device_ids` holds the id at each mesh position (any permutation of
    0..N-1); `devices[i]` is the TF device name of device id i (None for an abstract mesh,
    which serves lowering and reports). `addressable_ids` are the ids of this process's
    devices (all of them unless the mesh spans several workers). `workers[i]` numbers the
    worker process holding device id i (0, 1, ... in order of first appearance; from the
    job and task of the device names, or as given to Mesh.abstract): the cost model
    (gspmd_tf/cost_model.py) prices axes whose groups span workers as slower links.
    """

    def __init__(self, devices, axis_names, *more):
        if more:  # gt.Mesh(shape, axis_names, devices), as other APIs spell it
            raise ShardingError(
                f"gt.Mesh(devices, axis_names) takes 2 arguments, got {2 + len(more)}: "
                "the device array has the mesh's shape itself; give "
                "gt.Mesh(np.array(devices).reshape(shape), axis_names), or "
                "gt.Mesh.create(shape, axis_names) for this process's devices")
        grid = np.asarray(_device_names(devices), dtype=object)
        shape, axis_names = _check_axes(grid.shape, axis_names)
        names = _check_devices(grid.ravel())
        # ids follow the process's device order, whatever order the mesh lists them in
        order = _local_order(names)
        by_id = sorted(range(len(names)), key=lambda position: order[names[position]])
        ids = np.empty(len(names), dtype=np.int64)
        ids[by_id] = np.arange(len(names))
        devices = [names[p] for p in by_id]
        self._init(shape, axis_names, ids.reshape(shape), devices, _worker_numbers(devices))

    def _init(self, shape, axis_names, device_ids, devices, workers):
        self.shape = shape
        self.axis_names = axis_names
        self.size = int(device_ids.size)
        device_ids.setflags(write=False)
        self.device_ids = device_ids
        # position_of[id]: the flat (row-major) mesh position of device id `id`
        self._position_of = np.argsort(device_ids.ravel(), kind="stable")
        self._position_of.setflags(write=False)
        self.devices = devices
        self.addressable_ids = () if devices is None else tuple(
            i for i, name in enumerate(devices) if cluster.is_addressable(name))
        workers.setflags(write=False)
        self.workers = workers
        self._groups = {}
        self._shard_indices = {}

    @classmethod
    def create(cls, shape, axis_names, device_type=None):
        """A mesh over devices 0..N-1 in row-major order: this process's devices, or
        after gt.initialize_cluster those of every worker, worker-major."""
        if device_type is not None and not isinstance(device_type, str):
            raise ShardingError(
                f"Mesh.create's third argument is device_type, a str such as 'CPU' or "
                f"'GPU', not {type(device_type).__name__}; to build a mesh over devices "
                "you list, use gt.Mesh(np.array(devices).reshape(shape), axis_names)")
        shape, axis_names = _check_axes(shape, axis_names)
        names = global_device_names(device_type)
        needed = int(np.prod(shape))
        if needed > len(names) and cluster.current() is not None:
            counts = [sum(cluster.task_of(name) == task for name in names)
                      for task in range(cluster.current().num_workers)]
            raise ShardingError(
                f"mesh {tuple(shape)} needs {needed} devices but the cluster's "
                f"{len(counts)} workers have {len(names)} (worker: devices "
                f"{dict(enumerate(counts))}); call gt.configure_cpu_devices(n) on the "
                "workers before gt.initialize_cluster so that their n add up to at least "
                "the mesh size")
        if needed > len(names):
            raise ShardingError(
                f"mesh {tuple(shape)} needs {needed} devices but this process has "
                f"{len(names)} ({', '.join(names)}); call gt.configure_cpu_devices({needed}) "
                "before TensorFlow starts, or use a smaller mesh")
        return cls(np.array(names[:needed], dtype=object).reshape(shape), axis_names)

    @classmethod
    def abstract(cls, shape, axis_names, device_ids=None, workers=None):
        """A mesh with no devices: for lowering and reports only.

        `device_ids` (optional, an int array of `shape` holding each of 0..N-1 once) gives
        the device id at each position; row-major arange by default. `workers` (optional,
        N ints) gives the worker process of each device id, as on a mesh spanning several
        workers (e.g. [0, 0, 0, 0, 1, 1, 1, 1]: two workers of 4 devices); one by default.
        """
        shape, axis_names = _check_axes(shape, axis_names)
        size = int(np.prod(shape, dtype=np.int64))
        if device_ids is None:
            ids = np.arange(size, dtype=np.int64).reshape(shape)
        else:
            ids = np.array(device_ids, dtype=np.int64)
            if ids.shape != shape or sorted(ids.ravel().tolist()) != list(range(size)):
                raise ShardingError(
                    f"abstract mesh {shape}: device_ids {_short_list(ids)} must be an array of "
                    f"shape {shape} holding each id 0..{size - 1} once")
        mesh = cls.__new__(cls)
        mesh._init(shape, axis_names, ids, None, _abstract_workers(workers, size))
        return mesh

    @property
    def is_fully_addressable(self):
        """True when every device of the mesh belongs to this process."""
        return len(self.addressable_ids) == self.size

    @property
    def is_abstract(self):
        """True when the mesh has no devices to run on."""
        return self.devices is None

    def axis_index(self, name):
        """Position of axis `name` in the mesh shape."""
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise ShardingError(
                f"unknown mesh axis {name!r}: this mesh has axes {self.axis_names}") from None

    def parse_axis(self, name):
        """Axis name `name` as layouts hold it: a mesh axis name as it is; a sub-axis
        written as Shardy writes one, "x:(2)2" (2 devices of axis x, with 2 in the parts
        more major), as a SubAxis (the name of the axis when it is all of it).
        ShardingError for an unknown axis or a part that does not cut its axis."""
        if name in self.axis_names:
            return name
        match = _SUB_AXIS.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            self.axis_index(name)  # raises, naming the mesh's axes
        axis, pre, size = match.group(1), int(match.group(2)), int(match.group(3))
        sub = SubAxis(axis, pre, size, self.axis_size(axis))
        if pre < 1 or size < 1:
            raise ShardingError(f"sub-axis {name!r}: pre-size and size must be at least 1")
        self._check_sub_axis(sub)
        return axis if size == sub.whole else sub

    def axis_size(self, name):
        """Number of devices along axis `name` (a name or a SubAxis)."""
        if isinstance(name, SubAxis):
            self._check_sub_axis(name)
            return name.size
        return self.shape[self.axis_index(name)]

    def _check_sub_axis(self, sub):
        whole = self.shape[self.axis_index(sub.axis)]
        if sub.whole != whole or whole % (sub.pre * sub.size):
            raise ShardingError(f"sub-axis {sub} does not cut mesh axis {sub.axis!r} of "
                                f"{whole} devices")

    def axes_size(self, axes):
        """Product of the sizes of `axes`."""
        size = 1
        for name in axes:
            size *= self.axis_size(name)
        return size

    def coords(self, device_id):
        """The device's index along every mesh axis."""
        position = self._position_of[int(device_id)]
        return tuple(int(c) for c in np.unravel_index(position, self.shape))

    def positions(self):
        """The flat (row-major) mesh position of every device id: positions()[id]."""
        return self._position_of

    def shard_index(self, device_id, axes):
        """Linear index of the device along `axes`, the first axis major."""
        return int(self.shard_indices(axes)[int(device_id)])

    def shard_indices(self, axes):
        """Every device's shard_index along `axes`, indexed by device id."""
        axes = tuple(axes)
        if axes not in self._shard_indices:
            groups = self.groups(axes)
            index = np.empty(self.size, np.int64)
            index[groups] = np.arange(groups.shape[1])
            index.setflags(write=False)
            self._shard_indices[axes] = index
        return self._shard_indices[axes]

    def groups(self, axes):
        """Device ids sharing all coordinates outside `axes`: [num_groups, group_size].

        Each row is ordered by shard_index(., axes).
        """
        axes = tuple(axes)
        if axes not in self._groups:
            ids = self.arrange(axes).reshape(self.axes_size(axes), -1)
            self._groups[axes] = np.ascontiguousarray(ids.T)
        return self._groups[axes]

    def arrange(self, axes):
        """Device ids as an array [size of axes[0], ..., size of axes[-1], rest]: the
        device at index i of the first dims has shard index i along `axes` (names or
        SubAxis), and `rest` runs over the coordinates along every other mesh axis (or
        part of one) in mesh order. ShardingError when two of `axes` overlap."""
        axes = tuple(axes)
        sizes, factors_of = self._factors(axes)
        order = [f for a in axes for f in factors_of(a)]
        if len(set(order)) != len(order):
            raise ShardingError(f"mesh axes {tuple(str(a) for a in axes)} overlap: a mesh "
                                "axis (or part of one) can be named once")
        rest = [f for f in range(len(sizes)) if f not in order]
        ids = self.device_ids.reshape(sizes).transpose(order + rest)
        return ids.reshape([self.axis_size(a) for a in axes] + [-1])

    def with_arrangement(self, axes, ids):
        """The mesh of the same devices, axes and workers whose arrange(axes) is `ids`
        (an array of device ids in arrange's shape, [size of axes[0], ..., rest]): the
        mesh on which a tile assignment no order of this mesh's axes gives is a layout
        (Sharding.placement)."""
        axes = tuple(axes)
        sizes, factors_of = self._factors(axes)
        order = [f for a in axes for f in factors_of(a)]
        order += [f for f in range(len(sizes)) if f not in order]
        device_ids = np.asarray(ids, np.int64).reshape([sizes[f] for f in order]) \
            .transpose(np.argsort(order)).reshape(self.shape)
        mesh = Mesh.__new__(Mesh)
        mesh._init(self.shape, self.axis_names, device_ids.copy(), self.devices,
                   self.workers.copy())
        return mesh

    def same_devices(self, other):
        """True when `other` is a mesh over the same devices with the same ids (perhaps
        in another shape or order), so a device id means one device on both."""
        return (isinstance(other, Mesh) and self.size == other.size
                and self.devices == other.devices
                and np.array_equal(self.workers, other.workers))

    def _factors(self, axes):
        """Every mesh axis cut at the bounds of the sub-axes among `axes`: (the factor
        sizes, mesh-major, and a function from an axis name or SubAxis to its factors)."""
        cuts = {}
        for a in axes:
            if isinstance(a, SubAxis):
                self._check_sub_axis(a)
                cuts.setdefault(a.axis, set()).update((a.pre, a.pre * a.size))
            else:
                self.axis_index(a)
        sizes, bounds = [], {}
        for name, n in zip(self.axis_names, self.shape):
            points = sorted(cuts.get(name, set()) | {1, n})
            for lo, hi in zip(points, points[1:]):
                if hi % lo:
                    raise ShardingError(f"sub-axes of mesh axis {name!r} in "
                                        f"{tuple(str(a) for a in axes)} do not nest")
                bounds[(name, lo)] = len(sizes)
                sizes.append(hi // lo)

        def factors_of(a):
            if not isinstance(a, SubAxis):
                a = SubAxis(a, 1, self.axis_size(a), self.axis_size(a))
            return [f for (name, lo), f in bounds.items()
                    if name == a.axis and a.pre <= lo < a.pre * a.size]

        return sizes, factors_of

    def __eq__(self, other):
        return (isinstance(other, Mesh) and self.shape == other.shape
                and self.axis_names == other.axis_names and self.devices == other.devices
                and np.array_equal(self.device_ids, other.device_ids)
                and np.array_equal(self.workers, other.workers))

    def __hash__(self):
        return hash((self.shape, self.axis_names, tuple(self.devices or ()),
                     self.device_ids.tobytes(), self.workers.tobytes()))

    def __repr__(self):
        kind = "abstract " if self.is_abstract else ""
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"<{kind}Mesh {axes}>"


_JOB_TASK = re.compile(r"/job:([^/]+)/(?:replica:\d+/)?task:(\d+)")


def _worker_numbers(names):
    """The worker of each device name: 0, 1, ... per distinct (job, task), in order of
    first appearance (names without a job and task: this process's)."""
    numbers = {}
    workers = np.empty(len(names), np.int64)
    for i, name in enumerate(names):
        match = _JOB_TASK.search(name)
        key = (match.group(1), int(match.group(2))) if match else None
        workers[i] = numbers.setdefault(key, len(numbers))
    return workers


def _abstract_workers(workers, size):
    """`workers` (Mesh.abstract's) checked, as an int64 array of `size`."""
    if workers is None:
        return np.zeros(size, np.int64)
    try:
        array = np.array(workers, dtype=np.int64)
    except (TypeError, ValueError):
        array = None
    if array is None or array.shape != (size,) or (array < 0).any():
        raise ShardingError(
            f"abstract mesh of {size} devices: workers {_short_list(workers)} must be "
            f"{size} integers >= 0, the worker process of each device id")
    return array


def _check_axes(shape, axis_names):
    """The mesh shape and axis names as tuples, checked: ShardingError if malformed."""
    if isinstance(shape, numbers.Integral) or isinstance(axis_names, str):
        raise ShardingError(
            f"mesh shape {shape!r} and axis names {axis_names!r}: give a tuple of sizes and "
            "a tuple of names, e.g. gt.Mesh.create((2, 4), ('data', 'model'))")
    shape = tuple(check_count(s, f"mesh shape {tuple(shape)}: an axis size") for s in shape)
    axis_names = tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ShardingError(
            f"mesh shape {shape} has {len(shape)} dims but {len(axis_names)} axis names "
            f"{axis_names}: give one name per dim")
    for name in axis_names:
        if not isinstance(name, str) or not name:
            raise ShardingError(
                f"mesh axis names {axis_names}: {name!r} is not a non-empty string; name "
                "each axis with a string such as 'data'")
    if len(set(axis_names)) != len(axis_names):
        raise ShardingError(f"mesh axis names {axis_names} repeat a name: make them unique")
    size = 1
    for s in shape:
        size *= s
    check_num_devices(size, f"mesh shape {shape}")
    return shape, axis_names


def _device_names(devices):
    """The device array (nested lists or an ndarray) as an object ndarray of names,
    tf.config.LogicalDevice entries replaced by their names.

    ShardingError for numbers: device ids are derived, never given (Mesh.create and
    Mesh.abstract build meshes from a shape).
    """
    try:
        grid = np.array(_nested_names(devices), dtype=object)
    except ValueError as e:  # ragged nesting
        raise ShardingError(f"mesh devices: give a rectangular array of names ({e})") from None
    if any(isinstance(d, numbers.Number) for d in grid.ravel()):
        raise ShardingError(
            f"gt.Mesh(devices, axis_names) takes an array of TF device names, got "
            f"{_short_list(grid)}; for local devices 0..N-1 in row-major order use "
            "gt.Mesh.create(shape, axis_names), for no devices gt.Mesh.abstract(shape, ...)")
    return grid


def _nested_names(devices):
    """Nested lists of the entries of `devices`, each LogicalDevice replaced by its name
    (a LogicalDevice is a namedtuple, which numpy would otherwise take apart)."""
    if hasattr(devices, "device_type") and hasattr(devices, "name"):
        return devices.name
    if isinstance(devices, np.ndarray):
        return _nested_names(devices.tolist())
    if isinstance(devices, (list, tuple)):
        return [_nested_names(d) for d in devices]
    return devices


def _short_list(array, limit=120):
    text = str(np.asarray(array).tolist())
    return text if len(text) <= limit else text[:limit] + "...]"


def _check_devices(devices):
    """The mesh's TF device names (a flat list), each resolved to the one local logical
    device it names; ShardingError when one is missing, ambiguous or listed twice."""
    local = _local_names()
    resolved = [_resolve_device(name, local) for name in devices]
    seen = {}
    for position, name in enumerate(resolved):
        if name in seen:
            raise ShardingError(
                f"mesh devices list {name} twice (positions {seen[name]} and {position}); "
                "each device may appear once: a duplicated device would wait for itself "
                "in every collective")
        seen[name] = position
    return resolved


def _local_names():
    """Full names of every logical device of this process, in TF's order; after
    gt.initialize_cluster, of every worker's devices, worker-major."""
    import tensorflow as tf  # late: configure_cpu_devices must run before TF starts

    return cluster.global_device_names(d.name for d in tf.config.list_logical_devices())


def _local_order(names):
    """{name: rank} of `names` (resolved device names) in this process's device order:
    the order that numbers a mesh's device ids."""
    rank = {name: i for i, name in enumerate(_local_names())}
    return {name: rank[name] for name in names}


def _resolve_device(name, local):
    """The full name of the one local device `name` denotes."""
    try:
        spec = _device_spec(name)
    except (TypeError, ValueError) as e:
        raise ShardingError(f"mesh device {name!r} is not a TF device name: {e}") from None
    # local logical devices leave job, replica and task unset: those of this process
    joined = cluster.current()
    this_task = _device_spec("/job:localhost/replica:0/task:0" if joined is None else
                             joined.device_prefix(joined.task_index))
    if joined is not None:  # a name without a task means one of this worker's devices
        spec = this_task.make_merged_spec(spec)
    matches = [full for full in local
               if _spec_matches(spec, this_task.make_merged_spec(_device_spec(full)))]
    if len(matches) != 1:
        problem = "names no logical device" if not matches else \
            f"names {len(matches)} logical devices"
        raise ShardingError(
            f"mesh device {name!r} {problem} of this process "
            f"({', '.join(local)}); name one device that exists, e.g. '/device:CPU:0' "
            "(gt.configure_cpu_devices(n) before TensorFlow starts makes n CPU devices)")
    return matches[0]


def _device_spec(name):
    """tf.DeviceSpec of a device name string."""
    import tensorflow as tf

    if not isinstance(name, str):
        raise TypeError(f"expected a string, got {type(name).__name__}")
    return tf.DeviceSpec.from_string(name)


def _spec_matches(partial, full):
    """True when every field `partial` sets equals that field of `full`."""
    for field in ("job", "replica", "task", "device_type", "device_index"):
        value = getattr(partial, field)
        if value is not None and value != getattr(full, field):
            return False
    return True
