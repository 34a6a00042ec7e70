"""Provenance: every collective names the graph op that needs it, the user's source line
that created that op, the shardings it converts between and why; a combined all-reduce
keeps the origins of all its members; the text and HTML reports show them."""

import inspect

import pytest
import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.runtime.sources import is_user_frame
from gspmd_tf.spmd.provenance import REASONS

P = gt.P
MESH = gt.Mesh.abstract((2, 4), ("data", "model"))
SPEC = tf.TensorSpec


def _line_of(fn, text):
    """"test_provenance.py:LINE" of the line of `fn` containing `text`."""
    lines, first = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"test_provenance.py:{first + offset}"


def conflict_mlp(x, w1, w2):
    h = tf.nn.relu(tf.matmul(x, w1, name="first"))
    # h comes split over "model" on its columns, w2 on its own columns: h is gathered
    return tf.matmul(h, w2, name="second")


def contraction(x, w):
    return tf.matmul(x, w, name="contract")


def two_sums(x, w1, w2):
    a = tf.matmul(x, w1, name="sum_a")
    b = tf.matmul(x, w2, name="sum_b")
    return a, b


@pytest.fixture(scope="module")
def conflict():
    return gt.lower(conflict_mlp, MESH, (P("data"), P(None, "model"), P(None, "model")),
                    args=(SPEC((8, 16)), SPEC((16, 32)), SPEC((32, 16))))


def test_gather_names_op_source_line_tensor_shardings_and_reason(conflict):
    [gather] = conflict.collectives()
    assert gather.kind == "all-gather"
    assert gather.op == "second"
    assert gather.source == _line_of(conflict_mlp, 'name="second"')
    [origin] = gather.origins
    assert origin.tensor == "Relu"
    assert origin.from_spec == P("data", "model") and origin.to_spec == P("data")
    assert str(gather.from_sharding) == str(gt.Sharding.from_spec(MESH, P("data", "model"), 2))
    assert str(gather.to_sharding) == str(gt.Sharding.from_spec(MESH, P("data"), 2))
    assert gather.reason == "operand layout" and gather.reason in REASONS


def test_contraction_all_reduce_has_reason_contraction():
    low = gt.lower(contraction, MESH, (P("data", "model"), P("model")),
                   (P("data"),), args=(SPEC((8, 16)), SPEC((16, 4))))
    [reduce] = low.collectives()
    assert reduce.kind == "all-reduce" and reduce.reason == "contraction"
    assert reduce.op == "contract"
    assert reduce.source == _line_of(contraction, 'name="contract"')
    assert reduce.origins[0].to_spec == P("data")


def test_out_shardings_reshard_is_an_annotation():
    low = gt.lower(lambda x: tf.nn.relu(x), MESH, (P("data"),), (P(None, "model"),),
                   args=(SPEC((8, 16)),))
    reasons = {c.reason for c in low.collectives()}
    assert reasons == {"annotation"}, low.report()


def test_op_without_rule_gathers_with_reason_no_rule():
    def f(x):
        return tf.math.cumulative_logsumexp(x, axis=0)

    low = gt.lower(f, MESH, (P("data"),), args=(SPEC((8, 4)),))
    gathers = [c for c in low.collectives() if c.kind == "all-gather"]
    assert gathers and {c.reason for c in gathers} == {"no rule"}, low.report()
    assert gathers[0].op.startswith("Cumulative")


def test_combined_all_reduce_keeps_every_origin():
    low = gt.lower(two_sums, MESH, (P(None, "model"), P("model"), P("model")),
                   args=(SPEC((8, 16)), SPEC((16, 4)), SPEC((16, 4))))
    [combined] = low.collectives()
    assert combined.kind == "all-reduce"
    assert [o.op for o in combined.origins] == ["sum_a", "sum_b"]
    assert {o.reason for o in combined.origins} == {"contraction"}
    assert [o.source for o in combined.origins] == [
        _line_of(two_sums, 'name="sum_a"'), _line_of(two_sums, 'name="sum_b"')]


def test_reports_show_op_source_and_reason(conflict):
    gather = conflict.collectives()[0]
    text = conflict.report()
    assert f"for op 'second' ({gather.source}): 'Relu' P('data', 'model') -> P('data'), " \
           "operand layout" in text
    page = conflict.report(format="html")
    assert gather.source in page and "operand layout" in page
    # the op that needs it is marked in the drawn graph
    assert 'data-name="second" data-spec="P(&#x27;data&#x27;, &#x27;model&#x27;)" ' \
           'data-collectives="1">' in page


def test_library_frames_are_not_user_frames():
    assert not is_user_frame(tf.__file__)
    assert not is_user_frame(gt.__file__)
    assert not is_user_frame(inspect.__file__)
    assert is_user_frame(__file__)


def test_a_users_folder_named_like_a_library_holds_user_frames(tmp_path):
    # only the libraries' own directories are theirs: /home/me/keras/train.py is the user's
    for name in ("keras", "tensorflow", "gspmd_tf"):
        script = tmp_path / name / "train.py"
        script.parent.mkdir()
        script.write_text("")
        assert is_user_frame(str(script)), name


def test_gradient_collectives_point_at_the_forward_line():
    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            y = tf.matmul(x, w, name="forward")
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, w)

    low = gt.lower(step, MESH, (P("data"), P()), args=(SPEC((8, 16)), SPEC((16, 4))))
    [reduce] = low.collectives()  # the weight gradient summed over the batch split
    assert reduce.op.startswith("gradient_tape/forward")
    assert reduce.source == _line_of(step, 'name="forward"')


def two_scans(x):
    return tf.cumsum(x, axis=0, name="running_sum"), tf.math.cumprod(x, axis=0,
                                                                     name="running_product")


def test_a_move_needed_by_two_ops_names_both_and_counts_its_bytes_once():
    """Two ops that need the same tensor in the same layout share one all-gather (the
    export pass lowers the move once); it names both ops, the later one as sharing it,
    and the per-layer accounting counts its bytes once."""
    lowered = gt.lower(two_scans, MESH, (P("model"),), args=(SPEC((8, 4)),))
    [gather] = lowered.collectives()
    assert gather.kind == "all-gather"
    assert [o.op for o in gather.origins] == ["running_sum", "running_product"]
    assert [o.bytes for o in gather.origins] == [gather.bytes, 0]
    assert sum(layer.collective_bytes for layer in lowered.layers()) == gather.bytes
