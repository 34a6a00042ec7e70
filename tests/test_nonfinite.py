"""NaN and +-Inf on a split dim: every reduction-like op gives single-device TF's values.

Each input row holds one pattern (NaN/Inf in the first, middle or last shard, all-NaN,
all-Inf, ties across shards...); the reduced dim is split over a 1-D mesh of 8 or over one
or both axes of a 2x4 mesh, with even and uneven sizes.
"""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import assert_close, check_partitioned, single_device

P = gt.P
NAN, INF = np.nan, np.inf


def special_rows(n, rng):
    """[15, n] float32: one NaN/Inf pattern per row, placed across the shards of dim 1."""
    rows = rng.standard_normal((15, n)).astype(np.float32)
    put = {1: [(0, NAN)], 2: [(n - 1, NAN)], 3: [(n // 2, INF)], 4: [(n // 3, -INF)],
           8: [(n // 4, 5.0), (n - 1, 5.0), (1, -5.0), (n - 2, -5.0)],
           9: [(0, INF), (n - 1, -INF)], 10: [(n // 2, NAN), (1, INF)],
           11: [(1, NAN), (n - 2, NAN)]}
    for row, cells in put.items():
        for col, value in cells:
            rows[row, col] = value
    rows[5], rows[6], rows[7] = NAN, -INF, INF
    rows[12], rows[12, n - 1] = -INF, NAN    # argmax: no candidate but NaN -> index 0
    rows[13], rows[13, 0] = INF, NAN         # argmin: the same
    rows[14, :-1] = -INF
    return rows


def segment_ids(n):
    """Segments interleaved across the shards of the data dim; segment 3 stays empty."""
    return np.arange(n, dtype=np.int32) % 3


OPS = {
    "argmax": lambda x: tf.argmax(x, 1),
    "argmin": lambda x: tf.argmin(x, 1, output_type=tf.int32),
    "argmax_dim0": lambda x: tf.argmax(tf.transpose(x), 0),
    "argmax_int": lambda x: tf.argmax(tf.cast(tf.where(tf.math.is_finite(x), x, 0.0), tf.int32), 1),
    "argmin_half": lambda x: tf.argmin(tf.cast(x, tf.float16), 1),
    "softmax": tf.nn.softmax,
    "log_softmax": tf.nn.log_softmax,
    "sparse_xent": lambda x: tf.nn.sparse_softmax_cross_entropy_with_logits(
        tf.range(15) % x.shape[1], x),
    "xent_smooth": lambda x: tf.nn.softmax_cross_entropy_with_logits(
        tf.one_hot(tf.range(15) % x.shape[1], x.shape[1]) * 0.5 + 0.5 / x.shape[1], x),
    "xent_one_hot": lambda x: tf.nn.softmax_cross_entropy_with_logits(
        tf.one_hot(tf.range(15) % x.shape[1], x.shape[1]), x),
    "max": lambda x: tf.reduce_max(x, 1),
    "min": lambda x: tf.reduce_min(x, 1, keepdims=True),
    "sum": lambda x: tf.reduce_sum(x, 1),
    "prod": lambda x: tf.reduce_prod(x, 1),
    "mean": lambda x: tf.reduce_mean(x, 1),
    "all_any": lambda x: (tf.reduce_all(x > -1.0, 1), tf.reduce_any(tf.math.is_nan(x), 1),
                          tf.reduce_any(x > 1e30, 1)),
    "segment_max": lambda x: tf.math.unsorted_segment_max(
        tf.transpose(x), segment_ids(x.shape[1]), 4),
    "segment_min": lambda x: tf.math.unsorted_segment_min(
        tf.transpose(x), segment_ids(x.shape[1]), 4),
    "matmul": lambda x: x @ tf.reshape(tf.range(x.shape[1] * 3, dtype=tf.float32) % 5 - 2.0,
                                       (x.shape[1], 3)),
    "einsum": lambda x: tf.einsum("rn,rn->r", x, tf.reverse(x, [0])),
}

SPLITS = {
    "1d": ((8,), ("x",), P(None, "x")),
    "2d_minor": ((2, 4), ("a", "b"), P(None, "b")),
    "2d_major": ((2, 4), ("a", "b"), P("b", "a")),
    "2d_both": ((2, 4), ("a", "b"), P(None, ("a", "b"))),
}


# TF's float32 Softmax kernel on CPUs with oneDNN (TF_ENABLE_ONEDNN_OPTS=1, as conftest
# asks) puts NaN in lane-dependent places of a row holding NaN/+Inf ([0..14, nan] -> NaN
# at 0 and 15, 0 elsewhere; [0..15, nan] -> NaN at 15 and 16), which no partition of the
# row can reproduce; its Eigen kernel (float64, float16, or float32 without oneDNN, TF's
# default on CPUs it does not tune oneDNN for) makes such a row NaN, as the softmax of a
# row whose sum is NaN is. That is the reference here (test_softmax_of_a_split_row_...
# pins both).
REFERENCES = {"softmax": lambda x: tf.cast(tf.nn.softmax(tf.cast(x, tf.float64)), x.dtype)}


@pytest.mark.parametrize("n", [16, 13])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("op", list(OPS))
def test_nonfinite_values_match_single_device(op, split, n):
    shape, axes, spec = SPLITS[split]
    mesh = gt.Mesh.create(shape, axes)
    x = special_rows(n, np.random.default_rng(n))
    check_partitioned(OPS[op], (x,), mesh, (spec,), reference=REFERENCES.get(op))


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("op", ["sparse_xent", "xent_smooth", "xent_one_hot", "log_softmax"])
def test_cross_entropy_of_logits_near_the_float_maximum(op, split):
    # the empty segments of an unsorted_segment_min are float32's maximum: a row of them
    # has loss log(classes), which max + log(sum) - logit rounds to 0 (seed 96 #4229)
    shape, axes, spec = SPLITS[split]
    mesh = gt.Mesh.create(shape, axes)
    big = np.finfo(np.float32).max
    x = np.random.default_rng(4).standard_normal((15, 16)).astype(np.float32)
    # rows of equal huge logits (their losses are log(16), as the normal rows' are of
    # the order of 1: a wrong one is no rounding of a huge norm)
    x[0], x[3], x[6] = big, -big, big / 4
    check_partitioned(OPS[op], (x,), mesh, (spec,))


def test_softmax_of_a_split_row_with_nan_or_inf_is_nan_across_it_as_eigens_kernel():
    """Over a split row, softmax is NaN across every row holding NaN or +Inf (and every
    all -Inf row), exactly where TF's Eigen kernels (float64, float16) put NaN; finite
    rows equal single-device float32. Where single-device float32 differs, it is
    oneDNN's kernel: its NaNs are a subset of those, placed by SIMD lane (rolling the
    row moves them otherwise than the values), so no partition reproduces them."""
    mesh = gt.Mesh.create((8,), ("x",))
    x = special_rows(16, np.random.default_rng(16))
    got = gt.function(tf.nn.softmax, mesh=mesh, in_shardings=(P(None, "x"),))(x).numpy()
    nan_rows = np.isnan(x).any(1) | np.isposinf(x).any(1) | np.isneginf(x).all(1)
    np.testing.assert_array_equal(np.isnan(got), np.repeat(nan_rows[:, None], 16, 1))
    for dtype in (tf.float64, tf.float16):
        eigen = tf.nn.softmax(tf.cast(x, dtype)).numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(eigen), err_msg=dtype.name)
    single = single_device(tf.nn.softmax, (x,))[0]
    assert_close(got[~nan_rows], single[~nan_rows])
    if np.array_equal(np.isnan(single), np.isnan(got)):
        return  # float32 on Eigen's kernel (oneDNN off): equal everywhere
    assert (np.isnan(got) | ~np.isnan(single)).all()  # oneDNN's NaNs: a subset
    row = x[1]  # one NaN, at the start
    rolled = [np.roll(np.isnan(single_device(tf.nn.softmax, (np.roll(row, k)[None],))[0][0]),
                      -k) for k in range(16)]
    assert any(not np.array_equal(r, rolled[0]) for r in rolled), "NaNs follow the values"


SEGMENT_LAYOUTS = {  # data, ids, result
    "rows_over_both_axes": (P(("a", "b")), P(("a", "b")), None),
    "rows_and_segments_split": (P("b"), P("b"), P("a")),
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [16, 11])
@pytest.mark.parametrize("layout", list(SEGMENT_LAYOUTS))
def test_segment_extrema_random_nonfinite_rows(seed, n, layout):
    """Dense NaN/Inf, negative (dropped) ids, segments in few or many blocks."""
    rng = np.random.default_rng(seed)
    data = rng.choice(np.array([NAN, INF, -INF, 1.0, -2.0], np.float32), size=(n, 3),
                      p=[0.3, 0.2, 0.3, 0.1, 0.1])
    ids = rng.integers(-1, 4, size=n).astype(np.int32)
    mesh = gt.Mesh.create((2, 4), ("a", "b"))
    data_spec, ids_spec, out_spec = SEGMENT_LAYOUTS[layout]

    def f(d, i):
        return (tf.math.unsorted_segment_max(d, i, 5), tf.math.unsorted_segment_min(d, i, 5))

    check_partitioned(f, (data, ids), mesh, (data_spec, ids_spec),
                      out_shardings=(out_spec, out_spec))


@pytest.mark.parametrize("spec", [P("a", "b"), P(None, "b")])
def test_segment_extrema_over_rows_split_in_two_dims(spec, caplog):
    """Rows indexed by a 2-D ids tensor, split in its minor dim: not one block per device,
    so they are gathered (with a warning) and the values still match."""
    rng = np.random.default_rng(1)
    data = rng.choice(np.array([NAN, -INF, 1.0, 2.0], np.float32), size=(4, 8, 3))
    ids = rng.integers(0, 3, size=(4, 8)).astype(np.int32)
    mesh = gt.Mesh.create((2, 4), ("a", "b"))

    def f(d, i):
        return tf.math.unsorted_segment_max(d, i, 3), tf.math.unsorted_segment_min(d, i, 3)

    check_partitioned(f, (data, ids), mesh, (spec, spec))
    assert "gathered first" in caplog.text


@pytest.mark.parametrize("equation,x_shape,y_shape,x_spec,y_spec", [
    ("abc,cd->", (6, 12, 1), (1, 2), P("b"), P()),            # fuzzer seed 42 #142
    ("abc,cd->cda", (7, 4, 2), (2, 2), P(None, "b"), P()),     # fuzzer seed 42 #9
    ("ab,bc->ac", (3, 5), (5, 4), P(None, "a"), P(None, "b")),  # contraction only
    ("ab,cd->ad", (3, 13), (7, 2), P(None, ("a", "b")), P("b")),  # both own letters, uneven
])
def test_einsum_sums_letters_of_one_operand_first(equation, x_shape, y_shape, x_spec, y_spec):
    """TF sums a letter of one operand out of it before contracting: Inf * (a + b) is
    +-Inf where a split sum of products Inf * a + Inf * b is NaN."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal(x_shape).astype(np.float32)
    y = rng.standard_normal(y_shape).astype(np.float32)
    y.flat[0], x.flat[-1] = -INF, INF
    mesh = gt.Mesh.create((2, 4), ("a", "b"))
    check_partitioned(lambda x, y: tf.einsum(equation, x, y), (x, y), mesh, (x_spec, y_spec))
    check_partitioned(lambda x, y: tf.einsum(equation, x, y), (np.abs(x), y), mesh,
                      (x_spec, y_spec))


def test_conv_filter_gradient_of_inf_read_only_by_real_windows():
    """H = 6 over 4 shards (2, 2, 2, 0): the last shard's windows are padding, but its halo
    held a neighbour's Inf; 0 * Inf made the filter gradient NaN where TF's is finite
    (fuzzer, seed 46 #400). Elements no real window reads are masked."""
    mesh = gt.Mesh.create((1, 4), ("x", "y"))
    rng = np.random.default_rng(400)
    x = rng.standard_normal((2, 6, 1, 1)).astype(np.float32)
    x[0, 4, 0, 0] = INF
    w = rng.standard_normal((3, 1, 1, 4)).astype(np.float32)

    def fn(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.conv2d(x, w, 1, [[0, 0], [2, 0], [0, 2], [0, 0]])
            loss = tf.reduce_sum(y * np.linspace(0.5, 1.5, 144).reshape(2, 6, 3, 4).astype(np.float32))
        return tape.gradient(loss, w)
    check_partitioned(fn, (x, w), mesh, (P(None, "y"), P()))
