"""The reshard planner: emit(plan) gives exactly the target shards; the plans it picks.

XLA's answers below were read from the collectives of XLA's compiled HLO (JAX 0.10.2 on 8
host CPU devices) by benchmarks/xla_collectives.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        /work/jaxref/bin/python benchmarks/xla_collectives.py
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, strategies as st

from gspmd_tf.backends import LocalBackend
from gspmd_tf.layout import Layout, ceil_div
from gspmd_tf.mesh import Mesh
from gspmd_tf.spmd import planner
from gspmd_tf.spmd.planner import AllGather, AllToAll, LocalSlice, cost, plan
from gspmd_tf.spmd.program import Local, ProgramBuilder
from gspmd_tf.spmd.reshard import reshard

MESHES = {
    (8,): ("x",),
    (2, 4): ("data", "model"),
    (4, 2): ("a", "b"),
    (2, 2, 2): ("x", "y", "z"),
}
_MESH_CACHE = {}


def mesh_of(shape):
    if shape not in _MESH_CACHE:
        _MESH_CACHE[shape] = Mesh.create(shape, MESHES[shape])
    return _MESH_CACHE[shape]


def L(*dims, partial=(), reduce_op="sum"):
    return Layout(tuple(tuple(d) for d in dims), tuple(partial), reduce_op)


# ------------------------------------------------------------------------ exact shards

def block(mesh, layout, shape, device):
    """The global index ranges device `device` holds under `layout`."""
    out = []
    for n, axes in zip(shape, layout.dims):
        size = ceil_div(n, mesh.axes_size(axes))
        start = min(n, mesh.shard_index(device, axes) * size)
        out.append(slice(start, min(n, start + size)))
    return tuple(out)


def source_shards(mesh, layout, value, rng):
    """Each device's padded shard of `value` in `layout`; padding is garbage. A partial
    layout splits the value into per-device terms whose reduction over the partial axes
    is the value (sum: the index-0 device holds value - the others' random terms; max:
    the others hold smaller values)."""
    local = layout.local_shape(mesh, value.shape)
    shards = []
    for d in range(mesh.size):
        shard = rng.integers(-1000, 1000, local).astype(np.float32)  # garbage padding
        box = block(mesh, layout, value.shape, d)
        part = value[box]
        if layout.partial and mesh.shard_index(d, layout.partial):
            part = part - rng.integers(0 if layout.reduce_op == "sum" else 1, 5, part.shape)
        shard[tuple(slice(0, s.stop - s.start) for s in box)] = part
        shards.append(shard)
    if layout.partial and layout.reduce_op == "sum":
        for row in mesh.groups(layout.partial):
            box = block(mesh, layout, value.shape, row[0])
            inside = tuple(slice(0, s.stop - s.start) for s in box)
            others = sum(shards[d][inside] for d in row[1:])
            shards[row[0]][inside] = value[box] - others
    return shards


def run_reshard(mesh, src, dst, value, rng):
    b = ProgramBuilder(mesh)
    dtype = tf.as_dtype(value.dtype)
    ref = b.input(0, src.local_shape(mesh, value.shape), dtype)
    out = reshard(b, Local(ref, src, value.shape, dtype), dst)
    assert out.layout == dst
    b.graph.outputs.append(out.ref)
    shards = source_shards(mesh, src, value, rng)
    return LocalBackend(mesh).compile(b.graph)([shards])[0]


def check_exact(mesh, src, dst, value, rng):
    got = run_reshard(mesh, src, dst, value, rng)
    local = dst.local_shape(mesh, value.shape)
    for d in range(mesh.size):
        shard = got[d].numpy()
        assert shard.shape == local, (d, shard.shape, local)
        box = block(mesh, dst, value.shape, d)
        inside = tuple(slice(0, s.stop - s.start) for s in box)
        np.testing.assert_array_equal(shard[inside], value[box],
                                      err_msg=f"device {d}: {src} -> {dst}")


@st.composite
def reshard_cases(draw):
    """A mesh, a global shape (uneven dims likely), and two layouts (src maybe partial)."""
    mesh_shape = draw(st.sampled_from(sorted(MESHES)))
    names = MESHES[mesh_shape]
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))

    def layout(allow_partial):
        dims = [[] for _ in range(rank)]
        partial = []
        for name in draw(st.permutations(names)):
            where = draw(st.integers(-2 if allow_partial else -1, rank - 1))
            if where >= 0:
                dims[where].append(name)
            elif where == -2:
                partial.append(name)
        return L(*dims, partial=partial)

    return mesh_shape, shape, layout(True), layout(False)


@given(reshard_cases(), st.integers(0, 2**31 - 1))
def test_emit_plan_gives_exactly_the_target_shards(case, seed):
    mesh_shape, shape, src, dst = case
    mesh = mesh_of(mesh_shape)
    rng = np.random.default_rng(seed)
    value = rng.integers(-100, 100, shape).astype(np.float32)
    check_exact(mesh, src, dst, value, rng)


@pytest.mark.parametrize("mesh_shape, shape, src, dst", [
    ((2, 4), (6, 10), L(("model",), ()), L((), ("model",))),          # uneven all-to-all
    ((2, 4), (7, 5), L(("data",), ()), L(("data", "model"), ())),     # nested uneven slice
    ((2, 4), (7, 5), L(("data", "model"), ()), L(("data",), ())),     # nested uneven gather
    ((2, 4), (5, 9, 8), L((), ("data", "model"), ()), L((), (), ("data", "model"))),
    ((2, 4), (16, 3), L(("data", "model"), ()), L(("model",), ())),   # reorder + gather
    ((2, 2, 2), (5, 6), L(("x",), ("y",)), L(("y",), ("x",))),         # swap: permute
    ((2, 4), (6, 5), L((), (), partial=("model",)), L(("model",), ())),  # reduce-scatter
    ((2, 4), (6, 5), L(("data",), (), partial=("model",), reduce_op="max"), L((), ())),
])
def test_exact_on_chosen_cases(mesh_shape, shape, src, dst, rng):
    value = np.random.default_rng(0).integers(-100, 100, shape).astype(np.float32)
    check_exact(mesh_of(mesh_shape), src, dst, value, rng)


@pytest.fixture
def rng():
    return np.random.default_rng(1)
