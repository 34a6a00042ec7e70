"""gt.Variable: shards per device, reads/gradients/assigns inside gt.function, checkpoints."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from util import assert_close, assert_replicas_equal

P = gt.P


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


def _slice_entries(path, key):
    """(shape) of each slice stored for `key`; a checkpoint lists a slice as an entry
    "\\0<key>\\0<slice>"."""
    lines = tf.train.load_checkpoint(path).debug_string().split(b"\n")
    return [line.rsplit(b" ", 1)[-1].decode() for line in lines
            if line.startswith(b"\0" + key.encode() + b"\0")]


def test_checkpoint_stores_one_slice_per_distinct_shard(mesh, tmp_path):
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    w = gt.Variable(value, mesh, P("data", "model"), name="sliced")
    r = gt.Variable(value, mesh, P(None, "model"), name="half_replicated")
    path = tf.train.Checkpoint(w=w, r=r).save(str(tmp_path / "ckpt"))
    assert _slice_entries(path, "w/.ATTRIBUTES/VARIABLE_VALUE") == ["[4,3]"] * 8
    assert _slice_entries(path, "r/.ATTRIBUTES/VARIABLE_VALUE") == ["[8,3]"] * 4
    assert dict(tf.train.list_variables(path))["w/.ATTRIBUTES/VARIABLE_VALUE"] == [8, 12]


@pytest.mark.parametrize("shape,spec", [((30, 7), P("model", "data")), ((5,), P("model")),
                                        ((3,), P("model")), ((), P()), ((3, 4), P()),
                                        ((0, 4), P("data"))])
def test_checkpoint_round_trips_with_plain_variables(mesh, tmp_path, shape, spec):
    """Uneven and empty shards, scalars, replicated and empty variables: a checkpoint restores
    into a plain tf.Variable and onto other meshes; a plain one restores into shards."""
    value = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    v = gt.Variable(value, mesh, spec, name="round_trip")
    path = tf.train.Checkpoint(w=v).save(str(tmp_path / "sharded"))
    plain = tf.Variable(np.zeros(shape, np.float32))
    tf.train.Checkpoint(w=plain).restore(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), value)
    for other in _other_meshes():
        w = gt.Variable(lambda s, d: tf.zeros(s, d), other, spec, shape=shape, name="rt")
        tf.train.Checkpoint(w=w).restore(path).assert_consumed()
        np.testing.assert_array_equal(w.numpy(), value)
        assert_replicas_equal(w)
    plain_path = tf.train.Checkpoint(w=tf.Variable(value * 2)).save(str(tmp_path / "plain"))
    tf.train.Checkpoint(w=v).restore(plain_path).assert_consumed()
    np.testing.assert_array_equal(v.numpy(), value * 2)


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_failed_restore_writes_nothing(mesh, tmp_path, bad):
    """A later variable that does not match fails the restore before any variable is
    written (TF's RestoreV2 checks every requested slice's full shape and dtype)."""
    a_old, b_old = np.ones((8, 4), np.float32), np.ones((4, 4), np.float32)
    path = tf.train.Checkpoint(a=gt.Variable(a_old * 5, mesh, P("data"), name="a"),
                               b=gt.Variable(b_old * 5, mesh, P("model"), name="b")
                               ).save(str(tmp_path / "ckpt"))
    a = gt.Variable(a_old, mesh, P("data", "model"), name="a")
    b = (gt.Variable(np.ones((4, 8), np.float32), mesh, P("model"), name="b") if bad == "shape"
         else gt.Variable(np.ones((4, 4), np.float64), mesh, P("model"), name="b"))
    b_before = b.numpy()
    message = r"b/\.ATTRIBUTES/VARIABLE_VALUE.*shape.*\[4,8\].*\[4,4\]" if bad == "shape" \
        else "(?i)dtype"
    with pytest.raises(gt.ShardingError, match=message) as caught:
        tf.train.Checkpoint(a=a, b=b).restore(path)
    assert isinstance(caught.value.__cause__, tf.errors.InvalidArgumentError)
    np.testing.assert_array_equal(a.numpy(), a_old)
    np.testing.assert_array_equal(b.numpy(), b_before)
    for v in (a, b):
        assert_replicas_equal(v)


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


# ---------------------------------------------------------------- variables of other meshes
def _other_meshes():
    """Meshes with the variable mesh's axis names but another shape or device order."""
    devices = gt.Mesh.create((8,), ("x",)).devices
    return [gt.Mesh.create((4, 2), ("data", "model")),
            gt.Mesh.create((8, 1), ("data", "model")),
            gt.Mesh(np.reshape(devices[::-1], (2, 4)), ("data", "model"))]


@pytest.mark.parametrize("spec", [P("data", "model"), P("model"), P(None, ("data", "model"))])
def test_reads_of_a_variable_from_another_mesh_are_resharded(mesh, spec):
    rng = np.random.default_rng(4)
    value = rng.standard_normal((8, 12)).astype(np.float32)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    v = gt.Variable(value, mesh, spec, name="foreign_read")
    for other in _other_meshes():
        f = gt.function(lambda x: tf.tanh(x @ v) + tf.reduce_sum(v), mesh=other,
                        in_shardings=(P("data"),))
        for _ in range(2):
            assert_close(f(x).numpy(), np.tanh(x @ value) + value.sum(), f"read on {other}")
        np.testing.assert_array_equal(v.numpy(), value)
        assert_replicas_equal(v)


def _updates():
    """Traced updates of variable v (8, 12) with input x (8, 12)."""
    def fused_sgd(v, x):
        tf.raw_ops.ResourceApplyGradientDescent(var=v.handle, alpha=0.1, delta=x)
        return tf.reduce_sum(x)
    return {"assign": lambda v, x: v.assign(x * 2.0).read_value(),
            "assign_add": lambda v, x: v.assign_add(x),
            "assign_sub": lambda v, x: v.assign_sub(x),
            "fused_sgd": fused_sgd}


@pytest.mark.parametrize("update", sorted(_updates()))
def test_updates_of_a_variable_from_another_mesh_are_refused(mesh, update):
    value = np.arange(96, dtype=np.float32).reshape(8, 12)
    x = np.ones((8, 12), np.float32)
    v = gt.Variable(value, mesh, P("data", "model"), name="foreign_update")
    body = _updates()[update]
    for other in _other_meshes():
        f = gt.function(lambda x: body(v, x), mesh=other)
        with pytest.raises(gt.ShardingError,
                           match="updates variable 'foreign_update.*run the function on the "
                                 "variable's mesh"):
            f(x)
        np.testing.assert_array_equal(v.numpy(), value)
        assert_replicas_equal(v)
    # on its own mesh the same update works and keeps the replicas equal
    own = gt.function(lambda x: body(v, x), mesh=mesh)
    own(x)
    reference = tf.Variable(value)
    body(reference, tf.constant(x))
    assert_close(v.numpy(), reference.numpy(), update)
    assert_replicas_equal(v)


def test_error_names_both_meshes_with_their_devices(mesh):
    v = gt.Variable(np.zeros((8, 4), np.float32), mesh, P("data"), name="two_meshes")
    other = _other_meshes()[2]  # same shape and axes, reversed devices
    f = gt.function(lambda x: v.assign_add(x), mesh=other)
    with pytest.raises(gt.ShardingError) as info:
        f.lower(np.ones((8, 4), np.float32))
    message = str(info.value)
    assert "devices CPU:7, CPU:6" in message and "devices CPU:0, CPU:1" in message


# ---------------------------------------------------------------- initial values and updates
@pytest.mark.parametrize("returned,complaint", [
    (lambda s, d: tf.zeros((8, 12), d), r"it returned shape \(8, 12\)"),  # the whole tensor
    (lambda s, d: tf.zeros((s[0] - 1, s[1]), d), r"it returned shape \(3, 3\)"),
    (lambda s, d: tf.constant(1.0, d), r"it returned shape \(\)"),
    (lambda s, d: None, "it returned None"),
    (lambda s, d: tf.zeros(s, tf.float64), "does not convert.*float64"),
])
def test_initial_value_callable_must_return_one_shard(mesh, returned, complaint):
    with pytest.raises(gt.ShardingError,
                       match=r"of variable 'init_check.*shape \(4, 3\), dtype float32 .*"
                             + complaint):
        gt.Variable(returned, mesh, P("data", "model"), shape=(8, 12), name="init_check")


def test_initial_value_dtype_follows_tf_variable(mesh):
    """As tf.Variable: numpy values are cast to the dtype; tensors and python numbers of
    another kind are refused."""
    float_array = np.full((8, 4), 1.5)
    want = tf.Variable(float_array, dtype=tf.int32).numpy()
    got = gt.Variable(float_array, mesh, P("data"), dtype=tf.int32, name="cast").numpy()
    np.testing.assert_array_equal(got, want)
    for value in (tf.fill((8, 4), 1.5), [[1.5] * 4] * 8):
        with pytest.raises((TypeError, ValueError)):
            tf.Variable(value, dtype=tf.int32)
        with pytest.raises((TypeError, ValueError)):
            gt.Variable(value, mesh, P("data"), dtype=tf.int32, name="refused")
    with pytest.raises(gt.ShardingError, match="does not convert"):
        gt.Variable(lambda s, d: tf.fill(s, 1.5), mesh, P("data"), shape=(8, 4),
                    dtype=tf.int32, name="refused_fn")


@pytest.mark.parametrize("update", ["assign_add", "assign_sub"])
@pytest.mark.parametrize("delta", [np.ones(4, np.float32), np.ones((1, 4), np.float32), 1.0])
def test_eager_update_with_another_shape_is_refused_like_tf(mesh, update, delta):
    plain = tf.Variable(np.zeros((8, 4), np.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="shapes must be equal"):
        getattr(plain, update)(delta)
    v = gt.Variable(np.zeros((8, 4), np.float32), mesh, P("data", "model"), name="eager_upd")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"variable 'eager_upd.*\[8, 4\].*shapes must be equal"):
        getattr(v, update)(delta)
    np.testing.assert_array_equal(v.numpy(), np.zeros((8, 4)))
    with pytest.raises(gt.ShardingError, match=r"eager_upd.*cannot assign a value of shape"):
        v.assign(delta)


def test_eager_update_dtype_follows_tf_variable(mesh):
    plain = tf.Variable(np.zeros(8, np.int32))
    v = gt.Variable(np.zeros(8, np.int32), mesh, P("model"), name="int_var")
    for var in (plain, v):
        var.assign_add(np.full(8, 1.5))  # numpy: cast, as tf.Variable does
        with pytest.raises((TypeError, ValueError)):
            var.assign_add(1.5)
        with pytest.raises((TypeError, ValueError)):
            var.assign(tf.fill([8], 1.5))
    np.testing.assert_array_equal(v.numpy(), plain.numpy())
    assert_replicas_equal(v)


@pytest.mark.parametrize("shape,spec", [((2, 7, 1), P(None, None, "data")),
                                        ((0, 12, 5), P(("data", "model"))),
                                        ((1, 8), P("data", "model"))])
def test_variable_split_on_a_dim_of_size_0_or_1(mesh, shape, spec):
    """Such a dim holds the same on every device split or not; op rules give it no factor,
    so it is kept unsplit (a variable cannot be resharded; reading it tried to gather the
    handle: fuzzer, seed 41 #3 and #5)."""
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    v = gt.Variable(value, mesh, spec, name="thin")
    r = tf.Variable(value)

    def step(variable):
        def f(x):
            y = variable.read_value() * 2.0
            variable.assign_add(x)
            return y
        return f
    x = np.ones(shape, np.float32)
    f = gt.function(step(v), mesh=mesh, in_shardings=(P(),))
    for _ in range(2):
        assert_close(f(x).numpy(), step(r)(x).numpy(), "read")
    assert_close(v.numpy(), r.numpy(), "variable")
    assert_replicas_equal(v)
