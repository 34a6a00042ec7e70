"""MirrorPad and MirrorPadGrad on a split dim keep the split (halo exchange of the
mirrored ranges), as Pad does, with single-device values."""

import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned, randn

P = gt.P


@pytest.fixture(scope="module")
def mesh():
    return gt.Mesh.create((2, 4), ("a", "b"))


def kinds(low):
    return sorted(c.kind for c in low.collectives())


def mirror(paddings, mode):
    """x -> (MirrorPad(x) * weight, and the gradient of its sum of squares: MirrorPadGrad)."""
    def fn(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.pad(x, paddings, mode=mode)
            loss = tf.reduce_sum(y * y * tf.range(1.0, y.shape[0] + 1.0)[:, None])
        return y, tape.gradient(loss, x)
    return fn


@pytest.mark.parametrize("mode", ["REFLECT", "SYMMETRIC"])
@pytest.mark.parametrize("n, lo, hi", [(16, 1, 1), (16, 3, 2), (10, 2, 0), (13, 0, 3),
                                       (6, 3, 5)])
def test_mirror_pad_one_split_dim(mesh, rng, mode, n, lo, hi):
    if mode == "REFLECT" and max(lo, hi) >= n:
        pytest.skip("REFLECT pads at most n - 1")
    x = randn(rng, n, 5)
    low = check_partitioned(mirror([[lo, hi], [1, 2]], mode), (x,), mesh, (P("b"),),
                            (P("b"), P("b")))
    assert low.program.replicated_ops == []
    if max(lo, hi) <= -(-n // 4):  # halos within a neighbour's block
        assert set(kinds(low)) <= {"collective-permute"}, low.report()


def test_mirror_pad_large_pad_over_small_blocks(mesh, rng):
    """Pads longer than a block: halos span several shards (or the dim is gathered)."""
    x = randn(rng, 8, 3)
    low = check_partitioned(mirror([[6, 7], [0, 0]], "SYMMETRIC"), (x,), mesh, (P("b"),),
                            (P("b"), P("b")))
    assert low.program.replicated_ops == []


def test_mirror_pad_then_conv_two_split_dims(mesh, rng):
    """The ResNet/U-Net use: reflect padding of a spatially split image, then a VALID
    conv; the split stays, halos only."""
    x, w = randn(rng, 2, 8, 16, 3), randn(rng, 3, 3, 3, 4)

    def fn(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.conv2d(tf.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="REFLECT"),
                             w, 1, "VALID")
            loss = tf.reduce_sum(y * y)
        return [y] + tape.gradient(loss, [x, w])
    low = check_partitioned(fn, (x, w), mesh, (P(None, "a", "b"), None))
    assert low.program.replicated_ops == []
    assert "all-gather" not in kinds(low), low.report()


def test_mirror_pad_output_split_input_whole(mesh, rng):
    x = randn(rng, 12, 4)

    def fn(x):
        y = tf.pad(x, [[2, 3], [0, 0]], mode="REFLECT")
        return gt.mesh_split(y, mesh, P("b"))
    low = check_partitioned(fn, (x,), mesh, (P(),))
    assert kinds(low) == [], low.report()
