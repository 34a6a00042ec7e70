"""gt.keras.shard_model: Keras fit/evaluate/predict partitioned over a mesh equal one device."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import gspmd_tf as gt  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("gt.keras needs Keras' TensorFlow backend", allow_module_level=True)

# Keras' own save_weights calls np.array(variable) the NumPy 2 way; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

P = gt.P
RTOL = 1e-4  # relative (norm) error allowed between the mesh and the single-device run
VOCAB, SEQ, CLASSES, N, BATCH = 24, 6, 5, 32, 8

LAYOUT = {"embed/embeddings": P(None, "model"),
          "dense_hidden/kernel": P(None, "model"),    # column split ...
          "dense_logits/kernel": P("model", None)}    # ... then row split (Megatron)


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (n, SEQ)).astype(np.int32)
    y = rng.integers(0, CLASSES, (n,)).astype(np.int32)
    return x, y


def _embedding_model(optimizer):
    inputs = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, name="embed")(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, activation="relu", name="dense_hidden")(h)
    logits = keras.layers.Dense(CLASSES, name="dense_logits")(h)
    model = keras.Model(inputs, logits)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    return model


def _mlp(name):
    model = keras.Sequential([keras.Input((12,)),
                              keras.layers.Dense(32, activation="relu", name="d1"),
                              keras.layers.Dense(CLASSES, name="d2")], name=name)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    return model


def _twins(make):
    """Two models with the same initial weights."""
    keras.utils.set_random_seed(0)
    ref, sharded = make(), make()
    sharded.set_weights(ref.get_weights())
    return ref, sharded


def _close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"


class _BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _fit(model, x, y, **kwargs):
    losses = _BatchLosses()
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                        callbacks=[losses], **kwargs)
    return losses.losses, history.history


def _all_variables(model):
    return list(model.variables) + list(model.optimizer.variables) + \
        list(model.metrics_variables)


def _assert_same_state(ref, sharded):
    for a, b in zip(ref.variables + ref.optimizer.variables,
                    sharded.variables + sharded.optimizer.variables):
        if a.dtype == "float32":
            _close(b.numpy(), a.numpy(), b.path)
        else:
            np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=b.path)


@pytest.fixture(scope="module")
def adam_run(mesh):
    """The embedding model fit with Adam on one device and on the 2x4 mesh."""
    ref, sharded = _twins(lambda: _embedding_model(keras.optimizers.Adam(0.01)))
    gt.keras.shard_model(sharded, mesh, LAYOUT)
    x, y = _data()
    val = _data(16, seed=3)
    want = _fit(ref, x, y, epochs=2, validation_data=val)
    got = _fit(sharded, x, y, epochs=2, validation_data=val)
    return ref, sharded, want, got


def test_fit_adam_matches_single_device(adam_run):
    ref, sharded, (want_losses, want_hist), (got_losses, got_hist) = adam_run
    assert len(got_losses) == 2 * N // BATCH
    _close(got_losses, want_losses, "per-batch losses")
    assert sorted(got_hist) == sorted(want_hist)  # loss, accuracy, val_loss, val_accuracy
    for key in want_hist:
        _close(got_hist[key], want_hist[key], key)
        assert all(isinstance(v, float) for v in got_hist[key])
    _assert_same_state(ref, sharded)


def test_every_variable_is_sharded_and_devices_hold_shards(adam_run):
    _, model, _, _ = adam_run
    for v in _all_variables(model):
        assert isinstance(v._value, gt.Variable), v.path
    kernel = model.get_layer("dense_hidden").kernel
    assert gt.keras.layout_of(kernel) == P(None, "model")
    whole = int(np.prod(kernel.shape)) * 4
    assert kernel._value.shard_bytes() == [whole // 4] * 8
    # Adam's slots follow their variable; scalars (iteration, learning rate) replicate
    slots = {v.path: v for v in model.optimizer.variables}
    for name in ("dense_hidden_kernel_momentum", "dense_hidden_kernel_velocity"):
        slot = next(v for p, v in slots.items() if p.endswith(name))
        assert gt.keras.layout_of(slot) == P(None, "model")
        assert slot._value.shard_bytes() == [whole // 4] * 8
    assert gt.keras.layout_of(model.optimizer.iterations) == P()
    logits = model.get_layer("dense_logits").kernel
    assert gt.keras.layout_of(logits) == P("model")
    view = gt.visualize_sharding(logits)  # the Keras variable's blocks
    assert [devices for row in view.cells for _, devices in row] == \
        [(0, 4), (1, 5), (2, 6), (3, 7)]
    for v in model.metrics_variables:
        assert gt.keras.layout_of(v) == P()


def test_evaluate_and_predict_match_single_device(adam_run):
    ref, sharded, _, _ = adam_run
    x, y = _data(N, seed=5)
    _close(sharded.evaluate(x, y, batch_size=BATCH, verbose=0),
           ref.evaluate(x, y, batch_size=BATCH, verbose=0), "evaluate")
    got = sharded.predict(x, batch_size=BATCH, verbose=0)
    assert isinstance(got, np.ndarray) and got.shape == (N, CLASSES)
    _close(got, ref.predict(x, batch_size=BATCH, verbose=0), "predict")
    _close(sharded.predict_on_batch(x[:BATCH]), ref.predict_on_batch(x[:BATCH]),
           "predict_on_batch")


def test_save_weights_restores_onto_other_meshes(adam_run, tmp_path):
    ref, sharded, _, _ = adam_run
    path = str(tmp_path / "model.weights.h5")
    sharded.save_weights(path)
    want = [v.numpy() for v in sharded.variables + sharded.optimizer.variables]
    x, y = _data(N, seed=5)
    for shape, axes, layout in [
            ((4, 2), ("data", "model"), LAYOUT),
            ((8,), ("data",), {"dense_hidden/kernel": P(None, "data")})]:
        keras.utils.set_random_seed(1)  # other initial values
        other = _embedding_model(keras.optimizers.Adam(0.01))
        gt.keras.shard_model(other, gt.Mesh.create(shape, axes), layout)
        other.load_weights(path)
        got = [v.numpy() for v in other.variables + other.optimizer.variables]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)  # bit-identical
        if shape == (4, 2):  # the restored model runs on its mesh
            _close(other.evaluate(x, y, batch_size=BATCH, verbose=0),
                   ref.evaluate(x, y, batch_size=BATCH, verbose=0), "evaluate restored")


def test_fit_sgd_with_keras_layout_map(mesh):
    device_mesh = keras.distribution.DeviceMesh(
        (2, 4), ("data", "model"), devices=[f"cpu:{i}" for i in range(8)])
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map["dense.*kernel"] = (None, "model")
    layout_map["dense_hidden/bias"] = ("model",)
    ref, sharded = _twins(
        lambda: _embedding_model(keras.optimizers.SGD(0.1, momentum=0.9)))
    gt.keras.shard_model(sharded, layout_map=layout_map)  # mesh from the LayoutMap
    assert sharded._gt_keras.mesh.shape == (2, 4)
    assert gt.keras.layout_of(sharded.get_layer("dense_hidden").bias) == P("model")
    assert gt.keras.layout_of(sharded.get_layer("dense_logits").kernel) == P(None, "model")
    x, y = _data()
    want_losses, want_hist = _fit(ref, x, y, epochs=2)
    got_losses, got_hist = _fit(sharded, x, y, epochs=2)
    _close(got_losses, want_losses, "per-batch losses")
    _close(got_hist["accuracy"], want_hist["accuracy"], "accuracy")
    _assert_same_state(ref, sharded)
    # train_on_batch / test_on_batch go through the same partitioned steps
    _close(sharded.train_on_batch(x[:BATCH], y[:BATCH]),
           ref.train_on_batch(x[:BATCH], y[:BATCH]), "train_on_batch")
    _close(sharded.test_on_batch(x[:BATCH], y[:BATCH]),
           ref.test_on_batch(x[:BATCH], y[:BATCH]), "test_on_batch")


@pytest.mark.parametrize("shape", [(8, 1), (1, 8)])
def test_fit_on_other_meshes_shard_before_compile(shape):
    mesh = gt.Mesh.create(shape, ("data", "model"))
    keras.utils.set_random_seed(0)
    ref = _mlp(f"mlp_{shape[0]}x{shape[1]}")
    sharded = keras.models.clone_model(ref)  # not compiled yet: shard, then compile
    sharded.set_weights(ref.get_weights())
    gt.keras.shard_model(sharded, mesh, {".*/d1/kernel": P(None, "model"),
                                         ".*/d2/kernel": P("model", None)})
    sharded.compile(optimizer=keras.optimizers.Adam(0.01),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"], jit_compile=False)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((24, 12)).astype(np.float32)  # 24 = 3 batches of 8
    y = rng.integers(0, CLASSES, 24).astype(np.int32)
    want_losses, _ = _fit(ref, x, y, epochs=1)
    got_losses, _ = _fit(sharded, x, y, epochs=1)
    _close(got_losses, want_losses, "per-batch losses")
    _assert_same_state(ref, sharded)
    for v in _all_variables(sharded):  # optimizer and metrics built at the first step
        assert isinstance(v._value, gt.Variable), v.path
    if shape != (8, 1):
        return
    # compile() again with a new optimizer: the steps are rebuilt around it
    for model in (ref, sharded):
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
    want_losses, _ = _fit(ref, x, y, epochs=1)
    got_losses, _ = _fit(sharded, x, y, epochs=1)
    _close(got_losses, want_losses, "per-batch losses after re-compiling")
    _assert_same_state(ref, sharded)
    assert gt.keras.layout_of(sharded.optimizer.variables[-2]) is not None


def test_unmatched_regex_warns_and_lists_replicated(mesh):
    model = _embedding_model(keras.optimizers.SGD(0.1))
    with pytest.warns(UserWarning, match=r"nomatch.*/kernel.*match no variable") as record:
        gt.keras.shard_model(model, mesh, {"dense_hidden/kernel": P(None, "model"),
                                           "nomatch.*/kernel": P("model")})
    text = str(record[0].message)
    assert "embed/embeddings" in text and "dense_logits/kernel" in text
    assert "stay replicated: ['embed/embeddings', 'dense_hidden/bias'" in text
    assert gt.keras.layout_of(model.get_layer("dense_logits").kernel) == P()


def test_bad_layouts_name_the_variable(mesh):
    model = _embedding_model(keras.optimizers.SGD(0.1))
    with pytest.raises(gt.ShardingError, match="dense_hidden/bias.*rank 1"):
        gt.keras.shard_model(model, mesh, {"dense_hidden/bias": P(None, "model")})
    with pytest.raises(gt.ShardingError, match="dense_hidden/kernel.*several layout_map"):
        gt.keras.shard_model(model, mesh, {"dense.*kernel": P(None, "model"),
                                           ".*hidden.*": P()})
    with pytest.raises(gt.ShardingError, match="unknown mesh axis 'modle'"):
        gt.keras.shard_model(model, mesh, {"dense_hidden/kernel": P(None, "modle")})


def test_lowered_train_step_is_public(adam_run, mesh):
    _, sharded, _, _ = adam_run
    low = gt.keras.lowered(sharded, "train")  # the step fit ran last
    x_sharding, y_sharding = low.input_shardings[:2]
    assert x_sharding == gt.Sharding.from_spec(mesh, P("data"), 2)
    assert y_sharding == gt.Sharding.from_spec(mesh, P("data"), 1)  # labels split too
    assert low.collectives() and "all-reduce" in low.report()
    memory = low.memory()
    # every model, optimizer and metric variable enters as this device's shard
    shards = sum(v._value.shard_bytes()[0] for v in _all_variables(sharded))
    assert memory.variables == shards
    with pytest.raises(gt.ShardingError, match="use 'train', 'test' or 'predict'"):
        gt.keras.lowered(sharded, "fit")


def test_lowered_before_running_and_labels_split_by_a_longer_batch_spec(mesh):
    ref, sharded = _twins(lambda: _mlp("mlp_batch_spec"))
    gt.keras.shard_model(sharded, mesh, {".*/d1/kernel": P(None, "model")},
                         batch_spec=P("data", None))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 12)).astype(np.float32)
    y = rng.integers(0, CLASSES, 16).astype(np.int32)
    with pytest.raises(gt.ShardingError, match="has run no train step yet"):
        gt.keras.lowered(sharded, "train")
    low = gt.keras.lowered(sharded, "train", data=(x[:BATCH], y[:BATCH]))
    assert low.input_shardings[1] == gt.Sharding.from_spec(mesh, P("data"), 1)
    predict = gt.keras.lowered(sharded, "predict", data=(x[:BATCH],))
    assert predict.output_shardings[0].tile_shape[0] == 2  # batch still split by 'data'
    want_losses, _ = _fit(ref, x, y, epochs=1)
    got_losses, _ = _fit(sharded, x, y, epochs=1)
    _close(got_losses, want_losses, "per-batch losses")
    assert gt.keras.lowered(sharded, "train").input_shardings == low.input_shardings


def test_keras_layers_inside_gt_function_point_to_shard_model(mesh):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(8, name="d")])
    x = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    want = model(x).numpy()
    call = gt.function(lambda t: model(t), mesh=mesh, in_shardings=(P("data"),))
    with pytest.raises(gt.ShardingError, match=r"gt\.keras\.shard_model"):
        call(x)
    gt.keras.shard_model(model, mesh, {".*/d/kernel": P(None, "model")})
    call = gt.function(lambda t: model(t), mesh=mesh, in_shardings=(P("data"),))
    got = call(x)
    assert got.spec == P("data", "model")
    _close(got.numpy(), want, "sharded model called in gt.function")


def test_export_of_a_sharded_model_serves_on_one_device(mesh, tmp_path):
    ref, sharded = _twins(lambda: _mlp("mlp_export"))
    gt.keras.shard_model(sharded, mesh, {".*/d1/kernel": P(None, "model"),
                                         ".*/d2/kernel": P("model", None)})
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 12)).astype(np.float32)
    y = rng.integers(0, CLASSES, 8).astype(np.int32)
    for model in (ref, sharded):  # weights that moved on the mesh are what is exported
        model.train_on_batch(x, y)
    sharded.export(str(tmp_path / "served"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "served"))
    _close(served.serve(x).numpy(), ref.predict_on_batch(x), "exported model")


def _narrow_mlp():
    """d1's kernel has a dim of 1 (12, 1) and d2's one of 2 (1, 2): both smaller than the
    "model" axis of 4 a layout map splits them over."""
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(1, name="d1"),
                              keras.layers.Dense(2, name="d2")], name="narrow")
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    return model


def test_dims_smaller_than_their_axis_work_in_every_step_after_fit(mesh):
    """Steps built after the first (predict after fit, a validation epoch, fit after
    evaluate) keep the variables fit took over, also where a dim is smaller than the
    mesh axis splitting it."""
    ref, sharded = _twins(_narrow_mlp)
    gt.keras.shard_model(sharded, mesh, {".*/d1/kernel": P(None, "model"),
                                         ".*/d2/kernel": P(None, "model")})
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 12)).astype(np.float32)
    y = rng.integers(0, 2, 16).astype(np.int32)
    for model in (ref, sharded):
        _fit(model, x, y, epochs=1)
    _close(sharded.predict(x, batch_size=BATCH, verbose=0),
           ref.predict(x, batch_size=BATCH, verbose=0), "predict after fit")
    _, want = _fit(ref, x, y, epochs=2, validation_data=(x, y))
    _, got = _fit(sharded, x, y, epochs=2, validation_data=(x, y))
    _close(got["val_loss"], want["val_loss"], "validation losses")
    _close(sharded.evaluate(x, y, batch_size=BATCH, verbose=0),
           ref.evaluate(x, y, batch_size=BATCH, verbose=0), "evaluate")
    want_losses, _ = _fit(ref, x, y, epochs=1)
    got_losses, _ = _fit(sharded, x, y, epochs=1)
    _close(got_losses, want_losses, "fit after evaluate")
    _assert_same_state(ref, sharded)


# the compute dtype's rounding unit (2^-(mantissa bits)) of each mixed precision policy
_ROUNDING_UNIT = {"mixed_float16": 2.0 ** -10, "mixed_bfloat16": 2.0 ** -7}


@pytest.mark.parametrize("policy", sorted(_ROUNDING_UNIT))
def test_mixed_precision_fit_differs_from_single_device_by_less_than_its_rounding(mesh,
                                                                                   policy):
    """Keras's mixed precision policies (mixed_float16 wraps the optimizer in a
    LossScaleOptimizer) train on the mesh: after 4 steps each weight's update differs
    from single-device Keras's, relative to the update, by less than one rounding unit of
    the compute dtype (float32 runs are held to 1e-4 elsewhere; the partitioned step sums
    its float16 / bfloat16 products in another order), and the optimizers' counters are
    equal."""
    def make():
        keras.mixed_precision.set_global_policy(policy)
        try:
            model = keras.Sequential([keras.Input((12,)),
                                      keras.layers.Dense(32, activation="relu", name="d1"),
                                      keras.layers.Dense(CLASSES, name="d2", dtype="float32")],
                                     name="mixed")
        finally:
            keras.mixed_precision.set_global_policy("float32")
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        return model
    ref, sharded = _twins(make)
    gt.keras.shard_model(sharded, mesh, {".*/d1/kernel": P(None, "model"),
                                         ".*/d2/kernel": P("model", None)})
    start = [v.numpy() for v in ref.trainable_variables]
    rng = np.random.default_rng(6)
    x = rng.standard_normal((32, 12)).astype(np.float32)
    y = rng.integers(0, CLASSES, 32).astype(np.int32)
    for model in (ref, sharded):
        _fit(model, x, y, epochs=1)
    for before, a, b in zip(start, ref.trainable_variables, sharded.trainable_variables):
        update = np.linalg.norm(a.numpy().astype(np.float64) - before)
        err = np.linalg.norm(b.numpy().astype(np.float64) - a.numpy()) / update
        assert err < _ROUNDING_UNIT[policy], (b.path, err)
    counters = [(a.path, a.numpy(), b.numpy()) for a, b in zip(ref.optimizer.variables,
                                                                sharded.optimizer.variables)
                if not a.dtype.startswith("float")]
    assert counters and all(np.array_equal(a, b) for _, a, b in counters), counters


def test_a_failed_load_weights_leaves_every_variable_as_it_was(mesh, tmp_path):
    """d1 fits the file and d2 does not: Keras writes d1 before it finds d2's shape
    wrong; the sharded model writes d1 back."""
    path = str(tmp_path / "wider.weights.h5")
    keras.utils.set_random_seed(2)
    wider = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, name="d1"),
                              keras.layers.Dense(CLASSES + 1, name="d2")])
    wider.save_weights(path)
    keras.utils.set_random_seed(3)
    model = _mlp("load_target")
    gt.keras.shard_model(model, mesh, {"d1/kernel": P(None, "model")})
    before = [v.numpy() for v in _all_variables(model)]
    with pytest.raises(gt.ShardingError, match=r"load_weights\(.*wider.weights.h5.*every "
                       r"variable left as it was.*shape") as caught:
        model.load_weights(path)
    assert isinstance(caught.value.__cause__, ValueError)
    for v, want in zip(_all_variables(model), before):
        np.testing.assert_array_equal(v.numpy(), want, err_msg=v.path)
    assert not np.array_equal(wider.get_layer("d1").kernel.numpy(),
                              model.get_layer("d1").kernel.numpy())


class _CountedDense(keras.layers.Dense):
    """A Dense layer counting the calls of its `call` (one per trace)."""

    calls = 0

    def call(self, inputs):
        _CountedDense.calls += 1
        return super().call(inputs)


def test_first_fit_traces_the_forward_pass_once_and_builds_metrics(mesh):
    def make():
        inputs = keras.Input((12,))
        logits = _CountedDense(CLASSES, name="counted")(
            keras.layers.Dense(32, activation="relu", name="d1")(inputs))
        model = keras.Model(inputs, logits)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=False)
        return model
    ref, sharded = _twins(make)
    gt.keras.shard_model(sharded, mesh, {"d1/kernel": P(None, "model")})
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, 12)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH).astype(np.int32)
    _CountedDense.calls = 0
    _, got = _fit(sharded, x, y)
    # the step's trace only: the compiled metrics and loss are built from the model's
    # symbolic outputs, not from another trace of the model
    assert _CountedDense.calls == 1
    _, want = _fit(ref, x, y)
    for key in ("loss", "accuracy"):
        _close(got[key], want[key], key)
    _assert_same_state(ref, sharded)
