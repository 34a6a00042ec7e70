"""The ring of gt.ring_attention: blockwise attention, forward and backward, on a
sequence held as n device blocks of `chunks` chunks each ([b, n, chunks, c, h, d], the
device dim split over the mesh axis).

Every step, each device holds the K/V block of device (j - step) mod n and attends
some (query chunk, key chunk) pairs of its own and that block, folding each pair into
its query chunk's online-softmax statistics (max, denominator, numerator); then the K/V
blocks move one device on (a roll of the device dim: one collective-permute each).
Which pairs: `Ring.pairs(step)`. One chunk per device (the contiguous layout): the one
pair, causally masked where needed. Two chunks per device (the zigzag layout, device j
holding chunks j and 2n-1-j of the 2n): step 0 attends the three pairs of its own block
the causal mask leaves (not chunk j to the later chunk 2n-1-j); every later step
exactly the two pairs of the block that are visible (all queries to the earlier-held
chunk, or the later query chunk to both), so a causal ring computes no masked block
after the first step.

The backward (gt.ring_attention's own gradient, FlashAttention's) turns the ring again:
per pair it recomputes the weights from the rows' saved log-sum-exp, adds to the query
gradient, and to the K/V gradients, which travel with their blocks and are shifted home
after the last step.
"""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from gspmd_tf.annotations import mesh_split
from gspmd_tf.mesh import P

# a finite "minus infinity" for masked logits: exp of it minus any real max is 0, and
# no inf - inf can make a NaN in the online softmax or its gradient
MASKED = -1e30


@dataclass(frozen=True)
class Ring:
    """The layout and masking the ring's steps share. spec: the PartitionSpec of a block
    tensor [b, n, chunks, c, h, d] (its device dim split)."""

    mesh: object
    spec: P
    devices: int
    chunks: int
    chunk: int
    causal: bool
    scale: float

    def split(self, t):
        """`t` annotated with the block layout."""
        return mesh_split(t, self.mesh, self.spec)

    def shift(self, t):
        """Every device's block to the next device (one collective-permute)."""
        return self.split(tf.roll(t, 1, axis=1))

    def pairs(self, step):
        """[(query chunk, key chunk)] a device attends at `step` (module docstring):
        ints, or [n] int tensors when the chunk depends on the device."""
        if self.chunks == 1:
            return [(0, 0)]
        if isinstance(step, int) and step == 0:
            return [(0, 0), (1, 0), (1, 1)]
        # the K/V block came from an earlier device: all queries to its first chunk;
        # from a later one: the later query chunk to both of its chunks
        earlier = tf.cast(self._source(step) < tf.range(self.devices), tf.int32)
        both = 1 - earlier
        return [(1, 0), (both, both)]

    def logits(self, q, k, step, query_chunk, key_chunk):
        """[b, n, h, c, c]: scaled logits of the pair, causally masked."""
        logits = tf.einsum("bnqhd,bnkhd->bnhqk", q, k) * self.scale
        if not self.causal:
            return logits
        device = tf.range(self.devices)
        rows = tf.range(self.chunk)
        queries = self._position(device, query_chunk)[:, None] + rows[None, :]
        keys = self._position(self._source(step), key_chunk)[:, None] + rows[None, :]
        visible = queries[:, :, None] >= keys[:, None, :]                      # [n, q, k]
        return tf.where(visible[None, :, None], logits, MASKED)

    def _source(self, step):
        """[n]: the device whose K/V block each device holds at `step`."""
        return (tf.range(self.devices) - step) % self.devices

    def _position(self, device, chunk):
        """[n]: the sequence position of `chunk` of each `device`'s block."""
        if self.chunks == 1:
            return device * self.chunk
        index = tf.where(tf.equal(chunk, 0), device, 2 * self.devices - 1 - device)
        return index * self.chunk


def pick(t, chunk, chunks):
    """t [b, n, chunks, ...] at `chunk` (an int, or [n] per device): [b, n, ...]."""
    if isinstance(chunk, int):
        return t[:, :, chunk]
    weights = tf.reshape(tf.one_hot(chunk, chunks, dtype=t.dtype),
                         [1, -1, chunks] + [1] * (t.shape.rank - 3))
    return tf.reduce_sum(t * weights, axis=2)


def _placed(value, chunk, chunks, like):
    """(mask, value) to put `value` [b, n, ...] at `chunk` of a [b, n, chunks, ...]."""
    if isinstance(chunk, int):
        mask = tf.reshape(tf.one_hot(chunk, chunks, on_value=True, off_value=False),
                          [1, 1, chunks] + [1] * (like.shape.rank - 3))
    else:
        mask = tf.reshape(tf.one_hot(chunk, chunks, on_value=True, off_value=False),
                          [1, -1, chunks] + [1] * (like.shape.rank - 3))
    return mask, value[:, :, tf.newaxis]


def put(t, chunk, chunks, value):
    """t with `chunk` replaced by `value`."""
    mask, value = _placed(value, chunk, chunks, t)
    return tf.where(mask, value, t)


def add(t, chunk, chunks, value):
    """t with `value` added at `chunk`."""
    mask, value = _placed(value, chunk, chunks, t)
    return t + tf.where(mask, value, tf.zeros_like(value))


def ring_forward(ring, q, k, v):
    """(out [b, n, chunks, c, h, d], log-sum-exp of each row [b, n, chunks, h, c])."""
    def fold(step, k, v, statistics):
        running_max, denominator, numerator = statistics
        for query_chunk, key_chunk in ring.pairs(step):
            logits = ring.logits(pick(q, query_chunk, ring.chunks),
                                 pick(k, key_chunk, ring.chunks), step, query_chunk,
                                 key_chunk)
            old_max = pick(running_max, query_chunk, ring.chunks)
            new_max = tf.maximum(old_max, tf.reduce_max(logits, -1))
            rescale = tf.exp(old_max - new_max)
            weights = tf.exp(logits - new_max[..., None])
            attended = tf.einsum("bnhqk,bnkhd->bnhqd", weights,
                                 pick(v, key_chunk, ring.chunks))
            denominator = put(denominator, query_chunk, ring.chunks,
                              pick(denominator, query_chunk, ring.chunks) * rescale +
                              tf.reduce_sum(weights, -1))
            numerator = put(numerator, query_chunk, ring.chunks,
                            pick(numerator, query_chunk, ring.chunks) *
                            rescale[..., None] + attended)
            running_max = put(running_max, query_chunk, ring.chunks, new_max)
        return running_max, denominator, numerator

    batch, _, chunks, chunk, heads, head_dim = q.shape
    shape = [batch, ring.devices, chunks, heads, chunk]
    # step 0 (each device's own block, where a causal row first sees a key) before the
    # loop, the other n - 1 steps in it: every row's max is real before a later step
    # masks a whole row, so a masked weight is exp(MASKED - a real max) = 0
    statistics = fold(0, k, v, (tf.fill(shape, tf.constant(MASKED, q.dtype)),
                                tf.zeros(shape, q.dtype),
                                tf.zeros(shape + [head_dim], q.dtype)))

    def step(i, k, v, *statistics):
        k, v = ring.shift(k), ring.shift(v)
        return (i + 1, k, v) + fold(i, k, v, statistics)

    *_, running_max, denominator, numerator = tf.while_loop(
        lambda i, *_: i < ring.devices, step, (tf.constant(1), k, v) + statistics,
        maximum_iterations=ring.devices - 1)
    out = tf.transpose(numerator / denominator[..., None], [0, 1, 2, 4, 3, 5])
    return ring.split(out), running_max + tf.math.log(denominator)


def ring_backward(ring, q, k, v, out, logsumexp, d_out):
    """Gradients of the q, k, v blocks (module docstring)."""
    # d softmax: rowsum(d_out * out), the weights' share of each row's gradient
    row_term = tf.transpose(tf.reduce_sum(d_out * out, -1), [0, 1, 2, 4, 3])

    def fold(step, k, v, d_k, d_v, d_q):
        for query_chunk, key_chunk in ring.pairs(step):
            queries = pick(q, query_chunk, ring.chunks)
            keys = pick(k, key_chunk, ring.chunks)
            d_attended = pick(d_out, query_chunk, ring.chunks)
            weights = tf.exp(ring.logits(queries, keys, step, query_chunk, key_chunk) -
                             pick(logsumexp, query_chunk, ring.chunks)[..., None])
            d_v = add(d_v, key_chunk, ring.chunks,
                      tf.einsum("bnhqk,bnqhd->bnkhd", weights, d_attended))
            d_weights = tf.einsum("bnqhd,bnkhd->bnhqk", d_attended,
                                  pick(v, key_chunk, ring.chunks))
            d_logits = weights * (d_weights - pick(row_term, query_chunk,
                                                   ring.chunks)[..., None]) * ring.scale
            d_q = add(d_q, query_chunk, ring.chunks,
                      tf.einsum("bnhqk,bnkhd->bnqhd", d_logits, keys))
            d_k = add(d_k, key_chunk, ring.chunks,
                      tf.einsum("bnhqk,bnqhd->bnkhd", d_logits, queries))
        return d_k, d_v, d_q

    zeros = ring.split(tf.zeros_like(q))
    gradients = fold(0, k, v, zeros, zeros, zeros)

    def step(i, k, v, d_k, d_v, d_q):
        k, v, d_k, d_v = (ring.shift(t) for t in (k, v, d_k, d_v))
        return (i + 1, k, v) + fold(i, k, v, d_k, d_v, d_q)

    _, _, _, d_k, d_v, d_q = tf.while_loop(
        lambda i, *_: i < ring.devices, step, (tf.constant(1), k, v) + gradients,
        maximum_iterations=ring.devices - 1)
    # each K/V gradient is n - 1 devices on from its block's home: one more shift
    return d_q, ring.shift(d_k), ring.shift(d_v)
