"""Explicit reshards (spmd/export.py): the partitioner records every layout change as a
gt.Reshard node of the program (global shape, source and target layouts, the op that
needs it and why), and one export pass lowers each to the collectives the planner plans.
Checked as text, before and after export, the way XLA's and Shardy's partitioner tests
check theirs: each expected line must appear, in order, in the printed program (node
names after '#' left out). The annotated global graph for XLA's partitioner is derived
from the same explicit program: each gt.Reshard's target is an XlaSharding annotation
where the op needs it, checked as the text of that TF graph."""

import tensorflow as tf

import gspmd_tf as gt
from gspmd_tf.runtime.annotated import annotated_text

P = gt.P
S = tf.TensorSpec
MESH = gt.Mesh.abstract((2,), ("x",))


def assert_lines_in_order(text, expected):
    """Every line of `expected` is a line of `text` (its '  # name' comment dropped),
    in this order."""
    lines = [line.split("  # ")[0] for line in text.splitlines()]
    position = 0
    for want in expected:
        assert want in lines[position:], f"{want!r} not found after line {position} of:\n{text}"
        position = lines.index(want, position) + 1


def _texts(fn, in_shardings, out_shardings, specs):
    low = gt.lower(fn, MESH, in_shardings, out_shardings, args=specs)
    return low.as_text("explicit"), low.as_text("spmd")


def test_matmul_operand_gathered_by_one_reshard_then_an_all_gather():
    """x's rows and w's contracted rows are split over x: the cheapest plan gathers w
    (12 x 4) for the dot."""
    before, after = _texts(lambda x, w: x @ w, (P("x", None), P("x", None)), None,
                           [S((8, 12)), S((12, 4))])
    assert_lines_in_order(before, [
        "%1 = gt.Input() : float32[6, 4] {index=1, layout=P('x')}",
        "%2 = gt.Reshard(%1) : float32[12, 4] {shape=(12, 4), source=P('x'), target=P(), "
        "needed_by='matmul', reason='operand layout', tensor='w'}",
        "%3 = MatMul(%0, %2) : float32[4, 4]"])
    assert_lines_in_order(after, [
        "%2 = gt.AllGather(%1) : float32[12, 4] {axes=('x',), dim=0}",
        "%3 = MatMul(%0, %2) : float32[4, 4]"])
    assert "gt.Reshard" not in after and "gt.AllGather" not in before


def test_transpose_result_moved_to_the_output_layout_by_an_all_to_all():
    before, after = _texts(tf.transpose, (P("x", None),), (P("x", None),), [S((8, 4))])
    assert_lines_in_order(before, [
        "%2 = Transpose(%0, %1) : float32[4, 4]",
        "%3 = gt.Reshard(%2) : float32[2, 8] {shape=(4, 8), source=P(None, 'x'), "
        "target=P('x'), needed_by='Identity', reason='operand layout', tensor='transpose'}"])
    assert_lines_in_order(after, [
        "%2 = Transpose(%0, %1) : float32[4, 4]",
        "%3 = gt.AllToAll(%2) : float32[2, 8] {axes=('x',), split_dim=0, concat_dim=1}"])


def test_partial_sum_of_a_contraction_reduce_scattered():
    before, after = _texts(lambda x, w: x @ w, (P(None, "x"), P("x", None)), (P("x", None),),
                           [S((8, 12)), S((12, 4))])
    assert_lines_in_order(before, [
        "%2 = MatMul(%0, %1) : float32[8, 4]",
        "%3 = gt.Reshard(%2) : float32[4, 4] {shape=(8, 4), source=P() partial-sum('x',), "
        "target=P('x'), needed_by='matmul', reason='contraction', tensor='matmul'}"])
    assert_lines_in_order(after, [
        "%2 = MatMul(%0, %1) : float32[8, 4]",
        "%3 = gt.ReduceScatter(%2) : float32[4, 4] {axes=('x',), dim=0, reduce_op='sum'}"])


def test_one_tensor_needed_in_one_layout_by_two_ops_is_moved_once():
    """Each op's need is its own gt.Reshard (so each names its op); export lowers the
    two to one all-gather."""
    def two_users(x, w):
        return x @ w, tf.nn.relu(x) @ w

    low = gt.lower(two_users, MESH, (P("x", None), P("x", None)), None,
                   args=[S((8, 12)), S((12, 4))])
    needed_by = sorted(node.params["needed_by"] for node in low.program.explicit.nodes
                       if node.op == "gt.Reshard" and node.params.get("tensor") == "w")
    assert len(needed_by) == 2 and len(set(needed_by)) == 2 and "matmul" in needed_by
    gathers = [c for c in low.collectives() if c.kind == "all-gather"]
    assert [c.shape for c in gathers] == [(6, 4)]


def test_reshard_inside_a_loop_body_is_exported_in_the_body():
    def loop(x, w):
        return tf.while_loop(lambda i, y: i < 2, lambda i, y: (i + 1, y @ w),
                             (tf.constant(0), x))[1]

    before, after = _texts(loop, (P("x", None), P("x", None)), None, [S((8, 8)), S((8, 8))])
    assert "\n  region 1:\n" in before
    assert before.count("gt.Reshard(") >= 1 and "gt.Reshard(" not in after
    body = after.split("region 1:")[1]
    assert "gt.AllGather(" in body


# ---------------------------------------------- the annotated graph, from the same program

def _annotated(fn, in_shardings, out_shardings, specs):
    low = gt.lower(fn, MESH, in_shardings, out_shardings, args=specs)
    return low, annotated_text(low)


def test_annotated_matmul_reads_the_gathered_operand_through_its_sharding():
    _, text = _annotated(lambda x, w: x @ w, (P("x", None), P("x", None)), None,
                         [S((8, 12)), S((12, 4))])
    assert_lines_in_order(text, [
        "inputs_1 = Placeholder() sharding={devices=[2,1]0,1}",
        "XlaSharding_1 = XlaSharding(inputs_1:0) sharding={devices=[2,1]0,1}",
        "XlaSharding_2 = XlaSharding(XlaSharding_1:0) sharding={replicated}",
        "matmul = MatMul(XlaSharding:0, XlaSharding_2:0)"])


def test_annotated_transpose_result_moves_where_the_all_to_all_is():
    _, text = _annotated(tf.transpose, (P("x", None),), (P("x", None),), [S((8, 4))])
    assert_lines_in_order(text, [
        "transpose = Transpose(XlaSharding:0, transpose/perm:0)",
        "XlaSharding_1 = XlaSharding(transpose:0) sharding={devices=[1,2]0,1}",
        "XlaSharding_2 = XlaSharding(XlaSharding_1:0) sharding={devices=[2,1]0,1}",
        "Identity = Identity(XlaSharding_2:0)"])


def test_annotated_partial_sum_leaves_the_dot_in_its_scattered_layout():
    """A pending sum has no XLA sharding: the dot's result is annotated with the
    reduce-scatter's target only."""
    _, text = _annotated(lambda x, w: x @ w, (P(None, "x"), P("x", None)), (P("x", None),),
                         [S((8, 12)), S((12, 4))])
    assert_lines_in_order(text, [
        "matmul = MatMul(XlaSharding:0, XlaSharding_1:0)",
        "XlaSharding_2 = XlaSharding(matmul:0) sharding={devices=[2,1]0,1}",
        "Identity = Identity(XlaSharding_2:0)"])


def test_every_explicit_reshard_target_is_an_annotation():
    def mlp(x, w1, w2):
        return tf.transpose(tf.nn.relu(x @ w1) @ w2)

    mesh = gt.Mesh.abstract((2, 2), ("data", "model"))
    low = gt.lower(mlp, mesh, (P("data", "model"), P("model", "data"), P("model")),
                   (P("data", "model"),), args=[S((8, 8)), S((8, 16)), S((16, 8))])
    text = annotated_text(low)
    targets = {str(gt.Sharding.from_layout(mesh, node.params["target"]))
               for node in low.program.explicit.nodes
               if node.op == "gt.Reshard" and "tensor" in node.params}
    assert targets
    for sharding in targets:
        assert f"sharding={sharding}" in text, (sharding, text)


def test_an_exported_collective_is_named_after_its_reshard():
    low = gt.lower(lambda x, w: x @ w, MESH, (P(None, "x"), P("x", None)), (P("x", None),),
                   args=[S((8, 12)), S((12, 4))])
    (reshard,) = [n for n in low.program.explicit.nodes if n.op == "gt.Reshard"]
    (scatter,) = [n for n in low.program.graph.nodes if n.op == "gt.ReduceScatter"]
    assert scatter.name.startswith(reshard.name + "/")
    assert (reshard.params["needed_by"], reshard.params["reason"]) == ("matmul", "contraction")
