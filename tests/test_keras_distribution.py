"""Keras' own keras.distribution API on the TensorFlow backend (gspmd_tf.keras_distribution):
a model built under ModelParallel trains, evaluates and predicts partitioned, equal to
single-device Keras."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import gspmd_tf as gt  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("the TF backend's distribution API", allow_module_level=True)
kd = keras.distribution

# Keras' own save_weights calls np.array(variable) the NumPy 2 way; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

RTOL = 1e-4  # relative (norm) error allowed between the mesh and the single-device run
FEATURES, SEQ, CLASSES, N, BATCH = 8, 6, 5, 32, 8


def _close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"


def _compiled(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    return model


def _mlp():
    return _compiled(keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu", name="d1"),
         keras.layers.Dense(CLASSES, name="d2")], name="mlp"))


def _attention():
    inputs = keras.Input((SEQ, FEATURES))
    # no biases: the key bias has a zero gradient (softmax ignores a shift shared by all
    # keys), so Adam would move it by rounding noise alone
    h = keras.layers.MultiHeadAttention(4, 4, use_bias=False, name="mha")(inputs, inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return _compiled(keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h),
                                 name="attention"))


def _layout_map():
    device_mesh = kd.DeviceMesh((2, 4), ("batch", "model"), devices=kd.list_devices())
    layout_map = kd.LayoutMap(device_mesh)
    layout_map[".*d1/kernel"] = (None, "model")        # Megatron: column split ...
    layout_map[".*d2/kernel"] = ("model", None)        # ... then row split
    layout_map[".*mha/(query|key|value)/kernel"] = kd.TensorLayout((None, "model", None))
    layout_map[".*mha/attention_output/kernel"] = ("model", None, None)
    return layout_map


def _data(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N,) + shape).astype(np.float32)
    return x, rng.integers(0, CLASSES, N).astype(np.int32)


@pytest.fixture(scope="module", params=["mlp", "attention"])
def trained(request):
    """(single-device model, the same model built under ModelParallel, data, both
    histories): built once each with the same initial weights and fit for 2 epochs."""
    make, shape = {"mlp": (_mlp, (FEATURES,)),
                   "attention": (_attention, (SEQ, FEATURES))}[request.param]
    keras.utils.set_random_seed(0)
    ref = make()
    distribution = kd.ModelParallel(layout_map=_layout_map(), batch_dim_name="batch")
    with distribution.scope():
        model = make()
        model.set_weights(ref.get_weights())
        x, y = _data(shape, seed=1)
        got = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    want = ref.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return ref, model, distribution, (x, y), got.history, want.history


def test_fit_under_model_parallel_matches_single_device(trained):
    ref, model, _, _, got, want = trained
    for key in want:
        _close(got[key], want[key], key)
    for a, b in zip(ref.variables + ref.optimizer.variables,
                    model.variables + model.optimizer.variables):
        _close(b.numpy(), a.numpy(), b.path)


def test_evaluate_predict_and_train_on_batch_match_single_device(trained):
    ref, model, distribution, (x, y), _, _ = trained
    with distribution.scope():
        got_eval = model.evaluate(x, y, batch_size=BATCH, verbose=0)
        got_pred = model.predict(x, batch_size=BATCH, verbose=0)
    _close(got_eval, ref.evaluate(x, y, batch_size=BATCH, verbose=0), "evaluate")
    _close(got_pred, ref.predict(x, batch_size=BATCH, verbose=0), "predict")
    # outside the scope too: the variables keep the layouts they were created with
    _close(model.train_on_batch(x[:BATCH], y[:BATCH]),
           ref.train_on_batch(x[:BATCH], y[:BATCH]), "train_on_batch")


def test_layout_map_splits_variables_and_their_optimizer_slots(trained):
    _, model, _, _, _, _ = trained
    kernel = model.variables[0]
    mesh = model._gt_keras.mesh
    assert gt.Sharding.from_spec(mesh, gt.keras.layout_of(kernel), kernel.ndim) == \
        gt.Sharding.from_spec(mesh, gt.P(*kernel._layout.axes), kernel.ndim)
    assert "model" in gt.keras.layout_of(kernel)
    slots = [v for v in model.optimizer.variables if tuple(v.shape) == tuple(kernel.shape)]
    assert slots and all(gt.keras.layout_of(v) == gt.keras.layout_of(kernel) for v in slots)
    report = gt.keras.lowered(model, "train").report()
    assert f"{gt.keras.layout_of(kernel)!r} (annotated)" in report  # the split variable
    assert "P('batch') (annotated)" in report  # the batch split by batch_dim_name


def test_save_load_weights_and_export(trained, tmp_path):
    ref, model, _, (x, _), _, _ = trained
    path = str(tmp_path / f"{model.name}.weights.h5")
    model.save_weights(path)
    before = model.predict(x, batch_size=BATCH, verbose=0)
    model.set_weights([np.zeros_like(w) for w in model.get_weights()])
    model.load_weights(path)
    _close(model.predict(x, batch_size=BATCH, verbose=0), before, "predict after load")
    model.export(str(tmp_path / "served"), verbose=False)  # serves on one device
    served = tf.saved_model.load(str(tmp_path / "served"))
    _close(served.serve(x[:BATCH]).numpy(), ref.predict_on_batch(x[:BATCH]), "exported")


def test_list_devices_mesh_and_distribute_tensor_as_on_jax():
    assert kd.list_devices() == [f"cpu:{i}" for i in range(8)]
    device_mesh = kd.DeviceMesh((2, 4), ("batch", "model"))
    assert device_mesh.backend_mesh.shape == (2, 4)
    layout = kd.TensorLayout(("batch", "model"), device_mesh)
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    placed = kd.distribute_tensor(value, layout)  # eagerly: a value placed as shards
    assert isinstance(placed, gt.ShardedTensor) and placed.spec == gt.P("batch", "model")
    np.testing.assert_array_equal(placed.numpy(), value)
    assert placed.shards[5].shape == (4, 1)


def test_data_parallel_replicates_variables_and_splits_the_batch(tmp_path):
    """Every variable replicated, as one tf.Variable for the process's CPU devices (not
    one per device): fit equals single-device Keras in loss and weights, and
    save_weights / load_weights round-trip the one copy."""
    keras.utils.set_random_seed(0)
    ref = _mlp()
    with kd.DataParallel(devices=kd.list_devices()).scope():
        model = _mlp()
        model.set_weights(ref.get_weights())
        x, y = _data((FEATURES,), seed=2)
        lowered = gt.keras.lowered(model, "train", data=(x[:BATCH], y[:BATCH]))  # before fit
        assert lowered.input_shardings[0] == gt.Sharding.from_spec(
            model._gt_keras.mesh, gt.P("batch"), 2)
        got = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    want = ref.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    _close(got["loss"], want["loss"], "loss")
    for v, w in zip(model.weights, ref.weights):
        _close(v.numpy(), w.numpy(), v.path)
        assert len(v._value.copies()) == 1, v.path
    assert gt.keras.layout_of(model.variables[0]) == gt.P()
    assert model._gt_keras.batch_spec == gt.P("batch")
    path = str(tmp_path / "dp.weights.h5")
    model.save_weights(path)
    trained = model.get_weights()
    model.set_weights([np.zeros_like(w) for w in trained])  # changed, then loaded back
    model.load_weights(path)
    for got_w, want_w in zip(model.get_weights(), trained):
        np.testing.assert_array_equal(got_w, want_w)
