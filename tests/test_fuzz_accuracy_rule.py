"""The fuzzer's accuracy rule (gspmd_tf/testing/accuracy.py): a partitioned float value
that differs from single-device TF passes only when it is as close to the float64
program's value as TF's is, up to the tolerance relative to the magnitude of the terms
it sums (summed_magnitude, which follows moves, scalings, unrolled loops and
cross-entropies); non-finite kinds must match except where the terms overflow. Each
case is a fuzzer finding (benchmarks/RESULTS.md §6): TF's float32 rounding of cancelling
terms is excused, a real error of 30 times the bound is not.
"""

import numpy as np
import pytest
import tensorflow as tf

from gspmd_tf.testing.accuracy import (Mismatch, check_values, cross_entropy_magnitude,
                                       summed_magnitude, unrolling_while_loops)


def test_cross_entropy_magnitude_bounds_the_cancelled_terms():
    """|labels| * (|logsumexp| + max|logits|) per example, for dense and sparse labels;
    a 30x error relative to it is still a mismatch."""

    logits = np.array([[1.0, -2.0, 0.5, 3.0]])
    labels = np.array([[0.5, -1.0, 2.0, 0.25]])

    @tf.function
    def magnitudes(a, b, sparse):
        dense = tf.nn.softmax_cross_entropy_with_logits(labels=b, logits=a)
        one = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=sparse, logits=a)
        return summed_magnitude(tf, dense), summed_magnitude(tf, one), dense
    dense, sparse, loss = magnitudes(tf.constant(logits), tf.constant(labels),
                                     tf.constant([2]))
    bound = abs(np.log(np.exp(logits).sum())) + 3.0
    np.testing.assert_allclose(dense.numpy(), [3.75 * bound])
    np.testing.assert_allclose(sparse.numpy(), [bound])
    exact = loss.numpy()
    check_values(np.float32(exact + 1e-6), np.float32(exact), "ce", "float32", exact=exact,
                 terms=dense.numpy())
    with pytest.raises(Mismatch):
        check_values(np.float32(exact + 30 * 1e-5 * dense.numpy()), np.float32(exact),
                     "ce", "float32", exact=exact, terms=dense.numpy())


def test_accuracy_rule_excuses_only_tf_rounding():
    """A result off TF's by more than the tolerance passes only when it is no further from
    the float64 program's value than TF's is (TF's float32 sum of terms that cancel)."""
    import pytest

    exact = np.array([-0.00628261361271143])
    tf_sum, ours = np.float32([-0.0062847137]), np.float32([-0.0062828064])
    with pytest.raises(Mismatch):
        check_values(ours, tf_sum, "sum", "float32")
    check_values(ours, tf_sum, "sum", "float32", exact=exact)
    with pytest.raises(Mismatch):
        check_values(np.float32([-0.0063]), tf_sum, "sum", "float32", exact=exact)


def test_overflow_rule_excuses_only_disputed_non_finite_kinds():
    """A non-finite value of another kind than TF's passes only where the float64 program
    disagrees with TF: ours of the float64 program's kind (seed 21 #8884), or any
    non-finite kind where TF's and the float64 program's are both non-finite (seed 20
    #4063: an overflowing sum whose sign is an accident of order)."""
    import pytest

    inf, nan = np.inf, np.nan
    # 8884: TF NaN, float64 -Inf, ours -Inf; 4063: TF -Inf, float64 +Inf, ours NaN.
    check_values(np.float32([-inf]), np.float32([nan]), "prod", "float32", exact=[-inf])
    check_values(np.float32([nan]), np.float32([-inf]), "sum", "float32", exact=[inf])
    for ours, tf_value, exact in (
            ([nan], [-inf], [-inf]),   # TF and float64 agree: ours must match
            ([1.0], [-inf], [inf]),    # finite where both overflowed
            ([nan], [2.0], [inf]),     # not the float64 program's kind
            ([-inf], [nan], None)):    # no float64 program
        with pytest.raises(Mismatch):
            check_values(np.float32(ours), np.float32(tf_value), "x", "float32",
                         exact=exact if exact is None else np.array(exact))


def test_a_finite_value_of_the_float64_program_passes_where_tf_overflowed():
    """Seed 80 #401: TF's float16 product of 72 exp values overflows to +Inf in its own
    order; the float64 program and ours (multiplied in float64, rounded once) give
    8.3e-7. A finite value off the float64 program's, or one where the float64
    program overflows too, is still a mismatch."""
    inf = np.inf
    exact = np.array([8.344650268554688e-07])
    check_values(np.float16(exact), np.float16([inf]), "prod", "float16", exact=exact)
    for ours, exact in (([1e-6], [8.344650268554688e-07]), ([1.0], [inf])):
        with pytest.raises(Mismatch):
            check_values(np.float16(ours), np.float16([inf]), "prod", "float16",
                         exact=np.array(exact))


def test_exp_rounding_rule_scales_with_its_argument():
    """Seed 29 #8498: exp of about 79 turns 1.3 and 3 units of float32 rounding of the
    argument into relative errors 1.24e-5 (TF) and 2.76e-5 (gspmd-tf) against the float64
    program; the magnitude of an Exp is |exp(x)| * max(1, |x|), so ours passes, and an
    error 30x larger, or a position finite in ours but not in the float64 program, does
    not. Positions where ours and TF's both overflowed are left out."""
    import pytest

    x = tf.constant([79.22395802536995, 0.5, -3.0], tf.float64)
    magnitude = tf.function(lambda t: summed_magnitude(tf, tf.exp(t)))(x).numpy()
    np.testing.assert_allclose(magnitude, np.exp(x.numpy()) * [79.22395802536995, 1, 3])

    exact = np.array([2.5499273372605547e34, 1e40])
    terms = np.array([exact[0] * 79.22395802536995, 1e40 * 92])
    tf_value = np.float32([2.54989577075561e34, np.inf])
    ours = np.float32([2.5498568994383763e34, np.inf])
    with pytest.raises(Mismatch):
        check_values(ours, tf_value, "exp", "float32")
    check_values(ours, tf_value, "exp", "float32", exact=exact, terms=terms)
    far = np.float32([exact[0] * (1 - 30 * 2.76e-5), np.inf])
    with pytest.raises(Mismatch):
        check_values(far, tf_value, "exp", "float32", exact=exact, terms=terms)
    with pytest.raises(Mismatch):
        check_values(ours, tf_value, "exp", "float32", exact=np.array([np.inf, 1e40]),
                     terms=terms)


def test_overflowing_terms_leave_the_kind_to_summation_order():
    """Where the float64 magnitudes of the terms overflow and TF's value is non-finite,
    ours may be any non-finite value; elsewhere the kinds must match."""

    inf, nan = np.inf, np.nan
    tf_value, exact = np.float64([inf, 1.0]), np.float64([inf, 1.0])
    check_values(np.float64([nan, 1.0]), tf_value, "t3", "float64", exact=exact,
                 terms=np.float64([inf, 2.0]))
    for ours, terms in (([nan, 1.0], [1e308, 2.0]),   # the terms do not overflow
                        ([2.0, 1.0], [inf, 2.0]),     # finite where TF overflowed
                        ([nan, nan], [inf, 2.0])):    # TF finite there
        with pytest.raises(Mismatch):
            check_values(np.float64(ours), tf_value, "t3", "float64", exact=exact,
                         terms=np.float64(terms))


# Seed 24 #1489 (fuzz_cancellation.py prints its figures).

def _magnitudes(f, *args):
    """f's float64 outputs and accuracy.summed_magnitude of each, traced."""

    def with_magnitudes(*args):
        outs = f(*args)
        return outs + [summed_magnitude(tf, t) for t in outs]
    values = tf.function(with_magnitudes, autograph=False)(*args)
    return [v.numpy() for v in values[:len(values) // 2]], \
        [v.numpy() for v in values[len(values) // 2:]]


def test_summed_magnitude_is_that_of_the_terms_of_the_last_sum():
    """Seed 24 #1489 (shrunk): the gradient of a scalar added before a softmax sums terms
    that cancel to 0; summed_magnitude gives the sum of their magnitudes (the gradient
    at the sum's operand, summed in absolute value). A difference's terms are its two
    operands; a product sums nothing."""
    rng = np.random.default_rng(1000)
    x = tf.constant(rng.standard_normal(()), tf.float64)
    p = tf.constant(rng.standard_normal((3, 8, 1, 2)), tf.float64)
    weights = rng.uniform(0.5, 1.5, (5, 7, 4))

    def f(x, p):
        with tf.GradientTape() as tape:
            tape.watch(x)
            shifted = tf.reduce_sum(p, axis=-3) + x
            tape.watch(shifted)
            padded = tf.pad(tf.nn.softmax(shifted, axis=0), [[1, 1], [3, 3], [1, 1]])
            loss = tf.reduce_sum(padded * weights)
        grad_x, grad_shifted = tape.gradient(loss, [x, shifted])
        a, b = p[0, 0], p[1, 0]
        return [grad_x, grad_shifted, a - b, a * b]

    values, magnitudes = _magnitudes(f, x, p)
    (grad_x, grad_shifted, _, _), (terms, _, diff_terms, product_terms) = values, magnitudes
    assert abs(grad_x) < 1e-15  # 0 in real arithmetic
    np.testing.assert_allclose(terms, np.abs(grad_shifted).sum(), rtol=1e-12)
    assert terms > 1e10 * abs(grad_x)  # far larger than their sum
    a, b = p.numpy()[0, 0], p.numpy()[1, 0]
    np.testing.assert_allclose(diff_terms, np.abs(a) + np.abs(b), rtol=1e-12)
    np.testing.assert_allclose(product_terms, np.abs(a * b), rtol=1e-12)


def test_summed_magnitude_of_a_matmul_reshaped():
    """Through a reshape, a MatMul's terms: |a| @ |b|."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    _, (terms,) = _magnitudes(lambda a, b: [tf.reshape(tf.matmul(a, b), [6])],
                              tf.constant(a), tf.constant(b))
    np.testing.assert_allclose(terms, (np.abs(a) @ np.abs(b)).reshape(6), rtol=1e-12)


def test_accuracy_rule_relative_to_the_cancelling_terms():
    """Seed 24 #1489's output 7 (commands in RESULTS §6): TF 5.2e-8, gspmd-tf 9.3e-8, the
    float64 program 3.1e-16, its 6 terms 0.335 in magnitude. Both are float32 rounding of
    those terms (1.3 and 2.3 eps32 times it): excused relative to the terms, not to the
    value; a dropped term, a wrong sign, or an error 30 times the bound is not."""

    exact, terms = np.array(3.0531133177191805e-16), np.array(0.3354347574220473)
    tf_value, ours = np.float32(5.2154064e-08), np.float32(9.313226e-08)
    with pytest.raises(Mismatch):
        check_values(ours, tf_value, "grad", "float32", exact=exact)
    check_values(ours, tf_value, "grad", "float32", exact=exact, terms=terms)
    for wrong in (ours + np.float32(0.0662), np.float32(1e-4)):  # a dropped term, 30x
        with pytest.raises(Mismatch):
            check_values(wrong, tf_value, "grad", "float32", exact=exact, terms=terms)
    with pytest.raises(Mismatch):  # a wrong sign of a value that does not cancel
        check_values(np.float32([-0.25, 1.0]), np.float32([0.25000003, 1.0]), "x",
                     "float32", exact=np.array([0.25, 1.0]), terms=np.array([0.6, 1.0]))


def loss_through_a_loop(module):
    """#4500's shape: a cross-entropy halved in a one-trip loop, sliced and rolled; the
    loss, its term magnitude and the cross-entropy's own bound."""
    def f(logits, labels):
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        halved = module.while_loop(lambda i_, c_: i_ < 1, lambda i_, c_: (i_ + 1, c_ * 0.5),
                                   (tf.constant(0), loss))[1]
        out = tf.roll(tf.slice(halved, [1], [2]), 1, axis=0)
        return out, summed_magnitude(tf, out), cross_entropy_magnitude(tf, loss.op)
    logits = tf.constant(np.random.default_rng(0).standard_normal((4, 7)))
    return tf.function(f)(logits, tf.constant([1, 0, 6, 3]))


def test_magnitude_follows_slices_scalings_and_unrolled_loops():
    out, terms, bound = [t.numpy() for t in loss_through_a_loop(unrolling_while_loops(tf))]
    np.testing.assert_allclose(terms, 0.5 * np.roll(bound[1:3], 1))
    assert np.all(terms >= np.abs(out))
    # a real error is still a mismatch: 30x the tolerance relative to those terms
    with pytest.raises(Mismatch):
        check_values(np.float32(out + 30 * 1e-5 * terms), np.float32(out), "loss",
                     "float32", exact=out, terms=terms)


def test_a_kept_loop_gives_its_own_magnitude():
    """A tf.while_loop left as it is (no unrolling) has no summing op to look into."""
    out, terms, _ = [t.numpy() for t in loss_through_a_loop(tf)]
    np.testing.assert_array_equal(terms, np.abs(out))


def test_loops_with_a_data_dependent_condition_stay_loops():
    module = unrolling_while_loops(tf)

    @tf.function
    def f(limit):
        return module.while_loop(lambda i_, c_: i_ < limit, lambda i_, c_: (i_ + 1, c_ * 2.0),
                                 (tf.constant(0), tf.constant(1.0)))[1]
    types = {op.type for op in f.get_concrete_function(
        tf.TensorSpec([], tf.int32)).graph.get_operations()}
    assert types & {"While", "StatelessWhile"}, types
    assert f(tf.constant(3)).numpy() == 8.0


def test_summed_magnitude_carries_the_terms_through_a_softmax_gradient():
    """The gradient of softmax(x1 - x0) for x1 broadcast over the softmax axis is 0 in
    real arithmetic: float32 noise on both sides (seed 7 #13: TF 4.7e-9, gspmd-tf
    -1.1e-7). Its magnitude is that of what the softmax gradient cancels,
    sum_j (|g_j| + sum_k |g_k s_k|) s_j, not the noise: the noise passes, an error of 30
    times the bound does not."""
    x0 = np.random.default_rng(13).standard_normal((5, 3))
    x1 = np.random.default_rng(14).standard_normal((5, 1))
    weights = np.random.default_rng(0).uniform(0.5, 1.5, (5, 3))

    @tf.function
    def gradient_and_magnitude(a, b):
        with tf.GradientTape() as tape:
            tape.watch(b)
            s = tf.nn.softmax(b - a, axis=-1)
            loss = tf.reduce_sum(s * weights)
        grad = tape.gradient(loss, b)
        return grad, summed_magnitude(tf, grad), s
    grad, terms, s = (t.numpy() for t in gradient_and_magnitude(tf.constant(x0),
                                                                 tf.constant(x1)))
    np.testing.assert_allclose(grad, 0, atol=1e-12)
    g_s = np.abs(weights * s).sum(-1, keepdims=True)
    np.testing.assert_allclose(terms, ((weights + g_s) * s).sum(-1, keepdims=True))
    exact = np.zeros((5, 1))
    check_values(np.full((5, 1), -1.1e-7, np.float32), np.full((5, 1), 4.7e-9, np.float32),
                 "grad", "float32", exact=exact, terms=terms)
    with pytest.raises(Mismatch):
        check_values(np.float32(30 * 1e-5 * terms), np.full((5, 1), 4.7e-9, np.float32),
                     "grad", "float32", exact=exact, terms=terms)
