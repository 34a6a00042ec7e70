"""Shardy's knobs: user priorities (a p0 annotation claims the tensors it reaches
before a p1 one competes) and sharding groups (tensors that must share a sharding)."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt

P = gt.P
MESH = gt.Mesh.abstract((2, 4), ("data", "model"))
SPECS = (tf.TensorSpec((8, 16)), tf.TensorSpec((16, 8)))


def _conflict(x_priority, w_priority):
    """x split on its rows and w on its columns over the same axis: the product can
    take 'data' on one dim only; the annotation propagated first wins."""
    def f(x, w):
        x = gt.mesh_split(x, MESH, P("data"), priority=x_priority)
        w = gt.mesh_split(w, MESH, P(None, "data"), priority=w_priority)
        return tf.matmul(x, w, name="product")
    return gt.lower(f, MESH, args=SPECS)


@pytest.mark.parametrize("x_priority, w_priority, expected", [
    (0, 1, P("data")), (1, 0, P(None, "data"))])
def test_lower_priority_number_propagates_first(x_priority, w_priority, expected):
    low = _conflict(x_priority, w_priority)
    assert low.layout_of("product").to_spec() == expected
    # explain() still traces the winning axis back to its annotation
    [origin] = low.propagation.origin(low.graph.ref("product"))
    assert origin.seed_kind == "annotation"


def test_bad_priority_is_an_error():
    with pytest.raises(gt.ShardingError, match="priority=-1"):
        _conflict(-1, 0)


def grouped(x, z, w):
    a = tf.matmul(x, w, name="a")
    b = tf.tanh(z, name="b")
    return gt.sharding_group(a, "pair"), gt.sharding_group(b, "pair")


def test_sharding_group_gives_every_member_one_sharding(mesh):
    specs = (tf.TensorSpec((8, 16)), tf.TensorSpec((8, 8)), tf.TensorSpec((16, 8)))
    shardings = (P("data"), None, P(None, "model"))
    alone = gt.lower(lambda x, z, w: (tf.matmul(x, w), tf.tanh(z, name="b")), MESH,
                     shardings, args=specs)
    assert alone.layout_of("b").to_spec() == P()
    low = gt.lower(grouped, MESH, shardings, args=specs)
    assert low.layout_of("a").to_spec() == low.layout_of("b").to_spec() == P("data", "model")
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s.shape).astype(np.float32) for s in specs]
    got = gt.function(grouped, mesh=mesh, in_shardings=shardings)(*args)
    for value, want in zip(got, grouped(*map(tf.constant, args))):
        np.testing.assert_allclose(value.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_group_of_different_shapes_is_an_error():
    def f(x, z):
        return gt.sharding_group(x, 1), gt.sharding_group(z, 1)

    with pytest.raises(gt.ShardingError, match="sharding group"):
        gt.lower(f, MESH, args=(tf.TensorSpec((8, 16)), tf.TensorSpec((8, 8))))


def _through_barrier(direction):
    """x -> tanh -> barrier -> annotated P('data') on the far side; and a second chain
    from an annotated P('data') side through a barrier into an unannotated tanh."""
    def f(x, y):
        h = tf.tanh(x, name="before")
        h = gt.propagation_barrier(h, direction)
        out = gt.mesh_split(h * 2.0, MESH, P("data"))
        g = gt.mesh_split(y, MESH, P("data"))
        g = gt.propagation_barrier(g, direction)
        return out, tf.tanh(g, name="after")
    return gt.lower(f, MESH, args=(tf.TensorSpec((8, 4)), tf.TensorSpec((8, 4))))


@pytest.mark.parametrize("direction, backward_reaches, forward_reaches", [
    ("forward", False, True), ("backward", True, False), ("none", False, False)])
def test_propagation_barrier_lets_shardings_through_one_way(direction, backward_reaches,
                                                            forward_reaches):
    low = _through_barrier(direction)
    assert (low.layout_of("before").to_spec() == P("data")) == backward_reaches
    assert (low.layout_of("after").to_spec() == P("data")) == forward_reaches


def test_without_a_barrier_both_ways_propagate():
    def f(x, y):
        out = gt.mesh_split(tf.tanh(x, name="before") * 2.0, MESH, P("data"))
        return out, tf.tanh(gt.mesh_split(y, MESH, P("data")), name="after")

    low = gt.lower(f, MESH, args=(tf.TensorSpec((8, 4)), tf.TensorSpec((8, 4))))
    assert low.layout_of("before").to_spec() == low.layout_of("after").to_spec() == P("data")


def test_unknown_barrier_direction_is_an_error():
    with pytest.raises(gt.ShardingError, match="allowed_direction='sideways'"):
        _through_barrier("sideways")


def _open(open_dims):
    def f(x, w):
        h = gt.mesh_split(x, MESH, P("data"), open_dims=open_dims)
        return tf.matmul(h, w, name="product")
    return gt.lower(f, MESH, (None, P("model")), args=SPECS)


def test_open_dim_takes_more_axes_and_closed_dims_keep_the_spec():
    closed = _open(None)
    assert closed.layout_of("XlaSharding").to_spec() == P("data")
    opened = _open((1,))
    # dim 1 is open: the contraction over w's split rows reaches it; dim 0 keeps 'data'
    assert opened.layout_of("XlaSharding").to_spec() == P("data", "model")
    origins = {o.axis: o for o in opened.propagation.origin(opened.graph.ref("XlaSharding"))}
    assert origins["data"].seed_kind == "annotation" and origins["data"].num_hops == 0
    assert origins["model"].seed_kind.startswith("argument")


def test_open_dims_work_with_priorities():
    def f(x, w):
        h = gt.mesh_split(x, MESH, P("data"), priority=1, open_dims=(1,))
        w = gt.mesh_split(w, MESH, P("model"), priority=0)
        return tf.matmul(h, w, name="product")

    low = gt.lower(f, MESH, args=SPECS)
    assert low.layout_of("XlaSharding").to_spec() == P("data", "model")
