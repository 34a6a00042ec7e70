"""Optimizer helpers for SPMD training steps: an Adam update in plain TF ops (so
gspmd-tf partitions it like the model) and the sharding of a weight's optimizer state
(weight-update sharding, GSPMD paper section 3.3). Used by gspmd_tf.demo and the tests'
training steps."""

from __future__ import annotations

import tensorflow as tf

from gspmd_tf.mesh import PartitionSpec


def adam_update(variables, slots, grads, step, lr=0.01):
    """Adam on `variables` (tf or gt Variables): slots[i] = (m, v); `step` the 1-based
    step count tensor. Plain TF ops, so it partitions like the model."""
    for var, (m, v), g in zip(variables, slots, grads):
        m.assign(0.9 * m + 0.1 * g)
        v.assign(0.999 * v + 0.001 * tf.square(g))
        m_hat = m / (1.0 - tf.pow(0.9, step))
        v_hat = v / (1.0 - tf.pow(0.999, step))
        var.assign_sub(lr * m_hat / (tf.sqrt(v_hat) + 1e-7))


def slot_spec(spec, shape, mesh, axis="data"):
    """Weight-update sharding (GSPMD paper, section 3.3): the optimizer state of a
    weight is further split over the data-parallel `axis`, on its first dim that still
    divides."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    axes = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
    for d in sorted(range(len(shape)), key=lambda d: bool(axes[d])):  # unsplit dims first
        if shape[d] % (mesh.axes_size(axes[d]) * mesh.axis_size(axis)) == 0:
            axes[d] = axes[d] + (axis,)
            return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else a
                                   for a in axes])
    return spec
