"""The annotated global graph carries every reshard of gspmd-tf's program step by step,
device orders included, so XLA's SPMD partitioner moves what gspmd-tf moves.

The XLA check runs the HLO through XLA's GSPMD partitioner on 8 XLA CPU devices (JAX's
XLA, test-only: skipped unless GSPMD_TF_JAX_PYTHON names JAX's python; by hand:
benchmarks/bridge_cases.py then benchmarks/xla_spmd_check.py, RESULTS section 11.1)."""

import os
import re
import subprocess

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.runtime.annotated import AnnotatedGraph
from gspmd_tf.testing.bridge_cases import CASES, write_case
from util import JAX_PYTHON, requires_jax_python

P = gt.P
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")

MESH = gt.Mesh.abstract((2, 4), ("data", "model"))


def _sharding_calls(hlo):
    return re.findall(r'custom_call_target="Sharding", sharding=(\{[^}]*\})', hlo)


def _swap(x):
    return gt.mesh_split(x * 2.0, MESH, P("model", "data")) + 1.0


def test_reshard_through_another_device_order_is_annotated_step_by_step():
    """P(data, model) -> P(model, data): the planner all-to-alls model's minor half (a
    sub-axis) from dim 1 onto dim 0 (dim 0 split over (data, model's minor half): the
    devices in another order than the mesh's), then permutes to the target, as XLA does.
    The HLO reads the tensor through one sharding per step, in order."""
    low = gt.lower(_swap, MESH, (P("data", "model"),), args=[tf.TensorSpec((64, 256))])
    calls = _sharding_calls(low.as_text("hlo"))
    steps = ["{devices=[2,4]0,1,2,3,4,5,6,7}", "{devices=[4,2]0,2,1,3,4,6,5,7}",
             "{devices=[4,2]0,4,1,5,2,6,3,7}"]
    first = calls.index(steps[1]) - 1
    assert calls[first:first + 3] == steps
    assert [c.kind for c in low.collectives()] == ["all-to-all", "collective-permute"]


def test_operand_reshard_of_a_dot_is_annotated_step_by_step():
    """einsum bsh,hm->bsm with b split P(model, data) (devices in the mesh's order
    transposed), resharded for the dot to P(None, model) in two steps (gather data,
    all-to-all model onto dim 1): the dot reads b through both layouts, in order."""
    def dot(a, b):
        y = tf.einsum("bsh,hm->bsm", a, b)
        return gt.mesh_split(y, MESH, P("data", None, "model")) * 2.0
    low = gt.lower(dot, MESH, (P(None, None, "model"), P("model", "data")),
                   args=[tf.TensorSpec((2, 128, 64)), tf.TensorSpec((64, 256))])
    calls = _sharding_calls(low.as_text("hlo"))
    steps = ["{devices=[4,2]0,4,1,5,2,6,3,7}",
             "{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}",
             "{devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"]
    first = calls.index(steps[0])
    assert calls[first:first + 3] == steps
    assert [c.kind for c in low.collectives()] == ["all-gather", "all-gather", "all-to-all"]


def test_annotated_steps_keep_the_values():
    """Outside XLA the sharding ops are identities: the step-by-step annotations leave
    the function's values alone."""
    low = gt.lower(_swap, MESH, (P("data", "model"),), args=[tf.TensorSpec((64, 256))])
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    got = tf.function(AnnotatedGraph(low).emit, autograph=False)(x)[0]
    np.testing.assert_allclose(got.numpy(), x * 2.0 + 1.0, rtol=1e-6)


@requires_jax_python
def test_xla_moves_what_gspmd_tf_moves(tmp_path):
    """On 8 XLA CPU devices: values equal single device, and XLA's collectives are
    gspmd-tf's (same bytes per device) for a reshard through another device order and
    a dot's operand resharded in steps (before the step-by-step annotations XLA moved
    40960 B for the dot against gspmd-tf's 32768; the swap is XLA's own plan, over a
    sub-axis of model, in both)."""
    names = ["swap_axes", "partial_sum_to_batch_split"]
    assert set(names) <= set(CASES)
    for name in names:
        write_case(name, str(tmp_path))
    run = subprocess.run([JAX_PYTHON, os.path.join(BENCHMARKS, "xla_spmd_check.py"),
                          f"--cases={tmp_path}"], capture_output=True, text=True,
                         timeout=300, cwd=BENCHMARKS)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = {}
    for line in run.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in names:
            rows[cells[0]] = cells
    assert sorted(rows) == sorted(names), run.stdout
    for name, (_, devices, err, xla, xla_bytes, ours, our_bytes, ok) in rows.items():
        assert devices == "8" and float(err) <= 1e-5, rows[name]
        assert xla_bytes == our_bytes and ok == "yes", rows[name]
    assert rows["swap_axes"][3] == "1 all-to-all, 1 collective-permute"
    assert rows["partial_sum_to_batch_split"][4] == "32768"


# ---- captured gt.Variables: sharded parameters in, updated sharded values out

def _make_step(w):
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.nn.relu(x @ w)))
        w.assign_sub(0.01 * tape.gradient(loss, w))
        return loss
    return step


def _parameters_and_results(hlo):
    """(parameter shardings by number, result types) of the entry computation."""
    entry = hlo[hlo.index("\nENTRY"):]
    params = dict((int(n), s) for n, s in re.findall(
        r"parameter\((\d+)\).*?sharding=(\{[^}]*\})", entry))
    results = re.search(r"\) -> \((.*)\) \{", entry.splitlines()[1]).group(1)
    return params, results


def test_training_step_on_a_captured_variable_compiles_to_hlo(mesh):
    """The variable enters as a parameter with its sharding and leaves updated after
    the loss (TF's bridge cannot give a resource's update a sharding in a tf.function,
    so the annotated graph carries the variable as a value)."""
    w = gt.Variable(np.ones((16, 32), np.float32), mesh, P(None, "model"))
    low = gt.lower(_make_step(w), mesh, (P("data"),), args=[tf.TensorSpec((8, 16))])
    params, results = _parameters_and_results(low.as_text("hlo"))
    assert params == {0: str(low.input_shardings[0]), 1: str(w.sharding)}
    assert results == "f32[], f32[16,32]"


def test_other_uses_of_a_captured_variable_are_refused(mesh):
    w = gt.Variable(np.ones((16, 32), np.float32), mesh, P(None, "model"))

    def step(x):
        g = tf.ones((16, 32)) * tf.reduce_sum(x)
        tf.raw_ops.ResourceApplyGradientDescent(var=w.handle, alpha=0.1, delta=g)
        return tf.reduce_sum(x)
    low = gt.lower(step, mesh, (P("data"),), args=[tf.TensorSpec((8, 16))])
    with pytest.raises(gt.ShardingError, match="ResourceApplyGradientDescent.*v.assign_sub"):
        low.as_text("hlo")


def test_tpu_program_trains_captured_variables(mesh):
    """The TPU program's code path on TF's default strategy (CPU): two steps update the
    program's copy of the variable as single-device TF does; the gt.Variable is left
    as it was."""
    from gspmd_tf import tpu
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal((16, 32)).astype(np.float32)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    w = gt.Variable(w0, mesh, P(None, "model"))
    low = gt.lower(_make_step(w), mesh, (P("data"),), args=[tf.TensorSpec((8, 16))])
    run = tpu.TPUSystem(tf.distribute.get_strategy(), 8).program(low)
    reference = tf.Variable(w0)
    step = tf.function(_make_step(reference))
    for _ in range(2):
        got = run(x)[0].numpy()
        np.testing.assert_allclose(got, step(x).numpy(), rtol=1e-5)
        np.testing.assert_allclose(run.variables[0].numpy(), reference.numpy(), rtol=1e-5,
                                   atol=1e-5)
    assert np.abs(reference.numpy() - w0).max() > 0.1  # the steps moved the weights
    np.testing.assert_array_equal(w.numpy(), w0)


@requires_jax_python
def test_xla_runs_training_steps_on_captured_variables(tmp_path):
    """benchmarks/bridge_cases.py's train_step_variables (an SGD step of a Megatron MLP
    whose weights are captured gt.Variables) and embedding_step_variables (a gathered
    table updated by a scatter) on 8 XLA CPU devices: the loss and the updated
    variables equal single-device TF's, with gspmd-tf's collective bytes."""
    names = {"train_step_variables": 2, "embedding_step_variables": 1}  # -> variables
    for name, count in names.items():
        write_case(name, str(tmp_path))
        data = np.load(tmp_path / f"{name}.npz")
        # inputs: the arguments, then the variables
        arguments = sum(f.startswith("in") for f in data.files) - count
        for k in range(count):  # the updates are large enough for the check to see them
            before, after = data[f"in{arguments + k}"], data[f"out{1 + k}"]
            assert np.abs(after - before).max() > 1e-2, name
    run = subprocess.run([JAX_PYTHON, os.path.join(BENCHMARKS, "xla_spmd_check.py"),
                          f"--cases={tmp_path}"], capture_output=True, text=True,
                         timeout=300, cwd=BENCHMARKS)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    for name in names:
        row = next(line for line in run.stdout.splitlines()
                   if line.startswith(f"| {name} "))
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert float(cells[2]) <= 1e-5 and cells[4] == cells[6] and cells[7] == "yes", row
