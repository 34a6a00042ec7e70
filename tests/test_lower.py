"""gt.lower: the stages after tracing, on a ConcreteFunction, an imported Graph or a
Python function, give what gt.function(...).lower(...) gives."""

import numpy as np
import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.graph.importer import import_graph
from gspmd_tf.layout import Layout

P = gt.P
MESH = gt.Mesh.create((2, 4), ("data", "model"))
SPECS = (tf.TensorSpec((8, 16), tf.float32), tf.TensorSpec((16, 32), tf.float32))
IN = (P("data"), P(None, "model"))


def mlp(x, w):
    return tf.reduce_sum(tf.nn.relu(x @ w), axis=1), x @ w


def _summary(lowered):
    return ([str(s) for s in lowered.input_shardings],
            [str(s) for s in lowered.output_shardings],
            [(c.kind, c.shape, c.axes) for c in lowered.collectives()],
            [n.op for n in lowered.program.graph.nodes])


def test_lower_matches_gt_function_on_every_kind_of_program():
    expected = _summary(gt.function(mlp, mesh=MESH, in_shardings=IN).lower(*SPECS))
    concrete = tf.function(mlp, autograph=False).get_concrete_function(*SPECS)
    from_concrete = gt.lower(concrete, MESH, IN)
    from_graph = gt.lower(import_graph(concrete), MESH, IN)
    from_python = gt.lower(mlp, MESH, IN, args=SPECS)
    assert _summary(from_concrete) == expected
    assert _summary(from_graph) == expected
    assert _summary(from_python) == expected
    # the reduce over the split "model" dim leaves a partial sum: one all-reduce
    assert [c.kind for c in from_concrete.collectives()] == ["all-reduce"]
    assert set(from_concrete.stage_seconds) == {"import", "propagate", "partition"}
    assert from_graph.structured_outputs is None


def test_lowered_program_runs_and_matches_single_device():
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s.shape).astype(np.float32) for s in SPECS)
    concrete = tf.function(mlp, autograph=False).get_concrete_function(*SPECS)
    lowered = gt.lower(concrete, MESH, IN, (P(), P("data", "model")))
    assert [str(s) for s in lowered.output_shardings] == [
        "{replicated}", "{devices=[2,4]0,1,2,3,4,5,6,7}"]
    run = lowered.compile()
    inputs = [gt.ShardedTensor.from_value(v, MESH, s.to_layout(MESH, 2)).shards
              for v, s in zip((x, w), lowered.input_shardings)]
    outs = run(inputs)
    got = [gt.ShardedTensor(MESH, layout, lowered.graph.shape(ref), lowered.graph.dtype(ref),
                            shards).numpy()
           for ref, layout, shards in zip(lowered.graph.outputs,
                                          lowered.program.output_layouts, outs)]
    for value, want in zip(got, mlp(tf.constant(x), tf.constant(w))):
        np.testing.assert_allclose(value, want.numpy(), rtol=1e-5, atol=1e-5)


def test_lower_errors_name_what_to_change():
    concrete = tf.function(mlp, autograph=False).get_concrete_function(*SPECS)
    with pytest.raises(gt.ShardingError, match="2 inputs but in_shardings has 1"):
        gt.lower(concrete, MESH, (P("data"),))
    with pytest.raises(gt.ShardingError, match="give args="):
        gt.lower(mlp, MESH, IN)
    with pytest.raises(gt.ShardingError, match="already traced"):
        gt.lower(concrete, MESH, IN, args=SPECS)
    with pytest.raises(gt.ShardingError, match="needs a gt.Mesh"):
        gt.lower(concrete, (2, 4), IN)
    with pytest.raises(gt.ShardingError, match="one entry per flat output"):
        gt.lower(concrete, MESH, IN, P())


def test_lowered_is_complete_when_built():
    """gt.lower and gt.function share the trace stage and one LowerOptions record; the
    Lowered they return carries everything from its construction on."""
    from_python = gt.lower(mlp, MESH, IN, args=SPECS, windowed_einsum=1 << 20)
    assert from_python.options.mesh == MESH
    assert from_python.options.windowed_einsum == 1 << 20
    assert from_python.name == "gt.function 'mlp'"
    assert set(from_python.stage_seconds) == {"import", "propagate", "partition"}
    assert len(from_python.structured_outputs) == 2
    assert from_python.committed_args == frozenset()
    # an argument whose in_shardings entry is None enters in its ShardedTensor's layout
    x = gt.ShardedTensor.from_value(np.ones((8, 16), np.float32), MESH,
                                    Layout.from_spec(MESH, P("model"), 2))
    f = gt.function(mlp, mesh=MESH, in_shardings=(None, IN[1]))
    lowered = f.lower(x, SPECS[1])
    assert lowered.committed_args == frozenset({0})
    assert lowered.input_shardings[0] == x.sharding
    assert lowered.options is f.options
