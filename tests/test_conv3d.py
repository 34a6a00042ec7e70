"""3-D windowed ops (Conv3D, MaxPool3D, AvgPool3D and their gradients) split over any of
their three spatial dims: halo exchange (collective-permutes) gives single-device
values, as for the 2-D ops (test_conv.py)."""

import os
import sys

import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import Background, check_partitioned, randn, run_together, session_environ

P = gt.P
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def mesh3():
    return gt.Mesh.create((2, 2, 2), ("a", "b", "c"))


@pytest.fixture(scope="module")
def mesh8():
    return gt.Mesh.create((8,), ("s",))


def kinds(low):
    return sorted(c.kind for c in low.collectives())


def conv3d(stride, padding, dilation=1):
    return lambda x, w: tf.nn.conv3d(x, w, [1, stride, stride, stride, 1], padding,
                                     dilations=[1, dilation, dilation, dilation, 1])


def _grads(forward):
    """x, w -> (dloss/dx, dloss/dw) of sum(forward(x, w)^2)."""
    def fn(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = forward(x, w)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, w])
    return fn


def _pool(kind, ksize, stride, padding):
    op = tf.nn.max_pool3d if kind == "max" else tf.nn.avg_pool3d
    return lambda x, w: op(x, ksize, stride, padding) * tf.reduce_sum(w)


# ----------------------------------------------------------------- Conv3D


@pytest.mark.parametrize("spec", [P(None, "a", "b", "c"), P(None, None, ("a", "b")),
                                  P(None, None, None, ("a", "b", "c"))])
@pytest.mark.parametrize("stride, padding", [(1, "SAME"), (2, "SAME"), (1, "VALID")])
def test_conv3d_spatial_splits(mesh3, rng, spec, stride, padding):
    x, w = randn(rng, 2, 8, 8, 8, 2), randn(rng, 3, 3, 3, 2, 3)
    low = check_partitioned(conv3d(stride, padding), (x, w), mesh3, (spec, None))
    assert set(kinds(low)) <= {"collective-permute"}, low.report()
    assert low.program.replicated_ops == []


def test_conv3d_2x2x2_halos_each_way(mesh3, rng):
    x, w = randn(rng, 1, 6, 6, 6, 2), randn(rng, 3, 3, 3, 2, 2)
    low = check_partitioned(conv3d(1, "SAME"), (x, w), mesh3, (P(None, "a", "b", "c"), None))
    # one halo of one plane each way along D, H and W (edges and corners ride along)
    assert kinds(low) == ["collective-permute"] * 6
    assert str(low.output_shardings[0]).startswith("{devices=[1,2,2,2,1]")


@pytest.mark.parametrize("stride, padding", [(1, "SAME"), (2, "SAME"), (2, "VALID")])
def test_conv3d_uneven(mesh3, rng, stride, padding):
    # 7 and 5 over two shards, 9 over 2: uneven blocks with padded tails
    x, w = randn(rng, 1, 7, 5, 9, 2), randn(rng, 3, 2, 3, 2, 2)
    low = check_partitioned(conv3d(stride, padding), (x, w), mesh3,
                            (P(None, "a", "b", "c"), None))
    assert "all-gather" not in kinds(low), low.report()


def test_conv3d_dilated_uneven_over_eight(mesh8, rng):
    x, w = randn(rng, 1, 21, 4, 4, 2), randn(rng, 3, 2, 2, 2, 2)
    low = check_partitioned(conv3d(1, "SAME", dilation=2), (x, w), mesh8,
                            (P(None, "s"), None))
    assert set(kinds(low)) <= {"collective-permute"}, low.report()


def test_conv3d_batch_spatial_and_channels(mesh3, rng):
    x, w = randn(rng, 2, 6, 6, 4, 4), randn(rng, 3, 3, 1, 4, 2)
    low = check_partitioned(conv3d(1, "SAME"), (x, w), mesh3,
                            (P("a", "b", None, None, "c"), P(None, None, None, "c")))
    # D halos, and the split in-channels summed
    assert set(kinds(low)) == {"collective-permute", "all-reduce"}, low.report()


@pytest.mark.parametrize("stride, padding, shape", [
    (1, "SAME", (2, 8, 8, 8, 2)), (2, "SAME", (2, 8, 6, 8, 2)), (2, "VALID", (1, 7, 7, 5, 2))])
def test_conv3d_gradients(mesh3, rng, stride, padding, shape):
    """Conv3DBackpropInputV2 and Conv3DBackpropFilterV2 on a 2x2x2 spatial split."""
    x, w = randn(rng, *shape), randn(rng, 3, 3, 3, 2, 3)
    low = check_partitioned(_grads(conv3d(stride, padding)), (x, w), mesh3,
                            (P(None, "a", "b", "c"), None))
    assert low.program.replicated_ops == []
    if all(n % 2 == 0 for n in shape[1:4]):
        assert "all-gather" not in kinds(low), low.report()


def test_conv3d_transpose_upsampling(mesh3, rng):
    """Conv3DTranspose (Conv3DBackpropInputV2 as the forward op) and its gradients."""
    x, w = randn(rng, 1, 4, 4, 4, 3), randn(rng, 2, 2, 2, 2, 3)

    def up(x, w):
        return tf.nn.conv3d_transpose(x, w, [1, 8, 8, 8, 2], [1, 2, 2, 2, 1], "SAME")
    low = check_partitioned(_grads(up), (x, w), mesh3, (P(None, "a", "b", "c"), None))
    assert "all-gather" not in kinds(low), low.report()
    assert low.program.replicated_ops == []


# ----------------------------------------------------------------- pooling


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("ksize, stride, padding, shape", [
    (2, 2, "VALID", (1, 8, 8, 8, 2)), (3, 1, "SAME", (1, 8, 6, 8, 2)),
    (3, 2, "SAME", (1, 7, 6, 5, 2))])
@pytest.mark.parametrize("grad", [False, True])
def test_pool3d(mesh3, rng, kind, ksize, stride, padding, shape, grad):
    """MaxPool3D / AvgPool3D and MaxPool3DGrad / AvgPool3DGrad, 2x2x2 spatial split."""
    x, w = randn(rng, *shape) - 1.0, randn(rng, 2)
    fn = _pool(kind, ksize, stride, padding)
    low = check_partitioned(_grads(fn) if grad else fn, (x, w), mesh3,
                            (P(None, "a", "b", "c"), None))
    assert low.program.replicated_ops == []
    if all(n % 2 == 0 for n in shape[1:4]):
        # MaxPool3DGrad takes no explicit padding: with dims padded in front it runs
        # whole, which keeps TF's gradient for a NaN first in a window (handlers/conv.py,
        # _low_edge_clippable)
        whole = kind == "max" and grad and padding == "SAME" and stride == 1
        assert ("all-gather" in kinds(low)) == whole, low.report()


def test_pool3d_one_dim_split_over_eight(mesh8, rng):
    x, w = randn(rng, 1, 4, 19, 4, 2), randn(rng, 2)
    check_partitioned(_grads(_pool("max", [2, 3, 2], [1, 2, 1], "SAME")), (x, w), mesh8,
                      (P(None, None, "s"), None))


_LOWEST_PAD_CHECK = """
import numpy as np, tensorflow as tf
import gspmd_tf as gt
gt.configure_cpu_devices(2)
x = np.ones((1, 5, 1, 1, 3), np.float32)
x[0, 1, 0, 0, 2], x[0, 2, 0, 0, 2], x[0, 3, 0, 0, 1] = -np.inf, np.nan, np.inf
fn = lambda x: tf.nn.max_pool3d(x, [1, 2, 2], 1, "SAME")
want = fn(x).numpy()
assert (want == np.finfo(np.float32).min).sum() == 2, want
got = gt.function(fn, mesh=gt.Mesh.create((2,), ("a",)), in_shardings=(gt.P(None, "a"),))
np.testing.assert_array_equal(got(x).numpy(), want)
"""


@Background
def lowest_pad_check():
    """_LOWEST_PAD_CHECK's finished run in a fresh process with Eigen's kernels."""
    env = dict(session_environ(), TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return run_together([[sys.executable, "-c", _LOWEST_PAD_CHECK]], timeout=300, env=env)


def test_max_pool3d_pads_windows_with_lowest_float_as_tf_eigen_kernel():
    """TF's Eigen MaxPool3D pads SAME windows with the lowest finite float, not -inf: a
    window of -inf (or NaN) and padding gives -3.4e38 where the window alone gives -inf
    (fuzzer seed 58 #2085, #3699). The windows a split dim pads equal it. Run with
    TF_ENABLE_ONEDNN_OPTS=0 in a fresh process: the suite's oneDNN kernel gives -3.4e38
    for a VALID window of -inf too, so it cannot tell the padding values apart."""
    run, = lowest_pad_check.result()
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("user_pad", [False, True])
def test_padded_unsplit_dims_then_conv3d(rng, user_pad):
    """Two unsplit dims padded for a SAME Conv3D (and a Pad of the user's program
    before it): TF's oneDNN remapper computes Pad -> Pad -> Conv3D wrong in a graph, so
    the handler pads every dim in one PadV2 (fuzzer, seed 5 #47)."""
    mesh = gt.Mesh.create((2,), ("a",))
    x, w = randn(rng, 1, 2, 3, 3, 2), randn(rng, 2, 1, 2, 2, 2)

    def conv(pad):
        def fn(x, w):
            if user_pad:
                x = pad(x, [[0, 0], [1, 0], [0, 0], [0, 0], [0, 0]])
            return tf.nn.conv3d(x, w, [1] * 5, "SAME", dilations=[1, 2, 2, 2, 1])
        return fn
    # the reference pads with a PadV2: TF's remapper gets even one Pad into a dilated
    # SAME Conv3D wrong in a graph (the single-device tf.function)
    low = check_partitioned(conv(tf.pad), (x, w), mesh, (P(None, None, "a"), None),
                            reference=conv(lambda x, p: tf.raw_ops.PadV2(
                                input=x, paddings=p, constant_values=0.0)))
    assert low.program.replicated_ops == []
    # the handler's padding is one PadV2: no Pad -> Pad chain, whatever the user's Pad
    pads = [n.name for n in low.program.graph.nodes if n.op == "Pad"]
    assert pads == (["Pad"] if user_pad else []), pads


def test_conv3d_unequal_hw_dilations_run_replicated(rng):
    """TF's Conv3D shape function swaps the H and W dilations, so such a conv is not
    partitioned (a VALID local op would get a wrong static shape): it runs whole, with
    single-device values (fuzzer, seed 5 #61)."""
    mesh = gt.Mesh.create((2,), ("a",))
    x, w = randn(rng, 1, 2, 3, 3, 2), randn(rng, 2, 1, 2, 2, 2)

    def fn(x, w):
        return tf.nn.conv3d(x, w, [1] * 5, "SAME", dilations=[1, 2, 1, 2, 1])
    low = check_partitioned(fn, (x, w), mesh, (P(None, None, "a"), None))
    assert low.program.replicated_ops == ["Conv3D"]


def test_ncdhw_ops_and_gradients(mesh3, rng):
    """Channels-first volumes: TF's CPU MaxPool3DGrad takes NDHWC only, so the backend
    runs it between transposes, as it does the NCHW 2-D ops."""
    x, w = randn(rng, 1, 2, 6, 6, 6), randn(rng, 3, 3, 3, 2, 3)

    def fn(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.conv3d(x, w, [1] * 5, "SAME", data_format="NCDHW")
            y = (tf.nn.max_pool3d(y, 2, 2, "VALID", data_format="NCDHW")
                 + tf.nn.avg_pool3d(y, 2, 2, "SAME", data_format="NCDHW"))
            loss = tf.reduce_sum(y * y)
        return [y] + tape.gradient(loss, [x, w])
    low = check_partitioned(fn, (x, w), mesh3, (P(None, None, "a", "b", "c"), None))
    assert low.program.replicated_ops == []
    assert "all-gather" not in kinds(low), low.report()
