"""Layout maps the Keras tests and benchmarks share for models that publish none."""


def gpt2_megatron_layout_map(device_mesh):
    """Megatron's split of keras_hub's GPT-2 as a keras.distribution.LayoutMap on
    `device_mesh` (axes "batch", "model"): attention heads and the MLP's inner dim over
    "model"; the rest replicated."""
    import keras
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*self_attention/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[".*self_attention/(query|key|value)/bias"] = ("model", None)
    layout_map[".*attention_output/kernel"] = ("model", None, None)
    layout_map[".*feedforward_intermediate_dense/kernel"] = (None, "model")
    layout_map[".*feedforward_output_dense/kernel"] = ("model", None)
    return layout_map
