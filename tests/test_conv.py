"""Spatially partitioned convolutions and pooling: halo exchange (GSPMD's spatial
partitioning) gives single-device values, with collective-permutes, not all-gathers."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

import gspmd_tf as gt
from gspmd_tf import _halo
from util import check_partitioned, randn

P = gt.P


@pytest.fixture(scope="module")
def mesh3():
    return gt.Mesh.create((2, 2, 2), ("a", "b", "c"))


def kinds(low):
    return sorted(c.kind for c in low.collectives())


# ----------------------------------------------------------------- halo module vs numpy

def reference_window_plan(n, window, stride, dilation, pad_lo, pad_hi, shards):
    """Brute force: the operand elements each shard's windows read, and the halos."""
    dilated = (window - 1) * dilation + 1
    out = (n + pad_lo + pad_hi - dilated) // stride + 1
    own = -(-n // shards)
    w = -(-out // shards)
    left, right, useful = [], [], 0
    for i in range(shards):
        windows = [j for j in range(i * w, (i + 1) * w)]
        reads = [j * stride - pad_lo + t * dilation for j in windows for t in range(window)]
        left.append(i * own - min(reads))
        right.append(max(reads) + 1 - (i + 1) * own)
        useful += i * w < out
    return out, w, np.array(left), np.array(right), useful


window_configs = st.tuples(
    st.integers(1, 60),   # n
    st.integers(1, 6),    # window
    st.integers(1, 3),    # stride
    st.integers(1, 3),    # dilation
    st.integers(0, 4),    # pad_lo
    st.integers(0, 4),    # pad_hi
    st.integers(1, 16),   # shards
)


@given(window_configs)
def test_window_plan_matches_numpy(config):
    n, window, stride, dilation, pad_lo, pad_hi, shards = config
    if n + pad_lo + pad_hi < (window - 1) * dilation + 1:
        with pytest.raises(ValueError):
            _halo.window_plan(n, window, stride, dilation, pad_lo, pad_hi, shards)
        return
    out, w, left, right, useful = reference_window_plan(*config)
    plan = _halo.window_plan(n, window, stride, dilation, pad_lo, pad_hi, shards)
    assert (plan["out_size"], plan["out_shard"], plan["useful"]) == (out, w, useful)
    np.testing.assert_array_equal(plan["left"], left)
    np.testing.assert_array_equal(plan["right"], right)
    assert plan["ext_lo"] == max(0, left[:useful].max())
    assert plan["ext_hi"] == max(0, right[:useful].max())
    own = -(-n // shards)
    inner = [left[i] for i in range(1, useful)] + [right[i] for i in range(useful)
                                                     if i < shards - 1]
    assert plan["feasible"] == all(h <= own for h in inner)
    # every shard reads inside the extended tensor; useful ones exactly their range
    offset = plan["offset"]
    assert np.all(offset >= 0) and np.all(offset + plan["span"] <= plan["extended"])
    np.testing.assert_array_equal(offset[:useful], plan["ext_lo"] - left[:useful])
    assert plan["uniform"] == bool(np.all(offset[:useful] == offset[0]))


@given(st.tuples(st.integers(1, 40), st.integers(1, 5), st.integers(1, 3),
                 st.integers(1, 2), st.integers(0, 3), st.integers(1, 8)))
def test_transposed_plan_covers_gradient_reads(config):
    """Each shard's operand span holds every forward window touching its result block,
    and its block lies inside the (padded) local result."""
    n, window, stride, dilation, pad_lo, shards = config
    dilated = (window - 1) * dilation + 1
    pad_lo = min(pad_lo, dilated - 1)
    out = (n + pad_lo - dilated) // stride + 1
    if out < 1:
        return
    plan = _halo.transposed_plan(n, out, window, stride, dilation, pad_lo, shards)
    res = -(-n // shards)
    for i in range(plan["useful"]):
        block = range(i * res, min((i + 1) * res, n))
        touching = [j for j in range(out)
                    if any(j * stride - pad_lo + t * dilation in block for t in range(window))]
        lo, span = plan["start"][i], plan["span"]
        assert all(lo <= j < lo + span for j in touching)
        assert plan["first"][i] == lo * stride - pad_lo
        assert plan["first"][i] - plan["lead"] + plan["post"][i] == i * res
        assert plan["post"][i] + res <= plan["local_padded"]
        assert plan["offset"][i] + span <= plan["extended"]


def test_plan_fast_for_2048_shards():
    import time
    start = time.perf_counter()
    for _ in range(100):
        plan = _halo.window_plan(1 << 20, 7, 1, 1, 3, 3, 2048)
    assert plan["feasible"] and plan["ext_lo"] == 3 and plan["ext_hi"] == 3
    assert time.perf_counter() - start < 1.0


# ----------------------------------------------------------------- Conv2D values


def conv(stride, padding, dilation=1, data_format="NHWC"):
    return lambda x, w: tf.nn.conv2d(x, w, stride, padding, data_format=data_format,
                                     dilations=dilation)


@pytest.mark.parametrize("kernel", [3, 5])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_conv_h_split(mesh, rng, kernel, stride, padding):
    x, w = randn(rng, 2, 16, 8, 3), randn(rng, kernel, kernel, 3, 4)
    low = check_partitioned(conv(stride, padding), (x, w), mesh, (P(None, "model"), None))
    assert set(kinds(low)) <= {"collective-permute"}
    assert str(low.output_shardings[0]).startswith("{devices=[1,4,1,1,2]")


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_conv_h_and_w_split(mesh3, rng, padding):
    x, w = randn(rng, 2, 12, 12, 3), randn(rng, 3, 3, 3, 5)
    low = check_partitioned(conv(1, padding), (x, w), mesh3, (P("a", "b", "c"), None))
    # halos both ways along H and W (corners ride along the second exchange)
    assert kinds(low) == ["collective-permute"] * 4


@pytest.mark.parametrize("stride, padding", [(1, "SAME"), (2, "SAME"), (1, "VALID"),
                                             (3, "VALID")])
def test_conv_uneven_h(mesh, rng, stride, padding):
    x, w = randn(rng, 2, 10, 6, 3), randn(rng, 3, 3, 3, 4)
    low = check_partitioned(conv(stride, padding), (x, w), mesh, (P(None, "model"), None))
    # strided windows over 3-row shards: the halo from the right grows with the shard
    # index and spans two shards (two permutes that way), still no gather
    assert set(kinds(low)) <= {"collective-permute"}


def test_conv_channels_split_all_reduce(mesh, rng):
    x, w = randn(rng, 2, 8, 8, 6), randn(rng, 3, 3, 6, 4)
    low = check_partitioned(conv(1, "SAME"), (x, w), mesh,
                            (P(None, None, None, "model"), P(None, None, "model")),
                            (P(),))
    assert kinds(low) == ["all-reduce"]


def test_conv_uneven_channels(mesh, rng):
    x, w = randn(rng, 2, 8, 8, 6), randn(rng, 3, 3, 6, 4)
    check_partitioned(conv(1, "SAME"), (x, w), mesh,
                      (P(None, None, None, "model"), None))


def test_conv_batch_and_spatial(mesh, rng):
    x, w = randn(rng, 4, 16, 8, 3), randn(rng, 3, 3, 3, 4)
    low = check_partitioned(conv(1, "SAME"), (x, w), mesh, (P("data", "model"), None))
    assert kinds(low) == ["collective-permute"] * 2
    assert str(low.output_shardings[0]) == "{devices=[2,4,1,1]0,1,2,3,4,5,6,7}"


def test_conv_out_channels_and_spatial(mesh, rng):
    x, w = randn(rng, 2, 16, 8, 3), randn(rng, 3, 3, 3, 4)
    low = check_partitioned(conv(1, "SAME"), (x, w), mesh,
                            (P(None, "model"), P(None, None, None, "data")))
    assert set(kinds(low)) == {"collective-permute"}


def _nhwc_reference(fn):
    """`fn` of NCHW tensors computed in NHWC (TF's CPU kernels take only NHWC; a
    single-device run of NCHW convs relies on grappler rewriting them, which does not
    always happen): x transposed in, rank-4 results transposed out, except weight
    gradients (HWIO). `fn` must take data_format as a keyword."""
    def reference(x, w):
        outs = fn(tf.transpose(x, [0, 2, 3, 1]), w, data_format="NHWC")
        return tf.nest.map_structure(
            lambda t: tf.transpose(t, [0, 3, 1, 2]) if t.shape.rank == 4 and t.shape != w.shape
            else t, outs)
    return reference


def test_conv_nchw_explicit_dilated(mesh, rng):
    x, w = randn(rng, 2, 3, 16, 9), randn(rng, 3, 3, 3, 4)

    def f(x, w, data_format="NCHW"):
        pads = [[0, 0], [0, 0], [2, 1], [1, 0]]
        if data_format == "NHWC":
            pads = [pads[0], pads[2], pads[3], pads[1]]
        return tf.nn.conv2d(x, w, 1, pads, data_format=data_format, dilations=2)
    low = check_partitioned(f, (x, w), mesh, (P(None, None, "model"), None),
                            reference=_nhwc_reference(f))
    assert set(kinds(low)) == {"collective-permute"}


def test_halo_larger_than_shard_falls_back(mesh, rng):
    """A 7x7 kernel over 2-row shards: the dim is gathered whole, values still right."""
    x, w = randn(rng, 1, 8, 4, 2), randn(rng, 7, 7, 2, 3)
    low = check_partitioned(conv(1, "SAME"), (x, w), mesh, (P(None, "model"), None))
    assert kinds(low) == ["all-gather"]


def test_output_split_input_whole(mesh, rng):
    """Input replicated, output annotated split: each device slices its windows from the
    padded input; nothing moves."""
    x, w = randn(rng, 2, 16, 8, 3), randn(rng, 3, 3, 3, 4)

    def f(x, w):
        return gt.mesh_split(tf.nn.conv2d(x, w, 2, "SAME"), mesh, P(None, "model"))
    low = check_partitioned(f, (x, w), mesh, (P(), None))
    assert kinds(low) == []


def test_depthwise(mesh, rng):
    x, w = randn(rng, 2, 12, 8, 4), randn(rng, 3, 3, 4, 2)
    f = lambda x, w: tf.nn.depthwise_conv2d(x, w, [1, 1, 1, 1], "SAME")
    low = check_partitioned(f, (x, w), mesh, (P(None, "model", None, "data"), None))
    assert set(kinds(low)) == {"collective-permute"}


def test_nchw_gradients_h_and_w(mesh, rng):
    x, w = randn(rng, 2, 3, 16, 10), randn(rng, 3, 3, 3, 4)

    def grads(x, w, data_format="NCHW"):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.conv2d(x, w, 2, "SAME", data_format=data_format)
            y = tf.nn.avg_pool2d(y, 3, 1, "SAME", data_format=data_format)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, w])
    low = check_partitioned(grads, (x, w), mesh, (P(None, None, "model", "data"), None),
                            reference=_nhwc_reference(grads))
    assert set(kinds(low)) == {"collective-permute", "all-reduce"}


@pytest.mark.parametrize("spec", [P(None, "model", None, "data"), P("data", "model"),
                                  P(None, None, None, "model")])
def test_depthwise_gradients(mesh, rng, spec):
    x, w = randn(rng, 2, 12, 8, 4), randn(rng, 3, 3, 4, 2)

    def grads(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.depthwise_conv2d(x, w, [1, 2, 2, 1], "SAME")
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, w])
    low = check_partitioned(grads, (x, w), mesh, (spec, None))
    assert low.program.replicated_ops == []


# ----------------------------------------------------------------- pooling


@pytest.mark.parametrize("pool", ["max", "avg"])
@pytest.mark.parametrize("ksize, stride, padding, h", [
    (2, 2, "VALID", 16), (3, 1, "SAME", 16), (3, 2, "SAME", 16), (3, 1, "SAME", 10)])
def test_pool_h_split(mesh, rng, pool, ksize, stride, padding, h):
    op = tf.nn.max_pool2d if pool == "max" else tf.nn.avg_pool2d
    x = randn(rng, 2, h, 6, 3) - 3.0  # negative: zero padding would win a max
    low = check_partitioned(lambda x: op(x, ksize, stride, padding), (x,), mesh,
                            (P(None, "model"),))
    assert set(kinds(low)) <= {"collective-permute"}


def test_pool_h_and_w_split(mesh3, rng):
    x = randn(rng, 2, 12, 12, 3) - 3.0
    f = lambda x: (tf.nn.max_pool2d(x, 3, 1, "SAME"), tf.nn.avg_pool2d(x, 3, 2, "SAME"))
    check_partitioned(f, (x,), mesh3, (P("a", "b", "c"),))


# ----------------------------------------------------------------- a small CNN


def cnn(x, w1, w2, w3):
    h = tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME"))
    h = tf.nn.relu(tf.nn.conv2d(h, w2, 1, "SAME"))
    h = tf.nn.max_pool2d(h, 2, 2, "VALID")
    h = tf.reshape(h, [h.shape[0], -1])
    return h @ w3


def cnn_args(rng):
    return (randn(rng, 4, 16, 16, 3), randn(rng, 3, 3, 3, 8), randn(rng, 3, 3, 8, 8),
            randn(rng, 8 * 8 * 8, 10))


def test_cnn_spatial(mesh, rng):
    low = check_partitioned(cnn, cnn_args(rng), mesh, (P(None, "model"), None, None, None))
    # a halo each way per conv, no halo for the 2x2/2 pool, one all-reduce for the dense
    # layer (its contracting dim carries the spatial split)
    assert kinds(low) == ["all-reduce"] + ["collective-permute"] * 4
    assert low.program.replicated_ops == []
    permutes = [c for c in low.collectives() if c.kind == "collective-permute"]
    assert all(c.shape[1] == 1 for c in permutes)  # one row of halo per neighbour


def test_cnn_training_step(mesh, rng):
    def step(x, w1, w2, w3):
        with tf.GradientTape() as tape:
            tape.watch([w1, w2, w3])
            loss = tf.reduce_sum(tf.square(cnn(x, w1, w2, w3)))
        return (loss,) + tuple(tape.gradient(loss, [w1, w2, w3]))
    low = check_partitioned(step, cnn_args(rng), mesh, (P("data", "model"), None, None, None))
    assert "all-gather" not in kinds(low), low.report()
    # forward: a halo each way per conv (4); the weight gradients reuse them; the second
    # conv's input gradient exchanges dy halos (2); the 2x2/2 pool and its gradient
    # need none; the first conv's input gradient is not asked for (dead-code elimination
    # drops the halos a handler emitted but nothing read).
    assert kinds(low).count("collective-permute") == 4 + 2, low.report()


# ----------------------------------------------------------------- gradients directly


@pytest.mark.parametrize("stride, padding, h", [(1, "SAME", 16), (2, "SAME", 16),
                                                (2, "VALID", 17), (1, "SAME", 10)])
def test_conv_gradients_spatial(mesh, rng, stride, padding, h):
    x, w = randn(rng, 2, h, 6, 3), randn(rng, 3, 3, 3, 4)

    def grads(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.conv2d(x, w, stride, padding)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, w])
    low = check_partitioned(grads, (x, w), mesh, (P(None, "model"), None))
    assert low.program.replicated_ops == []
    if h % 4 == 0:
        assert "all-gather" not in kinds(low), low.report()


@pytest.mark.parametrize("pool", ["max", "avg"])
@pytest.mark.parametrize("ksize, stride, padding, h", [
    (2, 2, "VALID", 16), (3, 1, "SAME", 16), (3, 2, "SAME", 16), (3, 2, "SAME", 10)])
def test_pool_gradients_spatial(mesh, rng, pool, ksize, stride, padding, h):
    op = tf.nn.max_pool2d if pool == "max" else tf.nn.avg_pool2d
    x = randn(rng, 2, h, 6, 3) - 3.0

    def grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = op(x, ksize, stride, padding)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)
    low = check_partitioned(grad, (x,), mesh, (P(None, "model"),))
    assert low.program.replicated_ops == []
    if h % 4 == 0:
        assert "all-gather" not in kinds(low), low.report()


# ----------------------------------------------------------------- random configs


@given(st.tuples(st.integers(1, 5), st.integers(1, 3), st.sampled_from(["SAME", "VALID"]),
                 st.integers(5, 20), st.sampled_from([2, 4, 8]), st.integers(1, 2)))
def test_random_conv_configs(config):
    kernel, stride, padding, h, shards, dilation = config
    if stride > 1 and dilation > 1:  # TF's conv2d takes one or the other
        dilation = 1
    if padding == "VALID" and min(h, 9) < (kernel - 1) * dilation + 1:
        return
    mesh = gt.Mesh.create((shards, 8 // shards), ("x", "y"))
    rng = np.random.default_rng(h * 100 + kernel)
    x, w = randn(rng, 1, h, 9, 2), randn(rng, kernel, kernel, 2, 3)
    check_partitioned(conv(stride, padding, dilation), (x, w), mesh, (P(None, "x"), None))


@given(st.sampled_from(["conv", "max", "avg"]), st.integers(1, 4), st.integers(1, 2),
       st.sampled_from(["SAME", "VALID"]), st.integers(4, 11), st.integers(4, 11),
       st.sampled_from([P("a", "b"), P(None, ("a", "b"), "c"), P(None, "a", ("b", "c"))]),
       st.booleans())
def test_random_windowed_with_gradients(op, kernel, stride, padding, h, w, spec, grad):
    """Forward value (and input gradient) of conv/max/avg pooling, H and/or W split."""
    if padding == "VALID" and min(h, w) < kernel:
        return
    mesh = gt.Mesh.create((2, 2, 2), ("a", "b", "c"))
    rng = np.random.default_rng(h * 100 + w * 10 + kernel)
    x, f = randn(rng, 2, h, w, 3) - 1.0, randn(rng, kernel, kernel, 3, 2)

    def forward(x, f):
        if op == "conv":
            return tf.nn.conv2d(x, f, stride, padding)
        pool = tf.nn.max_pool2d if op == "max" else tf.nn.avg_pool2d
        return pool(x, kernel, stride, padding) * tf.reduce_sum(f)

    def fn(x, f):
        if not grad:
            return forward(x, f)
        with tf.GradientTape() as tape:
            tape.watch([x, f])
            loss = tf.reduce_sum(tf.square(forward(x, f)))
        return tape.gradient(loss, [x, f])
    def in_float64(x, f):
        # the reference: TF's oneDNN float32 kernels inside a tf.function give a wrong
        # filter gradient for a 1x1 convolution of stride 2 (94 off where float64 and
        # eager TF agree to 2e-5: TF_ENABLE_ONEDNN_OPTS=1, TF 2.21), so one device runs
        # in float64 (Eigen's kernels), as the partitioned float32 program must match
        return [tf.cast(t, tf.float32) for t in tf.nest.flatten(
            fn(tf.cast(x, tf.float64), tf.cast(f, tf.float64)))]
    low = check_partitioned(fn, (x, f), mesh, (spec, None),
                            reference=in_float64 if op == "conv" else None)
    assert low.program.replicated_ops == []


@pytest.mark.parametrize("spec", [P(), P(None, "model"), P("data", None, None, "model")])
def test_nhwc_conv_then_nchw_bias_add(spec):
    """A BiasAdd with data_format NCHW after an NHWC Conv2D adds the bias on dim 1. TF's
    graph optimizer fuses the pair into one oneDNN op adding it on the last dim (wrong
    values when the sizes agree, as here: 4 == 4), so the SPMD program must not contain
    the pair (fuzzer, seed 12 #871). The reference is the same sum written as an Add."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    rng = np.random.default_rng(871)
    x, w, bias = randn(rng, 2, 4, 4, 3), randn(rng, 1, 1, 3, 4), randn(rng, 4)

    def f(x, w, bias):
        return tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), bias, data_format="NCHW")

    def reference(x, w, bias):
        return tf.nn.conv2d(x, w, 1, "SAME") + tf.reshape(bias, [4, 1, 1])
    check_partitioned(f, (x, w, bias), mesh, (spec, None, None), reference=reference)


@pytest.mark.parametrize("spec,padding", [(P(None, None, "model", "data"), "SAME"),
                                          (P(None, None, None, "data"), "VALID")])
def test_one_strided_window_per_device(spec, padding):
    """TF's oneDNN Conv2D computes wrong values for some strided dims with one window
    (input (2, 3, 3, 1), filter (1, 3, 1, 1), strides [1, 1, 2, 1], VALID), a local shape
    a split makes of a conv TF gets right (fuzzer, seed 43 #379); such a dim runs with
    stride 1 on the window's extent."""
    mesh = gt.Mesh.create((2, 2), ("data", "model"))
    rng = np.random.default_rng(379)
    x, w = randn(rng, 2, 3, 3, 2), randn(rng, 1, 3, 2, 3)
    check_partitioned(lambda x, w: tf.nn.conv2d(x, w, [1, 2], padding), (x, w), mesh,
                      (spec, None))


@pytest.mark.parametrize("shape,kernel,mesh_shape,spec", [
    ((2, 4, 5, 2), (2, 2), (2,), P(None, "a")),      # H split: one window per device
    ((2, 1, 4, 3), (1, 2), (1,), P()),               # one window in H on one device
])
def test_depthwise_one_window_keeps_equal_strides(shape, kernel, mesh_shape, spec):
    """DepthwiseConv2dNative takes equal row and column strides only: a dim cut to its
    one window keeps the other dim's stride (fuzzer, seed 20 #1247, #1664). float64: the
    float32 op becomes a oneDNN one that takes unequal strides."""
    mesh = gt.Mesh.create(mesh_shape, ("a",))
    rng = np.random.default_rng(1247)
    x, w = rng.standard_normal(shape), rng.standard_normal((*kernel, shape[3], 2))
    check_partitioned(
        lambda x, w: tf.nn.depthwise_conv2d(x, w, [1, 2, 2, 1], "VALID"), (x, w), mesh,
        (spec, None))


@pytest.mark.parametrize("padding", [[[0, 0], [1, 0], [0, 0], [0, 0]], "SAME"])
def test_one_strided_window_of_padded_conv(padding):
    """A conv with its own padding whose dims are not split still has its one-window
    strided dims cut: splitting 3 input channels over 4 devices leaves one channel per
    device, where TF's oneDNN Conv2D gets such a dim wrong (fuzzer, seed 20 #3241)."""
    mesh = gt.Mesh.create((1, 4), ("data", "model"))
    rng = np.random.default_rng(3241)
    x, w = randn(rng, 2, 3, 3, 3), randn(rng, 2, 2, 3, 4)
    check_partitioned(lambda x, w: tf.nn.conv2d(x, w, [1, 2], padding), (x, w), mesh,
                      (None, P(None, None, "model")))


@pytest.mark.parametrize("spec", [P(), P(None, "a")])
@pytest.mark.parametrize("stride,padding,dilation", [
    (2, [[0, 0], [1, 1], [0, 0], [0, 0]], 1),   # seed 20 #7733
    (3, "VALID", 1),                            # seed 20 #3369
    (2, "VALID", 2),                            # seed 20 #9413
])
def test_global_one_strided_window_one_channel(spec, stride, padding, dilation):
    """A one-channel Conv2D whose W dim has one strided window leaving part of W unread:
    TF's oneDNN kernel gets it wrong on one device too, gspmd-tf (which cuts the window
    out) gets it right. The reference is the same conv written on the cut window."""
    mesh = gt.Mesh.create((2,), ("a",))
    rng = np.random.default_rng(7733)
    x, w = randn(rng, 2, 6, 3, 1), randn(rng, 2, 2, 1, 4)
    x[1, 0, 0, 0], x[0, 2, 1, 0] = np.nan, -np.inf

    def f(x, w):
        return tf.nn.conv2d(x, w, [1, stride], padding, dilations=[dilation, 1])

    def reference(x, w):
        return tf.nn.conv2d(x[:, :, :2], w, 1, padding, dilations=[dilation, 1])
    check_partitioned(f, (x, w), mesh, (spec, None), reference=reference)


@pytest.mark.parametrize("depthwise", [False, True])
def test_filter_gradient_uneven_split_with_inf(depthwise):
    """A filter gradient over a dim split unevenly (13 windows over 2 devices): the
    shard with 6 real windows and one of padding sums over its real windows only, since
    the padded window reads an x element a real one reads too, and 0 * Inf is NaN where
    one device has Inf (fuzzer, seed 20 #6689)."""
    mesh = gt.Mesh.create((2,), ("x",))
    rng = np.random.default_rng(6689)
    x, w = randn(rng, 2, 14, 3, 1), randn(rng, 2, 3, 1, 3)
    x[0, 13, 2, 0], x[0, 4, 2, 0] = -np.inf, np.inf
    dy = randn(rng, 2, 13, 1, 3) * (rng.random((2, 13, 1, 3)) < 0.6)
    conv = tf.nn.depthwise_conv2d if depthwise else (
        lambda x, w, strides, padding: tf.nn.conv2d(x, w[..., :1], strides, padding))

    def f(x, w, dy):
        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = tf.reduce_sum(conv(x, w, [1, 1, 1, 1], "VALID") * dy)
        return tape.gradient(loss, w)
    check_partitioned(f, (x, w, dy), mesh, (None, None, P(None, "x")))
