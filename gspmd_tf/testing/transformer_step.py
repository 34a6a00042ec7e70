"""An L-layer Transformer training step with Adam, as a pure function of its state, and
its hand shardings: shared by tests/test_auto_sharding.py and benchmarks/auto_sharding.py.

step(x, *weights, *m, *v) -> (*weights, *m, *v) after one Adam update. Per layer a
pre-norm self-attention block (Q, K, V projections as [M, N, K] einsums, softmax over
keys, O as [N, K, M]) and a ReLU feed-forward block, both residual; loss mean(x^2).
Each layer's ops are in a name scope (`layer3/attention/query`), as Keras and Lingvo
name them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from gspmd_tf.mesh import PartitionSpec

# weight name -> (shape of (M, N, K, H), Megatron spec: Q, K, V and the first FFN weight
# split over "model" on their output dims (heads, d_ff), O and the second FFN weight on
# their input dims, layer-norm scales replicated)
WEIGHTS = {
    "attention/norm": (lambda m, n, k, h: (m,), ()),
    "attention/query": (lambda m, n, k, h: (m, n, k), (None, "model")),
    "attention/key": (lambda m, n, k, h: (m, n, k), (None, "model")),
    "attention/value": (lambda m, n, k, h: (m, n, k), (None, "model")),
    "attention/output": (lambda m, n, k, h: (n, k, m), ("model",)),
    "mlp/norm": (lambda m, n, k, h: (m,), ()),
    "mlp/up": (lambda m, n, k, h: (m, h), (None, "model")),
    "mlp/down": (lambda m, n, k, h: (h, m), ("model",)),
}


@dataclass(frozen=True)
class Config:
    """Layers, model dim M, heads N, feed-forward dim H, sequence S, global batch B."""

    layers: int
    d_model: int
    heads: int
    d_ff: int
    seq: int
    batch: int

    def names(self) -> list:
        """The weight names, layer by layer."""
        return [f"layer{l}/{w}" for l in range(self.layers) for w in WEIGHTS]

    def shapes(self) -> list:
        """The global shape of every weight (and of its m and v), in names() order."""
        m, n, h = self.d_model, self.heads, self.d_ff
        return [WEIGHTS[name.split("/", 1)[1]][0](m, n, m // n, h) for name in self.names()]

    def specs(self) -> list:
        """tf.TensorSpecs of the step's arguments: x, the weights, m, v."""
        return [tf.TensorSpec((self.batch, self.seq, self.d_model), tf.float32)] + [
            tf.TensorSpec(s, tf.float32) for s in self.shapes() * 3]

    def values(self, seed: int = 0) -> list:
        """Random arguments: x, small weights, zero m and v."""
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(self.batch, self.seq, self.d_model)).astype(np.float32)
        weights = [(rng.normal(size=s) * 0.1 + (len(s) == 1)).astype(np.float32)
                   for s in self.shapes()]
        zeros = [np.zeros(s, np.float32) for s in self.shapes()]
        return [x] + weights + zeros + zeros

    def in_shardings(self, plan: str, auto=None) -> tuple:
        """in_shardings of the step: x split over "data" on its batch, the state by
        `plan`: "data" (replicated), "megatron" (WEIGHTS' specs, m and v alike) or
        "auto" (every entry `auto`, gt.AUTO)."""
        if plan == "auto":
            state = [auto] * len(self.names())
        elif plan == "megatron":
            state = [PartitionSpec(*WEIGHTS[n.split("/", 1)[1]][1]) for n in self.names()]
        else:
            state = [PartitionSpec()] * len(self.names())
        return (PartitionSpec("data"),) + tuple(state) * 3


def layer_norm(x, scale):
    mean = tf.reduce_mean(x, -1, keepdims=True)
    var = tf.reduce_mean(tf.square(x - mean), -1, keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-5) * scale


def make_step(config: Config):
    """The training step of `config` (see the module doc)."""
    names = config.names()
    count = len(names)

    def forward(x, w):
        for l in range(config.layers):
            p = {name: w[f"layer{l}/{name}"] for name in WEIGHTS}
            with tf.name_scope(f"layer{l}"):
                with tf.name_scope("attention"):
                    h = layer_norm(x, p["attention/norm"])
                    q, k, v = (tf.einsum("bsm,mnk->bsnk", h, p[f"attention/{n}"], name=n)
                               for n in ("query", "key", "value"))
                    scores = tf.einsum("bqnk,bsnk->bnqs", q, k, name="scores")
                    probs = tf.nn.softmax(scores / float(q.shape[-1]) ** 0.5)
                    context = tf.einsum("bnqs,bsnk->bqnk", probs, v, name="context")
                    x = x + tf.einsum("bqnk,nkm->bqm", context, p["attention/output"],
                                      name="output")
                with tf.name_scope("mlp"):
                    h = layer_norm(x, p["mlp/norm"])
                    hidden = tf.nn.relu(tf.einsum("bsm,mh->bsh", h, p["mlp/up"], name="up"))
                    x = x + tf.einsum("bsh,hm->bsm", hidden, p["mlp/down"], name="down")
        return tf.reduce_mean(tf.square(x))

    def step(x, *state):
        weights, ms, vs = state[:count], state[count:2 * count], state[2 * count:]
        with tf.GradientTape() as tape:
            tape.watch(weights)
            loss = forward(x, dict(zip(names, weights)))
        grads = tape.gradient(loss, weights)
        out_w, out_m, out_v = [], [], []
        with tf.name_scope("adam"):
            for w, m, v, g in zip(weights, ms, vs, grads):
                m = 0.9 * m + 0.1 * g
                v = 0.999 * v + 0.001 * tf.square(g)
                out_w.append(w - 0.001 * m / (tf.sqrt(v) + 1e-7))
                out_m.append(m)
                out_v.append(v)
        return out_w + out_m + out_v

    return step
