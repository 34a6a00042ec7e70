"""The annotated global graph carries every reshard of gspmd-tf's program step by step,
device orders included, so XLA's SPMD partitioner moves what gspmd-tf moves.

The XLA check runs the HLO through XLA's GSPMD partitioner on 8 XLA CPU devices (JAX's
XLA, test-only: skipped when /work/jaxref is absent; by hand:
benchmarks/bridge_cases.py then benchmarks/xla_spmd_check.py, RESULTS section 11.1)."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.runtime.annotated import AnnotatedGraph

P = gt.P
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
JAX_PYTHON = os.environ.get("GSPMD_TF_JAX_PYTHON", "/work/jaxref/bin/python")
sys.path.insert(0, BENCHMARKS)

from bridge_cases import CASES, write_case  # noqa: E402

MESH = gt.Mesh.abstract((2, 4), ("data", "model"))


def _sharding_calls(hlo):
    return re.findall(r'custom_call_target="Sharding", sharding=(\{[^}]*\})', hlo)


def _swap(x):
    return gt.mesh_split(x * 2.0, MESH, P("model", "data")) + 1.0


def test_reshard_through_another_device_order_is_annotated_step_by_step():
    """P(data, model) -> P(model, data): the planner all-to-alls dim 0's data onto dim 1
    (split (model, data): the devices in another order than the mesh's), permutes it to
    (data, model), then all-to-alls model onto dim 0. The HLO reads the tensor through
    one sharding per step, in order."""
    low = gt.lower(_swap, MESH, (P("data", "model"),), args=[tf.TensorSpec((64, 256))])
    calls = _sharding_calls(low.as_text("hlo"))
    steps = ["{devices=[1,8]0,4,1,5,2,6,3,7}", "{devices=[1,8]0,1,2,3,4,5,6,7}",
             "{devices=[4,2]0,4,1,5,2,6,3,7}"]
    first = calls.index(steps[0])
    assert calls[first:first + 3] == steps
    assert [c.kind for c in low.collectives()] == ["all-to-all", "collective-permute",
                                                   "all-to-all"]


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


@pytest.mark.skipif(not os.path.exists(JAX_PYTHON),
                    reason=f"needs JAX's XLA at {JAX_PYTHON} (GSPMD_TF_JAX_PYTHON)")
def test_xla_moves_what_gspmd_tf_moves(tmp_path):
    """On 8 XLA CPU devices: values equal single device, and XLA's collectives are
    gspmd-tf's (same bytes per device) for a reshard through another device order and
    a dot's operand resharded in steps (before the step-by-step annotations XLA moved
    40960 B for the dot against gspmd-tf's 32768, and 16384 B for the swap, its own
    cheaper plan, against 24576: it now follows gspmd-tf's plan)."""
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
    assert rows["swap_axes"][3] == "2 all-to-all, 1 collective-permute"
    assert rows["partial_sum_to_batch_split"][4] == "32768"
