"""A small Transformer language model written as plain single-device TF code, and its
training steps (SGD, Adam), shared by the training tests."""

import numpy as np
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.optimizer import adam_update

P = gt.P


def init_params(rng, vocab=16, d_model=8, heads=2, d_ff=16):
    """Global initial values, by name."""
    def n(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    return {"embed": n(vocab, d_model), "wq": n(d_model, d_model), "wk": n(d_model, d_model),
            "wv": n(d_model, d_model), "wo": n(d_model, d_model), "w1": n(d_model, d_ff),
            "b1": np.zeros(d_ff, np.float32), "w2": n(d_ff, d_model),
            "gamma": np.ones(d_model, np.float32), "beta": np.zeros(d_model, np.float32),
            "heads": heads}


SPECS = {"embed": P("model"), "wq": P(None, "model"), "wk": P(None, "model"),
         "wv": P(None, "model"), "wo": P("model"), "w1": P(None, "model"), "b1": P("model"),
         "w2": P("model"), "gamma": P(), "beta": P()}
NAMES = list(SPECS)


def layer_norm(x, gamma, beta):
    mean = tf.reduce_mean(x, -1, keepdims=True)
    var = tf.reduce_mean(tf.square(x - mean), -1, keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-5) * gamma + beta


def loss_fn(w, heads, tokens):
    """Next-token cross-entropy of a one-block Transformer; w maps names to tensors."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, s = inputs.shape
    d = w["embed"].shape[1]
    x = tf.gather(w["embed"], inputs)
    h = layer_norm(x, w["gamma"], w["beta"])

    def split(t):
        return tf.reshape(t, [b, s, heads, d // heads])
    q, k, v = (split(tf.einsum("bsd,de->bse", h, w[n])) for n in ("wq", "wk", "wv"))
    logits = tf.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    causal = np.triu(np.full((s, s), -1e9, np.float32), 1)
    probs = tf.nn.softmax(logits + causal)
    ctx = tf.reshape(tf.einsum("bhqk,bkhd->bqhd", probs, v), [b, s, d])
    x = x + tf.einsum("bsd,de->bse", ctx, w["wo"])
    h = layer_norm(x, w["gamma"], w["beta"])
    x = x + tf.einsum("bsf,fd->bsd", tf.nn.relu(tf.einsum("bsd,df->bsf", h, w["w1"]) + w["b1"]),
                      w["w2"])
    logits = tf.einsum("bsd,vd->bsv", x, w["embed"])
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits)
    return tf.reduce_mean(xent)


def make_step(variables, slots, heads, optimizer, lr=0.1):
    """One training step over `variables` (name -> tf/gt Variable); Adam keeps its
    moments in `slots` (name -> (m, v)) and its step count in slots["t"]."""
    def step(tokens):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, heads, tokens)
        grads = tape.gradient(loss, [variables[n] for n in NAMES])
        if optimizer == "sgd":
            for n, g in zip(NAMES, grads):
                variables[n].assign_sub(lr * g)
        else:
            adam_update([variables[n] for n in NAMES], [slots[n] for n in NAMES], grads,
                        slots["t"].assign_add(1.0))
        return loss
    return step
