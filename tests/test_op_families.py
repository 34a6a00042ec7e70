"""Op families with a rule that ran replicated before: special functions, the v1 Concat,
slice updates, InTopKV2, L2Loss, FFTs, Qr and Cholesky, image resizes and adjustments,
pooling's second derivative, string ops, and ops that need every input whole; complex
parts, matrix inverses and solves, reversals, space/depth moves, cross products and
scatters by max. Values
equal single-device TF on the 2x4 mesh with uneven splits (3, 5, 6 over 4 devices), and
no op runs replicated for lack of a rule."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import assert_like_tf_variable, randn, run_and_compare

P = gt.P
RNG = np.random.default_rng(25)


def positive(*shape):
    """Values in (0.1, 3): valid where special functions need positive arguments."""
    return RNG.uniform(0.1, 3.0, shape).astype(np.float32)


def unit(*shape):
    """Values in (-0.9, 0.9) (Erfinv) or, shifted, (0.05, 0.95) (Ndtri, Betainc x)."""
    return RNG.uniform(-0.9, 0.9, shape).astype(np.float32)


def ints(*shape, high=1000):
    return RNG.integers(-high, high, shape).astype(np.int32)


def spd(*batch, n=4):
    """A batch of symmetric positive definite matrices."""
    a = RNG.standard_normal(batch + (n, n)).astype(np.float32)
    return (a @ np.swapaxes(a, -1, -2) + n * np.eye(n, dtype=np.float32)).astype(np.float32)


def complex_of(x, y):
    return tf.complex(x, y)


SPLIT_BOTH = (P("data", "model"),)
CASES = [
    # elementwise special functions: each element on its own; the uneven tail (6 rows
    # over 4 devices) is padding whatever value it holds
    ("BesselI0e", tf.math.special.bessel_i0e, (randn(RNG, 6, 5),), SPLIT_BOTH),
    ("BesselI1e", tf.math.special.bessel_i1e, (randn(RNG, 6, 5),), SPLIT_BOTH),
    ("Ndtri", lambda x: tf.math.ndtri(x * 0.5 + 0.5), (unit(6, 5),), SPLIT_BOTH),
    ("Erfinv", tf.math.erfinv, (unit(6, 5),), SPLIT_BOTH),
    ("Igamma", tf.math.igamma, (positive(6, 5), positive(5)), (P("model", "data"), P())),
    ("Igammac", tf.math.igammac, (positive(6, 5), positive(6, 5)), SPLIT_BOTH * 2),
    ("IgammaGradA", lambda a, x: tf.raw_ops.IgammaGradA(a=a, x=x),
     (positive(6, 5), positive(6, 5)), SPLIT_BOTH * 2),
    ("Betainc", tf.math.betainc, (positive(6, 5), positive(6, 5), unit(6, 5) * 0.5 + 0.5),
     SPLIT_BOTH * 3),
    ("Polygamma", tf.math.polygamma, (np.ones((6, 5), np.float32), positive(6, 5)),
     SPLIT_BOTH * 2),
    ("Zeta", tf.math.zeta, (positive(6, 5) + 1.5, positive(6, 5)), SPLIT_BOTH * 2),
    ("NextAfter", tf.math.nextafter, (randn(RNG, 6, 5), randn(RNG, 6, 5)), SPLIT_BOTH * 2),
    ("Mod", lambda x, y: tf.raw_ops.Mod(x=x, y=y), (ints(6, 5), ints(6, 5, high=9) | 1),
     SPLIT_BOTH * 2),
    ("Invert", tf.bitwise.invert, (ints(6, 5),), SPLIT_BOTH),
    ("PopulationCount", lambda x: tf.raw_ops.PopulationCount(x=x), (ints(6, 5),), SPLIT_BOTH),
    ("Complex", lambda x, y: tf.math.abs(complex_of(x, y)), (randn(RNG, 6, 5),
                                                            randn(RNG, 6, 5)), SPLIT_BOTH * 2),
    # the v1 Concat (the axis first): the concatenated dim whole, the others split
    ("Concat", lambda a, b: tf.raw_ops.Concat(concat_dim=1, values=[a, b]),
     (randn(RNG, 6, 5), randn(RNG, 6, 3)), (P("model", "data"), P("model"))),
    # a slice updated in place: the rows it covers whole, the columns split
    ("TensorStridedSliceUpdate",
     lambda x, v: tf.raw_ops.TensorStridedSliceUpdate(input=x, begin=[1, 0], end=[4, 6],
                                                      strides=[1, 1], value=v),
     (randn(RNG, 5, 6), randn(RNG, 3, 6)), (P("data", "model"), P(None, "model"))),
    ("InTopKV2", lambda p, t: tf.math.in_top_k(t, p, 2),
     (randn(RNG, 6, 7), RNG.integers(0, 7, 6).astype(np.int32)), (P("model", "data"),
                                                                  P("model"))),
    ("L2Loss", tf.nn.l2_loss, (randn(RNG, 6, 5),), SPLIT_BOTH),
    # transforms: batch dims stay split, a split transformed dim is gathered first
    ("FFT", lambda x, y: tf.signal.fft(complex_of(x, y)), (randn(RNG, 6, 8),) * 2,
     (P("model", "data"),) * 2),
    ("IFFT2D", lambda x, y: tf.signal.ifft2d(complex_of(x, y)), (randn(RNG, 5, 4, 6),) * 2,
     (P("model"),) * 2),
    ("FFT3D", lambda x, y: tf.signal.fft3d(complex_of(x, y)), (randn(RNG, 3, 2, 4, 6),) * 2,
     (P("model", None, "data"),) * 2),
    ("RFFT", tf.signal.rfft, (randn(RNG, 6, 8),), (P("model"),)),
    ("RFFT2D", tf.signal.rfft2d, (randn(RNG, 3, 6, 8),), (P("data", "model"),)),
    ("IRFFT", lambda x, y: tf.signal.irfft(complex_of(x, y)), (randn(RNG, 6, 5),) * 2,
     (P("model"),) * 2),
    ("IRFFT3D", lambda x, y: tf.signal.irfft3d(complex_of(x, y)),
     (randn(RNG, 3, 2, 4, 5),) * 2, (P("model"),) * 2),
    # matrix factorizations on a batch split unevenly (its padding never fails)
    ("Qr", lambda x: tf.linalg.qr(x), (randn(RNG, 5, 4, 3),), (P("model", "data"),)),
    ("Cholesky", tf.linalg.cholesky, (spd(3, 2),), (P("model", "data"),)),
    # images: batch and channels split, height and width whole
    ("ResizeBilinear", lambda x: tf.image.resize(x, [7, 5]), (randn(RNG, 3, 4, 6, 5),),
     (P("model", "data", None, None),)),
    ("ResizeNearestNeighbor", lambda x: tf.image.resize(x, [7, 5], "nearest"),
     (randn(RNG, 3, 4, 6, 5),), (P("model", None, None, "data"),)),
    ("AdjustContrastv2", lambda x: tf.image.adjust_contrast(x, 1.7),
     (randn(RNG, 3, 4, 6, 5),), (P("model", "data", None, None),)),
    ("AdjustSaturation", lambda x: tf.image.adjust_saturation(x, 1.7),
     (positive(3, 5, 6, 3) / 3,), (P("model", "data"),)),
    # the string ops: hashed elementwise; a filename from scalars
    ("StringToHashBucketFast",
     lambda x: tf.strings.to_hash_bucket_fast(tf.strings.as_string(x), 97),
     (ints(6, 5),), SPLIT_BOTH),
    # strings of each element: a number read back (the padding of the uneven split
    # made a number first, so the local op does not fail on it), hashes, joins,
    # rewrites, base64 both ways
    ("StringToNumber", lambda x: tf.strings.to_number(tf.strings.as_string(x)),
     (ints(6, 5),), SPLIT_BOTH),
    ("StringToHashBucketStrong", lambda x: tf.strings.to_hash_bucket_strong(
        tf.strings.as_string(x), 97, [3, 5]), (ints(6, 5),), SPLIT_BOTH),
    ("StringJoin", lambda x: tf.strings.length(tf.strings.join(
        [tf.strings.as_string(x), "-", tf.strings.as_string(x * 2)])), (ints(6, 5),),
     SPLIT_BOTH),
    ("RegexReplace", lambda x: tf.strings.to_hash_bucket_fast(tf.strings.regex_replace(
        tf.strings.as_string(x), tf.constant("[13]"), "x"), 97), (ints(6, 5),), SPLIT_BOTH),
    ("DecodeBase64", lambda x: tf.strings.length(tf.io.decode_base64(tf.io.encode_base64(
        tf.strings.as_string(x)))), (ints(6, 5),), SPLIT_BOTH),
    ("DiagPart", lambda x: tf.linalg.tensor_diag_part(x * 2.0), (randn(RNG, 5, 5),),
     SPLIT_BOTH),
    # a complex number's parts, angle and conjugate, elementwise
    ("Angle", lambda x, y: tf.math.angle(complex_of(x, y)) + tf.math.imag(tf.math.conj(
        complex_of(y, x))) * tf.math.real(complex_of(x, y)), (randn(RNG, 6, 5),) * 2,
     SPLIT_BOTH * 2),
    # inverses and solves of a batch split unevenly: its padding made the identity first
    # (a singular padded matrix made TF's kernels fail)
    ("MatrixInverse", lambda a, b: (tf.linalg.inv(a), tf.linalg.solve(a, b)),
     (spd(3, 2), randn(RNG, 3, 2, 4, 2)), (P("model", "data"),) * 2),
    # reversed dims whole, the others split; blocks moved between space and depth of
    # each image of the batch; 3-vectors crossed; overwriting scatters by max
    ("ReverseV2", lambda x: tf.reverse(x, [1]), (randn(RNG, 6, 4, 5),),
     (P("model", None, "data"),)),
    ("SpaceToDepth", lambda x: tf.nn.depth_to_space(tf.nn.space_to_depth(x, 2) * 2.0, 2),
     (randn(RNG, 3, 4, 6, 2),), (P("model"),)),
    ("Cross", tf.linalg.cross, (randn(RNG, 6, 5, 3),) * 2, (P("model", "data"),) * 2),
    ("TensorScatterMax", lambda x, u: tf.tensor_scatter_nd_max(x, [[1], [3], [1]], u),
     (randn(RNG, 5, 6), randn(RNG, 3, 6)), (P(None, "model"),) * 2),
    ("InvertPermutation", lambda x: tf.math.invert_permutation(tf.argsort(x)),
     (randn(RNG, 6),), (P("model"),)),
]


@pytest.mark.parametrize("op_type, fn, args, specs", CASES, ids=[c[0] for c in CASES])
def test_family_partitions_without_running_replicated(op_type, fn, args, specs, mesh, caplog):
    low, warnings = run_and_compare(fn, args, mesh, specs, caplog=caplog)
    assert op_type in {n.op for n in low.graph.nodes}
    assert not low.program.replicated_ops, low.program.replicated_ops
    assert not [w for w in warnings if "no partitioning rule" in w], warnings


def resize_gradients(x):
    """The gradients of both resizes (ResizeBilinearGrad, ResizeNearestNeighborGrad)."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = (tf.reduce_sum(tf.image.resize(x, [7, 5]) ** 2, [1, 2])
             + tf.reduce_sum(tf.image.resize(x, [8, 3], "nearest") ** 3, [1, 2]))
    return tape.gradient(y, x)


def pool_second_derivative(x):
    """d/dx of (d/dx sum(maxpool(x) ** 2)) . x: MaxPoolGradGrad (2-D, then 3-D)."""
    def second(pool, x):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(pool(x) ** 2)
            g = inner.gradient(y, x)
            z = tf.reduce_sum(g * x)
        return outer.gradient(z, x)
    flat = second(lambda t: tf.nn.max_pool2d(t, 2, 2, "VALID"), x)
    deep = second(lambda t: tf.nn.max_pool3d(t, 2, 2, "VALID"), tf.reshape(x, [3, 2, 2, 6, 5]))
    return flat, deep


@pytest.mark.parametrize("fn, op_types, spec", [
    (resize_gradients, {"ResizeBilinearGrad", "ResizeNearestNeighborGrad"},
     P("model", None, None, "data")),
    (pool_second_derivative, {"MaxPoolGradGrad", "MaxPool3DGradGrad"}, P("model")),
])
def test_gradients_of_images_and_pools_keep_batch_and_channels_split(fn, op_types, spec, mesh,
                                                                     caplog):
    low, warnings = run_and_compare(fn, (randn(RNG, 3, 4, 6, 5),), mesh, (spec,),
                                    caplog=caplog)
    assert op_types <= {n.op for n in low.graph.nodes}
    assert not low.program.replicated_ops, low.program.replicated_ops


def test_ops_that_need_whole_inputs_run_without_a_warning(mesh, caplog):
    """StringFormat formats a whole tensor, ShardedFilename names one shard: their inputs
    are gathered (a rule that keeps them whole), no "no partitioning rule" warning."""
    def fn(x):
        text = tf.strings.format("x={}", x)
        name = tf.raw_ops.ShardedFilename(basename=tf.strings.as_string(tf.reduce_sum(x)),
                                          shard=1, num_shards=4)
        return tf.strings.length(text), tf.strings.length(name), x * 2.0

    low, warnings = run_and_compare(fn, (randn(RNG, 6, 5),), mesh, SPLIT_BOTH, caplog=caplog)
    assert {"StringFormat", "ShardedFilename"} <= {n.op for n in low.graph.nodes}
    assert not low.program.replicated_ops, low.program.replicated_ops


def test_disable_copy_on_read_on_a_split_variable(mesh):
    """DisableCopyOnRead (tf.Variable's, before a sparse read) on each device's shard."""
    value = randn(RNG, 6, 5)
    v = gt.Variable(value, mesh, P("model", "data"), name="copy_on_read")

    @gt.function(mesh=mesh)
    def step(x):
        tf.raw_ops.DisableCopyOnRead(resource=v.handle)
        v.assign_add(x)
        return v.read_value() * 2.0

    x = randn(RNG, 6, 5)
    np.testing.assert_allclose(step(x).numpy(), (value + x) * 2.0, rtol=1e-6)
    assert not step.lower(x).program.replicated_ops


def test_random_state_is_read_and_skipped_alike_on_every_device(mesh):
    """RngReadAndSkip (tf.random.Generator's draw) on a replicated gt.Variable holding the
    state: every device reads the same counter and advances its copy alike, call after
    call, as TF does on one device."""
    start = np.array([7, 0, 0], np.int64)
    state = gt.Variable(start, mesh, P(), name="rng_state")

    def draw(resource):
        return tf.raw_ops.RngReadAndSkip(resource=resource, alg=1, delta=10)

    with tf.device("/device:CPU:0"):
        plain = tf.Variable(start)
        want = [tf.function(lambda: draw(plain.handle))().numpy() for _ in range(2)]
    f = gt.function(lambda: draw(state.handle), mesh=mesh)
    got = [f().numpy() for _ in range(2)]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(state.numpy(), plain.numpy())
    assert not f.lower().program.replicated_ops


def test_a_variable_split_along_its_trailing_dim_is_scattered_into_in_place(mesh, caplog):
    """ResourceScatterAdd / Max / NdUpdate (tf.Variable.scatter_*) of a gt.Variable
    split along its columns, rows indexed twice: each device applies every update to
    its columns, values TF's, nothing replicated."""
    initial, rows, updates = randn(RNG, 5, 6), [1, 3, 1], randn(RNG, 3, 6)

    def make(v):
        def f(u):
            v.scatter_add(tf.IndexedSlices(u, rows))
            v.scatter_max(tf.IndexedSlices(u * 2.0, rows))
            v.scatter_nd_update([[4], [0]], u[:2])
            return (v.read_value(),)
        return f
    v = gt.Variable(initial, mesh, P(None, "model"), name="v")
    caplog.set_level("WARNING", logger="gspmd_tf")
    step = gt.function(make(v), mesh=mesh, in_shardings=(P(None, "model"),))
    assert_like_tf_variable(make, v, initial, [t.numpy() for t in step(updates)], [updates])
    assert {"ResourceScatterAdd", "ResourceScatterMax", "ResourceScatterNdUpdate"} <= {
        n.op for n in step.lower(updates).graph.nodes}
    assert "no partitioning rule" not in caplog.text
