"""gt.AUTO as a gt.keras layout map value: the auto-sharding search chooses those
variables' specs within shard_model's memory_limit, optimizer slots follow their weight,
and fit equals one device."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import gspmd_tf as gt  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("gt.keras needs Keras' TensorFlow backend", allow_module_level=True)

P = gt.P
D, H, BATCH = 64, 512, 16
RTOL = 1e-4  # relative (norm) error allowed, as tests/test_keras.py
# A kernel and its two Adam slots replicated take 3 * D * H * 4 bytes per kernel: the
# probe of the all-replicated plan needs about 794 kB per device; this rules it out.
LIMIT = 400_000


def _ffn():
    model = keras.Sequential([keras.Input((D,)),
                              keras.layers.Dense(H, activation="relu", name="up"),
                              keras.layers.Dense(D, name="down")], name="ffn")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=False)
    return model


def _data(n=4 * BATCH):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, D)).astype(np.float32),
            rng.normal(size=(n, D)).astype(np.float32))


def _close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"


@pytest.fixture(scope="module")
def auto_run(mesh):
    keras.utils.set_random_seed(0)
    ref, model = _ffn(), _ffn()
    model.set_weights(ref.get_weights())
    gt.keras.shard_model(model, mesh, {".*kernel": gt.AUTO}, memory_limit=LIMIT)
    x, y = _data()
    want = ref.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]
    got = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]
    return ref, model, want, got


def test_auto_kernels_are_split_within_the_memory_limit(auto_run):
    _, model, _, _ = auto_run
    probe = model._gt_keras.auto_lowered
    assert probe.memory().peak <= LIMIT
    for v in model.variables:
        spec = gt.keras.layout_of(v)
        if v.path.endswith("kernel"):
            axes = [a for entry in spec if entry for a in
                    ((entry,) if isinstance(entry, str) else entry)]
            assert model._gt_keras.mesh.axes_size(tuple(axes)) >= 4, (v.path, spec)
        else:
            assert spec == P(), (v.path, spec)  # biases: not AUTO, no key: replicated


def test_adam_slots_take_their_kernels_chosen_spec(auto_run):
    _, model, _, _ = auto_run
    specs = {v.path.split("/", 1)[1].replace("/", "_"): gt.keras.layout_of(v)
             for v in model.variables}
    slots = [v for v in model.optimizer.variables if "kernel_" in v.path]
    assert len(slots) == 4  # momentum and velocity of both kernels
    for slot in slots:
        weight = slot.path.split("/", 1)[1].rsplit("_", 1)[0].split("_", 1)[1]
        assert gt.keras.layout_of(slot) == specs[weight], slot.path


def test_default_batch_spec_is_searched_and_the_step_fits_at_the_first_search(auto_run):
    # the step starts from the batch split the probe's plan was fitted with, so the
    # real step's peak is within the limit without a second, tighter search
    _, model, _, _ = auto_run
    state = model._gt_keras
    assert state.batch_auto and isinstance(state.batch_spec, P), state.batch_spec
    assert state.auto_lowered.auto_plan.memory_limit == LIMIT
    step = gt.keras.lowered(model)
    assert step.memory().peak <= LIMIT
    assert step.input_shardings[0] == gt.Sharding.from_spec(state.mesh, state.batch_spec, 2)
    assert f"batch_spec (every batch leaf, cut to its rank): {state.batch_spec}" in \
        gt.keras.auto_report(model)


def test_fit_with_auto_kernels_equals_single_device(auto_run):
    ref, model, want, got = auto_run
    _close(got, want, "loss")
    for a, b in zip(ref.variables + ref.optimizer.variables,
                    model.variables + model.optimizer.variables):
        if a.dtype == "float32":
            _close(b.numpy(), a.numpy(), b.path)


def test_auto_report_names_each_auto_variable_and_its_spec(auto_run):
    _, model, _, _ = auto_run
    text = gt.keras.auto_report(model)
    for path in ("ffn/up/kernel", "ffn/down/kernel"):
        assert f"  {path}: {gt.keras.layout_of(model.get_layer(path.split('/')[1]).kernel)}" \
            in text, text
    assert "pin the plan with in_shardings=" in text
    state = model._gt_keras
    assert "pin the plan with gt.keras.shard_model(model, mesh, layout_map=" + repr(
        {v.path: gt.keras.layout_of(v) for v in model.variables
         if v.path.endswith("kernel")}) + f", batch_spec={state.batch_spec!r})" in text, text


def test_auto_report_without_auto_is_a_sharding_error(mesh):
    model = gt.keras.shard_model(_ffn(), mesh, {".*kernel": P(None, "model")})
    with pytest.raises(gt.ShardingError, match="no auto-sharding decisions"):
        gt.keras.auto_report(model)


def test_auto_in_a_gt_function_layout_map_is_a_sharding_error_naming_the_variable(mesh):
    w = tf.Variable(np.ones((8, 8), np.float32), name="w_auto")

    def f(x):
        return tf.matmul(x, w)

    step = gt.function(f, mesh=mesh, layout_map={"w_auto": gt.AUTO})
    with pytest.raises(gt.ShardingError, match="'w_auto'.*gt.AUTO.*arguments"):
        step(np.ones((4, 8), np.float32))


@pytest.mark.long
def test_resnet50_auto_plan_is_solved_within_the_stated_gap_and_the_same_every_search(mesh):
    # issue 23: on this 7k-op step HiGHS stopped at its time limit and the plan
    # depended on the machine's load; now the search settles it (solve.py: the best
    # plan of the relaxation's strategies, proven within 2.19%). At 32x32 images that
    # plan is proven within 5.7% only and the whole MIP still stops at its time limit.
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((8, 64, 64, 3)).astype(np.float32),
             rng.integers(0, 10, (8,)).astype(np.int32))

    def plan():
        model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
        model.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy())
        gt.keras.shard_model(model, mesh, {".*": gt.AUTO})
        gt.keras.lowered(model, "train", batch)
        state = model._gt_keras
        by_id = {id(v): v.path for v in model.variables}
        return state.auto_lowered.auto_plan.status, state.batch_spec, sorted(
            (by_id[k], str(spec)) for k, spec in state.auto_specs.items() if k in by_id)

    first = plan()
    assert "optimal" in first[0].lower() or "within" in first[0], first[0]
    assert plan() == first
