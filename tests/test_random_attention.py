"""Randomized differential tests of gt.ring_attention and gt.ulysses_attention.

Each example draws a mesh of the 8 CPU devices, the axis the sequence is split over and
maybe axes for the batch (and, for the ring, the heads), batch, sequence, heads and
head_dim (uneven batch and heads splits included; a sequence the API cannot split must
be a gt.ShardingError, as heads Ulysses cannot), causal or not, the ring's layout, and
random shardings of q, k, v and the output's weights, and the size of q and k (weights
near uniform or not). Values and the gradients of q, k,
v must equal plain softmax attention on single-device TF. More examples:
GSPMD_TF_EXAMPLES=200, or HYPOTHESIS_PROFILE=fuzz.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import event, given, settings, strategies as st

import gspmd_tf as gt
from gspmd_tf.attention import dot_product_attention, zigzag_order
from test_attention import with_gradients
from util import assert_close, examples, randn, single_device, specs

MESHES = [(8,), (2, 4), (4, 2), (2, 2, 2)]
VARIANTS = [("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", None)]
IDS = ["ring", "zigzag_ring", "ulysses"]
NAMES = ("a", "b", "c")
# examples per variant of the test running on the 8 devices (~1.5 s each): an eighth of
# the profile's


def refused(kind, layout, causal, seq, heads, devices):
    """Whether the API refuses these sizes (its docstrings): the sequence must divide
    over the axis (the causal zigzag layout: over twice its size), Ulysses' heads too."""
    chunks = 2 if kind == "ring" and causal and layout == "zigzag" else 1
    return seq % (devices * chunks) != 0 or (kind == "ulysses" and heads % devices != 0)


@st.composite
def attentions(draw, valid, variant=None):
    """A random attention call: a dict of the drawn choices (`valid`: only sizes the API
    takes, else any; `variant`: one of VARIANTS, else drawn)."""
    shape = draw(st.sampled_from(MESHES))
    names = NAMES[:len(shape)]
    axis = draw(st.sampled_from(names))
    devices = shape[names.index(axis)]
    others = [n for n in names if n != axis]
    batch_axis = draw(st.sampled_from([None] + others))
    kind, layout = variant or draw(st.sampled_from(VARIANTS))
    heads_axis = (draw(st.sampled_from([None] + [n for n in others if n != batch_axis]))
                  if kind == "ring" else None)
    causal = draw(st.booleans())
    chunks = 2 if causal and layout == "zigzag" else 1
    seq = devices * chunks * draw(st.integers(1, 2))
    heads = (devices * draw(st.integers(1, 2)) if kind == "ulysses"
             else draw(st.integers(1, 5)))
    if not valid:  # perhaps a size off by one, or by the axis size
        seq += draw(st.sampled_from([0, 1, devices]))
        heads += draw(st.sampled_from([0, 1]))
    return dict(shape=shape, names=names, axis=axis, devices=devices, kind=kind,
                batch_axis=batch_axis, heads_axis=heads_axis, causal=causal, layout=layout,
                dims=(draw(st.integers(1, 3)), seq, heads, draw(st.integers(1, 5))),
                specs=tuple(draw(specs(names, 4)) for _ in range(4)),
                # not much larger: at x8 a saturated softmax's gradient is a difference
                # of near-equal terms, single-device float32 TF's dq 9.8e-5 off float64's
                # (the ring's 5.0e-5)
                scale=draw(st.sampled_from([1.0, 0.1])),
                seed=draw(st.integers(0, 2 ** 16)))


def _attend(case, mesh):
    """attend(q, k, v): the case's attention on `mesh`."""
    options = dict(mesh=mesh, axis=case["axis"], causal=case["causal"],
                   batch_axis=case["batch_axis"])
    if case["kind"] == "ring":
        options.update(layout=case["layout"], heads_axis=case["heads_axis"])
        return lambda q, k, v: gt.ring_attention(q, k, v, **options)
    return lambda q, k, v: gt.ulysses_attention(q, k, v, **options)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
@settings(max_examples=examples(8))
@given(data=st.data())
def test_attention_equals_softmax_attention(variant, data):
    """A random call of `variant` (drawn from `data`) equals softmax attention."""
    case = data.draw(attentions(valid=True, variant=variant))
    event(f"{case['kind']} {case['layout']} causal={case['causal']} n={case['devices']}")
    mesh = gt.Mesh.create(case["shape"], case["names"])
    rng = np.random.default_rng(case["seed"])
    # logits as usual, or of 1/100 the size (weights near uniform)
    args = [randn(rng, *case["dims"]) * (case["scale"] if i < 2 else 1.0)
            for i in range(4)]
    seq = case["dims"][1]
    # the causal zigzag layout holds the sequence in zigzag order, the result too
    order = (zigzag_order(seq, case["devices"])
             if case["causal"] and case["layout"] == "zigzag" else list(range(seq)))
    f = gt.function(with_gradients(_attend(case, mesh)), mesh=mesh,
                    in_shardings=case["specs"])
    got = f(*[a[:, order] for a in args])
    want = single_device(with_gradients(
        lambda q, k, v: dot_product_attention(q, k, v, case["causal"])), args)
    assert len(got) == len(want) == 4
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        assert_close(g.numpy(), w[:, order], name)


@given(attentions(valid=False))
def test_attention_lowers_or_refuses_the_sizes(case):
    mesh = gt.Mesh.create(case["shape"], case["names"])
    args = [tf.TensorSpec(case["dims"], tf.float32)] * 4
    fn = with_gradients(_attend(case, mesh))
    refuse = refused(case["kind"], case["layout"], case["causal"], case["dims"][1],
                     case["dims"][2], case["devices"])
    event("refused" if refuse else "lowered")
    if refuse:
        with pytest.raises(gt.ShardingError):
            gt.lower(fn, mesh, case["specs"], args=args)
        return
    kinds = {c.kind for c in gt.lower(fn, mesh, case["specs"], args=args).collectives()}
    # the ring passes K/V by collective-permutes; Ulysses moves seq <-> heads splits
    assert ("collective-permute" if case["kind"] == "ring" else "all-to-all") in kinds
