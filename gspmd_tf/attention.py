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
on the diagonal is masked triangularly. The backward is a second ring (its own
gradient, FlashAttention's): each step recomputes the weights of the key block a device
holds from the rows' saved log-sum-exp, adds to the query gradient, and adds to the
K/V gradients that travel round with their blocks; no step's weights are kept.

ulysses_attention (DeepSpeed-Ulysses): an all-to-all moves the split from seq to heads,
each device runs exact attention for its heads over the whole sequence, and an
all-to-all moves the split back; heads must divide over the axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    by_sequence = P(batch_axis, axis, heads_axis)
    ring = _Ring(mesh, P(batch_axis, axis, None, heads_axis), devices, seq // devices,
                 causal, 1 / math.sqrt(head_dim))

    def blocks(t):  # [b, n, seq/n, h, d], the block dim split: each device its block
        return ring.split(tf.reshape(mesh_split(t, mesh, by_sequence),
                                     [batch, devices, seq // devices, heads, head_dim]))
    out = _ring_attention_blocks(ring, blocks(q), blocks(k), blocks(v))
    return mesh_split(tf.reshape(out, [batch, seq, heads, head_dim]), mesh, by_sequence)


@dataclass(frozen=True)
class _Ring:
    """What the ring's steps share: the block layout [b, n, seq/n, h, d] (`spec`, block
    dim split), n, seq/n, causal, the logit scale."""

    mesh: object
    spec: P
    devices: int
    block: int
    causal: bool
    scale: float

    def split(self, t):
        """`t` annotated with the block layout."""
        return mesh_split(t, self.mesh, self.spec)

    def shift(self, t):
        """Every device's block to the next device (one collective-permute)."""
        return self.split(tf.roll(t, 1, axis=1))

    def logits(self, q, k, step):
        """[b, n, h, q, k]: each query block's scaled logits against the key block it
        holds at `step` (block j holds key block (j - step) mod n), causally masked."""
        logits = tf.einsum("bnqhd,bnkhd->bnhqk", q, k) * self.scale
        if not self.causal:
            return logits
        query_position = tf.reshape(tf.range(self.devices * self.block),
                                    [self.devices, self.block])
        key_block = (tf.range(self.devices) - step) % self.devices
        key_position = key_block[:, None] * self.block + tf.range(self.block)[None, :]
        visible = query_position[:, :, None] >= key_position[:, None, :]      # [n, q, k]
        # step 0 is the diagonal block: every row has seen a key before a later step
        # masks a whole row, so a masked weight is exp(_MASKED - a real max) = 0
        return tf.where(visible[None, :, None], logits, _MASKED)


def _ring_attention_blocks(ring, q, k, v):
    """Attention on [b, n, seq/n, h, d] blocks with its own backward: the forward keeps
    only its output and each row's log-sum-exp, the backward turns the ring again and
    recomputes each block's weights (as FlashAttention does), so neither keeps more than
    one [seq/n, seq/n] block of weights per head."""
    @tf.custom_gradient
    def attend(q, k, v):
        out, logsumexp = _ring_forward(ring, q, k, v)
        return out, lambda d_out: _ring_backward(ring, q, k, v, out, logsumexp, d_out)
    return attend(q, k, v)


def _ring_forward(ring, q, k, v):
    """(out [b, n, q, h, d], log-sum-exp of each row's logits [b, n, h, q]): n steps of
    blockwise attention with online-softmax statistics, K/V shifting each step."""
    def step(i, k, v, running_max, denominator, numerator):
        logits = ring.logits(q, k, i)
        new_max = tf.maximum(running_max, tf.reduce_max(logits, -1))
        rescale = tf.exp(running_max - new_max)
        weights = tf.exp(logits - new_max[..., None])
        denominator = denominator * rescale + tf.reduce_sum(weights, -1)
        numerator = (numerator * rescale[..., None] +
                     tf.einsum("bnhqk,bnkhd->bnhqd", weights, v))
        return i + 1, ring.shift(k), ring.shift(v), new_max, denominator, numerator

    batch, _, _, heads, head_dim = q.shape
    statistics = [batch, ring.devices, heads, ring.block]
    _, _, _, running_max, denominator, numerator = tf.while_loop(
        lambda i, *_: i < ring.devices, step,
        (tf.constant(0), k, v, tf.fill(statistics, tf.constant(_MASKED, q.dtype)),
         tf.zeros(statistics, q.dtype), tf.zeros(statistics + [head_dim], q.dtype)),
        maximum_iterations=ring.devices)
    out = ring.split(tf.transpose(numerator / denominator[..., None], [0, 1, 3, 2, 4]))
    return out, running_max + tf.math.log(denominator)


def _ring_backward(ring, q, k, v, out, logsumexp, d_out):
    """Gradients of q, k, v blocks: the ring again, each step recomputing the weights
    of the key block it holds from the saved log-sum-exp; each K/V block's gradient
    travels with it and is home after n shifts."""
    # d softmax: rowsum(d_out * out), the weights' share of each row's gradient
    row_term = tf.transpose(tf.reduce_sum(d_out * out, -1), [0, 1, 3, 2])     # [b,n,h,q]

    def step(i, k, v, d_k, d_v, d_q):
        weights = tf.exp(ring.logits(q, k, i) - logsumexp[..., None])
        d_v += tf.einsum("bnhqk,bnqhd->bnkhd", weights, d_out)
        d_weights = tf.einsum("bnqhd,bnkhd->bnhqk", d_out, v)
        d_logits = weights * (d_weights - row_term[..., None]) * ring.scale
        d_q += tf.einsum("bnhqk,bnkhd->bnqhd", d_logits, k)
        d_k += tf.einsum("bnhqk,bnqhd->bnkhd", d_logits, q)
        return (i + 1, ring.shift(k), ring.shift(v), ring.shift(d_k), ring.shift(d_v),
                d_q)

    zeros = ring.split(tf.zeros_like(q))
    _, _, _, d_k, d_v, d_q = tf.while_loop(
        lambda i, *_: i < ring.devices, step, (tf.constant(0), k, v, zeros, zeros, zeros),
        maximum_iterations=ring.devices)
    return d_q, d_k, d_v


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
