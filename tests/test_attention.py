"""gt.ring_attention and gt.ulysses_attention on a sequence split over a mesh axis equal
single-device softmax attention, values and gradients of q, k, v (relative 1e-5); the
ring moves K/V by collective-permutes only (no all-gather, no all-to-all), Ulysses by
all-to-alls; bad shapes name what to change."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.attention import dot_product_attention, zigzag_order
from gspmd_tf.backends.base import node_multiply_adds, nodes_with_graphs
from util import assert_close, randn, single_device

P = gt.P
_SEQ = gt.Mesh.create((4,), ("seq",))
_DATA_SEQ = gt.Mesh.create((2, 2), ("data", "seq"))
BATCH, SEQ, HEADS, HEAD_DIM = 2, 16, 4, 8


def with_gradients(attend):
    """f(q, k, v, w) -> (out, d/dq, d/dk, d/dv) of sum(out * w)."""
    def f(q, k, v, w):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attend(q, k, v)
            loss = tf.reduce_sum(out * w)
        return (out,) + tuple(tape.gradient(loss, [q, k, v]))
    return f


def _args(seed):
    rng = np.random.default_rng(seed)
    return tuple(randn(rng, BATCH, SEQ, HEADS, HEAD_DIM) for _ in range(4))


def _check(attend, mesh, spec, causal, seed, **axes):
    args = _args(seed)
    f = gt.function(with_gradients(lambda q, k, v: attend(q, k, v, mesh=mesh, axis="seq",
                                                           causal=causal, **axes)),
                    mesh=mesh, in_shardings=(spec,) * 4)
    want = single_device(with_gradients(
        lambda q, k, v: dot_product_attention(q, k, v, causal)), args)
    got = f(*args)
    assert len(got) == len(want) == 4
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        assert_close(g.numpy(), w, name)
    return f.lower(*args)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_equals_softmax_attention_with_permutes_only(causal):
    low = _check(gt.ring_attention, _SEQ, P(None, "seq"), causal, int(causal))
    kinds = {c.kind for c in low.collectives()}
    assert "all-gather" not in kinds and "all-to-all" not in kinds, low.report()
    # one K/V block [b, 1, 1 chunk, seq/4, h, d] per hop, forward and in the gradient
    permutes = [c for c in low.collectives() if c.kind == "collective-permute"]
    assert permutes and {c.shape for c in permutes} == {
        (BATCH, 1, 1, SEQ // 4, HEADS, HEAD_DIM)}, low.report()
    assert not low.program.replicated_ops


def test_ring_with_batch_over_data_axis():
    low = _check(gt.ring_attention, _DATA_SEQ, P("data", "seq"), True, 2,
                 batch_axis="data")
    assert "all-gather" not in {c.kind for c in low.collectives()}, low.report()


def test_zigzag_ring_equals_causal_attention_in_zigzag_order():
    order = zigzag_order(SEQ, 4)
    args = _args(4)
    f = gt.function(with_gradients(lambda q, k, v: gt.ring_attention(
        q, k, v, mesh=_SEQ, axis="seq", causal=True, layout="zigzag")),
        mesh=_SEQ, in_shardings=(P(None, "seq"),) * 4)
    zigzagged = [a[:, order] for a in args]
    got = f(*zigzagged)
    want = single_device(with_gradients(
        lambda q, k, v: dot_product_attention(q, k, v, causal=True)), args)
    assert len(got) == len(want) == 4
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        assert_close(g.numpy(), w[:, order], name)
    kinds = {c.kind for c in f.lower(*zigzagged).collectives()}
    assert kinds == {"collective-permute"}


def _loop_multiply_adds(layout):
    args = [tf.TensorSpec([BATCH, SEQ, HEADS, HEAD_DIM])] * 3
    low = gt.lower(lambda q, k, v: gt.ring_attention(q, k, v, mesh=_SEQ, axis="seq",
                                                     causal=True, layout=layout),
                   _SEQ, (P(None, "seq"),) * 3, args=args)
    return sum(node_multiply_adds(g, n) for loop in low.program.graph.nodes
               for region in loop.regions for g, n in nodes_with_graphs(region))


def test_zigzag_steps_after_the_first_compute_half_the_causal_blocks():
    # contiguous: every step a whole [seq/4, seq/4] block per device, masked or not;
    # zigzag: the two visible [seq/8, seq/8] pairs of the block only
    assert 2 * _loop_multiply_adds("zigzag") == _loop_multiply_adds("contiguous")


def test_ulysses_equals_softmax_attention_by_all_to_alls():
    low = _check(gt.ulysses_attention, _SEQ, P(None, "seq"), True, 3)
    kinds = {c.kind for c in low.collectives()}
    assert "all-to-all" in kinds and "all-gather" not in kinds, low.report()


def test_bad_shapes_name_what_to_change():
    q = tf.zeros([1, 6, 4, 2])
    with pytest.raises(gt.ShardingError, match="sequence of 6 does not divide"):
        gt.ring_attention(q, q, q, mesh=_SEQ, axis="seq")
    q = tf.zeros([1, 8, 2, 2])
    with pytest.raises(gt.ShardingError, match="2 heads do not divide"):
        gt.ulysses_attention(q, q, q, mesh=_SEQ, axis="seq")
    with pytest.raises(gt.ShardingError, match="12 is no multiple of 8"):
        gt.ring_attention(*(tf.zeros([1, 12, 4, 2]),) * 3, mesh=_SEQ, axis="seq",
                          causal=True, layout="zigzag")
    with pytest.raises(gt.ShardingError, match="of one static shape"):
        gt.ring_attention(q, q[:, :4], q, mesh=_SEQ, axis="seq")
