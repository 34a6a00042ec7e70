"""A Reshape whose operand and result each split one dim over the same axes, the dims
before them holding as many elements in both: each shard's elements are one contiguous
range of the same flat suffix, so the result is a re-block of that suffix (the moved
boundaries by collective-permutes, as XLA's reshape with a halo exchange), where
gspmd-tf gathered the operand before."""

import numpy as np
import tensorflow as tf
from hypothesis import given, settings, strategies as st

import gspmd_tf as gt
from util import check_partitioned

P = gt.P

# XLA's spmd_partitioner_test program ReshapeMergeDimsWithHaloExchange on 2 devices:
# (2, 3, 7, 10) split on its 7 reshaped to (3, 2, 1, 14, 5) split on its 14. XLA's
# collectives (JAX 0.10.2, 8 host CPU devices, the program on the first 2; script:
# benchmarks/xla_reshape_halo.py): one collective-permute of 120 B per device.
XLA_HALO = [("collective-permute", 120)]


def test_merge_with_halo_moves_what_xla_moves():
    mesh = gt.Mesh.create((2,), ("x",))
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 10)).astype(np.float32)
    low = check_partitioned(lambda t: tf.reshape(t, (3, 2, 1, 14, 5)) * 3.0, (x,), mesh,
                            (P(None, None, "x"),), (P(None, None, None, "x"),))
    assert [(c.kind, c.bytes) for c in low.collectives()] == XLA_HALO, low.report()


@st.composite
def regroups(draw):
    """(mesh, axes, shape, spec, new shape, new spec): a prefix of whole dims regrouped,
    then a split dim and the dims after it regrouped into another split dim and whole
    dims of the same size (the splits even or not; the new split dim no smaller than its
    axes, which a smaller one would split over parts of)."""
    mesh_shape, names = draw(st.sampled_from([((2,), ("x",)), ((4,), ("x",)),
                                              ((2, 4), ("a", "b"))]))
    axes = draw(st.sampled_from([names[:1], names[-1:], names]))
    k = int(np.prod([dict(zip(names, mesh_shape))[n] for n in axes]))
    prefix = draw(st.lists(st.integers(1, 4), max_size=2))
    a, b = draw(st.integers(2, 9)), draw(st.integers(1, 6)) * k  # a * b >= k
    divisors = [d for d in range(1, a * b + 1) if (a * b) % d == 0 and a * b // d >= k]
    d = draw(st.sampled_from(divisors))
    new_prefix = [int(np.prod(prefix))] if prefix else []
    entry = axes if len(axes) > 1 else axes[0]
    shape = tuple(prefix) + (a, b)
    new_shape = tuple(new_prefix) + (a * b // d, d)
    spec = P(*([None] * len(prefix) + [entry]))
    new_spec = P(*([None] * len(new_prefix) + [entry]))
    return mesh_shape, names, shape, spec, new_shape, new_spec


@settings(max_examples=10)
@given(regroups())
def test_regrouped_reshape_matches_single_device_without_gathering(case):
    mesh_shape, names, shape, spec, new_shape, new_spec = case
    mesh = gt.Mesh.create(mesh_shape, names)
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    low = check_partitioned(lambda t: tf.reshape(t * 2.0, new_shape) * 3.0, (x,), mesh,
                            (spec,), (new_spec,))
    assert {c.kind for c in low.collectives()} <= {"collective-permute"}, low.report()
