"""The annotated global graph through TF's XLA bridge: Lowered.as_text("hlo"), and the HLO
run through XLA's SPMD partitioner on 8 XLA CPU devices (JAX's XLA, test-only: skipped
unless GSPMD_TF_JAX_PYTHON names JAX's python; the same check by hand is in
benchmarks/bridge_cases.py)."""

import os
import re
import subprocess

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.runtime.annotated import AnnotatedGraph, explicit_reshards
from gspmd_tf.testing.bridge_cases import CASES, write_case
from util import JAX_PYTHON, requires_jax_python

P = gt.P
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def _mlp(x, w1, w2):
    return tf.nn.relu(x @ w1) @ w2


MLP_SPECS = [tf.TensorSpec((16, 32)), tf.TensorSpec((32, 64)), tf.TensorSpec((64, 32))]


def _parameters(hlo):
    """{parameter number: sharding text} of the entry computation."""
    out = {}
    for line in hlo.splitlines():
        m = re.search(r"= \S+ parameter\((\d+)\).*?sharding=(\{[^}]*\})", line)
        if m and "arg" in line.split("=")[0]:
            out[int(m.group(1))] = m.group(2)
    return out


def _sharding_calls(hlo):
    return re.findall(r'custom_call_target="Sharding", sharding=(\{[^}]*\})', hlo)


def test_hlo_has_every_sharding_of_the_lowered_program():
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    low = gt.lower(_mlp, mesh, (P("data"), P(None, "model"), P("model")), args=MLP_SPECS)
    hlo = low.as_text("hlo")
    assert hlo.startswith("HloModule")
    params = _parameters(hlo)
    assert [params[i] for i in range(3)] == [str(s) for s in low.input_shardings]
    # every non-constant tensor of the traced graph is followed by its sharding (HLO
    # lists instructions in its own order)
    expected = sorted(str(low.sharding_of(node.name)) for node in low.graph.nodes
                      if node.op != "Const")
    assert sorted(_sharding_calls(hlo)) == expected
    assert "{devices=[2,4]0,1,2,3,4,5,6,7}" in expected  # the hidden layer: data x model
    assert hlo.count(" dot(") == 2


def test_hlo_on_an_abstract_mesh_of_2048_devices():
    mesh = gt.Mesh.abstract((32, 64), ("data", "model"))
    specs = [tf.TensorSpec((64, 128)), tf.TensorSpec((128, 256)), tf.TensorSpec((256, 128))]
    low = gt.lower(_mlp, mesh, (P("data"), P(None, "model"), P("model")), args=specs)
    params = _parameters(low.as_text("hlo"))
    assert [params[i] for i in range(3)] == [str(s) for s in low.input_shardings]
    assert low.input_shardings[1].tile_assignment.shape == (1, 64, 32)


def test_operand_reshards_are_annotated_on_the_edge():
    """w's contracting dim is split over data, x's over model: the partitioner reshards
    w to P("model") for the dot; the HLO reads w through a sharding of that layout, so
    XLA's partitioner reshards where gspmd-tf did."""
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    low = gt.lower(lambda x, w: x @ w, mesh, (P("data", "model"), P("model", "data")),
                   args=[tf.TensorSpec((16, 32)), tf.TensorSpec((32, 64))])
    resharded = gt.Sharding.from_spec(mesh, P("model"), 2)
    needs, _ = explicit_reshards(low)
    assert gt.Sharding.from_layout(mesh, needs["matmul", "w"][1]) == resharded
    assert str(resharded) in _sharding_calls(low.as_text("hlo"))
    tensors_only = AnnotatedGraph(low, operand_shardings=False)
    hlo = tf.function(tensors_only.emit, jit_compile=True).experimental_get_compiler_ir(
        *[tf.TensorSpec((16, 32)), tf.TensorSpec((32, 64))])(stage="hlo")
    assert str(resharded) not in _sharding_calls(hlo)


def test_captured_variable_is_a_sharded_parameter(mesh):
    w2 = gt.Variable(np.ones((64, 32), np.float32), mesh, P("model"))

    def f(x, w1):
        return tf.reduce_sum(_mlp(x, w1, w2))
    low = gt.function(f, mesh=mesh, in_shardings=(P("data"), P(None, "model"))).lower(
        *MLP_SPECS[:2])
    params = _parameters(low.as_text("hlo"))
    assert params[2] == str(w2.sharding)
    assert len(params) == 3


def test_control_flow_bodies_become_functions_of_the_hlo():
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))

    def f(x):
        return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0),
                             (tf.constant(0), x))[1]
    low = gt.lower(f, mesh, (P("data"),), args=[tf.TensorSpec((8, 4))])
    hlo = low.as_text("hlo")
    assert hlo.count(" while(") == 1
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    got = tf.function(AnnotatedGraph(low).emit, autograph=False)(x)[0]
    np.testing.assert_array_equal(got.numpy(), x * 8)


def test_unknown_dialect():
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    low = gt.lower(_mlp, mesh, (P("data"), None, None), args=MLP_SPECS)
    with pytest.raises(gt.ShardingError, match="'hlo'"):
        low.as_text("stablehlo")


def test_annotated_graph_computes_the_function():
    """Outside XLA the XlaSharding ops are identities: the emitted graph is the traced
    function (this is what runs under TPUStrategy, where XLA partitions it)."""
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))
    low = gt.lower(_mlp, mesh, (P("data"), P(None, "model"), P("model")), args=MLP_SPECS)
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s.shape).astype(np.float32) for s in MLP_SPECS]
    emitted = tf.function(AnnotatedGraph(low).emit, autograph=False)
    got = emitted(*values)[0].numpy()
    np.testing.assert_allclose(got, _mlp(*values).numpy(), rtol=1e-5, atol=1e-5)


@requires_jax_python
def test_xla_spmd_partitioner_runs_the_hlo(tmp_path):
    """matmul data and model parallel, a spatially split conv, a while loop and a cond,
    a 2-layer Transformer: values equal single device, XLA's collective bytes <=
    gspmd-tf's."""
    for name in CASES:
        write_case(name, str(tmp_path))
    run = subprocess.run([JAX_PYTHON, os.path.join(BENCHMARKS, "xla_spmd_check.py"),
                          f"--cases={tmp_path}"], capture_output=True, text=True,
                         timeout=300, cwd=BENCHMARKS)
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip() for row in rows] == sorted(CASES), run.stderr[-3000:]
    assert all(row.rstrip(" |").endswith("yes") for row in rows), run.stdout
    assert run.returncode == 0, run.stderr[-3000:]
