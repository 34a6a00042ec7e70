"""An op without a partitioning rule runs replicated; its warning names the user
shardings (annotation, argument) whose splits it drops, and where they were given."""

import numpy as np
import tensorflow as tf

import gspmd_tf as gt

P = gt.P


def _warnings(caplog, op):
    return [r.getMessage() for r in caplog.records if f"({op})" in r.getMessage()]


def test_warning_names_the_annotation_whose_split_is_gathered(mesh, caplog):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)

    @gt.function(mesh=mesh)
    def annotated(t):
        h = gt.mesh_split(tf.tanh(t) * 2.0, mesh, P("data", None))
        # CumulativeLogsumexp has no rule: it gathers h, dropping the annotated split
        return tf.math.cumulative_logsumexp(h + 1.0, axis=0)

    with caplog.at_level("WARNING", logger="gspmd_tf"):
        got = annotated(x).numpy()
    np.testing.assert_allclose(got, np.logaddexp.accumulate(np.tanh(x) * 2.0 + 1.0, axis=0),
                               rtol=1e-5)
    [warning] = _warnings(caplog, "CumulativeLogsumexp")
    low = annotated.lower(x)
    annotation = next(low.graph.tensor_name(ref) for ref in low.graph.annotations)
    operand = next(n for n in low.graph.nodes if n.op == "CumulativeLogsumexp").inputs[0]
    assert low.propagation.layout(operand).to_spec() == P("data")
    assert ("splits lost: 'CumulativeLogsumexp' gathers "
            f"{low.graph.tensor_name(operand)!r} (split {P('data')!r}: 'data' from the "
            f"annotation on {annotation!r})") in warning, warning


def test_grouped_warning_names_each_source_and_truncates(mesh, caplog):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)

    @gt.function(mesh=mesh, in_shardings=(P(None, "model"),))
    def chain(t):
        t = gt.mesh_split(t * 1.5, mesh, P("data", "model"))
        for _ in range(5):
            t = tf.math.cumulative_logsumexp(t, axis=1) * 0.5
            t = gt.mesh_split(t, mesh, P("data", "model"))  # split again after each
        return t

    with caplog.at_level("WARNING", logger="gspmd_tf"):
        got = chain(x).numpy()
    want = x * 1.5
    for _ in range(5):
        want = np.logaddexp.accumulate(want, axis=1) * 0.5
    np.testing.assert_allclose(got, want, rtol=1e-5)
    [warning] = _warnings(caplog, "CumulativeLogsumexp")
    assert warning.startswith("gspmd_tf: 5 ops (CumulativeLogsumexp) have no partitioning "
                              "rule"), warning
    lost = warning.split("; splits lost: ", 1)[1]
    # three ops spelled out, each naming the annotation before it, then a count
    assert lost.count(" gathers ") == 3
    assert lost.count("'data' and 'model' from the annotation on ") == 3
    assert lost.endswith("; ... (2 more of these ops gather split operands)"), lost


def test_split_from_an_argument_is_named_as_the_argument(mesh, caplog):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)

    @gt.function(mesh=mesh, in_shardings=(P("data", "model"),))
    def from_argument(t):
        return tf.math.cumulative_logsumexp(tf.exp(t * 0.1), axis=0)

    with caplog.at_level("WARNING", logger="gspmd_tf"):
        got = from_argument(x).numpy()
    np.testing.assert_allclose(got, np.logaddexp.accumulate(np.exp(x * 0.1), axis=0),
                               rtol=1e-5)
    [warning] = _warnings(caplog, "CumulativeLogsumexp")
    assert "(split P('data', 'model'): 'data' and 'model' from argument 0 " in warning, warning


def test_replicated_operands_lose_nothing(mesh, caplog):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)

    @gt.function(mesh=mesh, in_shardings=(P(),))
    def replicated(t):
        return tf.math.cumulative_logsumexp(t, axis=0)

    with caplog.at_level("WARNING", logger="gspmd_tf"):
        got = replicated(x).numpy()
    np.testing.assert_allclose(got, np.logaddexp.accumulate(x, axis=0), rtol=1e-5)
    # nothing was split: running replicated is no loss, and not warned about
    assert _warnings(caplog, "CumulativeLogsumexp") == []
    assert replicated.lower(x).program.replicated_ops == ["CumulativeLogsumexp"]


def test_op_inside_a_loop_body_names_the_annotation(mesh, caplog):
    x = np.arange(32, dtype=np.float32).reshape(8, 4) * 0.01

    @gt.function(mesh=mesh, in_shardings=(P("data", None),))
    def loop(t):
        def body(i, v):
            v = gt.mesh_split(v * 0.5, mesh, P("data", None))
            return i + 1, tf.math.cumulative_logsumexp(v, axis=0)
        return tf.while_loop(lambda i, v: i < 3, body, (tf.constant(0), t))[1]

    with caplog.at_level("WARNING", logger="gspmd_tf"):
        got = loop(x).numpy()
    want = x
    for _ in range(3):
        want = np.logaddexp.accumulate(want * 0.5, axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    [warning] = _warnings(caplog, "CumulativeLogsumexp")
    assert "(split P('data'): 'data' from the annotation on " in warning, warning
