"""A Keras 3 self-attention layer whose attention runs context-parallel: the sequence
split over a mesh axis, attention by gt.ring_attention or gt.ulysses_attention.

    layer = gt.context_parallel_attention(mesh, "seq", num_heads=4, key_dim=16,
                                          causal=True)
    model = keras.Sequential([keras.Input((seq, width)), layer, ...])
    gt.keras.shard_model(model, mesh, batch_spec=P(None, "seq"))   # x split on seq

The layer projects x [batch, seq, width] to queries, keys and values [batch, seq, heads,
key_dim] (kernels "query", "key", "value": [width, heads * key_dim]), attends, and
projects back ("output": [heads * key_dim, width]), as keras.layers.MultiHeadAttention
does for self-attention (without biases or dropout). Keras is imported when a layer is
made, never when gspmd_tf is.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from gspmd_tf.attention import ring_attention, ulysses_attention
from gspmd_tf.errors import ShardingError

_ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention}


def context_parallel_attention(mesh, axis, *, num_heads, key_dim, causal=False,
                               method="ring", layout="contiguous", name=None):
    """A Keras layer of self-attention over a sequence split over mesh axis `axis`
    (module docstring). method: "ring" (gt.ring_attention, with `layout`) or "ulysses"
    (gt.ulysses_attention)."""
    if method not in _ATTENTION:
        raise ShardingError(f"context_parallel_attention: method {method!r} is neither "
                            "'ring' nor 'ulysses'")
    options = {"layout": layout} if method == "ring" else {}
    attend = functools.partial(_ATTENTION[method], mesh=mesh, axis=axis, causal=causal,
                               **options)
    return _layer_class()(attend, num_heads, key_dim, name=name)


@functools.lru_cache(maxsize=None)
def _layer_class():
    """The Layer class, made once Keras is imported."""
    import keras

    class ContextParallelAttention(keras.layers.Layer):
        """Self-attention with projections; the attention is `attend(q, k, v)`."""

        def __init__(self, attend, num_heads, key_dim, **kwargs):
            super().__init__(**kwargs)
            self.attend, self.num_heads, self.key_dim = attend, num_heads, key_dim

        def build(self, input_shape):
            width, inner = input_shape[-1], self.num_heads * self.key_dim
            for kernel in ("query", "key", "value"):
                setattr(self, kernel, self.add_weight(name=kernel, shape=(width, inner)))
            self.output_kernel = self.add_weight(name="output", shape=(inner, width))

        def compute_output_shape(self, input_shape):
            # declared, so Keras never traces call() at an unknown batch size: the
            # context-parallel attention needs static shapes
            return input_shape

        def call(self, x):
            batch, seq, _ = x.shape
            heads = [tf.reshape(x @ kernel, [batch, seq, self.num_heads, self.key_dim])
                     for kernel in (self.query, self.key, self.value)]
            attended = self.attend(*heads)
            return tf.reshape(attended, [batch, seq, -1]) @ self.output_kernel

    return ContextParallelAttention
