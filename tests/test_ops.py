"""Ops real models use (issue 8, item 4), each against single-device TF on a 2x4 mesh:
values (even and uneven splits), gradients where TF has them, and that the op no longer
runs replicated."""

import logging
import os

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import assert_close, check_partitioned, randn

P = gt.P


def weights(t, k):
    """Fixed weights of the shape of `t`, different for each output k: a loss whose
    gradient has no cancellation (a sum of squares of normalized values would have one)."""
    index = tf.reshape(tf.range(tf.size(t)), tf.shape(t))
    return tf.sin(tf.cast(index, t.dtype) * 0.37 + k)


def with_gradient(fn):
    """fn's outputs, then the gradient of a weighted sum of them w.r.t. the float
    inputs it depends on."""
    def step(*args):
        floats = [a for a in args if a.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(floats)
            outs = tf.nest.flatten(fn(*args))
            loss = tf.add_n([tf.reduce_sum(o * weights(o, k)) for k, o in enumerate(outs)
                             if o.dtype.is_floating])
        grads = tape.gradient(loss, floats)
        return outs + [g for g in grads if g is not None]
    return step


def check(fn, args, mesh, specs, op_name, expect_spec=None, gradient=True):
    """Values (and gradients) equal single-device TF; nothing runs replicated; the op
    named `op_name` has the layout `expect_spec` when given."""
    low = check_partitioned(with_gradient(fn) if gradient else fn, args, mesh, specs)
    assert low.program.replicated_ops == [], low.report()
    if expect_spec is not None:
        assert low.layout_of(op_name).to_spec() == expect_spec, low.report()
    return low


# ------------------------------------------------------------- structure ops

@pytest.mark.parametrize("shape", [(6, 12), (5, 10)], ids=str)
def test_identity_n(mesh, rng, shape):
    """Keras' optimizer and tf.nn.silu pass tensors through an IdentityN: each output
    keeps its input's split, also where two share a mesh axis (nothing gathered)."""
    def fn(a, b):
        return tf.identity_n([a * 2.0, tf.sin(b)], name="idn")

    low = check(fn, [randn(rng, *shape), randn(rng, 7)], mesh,
                (P("data", "model"), P("model")), "idn", P("data", "model"))
    assert low.layout_of("idn:1").to_spec() == P("model"), low.report()
    assert "all-gather" not in [c.kind for c in low.collectives()], low.report()


@pytest.mark.parametrize("sizes", [3, [2, 7, 3]], ids=["Split", "SplitV"])
@pytest.mark.parametrize("spec, expect", [
    (P("data", None, "model"), P("data", None, "model")),
    (P(None, "model", "data"), P(None, None, "data")),  # the split axis is gathered
], ids=str)
def test_split(mesh, rng, sizes, spec, expect):
    def fn(x):
        return tf.split(x, sizes, axis=1, name="split")

    check(fn, [randn(rng, 5, 12, 10)], mesh, (spec,), "split", expect)


@pytest.mark.parametrize("shape", [(6, 8), (5, 7)], ids=str)
def test_pack(mesh, rng, shape):
    def fn(a, b):
        return tf.stack([a, b * 3.0], axis=1, name="stack")

    check(fn, [randn(rng, *shape), randn(rng, *shape)], mesh,
          (P("data", "model"), P("data", "model")), "stack", P("data", None, "model"))


@pytest.mark.parametrize("spec, expect", [(P("data", None, "model"), P("data", "model")),
                                          (P("data", "model"), P("data"))], ids=str)
def test_unpack(mesh, rng, spec, expect):
    """The removed dim is gathered; the others keep their split."""
    def fn(x):
        return tf.unstack(x, axis=1, name="unstack")

    check(fn, [randn(rng, 5, 3, 7)], mesh, (spec,), "unstack", expect)


@pytest.mark.parametrize("spec", [P("data"), P("data", "model", None), P("model")], ids=str)
def test_matrix_band_part(mesh, rng, spec):
    def fn(x):
        return tf.linalg.band_part(x, 1, -1, name="band")

    low = check(fn, [randn(rng, 5, 6, 6)], mesh, (spec,), "band")
    assert low.layout_of("band").dims[1:] == ((), ())


def test_clip_by_value(mesh, rng):
    def fn(x):
        return tf.raw_ops.ClipByValue(t=x, clip_value_min=-0.5, clip_value_max=0.7,
                                      name="clip")

    check(fn, [randn(rng, 6, 10)], mesh, (P("data", "model"),), "clip", P("data", "model"))


@pytest.mark.parametrize("op", ["Erf", "Select", "SelectV2"])
def test_already_partitioned(mesh, rng, op):
    """Erf and Select/SelectV2 had rules already: checked here with their gradients."""
    def fn(x, y):
        if op == "Erf":
            return tf.math.erf(x * y, name="op")
        if op == "Select":
            return tf.raw_ops.Select(condition=x[:, 0] > 0, x=x, y=y, name="op")
        return tf.raw_ops.SelectV2(condition=x > y, t=x, e=y, name="op")

    check(fn, [randn(rng, 6, 10), randn(rng, 6, 10)], mesh,
          (P("data", "model"), P("data", "model")), "op", P("data", "model"))


# ----------------------------------------------------- lookups and cumulative ops

@pytest.mark.parametrize("shape", [(6, 12), (5, 11)], ids=str)
def test_top_k(mesh, rng, shape):
    """The last dim is gathered, the batch dim stays split (values and indices)."""
    def fn(x):
        return tf.math.top_k(x, 3, name="topk")

    check(fn, [randn(rng, *shape)], mesh, (P("data", "model"),), "topk", P("data"))


@pytest.mark.parametrize("exclusive, reverse", [(False, False), (True, True)])
@pytest.mark.parametrize("spec, expect", [(P("data", None, "model"), P("data", None, "model")),
                                          (P("data", "model"), P("data"))], ids=str)
def test_cumsum(mesh, rng, exclusive, reverse, spec, expect):
    def fn(x):
        return tf.math.cumsum(x, axis=1, exclusive=exclusive, reverse=reverse, name="cum")

    check(fn, [randn(rng, 5, 6, 10)], mesh, (spec,), "cum", expect)


@pytest.mark.parametrize("index, shape, spec", [
    (lambda x: x[:, None, ..., 1:3], (5, 6, 10), P("data", "model")),
    (lambda x: x[..., 2], (5, 6, 10), P("data", "model")),
    (lambda x: x[tf.newaxis, 1:, ..., None], (4, 6, 10), P(None, "data", "model")),
    (lambda x: x[..., tf.newaxis, :3], (5, 7, 10), P("data", "model")),
], ids=["newaxis-ellipsis-slice", "ellipsis-shrink", "newaxis-both-ends", "ellipsis-newaxis"])
def test_strided_slice_with_new_axis_and_ellipsis(mesh, rng, index, shape, spec):
    """Masks normalized to the plain form: the dims a slice keeps whole stay split, in
    the slice and in its gradient (StridedSliceGrad with the same masks)."""
    def fn(x):
        return tf.identity(index(x), name="sliced")

    x = randn(rng, *shape)
    low = check(fn, [x], mesh, (spec,), "sliced")
    want = index(tf.constant(x)).shape
    assert low.layout_of("sliced").local_shape(mesh, tuple(want)) != tuple(want)


@pytest.mark.parametrize("indices_shape, specs", [
    ((6, 3, 2), (P(None, None, "model"), P("data"))),
    ((5, 3, 2), (P(None, None, "model"), P("data", "model"))),
    ((6, 3, 2), (P("model", "data"), P())),           # indexed dims split: masked lookup
    ((5, 3, 2), (P(None, "model"), P("data"))),         # 5 rows over 4: uneven
    ((6, 3, 1), (P("model"), P("data"))),               # K=1, batch split
], ids=str)
def test_gather_nd(mesh, rng, indices_shape, specs):
    """Index batch dims pass (uneven: padding rows are index 0); the trailing params dim
    stays split; split indexed dims are a masked local lookup and a sum. The gradient is
    a ScatterNd: partial sums over the split index rows."""
    params = randn(rng, 4, 5, 10)
    bounds = [4, 5][:indices_shape[-1]]
    indices = np.stack([rng.integers(0, n, indices_shape[:-1]) for n in bounds],
                       -1).astype(np.int32)

    def fn(p, i):
        return tf.gather_nd(p, i, name="gnd")

    low = check(fn, [params, indices], mesh, specs, "gnd")
    if specs[0][0] == "model":  # a masked lookup: no all-gather of the table
        assert [c.kind for c in low.collectives()].count("all-gather") == 0, low.report()


def scatter_args(rng, rows):
    """Indices [rows, 3, 2] into a [4, 5, 10] tensor, each (a, b) pair distinct (so that
    TensorScatterUpdate is deterministic), and updates [rows, 3, 10]."""
    flat = rng.permutation(20)[:rows * 3]
    indices = np.stack([flat // 5, flat % 5], -1).reshape(rows, 3, 2).astype(np.int32)
    return [randn(rng, 4, 5, 10), indices, randn(rng, rows, 3, 10)]


@pytest.mark.parametrize("op", ["ScatterNd", "TensorScatterAdd", "TensorScatterSub",
                                "TensorScatterUpdate"])
@pytest.mark.parametrize("rows, specs", [
    (6, (P(None, None, "model"), P("data"), P("data", None, "model"))),
    (5, (P(), P("data", "model"), P("data", "model"))),
], ids=["even", "uneven"])
def test_scatter(mesh, rng, op, rows, specs):
    def fn(t, i, u):
        if op == "ScatterNd":
            return tf.scatter_nd(i, u, [4, 5, 10], name="scatter") + t
        return getattr(tf.raw_ops, op)(tensor=t, indices=i, updates=u, name="scatter")

    low = check(fn, scatter_args(rng, rows), mesh, specs, "scatter")
    if op != "TensorScatterUpdate" and "data" in specs[1]:  # partial sums, added up
        assert any(c.kind in ("all-reduce", "reduce-scatter") for c in low.collectives())


def test_variable_shape_of_a_split_variable(mesh, rng):
    """VariableShape of a split variable is its global shape (folded: no op runs)."""
    v = gt.Variable(randn(rng, 6, 10), mesh=mesh, spec=P("data", "model"))

    def fn(x):
        shape = tf.raw_ops.VariableShape(input=v.handle)
        return tf.reshape(x, shape) * v.read_value()

    f = gt.function(fn, mesh=mesh, in_shardings=(P("model"),))
    x = randn(rng, 60)
    np.testing.assert_allclose(f(x).numpy(), x.reshape(6, 10) * v.numpy(), rtol=1e-6)
    assert f.lower(x).program.replicated_ops == []


# ------------------------------------------------------------------ batch norm

def batch_norm(training, data_format="NHWC", factor=1.0, op="FusedBatchNormV3"):
    """FusedBatchNorm(V2, V3) of x with scale, offset and running moments, named "bn"."""
    def fn(x, scale, offset, mean, var):
        blend = {} if op == "FusedBatchNorm" else {"exponential_avg_factor": factor}
        outs = getattr(tf.raw_ops, op)(
            x=x, scale=scale, offset=offset, mean=mean, variance=var, epsilon=1e-3,
            data_format=data_format, is_training=training, name="bn", **blend)
        return outs[:3]
    return fn


def bn_args(rng, shape, channel):
    c = shape[channel]
    return [randn(rng, *shape) * 2.0 + 0.5, randn(rng, c), randn(rng, c),
            randn(rng, c), np.abs(randn(rng, c)) + 0.5]


@pytest.mark.parametrize("training, factor", [(True, 1.0), (True, 0.3), (False, 1.0)],
                         ids=["training", "training-blended", "inference"])
@pytest.mark.parametrize("shape, spec", [
    ((4, 6, 5, 8), P("data", None, None, "model")),   # batch split, channels split
    ((5, 6, 5, 8), P("data", "model")),                # uneven batch, height split
    ((4, 7, 6, 3), P(None, "data", "model")),          # spatial split, uneven
], ids=["batch+channel", "batch+height", "spatial"])
def test_fused_batch_norm(mesh, rng, training, factor, shape, spec):
    """Values and gradients (FusedBatchNormGradV3) of x, scale and offset."""
    check(batch_norm(training, factor=factor), bn_args(rng, shape, -1), mesh,
          (spec, P(), P(), P(), P()), "bn")


@pytest.mark.parametrize("op", ["FusedBatchNorm", "FusedBatchNormV2"])
def test_fused_batch_norm_older_versions(mesh, rng, op):
    """FusedBatchNorm and V2 (TF1 graphs): the same handlers, no third reserve space."""
    check(batch_norm(True, op=op, factor=0.5 if op != "FusedBatchNorm" else 1.0),
          bn_args(rng, (5, 6, 5, 8), -1), mesh, (P("data", "model"), P(), P(), P(), P()),
          "bn")


@pytest.mark.parametrize("training", [True, False])
def test_fused_batch_norm_nchw(mesh, rng, training):
    """NCHW: the channel is dim 1 (batch and width split, uneven width)."""
    check(batch_norm(training, "NCHW"), bn_args(rng, (4, 3, 6, 5), 1), mesh,
          (P("data", None, None, "model"), P(), P(), P(), P()), "bn")


def conv_bn_step(v):
    """One SGD step of conv -> FusedBatchNormV3 (training, running moments blended and
    assigned, as tf_keras' fused BatchNormalization does) -> relu -> mean loss."""
    def step(x):
        with tf.GradientTape() as tape:
            h = tf.nn.conv2d(x, v["kernel"], 1, "SAME")
            y, mean, var = tf.raw_ops.FusedBatchNormV3(
                x=h, scale=v["gamma"], offset=v["beta"], mean=v["moving_mean"],
                variance=v["moving_var"], epsilon=1e-3, exponential_avg_factor=0.1,
                is_training=True)[:3]
            loss = tf.reduce_mean(tf.nn.relu(y) * weights(y, 0))
        trained = [v[n] for n in ("kernel", "gamma", "beta")]
        for var_, g in zip(trained, tape.gradient(loss, trained)):
            var_.assign_sub(0.5 * g)
        v["moving_mean"].assign(mean)
        v["moving_var"].assign(var)
        return loss
    return step


@pytest.mark.parametrize("spec", [P("data"), P("data", "model"), P(None, None, None, "model")],
                         ids=str)
def test_conv_batch_norm_training_step(mesh, rng, spec):
    """A ResNet-style conv + fused batch norm training step on a batch, height or channel
    split: loss, trained weights and running moments equal one device's."""
    init = {"kernel": randn(rng, 3, 3, 3, 8) * 0.3, "gamma": randn(rng, 8),
            "beta": randn(rng, 8), "moving_mean": randn(rng, 8),
            "moving_var": np.abs(randn(rng, 8)) + 0.5}
    x = randn(rng, 4, 6, 6, 3)
    with tf.device("/device:CPU:0"):
        local = {n: tf.Variable(a) for n, a in init.items()}
        want_loss = tf.function(conv_bn_step(local))(x).numpy()
    channel = spec if len(spec) == 4 else P()
    sharded = {n: gt.Variable(a, mesh, P(*channel[3:]) if a.ndim == 1 else
                              P(None, None, None, *channel[3:]), name=n)
               for n, a in init.items()}
    f = gt.function(conv_bn_step(sharded), mesh=mesh, in_shardings=(spec,))
    assert_close(f(x).numpy(), want_loss, "loss")
    for n in init:
        assert_close(sharded[n].numpy(), local[n].numpy(), n)
    assert f.lower(x).program.replicated_ops == []


# ------------------------------------------------------------------ stateless RNG

@pytest.mark.parametrize("draw", [
    lambda shape, seed: tf.random.stateless_uniform(shape, seed, name="rng"),
    lambda shape, seed: tf.random.stateless_normal(shape, seed, name="rng"),
    lambda shape, seed: tf.random.stateless_truncated_normal(shape, seed, name="rng"),
    lambda shape, seed: tf.cast(tf.random.stateless_uniform(
        shape, seed, minval=0, maxval=10, dtype=tf.int32, name="rng"), tf.float32),
    lambda shape, seed: tf.random.stateless_uniform(shape, seed, alg="philox", name="rng"),
    lambda shape, seed: tf.raw_ops.StatelessRandomUniform(shape=shape, seed=seed,
                                                          dtype=tf.float32, name="rng"),
], ids=["uniform", "normal", "truncated", "int", "philox", "v1"])
@pytest.mark.parametrize("shape", [(6, 8), (5, 7)], ids=str)
def test_stateless_random(mesh, rng, draw, shape):
    """Each device's shard is the single-device draw's slice."""
    def fn(x, seed):
        return x * draw(shape, seed)

    low = check(fn, [randn(rng, *shape), np.array([3, 7], np.int32)], mesh,
                (P("data", "model"), P()), "rng", gradient=False)
    assert low.collectives() == [], low.report()


@pytest.mark.parametrize("shape", [(8, 12), (5, 7)], ids=str)
def test_stateless_dropout(mesh, rng, shape):
    """Dropout with a stateless mask: values and the gradient equal one device's."""
    def fn(x, seed):
        return tf.nn.experimental.stateless_dropout(x, 0.4, seed)

    check(fn, [randn(rng, *shape), np.array([1, 2], np.int32)], mesh,
          (P("data", "model"), P()), "rng", gradient=True)


def test_keras_dropout_and_silu_train_model_split(mesh, rng):
    """Keras 3: Dense(silu) -> Dropout -> Dense with model-split kernels, one epoch of
    Adam: loss and weights equal one device's (the dropout mask is the single-device
    one), and no op runs replicated (silu's IdentityN, the optimizer's IdentityN, the
    dropout draw)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("gt.keras needs Keras' TensorFlow backend")
    x = randn(rng, 16, 12)
    y = rng.integers(0, 3, (16,)).astype(np.int32)

    def model():
        keras.utils.set_random_seed(1)
        m = keras.Sequential([keras.Input((12,)),
                              keras.layers.Dense(16, activation="silu", name="d1"),
                              keras.layers.Dropout(0.3, seed=5),
                              keras.layers.Dense(3, name="d2")])
        m.compile(optimizer=keras.optimizers.Adam(0.01), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m
    single, split = model(), model()
    gt.keras.shard_model(split, mesh, layout_map={".*d1/kernel": P(None, "model"),
                                                  ".*d2/kernel": P("model", None)})
    replicated = []
    handler = logging.Handler()
    handler.emit = lambda record: replicated.append(record.getMessage())
    logging.getLogger("gspmd_tf").addHandler(handler)
    try:
        want = single.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        got = split.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    finally:
        logging.getLogger("gspmd_tf").removeHandler(handler)
    assert_close(got.history["loss"], want.history["loss"], "loss")
    for a, b in zip(split.weights, single.weights):
        assert_close(a.numpy(), b.numpy(), a.path)
    assert not [m for m in replicated if "replicated" in m], replicated
