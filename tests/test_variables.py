"""gt.Variable: shards per device, reads/gradients/assigns inside gt.function, checkpoints."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import assert_close

P = gt.P


@pytest.fixture(scope="module")
def mesh():
    return gt.Mesh.create((2, 4), ("data", "model"))


def test_each_device_holds_only_its_shard(mesh):
    value = np.arange(30 * 8, dtype=np.float32).reshape(30, 8)
    v = gt.Variable(value, mesh, P("model", "data"), name="w")
    assert [tuple(s.shape) for s in v.shards] == [(8, 4)] * 8  # 30 rows -> 4 shards of 8
    assert v.shard_bytes() == [8 * 4 * 4] * 8
    np.testing.assert_array_equal(v.numpy(), value)
    assert str(v.sharding) == "{devices=[4,2]0,4,1,5,2,6,3,7}"


def test_callable_initial_value_builds_shards_only(mesh):
    calls = []

    def init(shape, dtype):
        calls.append(shape)
        return tf.ones(shape, dtype)

    v = gt.Variable(init, mesh, P(None, "model"), shape=(6, 8), name="ones")
    assert calls == [(6, 2)] * 4  # one call per distinct shard, never the whole (6, 8)
    np.testing.assert_array_equal(v.numpy(), np.ones((6, 8), np.float32))


def _sgd_step(v1, v2):
    """One SGD step of a two-layer MLP on variables v1, v2 (tf or gt Variables)."""
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.nn.relu(x @ v1) @ v2 - y))
        g1, g2 = tape.gradient(loss, [v1, v2])
        v1.assign_sub(0.1 * g1)
        v2.assign_add(-0.1 * g2)
        return loss
    return step


def test_sgd_steps_match_single_device(mesh):
    rng = np.random.default_rng(1)
    w1 = rng.standard_normal((12, 10)).astype(np.float32)
    w2 = (rng.standard_normal((10, 6)) * 0.3).astype(np.float32)
    x = rng.standard_normal((6, 12)).astype(np.float32)
    y = rng.standard_normal((6, 6)).astype(np.float32)
    v1 = gt.Variable(w1, mesh, P(None, "model"), name="w1")
    v2 = gt.Variable(w2, mesh, P("model"), name="w2")

    step = gt.function(_sgd_step(v1, v2), mesh=mesh, in_shardings=(P("data"), P("data")))
    losses = [step(x, y).numpy() for _ in range(4)]
    r1, r2 = tf.Variable(w1), tf.Variable(w2)
    ref_step = tf.function(_sgd_step(r1, r2))
    want_losses = [ref_step(x, y).numpy() for _ in range(4)]
    want1, want2 = r1.numpy(), r2.numpy()
    assert_close(np.array(losses), np.array(want_losses), "losses")
    assert_close(v1.numpy(), want1, "w1")
    assert_close(v2.numpy(), want2, "w2")
    kinds = [(c.kind, c.axes) for c in step.lower(x, y).collectives()]
    # weight gradients are data-parallel sums: all-reduced over "data" only
    assert ("all-reduce", ("model",)) in kinds
    assert all(axes in (("model",), ("data",)) for _, axes in kinds)


def test_plain_tf_variable_is_refused(mesh):
    v = tf.Variable(np.ones((4, 4), np.float32))
    f = gt.function(lambda x: x @ v, mesh=mesh)
    with pytest.raises(gt.ShardingError, match="not a gt.Variable"):
        f.lower(np.ones((4, 4), np.float32))


def test_checkpoint_restores_onto_another_mesh(mesh, tmp_path):
    value = np.random.default_rng(2).standard_normal((8, 12)).astype(np.float32)
    v = gt.Variable(value, mesh, P("data", "model"), name="ckpt_w")
    path = tf.train.Checkpoint(w=v).save(str(tmp_path / "ckpt"))
    for shape, spec in [((4, 2), P("data", "model")), ((8,), P(None, "x")), ((1, 8), P())]:
        axes = ("data", "model") if len(shape) == 2 else ("x",)
        other = gt.Mesh.create(shape, axes)
        w = gt.Variable(lambda s, d: tf.zeros(s, d), other, spec, shape=(8, 12), name="ckpt_w")
        tf.train.Checkpoint(w=w).restore(path).assert_consumed()
        np.testing.assert_array_equal(w.numpy(), value)  # bit-identical


def test_checkpoint_shape_mismatch_names_the_variable(mesh, tmp_path):
    v = gt.Variable(np.ones((4, 4), np.float32), mesh, P("data"), name="mismatch")
    path = tf.train.Checkpoint(w=v).save(str(tmp_path / "ckpt"))
    w = gt.Variable(np.ones((4, 8), np.float32), mesh, P("data"), name="mismatch")
    with pytest.raises((gt.ShardingError, ValueError), match="mismatch"):
        tf.train.Checkpoint(w=w).restore(path)


def test_spec_longer_than_variable_rank(mesh):
    with pytest.raises(gt.ShardingError, match="variable 'bad.*rank 1"):
        gt.Variable(np.ones(4, np.float32), mesh, P("data", "model"), name="bad")


def test_eager_reads_and_updates_act_on_the_global_value(mesh):
    v = gt.Variable(np.arange(8, dtype=np.float32), mesh, P("model"), trainable=False,
                    name="eager")
    np.testing.assert_array_equal(tf.convert_to_tensor(v).numpy(), np.arange(8))
    v.assign_add(np.ones(8, np.float32))
    v.assign_sub(np.full(8, 2.0, np.float32))
    np.testing.assert_array_equal(v.numpy(), np.arange(8) - 1.0)
    assert [tuple(s.shape) for s in v.shards] == [(2,)] * 8


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam", "keras_sgd_momentum"])
def test_fused_optimizer_updates_act_on_shards(mesh, kind):
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((12, 8)).astype(np.float32)
    x = rng.standard_normal((6, 12)).astype(np.float32)

    def make(variable, slot_a, slot_b, keras_opt=None):
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.tanh(x @ variable))
            g = tape.gradient(loss, variable)
            if kind == "sgd":
                tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=0.1, delta=g)
            elif kind == "momentum":
                tf.raw_ops.ResourceApplyMomentum(var=variable.handle, accum=slot_a.handle,
                                                 lr=0.1, grad=g, momentum=0.9)
            elif kind == "adam":
                tf.raw_ops.ResourceApplyAdam(var=variable.handle, m=slot_a.handle,
                                             v=slot_b.handle, beta1_power=0.9,
                                             beta2_power=0.999, lr=0.01, beta1=0.9,
                                             beta2=0.999, epsilon=1e-7, grad=g)
            else:
                tf.raw_ops.ResourceApplyKerasMomentum(var=variable.handle, accum=slot_a.handle,
                                                      lr=0.1, grad=g, momentum=0.9)
            return loss
        return step

    zeros = np.zeros_like(w0)
    with tf.device("/device:CPU:0"):
        ref = [tf.Variable(v) for v in (w0, zeros, zeros)]
        ref_step = tf.function(make(*ref))
        want = [ref_step(x).numpy() for _ in range(3)]
    sharded = [gt.Variable(v, mesh, P(None, "model"), name=f"{kind}_{i}")
               for i, v in enumerate((w0, zeros, zeros))]
    step = gt.function(make(*sharded), mesh=mesh, in_shardings=(P("data"),))
    got = [step(x).numpy() for _ in range(3)]
    assert_close(np.array(got), np.array(want), "losses")
    for s, r in zip(sharded, ref):
        assert_close(s.numpy(), r.numpy(), s.name)
    assert step.lower(x).program.replicated_ops == []
