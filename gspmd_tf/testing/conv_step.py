"""A small ResNet-like convolutional training step (plain SGD) as a pure function of its
weights, and its hand shardings: shared by tests/test_auto_sharding.py and
benchmarks/auto_sharding.py (--model=resnet).

step(images, *weights) -> weights after one SGD step. A 3x3 stem convolution (3 ->
width channels, ReLU), `blocks` residual blocks (two 3x3 convolutions, NHWC, SAME,
stride 1, ReLU, the input added back), a global mean over height and width and a dense
head to `classes` logits; loss mean(logits^2). Each block's ops are in a name scope
(`block2/conv1`), so the search clusters repeated blocks into one decision.

Plans on a (data, model) mesh: "data" (the batch split over "data", weights
replicated: data parallelism, which cannot use "model" when the batch is smaller than
the mesh), "spatial" (the images also split on their height over "model": the
activations' halos are exchanged, GSPMD's spatial partitioning) and "auto" (the images
split as data parallel's, every weight gt.AUTO).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from gspmd_tf.mesh import PartitionSpec

_LEARNING_RATE = 0.01


@dataclass(frozen=True)
class ConvConfig:
    """Residual blocks, channels (width), classes, image height = width, global batch."""

    blocks: int
    width: int
    classes: int
    image: int
    batch: int

    def names(self) -> list:
        """The weight names: the stem, each block's two filters, the head."""
        return ["stem"] + [f"block{b}/conv{k}" for b in range(self.blocks)
                           for k in (1, 2)] + ["head"]

    def shapes(self) -> list:
        """The global shape of every weight, in names() order."""
        w = self.width
        return [(3, 3, 3, w)] + [(3, 3, w, w)] * (2 * self.blocks) + [(w, self.classes)]

    def specs(self) -> list:
        """tf.TensorSpecs of the step's arguments: the images, then the weights."""
        return [tf.TensorSpec((self.batch, self.image, self.image, 3), tf.float32)] + [
            tf.TensorSpec(s, tf.float32) for s in self.shapes()]

    def values(self, seed: int = 0) -> list:
        """Random images and weights (He-scaled, so activations stay of order one)."""
        rng = np.random.default_rng(seed)
        images = rng.normal(size=(self.batch, self.image, self.image, 3))
        weights = [rng.normal(size=s) * np.sqrt(2.0 / np.prod(s[:-1])) for s in self.shapes()]
        return [a.astype(np.float32) for a in [images] + weights]

    def in_shardings(self, plan: str, auto=None) -> tuple:
        """in_shardings for `plan`: "data", "spatial" or "auto" (weights `auto`,
        gt.AUTO); see the module doc."""
        images = PartitionSpec("data", "model") if plan == "spatial" else PartitionSpec("data")
        weight = auto if plan == "auto" else PartitionSpec()
        return (images,) + (weight,) * len(self.names())


def _conv(x, w, name):
    return tf.nn.conv2d(x, w, strides=1, padding="SAME", name=name)


def make_conv_step(config: ConvConfig):
    """The training step of `config` (see the module doc)."""
    names = config.names()

    def forward(images, w):
        x = tf.nn.relu(_conv(images, w["stem"], "stem"))
        for b in range(config.blocks):
            with tf.name_scope(f"block{b}"):
                h = tf.nn.relu(_conv(x, w[f"block{b}/conv1"], "conv1"))
                x = tf.nn.relu(x + _conv(h, w[f"block{b}/conv2"], "conv2"))
        logits = tf.matmul(tf.reduce_mean(x, axis=(1, 2)), w["head"])
        return tf.reduce_mean(tf.square(logits))

    def step(images, *weights):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            loss = forward(images, dict(zip(names, weights)))
        return [w - _LEARNING_RATE * g for w, g in zip(weights, tape.gradient(loss, weights))]
    return step
