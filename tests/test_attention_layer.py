"""gt.context_parallel_attention: a Keras self-attention layer whose attention is the
ring (or Ulysses) over a seq-split mesh axis; under gt.keras.shard_model with the batch
split on seq, predict equals the layer's math on one device and the program moves K/V
by collective-permutes only."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import gspmd_tf as gt  # noqa: E402
from gspmd_tf.attention import dot_product_attention  # noqa: E402
from util import assert_close  # noqa: E402

keras = pytest.importorskip("keras")
P = gt.P
BATCH, SEQ, WIDTH, HEADS, KEY_DIM = 2, 16, 8, 4, 2


def _reference(layer, x):
    """The layer's projections and single-device causal attention."""
    q, k, v = (tf.reshape(x @ w.numpy(), [BATCH, SEQ, HEADS, KEY_DIM])
               for w in (layer.query, layer.key, layer.value))
    out = dot_product_attention(q, k, v, causal=True)
    return (tf.reshape(out, [BATCH, SEQ, -1]) @ layer.output_kernel.numpy()).numpy()


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_keras_model_predicts_as_one_device(method):
    mesh = gt.Mesh.create((4,), ("seq",))
    layer = gt.context_parallel_attention(mesh, "seq", num_heads=HEADS, key_dim=KEY_DIM,
                                          causal=True, method=method)
    model = keras.Sequential([keras.Input((SEQ, WIDTH), batch_size=BATCH), layer])
    x = np.random.default_rng(0).standard_normal((BATCH, SEQ, WIDTH)).astype(np.float32)
    want = _reference(layer, x)
    gt.keras.shard_model(model, mesh, batch_spec=P(None, "seq"))
    assert_close(model.predict(x, batch_size=BATCH, verbose=0), want, "output")
    kinds = {c.kind for c in gt.keras.lowered(model, "predict", x).collectives()}
    assert ("collective-permute" if method == "ring" else "all-to-all") in kinds
    assert "all-gather" not in kinds
