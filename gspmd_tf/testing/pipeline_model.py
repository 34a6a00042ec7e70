"""A small Transformer stack for gt.pipeline: one block per stage, weights stacked on a
leading stage dim, plain single-device TF code. Shared by tests/test_pipeline.py and
benchmarks/pipeline_bubble.py.

Token embedding (tied with the output projection) runs outside the pipeline; the S
blocks run as S pipeline stages over M microbatches; the loss is next-token
cross-entropy. Shardings on a (stage, data, model) mesh: block weights split over
"stage" on their stage dim and Megatron-style over "model" (heads of the attention
projections, the hidden dim of the MLP), microbatches over "data".
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import gspmd_tf as gt

P = gt.P

# per-stage weight specs (leading stage dim); the embedding is replicated
STAGE_SPECS = {"wq": P("stage", None, "model"), "wk": P("stage", None, "model"),
               "wv": P("stage", None, "model"), "wo": P("stage", "model"),
               "w1": P("stage", None, "model"), "w2": P("stage", "model")}
NAMES = ["embed"] + list(STAGE_SPECS)
SPECS = dict(STAGE_SPECS, embed=P())


def init_params(rng, stages=4, vocab=16, d_model=8, heads=2, d_ff=16, scale=0.3):
    """Initial values by name: the embedding [vocab, d] and each block weight stacked
    [stages, ...]; attention projections [d, heads * head_dim] and [heads * head_dim, d]."""
    def n(*shape):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    return {"embed": n(vocab, d_model), "wq": n(stages, d_model, d_model),
            "wk": n(stages, d_model, d_model), "wv": n(stages, d_model, d_model),
            "wo": n(stages, d_model, d_model), "w1": n(stages, d_model, d_ff),
            "w2": n(stages, d_ff, d_model)}


def _layer_norm(x):
    mean = tf.reduce_mean(x, -1, keepdims=True)
    return (x - mean) * tf.math.rsqrt(tf.reduce_mean(tf.square(x - mean), -1,
                                                     keepdims=True) + 1e-5)


def block(w, x, heads=2):
    """One pre-norm Transformer block (causal attention, ReLU MLP) on x [b, t, d]."""
    b, t, d = x.shape
    h = _layer_norm(x)

    def split(y):
        return tf.reshape(y, [b, t, heads, d // heads])
    q, k, v = (split(tf.einsum("btd,de->bte", h, w[n])) for n in ("wq", "wk", "wv"))
    logits = tf.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    probs = tf.nn.softmax(logits + np.triu(np.full((t, t), -1e9, np.float32), 1))
    attended = tf.reshape(tf.einsum("bhqk,bkhd->bqhd", probs, v), [b, t, d])
    x = x + tf.einsum("btd,de->bte", attended, w["wo"])
    h = _layer_norm(x)
    return x + tf.einsum("btf,fd->btd", tf.nn.relu(tf.einsum("btd,df->btf", h, w["w1"])),
                         w["w2"])


def sequential(stage_params, microbatches, stage_fn=None):
    """The unpipelined model: every microbatch through the S stages in order, each
    `stage_fn(params of one stage, x)` (default: this module's Transformer block)."""
    stage_fn = stage_fn or block
    stages = tf.nest.flatten(stage_params)[0].shape[0]
    outputs = []
    for m in range(microbatches.shape[0]):
        x = microbatches[m]
        for s in range(stages):
            x = stage_fn(tf.nest.map_structure(lambda p: p[s], stage_params), x)
        outputs.append(x)
    return tf.stack(outputs)


def unpipelined_value_and_grad(stage_fn, loss_fn, stage_params, microbatches, targets):
    """What gt.pipeline_value_and_grad computes, without a pipeline: the mean over the
    microbatches of loss_fn(`sequential` output m, targets[m]) and its gradients of
    `stage_params` (a nest like it; the layers in model order)."""
    leaves = tf.nest.flatten(stage_params)
    with tf.GradientTape() as tape:
        tape.watch(leaves)
        outputs = sequential(stage_params, microbatches, stage_fn)
        loss = tf.reduce_mean(tf.stack([loss_fn(outputs[m], targets[m])
                                        for m in range(outputs.shape[0])]))
    return loss, tf.nest.pack_sequence_as(stage_params, tape.gradient(loss, leaves))


def loss_fn(w, tokens, run_stages):
    """Next-token cross-entropy of tokens [M, b, t + 1]; `run_stages(stage_params,
    microbatches)` runs the blocks (gt.pipeline or `sequential`)."""
    inputs, targets = tokens[..., :-1], tokens[..., 1:]
    stage_params = {n: w[n] for n in STAGE_SPECS}
    x = run_stages(stage_params, tf.gather(w["embed"], inputs))
    logits = tf.einsum("mbtd,vd->mbtv", x, w["embed"])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))


def pipelined(mesh):
    """run_stages for loss_fn: gt.pipeline over the mesh's "stage" axis (microbatches
    split over "data")."""
    def run(stage_params, microbatches):
        return gt.pipeline(block, stage_params, microbatches, mesh=mesh,
                           microbatch_spec=P("data"))
    return run


def make_step(variables, run_stages, lr=0.2):
    """One SGD step on `variables` (name -> variable); returns the loss before it."""
    def step(tokens):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, tokens, run_stages)
        grads = tape.gradient(loss, [variables[n] for n in NAMES])
        for n, g in zip(NAMES, grads):
            variables[n].assign_sub(lr * g)
        return loss
    return step
