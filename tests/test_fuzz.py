"""A bounded slice of the differential fuzzer (benchmarks/fuzz.py) for `make test`.

40 random programs of seed 0, run by the fuzzer's own machinery (a worker subprocess with
one TF import, per-program timeout, crash attribution), must all equal single-device TF.
A failure names the programs; reproduce one with

    .venv/bin/python benchmarks/fuzz.py --seed=0 --start=INDEX --programs=1 --ops=2-8

which also prints it shrunk to a standalone snippet.
"""

import os
import sys


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

from fuzz import run_programs, signature  # noqa: E402
from fuzz_programs import describe, generate  # noqa: E402

SEED = 0
PROGRAMS = 40


def test_random_programs_match_single_device():
    programs = {i: generate(SEED, i, ops=(2, 8)) for i in range(PROGRAMS)}
    results = run_programs(programs, jobs=1, batch=PROGRAMS, timeout=120,
                           collective_timeout=30)
    assert len(results) == PROGRAMS
    failures = [f"#{i} {signature(r)} ({describe(programs[i])})"
                for i, r in sorted(results.items()) if r["status"] != "pass"]
    assert not failures, "\n".join(failures)


def test_programs_are_deterministic_per_seed():
    """Program i of a seed does not depend on how many programs are drawn."""
    assert generate(3, 17) == generate(3, 17)
    assert generate(3, 17) != generate(4, 17)


def test_accuracy_rule_excuses_only_tf_rounding():
    """A result off TF's by more than the tolerance passes only when it is no further from
    the float64 program's value than TF's is (TF's float32 sum of terms that cancel)."""
    import numpy as np
    import pytest
    from fuzz_worker import Mismatch, check_values

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
    import numpy as np
    import pytest
    from fuzz_worker import Mismatch, check_values

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


def test_mismatch_of_tf_kernel_choice_is_checked_against_eigen_kernels():
    """Seed 27 #9392: a matmul whose terms overflow float32 one by one (the fill value of
    an empty segment max times 1.03) but not summed with fused multiply-adds: TF's oneDNN
    kernel gives -1.26e38, its Eigen kernel and every split of the contraction -Inf. The
    worker alone calls it a mismatch; the driver passes it because gspmd-tf's values equal
    single-device TF's with TF_ENABLE_ONEDNN_OPTS=0, and a reference off by one value is
    still a mismatch."""
    from fuzz import EIGEN_KERNELS, Worker
    from fuzz_worker import decode_values, encode_values

    program = generate(27, 9392)
    worker = Worker(120, 30)
    eigen = Worker(120, 30, env=EIGEN_KERNELS)
    try:
        assert worker.run(program)["status"] == "mismatch"
        values = eigen.run(program, part="reference_values")
        assert values["status"] == "pass"
        assert worker.run(program, reference=values["detail"])["status"] == "pass"
        import tensorflow as tf
        outputs, variables = decode_values(values["detail"], tf)
        outputs[0][1] = outputs[0][1] + 1  # the max-pool output, off by one everywhere
        wrong = encode_values((outputs, variables))
        assert worker.run(program, reference=wrong)["status"] == "mismatch"
    finally:
        worker.stop()
        eigen.stop()
    result = run_programs({9392: program}, jobs=1, batch=1, timeout=120,
                          collective_timeout=30)[9392]
    assert result["status"] == "pass" and "Eigen kernels" in result["detail"]


def test_reference_values_survive_encoding():
    import numpy as np
    import tensorflow as tf
    from fuzz_worker import decode_values, encode_values

    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(np.inf, np.float64),
              np.array([1.5, -2], dtype=tf.bfloat16.as_numpy_dtype), np.zeros((0, 4), np.int32)]
    outputs, variables = decode_values(encode_values(([arrays], arrays[:1])), tf)
    for got, want in zip(outputs[0] + variables, arrays + arrays[:1]):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()


def test_exp_rounding_rule_scales_with_its_argument():
    """Seed 29 #8498: exp of about 79 turns 1.3 and 3 units of float32 rounding of the
    argument into relative errors 1.24e-5 (TF) and 2.76e-5 (gspmd-tf) against the float64
    program; the magnitude of an Exp is |exp(x)| * max(1, |x|), so ours passes, and an
    error 30x larger, or a position finite in ours but not in the float64 program, does
    not. Positions where ours and TF's both overflowed are left out."""
    import numpy as np
    import pytest
    import tensorflow as tf
    from fuzz_worker import Mismatch, check_values, summed_magnitude

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


def test_error_of_graph_mode_tf_is_not_ours():
    """Seed 31 #9463: TF's grappler remapper fuses add(x7 (1, 8), matmul(...)) into a
    MatMul whose "bias" must be 1-D, in gspmd-tf's program and in a single-device
    tf.function alike (eager TF runs it): invalid, not gspmd-tf's error. An error that
    graph-mode TF does not raise stays an error."""
    import tensorflow as tf
    from fuzz_worker import fails_in_graph_mode_too

    def remapped():
        f = tf.function(lambda p, x, b: tf.add(b, tf.linalg.matmul(p, x, transpose_a=True)))
        return f(tf.ones((3, 3)), tf.ones((3, 8)), tf.ones((1, 8)))
    try:
        remapped()
    except tf.errors.InvalidArgumentError as exc:
        ours = tf.errors.InvalidArgumentError(
            None, None, "8 root error(s) found.\n  (0) INVALID_ARGUMENT: "
            + str(exc).splitlines()[0].split("}}")[-1].strip())
    else:
        raise AssertionError("TF's remapper no longer fuses this add: update the test")
    assert "bias must be 1-dimensional" in fails_in_graph_mode_too(ours, remapped, tf)
    other = tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [3] vs. [4]")
    assert fails_in_graph_mode_too(other, remapped, tf) is None
    assert fails_in_graph_mode_too(ours, lambda: None, tf) is None  # graph mode runs it
    assert fails_in_graph_mode_too(ValueError("x"), remapped, tf) is None


def test_seed_31_9463_passes():
    """The whole program of seed 31 #9463 through the fuzzer's worker: gspmd-tf's
    program runs without grappler's remapper now (backends/tf_kernels.py call_attrs), so
    it computes what eager TF does."""
    programs = {9463: generate(31, 9463)}
    result = run_programs(programs, jobs=1, batch=1, timeout=120,
                          collective_timeout=30)[9463]
    assert result["status"] == "pass", result
