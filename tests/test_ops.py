"""Ops real models use (issue 8, item 4), each against single-device TF on a 2x4 mesh:
values (even and uneven splits), gradients where TF has them, and that the op no longer
runs replicated."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import check_partitioned, randn

P = gt.P


@pytest.fixture(scope="module")
def mesh():
    return gt.Mesh.create((2, 4), ("data", "model"))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def with_gradient(fn):
    """fn's outputs, then the gradient of a weighted sum of them w.r.t. the float
    inputs."""
    def step(*args):
        floats = [a for a in args if a.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(floats)
            outs = tf.nest.flatten(fn(*args))
            loss = tf.add_n([tf.reduce_sum(tf.square(o) * (k + 1.0)) for k, o in
                             enumerate(outs) if o.dtype.is_floating])
        return outs + tape.gradient(loss, floats)
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
    keeps its input's split."""
    def fn(a, b):
        return tf.identity_n([a * 2.0, tf.sin(b)], name="idn")

    check(fn, [randn(rng, *shape), randn(rng, 7)], mesh, (P("data", "model"), P("model")),
          "idn", P("data", "model"))


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


@pytest.mark.parametrize("indices_shape, spec", [((6, 3, 2), P("data")),
                                                 ((5, 3, 2), P("data", "model"))], ids=str)
def test_gather_nd(mesh, rng, indices_shape, spec):
    """Index batch dims pass (uneven: padding rows are index 0); the trailing params dim
    stays split. Its gradient is a ScatterNd: partial sums over the split index rows."""
    params = randn(rng, 4, 5, 10)
    indices = np.stack([rng.integers(0, 4, indices_shape[:-1]),
                        rng.integers(0, 5, indices_shape[:-1])], -1).astype(np.int32)

    def fn(p, i):
        return tf.gather_nd(p, i, name="gnd")

    check(fn, [params, indices], mesh, (P(None, None, "model"), spec), "gnd",
          P(*spec, None, "model") if len(spec) == 1 else None)


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
