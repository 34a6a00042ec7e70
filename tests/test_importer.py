"""Tests of the importer: traced tf.functions -> graph IR."""


import numpy as np
import pytest
import tensorflow as tf
from tensorflow.compiler.xla import xla_data_pb2
from tensorflow.python.compiler.xla.experimental import xla_sharding as xs

import gspmd_tf as gt
from gspmd_tf.graph import Ref, import_graph

F32 = tf.float32


def spec(*shape, dtype=F32):
    return tf.TensorSpec(shape, dtype)


def ops_of(graph):
    return [node.op for node in graph.nodes]


def node(graph, name):
    return graph.nodes[graph.node_index(name)]


def producer(graph, ref):
    return graph.nodes[ref.node]


def check_well_formed(graph):
    """Topological order, wiring in range, shapes as int tuples, unique names; the same
    in every region, with one parameter per region operand."""
    assert len({n.name for n in graph.nodes}) == len(graph.nodes)
    for i, n in enumerate(graph.nodes):
        assert all(ref.node < i and ref.out < len(graph.nodes[ref.node].out_shapes)
                   for ref in n.inputs), n
        assert all(c < i for c in n.control_inputs), n
        assert len(n.out_shapes) == len(n.out_dtypes)
        assert all(isinstance(d, int) for s in n.out_shapes for d in s)
        assert not any(k.startswith("_") for k in n.attrs), n
        for region in n.regions:
            check_well_formed(region)
            assert len(region.inputs) == len(n.region_operands()), n
    assert not {"NoOp", "PartitionedCall", "StatefulPartitionedCall"} & set(ops_of(graph))


def test_mlp_structure():
    @tf.function
    def mlp(x, w1, b1, w2):
        h = tf.nn.relu(tf.matmul(x, w1) + b1)
        return tf.matmul(h, w2, transpose_b=True)

    g = import_graph(mlp.get_concrete_function(spec(8, 4), spec(4, 16), spec(16),
                                               spec(2, 16)))
    check_well_formed(g)
    assert [g.tensor_name(r) for r in g.inputs] == ["x", "w1", "b1", "w2"]
    assert all(producer(g, r).op == "Placeholder" for r in g.inputs)
    assert g.captures == [] and g.annotations == {}

    mm1, add, relu, mm2 = (node(g, n) for n in ("MatMul", "add", "Relu", "MatMul_1"))
    assert mm1.inputs == [g.ref("x"), g.ref("w1")]
    assert add.op == "AddV2" and add.inputs == [g.ref("MatMul"), g.ref("b1")]
    assert relu.inputs == [g.ref("add")]
    assert mm2.inputs == [g.ref("Relu"), g.ref("w2")]
    assert mm1.out_shapes == [(8, 16)] and mm2.out_shapes == [(8, 2)]
    assert mm1.out_dtypes == [F32]
    assert mm2.attr("transpose_b") is True and mm2.attr("transpose_a") is False
    assert mm2.attr("T") == F32
    assert node(g, "x").attr("shape") == (8, 4)

    (out,) = g.outputs
    assert producer(g, out).op == "Identity"
    assert producer(g, out).inputs == [g.ref("MatMul_1")]
    assert g.shape(out) == (8, 2) and g.dtype(out) == F32


def test_multi_output_ops_and_dtypes():
    @tf.function
    def f(x):
        a, b, c = tf.split(x, 3, axis=1)
        values, indices = tf.math.top_k(a, k=2)
        return b + c, values, indices

    g = import_graph(f.get_concrete_function(spec(4, 6)))
    check_well_formed(g)
    split = next(n for n in g.nodes if n.op == "Split")
    assert split.out_shapes == [(4, 2)] * 3
    topk = node(g, "TopKV2")
    assert topk.out_dtypes == [F32, tf.int32] and topk.out_shapes == [(4, 2), (4, 2)]
    idx = g.outputs[2]
    assert producer(g, idx).inputs == [Ref(g.node_index("TopKV2"), 1)]
    assert g.tensor_name(Ref(g.node_index("TopKV2"), 1)) == "TopKV2:1"


def test_nested_calls_are_inlined():
    @tf.function
    def inner2(h):
        return tf.nn.relu(h) * 2.0

    @tf.function
    def inner(x, w):
        return inner2(tf.matmul(x, w))

    @tf.function
    def outer(x, w):
        return inner(x, w) + inner(x * 3.0, w)

    g = import_graph(outer.get_concrete_function(spec(8, 4), spec(4, 3)))
    check_well_formed(g)
    # Each call site has its own copy of the body, named after the call.
    calls = sorted(name[:-2] for name in g.aliases if "/" not in name)
    assert len(calls) == 2
    first, second = calls
    mm = node(g, f"{first}/MatMul")
    assert mm.inputs == [g.ref("x"), g.ref("w")]  # callee args wired to outer inputs
    assert mm.out_shapes == [(8, 3)]
    assert node(g, f"{second}/MatMul").inputs == [g.ref("mul"), g.ref("w")]
    relu = next(n for n in g.nodes if n.name.startswith(f"{first}/") and n.op == "Relu")
    # Doubly nested: "<call>/<inner call>/Relu", reading the inlined MatMul.
    assert relu.name.count("/") == 2 and relu.inputs == [g.ref(f"{first}/MatMul")]
    # The call's outputs are wired to the callee's returns; the call's name is an alias.
    add = node(g, "add")
    assert add.inputs == [g.ref(f"{first}:0"), g.ref(f"{second}:0")]
    ret = producer(g, add.inputs[0])
    assert ret.op == "Identity" and ret.name == f"{first}/Identity"


@pytest.mark.parametrize("pinned", [True, False])
def test_inlined_body_gets_call_site_shapes(pinned):
    v = tf.Variable(tf.ones([3]))

    # Traced on a relaxed signature, the callee alone only knows (None, 3).
    @tf.function(input_signature=[spec(None, 3)])
    def rowsum(x):
        return tf.reduce_sum(x * v, axis=1)

    @tf.function
    def f(x):
        y = rowsum(x)
        # Unless pinned, the traced graph itself has y * 2.0 of shape (None,) too.
        return (tf.ensure_shape(y, [8]) if pinned else y) * 2.0

    g = import_graph(f.get_concrete_function(spec(8, 3)))
    check_well_formed(g)
    total = next(n for n in g.nodes if n.op == "Sum")
    assert total.out_shapes == [(8,)]
    assert g.shape(g.outputs[0]) == (8,)


def test_gradient_through_nested_function():
    v = tf.Variable(tf.ones([4, 3]))

    @tf.function
    def inner(x):
        return tf.nn.relu(tf.matmul(x, v))

    @tf.function
    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(inner(x))
        return tape.gradient(loss, [x, v])

    g = import_graph(f.get_concrete_function(spec(8, 4)))
    check_well_formed(g)
    assert [g.shape(r) for r in g.outputs] == [(8, 4), (4, 3)]
    assert "ReluGrad" in ops_of(g)
    # The forward call's ReadVariableOp reads the captured variable's placeholder.
    read = next(n for n in g.nodes if n.op == "ReadVariableOp")
    assert read.out_shapes == [(4, 3)] and read.inputs == [g.inputs[1]]


def test_control_edges_rerouted_around_noops():
    v = tf.Variable(0.0)

    @tf.function
    def f(x):
        v.assign_add(1.0)
        return x * 2.0

    g = import_graph(f.get_concrete_function(spec(3)))
    check_well_formed(g)
    assign = g.node_index("AssignAddVariableOp")
    out = producer(g, g.outputs[0])
    assert assign in out.control_inputs  # was ^NoOp, and NoOp waited on the assign


def test_control_edge_on_call_waits_for_its_side_effects():
    v = tf.Variable(0.0)

    @tf.function
    def bump(x):
        v.assign_add(1.0)
        return x + 1.0

    @tf.function
    def f(x):
        return bump(x) * 2.0

    g = import_graph(f.get_concrete_function(spec(3)))
    check_well_formed(g)
    assign = next(i for i, n in enumerate(g.nodes) if n.op == "AssignAddVariableOp")
    assert assign in producer(g, g.outputs[0]).control_inputs


def test_control_inputs_of_a_call_reach_its_body():
    v = tf.Variable(0.0)

    @tf.function
    def inner(x):
        return tf.identity(x) + tf.ones([3])

    @tf.function
    def f(x):
        assign = v.assign(1.0)
        with tf.control_dependencies([assign]):
            return inner(x)

    g = import_graph(f.get_concrete_function(spec(3)))
    check_well_formed(g)
    assign = g.node_index("AssignVariableOp")
    in_body = [n.name.startswith("PartitionedCall/") for n in g.nodes]
    roots = [n for n, inside in zip(g.nodes, in_body)
             if inside and not any(in_body[r.node] for r in n.inputs)]
    assert sorted(n.op for n in roots) == ["Const", "Identity"]
    assert all(assign in n.control_inputs for n in roots)


def test_functional_control_flow_is_kept_whole():
    @tf.function
    def f(x):
        return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0),
                             (tf.constant(0), x))[1]

    g = import_graph(f.get_concrete_function(spec(2, 2)))
    check_well_formed(g)
    loop = next(n for n in g.nodes if "While" in n.op)
    # loop counter, maximum iterations, i, y
    assert loop.out_shapes == [(), (), (), (2, 2)]
    cond, body = loop.regions  # the bodies, imported as regions, not inlined
    assert [body.shape(r) for r in body.outputs] == loop.out_shapes
    assert [n.op for n in body.nodes if n.op == "Mul"] == ["Mul"]
    assert "Mul" not in ops_of(g)


def test_unknown_dim_raises_naming_the_tensor():
    @tf.function
    def f(x):
        return x * 2.0

    with pytest.raises(gt.ShardingError, match=r"'x'.*TensorSpec"):
        import_graph(f.get_concrete_function(spec(None, 4)))


def test_unknown_dim_inside_nested_function():
    @tf.function
    def inner(x):
        return tf.boolean_mask(x, x > 0)  # data-dependent length

    @tf.function
    def f(x):
        return tf.reduce_sum(inner(x))

    with pytest.raises(gt.ShardingError, match=r"tensor '[^']*/[^']*Where'.*depends on "
                       r"the input's values.*three arguments"):
        import_graph(f.get_concrete_function(spec(4)))


def test_captured_constant_and_variable():
    c = tf.constant([1.0, 2.0, 3.0])
    v = tf.Variable(tf.ones([4, 3], tf.float64))

    @tf.function
    def f(x):
        return tf.matmul(x, tf.cast(v, F32)) + c

    cf = f.get_concrete_function(spec(2, 4))
    g = import_graph(cf)
    check_well_formed(g)
    assert len(g.inputs) == 3 and len(g.captures) == 2
    assert [g.dtype(r) for r in g.inputs] == [F32, tf.resource, F32]
    handle, const = g.inputs[1:]
    assert producer(g, handle).params == {"var_shape": (4, 3), "var_dtype": tf.float64}
    assert g.shape(handle) == (4, 3)  # in the IR a handle has its variable's shape
    assert g.shape(const) == (3,)
    values = {g.dtype(r): value for r, value in zip(g.inputs[1:], g.captures)}
    np.testing.assert_array_equal(values[F32].numpy(), [1.0, 2.0, 3.0])
    assert values[tf.resource].dtype == tf.resource
    read = next(n for n in g.nodes if n.op == "ReadVariableOp")
    assert read.inputs == [handle] and read.out_shapes == [(4, 3)]


def test_variable_argument():
    @tf.function
    def f(x, var):
        return x + var.read_value()

    g = import_graph(f.get_concrete_function(spec(5), tf.Variable(tf.zeros([5]))))
    (_, var) = g.inputs
    assert g.dtype(var) == tf.resource
    assert producer(g, var).params == {"var_shape": (5,), "var_dtype": F32}


def test_plain_graph_with_explicit_inputs_and_outputs():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(F32, [2, 3], name="x")
        y = tf.nn.softmax(x, name="y")
    g = import_graph(graph, inputs=[x], outputs=[y])
    assert g.inputs == [g.ref("x")] and g.outputs == [g.ref("y")]
    assert g.captures == []


@pytest.mark.parametrize("use_op", [True, False])
def test_annotations_from_xla_sharding(use_op):
    mesh = np.arange(8).reshape(2, 4)

    @tf.function
    def f(x, w):
        a = xs.split(x, 0, 2, use_sharding_op=use_op)
        b = xs.tile(w, np.array([[0, 1], [2, 3]]), use_sharding_op=use_op)
        h = xs.mesh_split(tf.matmul(a, b), mesh, [0, -1], use_sharding_op=use_op)
        r = xs.replicate(h * 2.0, use_sharding_op=use_op)
        d = xs.assign_device(r + 1.0, 3, use_sharding_op=use_op)
        return d

    cf = f.get_concrete_function(spec(8, 4), spec(4, 6))
    g = import_graph(cf)
    check_well_formed(g)
    expected = [
        # (the op the annotation is on without an XlaSharding op, the sharding)
        ("x", xs.Sharding.split(tf.zeros([8, 4]), 0, 2)),
        ("w", xs.Sharding.tile(np.array([[0, 1], [2, 3]]))),
        ("MatMul", xs.mesh_split_sharding(mesh, [0, -1])),
        ("mul", xs.Sharding.replicate()),
        ("add", xs.Sharding.assign_device(3)),
    ]
    assert len(g.annotations) == len(expected)
    sharding_ops = [i for i, n in enumerate(g.nodes) if n.op == "XlaSharding"]
    assert len(sharding_ops) == (len(expected) if use_op else 0)
    for name, sharding in expected:
        ref = g.ref(name)
        if use_op:  # the annotated tensor is the XlaSharding op reading `name`
            ref = next(Ref(i, 0) for i in sharding_ops if g.nodes[i].inputs == [ref])
        assert g.annotations[ref] == sharding.proto, name
    # The contents, spelled out for a few of them.
    split = g.annotations[g.ref("x") if not use_op else Ref(sharding_ops[0], 0)]
    assert split.type == xla_data_pb2.OpSharding.OTHER
    assert list(split.tile_assignment_dimensions) == [2, 1]
    assert list(split.tile_assignment_devices) == [0, 1]
    mesh_split = g.annotations[Ref(sharding_ops[2], 0) if use_op else g.ref("MatMul")]
    assert list(mesh_split.tile_assignment_dimensions) == [2, 1, 4]
    assert mesh_split.replicate_on_last_tile_dim
    maximal = g.annotations[Ref(sharding_ops[4], 0) if use_op else g.ref("add")]
    assert maximal.type == xla_data_pb2.OpSharding.MAXIMAL
    assert list(maximal.tile_assignment_devices) == [3]


def test_partial_tile_proto_contents():
    @tf.function
    def f(x):
        return xs.mesh_split(x, np.arange(8).reshape(2, 4), [-1, 1], use_sharding_op=True)

    g = import_graph(f.get_concrete_function(spec(6, 8)))
    (sharding,) = g.annotations.values()
    assert list(sharding.tile_assignment_dimensions) == [1, 4, 2]
    assert list(sharding.tile_assignment_devices) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert sharding.replicate_on_last_tile_dim


def test_tuple_sharding_on_multi_output_op():
    @tf.function
    def f(x):
        parts = tf.split(x, 3, axis=0)
        xs.split(parts[1], 1, 2)  # sets a TUPLE `_XlaSharding` on the Split op
        return parts

    g = import_graph(f.get_concrete_function(spec(6, 4)))
    split = next(i for i, n in enumerate(g.nodes) if n.op == "Split")
    replicated = xs.Sharding.replicate().proto
    assert g.annotations[Ref(split, 0)] == replicated
    assert g.annotations[Ref(split, 1)] == xs.Sharding.split(tf.zeros([2, 4]), 1, 2).proto
    assert g.annotations[Ref(split, 2)] == replicated


def test_annotation_inside_nested_function_and_on_call_output():
    @tf.function
    def inner(x):
        y = xs.split(tf.nn.relu(x), 1, 4, use_sharding_op=True)
        return y * 2.0

    @tf.function
    def f(x):
        out = inner(x)
        xs.split(out, 0, 2)  # `_XlaSharding` on the call op: lands on its return
        return out + 1.0

    g = import_graph(f.get_concrete_function(spec(4, 8)))
    check_well_formed(g)
    inner_op = next(i for i, n in enumerate(g.nodes) if n.op == "XlaSharding")
    assert "/" in g.nodes[inner_op].name
    assert g.nodes[inner_op].inputs[0] == g.ref(g.nodes[inner_op].name.split("/")[0]
                                                 + "/Relu")
    assert list(g.annotations[Ref(inner_op, 0)].tile_assignment_dimensions) == [1, 4]
    ret = node(g, "add").inputs[0]  # the call's output: the callee's return
    assert producer(g, ret).op == "Identity"
    assert list(g.annotations[ret].tile_assignment_dimensions) == [2, 1]


def test_gt_mesh_split_is_read_by_the_same_path():
    mesh = gt.Mesh.abstract((2, 4), ("data", "model"))

    @tf.function
    def f(x):
        return gt.mesh_split(x, mesh, gt.P("data", "model")) * 2.0

    g = import_graph(f.get_concrete_function(spec(8, 8)))
    (ref, sharding), = g.annotations.items()
    assert producer(g, ref).op == "XlaSharding"
    assert str(gt.Sharding.from_proto(sharding)) == "{devices=[2,4]0,1,2,3,4,5,6,7}"


def test_identity_n_operands_each_keep_their_split():
    """tf.custom_gradient's IdentityN becomes one Identity per output: its operands are
    independent values, each keeps its split (nothing gathered), the gradient is the
    custom one, and "IdentityN:k" still names output k."""
    mesh = gt.Mesh.create((4,), ("x",))

    @tf.custom_gradient
    def scaled(a, b):
        return a * b, lambda d: (3 * d * b, 5 * d * a)

    def f(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = scaled(a, b)
            loss = tf.reduce_sum(y)
        return [y] + tape.gradient(loss, [a, b])
    a, b = np.arange(16, dtype=np.float32).reshape(2, 8), np.ones((2, 8), np.float32)
    fn = gt.function(f, mesh=mesh, in_shardings=(gt.P(None, "x"),) * 2)
    y, da, db = (t.numpy() for t in fn(a, b))
    np.testing.assert_array_equal(y, a * b)
    np.testing.assert_array_equal(da, 3 * b)
    np.testing.assert_array_equal(db, 5 * a)
    low = fn.lower(a, b)
    assert low.collectives() == [], low.report()
    [name] = {n.name.split("/output_")[0] for n in low.graph.nodes
              if "/output_" in n.name and n.op == "Identity"}
    assert str(low.sharding_of(f"{name}:1")) == str(
        gt.Sharding.from_spec(mesh, gt.P(None, "x"), 2))


@pytest.mark.parametrize("body, named", [
    (lambda x: tf.raw_ops.NextIteration(data=x), "TF1 while loop"),
    (lambda x: tf.raw_ops.TensorSummary(tensor=x), "its node's name into its value")])
def test_ops_no_spmd_program_can_run_as_written_are_refused_with_why(body, named):
    """A TF1 loop frame op outside its loop (it hung TF's executor on device-placed
    inputs) and TensorSummary (its value holds its node name, which each device's copy
    changes) are refused at import, naming the op and the way out."""
    fn = tf.function(body, autograph=False).get_concrete_function(spec(4, 6))
    with pytest.raises(gt.ShardingError, match=named) as error:
        import_graph(fn)
    assert "op '" in str(error.value)
