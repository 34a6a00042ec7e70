"""The fuzzer under the XLA backend (`benchmarks/fuzz.py --backend=xla`).

Seed 46 #553 (shrunk: tf.maximum of inputs holding NaN, benchmarks/RESULTS.md §14.11):
XLA's maximum returns a number where TF's returns NaN. Maximum's contract says XLA's
values differ from TF's kernel (registry xla_numerics), so the XLA backend runs it on
TF's kernel and gives eager TF's own value. For a difference no contract declares, the
fuzzer's reference is single-device TF running the same segments under jit_compile
(differential.one_device_segments): XLA's own difference passes, a partitioning bug
does not.
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


# A program whose minimum XLA compiles (its contract made silent on XLA's NaN order,
# as for an op whose difference no contract declares yet) while its maximum runs on
# TF's kernel: the partitioned values then equal neither eager TF nor the whole program
# under jit_compile, only single-device TF running the same segments.
_NAN_ORDER_PROGRAM = {
    "mesh": {"shape": [2, 4], "axes": ["a", "b"]},
    "inputs": [
        {"name": "x0", "shape": [8, 3], "dtype": "float32", "kind": "normal", "bound": None,
         "seed": 1, "special": [["nan", 5], ["nan", 12]], "spec": ["a", None]},
        {"name": "x1", "shape": [8, 3], "dtype": "float32", "kind": "normal", "bound": None,
         "seed": 2, "special": [["nan", 1], ["nan", 13]], "spec": ["b"]}],
    "ops": [
        {"out": "t0", "expr": "tf.minimum({0}, {1})", "args": ["x0", "x1"],
         "shape": [8, 3], "dtype": "float32", "family": "binary", "hint": None,
         "precision": "float32"},
        {"out": "t1", "expr": "tf.maximum({0}, {1})", "args": ["t0", "x1"],
         "shape": [8, 3], "dtype": "float32", "family": "binary", "hint": None,
         "precision": "float32"}],
    "outputs": ["t0", "t1"], "out_shardings": None, "grad": False}

# A reduction over the split dim: its partial sums meet in an all-reduce
_SUM_PROGRAM = dict(_NAN_ORDER_PROGRAM, ops=_NAN_ORDER_PROGRAM["ops"] + [
    {"out": "t2", "expr": "tf.reduce_sum({0}, axis=0)", "args": ["t1"], "shape": [3],
     "dtype": "float32", "family": "reduce", "hint": None, "precision": "float32"}],
    outputs=["t2"], inputs=[dict(x, special=[]) for x in _NAN_ORDER_PROGRAM["inputs"]])


def _compiling_minimum(monkeypatch):
    """The XLA backend (GSPMD_TF_BACKEND=xla) with Minimum compiled into its segments."""
    from gspmd_tf.backends import segments
    declared = segments.xla_numerics_differ
    monkeypatch.setattr(segments, "xla_numerics_differ", lambda node, dtype: None
                        if node.op == "Minimum" else declared(node, dtype))
    monkeypatch.setenv("GSPMD_TF_BACKEND", "xla")


def test_a_value_xla_computes_on_one_device_too_is_not_a_mismatch(monkeypatch):
    from gspmd_tf.testing import differential
    _compiling_minimum(monkeypatch)
    scope = differential.program_scope(differential.source(_NAN_ORDER_PROGRAM), False,
                                       tf, gt)
    args = [tf.constant(a) for a in scope["args"]]
    eager = [t.numpy() for t in scope["f"](*args)]
    whole = [t.numpy() for t in tf.function(scope["f"], jit_compile=True)(*args)]
    got = gt.function(scope["f"], mesh=gt.Mesh.create((2, 4), ("a", "b")),
                      in_shardings=scope["in_shardings"])(*scope["args"])
    got = [t.numpy() for t in got]
    # the premise: neither eager TF nor the whole program under XLA gives these values
    assert not np.array_equal(got[0], eager[0], equal_nan=True)
    assert not np.array_equal(got[1], whole[1], equal_nan=True)
    status, detail = differential.run_program(_NAN_ORDER_PROGRAM, tf, gt)
    assert (status, detail) == ("pass", "equals single-device TF running XLA's segments "
                                "(jit_compile) (eager TF differs)")


def test_a_partitioning_bug_is_a_mismatch_though_xla_segments_are_references(
        monkeypatch):
    from gspmd_tf.backends import collective_emitters
    from gspmd_tf.testing import differential
    _compiling_minimum(monkeypatch)
    assert differential.run_program(_SUM_PROGRAM, tf, gt) == ("pass", "")
    add_n = collective_emitters.add_n
    # the injected bug: an all-reduce of several devices counts the first one twice
    monkeypatch.setattr(collective_emitters, "add_n",
                        lambda ts: add_n(list(ts) + list(ts[:1])) if len(ts) > 1 else add_n(ts))
    status, detail = differential.run_program(_SUM_PROGRAM, tf, gt)
    assert status == "mismatch", detail
    assert "relative error" in detail


def test_the_xla_backend_gives_tf_relu6_of_nan_in_one_element_shards():
    """Seed 64 #50 under --backend=auto (shrunk: relu6 of a (4,) tensor holding NaN split
    over 8 devices): XLA:CPU's Relu6 of a one-element tensor gives 0 for NaN, of a
    longer one NaN as TF, so single-device TF under XLA (the whole tensor) cannot tell
    it; Relu6's contract says XLA's values differ and it runs on TF's kernel."""
    x = np.array([np.nan, np.inf, 1.0, np.nan], np.float32)
    one = tf.function(tf.nn.relu6, jit_compile=True)(tf.constant(x[:1])).numpy()
    assert one[0] == 0.0  # why the contract says so
    mesh = gt.Mesh.create((8,), ("x",))
    got = gt.function(tf.nn.relu6, mesh=mesh, in_shardings=(P("x"),), backend="xla")(x)
    np.testing.assert_array_equal(got.numpy(), tf.nn.relu6(x).numpy())
