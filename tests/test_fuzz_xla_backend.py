"""The fuzzer under the XLA backend (`benchmarks/fuzz.py --backend=xla`): a value that
differs from eager single-device TF only where XLA's semantics differ from TF's kernels
passes when single-device TF under jit_compile gives it too.

Seed 46 #553 (shrunk: tf.maximum of inputs holding NaN, benchmarks/RESULTS.md §14.11):
XLA's maximum returns a number where TF's returns NaN, on one device as on the
mesh.
"""

import numpy as np
import tensorflow as tf

from gspmd_tf.testing.generator import generate
from gspmd_tf.testing.workers import run_programs


def test_xla_semantics_are_taken_from_single_device_jit(monkeypatch):
    monkeypatch.setenv("GSPMD_TF_BACKEND", "xla")  # the workers inherit it
    result = run_programs({553: generate(46, 553)}, jobs=1, batch=1, timeout=120,
                          collective_timeout=30)[553]
    assert result["status"] == "pass", result
    assert "under XLA" in result["detail"], result


def test_the_two_semantics_differ():
    """What makes the reference above necessary: TF's kernel and XLA disagree on NaN."""
    x, y = tf.constant([1.0, np.nan]), tf.constant([np.nan, 2.0])
    eager = tf.maximum(x, y).numpy()
    compiled = tf.function(tf.maximum, jit_compile=True)(x, y).numpy()
    assert np.isnan(eager).all()
    assert not np.isnan(compiled).all(), compiled  # a number where TF gives NaN
