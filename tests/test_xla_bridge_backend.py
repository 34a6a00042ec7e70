"""The XLA-bridge backend (backends/xla_bridge.py), the TPU route as a peer of the other
backends: its capabilities, compile() of the annotated global program on an abstract
mesh, as_text() the annotated graph, a clear error when there is no TPU to run on, and,
without a TPU, the same annotated program compiled by TF's CPU XLA jit and run through
a strategy, both equal to single-device TF."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import XlaBridgeBackend, base
from gspmd_tf.backends.local import LocalBackend
from gspmd_tf.backends.xla_bridge import TPUNotFoundError
from gspmd_tf.runtime.annotated import GlobalProgram, annotated_text
from util import assert_close, randn, single_device

P = gt.P
MESH = gt.Mesh.abstract((2, 4), ("data", "model"))


def _mlp(x, w1, w2):
    return tf.nn.relu(x @ w1) @ w2


SPECS = [tf.TensorSpec((8, 16)), tf.TensorSpec((16, 32)), tf.TensorSpec((32, 16))]


@pytest.fixture(scope="module")
def lowered():
    return gt.lower(_mlp, MESH, (P("data"), P(None, "model"), P("model")), args=SPECS)


def test_capabilities_say_tpu_and_whole_program():
    caps = XlaBridgeBackend(MESH).capabilities
    assert caps.device_kinds == {"TPU"} and caps.whole_program
    assert caps.semantics == "xla" and caps.native_reduce_scatter
    assert not caps.copy_collectives and not caps.compiles_segments
    assert not LocalBackend(gt.Mesh.create((2,), ("x",))).capabilities.whole_program


def test_compiles_on_an_abstract_mesh_and_prints_the_annotated_graph(lowered):
    compiled = XlaBridgeBackend(MESH).compile(GlobalProgram(lowered))
    assert isinstance(compiled, base.Compiled)
    text = compiled.as_text()
    assert text == annotated_text(lowered)
    hidden = str(lowered.sharding_of("Relu"))
    assert hidden == "{devices=[2,4]0,1,2,3,4,5,6,7}" and f"sharding={hidden}" in text
    # its cost is gspmd-tf's per-device program of the same explicit-reshard program
    assert compiled.cost_analysis() == base.program_cost(lowered.program.graph)


def test_call_without_a_tpu_is_a_clear_error(lowered):
    compiled = XlaBridgeBackend(MESH).compile(GlobalProgram(lowered), "mlp")
    with pytest.raises(TPUNotFoundError, match="mlp.*gspmd_tf.tpu.connect"):
        compiled(*[np.zeros(s.shape, np.float32) for s in SPECS])


def test_cpu_xla_jit_runs_the_annotated_program_to_single_device_values(lowered, rng):
    args = [randn(rng, *s.shape) for s in SPECS]
    program = GlobalProgram(lowered)
    got = tf.function(program.emit, jit_compile=True, autograph=False)(*args)
    assert_close(got[0].numpy(), single_device(_mlp, args)[0])


def test_runs_through_a_strategy_to_single_device_values(lowered, rng):
    """TF's default strategy: the TPU code path (one replica, global values), on CPU."""
    args = [randn(rng, *s.shape) for s in SPECS]
    compiled = XlaBridgeBackend(MESH, tf.distribute.get_strategy()).compile(
        GlobalProgram(lowered))
    assert_close(compiled(*args)[0].numpy(), single_device(_mlp, args)[0])
