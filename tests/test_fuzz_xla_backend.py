"""The fuzzer under the XLA backend (`benchmarks/fuzz.py --backend=xla`).

Seed 46 #553 (shrunk: tf.maximum of inputs holding NaN, benchmarks/RESULTS.md §14.11):
XLA's maximum returns a number where TF's returns NaN. The fuzzer accepts a value that
single-device TF under jit_compile gives too, but the XLA backend no longer needs that:
Maximum's contract says XLA's values differ from TF's kernel (registry xla_numerics), so
the XLA backend runs it on TF's kernel and gives eager TF's own value.
"""

import numpy as np
import tensorflow as tf

from gspmd_tf.testing.generator import generate
from gspmd_tf.testing.workers import run_programs


def test_the_xla_backend_gives_tf_values_where_xla_semantics_differ(monkeypatch):
    monkeypatch.setenv("GSPMD_TF_BACKEND", "xla")  # the workers inherit it
    result = run_programs({553: generate(46, 553)}, jobs=1, batch=1, timeout=120,
                          collective_timeout=30)[553]
    assert result["status"] == "pass", result
    # equal to eager TF itself, not only to TF under jit_compile
    assert "under XLA" not in result["detail"], result


def test_the_two_semantics_differ():
    """What makes running Maximum on TF's kernel necessary: TF's kernel and XLA disagree
    on NaN."""
    x, y = tf.constant([1.0, np.nan]), tf.constant([np.nan, 2.0])
    eager = tf.maximum(x, y).numpy()
    compiled = tf.function(tf.maximum, jit_compile=True)(x, y).numpy()
    assert np.isnan(eager).all()
    assert not np.isnan(compiled).all(), compiled  # a number where TF gives NaN
