"""Pad, Slice and StridedSlice of a split dim keep the split: each device computes its
result block from its own block and halos its neighbours send (collective-permutes),
as XLA does, instead of gathering the dim."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import gspmd_tf as gt
from gspmd_tf.testing.collective_cases import WINDOWS, window_op
from util import check_partitioned, randn

P = gt.P
_MESH = gt.Mesh.create((2, 4), ("data", "model"))
_LINE = gt.Mesh.create((8,), ("x",))


@pytest.fixture(scope="module")
def mesh():
    return _MESH


@pytest.fixture(scope="module")
def line():
    return _LINE


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def kinds(low):
    return sorted(c.kind for c in low.collectives())


OPS = {
    "pad": (lambda x: tf.pad(x, [[1, 2], [0, 0]]), 16),
    "pad_uneven": (lambda x: tf.pad(x, [[3, 1], [0, 1]]), 13),
    "pad_value": (lambda x: tf.pad(x, [[2, 5], [1, 1]], constant_values=1.5), 13),
    "pad_then_scale": (lambda x: tf.pad(x, [[2, 1], [0, 0]]) * 2.0, 5),
    "slice": (lambda x: tf.slice(x, [1, 0], [14, 3]), 16),
    "slice_uneven": (lambda x: x[2:11], 13),
    "slice_far": (lambda x: x[9:15], 16),
    "strided": (lambda x: x[1:15:3], 16),
    "strided_uneven": (lambda x: x[::2], 13),
    "negative_bounds": (lambda x: x[-10:-1], 16),
    "shrink_other_dim": (lambda x: x[3:12, 1], 16),
}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("where", ["line", "model", "both_axes"])
def test_values_and_split_kept(name, where, mesh, line, rng):
    fn, n = OPS[name]
    m, spec = {"line": (line, P("x")), "model": (mesh, P("model")),
               "both_axes": (mesh, P(("data", "model")))}[where]
    x = randn(rng, n, 3)
    low = check_partitioned(fn, (x,), m, (spec,))
    assert "all-gather" not in kinds(low), low.report()
    rank = len(fn(x).shape)
    assert low.output_shardings[0] == gt.Sharding.from_spec(m, spec, rank), low.report()


def test_pad_of_unsplit_output_dim_slices_locally(mesh, rng):
    # the operand is whole, the result split: each device slices its block, no collective
    low = check_partitioned(lambda x: tf.pad(x, [[2, 3], [0, 0]]), (randn(rng, 10, 3),),
                            mesh, (P(),), (P("model"),))
    assert kinds(low) == [], low.report()


@pytest.mark.parametrize("op", ["pad", "slice", "strided_slice", "strided"])
def test_gradients(op, mesh, rng):
    # PadGrad is a Slice, SliceGrad a Pad, StridedSliceGrad of stride 1 a pad: all stay
    # split
    fn = {"pad": lambda x: tf.pad(x, [[1, 2], [0, 0]]),
          "slice": lambda x: tf.slice(x, [3, 0], [11, 3]),
          "strided_slice": lambda x: x[3:14],
          "strided": lambda x: x[1:15:2]}[op]

    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.square(fn(x) * w))
        return tape.gradient(loss, x)
    low = check_partitioned(step, (randn(rng, 16, 3), randn(rng, 3)), mesh,
                            (P("model"), None), (P("model"),))
    if op != "strided":  # StridedSliceGrad keeps its sliced dims whole
        assert "all-gather" not in kinds(low), low.report()


def test_height_split_conv_zero_padding_conv_stays_split(mesh, rng):
    """A ResNet stem: conv, ZeroPadding2D, conv on a height split: halos only."""
    def net(x, w1, w2):
        h = tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME"))
        h = tf.pad(h, [[0, 0], [1, 1], [1, 1], [0, 0]])  # Keras ZeroPadding2D
        return tf.nn.conv2d(h, w2, 2, "VALID")
    args = (randn(rng, 2, 16, 16, 3), randn(rng, 3, 3, 3, 4), randn(rng, 3, 3, 4, 4))
    low = check_partitioned(net, args, mesh, (P(None, "model"), None, None))
    assert set(kinds(low)) == {"collective-permute"}, low.report()
    assert low.output_shardings[0] == gt.Sharding.from_spec(mesh, P(None, "model"), 4)


# XLA's collectives (kind, operand bytes per device) for the WINDOWS cases of
# gspmd_tf/testing/collective_cases.py on the 2x4 mesh, the scalar all-reduce of the script's
# final sum left out:
#   XLA_FLAGS=--xla_force_host_platform_device_count=8 \
#       /work/jaxref/bin/python benchmarks/xla_collectives.py --case=NAME  (JAX 0.10.2)
XLA_WINDOWS = {
    "pad_split_dim": [("collective-permute", 256)],
    "pad_uneven": [("collective-permute", 256)],
    "pad_two_axes": [("collective-permute", 256), ("collective-permute", 256),
                     ("collective-permute", 128), ("collective-permute", 128)],
    "slice_shift": [("collective-permute", 128)],
    "slice_uneven": [("collective-permute", 128), ("collective-permute", 128)],
    "strided_slice": [],
    "slice_one_block": [("collective-permute", 128)] * 3,
    "slice_half": [("collective-permute", 256)] * 2,
    # one element picked, the size-1 result dim split as the operand's: XLA sends it to
    # the group's first device (none when that device owns it)
    "pick_last_block": [("collective-permute", 128)],
    "pick_inside_a_block": [("collective-permute", 128)],
    "pick_uneven": [("collective-permute", 128)],
    "pick_first": [],
    "pick_two_axes": [("collective-permute", 256)],
}


@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_moves_no_more_than_xla(name, mesh, rng):
    shape, spec, op = WINDOWS[name]
    fn = window_op(op, tf.pad, lambda x, index: x[index])
    low = check_partitioned(fn, (randn(rng, *shape),), mesh, (P(*spec),), (P(*spec),))
    ours = [(c.kind, c.bytes) for c in low.collectives()]
    assert {kind for kind, _ in ours} <= {kind for kind, _ in XLA_WINDOWS[name]}, ours
    assert sum(b for _, b in ours) <= sum(b for _, b in XLA_WINDOWS[name]), ours


def _check_rows(fn, n, axes, grad):
    """check_partitioned of `fn` (and, with `grad`, the gradient of a cubic loss of its
    result) on an (n, 3) input whose rows split over `axes`; the lowered program."""
    m = _LINE if axes == ("x",) else _MESH
    x = np.random.default_rng(n).standard_normal((n, 3)).astype(np.float32)
    if not grad:
        return check_partitioned(fn, (x,), m, (P(axes),))

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            loss = tf.reduce_sum(y * y * y)
        return y, tape.gradient(loss, x)
    return check_partitioned(step, (x,), m, (P(axes),))


@given(st.integers(1, 20),                                     # n
       st.sampled_from(["pad", "slice"]),
       st.integers(0, 6), st.integers(0, 6),                   # pad lo/hi, slice bounds
       st.integers(1, 4),                                      # slice stride
       st.sampled_from([("x",), ("model",), ("data", "model")]),
       st.booleans())                                          # gradient too
def test_random_pads_and_slices(n, kind, a, c, stride, axes, grad):
    if kind == "pad":
        fn = lambda x: tf.pad(x, [[a, c], [0, 0]], constant_values=0.5)  # noqa: E731
    else:
        fn = lambda x: x[min(a, n - 1):max(n - c, min(a, n - 1) + 1):stride]  # noqa: E731
    _check_rows(fn, n, axes, grad)


def test_both_dims_split(mesh, rng):
    def fn(x):
        return tf.pad(x, [[1, 2], [3, 0]])[2:9, 1:10:2]
    low = check_partitioned(fn, (randn(rng, 7, 10),), mesh, (P("data", "model"),))
    assert set(kinds(low)) == {"collective-permute"}, low.report()
    assert low.output_shardings[0] == gt.Sharding.from_spec(mesh, P("data", "model"), 2)


# One element picked out of a split dim (a pipeline taking the last stage's element out of
# a stage-split buffer): only that element's worth moves (the owner's element, zeros
# elsewhere, summed), never the dim gathered. XLA (JAX 0.10.2, the 2x4 mesh, result left
# replicated) sends a collective-permute to device 0 and then all-reduces it: for
# x[3:4] of (4, 32) on P(model) a permute of 128 B and an all-reduce of 128 B.
PICKS = {
    "last_stage": (lambda x: x[3:4], (4, 32), P("model")),
    "last_stage_shrunk": (lambda x: x[3], (4, 32), P("model")),
    "inside_a_block": (lambda x: x[5:6], (8, 32), P("model")),
    "uneven": (lambda x: x[-1], (6, 32), P("model")),
    "tf_slice": (lambda x: tf.slice(x, [2, 0, 0], [1, 8, 16]), (4, 8, 16),
                 P("model", "data")),
    "two_dims": (lambda x: x[3, :, 6], (4, 5, 8), P("model", None, "data")),
}


@pytest.mark.parametrize("name", sorted(PICKS))
def test_picked_element_moves_only_its_bytes(name, mesh, rng):
    fn, shape, spec = PICKS[name]
    x = randn(rng, *shape)
    low = check_partitioned(fn, (x,), mesh, (spec,))
    moved = [(c.kind, c.bytes) for c in low.collectives()]
    # the result is left to propagation (replicated): one all-reduce of the result, no
    # more bytes than XLA's permute + all-reduce of it
    assert [kind for kind, _ in moved] == ["all-reduce"], low.report()
    assert moved[0][1] <= np.asarray(fn(tf.constant(x))).nbytes, low.report()


def test_picked_element_kept_split_then_needed_whole_is_one_permute_and_one_all_reduce(
        mesh, rng):
    # the user keeps the element split as XLA does (on the group's first device), then
    # uses it whole: the reshard of a split size-1 dim is a broadcast of that device's
    # shard (an all-reduce of it and zeros), never an all-gather of the others' padding
    def fn(x, flags):
        kept = gt.mesh_split(x[3:4], mesh, P("model"))
        flag = gt.mesh_split(flags[3:4], mesh, P("model"))
        return kept * 2.0, tf.logical_not(flag)
    flags = rng.standard_normal((4, 32)) > 0
    low = check_partitioned(fn, (randn(rng, 4, 32), flags), mesh, (P("model"), P("model")))
    moved = sorted((c.kind, c.bytes) for c in low.collectives())
    # (bools move as int32)
    assert moved == [("all-reduce", 128)] * 2 + [("collective-permute", 128)] * 2, \
        low.report()


@settings(max_examples=3)
@given(st.integers(2, 13),                                     # n
       st.integers(0, 12),                                     # element
       st.sampled_from([("x",), ("model",), ("data", "model")]))
def test_random_picks_kept_split(n, element, axes):
    element %= n
    m = _LINE if axes == ("x",) else _MESH

    def fn(x):
        kept = gt.mesh_split(x[element:element + 1], m, P(axes))
        return kept, kept * 2.0
    x = np.random.default_rng(n).standard_normal((n, 3)).astype(np.float32)
    low = check_partitioned(fn, (x,), m, (P(axes),), (P(axes), P()))
    assert "all-gather" not in kinds(low), low.report()
    assert kinds(low).count("collective-permute") <= 1, low.report()


def test_last_stage_of_a_stage_buffer_feeds_a_loss_and_its_gradient(rng):
    stage_mesh = gt.Mesh.create((4, 2), ("stage", "data"))

    def step(buffer, target):
        with tf.GradientTape() as tape:
            tape.watch(buffer)
            loss = tf.reduce_mean(tf.square(buffer[-1] - target))
        return loss, tape.gradient(loss, buffer)
    low = check_partitioned(step, (randn(rng, 4, 8, 16), randn(rng, 8, 16)), stage_mesh,
                            (P("stage", "data"), P("data")))
    assert "all-gather" not in kinds(low), low.report()


@settings(max_examples=10)
@given(st.integers(2, 13),                                     # n
       st.integers(-13, 12),                                   # element
       st.booleans(),                                          # shrink (x[i]) or x[i:i+1]
       st.sampled_from([("x",), ("model",), ("data", "model")]),
       st.booleans())                                          # gradient too
def test_random_picks(n, element, shrink, axes, grad):
    element = element % n
    fn = (lambda x: x[element]) if shrink else (lambda x: x[element:element + 1])
    low = _check_rows(fn, n, axes, grad)
    assert "all-gather" not in kinds(low), low.report()
