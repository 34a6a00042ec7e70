"""The fuzzer under the XLA backend (`benchmarks/fuzz.py --backend=xla`).

Seed 46 #553 (shrunk: tf.maximum of inputs holding NaN, benchmarks/RESULTS.md §14.11):
XLA's maximum returns a number where TF's returns NaN. The fuzzer accepts a value that
single-device TF under jit_compile gives too, but the XLA backend no longer needs that:
Maximum's contract says XLA's values differ from TF's kernel (registry xla_numerics), so
the XLA backend runs it on TF's kernel and gives eager TF's own value.
"""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.testing.generator import generate
from gspmd_tf.testing.workers import run_programs

P = gt.P


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


# (op, its inputs by name): forward outputs NaN, Inf, -Inf and numbers, upstream
# gradients 0 where the output is not finite, NaN and Inf elsewhere
_Y = [np.nan, np.inf, -np.inf, 0.0, 1.0, -1.0, 0.0, np.nan]
_DY = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, np.nan, np.inf]
_GRADIENTS = {"SqrtGrad": ("y", "dy"), "RsqrtGrad": ("y", "dy"),
              "ReciprocalGrad": ("y", "dy"), "EluGrad": ("outputs", "gradients"),
              "SeluGrad": ("outputs", "gradients"), "ReluGrad": ("features", "gradients"),
              "Relu6Grad": ("features", "gradients")}


@pytest.mark.parametrize("op_type", sorted(_GRADIENTS))
def test_the_xla_backend_gives_tf_gradients_of_zero_and_nan_upstream_gradients(op_type):
    """Seed 60 #36 (shrunk: the gradient of rsqrt(x) before a minimum with x negative):
    TF's kernel gives 0 for a zero upstream gradient where the forward output is NaN,
    XLA's NaN; ReluGrad the other way round. The XLA backend compiles them in their
    xla_form (TF's kernel as TF ops) and gives TF's values."""
    mesh = gt.Mesh.create((2,), ("x",))
    first, second = _GRADIENTS[op_type]
    raw = getattr(tf.raw_ops, op_type)

    def f(y, dy):
        return raw(**{first: y, second: dy})
    y, dy = np.array(_Y, np.float32), np.array(_DY, np.float32)
    want = f(tf.constant(y), tf.constant(dy)).numpy()
    compiled = tf.function(f, jit_compile=True)(tf.constant(y), tf.constant(dy)).numpy()
    assert not np.array_equal(compiled, want, equal_nan=True)  # why the contract says so
    got = gt.function(f, mesh=mesh, in_shardings=(P("x"), P("x")), backend="xla")(y, dy)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("op_type", sorted(_GRADIENTS))
def test_the_xla_backend_compiles_gradient_kernels_whose_xla_values_differ(op_type):
    """No segment barrier at these gradients (the LM's backward step was cut into 11
    segments at its RsqrtGrad and ReluGrad ops): their xla_form compiles."""
    from gspmd_tf.backends import segments
    mesh = gt.Mesh.create((2,), ("x",))
    first, second = _GRADIENTS[op_type]
    raw = getattr(tf.raw_ops, op_type)
    spec = tf.TensorSpec((8,), tf.float32)
    lowered = gt.function(lambda y, dy: raw(**{first: y, second: dy}), mesh=mesh,
                          in_shardings=(P("x"), P("x")), backend="xla").lower(spec, spec)
    program = lowered.program.graph
    (node,) = [n for n in program.nodes if n.op == op_type]
    assert segments.why_not_compiled(program, node) is None
