"""The backend protocol (gspmd_tf/backends/base.py): every built-in backend has a
capabilities record, and compile(program) returns a Compiled object that runs and says
what it costs (multiply-adds from the op contracts, collective bytes), what memory its
arguments and results take, and prints its program."""

import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.backends import base
from gspmd_tf.backends.auto import AutoBackend
from gspmd_tf.backends.local import LocalBackend
from gspmd_tf.backends.xla import XlaBackend
from util import assert_close, randn, single_device

P = gt.P


@pytest.mark.parametrize("cls,semantics,segments,workers", [
    (LocalBackend, "tf", False, True), (XlaBackend, "xla", True, False),
    (AutoBackend, "xla", True, True)])
def test_capabilities(cls, semantics, segments, workers):
    mesh = gt.Mesh.create((2, 4), ("data", "model"))
    caps = cls(mesh).capabilities
    assert isinstance(caps, base.Capabilities)
    assert caps.semantics == semantics and caps.compiles_segments == segments
    assert caps.several_workers == workers and caps.device_kinds == {"CPU"}
    # collectives among one process's devices are copies: a reduce-scatter is native
    assert caps.copy_collectives and caps.native_reduce_scatter
    with pytest.raises(AttributeError):
        caps.semantics = "tf"  # frozen


@pytest.mark.parametrize("cls", [LocalBackend, XlaBackend])
def test_compiled_runs_and_reports_its_cost(cls, rng):
    """A matmul with its contracted dim split: each device multiplies (8 x 6) by (6 x 4)
    and all-reduces an 8 x 4 float32 partial sum."""
    mesh = gt.Mesh.create((2,), ("x",))
    args = [randn(rng, 8, 12), randn(rng, 12, 4)]
    lowered = gt.lower(tf.matmul, mesh, (P(None, "x"), P("x", None)), args=args)
    program = lowered.program.graph
    compiled = cls(mesh).compile(program, name="matmul")
    assert isinstance(compiled, base.Compiled) and compiled.program is program
    cost = compiled.cost_analysis()
    assert cost["multiply_adds"] == 8 * 4 * 6
    assert cost["collectives"] == 1 and cost["collective_bytes"] == 8 * 4 * 4
    assert compiled.memory() == {"argument_bytes": (8 * 6 + 6 * 4) * 4,
                                 "output_bytes": 8 * 4 * 4}
    text = compiled.as_text()
    assert "MatMul(" in text and "gt.AllReduce(" in text and text.splitlines()[-1].startswith(
        "return %")
    shards = [[args[0][:, 6 * d:6 * d + 6] for d in range(2)], [args[1][6 * d:6 * d + 6]
                                                       for d in range(2)]]
    outputs = compiled(shards)
    want = single_device(tf.matmul, args)[0]
    for d in range(2):
        assert_close(outputs[0][d].numpy(), want)


def test_program_text_indents_regions(rng):
    mesh = gt.Mesh.create((2,), ("x",))

    def loop(x):
        return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0),
                             (tf.constant(0), x))[1]

    program = gt.lower(loop, mesh, (P("x"),), args=[randn(rng, 4, 3)]).program.graph
    text = base.program_text(program)
    assert "\n  region 1:\n    %0 = gt.Input()" in text and "\n    return %" in text
