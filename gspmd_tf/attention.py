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
causal=True in the contiguous layout a key block after the query block contributes
nothing (its weights are exactly zero; the SPMD step still computes it: the devices run
in lockstep); the zigzag layout balances the causal work so that no step computes a
masked block but the first (ring.py). The backward is a second ring (its own
gradient, FlashAttention's): each step recomputes the weights of the key block a device
holds from the rows' saved log-sum-exp, adds to the query gradient, and adds to the
K/V gradients that travel round with their blocks; no step's weights are kept.

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
from gspmd_tf.ring import MASKED, Ring, ring_backward, ring_forward


def dot_product_attention(q, k, v, causal=False):
    """softmax(q k^T / sqrt(head_dim)) v on [batch, seq, heads, head_dim] (one device)."""
    logits = tf.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[1]
        logits = tf.where(tf.range(seq)[:, None] >= tf.range(seq)[None, :], logits,
                          MASKED)
    return tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(logits, -1), v)


def ring_attention(q, k, v, *, mesh, axis, causal=False, layout="contiguous",
                   batch_axis=None, heads_axis=None):
    """Attention of q over k, v with seq split over mesh axis `axis`, K/V passed round the
    ring of its devices (module docstring). Equal to dot_product_attention(q, k, v,
    causal); q, k, v: [batch, seq, heads, head_dim], seq a multiple of the axis size.

    layout="zigzag" (causal only; seq a multiple of twice the axis size): the sequence
    is held in zigzag order, device j holding chunks j and 2n-1-j of 2n
    (zigzag_order(seq, n) gives the positions in that order: put the tokens in it once,
    e.g. when loading data), so every device has equal causal work and no step after
    the first attends a masked block. q, k, v, the result and the causal mask are then
    in that order: the result equals dot_product_attention(q, k, v, causal) of the
    sequence in its own order, reordered the same way.

    batch_axis, heads_axis: mesh axes (or None) that split the batch and heads too (data
    and model parallelism). Returns [batch, seq, heads, head_dim], split like q."""
    q, k, v = (tf.convert_to_tensor(t) for t in (q, k, v))
    devices = _check(q, k, v, mesh, axis, "ring_attention")
    if layout not in ("contiguous", "zigzag"):
        raise ShardingError(f"ring_attention: layout {layout!r} is neither 'contiguous' "
                            "nor 'zigzag'")
    chunks = 2 if causal and layout == "zigzag" else 1
    batch, seq, heads, head_dim = q.shape
    if seq % (devices * chunks):
        raise ShardingError(f"ring_attention: the zigzag layout cuts the sequence into "
                            f"{2 * devices} chunks; {seq} is no multiple of {2 * devices}")
    by_sequence = P(batch_axis, axis, heads_axis)
    ring = Ring(mesh, P(batch_axis, axis, None, None, heads_axis), devices, chunks,
                seq // (devices * chunks), causal, 1 / math.sqrt(head_dim))
    block_shape = [batch, devices, chunks, ring.chunk, heads, head_dim]

    def blocks(t):  # [b, n, chunks, c, h, d], the device dim split: each its block
        return ring.split(tf.reshape(mesh_split(t, mesh, by_sequence), block_shape))

    @tf.custom_gradient
    def attend(q, k, v):
        out, logsumexp = ring_forward(ring, q, k, v)
        return out, lambda d_out: ring_backward(ring, q, k, v, out, logsumexp, d_out)
    out = attend(blocks(q), blocks(k), blocks(v))
    return mesh_split(tf.reshape(out, [batch, seq, heads, head_dim]), mesh, by_sequence)


def zigzag_order(seq, devices):
    """Sequence positions in the zigzag layout's order: device j's block holds chunk j,
    then chunk 2n-1-j, of 2n chunks (ring_attention(layout="zigzag")). Reorder tokens as
    `tf.gather(tokens, zigzag_order(seq, n), axis=1)`."""
    chunk = seq // (2 * devices)
    order = []
    for device in range(devices):
        for index in (device, 2 * devices - 1 - device):
            order.extend(range(index * chunk, (index + 1) * chunk))
    return order


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
