"""Context parallelism: attention over a sequence split across devices, as one SPMD program.

    out = gt.ring_attention(q, k, v, mesh=mesh, axis="seq", causal=True)
    out = gt.ulysses_attention(q, k, v, mesh=mesh, axis="seq")

q, k, v and out are [batch, seq, heads, head_dim], seq split over mesh axis `axis` (n
devices). Both are plain TF code with annotations, so they run inside a gt.function
(and on one device without a mesh-aware caller: the values are single-device TF's).

ring_attention (Ring Attention, Liu et al. 2023; blockwise attention with an online
softmax, Rabe & Staats / FlashAttention): the sequence is viewed as n blocks [b, n,
seq/n, ...] with the block dim split over `axis`, so each device holds one block of
queries, keys and values. n steps: every device attends its queries to the K/V block
it holds, folds the result into running (max, denominator, numerator) statistics, then
the K/V blocks move one device on (tf.roll of the block dim: a collective-permute each).
Nothing is all-gathered; a device holds two K/V blocks at most, not the sequence. With
causal=True a key block after the query block contributes nothing (its weights are
exactly zero; the SPMD step still computes it: the devices run in lockstep), the block
on the diagonal is masked triangularly. Gradients are TF's through the loop: the
backward is the ring turning the other way.

ulysses_attention (DeepSpeed-Ulysses): an all-to-all moves the split from seq to heads,
each device runs exact attention for its heads over the whole sequence, and an
all-to-all moves the split back; heads must divide over the axis.
"""

from __future__ import annotations

import math

import tensorflow as tf

from gspmd_tf.annotations import mesh_split
from gspmd_tf.errors import ShardingError
from gspmd_tf.mesh import P

# a finite "minus infinity" for masked logits: exp of it minus any real max is 0, and
# no inf - inf can make a NaN in the online softmax or its gradient
_MASKED = -1e30


def dot_product_attention(q, k, v, causal=False):
    """softmax(q k^T / sqrt(head_dim)) v on [batch, seq, heads, head_dim] (one device)."""
    logits = tf.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[1]
        logits = tf.where(tf.range(seq)[:, None] >= tf.range(seq)[None, :], logits,
                          _MASKED)
    return tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(logits, -1), v)


def ring_attention(q, k, v, *, mesh, axis, causal=False, batch_axis=None, heads_axis=None):
    """Attention of q over k, v with seq split over mesh axis `axis`, K/V passed round the
    ring of its devices (module docstring). Equal to dot_product_attention(q, k, v,
    causal); q, k, v: [batch, seq, heads, head_dim], seq a multiple of the axis size;
    batch_axis, heads_axis: mesh axes (or None) that split the batch and heads too (data
    and model parallelism). Returns [batch, seq, heads, head_dim], split like q."""
    q, k, v = (tf.convert_to_tensor(t) for t in (q, k, v))
    devices = _check(q, k, v, mesh, axis, "ring_attention")
    batch, seq, heads, head_dim = q.shape
    block = seq // devices

    by_sequence = P(batch_axis, axis, heads_axis)
    by_block = P(batch_axis, axis, None, heads_axis)

    def blocks(t):  # [b, n, seq/n, h, d], the block dim split: each device its block
        return mesh_split(tf.reshape(mesh_split(t, mesh, by_sequence),
                                     [batch, devices, block, heads, head_dim]),
                          mesh, by_block)
    q, k, v = blocks(q) / math.sqrt(head_dim), blocks(k), blocks(v)
    query_position = tf.reshape(tf.range(seq), [devices, block])

    def step(i, k, v, running_max, denominator, numerator):
        logits = tf.einsum("bnqhd,bnkhd->bnhqk", q, k)
        if causal:
            # block j holds K/V block (j - i) mod n after i steps
            key_block = (tf.range(devices) - i) % devices
            key_position = key_block[:, None] * block + tf.range(block)[None, :]
            visible = query_position[:, :, None] >= key_position[:, None, :]  # [n, q, k]
            # step 0 is the diagonal block: every row has seen a key before a later step
            # masks a whole row, so a masked weight is exp(_MASKED - a real max) = 0
            logits = tf.where(visible[None, :, None], logits, _MASKED)
        # the result does not depend on the max (it cancels): no gradient through it
        new_max = tf.stop_gradient(tf.maximum(running_max, tf.reduce_max(logits, -1)))
        rescale = tf.exp(running_max - new_max)
        weights = tf.exp(logits - new_max[..., None])
        denominator = denominator * rescale + tf.reduce_sum(weights, -1)
        numerator = (numerator * rescale[..., None] +
                     tf.einsum("bnhqk,bnkhd->bnhqd", weights, v))
        k, v = (mesh_split(tf.roll(t, 1, axis=1), mesh, by_block) for t in (k, v))
        return i + 1, k, v, new_max, denominator, numerator

    statistics = [batch, devices, heads, block]
    _, _, _, _, denominator, numerator = tf.while_loop(
        lambda i, *_: i < devices, step,
        (tf.constant(0), k, v, tf.fill(statistics, tf.constant(_MASKED, q.dtype)),
         tf.zeros(statistics, q.dtype), tf.zeros(statistics + [head_dim], q.dtype)),
        maximum_iterations=devices)
    out = tf.transpose(numerator / denominator[..., None], [0, 1, 3, 2, 4])
    return mesh_split(tf.reshape(out, [batch, seq, heads, head_dim]), mesh, by_sequence)


def ulysses_attention(q, k, v, *, mesh, axis, causal=False, batch_axis=None):
    """Attention with seq split over `axis`, computed head-split (DeepSpeed-Ulysses):
    all-to-alls move q, k, v from seq-split to heads-split, each device attends its heads
    over the whole sequence, an all-to-all moves the result back to seq-split. Equal to
    dot_product_attention(q, k, v, causal); heads a multiple of the axis size;
    batch_axis: a mesh axis (or None) splitting the batch too."""
    q, k, v = (tf.convert_to_tensor(t) for t in (q, k, v))
    devices = _check(q, k, v, mesh, axis, "ulysses_attention")
    if q.shape[2] % devices:
        raise ShardingError(f"ulysses_attention: {q.shape[2]} heads do not divide over "
                            f"the {devices} devices of axis {axis!r}; use ring_attention "
                            "or a multiple of the axis size")
    by_sequence, by_heads = P(batch_axis, axis), P(batch_axis, None, axis)

    def to_heads(t):
        return mesh_split(mesh_split(t, mesh, by_sequence), mesh, by_heads)
    out = dot_product_attention(to_heads(q), to_heads(k), to_heads(v), causal)
    return mesh_split(mesh_split(out, mesh, by_heads), mesh, by_sequence)


def _check(q, k, v, mesh, axis, what):
    """The axis size, after checking q, k, v are [batch, seq, heads, head_dim] alike with
    seq dividing over it (a ShardingError naming what to change otherwise)."""
    if not (q.shape.is_fully_defined() and q.shape.rank == 4 and q.shape == k.shape
            and q.shape == v.shape):
        raise ShardingError(f"{what}: q, k, v must be [batch, seq, heads, head_dim] of one "
                            f"static shape; got {q.shape}, {k.shape}, {v.shape}")
    devices = mesh.axis_size(axis)
    if q.shape[1] % devices:
        raise ShardingError(f"{what}: a sequence of {q.shape[1]} does not divide over the "
                            f"{devices} devices of axis {axis!r}; pad it to a multiple "
                            f"of {devices}")
    return devices
