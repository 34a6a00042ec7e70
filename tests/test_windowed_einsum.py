"""Windowed einsum (spmd/windowed_einsum.py): dots whose all-gather or reduce-scatter
runs as a loop of local dots and collective-permutes; values against single-device TF."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.PartitionSpec


def _kinds(lowered):
    return sorted(c.kind for c in lowered.collectives())


def _megatron(mesh, axis, windowed, data=None):
    """Sequence-parallel Megatron FFN: x split on rows over `axis`, W1 on columns, the
    hidden layer on columns, W2 on rows, the result back on rows: an all-gather before the first dot, a reduce-scatter
    after the second. Returns (gt.Function, the single-device function)."""
    rows = (data, axis) if data else axis

    def ffn(x, w1, w2):
        h = gt.mesh_split(tf.nn.relu(tf.matmul(x, w1)), mesh, P(data, axis))
        y = tf.matmul(h, w2)
        return gt.mesh_split(y, mesh, P(rows, None))

    def plain(x, w1, w2):
        return tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)

    f = gt.function(ffn, mesh=mesh, in_shardings=(P(rows, None), P(None, axis),
                                                  P(axis, None)),
                    windowed_einsum=windowed)
    return f, plain


@pytest.mark.parametrize("shape,axis,data", [((4,), "model", None),
                                             ((2, 4), "model", "data"),
                                             ((2, 4), "data", "model")])
def test_forward_matches_single_device(shape, axis, data, rng):
    mesh = gt.Mesh.create(shape, ("model",) if len(shape) == 1 else ("data", "model"))
    x = rng.standard_normal((16, 24)).astype(np.float32)
    w1 = rng.standard_normal((24, 32)).astype(np.float32)
    w2 = rng.standard_normal((32, 24)).astype(np.float32)
    f, plain = _megatron(mesh, axis, True, data)
    low = f.lower(x, w1, w2)
    kinds = _kinds(low)
    # the all-gather and the reduce-scatter became permutes
    assert "all-gather" not in kinds and "reduce-scatter" not in kinds, low.report()
    n = mesh.axis_size(axis)
    assert kinds.count("collective-permute") == 2 * (n - 1), kinds
    want = plain(x, w1, w2).numpy()
    np.testing.assert_allclose(f(x, w1, w2).numpy(), want, rtol=1e-5, atol=1e-5)
    plain_low = _megatron(mesh, axis, False, data)[0].lower(x, w1, w2)
    assert "all-gather" in _kinds(plain_low)


def test_gradient_matches_single_device(rng):
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    x = rng.standard_normal((16, 24)).astype(np.float32)
    w1 = rng.standard_normal((24, 32)).astype(np.float32)
    w2 = rng.standard_normal((32, 24)).astype(np.float32)

    def loss_and_grads(x, w1, w2):
        with tf.GradientTape() as tape:
            tape.watch([w1, w2])
            h = tf.nn.relu(tf.matmul(x, w1))
            if gt_split:
                h = gt.mesh_split(h, mesh, P(None, "model"))
            y = tf.matmul(h, w2)
            y = gt.mesh_split(y, mesh, P("model", None)) if gt_split else y
            loss = tf.reduce_sum(y * y)
        return [loss] + tape.gradient(loss, [w1, w2])

    gt_split = False
    want = [t.numpy() for t in tf.function(loss_and_grads)(x, w1, w2)]
    gt_split = True
    f = gt.function(loss_and_grads, mesh=mesh,
                    in_shardings=(P("model", None), P(None, "model"), P("model", None)),
                    windowed_einsum=True)
    kinds = _kinds(f.lower(x, w1, w2))
    # the backward dots reuse the operand the forward loop gathered on the way
    assert "collective-permute" in kinds and "all-gather" not in kinds, kinds
    assert "reduce-scatter" not in kinds, kinds
    for got, expected in zip(f(x, w1, w2), want):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-4)


def test_uneven_split_falls_back_to_plain_path(rng):
    """Rows 18 over 4 devices are padded: the loop would need the plain path's masks,
    so the dot keeps its all-gather, and values stay exact."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    x = rng.standard_normal((18, 24)).astype(np.float32)
    w1 = rng.standard_normal((24, 32)).astype(np.float32)
    w2 = rng.standard_normal((32, 24)).astype(np.float32)
    f, plain = _megatron(mesh, "model", True)
    assert "all-gather" in _kinds(f.lower(x, w1, w2))
    np.testing.assert_allclose(f(x, w1, w2).numpy(), plain(x, w1, w2).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_batch_matmul_and_einsum(rng):
    """BatchMatMulV2 and Einsum with the gathered operand's dim in the middle."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    a = rng.standard_normal((2, 8, 12)).astype(np.float32)
    b = rng.standard_normal((2, 12, 16)).astype(np.float32)

    def f(a, b):
        y = tf.matmul(a, b)
        z = tf.einsum("bsk,bkt->bst", a, b)
        return y + z

    g = gt.function(f, mesh=mesh, in_shardings=(P("data", "model"), P("data", None, "model")),
                    out_shardings=(P("data", None, "model"),), windowed_einsum=True)
    kinds = _kinds(g.lower(a, b))
    assert "all-gather" not in kinds and "collective-permute" in kinds, kinds
    np.testing.assert_allclose(g(a, b).numpy(), f(a, b).numpy(), rtol=1e-5, atol=1e-5)


def test_threshold_in_bytes(rng):
    """A threshold above the gathered operand's size keeps the plain all-gather."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    x = rng.standard_normal((16, 24)).astype(np.float32)
    w1 = rng.standard_normal((24, 32)).astype(np.float32)
    w2 = rng.standard_normal((32, 24)).astype(np.float32)
    big = _megatron(mesh, "model", 1 << 20)[0].lower(x, w1, w2)
    assert "all-gather" in _kinds(big)
    small = _megatron(mesh, "model", 64)[0].lower(x, w1, w2)
    assert "all-gather" not in _kinds(small)


@pytest.mark.parametrize("bad", [-1, 1.5, "yes"])
def test_bad_option_names_it(bad):
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match="windowed_einsum"):
        gt.function(lambda x: x, mesh=mesh, windowed_einsum=bad)


def test_xla_backend(rng):
    """The loop's dots and permutes through the XLA backend's segments."""
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    x = rng.standard_normal((16, 24)).astype(np.float32)
    w1 = rng.standard_normal((24, 32)).astype(np.float32)
    w2 = rng.standard_normal((32, 24)).astype(np.float32)
    f, plain = _megatron(mesh, "model", True)
    g = gt.function(f.fn, mesh=mesh, in_shardings=f.in_shardings, backend="xla",
                    windowed_einsum=True)
    np.testing.assert_allclose(g(x, w1, w2).numpy(), plain(x, w1, w2).numpy(),
                               rtol=1e-5, atol=1e-5)
