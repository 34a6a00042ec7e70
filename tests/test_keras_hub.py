"""keras_hub models (Gemma, Llama, Qwen, QwenMoe, Qwen3Moe) under their own layout maps
(get_layout_map), GPT-2 under Megatron's, with Keras' ModelParallel
on the mesh those maps assume ("batch", "model"): training equals single-device Keras.
Tiny configs built from arguments (no presets, no downloads)."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import gspmd_tf as gt  # noqa: E402
from gspmd_tf.testing.keras_layouts import gpt2_megatron_layout_map  # noqa: E402

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")
if keras.backend.backend() != "tensorflow":
    pytest.skip("the TF backend's distribution API", allow_module_level=True)
kd = keras.distribution

RTOL = 1e-4  # relative (norm) error allowed between the mesh and the single-device run
VOCAB, SEQ, N, BATCH = 32, 8, 16, 8


def _close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"


def _gemma():
    """One key/value head (the official map splits the head dim over "model")."""
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=4)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _llama():
    """Grouped-query attention: 2 key/value heads, fewer than the model axis's 4."""
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _qwen():
    backbone = keras_hub.models.QwenBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32)
    return keras_hub.models.QwenCausalLM(backbone=backbone, preprocessor=None)


def _qwen_moe():
    backbone = keras_hub.models.QwenMoeBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, moe_intermediate_dim=8,
        shared_expert_intermediate_dim=16, num_experts=4, top_k=2)
    return keras_hub.models.QwenMoeCausalLM(backbone=backbone, preprocessor=None)


def _qwen3_moe():
    backbone = keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, moe_intermediate_dim=8, num_experts=4,
        head_dim=4, top_k=2)
    return keras_hub.models.Qwen3MoeCausalLM(backbone=backbone, preprocessor=None)


def _gpt2():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=SEQ)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


MODELS = {
    "gemma": (_gemma, keras_hub.models.GemmaBackbone.get_layout_map),
    "llama": (_llama, keras_hub.models.LlamaBackbone.get_layout_map),
    "gpt2": (_gpt2, gpt2_megatron_layout_map),  # GPT-2 publishes no map
    "qwen": (_qwen, keras_hub.models.QwenBackbone.get_layout_map),
    "qwen_moe": (_qwen_moe, keras_hub.models.QwenMoeBackbone.get_layout_map),
    "qwen3_moe": (_qwen3_moe, keras_hub.models.Qwen3MoeBackbone.get_layout_map),
}


def _compiled(make):
    model = make()
    # SGD: a weight whose gradient is zero up to rounding (GPT-2's key bias) stays put,
    # where Adam would scale the rounding up to a full step
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


def _trains_as_on_one_device(name):
    make, layout_map_of = MODELS[name]
    keras.utils.set_random_seed(0)
    ref = _compiled(make)
    device_mesh = kd.DeviceMesh((2, 4), ("batch", "model"), devices=kd.list_devices())
    distribution = kd.ModelParallel(layout_map=layout_map_of(device_mesh),
                                    batch_dim_name="batch")
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, VOCAB, (N, SEQ)).astype(np.int32),
         "padding_mask": np.ones((N, SEQ), np.int32)}
    y = rng.integers(0, VOCAB, (N, SEQ)).astype(np.int32)
    with distribution.scope():
        model = _compiled(make)
        model.set_weights(ref.get_weights())
        got = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    want = ref.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    _close(got.history["loss"], want.history["loss"], "losses")
    for a, b in zip(ref.variables, model.variables):
        if name == "gpt2" and b.path.endswith("key/bias"):
            # without rotary embeddings its exact gradient is zero (softmax ignores a
            # shift shared by all keys): both runs hold rounding noise around zero
            assert np.abs(b.numpy()).max() < 1e-5 and np.abs(a.numpy()).max() < 1e-5
            continue
        _close(b.numpy(), a.numpy(), b.path)
    split = [v.path for v in model.backbone.variables
             if "model" in (gt.keras.layout_of(v) or ())]
    assert split, "the layout map split no variable over 'model'"
    return model


def test_gemma_with_one_kv_head_trains_under_its_layout_map():
    with pytest.warns(UserWarning, match=r"key/kernel' dim 0 of size 1 over \('model',\) "
                                         r"\(4 devices\): kept whole"):
        model = _trains_as_on_one_device("gemma")
    query = model.backbone.get_layer("decoder_block_0").attention.query_dense.kernel
    assert gt.keras.layout_of(query) == gt.P("model", "batch")


@pytest.mark.long
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen", "qwen_moe", "qwen3_moe"])
def test_keras_hub_model_trains_under_its_layout_map(name):
    _trains_as_on_one_device(name)
